"""Rotary position embedding in the interleaved (GPT-J) layout used by both Kimi-VL towers.

Dims (2p, 2p+1) form pair p and rotate together by one angle. The language model gives pair p
the angle pos·θ_p; MoonViT's 2-D variant gives even pairs the column angle and odd pairs the row
angle (see `vision_angles`).
"""

from __future__ import annotations

import torch


def inverse_frequencies(dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """θ_i = theta^(-2i/dim) for i < dim/2, shape (dim/2,), float32."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    return 1.0 / (theta**exponents)


def text_angles(positions: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
    """Angles for 1-D positions (T,) → (T, dim/2), float32."""
    return positions.float()[:, None] * inverse_frequencies(dim, theta, positions.device)[None, :]


def vision_angles(height: int, width: int, head_dim: int, device: torch.device) -> torch.Tensor:
    """Angles for an (h, w) patch grid, row-major → (h·w, head_dim/2), float32.

    head_dim/4 frequencies θ_i = 1/10000^(4i/head_dim); pair 2i turns by column·θ_i and pair
    2i+1 by row·θ_i, i.e. dims (4i, 4i+1) follow w and dims (4i+2, 4i+3) follow h.
    """
    freqs = inverse_frequencies(head_dim // 2, 10000.0, device)  # (head_dim/4,)
    flat = torch.arange(height * width, device=device)
    rows, cols = (flat // width).float(), (flat % width).float()
    col_angles = cols[:, None] * freqs[None, :]  # (h·w, head_dim/4)
    row_angles = rows[:, None] * freqs[None, :]
    return torch.stack((col_angles, row_angles), dim=-1).flatten(1)  # (h·w, head_dim/2)


def rotor(angles: torch.Tensor) -> torch.Tensor:
    """cos + i·sin of angles (T, dim/2), complex64: computed once per forward, used by every
    layer for q and k alike."""
    return torch.polar(torch.ones_like(angles), angles)


def rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x (T, ..., dim) by angles (T, dim/2), given as angles or as
    their `rotor`; math in float32. Pair (a, b) becomes (a cos - b sin, a sin + b cos): the
    complex product (a + ib)(cos + i sin)."""
    turn = angles if angles.is_complex() else rotor(angles)
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    while turn.dim() < pairs.dim():
        turn = turn.unsqueeze(-2)  # broadcast over head dims
    return torch.view_as_real(pairs * turn).reshape(x.shape).to(x.dtype)
