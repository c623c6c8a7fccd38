"""One request being generated: its cache, sampler and stop rules, shared by decode and tests.

A sequence ends on an eos id (the token is counted but adds no text; with `ignore_eos` it goes
on, as benchmarks ask) or one of its `stop_token_ids`, on a stop string (the reply is cut before
it, and text that might be the start of a stop string is held back until it cannot be; none is
looked for before `min_tokens`), when its grammar allows nothing more, or at `max_tokens`. Each
accepted token gives an `Output`: what the client gets for it. Where the output goes is the
decode server's business, not the sequence's.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from epd.generation.detokenizer import Detokenizer
from epd.generation.grammar import advance
from epd.generation.logits import presence
from epd.generation.params import FinishReason, SamplingParams, TokenLogprob
from epd.generation.sampling import token_logprob
from epd.model.latent_cache import LatentCache
from epd.model.latent_pool import PagedCache


@dataclass(frozen=True)
class Output:
    """What the client gets for the tokens just accepted."""

    token_ids: tuple[int, ...]
    text: str  # released text: complete characters not held back for a stop string
    completion_tokens: int  # total so far
    finish_reason: FinishReason | None = None  # on the last output
    logprobs: tuple[TokenLogprob, ...] = ()


class Sequence:
    def __init__(
        self,
        request_id: str,
        sampling: SamplingParams,
        generator: torch.Generator,
        cache: LatentCache | PagedCache,  # paged while it runs in decode's batch
        tokenizer: PreTrainedTokenizerBase,
        eos_ids: Collection[int],
        prompt_ids: torch.Tensor,
        matcher: Any = None,
        index: int = 0,
    ) -> None:
        self.request_id, self.index = request_id, index  # index: the choice (n > 1)
        self.sampling, self.generator, self.cache = sampling, generator, cache
        self.tokenizer, self.eos_ids = tokenizer, frozenset(eos_ids)
        self.prompt_ids = prompt_ids  # (prompt tokens,) int64, for repetition penalties
        self._prompt_presence: torch.Tensor | None = None
        self.stop_ids = frozenset(sampling.stop_token_ids)
        self.matcher = matcher  # the request's grammar, fed every accepted token
        self.detokenizer = Detokenizer(tokenizer, sampling.skip_special_tokens)
        self.tokens: list[int] = []
        self.text, self.sent = "", 0  # reply text so far; characters already released
        self.finish_reason: FinishReason | None = None

    def prompt_presence(self, vocab: int, device: torch.device) -> torch.Tensor:
        """(vocab,) bool: the prompt's tokens, for repetition penalties; made once."""
        if self._prompt_presence is None:
            self._prompt_presence = presence(self.prompt_ids, vocab, device)
        return self._prompt_presence

    @property
    def key(self) -> tuple[str, int]:
        return self.request_id, self.index

    @property
    def last_token(self) -> int:
        return self.tokens[-1]

    def logprob(self, logits: torch.Tensor, token: int) -> TokenLogprob | None:
        """What the request asked to know of `token`'s probability under logits (vocab,)."""
        if not self.sampling.logprobs:
            return None
        return token_logprob(logits, token, self.sampling.top_logprobs, self.tokenizer)

    def accept(self, token: int, logprob: TokenLogprob | None = None) -> Output:
        """Record a generated token and say what the client gets for it."""
        assert self.finish_reason is None
        grammar_done = self.matcher is not None and advance(self.matcher, token)
        self.tokens.append(token)
        if (token in self.eos_ids and not self.sampling.ignore_eos) or token in self.stop_ids:
            self.finish_reason = "stop"
        else:
            self.text += self.detokenizer.add(token)
            if len(self.tokens) >= self.sampling.min_tokens:
                self._apply_stop_strings()
        if self.finish_reason is None and grammar_done:
            self.finish_reason = "stop"  # the grammar allows nothing more
        if self.finish_reason is None and len(self.tokens) >= self.sampling.max_tokens:
            self.finish_reason = "length"
        end = len(self.text) if self.finish_reason else len(self.text) - self._held_back()
        released, self.sent = self.text[self.sent : end], max(self.sent, end)
        return Output(
            token_ids=(token,),
            text=released,
            completion_tokens=len(self.tokens),
            finish_reason=self.finish_reason,
            logprobs=(logprob,) if logprob else (),
        )

    def _apply_stop_strings(self) -> None:
        longest = max((len(s) for s in self.sampling.stop), default=0)
        start = max(0, self.sent - longest)
        hits = [i for s in self.sampling.stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.finish_reason = "stop"

    def _held_back(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        for size in range(
            min(len(self.text), max((len(s) for s in self.sampling.stop), default=0)), 0, -1
        ):
            tail = self.text[-size:]
            if any(s.startswith(tail) for s in self.sampling.stop):
                return size
        return 0
