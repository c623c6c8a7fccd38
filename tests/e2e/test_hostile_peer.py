"""A hostile peer and a dead one, against real processes while honest streams run.

The cluster's encode and decode reply to any port of loopback and of 192.0.2.0/24 (`--prefills`
as a Kubernetes config names a pod network), so the attacker can name addresses it owns,
addresses that refuse connections (loopback ports nobody serves) and addresses that never answer
(192.0.2.0/24 is reserved for documentation: nothing there replies); and every ZeroMQ socket
redials a lost peer every millisecond instead of every 100, so an outage fills whatever it can
fill a hundred times faster.
"""

import base64
import pickle
import signal
import subprocess
import sys
import threading
import time

import msgspec
import openai
import pytest
import torch
import zmq
from PIL import Image

from epd.checkpoint.config import load_model_config
from epd.generation.params import SamplingParams
from epd.wire.codec import decode, encode
from epd.wire.messages import EncodeRequest, Failure, ImageEmbeddings, KVHandoff
from tests.wire import zmtp
from tests.wire.test_hostile_headers import MESSAGE_PACKS, PICKLES

from . import stack
from .stack import cluster, data_url, image_part, role, text_part, usage

ENV = {"EPD_ZMQ_RECONNECT_MS": "1"}  # every lost peer redialled each millisecond
PREFILLS = ("tcp://127.0.0.1:*", "tcp://192.0.2.0/24:*")
CASES = {
    "text": [{"role": "user", "content": "Tell me about shapes"}],
    "image": [
        {
            "role": "user",
            "content": [image_part(data_url(Image.new("RGB", (84, 56), "red"))), text_part("?")],
        }
    ],
}
PARAMS = {"max_tokens": 40, "temperature": 0}
CORPUS = [[p.values[0]] for p in PICKLES] + [[m] for m in MESSAGE_PACKS.values()]
# Junk messages a raw ZMTP peer sends each role, a ping after each, before it resets: libzmq
# 4.3.5 aborted a role whose receive limit this filled (tests/wire/test_transport.py).
RAW = 500
PNG = base64.b64decode(data_url(Image.new("RGB", (28, 28), "blue")).split(",")[1])


@pytest.fixture(scope="module")
def three(tiny_checkpoint):
    with cluster(tiny_checkpoint, PREFILLS, ENV) as started:
        yield started


@pytest.fixture(scope="module")
def expected(local):
    return {
        case: local.chat({"model": "tiny", "messages": m, **PARAMS}).text
        for case, m in CASES.items()
    }


def health(base: int) -> dict[str, tuple[int, dict]]:
    """Every role's GET /health: (status, body)."""
    ports = {"encode": base + 10, "prefill": base + 20, "decode": base + 12}
    return {name: stack.health(port) for name, port in ports.items()}


def refusals(base: int) -> dict[str, int]:
    return {name: body["refused_messages"] for name, (_, body) in health(base).items()}


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before[name] for name in after}


