"""Automatic prefix caching: prompt KV kept after its request, so the next prompt that starts
the same way (the next turn of a conversation, a shared system prompt, the same image) prefills
only what follows.

A prompt's full blocks are stored, after its prefill, in blocks of the cache's own storage
(layers, blocks, BLOCK_TOKENS, latent_dim), keyed by their chained content hash
(`block_hashes`: the request's `cache_salt`, token ids, and the digest of each image whose
rows a block holds), so prompts of different salts (tenants) never share rows. A new prompt
takes a copy of the rows of its longest cached prefix of whole blocks, leaving at least
its last token to compute (its logits give the first token), and its prefill starts there, as
a chunk continues the chunks before it. Blocks nobody holds are evicted least recently used
first, the last blocks of a prompt before its first (a prefix is found from its start), within
`max_bytes`. The storage grows by doubling up to that budget, so an idle cache costs nothing;
a forward that runs out of memory empties it (`clear`) and runs again: requests come first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from epd.model.block_manager import BLOCK_TOKENS, BlockManager, ImageSpan, PoolFull, block_hashes
from epd.model.latent_cache import LatentCache


def image_spans(
    prompt_ids: Sequence[int], placeholder_id: int, tokens: Sequence[int], digests: Sequence[str]
) -> tuple[ImageSpan, ...] | None:
    """Each image's placeholder run in the prompt (images in order, `tokens` slots each), or
    None when the runs are not one after another as expected: such a prompt is not cached."""
    slots = [i for i, token in enumerate(prompt_ids) if token == placeholder_id]
    if len(slots) != sum(tokens) or len(tokens) != len(digests):
        return None
    spans, first = [], 0
    for count, digest in zip(tokens, digests, strict=True):
        start = slots[first] if count else 0
        if count and slots[first + count - 1] != start + count - 1:
            return None
        spans.append(ImageSpan(start, count, bytes.fromhex(digest)))
        first += count
    return tuple(spans)


class PrefixCache:
    def __init__(
        self, layers: int, latent_dim: int, dtype: torch.dtype, device: torch.device, max_bytes: int
    ) -> None:
        per_block = layers * BLOCK_TOKENS * latent_dim * dtype.itemsize
        self.max_blocks = 1 + max_bytes // per_block  # + the zero block
        self.storage = torch.zeros(layers, 1, BLOCK_TOKENS, latent_dim, dtype=dtype, device=device)
        self.blocks = BlockManager(1)
        self.queries = self.hits = 0  # prompt tokens looked up, and found

    def lookup(
        self, prompt_ids: Sequence[int], images: Sequence[ImageSpan], salt: str | None = None
    ) -> LatentCache | None:
        """A copy of the rows of the prompt's longest cached prefix of whole blocks, short of
        its last token, among those stored with the same salt; None on a miss."""
        self.queries += len(prompt_ids)
        hashes = block_hashes(prompt_ids[: len(prompt_ids) - 1], images, salt)
        found = self.blocks.match(hashes)
        if not found:
            return None
        self.hits += len(found) * BLOCK_TOKENS
        rows = self.storage[:, found].flatten(1, 2).clone()  # (layers, hit, latent_dim)
        self.blocks.release(found[::-1])  # the later blocks the less recently used
        return LatentCache.from_tensor(rows)

    @torch.inference_mode()
    def store(
        self,
        prompt_ids: Sequence[int],
        images: Sequence[ImageSpan],
        rows: torch.Tensor,
        salt: str | None = None,
    ) -> None:
        """Keep the full blocks of a prefilled prompt: rows (layers, ≥ len(prompt_ids), latent),
        for later prompts of the same salt."""
        hashes = block_hashes(prompt_ids, images, salt)
        held = self.blocks.match(hashes)  # those cached already
        for index in range(len(held), len(hashes)):
            try:
                (block,) = self.take()
            except PoolFull:  # every block is held (prompts being looked up): keep what fits
                break
            span = slice(index * BLOCK_TOKENS, (index + 1) * BLOCK_TOKENS)
            self.storage[:, block] = rows[:, span].to(self.storage)
            held.append(block)
            if not self.blocks.publish(block, hashes[index]):  # cached meanwhile elsewhere
                break
        self.blocks.release(held[::-1])

    def take(self) -> list[int]:
        """A block, growing the storage (doubling, up to the budget) before evicting."""
        if not self.blocks.free and self.storage.shape[1] < self.max_blocks:
            have = self.storage.shape[1]
            grown = self.storage.new_zeros(
                self.storage.shape[0], min(2 * have, self.max_blocks), *self.storage.shape[2:]
            )
            grown[:, :have] = self.storage
            self.storage = grown
            self.blocks.grow(grown.shape[1])
        return self.blocks.allocate(1)

    def clear(self) -> int:
        """Forget every cached block and give the storage's memory back (a forward that needs
        it comes first); the bytes freed. Only between lookups and stores: none is held."""
        freed = self.storage.nbytes - self.storage[:, :1].nbytes
        self.storage = self.storage[:, :1].clone()
        self.blocks = BlockManager(1)
        return freed

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes

    def status(self) -> dict[str, object]:
        rate = self.hits / self.queries if self.queries else 0.0
        return {
            "prefix_cache": {
                "cached_tokens": self.blocks.cached * BLOCK_TOKENS,
                "bytes": self.nbytes,
                "hit_rate": round(rate, 4),
            }
        }
