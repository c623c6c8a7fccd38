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

import msgspec
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
from epd.kv.hashing import BLOCK_TOKENS, HASH_BYTES
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


class ImageRows(Record, frozen=True):
    """An image's rows in a prompt: positions [start, start + length), and its file's digest
    (what a block's hash names it by)."""

    start: int
    length: int
    digest: Annotated[bytes, Meta(min_length=HASH_BYTES, max_length=HASH_BYTES)]

    def __post_init__(self) -> None:
        require(self.start >= 0 and self.length >= 0, "an image's rows start and count ≥ 0")


def unnamed_blocks() -> torch.Tensor:
    """No block hashes: (0, 32) uint8."""
    return torch.empty(0, HASH_BYTES, dtype=torch.uint8)


class KVHandoff(WireMessage, frozen=True):
    """prefill → decode: everything needed to go on generating where prefill stopped.

    The prompt's KV comes by block: `block_hashes` names each full block of the prompt
    (`kv/hashing.py`, chained from the model, the request's salt digest and its images, which
    decode hashes again to check them), and `cache` carries the rows after the first
    `cached_blocks` of them, which prefill believes the decoder holds already; a decoder that
    lacks one answers `KVMissing` and gets the hand-off again from the blocks it has."""

    reply_to: Address
    prompt_tokens: int
    first_tokens: Annotated[tuple[int, ...], Meta(max_length=MAX_CHOICES)]  # one per choice
    first_logprobs: Annotated[tuple[TokenLogprob | None, ...], Meta(max_length=MAX_CHOICES)]
    sampling: SamplingParams
    rng_states: torch.Tensor  # (n, state) uint8: each choice's generator after its first token
    # latent KV of tokens [cached_blocks · 16, prompt_tokens): (layers, rows, kv_lora_rank + rope)
    cache: torch.Tensor
    prompt_ids: torch.Tensor  # (prompt_tokens,) int64, for penalties on the prompt's tokens
    # (prompt_tokens // 16, 32) uint8: the hash of each full block; (0, 32) where the prompt's
    # blocks cannot be named (images not known by digest, scored prompts): nothing is shared.
    block_hashes: torch.Tensor = msgspec.field(default_factory=unnamed_blocks)
    cached_blocks: int = 0
    salt: Annotated[bytes, Meta(max_length=HASH_BYTES)] = b""  # the cache salt's digest, or none
    images: Annotated[tuple[ImageRows, ...], Meta(max_length=MAX_ITEMS)] = ()
    # A request moved from a decoder that died (migration): its last `resumed_tokens` prompt
    # ids are the reply's tokens the client has already, after the first; `first_tokens` is the
    # last one it has, and `rng_states` the generator after it. Decode replays them (sending
    # nothing) and goes on. One choice only.
    resumed_tokens: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_address(self.reply_to, "reply_to", optional=True)  # empty: served in-process
        n = self.sampling.n
        require(
            0 <= self.resumed_tokens < self.prompt_tokens and (self.resumed_tokens == 0 or n == 1),
            "resumed_tokens must be 0, or fewer than the prompt's tokens for one choice",
        )
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
        require(
            self.prompt_ids.dtype == torch.int64
            and tuple(self.prompt_ids.shape) == (self.prompt_tokens,),
            f"prompt_ids must be {self.prompt_tokens} int64 token ids",
        )
        self.check_blocks()

    def check_blocks(self) -> None:
        """The hashes, the blocks not sent and the rows sent must add up to the prompt."""
        hashes, full = self.block_hashes, self.prompt_tokens // BLOCK_TOKENS
        require(
            hashes.dtype == torch.uint8
            and hashes.dim() == 2
            and hashes.shape[1] == HASH_BYTES
            and hashes.shape[0] in (0, full),
            f"block_hashes must be ({full} or 0, {HASH_BYTES}) uint8",
        )
        require(
            0 <= self.cached_blocks <= hashes.shape[0],
            f"{self.cached_blocks} blocks said to be cached, of {hashes.shape[0]} named",
        )
        check_tensor(self.cache, "cache", rank=3)
        rows = self.prompt_tokens - self.cached_blocks * BLOCK_TOKENS
        require(
            self.prompt_tokens >= 1 and self.cache.shape[1] == rows,
            f"a cache of {self.cache.shape[1]} tokens for {rows} of a prompt of "
            f"{self.prompt_tokens} not cached",
        )
        require(len(self.salt) in (0, HASH_BYTES), f"a salt digest has 0 or {HASH_BYTES} bytes")
        require(
            all(i.start + i.length <= self.prompt_tokens for i in self.images),
            "an image's rows lie past the prompt",
        )


class KVMissing(WireMessage, frozen=True):
    """decode → prefill: the hand-off named blocks as cached that this decoder no longer holds
    (it evicted them); it holds the first `held_blocks`, and takes the hand-off again from
    there. `keeps` false: it keeps no blocks at all (its prefix cache is off)."""

    held_blocks: int
    keeps: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.held_blocks >= 0, "held_blocks must be ≥ 0")


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


Message = EncodeRequest | ImageEmbeddings | Failure | KVHandoff | KVMissing | TokenDelta | Abort
MESSAGE_TYPES: tuple[type[WireMessage], ...] = typing.get_args(Message)
