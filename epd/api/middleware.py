"""What every HTTP response gets, whatever the route: a request id, OpenAI-style errors, CORS,
the API key check, a bound on the body's size, and admission (in-flight count, drain)."""

from __future__ import annotations

import asyncio
import hmac
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from epd.api.bodies import CLOSE, BodyReading, Reading
from epd.api.errors import APIError, overloaded
from epd.wire.limits import ID_CHARS

REQUEST_ID = re.compile(f"[{ID_CHARS}]{{1,128}}")  # what may be echoed into a header and logs
DISCONNECT_POLL_S = 0.25  # how often a reply being gathered checks that its client is there
T = TypeVar("T")


class RequestIds:
    """Echo the client's `x-request-id` (or a new one) on every response; routes read it from
    `request.state.request_id`. An id that is not plain (too long, odd characters) is replaced,
    not echoed: it would go into headers and log lines."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"], state["arrived"] = request_id, time.perf_counter()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


class Unforeseen:
    """An error no route foresaw, answered as the route's own errors are, by `handler`, unless
    the response had begun (then nothing more can be said). Starlette's own handler for any
    Exception sends its answer and raises again, and uvicorn then closes the connection: a
    client's next request on it failed."""

    def __init__(
        self, app: ASGIApp, handler: Callable[[Request, Exception], Awaitable[Response]]
    ) -> None:
        self.app, self.handler = app, handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as error:
            if started:
                raise
            response = await self.handler(Request(scope, receive), error)
            await response(scope, receive, send)


def request_id(request: Request) -> str:
    return str(getattr(request.state, "request_id", "")) or uuid.uuid4().hex


def arrived(request: Request) -> float:
    """When the request reached the server (perf_counter seconds)."""
    return float(getattr(request.state, "arrived", 0.0)) or time.perf_counter()


# Routes outside /v1 that the key guards too.
GUARDED_ROUTES = (
    "/tokenize",  # vLLM's tokenizer routes: they put the CPU to work
    "/detokenize",
    "/tokenizer_info",
    "/docs",  # FastAPI's docs: they list every route
    "/docs/oauth2-redirect",
    "/redoc",
    "/openapi.json",
)


def holds_key(headers: list[tuple[bytes, bytes]], key: str) -> bool:
    """Whether a request's headers carry `Authorization: Bearer <key>` (compared in constant
    time); with no key set, every request does."""
    given = dict(headers).get(b"authorization", b"")
    return not key or hmac.compare_digest(given, f"Bearer {key}".encode())


def key_holders(key: str) -> Callable[[Request], bool]:
    """Whether a request holds the key: who sees what GET /health adds to its state."""
    return lambda request: holds_key(request.scope["headers"], key)


