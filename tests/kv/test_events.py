"""epd's KV events read by a subscriber written from vLLM's published types, over real ZeroMQ
sockets on loopback: the frames, the sequence numbers, every field, the replay protocol."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq

from epd.config.settings import KV_EVENTS_FIELDS
from epd.kv.events import KVEventsConfig, NoEvents, ZmqKVEvents, open_kv_events, with_port_offset
from epd.kv.publisher import ZmqPublisher
from tests.e2e.stack import ports_free
from tests.wire import zmtp


# The subscriber's side, declared as vLLM's example subscriber declares it
# (examples/features/kv_events/kv_events_subscriber.py), with the batch's data_parallel_rank
# that vLLM's own EventBatch has; nothing of it comes from epd.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
TOPIC = "kv-events"
DIGESTS = [hashlib.sha256(bytes([i])).digest() for i in range(4)]


def as_int(digest: bytes) -> int:
    """vLLM's default event hash: the digest's low 64 bits, big-endian."""
    return int.from_bytes(digest[-8:], "big")


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> BlockStored:
    """What vLLM's block pool sends for Kimi-VL's blocks (one group of MLA layers)."""
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
        kv_cache_spec_kind="mla_attention",
    )


@pytest.fixture
def start() -> Iterator[Callable[..., tuple[ZmqKVEvents, int]]]:
    """Starts a publisher on a free port N (replay on N + 5), closed after the test."""
    made: list[ZmqKVEvents] = []

    def start(replay: bool = False, rank: int = 0, **settings: Any) -> tuple[ZmqKVEvents, int]:
        for _ in range(50):
            port = random.randrange(20000, 30000, 10)  # below the kernel's ephemeral ports
            config = KVEventsConfig(
                enable_kv_cache_events=True,
                endpoint=f"tcp://*:{port}",
                replay_endpoint=f"tcp://*:{port + 5}" if replay else None,
                topic=TOPIC,
                **settings,
            )
            with contextlib.suppress(ValueError):  # a port taken: try another
                made.append(ZmqKVEvents(config, rank))
                return made[-1], port
        raise AssertionError("no free port")

    yield start
    for events in made:
        events.close()


@pytest.fixture
def socket() -> Iterator[Callable[..., zmq.Socket[bytes]]]:
    made: list[zmq.Socket[bytes]] = []

    def socket(kind: int, address: str = "") -> zmq.Socket[bytes]:
        made.append(zmq.Context.instance().socket(kind))
        made[-1].set(zmq.LINGER, 0)
        if address:
            made[-1].connect(address)
        return made[-1]

    yield socket
    for s in made:
        s.close(linger=0)


def probe(events: ZmqKVEvents, sub: zmq.Socket[bytes]) -> int:
    """Sends one-event batches until the subscriber has one (a PUB socket drops what it sends
    before a subscription reaches it: ZeroMQ's slow joiner); the sequence of the last sent."""
    deadline, last = time.monotonic() + 10, -1
    while time.monotonic() < deadline:
        events.cleared()
        events.flush()
        last += 1
        if sub.poll(50):
            return last
    raise AssertionError("the subscriber received nothing")


def receive_after(sub: zmq.Socket[bytes], sequence: int) -> list[bytes]:
    """The next message past `sequence`, the probes before it skipped."""
    while True:
        assert sub.poll(5000), "no message"
        frames = sub.recv_multipart()
        if int.from_bytes(frames[1], "big") > sequence:
            return frames


def replay(dealer: zmq.Socket[bytes], start: int) -> list[tuple[bytes, int, bytes]]:
    """One replay request as vLLM's clients send it: [topic, sequence, payload] answers."""
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    answers = []
    while True:
        assert dealer.poll(5000), "no end marker"
        empty, topic, sequence, payload = dealer.recv_multipart()
        assert empty == b""
        if sequence == END_SEQ:
            assert topic == payload == b""
            return answers
        answers.append((topic, int.from_bytes(sequence, "big"), payload))


def replay_through(dealer: zmq.Socket[bytes], start: int, last: int) -> list[tuple[Any, ...]]:
    """The replay from `start` once the publisher's thread has sent batch `last`."""
    deadline = time.monotonic() + 10
    while True:
        answers = replay(dealer, start)
        if answers and answers[-1][1] == last:
            return answers
        assert time.monotonic() < deadline, f"batch {last} never sent: {answers}"
        time.sleep(0.01)


@pytest.mark.parametrize("publisher_binds", [True, False])
def test_a_vllm_subscriber_reads_each_steps_batch(start, socket, publisher_binds):
    sub = socket(zmq.SUB)
    sub.subscribe(TOPIC)
    if publisher_binds:  # tcp://*:N binds, as in vLLM
        events, port = start()
        sub.connect(f"tcp://127.0.0.1:{port}")
    else:  # tcp://127.0.0.1:N connects, as in vLLM: to a subscriber that binds
        port = sub.bind_to_random_port("tcp://127.0.0.1", 20000, 30000)
        config = KVEventsConfig(True, endpoint=f"tcp://127.0.0.1:{port}", topic=TOPIC)
        events = ZmqKVEvents(config)
    last_probe = probe(events, sub)
    events.stored(DIGESTS[:2], None, list(range(100, 132)), 16)
    events.removed([DIGESTS[3]])
    events.flush()
    events.stored([DIGESTS[2]], DIGESTS[1], list(range(132, 148)), 16)
    events.cleared()
    events.flush()
    events.flush()  # nothing recorded since: nothing sent
    first, second = receive_after(sub, last_probe), receive_after(sub, last_probe)
    assert not sub.poll(100)
    events.close()

    assert [first[:2], second[:2]] == [
        [TOPIC.encode(), (last_probe + 1).to_bytes(8, "big")],
        [TOPIC.encode(), (last_probe + 2).to_bytes(8, "big")],
    ]
    one, two = DECODER.decode(first[2]), DECODER.decode(second[2])
    assert one.data_parallel_rank == two.data_parallel_rank == 0
    assert abs(one.ts - time.time()) < 60 and one.ts <= two.ts
    assert one.events == [
        stored([as_int(DIGESTS[0]), as_int(DIGESTS[1])], None, list(range(100, 132))),
        BlockRemoved([as_int(DIGESTS[3])], medium="GPU", group_idx=0),
    ]
    assert two.events == [
        stored([as_int(DIGESTS[2])], as_int(DIGESTS[1]), list(range(132, 148))),
        AllBlocksCleared(),
    ]


def test_the_wire_is_a_batch_array_of_event_maps_in_vllms_field_order(start, socket):
    events, port = start(replay=True)
    events.stored([DIGESTS[0]], None, list(range(16)), 16)
    events.removed([DIGESTS[0]])
    events.cleared()
    events.flush()
    [(_, _, payload)] = replay_through(socket(zmq.DEALER, f"tcp://127.0.0.1:{port + 5}"), 0, 0)
    ts, (store, remove, clear), rank = msgspec.msgpack.decode(payload)
    assert isinstance(ts, float) and rank == 0
    assert list(store) == [
        *("type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"),
        *("medium", "lora_name", "group_idx", "kv_cache_spec_kind"),
    ]
    assert remove == {"type": "BlockRemoved", "block_hashes": [as_int(DIGESTS[0])]} | {
        "medium": "GPU",
        "group_idx": 0,
    }
    assert clear == {"type": "AllBlocksCleared"}


def test_replay_gives_the_batches_from_a_sequence_number_then_the_end_marker(start, socket):
    events, port = start(replay=True)
    for i in range(5):
        events.stored([DIGESTS[i % 4]], None, list(range(16)), 16)
        events.flush()
    dealer = socket(zmq.DEALER, f"tcp://127.0.0.1:{port + 5}")

    answers = replay_through(dealer, 0, 4)
    numbered = [(topic, sequence) for topic, sequence, _ in answers]
    assert numbered == [(TOPIC.encode(), n) for n in range(5)]  # from 0, as vLLM's
    hashes = [DECODER.decode(payload).events[0].block_hashes for *_, payload in answers]
    assert hashes == [[as_int(DIGESTS[i % 4])] for i in range(5)]
    assert [sequence for _, sequence, _ in replay(dealer, 3)] == [3, 4]
    assert replay(dealer, 5) == []  # the end marker alone


def test_replay_keeps_the_last_buffer_steps_batches(start, socket):
    events, port = start(replay=True, buffer_steps=3)
    for _ in range(5):
        events.cleared()
        events.flush()
    answers = replay_through(socket(zmq.DEALER, f"tcp://127.0.0.1:{port + 5}"), 0, 4)
    assert [sequence for _, sequence, _ in answers] == [2, 3, 4]


def test_a_data_parallel_rank_moves_both_ports_and_tags_its_batches(start, socket):
    events, port = start(replay=True, rank=2)
    sub = socket(zmq.SUB, f"tcp://127.0.0.1:{port + 2}")
    sub.subscribe(b"")
    last = probe(events, sub)
    answers = replay_through(socket(zmq.DEALER, f"tcp://127.0.0.1:{port + 7}"), 0, last)
    assert {DECODER.decode(payload).data_parallel_rank for *_, payload in answers} == {2}


def test_block_hashes_are_the_digests_where_vllms_switch_says(start, socket, monkeypatch):
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    events, port = start(replay=True)
    events.stored(DIGESTS[1:3], DIGESTS[0], list(range(32)), 16)
    events.flush()
    [(*_, payload)] = replay_through(socket(zmq.DEALER, f"tcp://127.0.0.1:{port + 5}"), 0, 0)
    [event] = DECODER.decode(payload).events
    assert event.block_hashes == DIGESTS[1:3] and event.parent_block_hash == DIGESTS[0]


def test_a_full_queue_drops_counts_and_never_blocks(start, socket, monkeypatch, caplog):
    stalled, go_on = threading.Event(), threading.Event()
    answer = ZmqPublisher._answer_replays

    def stall(self: ZmqPublisher) -> None:  # holds the publisher's thread before its queue
        stalled.set()
        go_on.wait(10)
        answer(self)

    monkeypatch.setattr(ZmqPublisher, "_answer_replays", stall)
    events, port = start(replay=True, max_queue_size=2)
    assert stalled.wait(10)
    began = time.monotonic()
    for _ in range(5):
        events.cleared()
        events.flush()
    assert time.monotonic() - began < 0.5 and events.dropped == 3
    warned = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert [w.split(" batches")[0] for w in warned] == ["kv events: 1", "kv events: 2"]

    go_on.set()
    dealer = socket(zmq.DEALER, f"tcp://127.0.0.1:{port + 5}")
    replay_through(dealer, 0, 1)  # the queue sent: room again
    events.cleared()
    events.flush()
    answers = replay_through(dealer, 0, 5)
    assert [sequence for _, sequence, _ in answers] == [0, 1, 5]  # the dropped ones a gap


@pytest.mark.parametrize("replay", [False, True])
def test_close_is_prompt_and_frees_the_ports(start, replay):
    events, port = start(replay=replay)
    events.cleared()
    events.flush()
    began = time.monotonic()
    events.close()
    assert time.monotonic() - began < 1
    events.close()  # a second close does nothing
    events.cleared()
    with pytest.raises(RuntimeError, match="after close"):
        events.flush()
    again = KVEventsConfig(
        True,
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{port + 5}" if replay else None,
    )
    deadline = time.monotonic() + 5  # libzmq lets a closed socket's port go a moment later
    while True:
        try:
            ZmqKVEvents(again).close()  # the same ports: the first one's sockets are closed
            return
        except ValueError:
            assert time.monotonic() < deadline, "the ports stay taken"
            time.sleep(0.01)


# A publisher (PUB on the port given, replay ROUTER 5 above) with a high-water mark of 10,
# publishing for 2 s: "alive" if it got there.
PUBLISHING = """
import sys, time
from epd.kv.events import KVEventsConfig, ZmqKVEvents
port = int(sys.argv[1])
events = ZmqKVEvents(KVEventsConfig(True, endpoint=f"tcp://*:{port}",
                                    replay_endpoint=f"tcp://*:{port + 5}", hwm=10))
print("bound", flush=True)
deadline = time.monotonic() + 2
while time.monotonic() < deadline:
    events.cleared()
    events.flush()
    time.sleep(0.01)
print("alive", flush=True)
"""


def test_a_peer_that_floods_and_resets_cannot_abort_the_publisher():
    """What subscribers and replay clients send in has no limit: with the high-water mark as
    its receive limit too, a peer writing ZMTP by hand (tests/wire/zmtp.py) filled it, reset,
    and the process died of SIGABRT at its next publish (checked)."""
    port = zmtp.free_port()
    while not ports_free(port + 5):  # the replay port
        port = zmtp.free_port()
    publisher = subprocess.Popen(
        [sys.executable, "-c", PUBLISHING, str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert publisher.stdout.readline() == "bound\n"
    with contextlib.suppress(ConnectionError):  # a publisher gone: its stderr says why
        for _ in range(2):
            zmtp.flood_and_reset(port, "SUB", 2000, pause_s=0.1)
            zmtp.flood_and_reset(port + 5, "DEALER", 2000, pause_s=0.1)
    out, err = publisher.communicate(timeout=30)
    assert publisher.returncode == 0 and out == "alive\n", err


def test_defaults_are_vllms():
    assert KVEventsConfig.from_json("{}") == KVEventsConfig(
        enable_kv_cache_events=False,
        publisher="null",
        endpoint="tcp://*:5557",
        replay_endpoint=None,
        buffer_steps=10_000,
        hwm=100_000,
        max_queue_size=100_000,
        topic="",
    )
    assert KVEventsConfig.from_json('{"enable_kv_cache_events": true}').publisher == "zmq"
    assert tuple(f.name for f in dataclasses.fields(KVEventsConfig)) == KV_EVENTS_FIELDS


@pytest.mark.parametrize(
    "given,says",
    [
        ('{"enable_kv_cache_events": true, "topc": "x"}', "unknown key topc (vLLM's are enable"),
        ('{"publisher": "kafka"}', "publisher 'kafka': epd publishes with zmq (or null"),
        ('{"enable_kv_cache_events": true, "endpoint": ""}', "endpoint '': events need a ZeroMQ"),
        ('{"enable_kv_cache_events": 1}', "enable_kv_cache_events must be bool"),
        ('{"hwm": "100"}', "hwm must be int"),
        ('{"replay_endpoint": 5558}', "replay_endpoint must be str or null"),
        ('{"buffer_steps": -1}', "buffer_steps must be 0 or more"),
        ('["zmq"]', "must be a JSON object"),
        ("{", "not JSON"),
    ],
)
def test_a_bad_config_is_refused_with_what_is_wrong(given, says):
    with pytest.raises(ValueError, match=f"kv_events_config: .*{re.escape(says)}"):
        KVEventsConfig.from_json(given)


@pytest.mark.parametrize(
    "given",
    ["", '{"enable_kv_cache_events": false, "publisher": "zmq"}', '{"publisher": "null"}'],
)
def test_a_config_that_publishes_nothing_gives_no_events(given):
    events = open_kv_events(given)
    assert isinstance(events, NoEvents)
    events.stored(DIGESTS[:1], None, list(range(16)), 16)
    events.flush()
    events.close()


@pytest.mark.parametrize(
    "endpoint,offset,moved",
    [
        ("tcp://*:5557", 2, "tcp://*:5559"),
        ("tcp://[::1]:5557", 1, "tcp://[::1]:5558"),
        ("ipc:///tmp/kv", 0, "ipc:///tmp/kv"),
    ],
)
def test_with_port_offset_moves_a_tcp_port(endpoint, offset, moved):
    assert with_port_offset(endpoint, offset) == moved


@pytest.mark.parametrize(
    "endpoint,offset,says",
    [
        ("ipc:///tmp/kv", 1, "only a tcp:// endpoint's port"),
        ("tcp://host", 1, "not a tcp://HOST:PORT"),
        ("tcp://*:65535", 1, "not a tcp://HOST:PORT"),
    ],
)
def test_with_port_offset_refuses_what_has_no_port_to_move(endpoint, offset, says):
    with pytest.raises(ValueError, match=says):
        with_port_offset(endpoint, offset)
