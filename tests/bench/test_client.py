"""`stream` against a real HTTP server on loopback: what it times, and each way a request fails."""

import asyncio
import json
import socket

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from epd.bench.client import Timing, stream
from epd.bench.runner import served_model


def sse(*events: object) -> bytes:
    lines = (f"data: {json.dumps(e) if isinstance(e, dict) else e}\n\n" for e in events)
    return "".join(lines).encode()


USAGE = {"prompt_tokens": 7, "completion_tokens": 3}


def content(text: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


async def streamed(request: web.Request) -> web.StreamResponse:
    """Each route's answer, written a piece at a time as a server streams it."""
    pieces = {
        "/ok": [
            sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}),
            sse(content("Hel")),
            sse(content("lo"), {"choices": [], "usage": USAGE}),
            sse("[DONE]"),
        ],
        "/text": [  # the legacy completions' chunks: text, no delta
            sse({"choices": [{"index": 0, "text": "Hel", "finish_reason": None}]}),
            sse({"choices": [{"index": 0, "text": "lo", "finish_reason": "length"}]}),
            sse({"choices": [], "usage": USAGE}, "[DONE]"),
        ],
        "/garbage": [sse("not json")],
        "/empty": [sse("[DONE]")],
        "/in-band": [sse({"error": {"message": "decode failed", "code": 500}}, "[DONE]")],
        "/slow": [sse(content("a")), None],  # None: stall
        "/long": [sse(content("a")), b"data: " + b"x" * (2 << 20) + b"\n\n"],
    }[request.path]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for piece in pieces:
        if piece is None:
            await asyncio.sleep(30)
        else:
            await response.write(piece)
    return response


async def refused(request: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "max_tokens: must be positive"}}, status=400)


def app() -> web.Application:
    application = web.Application()
    application.router.add_post("/refused", refused)
    application.router.add_get("/empty/models", nothing)
    application.router.add_get("/listed/models", listed)
    application.router.add_post("/{name}", streamed)
    return application


async def nothing(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def listed(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "small", "object": "model"}]})


def run(path: str, limit_s: float = 5.0, read_s: float | None = None) -> Timing:
    async def go() -> Timing:
        timeout = aiohttp.ClientTimeout(sock_read=read_s)
        async with (
            TestServer(app(), host="127.0.0.1") as server,
            aiohttp.ClientSession(timeout=timeout) as client,
        ):
            return await stream(client, str(server.make_url(path)), {}, 0.0, limit_s)

    return asyncio.run(go())


def test_a_stream_is_timed_chunk_by_chunk_and_counts_what_usage_says():
    timing = run("/ok")
    assert timing.ok and not timing.error
    assert len(timing.chunks) == 2 and timing.first_token == timing.chunks[0]
    assert timing.start <= timing.first_token <= timing.chunks[1] <= timing.end
    assert (timing.prompt_tokens, timing.output_tokens) == (7, 3)


def test_a_legacy_completions_stream_is_timed_by_its_text_chunks():
    timing = run("/text")
    assert timing.ok and len(timing.chunks) == 2 and timing.first_token == timing.chunks[0]
    assert timing.output_tokens == 3


@pytest.mark.parametrize(
    ("path", "error"),
    [
        ("/refused", "HTTP 400: "),
        ("/garbage", "JSONDecodeError"),
        ("/empty", "the stream held no content"),
        ("/in-band", "decode failed"),
    ],
)
def test_a_failed_request_is_recorded_not_raised(path, error):
    timing = run(path)
    assert not timing.ok and error in timing.error


def test_a_stalled_stream_fails_at_the_request_limit():
    timing = run("/slow", limit_s=2.0)
    assert not timing.ok and timing.error == "no answer within 2.0s"
    assert len(timing.chunks) == 1  # what came before the stall was read


def test_a_read_that_times_out_is_named_not_taken_for_the_request_limit():
    timing = run("/slow", limit_s=20.0, read_s=0.3)
    assert not timing.ok and timing.error.startswith("SocketTimeoutError")


def test_a_line_past_the_read_buffer_fails_its_request_alone():
    timing = run("/long")
    assert not timing.ok and "LineTooLong" in timing.error


def test_a_server_that_is_not_there_is_an_error():
    with socket.socket() as closed:  # a port nothing listens on once this closes
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]

    async def go() -> Timing:
        async with aiohttp.ClientSession() as client:
            return await stream(client, f"http://127.0.0.1:{port}/v1", {}, 0.0, 5.0)

    timing = asyncio.run(go())
    assert not timing.ok and "ClientConnectorError" in timing.error


@pytest.mark.parametrize("base", ["/listed", "/empty", "/missing"])
def test_the_served_model_is_listed_or_the_user_is_told_to_name_it(base):
    async def go() -> str:
        async with TestServer(app(), host="127.0.0.1") as server, aiohttp.ClientSession() as client:
            return await served_model(client, str(server.make_url(base)))

    if base == "/listed":
        assert asyncio.run(go()) == "small"
    else:
        with pytest.raises(ValueError, match="name the model with --model"):
            asyncio.run(go())
