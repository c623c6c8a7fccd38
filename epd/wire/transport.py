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
    except Exception:  # a decoder bug must not take the receiving loop down with it
        log.exception("refused a message that failed to decode")
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
        self.lost: list[str] = []  # peers that went down, until `take_lost` hands them over

    def connect(self, address: str, wait_ms: int = 0) -> bool:
        """Connect to `address` once, giving a new peer up to `wait_ms` to accept.

        False if the address cannot be connected to at all.
        """
        new = address not in self.sockets
        if new:
            socket = self.context.socket(zmq.PUSH)
            socket.setsockopt(zmq.IMMEDIATE, 1)
            socket.setsockopt(zmq.LINGER, 0)
            monitor = socket.get_monitor_socket(UP_EVENTS | DOWN_EVENTS)
            try:
                socket.connect(address)
            except zmq.ZMQError as e:  # e.g. a wildcard or malformed reply address
                log.error("cannot connect to %r: %s", address, e)
                socket.disable_monitor()
                monitor.close(linger=0)
                socket.close(linger=0)
                return False
            self.sockets[address], self.monitors[address], self.up[address] = socket, monitor, False
        if new and wait_ms and self.monitors[address].poll(wait_ms):
            self.poll_events()
        return True

    def poll_events(self) -> None:
        """Apply pending connect/disconnect events; remember peers that went down."""
        for address, monitor in self.monitors.items():
            while monitor.poll(0):
                event = recv_monitor_message(monitor)["event"]
                was_up = self.up[address]
                self.up[address] = bool(event & UP_EVENTS)
                if was_up and not self.up[address]:
                    self.lost.append(address)

    def take_lost(self) -> list[str]:
        """Peers that went down since the last call (each reported once)."""
        self.poll_events()
        lost, self.lost = self.lost, []
        return lost

    def is_up(self, address: str) -> bool:
        self.poll_events()
        return self.up.get(address, False)

    def send(self, address: str, message: Message, wait_ms: int = 0) -> bool:
        """Queue `message` for `address`; False if that peer has no live connection.

        `wait_ms` gives a peer seen for the first time that long to accept the connection.
        """
        if not self.connect(address, wait_ms):
            return False
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
