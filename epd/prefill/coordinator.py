"""A request's life in prefill, from the API's hand-over to its last token, in one place.

`submit` takes a prepared request through its images (from the image cache, or the encoders),
its prefill (packed with whatever else waits, `PrefillBatcher`) and its hand-off to a decoder;
`deltas` then streams its tokens: each choice's first, which prefill sampled, at once, and
decode's after it. `Router` carries the messages to and from the peers; each request's `Status`
says where it stands (on `/health`, by count).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import NamedTuple, TypeVar

import torch

from epd.config.roles import PrefillConfig
from epd.generation.finite import overflows
from epd.generation.status import Status
from epd.multimodal.grids import Grid, kimi_vl_grids
from epd.prefill.batcher import PrefillBatcher, token_budget
from epd.prefill.engine import Prefilled, PrefillEngine, Prompt
from epd.prefill.errors import (
    BadRequest,
    Internal,
    Overloaded,
    PrefillError,
    TimedOut,
    Unavailable,
)
from epd.prefill.image_cache import ImageCache, digests
from epd.prefill.metrics import PrefillMetrics
from epd.prefill.prefix_cache import PrefixCache, image_spans
from epd.prefill.request import PreparedRequest, Stream
from epd.prefill.router import Router
from epd.runtime.process import torch_threads
from epd.runtime.watchdog import Watchdog
from epd.wire.codec import WireError
from epd.wire.messages import EncodeRequest, ImageEmbeddings, TokenDelta

log = logging.getLogger(__name__)
T = TypeVar("T")
now = time.perf_counter
# The statuses a request has between `submit` and its last delta.
IN_PREFILL = (Status.ENCODING, Status.WAITING, Status.RUNNING, Status.DECODING)
# How often a request waiting for its images asks whether they will still be back in time.
LATE_CHECK_S = 0.5


class Part(NamedTuple):
    """The images of a request sent to one encoder."""

    indices: list[int]  # in the request
    encoder: str
    patches: int


class Images(NamedTuple):
    """A request's images as prefill takes them: their embeddings, (rows, hidden) in prompt
    order, and each file's key in the image cache (what the prefix cache knows them by)."""

    rows: torch.Tensor
    digests: tuple[str, ...]


