"""`Outbox`: one PUSH socket per peer address; sending never waits.

A message that cannot go out at once (the peer is still connecting, reconnecting, or its
libzmq queue is full) waits in that peer's bounded queue; the owner's loop calls `poll()`, which
sends what waited once it can, and gives up on a message that has waited too long, reporting its
request so the owner can fail or abort it: `connect_timeout_s` while the peer is not connected,
`stall_timeout_s` while it is connected but takes nothing. An epd peer's libzmq takes what comes
however long its loop is held (it has no receive limit: docs/architecture.md, "Reading never
stops"), so that wait ends only for a peer whose I/O stopped too, a frozen process that its
heartbeats have not yet given away, or a peer that is not epd's.
Monitor events are read on every poll: libzmq blocks its I/O thread, and with it every socket
of the process, once a monitor's queue is full. Peers that go idle or never answer are closed
and their number is capped, so a stream of distinct reply addresses cannot exhaust file
descriptors.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from epd.wire.codec import Frame, encode
from epd.wire.curve import CurveKeys
from epd.wire.messages import Message

log = logging.getLogger(__name__)

# How often a lost peer is redialled. Every failed attempt is an event on libzmq's side; a test
# shrinks this to show that a long outage no longer fills the monitor queues.
RECONNECT_MS = int(os.environ.get("EPD_ZMQ_RECONNECT_MS", "100"))
HEARTBEAT_MS = 1000  # ZMTP pings on every connection...
# ...so a vanished or frozen peer (its host gone, nothing closed; SIGSTOP) is disconnected. A
# peer whose loop is held still answers from libzmq's I/O thread, and stays up.
HEARTBEAT_TIMEOUT_MS = 5000
EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED  # none fire while a peer is away
LIBZMQ_QUEUE = 64  # messages libzmq holds per peer; beyond, they wait in ours (bounded, timed)
# Decode sends a delta per stream per step (~1000 a second at 16 streams): a queue this long
# holds a minute of them for a prefill that stalls, at a few hundred bytes each.
MAX_QUEUED = 65536
CLOSING_LINGER_MS = 2000  # a connected peer's socket, closed, delivers what it holds for this long
INBOUND_BYTES = 4096  # the largest frame a peer may send a PUSH socket: a larger one drops it
STALL_TIMEOUT_S = 30.0  # the longest a connected peer may take nothing before its messages fail


@dataclass
class Queued:
    frames: list[Frame]
    request_id: str
    since: float
    size: int


@dataclass
class Peer:
    socket: zmq.Socket
    monitor: zmq.Socket
    last_used: float
    up: bool = False
    queue: deque[Queued] = field(default_factory=deque)


@dataclass
class Losses:
    """What `Outbox.poll` found gone since its last call."""

    peers: list[str] = field(default_factory=list)  # disconnected
    requests: list[tuple[str, str]] = field(default_factory=list)  # (peer, request id) undelivered


class Outbox:
    """`pinned` peers (the ones a role is configured to use) stay open; other peers are closed
    after `idle_close_s` without traffic, and at most `max_peers` are open at once."""

    def __init__(
        self,
        context: zmq.Context | None = None,
        pinned: Iterable[str] = (),
        *,
        max_peers: int = 256,
        idle_close_s: float = 60.0,
        connect_timeout_s: float = 2.0,
        stall_timeout_s: float = STALL_TIMEOUT_S,
        max_queued: int = MAX_QUEUED,
        max_queued_bytes: int = 1 << 30,
        curve: CurveKeys | None = None,
    ) -> None:
        self.context = context or zmq.Context.instance()
        self.curve = curve  # when set, every connection is a CURVE client of the cluster
        self.pinned = frozenset(pinned)
        self.max_peers, self.idle_close_s = max_peers, idle_close_s
        self.connect_timeout_s, self.stall_timeout_s = connect_timeout_s, stall_timeout_s
        self.max_queued, self.max_queued_bytes = max_queued, max_queued_bytes
        self.queued_bytes = 0
        self.peers: dict[str, Peer] = {}
        self.disconnected: list[str] = []  # since the last `poll`
        self.dropped: list[tuple[str, str]] = []  # (peer, request id) evicted since then
        for address in self.pinned:
            self.connect(address)

    @property
    def queued(self) -> int:
        """Messages waiting for their peer."""
        return sum(len(p.queue) for p in self.peers.values())

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

    def is_up(self, address: str) -> bool:
        peer = self.peers.get(address)
        if peer is None:
            return False
        self._events(address, peer)
        return peer.up

    def _open(self, address: str) -> Peer | None:
        try:
            socket = self.context.socket(zmq.PUSH)
        except zmq.ZMQError as e:  # no file descriptor left: this message's request fails alone
            log.error("cannot open a socket for %r: %s", address, e)
            return None
        for option, value in (
            (zmq.IMMEDIATE, 1),  # libzmq never queues for a connection that is gone
            (zmq.SNDHWM, LIBZMQ_QUEUE),
            # Nothing reads a PUSH socket's inbound side and no honest peer sends to it; with a
            # limit there, a peer writing ZMTP by hand could fill it and reset, and libzmq
            # 4.3.5 would abort the process (docs/architecture.md, "Reading never stops").
            # What an honest peer sends in is commands (pings, CURVE's handshake), all small.
            (zmq.RCVHWM, 0),
            (zmq.MAXMSGSIZE, INBOUND_BYTES),
            (zmq.LINGER, 0),
            (zmq.RECONNECT_IVL, RECONNECT_MS),
            (zmq.HEARTBEAT_IVL, HEARTBEAT_MS),
            (zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS),
        ):
            socket.setsockopt(option, value)
        if self.curve is not None:
            self.curve.connect(socket)
        try:
            monitor = socket.get_monitor_socket(EVENTS)
        except zmq.ZMQError as e:  # as above: its own descriptors
            log.error("cannot monitor a socket for %r: %s", address, e)
            socket.close(linger=0)
            return None
        try:
            socket.connect(address)
        except zmq.ZMQError as e:  # e.g. a wildcard or malformed address
            log.error("cannot connect to %r: %s", address, e)
            _close(socket, monitor)
            return None
        peer = self.peers[address] = Peer(socket, monitor, time.monotonic())
        return peer

    def pin(self, addresses: Iterable[str]) -> None:
        """Make `addresses` the pinned peers (connected now, kept open); peers no longer pinned
        are closed like any other once idle."""
        self.pinned = frozenset(addresses)
        for address in self.pinned:
            self.connect(address)

    def _evict(self) -> bool:
        """Make room for one more peer; False if every peer is pinned or connected and busy.

        The least recently used peer that is not connected goes first, with what waited for it
        (its requests are reported lost): a flood of reply addresses nobody serves must not push
        out a live prefill. Failing that, the least recently used idle one; what it was handed
        still goes out (`_close_peer`).
        """
        unpinned = [a for a in self.peers if a not in self.pinned]
        away = [a for a in unpinned if not self.peers[a].up]
        idle = [a for a in unpinned if not self.peers[a].queue]
        for candidates in (away, idle):
            if candidates:
                address = min(candidates, key=lambda a: self.peers[a].last_used)
                self.dropped += [(address, q.request_id) for q in self.peers[address].queue]
                self._close_peer(address)
                return True
        return False

    def _close_peer(self, address: str, linger_ms: int | None = None) -> None:
        """Close a peer's socket; by default what libzmq holds for a connected peer still goes
        out, for up to CLOSING_LINGER_MS (with no linger it would be dropped without a word)."""
        peer = self.peers.pop(address)
        self.queued_bytes -= sum(q.size for q in peer.queue)
        if linger_ms is None:
            linger_ms = CLOSING_LINGER_MS if peer.up else 0
        peer.socket.setsockopt(zmq.LINGER, linger_ms)
        _close(peer.socket, peer.monitor)

    def _events(self, address: str, peer: Peer) -> None:
        """Read every queued monitor event of one peer (a full queue would stall libzmq)."""
        while peer.monitor.poll(0):
            event = recv_monitor_message(peer.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                peer.up = True
            elif event == zmq.EVENT_DISCONNECTED and peer.up:
                peer.up = False
                self.disconnected.append(address)

    # Sending.
    def send(self, address: str, message: Message) -> bool:
        """Send `message` to `address`, or queue it until it can go; never waits.

        False if it can be neither sent nor queued: the address cannot be connected to, or the
        queues are full.
        """
        peer = self.connect(address)
        if peer is None:
            return False
        self._events(address, peer)
        frames = encode(message)
        if peer.up and self._flush(peer) and _send(peer.socket, frames):
            return True
        size = sum(memoryview(f).nbytes for f in frames)
        if len(peer.queue) >= self.max_queued or self.queued_bytes + size > self.max_queued_bytes:
            log.warning("too many messages wait for %s; refused one more", address)
            return False
        peer.queue.append(Queued(frames, message.request_id, time.monotonic(), size))
        self.queued_bytes += size
        return True

    def _flush(self, peer: Peer) -> bool:
        """Send what waited for this peer, in order; True once nothing waits."""
        while peer.queue:
            if not _send(peer.socket, peer.queue[0].frames):
                return False
            self.queued_bytes -= peer.queue.popleft().size
        return True

    def poll(self) -> Losses:
        """Apply connection events, send or expire what waits, close idle and dead peers."""
        now, losses = time.monotonic(), Losses()
        for address, peer in list(self.peers.items()):
            self._events(address, peer)
            if peer.up:
                self._flush(peer)
            expired = self._expire(address, peer, now)
            losses.requests += [(address, q.request_id) for q in expired]
            idle = now - peer.last_used > self.idle_close_s
            gone = expired and not peer.up  # never answered: free its slot
            if address not in self.pinned and not peer.queue and (idle or gone):
                self._close_peer(address)
        losses.peers, self.disconnected = list(dict.fromkeys(self.disconnected)), []
        losses.requests, self.dropped = self.dropped + losses.requests, []
        return losses

    def _expire(self, address: str, peer: Peer, now: float) -> list[Queued]:
        """Take off the messages that waited too long: for a connection, or for a connected
        peer to read."""
        limit = self.stall_timeout_s if peer.up else self.connect_timeout_s
        expired = []
        while peer.queue and now - peer.queue[0].since > limit:
            expired.append(peer.queue.popleft())
            self.queued_bytes -= expired[-1].size
        if expired:
            log.warning("%d messages for %s were not taken in time", len(expired), address)
        return expired

    def close(self, linger_ms: int = 0) -> None:
        """Close every socket; `linger_ms` lets messages already handed to libzmq go out."""
        for address in list(self.peers):
            self._close_peer(address, linger_ms)


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
