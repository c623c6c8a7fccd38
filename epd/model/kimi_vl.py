"""Kimi-VL: MoonViT + projector + DeepSeek-V3, holding only the parts a process's role needs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from epd.model.config import KimiVLConfig
from epd.model.deepseek import DeepseekV3ForCausalLM
from epd.model.moonvit import Grid, MoonViT
from epd.model.projector import Projector

Role = Literal["encode", "language", "all"]

# Checkpoint tensor-name prefixes each role owns.
ROLE_PREFIXES: dict[str, tuple[str, ...]] = {
    "encode": ("vision_tower.", "multi_modal_projector."),
    "language": ("language_model.",),
    "all": ("vision_tower.", "multi_modal_projector.", "language_model."),
}


class KimiVL(nn.Module):
    def __init__(self, config: KimiVLConfig, role: Role = "all") -> None:
        super().__init__()
        if role not in ROLE_PREFIXES:
            raise ValueError(f"unknown role {role!r}; expected one of {sorted(ROLE_PREFIXES)}")
        self.config, self.role = config, role
        if role in ("encode", "all"):
            self.vision_tower = MoonViT(config.vision)
            self.multi_modal_projector = Projector(config)
        if role in ("language", "all"):
            self.language_model = DeepseekV3ForCausalLM(config.text)

    def encode_images(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """Patches (Σ h·w, 3, p, p) of images with (h, w) grids → (Σ h·w/4, text hidden)."""
        return self.multi_modal_projector(self.vision_tower(pixel_values, grids))
