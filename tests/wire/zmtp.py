"""A raw ZMTP 3.0 peer, as an attacker writes one by hand: no libzmq on its side."""

import socket
import struct
import time

GREETING = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\x00") + bytes(32)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def frame(body: bytes, command: bool = False) -> bytes:
    """One short frame (under 256 bytes): flags, size, body."""
    return bytes([0x04 if command else 0x00, len(body)]) + body


def ready(socket_type: str) -> bytes:
    """The READY command's body: the one property a NULL handshake needs."""
    return b"\x05READY\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type.encode()


PING = frame(b"\x04PING" + bytes(2), command=True)  # TTL 0, no context


def greet(peer: socket.socket, socket_type: str) -> socket.socket:
    """Greetings exchanged and READY sent on a connection: messages may follow."""
    peer.sendall(GREETING)
    greeting = b""
    peer.settimeout(10)
    while len(greeting) < len(GREETING):  # libzmq reads READY only after its greeting
        if not (chunk := peer.recv(len(GREETING) - len(greeting))):
            raise ConnectionResetError("closed in the handshake")
        greeting += chunk
    peer.sendall(frame(ready(socket_type), command=True))
    return peer


def handshake(port: int, socket_type: str) -> socket.socket:
    """A connection to `port`, greeted, as a peer of `socket_type`."""
    return greet(socket.create_connection(("127.0.0.1", port)), socket_type)


def flood_and_reset(port: int, socket_type: str, count: int, pause_s: float = 0.3) -> None:
    """To `port`: `count` 100-byte messages, each followed by a ping, then a reset (SO_LINGER
    0), as from a killed process with unread data. A receiver that died meanwhile resets us."""
    reset_after_flooding(handshake(port, socket_type), count, pause_s)


def reset_after_flooding(peer: socket.socket, count: int, pause_s: float) -> None:
    try:
        peer.sendall((frame(b"x" * 100) + PING) * count)
        time.sleep(pause_s)
    except OSError:
        pass
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    peer.close()
