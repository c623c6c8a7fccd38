"""Inbox and Outbox over real ZeroMQ sockets: nothing waits on a peer, nothing grows unbounded."""

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest.mock

import pytest
import torch
import zmq

from epd.wire import outbox as outbox_module
from epd.wire import transport
from epd.wire.messages import Abort, ImageEmbeddings
from epd.wire.outbox import Outbox
from epd.wire.transport import Inbox, WireProbe

from . import zmtp


@pytest.fixture
def address(tmp_path):
    return f"ipc://{tmp_path}/peer"


@pytest.fixture
def context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def wait_until(check, timeout=3.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


ROWS = torch.zeros(16, 1024)  # 64 KiB a message: libzmq's queues hold a few


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_messages_arrive_typed(context, address):
    inbox, outbox = Inbox(context, address), Outbox(context, [address])
    assert wait_until(lambda: outbox.is_up(address))
    embeddings = torch.randn(6, 4)
    assert outbox.send(address, ImageEmbeddings("r", 0, ((4, 6),), embeddings))
    received = inbox.recv(timeout_ms=2000)
    assert isinstance(received, ImageEmbeddings) and torch.equal(received.embeddings, embeddings)


def test_connections_that_are_no_live_peer_are_dropped(context, monkeypatch):
    """One that never finishes its handshake and one that finishes it and then answers no
    ping each hold a descriptor; both are dropped, while a real peer stays connected."""
    monkeypatch.setattr(transport, "HANDSHAKE_MS", 500)
    monkeypatch.setattr(transport, "HEARTBEAT_MS", 100)
    monkeypatch.setattr(transport, "HEARTBEAT_TIMEOUT_MS", 500)
    port = zmtp.free_port()
    address = f"tcp://127.0.0.1:{port}"
    inbox, outbox = Inbox(context, address), Outbox(context, [address])
    silent = socket.create_connection(("127.0.0.1", port))
    mute = socket.create_connection(("127.0.0.1", port))
    mute.sendall(zmtp.GREETING + zmtp.frame(zmtp.ready("PUSH"), command=True))
    for connection in (silent, mute):
        connection.settimeout(5)
        while connection.recv(4096):  # its greeting, then pings, until the inbox closes it
            pass
    assert outbox.is_up(address) and outbox.send(address, Abort("still-here"))
    assert inbox.recv(timeout_ms=2000) == Abort("still-here")


# A process with an inbox for messages up to 1 GiB (a receive limit, as the inbox had, would be
# 2 of them a connection), that reads nothing for 2.5 s while raw peers flood it and reset
# their connections, then reads until a message from an
# honest sender arrives: "alive N" (N raw messages read, each refused) if it got there.
RECEIVER = """
import sys, time, zmq
from epd.wire.codec import encode
from epd.wire.messages import Abort
from epd.wire.transport import Inbox
context = zmq.Context()
inbox = Inbox(context, sys.argv[1], max_frame_bytes=1 << 30)
print("bound", flush=True)
time.sleep(2.5)
honest = context.socket(zmq.PUSH)
honest.connect(sys.argv[1])
honest.send_multipart(encode(Abort("honest")))
deadline = time.monotonic() + 10
while inbox.recv(timeout_ms=100) != Abort("honest") and time.monotonic() < deadline:
    pass
while inbox.socket.poll(300):  # and whatever the raw peers left
    inbox.recv(timeout_ms=0)
print("alive", inbox.refusals.total, flush=True)
"""


def survives() -> subprocess.CompletedProcess:
    port = zmtp.free_port()
    receiver = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, f"tcp://127.0.0.1:{port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert receiver.stdout.readline() == "bound\n"
    for _ in range(4):
        zmtp.flood_and_reset(port, "PUSH", 200)
    out, err = receiver.communicate(timeout=30)
    return subprocess.CompletedProcess(receiver.args, receiver.returncode, out, err)


def test_a_peer_that_floods_and_resets_cannot_abort_the_receiver(context, address):
    """libzmq 4.3.5 aborts on a connection whose reading it stopped at the receive limit, once
    it is reset and libzmq writes to it: a heartbeat, or the answer to a ping read before the
    stop. With the limit the inbox had (2 messages of its largest size, here), this test's
    receiver died of SIGABRT in every run; the inbox now has no limit, so reading never stops."""
    assert Inbox(context, address).socket.getsockopt(zmq.RCVHWM) == 0  # no limit, any size
    result = survives()
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("alive") and int(result.stdout.split()[1]) == 4 * 200


# A process with an outbox pinned to a peer, polling it for 3 s: "alive" if it got there.
SENDER = """
import sys, time, zmq
from epd.wire.outbox import Outbox
outbox = Outbox(zmq.Context(), [sys.argv[1]])
deadline = time.monotonic() + 3
while time.monotonic() < deadline:
    outbox.poll()
    time.sleep(0.05)
print("alive", flush=True)
"""


def test_a_peer_an_outbox_connects_to_cannot_abort_it_by_flooding_and_resetting():
    """A PUSH socket's inbound side is never read: a peer that writes ZMTP by hand (claiming
    to be a PULL) filled libzmq's default limit of 1000 there and reset, and the sender died
    of SIGABRT at its next heartbeat (checked); the outbox sets no limit."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    sender = subprocess.Popen(
        [sys.executable, "-c", SENDER, f"tcp://127.0.0.1:{port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    listener.settimeout(20)
    try:
        peer, _ = listener.accept()
        zmtp.reset_after_flooding(zmtp.greet(peer, "PULL"), 2000, pause_s=0.3)
    except BaseException:
        sender.kill()
        raise
    finally:
        listener.close()
    out, err = sender.communicate(timeout=30)
    assert sender.returncode == 0 and out == "alive\n", err


def test_an_inbox_says_whether_a_message_waits_unread(context, address):
    inbox, outbox = Inbox(context, address), Outbox(context, [address])
    assert wait_until(lambda: outbox.is_up(address)) and not inbox.pending()
    assert outbox.send(address, Abort("r"))
    assert wait_until(inbox.pending)
    assert isinstance(inbox.recv(timeout_ms=2000), Abort) and not inbox.pending()
    assert outbox.send(address, Abort("r"))
    assert wait_until(inbox.pending)
    inbox.close()
    assert not inbox.pending()  # closed: never, and no error


def test_the_first_message_to_a_new_peer_waits_for_its_connection(context, address):
    inbox, outbox = Inbox(context, address), Outbox(context)
    assert outbox.send(address, Abort("first"))  # queued: the connection is not up yet
    assert wait_until(lambda: outbox.poll() and outbox.queued == 0)
    assert inbox.recv(timeout_ms=2000) == Abort("first")


def test_a_dead_peer_costs_no_wait_and_is_reported_once(context, address):
    outbox = Outbox(context, connect_timeout_s=0.2)
    start = time.monotonic()
    for i in range(100):
        assert outbox.send(address, Abort(f"r{i}"))
    assert time.monotonic() - start < 2.0  # waiting on the peer would take 100 × 0.2 s
    losses = []
    assert wait_until(lambda: losses.extend(outbox.poll().requests) or len(losses) == 100)
    assert losses == [(address, f"r{i}") for i in range(100)]  # each request reported once
    assert outbox.queued == 0 and outbox.queued_bytes == 0 and outbox.peers == {}


def test_queues_are_bounded(context, address):
    outbox = Outbox(context, max_queued=3)
    assert all(outbox.send(address, Abort(f"r{i}")) for i in range(3))
    assert not outbox.send(address, Abort("r3"))
    small = Outbox(context, max_queued_bytes=2000)
    assert not small.send(address, ImageEmbeddings("r", 0, ((2, 2),), torch.zeros(1, 1000)))


def test_disconnect_is_reported_and_reconnect_recovers(context, address):
    inbox, outbox = Inbox(context, address), Outbox(context, [address])
    assert wait_until(lambda: outbox.is_up(address))
    inbox.close()
    assert wait_until(lambda: outbox.poll().peers == [address])
    assert outbox.poll().peers == []  # reported once
    inbox = Inbox(context, address)  # the peer comes back on the same address
    assert wait_until(lambda: outbox.is_up(address))
    assert outbox.send(address, Abort("again"))
    assert inbox.recv(timeout_ms=2000) == Abort("again")


def test_unconnectable_address_is_refused_not_raised(context):
    outbox = Outbox(context)
    assert outbox.send("tcp://*:7102", Abort("r")) is False
    assert outbox.peers == {}


def test_distinct_reply_addresses_cannot_exhaust_descriptors(context, tmp_path):
    outbox = Outbox(context, max_peers=16, idle_close_s=0.3, connect_timeout_s=0.1)
    outbox.send(f"ipc://{tmp_path}/warm-up", Abort("r"))  # libzmq starts its threads
    assert wait_until(lambda: outbox.poll() and not outbox.peers)
    before = open_fds()
    for i in range(500):
        outbox.send(f"ipc://{tmp_path}/dead-{i}", Abort("r"))
        outbox.poll()
    assert len(outbox.peers) <= 16
    # libzmq's reaper thread frees a closed socket's descriptors a little later, later still
    # on busy cores; what must hold is that they do not stay.
    assert wait_until(lambda: open_fds() - before < 16 * 4)
    assert wait_until(lambda: outbox.poll() and not outbox.peers)  # dead ones are closed
    assert wait_until(lambda: open_fds() <= before)


def test_a_flood_of_dead_reply_addresses_cannot_lock_out_a_live_peer(context, address, tmp_path):
    inbox = Inbox(context, address)
    outbox = Outbox(context, max_peers=8, connect_timeout_s=0.3)
    for i in range(8):  # every slot holds a message for a peer that will never answer
        assert outbox.send(f"ipc://{tmp_path}/dead-{i}", Abort(f"dead-{i}"))
    assert outbox.send(address, Abort("live"))  # the least recently used dead peer made room
    losses = []

    def settled():
        losses.extend(outbox.poll().requests)
        return len(losses) == 8

    assert wait_until(settled)  # the evicted one at once, the others when they time out
    assert (f"ipc://{tmp_path}/dead-0", "dead-0") in losses
    assert inbox.recv(timeout_ms=2000) == Abort("live")


def test_a_flood_of_dead_reply_addresses_cannot_push_out_a_slow_live_peer(context, tmp_path):
    """A live peer reading slowly, whose messages all sit in libzmq (none in the outbox's own
    queue), is not the one evicted for a flood of reply addresses nobody serves; and once it
    is evicted (only live peers left), what libzmq held for it still arrives."""
    slow = context.socket(zmq.PULL)
    slow.setsockopt(zmq.RCVHWM, 1)
    address = f"ipc://{tmp_path}/slow"
    slow.bind(address)
    outbox = Outbox(context, max_peers=8, connect_timeout_s=0.3)
    assert outbox.send(address, Abort("first")) and wait_until(lambda: outbox.is_up(address))
    outbox.poll()  # the first goes out
    sent = 1
    while not outbox.peers[address].queue:  # libzmq's queues fill up
        assert outbox.send(address, ImageEmbeddings(f"r{sent}", 0, ((2, 2),), ROWS))
        sent += 1

    def arrived() -> bool:
        # libzmq tells the sender of the room a read made asynchronously: keep offering what
        # waits (as every role's loop polls), or the peer may wait on an empty pipe.
        outbox.poll()
        return bool(slow.poll(10))

    while outbox.peers[address].queue:  # the peer reads a little; what waited goes to libzmq
        assert wait_until(arrived)
        slow.recv_multipart()
        sent -= 1
    for i in range(20):  # each takes a slot, and waits for a connection that never comes
        assert outbox.send(f"ipc://{tmp_path}/dead-{i}", Abort(f"dead-{i}"))
    assert address in outbox.peers  # the dead ones made room for one another
    live = []
    for i in range(7):  # live peers fill the other slots: the slow one is pushed out at last
        live.append(Inbox(context, f"ipc://{tmp_path}/live-{i}"))
        assert outbox.send(f"ipc://{tmp_path}/live-{i}", Abort(f"live-{i}"))
        assert wait_until(lambda: not outbox.poll().peers and outbox.queued == 0)
    assert outbox.send(f"ipc://{tmp_path}/live-7", Abort("live-7"))
    assert address not in outbox.peers and outbox.poll().requests == []
    for _ in range(sent):  # ...and every message it was handed arrives
        assert slow.poll(3000), "a message handed to libzmq was dropped"
        slow.recv_multipart()
    slow.close(linger=0)


def test_pinned_peers_stay_open(context, address):
    outbox = Outbox(context, [address], idle_close_s=0.05)
    time.sleep(0.1)
    outbox.poll()
    assert address in outbox.peers


def test_refused_message_is_dropped_and_the_inbox_goes_on(context, address, caplog):
    inbox = Inbox(context, address)
    raw = context.socket(zmq.PUSH)
    raw.connect(address)
    raw.send_multipart([b"\x80\x05cos\nsystem\n."])
    raw.send_multipart([b"not a header at all"])
    outbox = Outbox(context, [address])
    assert wait_until(lambda: outbox.is_up(address))
    outbox.send(address, Abort("fine"))
    received = [inbox.recv(timeout_ms=2000) for _ in range(3)]  # fair-queued: any order
    assert sorted(received, key=str) == [Abort("fine"), None, None]
    assert caplog.text.count("refused a message") == 2 and inbox.refusals.total == 2
    raw.close(linger=0)


def test_a_frame_over_the_limit_is_never_read(context, address):
    inbox = Inbox(context, address, max_frame_bytes=1 << 20)
    raw = context.socket(zmq.PUSH)
    raw.connect(address)
    raw.send(bytes(8 << 20))
    outbox = Outbox(context, [address])
    assert wait_until(lambda: outbox.is_up(address))
    outbox.send(address, Abort("after"))
    assert inbox.recv(timeout_ms=2000) == Abort("after")
    assert inbox.recv(timeout_ms=200) is None  # the big frame never arrived
    raw.close(linger=0)


def test_a_peer_that_does_not_read_makes_messages_wait_then_fail_by_age(context, address):
    """A peer whose libzmq takes nothing more (a stopped process: its buffers fill)."""
    stopped = context.socket(zmq.PULL)
    stopped.setsockopt(zmq.RCVHWM, 1)
    stopped.bind(address)
    outbox = Outbox(context, [address], stall_timeout_s=0.5)
    assert wait_until(lambda: outbox.is_up(address))
    rows = torch.zeros(16, 1024)  # 64 KiB a message
    sent = [outbox.send(address, ImageEmbeddings(f"r{i}", 0, ((2, 2),), rows)) for i in range(600)]
    assert all(sent) and outbox.queued > 0  # what libzmq did not take waits, in order
    first = int(outbox.peers[address].queue[0].request_id[1:])
    losses = []
    assert wait_until(lambda: losses.extend(outbox.poll().requests) or outbox.queued == 0)
    # Lost by age, in order, up to the last; libzmq may still have taken a few of the first
    # waiting ones as the receiving side's buffers filled (its I/O thread reads on its own).
    assert {a for a, _ in losses} == {address}
    lost = [int(request_id[1:]) for _, request_id in losses]
    assert lost[0] >= first and lost == list(range(lost[0], 600))
    assert not outbox.poll().peers  # the peer is not lost
    stopped.close(linger=0)


def test_a_peer_that_stalls_for_seconds_loses_nothing(context, address, monkeypatch):
    """A receiver that reads nothing for a while (its loop held by one large request): its
    libzmq reads on, and answers pings; neither side may take that for a dead peer. Every
    message arrives, in order, once it reads again. The sender's timeouts shrunk: its
    heartbeat's to 0.3 s, a message's wait for a connection to 0.2 s."""
    for module in (outbox_module, transport):  # each side pings every 0.1 s
        monkeypatch.setattr(module, "HEARTBEAT_MS", 100)
    monkeypatch.setattr(outbox_module, "HEARTBEAT_TIMEOUT_MS", 300)
    inbox = Inbox(context, address)
    outbox = Outbox(context, [address], connect_timeout_s=0.2, stall_timeout_s=30)
    assert wait_until(lambda: outbox.is_up(address))
    sent, deadline = 0, time.monotonic() + 1.5  # five heartbeat timeouts, nothing read
    while time.monotonic() < deadline:
        for _ in range(50):
            assert outbox.send(address, Abort(f"r{sent}"))
            sent += 1
        losses = outbox.poll()
        assert losses.requests == [] and losses.peers == []
        time.sleep(0.01)
    received, deadline = [], time.monotonic() + 10
    while len(received) < sent and time.monotonic() < deadline:
        message = inbox.recv(timeout_ms=10)
        if message is None:  # send what waited, if anything did
            losses = outbox.poll()
            assert losses.requests == [] and losses.peers == []
        else:
            received.append(message.request_id)
    assert received == [f"r{i}" for i in range(sent)] and outbox.queued == 0
    inbox.close()


def refused_all(context, address, payload: bytes, count: int) -> Inbox:
    """An inbox that took `count` copies of `payload` from a raw peer, each refused."""
    inbox = Inbox(context, address)
    raw = context.socket(zmq.PUSH)
    raw.connect(address)
    for _ in range(count):
        raw.send(payload)
    while inbox.recv(timeout_ms=500) is not None or inbox.refusals.total < count:
        pass
    raw.close(linger=0)
    return inbox


def test_refusals_are_counted_and_logged_a_few_a_second(context, address, caplog):
    assert refused_all(context, address, b"junk", 200).refusals.total == 200
    assert caplog.text.count("refused a message") <= 30


def test_a_message_the_decoder_fails_on_is_a_counted_refusal(context, address, caplog, monkeypatch):
    """A decoder bug (any exception, not only a WireError) drops the message, and a peer that
    sends it again and again gets it counted and logged a few times a second, no more."""

    def broken(frames, max_header_bytes):
        raise RuntimeError("Storage size calculation overflowed")

    monkeypatch.setattr(transport, "decode", broken)
    assert refused_all(context, address, b"anything", 100).refusals.total == 100
    assert "RuntimeError: Storage size calculation overflowed" in caplog.text
    assert caplog.text.count("refused a message") <= 30 and "Traceback" not in caplog.text


def test_the_probe_sees_the_io_thread_move_messages(context):
    """Over a socket in a directory only this user may enter: no one else can flood it."""
    trips = threading.Semaphore(0)
    probe = WireProbe(context, trips.release, interval_s=0.05)
    assert os.stat(probe.directory).st_mode & 0o777 == 0o700
    assert probe.pull.getsockopt(zmq.LAST_ENDPOINT).decode().startswith(f"ipc://{probe.directory}")
    assert all(trips.acquire(timeout=2) for _ in range(3))
    probe.close()
    assert not os.path.exists(probe.directory)


def test_the_probe_goes_over_loopback_where_tmpdir_is_too_long_for_a_socket(context, tmp_path):
    long = tmp_path / ("d" * 100)  # with /epd-probe-XXXXXXXX/probe, past a socket path's 107
    long.mkdir()
    trips = threading.Semaphore(0)
    with unittest.mock.patch.object(tempfile, "tempdir", str(long)):
        probe = WireProbe(context, trips.release, interval_s=0.05)
    assert probe.pull.getsockopt(zmq.LAST_ENDPOINT).decode().startswith("tcp://127.0.0.1:")
    assert all(trips.acquire(timeout=2) for _ in range(3))
    probe.close()
    assert list(long.iterdir()) == []
