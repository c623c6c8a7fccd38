"""The prefills' KV events, published as vLLM publishes them, reach the router's index."""

import subprocess
import sys
import time

import zmq

from epd.kv.events import KVEventsConfig, ZmqKVEvents
from epd.kv.index import BlockIndex, external
from epd.kv.listener import KVEventListener
from tests.wire import zmtp

BLOCKS = [bytes([i]) * 32 for i in range(3)]


def publisher(port: int, topic: str) -> ZmqKVEvents:
    endpoint = f"tcp://127.0.0.1:{port}"  # no *: connected, to the router's socket
    return ZmqKVEvents(KVEventsConfig(True, endpoint=endpoint, topic=topic))


def until(condition, publish, seconds=10.0) -> bool:
    """Publish until the condition holds (a subscriber misses what came before it joined)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        publish()
        time.sleep(0.05)
        if condition():
            return True
    return False


def test_stored_and_removed_blocks_reach_the_index_under_their_prefills_topic():
    port, index = zmtp.free_port(), BlockIndex()
    owners = {"prefill-0": "http://a", "prefill-1": "http://b"}
    listener = KVEventListener(index, f"tcp://127.0.0.1:{port}", owners.get)
    a, stranger = publisher(port, "prefill-0"), publisher(port, "someone-else")
    hashes = [external(b) for b in BLOCKS]
    try:

        def store() -> None:
            for events in (a, stranger):
                events.stored(BLOCKS, None, list(range(48)), 16)
                events.flush()

        assert until(lambda: index.matched("http://a", hashes) == 3, store)
        assert index.matched("http://b", hashes) == 0  # nothing came under its topic
        assert index.peers() == ["http://a"]  # a topic no prefill named: filed nowhere

        def remove() -> None:
            a.removed(BLOCKS[1:2])
            a.flush()

        assert until(lambda: index.matched("http://a", hashes) == 1, remove)
    finally:
        a.close()
        stranger.close()
        listener.close()


def test_a_message_that_is_no_event_batch_is_counted_and_dropped():
    port, index = zmtp.free_port(), BlockIndex()
    listener = KVEventListener(index, f"tcp://127.0.0.1:{port}", lambda topic: "http://a")
    push = zmq.Context.instance().socket(zmq.PUB)
    push.connect(f"tcp://127.0.0.1:{port}")
    try:

        def junk() -> None:
            push.send_multipart([b"t", b"\0" * 8, b"\xc1 not msgpack"])
            push.send_multipart([b"only one frame"])

        assert until(lambda: listener.refused >= 2, junk)
        assert index.blocks == {} and listener.batches == 0
    finally:
        push.close(linger=0)
        listener.close()


# A bound listener that waits while raw peers flood it and reset, then files a real batch:
# "alive N M" (N messages refused, M of the batch's blocks filed) if it got there.
LISTENER = """
import sys, time
from epd.kv.events import KVEventsConfig, ZmqKVEvents
from epd.kv.index import BlockIndex, external
from epd.kv.listener import KVEventListener
index = BlockIndex()
listener = KVEventListener(index, sys.argv[1], lambda topic: "http://a")
print("bound", flush=True)
sys.stdin.readline()  # the raw peers have come and gone
events = ZmqKVEvents(KVEventsConfig(True, endpoint=sys.argv[1], topic="t"))
hashes, deadline = [external(bytes(32))], time.monotonic() + 10
while not index.matched("http://a", hashes) and time.monotonic() < deadline:
    events.stored([bytes(32)], None, list(range(16)), 16)
    events.flush()
    time.sleep(0.05)
print("alive", listener.refused, index.matched("http://a", hashes), flush=True)
"""


def test_a_publisher_that_floods_and_resets_cannot_abort_the_listener():
    """libzmq 4.3.5 aborts on a connection whose reading it stopped at the receive limit, once
    it is reset and libzmq answers a ping read before the stop (tests/wire/test_transport.py).
    With the limit the listener had (1000 batches), the router's process died of SIGABRT
    under this flood; the listener now has none."""
    port = zmtp.free_port()
    here = KVEventListener(BlockIndex(), f"tcp://127.0.0.1:{zmtp.free_port()}")
    assert [s.getsockopt(zmq.RCVHWM) for s in here.sockets] == [0]  # no limit, any flood
    here.close()
    listener = subprocess.Popen(
        [sys.executable, "-c", LISTENER, f"tcp://127.0.0.1:{port}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert listener.stdout.readline() == "bound\n"
    for _ in range(4):
        try:
            zmtp.flood_and_reset(port, "PUB", 50_000, pause_s=0.02)
        except ConnectionError:  # the listener is gone: its stderr says why
            break
    out, err = listener.communicate("\n", timeout=60)
    assert listener.returncode == 0, err
    _, refused, filed = out.split()
    assert int(refused) > 0 and int(filed) == 1
