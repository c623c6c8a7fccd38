"""The `epd route` process: the checkpoint's tokenizer and prompt rules (no weights, no torch),
the prefills it routes to, their KV events, and the app under uvicorn."""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from epd.api.middleware import api_key
from epd.api.prepare import PromptBuilder
from epd.checkpoint.tokenizer import load_tokenizer
from epd.config.roles import RouteConfig
from epd.kv.index import BlockIndex
from epd.kv.listener import KVEventListener
from epd.route.app import Router, create_app
from epd.route.metrics import RouterMetrics
from epd.route.prefills import PrefillSet
from epd.route.prompts import PromptNamer
from epd.runtime.health import HTTP_PROTOCOL
from epd.runtime.process import (
    STOP_GRACE_S,
    announce_ready,
    follow_supervisor,
    raise_file_limit,
    setup_logging,
    stop_event,
)

log = logging.getLogger(__name__)


def build_router(config: RouteConfig) -> tuple[Router, KVEventListener | None]:
    tokenizer = load_tokenizer(config.model, config.trust_remote_code, config.chat_template)
    builder = PromptBuilder.from_checkpoint(
        config.model, tokenizer, default_max_tokens=1, max_model_len=config.max_model_len
    )
    index = BlockIndex()
    prefills = PrefillSet(config.prefill_urls, index, api_key(config.api_key))
    events = None
    if config.kv_events_bind:
        events = KVEventListener(index, config.kv_events_bind, prefills.owner)
    namer = PromptNamer(builder, config.max_image_bytes)
    return Router(config, namer, prefills, index, RouterMetrics(config.model_name)), events


def run(config: RouteConfig) -> None:
    setup_logging("router", config.log_level, config.log_format)
    stop_event(STOP_GRACE_S)  # uvicorn takes the signals once it runs; before, this exits
    follow_supervisor()
    raise_file_limit()
    router, events = build_router(config)
    server: uvicorn.Server

    async def announce() -> None:
        while not server.started:
            await asyncio.sleep(0.05)
        api = f"http://{config.host}:{config.port}/v1"
        endpoints = {"kv_events": config.kv_events_bind} if events is not None else {}
        announce_ready("route", api=api, prefills=" ".join(config.prefill_urls), **endpoints)

    server = uvicorn.Server(
        uvicorn.Config(
            create_app(router, on_started=announce),
            host=config.host,
            port=config.port,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=int(STOP_GRACE_S / 2),
            http=HTTP_PROTOCOL,
        )
    )
    try:
        server.run()
    finally:
        if events is not None:
            events.close()
