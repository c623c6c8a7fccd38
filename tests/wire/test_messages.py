"""Messages check their values, not only their types: a NaN is a float.

Each poisoned value is refused when a message is built here and when a peer's header carries it.
"""

import math

import msgspec
import pytest
import torch

from epd.generation.params import SamplingParams, TokenLogprob
from epd.wire.codec import WireError, decode, encode
from epd.wire.messages import (
    EncodeRequest,
    Failure,
    ImageEmbeddings,
    KVHandoff,
    TokenDelta,
)

NAN, INF = math.nan, math.inf
RNG = torch.Generator().manual_seed(0).get_state()


def handoff(**changes):
    fields = {
        "request_id": "r",
        "reply_to": "tcp://127.0.0.1:7102",
        "prompt_tokens": 3,
        "first_tokens": (5,),
        "first_logprobs": (None,),
        "sampling": SamplingParams(8),
        "rng_states": RNG[None],
        "cache": torch.zeros(2, 3, 8),
        "prompt_ids": torch.tensor([1, 2, 3]),
    }
    return KVHandoff(**(fields | changes))


SAMPLING = [
    ({"temperature": NAN}, "temperature"),
    ({"temperature": INF}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": NAN}, "top_p"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"top_logprobs": 5000}, "top_logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": ("",)}, "stop"),
    ({"stop": ("x" * 10_000,)}, "stop"),
    ({"stop": ("a",) * 17}, "stop"),
    ({"presence_penalty": NAN}, "presence_penalty"),
    ({"frequency_penalty": INF}, "frequency_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 1e-30}, "repetition_penalty"),  # would overflow the logits
    ({"repetition_penalty": NAN}, "repetition_penalty"),
    ({"min_p": NAN}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": 9}, "min_tokens"),  # over max_tokens
    ({"min_tokens": -1}, "min_tokens"),
    ({"logit_bias": ((3, INF),)}, "logit_bias"),
    ({"logit_bias": ((3, NAN),)}, "logit_bias"),
    ({"logit_bias": ((-1, 5.0),)}, "logit_bias"),
    ({"logit_bias": ((3, 101.0),)}, "logit_bias"),
    ({"stop_token_ids": (-4,)}, "stop_token_ids"),
]


@pytest.mark.parametrize("changes,field", SAMPLING, ids=lambda v: str(v)[:40])
def test_poisoned_sampling_is_refused_here_and_on_the_wire(changes, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**({"max_tokens": 8} | changes))
    good = encode(handoff())
    raw = msgspec.msgpack.decode(good[0])
    sampling = SamplingParams(8)
    values = [getattr(sampling, name) for name in SamplingParams.__struct_fields__]
    for name, value in changes.items():
        values[SamplingParams.__struct_fields__.index(name)] = value
    raw[6] = values
    with pytest.raises(WireError, match=rf"{field}|at `\$\[6\]"):  # named, or its place
        decode([msgspec.msgpack.encode(raw), *map(bytes, good[1:])])


@pytest.mark.parametrize(
    "prompt_ids", [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1, 2]), torch.tensor([[1, 2, 3]])]
)
def test_prompt_ids_must_be_the_prompts_int64_ids(prompt_ids):
    with pytest.raises(ValueError, match="prompt_ids"):
        handoff(prompt_ids=prompt_ids)


@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_a_cache_holding_nan_or_inf_is_refused(value):
    cache = torch.zeros(2, 3, 8)
    cache[1, 2, 3] = value
    with pytest.raises(ValueError, match="cache holds NaN or infinite"):
        handoff(cache=cache)
    frames = encode(handoff())
    frames[2] = cache.numpy().tobytes()
    with pytest.raises(WireError, match="cache holds NaN or infinite"):
        decode([bytes(f) for f in frames])


def test_embeddings_holding_nan_are_refused():
    frames = encode(ImageEmbeddings("r", 0, ((2, 2),), torch.zeros(1, 4)))
    with pytest.raises(WireError, match="embeddings holds NaN"):
        decode([frames[0], torch.full((1, 4), NAN).numpy().tobytes()])


@pytest.mark.parametrize(
    "changes,fragment",
    [
        ({"cache": torch.zeros(2, 4, 8)}, "a cache of 4 tokens for 3 of a prompt of 3"),
        ({"cached_blocks": 1}, "1 blocks said to be cached, of 0 named"),
        ({"cached_blocks": -1}, "blocks said to be cached"),
        ({"block_hashes": torch.zeros(1, 32, dtype=torch.uint8)}, "block_hashes must be"),
        ({"block_hashes": torch.zeros(0, 16, dtype=torch.uint8)}, "block_hashes must be"),
        ({"salt": b"x" * 7}, "a salt digest has 0 or 32 bytes"),
        ({"cache": torch.zeros(3, 8)}, "cache must have 3 dimensions"),
        ({"cache": torch.zeros(2, 3, 8, dtype=torch.int64)}, "cache must hold floats"),
        ({"rng_states": torch.zeros(4)}, "rng_states"),
        ({"rng_states": RNG}, "rng_states"),  # not one row per choice
        ({"first_tokens": (-1,)}, "first_tokens"),
        ({"first_tokens": (1, 2)}, "first_tokens"),  # two first tokens for one choice
        ({"sampling": SamplingParams(8, n=2)}, "first_tokens"),
        ({"reply_to": "http://example.com"}, "reply_to must be a ZeroMQ address"),
        ({"request_id": ""}, "request_id"),
        ({"request_id": "r" * 1000}, "request_id"),
        ({"request_id": "r1\n2026-01-01 decode INFO forged"}, "request_id"),  # a log line
        ({"request_id": "r1 x"}, "request_id"),
    ],
)
def test_handoffs_check_their_shapes_and_ids(changes, fragment):
    with pytest.raises(ValueError, match=fragment):
        handoff(**changes)


@pytest.mark.parametrize(
    "build,fragment",
    [
        (lambda: TokenLogprob("x", NAN, ()), "logprob"),
        (lambda: TokenLogprob("x", 0.5, ()), "logprob"),
        (lambda: TokenLogprob("x", -1.0, (300,)), "token bytes"),
        (lambda: TokenDelta("r", (), "", 1), "at least one token"),
        (lambda: TokenDelta("r", (-3,), "", 1), "token ids"),
        (lambda: TokenDelta("r", (3,), "", 1, "exploded"), "finish_reason"),  # type: ignore[arg-type]
        (lambda: EncodeRequest("r", -1, (b"x",), (0,), "tcp://a:1"), "part_index"),
        (lambda: EncodeRequest("r", 0, (), (), "tcp://a:1"), "needs images"),
        (lambda: EncodeRequest("r", 0, (b"x",), (-1,), "tcp://a:1"), "image_indices"),
        (lambda: ImageEmbeddings("r", 0, ((0, 2),), torch.zeros(1, 4)), "grids"),
        (lambda: Failure("r", "bad\rcode", "why"), "code"),
    ],
)
def test_other_messages_check_their_values(build, fragment):
    with pytest.raises(ValueError, match=fragment):
        build()


@pytest.mark.parametrize("usage", [1.5, -0.1, NAN, INF])
def test_a_decoders_kv_cache_usage_is_a_fraction(usage):
    """A delta says how full its decoder's KV cache is; prefill exports it as a gauge, so a
    value out of 0 to 1 (or NaN) is refused, here and as it arrives."""
    with pytest.raises(ValueError, match="kv_cache_usage"):
        TokenDelta("r", (3,), "", 1, kv_cache_usage=usage)

    def header(usage: float) -> bytes:
        return msgspec.msgpack.encode(["TokenDelta", "r", [3], "", 1, None, [], 0, usage])

    with pytest.raises(WireError, match="kv_cache_usage"):
        decode([header(usage)])
    assert decode([header(0.5)]).kv_cache_usage == 0.5


@pytest.mark.parametrize(
    ("finish", "stop", "fragment"),
    [
        (None, 7, "without a stop"),
        ("length", "x", "without a stop"),
        ("stop", -1, "no stop"),
        ("stop", "", "no stop"),
    ],
)
def test_a_stop_reason_is_a_stop_that_ended_the_choice(finish, stop, fragment):
    """Only a choice that a stop ended names one (the API shows it as vLLM's stop_reason),
    here and as it arrives."""
    with pytest.raises(ValueError, match=fragment):
        TokenDelta("r", (3,), "", 1, finish, stop_reason=stop)

    def header(stop: object) -> bytes:
        return msgspec.msgpack.encode(["TokenDelta", "r", [3], "", 1, finish, [], 0, None, stop])

    with pytest.raises(WireError, match=fragment):
        decode([header(stop)])


def test_a_stop_reason_is_no_longer_than_a_stop_string():
    header = ["TokenDelta", "r", [3], "", 1, "stop", [], 0, None, "x" * 257]
    with pytest.raises(WireError, match="length <= 256"):
        decode([msgspec.msgpack.encode(header)])
    assert decode([msgspec.msgpack.encode([*header[:-1], "x" * 256])]).stop_reason == "x" * 256


def test_a_finish_reason_is_stop_or_length():
    header = msgspec.msgpack.encode(["TokenDelta", "r", [3], "", 1, "exploded", []])
    with pytest.raises(WireError, match="Invalid enum value 'exploded'"):
        decode([header])
