"""ZeroMQ CURVE between the processes: only those holding the cluster's keys can connect.

One key directory serves a whole deployment (`epd keys DIR` makes it; copy it to every node):
- `server.key_secret`: every bound socket (encode, prefill, decode) is a CURVE server with it;
- `client.key_secret`: every connecting socket proves itself with it, and knows the server's
  public key (`server.key`), so it cannot be sent to an impostor;
- an authenticator (ZAP) in each process admits only the public keys found in the directory.

A peer without the keys fails the CURVE handshake: ZeroMQ drops it before any byte of a
message reaches our decoder.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

ROLES = ("server", "client")


@dataclass(frozen=True)
class CurveKeys:
    directory: Path
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def load(cls, directory: str | Path) -> CurveKeys:
        """The keys `epd keys` wrote to `directory`; ValueError naming what is missing."""
        folder = Path(directory)
        try:
            server = zmq.auth.load_certificate(folder / "server.key_secret")
            client = zmq.auth.load_certificate(folder / "client.key_secret")
        except (OSError, ValueError) as e:
            raise ValueError(
                f"zmq_curve_keys={str(directory)!r}: no CURVE keys there ({e}); "
                "make them with `epd keys DIR`"
            ) from None
        if server[1] is None or client[1] is None:
            raise ValueError(f"zmq_curve_keys={str(directory)!r}: a secret key is missing")
        return cls(folder, server[0], server[1], client[0], client[1])

    def serve(self, socket: zmq.Socket) -> None:
        """Make a socket that binds a CURVE server (before it binds)."""
        socket.curve_server = True
        socket.curve_publickey = self.server_public
        socket.curve_secretkey = self.server_secret

    def connect(self, socket: zmq.Socket) -> None:
        """Make a socket that connects a CURVE client of the cluster (before it connects)."""
        socket.curve_serverkey = self.server_public
        socket.curve_publickey = self.client_public
        socket.curve_secretkey = self.client_secret


def authenticate(context: zmq.Context, keys: CurveKeys) -> ThreadAuthenticator:
    """Start the process's authenticator: CURVE clients are admitted by their public key, which
    must be one in the key directory."""
    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve(domain="*", location=str(keys.directory))
    return authenticator


@functools.cache
def process_keys(directory: str) -> CurveKeys | None:
    """This process's keys, with its authenticator started on its one context (once; it lives
    as long as the process); None when `directory` is empty (CURVE off)."""
    if not directory:
        return None
    keys = CurveKeys.load(directory)
    _AUTHENTICATORS.append(authenticate(zmq.Context.instance(), keys))
    return keys


_AUTHENTICATORS: list[ThreadAuthenticator] = []


def make_keys(directory: str | Path, if_missing: bool = False) -> Path:
    """Write a new cluster key directory (readable by its owner only); one that holds keys
    already is kept as it is when `if_missing`, else refused."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    held = [role for role in ROLES if (folder / f"{role}.key_secret").exists()]
    if if_missing and len(held) == len(ROLES):
        return folder
    if held:
        raise ValueError(f"{folder} already holds CURVE keys: not overwriting them")
    for role in ROLES:
        _, secret = zmq.auth.create_certificates(folder, role)
        os.chmod(secret, 0o600)
    return folder
