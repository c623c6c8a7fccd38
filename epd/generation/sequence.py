"""One choice being generated: its transcript (prompt, stop rules, text) and what generates it,
its KV and sampler. Shared by decode and tests; where its outputs go is decode's business."""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
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
        self._history: np.ndarray | None = None  # `history`'s buffer, once drafts need it
        self._known = 0  # its tokens in that buffer

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

    def history(self) -> np.ndarray:
        """Its prompt and reply so far, (tokens,) int64, the tokens drafts are looked up in:
        kept, the reply's new tokens appended (its buffer doubles as it fills)."""
        total = self.prompt_ids.shape[0] + len(self.tokens)
        if self._history is None or total > self._history.shape[0]:
            grown = np.empty(
                max(total, 2 * (0 if self._history is None else len(self._history))), np.int64
            )
            grown[: self.prompt_ids.shape[0]] = self.prompt_ids.numpy()
            self._history, self._known = grown, self.prompt_ids.shape[0]
        new = self.tokens[self._known - self.prompt_ids.shape[0] :]
        self._history[self._known : total] = new
        self._known = total
        return self._history[:total]

    def logprob(self, logits: torch.Tensor, token: int) -> TokenLogprob | None:
        """What the request asked to know of `token`'s probability under logits (vocab,)."""
        if not self.sampling.logprobs:
            return None
        return token_logprob(logits, token, self.sampling.top_logprobs, self.tokenizer)
