"""One choice being generated: its transcript (prompt, stop rules, text) and what generates it,
its KV and sampler. Shared by decode and tests; where its outputs go is decode's business."""

from __future__ import annotations

from collections.abc import Collection

import torch
from transformers import PreTrainedTokenizerBase

from epd.generation.params import SamplingParams, TokenLogprob
from epd.generation.reasoning import Gate
from epd.generation.sampling import token_logprob
from epd.generation.status import Status
from epd.generation.transcript import Transcript
from epd.kv.pool import BlockTable


class Sequence(Transcript):
    def __init__(
        self,
        request_id: str,
        sampling: SamplingParams,
        generator: torch.Generator,
        table: BlockTable,
        pending: torch.Tensor | None,
        tokenizer: PreTrainedTokenizerBase,
        eos_ids: Collection[int],
        prompt_ids: torch.Tensor,
        grammar: Gate | None = None,
        index: int = 0,
    ) -> None:
        super().__init__(sampling, tokenizer, eos_ids, prompt_ids, grammar)
        self.request_id, self.index = request_id, index  # index: the choice (n > 1)
        self.generator = generator
        # Its KV: rows [0, table.length) in the pool's blocks, then `pending` ones, (layers,
        # rows, latent) in host memory, not in the pool yet (waiting to join the batch).
        self.table, self.pending = table, pending
        self.block_hashes: tuple[bytes, ...] = ()  # its prompt's full blocks', where named
        self.named_ids = prompt_ids  # the tokens those blocks hold (`KVHandoff.resumed_tokens`)
        self.status = Status.WAITING  # the scheduler's to move on
        self._prompt_list: list[int] | None = None  # its prompt's ids, once drafts need them

    @property
    def key(self) -> tuple[str, int]:
        return self.request_id, self.index

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV it has: in the pool, and waiting to go in."""
        return self.table.length + (0 if self.pending is None else self.pending.shape[1])

    @property
    def last_token(self) -> int:
        return self.tokens[-1]

    def history(self) -> list[int]:
        """Its prompt and reply so far, the tokens drafts are looked up in."""
        if self._prompt_list is None:
            self._prompt_list = self.prompt_ids.tolist()
        return [*self._prompt_list, *self.tokens]

    def logprob(self, logits: torch.Tensor, token: int) -> TokenLogprob | None:
        """What the request asked to know of `token`'s probability under logits (vocab,)."""
        if not self.sampling.logprobs:
            return None
        return token_logprob(logits, token, self.sampling.top_logprobs, self.tokenizer)
