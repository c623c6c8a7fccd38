"""Projected image embeddings kept by content, so an image asked about again skips encode.

Keyed by the SHA-256 of the image file (the processor's rules are fixed for a deployment), and
of the request's `cache_salt` if it sent one: a tenant that salts its requests neither gets nor
gives another's embeddings, so whether an image was sent before cannot be timed across salts.
Least recently used out first under a byte budget; hits and misses are counted for GET /health.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)


def digests(images: Sequence[bytes], salt: str | None = None) -> list[str]:
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


class ImageCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.bytes = max_bytes, 0
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()  # digest → (tokens, hidden)
        self.hits = self.misses = 0

    def get(self, digest: str) -> torch.Tensor | None:
        rows = self.entries.get(digest)
        if rows is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(digest)
        return rows

    def put(self, digest: str, rows: torch.Tensor) -> None:
        """Keep an image's rows (copied: a received frame may hold other images too). The cache
        is optional: a copy that cannot be made (no memory left) is not kept, and the request
        goes on with its rows."""
        size = rows.nbytes
        if size > self.max_bytes or digest in self.entries:
            return
        try:
            copy = rows.clone()
        except (RuntimeError, MemoryError) as e:
            log.warning("image cache: %d bytes not kept: %s", size, e)
            return
        while self.bytes + size > self.max_bytes:
            _, dropped = self.entries.popitem(last=False)
            self.bytes -= dropped.nbytes
        self.entries[digest] = copy
        self.bytes += size

    def status(self) -> dict[str, object]:
        return {"image_cache": {"hits": self.hits, "misses": self.misses, "bytes": self.bytes}}
