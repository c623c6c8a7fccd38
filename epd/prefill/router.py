"""Prefill's side of the wire: its peers, what it sends them, and routing their replies.

Runs on the API's event loop. A request waits on futures (its images' embeddings, `expect`)
and on its stream's queue (token deltas, `open`), keyed by its id; the router resolves them
from what arrives, and with an error on a Failure, or when the peer that holds the request
disconnects or does not take it in time, so that no request waits on a dead process. What a
request does with them (`Coordinator`) is not the router's business.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from epd.config.roles import PrefillConfig
from epd.prefill.encode_load import EncodeLoad
from epd.prefill.errors import (
    DecoderLost,
    EncoderLost,
    PrefillError,
    Unavailable,
    from_failure,
)
from epd.prefill.metrics import PrefillMetrics
from epd.prefill.peers import RESOLVE_S, PeerSet
from epd.prefill.request import Request
from epd.wire.curve import process_keys
from epd.wire.limits import PerSecond
from epd.wire.messages import Abort, Failure, ImageEmbeddings, KVMissing, Message, TokenDelta
from epd.wire.outbox import Outbox
from epd.wire.transport import Inbox, async_context

log = logging.getLogger(__name__)
PEER_POLL_S = 0.02
PEER_GRACE_S = 0.5  # how long a request waits for a peer that is just connecting
MAX_DISOWNED = 4096  # requests not ours that decoders were asked to drop, remembered
# Requests not ours that decoders are asked to drop, at most, each second. Anyone may send a
# 22-byte delta for a new id: unchecked, a flood of them became a flood of Aborts on the queue
# that carries real hand-offs to decode. Ours need few: a request whose client left was
# aborted already when it was released.
DISOWNED_PER_S = 64
# How long what a lost peer sent before it went (its last tokens, a Failure saying why it
# stopped) has to be read before its requests fail for the loss: the disconnect is seen on
# another connection and can overtake them. Messages still unread then may hold them too, so
# the loss waits for those, up to LAST_WORDS_MAX_S.
LAST_WORDS_S, LAST_WORDS_MAX_S = 0.5, 2.5


@dataclass
class EncodeWait:
    encoder: str
    future: asyncio.Future[ImageEmbeddings]


class Router:
    def __init__(
        self,
        config: PrefillConfig,
        largest_message: int,
        metrics: PrefillMetrics,
        polled: Callable[[], None] = lambda: None,
    ) -> None:
        """`largest_message`: bytes of the largest reply to take (every image's embeddings);
        `polled`: called at every poll of the peers (the watchdog's sign of a live loop)."""
        self.metrics, self.polled = metrics, polled
        keys = process_keys(config.zmq_curve_keys)
        self.encoders = PeerSet("encode", config.encoders)
        self.decoders = PeerSet("decode", config.decoders)
        self.outbox = Outbox(pinned=self.peers(), curve=keys)
        for peers in (self.encoders, self.decoders):
            for address in peers.current:
                metrics.watch_peer(peers.role, address, self.outbox.is_up)
        self.inbox = Inbox(async_context(), config.bind, largest_message, curve=keys)
        self.load = EncodeLoad(config.encode_timeout_s)  # what each encoder has to do
        self.waits: dict[tuple[str, int], EncodeWait] = {}  # images being encoded
        self.streams: dict[str, Request] = {}  # requests handed to decode, by wire id
        self.kv_usage: dict[str, float] = {}  # each decoder's KV cache use, as it last said
        self.lost: Callable[[str], None] = lambda address: None  # told of each peer lost
        self.disowned: OrderedDict[str, None] = OrderedDict()  # unknown requests aborted (LRU)
        self.disowning = PerSecond(DISOWNED_PER_S)
        self.ended: PrefillError | None = None  # set by `end_all`: the error of every request

    def tasks(self) -> list[asyncio.Task[None]]:
        return [
            asyncio.create_task(self.read()),
            asyncio.create_task(self.watch_peers()),
            asyncio.create_task(self.follow_services()),
        ]

    def close(self) -> None:
        self.inbox.close()
        self.outbox.close()

    def peers(self) -> tuple[str, ...]:
        return (*self.encoders.current, *self.decoders.current)

    # What requests wait on.
    def expect(self, request_id: str, part: int, encoder: str) -> asyncio.Future[ImageEmbeddings]:
        """The embeddings of a request's part, once `encoder` sends them (`forget` after)."""
        future: asyncio.Future[ImageEmbeddings] = asyncio.get_running_loop().create_future()
        self.waits[(request_id, part)] = EncodeWait(encoder, future)
        if self.ended is not None:
            future.set_exception(self.ended)
        return future

    def forget(self, request_id: str, parts: int) -> None:
        for part in range(parts):
            self.waits.pop((request_id, part), None)

    def open(self, stream: Request) -> None:
        """Deltas for the stream's request go to its queue from now on (`release` after)."""
        self.streams[stream.wire_id] = stream
        if self.ended is not None:
            stream.queue.put_nowait(self.ended)

    def release(self, stream: Request, finished: bool = False) -> None:
        """The stream is over: forgotten, and aborted in decode unless it finished there (once,
        whichever of its ends comes first)."""
        if self.streams.get(stream.wire_id) is stream:
            del self.streams[stream.wire_id]
            if not finished and stream.decoder:  # none while it moves between decoders
                self.outbox.send(stream.decoder, Abort(stream.wire_id))

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
        elif isinstance(message, KVMissing):  # its decoder wants the hand-off again
            if (stream := self.streams.get(message.request_id)) is not None:
                stream.queue.put_nowait(message)
        elif isinstance(message, Failure):
            self.load.failed(message.request_id)  # on every encoder: see `EncodeLoad.failed`
            self.fail(message.request_id, from_failure(message))
        else:
            self.inbox.refusals.log(f"a {type(message).__name__}: prefill does not take it")

    def decoder_reported(self, decoder: str, kv_cache_usage: float | None) -> None:
        """What a decoder said of its KV cache with a delta of a request it holds for this
        prefill (not one it has stopped using: that series went with it)."""
        if kv_cache_usage is not None and decoder in self.decoders.current:
            self.metrics.decoder_reported(decoder, kv_cache_usage)
            self.kv_usage[decoder] = kv_cache_usage

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

    def end_all(self, error: PrefillError) -> None:
        """Fail every request with `error` now, those that wait from now on too: the process
        stops, and a stream that ends with an error event tells its client why, where a
        connection cut at exit would not."""
        self.ended = error
        for wait in self.waits.values():
            if not wait.future.done():
                wait.future.set_exception(error)
        for stream in self.streams.values():
            stream.queue.put_nowait(error)

    # The peers.
    async def watch_peers(self) -> None:
        """Fail every request held by a peer that disconnected (once its last words are read,
        `fail_held_by`), or that its peer did not take in time."""
        while True:
            self.polled()
            losses = self.outbox.poll()
            for address in losses.peers:
                log.warning("lost the connection to %s", address)
                self.lost(address)
                self.fail_held_by(address)
            for address, request_id in losses.requests:
                self.load.failed(request_id, address)  # never reached it: not in its queue
                self.fail(request_id, Unavailable(f"{address} did not take this request in time"))
            await asyncio.sleep(PEER_POLL_S)

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
                    self.kv_usage.pop(address, None)
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
                    future.set_exception(EncoderLost(error))
            for stream in streams:
                # not released yet, nor moved to another decoder since (`Coordinator.migrate`)
                if self.streams.get(stream.wire_id) is stream and stream.decoder == address:
                    stream.queue.put_nowait(DecoderLost(error, address))

        loop.call_later(LAST_WORDS_S, fail)  # harmless if the router has stopped by then

    async def pick(self, peers: PeerSet, role: str) -> list[str]:
        """Live peers of a role, rotated; a short grace lets a (re)connecting peer finish."""
        deadline = asyncio.get_running_loop().time() + PEER_GRACE_S
        while not (live := self.live(peers)):
            if asyncio.get_running_loop().time() > deadline:
                tried = ", ".join(peers.current or peers.configured)
                raise Unavailable(f"no {role} server is reachable (tried {tried})")
            await asyncio.sleep(PEER_POLL_S)
        return live

    def running(self) -> Counter[str]:
        """This prefill's requests streaming from each decoder."""
        return Counter(stream.decoder for stream in self.streams.values())

    def live(self, peers: PeerSet) -> list[str]:
        """Live peers of a role now, rotated; none if none is up."""
        live = [a for a in peers.current if self.outbox.is_up(a)]
        if not live:
            return []
        start = next(peers.turns) % len(live)
        return live[start:] + live[:start]
