"""The FastAPI app: /v1/chat/completions, /v1/completions, /v1/responses (`responses_api.py`),
/v1/models (and /v1/models/{id}), /version, vLLM's tokenizer routes (`tokens.py`), /health."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, TypeVar, cast

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from transformers import PreTrainedTokenizerBase

from epd.api import tokens
from epd.api.bodies import SMALL_BODY, Reading, parsed
from epd.api.errors import APIError, as_api_error, bad_request, overloaded
from epd.api.fingerprint import system_fingerprint
from epd.api.images import ImageLoader, MediaPolicy
from epd.api.middleware import (
    BodyLimits,
    Gate,
    Unforeseen,
    add_middleware,
    api_key,
    arrived,
    key_holders,
    request_id,
    until_disconnected,
)
from epd.api.prepare import PromptBuilder, check_grammar, check_scored
from epd.api.reasoning import reasoning_of, split_deltas
from epd.api.responses import Echo, Reply, TextReply, prompt_logprobs_json
from epd.api.responses_api import ResponseReply, named_as_responses, parse_responses
from epd.api.schema import (
    ChatCompletionRequest,
    DetokenizeRequest,
    GenerationRequest,
    TokenizeRequest,
    parse_completion,
    parse_plain,
    parse_request,
    parse_tokenize,
)
from epd.api.tool_prompts import ForcedTools
from epd.api.tools import ToolReply
from epd.checkpoint.tokenizer import decode_text
from epd.config.roles import PrefillConfig
from epd.generation.reasoning import Markers
from epd.generation.sampling import Scored, spelled
from epd.kv.events import KVEventsConfig
from epd.multimodal.grids import Grid
from epd.prefill.coordinator import Coordinator
from epd.prefill.engine import PrefillEngine
from epd.prefill.errors import PrefillError
from epd.prefill.metrics import PrefillMetrics, Timeline
from epd.prefill.request import PreparedRequest
from epd.runtime.health import DRAINING, health_router
from epd.runtime.metrics import metrics_router
from epd.runtime.role import probe_wire
from epd.runtime.watchdog import Watchdog
from epd.wire.messages import TokenDelta

log = logging.getLogger(__name__)
T = TypeVar("T")


class ForModel(Protocol):
    """A request that may name the model it is for (None: the one served)."""

    @property
    def model(self) -> str | None: ...


R = TypeVar("R", bound=ForModel)


@dataclass
class Service:
    config: PrefillConfig
    model_name: str
    builder: PromptBuilder
    engine: PrefillEngine
    watchdog: Watchdog
    coordinator: Coordinator | None = None
    gate: Gate = field(default_factory=Gate)  # in flight and draining, for the middleware
    metrics: PrefillMetrics = field(init=False)  # every series labelled model_name
    waiting: int = 0  # requests between arrival and their hand-off to decode
    media: ImageLoader = field(init=False)
    # Reading and tokenising a prompt runs here, not on the event loop: a long one takes
    # seconds, and every other request's streaming waits on the loop.
    prompts: ThreadPoolExecutor = field(init=False)
    fingerprint: str = field(init=False)  # every reply's system_fingerprint
    reading: Reading = field(init=False)  # request bodies arriving and parsed, for the middleware

    def __post_init__(self) -> None:
        self.reading = reading_bound(self.config)
        self.metrics = PrefillMetrics(self.model_name)
        lm, context = self.engine.lm, self.builder.context_length
        self.fingerprint = system_fingerprint(
            self.config.model, lm.lm_head.weight.dtype, self.engine.device, context
        )
        self.media = ImageLoader(MediaPolicy.of(self.config))
        self.metrics.waiting.set_function(lambda: self.waiting)
        self.gate.refused = lambda: self.metrics.refused.labels("draining").inc()
        self.reading.refused = lambda: self.metrics.refused.labels("bodies").inc()
        self.prompts = ThreadPoolExecutor(2, thread_name_prefix="prompts")

    def status(self) -> dict[str, object]:
        """What GET /health adds to its body."""
        if self.coordinator is None:
            return {}
        coordinator = self.coordinator
        router = coordinator.router
        requests: dict[str, object] = {"in_flight": self.gate.in_flight, "waiting": self.waiting}
        requests["by_status"] = coordinator.counts()
        outbox = router.outbox
        requests["peers"] = {a: "up" if outbox.is_up(a) else "down" for a in router.peers()}
        refused = {"refused_messages": router.inbox.refusals.total}
        images = coordinator.encoding.images.status() | router.load.status()
        return requests | refused | images | coordinator.batcher.status() | self.kv_status()

    def kv_status(self) -> dict[str, object]:
        """What a router needs to follow this prefill's blocks (`epd route`): the key its block
        hashes start from, and the topic its KV events carry (None: it publishes none)."""
        events = self.config.kv_events_config
        config = KVEventsConfig.from_json(events) if events else None
        topic = config.topic if config is not None and config.publishes else None
        key = self.engine.model_key.hex()
        return {"kv": {"model_key": key, "events_topic": topic, "instance": INSTANCE}}

    @contextmanager
    def queue_slot(self, places: int = 1) -> Iterator[None]:
        """Hold `places` of `max_queued_requests` (a place per prompt) from arrival to the
        hand-off to decode; with too few free, a 503 at once rather than a timeout a minute
        later."""
        if self.waiting + places > self.config.max_queued_requests:
            self.metrics.refused.labels("overloaded").inc()
            raise overloaded(
                f"{self.waiting} requests are already waiting for prefill "
                f"(max_queued_requests); retry shortly"
            )
        self.waiting += places
        try:
            yield
        finally:
            self.waiting -= places

    def served(self, request: R) -> R:
        """The request, if it asks for the model this server serves (by its name, or by the
        checkpoint path it was started with, as vLLM names it; none: this one); else a 404."""
        if request.model is not None and request.model not in self.config.model_names:
            raise unknown_model(request.model, self.model_name)
        return request

    async def off_loop(self, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` on the prompts' threads, unless the process ends its requests first."""
        self.check_serving()
        return await self.unless_ended(
            asyncio.get_running_loop().run_in_executor(self.prompts, work, *args)
        )

    async def unless_ended(self, work: Awaitable[T]) -> T:
        if self.coordinator is None:
            return await work
        return await self.coordinator.unless_ended(work)

    def check_serving(self) -> None:
        """Raise the error of every request in flight once the process has ended them (at the
        drain's end): a request must not start a step, a prompt built or images fetched, that
        would carry it past the process's exit, into a cut connection."""
        if self.coordinator is not None and self.coordinator.ending.is_set():
            raise self.coordinator.ended()

    def problems(self) -> list[str]:
        """Why this prefill cannot serve now: shutting down, or no live encoder or decoder (a
        hung peer counts: it stops answering ZeroMQ heartbeats)."""
        found = [DRAINING] if self.gate.draining else []
        if self.coordinator is None:
            return [*found, "starting"]
        router = self.coordinator.router
        for peers in (router.encoders, router.decoders):
            if not any(router.outbox.is_up(a) for a in peers.current):
                tried = ", ".join(peers.current or peers.configured)
                found.append(f"no {peers.role} server answers (tried {tried})")
        return found

    async def load_images(self, urls: list[str]) -> list[bytes]:
        if len(urls) > self.config.max_images:
            raise bad_request(f"{len(urls)} images is over the limit of {self.config.max_images}")
        self.check_serving()
        return await self.unless_ended(self.media.load(urls))

    def check_encode_room(
        self, images: list[bytes], grids: tuple[Grid, ...], salt: str | None = None
    ) -> None:
        """A 503 at once for images the encoders cannot take in time, judged from the sizes in
        their headers (`grids`): before the prompt is built round them and before they are
        hashed, which in a burst of large images took seconds of their wait."""
        if images and self.coordinator is not None:
            self.coordinator.encoding.check_room(images, grids, salt)


