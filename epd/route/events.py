"""The prefills' KV events, as vLLM publishes them (`kv/events.py`), into the router's index.

The router binds one SUB socket; each prefill's publisher connects to it (vLLM's rule: an
endpoint without * is connected) and sends its batches under a topic of its own, which its
/health names (`PrefillSet`). Events under a topic no prefill has named are dropped: the
router cannot tell whose they are. A batch's sequence numbers are not checked: a gap (a
publisher's full queue, a slow joiner) leaves the index a little stale, which costs a cache hit,
never a wrong answer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import msgspec
import zmq

from epd.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from epd.route.index import PrefixIndex

log = logging.getLogger(__name__)
MAX_BATCH_BYTES = 16 << 20  # a larger message is dropped by ZeroMQ before it is read
QUEUED_BATCHES = 1000  # past these unread, ZeroMQ drops batches: at most this × the size above
POLL_MS = 200


class KVEventListener:
    def __init__(self, bind: str, index: PrefixIndex, owner: Callable[[str], str | None]):
        """`owner(topic)`: the prefill URL that publishes under `topic`, if any."""
        self.index, self.owner = index, owner
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)
        self.socket.setsockopt(zmq.RCVHWM, QUEUED_BATCHES)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.subscribe(b"")
        self.socket.bind(bind)
        self.batches = self.refused = 0
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self.run, name="kv-events", daemon=True)
        self.thread.start()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        while not self.closed.is_set():
            if not poller.poll(POLL_MS):
                continue
            try:
                self.take(self.socket.recv_multipart(zmq.NOBLOCK))
            except zmq.ZMQError:
                continue
            except Exception:  # one batch (a bug, a hostile one) must not end the listening
                self.refused += 1
                log.exception("a KV events batch could not be filed")
        self.socket.close()

    def take(self, frames: list[bytes]) -> None:
        """One published batch: [topic, sequence, payload]."""
        if len(frames) != 3:
            self.refused += 1
            return
        prefill = self.owner(frames[0].decode("utf-8", "replace"))
        if prefill is None:
            return
        try:
            batch = self.decoder.decode(frames[2])
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.refused += 1
            return
        self.batches += 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.index.stored(prefill, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.index.removed(prefill, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.index.cleared(prefill)

    def close(self) -> None:
        self.closed.set()
        self.thread.join(timeout=1.0)
