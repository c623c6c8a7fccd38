"""KV memory in fixed-size blocks of one storage, under a budget: the one home of KV in a role.

`storage` is (layers, blocks, BLOCK_TOKENS, latent_dim): MLA's latent row per token and layer
(576 values at Kimi-VL's widths). Its blocks are handed out by a `BlockManager`. A request's
KV is a `BlockTable`, the list of its blocks, so its row t is
`storage[:, blocks[t // BLOCK_TOKENS], t % BLOCK_TOKENS]`; memory is the sum of the requests'
lengths, rounded up to blocks. A full block that a request publishes (`publish`) is kept, once
nobody holds it, for the next request whose prompt begins the same way (`match`: a prefix
shares the blocks, it copies nothing), least recently used out first, and only in free space:
an allocation takes a cached block as soon as no free one is left.

Prefill's forward writes its rows here, decode's steps read and append here; attention reads
the blocks through the model's seam (`epd/model/paged.py`), the same pool on every device.

Blocks are zeroed as they are handed out (not as they are freed: a cached block keeps its rows).
Rows past a request's length are read, masked, by every decode step, and a masked NaN left by
an earlier owner would still poison the weighted sums (0 × NaN).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from epd.kv.blocks import BlockManager, PoolFull
from epd.kv.events import KVEvents
from epd.kv.hashing import BLOCK_TOKENS, blocks_for

__all__ = ["BlockPool", "BlockTable", "PoolFull"]


class BlockTable:
    """A request's KV in a pool's blocks (its table), `length` rows filled."""

    def __init__(self, pool: BlockPool, blocks: list[int], length: int) -> None:
        self.pool, self.blocks, self.length = pool, blocks, length
        self.published = 0  # leading full blocks published (or matched) already

    def rows(self, start: int = 0) -> torch.Tensor:
        """Rows [start, length), (layers, length - start, latent_dim): a copy out of the blocks."""
        first = start // BLOCK_TOKENS
        picked = self.pool.storage[:, self.blocks[first : blocks_for(self.length)]]
        return picked.flatten(1, 2)[
            :, start - first * BLOCK_TOKENS : self.length - first * BLOCK_TOKENS
        ]

    def layer(self, index: int) -> torch.Tensor:
        """One layer's rows, (length, latent_dim): what a chunk of prefill attends to after."""
        used = torch.tensor(
            self.blocks[: blocks_for(self.length)],
            dtype=torch.int64,
            device=self.pool.storage.device,
        )
        return self.pool.storage[index].index_select(0, used).flatten(0, 1)[: self.length]

    def reserve(self, tokens: int) -> None:
        """Blocks are the pool's to hand out (`BlockPool.make_room`); here only checked: a row
        past the blocks would be written into the zero block, which pads every table."""
        if blocks_for(self.length + tokens) > len(self.blocks):
            raise RuntimeError(f"no room was made in the pool for {tokens} more rows")


