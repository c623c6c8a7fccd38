"""Receiving: an `Inbox` that binds a PULL socket, and a probe of the process's ZeroMQ I/O.

(Sending is `outbox.Outbox`.)
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from epd.wire.codec import HEADER_BYTES, WireError, decode
from epd.wire.curve import CurveKeys
from epd.wire.limits import PerSecond
from epd.wire.messages import Message
from epd.wire.outbox import STALL_TIMEOUT_S

log = logging.getLogger(__name__)
# libzmq reads every connection as it comes (no receive limit; docs/architecture.md, "Reading
# never stops"): with a limit it stops reading a connection once that many messages wait, and
# libzmq 4.3.5 aborts the process (`Assertion failed: !_io_error`, stream_engine_base.cpp:310;
# zeromq/libzmq#4841) when a connection so stopped is then reset and it writes to it: a
# heartbeat of ours, or an answer to a ping read before the stop. A sender that filled the
# queue and died did it (a pyzmq peer in CI, 2026-12-07), as a killed prefill could. Memory is
# bounded otherwise: each message by `max_frame_bytes`, an honest peer's backlog by its
# requests in flight, and a process that stops reading for good by its watchdog, which ends
# it. A hostile peer's is not (README, "Security").
# A connection that is not a live ZeroMQ peer holds a descriptor until dropped: one that does
# not finish its handshake (libzmq's default waits 30 s), or one that finished it and then
# answers no ping (without pings, kept for ever: a host that vanished without closing, or a
# hostile client holding descriptors). Real peers answer pings from libzmq's own I/O thread,
# and this side reads their answers however long its own loop is held; a sender frozen for
# less than its own stall timeout (SIGSTOP, then SIGCONT) keeps its connection.
HANDSHAKE_MS = 5000
HEARTBEAT_MS, HEARTBEAT_TIMEOUT_MS = 1000, int(STALL_TIMEOUT_S * 1000)
REFUSALS_LOGGED_PER_S = 10
LOOPBACK = "tcp://127.0.0.1:*"  # the wire probe's address where an IPC path would be too long
DRAINED_PER_TRIP = 100  # messages the wire probe reads in a round, its own one among them
MAX_PROBLEM_CHARS = 500  # of a refusal's text, logged


class Refusals:
    """Counts refused messages and logs a few a second, so a flood cannot fill the disk."""

    def __init__(self) -> None:
        self.total, self.unlogged = 0, 0
        self.logged = PerSecond(REFUSALS_LOGGED_PER_S)

    def log(self, problem: str) -> None:
        """Count one refusal; log it, cut to MAX_PROBLEM_CHARS (a peer may write the text),
        unless this second's few were logged already (those are counted in the next line)."""
        self.total += 1
        if not self.logged.take():
            self.unlogged += 1
            return
        if self.unlogged:
            log.error("refused %d more messages", self.unlogged)
            self.unlogged = 0
        log.error("refused a message: %s", problem[:MAX_PROBLEM_CHARS])


