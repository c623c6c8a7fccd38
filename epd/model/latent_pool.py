"""The running sequences' latent caches in fixed-size blocks of one storage, under a budget.

`storage` is (layers, blocks, BLOCK_TOKENS, latent_dim), its blocks handed out by a
`BlockManager` (the same bookkeeping as prefill's prefix cache). A sequence that joins the running
batch copies its cache into free blocks; its `PagedCache` lists them (its block table), so its row t
is `storage[:, blocks[t // BLOCK_TOKENS], t % BLOCK_TOKENS]`. The pool holds at most
`max_tokens` rows, so memory is the sum of the running caches' lengths, rounded up to blocks,
and bounded: a sequence joins only when blocks for it are free (`can_admit`), and one that must
grow when none is free makes the scheduler send another back to wait (`evict`).

A step's attention reads the blocks through the model's `BlockReader` (`epd/model/paged.py`):
the pool is the same on every device; what a CPU keeps beside it lives with its reader.

Block 0 is never handed out: it stays zeros and pads the tables of shorter caches. Freed blocks
are zeroed too. Rows past a cache's length are read, masked, by every step, and a masked NaN
left by an earlier owner would still poison the weighted sums (0 × NaN).
"""

from __future__ import annotations

import torch

from epd.model.block_manager import BLOCK_TOKENS, BlockManager, PoolFull, blocks_for
from epd.model.latent_cache import LatentCache
from epd.model.paged import BlockReader, GatherEachStep, PagedBatch


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


class LatentPool:
    def __init__(
        self,
        layers: int,
        latent_dim: int,
        device: torch.device,
        dtype: torch.dtype,
        max_tokens: int,
        preallocate: bool = False,
        reader: BlockReader | None = None,
    ) -> None:
        """`preallocate`: take the whole budget now and keep it (on a GPU: growing by doubling
        would need 1.5× the budget at once, and other allocations could take the memory);
        otherwise grow by doubling and give the memory back whenever the pool empties.
        `reader`: how steps read the blocks (the model's `block_reader`; by default gathered
        every step)."""
        self.max_blocks = 1 + blocks_for(max_tokens)  # + the zero block
        self.preallocated = preallocate
        blocks = self.max_blocks if preallocate else 1
        self.storage = torch.zeros(
            layers, blocks, BLOCK_TOKENS, latent_dim, device=device, dtype=dtype
        )
        self.blocks = BlockManager(blocks)  # which blocks of the storage are free or held
        self.caches: set[PagedCache] = set()
        self.reader = reader or GatherEachStep()

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
            self.reader.forget()
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
        self.reader.forget()
        if self.preallocated:
            self.storage.zero_()
            self.blocks.reset()
        else:
            self.storage = self.storage[:, :1].clone()
            self.blocks = BlockManager(1)

    def batch(self, caches: list[PagedCache]) -> PagedBatch:
        """A decode step over these caches, in this order; each must have room (`make_room`)."""
        return self.reader.batch(self.storage, caches, self.max_bytes)

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
