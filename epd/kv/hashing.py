"""What a block of KV rows holds, named by a hash of everything that determines its rows.

Block i of a prompt holds the latent KV of tokens [16i, 16i + 16). Those rows depend on the
model that computed them (its checkpoint, and the dtype it ran in), on every token before and in
the block, on the images whose rows fill their placeholders, and nothing else. So a block's hash
chains over all of it: block 0's starts from a seed of the model and the request's cache salt
(vLLM's `cache_salt`, one per tenant), block i's from block i - 1's hash, then its own token
ids and, for each image it holds rows of, the image file's digest and the offset of its first
row. Equal hashes mean equal rows: one process may share them between prompts, and two
processes may tell each other which blocks they hold by hash alone (prefill and decode do).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

BLOCK_TOKENS = 16  # rows per block: vLLM's default; smaller wastes less, larger gathers fewer
HASH_BYTES = 32  # a block's hash: SHA-256


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_TOKENS)


@dataclass(frozen=True)
class ImageSpan:
    """An image's tokens in a prompt: positions [start, start + length), and its file's digest."""

    start: int
    length: int
    digest: bytes


def image_spans(
    prompt_ids: Sequence[int], placeholder_id: int, tokens: Sequence[int], digests: Sequence[str]
) -> tuple[ImageSpan, ...] | None:
    """Each image's placeholder run in the prompt (images in order, `tokens` slots each), or
    None when the runs are not one after another as expected: such a prompt's blocks cannot be
    named, and are never shared."""
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


def image_digests(images: Sequence[bytes], salt: str | None = None) -> list[str]:
    """Each image's key: the SHA-256 of its file, or for a salted request, of a digest of the
    salt and then the file (a fixed-length seed, so no salt and file run into another's)."""
    if salt is None:
        return [hashlib.sha256(data).hexdigest() for data in images]
    seed = hashlib.sha256(b"epd image salt\0" + salt.encode("utf-8", "surrogatepass")).digest()
    keys = []
    for data in images:
        digest = hashlib.sha256(seed)
        digest.update(data)
        keys.append(digest.hexdigest())
    return keys


def model_key(checkpoint: bytes, dtype: str) -> bytes:
    """What a model's rows depend on beyond its inputs: its checkpoint's digest
    (`checkpoint/identity.py`) and the dtype its forward ran in."""
    return hashlib.sha256(b"epd kv model\0" + checkpoint + b"\0" + dtype.encode()).digest()


def salt_digest(salt: str | None) -> bytes:
    """A request's cache salt as it travels between roles: empty when unsalted, else a digest
    (the salt itself, a tenant's secret, never leaves the API)."""
    if salt is None:
        return b""
    return hashlib.sha256(b"epd cache_salt\0" + salt.encode("utf-8", "surrogatepass")).digest()


def chain_seed(model: bytes, salt: bytes = b"") -> bytes:
    """What block 0's hash starts from: the model key and the salt's digest (empty: unsalted),
    each after its length, so that no two pairs spell the same bytes."""
    parts = (len(model).to_bytes(2, "little"), model, len(salt).to_bytes(2, "little"), salt)
    return hashlib.sha256(b"epd chain\0" + b"".join(parts)).digest()


def block_hashes(
    token_ids: Sequence[int], images: Sequence[ImageSpan] = (), seed: bytes = b""
) -> list[bytes]:
    """The chained content hash of each full block of a prompt: block i's covers every token
    before it (through block i - 1's hash, block 0's through the seed), its own token ids, and
    which image rows it holds (each image overlapping it: its digest and the offset of its first
    row in the block)."""
    hashes: list[bytes] = []
    previous = seed
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
