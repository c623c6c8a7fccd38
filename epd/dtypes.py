"""Names of the torch dtypes that may appear in configs and on the wire."""

from __future__ import annotations

import torch

TENSOR_DTYPES = {  # what a tensor may hold on the wire
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}
NAMES = {dtype: name for name, dtype in TENSOR_DTYPES.items()}
MODEL_DTYPES = ("float32", "bfloat16", "float16")  # what a model may run in


def model_dtype(name: str) -> torch.dtype | None:
    """A config's dtype; None for 'auto', which the loader resolves per device."""
    if name == "auto":
        return None
    if name not in MODEL_DTYPES:
        raise ValueError(f"dtype {name!r} is not one of auto, {', '.join(MODEL_DTYPES)}")
    return TENSOR_DTYPES[name]
