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

from typing import NamedTuple, Protocol

import torch

from epd.kv.hashing import BLOCK_TOKENS, blocks_for
from epd.kv.pool import BlockTable


class Part(NamedTuple):
    """Some of a decode step's requests, for one attention call."""

    rows: torch.Tensor | None  # (n,) which rows of the batch; None: all of them, in order
    cache: torch.Tensor  # (n, T, latent_dim): their caches padded to the longest of them
    visible: torch.Tensor  # (n, T): the real rows


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
    """A decode step over pooled caches: each writes its row into its own block, and the step
    attends over their blocks gathered by table, in parts of similar lengths (`by_length`), so
    that one long cache does not pad every short one to its length. Layers call
    `append_and_gather` with the step's latent rows; `advance` ends the step."""

    def __init__(self, storage: torch.Tensor, caches: list[BlockTable]) -> None:
        for cache in caches:
            cache.reserve(1)
        self.storage, self.paged = storage, caches
        # (B,) the positions of the tokens decoded, after each cache's rows
        self.positions = torch.tensor([c.length for c in caches], device=storage.device)
        self.block = torch.tensor(
            [c.blocks[c.length // BLOCK_TOKENS] for c in caches], device=storage.device
        )
        self.offset = self.positions % BLOCK_TOKENS  # (B,) where each writes its row
        self.tables = self.make_tables()

    def make_tables(self) -> list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]]:
        return [self.table(part) for part in by_length([c.length + 1 for c in self.paged])]

    def table(self, part: list[int]) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Of some of the caches (by position in the batch): the rows (None: all, in order),
        their blocks, padded with the zero block, flat (n · width,), and their visible rows."""
        device, caches = self.storage.device, [self.paged[i] for i in part]
        lengths = torch.tensor([c.length + 1 for c in caches])
        width = blocks_for(int(lengths.max()))
        # Whole blocks, the rows past each length masked: attention's products then meet a new
        # length once every BLOCK_TOKENS steps, not every step (oneDNN, which runs bfloat16
        # ones on a CPU, builds a kernel for each shape it meets).
        visible = (torch.arange(width * BLOCK_TOKENS)[None, :] < lengths[:, None]).to(device)
        rows = None if len(part) == len(self.paged) else torch.tensor(part, device=device)
        return rows, table_of(caches, width, device), visible

    def append_and_gather(self, layer: int, latent: torch.Tensor) -> list[Part]:
        """latent (B, latent_dim) → the caches including it, in parts, copies."""
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
        for cache in self.paged:
            cache.length += 1


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

    def batch(self, storage: torch.Tensor, caches: list[BlockTable], budget: int) -> PagedBatch:
        """A step over these caches, in this order; what it keeps takes at most `budget` bytes."""
        ...

    def forget(self) -> None:
        """The pool emptied or was cleared: nothing kept may stay."""
        ...


class GatherEachStep:
    """Every step gathers the blocks it attends over, anew (no paged attention kernel here)."""

    copies = 1

    def batch(self, storage: torch.Tensor, caches: list[BlockTable], budget: int) -> PagedBatch:
        return PagedBatch(storage, caches)

    def forget(self) -> None:
        pass
