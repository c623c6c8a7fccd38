"""The codec: round trips of every message, zero-copy tensors, and typed decoding."""

import msgspec
import numpy as np
import pytest
import torch

from epd.generation.params import SamplingParams, TokenLogprob, TopLogprob
from epd.wire.codec import WireError, decode, encode
from epd.wire.messages import (
    Abort,
    EncodeRequest,
    Failure,
    ImageEmbeddings,
    KVHandoff,
    TokenDelta,
)

LOGPROB = TokenLogprob("hi", -0.5, (104, 105), (TopLogprob("hi", -0.5, (104, 105)),))
RNG = torch.Generator().manual_seed(3).get_state()
MESSAGES = [
    EncodeRequest("r1", 0, (b"\x89PNG...", b"GIF89a"), (0, 2), "tcp://127.0.0.1:1"),
    ImageEmbeddings("r1", 1, ((40, 60), (20, 40)), torch.randn(800, 16)),
    Failure("r1", "bad_image", "image 1: corrupt"),
    KVHandoff(
        "r1",
        "tcp://127.0.0.1:1",
        13,
        (7, 9),
        (LOGPROB, None),
        SamplingParams(
            32,
            0.7,
            0.9,
            5,
            1234,
            ("\n\n",),
            True,
            1,
            False,
            0.5,
            -1.0,
            1.2,
            0.1,
            2,
            ((3, -5.0),),
            grammar='{"grammars": []}',
            n=2,
        ),
        torch.stack([RNG, RNG]),
        torch.randn(3, 13, 40).to(torch.bfloat16),
        torch.arange(13),
    ),
    TokenDelta("r1", (7,), "hi", 1, None, (LOGPROB,)),
    TokenDelta("r1", (8,), "", 2, "stop"),
    TokenDelta("r1", (8,), "x", 3, None, (), 1),
    TokenDelta("r1", (8,), "x", 3, None, (), 1, kv_cache_usage=0.25),
    TokenDelta("r1", (9,), "", 4, "stop", stop_reason=9),
    TokenDelta("r1", (9,), "", 4, "stop", stop_reason="END"),
    Abort("r1"),
]


def wire(frames):
    """What a receiver holds: bytes, as ZeroMQ hands them over."""
    return [bytes(f) for f in frames]


def fields(message):
    return {name: getattr(message, name) for name in message.__struct_fields__}


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    back = decode(wire(encode(message)))
    assert type(back) is type(message)
    for name, value in fields(message).items():
        if isinstance(value, torch.Tensor):
            assert getattr(back, name).dtype == value.dtype
            assert torch.equal(getattr(back, name), value)
        else:
            assert getattr(back, name) == value


def test_tensors_travel_outside_the_header():
    frames = encode(MESSAGES[1])
    assert len(frames) == 2 and len(frames[0]) < 100
    assert frames[1].nbytes == 800 * 16 * 4
    tag, _, _, _, ref = msgspec.msgpack.decode(frames[0])
    assert tag == "ImageEmbeddings" and ref == [1, "float32", [800, 16]]


def test_tensor_frames_are_not_copied():
    tensor = torch.randn(64, 8)
    header, frame = encode(ImageEmbeddings("r", 0, ((16, 16),), tensor))
    assert np.frombuffer(frame, dtype=np.uint8).ctypes.data == tensor.data_ptr()
    assert decode([header, frame]).embeddings.data_ptr() == tensor.data_ptr()


def test_numpy_grids_never_reach_a_header():
    """The production bug: an encoder that put NumPy objects in a header cannot send them."""
    grids = ((np.int64(40), np.int64(60)),)
    with pytest.raises(TypeError, match="int64 cannot travel"):
        encode(ImageEmbeddings("r", 0, grids, torch.zeros(600, 4)))  # type: ignore[arg-type]


def test_a_header_no_peer_would_take_is_refused_when_sent_not_silently_there():
    """Each field is bounded, not their sum: 16 choices' logprobs of 4096-character tokens."""
    long = TokenLogprob("x" * 4096, -0.5, (120,))
    handoff = msgspec.structs.replace(
        MESSAGES[3],
        first_tokens=(7,) * 16,
        first_logprobs=(long,) * 16,
        sampling=SamplingParams(32, n=16, logprobs=True),
        rng_states=RNG.expand(16, -1).contiguous(),
    )
    with pytest.raises(WireError, match=r"header is over the 65536 a peer takes"):
        encode(handoff)
    images = EncodeRequest("r1", 0, (b"\x89PNG" + bytes(1 << 17),), (0,), "tcp://127.0.0.1:1")
    assert len(encode(images)[0]) > 1 << 17  # files travel in the header, bounded by encode


def header(*items) -> bytes:
    return msgspec.msgpack.encode(list(items))


def test_fields_of_the_wrong_type_are_refused():
    with pytest.raises(WireError, match=r"Expected `str`, got `int` - at `\$\[2\]`"):
        decode([header("Failure", "r", 3, "x")])


def test_extra_and_missing_fields_are_refused():
    with pytest.raises(WireError, match="at most length 1, got 2"):
        decode([header("Abort", "r", "payload")])
    with pytest.raises(WireError, match="at least length 4, got 3"):
        decode([header("Failure", "r", "internal")])


def test_nested_values_are_checked():
    sampling = ["many", 1.0, 1.0, 0, None, [], False, 0]
    with pytest.raises(WireError, match=r"at `\$\[6\]\[0\]`"):
        decode([header("KVHandoff", "r", "tcp://a:1", 1, [0], [None], sampling, None, None, None)])


@pytest.mark.parametrize(
    "ref,pattern",
    [
        ([1, "float32", [5, 4]], "has 64 bytes"),
        ([2, "float32", [4, 4]], "bad tensor reference"),
        ([0, "float32", [4, 4]], "bad tensor reference"),
        ([1, "object", [4, 4]], "bad tensor reference"),
        ([1, "float32", [-4, -4]], "bad tensor shape"),
        ([1, "float32", [0, 2**60]], "bad tensor shape"),
        ([1, "float32", [1] * 9 + [16]], "length <= 8"),
        ([1, "float32"], "at least length 3"),
        ("a tensor", "Expected `array`"),
    ],
)
def test_bad_tensor_references_are_refused(ref, pattern):
    with pytest.raises(WireError, match=pattern):
        decode([header("ImageEmbeddings", "r", 0, [[2, 2]], ref), bytes(64)])


def test_every_frame_belongs_to_exactly_one_tensor():
    good = wire(encode(MESSAGES[1]))
    with pytest.raises(WireError, match="2 frames for 1 tensors"):
        decode([*good, bytes(8)])
    ref = [1, "uint8", [4]]
    both = header("KVHandoff", "r", "", 1, [0], [None], [4], ref, ref, [2, "int64", [1]])
    with pytest.raises(WireError, match="bad tensor reference"):
        decode([both, bytes(4), bytes(8)])


def test_an_empty_tensor_torch_cannot_lay_out_is_refused():
    """(2**47, 2**47, 0) holds no element, as its empty frame says, but its non-zero dims span
    more than torch can address: refused as a bad shape, not raised from torch."""
    ref = [1, "float32", [2**47, 2**47, 0]]
    with pytest.raises(WireError, match="bad tensor shape"):
        decode([header("ImageEmbeddings", "r", 0, [[2, 2]], ref), b""])
