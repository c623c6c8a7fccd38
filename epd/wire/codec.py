"""The one codec: a message ↔ ZeroMQ multipart frames.

Frame 0 is the pickled header: the message with each tensor field replaced by a `TensorRef`.
Frames 1.. are the tensors' raw bytes, sent from their own memory and rebuilt with
`torch.frombuffer`, so neither side copies them. Headers load only through `SafeUnpickler`,
whose allow-list names exact classes; every field is then checked against its annotation.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import types
import typing
import warnings
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from epd.dtypes import DTYPES, NAMES
from epd.wire import messages
from epd.wire.messages import ALLOWED, MESSAGE_TYPES, Message

Frame = bytes | memoryview


MAX_RANK = 8


class WireError(ValueError):
    """A message that cannot or must not be decoded."""


@dataclass(frozen=True)
class TensorRef:
    """Stands in a header for the tensor carried by frame `frame`."""

    frame: int
    dtype: str
    shape: tuple[int, ...]


_CLASSES = {(cls.__module__, cls.__qualname__): cls for cls in (*ALLOWED, TensorRef)}


class SafeUnpickler(pickle.Unpickler):
    """Builds only the classes in the allow-list; refuses every other global by exact name."""

    def find_class(self, module: str, name: str) -> Any:
        cls = _CLASSES.get((module, name))
        if cls is None:
            raise WireError(f"refused to unpickle {module}.{name}: not an epd message type")
        return cls


def encode(message: Message) -> list[Frame]:
    if not isinstance(message, MESSAGE_TYPES):
        raise TypeError(f"{type(message).__name__} is not a message type")
    frames: list[Frame] = []
    refs = {}
    for f in dataclasses.fields(message):
        value = getattr(message, f.name)
        if isinstance(value, torch.Tensor):
            tensor = value.detach().contiguous().cpu()
            frames.append(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]
            refs[f.name] = TensorRef(len(frames), NAMES[tensor.dtype], tuple(tensor.shape))
    header = dataclasses.replace(message, **refs)  # type: ignore[arg-type]
    return [pickle.dumps(header, protocol=5), *frames]


def decode(frames: typing.Sequence[Any]) -> Message:
    """Frames (bytes, memoryviews or zmq.Frame) → a checked message; raises WireError."""
    if not frames:
        raise WireError("empty message")
    buffers = [f.buffer if hasattr(f, "buffer") else memoryview(f) for f in frames]
    try:
        message = SafeUnpickler(io.BytesIO(buffers[0])).load()
    except WireError:
        raise
    except Exception as e:  # malformed pickles raise many types; all mean the same here
        raise WireError(f"unreadable header: {type(e).__name__}: {e}") from e
    if type(message) not in MESSAGE_TYPES:
        raise WireError(f"header holds a {type(message).__name__}, not a message")
    if set(vars(message)) != {f.name for f in dataclasses.fields(message)}:
        raise WireError(f"header is not a well-formed {type(message).__name__}")
    tensors = {
        name: _tensor(ref, buffers)
        for name, ref in vars(message).items()
        if isinstance(ref, TensorRef)
    }
    message = dataclasses.replace(message, **tensors)
    _check(message, type(message), type(message).__name__, set())
    return message


def _tensor(ref: TensorRef, buffers: list[memoryview]) -> torch.Tensor:
    _check(ref, TensorRef, "TensorRef", set())
    if ref.dtype not in DTYPES or not 0 < ref.frame < len(buffers):
        raise WireError(f"bad tensor reference {ref}")
    dtype, raw = DTYPES[ref.dtype], buffers[ref.frame]
    if len(ref.shape) > MAX_RANK or not all(0 <= d < 2**48 for d in ref.shape):
        raise WireError(f"bad tensor shape {ref.shape}")
    count = 1
    for dim in ref.shape:
        count *= dim
    if count * dtype.itemsize != raw.nbytes:
        raise WireError(
            f"frame {ref.frame} holds {raw.nbytes} bytes, not a {ref.dtype} {ref.shape}"
        )
    if raw.nbytes == 0:
        return torch.empty(ref.shape, dtype=dtype)
    # Received frames are read-only memory that we never write into (caches grow into new
    # memory), so the tensor can share it instead of copying.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(raw, dtype=torch.uint8)
    return flat.view(dtype).view(ref.shape)


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(messages))


def _check(value: Any, hint: Any, where: str, seen: set[tuple[int, Any]]) -> None:
    """Raise WireError unless `value` has exactly the type `hint` names.

    `seen` holds the (object, type) pairs checked or being checked: a pickle can reference one
    object many times (even inside itself) for free, and re-checking every reference would let a
    small header cost minutes.
    """
    key = (id(value), hint)
    if key in seen:
        return
    seen.add(key)
    try:
        _check_once(value, hint, where, seen)
    except WireError:
        seen.discard(key)
        raise


def _check_once(value: Any, hint: Any, where: str, seen: set[tuple[int, Any]]) -> None:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for option in args:
            try:
                return _check(value, option, where, seen)
            except WireError:
                continue
        raise WireError(f"{where} has a {type(value).__name__}, expected {hint}")
    if origin is tuple:
        if type(value) is not tuple:
            raise WireError(f"{where} is a {type(value).__name__}, expected a tuple")
        items = args[:1] * len(value) if args[-1:] == (...,) else args
        if len(items) != len(value):
            raise WireError(f"{where} has {len(value)} items, expected {len(items)}")
        for i, (item, item_hint) in enumerate(zip(value, items, strict=True)):
            _check(item, item_hint, f"{where}[{i}]", seen)
        return
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        names = {f.name for f in dataclasses.fields(hint)}
        if type(value) is not hint or set(vars(value)) != names:
            raise WireError(f"{where} is not a well-formed {hint.__name__}")
        for name, field_hint in _hints(hint).items():  # type: ignore[arg-type]
            _check(getattr(value, name), field_hint, f"{where}.{name}", seen)
        return
    expected: Any = type(None) if hint is None else hint
    ok = type(value) is expected or (expected is float and type(value) is int)
    if expected is torch.Tensor:
        ok = isinstance(value, torch.Tensor)
    if not ok:
        raise WireError(f"{where} is a {type(value).__name__}, expected {expected.__name__}")
