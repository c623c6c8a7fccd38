"""The codec: round trips of every message, and refusal of every crafted header."""

import builtins
import os
import pickle
import pickletools

import numpy as np
import pytest
import torch

from epd.wire.codec import TensorRef, WireError, decode, encode
from epd.wire.messages import (
    Abort,
    EncodeRequest,
    Failure,
    ImageEmbeddings,
    KVHandoff,
    SamplingParams,
    TokenDelta,
    TokenLogprob,
    TopLogprob,
)

LOGPROB = TokenLogprob("hi", -0.5, (104, 105), (TopLogprob("hi", -0.5, (104, 105)),))
MESSAGES = [
    EncodeRequest("r1", 0, 2, (b"\x89PNG...", b"GIF89a"), 0, "tcp://127.0.0.1:1"),
    ImageEmbeddings("r1", 1, ((40, 60), (20, 40)), torch.randn(800, 16)),
    Failure("r1", "bad_image", "image 1: corrupt"),
    KVHandoff(
        "r1",
        "tcp://127.0.0.1:1",
        13,
        7,
        LOGPROB,
        SamplingParams(32, 0.7, 0.9, 5, 1234, ("\n\n",), True, 1),
        torch.Generator().manual_seed(3).get_state(),
        torch.randn(3, 13, 40).to(torch.bfloat16),
    ),
    TokenDelta("r1", (7,), "hi", 1, None, (LOGPROB,)),
    TokenDelta("r1", (8,), "", 2, "stop"),
    Abort("r1"),
]


def wire(frames):
    """What a receiver holds: bytes, as ZeroMQ hands them over."""
    return [bytes(f) for f in frames]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    back = decode(wire(encode(message)))
    assert type(back) is type(message)
    for name, value in vars(message).items():
        if isinstance(value, torch.Tensor):
            assert back.__dict__[name].dtype == value.dtype
            assert torch.equal(back.__dict__[name], value)
        else:
            assert back.__dict__[name] == value


def test_tensors_travel_outside_the_header():
    frames = encode(MESSAGES[1])
    assert len(frames) == 2 and len(frames[0]) < 1000
    assert frames[1].nbytes == 800 * 16 * 4
    assert isinstance(pickle.loads(frames[0]).embeddings, TensorRef)


def test_tensor_frames_are_not_copied():
    tensor = torch.randn(64, 8)
    header, frame = encode(ImageEmbeddings("r", 0, ((16, 16),), tensor))
    assert np.frombuffer(frame, dtype=np.uint8).ctypes.data == tensor.data_ptr()
    assert decode([header, frame]).embeddings.data_ptr() == tensor.data_ptr()


def test_numpy_grids_never_reach_a_header():
    """The production bug: an encoder that put NumPy objects in the header is refused."""
    frames = encode(ImageEmbeddings("r", 0, ((np.int64(40), np.int64(60)),), torch.zeros(600, 4)))
    with pytest.raises(WireError, match="numpy"):
        decode(wire(frames))


class Reduce:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def crafted(obj) -> bytes:
    return pickle.dumps(obj, protocol=5)


@pytest.mark.parametrize(
    "header,pattern",
    [
        (crafted(Reduce(os.system, "echo pwned")), r"posix\.system|nt\.system"),
        (crafted(Reduce(builtins.eval, "1+1")), r"builtins\.eval"),
        (crafted(Reduce(builtins.getattr, "text", "upper")), r"builtins\.getattr"),
        (crafted(Reduce(builtins.__import__, "os")), r"builtins\.__import__"),
        (crafted(np.zeros(3)), "numpy"),
        (crafted(torch.zeros(3)), "torch"),
        (crafted(torch.zeros(3).untyped_storage()), "torch"),
        (crafted(Reduce(pickletools.dis, b"")), "pickletools"),
        (crafted({"request_id": "x"}), "not a message"),
        (b"\x80\x05garbage", "unreadable header"),
        (b"", "unreadable header"),
    ],
)
def test_crafted_headers_are_refused(header, pattern):
    with pytest.raises(WireError, match=pattern):
        decode([header])


def test_fields_of_the_wrong_type_are_refused():
    bad = Failure("r", "internal", "x")
    object.__setattr__(bad, "code", 3)
    with pytest.raises(WireError, match=r"Failure\.code is a int"):
        decode(wire(encode(bad)))


def test_extra_attributes_are_refused():
    bad = Abort("r")
    object.__setattr__(bad, "payload", "x")
    with pytest.raises(WireError, match="not a well-formed Abort"):
        decode([pickle.dumps(bad, protocol=5)])


def test_nested_values_are_checked():
    bad = KVHandoff(*[getattr(MESSAGES[3], n) for n in vars(MESSAGES[3])])
    object.__setattr__(bad, "sampling", SamplingParams(max_tokens="many"))  # type: ignore[arg-type]
    with pytest.raises(WireError, match=r"sampling\.max_tokens"):
        decode(wire(encode(bad)))


@pytest.mark.parametrize(
    "ref,pattern",
    [
        (TensorRef(1, "float32", (5, 4)), "holds 64 bytes"),
        (TensorRef(2, "float32", (4, 4)), "bad tensor reference"),
        (TensorRef(0, "float32", (4, 4)), "bad tensor reference"),
        (TensorRef(1, "object", (4, 4)), "bad tensor reference"),
        (TensorRef(1, "float32", (-4, -4)), "bad tensor shape"),
        (TensorRef(1, "float32", (0, 2**70)), "bad tensor shape"),
        (TensorRef(1, "float32", (1,) * 9 + (16,)), "bad tensor shape"),
    ],
)
def test_bad_tensor_references_are_refused(ref, pattern):
    header = pickle.dumps(ImageEmbeddings("r", 0, ((2, 2),), ref), protocol=5)  # type: ignore[arg-type]
    with pytest.raises(WireError, match=pattern):
        decode([header, bytes(64)])


def test_tensor_field_without_a_frame_is_refused():
    header = pickle.dumps(ImageEmbeddings("r", 0, ((2, 2),), "not a tensor"), protocol=5)  # type: ignore[arg-type]
    with pytest.raises(WireError, match="embeddings is a str"):
        decode([header])


def test_shared_references_cost_one_check():
    """Thousands of references to one object must not be checked thousands of times each."""
    import time

    top = TopLogprob("x", -1.0, (1,) * 100)
    entry = TokenLogprob("x", -1.0, (1,), (top,) * 3000)
    header = pickle.dumps(TokenDelta("r", (1,), "x", 1, None, (entry,) * 3000), protocol=5)
    assert len(header) < 100_000
    start = time.monotonic()
    decode([header])
    assert time.monotonic() - start < 1.0


def test_a_bad_item_is_refused_even_after_a_good_reference_to_it():
    bad = TokenLogprob("x", -1.0, (1,), ())
    object.__setattr__(bad, "logprob", "high")
    header = pickle.dumps(TokenDelta("r", (1,), "x", 1, None, (bad, bad)), protocol=5)
    with pytest.raises(WireError, match=r"logprobs\[0\]\.logprob"):
        decode([header])
