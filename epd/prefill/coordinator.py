"""Prefill's side of the wire: send work to encoders and decoders, route their replies.

Runs on the API's event loop. Each request waits on futures (image embeddings) and a queue
(token deltas) keyed by its id; a Failure, a timeout or a peer that disconnects resolves them with
an error, so no request waits on a dead process. A request's first tokens come from prefill
itself, at once; decode sends the rest (and gets nothing to do if the first tokens end it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
import time
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

import torch

from epd.config.roles import PrefillConfig
from epd.generation.finite import overflows
from epd.generation.sampling import Scored
from epd.multimodal.grids import kimi_vl_grids
from epd.prefill.batcher import PrefillBatcher, token_budget
from epd.prefill.encode_load import EncodeLoad
from epd.prefill.engine import Prefilled, PrefillEngine, Prompt
from epd.prefill.errors import (
    BadRequest,
    Internal,
    Overloaded,
    PrefillError,
    TimedOut,
    Unavailable,
    from_failure,
)
from epd.prefill.image_cache import ImageCache, digests
from epd.prefill.metrics import PrefillMetrics
from epd.prefill.peers import RESOLVE_S, PeerSet
from epd.prefill.prefix_cache import PrefixCache, image_spans
from epd.prefill.request import PreparedRequest
from epd.runtime.process import torch_threads
from epd.runtime.watchdog import Watchdog
from epd.wire.codec import WireError
from epd.wire.curve import process_keys
from epd.wire.messages import (
    Abort,
    EncodeRequest,
    Failure,
    ImageEmbeddings,
    Message,
    TokenDelta,
)
from epd.wire.outbox import Outbox
from epd.wire.transport import Inbox, PerSecond, async_context

log = logging.getLogger(__name__)
PEER_POLL_S = 0.02
PEER_GRACE_S = 0.5  # how long a request waits for a peer that is just connecting
MAX_DISOWNED = 4096  # requests not ours that decoders were asked to drop, remembered
# Requests not ours that decoders are asked to drop, at most, each second. Anyone may send a
# 22-byte delta for a new id: unchecked, a flood of them became a flood of Aborts on the queue
# that carries real hand-offs to decode (65 536 queued in 2.6 s, measured). Ours need few:
# a request whose client left was aborted already when it was released.
DISOWNED_PER_S = 64
# How long what a lost peer sent before it went (its last tokens, a Failure saying why it
# stopped) has to be read before its requests fail for the loss: the disconnect is seen on
# another connection and can overtake them. Messages still unread then may hold them too, so
# the loss waits for those, up to LAST_WORDS_MAX_S.
LAST_WORDS_S, LAST_WORDS_MAX_S = 0.5, 2.5
T = TypeVar("T")
now = time.perf_counter


class Images(NamedTuple):
    """A request's images as prefill takes them: their embeddings, (rows, hidden) in prompt
    order, and each file's SHA-256 (what the prefix cache knows them by)."""

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


@dataclass
class EncodeWait:
    encoder: str
    future: asyncio.Future[ImageEmbeddings]


