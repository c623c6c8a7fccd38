"""Names of the torch dtypes that may appear in configs and on the wire.

The names need no torch: the CLI and `epd serve`'s own process read them without importing it
(two seconds of every start); the dtypes they stand for come from `tensor_dtype` and
`dtype_name`, in the processes that hold tensors.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MODEL_DTYPES = ("float32", "bfloat16", "float16")  # what a model may run in
WIRE_DTYPES = (*MODEL_DTYPES, "int64", "int32", "uint8")  # what a tensor may hold on the wire


def tensor_dtype(name: str) -> torch.dtype:
    """The dtype a name in WIRE_DTYPES stands for (KeyError for any other)."""
    return _dtypes()[name]


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype's name in WIRE_DTYPES (KeyError for a dtype the wire does not carry)."""
    return _names()[dtype]


def model_dtype(name: str) -> torch.dtype | None:
    """A config's dtype; None for 'auto', which the loader resolves per device."""
    if name == "auto":
        return None
    if name not in MODEL_DTYPES:
        raise ValueError(f"dtype {name!r} is not one of auto, {', '.join(MODEL_DTYPES)}")
    return tensor_dtype(name)


@functools.cache
def _dtypes() -> dict[str, torch.dtype]:
    import torch

    return {name: getattr(torch, name) for name in WIRE_DTYPES}


@functools.cache
def _names() -> dict[torch.dtype, str]:
    return {dtype: name for name, dtype in _dtypes().items()}
