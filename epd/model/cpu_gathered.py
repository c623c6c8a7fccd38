"""On a CPU, the running caches gathered once and kept between decode steps.

Gathering every layer's blocks anew took a large share of a CPU decode step over long caches,
and a CPU has the memory for a copy. So `KeepGathered` keeps the running caches gathered
(`Gathered`) between steps: each step writes its rows into the blocks and into the copy, and the
copy is made again only when the batch changes (a sequence joins, leaves or is sent back) or its
longest cache outgrows the copy's HEADROOM_BLOCKS. The copy takes at most the pool's budget.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from epd.kv.hashing import BLOCK_TOKENS
from epd.kv.pool import BlockTable
from epd.model.paged import PagedBatch, Part, padded_parts, table_of

# Blocks a kept copy has past each part's longest cache: it is gathered again at most every
# HEADROOM_BLOCKS · BLOCK_TOKENS steps as caches grow, and attention reads as many more rows
# (masked) until then.
HEADROOM_BLOCKS = 2


class GatheredPart(NamedTuple):
    rows: torch.Tensor | None  # (n,) which caches of the batch; None: all of them, in order
    members: list[int]  # the same, as positions in the batch
    caches: torch.Tensor  # (layers, n, width · BLOCK_TOKENS, latent_dim)


class PartStep(NamedTuple):
    """A step's own, for one part of a `Gathered` copy."""

    taken: torch.Tensor | None  # (r,) the step's rows the part's caches write; None: all
    own: torch.Tensor  # (r,) whose they are: 0 … n - 1, the part's own caches
    where: torch.Tensor  # (r,) at which position each is written
    rows: torch.Tensor | None  # the part's query rows (`Part.rows`)
    visible: torch.Tensor  # and what each sees (`Part.visible`)


class Gathered:
    """The running caches' blocks gathered out of the storage once and kept between steps, in
    parts of similar lengths (`by_length`), each HEADROOM_BLOCKS longer than its longest cache.
    Each step writes its rows in too (`append`), and rolls back what it refused (`keep`), so the
    copy holds what the blocks hold for as long as the batch is the same caches, in the same
    order (`serves`)."""

    def __init__(self, storage: torch.Tensor, caches: list[BlockTable], counts: list[int]) -> None:
        self.caches = list(caches)
        self.lengths = [c.length for c in caches]  # rows each holds before the step
        device = storage.device
        self.parts: list[GatheredPart] = []
        ends = [n + count for n, count in zip(self.lengths, counts, strict=True)]
        for part, width in padded_parts(ends, HEADROOM_BLOCKS):
            gathered = storage.index_select(1, table_of([caches[i] for i in part], width, device))
            rows = None if len(part) == len(caches) else torch.tensor(part, device=device)
            # (layers, n · width, BLOCK_TOKENS, latent) → (layers, n, width · BLOCK_TOKENS, latent)
            copied = gathered.view(gathered.shape[0], len(part), -1, gathered.shape[-1])
            self.parts.append(GatheredPart(rows, part, copied))

    @staticmethod
    def nbytes_for(caches: list[BlockTable], storage: torch.Tensor, counts: list[int]) -> int:
        """What a copy of these caches would take (each part padded as `by_length` pads it)."""
        per_row = storage.shape[0] * storage.shape[-1] * storage.element_size()
        ends = [c.length + n for c, n in zip(caches, counts, strict=True)]
        parts = padded_parts(ends, HEADROOM_BLOCKS)
        return sum(len(part) * width for part, width in parts) * BLOCK_TOKENS * per_row

    def serves(self, caches: list[BlockTable], counts: list[int]) -> bool:
        """Whether the copy holds these caches as they are, with room for `counts` more rows."""
        return (
            len(caches) == len(self.caches)
            and all(a is b for a, b in zip(caches, self.caches, strict=True))
            and all(c.length == n for c, n in zip(caches, self.lengths, strict=True))
            and all(
                self.lengths[i] + counts[i] <= part.caches.shape[2]
                for part in self.parts
                for i in part.members
            )
        )

    def begin(self, batch: PagedBatch) -> list[PartStep]:
        """A step's rows (`batch`'s): per part, where its caches write them, and what each
        query row then sees."""
        if not batch.several:  # a row per cache: the step's rows are the caches
            return [
                PartStep(
                    part.rows,
                    torch.arange(len(part.members), device=batch.positions.device),
                    batch.positions if part.rows is None else batch.positions[part.rows],
                    *batch.queries(part.members, part.caches.shape[2]),
                )
                for part in self.parts
            ]
        first = [0, *itertools.accumulate(batch.counts)]
        steps = []
        for part in self.parts:
            taken = [r for i in part.members for r in range(first[i], first[i + 1])]
            own = [k for k, i in enumerate(part.members) for _ in range(batch.counts[i])]
            device = batch.positions.device
            index = torch.tensor(taken, device=device)
            steps.append(
                PartStep(
                    index,
                    torch.tensor(own, device=device),
                    batch.positions[index],
                    *batch.queries(part.members, part.caches.shape[2]),
                )
            )
        return steps

    def append(self, step: list[PartStep], layer: int, latent: torch.Tensor) -> list[Part]:
        """latent (R, latent_dim) of layer `layer`, written in → that layer's parts."""
        parts = []
        for part, mine in zip(self.parts, step, strict=True):
            cache = part.caches[layer]  # (n, width · BLOCK_TOKENS, latent_dim)
            cache[mine.own, mine.where] = latent if mine.taken is None else latent[mine.taken]
            parts.append(Part(mine.rows, cache, mine.visible))
        return parts

    def advance(self, counts: list[int]) -> None:
        self.lengths = [n + count for n, count in zip(self.lengths, counts, strict=True)]

    def keep(self, lengths: list[int]) -> None:
        """The caches rolled back to these lengths: the rows after them zeroed here too (a
        masked row is still read, and a NaN there would poison the sums, as in the pool)."""
        for part in self.parts:
            for k, i in enumerate(part.members):
                part.caches[:, k, lengths[i] : self.lengths[i]] = 0
        self.lengths = list(lengths)


