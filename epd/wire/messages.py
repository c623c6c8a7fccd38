"""Every message that travels between epd processes, and the values it may hold.

Messages are msgspec Structs: frozen, with exactly their declared fields, decoded only into
these types (see `codec`). Tensors are top-level fields and travel as raw frames beside the
header; grids are tuples of ints. Field lengths are bounded by their types, and each type checks
its values when it is built, here or by the decoder (see `limits`): a NaN is a float, and a
hand-off holding one must be refused before it meets the requests it would be batched with.
"""

from __future__ import annotations

import typing
from typing import TYPE_CHECKING, Annotated

import torch
from msgspec import Meta

from epd.generation.params import (
    FINISH_REASONS,
    MAX_CHOICES,
    FinishReason,
    Record,
    SamplingParams,
    StopReason,
    Text,
    TokenLogprob,
    require,
)
from epd.multimodal.grids import Grid
from epd.wire.limits import (
    MAX_ITEMS,
    Address,
    Id,
    check_address,
    check_id,
    check_tensor,
)

if TYPE_CHECKING:  # only its fields are read: the wire need not load tokenizers
    from epd.generation.transcript import Output


class WireMessage(Record, frozen=True, tag=True):
    """A message: the header names its type (the class name) before the fields."""

    request_id: Id

    def __post_init__(self) -> None:
        check_id(self.request_id, "request_id")


class EncodeRequest(WireMessage, frozen=True):
    """prefill → encode: part `part_index` of a request's images (prefill may split them)."""

    part_index: int
    images: Annotated[tuple[bytes, ...], Meta(max_length=MAX_ITEMS)]  # PNG, JPEG, WebP, GIF files
    image_indices: Annotated[tuple[int, ...], Meta(max_length=MAX_ITEMS)]  # each in the request
    reply_to: Address
    # Prefill had no other request in flight as it sent this: nothing else works meanwhile, and
    # the encoder may use the cores the other roles leave idle (`alone_threads`).
    alone: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.part_index >= 0, "part_index must be ≥ 0")
        require(len(self.images) > 0 and all(self.images), "an encode request needs images")
        require(
            len(self.image_indices) == len(self.images) and min(self.image_indices) >= 0,
            "image_indices must give each image's index in the request",
        )
        check_address(self.reply_to, "reply_to")


class ImageEmbeddings(WireMessage, frozen=True):
    """encode → prefill: projected embeddings of one part, rows ordered image by image."""

    part_index: int
    grids: Annotated[tuple[Grid, ...], Meta(max_length=MAX_ITEMS)]  # Kimi-VL (h, w) in patches
    embeddings: torch.Tensor  # (Σ h·w/4, text hidden)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.part_index >= 0, "part_index must be ≥ 0")
        require(
            len(self.grids) > 0 and all(h > 0 and w > 0 for h, w in self.grids),
            "grids must be positive (h, w) pairs",
        )
        check_tensor(self.embeddings, "embeddings", rank=2)


class Failure(WireMessage, frozen=True):
    """Any process → the one waiting on a request: what went wrong, never silence."""

    code: Id  # "bad_image", "bad_request", "unavailable", "internal", ...
    message: Text  # build it with `limits.cut` when it quotes an exception

    def __post_init__(self) -> None:
        super().__post_init__()
        check_id(self.code, "code")


