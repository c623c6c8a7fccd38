"""A request's KV blocks as prefill will name them, computed in the router with prefill's own
code: the same request parsing, chat template, tokenizer, image grids and block hashes
(`api/prepare.py`, `kv/hashing.py`), so a block the router looks for is the block a prefill
stored.

Images given as data: URLs are hashed whole. An image given by URL is fetched by the prefill
alone (the router fetches nothing), so a prompt's blocks are named up to its first such image:
the shared system prompt and the turns before it still route. A request that prefill would
refuse, or whose prompt it scores (`prompt_logprobs`: never cached), names no blocks; the
prefill it goes to gives the answer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from epd.api.errors import APIError
from epd.api.images import from_data_url
from epd.api.prepare import PromptBuilder
from epd.api.schema import parse_completion, parse_request
from epd.kv.hashing import (
    ImageSpan,
    block_hashes,
    chain_seed,
    image_digests,
    image_spans,
    salt_digest,
)
from epd.kv.index import external

log = logging.getLogger(__name__)
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@dataclass(frozen=True)
class Named:
    """A prompt as its blocks are named: token ids, image rows, and the salt's digest."""

    prompt_ids: list[int]
    spans: tuple[ImageSpan, ...]
    salt: bytes

    def hashes(self, model_key: bytes) -> list[int]:
        """Its full blocks' hashes, as KV events give them, for a model key."""
        seed = chain_seed(model_key, self.salt)
        return [external(h) for h in block_hashes(self.prompt_ids, self.spans, seed)]


class PromptNamer:
    def __init__(self, builder: PromptBuilder, max_image_bytes: int) -> None:
        self.builder, self.max_image_bytes = builder, max_image_bytes
        self.readers: dict[str, Callable[[Any], Named | None]] = {
            CHAT: self.chat,
            COMPLETIONS: self.completion,
        }

    def name(self, path: str, body: Any) -> Named | None:
        """The prompt of a request to `path`, or None where its blocks cannot be named."""
        reader = self.readers.get(path)
        if reader is None:
            return None
        try:
            return reader(body)
        except (APIError, ValueError, TypeError, KeyError):  # the prefill will say what is wrong
            return None
        except Exception:  # a bug here must cost the request its routing, not its answer
            log.exception("naming a request's blocks failed")
            return None

    def chat(self, body: Any) -> Named | None:
        chat = parse_request(body)
        if chat.prompt_logprobs is not None:
            return None
        conversation = self.builder.read(chat)
        urls = conversation.image_urls
        given = [url for url in urls if url.startswith("data:")]
        if len(given) < len(urls):  # an image by URL: name the blocks before the first image
            ids = self.builder.prompt_ids(conversation, [1] * len(urls))
            first = ids.index(self.builder.placeholder_id)
            return Named(ids[:first], (), salt_digest(chat.cache_salt))  # full blocks only
        images = [from_data_url(url, i, self.max_image_bytes) for i, url in enumerate(urls)]
        _, counts = self.builder.image_tokens(images)
        ids = self.builder.prompt_ids(conversation, counts)
        digests = image_digests(images, chat.cache_salt)
        spans = image_spans(ids, self.builder.placeholder_id, counts, digests)
        if spans is None:
            return None
        return Named(ids, spans, salt_digest(chat.cache_salt))

    def completion(self, body: Any) -> Named | None:
        request = parse_completion(body)
        if request.prompt_logprobs is not None or len(request.prompts) != 1:
            return None  # a list of prompts goes to one prefill: named by none of them
        prepared = self.builder.prepare_completion(request)
        return Named(prepared.prompt_ids, (), salt_digest(request.cache_salt))
