"""A request's life in prefill, from the API's hand-over to its last token, in one place.

`submit` takes a prepared request through its images (`Encoding`: from the image cache, or
the encoders), its prefill (packed with whatever else waits, `PrefillBatcher`) and its
hand-off to a decoder; `deltas` then streams its tokens: each choice's first, which prefill
sampled, at once, and decode's after it. `Router` carries the messages to and from the peers;
each request has one record (`Request`): its status (on `/health`, by count), its prompt's
computed tokens and, once handed off, its stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import TypeVar

from epd.config.roles import PrefillConfig
from epd.generation.sampling import advanced
from epd.generation.status import Status
from epd.kv.hashing import BLOCK_TOKENS, image_spans, salt_digest
from epd.prefill.batcher import PrefillBatcher, token_budget
from epd.prefill.decoders import Candidate, choose
from epd.prefill.encoding import Encoding, Images
from epd.prefill.engine import Handed, Prefilled, PrefillEngine, Prompt, Resume
from epd.prefill.errors import (
    BadRequest,
    DecoderLost,
    Internal,
    PrefillError,
    TimedOut,
    Unavailable,
)
from epd.prefill.kv import DecoderBlocks
from epd.prefill.metrics import PrefillMetrics
from epd.prefill.request import PreparedRequest, Request
from epd.prefill.router import Router
from epd.runtime.process import torch_threads
from epd.runtime.watchdog import Watchdog
from epd.wire.codec import WireError
from epd.wire.messages import KVHandoff, KVMissing, TokenDelta

log = logging.getLogger(__name__)
T = TypeVar("T")
now = time.perf_counter
# The statuses a request has between `submit` and its last delta.
IN_PREFILL = (Status.ENCODING, Status.WAITING, Status.RUNNING, Status.DECODING)
MAX_RESENDS = 2  # hand-offs sent again to a decoder that says it lacks blocks, per request
HASHED_ON_LOOP = 4096  # prompt tokens hashed on the event loop; longer prompts off it


async def within(awaitable: Awaitable[T], seconds: float, error: Exception) -> T:
    """Await with a time limit, raising `error` when it runs out.

    Unlike `asyncio.wait_for` before Python 3.12, this never swallows a cancellation that lands
    as the awaited result arrives, so a cancelled request always runs its clean-up.
    """
    future = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({future}, timeout=seconds)
    finally:
        if not future.done():
            future.cancel()
    if not done:
        raise error
    return future.result()


async def unless_set(work: Awaitable[T], event: asyncio.Event, error: Callable[[], Exception]) -> T:
    """Await `work`, or raise `error()` (cancelling it) as soon as `event` is set."""
    task, setting = asyncio.ensure_future(work), asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({task, setting}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise error()
        return task.result()
    finally:
        setting.cancel()
        if not task.done():
            task.cancel()


class Coordinator:
    def __init__(
        self,
        config: PrefillConfig,
        engine: PrefillEngine,
        max_image_tokens: int,
        watchdog: Watchdog,
        metrics: PrefillMetrics | None = None,
        in_flight: Callable[[], int] = lambda: 0,
    ) -> None:
        self.config, self.engine, self.watchdog = config, engine, watchdog
        self.in_flight = in_flight
        self.metrics = metrics or PrefillMetrics(config.model_name)
        rows = config.max_images * max_image_tokens
        largest = rows * engine.lm.config.hidden_size * 4  # float32 embeddings of every image
        self.router = Router(config, largest, self.metrics, polled=self.beat)
        # An encoder not measured yet may hold one request at this server's limits (its
        # images' patches: 2×2 of them make a token), which encode_timeout_s allows for.
        self.router.load.first_patches = config.max_images * max_image_tokens * 4
        self.requests: dict[str, Request] = {}  # between `submit` and their last delta
        budget = token_budget(config.max_prefill_tokens, engine.device)
        self.batcher = PrefillBatcher(
            engine,
            budget,
            config.reply_address,
            self.metrics,
            progressed=lambda: watchdog.beat("prefill"),
            min_chunk=config.min_chunk_tokens,
            threads=torch_threads(config.threads, config.device),
            busy_threads=config.busy_threads,
            # API requests other than the forward's (in flight from arrival to their last
            # byte): read and tokenised, encoding, waiting, decoding.
            others_running=lambda: self.in_flight_count() > len(self.batcher.forward),
        )
        self.encoding = Encoding(config, engine, self.router, self.metrics)
        # What each decoder holds, as prefill believes; its events followed from the start.
        self.decoder_blocks = DecoderBlocks(events=config.decoder_kv_events)
        self.decoder_blocks.keep_only(self.router.decoders.current)
        self.router.lost = self.decoder_blocks.lost
        self.bound: Counter[str] = Counter()  # requests in prefill, by the decoder chosen
        self.tasks: list[asyncio.Task[None]] = []
        self.ending = asyncio.Event()  # set by `end_all`

    def start(self) -> None:
        self.batching = asyncio.create_task(self.batcher.run())
        self.tasks = [*self.router.tasks(), self.batching]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.batcher.close()
        self.router.close()
        self.decoder_blocks.close()

    def end_all(self, error: PrefillError) -> None:
        """Fail every request in flight with `error` now, and those that go on from now on,
        wherever they are (waiting for images, for prefill or in it, for decode's tokens): the
        process stops, and a client told why beats a connection cut at exit."""
        self.router.end_all(error)
        self.batcher.end_all(error)
        self.ending.set()

    async def unless_ended(self, work: Awaitable[T]) -> T:
        """Await `work` (a prompt built, images fetched) unless `end_all` comes first: then
        its error, at once."""
        return await unless_set(work, self.ending, self.ended)

    def ended(self) -> PrefillError:
        """The error `end_all` gave every request; Unavailable before it."""
        return self.router.ended or Unavailable("the server stopped before this request finished")

    def beat(self) -> None:
        """The loop is alive; so is prefill, when it has nothing to do."""
        self.watchdog.beat("loop")
        if not self.batcher.busy and not self.batching.done():
            self.watchdog.beat("prefill")

    def in_flight_count(self) -> int:
        """Requests in flight: the API's count, or where nothing counts them (tests), those
        between `submit` and their last delta."""
        return max(self.in_flight(), len(self.requests))

    def counts(self) -> dict[str, int]:
        """Requests by status, for /health."""
        counted = Counter(request.status for request in self.requests.values())
        return {status.value: counted[status] for status in IN_PREFILL}

    # A request's path.
    async def submit(self, prepared: PreparedRequest) -> Request:
        """Encode a request's images, prefill it and hand it to a decoder (unless its first
        tokens end it); raises, before any reply is sent, what kept it from decode. Its
        deltas then come from `deltas`, which ends its life."""
        request = self.requests[prepared.request_id] = Request(prepared.request_id)
        if prepared.sampling.n == 1 and self.config.migration_limit:  # what moving it needs
            request.prepared = prepared
        try:
            images = await self.encoding.embed(prepared)
            request.status = Status.WAITING
            await self.prefill(prepared, images, request)
            return request
        except BaseException:  # its hand-off may have released it already
            self.requests.pop(prepared.request_id, None)
            raise

    async def prefill(
        self,
        prepared: PreparedRequest,
        images: Images | None,
        request: Request,
        resume: Resume | None = None,
    ) -> None:
        """Prefill the request, packed with whatever else waits for prefill, and hand it to a
        decoder unless its first tokens ended it; raises (before any reply is sent) if no
        decoder can take it. `resume`: a request moving to another decoder (`migrate`)."""
        ids, slot = prepared.prompt_ids, self.engine.placeholder_id
        spans = image_spans(ids, slot, prepared.image_tokens, images.digests) if images else ()
        prompt = Prompt(
            prepared.request_id,
            ids,
            None if images is None else images.rows,
            prepared.sampling,
            prepared.prompt_logprobs,
            image_spans=spans,
            salt=salt_digest(prepared.cache_salt),
            resume=resume,
        )
        if prompt.cacheable:
            prompt = replace(prompt, block_hashes=await self.hashes(prompt))
        # Its decoder, chosen now, so that the hand-off leaves out the blocks it holds; where
        # none is up, after the prefill (whose first token may end the request: none needed).
        live = self.router.live(self.router.decoders) if prepared.sampling.max_tokens > 1 else []
        self.decoder_blocks.keep_only(self.router.decoders.current)
        decoder = ""
        if live:
            decoder, held = self.choose_decoder(live, prompt.block_hashes)
            prompt = replace(prompt, decoder_blocks=held)
        self.bound[decoder] += 1  # counted as its decoder's from now: prompts prefilled together
        try:  # choose before any of them streams
            prefilled = await self.batcher.prefill(prompt, request)
            await self.hand_off(request, prefilled, decoder, prompt.block_hashes)
        finally:
            self.bound[decoder] -= 1

    def choose_decoder(self, live: list[str], hashes: tuple[bytes, ...]) -> tuple[str, int]:
        """The live decoder (rotated: equals take turns) that holds most of the prompt, weighed
        against how full and busy each is (`decoders.choose`), and the blocks it holds."""
        if len(live) == 1:  # nothing to weigh: no count over every stream on the loop
            return live[0], self.decoder_blocks.blocks(live[0], hashes)
        running, usage = self.router.running() + self.bound, self.router.kv_usage
        candidates = [
            Candidate(d, self.decoder_blocks.blocks(d, hashes), usage.get(d, 0.0), running[d])
            for d in live
        ]
        chosen = choose(candidates, len(hashes))
        return chosen.address, chosen.held

    async def hashes(self, prompt: Prompt) -> tuple[bytes, ...]:
        """The prompt's block hashes (a long prompt's off the event loop)."""
        ids, spans = prompt.prompt_ids, prompt.image_spans or ()
        if len(ids) <= HASHED_ON_LOOP:
            return self.engine.hashes(ids, spans, prompt.salt)
        return await asyncio.to_thread(self.engine.hashes, ids, spans, prompt.salt)

    async def hand_off(
        self, request: Request, prefilled: Prefilled, decoder: str, hashes: tuple[bytes, ...]
    ) -> None:
        """The request's first tokens, and unless they ended it, its hand-off to `decoder` (or
        another, where that one went): its record then streams decode's tokens."""
        if prefilled.first:  # none for a request moving on: its client has them
            first = (TokenDelta.of(request.request_id, i, o) for i, o in enumerate(prefilled.first))
            request.first = tuple(first)
            request.choices, request.prompt_logprobs = len(request.first), prefilled.prompt_logprobs
        handoff = prefilled.handoff
        if handoff is None:
            return
        assert prefilled.table is not None, "a hand-off's blocks are held until decode has it"
        handed = Handed.of(handoff, prefilled.table, hashes)
        router = self.router
        try:
            if not decoder or not router.outbox.is_up(decoder):  # none was up, or it went
                live = await router.pick(router.decoders, "decode")
                decoder, held = self.choose_decoder(live, hashes)
                if held != handoff.cached_blocks:  # the rows after what this one holds
                    handoff = await self.on_engine(self.engine.resend, handed, held)
        except BaseException:
            self.batcher.on_engine(self.engine.kv.release, handed.table)
            raise
        request.decoder, request.handed = decoder, handed
        request.sent_at, request.max_tokens = now(), handoff.sampling.max_tokens
        if request.prepared is not None and request.rng_state is None:
            request.rng_state = handoff.rng_states[0]  # after the first token: moving replays
        router.open(request)
        try:
            if router.ended is not None:  # its forward ran on through `end_all`
                raise router.ended
            self.send(request, handoff)
        except BaseException:
            self.release(request, finished=True)
            raise
        request.status = Status.DECODING

    def send(self, request: Request, handoff: KVHandoff) -> None:
        """Hand a request to its decoder; raises what kept it from going."""
        try:
            sent = self.router.outbox.send(request.decoder, handoff)
        except WireError as e:  # its settings (grammar, stop strings, logprobs...) add up past it
            raise BadRequest(f"the request is too large to hand to decode: {e}") from None
        if not sent:
            raise Unavailable(f"decode server {request.decoder} is not reachable")
        assert request.handed is not None
        self.decoder_blocks.sent(request.decoder, request.handed.hashes)
        self.metrics.handoff_bytes.inc(handoff.cache.nbytes)
        self.metrics.handoff_tokens.inc(handoff.cache.shape[1])
        request.handed.reused = handoff.cached_blocks  # counted once decode has taken it

    async def resend(self, request: Request, missing: KVMissing) -> None:
        """The decoder lacks blocks it was said to hold (it evicted them): the hand-off again,
        with the rows after those it has."""
        handed = request.handed
        if handed is None or handed.resends >= MAX_RESENDS:
            raise Internal(f"decode asked {MAX_RESENDS + 1} times for the request's KV blocks")
        handed.resends += 1
        self.decoder_blocks.missing(
            request.decoder, handed.hashes, missing.held_blocks, missing.keeps
        )
        handoff = await self.on_engine(self.engine.resend, handed, missing.held_blocks)
        self.send(request, handoff)

    async def migrate(self, request: Request, lost: DecoderLost) -> None:
        """Move a stream whose decoder died to another: its prompt and its reply so far
        prefilled again (the prompt's blocks from the prefix cache, so mostly the reply's
        tokens are computed; its images from the image cache, or encoded again), and handed on
        from the last token its client has, the generator where the dead decoder's was
        (`Resume`): the client's stream goes on, no token lost or repeated. Raises `lost` where
        it may not move (more than one choice, `migration_limit` reached), or what kept it from
        another decoder (none is up: at once)."""
        prepared, emitted = request.prepared, request.emitted
        if prepared is None or request.rng_state is None or not emitted:
            raise lost
        try:
            if request.migrations >= self.config.migration_limit:
                raise lost
            await self.router.pick(self.router.decoders, "decode")  # none: fail now, not later
            log.warning(
                "%s: %s; moving it to another decoder after %d tokens",
                request.request_id,
                lost,
                len(emitted),
            )
            self.router.release(request)  # aborted there, if it is back; its words refused
            request.decoder = ""  # it has left that one: a late word of its loss is stale
            request.migrations += 1  # a new wire id (`Request.wire_id`)
            self.decoded(request)
            moved = replace(
                prepared,
                request_id=request.wire_id,
                prompt_ids=[*prepared.prompt_ids, *emitted[:-1]],
            )
            state = advanced(request.rng_state, prepared.sampling, len(emitted) - 1)
            images = await self.encoding.embed(moved)
            await self.prefill(moved, images, request, Resume(len(emitted) - 1, emitted[-1], state))
        except PrefillError:
            self.metrics.migrations.labels("decode", "failed").inc()
            raise
        self.metrics.migrations.labels("decode", "resumed").inc()

    async def on_engine(self, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) on the engine's thread, as every use of its pool, between forwards."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.batcher.executor, fn, *args)

    def decoded(self, request: Request) -> None:
        """Decode took the hand-off (or gave up on it): prefill lets go of its blocks, which
        stay cached where they were published."""
        if request.handed is not None:
            self.batcher.on_engine(self.engine.kv.release, request.handed.table)
            request.handed = None

    def deltas(self, request: Request) -> AsyncIterator[TokenDelta]:
        """The request's deltas until each choice's last one; leaving early aborts it in decode.

        A reply that never starts reading them (its client left as the response began) never
        runs the generator's clean-up, so the stream is also released when the generator is
        dropped: otherwise decode would run it to its end for nobody, and prefill would count
        it as running for ever (`PrefillBatcher.forward_threads`). (On the loop: the garbage
        collector may drop it on any thread.)
        """
        deltas, loop = self.read_deltas(request), asyncio.get_running_loop()
        weakref.finalize(deltas, on_loop, loop, self.release, request).atexit = False
        return deltas

    def release(self, request: Request, finished: bool = False) -> None:
        """The request's life is over: its stream forgotten (and aborted in decode unless it
        finished there), once, whichever of its ends comes first."""
        self.requests.pop(request.request_id, None)
        self.decoded(request)
        self.router.release(request, finished)

    async def read_deltas(self, request: Request) -> AsyncIterator[TokenDelta]:
        """Prefill's first deltas, then decode's, each of which must carry on its choice: a
        decoder that repeats a token (one of another version, which sends the first token
        again) or revives an ended choice fails the request rather than garble it."""
        open_choices = set(range(request.choices))
        tokens = [0] * request.choices  # each choice's tokens so far
        try:
            for delta in request.first:
                tokens[delta.index] = delta.completion_tokens
                if request.prepared is not None:  # one choice: what moving it replays
                    request.emitted.extend(delta.token_ids)
                if delta.finish_reason is not None:
                    open_choices.discard(delta.index)
                yield delta
            while open_choices:
                limit = self.config.token_timeout_s
                item = await within(
                    request.queue.get(), limit, TimedOut(f"decode sent nothing for {limit}s")
                )
                if isinstance(item, TokenDelta | KVMissing) and item.request_id != request.wire_id:
                    continue  # queued by a decoder it left, between its loss and the move
                if isinstance(item, KVMissing):
                    await self.resend(request, item)
                    continue
                if isinstance(item, DecoderLost):
                    if item.decoder == request.decoder:  # else: one it has left already
                        await self.migrate(request, item)
                    continue
                if isinstance(item, TokenDelta) and request.handed is not None:
                    reused = request.handed.reused * BLOCK_TOKENS
                    self.metrics.handoff_reused_tokens.inc(reused)
                self.decoded(request)
                if isinstance(item, PrefillError):
                    raise item
                if request.sent_at:  # decode's first delta: the hand-off's round trip is done
                    self.metrics.handoff_seconds.observe(now() - request.sent_at)
                    request.sent_at = 0.0
                check_follows(item, request, tokens, open_choices)
                tokens[item.index] = item.completion_tokens
                if request.prepared is not None:
                    request.emitted.extend(item.token_ids)
                if item.finish_reason is not None:
                    open_choices.discard(item.index)
                yield item
        finally:  # client gone or failure: free the request's KV in decode
            self.release(request, finished=not open_choices)


def check_follows(
    item: TokenDelta, request: Request, tokens: list[int], open_choices: set[int]
) -> None:
    """Raise Internal unless decode's delta carries on an open choice, within max_tokens."""
    choice = f"choice {item.index} of {request.choices}"
    if item.index not in open_choices:
        raise Internal(f"decode sent a delta for {choice}, which is not open")
    if item.completion_tokens != tokens[item.index] + len(item.token_ids):
        raise Internal(
            f"decode's delta for {choice} does not follow on: {item.completion_tokens}"
            f" tokens in all, after {tokens[item.index]} and {len(item.token_ids)} new"
        )
    if item.completion_tokens > request.max_tokens:
        raise Internal(
            f"decode sent {item.completion_tokens} tokens for {choice}, past the "
            f"request's max_tokens of {request.max_tokens}"
        )


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args: object) -> None:
    """fn(*args) on the loop, from any thread, unless the loop has closed (the process ends)."""
    if not loop.is_closed():
        loop.call_soon_threadsafe(fn, *args)
