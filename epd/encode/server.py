"""`epd encode`: receive EncodeRequests, answer each with ImageEmbeddings or a Failure."""

from __future__ import annotations

import logging

import zmq

from epd.checkpoint.config import load_processor_config
from epd.checkpoint.weights import load_model
from epd.config.roles import EncodeConfig
from epd.dtypes import model_dtype
from epd.encode.encoder import Encoder
from epd.multimodal.image_processor import ImageProcessor
from epd.multimodal.images import ImageError
from epd.process import HealthServer, announce_ready, setup_logging, stop_event
from epd.wire.messages import EncodeRequest, Failure, ImageEmbeddings
from epd.wire.transport import Inbox, Outbox

log = logging.getLogger(__name__)
REPLY_CONNECT_MS = 2000


def handle(encoder: Encoder, request: EncodeRequest) -> ImageEmbeddings | Failure:
    try:
        grids, embeddings = encoder.encode(request.images, request.first_image)
    except ImageError as e:
        return Failure(request.request_id, "bad_image", str(e))
    except Exception as e:  # the request fails, the server goes on: prefill hears why
        log.exception("encoding %s failed", request.request_id)
        return Failure(request.request_id, "internal", f"encode failed: {type(e).__name__}: {e}")
    return ImageEmbeddings(request.request_id, request.part_index, grids, embeddings)


def run(config: EncodeConfig) -> None:
    setup_logging("encode")
    stop = stop_event()
    model = load_model(config.model, "encode", config.device, model_dtype(config.dtype))
    processor = ImageProcessor(load_processor_config(config.model))
    encoder = Encoder(model, processor, config.max_image_pixels)
    context: zmq.Context = zmq.Context.instance()
    inbox, outbox = Inbox(context, config.bind), Outbox(context)
    health = HealthServer("encode", config.health_host, config.health_port)
    announce_ready("encode", zmq=config.bind, health=health.url)
    try:
        while not stop.is_set():
            request = inbox.recv(timeout_ms=100)
            if request is None:
                continue
            if not isinstance(request, EncodeRequest):
                log.error("ignored a %s: encode only takes EncodeRequest", type(request).__name__)
                continue
            reply = handle(encoder, request)
            if not outbox.send(request.reply_to, reply, wait_ms=REPLY_CONNECT_MS):
                log.warning(
                    "dropped the reply to %s: %s unreachable", request.request_id, request.reply_to
                )
    finally:
        health.close()
        inbox.close()
        outbox.close()