class KVHandoff(WireMessage, frozen=True):
    """prefill → decode: everything needed to go on generating where prefill stopped."""

    reply_to: Address
    prompt_tokens: int
    first_tokens: Annotated[tuple[int, ...], Meta(max_length=MAX_CHOICES)]  # one per choice
    first_logprobs: Annotated[tuple[TokenLogprob | None, ...], Meta(max_length=MAX_CHOICES)]
    sampling: SamplingParams
    rng_states: torch.Tensor  # (n, state) uint8: each choice's generator after its first token
    cache: torch.Tensor  # latent KV (layers, prompt_tokens, kv_lora_rank + qk_rope_head_dim)
    prompt_ids: torch.Tensor  # (prompt_tokens,) int64, for penalties on the prompt's tokens
    # Prefill had no other request in flight as it sent this: until something else comes, the
    # decoder may take the cores the other roles leave idle (`alone_threads`).
    alone: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_address(self.reply_to, "reply_to", optional=True)  # empty: served in-process
        n = self.sampling.n
        require(
            len(self.first_tokens) == len(self.first_logprobs) == n,
            f"first_tokens and first_logprobs must have one entry for each of the {n} choices",
        )
        require(all(t >= 0 for t in self.first_tokens), "first_tokens must be ≥ 0")
        require(
            self.rng_states.dtype == torch.uint8
            and self.rng_states.dim() == 2
            and self.rng_states.shape[0] == n,
            f"rng_states must be a ({n}, state) uint8 tensor",
        )
        check_tensor(self.cache, "cache", rank=3)
        require(
            self.prompt_tokens >= 1 and self.cache.shape[1] == self.prompt_tokens,
            f"a cache of {self.cache.shape[1]} tokens for a prompt of {self.prompt_tokens}",
        )
        require(
            self.prompt_ids.dtype == torch.int64
            and tuple(self.prompt_ids.shape) == (self.prompt_tokens,),
            f"prompt_ids must be {self.prompt_tokens} int64 token ids",
        )


class TokenDelta(WireMessage, frozen=True):
    """decode → prefill: newly generated tokens and the text they complete, and how full the
    decoder's KV cache is as it sends them (what prefill knows of a decoder's load)."""

    token_ids: Annotated[tuple[int, ...], Meta(max_length=MAX_ITEMS)]
    text: Text
    completion_tokens: int  # total so far, of this choice
    finish_reason: FinishReason | None = None  # on the choice's last delta
    logprobs: Annotated[tuple[TokenLogprob, ...], Meta(max_length=MAX_ITEMS)] = ()
    index: int = 0  # the choice (n > 1)
    # The decoder's KV cache blocks in use after the step that made these tokens, 0 to 1 (None:
    # prefill's own first tokens, or a decoder of the version before).
    kv_cache_usage: float | None = None
    stop_reason: StopReason = None  # with finish_reason "stop": the stop token id or string

    def __post_init__(self) -> None:
        super().__post_init__()
        require(len(self.token_ids) > 0, "a delta carries at least one token")
        require(all(t >= 0 for t in self.token_ids), "token ids must be ≥ 0")
        require(self.completion_tokens >= len(self.token_ids), "completion_tokens is too small")
        require(len(self.logprobs) <= len(self.token_ids), "more logprobs than tokens")
        require(0 <= self.index < MAX_CHOICES, f"index must be 0 to {MAX_CHOICES - 1}")
        require(self.finish_reason in FINISH_REASONS, f"finish_reason {self.finish_reason!r}")
        usage = self.kv_cache_usage
        require(usage is None or 0.0 <= usage <= 1.0, "kv_cache_usage must be 0 to 1")  # no NaN
        stop = self.stop_reason
        require(stop is None or self.finish_reason == "stop", "stop_reason without a stop")
        require(stop != "" and (not isinstance(stop, int) or stop >= 0), "stop_reason is no stop")

    @classmethod
    def of(
        cls, request_id: str, index: int, output: Output, kv_cache_usage: float | None = None
    ) -> TokenDelta:
        """The delta that carries choice `index`'s output."""
        return cls(
            request_id,
            output.token_ids,
            output.text,
            output.completion_tokens,
            output.finish_reason,
            output.logprobs,
            index,
            kv_cache_usage,
            output.stop_reason,
        )


class Abort(WireMessage, frozen=True):
    """prefill → decode: the client went away; free the request."""


Message = EncodeRequest | ImageEmbeddings | Failure | KVHandoff | TokenDelta | Abort
MESSAGE_TYPES: tuple[type[WireMessage], ...] = typing.get_args(Message)