class KeptBatch(PagedBatch):
    """A step over pooled caches that attends over a `Gathered` copy of them kept from the
    steps before; the copy takes each step's rows, as the blocks do."""

    def __init__(
        self,
        storage: torch.Tensor,
        caches: list[BlockTable],
        kept: Gathered,
        counts: list[int] | None = None,
    ) -> None:
        self.kept = kept
        super().__init__(storage, caches, counts)
        self.step = kept.begin(self)

    def make_tables(self) -> list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]]:
        return []  # the copy is gathered already

    def append_and_gather(self, layer: int, latent: torch.Tensor) -> list[Part]:
        self.storage[layer][self.block, self.offset] = latent
        return self.kept.append(self.step, layer, latent)

    def advance(self) -> None:
        super().advance()
        self.kept.advance(self.counts)

    def keep(self, kept: list[int]) -> None:
        if kept != self.counts:  # something to roll back
            super().keep(kept)
            self.kept.keep([c.length for c in self.paged])


class KeepGathered:
    """A pool's reader that keeps the running caches gathered between steps, where that copy
    fits the pool's budget; otherwise it gathers them step by step."""

    copies = 2

    def __init__(self) -> None:
        self.kept: Gathered | None = None

    def batch(
        self,
        storage: torch.Tensor,
        caches: list[BlockTable],
        budget: int,
        counts: list[int] | None = None,
    ) -> PagedBatch:
        counts = counts or [1] * len(caches)
        if self.kept is None or not self.kept.serves(caches, counts):
            self.kept = None  # the old copy goes first: two at once would be the peak
            if Gathered.nbytes_for(caches, storage, counts) <= budget:
                self.kept = Gathered(storage, caches, counts)
        if self.kept is None:
            return PagedBatch(storage, caches, counts)
        return KeptBatch(storage, caches, self.kept, counts)

    def forget(self) -> None:
        self.kept = None
