"""A decode step's attention over a `BlockPool`'s blocks, and how it reads them: the seam
between the one home of KV (`epd/kv/`) and the attention code.

A running cache's rows sit in the blocks of its table: row t at
`storage[:, blocks[t // BLOCK_TOKENS], t % BLOCK_TOKENS]`. A step writes each cache's new row
into its block and attends over the blocks gathered into padded (n, T, latent_dim) tensors, in
parts of similar lengths (none padded past twice its own), so that one long cache does not make
every short one's gathered rows and attention as long as itself. A paged attention kernel would
read the blocks in place; torch has none, so `GatherEachStep` gathers them every step. A reader
may keep what it gathered between steps instead (`epd/model/cpu_gathered.py`, on a CPU): the
model chooses its reader (`DeepseekV3ForCausalLM.block_reader`), the pool does not.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple, Protocol

import torch

from epd.kv.hashing import BLOCK_TOKENS, blocks_for
from epd.kv.pool import BlockTable


class Part(NamedTuple):
    """Some of a decode step's requests, for one attention call."""

    # Which of the step's query rows: None, all of them, in order; (n,) one per request; or
    # (n, m) a request's several (speculative decoding), padded with the scratch row, R.
    rows: torch.Tensor | None
    cache: torch.Tensor  # (n, T, latent_dim): their caches padded to the longest of them
    visible: torch.Tensor  # (n, T), or (n, m, T) for several rows each: what each row sees


