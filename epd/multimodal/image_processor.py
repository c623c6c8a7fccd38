"""Kimi-VL's image processor: resize to the patch budget, pad to whole merge windows, patchify.

Output is every image's patches concatenated, (Σ h·w, 3, p, p) in row-major patch order, and each
image's 2-D (h, w) grid in patches. `grid_for_size` answers the grid from the pixel size alone, so
a prompt can be laid out before any pixel is decoded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from epd.checkpoint.config import ProcessorConfig
from epd.multimodal.grids import MAX_SIDE, Grid

if TYPE_CHECKING:  # grids are read where no torch is imported (`epd route`)
    import torch


@dataclass(frozen=True)
class ProcessedImages:
    pixel_values: torch.Tensor  # (Σ h·w, 3, p, p) float32
    grids: tuple[Grid, ...]  # per image


class ImageProcessor:
    def __init__(self, config: ProcessorConfig) -> None:
        self.config = config

    @cached_property
    def mean(self) -> torch.Tensor:
        import torch

        return torch.tensor(self.config.image_mean, dtype=torch.float32)[:, None, None]

    @cached_property
    def std(self) -> torch.Tensor:
        import torch

        return torch.tensor(self.config.image_std, dtype=torch.float32)[:, None, None]

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(w, h) after scaling down to at most `in_token_limit` whole patches."""
        p = self.config.patch_size
        patches = (width // p) * (height // p)
        if patches <= self.config.in_token_limit:
            return width, height
        s = math.sqrt(self.config.in_token_limit / patches)
        return int(width * s), int(height * s)

    def grid_for_size(self, width: int, height: int) -> Grid:
        """The (h, w) patch grid an image of this pixel size becomes; raises if out of range."""
        if width <= 0 or height <= 0:
            raise ValueError(f"image size {width}x{height} is empty")
        p, (mh, mw) = self.config.patch_size, self.config.merge_kernel_size
        w, h = self.resized_size(width, height)
        if self.config.pad_input:
            grid = (math.ceil(h / (p * mh)) * mh, math.ceil(w / (p * mw)) * mw)
        else:
            grid = (h // p, w // p)
        if min(grid) == 0 or max(grid) >= MAX_SIDE:
            raise ValueError(
                f"image size {width}x{height} gives grid {grid}, outside 1..{MAX_SIDE - 1}"
            )
        return grid

    def tokens(self, grid: Grid) -> int:
        """Tokens an image of this grid becomes: one per merge window."""
        (h, w), (mh, mw) = grid, self.config.merge_kernel_size
        return (h // mh) * (w // mw)

    def max_tokens(self) -> int:
        """An upper bound on the tokens of any one image (it sizes message limits)."""
        (mh, mw), side = self.config.merge_kernel_size, MAX_SIDE - 1
        # A resized image has at most in_token_limit whole patches of at most `side` per row
        # and column; rounding up to whole merge windows adds under mh + 1 rows, mw + 1 columns.
        patches = self.config.in_token_limit + (mh + mw + 2) * side + (mh + 1) * (mw + 1)
        return patches // (mh * mw)

    def preprocess(self, image: Image.Image) -> tuple[torch.Tensor, Grid]:
        """One image → patches (h·w, 3, p, p) and its (h, w) grid."""
        import torch

        image = image.convert("RGB")
        grid = self.grid_for_size(*image.size)
        size = self.resized_size(*image.size)
        if size != image.size:
            image = image.resize(size, Image.Resampling.BICUBIC)
        p = self.config.patch_size
        gh, gw = grid
        if self.config.pad_input:  # black padding right and bottom, before normalisation
            canvas = Image.new("RGB", (gw * p, gh * p))
            canvas.paste(image, (0, 0))
            image = canvas
        else:  # centre crop to whole patches
            left, top = (image.width - gw * p) // 2, (image.height - gh * p) // 2
            image = image.crop((left, top, left + gw * p, top + gh * p))
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
        pixels = (pixels - self.mean) / self.std  # (3, H, W)
        patches = pixels.view(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3, p, p)
        return patches, grid

    def __call__(self, images: list[Image.Image]) -> ProcessedImages:
        import torch

        processed = [self.preprocess(image) for image in images]
        return ProcessedImages(
            pixel_values=torch.cat([patches for patches, _ in processed]),
            grids=tuple(grid for _, grid in processed),
        )
