"""Ctrl-C on `epd serve` with streams in flight: they drain, and what the drain leaves (or a
second Ctrl-C cuts short) ends with an OpenAI-style error event and [DONE], never a cut
connection or a traceback. Timings leave room for a loaded 2-core machine."""

import json
import signal
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import requests

from .stack import LONG, Process, free_base, health, serve
from .test_failures import alive


def events(port: int, started: threading.Semaphore) -> list[str]:
    """What the `data:` lines of one long chat stream carry, read until the server ends it;
    `started` is released once decode holds it (its second piece of text)."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "count"}],
        "max_tokens": LONG,
        "stream": True,
        "ignore_eos": True,
    }
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    said: list[str] = []
    with requests.post(url, json=body, stream=True, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith(b"data: "):
                said.append(line[len(b"data: ") :].decode())
                if len(said) == 3:  # the role's chunk, then two pieces of text
                    started.release()
    return said


def streams_under_way(pool: ThreadPoolExecutor, port: int, count: int) -> list[Future[list[str]]]:
    started = threading.Semaphore(0)
    streams = [pool.submit(events, port, started) for _ in range(count)]
    for _ in streams:
        assert started.acquire(timeout=30), "a stream did not get under way"
    return streams


def body_under_way(port: int) -> socket.socket:
    """A chat request whose body has begun to arrive (a few bytes of the 1 MB announced): its
    deadline is ~17 s away."""
    connection = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    connection.sendall(f"{head}Content-Length: {1 << 20}\r\n\r\n".encode() + b'{"model": ')
    return connection


def answer(connection: socket.socket) -> tuple[str, dict]:
    """The response's head and JSON body, read until the server closes the connection."""
    data = b""
    while chunk := connection.recv(65536):
        data += chunk
    connection.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return head.decode().lower(), json.loads(body)


def assert_ended_with_an_error(said: list[str]) -> None:
    assert said[-1] == "[DONE]", said[-3:]
    error = json.loads(said[-2])["error"]
    assert error["message"] == "the server stopped before this request finished"
    assert error["code"] == "service_unavailable"
    assert len(said) < LONG  # ended, not finished


def assert_gone_within(stack: Process, pids: list[int], seconds: float, since: float) -> None:
    """`epd serve` and every role it ran are gone `seconds` after `since`, cleanly: no
    traceback in anything they logged."""
    assert stack.popen.wait(seconds) == 0, stack.output
    assert not [pid for pid in pids if alive(pid)]
    took = time.monotonic() - since
    assert took < seconds, f"{took:.1f}s"
    assert "Traceback" not in stack.output, stack.output


def test_streams_the_drain_leaves_end_with_an_error_event(tiny_checkpoint):
    base = free_base()
    stack = serve(tiny_checkpoint, base, "--served-model-name", "tiny", "--drain-timeout-s", "2")
    pids = list(stack.role_pids().values())
    try:
        with ThreadPoolExecutor(2) as pool:
            streams = streams_under_way(pool, base + 20, 2)
            arriving = body_under_way(base + 20)
            deadline = time.monotonic() + 10
            while health(base + 20)[1].get("in_flight") != 3:  # its headers are in
                assert time.monotonic() < deadline, "the body's request was not taken"
                time.sleep(0.05)
            asked = time.monotonic()
            stack.popen.send_signal(signal.SIGINT)
            ended = [stream.result(timeout=30) for stream in streams]
            took = time.monotonic() - asked
        for said in ended:
            assert_ended_with_an_error(said)
        head, body = answer(arriving)  # as the streams' error, and no retry on this server
        assert head.startswith("http/1.1 503") and "connection: close" in head
        assert "retry-after" not in head and body["error"]["code"] == "service_unavailable"
        assert 2 <= took < 2 + 8  # the drain, then at once (it was ~44 s, cut, before)
        assert_gone_within(stack, pids, 2 + 12, asked)
    finally:
        stack.stop()
    assert "drain: 3 requests still in flight after 2.0s: each ends with an error" in stack.output


def test_a_second_ctrl_c_ends_the_streams_at_once(tiny_checkpoint):
    base = free_base()
    stack = serve(tiny_checkpoint, base, "--served-model-name", "tiny", "--drain-timeout-s", "300")
    pids = list(stack.role_pids().values())
    try:
        with ThreadPoolExecutor(2) as pool:
            streams = streams_under_way(pool, base + 20, 2)
            stack.popen.send_signal(signal.SIGINT)
            deadline = time.monotonic() + 10
            while health(base + 20)[1].get("status") != "unavailable":  # draining
                assert time.monotonic() < deadline, "no drain began"
                time.sleep(0.05)
            assert not any(stream.done() for stream in streams)
            asked = time.monotonic()
            stack.popen.send_signal(signal.SIGINT)  # was ignored: the streams ran to their end
            ended = [stream.result(timeout=30) for stream in streams]
            assert time.monotonic() - asked < 8
        for said in ended:
            assert_ended_with_an_error(said)
        assert_gone_within(stack, pids, 10, asked)
    finally:
        stack.stop()
    assert "in flight when asked again to stop: each ends with an error" in stack.output
