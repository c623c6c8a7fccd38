"""What a message may hold beside its generation values (`epd.generation.params`): bounded
field types and the value checks the messages share.

Lengths are part of the field types (`Meta(max_length=...)`), so the decoder refuses an oversized
string or array from its header alone, before building anything. Values are checked by the
`check_*` helpers in each message's `__post_init__`, which runs both when a message is built
here and when one is decoded.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Annotated

from msgspec import Meta

from epd.config.roles import ADDRESS_SCHEMES
from epd.generation.params import MAX_TEXT_CHARS, require

if TYPE_CHECKING:
    import torch

MAX_ID_CHARS = 256  # request ids, error codes
MAX_ADDRESS_CHARS = 512  # ZeroMQ addresses
MAX_ITEMS = 256  # images per request, grids per payload, tokens per delta

ID_CHARS = "A-Za-z0-9._:-"  # ids go into log lines and headers: no spaces, no line breaks
ID = re.compile(f"[{ID_CHARS}]{{1,{MAX_ID_CHARS}}}")  # checked on every message: compiled once
Id = Annotated[str, Meta(max_length=MAX_ID_CHARS)]
Address = Annotated[str, Meta(max_length=MAX_ADDRESS_CHARS)]


def check_id(value: str, name: str) -> None:
    require(
        ID.fullmatch(value) is not None,
        f"{name} must be 1 to {MAX_ID_CHARS} of the characters {ID_CHARS}",
    )


def check_address(value: str, name: str, optional: bool = False) -> None:
    require(
        (optional and not value)
        or (len(value) <= MAX_ADDRESS_CHARS and value.startswith(ADDRESS_SCHEMES)),
        f"{name} must be a ZeroMQ address (tcp://, ipc://, inproc://), not {value[:80]!r}",
    )


def check_tensor(tensor: torch.Tensor, name: str, rank: int) -> None:
    """A floating tensor of `rank` dimensions holding only finite values."""
    from epd.generation.finite import all_finite  # here: the API reads these limits, no torch

    require(tensor.dim() == rank, f"{name} must have {rank} dimensions, not {tensor.dim()}")
    require(tensor.is_floating_point(), f"{name} must hold floats, not {tensor.dtype}")
    require(all_finite(tensor), f"{name} holds NaN or infinite values")


def cut(text: str) -> str:
    """`text` cut to fit a message's text field (error messages can be long)."""
    return text if len(text) <= MAX_TEXT_CHARS else text[: MAX_TEXT_CHARS - 1] + "…"


class PerSecond:
    """Lets at most `limit` events a second through: a flood of messages must not become a
    flood of what they cause (log lines, Aborts)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.second, self.count = 0, 0

    def take(self) -> bool:
        """Count one event: whether it is within this second's limit."""
        second = int(time.monotonic())
        if second != self.second:
            self.second, self.count = second, 0
        self.count += 1
        return self.count <= self.limit
