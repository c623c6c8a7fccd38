"""`epd encode`: receive EncodeRequests, answer each with ImageEmbeddings or a Failure."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import torch
import zmq

from epd.checkpoint.config import load_processor_config
from epd.checkpoint.weights import load_model
from epd.config.roles import EncodeConfig
from epd.dtypes import model_dtype
from epd.encode.encoder import Encoder, Prepared
from epd.encode.metrics import EncodeMetrics
from epd.multimodal.image_processor import ImageProcessor
from epd.multimodal.images import ImageError
from epd.runtime.idle import OthersIdle
from epd.runtime.process import use_torch_threads
from epd.runtime.role import run_role
from epd.runtime.watchdog import Watchdog
from epd.wire.addresses import Prefills
from epd.wire.codec import HEADER_BYTES
from epd.wire.curve import process_keys
from epd.wire.limits import cut
from epd.wire.messages import EncodeRequest, Failure, ImageEmbeddings
from epd.wire.outbox import Outbox
from epd.wire.transport import Inbox

log = logging.getLogger(__name__)
GPU_BATCH_PATCHES = 16384  # four images at Kimi-VL's largest (in_token_limit 4096 patches)


def failure(request: EncodeRequest, error: Exception) -> Failure:
    """Why a request has no embeddings, for its prefill; the server goes on."""
    if isinstance(error, ImageError):
        return Failure(request.request_id, "bad_image", cut(str(error)))
    log.error("encoding %s failed", request.request_id, exc_info=error)
    why = cut(f"encode failed: {type(error).__name__}: {error}")
    return Failure(request.request_id, "internal", why)


def prepare(
    encoder: Encoder, request: EncodeRequest, progress: Callable[[], None] = lambda: None
) -> Prepared | Failure:
    """The request's images decoded and preprocessed, or why they cannot be."""
    try:
        return encoder.prepare(request.images, request.image_indices, progress)
    except Exception as e:
        return failure(request, e)


def encode_prepared(
    encoder: Encoder, ready: list[tuple[EncodeRequest, Prepared]]
) -> list[ImageEmbeddings | Failure]:
    """Each request's reply, their images in one forward; if that fails, each request is
    tried alone, so one that breaks the batch fails alone."""
    try:
        rows = encoder.forward([prepared for _, prepared in ready])
    except Exception as e:
        if len(ready) == 1:
            return [failure(ready[0][0], e)]
        log.warning("a batch of %d encode requests failed; trying each alone", len(ready))
        return [encode_prepared(encoder, [one])[0] for one in ready]
    return [
        reply(request, prepared, embeddings)
        for (request, prepared), embeddings in zip(ready, rows, strict=True)
    ]


def reply(
    request: EncodeRequest, prepared: Prepared, embeddings: torch.Tensor
) -> ImageEmbeddings | Failure:
    """The request's embeddings (its tokens, hidden), or a Failure when the message refuses
    them (an overflow to inf or NaN in this request's images): its batch's others go on."""
    try:
        return ImageEmbeddings(request.request_id, request.part_index, prepared.grids, embeddings)
    except ValueError as e:
        return failure(request, e)


def handle(
    encoder: Encoder, request: EncodeRequest, progress: Callable[[], None] = lambda: None
) -> ImageEmbeddings | Failure:
    """Embeddings for one request's images, or a Failure saying why there are none."""
    prepared = prepare(encoder, request, progress)
    if isinstance(prepared, Failure):
        return prepared
    return encode_prepared(encoder, [(request, prepared)])[0]