def by_length(lengths: list[int]) -> list[list[int]]:
    """Positions grouped so that none is padded to more than twice its length: longest first,
    a new group where a length falls to half its group's longest. All in one group keep their
    order (the common case: one attention call, no reordering)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and 2 * lengths[i] > lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [list(range(len(lengths)))] if len(groups) == 1 else groups


class PagedBatch:
    """A decode step over pooled caches: each writes its rows into its own blocks, and the step
    attends over their blocks gathered by table, in parts of similar lengths (`by_length`), so
    that one long cache does not pad every short one to its length. Layers call
    `append_and_gather` with the step's latent rows; `advance` ends the step.

    A cache takes one row a step, or `counts` of them (speculative decoding: its last token and
    its drafts, R rows in all, each cache's together, in order); row j of a cache sees its rows
    before the step and its own up to j. After the step, `keep` rolls back the rows refused."""

    def __init__(
        self, storage: torch.Tensor, caches: list[BlockTable], counts: list[int] | None = None
    ) -> None:
        self.counts = counts or [1] * len(caches)
        for cache, count in zip(caches, self.counts, strict=True):
            cache.reserve(count)
        self.storage, self.paged = storage, caches
        self.starts = [c.length for c in caches]  # each cache's rows before the step
        self.several = any(n > 1 for n in self.counts)
        device = storage.device
        spans = [
            (c, p)
            for c, n in zip(caches, self.counts, strict=True)
            for p in range(c.length, c.length + n)
        ]
        # (R,) the positions of the tokens decoded, after each cache's rows, and their blocks
        self.positions = torch.tensor([p for _, p in spans], device=device)
        self.block = torch.tensor([c.blocks[p // BLOCK_TOKENS] for c, p in spans], device=device)
        self.offset = self.positions % BLOCK_TOKENS  # (R,) where each writes its row
        self.tables = self.make_tables()

    def ends(self) -> list[int]:
        """The rows each cache holds once the step wrote its own."""
        return [start + n for start, n in zip(self.starts, self.counts, strict=True)]

    def make_tables(self) -> list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]]:
        return [self.table(part) for part in by_length(self.ends())]

    def table(self, part: list[int]) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Of some of the caches (by position in the batch): their query rows (`Part.rows`),
        their blocks, padded with the zero block, flat (n · width,), and what each row sees."""
        caches = [self.paged[i] for i in part]
        width = blocks_for(max(self.ends()[i] for i in part))
        # Whole blocks, the rows past each length masked: attention's products then meet a new
        # length once every BLOCK_TOKENS steps, not every step (oneDNN, which runs bfloat16
        # ones on a CPU, builds a kernel for each shape it meets).
        rows, visible = self.queries(part, width * BLOCK_TOKENS)
        return rows, table_of(caches, width, self.storage.device), visible

    def queries(self, part: list[int], seen: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Some caches' query rows (`Part.rows`) and what each sees of `seen` rows: (n, seen),
        or with several rows a cache, (n, m, seen), a padding row seeing as its cache's last."""
        device = self.storage.device
        if not self.several:
            lengths = torch.tensor([self.starts[i] + 1 for i in part])
            visible = (torch.arange(seen)[None, :] < lengths[:, None]).to(device)
            rows = None if len(part) == len(self.paged) else torch.tensor(part, device=device)
            return rows, visible
        first = [0, *itertools.accumulate(self.counts)]  # each cache's first row in the step
        width = max(self.counts[i] for i in part)
        scratch = first[-1]  # R: the row a padding slot reads and writes
        rows = torch.tensor(
            [[first[i] + j if j < self.counts[i] else scratch for j in range(width)] for i in part]
        )
        last = torch.tensor(  # the last row each sees: a padding row, its cache's last
            [[self.starts[i] + min(j, self.counts[i] - 1) for j in range(width)] for i in part]
        )
        visible = torch.arange(seen)[None, None, :] <= last[:, :, None]  # (n, m, seen)
        return rows.to(device), visible.to(device)

    def append_and_gather(self, layer: int, latent: torch.Tensor) -> list[Part]:
        """latent (R, latent_dim) → the caches including it, in parts, copies."""
        blocks = self.storage[layer]  # (blocks, BLOCK_TOKENS, latent_dim)
        blocks[self.block, self.offset] = latent
        parts = []
        for rows, table, visible in self.tables:
            # index_select copies whole blocks; indexing with a 2-D table was ~4x slower here
            gathered = blocks.index_select(0, table)  # (n · width, BLOCK_TOKENS, latent)
            cache = gathered.view(len(visible), -1, blocks.shape[-1])  # (n, width · BLOCK, ·)
            parts.append(Part(rows, cache, visible))
        return parts

    def advance(self) -> None:
        for cache, count in zip(self.paged, self.counts, strict=True):
            cache.length += count

    def keep(self, kept: list[int]) -> None:
        """After the step: of each cache's rows, its first `kept` stay (the tokens accepted);
        the pool rolls back the rest (`BlockPool.truncate`)."""
        spans = zip(self.paged, self.starts, self.counts, kept, strict=True)
        for cache, start, count, keep in spans:
            if keep < count:
                cache.pool.truncate(cache, start + keep)


def table_of(caches: list[BlockTable], width: int, device: torch.device) -> torch.Tensor:
    """The caches' first `width` blocks each, padded with the zero block, flat (n · width,)."""
    blocks = [b for c in caches for b in (c.blocks + [0] * width)[:width]]
    return torch.tensor(blocks, device=device)


def padded_parts(lengths: list[int], room: int = 0) -> list[tuple[list[int], int]]:
    """`by_length`'s parts of caches of these lengths, each with its width in blocks: its
    longest cache's, and `room` more."""
    return [(part, blocks_for(max(lengths[i] for i in part)) + room) for part in by_length(lengths)]


class BlockReader(Protocol):
    """How a decode step reads a pool's blocks. `copies`: the pool's memory counted with what
    the reader keeps beside it (at most as much again)."""

    copies: int

    def batch(
        self,
        storage: torch.Tensor,
        caches: list[BlockTable],
        budget: int,
        counts: list[int] | None = None,
    ) -> PagedBatch:
        """A step over these caches, in this order, `counts` rows each (default one); what it
        keeps takes at most `budget` bytes."""
        ...

    def forget(self) -> None:
        """The pool emptied or was cleared: nothing kept may stay."""
        ...


class GatherEachStep:
    """Every step gathers the blocks it attends over, anew (no paged attention kernel here)."""

    copies = 1

    def batch(
        self,
        storage: torch.Tensor,
        caches: list[BlockTable],
        budget: int,
        counts: list[int] | None = None,
    ) -> PagedBatch:
        return PagedBatch(storage, caches, counts)

    def forget(self) -> None:
        pass
