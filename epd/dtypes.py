"""Names of the torch dtypes that may appear in configs and on the wire."""

from __future__ import annotations

import torch

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


def model_dtype(name: str) -> torch.dtype | None:
    """A config's dtype; None for 'auto', which the loader resolves per device."""
    if name == "auto":
        return None
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype {name!r} is not one of auto, float32, bfloat16, float16")
    return DTYPES[name]
