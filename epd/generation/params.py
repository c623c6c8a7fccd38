"""How a request is generated, and what it gives back beside text: values every layer shares.

They are msgspec Structs so that the messages carrying them between processes decode straight
into them (see `epd.wire`): frozen, exactly their fields, lengths bounded by their types, and
values checked whenever one is built, here or by a decoder. A NaN is a float: a sampling
setting that holds one must be refused before it meets the requests it would be batched with.
"""

from __future__ import annotations

import math
import typing
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

MAX_TEXT_CHARS = 1 << 14  # a token's spelling, and any text sent with a reply
MAX_TOKEN_BYTES = 1024
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256  # longer stop strings would make every step's stop check slow
MAX_TOP_LOGPROBS = 20
MIN_LOGPROB = -9999.0  # what OpenAI reports for a token the model all but ruled out

FinishReason = Literal["stop", "length"]
FINISH_REASONS = (None, *typing.get_args(FinishReason))
Text = Annotated[str, Meta(max_length=MAX_TEXT_CHARS)]
TokenBytes = Annotated[tuple[int, ...], Meta(max_length=MAX_TOKEN_BYTES)]
StopStrings = Annotated[
    tuple[Annotated[str, Meta(max_length=MAX_STOP_CHARS)], ...], Meta(max_length=MAX_STOP_STRINGS)
]


def require(condition: bool, problem: str) -> None:
    """Raise ValueError(problem) unless `condition` holds; a decoder reports it as refused."""
    if not condition:
        raise ValueError(problem)


def check_logprob(logprob: float, token_bytes: tuple[int, ...]) -> None:
    require(MIN_LOGPROB <= logprob <= 0, f"a logprob must be in [{MIN_LOGPROB}, 0], not {logprob}")
    require(all(0 <= b < 256 for b in token_bytes), "token bytes must be 0 to 255")


class Record(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """A value that may travel between processes: its fields, in order, and nothing else."""


class SamplingParams(Record, frozen=True):
    """How to pick each token; temperature 0 is greedy."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    seed: int | None = None
    stop: StopStrings = ()
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False  # generate max_tokens whatever the model says (benchmarks)

    def __post_init__(self) -> None:
        require(self.max_tokens >= 1, f"max_tokens must be at least 1, not {self.max_tokens}")
        require(
            math.isfinite(self.temperature) and self.temperature >= 0,
            f"temperature must be a finite number ≥ 0, not {self.temperature}",
        )
        require(0 < self.top_p <= 1, f"top_p must be in (0, 1], not {self.top_p}")
        require(self.top_k >= 0, f"top_k must be ≥ 0 (0: no limit), not {self.top_k}")
        require(
            self.seed is None or -(2**63) <= self.seed < 2**64,
            "seed must fit in 64 bits",
        )
        require(
            len(self.stop) <= MAX_STOP_STRINGS
            and all(0 < len(s) <= MAX_STOP_CHARS for s in self.stop),
            f"stop takes up to {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_CHARS} characters",
        )
        require(
            0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
            f"top_logprobs must be 0 to {MAX_TOP_LOGPROBS}, not {self.top_logprobs}",
        )


class TopLogprob(Record, frozen=True):
    token: Text
    logprob: float
    bytes: TokenBytes

    def __post_init__(self) -> None:
        check_logprob(self.logprob, self.bytes)


class TokenLogprob(Record, frozen=True):
    token: Text
    logprob: float
    bytes: TokenBytes
    top_logprobs: Annotated[tuple[TopLogprob, ...], Meta(max_length=MAX_TOP_LOGPROBS)] = ()

    def __post_init__(self) -> None:
        check_logprob(self.logprob, self.bytes)
        require(
            len(self.top_logprobs) <= MAX_TOP_LOGPROBS,
            f"at most {MAX_TOP_LOGPROBS} top logprobs",
        )
