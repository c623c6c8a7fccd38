"""The life of an encode or decode process: one loop, watched, behind GET /health.

The role builds its server (loading the model takes minutes for a real checkpoint, so the
watchdog starts after it); the runtime then serves /health, prints the ready line and steps the
server until asked to stop, then drains (see `run_role`). A step that raises is logged and the
loop goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

import zmq
from prometheus_client import CollectorRegistry

from epd.runtime.health import DRAINING, HealthServer, health_router
from epd.runtime.metrics import metrics_router
from epd.runtime.process import STOP_GRACE_S, ProcessOptions, announce_ready, start_process
from epd.runtime.watchdog import Watchdog
from epd.wire.transport import WireProbe

log = logging.getLogger(__name__)


class RoleConfig(ProcessOptions, Protocol):
    @property
    def bind(self) -> str: ...
    @property
    def health_host(self) -> str: ...
    @property
    def health_port(self) -> int: ...
    @property
    def watchdog_s(self) -> float: ...


class RoleServer(Protocol):
    def step(self) -> None:
        """Do one round of work; return within a moment when there is none."""

    def status(self) -> dict[str, object]:
        """What GET /health adds to its body."""

    def close(self) -> None:
        """Stop: end the requests still held, close sockets."""

    def stop_taking(self) -> None:
        """A stop was asked for: refuse new work from now on (the drain)."""

    def holding(self) -> bool:
        """Whether work taken before the stop is still under way (the drain waits for it)."""

    @property
    def registry(self) -> CollectorRegistry:
        """Its metrics, served at GET /metrics beside /health."""

    def endpoints(self) -> dict[str, str]:
        """What its ready line names besides its socket and /health (e.g. its KV events)."""


def run_step(name: str, server: RoleServer, watchdog: Watchdog) -> None:
    watchdog.beat("loop")
    try:
        server.step()
    except Exception:  # a bug in one step must not end the server
        log.exception("a %s step failed", name)


def probe_wire(watchdog: Watchdog) -> WireProbe:
    """Beat the watchdog's "wire" on each round trip through this process's ZeroMQ I/O."""
    return WireProbe(zmq.Context.instance(), lambda: watchdog.beat("wire"))


def run_role(
    name: str, config: RoleConfig, build: Callable[[Watchdog], RoleServer], drain_s: float = 0.0
) -> None:
    """Run role `name`: `build(watchdog)` makes its server (and may beat the watchdog). On a
    stop request it drains: new work is refused while what it holds goes on, for up to
    `drain_s`; then it closes."""
    stop = start_process(name, config, grace_s=STOP_GRACE_S + drain_s)
    watchdog = Watchdog(config.watchdog_s)
    server = build(watchdog)
    watchdog.start()
    probe = probe_wire(watchdog)

    refusing = threading.Event()  # set once the server refuses new work, not at the signal:
    # the step under way when it came may still take some, and health must not say otherwise

    def draining() -> list[str]:
        return [DRAINING] if refusing.is_set() else []

    router = health_router(name, watchdog, server.status, draining)
    router.include_router(metrics_router(server.registry))
    health = HealthServer(router, config.health_host, config.health_port)
    announce_ready(name, zmq=config.bind, health=health.url, **server.endpoints())
    try:
        while not stop.is_set():
            run_step(name, server, watchdog)
        server.stop_taking()
        refusing.set()
        deadline = time.monotonic() + drain_s
        if server.holding():
            log.info("draining: finishing the work under way for up to %ss", drain_s)
        while server.holding() and time.monotonic() < deadline:
            run_step(name, server, watchdog)
    finally:
        watchdog.close()  # stopping is not stalling
        try:
            server.close()
        finally:
            health.close()
            probe.close()
