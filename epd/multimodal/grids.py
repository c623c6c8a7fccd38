"""Image grid metadata: one place that knows what a grid row means.

A grid row gives an image's size in patches. Kimi-VL's are 2-D (h, w); a 3-D (t, h, w) row, as
Qwen-style processors write them, is accepted for a single frame (t = 1) and refused otherwise,
the bug class that made encoders send 3-D grids to a 2-D model. Rows may arrive as torch
tensors, NumPy arrays or lists; they leave as tuples of plain Python ints, never as NumPy
objects, so they are safe to put in a message header.
"""

from __future__ import annotations

import numbers
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from epd.model.config import Grid

MAX_SIDE = 512  # a grid side of 512 patches or more is refused, as Kimi-VL's processor does
FORMS = "expected (h, w) or (t, h, w) rows of positive ints, h and w even and below 512"


def _plain(grids: Any) -> list[Any]:
    torch = sys.modules.get("torch")  # a tensor's class, where torch is loaded (else none is)
    tensor = (np.ndarray,) if torch is None else (torch.Tensor, np.ndarray)
    if isinstance(grids, tensor):
        if str(grids.dtype) in ("torch.bool", "bool"):
            raise ValueError(f"grid values must be integers, got booleans; {FORMS}")
        return grids.tolist()
    if isinstance(grids, Sequence) and not isinstance(grids, str | bytes):
        return [_plain(g) if not isinstance(g, numbers.Number) else g for g in grids]
    raise ValueError(f"grids must be a tensor, array or list, got {type(grids).__name__}; {FORMS}")


def _check_row(row: Any) -> tuple[int, ...]:
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


def grid_rows(grids: Any) -> tuple[tuple[int, ...], ...]:
    """Validate one row ([h, w]) or many ([[h, w], ...]) → tuple of int tuples."""
    rows = _plain(grids)
    if rows and all(isinstance(v, numbers.Number) for v in rows):
        rows = [rows]  # a single row
    return tuple(_check_row(r) for r in rows)


def kimi_vl_grids(grids: Any) -> tuple[Grid, ...]:
    """Normalise to Kimi-VL's 2-D (h, w) rows; a (1, h, w) row drops its time axis."""
    out = []
    for row in grid_rows(grids):
        if len(row) == 3 and row[0] != 1:
            raise ValueError(f"grid row {list(row)} has t={row[0]}; Kimi-VL images need t=1")
        out.append((row[-2], row[-1]))
    return tuple(out)