class Inbox:
    """A bound PULL socket (sync or asyncio, by the context given), a CURVE server if given keys.

    A peer that sends a frame over `max_frame_bytes` is disconnected by libzmq before the frame
    is read into memory; headers over `max_header_bytes` are refused undecoded.
    """

    def __init__(
        self,
        context: zmq.Context,
        address: str,
        max_frame_bytes: int = -1,
        max_header_bytes: int = HEADER_BYTES,
        curve: CurveKeys | None = None,
    ) -> None:
        self.max_header_bytes = max_header_bytes
        self.refusals = Refusals()
        self.socket = context.socket(zmq.PULL)
        if curve is not None:  # peers without the keys are dropped in the handshake
            curve.serve(self.socket)
        for option, value in (
            (zmq.LINGER, 0),
            (zmq.RCVHWM, 0),  # unlimited: see above
            (zmq.HANDSHAKE_IVL, HANDSHAKE_MS),
            (zmq.HEARTBEAT_IVL, HEARTBEAT_MS),
            (zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS),
        ):
            self.socket.setsockopt(option, value)
        if max_frame_bytes >= 0:
            self.socket.setsockopt(zmq.MAXMSGSIZE, max(max_frame_bytes, max_header_bytes))
        self.socket.bind(address)

    def receive(self, frames: list[Any]) -> Message | None:
        """Decode frames; a refused or malformed message is logged and dropped, never raised."""
        try:
            return decode(frames, self.max_header_bytes)
        except WireError as e:
            self.refusals.log(str(e))
        except Exception as e:  # a decoder bug must not take the receiving loop down with it
            # counted and rate-limited as any refusal: a peer could send it again and again
            self.refusals.log(f"a message that failed to decode: {type(e).__name__}: {e}")
        return None

    def recv(self, timeout_ms: int) -> Message | None:
        """Next valid message, or None after `timeout_ms` without one (sync sockets)."""
        if not self.socket.poll(timeout_ms):
            return None
        try:  # never blocks: a CURVE server's socket can report input before a message
            frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return self.receive(frames)

    def pending(self) -> bool:
        """Whether a message has arrived that no recv has taken yet (never, once closed)."""
        return not self.socket.closed and bool(self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    async def arecv(self) -> Message | None:
        """Next message, or None if it was refused or was not there (asyncio sockets)."""
        try:
            frames = await self.socket.recv_multipart(copy=False)  # type: ignore[misc]
        except zmq.Again:
            # As in `recv`: a CURVE server's socket, once one connection has failed its
            # handshake beside others, can report input before a message; pyzmq then raises
            # Again out of the await, and the reading task, had it not been caught, ended.
            return None
        return self.receive(frames)

    def close(self) -> None:
        self.socket.close(linger=0)


class WireProbe:
    """Proves that this process's ZeroMQ I/O thread still moves messages.

    A background thread sends itself a message every `interval_s` and calls `on_round_trip`
    each time one arrives; a stalled I/O thread stops the calls. The message goes over an IPC
    socket in a directory only this user may enter (mode 0700): through the I/O thread, as
    TCP would, but no other user's process can connect to it and flood it. Where TMPDIR is too
    long for a socket's path, loopback TCP (a flood there only keeps the probe busy: reading
    has no limit, and a round of it at most DRAINED_PER_TRIP messages).
    """

    def __init__(
        self, context: zmq.Context, on_round_trip: Callable[[], None], interval_s: float = 0.5
    ) -> None:
        self.on_round_trip, self.interval_ms = on_round_trip, int(interval_s * 1000)
        self.directory = tempfile.mkdtemp(prefix="epd-probe-")
        path = f"{self.directory}/probe"
        self.pull = context.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 0)  # "Reading never stops", as an inbox
        try:
            self.pull.bind(f"ipc://{path}" if len(path) < zmq.IPC_PATH_MAX_LEN else LOOPBACK)
        except zmq.ZMQError:
            self.pull.close(linger=0)
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        self.push = context.socket(zmq.PUSH)
        self.push.connect(self.pull.getsockopt(zmq.LAST_ENDPOINT).decode())
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self._run, name="wire-probe", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.closing.is_set():
            with contextlib.suppress(zmq.Again):  # the last probe is still on its way
                self.push.send(b"", zmq.NOBLOCK)
            if self.pull.poll(self.interval_ms):
                for _ in range(DRAINED_PER_TRIP):
                    if not self.pull.poll(0):
                        break
                    self.pull.recv()
                self.on_round_trip()
                self.closing.wait(self.interval_ms / 1000)
        self.push.close(linger=0)
        self.pull.close(linger=0)
        shutil.rmtree(self.directory, ignore_errors=True)

    def close(self) -> None:
        self.closing.set()
        self.thread.join()


@functools.cache
def async_context() -> zmq.asyncio.Context:
    """An asyncio view of the process's one context, so one I/O thread carries everything."""
    return zmq.asyncio.Context.shadow(zmq.Context.instance())
