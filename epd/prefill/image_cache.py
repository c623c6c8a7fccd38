"""Projected image embeddings kept by content, so an image asked about again skips encode.

Keyed by the SHA-256 of the image file (the processor's rules are fixed for a deployment), and
of the request's `cache_salt` if it sent one: a tenant that salts its requests neither gets nor
gives another's embeddings, so whether an image was sent before cannot be timed across salts.
Least recently used out first under a byte budget; hits and misses are counted for GET /health.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict

import torch

log = logging.getLogger(__name__)
FileKey = tuple[str | None, int]  # what is known of an image before it is hashed: salt, size


class ImageCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.bytes = max_bytes, 0
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()  # digest → (tokens, hidden)
        self.hits = self.misses = 0
        # Each kept image's file size with the cache_salt it was sent under (None: not given),
        # and how many have each: a file of a size none has under its salt is not here, which
        # is known before it is hashed (`may_hold`), and says nothing of other salts' images.
        self.file_bytes: dict[str, FileKey | None] = {}
        self.sizes: Counter[FileKey | None] = Counter()

    def may_hold(self, file_bytes: int, salt: str | None = None) -> bool:
        """Whether an image file of this size, sent under `salt`, may be cached (False:
        surely not)."""
        return bool(self.sizes[(salt, file_bytes)] or self.sizes[None])

    def get(self, digest: str) -> torch.Tensor | None:
        rows = self.entries.get(digest)
        if rows is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(digest)
        return rows

    def put(
        self,
        digest: str,
        rows: torch.Tensor,
        file_bytes: int | None = None,
        salt: str | None = None,
    ) -> None:
        """Keep an image's rows (copied: a received frame may hold other images too), and its
        file's size and salt if given. The cache is optional: a copy that cannot be made (no memory
        left) is not kept, and the request goes on with its rows."""
        size = rows.nbytes
        if size > self.max_bytes or digest in self.entries:
            return
        try:
            copy = rows.clone()
        except (RuntimeError, MemoryError) as e:
            log.warning("image cache: %d bytes not kept: %s", size, e)
            return
        while self.bytes + size > self.max_bytes:
            dropped_digest, dropped = self.entries.popitem(last=False)
            self.bytes -= dropped.nbytes
            dropped_size = self.file_bytes.pop(dropped_digest)
            self.sizes[dropped_size] -= 1
            if not self.sizes[dropped_size]:
                del self.sizes[dropped_size]  # the sizes stay as many as the entries
        self.entries[digest] = copy
        self.bytes += size
        key = None if file_bytes is None else (salt, file_bytes)
        self.file_bytes[digest] = key
        self.sizes[key] += 1

    def status(self) -> dict[str, object]:
        return {"image_cache": {"hits": self.hits, "misses": self.misses, "bytes": self.bytes}}
