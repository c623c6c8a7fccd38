"""Request bodies while they arrive and are parsed: how many at once, their bytes together, and
how long one may take. Each is a bound an attacker would otherwise choose: 20 bodies of 88 MB
at once took prefill to 3.8 GB and stalled the streams beside them for 8 s; 300 connections
that announced 1 MB and sent 9 bytes stayed open, counted in flight, for ever."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from epd.api.errors import APIError, bad_request, overloaded, unavailable
from epd.wire.limits import PerSecond

log = logging.getLogger(__name__)

# Bodies up to this size are parsed on the event loop (`app.read_body`), one at a time, and
# take no bytes of `max_bytes`: the arriving bodies' count bounds them. Three connections
# that each announce a 100 MB body and send nothing would otherwise hold every request back.
SMALL_BODY = 1 << 20
CLOSE = {"Connection": "close"}  # a body refused or cut short leaves bytes unread on the wire
# A body's deadline, under `timeout_s`: FIRST_BYTES_S, then a second for each MIN_RATE bytes
# (declared, or a chunked body's so far). 64 KiB/s is a slow uplink (0.5 Mbit/s, poor mobile
# data): a legitimate client that sends slower than that needs a longer request_body_timeout_s
# anyway. Without it a 2-byte body that never came held its place the whole 30 s.
FIRST_BYTES_S, MIN_RATE = 2.0, 64 << 10
REFUSALS_LOGGED_PER_S = 1  # one line a second, at most, for bodies refused with 503


@dataclass
class Reading:
    """The request bodies being read now: at most `max_arriving` still arriving (at most
    `max_per_client` of them from one address), each by its deadline (`Body.allowed_s`, at
    most `timeout_s` from its headers), and those over `small` holding at most `max_bytes`
    together from their headers until they are parsed (a body alone may hold more: it always
    gets read)."""

    max_arriving: int
    max_bytes: int
    timeout_s: float
    max_per_client: int = 0  # bodies arriving from one address (0: `max_arriving`)
    small: int = SMALL_BODY
    held: int = 0  # bytes of bodies over `small`, from their headers until parsed
    arriving: set[Body] = field(default_factory=set)
    by_client: Counter[str] = field(default_factory=Counter)  # of `arriving`
    ended: str = ""  # why every body still arriving fails: the process stops
    refused: Callable[[], None] = lambda: None  # told of each body refused with 503
    unlogged: int = 0  # refusals not logged (`refuse`)
    logged: PerSecond = field(default_factory=lambda: PerSecond(REFUSALS_LOGGED_PER_S))

    def admit(self, declared: int | None, client: str = "") -> Body:
        """A place for a body of `declared` bytes (None: chunked, counted as it comes) from
        `client` (an address), or a 503 with Retry-After."""
        if len(self.arriving) >= self.max_arriving:
            raise self.refuse(
                f"{len(self.arriving)} request bodies are already arriving "
                "(max_arriving_bodies); retry shortly",
            )
        if self.by_client[client] >= (self.max_per_client or self.max_arriving):
            raise self.refuse(
                f"{self.by_client[client]} request bodies from this address are already "
                "arriving (max_arriving_bodies_per_client); retry shortly",
            )
        body = Body(self, declared, client)
        body.hold(declared or 0)
        self.arriving.add(body)
        self.by_client[client] += 1
        return body

    def refuse(self, why: str) -> APIError:
        """The 503 for a body refused, counted (`refused`) and logged, a line a second at most
        (a flood of refusals must not become a flood of lines)."""
        self.refused()
        if not self.logged.take():
            self.unlogged += 1
        else:
            more = f" (and {self.unlogged} more since the last line)" if self.unlogged else ""
            log.warning("a request body refused with 503: %s%s", why, more)
            self.unlogged = 0
        error = overloaded(why)
        error.headers |= CLOSE
        return error

    def end_all(self, why: str) -> None:
        """Fail every body still arriving now, and any that comes from now on (the process
        stops: a read that waited for more bytes must not hold its shutdown up)."""
        self.ended = why
        for body in self.arriving:
            body.cut_short()


class Body:
    """One request's share of `Reading`: its place among the bodies arriving (until its last
    byte) and the bytes it holds (until it is parsed)."""

    def __init__(self, reading: Reading, declared: int | None, client: str = "") -> None:
        self.reading, self.client = reading, client
        self.declared, self.chunked = declared or 0, declared is None
        self.started = time.monotonic()
        self.held = self.received = 0
        self.timeout: asyncio.Timeout | None = None  # of the read under way

    @property
    def allowed_s(self) -> float:
        """How long the body may take from its headers: FIRST_BYTES_S and a second for each
        MIN_RATE bytes of it (a chunked body's so far: its deadline moves as they come), at
        most the reading's `timeout_s`."""
        size = max(self.declared, self.received)
        return min(self.reading.timeout_s, FIRST_BYTES_S + size / MIN_RATE)

    def hold(self, size: int) -> None:
        """Hold `size` bytes in all (the declared length, or what a chunked body has sent so
        far), or raise a 503 if other bodies hold too many already."""
        wanted = size if size > self.reading.small else 0
        others = self.reading.held - self.held
        if wanted > self.held and others and others + wanted > self.reading.max_bytes:
            raise self.reading.refuse(
                f"request bodies of {others} bytes are being read (max_request_bytes_at_once); "
                "retry shortly",
            )
        self.reading.held += wanted - self.held
        self.held = wanted

    def parsed(self) -> None:
        self.hold(0)

    def arrived(self) -> None:
        if self in self.reading.arriving:
            self.reading.arriving.discard(self)
            self.reading.by_client[self.client] -= 1
            if not self.reading.by_client[self.client]:
                del self.reading.by_client[self.client]

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
            self.hold(self.received)  # its 503 closes the connection: the rest is unread
        if not message.get("more_body"):
            self.arrived()
        return message

    def loop_deadline(self) -> float:
        """The deadline on the loop's clock; past already once the process stops."""
        if self.reading.ended:
            return -1
        deadline = self.started + self.allowed_s
        return asyncio.get_running_loop().time() + deadline - time.monotonic()

    def late(self) -> APIError:
        """The error of a body its deadline ended: a 408, or, once the process stops, the 503
        every request still in flight ends with (no Retry-After: this server will not be)."""
        if self.reading.ended:
            error = unavailable(self.reading.ended)
            error.headers |= CLOSE
            return error
        return APIError(
            408,
            f"the request body did not arrive within {self.allowed_s:.1f}s "
            f"(request_body_timeout_s, {self.reading.timeout_s}s, or sooner for a small body: "
            f"{FIRST_BYTES_S:.0f}s and a second for each {MIN_RATE >> 10} KiB)",
            code="request_timeout",
            headers=CLOSE,
        )


def body_length(scope: Scope) -> int | None:
    """The bytes of a request's body as its headers announce them; None for a chunked one
    (any Transfer-Encoding: it overrides a Content-Length), a 400 for a length that is not a
    number (it would otherwise pass as no body, unadmitted and without a deadline)."""
    headers = dict(scope["headers"])
    if b"transfer-encoding" in headers:
        return None
    declared = headers.get(b"content-length", b"0").strip()
    if not declared.isdigit():
        raise bad_request("the request's Content-Length is not a number")
    return int(declared)


class BodyReading:
    """A request that announces a body (a Content-Length, or chunked) takes its place in
    `Reading` before a byte of it is read (503 with Retry-After where there is none; 400 for a
    Content-Length that is not a number), and its reads are held to its deadline."""

    def __init__(self, app: ASGIApp, reading: Reading) -> None:
        self.app, self.reading = app, reading

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            declared = body_length(scope)
            body = None if declared == 0 else self.reading.admit(declared, client_address(scope))
        except APIError as refused:
            headers = refused.headers | CLOSE
            await JSONResponse(refused.body(), refused.status, headers)(scope, receive, send)
            return
        if body is None:
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})["body"] = body

        async def receive_within() -> Message:
            return await body.receive(receive)

        try:
            await self.app(scope, receive_within, send)
        finally:
            body.close()


def client_address(scope: Scope) -> str:
    """The address a request came from (behind a proxy, the proxy's, for every client)."""
    client = scope.get("client")
    return str(client[0]) if client else ""


def parsed(request: Request) -> None:
    """The request's body is parsed: the bytes it held are free for other bodies."""
    body = request.scope.get("state", {}).get("body")
    if isinstance(body, Body):
        body.parsed()
