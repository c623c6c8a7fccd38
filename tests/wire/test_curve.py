"""CURVE on real sockets: peers with the cluster's keys talk, peers without them never reach
the decoder."""

import time

import zmq

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
