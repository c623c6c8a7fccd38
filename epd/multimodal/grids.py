"""Image grid metadata: one place that knows what a grid row means in each model family.

A grid row gives an image's size in patches. Kimi-VL emits 2-D (h, w) rows; Kimi-K2.5 and
Qwen-style processors emit 3-D (t, h, w) rows. Rows may arrive as torch tensors, NumPy arrays or
lists; they leave as tuples of plain Python ints (or torch int64), never as NumPy objects, so they
are safe to put in a message header.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

Family = Literal["kimi_vl", "kimi_k25", "qwen"]
Row = tuple[int, ...]
MAX_SIDE = 512  # a grid side of 512 patches or more is refused, as Kimi-VL's processor does
FORMS = "expected (h, w) or (t, h, w) rows of positive ints, h and w even and below 512"


def _plain(grids: Any) -> list[Any]:
    if isinstance(grids, torch.Tensor | np.ndarray):
        if grids.dtype == torch.bool or grids.dtype == np.bool_:
            raise ValueError(f"grid values must be integers, got booleans; {FORMS}")
        return grids.tolist()
    if isinstance(grids, Sequence) and not isinstance(grids, str | bytes):
        return [_plain(g) if not isinstance(g, numbers.Number) else g for g in grids]
    raise ValueError(f"grids must be a tensor, array or list, got {type(grids).__name__}; {FORMS}")


def _check_row(row: Any) -> Row:
    if not isinstance(row, list) or len(row) not in (2, 3):
        raise ValueError(f"bad grid row {row!r}: {FORMS}")
    values = []
    for v in row:
        integral = isinstance(v, numbers.Integral) and not isinstance(v, bool | np.bool_)
        if not integral or v <= 0:
            raise ValueError(f"bad grid row {row!r}: {FORMS}")
        values.append(int(v))
    h, w = values[-2:]
    if h % 2 or w % 2 or h >= MAX_SIDE or w >= MAX_SIDE:
        raise ValueError(f"bad grid row {row!r}: {FORMS}")
    return tuple(values)


def grid_rows(grids: Any) -> tuple[Row, ...]:
    """Validate one row ([h, w]) or many ([[h, w], ...]) → tuple of int tuples."""
    rows = _plain(grids)
    if rows and all(isinstance(v, numbers.Number) for v in rows):
        rows = [rows]  # a single row
    return tuple(_check_row(r) for r in rows)


def kimi_vl_grids(grids: Any) -> tuple[tuple[int, int], ...]:
    """Normalise to Kimi-VL's 2-D (h, w) rows; a (1, h, w) row drops its time axis."""
    out = []
    for row in grid_rows(grids):
        if len(row) == 3 and row[0] != 1:
            raise ValueError(f"grid row {list(row)} has t={row[0]}; Kimi-VL images need t=1")
        out.append((row[-2], row[-1]))
    return tuple(out)


def patch_count(row: Sequence[int], family: Family = "kimi_vl") -> int:
    """Patches the vision tower sees: h·w for Kimi-VL, t·h·w for the (t, h, w) families."""
    (row,) = grid_rows(list(row))
    if family == "kimi_vl":
        (h, w), t = kimi_vl_grids([list(row)])[0], 1
    else:
        t, h, w = _three(row, family)
    return t * h * w


def token_count(
    row: Sequence[int], family: Family = "kimi_vl", merge: tuple[int, int] = (2, 2)
) -> int:
    """Tokens the image becomes in the prompt after the patch merger."""
    mh, mw = merge
    (row,) = grid_rows(list(row))
    if family == "kimi_vl":
        h, w = kimi_vl_grids([list(row)])[0]
        return h * w // (mh * mw)
    t, h, w = _three(row, family)
    if family == "kimi_k25":
        return h * w // (mh * mw)  # K2.5 pools time away
    if family == "qwen":
        return t * h * w // (mh * mw)
    raise ValueError(f"unknown grid family {family!r}; expected kimi_vl, kimi_k25 or qwen")


def _three(row: Row, family: str) -> tuple[int, int, int]:
    if len(row) == 2:
        return 1, row[0], row[1]  # an (h, w) row is a single frame
    t, h, w = row
    return t, h, w


def grid_tensor(grids: Any) -> torch.Tensor:
    """Validated rows as a torch int64 tensor (N, 2 or 3)."""
    return torch.tensor(grid_rows(grids), dtype=torch.int64)


def split_embeddings(
    embeds: torch.Tensor, grids: Any, family: Family = "kimi_vl", merge: tuple[int, int] = (2, 2)
) -> list[torch.Tensor]:
    """Slice a concatenated (Σ tokens, D) embedding into one piece per image."""
    counts = [token_count(row, family, merge) for row in grid_rows(grids)]
    if sum(counts) != embeds.shape[0]:
        raise ValueError(
            f"embedding has {embeds.shape[0]} rows but grids {[list(r) for r in grid_rows(grids)]} "
            f"give {sum(counts)} tokens"
        )
    return list(embeds.split(counts))
