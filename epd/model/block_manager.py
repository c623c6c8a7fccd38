"""Which blocks of a latent KV storage hold what: the one bookkeeping for KV memory.

A storage of `blocks` blocks of BLOCK_TOKENS rows each (`LatentPool`'s, prefill's prefix
cache's) is handed out by a `BlockManager`: a free list, a reference count per block, and, for
a full block whose rows may serve another prompt, its content hash. A block whose count falls
to 0 goes back to the free list, unless it has a hash: then it stays cached, its rows intact,
until a new allocation needs it (least recently used first). A prompt finds the cached blocks
of its longest cached prefix (`match`) by hashes chained block by block over the prompt's
cache salt, the token ids before and in each block and the digest of every image whose tokens
it holds (`block_hashes`), so equal hashes mean equal rows: the same tokens at the same
positions, after the same past; and only prompts of one salt share rows.

Block 0 is never handed out: the storage keeps it as zeros to pad shorter caches' tables.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

BLOCK_TOKENS = 16  # rows per block: vLLM's default; smaller wastes less, larger gathers fewer


class PoolFull(RuntimeError):
    """Not enough free blocks under the pool's budget."""


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_TOKENS)


@dataclass(frozen=True)
class ImageSpan:
    """An image's tokens in a prompt: positions [start, start + length), and its file's digest."""

    start: int
    length: int
    digest: bytes


def salt_seed(salt: str | None) -> bytes:
    """What a prompt's first block hash starts from: nothing, or for a salted prompt (vLLM's
    `cache_salt`, one per tenant) a digest of its salt, so that every hash of its chain differs
    from an unsalted or differently salted prompt's. Tagged: an unsalted first block would need
    token ids spelling the tag (ids past any vocabulary) to hash like a salted one's seed."""
    if salt is None:
        return b""
    return hashlib.sha256(b"epd cache_salt\0" + salt.encode("utf-8", "surrogatepass")).digest()


def block_hashes(
    token_ids: Sequence[int], images: Sequence[ImageSpan] = (), salt: str | None = None
) -> list[bytes]:
    """The chained content hash of each full block of a prompt: block i's covers every token
    before it (through block i - 1's hash, block 0's through the salt), its own token ids, and
    which image rows it holds (each image overlapping it: its digest and the offset of its
    first row in the block)."""
    hashes: list[bytes] = []
    previous = salt_seed(salt)
    for block in range(len(token_ids) // BLOCK_TOKENS):
        start, stop = block * BLOCK_TOKENS, (block + 1) * BLOCK_TOKENS
        digest = hashlib.sha256(previous)
        digest.update(b"".join(t.to_bytes(4, "little") for t in token_ids[start:stop]))
        for image in images:
            if image.start < stop and image.start + image.length > start:
                offset = start - image.start  # negative when the image begins in this block
                digest.update(image.digest + offset.to_bytes(8, "little", signed=True))
        previous = digest.digest()
        hashes.append(previous)
    return hashes


class BlockManager:
    """Blocks 1 … `blocks` - 1 of a storage: free, held (counted), or cached (hashed, held by
    nobody, evicted least recently used first when the free ones run out)."""

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks
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
        while len(taken) < count:
            block, _ = self.unused.popitem(last=False)
            del self.by_hash[self.hash_of.pop(block)]
            taken.append(block)
        for block in taken:
            self.refs[block] = 1
        return taken

    def release(self, blocks: Sequence[int]) -> list[int]:
        """Let go of one hold on each block; returns those that became free (not cached): their
        rows are no one's any more."""
        freed = []
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block]:
                continue
            del self.refs[block]
            if block in self.hash_of:
                self.unused[block] = None  # the most recently used
            else:
                freed.append(block)
        self.free = sorted([*self.free, *freed], reverse=True)
        return freed

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

    def publish(self, block: int, content: bytes) -> bool:
        """Record a held, full block's hash, so that later prompts may match it; False (and
        nothing recorded) when another block already holds that content."""
        assert block in self.refs, "only a held block's rows are known"
        if content in self.by_hash or block in self.hash_of:
            return False
        self.hash_of[block], self.by_hash[content] = content, block
        return True

    def reset(self) -> None:
        """Forget everything: every block free."""
        self.free = list(range(self.blocks - 1, 0, -1))
        self.refs.clear()
        self.hash_of.clear()
        self.by_hash.clear()
        self.unused.clear()
