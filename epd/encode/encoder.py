"""The encode step, free of I/O: image files → (normalised grids, projected embeddings)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from epd.model.kimi_vl import KimiVL
from epd.multimodal.grids import Grid, kimi_vl_grids
from epd.multimodal.image_processor import ImageProcessor
from epd.multimodal.images import decode_image


class Encoder:
    def __init__(self, model: KimiVL, processor: ImageProcessor, max_image_pixels: int) -> None:
        self.model, self.processor, self.max_image_pixels = model, processor, max_image_pixels
        weight = model.multi_modal_projector.linear_1.weight
        self.device, self.dtype = weight.device, weight.dtype

    @torch.inference_mode()
    def encode(
        self,
        images: Sequence[bytes],
        indices: Sequence[int] = (),
        progress: Callable[[], None] = lambda: None,
    ) -> tuple[tuple[Grid, ...], torch.Tensor]:
        """All images in one batch → grids ((h, w) ints) and embeddings (Σ h·w/4, hidden).

        Raises ImageError naming the image that cannot be used by its index in the request
        (`indices`, default 0, 1, ...).
        `progress` is called as each image is decoded and preprocessed, which for a large one
        takes a while.
        """
        patches, sizes = [], []
        for i, data in enumerate(images):
            index = indices[i] if indices else i
            image = decode_image(data, index, self.max_image_pixels)
            pixels, grid = self.processor.preprocess(image)  # (h·w, 3, p, p)
            patches.append(pixels)
            sizes.append(grid)
            progress()
        grids = kimi_vl_grids(sizes)  # plain (h, w) ints: safe for a message header
        pixels = torch.cat(patches).to(self.device, self.dtype)
        embeddings = self.model.encode_images(pixels, list(grids))
        tokens = sum(map(self.processor.tokens, grids))
        assert embeddings.shape[0] == tokens, f"{embeddings.shape[0]} rows for {tokens} tokens"
        return grids, embeddings
