"""Prometheus metrics: what every role shares (buckets, the GET /metrics route).

Each role keeps its metrics in a registry of its own (`epd.prefill.metrics`,
`epd.encode.metrics`, `epd.decode.metrics`), so a process exposes what it measures and nothing
else, and servers built side by side in one test process do not share counts. Names follow
vLLM's under an `epd:` prefix; a Counter named `epd:x` is exposed as `epd:x_total`.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import APIRouter, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

# Seconds: from a fast GPU step to a queued request on a busy CPU.
LATENCY_BUCKETS = (
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class RoleMetrics:
    """A role's metrics in a registry of its own; names get the `epd:` prefix here."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

    def counter(self, name: str, about: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(f"epd:{name}", about, labels, registry=self.registry)

    def gauge(self, name: str, about: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(f"epd:{name}", about, labels, registry=self.registry)

    def seconds(self, name: str, about: str) -> Histogram:
        return Histogram(f"epd:{name}", about, buckets=LATENCY_BUCKETS, registry=self.registry)

    def sizes(self, name: str, about: str) -> Histogram:
        return Histogram(f"epd:{name}", about, buckets=BATCH_BUCKETS, registry=self.registry)


def metrics_router(registry: CollectorRegistry) -> APIRouter:
    """GET /metrics: the registry in Prometheus' text format (open, like /health)."""
    router = APIRouter()

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return router
