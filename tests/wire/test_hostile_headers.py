"""A corpus of hostile headers: every one is refused, and nothing in the process changes.

The pickle attacks are the ones that beat allow-list unpicklers (BUILD on an allowed class is a
setattr on it; INST/OBJ/NEWOBJ_EX/REDUCE build or call; memo reuse mutates a shared object;
bombs exhaust memory or the stack), written opcode by opcode for every protocol that has the
opcode. The MessagePack attacks aim at the decoder that replaced it.
"""

import builtins
import os
import struct
import subprocess
import sys
import tempfile
import time
import uuid

import msgspec
import pytest
import torch

from epd.wire import codec, messages, transport
from epd.wire.codec import WireError, decode

TARGET = ("epd.wire.messages", "SamplingParams")  # an allowed class under the old unpickler
PWNED = os.path.join(tempfile.gettempdir(), f"epd-pwned-{uuid.uuid4().hex}")  # os.system's mark


class Pickle:
    """Writes pickle opcodes for one protocol (0-5)."""

    def __init__(self, protocol: int) -> None:
        self.protocol = protocol
        self.out = b"\x80" + bytes([protocol]) if protocol >= 2 else b""

    def op(self, raw: bytes) -> "Pickle":
        self.out += raw
        return self

    def str(self, text: str) -> "Pickle":
        data = text.encode()
        if self.protocol == 0:
            return self.op(b"V" + data + b"\n")
        return self.op(b"X" + struct.pack("<I", len(data)) + data)

    def glob(self, module: str, name: str) -> "Pickle":
        if self.protocol >= 4:
            return self.str(module).str(name).op(b"\x93")  # STACK_GLOBAL
        return self.op(b"c" + module.encode() + b"\n" + name.encode() + b"\n")

    def dict(self, **items: object) -> "Pickle":
        self.op(b"(d" if self.protocol == 0 else b"}")
        for key, value in items.items():
            self.str(key)
            self.op(b"N") if value is None else self.str(str(value))
            self.op(b"s")
        return self

    def tuple(self, build) -> "Pickle":
        self.op(b"(")
        build(self)
        return self.op(b"t")

    def done(self) -> bytes:
        return self.out + b"."


def build_on_class(p: Pickle) -> bytes:
    """BUILD (None, {"__init__": None}) on a class object: setattr on the class."""
    p.glob(*TARGET).tuple(lambda p: p.op(b"N").dict(__init__=None))
    return p.op(b"b0").glob("epd.wire.messages", "Abort").done()


def build_on_shared_instance(p: Pickle) -> bytes:
    """BUILD on a module-level object: silence the logger that reports refusals."""
    p.glob("epd.wire.transport", "log").dict(disabled="1")
    return p.op(b"b").done()


def inst(p: Pickle) -> bytes:
    return p.op(b"(").str("r").op(b"iepd.wire.messages\nAbort\n").done()


def obj(p: Pickle) -> bytes:
    return p.op(b"(").glob("epd.wire.messages", "Abort").str("r").op(b"o").done()


def newobj_ex(p: Pickle) -> bytes:
    p.glob("epd.wire.messages", "Abort").op(b")").dict(request_id="r", __class__="os.system")
    return p.op(b"\x92").done()


def reduce_with_wrong_arguments(p: Pickle) -> bytes:
    return p.glob(*TARGET).tuple(lambda p: p.str("many")).op(b"R").done()


def reduce_os_system(p: Pickle) -> bytes:
    return p.glob("os", "system").tuple(lambda p: p.str(f"touch {PWNED}")).op(b"R").done()


def memo_reuse(p: Pickle) -> bytes:
    """Place a memoised list in the result, then change it through the memo: a shared object
    mutated after any check of the place it was put."""
    put, get = (b"p0\n", b"g0\n") if p.protocol == 0 else (b"q\x00", b"h\x00")
    p.op(b"(l" if p.protocol == 0 else b"]").op(put).op(b"(" + get + b"t")
    return p.op(get).str("forged").op(b"a0").done()


def recursion_bomb(p: Pickle) -> bytes:
    return p.op(b"(" * 200_000 + b"t" * 200_000).done()


def width_bomb(p: Pickle) -> bytes:
    """One list, memoised, referenced a million times: tiny on the wire, huge once expanded."""
    put, get = (b"p0\n", b"g0\n") if p.protocol == 0 else (b"q\x00", b"h\x00")
    p.op(b"(l" if p.protocol == 0 else b"]").op(put).op(b"(")
    return p.op(get * 1_000_000).op(b"l" if p.protocol == 0 else b"t").done()


def huge_lengths(p: Pickle) -> bytes:
    if p.protocol == 0:
        return p.op(b"S'" + b"a" * 100).done()  # a string that never ends
    return p.op(b"X\xff\xff\xff\xff" + b"a" * 100).done()


def huge_frame(p: Pickle) -> bytes:
    return p.op(b"\x95" + struct.pack("<Q", 2**63) + b"N").done()


