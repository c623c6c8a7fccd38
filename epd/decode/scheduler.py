"""Continuous batching: every step advances all running sequences by one token together.

New sequences join between steps (their first token, sampled by prefill, is emitted on
arrival); finished and aborted ones leave between steps and their caches are freed. Beyond
`max_batch_size` sequences wait, in arrival order, for a free slot.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection

import torch
from transformers import PreTrainedTokenizerBase

from epd.generation.sampling import restore_generator
from epd.generation.sequence import Sequence
from epd.model.deepseek import DeepseekV3ForCausalLM
from epd.model.latent_cache import LatentCache
from epd.wire.messages import KVHandoff, TokenDelta


class Scheduler:
    def __init__(
        self,
        lm: DeepseekV3ForCausalLM,
        tokenizer: PreTrainedTokenizerBase,
        eos_ids: Collection[int],
        max_batch_size: int = 64,
    ) -> None:
        self.lm, self.tokenizer, self.eos_ids = lm, tokenizer, eos_ids
        self.max_batch_size = max_batch_size
        self.device = lm.lm_head.weight.device
        self.running: dict[str, Sequence] = {}
        self.waiting: deque[Sequence] = deque()

    def __len__(self) -> int:
        return len(self.running) + len(self.waiting)

    def check(self, handoff: KVHandoff) -> None:
        """Refuse a hand-off this model cannot resume, before it touches any state."""
        config = self.lm.config
        expected = (config.num_hidden_layers, handoff.prompt_tokens, config.latent_dim)
        if tuple(handoff.cache.shape) != expected:
            raise ValueError(f"KV cache of shape {tuple(handoff.cache.shape)}, expected {expected}")
        if not 0 <= handoff.first_token < config.vocab_size:
            raise ValueError(f"first token {handoff.first_token} is outside the vocabulary")
        if handoff.sampling.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")

    def add(self, handoff: KVHandoff) -> tuple[Sequence, TokenDelta]:
        """Admit a prefilled request; its first token is accepted (and may already finish it)."""
        self.check(handoff)
        try:
            generator = restore_generator(handoff.rng_state)
        except RuntimeError as e:
            raise ValueError(f"unusable sampler state: {e}") from None
        cache = LatentCache.from_tensor(handoff.cache.to(self.device, self.lm.lm_head.weight.dtype))
        sequence = Sequence(
            handoff.request_id,
            handoff.sampling,
            generator,
            cache,
            self.tokenizer,
            self.eos_ids,
            handoff.reply_to,
        )
        delta = sequence.accept(handoff.first_token, handoff.first_logprob)
        if sequence.finish_reason is None:
            self.waiting.append(sequence)
        return sequence, delta

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; its cache goes with it."""
        if self.running.pop(request_id, None) is not None:
            return True
        kept = [s for s in self.waiting if s.request_id != request_id]
        found = len(kept) != len(self.waiting)
        self.waiting = deque(kept)
        return found

    @torch.inference_mode()
    def step(self) -> list[tuple[Sequence, TokenDelta]]:
        """Advance every running sequence by one token; return what each produced."""
        while self.waiting and len(self.running) < self.max_batch_size:
            sequence = self.waiting.popleft()
            self.running[sequence.request_id] = sequence
        batch = list(self.running.values())
        if not batch:
            return []
        tokens = torch.tensor([s.last_token for s in batch], device=self.device)
        logits = self.lm.logits(self.lm.decode(tokens, [s.cache for s in batch]))  # (B, vocab)
        produced = []
        for sequence, row in zip(batch, logits, strict=True):
            delta = sequence.accept(*sequence.pick(row))
            produced.append((sequence, delta))
            if sequence.finish_reason is not None:
                del self.running[sequence.request_id]
        return produced
