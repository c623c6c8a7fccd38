"""Continuous batching: every step advances all running sequences together, by one token each,
or with speculative decoding (`speculative`) by the drafts the model agrees with and one more.

New sequences join between steps (their first token, sampled by prefill, is emitted on
arrival); finished and aborted ones leave between steps and their blocks are let go. A running
sequence's KV lives in the blocks of a `BlockPool`, which holds at most `max_kv_tokens` rows.
Sequences wait, in arrival order, for a batch slot (beyond `max_batch_size`) and for blocks
enough for their KV; the first in line is never passed. When a running sequence needs a new
block and none is free, the one that joined last goes back to the head of the line, its rows
moved to host memory (preempted, as vLLM swaps), and joins again, unchanged, when blocks free up.

Decode keeps a prefix cache too: the full blocks of a prompt stay cached after its request,
by hash (`kv/hashing.py`), in free space only. A hand-off names its prompt's blocks and carries
the rows only of those after the ones prefill believes decode holds; decode checks the names
against the prompt (hashing it again), holds the blocks it was told it has from admission on,
and answers `Lacking` (a `KVMissing` on the wire) where it evicted one meanwhile. Only blocks
computed by prefill are named: a reply's own rows, computed step by step, are never shared, so
outputs are the same with the cache on or off.

A step samples every row in one batched call (one finiteness check, the requests' penalties,
biases and bans applied batched, one transfer to the host); with drafts, one such call per
position, each sequence's controls as they stand after the tokens before it (`_accept`).
Its failures are per sequence: a row whose logits are not finite or cannot be sampled fails that
sequence only, and when the batched forward or the batched sampling fails, each sequence is run
alone (from its generator's earlier state) so only the ones that fail alone are failed.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from functools import cached_property
from typing import cast

import torch
from transformers import PreTrainedTokenizerBase

from epd.config.speculative import SpeculativeConfig
from epd.dtypes import dtype_name
from epd.generation.finite import finite_rows, overflows
from epd.generation.grammar import GrammarError, Grammars
from epd.generation.logits import NoTokenAllowed, adjust, require_a_token
from epd.generation.reasoning import gate
from epd.generation.sampling import (
    GREEDY_BELOW,
    probabilities,
    restore_generator,
    sample_batch,
)
from epd.generation.sequence import Sequence
from epd.generation.speculative import proposer, verify
from epd.generation.status import Status
from epd.generation.transcript import Output, joined
from epd.kv.events import KVEvents
from epd.kv.hashing import BLOCK_TOKENS, ImageSpan, block_hashes, chain_seed, model_key
from epd.kv.pool import BlockPool, PoolFull
from epd.memory import available_memory
from epd.model.config import TextConfig
from epd.model.deepseek import DeepseekV3ForCausalLM
from epd.model.paged import PagedBatch
from epd.wire.messages import KVHandoff

log = logging.getLogger(__name__)
IN_DECODE = (Status.WAITING, Status.RUNNING, Status.PREEMPTED)


class NonFinite(ValueError):
    """A row of logits holds NaN or infinity: nothing can be sampled from it."""


class TooLarge(ValueError):
    """A request needs more KV cache than decode has in all: the client's to change."""


class Busy(ValueError):
    """Decode holds as many requests as it may: this one must go elsewhere or come back later."""


class Lacking(ValueError):
    """The hand-off says decode holds blocks it no longer holds: only its first `held`."""

    def __init__(self, held: int, keeps: bool) -> None:
        super().__init__(f"decode holds {held} of the blocks named as cached")
        self.held, self.keeps = held, keeps


@dataclass
class Step:
    """What one step did: a delta for each sequence that advanced, a reason for each that failed."""

    produced: list[tuple[Sequence, Output]] = field(default_factory=list)
    failed: list[tuple[Sequence, str]] = field(default_factory=list)
    refused: list[tuple[Sequence, str]] = field(default_factory=list)  # the request's own doing
    preempted: int = 0  # sequences sent back to wait for blocks
    batch: int = 0  # sequences the forward ran for
    drafts: int = 0  # sequences that had drafts to verify (speculative decoding)
    draft_tokens: int = 0  # drafts verified
    accepted: list[int] = field(default_factory=list)  # drafts accepted, by position


