"""A request's images as prefill takes them: their embeddings from the image cache, or from
the encoders, split over those that answer.

Images go to the encoders only where they would be back well within `encode_timeout_s`
(`EncodeLoad`): judged as soon as the API has the files, from the sizes their headers give
(`check_room`, before they are hashed), again when they are sent, and every `LATE_CHECK_S`
while the request waits, so that a burst, or an encoder that slows, costs 503s with
Retry-After at once rather than timeouts at the limit. What comes back is checked against the
placeholders expanded for it before it is cached or used (`check_payloads`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

from epd.config.roles import PrefillConfig
from epd.generation.finite import overflows
from epd.kv.hashing import image_digests
from epd.multimodal.grids import Grid, kimi_vl_grids
from epd.prefill.engine import PrefillEngine
from epd.prefill.errors import EncoderLost, Internal, Overloaded, TimedOut, Unavailable
from epd.prefill.image_cache import ImageCache
from epd.prefill.metrics import PrefillMetrics
from epd.prefill.request import PreparedRequest
from epd.prefill.router import Router
from epd.wire.messages import EncodeRequest, ImageEmbeddings

log = logging.getLogger(__name__)
# How often a request waiting for its images asks whether they will still be back in time.
LATE_CHECK_S = 0.5
MAX_PARTS = 1024  # parts of one try, at most (one per image): a try's part numbers start apart


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


class Encoding:
    """The images of prefill's requests: cached, or encoded by the encoders `router` reaches."""

    def __init__(
        self,
        config: PrefillConfig,
        engine: PrefillEngine,
        router: Router,
        metrics: PrefillMetrics,
    ) -> None:
        self.config, self.engine, self.router, self.metrics = config, engine, router, metrics
        self.images = ImageCache(config.image_cache_bytes)

    async def embed(self, request: PreparedRequest) -> Images | None:
        """Every image's embeddings, in prompt order: from the cache, or from the encoders."""
        if not request.images:
            return None
        self.check_room(request.images, request.grids, request.cache_salt)  # before hashing
        # Hashing large files takes time; salted keys keep one tenant's encodes its own.
        keys = await asyncio.to_thread(image_digests, request.images, request.cache_salt)
        rows = {
            i: found for i, key in enumerate(keys) if (found := self.images.get(key)) is not None
        }
        missing = [i for i in range(len(request.images)) if i not in rows]
        self.metrics.images.inc(len(keys))
        self.metrics.image_cache_hits.inc(len(rows))
        if missing:
            payloads, lm = await self.encode_moving_on(request, missing), self.engine.lm
            encoded = check_payloads(
                request, missing, payloads, lm.config.hidden_size, lm.lm_head.weight.dtype
            )
            for index, image_rows in zip(missing, encoded, strict=True):
                size = len(request.images[index])
                self.images.put(keys[index], image_rows, size, request.cache_salt)
                rows[index] = image_rows
        return Images(torch.cat([rows[i] for i in range(len(request.images))]), tuple(keys))

    async def encode_moving_on(
        self, request: PreparedRequest, indices: list[int]
    ) -> list[ImageEmbeddings]:
        """`encode_images`, again on the encoders left where one holding some of them dies, up
        to `migration_limit` times (each try's parts numbered apart from the last's, so that a
        late reply of the lost encoder answers nothing)."""
        for attempt in itertools.count():
            try:
                return await self.encode_images(request, indices, attempt)
            except EncoderLost as lost:
                if attempt >= self.config.migration_limit:
                    self.metrics.migrations.labels("encode", "failed").inc()
                    raise
                log.warning("%s: %s; encoding its images again", request.request_id, lost)
                self.metrics.migrations.labels("encode", "resumed").inc()
        raise AssertionError("unreachable")

    async def encode_images(
        self, request: PreparedRequest, indices: list[int], attempt: int = 0
    ) -> list[ImageEmbeddings]:
        """The embeddings of the images at `indices`, split over the live encoders (as parts
        numbered from `attempt` × MAX_PARTS)."""
        router = self.router
        live = await router.pick(router.encoders, "encode")
        encoders = router.load.quickest(live, patches(request.grids, indices))
        parts = self.parts(request.grids, indices, encoders)
        self.admit(parts)
        waits, first = [], attempt * MAX_PARTS
        for number, part in enumerate(parts, first):
            future = router.expect(request.request_id, number, part.encoder)
            waits.append(future)
            files = tuple(request.images[i] for i in part.indices)
            message = EncodeRequest(
                request.request_id,
                number,
                files,
                tuple(part.indices),
                self.config.reply_address,
            )
            if router.outbox.send(part.encoder, message):  # counted once it is on its way
                router.load.sending((request.request_id, number), part.encoder, part.patches)
            else:
                future.set_exception(Unavailable(f"encode server {part.encoder} is not reachable"))
        start = time.perf_counter()
        try:
            replies = await self.until_encoded(request.request_id, waits)
            self.metrics.encode_wait.observe(time.perf_counter() - start)
            self.metrics.embedding_bytes.inc(sum(r.embeddings.nbytes for r in replies))
            return replies
        finally:
            router.forget(request.request_id, first + len(parts))

    def parts(self, grids: Sequence[Grid], indices: list[int], encoders: list[str]) -> list[Part]:
        """The images at `indices` split over `encoders`, each part with its patches (from the
        grids that the images' headers gave, before any pixel is decoded)."""
        groups = [indices[start:stop] for start, stop in split(len(indices), len(encoders))]
        return [
            Part(group, encoder, patches(grids, group))
            for group, encoder in zip(groups, encoders, strict=False)
        ]

    def check_room(
        self, images: Sequence[bytes], grids: Sequence[Grid], salt: str | None = None
    ) -> None:
        """Raise Overloaded, before the images are hashed, if those surely not cached (of a
        file size no cached image has) would not be encoded in time; which of the others are
        cached, and cost no encode, the hashes tell. The API asks as soon as it has the files,
        before it builds the prompt round them. The images are judged on the encoders a send
        now would give them to: the quickest (`EncodeLoad.quickest`)."""
        router, cache = self.router, self.images
        new = [i for i, data in enumerate(images) if not cache.may_hold(len(data), salt)]
        up = [a for a in router.encoders.current if router.outbox.is_up(a)]
        live = router.load.quickest(up, patches(grids, new))
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


def patches(grids: Sequence[Grid], indices: Sequence[int]) -> int:
    """The vision tower's patches of the images at `indices`."""
    return sum(h * w for h, w in (grids[i] for i in indices))


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
