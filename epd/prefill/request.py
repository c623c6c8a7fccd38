"""A request as prefill takes it from the API: prompt ids with expanded image slots, and images."""

from __future__ import annotations

from dataclasses import dataclass

from epd.generation.params import SamplingParams
from epd.multimodal.grids import Grid


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    prompt_ids: list[int]  # placeholders already expanded to each image's token count
    images: list[bytes]
    grids: tuple[Grid, ...]  # expected from each image's size; encode must agree
    image_tokens: tuple[int, ...]  # placeholder slots per image
    sampling: SamplingParams
    prompt_logprobs: int | None = None  # score the prompt's tokens, with this many alternatives
