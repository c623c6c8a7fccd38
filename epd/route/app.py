"""The router's HTTP side: every route the prefill API serves, passed to a prefill chosen for
the request (`choice.py`), the reply passed back chunk by chunk as it comes.

What the client sees is the prefill's reply, with two exceptions:
- a prefill that refuses the request (503, 429) or cannot be reached before any byte of its
  reply went to the client: the request goes to the next prefill in the order, up to every
  live one; a reply not streamed is read whole first, so a prefill that dies while it works
  on one costs a retry, not the request;
- a stream cut off by its prefill (kill -9, its connection reset) ends with an OpenAI-style
  error event and `[DONE]`, at once, instead of a connection that closes mid-stream.
The API key and CORS are checked here as in prefill (`api/middleware.py`), and the key is
passed on: the prefills check it again. /health and /metrics are the router's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from epd.api.errors import APIError, as_api_error, unavailable
from epd.api.middleware import (
    BodyLimits,
    Unforeseen,
    add_middleware,
    api_key,
    key_holders,
    request_id,
    until_disconnected,
)
from epd.config.roles import RouteConfig
from epd.kv.index import BlockIndex
from epd.route.choice import Candidate, order
from epd.route.metrics import RouterMetrics
from epd.route.prefills import Prefill, PrefillSet
from epd.route.prompts import PromptNamer

log = logging.getLogger(__name__)
REFUSED = (429, 503)  # statuses another prefill may answer otherwise
# Hop-by-hop headers, and those the router sets itself (its own request id, the body's length).
NOT_PASSED = {
    "host",
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "x-request-id",
    "date",
    "server",
}
TIMEOUT = httpx.Timeout(connect=2.0, read=None, write=30.0, pool=None)
NAMING_S = 1.0  # a request whose blocks take longer to name is routed by load alone


@dataclass
class Router:
    config: RouteConfig
    namer: PromptNamer
    prefills: PrefillSet
    index: BlockIndex
    metrics: RouterMetrics
    client: httpx.AsyncClient = field(
        default_factory=lambda: httpx.AsyncClient(
            timeout=TIMEOUT, limits=httpx.Limits(max_connections=None), trust_env=False
        )
    )
    turns: itertools.count[int] = field(default_factory=itertools.count)
    threads: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="prompts")
    )

    async def plan(self, path: str, body: bytes) -> tuple[list[Prefill], str, list[int]]:
        """The live prefills in the order to try them, why the first, and the prompt's block
        hashes as the first names them (empty: not named)."""
        live = self.prefills.live()
        if not live:  # none up at the last poll (a fleet just started): ask again now
            await self.prefills.poll_once(self.client)
            live = self.prefills.live()
        hashes: dict[bytes, list[int]] = {}
        if self.config.routing == "cache-aware" and len(live) > 1:
            loop = asyncio.get_running_loop()
            naming = loop.run_in_executor(self.threads, self.name, path, body)
            try:
                named = await asyncio.wait_for(naming, NAMING_S)
            except TimeoutError:  # a huge body, or the threads busy with others': by load
                named = None
            if named is not None:
                for key in {p.model_key for p in live}:
                    hashes[key] = named.hashes(key)
        candidates = [
            Candidate(p.url, p.load, self.index.matched(p.url, hashes.get(p.model_key, [])))
            for p in live
        ]
        blocks = max(map(len, hashes.values()), default=0)
        ranked, reason = order(candidates, self.config.routing, blocks, next(self.turns))
        by_url = {p.url: p for p in live}  # not the set's: a lookup may have changed it since
        chosen = [by_url[c.url] for c in ranked]
        if ranked and blocks:
            self.metrics.prompt_blocks.inc(blocks)
            self.metrics.matched_blocks.inc(ranked[0].matched)
        return chosen, reason, hashes.get(chosen[0].model_key, []) if chosen else []

    def name(self, path: str, body: bytes) -> Any:
        try:
            parsed = json.loads(body)
        except ValueError:
            return None
        return self.namer.name(path, parsed)

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        path = request.url.path  # decoded: what the routes are named by
        chosen, reason, hashes = await self.plan(path, body if request.method == "POST" else b"")
        if not chosen:
            self.metrics.failed.labels("no_prefill").inc()
            return error_response(unavailable("no prefill is ready to take the request"))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in NOT_PASSED}
        headers["x-request-id"] = request_id(request)
        target = as_sent(request)
        for attempt, prefill in enumerate(chosen):
            why = "retry" if attempt else reason
            last = attempt == len(chosen) - 1  # its refusal is the answer: none to try after
            reply = await self.send(request, prefill, target, headers, body, why, hashes, last)
            if reply is not None:
                return reply
        self.metrics.failed.labels("no_prefill").inc()
        return error_response(unavailable("no prefill could take the request; retry"))

    async def send(
        self,
        request: Request,
        prefill: Prefill,
        target: str,
        headers: dict[str, str],
        body: bytes,
        why: str,
        hashes: list[int],
        last: bool = True,
    ) -> Response | None:
        """The prefill's reply to the request, or None where it refused (unless it is the
        `last` to ask) or failed before any byte of it went to the client (the next prefill
        is tried)."""
        prefill.in_flight += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                prefill.in_flight -= 1

        try:
            built = self.client.build_request(
                request.method, prefill.url + target, headers=headers, content=body
            )
            upstream = await self.client.send(built, stream=True)
        except httpx.HTTPError as e:
            log.warning("prefill %s did not take a request: %s", prefill.url, e)
            self.prefills.down(prefill)
            release()
            return None
        except BaseException:  # a target httpx refuses, a cancelled request: never counted
            release()
            raise
        try:
            if upstream.status_code in REFUSED and not last:
                await upstream.aclose()
                release()
                return None
            self.metrics.routed.labels(prefill.url, why).inc()
            if upstream.status_code < 400 and hashes:
                self.index.sent(prefill.url, hashes)
            passed = {k: v for k, v in upstream.headers.items() if k.lower() not in NOT_PASSED}
            if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                relay = self.relay(upstream, prefill, release, request.url.path)
                return StreamingResponse(relay, upstream.status_code, passed)
            try:
                content = await until_disconnected(request, upstream.aread())
            except httpx.HTTPError as e:  # it died while working on it: nothing was sent yet
                log.warning("prefill %s failed mid-reply: %s", prefill.url, e)
                self.prefills.down(prefill)
                return None
            finally:
                await upstream.aclose()
                release()
            if content is None:  # the client left: its prefill was told, by the close
                return Response(status_code=499)
            passed.pop("content-encoding", None)  # read decoded
            return Response(content, upstream.status_code, passed)
        except BaseException:
            await upstream.aclose()
            release()
            raise

    async def relay(
        self, upstream: httpx.Response, prefill: Prefill, release: Any, path: str
    ) -> AsyncIterator[bytes]:
        """The stream's bytes as they come; a stream its prefill cut off ends with an error
        event and [DONE] (the client's parser sees why, not a broken connection)."""
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            log.warning("prefill %s cut a stream off: %s", prefill.url, e)
            self.metrics.failed.labels("upstream").inc()
            error = unavailable("the prefill serving this stream failed; retry the request")
            yield error_event(error, path)
        finally:
            with contextlib.suppress(Exception):
                await upstream.aclose()
            release()

    def status(self) -> dict[str, Any]:
        """What /health shows a key holder: each prefill's state, and what the index holds of
        it (`followed`: by its KV events, or by the requests sent to it)."""
        return {
            "prefills": {
                p.url: {
                    "up": p.up,
                    "in_flight": p.in_flight,
                    "load": p.load,
                    "blocks": self.index.held(p.url),
                    "followed": "events" if p.url in self.index.fed else "requests",
                }
                for p in self.prefills.prefills.values()
            },
            "routing": self.config.routing,
        }


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def error_event(error: APIError, path: str) -> bytes:
    """A stream's last words when its prefill is gone, in its API's form (after blank lines:
    the prefill's last event may have been cut short)."""
    if path.startswith("/v1/responses"):  # that API's error event, and no [DONE]
        fields = {"type": "error", "code": error.code, "message": error.message, "param": None}
        return f"\n\nevent: error\ndata: {json.dumps(fields)}\n\n".encode()
    return f"\n\ndata: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()


def as_sent(request: Request) -> str:
    """The request's path and query as the client sent them, still percent-encoded: decoded,
    a %3F or %2F would mean something else to the prefill, and a %01 no URL at all."""
    path = request.scope.get("raw_path") or request.url.path.encode()
    query = request.scope.get("query_string", b"")
    return (path + (b"?" + query if query else b"")).decode("latin-1")


def create_app(router: Router, on_started: Any = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.prefills.poll(router.client)  # before the first request: who is up
        follow = asyncio.create_task(
            router.prefills.follow(router.client, router.config.health_interval_s)
        )
        started = asyncio.create_task(on_started()) if on_started is not None else None
        yield
        for task in (follow, started):
            if task is not None:
                task.cancel()
        await router.client.aclose()
        router.threads.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="epd route", lifespan=lifespan, openapi_url=None)

    async def as_json(request: Request, error: Exception) -> JSONResponse:
        """Every error becomes an OpenAI-style body with its status (a 413 from the body
        bounds, a request that cannot be sent on), never a plain-text 500."""
        api_error = as_api_error(error)
        if api_error.status >= 500 and not isinstance(error, APIError):
            log.exception("unhandled error", exc_info=error)
        return error_response(api_error)

    app.add_exception_handler(APIError, as_json)
    app.add_middleware(Unforeseen, handler=as_json)  # the first added: innermost
    config = router.config
    key = api_key(config.api_key)
    limits = BodyLimits(config.max_request_bytes, config.max_text_request_bytes)
    add_middleware(app, config.allowed_origins, key, limits)
    trusted = key_holders(key)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        live = router.prefills.live()
        router.metrics.live.set(len(live))
        body: dict[str, Any] = {"status": "ok" if live else "unavailable", "role": "router"}
        if not live:
            body["problems"] = ["no prefill is ready"]
        if trusted(request):
            body |= router.status()
        return JSONResponse(body, status_code=200 if live else 503)

    @app.get("/health/live")
    async def live() -> JSONResponse:
        """The router itself answers (its prefills aside): what a liveness probe asks."""
        return JSONResponse({"status": "ok", "role": "router"})

    @app.get("/metrics")
    async def metrics() -> Response:
        router.metrics.live.set(len(router.prefills.live()))
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def passed_on(request: Request) -> Response:
        return await router.forward(request)

    return app
