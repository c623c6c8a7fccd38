"""`system_fingerprint`, as vLLM's server gives it: the server's version and a short hash of
what shapes its replies, `epd-<version>-<8 hex digits>`.

OpenAI's field lets a client tell that replies to the same seeded request may differ because
the backend changed, not by chance. vLLM (by default, `--fingerprint-mode full`) hashes its
whole engine configuration; here it is what prefill loads and serves with: the checkpoint,
the dtype its weights run in, the device kind, and the context a request may use. Computed
once at start, so a reply pays a lookup.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path

import torch


def system_fingerprint(
    checkpoint: str, dtype: torch.dtype, device: torch.device, context_length: int
) -> str:
    settings = {
        "checkpoint": str(Path(checkpoint).resolve()),
        "dtype": str(dtype),
        "device": device.type,
        "context_length": context_length,
    }
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    return f"epd-{importlib.metadata.version('epd')}-{digest[:8]}"
