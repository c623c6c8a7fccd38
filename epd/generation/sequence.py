"""One choice being generated: its transcript (prompt, stop rules, text) and what generates it,
its cache and sampler. Shared by decode and tests; where its outputs go is decode's business."""

from __future__ import annotations

from collections.abc import Collection

import torch
from transformers import PreTrainedTokenizerBase

from epd.generation.params import SamplingParams, TokenLogprob
from epd.generation.reasoning import Gate
from epd.generation.sampling import token_logprob
from epd.generation.status import Status
from epd.generation.transcript import Transcript
from epd.model.latent_cache import LatentCache
from epd.model.latent_pool import PagedCache


class Sequence(Transcript):
    def __init__(
        self,
        request_id: str,
        sampling: SamplingParams,
        generator: torch.Generator,
        cache: LatentCache | PagedCache,  # paged while it runs in decode's batch
        tokenizer: PreTrainedTokenizerBase,
        eos_ids: Collection[int],
        prompt_ids: torch.Tensor,
        grammar: Gate | None = None,
        index: int = 0,
    ) -> None:
        super().__init__(sampling, tokenizer, eos_ids, prompt_ids, grammar)
        self.request_id, self.index = request_id, index  # index: the choice (n > 1)
        self.generator, self.cache = generator, cache
        self.status = Status.WAITING  # the scheduler's to move on

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
