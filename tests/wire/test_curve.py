"""CURVE on real sockets: peers with the cluster's keys talk, peers without them never reach
the decoder."""

import asyncio
import time

import zmq
import zmq.asyncio

from epd.wire.curve import CurveKeys, authenticate, make_keys
from epd.wire.messages import Abort
from epd.wire.outbox import Outbox
from epd.wire.transport import Inbox


def received(inbox: Inbox, outbox: Outbox, seconds: float = 1.5):
    """The next message, while the outbox sends what waits for the handshake."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        outbox.poll()
        if (message := inbox.recv(50)) is not None:
            return message
    return None


def test_only_peers_with_the_keys_get_through(tmp_path):
    keys = CurveKeys.load(make_keys(tmp_path / "keys"))
    context = zmq.Context()
    authenticator = authenticate(context, keys)
    inbox = Inbox(context, "tcp://127.0.0.1:*", curve=keys)
    address = inbox.socket.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        outbox = Outbox(context, pinned=[address], curve=keys)
        assert outbox.send(address, Abort("with-keys"))
        assert received(inbox, outbox) == Abort("with-keys")

        plain = context.socket(zmq.PUSH)  # no CURVE at all
        plain.connect(address)
        plain.send(b"junk that would reach the decoder", zmq.NOBLOCK)
        stranger = context.socket(zmq.PUSH)  # knows the server key, has keys of its own
        public, secret = zmq.curve_keypair()
        stranger.curve_serverkey, stranger.curve_publickey = keys.server_public, public
        stranger.curve_secretkey = secret
        stranger.connect(address)
        stranger.send(b"junk", zmq.NOBLOCK)
        assert received(inbox, outbox) is None and inbox.refusals.total == 0  # never decoded

        assert outbox.send(address, Abort("still-open"))  # the keyed peer is unaffected
        assert received(inbox, outbox) == Abort("still-open")
    finally:
        authenticator.stop()
        context.destroy(linger=0)  # every socket, whatever failed


def test_keys_are_private_and_never_overwritten(tmp_path):
    import pytest

    folder = make_keys(tmp_path / "keys")
    assert folder.stat().st_mode & 0o077 == 0
    assert (folder / "server.key_secret").stat().st_mode & 0o077 == 0
    with pytest.raises(ValueError, match="not overwriting"):
        make_keys(folder)
    with pytest.raises(ValueError, match="epd keys"):
        CurveKeys.load(tmp_path / "nowhere")


def test_a_failed_handshake_beside_live_peers_does_not_end_the_reading(tmp_path):
    """Once a stranger fails its handshake beside two members' connections, the CURVE server's
    asyncio socket can report input before a message, and pyzmq raises Again out of the await:
    prefill's reading task ended there and no message was read again (the two: decode's and
    encode's). The inbox takes it as no message, and the next ones arrive."""
    keys = CurveKeys.load(make_keys(tmp_path / "keys"))
    server = zmq.asyncio.Context()
    clients = [zmq.Context() for _ in range(2)]
    authenticators = [authenticate(context, keys) for context in (server, *clients)]
    inbox = Inbox(server, "tcp://127.0.0.1:*", curve=keys)
    address = inbox.socket.getsockopt_string(zmq.LAST_ENDPOINT)
    idle, sender = (Outbox(context, [address], curve=keys) for context in clients)

    async def next_message() -> Abort | None:
        while True:  # as prefill reads: None (refused or not there) and on
            if (message := await inbox.arecv()) is not None:
                return message

    async def main() -> list[Abort | None]:
        for _ in range(50):  # both connect
            idle.poll(), sender.poll()
            await asyncio.sleep(0.01)
        stranger, plains, got = zmq.Context(), [], []
        for round in range(3):
            sender.send(address, Abort(f"before-{round}"))
            got.append(await asyncio.wait_for(next_message(), 5))
            plain = stranger.socket(zmq.PUSH)  # no CURVE: fails the handshake
            plains.append(plain)
            plain.connect(address)
            plain.send(b"x", zmq.NOBLOCK)
            for _ in range(50):
                idle.poll(), sender.poll()
                await asyncio.sleep(0.01)
            sender.send(address, Abort(f"after-{round}"))
            got.append(await asyncio.wait_for(next_message(), 5))
        for plain in plains:
            plain.close(linger=0)
        stranger.term()
        return got

    try:
        names = [f"{when}-{round}" for round in range(3) for when in ("before", "after")]
        assert asyncio.run(main()) == [Abort(name) for name in names]
    finally:
        for outbox in (idle, sender):
            outbox.close()
        inbox.close()
        for authenticator in authenticators:
            authenticator.stop()
        for context in (*clients, server):
            context.destroy(linger=0)
