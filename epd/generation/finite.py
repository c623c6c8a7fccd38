"""Whether tensors hold only finite values, read once: by their least and greatest values.

NaN spreads to both bounds, +inf to the greatest, -inf to the least, so a tensor is finite
exactly when both bounds are. `isfinite(t).all()` first writes a bool per value, several
times slower on a CPU (docs/benchmarks.md):
- a whole tensor, `all_finite`: one `aminmax` pass. A hand-off's cache is checked while a
  decode step's batch waits for it to be received;
- rows, `finite_rows`: `amax` and `amin` along them (faster than `aminmax` along a
  dimension). Every decode step checks its rows of logits over the whole vocabulary.
"""

from __future__ import annotations

import torch


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether a floating tensor holds no NaN and no ±inf (an empty one does not)."""
    if tensor.numel() == 0:
        return True
    return all(bool(bound.isfinite()) for bound in torch.aminmax(tensor))


def finite_rows(logits: torch.Tensor) -> list[bool]:
    """Whether each row of logits (B, vocab) holds no NaN and no ±inf."""
    return (logits.amax(-1).isfinite() & logits.amin(-1).isfinite()).tolist()


def overflows(tensor: torch.Tensor, dtype: torch.dtype) -> float | None:
    """The largest magnitude in a finite `tensor` when a cast to `dtype` would turn it into
    ±inf (a float32 peer's values sent to a float16 model); None when they all fit."""
    if tensor.numel() == 0 or torch.finfo(tensor.dtype).max <= torch.finfo(dtype).max:
        return None  # nothing to read, or a cast that widens (bfloat16 to float32)
    least, greatest = torch.aminmax(tensor)  # one pass, no copy (as `all_finite`)
    largest = max(-float(least), float(greatest))
    return largest if largest > torch.finfo(dtype).max else None
