"""Request bodies while they arrive and are parsed: how many at once, their bytes together, and
how long one may take. Each is a bound an attacker would otherwise choose: 20 bodies of 88 MB
at once took prefill to 3.8 GB and stalled the streams beside them for 8 s; 300 connections
that announced 1 MB and sent 9 bytes stayed open, counted in flight, for ever."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from epd.api.errors import APIError, overloaded

# Bodies up to this size are parsed on the event loop (`app.read_body`), one at a time, and
# take no bytes of `max_bytes`: the arriving bodies' count bounds them. Three connections
# that each announce a 100 MB body and send nothing would otherwise hold every request back.
SMALL_BODY = 1 << 20
CLOSE = {"Connection": "close"}  # a body refused or cut short leaves bytes unread on the wire


@dataclass
class Reading:
    """The request bodies being read now: at most `max_arriving` still arriving, each within
    `timeout_s` of its headers, and those over `small` holding at most `max_bytes` together
    from their headers until they are parsed (a body alone may hold more: it always gets
    read)."""

    max_arriving: int
    max_bytes: int
    timeout_s: float
    small: int = SMALL_BODY
    held: int = 0  # bytes of bodies over `small`, from their headers until parsed
    arriving: set[Body] = field(default_factory=set)
    ended: str = ""  # why every body still arriving fails: the process stops

    def admit(self, declared: int | None) -> Body:
        """A place for a body of `declared` bytes (None: chunked, counted as it comes), or a
        503 with Retry-After."""
        if len(self.arriving) >= self.max_arriving:
            raise overloaded(
                f"{len(self.arriving)} request bodies are already arriving "
                "(max_arriving_bodies); retry shortly",
            )
        body = Body(self, time.monotonic() + self.timeout_s, chunked=declared is None)
        body.hold(declared or 0)
        self.arriving.add(body)
        return body

    def end_all(self, why: str) -> None:
        """Fail every body still arriving now, and any that comes from now on (the process
        stops: a read that waited for more bytes must not hold its shutdown up)."""
        self.ended = why
        for body in self.arriving:
            body.cut_short()


class Body:
    """One request's share of `Reading`: its place among the bodies arriving (until its last
    byte) and the bytes it holds (until it is parsed)."""

    def __init__(self, reading: Reading, deadline: float, chunked: bool) -> None:
        self.reading, self.deadline, self.chunked = reading, deadline, chunked
        self.held = self.received = 0
        self.timeout: asyncio.Timeout | None = None  # of the read under way

    def hold(self, size: int) -> None:
        """Hold `size` bytes in all (the declared length, or what a chunked body has sent so
        far), or raise a 503 if other bodies hold too many already."""
        wanted = size if size > self.reading.small else 0
        others = self.reading.held - self.held
        if wanted > self.held and others and others + wanted > self.reading.max_bytes:
            raise overloaded(
                f"request bodies of {others} bytes are being read (max_request_bytes_at_once); "
                "retry shortly",
            )
        self.reading.held += wanted - self.held
        self.held = wanted

    def parsed(self) -> None:
        self.hold(0)

    def arrived(self) -> None:
        self.reading.arriving.discard(self)

    def close(self) -> None:
        self.arrived()
        self.parsed()

    def cut_short(self) -> None:
        """End the read under way now, unless its deadline already did (in this pass of the
        loop: an expiring timeout cannot be moved)."""
        if self.timeout is not None and not self.timeout.expired():
            self.timeout.reschedule(-1)  # in the past: the read under way ends now

    async def receive(self, receive: Receive) -> Message:
        """The next part of the body, or a 408 once its deadline passed (a 503 once the
        process stops); after the body, what comes (a disconnect) whenever it comes."""
        if self not in self.reading.arriving:
            return await receive()
        try:
            async with asyncio.timeout_at(self.loop_deadline()) as self.timeout:
                message = await receive()
        except TimeoutError:
            self.close()
            raise self.late() from None
        finally:
            self.timeout = None
        self.received += len(message.get("body", b""))
        if self.chunked:
            self.hold(self.received)
        if not message.get("more_body"):
            self.arrived()
        return message

    def loop_deadline(self) -> float:
        """The deadline on the loop's clock; past already once the process stops."""
        if self.reading.ended:
            return -1
        return asyncio.get_running_loop().time() + self.deadline - time.monotonic()

    def late(self) -> APIError:
        if self.reading.ended:
            error = overloaded(self.reading.ended)
            error.headers |= CLOSE
            return error
        return APIError(
            408,
            f"the request body did not arrive within {self.reading.timeout_s}s "
            "(request_body_timeout_s)",
            code="request_timeout",
            headers=CLOSE,
        )


def body_length(scope: Scope) -> int | None:
    """The bytes of a request's body as its headers announce them; None for a chunked one."""
    headers = dict(scope["headers"])
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        return None
    declared = headers.get(b"content-length", b"0")
    return int(declared) if declared.isdigit() else 0


class BodyReading:
    """A request with a body takes its place in `Reading` before a byte of it is read (503
    with Retry-After where there is none), and its reads are held to the deadline."""

    def __init__(self, app: ASGIApp, reading: Reading) -> None:
        self.app, self.reading = app, reading

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = body_length(scope) if scope["type"] == "http" else 0
        if declared == 0:
            await self.app(scope, receive, send)
            return
        try:
            body = self.reading.admit(declared)
        except APIError as refused:
            headers = refused.headers | CLOSE
            await JSONResponse(refused.body(), refused.status, headers)(scope, receive, send)
            return
        scope.setdefault("state", {})["body"] = body

        async def receive_within() -> Message:
            return await body.receive(receive)

        try:
            await self.app(scope, receive_within, send)
        finally:
            body.close()


def parsed(request: Request) -> None:
    """The request's body is parsed: the bytes it held are free for other bodies."""
    body = request.scope.get("state", {}).get("body")
    if isinstance(body, Body):
        body.parsed()
