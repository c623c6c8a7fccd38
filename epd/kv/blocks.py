"""Which blocks of a KV storage hold what: the bookkeeping of every role's KV memory.

A storage of `blocks` blocks of BLOCK_TOKENS rows each (`BlockPool`'s) is handed out by a
`BlockManager`: a free list, a reference count per block, and, for a full block whose rows may
serve another request, its content hash (`hashing.block_hashes`). A block whose count falls to
0 goes back to the free list, unless it has a hash: then it stays cached, its rows intact, until
a new allocation needs it (least recently used first), or while it is over `max_cached`. A
request finds the cached blocks of its longest cached prefix (`match`) by their hashes, and
shares them: each holder counts once.

Every change to what is cached is told to `events` (vLLM's KV events: stored, removed,
cleared), so that a router or a peer can know what this process holds without asking.

Block 0 is never handed out: the storage keeps it as zeros to pad shorter caches' tables.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from epd.kv.events import KVEvents, NoEvents
from epd.kv.hashing import BLOCK_TOKENS


class PoolFull(RuntimeError):
    """Not enough free blocks under the pool's budget."""


class BlockManager:
    """Blocks 1 … `blocks` - 1 of a storage: free, held (counted), or cached (hashed, held by
    nobody, evicted least recently used first when the free ones run out)."""

    def __init__(
        self, blocks: int, events: KVEvents | None = None, max_cached: int | None = None
    ) -> None:
        self.blocks = blocks
        self.events: KVEvents = events if events is not None else NoEvents()
        self.max_cached = max_cached  # cached blocks nobody holds, at most (None: any)
        self.free = list(range(blocks - 1, 0, -1))  # lowest last: handed out first
        self.refs: dict[int, int] = {}  # held blocks: how many hold each
        self.hash_of: dict[int, bytes] = {}  # full blocks whose rows may serve others
        self.by_hash: dict[bytes, int] = {}
        self.unused: OrderedDict[int, None] = OrderedDict()  # cached, held by none: LRU first

    @property
    def available(self) -> int:
        """Blocks an allocation may take: free, or cached and held by none."""
        return len(self.free) + len(self.unused)

    @property
    def held(self) -> int:
        return len(self.refs)

    @property
    def cached(self) -> int:
        return len(self.hash_of)

    def grow(self, blocks: int) -> None:
        """The storage now has `blocks` blocks: the new ones are free."""
        self.free = sorted([*self.free, *range(self.blocks, blocks)], reverse=True)
        self.blocks = blocks

    def allocate(self, count: int) -> list[int]:
        """`count` blocks, held once each: free ones first, then the least recently used cached
        ones, which lose their hash. Raises PoolFull."""
        if count > self.available:
            raise PoolFull(
                f"{count} blocks of {BLOCK_TOKENS} rows asked for, {self.available} free "
                f"of {self.blocks - 1}"
            )
        taken = self.free[-count:][::-1] if count else []
        del self.free[len(self.free) - len(taken) :]
        evicted = [
            self.uncache(self.unused.popitem(last=False)[0]) for _ in range(count - len(taken))
        ]
        if evicted:
            self.events.removed([content for _, content in evicted])
        taken += [block for block, _ in evicted]
        for block in taken:
            self.refs[block] = 1
        return taken

    def uncache(self, block: int) -> tuple[int, bytes]:
        """Forget a cached block's hash; the block and the hash it had."""
        content = self.hash_of.pop(block)
        del self.by_hash[content]
        return block, content

    def hold(self, blocks: Sequence[int]) -> None:
        """One more hold on each of these held blocks (a request sharing another's)."""
        for block in blocks:
            self.refs[block] += 1

    def release(self, blocks: Sequence[int]) -> list[int]:
        """Let go of one hold on each block; returns those that became free (not cached): their
        rows are no one's any more. Blocks released together go to the cache's least recently
        used end last first, so a prefix outlives its own later blocks."""
        freed = []
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block]:
                continue
            del self.refs[block]
            if block in self.hash_of:
                self.unused[block] = None  # the most recently used
            else:
                freed.append(block)
        freed += self.trim()
        self.free = sorted([*self.free, *freed], reverse=True)
        return freed

    def trim(self) -> list[int]:
        """Cached blocks past `max_cached`, least recently used first, made free."""
        over = 0 if self.max_cached is None else len(self.unused) - self.max_cached
        return self.evict(max(0, over))

    def evict(self, count: int) -> list[int]:
        """The `count` least recently used cached blocks nobody holds, their hashes forgotten."""
        evicted = [self.uncache(self.unused.popitem(last=False)[0]) for _ in range(count)]
        if evicted:
            self.events.removed([content for _, content in evicted])
        return [block for block, _ in evicted]

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes`, each now held once more."""
        found = []
        for content in hashes:
            if (block := self.by_hash.get(content)) is None:
                break
            found.append(block)
        for block in found:
            self.unused.pop(block, None)
            self.refs[block] = self.refs.get(block, 0) + 1
        return found

    def publish(
        self, block: int, content: bytes, parent: bytes | None, token_ids: Sequence[int]
    ) -> bool:
        """Record a held, full block's hash (its chain's `parent`, its tokens), so that later
        requests may match it; False (and nothing recorded) when another block already holds
        that content."""
        assert block in self.refs, "only a held block's rows are known"
        if content in self.by_hash or block in self.hash_of:
            return False
        self.hash_of[block], self.by_hash[content] = content, block
        self.events.stored([content], parent, list(token_ids), BLOCK_TOKENS)
        return True

    def drop_cached(self) -> list[int]:
        """Every cached block nobody holds made free (memory for requests comes first)."""
        dropped = self.evict(len(self.unused))
        self.free = sorted([*self.free, *dropped], reverse=True)
        return dropped

    def shrink(self, blocks: int) -> None:
        """The storage now has only its first `blocks` blocks: none past them may be held or
        cached (`drop_cached` first)."""
        assert all(b < blocks for b in [*self.refs, *self.hash_of]), "a block past the end is used"
        self.free = [b for b in self.free if b < blocks]
        self.blocks = blocks

    def reset(self, blocks: int | None = None) -> None:
        """Forget everything: every block free (of a storage of `blocks` now, if given)."""
        if self.hash_of:
            self.events.cleared()
        self.blocks = self.blocks if blocks is None else blocks
        self.free = list(range(self.blocks - 1, 0, -1))
        self.refs.clear()
        self.hash_of.clear()
        self.by_hash.clear()
        self.unused.clear()
