"""Typed ZeroMQ wrappers: an `Inbox` that binds a PULL socket and an `Outbox` of PUSH sockets.

Outbox sockets set IMMEDIATE, so a message to a peer with no live connection fails at once
instead of queueing for a process that may never come back; a monitor socket per peer tracks
connects and disconnects so the sender can fail the requests that peer held.
"""

from __future__ import annotations

import logging
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from epd.wire.codec import WireError, decode, encode
from epd.wire.messages import Message

log = logging.getLogger(__name__)
UP_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED
DOWN_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


def receive(frames: list[Any]) -> Message | None:
    """Decode frames; a refused or malformed message is logged and dropped, never raised."""
    try:
        return decode(frames)
    except WireError as e:
        log.error("refused a message: %s", e)
        return None


class Inbox:
    """A bound PULL socket (sync or asyncio, by the context given)."""

    def __init__(self, context: zmq.Context, address: str) -> None:
        self.socket = context.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
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


class Outbox:
    """One PUSH socket per peer address, connected on first use and watched."""

    def __init__(self, context: zmq.Context | None = None) -> None:
        # Sends never block, so a plain (sync) context serves asyncio callers too.
        self.context = context or zmq.Context.instance()
        self.sockets: dict[str, zmq.Socket] = {}
        self.monitors: dict[str, zmq.Socket] = {}
        self.up: dict[str, bool] = {}

    def connect(self, address: str, wait_ms: int = 0) -> None:
        """Connect to `address` (once); optionally wait until the connection is live."""
        if address not in self.sockets:
            socket = self.context.socket(zmq.PUSH)
            socket.setsockopt(zmq.IMMEDIATE, 1)
            socket.setsockopt(zmq.LINGER, 0)
            self.monitors[address] = socket.get_monitor_socket(UP_EVENTS | DOWN_EVENTS)
            socket.connect(address)
            self.sockets[address], self.up[address] = socket, False
        if wait_ms and not self.up[address] and self.monitors[address].poll(wait_ms):
            self.poll_events()

    def poll_events(self) -> list[str]:
        """Apply pending connect/disconnect events; return addresses that just went down."""
        went_down = []
        for address, monitor in self.monitors.items():
            while monitor.poll(0):
                event = recv_monitor_message(monitor)["event"]
                was_up = self.up[address]
                self.up[address] = bool(event & UP_EVENTS)
                if was_up and not self.up[address]:
                    went_down.append(address)
        return went_down

    def is_up(self, address: str) -> bool:
        self.poll_events()
        return self.up.get(address, False)

    def send(self, address: str, message: Message) -> bool:
        """Queue `message` for `address`; False if that peer has no live connection."""
        self.connect(address)
        try:
            self.sockets[address].send_multipart(encode(message), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        for address, socket in self.sockets.items():
            socket.disable_monitor()
            self.monitors[address].close(linger=0)
            socket.close(linger=0)
        self.sockets.clear()
        self.monitors.clear()


def async_context() -> zmq.asyncio.Context:
    return zmq.asyncio.Context.instance()


__all__ = ["Inbox", "Outbox", "WireError", "async_context", "receive"]
