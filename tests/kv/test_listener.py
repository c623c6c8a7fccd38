"""The prefills' KV events, published as vLLM publishes them, reach the router's index."""

import socket
import time

import zmq

from epd.kv.events import KVEventsConfig, ZmqKVEvents
from epd.kv.index import BlockIndex, external
from epd.kv.listener import KVEventListener

BLOCKS = [bytes([i]) * 32 for i in range(3)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    port, index = free_port(), BlockIndex()
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
    port, index = free_port(), BlockIndex()
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