class BlockPool:
    def __init__(
        self,
        layers: int,
        latent_dim: int,
        device: torch.device,
        dtype: torch.dtype,
        max_tokens: int,
        preallocate: bool = False,
        events: KVEvents | None = None,
        max_cached_tokens: int | None = None,
    ) -> None:
        """`preallocate`: take the whole budget now and keep it (on a GPU: growing by doubling
        would need 1.5× the budget at once, and other allocations could take the memory);
        otherwise grow by doubling and give the memory back whenever nothing is held or cached.
        `max_cached_tokens`: rows kept cached for later requests, at most (None: any, in free
        space; 0: none, nothing is ever published)."""
        self.max_blocks = 1 + blocks_for(max_tokens)  # + the zero block
        self.preallocated = preallocate
        blocks = self.max_blocks if preallocate else 1
        self.storage = torch.zeros(
            layers, blocks, BLOCK_TOKENS, latent_dim, device=device, dtype=dtype
        )
        cached = None if max_cached_tokens is None else max_cached_tokens // BLOCK_TOKENS
        self.caching = cached != 0
        self.blocks = BlockManager(blocks, events, cached)  # which blocks are free, held, cached
        self.tables: set[BlockTable] = set()

    def __len__(self) -> int:
        return len(self.tables)

    @property
    def max_tokens(self) -> int:
        return (self.max_blocks - 1) * BLOCK_TOKENS

    @property
    def bytes_per_block(self) -> int:
        return self.storage[:, :1].nbytes

    @property
    def max_bytes(self) -> int:
        """The storage's bytes at the budget."""
        return self.bytes_per_block * self.max_blocks

    @property
    def free_blocks(self) -> int:
        """Blocks a request may still take: free or cached in storage, or not allocated yet."""
        return self.blocks.available + self.max_blocks - self.storage.shape[1]

    @property
    def unused_blocks(self) -> int:
        """Blocks nobody holds nor caches: free in storage, or not allocated yet (taking them
        evicts nothing)."""
        return len(self.blocks.free) + self.max_blocks - self.storage.shape[1]

    @property
    def used_blocks(self) -> int:
        """Blocks some request holds (cached ones held by none are free space)."""
        return self.max_blocks - 1 - self.free_blocks

    def can_admit(self, length: int, shared: int = 0, running: int = 0) -> bool:
        """Whether a request of `length` rows, `shared` of them in blocks it holds already, and
        its next step's row fit in the free blocks, with a block to spare for each of `running`
        requests' next step (so a join does not at once send another back to wait)."""
        needed = blocks_for(length + 1) - shared // BLOCK_TOKENS
        return needed + running <= self.free_blocks

    def flush_events(self) -> None:
        """Publish what was cached and evicted since the last flush, as one batch of KV events
        (a role calls it once a step)."""
        self.blocks.events.flush()

    @torch.inference_mode()
    def match(self, hashes: Sequence[bytes]) -> BlockTable:
        """A table of the cached blocks of the longest prefix of `hashes`, held (maybe empty)."""
        found = self.blocks.match(hashes) if self.caching else []
        table = BlockTable(self, found, len(found) * BLOCK_TOKENS)
        table.published = len(found)
        self.tables.add(table)
        return table

    def share(self, table: BlockTable) -> BlockTable:
        """Another table of the same full blocks, each held once more (n choices of a prompt)."""
        assert table.length % BLOCK_TOKENS == 0, "only whole blocks are shared"
        self.blocks.hold(table.blocks)
        shared = BlockTable(self, list(table.blocks), table.length)
        shared.published = table.published
        self.tables.add(shared)
        return shared

    def table(self) -> BlockTable:
        """An empty table, to write rows into."""
        table = BlockTable(self, [], 0)
        self.tables.add(table)
        return table

    @torch.inference_mode()
    def write(self, table: BlockTable, rows: torch.Tensor) -> None:
        """Append rows (layers, n, latent_dim), on any device, to a table: into the free rows of
        its last block, then into blocks taken for it. Raises PoolFull."""
        start, total = table.length, table.length + rows.shape[1]
        if total == start:
            return
        if blocks_for(total) > len(table.blocks):
            table.blocks += self.take(blocks_for(total) - len(table.blocks))
        positions = torch.arange(start, total)
        blocks = torch.tensor(table.blocks, dtype=torch.int64)[positions // BLOCK_TOKENS]
        where = (blocks.to(self.storage.device), (positions % BLOCK_TOKENS).to(self.storage.device))
        self.storage[:, where[0], where[1]] = rows.to(self.storage)  # (layers, n, latent_dim)
        table.length = total

    def make_room(self, table: BlockTable, rows: int = 1) -> None:
        """Blocks for the table's next `rows` rows, where its own are full. Raises PoolFull."""
        if (needed := blocks_for(table.length + rows) - len(table.blocks)) > 0:
            table.blocks += self.take(needed)

    @torch.inference_mode()
    def truncate(self, table: BlockTable, length: int) -> None:
        """Roll a table back to its first `length` rows (speculative decoding's refused drafts):
        the rows after them zeroed in the block they share, the blocks past it let go. Only a
        reply's own rows go: they are never published, so no other table holds their blocks."""
        assert table.published * BLOCK_TOKENS <= length <= table.length, "rows to roll back"
        keep = blocks_for(length)
        if length % BLOCK_TOKENS:
            self.storage[:, table.blocks[keep - 1], length % BLOCK_TOKENS :] = 0
        self.blocks.release(table.blocks[keep:])
        del table.blocks[keep:]
        table.length = length

    def publish(self, table: BlockTable, hashes: Sequence[bytes], token_ids: Sequence[int]) -> None:
        """Make the table's full blocks with these hashes (its first len(hashes), all filled)
        matchable by later requests, with their tokens (for the KV events)."""
        if not self.caching:
            return
        count = min(len(hashes), table.length // BLOCK_TOKENS)
        for index in range(table.published, count):
            parent = hashes[index - 1] if index else None
            tokens = token_ids[index * BLOCK_TOKENS : (index + 1) * BLOCK_TOKENS]
            self.blocks.publish(table.blocks[index], hashes[index], parent, tokens)
        table.published = max(table.published, count)

    @torch.inference_mode()  # the storage is an inference tensor: release runs outside a step
    def release(self, table: BlockTable) -> None:
        """Let go of a table's blocks: published ones stay cached, the others are free."""
        if table not in self.tables:
            return
        self.tables.discard(table)
        self.blocks.release(table.blocks)
        table.blocks = []
        if not self.tables and not self.blocks.cached and not self.preallocated:
            self.storage = self.storage[:, :1].clone()  # the memory goes back
            self.blocks.reset(1)

    def evict(self, table: BlockTable) -> torch.Tensor:
        """A table's rows moved into host memory, (layers, length, latent); its blocks let go."""
        kept = table.rows().cpu()
        self.release(table)
        return kept

    @torch.inference_mode()
    def drop_cached(self) -> int:
        """Forget every cached block nobody holds, and give back the storage past the last held
        block where it grows (the memory goes to requests); the bytes given back."""
        self.blocks.drop_cached()
        if self.preallocated:
            return 0
        keep = 1 + max(self.blocks.refs, default=0)
        freed = (self.storage.shape[1] - keep) * self.bytes_per_block
        self.storage = self.storage[:, :keep].clone()
        self.blocks.shrink(keep)
        return freed

    @torch.inference_mode()
    def clear(self) -> None:
        """Forget every table and cached block and start afresh: after a failed step nothing it
        held may be trusted. Preallocated storage is kept, zeroed; otherwise the memory goes
        back."""
        for table in self.tables:
            table.blocks = []
        self.tables.clear()
        if self.preallocated:
            self.storage.zero_()
            self.blocks.reset()
        else:
            self.storage = self.storage[:, :1].clone()
            self.blocks.reset(1)

    @torch.inference_mode()
    def take(self, count: int) -> list[int]:
        """`count` blocks, zeroed: free ones, growing the storage (doubling, up to the budget)
        before cached ones are evicted."""
        if count > self.free_blocks:
            raise PoolFull(
                f"{count} blocks of {BLOCK_TOKENS} rows asked for, {self.free_blocks} free "
                f"of {self.max_blocks - 1}"
            )
        have = self.storage.shape[1]
        if count > len(self.blocks.free) and have < self.max_blocks:  # before evicting cached
            self.grow(min(max(2 * have, have + count - len(self.blocks.free)), self.max_blocks))
        taken = self.blocks.allocate(count)
        self.storage[:, taken] = 0
        return taken

    @torch.inference_mode()
    def grow(self, blocks: int) -> None:
        """Move the storage into a larger one of `blocks` blocks; the new ones are free."""
        have = self.storage.shape[1]
        storage = self.storage.new_empty(self.storage.shape[0], blocks, *self.storage.shape[2:])
        storage[:, :have] = self.storage
        storage[:, have:] = 0
        self.storage = storage
        self.blocks.grow(blocks)
