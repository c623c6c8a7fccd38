"""Typed ZeroMQ wrappers: an `Inbox` that binds a PULL socket and an `Outbox` of PUSH sockets.

Nothing here waits on a peer. A message to a peer that is not connected yet (or is reconnecting)
waits in that peer's bounded queue, for at most `connect_timeout_s`; the owner's loop calls
`Outbox.poll()`, which delivers it once the connection is up, or drops it and reports the peer
as lost so the owner can fail or abort what that peer held. Monitor events are read on every
poll: libzmq blocks its I/O thread, and with it every socket of the process, once a monitor's
queue is full. Reply peers that go idle are closed and their number is capped, so a stream of
distinct reply addresses cannot exhaust file descriptors.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from epd.wire.codec import Frame, WireError, decode, encode
from epd.wire.messages import Message

log = logging.getLogger(__name__)

# How often a lost peer is redialled. Every failed attempt is an event on libzmq's side; a test
# shrinks this to show that a long outage no longer fills the monitor queues.
RECONNECT_MS = int(os.environ.get("EPD_ZMQ_RECONNECT_MS", "100"))
HEARTBEAT_MS = 1000  # ZMTP pings on every connection...
HEARTBEAT_TIMEOUT_MS = 5000  # ...so a hung (not only a dead) peer is disconnected
EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED  # none fire while a peer is away


def receive(frames: list[Any]) -> Message | None:
    """Decode frames; a refused or malformed message is logged and dropped, never raised."""
    try:
        return decode(frames)
    except WireError as e:
        log.error("refused a message: %s", e)
    except Exception:  # a decoder bug must not take the receiving loop down with it
        log.exception("refused a message that failed to decode")
    return None


class Inbox:
    """A bound PULL socket (sync or asyncio, by the context given).

    A peer that sends a frame over `max_frame_bytes` is disconnected by libzmq before the frame
    is read into memory.
    """

    def __init__(self, context: zmq.Context, address: str, max_frame_bytes: int = -1) -> None:
        self.socket = context.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self.socket.bind(address)

    def recv(self, timeout_ms: int) -> Message | None:
        """Next valid message, or None after `timeout_ms` without one (sync sockets)."""
        if not self.socket.poll(timeout_ms):
            return None
        return receive(self.socket.recv_multipart(copy=False))

    async def arecv(self) -> Message | None:
        """Next message or None if it was refused (asyncio sockets)."""
        frames = await self.socket.recv_multipart(copy=False)  # type: ignore[misc]
        return receive(frames)

    def close(self) -> None:
        self.socket.close(linger=0)


@dataclass
class Peer:
    socket: zmq.Socket
    monitor: zmq.Socket
    last_used: float
    up: bool = False
    pending: deque[list[Frame]] = field(default_factory=deque)
    pending_since: float = 0.0  # when the oldest queued message was queued


class Outbox:
    """One PUSH socket per peer address, connected on first use and watched.

    `pinned` peers (the ones a role is configured to use) stay open; other peers are closed after
    `idle_close_s` without traffic, and at most `max_peers` are open at once.
    """

    def __init__(
        self,
        context: zmq.Context | None = None,
        pinned: Iterable[str] = (),
        *,
        max_peers: int = 256,
        idle_close_s: float = 60.0,
        connect_timeout_s: float = 2.0,
        max_pending: int = 1024,
        max_pending_bytes: int = 1 << 30,
    ) -> None:
        self.context = context or zmq.Context.instance()
        self.pinned = frozenset(pinned)
        self.max_peers, self.idle_close_s = max_peers, idle_close_s
        self.connect_timeout_s = connect_timeout_s
        self.max_pending, self.max_pending_bytes = max_pending, max_pending_bytes
        self.pending_bytes = 0
        self.peers: dict[str, Peer] = {}
        self.lost: list[str] = []  # peers lost since the last `poll`
        for address in self.pinned:
            self.connect(address)

    # Peers.
    def connect(self, address: str) -> Peer | None:
        """The peer at `address`, connecting to it now if needed; None if it cannot be."""
        peer = self.peers.get(address)
        if peer is None:
            if len(self.peers) >= self.max_peers and not self._evict():
                log.error("not connecting to %s: %d peers are open", address, len(self.peers))
                return None
            peer = self._open(address)
        if peer is not None:
            peer.last_used = time.monotonic()
        return peer

    def _open(self, address: str) -> Peer | None:
        socket = self.context.socket(zmq.PUSH)
        for option, value in (
            (zmq.IMMEDIATE, 1),  # only ever queue in a live connection, never for a lost one
            (zmq.LINGER, 0),
            (zmq.RECONNECT_IVL, RECONNECT_MS),
            (zmq.HEARTBEAT_IVL, HEARTBEAT_MS),
            (zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS),
        ):
            socket.setsockopt(option, value)
        monitor = socket.get_monitor_socket(EVENTS)
        try:
            socket.connect(address)
        except zmq.ZMQError as e:  # e.g. a wildcard or malformed address
            log.error("cannot connect to %r: %s", address, e)
            _close(socket, monitor)
            return None
        peer = self.peers[address] = Peer(socket, monitor, time.monotonic())
        return peer

    def _evict(self) -> bool:
        """Close the least recently used idle peer that is not pinned; False if there is none."""
        idle = [a for a, p in self.peers.items() if a not in self.pinned and not p.pending]
        if not idle:
            return False
        self._close_peer(min(idle, key=lambda a: self.peers[a].last_used))
        return True

    def _close_peer(self, address: str) -> None:
        peer = self.peers.pop(address)
        self._drop_pending(peer)
        _close(peer.socket, peer.monitor)

    def _events(self, address: str, peer: Peer) -> None:
        """Read every queued monitor event of one peer (a full queue would stall libzmq)."""
        while peer.monitor.poll(0):
            event = recv_monitor_message(peer.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                peer.up = True
            elif event == zmq.EVENT_DISCONNECTED and peer.up:
                peer.up = False
                self.lost.append(address)

    def is_up(self, address: str) -> bool:
        peer = self.peers.get(address)
        if peer is None:
            return False
        self._events(address, peer)
        return peer.up

    @property
    def pending(self) -> int:
        """Messages waiting for a peer to connect."""
        return sum(len(p.pending) for p in self.peers.values())

    # Sending.
    def send(self, address: str, message: Message) -> bool:
        """Send `message` to `address`, or queue it while that peer connects; never waits.

        False if it can be neither sent nor queued: the address cannot be connected to, the
        peer is not taking messages (its queue in libzmq is full), or the queues are full.
        """
        peer = self.connect(address)
        if peer is None:
            return False
        self._events(address, peer)
        frames = encode(message)
        if peer.up and self._flush(peer):
            return _send(peer.socket, frames)
        size = _size(frames)
        full = len(peer.pending) >= self.max_pending
        if full or self.pending_bytes + size > self.max_pending_bytes:
            log.warning("%s has too many messages waiting; refused one more", address)
            return False
        if not peer.pending:
            peer.pending_since = time.monotonic()
        peer.pending.append(frames)
        self.pending_bytes += size
        return True

    def _flush(self, peer: Peer) -> bool:
        """Send what waited for this peer, in order; True once nothing waits."""
        while peer.pending:
            if not _send(peer.socket, peer.pending[0]):
                return False
            self.pending_bytes -= _size(peer.pending.popleft())
        return True

    def _drop_pending(self, peer: Peer) -> None:
        self.pending_bytes -= sum(_size(frames) for frames in peer.pending)
        peer.pending.clear()

    def poll(self) -> list[str]:
        """Apply connection events, deliver or expire queued messages, close idle peers.

        Returns the peers lost since the last call, each once: those that disconnected and those
        that did not connect in time to take the messages queued for them.
        """
        now = time.monotonic()
        for address, peer in list(self.peers.items()):
            self._events(address, peer)
            if peer.up:
                self._flush(peer)
            if peer.pending and now - peer.pending_since > self.connect_timeout_s:
                log.warning("%s did not take %d messages in time", address, len(peer.pending))
                self._drop_pending(peer)
                self.lost.append(address)
                if not peer.up and address not in self.pinned:  # likely gone: free its slot
                    self._close_peer(address)
                    continue
            idle = now - peer.last_used > self.idle_close_s
            if idle and not peer.pending and address not in self.pinned:
                self._close_peer(address)
        lost, self.lost = list(dict.fromkeys(self.lost)), []
        return lost

    def close(self, linger_ms: int = 0) -> None:
        """Close every socket; `linger_ms` lets messages already handed to libzmq go out."""
        for address in list(self.peers):
            self.peers[address].socket.setsockopt(zmq.LINGER, linger_ms)
            self._close_peer(address)


def _size(frames: list[Frame]) -> int:
    return sum(memoryview(f).nbytes for f in frames)


def _send(socket: zmq.Socket, frames: list[Frame]) -> bool:
    try:
        socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return False
    return True


def _close(socket: zmq.Socket, monitor: zmq.Socket) -> None:
    socket.disable_monitor()
    monitor.close(linger=0)
    socket.close()


def reply_allowed(address: str, patterns: Iterable[str]) -> bool:
    """Whether a request's reply address names one of the prefills this role serves."""
    return any(fnmatch.fnmatchcase(address, pattern) for pattern in patterns)


