"""`epd prefill`: the API, the prompt builder and the prefill engine in one process."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from functools import partial
from types import FrameType

import uvicorn

from epd.api.app import Service, create_app
from epd.api.prepare import PromptBuilder
from epd.checkpoint.identity import checkpoint_digest
from epd.checkpoint.progress import phase
from epd.checkpoint.tokenizer import load_tokenizer, stop_token_ids
from epd.checkpoint.weights import load_model
from epd.config.roles import PrefillConfig
from epd.dtypes import model_dtype
from epd.generation.reasoning import prepare
from epd.kv.events import kv_events_endpoints
from epd.model.mla import bottom_right_causal
from epd.prefill.engine import PrefillEngine
from epd.prefill.errors import Unavailable
from epd.prefill.kv import prefill_pool
from epd.runtime.health import HTTP_PROTOCOL
from epd.runtime.process import (
    STOP_GRACE_S,
    announce_ready,
    on_passing_thread,
    set_torch_threads,
    start_process,
)
from epd.runtime.watchdog import Watchdog
from epd.wire.curve import process_keys

log = logging.getLogger(__name__)

# The main loop, the wire, and the prefill forward (its thread runs apart from the loop).
PREFILL_ACTIVITIES = ("loop", "wire", "prefill")
ENDING_S = 2.0  # for requests ended at the drain's end to send their error and finish


def build_service(config: PrefillConfig) -> Service:
    process_keys(config.zmq_curve_keys)  # missing keys fail before the model loads
    tokenizer = load_tokenizer(config.model, config.trust_remote_code, config.chat_template)
    builder = PromptBuilder.from_checkpoint(
        config.model,
        tokenizer,
        config.default_max_tokens,
        config.max_image_pixels,
        config.max_n,
        config.reasoning_parser,
        config.max_model_len,
        config.generation_config,
        config.seed,
        config.override_generation_config,
    )
    if builder.reasoning:
        log.info("reasoning parser: %s ... %s", builder.reasoning.start, builder.reasoning.end)
    # On a thread that ends, so that the forward's thread keeps the only OpenMP pool.
    lm = on_passing_thread(
        load_model,
        config.model,
        "language",
        config.device,
        model_dtype(config.dtype),
        config.cpu_weight_copies,
    ).language_model
    eos_ids = stop_token_ids(config.model, tokenizer)
    kv, checkpoint = prefill_pool(config, lm), checkpoint_digest(config.model)
    engine = PrefillEngine(lm, tokenizer, builder.placeholder_id, eos_ids, kv, checkpoint)
    with phase("warming up: the grammar tables and the attention over a past", "warmed up"):
        prepare(engine.grammars)  # built now (or found unavailable), not at the first grammar
        bottom_right_causal()  # imported now, not at the first prompt after its cached blocks
    return Service(
        config, config.model_name, builder, engine, Watchdog(config.watchdog_s, PREFILL_ACTIVITIES)
    )


class DrainingServer(uvicorn.Server):
    """uvicorn, with a drain before its graceful shutdown.

    On the first SIGTERM or SIGINT new API requests get 503 (and /health 503, so a load
    balancer turns away) while the requests in flight finish, for up to `drain_timeout_s`;
    those still in flight then end with a 503 (a stream's error event, then [DONE]), and uvicorn
    shuts down as usual. A second signal ends them at once, a third is uvicorn's own.
    """

    def __init__(
        self, config: uvicorn.Config, service: Service, stop: threading.Event | None = None
    ) -> None:
        super().__init__(config)
        self.service = service
        self.stop = stop or threading.Event()  # the process's own stop event (`start_process`)
        self.hurried = threading.Event()  # asked again: the drain ends now

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()  # requests are ended on it (`drain`)
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's start; then, if a stop signal came before uvicorn took the signals (it
        went to the process's own handler, which set `stop` and started the exit timer), the
        drain begins at once rather than serve until that timer kills the process."""
        await super().startup(sockets)
        if self.stop.is_set() and not self.service.gate.draining:
            self.handle_exit(signal.SIGTERM, None)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        gate = self.service.gate
        if self.hurried.is_set():
            super().handle_exit(sig, frame)
        elif gate.draining:
            self.hurried.set()
        else:
            gate.draining = True
            self._captured_signals.append(sig)  # re-raised to our own handler once uvicorn is done
            log.info("draining: %d requests in flight, new ones get 503", gate.in_flight)
            threading.Thread(target=self.drain, name="drain", daemon=True).start()

    def drain(self) -> None:
        gate, limit = self.service.gate, self.service.config.drain_timeout_s
        self.wait_while_in_flight(limit, unless=self.hurried)
        if gate.in_flight:
            why = "when asked again to stop" if self.hurried.is_set() else f"after {limit}s"
            message = "drain: %d requests still in flight %s: each ends with an error"
            log.warning(message, gate.in_flight, why)
            self.loop.call_soon_threadsafe(end_requests, self.service)
            self.wait_while_in_flight(ENDING_S, unless=threading.Event())
        self.should_exit = True

    def wait_while_in_flight(self, seconds: float, unless: threading.Event) -> None:
        """Until no request is in flight, `seconds` pass or `unless` is set."""
        deadline = time.monotonic() + seconds
        while self.service.gate.in_flight and time.monotonic() < deadline:
            if unless.wait(0.05):
                return


def end_requests(service: Service) -> None:
    """Every request still in flight fails now, wherever it is, those still sending their body
    too; each step apart, so that one that fails leaves the others to run (it is logged)."""
    error = Unavailable("the server stopped before this request finished")
    steps: list[Callable[[], None]] = [lambda: service.reading.end_all(str(error))]
    if service.coordinator is not None:
        steps.insert(0, partial(service.coordinator.end_all, error))  # streams first
    for step in steps:
        try:
            step()
        except Exception:  # e.g. a bug in one: the rest must still end their requests
            log.exception("ending the requests in flight: a step failed")


def run(config: PrefillConfig) -> None:
    stop = start_process("prefill", config)
    service = build_service(config)
    if stop.is_set():  # asked to stop while the model loaded
        return
    # The loop's own torch work is small (joining image rows): on one thread it starts no
    # OpenMP pool beside the forward's (`on_passing_thread` says why that matters). The
    # forward's thread sets its own count (`PrefillBatcher`).
    set_torch_threads(1)
    service.watchdog.start()  # once the model is loaded: that takes time
    server: uvicorn.Server

    async def announce() -> None:
        while not server.started:
            await asyncio.sleep(0.05)
        if service.gate.draining:  # stopping already (`DrainingServer.startup`): not ready
            return
        api = f"http://{config.host}:{config.port}/v1"
        health = f"http://{config.host}:{config.port}/health"
        events = kv_events_endpoints(service.engine.kv.blocks.events)
        announce_ready("prefill", api=api, zmq=config.bind, health=health, **events)

    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler
    # found before it started (ours, from start_process), so a requested stop exits with 0.
    app = create_app(service, on_started=announce)
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_config=None,  # uvicorn's lines go through our handler, in our format
            access_log=config.access_log,
            log_level=config.uvicorn_log_level or None,  # None: as setup_logging set it
            timeout_graceful_shutdown=int(STOP_GRACE_S / 2),  # then open streams are cut
            http=HTTP_PROTOCOL,
        ),
        service,
        stop,
    )
    server.run()
