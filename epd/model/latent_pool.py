"""The running sequences' latent caches in fixed-size blocks of one storage, under a budget.

`storage` is (layers, blocks, BLOCK_TOKENS, latent_dim), its blocks handed out by a
`BlockManager` (the same bookkeeping as prefill's prefix cache). A sequence that joins the running
batch copies its cache into free blocks; its `PagedCache` lists them (its block table), so its row t
is `storage[:, blocks[t // BLOCK_TOKENS], t % BLOCK_TOKENS]`. The pool holds at most
`max_tokens` rows, so memory is the sum of the running caches' lengths, rounded up to blocks,
and bounded: a sequence joins only when blocks for it are free (`can_admit`), and one that must
grow when none is free makes the scheduler send another back to wait (`evict`).

A step attends over the running caches' blocks gathered into padded (n, T, latent_dim) tensors,
in parts of similar lengths (none padded past twice its own), so that one long cache does not
make every short one's gathered rows and attention as long as itself. A paged attention kernel
would read the blocks in place; torch has none on a CPU, where gathering every layer's blocks
anew took 9-21% of a step of 16-64 requests over 1000-token caches (docs/benchmarks.md). So a pool
that `keeps_gathered` (decode's on a CPU) keeps the gathered copy between steps (`Gathered`):
each step writes its rows into the blocks and into the copy, and the copy is made again only
when the batch changes (a sequence joins, leaves or is sent back) or its longest cache
outgrows the copy's HEADROOM_BLOCKS. The copy takes at most as much memory as the budget.

Block 0 is never handed out: it stays zeros and pads the tables of shorter caches. Freed blocks
are zeroed too. Rows past a cache's length are read, masked, by every step, and a masked NaN
left by an earlier owner would still poison the weighted sums (0 × NaN).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from epd.model.block_manager import BLOCK_TOKENS, BlockManager, PoolFull, blocks_for
from epd.model.latent_cache import DecodeBatch, LatentCache, Part

# Blocks a kept copy has past each part's longest cache: it is gathered again at most every
# HEADROOM_BLOCKS · BLOCK_TOKENS steps as caches grow, and attention reads as many more rows
# (masked) until then.
HEADROOM_BLOCKS = 2


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


class PagedCache:
    """A running sequence's cache in a pool's blocks (its table), `length` rows long."""

    def __init__(self, pool: LatentPool, blocks: list[int], length: int) -> None:
        self.pool, self.blocks, self.length = pool, blocks, length

    def tensor(self) -> torch.Tensor:
        """The filled part, (layers, length, latent_dim): a copy out of the blocks."""
        return self.pool.storage[:, self.blocks].flatten(1, 2)[:, : self.length]

    def reserve(self, tokens: int) -> None:
        """Blocks are the pool's to hand out (`LatentPool.make_room`); here only checked: a
        row past the blocks would be written into the zero block, which pads every table."""
        if blocks_for(self.length + tokens) > len(self.blocks):
            raise RuntimeError(f"no room was made in the pool for {tokens} more rows")


class PagedBatch(DecodeBatch):
    """A decode step over pooled caches: each writes its row into its own block, and the step
    attends over their blocks gathered by table, in parts of similar lengths (`by_length`), so
    that one long cache does not pad every short one to its length; or, given a `Gathered`
    copy of them kept from the steps before, over that copy, which takes the rows too."""

    def __init__(
        self, storage: torch.Tensor, caches: list[PagedCache], kept: Gathered | None = None
    ) -> None:
        for cache in caches:
            cache.reserve(1)
        self.storage, self.paged, self.kept = storage, caches, kept
        self.index([c.length for c in caches], storage.device)
        device = storage.device
        self.block = torch.tensor(
            [c.blocks[c.length // BLOCK_TOKENS] for c in caches], device=device
        )
        self.offset = self.positions % BLOCK_TOKENS  # (B,) where each writes its row
        if kept is None:
            self.tables = [self.table(part) for part in by_length([c.length + 1 for c in caches])]
        else:
            self.step = kept.begin(self.positions)

    def table(self, part: list[int]) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Of some of the caches (by position in the batch): the rows (None: all, in order),
        their blocks, padded with the zero block, flat (n · width,), and their visible rows."""
        device, caches = self.storage.device, [self.paged[i] for i in part]
        lengths = torch.tensor([c.length + 1 for c in caches])
        width = blocks_for(int(lengths.max()))
        # Whole blocks, the rows past each length masked: attention's products then meet a new
        # length once every BLOCK_TOKENS steps, not every step (oneDNN, which runs bfloat16
        # ones on a CPU, builds a kernel for each shape it meets: docs/benchmarks.md).
        visible = (torch.arange(width * BLOCK_TOKENS)[None, :] < lengths[:, None]).to(device)
        rows = None if len(part) == len(self.paged) else torch.tensor(part, device=device)
        return rows, table_of(caches, width, device), visible

    def append_and_gather(self, layer: int, latent: torch.Tensor) -> list[Part]:
        """latent (B, latent_dim) → the caches including it, in parts, copies."""
        blocks = self.storage[layer]  # (blocks, BLOCK_TOKENS, latent_dim)
        blocks[self.block, self.offset] = latent
        if self.kept is not None:
            return self.kept.append(self.step, layer, latent)
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
        if self.kept is not None:
            self.kept.advance()