# This process's own id: a router told apart a restarted prefill by its pid, which in a
# container is the same (1) each time.
INSTANCE = secrets.token_hex(8)


def handle_errors(app: FastAPI, metrics: PrefillMetrics) -> None:
    """Every error a route raises becomes an OpenAI-style body with its status."""

    async def as_json(request: Request, error: Exception) -> JSONResponse:
        api_error = as_api_error(error)
        metrics.failure.labels(str(api_error.status)).inc()
        if api_error.status >= 500 and not isinstance(error, (APIError, PrefillError)):
            log.exception("unhandled error", exc_info=error)
        log.info(
            "request %s: %d after %.0f ms: %s",
            request_id(request),
            api_error.status,
            (time.perf_counter() - arrived(request)) * 1000,
            api_error.message[:200],
        )
        return JSONResponse(
            api_error.body(), status_code=api_error.status, headers=api_error.headers
        )

    for kind in (APIError, PrefillError):
        app.add_exception_handler(kind, as_json)
    app.add_middleware(Unforeseen, handler=as_json)  # the first added: innermost


def create_app(service: Service, on_started: Callable[[], Any] | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        processor = service.builder.processor
        service.coordinator = Coordinator(
            service.config,
            service.engine,
            processor.max_tokens(),
            service.watchdog,
            service.metrics,
            in_flight=lambda: service.gate.in_flight,
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
        service.prompts.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="epd", lifespan=lifespan)
    handle_errors(app, service.metrics)
    config = service.config
    limits = BodyLimits(config.max_request_bytes, config.max_text_request_bytes)
    key, gate = api_key(config.api_key), service.gate
    add_middleware(app, config.allowed_origins, key, limits, gate, service.reading)
    trusted = key_holders(key)  # only they see /health's counts
    app.include_router(
        health_router("prefill", service.watchdog, service.status, service.problems, trusted)
    )
    app.include_router(metrics_router(service.metrics.registry, config.peer_metrics))
    started = int(time.time())
    cards = {  # one per served name, as vLLM lists them
        name: {
            "id": name,
            "object": "model",
            "created": started,  # as vLLM's card: when this server started
            "owned_by": "epd",
            "root": config.model,  # vLLM's fields: what it was loaded from, the context it takes
            "parent": None,
            "max_model_len": service.builder.context_length,
        }
        for name in config.served_model_name or (config.model_name,)
    }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": list(cards.values())}

    @app.get("/v1/models/{model_id:path}")  # ids may hold slashes: moonshotai/Kimi-VL-...
    async def model(model_id: str) -> dict[str, Any]:
        if model_id not in config.model_names:
            raise unknown_model(model_id, service.model_name)
        return cards.get(model_id, cards[config.model_name])  # the path: the first name's card

    @app.get("/version")  # as vLLM's: what clients read to tell servers apart
    async def version() -> dict[str, str]:
        return {"version": importlib.metadata.version("epd")}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        asked = service.served(await read_body(request, parse_tokenize))
        if isinstance(asked, TokenizeRequest):
            return await service.off_loop(tokens.tokenize, service.builder, asked)
        with service.queue_slot():  # its images are fetched and read as a chat's are
            conversation = await service.off_loop(service.builder.read, asked)
            images = await service.load_images(conversation.image_urls)
            return await service.off_loop(
                tokens.tokenize_chat, service.builder, conversation, images, asked.return_token_strs
            )

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, str]:
        parse = partial(parse_plain, kind=DetokenizeRequest)
        asked = service.served(await read_body(request, parse))
        return await service.off_loop(tokens.detokenize, service.builder, asked)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return tokens.tokenizer_info(service.builder)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        chat = service.served(await read_body(request, parse_request))
        with service.queue_slot():
            reply, deltas, images = await start_chat(service, chat, request)
        return await respond(service, request, reply, deltas, chat, images)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        asked, chat = await read_body(request, parse_responses)  # both off the loop if large
        service.served(asked)
        with service.queue_slot():
            try:
                reply, deltas, images = await start_chat(service, chat, request)
            except APIError as e:  # e.g. the context length, from the chat fields it became
                raise named_as_responses(e, asked) from None
        response = ResponseReply(
            reply.request_id,
            reply.model,
            reply.prompt_tokens,
            want_logprobs=False,
            echoed=asked.echoed(),
            response_id="resp_" + reply.request_id.removeprefix("chatcmpl-"),
            reasoning=reply.reasoning,
            cached_tokens=reply.cached_tokens,
        )
        return await respond(service, request, response, deltas, chat, images)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        legacy = service.served(await read_body(request, parse_completion))
        count, rid = len(legacy.prompts), request_id(request)
        with service.queue_slot(count):
            prepared = [
                await service.off_loop(service.builder.prepare_completion, legacy, rid, which)
                for which in range(count)
            ]
            check_scored(legacy, prepared)
            started = await generate_all(service, prepared)
        reply = TextReply(
            prepared[0].request_id,
            service.model_name,
            sum(len(p.prompt_ids) for p in prepared),
            legacy.wants_logprobs,
            legacy.include_usage,
            echoes=[
                echo_of(service, legacy.prompts[which], p, s.prompt_logprobs, legacy.logprobs or 0)
                for which, (p, s) in enumerate(zip(prepared, started, strict=True))
            ]
            if legacy.echo
            else [],
            n=legacy.n,
            prompt_only=legacy.prompt_only,
            cached_tokens=sum(s.cached_tokens for s in started),  # a prompt's once, whatever n
            system_fingerprint=service.fingerprint,
        )
        if legacy.prompt_logprobs is not None:
            reply.prompt_logprobs = [
                await prompt_scores(service, s, legacy.prompt_logprobs) for s in started
            ]
        deltas = merged([s.deltas for s in started], legacy.n)
        return await respond(service, request, reply, deltas, legacy, choices=count * legacy.n)

    return app


