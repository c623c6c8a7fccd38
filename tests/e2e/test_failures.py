"""Dead peers: errors fast, the rest keeps serving, and a restarted process serves again."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from PIL import Image

from . import stack
from .stack import (
    cluster,
    data_url,
    free_base,
    image_part,
    role,
    serve,
    streams_under_way,
    text_part,
)

IMAGE = [
    {
        "role": "user",
        "content": [image_part(data_url(Image.new("RGB", (56, 56), "red"))), text_part("?")],
    }
]
NEW_IMAGE = [
    {
        "role": "user",
        "content": [image_part(data_url(Image.new("RGB", (56, 56), "blue"))), text_part("?")],
    }
]
TEXT = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def three(tiny_checkpoint):
    with cluster(tiny_checkpoint) as started:
        yield started


def ask(client, messages):
    return client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=3, temperature=0
    )


def eventually(check, timeout=15.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except (openai.APIError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_dead_encode_fails_image_requests_fast_and_text_goes_on(three, tiny_checkpoint):
    processes, client, base = three
    assert ask(client, IMAGE).usage.completion_tokens == 3
    processes["encode"].popen.send_signal(signal.SIGKILL)
    processes["encode"].popen.wait()
    time.sleep(0.3)  # the disconnect reaches prefill's monitor
    start = time.monotonic()
    with pytest.raises(openai.InternalServerError, match="no encode server is reachable") as error:
        ask(client, NEW_IMAGE)
    assert error.value.status_code == 503 and time.monotonic() - start < 2
    assert ask(client, TEXT).usage.completion_tokens == 3  # text skips encode
    assert ask(client, IMAGE).usage.completion_tokens == 3  # an image seen before, too
    processes["encode"] = role("encode", tiny_checkpoint, base).wait_ready()
    assert eventually(lambda: ask(client, NEW_IMAGE)).usage.completion_tokens == 3


def test_dead_decode_fails_fast_then_recovers(three, tiny_checkpoint):
    processes, client, base = three
    processes["decode"].popen.send_signal(signal.SIGKILL)
    processes["decode"].popen.wait()
    time.sleep(0.3)
    start = time.monotonic()
    with pytest.raises(openai.InternalServerError, match="no decode server is reachable"):
        ask(client, TEXT)
    assert time.monotonic() - start < 2
    processes["decode"] = role("decode", tiny_checkpoint, base).wait_ready()
    assert eventually(lambda: ask(client, TEXT)).usage.completion_tokens == 3


def test_a_decoder_killed_mid_stream_fails_its_streams_fast(three, tiny_checkpoint):
    """With no other decoder to move them to (tests/e2e/test_migration.py moves them), its
    streams end with an error event within 2 s: the disconnect, not the 60 s token timeout."""
    processes, client, base = three
    with ThreadPoolExecutor(2) as pool:
        streams = streams_under_way(pool, client, 2)
        processes["decode"].popen.send_signal(signal.SIGKILL)
        start = time.monotonic()
        gone = f"no decode server is reachable \\(tried tcp://127.0.0.1:{base + 2}\\)"
        for stream in streams:
            with pytest.raises(openai.APIError, match=gone):
                stream.result(timeout=30)
        assert time.monotonic() - start < 2
    processes["decode"].popen.wait()
    processes["decode"] = role("decode", tiny_checkpoint, base).wait_ready()
    assert eventually(lambda: ask(client, TEXT)).usage.completion_tokens == 3


def health(port):
    return stack.health(port)[1]


def test_serve_restarts_a_child_that_dies(tiny_checkpoint):
    base = free_base()
    stack = serve(tiny_checkpoint, base)
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{base + 20}/v1", api_key="-", max_retries=0
        )
        model = client.models.list().data[0].id
        old = health(base + 10)["pid"]
        os.kill(old, signal.SIGKILL)
        assert eventually(lambda: health(base + 10)["pid"]) != old
        assert "encode exited with code -9; restarting" in stack.output
        reply = eventually(
            lambda: client.chat.completions.create(
                model=model, messages=IMAGE, max_tokens=2, extra_body={"ignore_eos": True}
            )
        )
        assert reply.usage.completion_tokens == 2
    finally:
        assert stack.stop() == 0


def test_serve_exits_with_the_error_of_a_child_that_cannot_start(tmp_path):
    base = free_base()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "epd.cli",
            "serve",
            "--model",
            str(tmp_path),  # a folder, but no checkpoint: the children fail as they load it
            "--port",
            str(base + 20),
            "--internal-base-port",
            str(base),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "failed to start" in result.stderr and "config.json is missing" in result.stderr


def test_children_end_when_serve_is_killed(tiny_checkpoint):
    """kill -9 of `epd serve` leaves no orphan holding its ports: a new one could bind them
    all at once."""
    base = free_base()
    stack = serve(tiny_checkpoint, base)
    children = [health(base + 10)["pid"], health(base + 12)["pid"], health(base + 20)["pid"]]
    stack.popen.send_signal(signal.SIGKILL)
    stack.popen.wait()
    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {pid: where(pid) for pid in children if alive(pid)}
    for pid in left:  # so that a failure here leaves no process to the tests after it
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    # Which child stays and in what state, and what the roles said: a failure says why.
    assert not left, f"children still run 20 s after serve was killed: {left}\n{stack.output}"
    ports = (base, base + 1, base + 2, base + 10, base + 12, base + 20)
    assert all(bindable(port) for port in ports), stack.output


def bindable(port: int) -> bool:
    """Whether a new server could listen on the port now: nothing listens there (a socket
    of the old one's in TIME_WAIT does not count, as servers bind with SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True


def where(pid: int) -> str:
    """Which role a process is (its command line) and its state, from /proc."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            command = cmdline.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except FileNotFoundError:
        return "gone"
    return f"{command}: {state(pid) or 'gone'}"


def alive(pid: int) -> bool:
    """Running, not ended: a zombie waiting for its new parent to reap it has ended."""
    now = state(pid)
    return now is not None and not now.startswith("Z")


def state(pid: int) -> str | None:
    """A process's state as /proc names it ("S (sleeping)"), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            line = next(line for line in status if line.startswith("State:"))
    except FileNotFoundError:
        return None
    return line.split(maxsplit=1)[1].strip()
