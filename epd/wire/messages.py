"""Every message that travels between epd processes.

Headers hold only these dataclasses and plain Python values (str, int, float, bool, None, bytes,
tuples). Tensors are top-level fields and travel as raw frames beside the header; grids are tuples
of ints. `ALLOWED` is the exact allow-list of classes the receiving unpickler will build.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field

import torch

Grid = tuple[int, int]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token; temperature 0 is greedy."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass(frozen=True)
class EncodeRequest:
    """prefill → encode: part `part_index` of `part_count` of a request's images, in order."""

    request_id: str
    part_index: int
    part_count: int
    images: tuple[bytes, ...]  # encoded files: PNG, JPEG, WebP, GIF
    first_image: int  # index of images[0] among all the request's images
    reply_to: str


@dataclass(frozen=True)
class ImageEmbeddings:
    """encode → prefill: projected embeddings of one part, rows ordered image by image."""

    request_id: str
    part_index: int
    grids: tuple[Grid, ...]  # Kimi-VL (h, w) in patches, one per image
    embeddings: torch.Tensor  # (Σ h·w/4, text hidden)


@dataclass(frozen=True)
class Failure:
    """Any process → the one waiting on a request: what went wrong, never silence."""

    request_id: str
    code: str  # "bad_image", "internal", ...
    message: str


@dataclass(frozen=True)
class TopLogprob:
    token: str
    logprob: float
    bytes: tuple[int, ...]


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    bytes: tuple[int, ...]
    top_logprobs: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class KVHandoff:
    """prefill → decode: everything needed to go on generating where prefill stopped."""

    request_id: str
    reply_to: str
    prompt_tokens: int
    first_token: int
    first_logprob: TokenLogprob | None
    sampling: SamplingParams
    rng_state: torch.Tensor  # the request's generator state after sampling the first token
    cache: torch.Tensor  # latent KV (layers, prompt_tokens, kv_lora_rank + qk_rope_head_dim)


@dataclass(frozen=True)
class TokenDelta:
    """decode → prefill: newly generated tokens and the text they complete."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    completion_tokens: int  # total so far
    finish_reason: str | None = None  # "stop" or "length" on the last delta
    logprobs: tuple[TokenLogprob, ...] = field(default=())


@dataclass(frozen=True)
class Abort:
    """prefill → decode: the client went away; free the request."""

    request_id: str


Message = EncodeRequest | ImageEmbeddings | Failure | KVHandoff | TokenDelta | Abort
MESSAGE_TYPES: tuple[type, ...] = typing.get_args(Message)
ALLOWED: tuple[type, ...] = (*MESSAGE_TYPES, SamplingParams, TokenLogprob, TopLogprob)