class BearerKey:
    """Every /v1 request, and those of GUARDED_ROUTES (the API's docs among them), must send
    `Authorization: Bearer <key>`; /health and /metrics stay open for probes and scrapers
    (/health's counts only to a holder of the key: `key_holders`). A missing or wrong key is a
    401 before anything is read."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.key = app, key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        guarded = path.startswith("/v1") or path in GUARDED_ROUTES
        if guarded and not holds_key(scope["headers"], self.key):
            body = APIError(
                401,
                "a valid API key is needed: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            ).body()
            await JSONResponse(body, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


# Routes whose bodies carry no images: prompts as text or token ids, which need far less room.
TEXT_ROUTES = ("/v1/completions", "/detokenize")
# The most JSON values (arrays, objects and array or object members) one body may hold. A
# legitimate body holds far fewer: MAX_CHAT_ITEMS messages and parts are ~4 each, a prompt of
# token ids one per token. Built as Python objects, each costs ~70 bytes and interpreter time
# that no other request gets: 22 million empty arrays (an 88 MB body) took 4 GB and 15 s.
MAX_JSON_VALUES = 1 << 19


def json_values(chunk: bytes) -> int:
    """At least how many JSON values `chunk` opens or separates: its `[`, `{` and `,` bytes
    (those inside strings too, so a bound on it is a little stricter than on the values
    themselves; base64 images hold none). Counted at C speed, before anything is parsed."""
    return chunk.count(b"[") + chunk.count(b"{") + chunk.count(b",")


@dataclass(frozen=True)
class BodyLimits:
    """How large a request body may be: `max_bytes` where it may carry images, `max_text_bytes`
    on TEXT_ROUTES, and at most `max_values` JSON values anywhere."""

    max_bytes: int = 100 << 20
    max_text_bytes: int = 16 << 20
    max_values: int = MAX_JSON_VALUES

    def size_for(self, path: str) -> tuple[int, str]:
        """The byte limit of a route, and the setting that sets it."""
        if path in TEXT_ROUTES:
            return min(self.max_text_bytes, self.max_bytes), "max_text_request_bytes"
        return self.max_bytes, "max_request_bytes"


class BodyLimit:
    """Bodies over their route's size get a 413 before they are read (a declared
    Content-Length) or as soon as the bytes received pass it (a chunked body); bodies of
    more JSON values than `max_values` get a 413 as soon as the bytes received hold them. Never
    after parsing: a parse holds the interpreter, and every other stream waits."""

    def __init__(self, app: ASGIApp, limits: BodyLimits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes, setting = self.limits.size_for(scope["path"])
        # Refused unread, or part read: the rest of the body is left on the wire, so its
        # connection closes (else uvicorn would read and drop all of it for the next request).
        too_large = APIError(
            413,
            f"the request body is over {max_bytes} bytes ({setting})",
            code="request_too_large",
            headers=CLOSE,
        )
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > max_bytes:
            await JSONResponse(too_large.body(), 413, too_large.headers)(scope, receive, send)
            return
        received = values = 0

        async def counted() -> Message:
            nonlocal received, values
            message = await receive()
            chunk = message.get("body", b"")
            received, values = received + len(chunk), values + json_values(chunk)
            if received > max_bytes:
                raise too_large  # raised in the route: its error handler answers
            if values > self.limits.max_values:
                raise APIError(
                    413,
                    f"the request body holds over {self.limits.max_values} JSON values "
                    "(arrays, objects and their members)",
                    code="request_too_large",
                    headers=CLOSE,
                )
            return message

        await self.app(scope, counted, send)


@dataclass
class Gate:
    """What `Admission` shares with the process that drains it."""

    in_flight: int = 0
    draining: bool = False
    refused: Callable[[], None] = lambda: None  # told of each request refused while draining


class Admission:
    """Counts the API requests in flight (`in_flight`, until their last byte is sent); once
    `draining` is set, new ones get 503 with Retry-After while those in flight finish."""

    def __init__(self, app: ASGIApp, gate: Gate) -> None:
        self.app, self.gate = app, gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        if self.gate.draining and scope["method"] == "POST":
            self.gate.refused()
            error = overloaded("the server is shutting down; retry on another replica")
            response = JSONResponse(error.body(), 503, headers=error.headers | CLOSE)
            await response(scope, receive, send)
            return
        self.gate.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.gate.in_flight -= 1


def api_key(configured: str) -> str:
    """The key from the config, else from EPD_API_KEY (how `epd serve` passes it on)."""
    return configured or os.environ.get("EPD_API_KEY", "")


def add_middleware(
    app: FastAPI,
    allowed_origins: tuple[str, ...],
    key: str = "",
    body_limits: BodyLimits | None = None,
    gate: Gate | None = None,
    reading: Reading | None = None,
) -> None:
    if reading is not None:  # innermost: bodies the size bound and the key refuse take no place
        app.add_middleware(BodyReading, reading=reading)
    # after the key check
    app.add_middleware(BodyLimit, limits=body_limits or BodyLimits())
    if key:  # CORS preflights and request ids come before it
        app.add_middleware(BearerKey, key=key)
    if gate is not None:
        app.add_middleware(Admission, gate=gate)
    if allowed_origins:  # none by default: browsers on other origins get no answer to read
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["x-request-id"],
        )
    app.add_middleware(RequestIds)  # outermost: CORS answers and errors get an id too

    async def http_error(request: Request, error: Exception) -> JSONResponse:
        """Starlette's own 404 and 405 as OpenAI-style bodies."""
        assert isinstance(error, HTTPException)
        status = error.status_code
        messages: dict[int, tuple[str, Any]] = {
            404: (f"no such route: {request.method} {request.url.path}", "not_found"),
            405: (f"{request.method} is not allowed on {request.url.path}", "method_not_allowed"),
        }
        message, code = messages.get(status, (str(error.detail), None))
        body = APIError(status, message, kind="invalid_request_error", code=code).body()
        return JSONResponse(body, status_code=status, headers=error.headers)

    app.add_exception_handler(HTTPException, http_error)


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, cancelling it if the client leaves (None then): a reply nobody will read
    must not keep prefill and decode at work (cancelling aborts it there, or closes the
    prefill's connection, which aborts it there)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return None
    return task.result()
