"""On a CPU, the running caches gathered once and kept between decode steps.

Gathering every layer's blocks anew took a large share of a CPU decode step over long caches,
and a CPU has the memory for a copy. So `KeepGathered` keeps the running caches gathered
(`Gathered`) between steps: each step writes its rows into the blocks and into the copy, and the
copy is made again only when the batch changes (a sequence joins, leaves or is sent back) or its
longest cache outgrows the copy's HEADROOM_BLOCKS. The copy takes at most the pool's budget.
"""

from __future__ import annotations

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
    rows: torch.Tensor | None  # (n,) which rows of the batch; None: all of them, in order
    members: list[int]  # the same, as positions in the batch
    own: torch.Tensor  # (n,) 0 … n - 1: the part's own rows
    caches: torch.Tensor  # (layers, n, width · BLOCK_TOKENS, latent_dim)


# A step's own, per part of a `Gathered` copy: where each cache writes its row (n,), and the
# rows each then sees (n, width · BLOCK_TOKENS).
GatheredStep = list[tuple[torch.Tensor, torch.Tensor]]


class Gathered:
    """The running caches' blocks gathered out of the storage once and kept between steps, in
    parts of similar lengths (`by_length`), each HEADROOM_BLOCKS longer than its longest cache.
    Each step writes its rows in too (`append`), so the copy holds what the blocks hold for as
    long as the batch is the same caches, in the same order (`serves`)."""

    def __init__(self, storage: torch.Tensor, caches: list[BlockTable]) -> None:
        self.caches = list(caches)
        self.lengths = [c.length for c in caches]  # rows each holds before the step
        device = storage.device
        self.parts: list[GatheredPart] = []
        for part, width in padded_parts([n + 1 for n in self.lengths], HEADROOM_BLOCKS):
            gathered = storage.index_select(1, table_of([caches[i] for i in part], width, device))
            rows = None if len(part) == len(caches) else torch.tensor(part, device=device)
            own = torch.arange(len(part), device=device)
            # (layers, n · width, BLOCK_TOKENS, latent) → (layers, n, width · BLOCK_TOKENS, latent)
            copied = gathered.view(gathered.shape[0], len(part), -1, gathered.shape[-1])
            self.parts.append(GatheredPart(rows, part, own, copied))

    @staticmethod
    def nbytes_for(caches: list[BlockTable], storage: torch.Tensor) -> int:
        """What a copy of these caches would take (each part padded as `by_length` pads it)."""
        per_row = storage.shape[0] * storage.shape[-1] * storage.element_size()
        parts = padded_parts([c.length + 1 for c in caches], HEADROOM_BLOCKS)
        return sum(len(part) * width for part, width in parts) * BLOCK_TOKENS * per_row

    def serves(self, caches: list[BlockTable]) -> bool:
        """Whether the copy holds these caches as they are, with room for one more row each."""
        return (
            len(caches) == len(self.caches)
            and all(a is b for a, b in zip(caches, self.caches, strict=True))
            and all(c.length == n for c, n in zip(caches, self.lengths, strict=True))
            and all(
                self.lengths[i] < part.caches.shape[2] for part in self.parts for i in part.members
            )
        )

    def begin(self, positions: torch.Tensor) -> GatheredStep:
        """A step whose rows go at positions (B,): per part, where its caches write, and what
        they then see."""
        step = []
        for part in self.parts:
            where = positions if part.rows is None else positions[part.rows]
            rows_seen = torch.arange(part.caches.shape[2], device=where.device)
            step.append((where, rows_seen[None, :] <= where[:, None]))
        return step

    def append(self, step: GatheredStep, layer: int, latent: torch.Tensor) -> list[Part]:
        """latent (B, latent_dim) of layer `layer`, written in → that layer's parts."""
        parts = []
        for part, (where, seen) in zip(self.parts, step, strict=True):
            cache = part.caches[layer]  # (n, width · BLOCK_TOKENS, latent_dim)
            cache[part.own, where] = latent if part.rows is None else latent[part.rows]
            parts.append(Part(part.rows, cache, seen))
        return parts

    def advance(self) -> None:
        self.lengths = [n + 1 for n in self.lengths]


class KeptBatch(PagedBatch):
    """A step over pooled caches that attends over a `Gathered` copy of them kept from the
    steps before; the copy takes each step's rows, as the blocks do."""

    def __init__(self, storage: torch.Tensor, caches: list[BlockTable], kept: Gathered) -> None:
        self.kept = kept
        super().__init__(storage, caches)
        self.step = kept.begin(self.positions)

    def make_tables(self) -> list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]]:
        return []  # the copy is gathered already

    def append_and_gather(self, layer: int, latent: torch.Tensor) -> list[Part]:
        self.storage[layer][self.block, self.offset] = latent
        return self.kept.append(self.step, layer, latent)

    def advance(self) -> None:
        super().advance()
        self.kept.advance()


class KeepGathered:
    """A pool's reader that keeps the running caches gathered between steps, where that copy
    fits the pool's budget; otherwise it gathers them step by step."""

    copies = 2

    def __init__(self) -> None:
        self.kept: Gathered | None = None

    def batch(self, storage: torch.Tensor, caches: list[BlockTable], budget: int) -> PagedBatch:
        if self.kept is None or not self.kept.serves(caches):
            self.kept = None  # the old copy goes first: two at once would be the peak
            if Gathered.nbytes_for(caches, storage) <= budget:
                self.kept = Gathered(storage, caches)
        if self.kept is None:
            return PagedBatch(storage, caches)
        return KeptBatch(storage, caches, self.kept)

    def forget(self) -> None:
        self.kept = None
