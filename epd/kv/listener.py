"""Peers' KV events, as vLLM publishes them (`events.py`), filed into a `BlockIndex`.

Two ways to hear a peer, one thread for both:
- `bind`: one SUB socket that publishers connect to (vLLM's rule: an endpoint without * is
  connected), each under a topic of its own; `owner(topic)` names the peer, and events under a
  topic no peer has named are dropped: whose they are cannot be told. The router hears its
  prefills so (each names its topic in its /health), as llm-d's scheduler hears vLLM pods.
- `follow`: a SUB socket connected to one peer's bound publisher; the socket names the peer,
  whatever its topic. Prefill hears its decoders so: every prefill hears every decoder.

A batch's sequence numbers are not checked: a gap (a publisher's full queue, a slow joiner)
leaves the index a little stale, which costs a cache hit or a resent hand-off, never a wrong
answer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import msgspec
import zmq

from epd.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from epd.kv.index import BlockIndex

log = logging.getLogger(__name__)
MAX_BATCH_BYTES = 16 << 20  # a larger message is dropped by ZeroMQ before it is read
# A followed peer's socket: a step's batch names a few blocks a sequence (a 128k-token hand-off,
# 8k blocks with their tokens, is ~1 MB).
PEER_BATCH_BYTES = 4 << 20
POLL_MS = 200
DRAINED_PER_POLL = 100  # filed from one socket before the others and new peers get a turn


class KVEventListener:
    def __init__(
        self,
        index: BlockIndex,
        bind: str = "",
        owner: Callable[[str], str | None] = lambda topic: None,
    ) -> None:
        """Files into `index`; with `bind`, hears publishers that connect there, `owner(topic)`
        naming the peer that publishes under `topic`, if any."""
        self.index, self.owner = index, owner
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.sockets: dict[zmq.Socket[bytes], str | None] = {}  # → its peer (None: by topic)
        if bind:
            self.sockets[_subscriber(bind, bound=True)] = None
        self.wanted: dict[str, str] = {}  # peer → its endpoint, to follow (read by the thread)
        self.followed: dict[str, tuple[str, zmq.Socket[bytes]]] = {}  # the thread's own
        self.failed: set[tuple[str, str]] = set()  # (peer, endpoint) that could not be followed
        self.batches = self.refused = 0
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self.run, name="kv-events", daemon=True)
        self.thread.start()

    def follow(self, peers: dict[str, str]) -> None:
        """Hear exactly these peers' publishers (peer → endpoint), no others: those new are
        connected, those gone closed and forgotten (from any thread; done within POLL_MS)."""
        with self.lock:
            self.wanted = dict(peers)

    def run(self) -> None:
        while not self.closed.is_set():
            self.reconcile()
            poller = zmq.Poller()
            for socket in self.sockets:
                poller.register(socket, zmq.POLLIN)
            for socket, _ in poller.poll(POLL_MS) if self.sockets else []:
                self.drain(socket)
            if not self.sockets:
                self.closed.wait(POLL_MS / 1000)
        for socket in self.sockets:
            socket.close()

    def drain(self, socket: zmq.Socket[bytes]) -> None:
        """File what waits on `socket`, up to DRAINED_PER_POLL batches: its libzmq has no
        receive limit, so what this thread leaves unread is what waits in memory."""
        for _ in range(DRAINED_PER_POLL):
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:  # nothing more (Again), or the socket went
                return
            try:
                self.take(frames, self.sockets[socket])
            except Exception:  # one batch (a bug, a hostile one) must not end the listening
                self.refused += 1
                log.exception("a KV events batch could not be filed")

    def reconcile(self) -> None:
        """Connect to the peers newly wanted (or moved), close those no longer."""
        with self.lock:
            wanted = self.wanted
        for peer, (endpoint, socket) in list(self.followed.items()):
            if wanted.get(peer) != endpoint:
                del self.followed[peer], self.sockets[socket]
                socket.close()
                self.index.forget(peer)
        for peer, endpoint in wanted.items():
            if peer in self.followed:
                continue
            try:
                socket = _subscriber(endpoint, bound=False, small=True)
            except zmq.ZMQError as e:
                if (peer, endpoint) not in self.failed:  # tried again each poll, said once
                    self.failed.add((peer, endpoint))
                    log.warning("cannot follow %s's KV events at %s: %s", peer, endpoint, e)
                continue
            self.followed[peer] = (endpoint, socket)
            self.sockets[socket] = peer

    def take(self, frames: list[bytes], peer: str | None = None) -> None:
        """One published batch: [topic, sequence, payload]; `peer`: whose (None: by topic)."""
        if len(frames) != 3:
            self.refused += 1
            return
        if peer is None:
            peer = self.owner(frames[0].decode("utf-8", "replace"))
            if peer is None:
                return
        try:
            batch = self.decoder.decode(frames[2])
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.refused += 1
            return
        self.batches += 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.index.stored(peer, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.index.removed(peer, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.index.cleared(peer)

    def close(self) -> None:
        self.closed.set()
        self.thread.join(timeout=1.0)


def _subscriber(endpoint: str, bound: bool, small: bool = False) -> zmq.Socket[bytes]:
    """A SUB socket for every topic; `small`: one of a socket per peer (tighter bounds: many
    of them may be open, and one peer's batches are small)."""
    socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.MAXMSGSIZE, PEER_BATCH_BYTES if small else MAX_BATCH_BYTES)
    # No receive limit, as an inbox's (wire/transport.py): libzmq 4.3.5 aborts the process
    # when a connection it stopped reading at the limit is reset by a peer whose ping it holds.
    # This socket's own thread reads at once, so batches wait only while it is behind.
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.LINGER, 0)
    socket.subscribe(b"")
    try:
        socket.bind(endpoint) if bound else socket.connect(endpoint)
    except zmq.ZMQError:
        socket.close()
        raise
    return socket