@dataclass
class Stream:
    request_id: str
    decoder: str  # "" when the first tokens ended every choice: nothing was handed off
    choices: int  # the request's n: it ends once each choice has had its last delta
    first: tuple[TokenDelta, ...] = ()  # each choice's first token, from prefill
    queue: asyncio.Queue[TokenDelta | PrefillError] = field(default_factory=asyncio.Queue)
    sent_at: float = 0.0  # when the hand-off went to the decoder (perf_counter)
    max_tokens: int = sys.maxsize  # the request's: no choice may have more
    prompt_logprobs: tuple[Scored, ...] = ()  # scored prompt tokens, if asked (`Prompt`)


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
        self.metrics = metrics or PrefillMetrics(config.model_name)
        keys = process_keys(config.zmq_curve_keys)
        self.encoders = PeerSet("encode", config.encoders)
        self.decoders = PeerSet("decode", config.decoders)
        self.outbox = Outbox(pinned=self.peers(), curve=keys)
        for peers in (self.encoders, self.decoders):
            for address in peers.current:
                self.metrics.watch_peer(peers.role, address, self.outbox.is_up)
        rows = config.max_images * max_image_tokens
        largest = rows * engine.lm.config.hidden_size * 4  # float32 embeddings of every image
        self.inbox = Inbox(async_context(), config.bind, largest, curve=keys)
        self.waits: dict[tuple[str, int], EncodeWait] = {}  # images being encoded
        self.streams: dict[str, Stream] = {}  # requests handed to decode, not finished
        self.disowned: OrderedDict[str, None] = OrderedDict()  # unknown requests aborted (LRU)
        self.disowning = PerSecond(DISOWNED_PER_S)
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
            # byte): read and tokenised, encoding, waiting, decoding. `streams` and `waits`
            # count those last where nothing counts requests (tests).
            others_running=lambda: (
                in_flight() > len(self.batcher.forward) or bool(self.streams or self.waits)
            ),
            prefix_cache=prefix_cache(config, engine),
        )
        self.images = ImageCache(config.image_cache_bytes)
        self.load = EncodeLoad(config.encode_timeout_s)
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self.batching = asyncio.create_task(self.batcher.run())
        self.tasks = [
            asyncio.create_task(self.read()),
            asyncio.create_task(self.watch_peers()),
            asyncio.create_task(self.follow_services()),
            self.batching,
        ]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.batcher.close()
        self.inbox.close()
        self.outbox.close()

    # Receiving.
    async def read(self) -> None:
        while True:
            message = None
            try:
                message = await self.inbox.arecv()
                if message is not None:
                    self.route(message)
            except Exception as e:  # one message (or a socket's hiccup) must not end the reading
                self.inbox.refusals.log(f"reading a message failed: {type(e).__name__}: {e}")
            del message  # an unclaimed payload must not stay alive until the next one comes
            # A queued message makes arecv return at once, without yielding: let the API and
            # the peer watch run between messages, or a flood would starve them.
            await asyncio.sleep(0)

    def route(self, message: Message) -> None:
        if isinstance(message, ImageEmbeddings):
            self.load.replied((message.request_id, message.part_index))
            wait = self.waits.get((message.request_id, message.part_index))
            if wait and not wait.future.done():
                wait.future.set_result(message)
        elif isinstance(message, TokenDelta):
            if (stream := self.streams.get(message.request_id)) is not None:
                stream.queue.put_nowait(message)
                self.decoder_reported(stream.decoder, message.kv_cache_usage)
            else:
                self.disown(message.request_id)
        elif isinstance(message, Failure):
            self.load.failed(message.request_id)
            self.fail(message.request_id, from_failure(message))
        else:
            self.inbox.refusals.log(f"a {type(message).__name__}: prefill does not take it")

    def decoder_reported(self, decoder: str, kv_cache_usage: float | None) -> None:
        """What a decoder said of its KV cache with a delta of a request it holds for this
        prefill (not one it has stopped using: that series went with it)."""
        if kv_cache_usage is not None and decoder in self.decoders.current:
            self.metrics.decoder_reported(decoder, kv_cache_usage)

    def disown(self, request_id: str) -> None:
        """Tokens came for a request this prefill does not hold (its client left, it timed out,
        or someone handed decode a request in this prefill's name): every decoder is asked,
        once per request, to drop it, so that what holds decode's room is what is wanted; past
        DISOWNED_PER_S such requests a second, the tokens are only refused."""
        if request_id in self.disowned:
            return
        if not self.disowning.take():
            self.inbox.refusals.log(f"tokens for {request_id}, not a request of this prefill")
            return
        self.disowned[request_id] = None
        if len(self.disowned) > MAX_DISOWNED:
            self.disowned.popitem(last=False)
        for decoder in self.decoders.current:
            self.outbox.send(decoder, Abort(request_id))

    def fail(self, request_id: str, error: PrefillError) -> None:
        for (rid, _), wait in self.waits.items():
            if rid == request_id and not wait.future.done():
                wait.future.set_exception(error)
        if (stream := self.streams.get(request_id)) is not None:
            stream.queue.put_nowait(error)

    async def watch_peers(self) -> None:
        """Fail every request held by a peer that disconnected (once its last words are read,
        `fail_held_by`), or that its peer did not take in time."""
        while True:
            self.watchdog.beat("loop")
            if not self.batcher.busy and not self.batching.done():  # idle and alive
                self.watchdog.beat("prefill")
            losses = self.outbox.poll()
            for address in losses.peers:
                log.warning("lost the connection to %s", address)
                self.fail_held_by(address)
            for address, request_id in losses.requests:
                self.fail(request_id, Unavailable(f"{address} did not take this request in time"))
            await asyncio.sleep(PEER_POLL_S)

    def peers(self) -> tuple[str, ...]:
        return (*self.encoders.current, *self.decoders.current)

    async def follow_services(self) -> None:
        """Resolve the peers given as host names again, now and then (see `peers`)."""
        if not (self.encoders.services or self.decoders.services):
            return
        while True:
            await asyncio.sleep(RESOLVE_S)
            for peers in (self.encoders, self.decoders):
                added, removed = await asyncio.to_thread(peers.resolve)
                for address in added:
                    self.metrics.watch_peer(peers.role, address, self.outbox.is_up)
                for address in removed:
                    self.metrics.forget_peer(peers.role, address)
            self.outbox.pin(self.peers())

    def fail_held_by(self, address: str) -> None:
        """Fail the requests a lost peer holds now (not ones handed to it once it is back),
        unless its last words end them first: LAST_WORDS_S from now, or once no message waits
        unread, up to LAST_WORDS_MAX_S."""
        error = f"lost the connection to {address} while it held this request"
        self.load.lost(address)
        waits = [wait.future for wait in self.waits.values() if wait.encoder == address]
        streams = [stream for stream in self.streams.values() if stream.decoder == address]
        loop = asyncio.get_running_loop()
        give_up = loop.time() + LAST_WORDS_MAX_S

        def fail() -> None:
            if self.inbox.pending() and loop.time() < give_up:  # unread: its last words, maybe
                loop.call_later(PEER_POLL_S, fail)
                return
            for future in waits:
                if not future.done():
                    future.set_exception(Unavailable(error))
            for stream in streams:
                if self.streams.get(stream.request_id) is stream:  # not released yet
                    stream.queue.put_nowait(Unavailable(error))

        loop.call_later(LAST_WORDS_S, fail)  # harmless if the coordinator has stopped by then

    # Sending.
    async def pick(self, peers: PeerSet, role: str) -> list[str]:
        """Live peers of a role, rotated; a short grace lets a (re)connecting peer finish."""
        deadline = asyncio.get_running_loop().time() + PEER_GRACE_S
        while not (live := [a for a in peers.current if self.outbox.is_up(a)]):
            if asyncio.get_running_loop().time() > deadline:
                tried = ", ".join(peers.current or peers.configured)
                raise Unavailable(f"no {role} server is reachable (tried {tried})")
            await asyncio.sleep(PEER_POLL_S)
        start = next(peers.turns) % len(live)
        return live[start:] + live[:start]

    async def encode(self, request: PreparedRequest) -> Images | None:
        """Every image's embeddings, in prompt order: from the cache, or from the encoders."""
        if not request.images:
            return None
        keys = await asyncio.to_thread(digests, request.images)  # hashing large files takes time
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
                self.images.put(keys[index], image_rows)
                rows[index] = image_rows
        return Images(torch.cat([rows[i] for i in range(len(request.images))]), tuple(keys))

    async def encode_images(
        self, request: PreparedRequest, indices: list[int]
    ) -> list[ImageEmbeddings]:
        """The embeddings of the images at `indices`, split over the live encoders."""
        encoders = await self.pick(self.encoders, "encode")
        parts = [indices[start:stop] for start, stop in split(len(indices), len(encoders))]
        patches = [sum(h * w for h, w in (request.grids[i] for i in part)) for part in parts]
        self.load.expire(2 * self.config.encode_timeout_s)
        try:
            self.load.admit(sum(patches))
        except Overloaded:
            self.metrics.refused.labels("encode_backlog").inc()
            raise
        waits = []
        for part, (images, encoder) in enumerate(zip(parts, encoders, strict=False)):
            future: asyncio.Future[ImageEmbeddings] = asyncio.get_running_loop().create_future()
            self.waits[(request.request_id, part)] = EncodeWait(encoder, future)
            self.load.sending((request.request_id, part), encoder, patches[part])
            waits.append(future)
            files = tuple(request.images[i] for i in images)
            message = EncodeRequest(
                request.request_id, part, files, tuple(images), self.config.reply_address
            )
            if not self.outbox.send(encoder, message):
                future.set_exception(Unavailable(f"encode server {encoder} is not reachable"))
        limit, start = self.config.encode_timeout_s, time.perf_counter()
        try:
            replies = await within(
                asyncio.gather(*waits), limit, TimedOut(f"no image embeddings within {limit}s")
            )
            self.metrics.encode_wait.observe(time.perf_counter() - start)
            self.metrics.embedding_bytes.inc(sum(r.embeddings.nbytes for r in replies))
            return replies
        finally:
            for part in range(len(parts)):
                self.waits.pop((request.request_id, part), None)

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
        )
        return await self.hand_off(request.request_id, await self.batcher.prefill(prompt))

    async def hand_off(self, request_id: str, prefilled: Prefilled) -> Stream:
        first = tuple(TokenDelta.of(request_id, i, out) for i, out in enumerate(prefilled.first))
        handoff, scored = prefilled.handoff, prefilled.prompt_logprobs
        if handoff is None:
            return Stream(request_id, "", len(first), first, prompt_logprobs=scored)
        decoder = (await self.pick(self.decoders, "decode"))[0]
        stream = Stream(
            request_id,
            decoder,
            len(first),
            first,
            sent_at=now(),
            max_tokens=handoff.sampling.max_tokens,
            prompt_logprobs=scored,
        )
        self.streams[request_id] = stream
        try:
            sent = self.outbox.send(decoder, handoff)
        except WireError as e:  # its settings (grammar, stop strings, logprobs...) add up past it
            del self.streams[request_id]
            raise BadRequest(f"the request is too large to hand to decode: {e}") from None
        except BaseException:  # e.g. a value the wire cannot carry: no stream to wait for
            del self.streams[request_id]
            raise
        if not sent:
            del self.streams[request_id]
            raise Unavailable(f"decode server {decoder} is not reachable")
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
        """The stream is over: forgotten, and aborted in decode unless it finished there (once,
        whichever of its ends comes first)."""
        if self.streams.get(stream.request_id) is stream:
            del self.streams[stream.request_id]
            if not finished:
                self.outbox.send(stream.decoder, Abort(stream.request_id))

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
                tokens[item.index] = item.completion_tokens
                if item.finish_reason is not None:
                    open_choices.discard(item.index)
                yield item
        finally:  # client gone or failure: free the request's KV in decode
            self.release(stream, finished=not open_choices)


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
