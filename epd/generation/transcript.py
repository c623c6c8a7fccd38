"""A choice's reply as its client gets it: the tokens accepted, the text released, why it ended.
With its prompt, it is also the history that the sampling controls read (`logits.History`).

A reply ends on an eos id (the token is counted but adds no text; with `ignore_eos` it goes on,
as benchmarks ask) or one of its `stop_token_ids`, on a stop string (the reply is cut before it;
text that might be the start of a stop string is held back until it cannot be; one that ends
before `min_tokens` does not count: `stops.py`), when its grammar allows nothing more, or at
`max_tokens`. With `include_stop_str` (vLLM's `include_stop_str_in_output`) the reply keeps the
stop string, or the stop token's text where it has one. Each accepted token gives an `Output`:
what the client gets for it; the last one says which stop ended the reply (vLLM's
`stop_reason`: the stop token id, or the stop string as it matched; None for an eos, the
grammar's end or `max_tokens`, as vLLM reports them).

The rules depend on nothing but the tokens, so two transcripts fed the same tokens give the same
outputs: prefill says what the first token gives (and the client has it at once), and decode's
`Sequence`, fed that token again, goes on from the same place.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from epd.generation.detokenizer import Detokenizer
from epd.generation.logits import presence
from epd.generation.params import FinishReason, SamplingParams, StopReason, TokenLogprob
from epd.generation.reasoning import Gate
from epd.generation.stops import StopScanner


@dataclass(frozen=True)
class Output:
    """What the client gets for the tokens just accepted."""

    token_ids: tuple[int, ...]
    text: str  # released text: complete characters not held back for a stop string
    completion_tokens: int  # total so far
    finish_reason: FinishReason | None = None  # on the last output
    logprobs: tuple[TokenLogprob, ...] = ()
    stop_reason: StopReason = None  # on the last output: the stop token id or string that ended it


def joined(outputs: Sequence[Output]) -> Output:
    """Several outputs of one choice as one (a speculative step's tokens): the tokens, text and
    logprobs of all, in order, and where the last one leaves the reply."""
    last = outputs[-1]
    return Output(
        token_ids=tuple(t for o in outputs for t in o.token_ids),
        text="".join(o.text for o in outputs),
        completion_tokens=last.completion_tokens,
        finish_reason=last.finish_reason,
        logprobs=tuple(lp for o in outputs for lp in o.logprobs),
        stop_reason=last.stop_reason,
    )


class Transcript:
    def __init__(
        self,
        sampling: SamplingParams,
        tokenizer: PreTrainedTokenizerBase,
        eos_ids: Collection[int],
        prompt_ids: torch.Tensor,
        grammar: Gate | None = None,
    ) -> None:
        self.sampling, self.tokenizer, self.eos_ids = sampling, tokenizer, frozenset(eos_ids)
        self.prompt_ids = prompt_ids  # (prompt tokens,) int64, for repetition penalties
        self._prompt_presence: torch.Tensor | None = None
        self.stop_ids = frozenset(sampling.stop_token_ids)
        self.grammar = grammar  # the request's grammar, fed every accepted token
        self.detokenizer = Detokenizer(tokenizer, sampling.skip_special_tokens)
        self.stops = StopScanner(sampling.stop)
        self.tokens: list[int] = []
        self.text, self.sent = "", 0  # reply text so far; characters already released
        self.finish_reason: FinishReason | None = None
        self.stop_reason: StopReason = None

    @property
    def matcher(self) -> Any:
        """The grammar's matcher where it applies to the next token, or None."""
        return self.grammar.matcher if self.grammar else None

    @property
    def grammar_waits(self) -> bool:
        """Whether the grammar waits for an answer a reasoning model has not begun yet."""
        return self.grammar is not None and self.grammar.waits

    @property
    def also_allowed(self) -> Sequence[int]:
        """Tokens allowed besides the grammar's (a reasoning model's start marker's)."""
        return self.grammar.also_allowed if self.grammar else ()

    def prompt_presence(self, vocab: int, device: torch.device) -> torch.Tensor:
        """(vocab,) bool: the prompt's tokens, for repetition penalties; made once."""
        if self._prompt_presence is None:
            self._prompt_presence = presence(self.prompt_ids, vocab, device)
        return self._prompt_presence

    def accept(self, token: int, logprob: TokenLogprob | None = None) -> Output:
        """Record a generated token and say what the client gets for it."""
        assert self.finish_reason is None
        grammar_done = self.grammar is not None and self.grammar.accept(token)
        self.tokens.append(token)
        eos = token in self.eos_ids and not self.sampling.ignore_eos
        if eos or token in self.stop_ids:
            if self.sampling.include_stop_str:  # the stop token's text, where it has one
                self.text += self.detokenizer.add(token)
            self.finish_reason = "stop"
            # As vLLM: the tokenizer's eos is no stop of the request's; generation_config's
            # other eos ids (Kimi's <|im_end|>, which ends every turn) are stop token ids.
            primary = eos and token == self.tokenizer.eos_token_id
            self.stop_reason = None if primary else token
        else:
            self._add_text(self.detokenizer.add(token))
        if self.finish_reason is None and grammar_done:
            self.finish_reason = "stop"  # the grammar allows nothing more
        if self.finish_reason is None and len(self.tokens) >= self.sampling.max_tokens:
            self.finish_reason = "length"
        end = len(self.text) if self.finish_reason else len(self.text) - self.stops.held
        released, self.sent = self.text[self.sent : end], max(self.sent, end)
        return Output(
            token_ids=(token,),
            text=released,
            completion_tokens=len(self.tokens),
            finish_reason=self.finish_reason,
            logprobs=(logprob,) if logprob else (),
            stop_reason=self.stop_reason,
        )

    def _add_text(self, new: str) -> None:
        """Append the token's text, cut before a stop string it completes (none before
        min_tokens), or after it where the request asks to include it."""
        found = self.stops.scan(new, honoured=len(self.tokens) >= self.sampling.min_tokens)
        self.text += new
        if found is not None:
            start, end = (len(self.text) - len(new) + at for at in found)
            self.stop_reason = self.text[start:end]  # the stop string, which may begin before new
            self.text = self.text[: end if self.sampling.include_stop_str else start]
            self.finish_reason = "stop"
