"""A request in prefill: as the API hands it over (`PreparedRequest`), and its one record from
then to its last token (`Request`): where it stands, how much of its prompt is computed, and once
handed off, the stream its tokens come back on."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from epd.generation.params import SamplingParams
from epd.generation.status import Status
from epd.multimodal.grids import Grid

if TYPE_CHECKING:  # `PreparedRequest` is built where no torch is imported (`epd route`)
    import torch

    from epd.generation.sampling import Scored
    from epd.prefill.engine import Handed
    from epd.prefill.errors import PrefillError
    from epd.wire.messages import KVMissing, TokenDelta


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    prompt_ids: list[int]  # placeholders already expanded to each image's token count
    images: list[bytes]
    grids: tuple[Grid, ...]  # expected from each image's size; encode must agree
    image_tokens: tuple[int, ...]  # placeholder slots per image
    sampling: SamplingParams
    prompt_logprobs: int | None = None  # score the prompt's tokens, with this many alternatives
    # vLLM's `cache_salt`: only requests of the same salt share the prefix and image caches'
    # entries (None: the unsalted ones'), so tenants cannot time each other's prompts
    cache_salt: str | None = None


@dataclass(eq=False)
class Request:
    """A request's one record in prefill, from `Coordinator.submit` to its last delta: its
    status, its prompt's `num_computed_tokens` (the batcher's), and from its hand-off the
    tokens: each choice's first from prefill, the rest from `decoder`."""

    request_id: str
    decoder: str = ""  # "" until handed off, and where the first tokens ended every choice
    choices: int = 1  # the request's n: it ends once each choice has had its last delta
    first: tuple[TokenDelta, ...] = ()  # each choice's first token, from prefill
    queue: asyncio.Queue[TokenDelta | KVMissing | PrefillError] = field(
        default_factory=asyncio.Queue
    )
    sent_at: float = 0.0  # when the hand-off went to the decoder (perf_counter)
    max_tokens: int = sys.maxsize  # the request's: no choice may have more
    prompt_logprobs: tuple[Scored, ...] = ()  # scored prompt tokens, if asked (`Prompt`)
    handed: Handed | None = None  # the hand-off, until decode's first word: to send it again
    status: Status = Status.ENCODING
    num_computed_tokens: int = 0  # prompt tokens prefilled so far, or found cached
    cached_tokens: int = 0  # of those, found cached: what its reply's usage reports
    # What moving it to another decoder needs (one choice only, `Coordinator.migrate`): the
    # request as the API handed it over, its generator after the first token, the tokens its
    # client has so far, and how often it moved.
    prepared: PreparedRequest | None = None
    rng_state: torch.Tensor | None = None
    emitted: list[int] = field(default_factory=list)
    migrations: int = 0

    @property
    def wire_id(self) -> str:
        """The request's id on the wire: one of its own for each decoder it moves to, so that
        what a decoder it has left still sends (one that stalled and came back) is refused as
        no request of this prefill's, never taken as this stream's."""
        return f"{self.request_id}.m{self.migrations}" if self.migrations else self.request_id
