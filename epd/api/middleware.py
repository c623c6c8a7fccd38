"""What every HTTP response gets, whatever the route: a request id, OpenAI-style errors, CORS,
and the API key check."""

from __future__ import annotations

import hmac
import os
import re
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from epd.api.errors import APIError

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # what may be echoed into a header and logs


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


def request_id(request: Request) -> str:
    return str(getattr(request.state, "request_id", "")) or uuid.uuid4().hex


def arrived(request: Request) -> float:
    """When the request reached the server (perf_counter seconds)."""
    return float(getattr(request.state, "arrived", 0.0)) or time.perf_counter()


class BearerKey:
    """Every /v1 request must send `Authorization: Bearer <key>` (compared in constant time);
    /health stays open for probes. A missing or wrong key is a 401 before anything is read."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
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


def api_key(configured: str) -> str:
    """The key from the config, else from EPD_API_KEY (how `epd serve` passes it on)."""
    return configured or os.environ.get("EPD_API_KEY", "")


def add_middleware(app: FastAPI, allowed_origins: tuple[str, ...], key: str = "") -> None:
    if key:  # innermost: CORS preflights and request ids come before it
        app.add_middleware(BearerKey, key=key)
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