class WireProbe:
    """Proves that this process's ZeroMQ I/O thread still moves messages.

    A background thread sends itself a message over loopback TCP every `interval_s` and calls
    `on_round_trip` each time one arrives; a stalled I/O thread stops the calls.
    """

    def __init__(
        self, context: zmq.Context, on_round_trip: Callable[[], None], interval_s: float = 0.5
    ) -> None:
        self.on_round_trip, self.interval_ms = on_round_trip, int(interval_s * 1000)
        self.pull = context.socket(zmq.PULL)
        port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.push = context.socket(zmq.PUSH)
        self.push.connect(f"tcp://127.0.0.1:{port}")
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self._run, name="wire-probe", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.closing.is_set():
            with contextlib.suppress(zmq.Again):  # the last probe is still on its way
                self.push.send(b"", zmq.NOBLOCK)
            if self.pull.poll(self.interval_ms):
                while self.pull.poll(0):
                    self.pull.recv()
                self.on_round_trip()
                self.closing.wait(self.interval_ms / 1000)
        self.push.close(linger=0)
        self.pull.close(linger=0)

    def close(self) -> None:
        self.closing.set()
        self.thread.join()


@functools.cache
def async_context() -> zmq.asyncio.Context:
    """An asyncio view of the process's one context, so one I/O thread carries everything."""
    return zmq.asyncio.Context.shadow(zmq.Context.instance())


__all__ = ["Inbox", "Outbox", "WireError", "WireProbe", "async_context", "receive", "reply_allowed"]
