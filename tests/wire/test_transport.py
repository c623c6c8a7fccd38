"""Inbox and Outbox over real ZeroMQ sockets."""

import time

import pytest
import torch
import zmq

from epd.wire.messages import Abort, ImageEmbeddings
from epd.wire.transport import Inbox, Outbox


@pytest.fixture
def address(tmp_path):
    return f"ipc://{tmp_path}/peer"


@pytest.fixture
def context():
    return zmq.Context()


def wait_until(check, timeout=3.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


def test_lost_peers_are_kept_for_the_watcher_even_if_someone_asks_is_up(context, address):
    inbox, outbox = Inbox(context, address), Outbox(context)
    outbox.connect(address, wait_ms=2000)
    inbox.close()
    assert wait_until(lambda: not outbox.is_up(address))
    assert outbox.take_lost() == [address]
    outbox.close()


def test_unconnectable_address_is_refused_not_raised(context):
    outbox = Outbox(context)
    assert outbox.send("tcp://*:7102", Abort("r")) is False
    assert outbox.sockets == {}
    outbox.close()


def test_send_to_an_absent_peer_fails_at_once(context, address):
    outbox = Outbox(context)
    start = time.monotonic()
    assert outbox.send(address, Abort("r")) is False
    assert time.monotonic() - start < 0.5
    outbox.close()


def test_messages_arrive_typed(context, address):
    inbox, outbox = Inbox(context, address), Outbox(context)
    outbox.connect(address, wait_ms=2000)
    assert outbox.is_up(address)
    embeddings = torch.randn(6, 4)
    assert outbox.send(address, ImageEmbeddings("r", 0, ((4, 6),), embeddings))
    received = inbox.recv(timeout_ms=2000)
    assert isinstance(received, ImageEmbeddings) and torch.equal(received.embeddings, embeddings)
    inbox.close(), outbox.close()


def test_disconnect_is_reported_and_reconnect_recovers(context, address):
    inbox, outbox = Inbox(context, address), Outbox(context)
    outbox.connect(address, wait_ms=2000)
    inbox.close()
    assert wait_until(lambda: address in outbox.take_lost())
    assert outbox.take_lost() == []  # reported once
    assert outbox.send(address, Abort("lost")) is False
    inbox = Inbox(context, address)  # the peer comes back on the same address
    assert wait_until(lambda: outbox.is_up(address))
    assert outbox.send(address, Abort("again"))
    assert inbox.recv(timeout_ms=2000) == Abort("again")
    inbox.close(), outbox.close()


def test_refused_message_is_dropped_and_the_inbox_goes_on(context, address, caplog):
    inbox = Inbox(context, address)
    raw = context.socket(zmq.PUSH)
    raw.connect(address)
    raw.send_multipart([b"\x80\x05cos\nsystem\n."])
    raw.send_multipart([b"not a pickle at all"])
    outbox = Outbox(context)
    outbox.connect(address, wait_ms=2000)
    outbox.send(address, Abort("fine"))
    received = [inbox.recv(timeout_ms=2000) for _ in range(3)]  # fair-queued: any order
    assert sorted(received, key=str) == [Abort("fine"), None, None]
    assert caplog.text.count("refused a message") == 2
    raw.close(linger=0), inbox.close(), outbox.close()
