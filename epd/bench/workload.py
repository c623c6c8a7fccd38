"""The requests of a run: prompts of about N words and, optionally, images of a chosen size.

Seeded, so two servers get the same requests. Prompts are random words (each about one token
in a BPE vocabulary), different per request so no server can reuse a cached prefix; images are
random noise PNGs, different per request unless `repeat_images` (which an embedding cache
should notice).
"""

from __future__ import annotations

import base64
import io
import random
from typing import Any

import numpy as np
from PIL import Image

from epd.bench.config import BenchConfig

COMMON = """
the of and to in is that for it as was with be by on not he this are or his from at which but
have an they you were her she there one all we their has been if more when will would who so no
time can out up about into than them some could only other new then what two may
"""
WORDS = COMMON.split()


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def image_url(rng: random.Random, width: int, height: int) -> str:
    pixels = np.random.default_rng(rng.getrandbits(32)).integers(0, 256, (height, width, 3))
    buffer = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def bodies(config: BenchConfig, model: str, count: int, offset: int = 0) -> list[dict[str, Any]]:
    """`count` chat-completion request bodies (the `offset`-th onwards of this seed's sequence)."""
    shared = random.Random(f"{config.seed}-images")
    fixed = [
        image_url(shared, config.image_width, config.image_height) for _ in range(config.images)
    ]
    out = []
    for index in range(offset, offset + count):
        rng = random.Random(f"{config.seed}-{index}")
        urls = (
            fixed
            if config.repeat_images
            else [
                image_url(rng, config.image_width, config.image_height)
                for _ in range(config.images)
            ]
        )
        content = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
        content.append({"type": "text", "text": prompt(rng, config.prompt_tokens)})
        body = {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": config.output_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if config.ignore_eos:
            body["ignore_eos"] = True
        out.append(body)
    return out
