"""`epd encode`: receive EncodeRequests, answer each with ImageEmbeddings or a Failure."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import zmq

from epd.checkpoint.config import load_processor_config
from epd.checkpoint.weights import load_model
from epd.config.roles import EncodeConfig
from epd.dtypes import model_dtype
from epd.encode.encoder import Encoder
from epd.encode.metrics import EncodeMetrics
from epd.multimodal.image_processor import ImageProcessor
from epd.multimodal.images import ImageError
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


def handle(
    encoder: Encoder, request: EncodeRequest, progress: Callable[[], None] = lambda: None
) -> ImageEmbeddings | Failure:
    """Embeddings for the request's images, or a Failure saying why there are none."""
    try:
        grids, embeddings = encoder.encode(request.images, request.image_indices, progress)
        return ImageEmbeddings(request.request_id, request.part_index, grids, embeddings)
    except ImageError as e:
        return Failure(request.request_id, "bad_image", cut(str(e)))
    except Exception as e:  # the request fails, the server goes on: prefill hears why
        log.exception("encoding %s failed", request.request_id)
        why = cut(f"encode failed: {type(e).__name__}: {e}")
        return Failure(request.request_id, "internal", why)


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
        self.metrics = EncodeMetrics()
        self.registry = self.metrics.registry

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
        self.metrics.seconds.observe(seconds)
        self.metrics.images.inc(len(reply.grids))
        self.metrics.embedding_bytes.inc(reply.embeddings.nbytes)

    def close(self) -> None:
        self.inbox.close()
        self.outbox.close(linger_ms=500)  # replies already handed over get out

    def step(self) -> None:
        """Answer one request, if one comes within a moment."""
        self.outbox.poll()
        request = self.inbox.recv(timeout_ms=10 if self.outbox.queued else 100)
        if request is None:
            return
        if not isinstance(request, EncodeRequest):
            log.error("ignored a %s: encode only takes EncodeRequest", type(request).__name__)
        elif not self.prefills.allows(request.reply_to):
            log.error(
                "refused %s: %r is not a prefill of this encoder",
                request.request_id,
                request.reply_to,
            )
        else:
            start = time.perf_counter()
            reply = self.over_limits(request) or handle(self.encoder, request, self.progress)
            self.count(reply, time.perf_counter() - start)
            if not self.outbox.send(request.reply_to, reply):
                log.warning(
                    "dropped the reply to %s: %s unreachable", request.request_id, request.reply_to
                )


def run(config: EncodeConfig) -> None:
    def build(watchdog: Watchdog) -> EncodeServer:
        prefills = Prefills.parse(config.prefills)  # a bad pattern fails before the model loads
        keys = process_keys(config.zmq_curve_keys)  # so do missing keys
        model = load_model(config.model, "encode", config.device, model_dtype(config.dtype))
        processor = ImageProcessor(load_processor_config(config.model))
        encoder = Encoder(model, processor, config.max_image_pixels)
        context: zmq.Context = zmq.Context.instance()
        largest = config.max_images * config.max_image_bytes + HEADER_BYTES  # files in a header
        inbox = Inbox(context, config.bind, largest, max_header_bytes=largest, curve=keys)
        beat = functools.partial(watchdog.beat, "loop")  # once per image: large ones take a while
        outbox = Outbox(context, curve=keys)
        return EncodeServer(encoder, inbox, outbox, config, prefills, beat)

    run_role("encode", config, build)
