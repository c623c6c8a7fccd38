"""What a message may hold: bounded field types and value checks shared by every message.

Lengths are part of the field types (`Meta(max_length=...)`), so the decoder refuses an oversized
string or array from its header alone, before building anything. Values are checked by the
`require`/`check_*` helpers in each message's `__post_init__`, which runs both when a message is
built here and when one is decoded.
"""

from __future__ import annotations

from typing import Annotated

import torch
from msgspec import Meta

MAX_ID_CHARS = 256  # request ids, error codes
MAX_ADDRESS_CHARS = 512  # ZeroMQ addresses
MAX_TEXT_CHARS = 1 << 14  # a delta's text, a failure's explanation, a token's spelling
MAX_ITEMS = 256  # images per request, grids per payload, tokens per delta
MAX_TOKEN_BYTES = 1024
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256  # longer stop strings would make every step's stop check slow
MAX_TOP_LOGPROBS = 20
MIN_LOGPROB = -9999.0  # what OpenAI reports for a token the model all but ruled out
FINISH_REASONS = (None, "stop", "length")
ADDRESS_SCHEMES = ("tcp://", "ipc://", "inproc://")

Id = Annotated[str, Meta(max_length=MAX_ID_CHARS)]
Address = Annotated[str, Meta(max_length=MAX_ADDRESS_CHARS)]
Text = Annotated[str, Meta(max_length=MAX_TEXT_CHARS)]
TokenBytes = Annotated[tuple[int, ...], Meta(max_length=MAX_TOKEN_BYTES)]
Grid = tuple[int, int]


def require(condition: bool, problem: str) -> None:
    """Raise ValueError(problem) unless `condition` holds; the decoder reports it as refused."""
    if not condition:
        raise ValueError(problem)


def check_id(value: str, name: str) -> None:
    require(0 < len(value) <= MAX_ID_CHARS, f"{name} must be 1 to {MAX_ID_CHARS} characters")


def check_address(value: str, name: str, optional: bool = False) -> None:
    require(
        (optional and not value)
        or (len(value) <= MAX_ADDRESS_CHARS and value.startswith(ADDRESS_SCHEMES)),
        f"{name} must be a ZeroMQ address (tcp://, ipc://, inproc://), not {value[:80]!r}",
    )


def check_logprob(logprob: float, token_bytes: tuple[int, ...]) -> None:
    require(MIN_LOGPROB <= logprob <= 0, f"a logprob must be in [{MIN_LOGPROB}, 0], not {logprob}")
    require(all(0 <= b < 256 for b in token_bytes), "token bytes must be 0 to 255")


def check_tensor(tensor: torch.Tensor, name: str, rank: int) -> None:
    """A floating tensor of `rank` dimensions holding only finite values."""
    require(tensor.dim() == rank, f"{name} must have {rank} dimensions, not {tensor.dim()}")
    require(tensor.is_floating_point(), f"{name} must hold floats, not {tensor.dtype}")
    require(bool(torch.isfinite(tensor).all()), f"{name} holds NaN or infinite values")


def cut(text: str) -> str:
    """`text` cut to fit a message's text field (error messages can be long)."""
    return text if len(text) <= MAX_TEXT_CHARS else text[: MAX_TEXT_CHARS - 1] + "…"