def prefix_cache(config: PrefillConfig, engine: PrefillEngine) -> PrefixCache | None:
    """The prefix cache, if it is on; a cache that cannot be made is left out, with a warning:
    an optional part never keeps prefill from serving."""
    if not config.enable_prefix_caching or not config.prefix_cache_bytes:
        return None
    lm = engine.lm
    try:
        return PrefixCache(
            lm.config.num_hidden_layers,
            lm.config.latent_dim,
            lm.lm_head.weight.dtype,
            engine.device,
            config.prefix_cache_bytes,
        )
    except Exception as e:  # e.g. no memory for its first block on the device
        log.warning("prefill runs without a prefix cache: %s: %s", type(e).__name__, e)
        return None


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
        self.status: dict[str, Status] = {}  # requests between `submit` and their last delta
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
            others_running=lambda: self.requests() > len(self.batcher.forward),
            prefix_cache=prefix_cache(config, engine),
            moved=self.moved,
        )
        self.images = ImageCache(config.image_cache_bytes)
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self.batching = asyncio.create_task(self.batcher.run())
        self.tasks = [*self.router.tasks(), self.batching]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.batcher.close()
        self.router.close()

    def beat(self) -> None:
        """The loop is alive; so is prefill, when it has nothing to do."""
        self.watchdog.beat("loop")
        if not self.batcher.busy and not self.batching.done():
            self.watchdog.beat("prefill")

    def requests(self) -> int:
        """Requests in flight: the API's count, or where nothing counts them (tests), those
        between `submit` and their last delta."""
        return max(self.in_flight(), len(self.status))

    def alone(self) -> bool:
        """Whether the one request in flight is the one asking (its encode may then take the
        cores that the other roles leave idle)."""
        return self.requests() <= 1 and not self.batcher.busy

    def moved(self, request_id: str, status: Status) -> None:
        if request_id in self.status:
            self.status[request_id] = status

    def counts(self) -> dict[str, int]:
        """Requests by status, for /health."""
        counted = Counter(self.status.values())
        return {status.value: counted[status] for status in IN_PREFILL}

    # A request's path.
    async def submit(self, request: PreparedRequest) -> Stream:
        """Encode a request's images, prefill it and hand it to a decoder (unless its first
        tokens end it); raises, before any reply is sent, what kept it from decode. Its
        deltas then come from `deltas`, which ends its life."""
        self.status[request.request_id] = Status.ENCODING
        try:
            images = await self.encode(request)
            self.status[request.request_id] = Status.WAITING
            return await self.prefill(request, images)
        except BaseException:
            del self.status[request.request_id]
            raise

    async def encode(self, request: PreparedRequest) -> Images | None:
        """Every image's embeddings, in prompt order: from the cache, or from the encoders."""
        if not request.images:
            return None
        self.check_room(request.images, request.grids, request.cache_salt)  # before hashing
        # Hashing large files takes time; salted keys keep one tenant's encodes its own.
        keys = await asyncio.to_thread(digests, request.images, request.cache_salt)
        rows = {
            i: found for i, key in enumerate(keys) if (found := self.images.get(key)) is not None
        }
        missing = [i for i in range(len(request.images)) if i not in rows]
        self.metrics.images.inc(len(keys))
        self.metrics.image_cache_hits.inc(len(rows))
        if missing:
            payloads, lm = await self.encode_images(request, missing), self.engine.lm
            encoded = check_payloads(
                request, missing, payloads, lm.config.hidden_size, lm.lm_head.weight.dtype
            )
            for index, image_rows in zip(missing, encoded, strict=True):
                size = len(request.images[index])
                self.images.put(keys[index], image_rows, size, request.cache_salt)
                rows[index] = image_rows
        return Images(torch.cat([rows[i] for i in range(len(request.images))]), tuple(keys))

    async def encode_images(
        self, request: PreparedRequest, indices: list[int]
    ) -> list[ImageEmbeddings]:
        """The embeddings of the images at `indices`, split over the live encoders."""
        router = self.router
        encoders = await router.pick(router.encoders, "encode")
        parts = self.parts(request.grids, indices, encoders)
        self.admit(parts)
        waits, alone = [], self.alone()
        for number, part in enumerate(parts):
            future = router.expect(request.request_id, number, part.encoder)
            router.load.sending((request.request_id, number), part.encoder, part.patches)
            waits.append(future)
            files = tuple(request.images[i] for i in part.indices)
            message = EncodeRequest(
                request.request_id,
                number,
                files,
                tuple(part.indices),
                self.config.reply_address,
                alone,
            )
            if not router.outbox.send(part.encoder, message):
                future.set_exception(Unavailable(f"encode server {part.encoder} is not reachable"))
        start = time.perf_counter()
        try:
            replies = await self.until_encoded(request.request_id, waits)
            self.metrics.encode_wait.observe(time.perf_counter() - start)
            self.metrics.embedding_bytes.inc(sum(r.embeddings.nbytes for r in replies))
            return replies
        finally:
            router.forget(request.request_id, len(parts))

    def parts(self, grids: Sequence[Grid], indices: list[int], encoders: list[str]) -> list[Part]:
        """The images at `indices` split over `encoders`, each part with its patches (from the
        grids that the images' headers gave, before any pixel is decoded)."""
        groups = [indices[start:stop] for start, stop in split(len(indices), len(encoders))]
        return [
            Part(group, encoder, sum(h * w for h, w in (grids[i] for i in group)))
            for group, encoder in zip(groups, encoders, strict=False)
        ]

    def check_room(
        self, images: Sequence[bytes], grids: Sequence[Grid], salt: str | None = None
    ) -> None:
        """Raise Overloaded, before the images are hashed, if those surely not cached (of a
        file size no cached image has) would not be encoded in time; which of the others are
        cached, and cost no encode, the hashes tell. The API asks as soon as it has the files,
        before it builds the prompt round them."""
        router, cache = self.router, self.images
        new = [i for i, data in enumerate(images) if not cache.may_hold(len(data), salt)]
        live = [a for a in router.encoders.current if router.outbox.is_up(a)]
        if new and live:  # none live: `pick` says so, after a grace for one connecting
            self.admit(self.parts(grids, new, live))

    def admit(self, parts: list[Part]) -> None:
        """Raise Overloaded unless the parts would be back well within encode_timeout_s."""
        load = self.router.load
        load.expire(2 * self.config.encode_timeout_s)
        try:
            load.admit([(part.encoder, part.patches) for part in parts])
        except Overloaded:
            self.metrics.refused.labels("encode_backlog").inc()
            raise

    async def until_encoded(
        self, request_id: str, waits: list[asyncio.Future[ImageEmbeddings]]
    ) -> list[ImageEmbeddings]:
        """The parts' embeddings. Refused (Overloaded) as soon as the encoders' pace shows they
        would not all be back within encode_timeout_s, so that an encoder slowing after the
        request was admitted costs a 503 with Retry-After, not a timeout at the limit."""
        limit, start = self.config.encode_timeout_s, time.perf_counter()
        gathered = asyncio.ensure_future(asyncio.gather(*waits))
        try:
            while not gathered.done():
                waited = time.perf_counter() - start
                if waited >= limit:
                    raise TimedOut(f"no image embeddings within {limit}s")
                try:
                    self.router.load.check_in_time(request_id, waited)
                except Overloaded:
                    self.metrics.refused.labels("encode_late").inc()
                    raise
                await asyncio.wait({gathered}, timeout=min(LATE_CHECK_S, limit - waited))
        finally:
            if not gathered.done():
                gathered.cancel()
        return gathered.result()

    async def prefill(self, request: PreparedRequest, images: Images | None) -> Stream:
        """Prefill the request, packed with whatever else waits for prefill, and hand it to a
        decoder unless its first tokens ended it; raises (before any reply is sent) if no
        decoder can take it."""
        ids, slot = request.prompt_ids, self.engine.placeholder_id
        spans = image_spans(ids, slot, request.image_tokens, images.digests) if images else ()
        prompt = Prompt(
            request.request_id,
            ids,
            None if images is None else images.rows,
            request.sampling,
            request.prompt_logprobs,
            image_spans=spans,
            alone=self.alone(),  # its decoder may then take the idle cores from its first step
            cache_salt=request.cache_salt,
        )
        return await self.hand_off(request.request_id, await self.batcher.prefill(prompt))

    async def hand_off(self, request_id: str, prefilled: Prefilled) -> Stream:
        first = tuple(TokenDelta.of(request_id, i, out) for i, out in enumerate(prefilled.first))
        handoff, scored = prefilled.handoff, prefilled.prompt_logprobs
        cached = prefilled.cached_tokens  # for the reply's usage
        if handoff is None:
            return Stream(
                request_id, "", len(first), first, prompt_logprobs=scored, cached_tokens=cached
            )
        router = self.router
        decoder = (await router.pick(router.decoders, "decode"))[0]
        stream = Stream(
            request_id,
            decoder,
            len(first),
            first,
            sent_at=now(),
            max_tokens=handoff.sampling.max_tokens,
            prompt_logprobs=scored,
            cached_tokens=cached,
        )
        router.open(stream)
        try:
            sent = router.outbox.send(decoder, handoff)
        except WireError as e:  # its settings (grammar, stop strings, logprobs...) add up past it
            router.release(stream, finished=True)
            raise BadRequest(f"the request is too large to hand to decode: {e}") from None
        except BaseException:  # e.g. a value the wire cannot carry: no stream to wait for
            router.release(stream, finished=True)
            raise
        if not sent:
            router.release(stream, finished=True)
            raise Unavailable(f"decode server {decoder} is not reachable")
        self.moved(request_id, Status.DECODING)
        self.metrics.handoff_bytes.inc(handoff.cache.nbytes)
        return stream

    def deltas(self, stream: Stream) -> AsyncIterator[TokenDelta]:
        """The request's deltas until each choice's last one; leaving early aborts it in decode.

        A reply that never starts reading them (its client left as the response began) never
        runs the generator's clean-up, so the stream is also released when the generator is
        dropped: otherwise decode would run it to its end for nobody, and prefill would count
        it as running for ever (`PrefillBatcher.forward_threads`). (On the loop: the garbage
        collector may drop it on any thread.)
        """
        deltas, loop = self.read_deltas(stream), asyncio.get_running_loop()
        weakref.finalize(deltas, on_loop, loop, self.release, stream).atexit = False
        return deltas

    def release(self, stream: Stream, finished: bool = False) -> None:
        """The request's life is over: its stream forgotten (and aborted in decode unless it
        finished there), once, whichever of its ends comes first."""
        self.status.pop(stream.request_id, None)
        self.router.release(stream, finished)

    async def read_deltas(self, stream: Stream) -> AsyncIterator[TokenDelta]:
        """Prefill's first deltas, then decode's, each of which must carry on its choice: a
        decoder that repeats a token (one of another version, which sends the first token
        again) or revives an ended choice fails the request rather than garble it."""
        open_choices = set(range(stream.choices))
        tokens = [0] * stream.choices  # each choice's tokens so far
        try:
            for delta in stream.first:
                tokens[delta.index] = delta.completion_tokens
                if delta.finish_reason is not None:
                    open_choices.discard(delta.index)
                yield delta
            while open_choices:
                limit = self.config.token_timeout_s
                item = await within(
                    stream.queue.get(), limit, TimedOut(f"decode sent nothing for {limit}s")
                )
                if isinstance(item, PrefillError):
                    raise item
                if stream.sent_at:  # decode's first delta: the hand-off's round trip is done
                    self.metrics.handoff_seconds.observe(now() - stream.sent_at)
                    stream.sent_at = 0.0
                check_follows(item, stream, tokens, open_choices)
                tokens[item.index] = item.completion_tokens
                if item.finish_reason is not None:
                    open_choices.discard(item.index)
                yield item
        finally:  # client gone or failure: free the request's KV in decode
            self.release(stream, finished=not open_choices)