ATTACKS = {
    build_on_class: range(6),
    build_on_shared_instance: range(6),
    inst: [0],
    obj: range(1, 6),
    newobj_ex: [4, 5],
    reduce_with_wrong_arguments: range(6),
    reduce_os_system: range(6),
    memo_reuse: range(6),
    recursion_bomb: range(6),
    width_bomb: range(6),
    huge_lengths: range(6),
    huge_frame: [4, 5],
}
PICKLES = [
    pytest.param(attack(Pickle(protocol)), id=f"{attack.__name__}-protocol{protocol}")
    for attack, protocols in ATTACKS.items()
    for protocol in protocols
]


def msgpack(*items) -> bytes:
    return msgspec.msgpack.encode(list(items))


SAMPLING = [8, 1.0, 1.0, 0, None, [], False, 0]
MESSAGE_PACKS = {
    "not a message type": msgpack("SamplingParams", *SAMPLING),
    "the codec's own type": msgpack("TensorRef", 1, "float32", [1]),
    "the message base class": msgpack("WireMessage", "r"),
    "an unknown type": msgpack("Exploit", "r"),
    "no type": msgspec.msgpack.encode({"request_id": "r"}),
    "an extension type": msgspec.msgpack.encode(["Abort", msgspec.msgpack.Ext(1, b"os.system")]),
    "a timestamp for a string": msgspec.msgpack.encode(["Abort", msgspec.msgpack.Ext(-1, b"\0")]),
    "nesting a hundred thousand deep": b"\x92\xa5Abort" + b"\x91" * 100_000 + b"\xa1r",
    "a million nils for token ids": b"\x93\xaaTokenDelta\xa1r\xdd\x00\x0f\x42\x40"
    + b"\xc0" * 10**6,
    "an array declaring 4 billion items": b"\xdd\xff\xff\xff\xff" + b"\xc0" * 100,
    "a map declaring 4 billion items": b"\xdf\xff\xff\xff\xff" + b"\xc0" * 100,
    "a string declaring 4 GB": b"\x92\xa5Abort\xdb\xff\xff\xff\xff" + b"a" * 100,
    "bytes declaring 4 GB": b"\x92\xa5Abort\xc6\xff\xff\xff\xff" + b"a" * 100,
    "a bool for an int": msgpack("Failure", "r", True, "x"),
    "a float for an int": msgpack("TokenDelta", "r", [1.0], "x", 1),
    "bad UTF-8": b"\x92\xa5Abort\xa2\xff\xfe",
    "trailing bytes": msgpack("Abort", "r") + b"\x00",
    "empty": b"",
    "a header over 64 KiB": msgpack("Failure", "r", "internal", "x" * 70_000),
    "a map where a tensor goes": msgpack(
        "ImageEmbeddings", "r", 0, [[2, 2]], {i: i for i in range(5000)}
    ),
    "a ten-thousand-character request id": msgpack("Abort", "r" * 10_000),
    "a thousand token ids": msgpack("TokenDelta", "r", list(range(1000)), "x", 1000),
}


def state() -> dict[str, dict[str, int]]:
    """Every namespace a hostile header could want to change, as {name: id(value)}."""
    spaces = {m.__name__: vars(m) for m in (messages, codec, transport, builtins, os, torch)}
    for module in (messages, codec):
        for name, value in vars(module).items():
            if isinstance(value, type) and value.__module__ == module.__name__:
                spaces[f"{module.__name__}.{name}"] = dict(vars(value))
    spaces["logger"] = dict(vars(transport.log))
    return {name: {k: id(v) for k, v in space.items()} for name, space in spaces.items()}


@pytest.fixture
def unchanged():
    before = state()
    yield
    assert state() == before
    assert not os.path.exists(PWNED)


@pytest.mark.parametrize("payload", PICKLES)
def test_hostile_pickles_are_refused_and_change_nothing(payload, unchanged):
    start = time.monotonic()
    with pytest.raises(WireError):
        decode([payload])
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize("payload", MESSAGE_PACKS.values(), ids=MESSAGE_PACKS.keys())
def test_hostile_message_packs_are_refused_and_change_nothing(payload, unchanged):
    start = time.monotonic()
    with pytest.raises(WireError):
        decode([payload])
    assert time.monotonic() - start < 1.0


def test_more_frames_than_a_message_has_tensors_are_refused_unread(unchanged):
    with pytest.raises(WireError, match="1 to 5 frames, not 10000"):
        decode([msgpack("Abort", "r")] + [b"x"] * 9999)


def test_the_corpus_is_hostile_to_a_plain_unpickler():
    """The class-mutation pickle is a real attack: plain pickle, in a separate process, runs it."""
    check = (
        "import pickle, sys; from epd.wire import messages; pickle.loads(sys.stdin.buffer.read()); "
        "print(messages.SamplingParams.__init__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", check], input=build_on_class(Pickle(5)), capture_output=True
    )
    assert result.stdout.strip() == b"None", result.stderr