def table_of(caches: list[PagedCache], width: int, device: torch.device) -> torch.Tensor:
    """The caches' first `width` blocks each, padded with the zero block, flat (n · width,)."""
    blocks = [b for c in caches for b in (c.blocks + [0] * width)[:width]]
    return torch.tensor(blocks, device=device)


def padded_parts(lengths: list[int], room: int = 0) -> list[tuple[list[int], int]]:
    """`by_length`'s parts of caches of these lengths, each with its width in blocks: its
    longest cache's, and `room` more."""
    return [(part, blocks_for(max(lengths[i] for i in part)) + room) for part in by_length(lengths)]


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

    def __init__(self, storage: torch.Tensor, caches: list[PagedCache]) -> None:
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
    def nbytes_for(caches: list[PagedCache], storage: torch.Tensor) -> int:
        """What a copy of these caches would take (each part padded as `by_length` pads it)."""
        per_row = storage.shape[0] * storage.shape[-1] * storage.element_size()
        parts = padded_parts([c.length + 1 for c in caches], HEADROOM_BLOCKS)
        return sum(len(part) * width for part, width in parts) * BLOCK_TOKENS * per_row

    def serves(self, caches: list[PagedCache]) -> bool:
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


class LatentPool:
    def __init__(
        self,
        layers: int,
        latent_dim: int,
        device: torch.device,
        dtype: torch.dtype,
        max_tokens: int,
        preallocate: bool = False,
        keeps_gathered: bool = False,
    ) -> None:
        """`preallocate`: take the whole budget now and keep it (on a GPU: growing by doubling
        would need 1.5× the budget at once, and other allocations could take the memory);
        otherwise grow by doubling and give the memory back whenever the pool empties.
        `keeps_gathered`: keep the running caches gathered between steps, where that copy
        takes no more memory than the storage at the budget (`Gathered`)."""
        self.max_blocks = 1 + blocks_for(max_tokens)  # + the zero block
        self.preallocated = preallocate
        blocks = self.max_blocks if preallocate else 1
        self.storage = torch.zeros(
            layers, blocks, BLOCK_TOKENS, latent_dim, device=device, dtype=dtype
        )
        self.blocks = BlockManager(blocks)  # which blocks of the storage are free or held
        self.caches: set[PagedCache] = set()
        self.keeps_gathered = keeps_gathered
        self.kept: Gathered | None = None

    def __len__(self) -> int:
        return len(self.caches)

    @property
    def max_tokens(self) -> int:
        return (self.max_blocks - 1) * BLOCK_TOKENS

    @property
    def max_bytes(self) -> int:
        """The storage's bytes at the budget."""
        return self.storage[:, :1].nbytes * self.max_blocks

    @property
    def free_blocks(self) -> int:
        """Blocks a cache may still take: free in storage, or not allocated yet."""
        return self.blocks.available + self.max_blocks - self.storage.shape[1]

    @property
    def used_blocks(self) -> int:
        return self.max_blocks - 1 - self.free_blocks

    def can_admit(self, length: int) -> bool:
        """Whether a cache of `length` rows, and its next step's, fits in the free blocks, with
        a block to spare for each running cache's next step (so a join does not at once send
        another back to wait)."""
        return blocks_for(length + 1) + len(self.caches) <= self.free_blocks

    @torch.inference_mode()
    def admit(self, cache: LatentCache | PagedCache) -> PagedCache:
        """Copy a cache (on any device) into free blocks, with room for a step's row.

        Raises PoolFull when the blocks are not free, or e.g. out of memory while growing.
        """
        blocks = self.take(blocks_for(cache.length + 1))
        try:
            rows = cache.tensor()
            used = blocks[: blocks_for(cache.length)]
            padded = rows.new_zeros(rows.shape[0], len(used) * BLOCK_TOKENS, rows.shape[2])
            padded[:, : cache.length] = rows
            self.storage[:, used] = padded.unflatten(1, (len(used), BLOCK_TOKENS)).to(self.storage)
        except BaseException:  # e.g. out of memory copying it in: the blocks are still free
            self.give_back(blocks)
            raise
        paged = PagedCache(self, blocks, cache.length)
        self.caches.add(paged)
        return paged

    def make_room(self, cache: PagedCache) -> None:
        """A block for the cache's next row, if its blocks are full. Raises PoolFull."""
        if blocks_for(cache.length + 1) > len(cache.blocks):
            cache.blocks += self.take(1)

    @torch.inference_mode()  # the storage is an inference tensor: abort runs outside a step
    def release(self, cache: PagedCache) -> None:
        """Give a cache's blocks back, zeroed (see the module's note on NaN)."""
        self.caches.discard(cache)
        self.give_back(cache.blocks)
        cache.blocks = []
        if not self.caches:
            self.kept = None
            if not self.preallocated:  # the memory goes back
                self.clear()

    def give_back(self, blocks: list[int]) -> None:
        """Blocks no cache holds any more: zeroed, and free."""
        self.storage[:, blocks] = 0
        self.blocks.release(blocks)

    def evict(self, cache: PagedCache) -> LatentCache:
        """Move a cache out of the pool, into host memory, freeing its blocks."""
        kept = LatentCache.from_tensor(cache.tensor().cpu())
        self.release(cache)
        return kept

    @torch.inference_mode()
    def clear(self) -> None:
        """Forget every cache and start afresh: after a failed step nothing it held may be
        trusted. Preallocated storage is kept, zeroed; otherwise the memory goes back."""
        for cache in self.caches:
            cache.blocks = []
        self.caches.clear()
        self.kept = None
        if self.preallocated:
            self.storage.zero_()
            self.blocks.reset()
        else:
            self.storage = self.storage[:, :1].clone()
            self.blocks = BlockManager(1)

    def batch(self, caches: list[PagedCache]) -> PagedBatch:
        """A decode step over these caches, in this order; each must have room (`make_room`)."""
        if not self.keeps_gathered:
            return PagedBatch(self.storage, caches)
        if self.kept is None or not self.kept.serves(caches):
            self.kept = None  # the old copy goes first: two at once would be the peak
            if Gathered.nbytes_for(caches, self.storage) <= self.max_bytes:
                self.kept = Gathered(self.storage, caches)
        return PagedBatch(self.storage, caches, self.kept)

    @torch.inference_mode()
    def take(self, count: int) -> list[int]:
        """`count` free blocks, growing the storage (doubling, up to the budget) if needed."""
        if count > self.free_blocks:
            raise PoolFull(
                f"{count} blocks of {BLOCK_TOKENS} rows asked for, {self.free_blocks} free "
                f"of {self.max_blocks - 1}"
            )
        if count > self.blocks.available:
            have = self.storage.shape[1]
            self.grow(min(max(2 * have, have + count - self.blocks.available), self.max_blocks))
        return self.blocks.allocate(count)

    @torch.inference_mode()
    def grow(self, blocks: int) -> None:
        """Move the storage into a larger one of `blocks` blocks; the new ones are free."""
        have = self.storage.shape[1]
        storage = self.storage.new_empty(self.storage.shape[0], blocks, *self.storage.shape[2:])
        storage[:, :have] = self.storage
        storage[:, have:] = 0
        self.storage = storage
        self.blocks.grow(blocks)