def check_follows(
    item: TokenDelta, stream: Stream, tokens: list[int], open_choices: set[int]
) -> None:
    """Raise Internal unless decode's delta carries on an open choice, within max_tokens."""
    choice = f"choice {item.index} of {stream.choices}"
    if item.index not in open_choices:
        raise Internal(f"decode sent a delta for {choice}, which is not open")
    if item.completion_tokens != tokens[item.index] + len(item.token_ids):
        raise Internal(
            f"decode's delta for {choice} does not follow on: {item.completion_tokens}"
            f" tokens in all, after {tokens[item.index]} and {len(item.token_ids)} new"
        )
    if item.completion_tokens > stream.max_tokens:
        raise Internal(
            f"decode sent {item.completion_tokens} tokens for {choice}, past the "
            f"request's max_tokens of {stream.max_tokens}"
        )


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args: object) -> None:
    """fn(*args) on the loop, from any thread, unless the loop has closed (the process ends)."""
    if not loop.is_closed():
        loop.call_soon_threadsafe(fn, *args)


def split(count: int, workers: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) ranges of `count` images over at most `workers` parts."""
    parts = min(count, workers)
    bounds = [round(i * count / parts) for i in range(parts + 1)]
    return list(itertools.pairwise(bounds))


def check_payloads(
    request: PreparedRequest,
    indices: list[int],
    payloads: list[ImageEmbeddings],
    hidden: int,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Each image's rows (tokens, hidden), refusing payloads whose grids or rows disagree with
    the placeholders expanded for the images at `indices`, whose rows are not `hidden` wide, or
    whose values a cast to the model's `dtype` would turn into ±inf. Each payload must hold its
    own images' rows: a short one must not borrow the next one's. (Unchecked rows would be
    cached by the images' hashes, and fail or mislead each later request for those images.)"""
    try:
        grids = tuple(grid for p in payloads for grid in kimi_vl_grids(p.grids))
    except ValueError as e:  # e.g. an odd side, which the 2×2 merge cannot take
        raise Internal(f"encode returned unusable grids: {e}") from None
    expected = tuple(request.grids[i] for i in indices)
    if grids != expected:
        raise Internal(f"encode returned grids {list(grids)} for images of grids {list(expected)}")
    rows: list[torch.Tensor] = []
    for payload in payloads:
        embeddings = payload.embeddings  # (Σ tokens of its images, hidden)
        mine = indices[len(rows) : len(rows) + len(payload.grids)]  # its images, in order
        slots = [request.image_tokens[i] for i in mine]
        if embeddings.shape[1] != hidden:
            raise Internal(
                f"encode returned embeddings {embeddings.shape[1]} wide, not the model's {hidden}"
            )
        if embeddings.shape[0] != sum(slots):
            raise Internal(
                f"encode returned {embeddings.shape[0]} embedding rows for {sum(slots)} image slots"
            )
        if (largest := overflows(embeddings, dtype)) is not None:  # finite: the message checked
            raise Internal(f"encode returned embeddings up to {largest:.3g}, past {dtype}'s range")
        rows.extend(embeddings.split(slots))
    return rows
