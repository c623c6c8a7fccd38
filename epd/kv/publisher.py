"""vLLM's ZeroMQ event publisher (vllm/distributed/kv_events.py, `ZmqEventPublisher`): its
sockets, frames, replay buffer and replay protocol, on a thread of its own so that the caller
only queues. `events` says what the batches hold.

- PUB: `[topic, sequence (8 bytes big-endian, from 0), msgpack payload]` per batch;
- replay (ROUTER): a request `[start sequence (8 bytes)]` gets `[topic, sequence, payload]` for
  each buffered batch from there on, then `[b"", -1 (8 bytes, signed), b""]`, each after the
  ROUTER's identity and empty frame (a REQ client adds and strips those; a DEALER sends b"").
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end of a replay
POLL_S = 0.05  # how soon the thread answers a replay request while no batch comes
INBOUND_BYTES = 4096  # the largest subscription or replay request: a larger one drops its peer
CLOSE_S = 0.5  # how long close() lets the thread send what is queued


class ZmqPublisher:
    """Where vLLM's caller waits for room in the queue, this one drops the batch and counts it
    (`dropped`); its sequence number is spent all the same, so subscribers see the gap."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        *,
        buffer_steps: int,
        hwm: int,
        max_queue_size: int,
        topic: str,
    ) -> None:
        self.dropped = 0
        self._topic = topic.encode()
        self._queue: queue.Queue[tuple[int, msgspec.Struct] | None] = queue.Queue(max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._sequences = itertools.count()
        self._closed = False
        self._deadline = math.inf  # when the thread stops, set by close()
        self._pub = _socket(zmq.PUB, endpoint, hwm)
        self._replay: zmq.Socket[bytes] | None = None
        if replay_endpoint is not None:
            try:
                # A whole buffer's replay fits in a client's reply queue (libzmq's default
                # high-water mark drops past 1000 messages, and vLLM's replay with it).
                self._replay = _socket(zmq.ROUTER, replay_endpoint, buffer_steps + 1, bind=True)
            except ValueError:
                self._pub.close(linger=0)
                raise
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: msgspec.Struct) -> None:
        """Queue `batch` for the thread; never blocks."""
        if self._closed:
            raise RuntimeError("kv events: a batch published after close()")
        try:
            self._queue.put_nowait((next(self._sequences), batch))
        except queue.Full:
            self.dropped += 1
            if self.dropped & (self.dropped - 1) == 0:  # the 1st, 2nd, 4th...: counted, no flood
                log.warning(
                    "kv events: %d batches dropped so far, the publisher's queue being full "
                    "(max_queue_size %d); subscribers see gaps in the sequence",
                    self.dropped,
                    self._queue.maxsize,
                )

    def close(self) -> None:
        """Send what is queued (for up to CLOSE_S), then stop the thread and close the sockets
        (linger 0); returns within a second."""
        if self._closed:
            return
        self._closed = True
        self._deadline = time.monotonic() + CLOSE_S
        with contextlib.suppress(queue.Full):  # full, the thread stops at the deadline instead
            self._queue.put_nowait(None)
        self._thread.join(CLOSE_S + 2 * POLL_S)
        if self._thread.is_alive():  # its sockets are its own until it ends
            log.warning("kv events: the publisher thread did not stop; its sockets stay open")
            return
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        wait = POLL_S if self._replay is not None else None
        while time.monotonic() < self._deadline:
            self._answer_replays()
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                continue
            if item is None:  # close(): everything queued before it is sent
                return
            sequence, batch = item
            payload = encoder.encode(batch)
            self._pub.send_multipart((self._topic, sequence.to_bytes(8, "big"), payload))
            self._buffer.append((sequence, payload))

    def _answer_replays(self) -> None:
        while self._replay is not None and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3:  # [identity, empty, start sequence]
                log.warning("kv events: a replay request of %d frames ignored", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for sequence, payload in self._buffer:
                if sequence >= first:
                    reply = (client, b"", self._topic, sequence.to_bytes(8, "big"), payload)
                    self._replay.send_multipart(reply)
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def _socket(kind: int, endpoint: str, hwm: int, bind: bool = False) -> zmq.Socket[bytes]:
    """A socket on `endpoint`: bound where asked, or where the endpoint has a wildcard (* or
    ::) or is ipc:// or inproc://, else connected (vLLM's rule: bind stable, connect volatile)."""
    socket: zmq.Socket[bytes] = zmq.Context.instance().socket(kind)
    socket.set(zmq.LINGER, 0)
    socket.set(zmq.SNDHWM, hwm)  # before bind or connect: libzmq sizes a pipe as it makes it
    # What peers send in (subscriptions, replay requests) has no limit: with one, a peer
    # writing ZMTP by hand could fill it and reset, and libzmq 4.3.5 would abort the process
    # (docs/architecture.md, "Reading never stops"). Each of those messages is small.
    socket.set(zmq.RCVHWM, 0)
    socket.set(zmq.MAXMSGSIZE, INBOUND_BYTES)
    binds = bind or "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc", "inproc"))
    try:
        socket.bind(endpoint) if binds else socket.connect(endpoint)
    except zmq.ZMQError as e:
        socket.close(linger=0)
        verb = "bind" if binds else "connect"
        raise ValueError(f"kv events: cannot {verb} {endpoint}: {e}") from None
    return socket
