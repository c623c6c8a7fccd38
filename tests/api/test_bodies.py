"""Request bodies an attacker sends: many large ones at once, slow ones, against the API under
a real uvicorn, over real sockets."""

import asyncio
import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import uvicorn

from epd.api.app import create_app
from epd.api.bodies import FIRST_BYTES_S, MIN_RATE, Reading, body_length
from epd.api.errors import APIError
from epd.api.middleware import BodyLimit, BodyLimits
from epd.api.server import build_service, end_requests
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
    # as every request in flight ends at the drain's end: no Retry-After from a server that stops
    assert (error.code, error.headers) == ("service_unavailable", {"Connection": "close"})
    assert not reading.arriving


def test_a_cut_short_after_the_bodys_own_deadline_fired_does_not_raise():
    """The deadline and the stop in the same pass of the loop: an expiring timeout cannot be
    moved, and the stop's clean-up must go on (it used to raise RuntimeError)."""
    reading = Reading(max_arriving=4, max_bytes=3000, timeout_s=30.0)

    async def run() -> None:
        body = reading.admit(100)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(-1) as body.timeout:  # fires at the next pass
                try:
                    await asyncio.sleep(1)
                except asyncio.CancelledError:
                    assert body.timeout.expired()
                    reading.end_all("the server is shutting down")
                    raise

    asyncio.run(run())


def test_the_end_of_the_drain_runs_every_step_though_one_fails(caplog):
    ended = []

    def broken(error):
        raise RuntimeError("a bug in one step")

    service = SimpleNamespace(
        coordinator=SimpleNamespace(end_all=broken),
        reading=SimpleNamespace(end_all=ended.append),
    )
    end_requests(service)  # type: ignore[arg-type]
    assert ended == ["the server stopped before this request finished"]
    assert "a step failed" in caplog.text


def test_a_small_bodys_deadline_is_short_and_a_chunked_ones_moves_as_its_bytes_come():
    reading = Reading(max_arriving=4, max_bytes=3000, timeout_s=30.0)
    assert reading.admit(2).allowed_s == pytest.approx(FIRST_BYTES_S, abs=1e-3)
    assert reading.admit(MIN_RATE * 4).allowed_s == FIRST_BYTES_S + 4
    assert reading.admit(100 << 20).allowed_s == 30.0  # never past request_body_timeout_s
    chunked = reading.admit(None)
    assert chunked.allowed_s == FIRST_BYTES_S
    chunked.received = MIN_RATE * 3
    assert chunked.allowed_s == FIRST_BYTES_S + 3


def test_one_address_holds_at_most_its_share_of_the_bodies_arriving(caplog):
    refused = []
    reading = Reading(max_arriving=8, max_bytes=3000, timeout_s=30.0, max_per_client=2)
    reading.refused = lambda: refused.append(1)
    reading.logged = SimpleNamespace(take=iter([True] + [False] * 9).__next__)  # 1 a second
    first, _ = reading.admit(10, "10.0.0.1"), reading.admit(10, "10.0.0.1")
    with pytest.raises(APIError, match="max_arriving_bodies_per_client") as third:
        reading.admit(10, "10.0.0.1")
    assert third.value.status == 503 and third.value.headers["Connection"] == "close"
    reading.admit(10, "10.0.0.2")  # another address is not held back
    first.close()
    reading.admit(10, "10.0.0.1")  # its place is free again
    assert refused == [1] and "max_arriving_bodies_per_client" in caplog.text
    for _ in range(5):  # a flood of refusals within the second logs no more lines
        with pytest.raises(APIError):
            reading.admit(10, "10.0.0.1")
    assert len(refused) == 6 and caplog.text.count("refused with 503") == 1


def test_a_chunked_bodys_refusal_closes_its_connection():
    reading = Reading(max_arriving=4, max_bytes=1000, timeout_s=30.0, small=100)
    reading.admit(900)
    chunked = reading.admit(None)

    async def receive() -> dict:
        return {"type": "http.request", "body": b"x" * 200, "more_body": True}

    with pytest.raises(APIError, match="max_request_bytes_at_once") as refused:
        asyncio.run(chunked.receive(receive))
    assert refused.value.headers == {"Retry-After": "1", "Connection": "close"}


def test_a_body_too_large_part_read_closes_its_connection():
    async def route(scope, receive, send) -> None:
        await receive()

    limit = BodyLimit(route, BodyLimits(max_bytes=10))
    scope = {"type": "http", "path": "/v1/chat/completions", "headers": []}

    async def receive() -> dict:
        return {"type": "http.request", "body": b"x" * 20, "more_body": True}

    with pytest.raises(APIError, match="over 10 bytes") as refused:
        asyncio.run(limit(scope, receive, None))  # type: ignore[arg-type]
    assert (refused.value.status, refused.value.headers["Connection"]) == (413, "close")


@pytest.mark.parametrize(
    ("headers", "length"),
    [
        ([], 0),
        ([(b"content-length", b"12")], 12),
        ([(b"transfer-encoding", b"chunked")], None),
        ([(b"transfer-encoding", b"gzip, chunked"), (b"content-length", b"5")], None),
        ([(b"content-length", b"twelve")], 400),
        ([(b"content-length", b"-1")], 400),
    ],
)
def test_a_bodys_length_as_its_headers_give_it(headers, length):
    if length == 400:
        with pytest.raises(APIError, match="Content-Length") as refused:
            body_length({"headers": headers})
        assert refused.value.status == 400
    else:
        assert body_length({"headers": headers}) == length
