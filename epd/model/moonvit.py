"""MoonViT: Kimi-VL's native-resolution vision tower.

Images of different sizes travel as one packed sequence of patches, (L, 3, 14, 14) with
L = Σ h·w; `grids` holds each image's (h, w) in patches. Everything but attention works on the
packed sequence; attention runs per image, which is exactly the block-diagonal mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from epd.model.config import Grid, VisionConfig
from epd.model.rope import rotate, rotor, vision_angles


class PositionTable(nn.Module):
    """Learned (H0, W0, D) position table, resized bicubically to each image's grid."""

    def __init__(self, height: int, width: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(height, width, dim))

    def forward(self, grids: Sequence[Grid]) -> torch.Tensor:
        """→ (Σ h·w, D), each image's table flattened row-major."""
        table = self.weight.permute(2, 0, 1).unsqueeze(0)  # (1, D, H0, W0)
        pieces = []
        for h, w in grids:
            if (h, w) == tuple(self.weight.shape[:2]):
                pieces.append(self.weight.flatten(0, 1))
                continue
            # bicubic is not implemented for bf16 on every backend: resize in float32.
            resized = F.interpolate(table.float(), size=(h, w), mode="bicubic", align_corners=False)
            pieces.append(resized[0].permute(1, 2, 0).flatten(0, 1).to(self.weight.dtype))
        return torch.cat(pieces)


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        p = config.patch_size
        self.proj = nn.Conv2d(3, config.hidden_size, kernel_size=p, stride=p)
        self.pos_emb = PositionTable(
            config.init_pos_emb_height, config.init_pos_emb_width, config.hidden_size
        )

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        x = self.proj(pixel_values.to(self.proj.weight.dtype))  # (L, D, 1, 1)
        return x.flatten(1) + self.pos_emb(grids)  # (L, D)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc0 = nn.Linear(dim, hidden)
        self.fc1 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.heads = config.num_attention_heads
        self.norm0 = nn.LayerNorm(d, eps=1e-5)
        self.wqkv = nn.Linear(d, 3 * d)
        self.wo = nn.Linear(d, d)
        self.norm1 = nn.LayerNorm(d, eps=1e-5)
        self.mlp = MLP(d, config.intermediate_size)

    def forward(self, x: torch.Tensor, angles: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.wo(self.attention(self.norm0(x), angles, lengths))
        return x + self.mlp(self.norm1(x))

    def attention(self, x: torch.Tensor, angles: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        # wqkv output is q-block | k-block | v-block, each head-major: (L, 3, heads, head_dim).
        q, k, v = self.wqkv(x).unflatten(-1, (3, self.heads, -1)).unbind(1)
        q, k = rotate(q, angles), rotate(k, angles)
        outputs = []
        # Non-causal attention within each image only (block-diagonal over the packed batch).
        for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True):
            # (1, heads, l, head_dim): the 4-D form reaches the fused (flash) kernels, CPU included.
            heads_first = [t.transpose(0, 1)[None] for t in (qi, ki, vi)]
            outputs.append(F.scaled_dot_product_attention(*heads_first)[0].transpose(0, 1))
        return torch.cat(outputs).flatten(1)  # (L, D)


class Encoder(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=1e-5)

    def forward(self, x: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        # One rotor per forward, for every block's q and k (cos/sin are not cheap at L patches).
        angles = rotor(torch.cat([vision_angles(h, w, self.head_dim, x.device) for h, w in grids]))
        lengths = [h * w for h, w in grids]
        for block in self.blocks:
            x = block(x, angles, lengths)
        return self.final_layernorm(x)


def merge_patches(x: torch.Tensor, grids: Sequence[Grid], kernel: tuple[int, int]) -> torch.Tensor:
    """Group each image's patches into kh×kw windows: (Σ h·w, D) → (Σ h·w/(kh·kw), kh·kw, D).

    Per image: view (h/kh, kh, w/kw, kw, D) → permute (0, 2, 1, 3, 4), so every output row holds
    one window's patches in row-major order; windows themselves come out row-major.
    """
    kh, kw = kernel
    merged = []
    for image, (h, w) in zip(x.split([h * w for h, w in grids]), grids, strict=True):
        windows = image.view(h // kh, kh, w // kw, kw, -1).permute(0, 2, 1, 3, 4)
        merged.append(windows.reshape(-1, kh * kw, image.shape[-1]))
    return torch.cat(merged)


class MoonViT(nn.Module):
    """pixel patches (L, 3, p, p) + grids → merged windows (Σ tokens, kh·kw, D)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.merge_kernel = config.merge_kernel_size
        self.patch_embed = PatchEmbed(config)
        self.encoder = Encoder(config)

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        x = self.encoder(self.patch_embed(pixel_values, grids), grids)
        return merge_patches(x, grids, self.merge_kernel)
