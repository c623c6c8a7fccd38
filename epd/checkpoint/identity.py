"""A checkpoint's identity as a digest, the same wherever its files are: what KV rows computed
with it are named by (`kv/hashing.py`), so that two processes agree on blocks only when they
run the same weights.

Hashing every weight would read gigabytes at each start. The digest reads `config.json`, and
of each safetensors file its size, its header (every tensor's name, dtype, shape and offsets)
and SAMPLES pieces of SAMPLE_BYTES spread over its data: two fine-tunes of one architecture
share headers, but not their weights' bytes anywhere.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import BinaryIO

SAMPLES, SAMPLE_BYTES = 16, 4096
MAX_HEADER = 100 << 20  # safetensors' own bound on a header


def checkpoint_digest(directory: str | Path) -> bytes:
    """SHA-256 over config.json and samples of every safetensors file (in name order)."""
    directory = Path(directory)
    digest = hashlib.sha256(b"epd checkpoint\0")
    config = directory / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    for path in sorted(directory.glob("*.safetensors")):
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as file:
            digest.update(sampled(file, path.stat().st_size))
    return digest.digest()


def sampled(stream: BinaryIO, size: int) -> bytes:
    """A file's size, its safetensors header and SAMPLES pieces of the rest, as one string."""
    head = stream.read(8)
    header_bytes = int.from_bytes(head, "little") if len(head) == 8 else 0
    pieces = [size.to_bytes(8, "little"), head, stream.read(min(header_bytes, size, MAX_HEADER))]
    start = 8 + header_bytes
    span = max(0, size - start - SAMPLE_BYTES)
    for k in range(SAMPLES):
        stream.seek(start + span * k // max(1, SAMPLES - 1))
        pieces.append(stream.read(SAMPLE_BYTES))
    return b"".join(pieces)