class Scheduler:
    def __init__(
        self,
        lm: DeepseekV3ForCausalLM,
        tokenizer: PreTrainedTokenizerBase,
        eos_ids: Collection[int],
        max_batch_size: int = 64,
        max_kv_tokens: int = 0,
        preallocate: bool = False,
        context_length: int = 0,
        memory_share: float = 0.0,
        checkpoint: bytes = b"",
        prefix_caching: bool = True,
        events: KVEvents | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        """`context_length`: the most tokens of a sequence (0: the model's); `memory_share`:
        of the device's memory, for an automatic KV budget (`kv_memory`); `checkpoint`: its
        digest, which names the blocks it is handed (`hashing.model_key`); `prefix_caching`:
        keep prompts' blocks after their requests; `events`: told what it caches and evicts
        (vLLM's KV events); `speculative`: draft tokens and verify them (off: None)."""
        self.lm, self.tokenizer, self.eos_ids = lm, tokenizer, eos_ids
        self.max_batch_size = max_batch_size
        self.context_length = context_length or lm.config.max_position_embeddings
        self.max_waiting = 4 * max_batch_size  # each holds its cache: bound what one peer can park
        self.device = lm.lm_head.weight.device
        self.running: dict[tuple[str, int], Sequence] = {}  # by (request id, choice)
        self.waiting: deque[Sequence] = deque()
        self.checkpoint = checkpoint
        self.speculative = speculative
        self.proposer = proposer(speculative) if speculative else None
        self.stepped: list[PagedBatch] = []  # the forwards of the step under way
        config, dtype = lm.config, lm.lm_head.weight.dtype
        self.reader = reader = lm.block_reader()  # how steps read the pool: what it keeps beside
        budget = max_kv_tokens or default_kv_tokens(
            config,
            max_batch_size,
            self.device,
            dtype,
            self.context_length,
            memory_share,
            reader.copies,
        )
        layers, width = config.num_hidden_layers, config.latent_dim
        cached = None if prefix_caching else 0  # cached blocks: any number, in free space
        try:
            self.pool = BlockPool(
                layers, width, self.device, dtype, budget, preallocate, events, cached
            )
        except torch.OutOfMemoryError as e:
            raise RuntimeError(
                f"decode's KV cache of {budget} tokens does not fit in memory: set a smaller "
                "--max-kv-tokens"
            ) from e
        # Waiting caches stay in memory where they arrived: at most what the pool holds, in
        # bytes (their number alone let 192 contexts of 128k tokens, ~4 GB each, wait).
        self.max_waiting_bytes = self.pool.max_tokens * layers * width * dtype.itemsize

    @cached_property
    def grammars(self) -> Grammars:  # built on first use: a large vocabulary takes a second
        return Grammars(self.tokenizer, self.lm.config.vocab_size, self.eos_ids)

    def __len__(self) -> int:
        return len(self.running) + len(self.waiting)

    def __contains__(self, request_id: str) -> bool:
        return any(s.request_id == request_id for s in self.sequences())

    def sequences(self) -> list[Sequence]:
        return [*self.running.values(), *self.waiting]

    def check(self, handoff: KVHandoff) -> None:
        """Refuse a hand-off this model cannot resume, before it touches any state.

        The message checked its own values (finite cache, sampling in range); these checks need
        the model: sizes, the vocabulary and the context length.
        """
        config = self.lm.config
        rows = handoff.prompt_tokens - handoff.cached_blocks * BLOCK_TOKENS
        expected = (config.num_hidden_layers, rows, config.latent_dim)
        if tuple(handoff.cache.shape) != expected:
            raise ValueError(f"KV cache of shape {tuple(handoff.cache.shape)}, expected {expected}")
        if any(not 0 <= t < config.vocab_size for t in handoff.first_tokens):
            raise ValueError(f"a first token of {handoff.first_tokens} is outside the vocabulary")
        ids = handoff.prompt_ids
        if int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size:
            raise ValueError("a prompt token id is outside the vocabulary")
        if any(not 0 <= t < config.vocab_size for t in handoff.sampling.token_ids()):
            raise ValueError("logit_bias or stop_token_ids name a token outside the vocabulary")
        # (a migrated request's reply so far is in its prompt, and counted in max_tokens too)
        total = handoff.prompt_tokens - handoff.resumed_tokens + handoff.sampling.max_tokens
        if total > self.context_length:
            raise ValueError(
                f"{handoff.prompt_tokens} prompt tokens and max_tokens "
                f"{handoff.sampling.max_tokens} exceed the context length {self.context_length}"
            )
        if total > self.pool.max_tokens:
            raise TooLarge(
                f"{handoff.prompt_tokens} prompt tokens and max_tokens "
                f"{handoff.sampling.max_tokens} exceed decode's KV cache of "
                f"{self.pool.max_tokens} tokens (--max-kv-tokens)"
            )
        dtype = self.lm.lm_head.weight.dtype
        if (largest := overflows(handoff.cache, dtype)) is not None:  # finite: the message checked
            raise ValueError(f"KV cache values up to {largest:.3g} overflow decode's {dtype}")
        if handoff.request_id in self:
            raise ValueError(f"request {handoff.request_id} is already decoding")
        if handoff.sampling.n > self.max_waiting:  # never: it is no use coming back later
            raise TooLarge(
                f"n={handoff.sampling.n} choices are more than decode's {self.max_waiting} "
                "waiting places (4 × --max-batch-size)"
            )
        if len(self.waiting) + handoff.sampling.n > self.max_waiting:
            raise Busy(f"decode is full: {len(self.waiting)} sequences wait for a batch slot")
        waiting_bytes = self.waiting_bytes()
        if waiting_bytes and waiting_bytes + handoff.cache.nbytes > self.max_waiting_bytes:
            raise Busy(f"decode is full: {waiting_bytes} bytes of caches wait for a batch slot")

    def waiting_bytes(self) -> int:
        """The memory the waiting sequences' rows take (a request's choices share one)."""
        pending = {id(s.pending): s.pending.nbytes for s in self.waiting if s.pending is not None}
        return sum(pending.values())

    def named(self, handoff: KVHandoff) -> tuple[bytes, ...]:
        """The hand-off's block hashes, checked against its prompt: hashed here again from the
        tokens, images and salt it gives, and from this decoder's checkpoint and the rows'
        dtype. A hand-off whose names do not match is refused: its blocks would be another's."""
        named = handoff.block_hashes
        if not named.shape[0]:
            return ()
        images = [ImageSpan(i.start, i.length, i.digest) for i in handoff.images]
        seed = chain_seed(model_key(self.checkpoint, dtype_name(handoff.cache.dtype)), handoff.salt)
        hashes = tuple(block_hashes(handoff.prompt_ids.tolist(), images, seed))
        if b"".join(hashes) != named.numpy().tobytes():
            raise ValueError("the hand-off's block hashes do not match its prompt")
        return hashes

    def add(self, handoff: KVHandoff) -> list[tuple[Sequence, Output]]:
        """Admit a prefilled request, a sequence per choice; the choices share the blocks decode
        held of the prompt already, and its rows that came, until each joins the batch, where
        the rows go into blocks of its own. Each first token is accepted (and may already finish
        its choice). Raises Lacking where a block named as held is not."""
        self.check(handoff)
        hashes = self.named(handoff)
        try:
            generators = [restore_generator(state) for state in handoff.rng_states]
        except RuntimeError as e:
            raise ValueError(f"unusable sampler state: {e}") from None
        held = self.pool.match(hashes[: handoff.cached_blocks])
        if held.length < handoff.cached_blocks * BLOCK_TOKENS:
            self.pool.release(held)
            raise Lacking(held.length // BLOCK_TOKENS, self.pool.caching)
        # Rows that came wait where they arrived (host memory, from the wire); the pool's budget
        # bounds the device's.
        rows = handoff.cache.to(dtype=self.lm.lm_head.weight.dtype)
        tables = [held, *(self.pool.share(held) for _ in generators[1:])]
        added = []
        try:
            resumed = handoff.resumed_tokens  # a migrated request's reply so far, in its prompt
            prompt_ids = handoff.prompt_ids[: handoff.prompt_tokens - resumed]
            for index, (generator, table) in enumerate(zip(generators, tables, strict=True)):
                sequence = Sequence(
                    handoff.request_id,
                    handoff.sampling,
                    generator,
                    table,
                    rows,
                    self.tokenizer,
                    self.eos_ids,
                    prompt_ids,
                    gate(self.grammars, handoff.sampling),  # GrammarError: refused
                    index,
                )
                sequence.block_hashes = hashes
                sequence.named_ids = handoff.prompt_ids  # a migrated one's: the reply's too
                replay(sequence, handoff.prompt_ids[len(prompt_ids) :].tolist())
                first = handoff.first_tokens[index], handoff.first_logprobs[index]
                added.append((sequence, sequence.accept(*first)))
        except BaseException:
            for table in tables:
                self.pool.release(table)
            raise
        for sequence, _ in added:
            if sequence.finish_reason is None:
                self.waiting.append(sequence)
            else:
                self.pool.release(sequence.table)
        return added

    def abort(self, request_id: str) -> bool:
        """Drop a request, every choice of it, wherever it is; its caches go with it."""
        keys = [key for key in self.running if key[0] == request_id]
        for key in keys:
            self._leave(self.running[key])
        kept = [s for s in self.waiting if s.request_id != request_id]
        for sequence in self.waiting:
            if sequence.request_id == request_id:
                self.pool.release(sequence.table)
        found = bool(keys) or len(kept) != len(self.waiting)
        self.waiting = deque(kept)
        return found

    def drain(self) -> list[Sequence]:
        """Remove and return every sequence, running or waiting."""
        sequences = self.sequences()
        self.running.clear()
        self.pool.clear()
        self.reader.forget()
        self.waiting.clear()
        return sequences

    @torch.inference_mode()
    def step(self) -> Step:
        """Advance every running sequence by one token, or with speculative decoding by the
        drafts the model agrees with and one token more; say what each produced or why it
        failed."""
        step = Step()
        self._join(step)
        self._make_room(step)
        drafts = self._propose(step)
        step.batch = len(self.running)
        self.stepped = []
        good: list[tuple[Sequence, torch.Tensor]] = []
        for sequence, rows in self._logits(list(self.running.values()), drafts):
            if isinstance(rows, Exception):
                self._fail(step, sequence, rows)
            else:
                good.append((sequence, rows))
        self._accept(step, good, drafts)
        return step

    def _propose(self, step: Step) -> dict[tuple[str, int], list[int]]:
        """Each running sequence's drafts, with room made in the pool for their rows: none past
        its max_tokens, as a step gives one token more; none at all in a batch of
        `disable_by_batch_size` or more; only as many rows as blocks nobody holds or caches
        take (drafts are mostly refused: they never evict a cached prefix nor send a sequence
        back); and none for a sequence whose drafting fails (it steps on alone, logged)."""
        if self.proposer is None or self.speculative is None:
            return {}
        most = self.speculative.num_speculative_tokens
        step.accepted = [0] * most
        if not self.speculative.drafts_at(len(self.running)):
            return {}
        found = {}
        for sequence in self.running.values():
            try:
                if drafts := self._drafts(sequence, most):
                    found[sequence.key] = drafts
            except Exception:
                log.exception(
                    "request %s: its drafts failed; it steps without", sequence.request_id
                )
        return found

    def _drafts(self, sequence: Sequence, most: int) -> list[int]:
        limit = min(most, sequence.sampling.max_tokens - len(sequence.tokens) - 1)
        if limit < 1:
            return []
        drafts = self.proposer.propose(sequence.history(), limit) if self.proposer else []
        table = sequence.table
        room = (len(table.blocks) + self.pool.unused_blocks) * BLOCK_TOKENS - table.length - 1
        drafts = drafts[: max(0, room)]
        self.pool.make_room(table, 1 + len(drafts))
        return drafts

    def _accept(
        self,
        step: Step,
        batch: list[tuple[Sequence, torch.Tensor]],
        drafts: dict[tuple[str, int], list[int]],
    ) -> None:
        """Each sequence's tokens from its rows of logits (1 + its drafts, vocab): position by
        position, every sequence still going sampled together under its controls as they are
        after the tokens before (penalties, grammar, min_tokens), a draft kept while the model
        agrees with it (greedy: it is the token; sampled: `verify`), until a token that is no
        draft, the last row, or the end of the reply. The rows after its last token roll back."""
        outputs: dict[tuple[str, int], list[Output]] = {s.key: [] for s, _ in batch}
        going = batch
        for position in range(max((rows.shape[0] for _, rows in batch), default=0)):
            here = [(s, rows) for s, rows in going if position < rows.shape[0]]
            if not here:
                break
            logits = torch.stack([rows[position] for _, rows in here])  # (n, vocab)
            wanted = [drafts.get(s.key, [])[position : position + 1] for s, _ in here]
            guesses = [guess[0] if guess else None for guess in wanted]
            going = []
            for (sequence, rows), token, draft in zip(
                here, self._sample(here, logits, guesses), guesses, strict=True
            ):
                try:
                    if isinstance(token, Exception):
                        raise token
                    logprob = sequence.logprob(rows[position], token)
                    outputs[sequence.key].append(sequence.accept(token, logprob))
                except Exception as e:
                    del outputs[sequence.key]
                    self._fail(step, sequence, e)
                    continue
                if sequence.finish_reason is None and token == draft:
                    going.append((sequence, rows))
        kept = {}
        for sequence, _ in batch:
            if sequence.key in outputs:
                self._count(step, drafts.get(sequence.key, []), outputs[sequence.key])
                step.produced.append((sequence, joined(outputs[sequence.key])))
                if sequence.finish_reason is not None:
                    self._leave(sequence)  # its blocks go whole
                else:
                    kept[sequence.table] = len(outputs[sequence.key])
        for paged in self.stepped:  # rows after each one's last token go; the gone keep theirs
            paged.keep([kept.get(c, n) for c, n in zip(paged.paged, paged.counts, strict=True)])
        self.stepped = []

    @staticmethod
    def _count(step: Step, drafts: list[int], outputs: list[Output]) -> None:
        """A sequence's drafts, and those its step's tokens kept, by position, into the step."""
        if not drafts:
            return
        step.drafts += 1
        step.draft_tokens += len(drafts)
        tokens = [t for output in outputs for t in output.token_ids]
        for position, (draft, token) in enumerate(zip(drafts, tokens, strict=False)):
            if draft != token:
                break
            step.accepted[position] += 1

    def _join(self, step: Step) -> None:
        """Waiting sequences join, in order, while there are batch slots and free blocks."""
        while self.waiting and len(self.running) < self.max_batch_size:
            first = self.waiting[0]
            length, shared = first.num_computed_tokens, first.table.length
            if not self.pool.can_admit(length, shared, len(self.running)):
                return  # the first in line waits for blocks, and nobody passes it
            sequence = self.waiting.popleft()
            try:
                self._into_pool(sequence)
            except Exception as e:  # e.g. no memory for its rows: it fails alone
                log.error("request %s could not join the batch", sequence.request_id, exc_info=e)
                step.failed.append((sequence, f"decode failed: {type(e).__name__}: {e}"))
                self.pool.release(sequence.table)
                continue
            self.running[sequence.key] = sequence
            sequence.status = Status.RUNNING

    def _into_pool(self, sequence: Sequence) -> None:
        """A joining sequence's rows into blocks, with room for its next: after the cached
        blocks of its prompt where it holds none yet (another choice of its request, or an
        earlier request, may have put them there), and its prompt's full blocks published."""
        pending = sequence.pending
        if pending is not None and not sequence.table.length and sequence.block_hashes:
            self.pool.release(sequence.table)
            usable = sequence.block_hashes[: pending.shape[1] // BLOCK_TOKENS]
            sequence.table = self.pool.match(usable)
            pending = pending[:, sequence.table.length :]
        if pending is not None:
            self.pool.write(sequence.table, pending)
            sequence.pending = None
        self.pool.make_room(sequence.table)
        self.pool.publish(sequence.table, sequence.block_hashes, sequence.named_ids.tolist())

    def _make_room(self, step: Step) -> None:
        """A row for every running sequence's next token. When no block is free, the sequence
        that joined last goes back to wait (it may be the one in need), until the rest fit:
        `check` made sure any one of them fits alone."""
        for sequence in list(self.running.values()):  # in the order they joined
            while sequence.key in self.running:
                try:
                    self.pool.make_room(sequence.table)
                    break
                except PoolFull:
                    self._preempt(step, list(self.running.values())[-1])
                except Exception as e:  # e.g. out of memory growing the storage
                    self._fail(step, sequence, e)

    def _preempt(self, step: Step, sequence: Sequence) -> None:
        """Send a running sequence back to the head of the line, its cache in host memory."""
        del self.running[sequence.key]
        try:
            sequence.pending = self.pool.evict(sequence.table)
            sequence.table = self.pool.table()
        except Exception as e:
            self.running[sequence.key] = sequence  # so that failing it releases its blocks
            self._fail(step, sequence, e)
            return
        self.waiting.appendleft(sequence)
        sequence.status = Status.PREEMPTED
        step.preempted += 1
        log.info("request %s waits for KV cache blocks", sequence.request_id)
        if not self.running:
            self.reader.forget()

    def _leave(self, sequence: Sequence) -> None:
        del self.running[sequence.key]
        self.pool.release(sequence.table)
        sequence.status = Status.FINISHED
        if not self.running:  # what the reader keeps beside the pool goes
            self.reader.forget()

    def counts(self) -> dict[str, int]:
        """Sequences by status: waiting (not yet run), running, preempted (waiting again)."""
        statuses = [s.status for s in self.sequences()]
        return {status.value: statuses.count(status) for status in IN_DECODE}

    def _fail(self, step: Step, sequence: Sequence, error: Exception) -> None:
        if isinstance(error, NoTokenAllowed | GrammarError):  # what it asked for, not a fault
            log.warning("request %s cannot go on: %s", sequence.request_id, error)
            if isinstance(error, GrammarError) and sequence.sampling.grammar:
                self.grammars.forget(sequence.sampling.grammar)
            step.refused.append((sequence, str(error)))
        else:
            log.error("request %s failed in a decode step", sequence.request_id, exc_info=error)
            step.failed.append((sequence, f"decode failed: {type(error).__name__}: {error}"))
        self._leave(sequence)

    def _sample(
        self,
        batch: list[tuple[Sequence, torch.Tensor]],
        logits: torch.Tensor,
        drafts: list[int | None] | None = None,
    ) -> list[int | Exception]:
        """Each row's token, drawn in one batched call, or where a sampled row has a draft,
        that draft kept or replaced (`verify`); a row that is not finite, or that fails when
        drawn alone after the batch failed, gets its error instead."""
        drafts = drafts or [None] * len(batch)
        finite = finite_rows(logits)
        results: list[int | Exception] = [
            NonFinite("the model's logits for this request are not finite") for _ in batch
        ]
        rows = [i for i, ok in enumerate(finite) if ok]
        sequences = [batch[i][0] for i in rows]
        states = [s.generator.get_state() for s in sequences]
        try:
            picked = logits[rows]
            adjusted = adjust(picked, sequences, self.eos_ids)
            if adjusted is not picked:  # controls ran: one row may have no token left
                require_a_token(adjusted)  # it is then found alone, below
            tokens = self._draw(adjusted, sequences, [drafts[i] for i in rows])
        except Exception as e:
            if len(rows) == 1:
                results[rows[0]] = e
                return results
            log.exception("batched sampling failed; sampling its %d requests alone", len(rows))
            for sequence, state in zip(sequences, states, strict=True):
                sequence.generator.set_state(state)  # the failed call may have drawn already
            for i in rows:
                results[i] = self._sample([batch[i]], logits[i : i + 1], [drafts[i]])[0]
            return results
        for i, token in zip(rows, tokens, strict=True):
            results[i] = token
        return results

    def _draw(
        self, logits: torch.Tensor, sequences: list[Sequence], drafts: list[int | None]
    ) -> list[int]:
        """Tokens from adjusted logits (n, vocab): `sample_batch`'s, but for a sampled row
        with a draft, which keeps or replaces it by the row's distribution (`verify`)."""
        checked = [
            i
            for i, (s, d) in enumerate(zip(sequences, drafts, strict=True))
            if d is not None and s.sampling.temperature >= GREEDY_BELOW
        ]
        plain = sorted(set(range(len(sequences))) - set(checked))
        tokens = [0] * len(sequences)
        if plain:
            drawn = sample_batch(
                logits[plain],
                [sequences[i].sampling for i in plain],
                [sequences[i].generator for i in plain],
            ).tolist()
            for i, token in zip(plain, drawn, strict=True):
                tokens[i] = token
        if checked:
            probs = probabilities(logits[checked], [sequences[i].sampling for i in checked])
            for i, row in zip(checked, probs.cpu(), strict=True):
                tokens[i] = verify(cast(int, drafts[i]), row, sequences[i].generator)
        return tokens

    def _logits(
        self, batch: list[Sequence], drafts: dict[tuple[str, int], list[int]]
    ) -> list[tuple[Sequence, torch.Tensor | Exception]]:
        """Each sequence's logits (1 + its drafts, vocab): for the token after its last, and
        after each draft; or the error that kept it from them."""
        if not batch:
            return []
        lengths = [s.table.length for s in batch]
        try:
            return list(zip(batch, self._forward(batch, drafts), strict=True))
        except Exception as e:
            for sequence, length in zip(batch, lengths, strict=True):
                sequence.table.length = length  # a failure after the caches grew must not count
            if len(batch) == 1:
                return [(batch[0], e)]
            log.exception("a batched decode step failed; running its %d requests alone", len(batch))
        return [pair for sequence in batch for pair in self._logits([sequence], drafts)]

    def _forward(
        self, batch: list[Sequence], drafts: dict[tuple[str, int], list[int]]
    ) -> tuple[torch.Tensor, ...]:
        fed = [[s.last_token, *drafts.get(s.key, [])] for s in batch]
        counts = [len(tokens) for tokens in fed]
        tokens = torch.tensor([t for own in fed for t in own], device=self.device)  # (R,)
        tables = [s.table for s in batch]
        paged = self.reader.batch(self.pool.storage, tables, self.pool.max_bytes, counts)
        logits = self.lm.logits(self.lm.decode(tokens, paged))  # (R, vocab)
        self.stepped.append(paged)
        return logits.split(counts)


def default_kv_tokens(
    config: TextConfig,
    max_batch_size: int,
    device: torch.device,
    dtype: torch.dtype,
    context: int = 0,
    memory_share: float = 0.0,
    copies: int = 1,
) -> int:
    """Decode's KV cache budget when none is set: every batch slot at the full context (the
    model's, or `context`), or what `kv_memory` holds if that is less, but always one whole
    context."""
    per_token = config.num_hidden_layers * config.latent_dim * dtype.itemsize
    context = context or config.max_position_embeddings
    room = kv_memory(device, memory_share, copies)
    return max(context, min(max_batch_size * context, room // per_token))


def kv_memory(device: torch.device, share: float = 0.0, copies: int = 1) -> int:
    """Bytes an automatic KV budget may take. With a `share` of the device's memory (vLLM's
    gpu_memory_utilization): on a GPU what the share leaves once this process's weights are
    loaded, within the memory free; on a CPU the share of the memory free now. Without one,
    half the memory free. On a CPU, `copies` share it: the pool and what its reader keeps beside
    it (`BlockReader.copies`: a gathered copy of at most the pool's size)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if not share:
            return free // 2
        return max(0, min(free, int(share * total) - torch.cuda.memory_reserved(device)))
    return int(available_memory() * (share or 0.5)) // copies


def replay(sequence: Sequence, tokens: list[int]) -> None:
    """Feed a migrated reply's tokens to its new sequence, as its first decoder did: its
    transcript (text, stop strings, grammar, penalties' history) comes to the same place, and
    what they gave the client is not given again. A token that would end it is refused: the
    client's reply went on past it."""
    for token in tokens:
        if sequence.finish_reason is not None:
            raise ValueError("a resumed reply ended before its last token")
        sequence.accept(token)
    if sequence.finish_reason is not None:
        raise ValueError("a resumed reply ended before its last token")