def eventually(check, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


class Honest:
    """Greedy streams, one thread per case, repeated until stopped: texts and inter-chunk gaps."""

    def __init__(self, client: openai.OpenAI) -> None:
        self.client, self.stop = client, threading.Event()
        self.texts: list[tuple[str, str]] = []
        self.gaps: list[float] = []
        self.errors: list[Exception] = []
        self.threads = [threading.Thread(target=self.run, args=(c,)) for c in CASES for _ in (0, 1)]

    def __enter__(self) -> "Honest":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(120)

    def run(self, case: str) -> None:
        while not self.stop.is_set():
            try:
                self.texts.append((case, self.one(case)))
            except Exception as e:
                self.errors.append(e)

    def one(self, case: str) -> str:
        text, last = "", None
        stream = self.client.chat.completions.create(
            model="tiny", messages=CASES[case], stream=True, **PARAMS
        )
        for chunk in stream:
            now = time.monotonic()
            if last is not None:
                self.gaps.append(now - last)
            last = now
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        return text


def frames(message) -> list[bytes]:
    return [bytes(f) for f in encode(message)]


def push(port: int, messages: list[list[bytes]], linger_ms: int = 2000) -> None:
    """Send raw multipart messages to a role's ZeroMQ port, as anyone on the network can."""
    context = zmq.Context()
    sender = context.socket(zmq.PUSH)
    sender.setsockopt(zmq.SNDHWM, 0)
    sender.connect(f"tcp://127.0.0.1:{port}")
    for message in messages:
        sender.send_multipart(message)
    sender.close(linger=linger_ms)
    context.term()


def edited(message, index: int, value) -> list[bytes]:
    """A message's frames with field `index` of its header replaced (values, not types, bad)."""
    frames = [bytes(f) for f in encode(message)]
    header = msgspec.msgpack.decode(frames[0])
    if isinstance(index, tuple):
        header[index[0]][index[1]] = value
    else:
        header[index] = value
    return [msgspec.msgpack.encode(header), *frames[1:]]


def handoff(checkpoint, request_id: str, reply_to: str, max_tokens: int = 300) -> KVHandoff:
    text = load_model_config(checkpoint).text
    return KVHandoff(
        request_id,
        reply_to,
        prompt_tokens=4,
        first_tokens=(7,),
        first_logprobs=(None,),
        sampling=SamplingParams(max_tokens, temperature=0),
        rng_states=torch.Generator().manual_seed(0).get_state()[None],
        cache=torch.randn(text.num_hidden_layers, 4, text.latent_dim),
        prompt_ids=torch.tensor([5, 6, 7, 8]),
    )


def poisoned_handoffs(checkpoint) -> list[list[bytes]]:
    good = handoff(checkpoint, "poisoned", "tcp://127.0.0.1:9")
    nan_cache = good.cache.clone()
    nan_cache[0, 0, 0] = float("nan")
    fields = SamplingParams.__struct_fields__
    bad = [
        ("temperature", float("nan")),
        ("top_p", float("nan")),
        ("top_p", 0.0),
        ("top_k", -5),
        ("top_logprobs", 5000),
        ("presence_penalty", float("nan")),
        ("repetition_penalty", 1e-30),  # would overflow every logit it divides
        ("logit_bias", [[3, float("inf")]]),
        ("stop_token_ids", [10**9]),  # outside the vocabulary
    ]
    frames = [edited(good, (6, fields.index(name)), value) for name, value in bad]
    header, rng, _, ids, hashes = [bytes(f) for f in encode(good)]
    frames.append([header, rng, nan_cache.numpy().tobytes(), ids, hashes])
    frames.append([header, rng, (nan_cache / 0).numpy().tobytes(), ids, hashes])
    outside = torch.tensor([5, 6, 7, 10**9]).numpy().tobytes()  # a prompt id past the vocabulary
    frames.append([header, rng, good.cache.numpy().tobytes(), outside, hashes])
    return frames


def attack(base: int, checkpoint: str) -> list[tuple[int, list[list[bytes]]]]:
    """Everything a hostile peer sends, as (port, messages), built before it is sent."""
    files = (PNG,)
    leaks = [EncodeRequest("far", 0, files, (0,), "tcp://10.9.9.9:7102")] + [
        EncodeRequest(f"leak-{i}", 0, files, (0,), f"tcp://127.0.0.1:{2000 + i}")
        for i in range(300)
    ]
    dead = [handoff(checkpoint, f"dead-{i}", f"tcp://127.0.0.1:{i + 1}") for i in range(15)]
    dead += [handoff(checkpoint, f"void-{i}", f"tcp://192.0.2.{i + 1}:7102") for i in range(15)]
    unclaimed = ImageEmbeddings("unknown", 0, ((40, 60),), torch.randn(600, 64))
    return [
        *((port, CORPUS) for port in (base, base + 1, base + 2)),
        (base + 2, poisoned_handoffs(checkpoint)),
        (base + 2, [frames(h) for h in dead]),
        (base, [frames(r) for r in leaks]),
        (base + 1, [[bytes(500 << 20)]]),
        (base + 1, [frames(unclaimed)] * 20),
    ]


# The attacker: a process of its own (as on another host) that only sends what it is given.
SENDER = """
import pickle, sys, zmq
context = zmq.Context()
for port, messages in pickle.load(sys.stdin.buffer):
    sender = context.socket(zmq.PUSH)
    sender.setsockopt(zmq.SNDHWM, 0)
    sender.connect(f"tcp://127.0.0.1:{port}")
    for message in messages:
        sender.send_multipart(message)
    sender.close(linger=2000)
context.term()
"""


def test_hostile_and_dead_peers_hurt_no_honest_request(three, expected, tiny_checkpoint):
    _, client, base = three
    pids = {name: body["pid"] for name, (_, body) in health(base).items()}
    for case in CASES:  # warm up, so the baseline below includes what serving always holds
        client.chat.completions.create(model="tiny", messages=CASES[case], **PARAMS)
    mine = zmq.Context().socket(zmq.PULL)  # an address of ours that decode may reply to
    mine_port = mine.bind_to_random_port("tcp://127.0.0.1")
    too_long = handoff(tiny_checkpoint, "too-long", f"tcp://127.0.0.1:{mine_port}", 10**6)
    push(base + 2, [[bytes(f) for f in encode(too_long)]])
    assert mine.poll(5000)  # refused with a Failure, which only a real peer can hear
    failure = decode(mine.recv_multipart())
    assert isinstance(failure, Failure) and "exceed the context length" in failure.message
    mine.close(linger=0)
    before = {name: usage(pid) for name, pid in pids.items()}
    refused = refusals(base)

    messages = pickle.dumps(attack(base, str(tiny_checkpoint)))
    with Honest(client) as honest:
        attacker = subprocess.run(
            [sys.executable, "-c", SENDER], input=messages, capture_output=True, timeout=120
        )
        for port in (base, base + 1, base + 2):  # by hand: pings among junk, then a reset
            zmtp.flood_and_reset(port, "PUSH", RAW, pause_s=0.5)  # all read before it
        time.sleep(3)  # the dead peers time out while the honest streams go on
        assert all(status == 200 for status, _ in health(base).values())

    assert not honest.errors, honest.errors[:3]
    assert {case for case, _ in honest.texts} == set(CASES)
    assert all(text == expected[case] for case, text in honest.texts)
    assert max(honest.gaps) < 1.0, f"a stream stalled for {max(honest.gaps):.2f}s"
    assert attacker.returncode == 0, attacker.stderr
    # Each malformed message, plus encode's request from an address that is not a prefill.
    expected_refusals = {
        "encode": len(CORPUS) + RAW + 1,
        "prefill": len(CORPUS) + RAW,
        "decode": len(CORPUS) + RAW + 10,
    }
    assert eventually(lambda: delta(refusals(base), refused) == expected_refusals)
    # (Its log line may be among those a flood of refusals leaves out: a few a second.)

    deadline = time.monotonic() + 20  # encode works through its queue, dead peers time out
    while time.monotonic() < deadline:
        after = {name: usage(pid) for name, pid in pids.items()}
        if all(after[n][1] <= before[n][1] + 2 for n in pids):
            break
        time.sleep(0.5)
    for name in pids:
        (rss_before, fds_before), (rss_after, fds_after) = before[name], after[name]
        assert fds_after <= fds_before + 2, f"{name}: {fds_before} → {fds_after} descriptors"
        grown = (rss_after - rss_before) >> 20
        assert grown < 64, f"{name} grew by {grown} MiB"
    assert health(base)["decode"][1]["running"] == 0  # the dead peers' requests were dropped


def test_encode_and_decode_serve_again_after_a_long_prefill_outage(three, tiny_checkpoint):
    """With every lost peer redialled each millisecond, 5 s down is 5000 failed redials per
    socket; libzmq froze a process for good once 2000 of their events had queued."""
    processes, client, base = three
    client.chat.completions.create(model="tiny", messages=CASES["image"], max_tokens=2)
    processes["prefill"].popen.send_signal(signal.SIGKILL)
    processes["prefill"].popen.wait()
    time.sleep(5)
    processes["prefill"] = role("prefill", tiny_checkpoint, base, env=ENV).wait_ready()
    for case in CASES:
        reply = client.chat.completions.create(
            model="tiny", messages=CASES[case], max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert reply.usage.completion_tokens == 3
    assert all(status == 200 for status, _ in health(base).values())
