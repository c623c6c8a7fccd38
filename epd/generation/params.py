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
MAX_STOP_STRINGS = 16  # OpenAI takes 4; lm-eval sends a task's own (6 for HumanEval)
MAX_STOP_CHARS = 256  # longer stop strings would make every step's stop check slow
MAX_TOP_LOGPROBS = 20
MIN_LOGPROB = -9999.0  # what OpenAI reports for a token the model all but ruled out

FinishReason = Literal["stop", "length"]
FINISH_REASONS = (None, *typing.get_args(FinishReason))
Text = Annotated[str, Meta(max_length=MAX_TEXT_CHARS)]
TokenBytes = Annotated[tuple[int, ...], Meta(max_length=MAX_TOKEN_BYTES)]
StopString = Annotated[str, Meta(max_length=MAX_STOP_CHARS)]
StopStrings = Annotated[tuple[StopString, ...], Meta(max_length=MAX_STOP_STRINGS)]
# vLLM's `stop_reason`: which of a request's stops ended a choice, the stop token id or the
# stop string; None where an eos, the grammar's end or max_tokens did.
StopReason = int | StopString | None
MAX_LOGIT_BIAS = 1024  # token biases per request
MAX_STOP_TOKEN_IDS = 64
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range: ±100 bans or forces a token
PENALTY_LIMIT = 2.0  # OpenAI's range for presence and frequency penalties
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # dividing by less could overflow float32 logits
MAX_CHOICES = 128  # n: choices of one request
MAX_GRAMMAR_CHARS = 24 * 1024  # in UTF-8 bytes too: a hand-off's header stays under 64 KiB
GrammarText = Annotated[str, Meta(max_length=MAX_GRAMMAR_CHARS)]
MAX_MARKER_CHARS = 32  # a reasoning model's marker ("◁think▷")
Marker = Annotated[str, Meta(min_length=1, max_length=MAX_MARKER_CHARS)]
LogitBias = Annotated[tuple[tuple[int, float], ...], Meta(max_length=MAX_LOGIT_BIAS)]
StopTokenIds = Annotated[tuple[int, ...], Meta(max_length=MAX_STOP_TOKEN_IDS)]


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
    presence_penalty: float = 0.0  # subtracted once from each token generated so far
    frequency_penalty: float = 0.0  # subtracted per time each token was generated so far
    repetition_penalty: float = 1.0  # divides (positive) or multiplies logits of seen tokens
    min_p: float = 0.0  # drop tokens less likely than min_p × the likeliest one
    min_tokens: int = 0  # no eos or stop token id before this many tokens
    logit_bias: LogitBias = ()  # (token id, bias) pairs, added to the logits
    stop_token_ids: StopTokenIds = ()  # end the reply like an eos id
    skip_special_tokens: bool = True  # leave special tokens out of the text
    grammar: GrammarText = ""  # llguidance grammar the reply must follow ("": none)
    n: int = 1  # choices, each sampled on its own from the same prompt
    include_stop_str: bool = False  # keep the stop string (or stop token's text) that ended it
    # A reasoning model's start and end markers: its grammar applies to the answer after its
    # reasoning (`reasoning.Gate`); `reasoning_open`: the prompt already opened the reasoning.
    reasoning: tuple[Marker, Marker] | None = None
    reasoning_open: bool = False

    def choice_seed(self, index: int) -> int | None:
        """Choice `index`'s seed: the request's for the first, then the next ones (a seeded
        request with n > 1 is reproducible, its choices still differ)."""
        if self.seed is None or index == 0:
            return self.seed
        return (self.seed + index) % 2**63

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

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
        self._check_controls()

    def _check_controls(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            require(
                -PENALTY_LIMIT <= value <= PENALTY_LIMIT,
                f"{name} must be in [-{PENALTY_LIMIT}, {PENALTY_LIMIT}], not {value}",
            )
        low, high = REPETITION_PENALTY_RANGE
        require(
            low <= self.repetition_penalty <= high,
            f"repetition_penalty must be in [{low}, {high}], not {self.repetition_penalty}",
        )
        require(0 <= self.min_p <= 1, f"min_p must be in [0, 1], not {self.min_p}")
        require(
            0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens must be in [0, max_tokens], not {self.min_tokens}",
        )
        require(
            all(
                token >= 0 and -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT
                for token, bias in self.logit_bias
            ),
            f"logit_bias maps token ids ≥ 0 to biases in [-{LOGIT_BIAS_LIMIT}, {LOGIT_BIAS_LIMIT}]",
        )
        require(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be ≥ 0")
        require(1 <= self.n <= MAX_CHOICES, f"n must be 1 to {MAX_CHOICES}, not {self.n}")
        require(
            self.reasoning is None
            or (
                len(self.reasoning) == 2
                and all(0 < len(m) <= MAX_MARKER_CHARS for m in self.reasoning)
                and self.reasoning[0] != self.reasoning[1]
            ),
            "reasoning takes a start and an end marker, different, of 1 to "
            f"{MAX_MARKER_CHARS} characters",
        )
        size = len(self.grammar.encode())
        require(
            size <= MAX_GRAMMAR_CHARS,
            f"a grammar may have up to {MAX_GRAMMAR_CHARS} bytes, not {size}",
        )

    def token_ids(self) -> tuple[int, ...]:
        """Every token id the request names, for a check against the vocabulary."""
        return tuple(t for t, _ in self.logit_bias) + self.stop_token_ids


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
