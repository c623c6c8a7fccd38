"""Request bodies an attacker sends: many large ones at once, slow ones, against the API under
a real uvicorn, over real sockets."""

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn

from epd.api.app import create_app
from epd.api.bodies import Reading
from epd.api.errors import APIError
from epd.api.server import build_service
from epd.config.roles import PrefillConfig
from epd.runtime.health import HTTP_PROTOCOL


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    """The prefill API (peers unserved) under uvicorn on a free port: bodies over 100 bytes
    hold at most 3000 bytes together, at most 3 bodies arrive at once, each within 1 s."""
    sockets = tmp_path_factory.mktemp("bodies")
    config = PrefillConfig(
        model=str(tiny_checkpoint),
        bind=f"ipc://{sockets}/prefill",
        encoders=(f"ipc://{sockets}/encode",),
        decoders=(f"ipc://{sockets}/decode",),
        served_model_name="tiny",
        max_request_bytes_at_once=3000,
        max_arriving_bodies=3,
        request_body_timeout_s=1.0,
    )
    service = build_service(config)
    service.reading.small = 100
    app = create_app(service)
    uvicorn_config = uvicorn.Config(app, port=0, log_config=None, http=HTTP_PROTOCOL)
    running = uvicorn.Server(uvicorn_config)
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    while not running.started:
        assert thread.is_alive()
        time.sleep(0.01)
    yield running.servers[0].sockets[0].getsockname()[1], service
    running.should_exit = True
    thread.join(10)


def begin(port: int, declared: int, sent: bytes = b"", path: str = "/tokenize") -> socket.socket:
    """A POST that announces `declared` bytes of body and has sent `sent` of them so far."""
    connection = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    connection.sendall(f"{head}Content-Length: {declared}\r\n\r\n".encode() + sent)
    return connection


def answer(connection: socket.socket) -> tuple[int, dict[str, str], dict]:
    """The response's status, headers and JSON body; the connection is read to its end."""
    data = b""
    while chunk := connection.recv(65536):
        data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        fields = dict(
            line.decode().lower().split(": ", 1) for line in head.split(b"\r\n")[1:] if line
        )
        if len(body) >= int(fields.get("content-length", "-1")) >= 0:
            break
    connection.close()
    status = int(head.split(b" ")[1])
    return status, fields, json.loads(body)


def tokenize_body(size: int) -> bytes:
    """A valid /tokenize body of exactly `size` bytes."""
    body = b'{"prompt": "hi"}'
    return body + b" " * (size - len(body))


def test_bodies_over_the_bytes_at_once_are_refused_before_they_are_read(server):
    port, service = server
    large = tokenize_body(2000)
    first = begin(port, 2000, large[:10])  # holds 2000 of the 3000 bytes until it is parsed
    started = time.monotonic()
    status, headers, error = answer(begin(port, 2000))  # not a byte of it sent
    assert (status, headers["retry-after"], headers["connection"]) == (503, "1", "close")
    assert "max_request_bytes_at_once" in error["error"]["message"]
    assert time.monotonic() - started < 0.9  # at once, not at the reading deadline
    small = tokenize_body(50)  # a small body takes no bytes of the bound
    assert answer(begin(port, 50, small))[0] == 200
    first.sendall(large[10:])
    assert answer(first)[0] == 200
    assert service.reading.held == 0  # parsed: the bytes are free again
    assert answer(begin(port, 2000, large))[0] == 200


def test_slow_bodies_take_few_places_and_get_408_at_their_deadline(server):
    port, service = server
    slow = [begin(port, 1000, b'{"prompt"', "/v1/chat/completions") for _ in range(3)]
    started = time.monotonic()
    status, headers, error = answer(begin(port, 100, tokenize_body(100)))
    assert (status, headers["retry-after"]) == (503, "1")
    assert "max_arriving_bodies" in error["error"]["message"]
    assert time.monotonic() - started < 0.9
    for connection in slow:
        status, headers, error = answer(connection)  # read to its end: closed after the 408
        assert (status, headers["connection"]) == (408, "close")
        assert "request_body_timeout_s" in error["error"]["message"]
    assert 0.9 < time.monotonic() - started < 5
    assert not service.reading.arriving and service.gate.in_flight == 0
    assert answer(begin(port, 100, tokenize_body(100)))[0] == 200


def test_a_chunked_body_counts_its_bytes_as_they_arrive():
    reading = Reading(max_arriving=4, max_bytes=3000, timeout_s=30.0, small=100)
    declared = reading.admit(2000)
    chunked = reading.admit(None)  # its size unknown: it takes a place, no bytes yet
    parts = iter([{"type": "http.request", "body": b"x" * 900, "more_body": True}] * 2)

    async def receive() -> dict:
        return next(parts)

    asyncio.run(chunked.receive(receive))  # 900: 2900 held in all
    with pytest.raises(APIError, match="max_request_bytes_at_once") as refused:
        asyncio.run(chunked.receive(receive))  # 1800 would pass 3000
    assert refused.value.status == 503
    declared.close()
    chunked.close()  # as the middleware does once its request ends
    assert reading.admit(5000).held == 5000  # alone, a body over the bound is still read


def test_ending_fails_the_bodies_still_arriving_at_once():
    """A stopping server cuts a read that waits for more bytes short, rather than wait for
    its deadline."""
    reading = Reading(max_arriving=4, max_bytes=3000, timeout_s=30.0)

    async def run() -> APIError:
        body = reading.admit(100)
        never = asyncio.Event()

        async def receive() -> dict:
            await never.wait()
            return {}

        read = asyncio.create_task(body.receive(receive))
        await asyncio.sleep(0.05)
        reading.end_all("the server is shutting down")
        with pytest.raises(APIError) as ended:
            await asyncio.wait_for(read, 5)
        return ended.value

    error = asyncio.run(run())
    assert error.status == 503 and error.message == "the server is shutting down"
    assert not reading.arriving
