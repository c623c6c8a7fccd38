"""`stream` against a real HTTP server on loopback: what it times, and each way a request fails."""

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from epd.bench.client import Timing, stream


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
        "/garbage": [sse("not json")],
        "/empty": [sse("[DONE]")],
        "/in-band": [sse({"error": {"message": "decode failed", "code": 500}}, "[DONE]")],
        "/slow": [sse(content("a")), None],  # None: stall
    }[request.path]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for piece in pieces:
        if piece is None:
            await asyncio.sleep(5)
        else:
            await response.write(piece)
    return response


async def refused(request: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "max_tokens: must be positive"}}, status=400)


def run(path: str, limit_s: float = 5.0) -> Timing:
    async def go() -> Timing:
        app = web.Application()
        app.router.add_post("/refused", refused)
        app.router.add_post("/{name}", streamed)
        async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as client:
            return await stream(client, str(server.make_url(path)), {}, 0.0, limit_s)

    return asyncio.run(go())


def test_a_stream_is_timed_chunk_by_chunk_and_counts_what_usage_says():
    timing = run("/ok")
    assert timing.ok and not timing.error
    assert len(timing.chunks) == 2 and timing.first_token == timing.chunks[0]
    assert timing.start <= timing.first_token <= timing.chunks[1] <= timing.end
    assert (timing.prompt_tokens, timing.output_tokens) == (7, 3)


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
    timing = run("/slow", limit_s=0.5)
    assert not timing.ok and timing.error == "no answer within 0.5s"
    assert len(timing.chunks) == 1  # what came before the stall was read


def test_a_server_that_is_not_there_is_an_error():
    async def go() -> Timing:
        async with aiohttp.ClientSession() as client:
            return await stream(client, "http://127.0.0.1:9/v1", {}, 0.0, 5.0)

    timing = asyncio.run(go())
    assert not timing.ok and "ClientConnectorError" in timing.error