class EncodeServer:
    def __init__(
        self,
        encoder: Encoder,
        inbox: Inbox,
        outbox: Outbox,
        config: EncodeConfig,
        prefills: Prefills,
        progress: Callable[[], None] = lambda: None,
    ) -> None:
        self.encoder, self.inbox, self.outbox, self.config = encoder, inbox, outbox, config
        self.prefills, self.progress = prefills, progress
        self.metrics = EncodeMetrics(config.model_name)
        self.registry = self.metrics.registry
        # On a CPU the vision tower is compute-bound already, and a batch holds back the first
        # request's prefill, which runs beside encode on other cores (docs/benchmarks.md,
        # "Batching images on a CPU"). A GPU gains from larger launches.
        gpu = encoder.device.type == "cuda"
        self.batch_patches = config.batch_patches or (GPU_BATCH_PATCHES if gpu else 1)
        self.others_idle = OthersIdle()  # sampled every step, idle ones included

    def over_limits(self, request: EncodeRequest) -> Failure | None:
        """A Failure for a request with more or larger images than this encoder takes."""
        most, largest = self.config.max_images, self.config.max_image_bytes
        if len(request.images) > most:
            message = f"{len(request.images)} images is over this encoder's limit of {most}"
            return Failure(request.request_id, "bad_request", message)
        for index, image in zip(request.image_indices, request.images, strict=True):
            if len(image) > largest:
                message = f"image {index}: larger than this encoder's limit of {largest} bytes"
                return Failure(request.request_id, "bad_image", message)
        return None

    def status(self) -> dict[str, object]:
        return {"refused_messages": self.inbox.refusals.total}

    def stop_taking(self) -> None:
        """Nothing to do: each request is answered within the step that takes it."""

    def holding(self) -> bool:
        return False

    def count(self, reply: ImageEmbeddings | Failure, seconds: float) -> None:
        if isinstance(reply, Failure):
            self.metrics.failures.inc()
            return
        self.metrics.encode_time.observe(seconds)
        self.metrics.images.inc(len(reply.grids))
        self.metrics.embedding_bytes.inc(reply.embeddings.nbytes)

    def close(self) -> None:
        self.inbox.close()
        self.outbox.close(linger_ms=500)  # replies already handed over get out

    def endpoints(self) -> dict[str, str]:
        return {}  # encode holds no KV

    def step(self) -> None:
        """Answer the requests that wait, if one comes within a moment: as many as are queued,
        up to `batch_patches` image patches, in one forward of the vision tower."""
        self.outbox.poll()
        message = self.inbox.recv(timeout_ms=10 if self.outbox.queued else 100)
        # Where the idle cores may be taken (a CPU under epd serve): were they idle in the last
        # window before these requests came (sampled every step, the idle ones too)?
        may_take = bool(self.config.alone_threads)
        idle = may_take and self.others_idle()
        start = time.perf_counter()
        ready: list[tuple[EncodeRequest, Prepared]] = []
        patches = 0
        while message is not None:
            if (request := self.admit(message)) is not None:
                prepared = prepare(self.encoder, request, self.progress)
                if isinstance(prepared, Failure):  # an image it cannot read: it fails alone
                    self.answer(request, prepared, 0.0)
                else:
                    ready.append((request, prepared))
                    patches += prepared.patches
            if patches >= self.batch_patches:
                break
            message = self.inbox.recv(timeout_ms=0)
        if not ready:
            return
        # A lone request: nothing waits behind it, and the others left their cores in the
        # last window, or their work has just ended (its prefill waits for these images).
        alone = may_take and not self.inbox.pending() and (idle or self.others_idle.now())
        self.use_threads(alone)
        replies = encode_prepared(self.encoder, ready)
        self.metrics.batch_size.observe(len(ready))
        for (request, _), reply in zip(ready, replies, strict=True):
            self.answer(request, reply, time.perf_counter() - start)

    def use_threads(self, alone: bool) -> None:
        """Every core for a forward while the machine's other processes leave theirs idle
        (`alone_threads`: a lone request's prefill waits for these images), this encoder's
        share otherwise."""
        config = self.config
        threads = config.alone_threads if alone and config.alone_threads else config.threads
        use_torch_threads(threads)

    def admit(self, message: object) -> EncodeRequest | None:
        """The message, if it is a request this encoder takes; a Failure goes back at once for
        one over its limits."""
        if not isinstance(message, EncodeRequest):
            self.inbox.refusals.log(f"a {type(message).__name__}: encode only takes EncodeRequest")
            return None
        if not self.prefills.allows(message.reply_to):
            self.inbox.refusals.log(
                f"{message.request_id}: {message.reply_to!r} is not a prefill of this encoder"
            )
            return None
        if (refusal := self.over_limits(message)) is not None:
            self.answer(message, refusal, 0.0)
            return None
        return message

    def answer(
        self, request: EncodeRequest, reply: ImageEmbeddings | Failure, seconds: float
    ) -> None:
        self.count(reply, seconds)
        if not self.outbox.send(request.reply_to, reply):
            log.warning(
                "dropped the reply to %s: %s unreachable", request.request_id, request.reply_to
            )


def run(config: EncodeConfig) -> None:
    def build(watchdog: Watchdog) -> EncodeServer:
        prefills = Prefills.parse(config.prefills)  # a bad pattern fails before the model loads
        keys = process_keys(config.zmq_curve_keys)  # so do missing keys
        model = load_model(
            config.model,
            "encode",
            config.device,
            model_dtype(config.dtype),
            config.cpu_weight_copies,
        )
        processor = ImageProcessor(load_processor_config(config.model))
        encoder = Encoder(model, processor, config.max_image_pixels)
        context: zmq.Context = zmq.Context.instance()
        largest = config.max_images * config.max_image_bytes + HEADER_BYTES  # files in a header
        inbox = Inbox(context, config.bind, largest, max_header_bytes=largest, curve=keys)
        beat = functools.partial(watchdog.beat, "loop")  # once per image: large ones take a while
        # The prefills named exactly stay connected: never closed as idle nor pushed out.
        outbox = Outbox(context, prefills.exact, curve=keys)
        return EncodeServer(encoder, inbox, outbox, config, prefills, beat)

    run_role("encode", config, build)
