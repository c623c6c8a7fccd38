"""The multi-modal projector: merged vision windows → language-model embeddings."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epd.model.config import KimiVLConfig


class Projector(nn.Module):
    """(N, kh·kw, D) → (N, text hidden).

    `pre_norm` normalises each patch's D-vector *before* the window is flattened to kh·kw·D;
    then linear_1 → exact (erf) GELU → linear_2.
    """

    def __init__(self, config: KimiVLConfig) -> None:
        super().__init__()
        self.pre_norm = nn.LayerNorm(config.vision.hidden_size, eps=1e-5)
        self.linear_1 = nn.Linear(config.merged_dim, config.merged_dim)
        self.linear_2 = nn.Linear(config.merged_dim, config.text.hidden_size)

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        x = self.pre_norm(windows).flatten(1)  # (N, kh·kw·D)
        return self.linear_2(F.gelu(self.linear_1(x)))
