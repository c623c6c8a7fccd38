"""The FastAPI app: /v1/chat/completions, /v1/completions, /v1/models (and /v1/models/{id}) and
/health."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from epd.api.errors import APIError, as_api_error, bad_request
from epd.api.images import ImageLoader, MediaPolicy
from epd.api.middleware import add_middleware, api_key, arrived, request_id
from epd.api.prepare import PromptBuilder, check_grammar
from epd.api.responses import Reply, TextReply
from epd.api.schema import (
    ChatCompletionRequest,
    GenerationRequest,
    parse_completion,
    parse_request,
)
from epd.api.tools import ForcedTools, ToolReply
from epd.config.roles import PrefillConfig
from epd.prefill.coordinator import Coordinator
from epd.prefill.engine import PrefillEngine
from epd.prefill.errors import PrefillError
from epd.prefill.request import PreparedRequest
from epd.runtime.health import health_router
from epd.runtime.role import probe_wire
from epd.runtime.watchdog import Watchdog
from epd.wire.messages import KVHandoff, TokenDelta

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.25


@dataclass
class Service:
    config: PrefillConfig
    model_name: str
    builder: PromptBuilder
    engine: PrefillEngine
    watchdog: Watchdog
    coordinator: Coordinator | None = None

    def status(self) -> dict[str, object]:
        """What GET /health adds to its body."""
        if self.coordinator is None:
            return {}
        coordinator = self.coordinator
        refused = {"refused_messages": coordinator.inbox.refusals.total}
        return refused | coordinator.images.status() | coordinator.batcher.status()

    media: ImageLoader = field(init=False)

    def __post_init__(self) -> None:
        self.media = ImageLoader(MediaPolicy.of(self.config))

    async def load_images(self, urls: list[str]) -> list[bytes]:
        if len(urls) > self.config.max_images:
            raise bad_request(f"{len(urls)} images is over the limit of {self.config.max_images}")
        return await self.media.load(urls)


def handle_errors(app: FastAPI) -> None:
    """Every error a route raises becomes an OpenAI-style body with its status."""

    async def as_json(request: Request, error: Exception) -> JSONResponse:
        api_error = as_api_error(error)
        if api_error.status >= 500 and not isinstance(error, (APIError, PrefillError)):
            log.exception("unhandled error", exc_info=error)
        log.info(
            "request %s: %d after %.0f ms: %s",
            request_id(request),
            api_error.status,
            (time.perf_counter() - arrived(request)) * 1000,
            api_error.message[:200],
        )
        return JSONResponse(api_error.body(), status_code=api_error.status)

    for kind in (APIError, PrefillError, Exception):
        app.add_exception_handler(kind, as_json)


def create_app(service: Service, on_started: Callable[[], Any] | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        processor = service.builder.processor
        service.coordinator = Coordinator(
            service.config, service.engine, processor.max_tokens(), service.watchdog
        )
        service.coordinator.start()
        probe = probe_wire(service.watchdog)
        if on_started is not None:
            started = asyncio.create_task(on_started())
        yield
        if on_started is not None:
            started.cancel()
        service.watchdog.close()  # stopping is not stalling
        probe.close()
        await service.coordinator.stop()
        service.media.close()

    app = FastAPI(title="epd", lifespan=lifespan)
    handle_errors(app)
    add_middleware(app, service.config.allowed_origins, api_key(service.config.api_key))
    app.include_router(health_router("prefill", service.watchdog, service.status))
    card = {"id": service.model_name, "object": "model", "created": 0, "owned_by": "epd"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")  # ids may hold slashes: moonshotai/Kimi-VL-...
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != service.model_name:
            raise unknown_model(model_id, service.model_name)
        return card

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        chat = parse_request(await json_body(request))
        if chat.model != service.model_name:
            raise unknown_model(chat.model, service.model_name)
        return await complete(service, chat, request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        legacy = parse_completion(await json_body(request))
        if legacy.model != service.model_name:
            raise unknown_model(legacy.model, service.model_name)
        prepared = service.builder.prepare_completion(legacy, request_id(request))
        handoff, deltas = await generate(service, prepared)
        reply = TextReply(
            prepared.request_id,
            service.model_name,
            handoff.prompt_tokens,
            legacy.wants_logprobs,
            legacy.include_usage,
        )
        return await respond(request, reply, deltas, legacy)

    return app


async def json_body(request: Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise bad_request("the request body is not valid JSON") from None
    except RecursionError:  # the parser's own depth limit: arrays nested 100 000 deep
        raise bad_request("the request body is nested too deeply") from None


def unknown_model(asked: str, served: str) -> APIError:
    return APIError(
        404,
        f"model {asked[:200]!r} does not exist; this server has {served!r}",
        param="model",
        code="model_not_found",
    )


async def complete(service: Service, chat: ChatCompletionRequest, request: Request) -> Response:
    conversation = service.builder.read(chat)
    images = await service.load_images(conversation.image_urls)
    try:
        prepared = service.builder.prepare(conversation, images, request_id(request))
    except ValueError as e:  # e.g. more images than the prompt has placeholders
        raise bad_request(str(e)) from None
    handoff, deltas = await generate(service, prepared)
    names = (prepared.request_id, service.model_name, handoff.prompt_tokens)
    forced = ForcedTools.of(chat)
    reply = (
        Reply(*names, chat.logprobs, chat.include_usage)
        if forced is None
        else ToolReply(*names, chat.logprobs, chat.include_usage, forced=forced)
    )
    return await respond(request, reply, deltas, chat, len(prepared.images))


async def generate(
    service: Service, prepared: PreparedRequest
) -> tuple[KVHandoff, AsyncIterator[TokenDelta]]:
    """Encode, prefill and hand a prepared request to decode; its deltas to come."""
    coordinator = service.coordinator
    assert coordinator is not None
    if prepared.sampling.grammar:  # off the loop: the first one builds llguidance's tokenizer
        await asyncio.to_thread(check_grammar, service.engine, prepared.sampling)
    embeddings = await coordinator.encode(prepared)
    handoff = await coordinator.prefill(prepared, embeddings)
    return handoff, coordinator.deltas(await coordinator.hand_off(handoff))


async def respond(
    request: Request,
    reply: Reply,
    deltas: AsyncIterator[TokenDelta],
    asked: GenerationRequest,
    images: int = 0,
) -> Response:
    """A stream of chunks, or the whole reply once every choice has ended."""
    deltas = logged(deltas, reply, arrived(request), images)
    if asked.stream:
        events = stream(reply, deltas, asked.include_usage, asked.n)
        return StreamingResponse(events, media_type="text/event-stream")
    collected = await until_disconnected(request, collect(deltas))
    if collected is None:
        return Response(status_code=499)  # nobody is listening any more
    return JSONResponse(reply.completion(collected))


async def logged(
    deltas: AsyncIterator[TokenDelta], reply: Reply, arrived: float, images: int
) -> AsyncIterator[TokenDelta]:
    """The deltas, passed on; one log line when the request ends, however it ends."""
    first: float | None = None
    tokens: dict[int, int] = {}  # each choice's tokens so far
    outcome = "ended early (client gone)"
    try:
        async for delta in deltas:
            first = first or time.perf_counter()
            tokens[delta.index] = delta.completion_tokens
            yield delta
        outcome = "done"
    except Exception as error:
        outcome = f"failed ({as_api_error(error).status})"
        raise
    finally:
        ttft = f"{(first - arrived) * 1000:.0f} ms" if first else "-"
        log.info(
            "request %s %s: %d prompt + %d output tokens, %d images, TTFT %s, %.0f ms in all",
            reply.request_id,
            outcome,
            reply.prompt_tokens,
            sum(tokens.values()),
            images,
            ttft,
            (time.perf_counter() - arrived) * 1000,
        )


async def collect(deltas: AsyncIterator[TokenDelta]) -> list[TokenDelta]:
    return [delta async for delta in deltas]


async def until_disconnected(request: Request, work: Any) -> list[TokenDelta] | None:
    """Await `work`, cancelling it (which aborts the request in decode) if the client leaves."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return None
    return task.result()


async def stream(
    reply: Reply, deltas: AsyncIterator[TokenDelta], usage: bool, choices: int
) -> AsyncIterator[str]:
    """SSE: a role chunk per choice, content chunks, each choice's finish, optional usage (of
    every choice), then [DONE]."""
    for chunk in reply.opening(choices):
        yield chunk
    completion_tokens: dict[int, int] = {}
    try:
        async for delta in deltas:
            completion_tokens[delta.index] = delta.completion_tokens
            if (delta.text or delta.logprobs or delta.finish_reason) and (
                chunk := reply.delta_chunk(delta)
            ):
                yield chunk
        if usage:
            yield reply.usage_chunk(sum(completion_tokens.values()))
    except Exception as error:  # headers are sent: report in-band, as OpenAI does
        if not isinstance(error, (APIError, PrefillError)):
            log.exception("streaming %s failed", reply.request_id)
        yield f"data: {json.dumps(as_api_error(error).body())}\n\n"
    yield "data: [DONE]\n\n"
