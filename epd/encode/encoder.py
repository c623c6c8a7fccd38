"""The encode step, free of I/O: image files → (normalised grids, projected embeddings)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from epd.model.kimi_vl import KimiVL
from epd.multimodal.grids import Grid, kimi_vl_grids
from epd.multimodal.image_processor import ImageProcessor
from epd.multimodal.images import decode_image


@dataclass(frozen=True)
class Prepared:
    """One request's images, decoded and preprocessed: ready for the vision tower."""

    grids: tuple[Grid, ...]  # plain (h, w) ints: safe for a message header
    pixels: torch.Tensor  # (Σ h·w, 3, p, p), on the model's device and dtype

    @property
    def patches(self) -> int:
        return self.pixels.shape[0]


class Encoder:
    def __init__(self, model: KimiVL, processor: ImageProcessor, max_image_pixels: int) -> None:
        self.model, self.processor, self.max_image_pixels = model, processor, max_image_pixels
        weight = model.multi_modal_projector.linear_1.weight
        self.device, self.dtype = weight.device, weight.dtype

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
        prepared = self.prepare(images, indices, progress)
        return prepared.grids, self.forward([prepared])[0]

    def prepare(
        self,
        images: Sequence[bytes],
        indices: Sequence[int] = (),
        progress: Callable[[], None] = lambda: None,
    ) -> Prepared:
        """Decode and preprocess one request's images; ImageError names a bad one."""
        patches, sizes = [], []
        for i, data in enumerate(images):
            index = indices[i] if indices else i
            image = decode_image(data, index, self.max_image_pixels)
            pixels, grid = self.processor.preprocess(image)  # (h·w, 3, p, p)
            patches.append(pixels)
            sizes.append(grid)
            progress()
        pixels = torch.cat(patches).to(self.device, self.dtype)
        return Prepared(kimi_vl_grids(sizes), pixels)

    @torch.inference_mode()
    def forward(self, batch: Sequence[Prepared]) -> list[torch.Tensor]:
        """Several requests' images through the vision tower in one batch: each request's
        embeddings (Σ h·w/4, hidden), in order. Attention stays within each image, so a
        request's rows do not depend on what else is in the batch."""
        grids = [grid for prepared in batch for grid in prepared.grids]
        embeddings = self.model.encode_images(torch.cat([p.pixels for p in batch]), grids)
        rows = [sum(map(self.processor.tokens, p.grids)) for p in batch]
        assert embeddings.shape[0] == sum(rows), f"{embeddings.shape[0]} rows for {sum(rows)}"
        return list(embeddings.split(rows))
