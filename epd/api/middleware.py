"""What every HTTP response gets, whatever the route: a request id, OpenAI-style errors, CORS,
the API key check, a bound on the body's size, and admission (in-flight count, drain)."""

from __future__ import annotations

import hmac
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from epd.api.errors import APIError, overloaded
from epd.wire.limits import ID_CHARS

REQUEST_ID = re.compile(f"[{ID_CHARS}]{{1,128}}")  # what may be echoed into a header and logs


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


# Routes outside /v1 that the key guards too: vLLM's tokenizer routes put the CPU to work.
GUARDED_ROUTES = ("/tokenize", "/detokenize", "/tokenizer_info")


class BearerKey:
    """Every /v1 request, and those of GUARDED_ROUTES, must send `Authorization: Bearer <key>`
    (compared in constant time); /health stays open for probes. A missing or wrong key is a
    401 before anything is read."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if path.startswith("/v1") or path in GUARDED_ROUTES:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                body = APIError(
                    401,
                    "a valid API key is needed: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                ).body()
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Bodies over `max_bytes` get a 413 before they are read (a declared Content-Length) or as
    soon as the bytes received pass the limit (a chunked body), never after parsing."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def too_large(self) -> APIError:
        return APIError(
            413,
            f"the request body is over {self.max_bytes} bytes (max_request_bytes)",
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            error = self.too_large()
            await JSONResponse(error.body(), status_code=413)(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise self.too_large()  # raised in the route: its error handler answers
            return message

        await self.app(scope, counted, send)


CLOSE = {"Connection": "close"}


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
    max_body_bytes: int = 100 << 20,
    gate: Gate | None = None,
) -> None:
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)  # innermost: after the key check
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
