"""The requests of a run: prompts of about N words and, optionally, images of a chosen size.

Seeded, so two servers get the same requests. Prompts are random words (each about one token
in a BPE vocabulary), different per request so no server can reuse a cached prefix, except
where the workload shares one on purpose: a system prompt in every request
(`system_prompt_tokens`), or the turns before in a conversation (`turns`). Images are random
noise PNGs, different per conversation unless `repeat_images` (which an embedding cache should
notice). With `--dataset-name sharegpt` each request's text and max_tokens are a ShareGPT
conversation's instead (`sharegpt`). The legacy completions endpoint gets the same text as one
prompt.
"""

from __future__ import annotations

import base64
import io
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from epd.bench.config import BenchConfig
from epd.bench.sharegpt import Sample

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


def conversations(
    config: BenchConfig,
    model: str,
    count: int,
    offset: int = 0,
    samples: Sequence[Sample] = (),
) -> list[list[dict[str, Any]]]:
    """`count` request bodies (the `offset`-th onwards of this seed's sequence), in
    conversations of `config.turns` turns, to be sent each after the one before; their text
    from `samples` where there are some (ShareGPT's), else random words."""
    shared = random.Random(f"{config.seed}-images")
    fixed = [
        image_url(shared, config.image_width, config.image_height) for _ in range(config.images)
    ]
    system = prompt(random.Random(f"{config.seed}-system"), config.system_prompt_tokens)
    turns = config.turns
    out = []
    for first in range(offset - offset % turns, offset + count, turns):
        rng = random.Random(
            f"{config.seed}-{first // turns}" if turns > 1 else f"{config.seed}-{first}"
        )
        urls = (
            fixed
            if config.repeat_images
            else [
                image_url(rng, config.image_width, config.image_height)
                for _ in range(config.images)
            ]
        )
        opening = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        conversation = []
        for turn in range(turns):
            text, max_tokens = user_turn(config, rng, first + turn, samples)
            content: Any = [*opening, {"type": "text", "text": text}] if turn == 0 else text
            messages = [*messages, {"role": "user", "content": content}]
            if offset <= first + turn < offset + count:
                conversation.append(request(config, model, messages, max_tokens))
            reply = prompt(rng, config.output_tokens)  # what the model might have said
            messages = [*messages, {"role": "assistant", "content": reply}]
        out.append(conversation)
    return [c for c in out if c]


def user_turn(
    config: BenchConfig, rng: random.Random, index: int, samples: Sequence[Sample]
) -> tuple[str, int]:
    """The `index`-th request's new text and max_tokens: a sample's (repeated where there are
    too few), or random words."""
    if samples:
        chosen = samples[index % len(samples)]
        return chosen.prompt, chosen.output_tokens
    return prompt(rng, config.prompt_tokens), config.output_tokens


def request(
    config: BenchConfig, model: str, messages: list[dict[str, Any]], max_tokens: int
) -> dict[str, Any]:
    """A streamed request of `messages`: as they are for chat, as one text for completions."""
    body: dict[str, Any] = {"model": model}
    if config.chat:
        body["messages"] = messages
    else:
        body["prompt"] = "\n\n".join(text_of(m["content"]) for m in messages)
    body |= {
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        body["ignore_eos"] = True
    return body


def text_of(content: str | list[dict[str, Any]]) -> str:
    """A message's text (a completions prompt has no images: the config refuses them)."""
    if isinstance(content, str):
        return content
    return " ".join(part["text"] for part in content if part["type"] == "text")


def bodies(
    config: BenchConfig, model: str, count: int, offset: int = 0, samples: Sequence[Sample] = ()
) -> list[dict[str, Any]]:
    """`conversations`' bodies, one after another."""
    return [b for turns in conversations(config, model, count, offset, samples) for b in turns]