def reading_bound(config: PrefillConfig) -> Reading:
    """The bounds on request bodies arriving and parsed at once (`bodies.Reading`)."""
    return Reading(
        config.max_arriving_bodies,
        config.max_request_bytes_at_once,
        config.request_body_timeout_s,
        config.max_arriving_bodies_per_client,
    )


async def read_body(request: Request, parse: Callable[[Any], T]) -> T:
    """The body, parsed as JSON and then by `parse`; a large body off the event loop: a 34 MB
    one of a million messages held every other stream up for 5.7 s."""
    body = await request.body()  # its size is bounded by the middleware, before it arrives
    try:
        if len(body) <= SMALL_BODY:
            return parse(parse_json(body))
        return await asyncio.to_thread(lambda: parse(parse_json(body)))
    finally:
        parsed(request)  # its bytes are no longer counted against other bodies


# A UTF-16 surrogate escape. JSON may pair two into one character; one left alone is text
# that no UTF-8 encoder takes (the tokenizer, the wire), found only much later.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def parse_json(body: bytes) -> Any:
    try:
        parsed = json.loads(body)
    except RecursionError:  # the parser's own depth limit: arrays nested 100 000 deep
        raise bad_request("the request body is nested too deeply") from None
    except ValueError as e:  # bad JSON or UTF-8, or an integer of over 4300 digits
        if "digits" in str(e):
            raise bad_request("the request body holds a number of over 4300 digits") from None
        raise bad_request("the request body is not valid JSON") from None
    if SURROGATE_ESCAPE.search(body):  # rare: look at the strings themselves
        try:
            json.dumps(parsed, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise bad_request(
                "the request body holds a lone UTF-16 surrogate (\\ud800-\\udfff)"
            ) from None
    return parsed


def unknown_model(asked: str, served: str) -> APIError:
    return APIError(
        404,
        f"model {asked[:200]!r} does not exist; this server has {served!r}",
        param="model",
        code="model_not_found",
    )


async def start_chat(
    service: Service, chat: ChatCompletionRequest, request: Request
) -> tuple[Reply, AsyncIterator[TokenDelta], int]:
    """A chat request up to its hand-off to decode: its reply, deltas to come, and images."""
    builder = service.builder
    conversation = await service.off_loop(builder.read, chat)
    images = await service.load_images(conversation.image_urls)
    # Off the loop, once: a header can take milliseconds to read (`open_image`), and prepare
    # takes the grids found here.
    grids = await service.off_loop(builder.grids, images)
    service.check_encode_room(images, grids, chat.cache_salt)
    try:
        prepared = await service.off_loop(
            builder.prepare, conversation, images, request_id(request), grids
        )
    except ValueError as e:  # e.g. more images than the prompt has placeholders
        raise bad_request(str(e)) from None
    check_scored(chat, [prepared])
    started = await generate(service, prepared)
    names = (prepared.request_id, service.model_name, len(prepared.prompt_ids))
    forced = ForcedTools.of(chat)
    reply = (
        Reply(*names, chat.logprobs, chat.include_usage)
        if forced is None
        else ToolReply(*names, chat.logprobs, chat.include_usage, forced=forced)
    )
    if chat.prompt_logprobs is not None:
        reply.prompt_logprobs = [await prompt_scores(service, started, chat.prompt_logprobs)]
    reply.echo_text, reply.cached_tokens = chat.echoed, started.cached_tokens
    reply.system_fingerprint = service.fingerprint
    deltas, sampling = started.deltas, prepared.sampling
    if sampling.reasoning is not None:  # a reasoning model: its text split as it comes
        reply.reasoning = True
        deltas = split_deltas(deltas, Markers(*sampling.reasoning), sampling.reasoning_open)
    return reply, deltas, len(prepared.images)


async def prompt_scores(
    service: Service, started: Started, alternatives: int
) -> list[dict[str, Any] | None]:
    """A prompt's `prompt_logprobs` as vLLM gives them (off the loop: a token is spelt for
    each entry)."""
    spell = partial(token_text, service.builder.tokenizer)
    return await service.off_loop(
        prompt_logprobs_json, started.prompt_logprobs, alternatives, spell
    )


def token_text(tokenizer: PreTrainedTokenizerBase, token: int) -> str:
    return decode_text(tokenizer, [token])


@dataclass(frozen=True)
class Started:
    """A request prefilled and handed on: its deltas to come, its prompt's tokens scored
    if it asked (`PreparedRequest.prompt_logprobs`), and how many came from the prefix cache."""

    deltas: AsyncIterator[TokenDelta]
    prompt_logprobs: tuple[Scored, ...] = ()
    cached_tokens: int = 0


async def generate(service: Service, prepared: PreparedRequest) -> Started:
    """Encode and prefill a prepared request, and hand it to decode."""
    coordinator = service.coordinator
    assert coordinator is not None
    if prepared.sampling.grammar:  # off the loop: the first one builds llguidance's tokenizer
        await service.off_loop(check_grammar, service.engine, prepared.sampling)
    request = await coordinator.submit(prepared)
    return Started(coordinator.deltas(request), request.prompt_logprobs, request.cached_tokens)


async def generate_all(service: Service, prepared: list[PreparedRequest]) -> list[Started]:
    """`generate` for several prompts at once (prefill packs them); if one fails, the others
    are aborted and its error raised."""
    started = await asyncio.gather(
        *(generate(service, p) for p in prepared), return_exceptions=True
    )
    failed = [r for r in started if isinstance(r, BaseException)]
    if failed:
        for one in started:
            if not isinstance(one, BaseException):
                await cast(AsyncGenerator[TokenDelta, None], one.deltas).aclose()  # aborts it
        raise failed[0]
    return cast(list[Started], started)


def echo_of(
    service: Service,
    asked: str | list[int],
    prepared: PreparedRequest,
    scored: tuple[Scored, ...],
    alternatives: int,
) -> Echo:
    """What a legacy completion's `echo` gives back of one prompt: its text as sent (token
    ids decoded), and its tokens spelt for the logprobs, each with its `alternatives`."""
    tokenizer = service.builder.tokenizer
    text = asked if isinstance(asked, str) else decode_text(tokenizer, asked)
    spelt = tuple(spelled(s, tokenizer, alternatives) for s in scored)
    return Echo(text, decode_text(tokenizer, prepared.prompt_ids[:1]), spelt)


async def merged(streams: list[AsyncIterator[TokenDelta]], n: int) -> AsyncIterator[TokenDelta]:
    """Several prompts' deltas as one reply's, as they come: prompt i's choice j is choice
    i·n + j. A failure of one fails the reply; ending early (or failing) aborts the rest."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield delta
        return
    generators = cast(list[AsyncGenerator[TokenDelta, None]], streams)
    pending = {asyncio.ensure_future(anext(g)): i for i, g in enumerate(generators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                which = pending.pop(task)
                try:
                    delta = task.result()
                except StopAsyncIteration:
                    continue
                yield msgspec.structs.replace(delta, index=which * n + delta.index)
                pending[asyncio.ensure_future(anext(generators[which]))] = which
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for generator in generators:
            await generator.aclose()


async def respond(
    service: Service,
    request: Request,
    reply: Reply,
    deltas: AsyncIterator[TokenDelta],
    asked: GenerationRequest,
    images: int = 0,
    choices: int = 0,
) -> Response:
    """A stream of chunks, or the whole reply once every choice (`asked.n` unless given)
    has ended."""
    metrics = service.metrics
    quiet = service.config.disable_log_requests
    deltas = logged(deltas, reply, arrived(request), images, metrics, quiet)
    if asked.stream:
        events = stream(reply, deltas, asked.include_usage, choices or asked.n, metrics)
        return StreamingResponse(events, media_type="text/event-stream")
    collected = await until_disconnected(request, collect(deltas))
    if collected is None:
        return Response(status_code=499)  # nobody is listening any more
    return JSONResponse(reply.completion(collected))


async def logged(
    deltas: AsyncIterator[TokenDelta],
    reply: Reply,
    arrived: float,
    images: int,
    metrics: PrefillMetrics,
    quiet: bool = False,
) -> AsyncIterator[TokenDelta]:
    """The deltas, passed on; metrics as they come, and one log line when the request ends,
    however it ends, at debug level if `quiet` (a failure is counted where its status is
    decided: `as_json`, `stream`)."""
    timeline = Timeline(arrived)
    reason, outcome = "abort", "ended early (client gone)"
    metrics.running.inc()
    try:
        async for delta in deltas:
            metrics.delta(timeline, delta.index, delta.completion_tokens, time.perf_counter())
            reason = delta.finish_reason or reason
            yield delta
        outcome = "done"
    except Exception as error:
        reason, outcome = "", f"failed ({as_api_error(error).status})"
        raise
    finally:
        metrics.running.dec()
        now = time.perf_counter()
        metrics.ended(timeline, reply.prompt_tokens, reason, now)
        first = timeline.first
        ttft = f"{(first - arrived) * 1000:.0f} ms" if first else "-"
        log.log(
            logging.DEBUG if quiet else logging.INFO,
            "request %s %s: %d prompt + %d output tokens, %d images, TTFT %s, %.0f ms in all",
            reply.request_id,
            outcome,
            reply.prompt_tokens,
            timeline.generated,
            images,
            ttft,
            (now - arrived) * 1000,
        )


async def collect(deltas: AsyncIterator[TokenDelta]) -> list[TokenDelta]:
    return [delta async for delta in deltas]


async def stream(
    reply: Reply,
    deltas: AsyncIterator[TokenDelta],
    usage: bool,
    choices: int,
    metrics: PrefillMetrics,
) -> AsyncIterator[str]:
    """SSE: a role chunk per choice, content chunks, each choice's finish, optional usage (of
    every choice), then [DONE]."""
    for chunk in reply.opening(choices):
        yield chunk
    completion_tokens: dict[int, int] = {}
    try:
        async for delta in deltas:
            completion_tokens[delta.index] = delta.completion_tokens
            said = delta.text or reasoning_of(delta) or delta.logprobs or delta.finish_reason
            if said and (chunk := reply.delta_chunk(delta)):
                yield chunk
        if usage:
            yield reply.usage_chunk(sum(completion_tokens.values()))
    except Exception as error:  # headers are sent: report in-band, as OpenAI does
        metrics.failure.labels(str(as_api_error(error).status)).inc()
        if not isinstance(error, (APIError, PrefillError)):
            log.exception("streaming %s failed", reply.request_id)
        yield reply.error_chunk(as_api_error(error))
    if closing := reply.closing():
        yield closing
