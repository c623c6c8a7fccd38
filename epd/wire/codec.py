"""The one codec: a message ↔ ZeroMQ multipart frames.

Frame 0 is the header: the message as MessagePack, each tensor field replaced by a `TensorRef`.
Frames 1.. are the tensors' raw bytes, sent from their own memory and rebuilt with
`torch.frombuffer`, so neither side copies them.

Headers are decoded by msgspec straight into the message types, never into objects of any other
kind: MessagePack can only spell plain values (no classes, no calls, no references), so no
header can build, call or change anything but a fresh message. Every field's type is checked on
the way in and every value by the message's own checks; anything else is a WireError.
"""

from __future__ import annotations

import math
import typing
import warnings
from typing import Annotated, Any

import msgspec
import torch
from msgspec import Meta

from epd.dtypes import WIRE_DTYPES, dtype_name, tensor_dtype
from epd.generation.params import Record
from epd.wire.messages import MESSAGE_TYPES, EncodeRequest, Message

Frame = bytes | memoryview
MAX_RANK = 8
MAX_TENSORS = 4  # the most tensor fields any message has (a hand-off)
HEADER_BYTES = 1 << 16  # every header but an EncodeRequest's (which holds image files) fits


class WireError(ValueError):
    """A message that cannot or must not be decoded."""


class TensorRef(Record, frozen=True):
    """Stands in a header for the tensor carried by frame `frame`."""

    frame: int
    dtype: Annotated[str, Meta(max_length=16)]
    shape: Annotated[tuple[int, ...], Meta(max_length=MAX_RANK)]


def encode(message: Message) -> list[Frame]:
    frames: list[Frame] = []

    def tensor_ref(value: Any) -> TensorRef:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"a {type(value).__name__} cannot travel in a message")
        tensor = value.detach().contiguous().cpu()
        frames.append(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]
        return TensorRef(len(frames), dtype_name(tensor.dtype), tuple(tensor.shape))

    if not isinstance(message, MESSAGE_TYPES):
        raise TypeError(f"{type(message).__name__} is not a message type")
    header = msgspec.msgpack.Encoder(enc_hook=tensor_ref).encode(message)
    if len(header) > HEADER_BYTES and not isinstance(message, EncodeRequest):
        # Every field is bounded, but not their sum: say so here, not by a silent refusal there.
        raise WireError(f"its {len(header)}-byte header is over the {HEADER_BYTES} a peer takes")
    return [header, *frames]


def decode(frames: typing.Sequence[Any], max_header_bytes: int = HEADER_BYTES) -> Message:
    """Frames (bytes, memoryviews or zmq.Frame) → a checked message; raises WireError.

    Sizes are checked before anything is decoded: a header over `max_header_bytes` or more
    frames than a message has tensors is refused unread.
    """
    if not 0 < len(frames) <= 1 + MAX_TENSORS:
        raise WireError(f"a message has 1 to {1 + MAX_TENSORS} frames, not {len(frames)}")
    buffers = [f.buffer if hasattr(f, "buffer") else memoryview(f) for f in frames]
    if buffers[0].nbytes > max_header_bytes:
        raise WireError(f"a {buffers[0].nbytes}-byte header is over {max_header_bytes} bytes")
    used: set[int] = set()

    def tensor(hint: type, raw: Any) -> torch.Tensor:
        if hint is not torch.Tensor:
            raise NotImplementedError
        return _tensor(msgspec.convert(raw, TensorRef), buffers, used)

    try:
        message = msgspec.msgpack.Decoder(Message, dec_hook=tensor).decode(buffers[0])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WireError(f"refused header{_looks_like(buffers[0])}: {e}") from None
    except RecursionError:
        raise WireError("refused header: nested too deeply") from None
    if len(used) != len(buffers) - 1:
        raise WireError(f"{len(buffers) - 1} frames for {len(used)} tensors")
    return message


def _looks_like(header: memoryview) -> str:
    """Name a pickle for what it is: an older epd, or someone trying the old attacks."""
    if header[:1] == b"\x80" and len(header) > 1 and header[1] <= 5:
        return f" (a pickle, protocol {header[1]}: never loaded)"
    return ""


def _tensor(ref: TensorRef, buffers: list[memoryview], used: set[int]) -> torch.Tensor:
    if ref.dtype not in WIRE_DTYPES or not 0 < ref.frame < len(buffers) or ref.frame in used:
        raise ValueError(f"bad tensor reference {ref}")
    used.add(ref.frame)
    dtype, raw = tensor_dtype(ref.dtype), buffers[ref.frame]
    # Each dim, and the elements the non-zero ones span: an empty tensor of (2**47, 2**47, 0)
    # matches its empty frame, but torch cannot lay it out.
    if len(ref.shape) > MAX_RANK or not all(0 <= d < 2**48 for d in ref.shape):
        raise ValueError(f"bad tensor shape {ref.shape}")
    if math.prod(d for d in ref.shape if d) >= 2**48:
        raise ValueError(f"bad tensor shape {ref.shape}")
    if math.prod(ref.shape) * dtype.itemsize != raw.nbytes:
        raise ValueError(f"frame {ref.frame} has {raw.nbytes} bytes, not a {ref.dtype} {ref.shape}")
    if raw.nbytes == 0:
        return torch.empty(ref.shape, dtype=dtype)
    # Received frames are read-only memory that we never write into (caches grow into new
    # memory), so the tensor can share it instead of copying.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(raw, dtype=torch.uint8)
    return flat.view(dtype).view(ref.shape)
