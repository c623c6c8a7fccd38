"""The life of an encode or decode process: one loop, watched, behind GET /health.

The role builds its server (loading the model takes minutes for a real checkpoint, so the
watchdog starts after it); the runtime then serves /health, prints the ready line and steps the
server until asked to stop. A step that raises is logged and the loop goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import zmq
from prometheus_client import CollectorRegistry

from epd.runtime.health import HealthServer, health_router
from epd.runtime.metrics import metrics_router
from epd.runtime.process import ProcessOptions, announce_ready, start_process
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

    @property
    def registry(self) -> CollectorRegistry:
        """Its metrics, served at GET /metrics beside /health."""


def probe_wire(watchdog: Watchdog) -> WireProbe:
    """Beat the watchdog's "wire" on each round trip through this process's ZeroMQ I/O."""
    return WireProbe(zmq.Context.instance(), lambda: watchdog.beat("wire"))


def run_role(name: str, config: RoleConfig, build: Callable[[Watchdog], RoleServer]) -> None:
    """Run role `name`: `build(watchdog)` makes its server (and may beat the watchdog)."""
    stop = start_process(name, config)
    watchdog = Watchdog(config.watchdog_s)
    server = build(watchdog)
    watchdog.start()
    probe = probe_wire(watchdog)
    router = health_router(name, watchdog, server.status)
    router.include_router(metrics_router(server.registry))
    health = HealthServer(router, config.health_host, config.health_port)
    announce_ready(name, zmq=config.bind, health=health.url)
    try:
        while not stop.is_set():
            watchdog.beat("loop")
            try:
                server.step()
            except Exception:  # a bug in one step must not end the server
                log.exception("a %s step failed", name)
    finally:
        watchdog.close()  # stopping is not stalling
        try:
            server.close()
        finally:
            health.close()
            probe.close()
