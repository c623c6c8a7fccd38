"""Prometheus metrics: what every role shares (buckets, the GET /metrics route).

Each role keeps its metrics in a registry of its own (`epd.prefill.metrics`,
`epd.encode.metrics`, `epd.decode.metrics`), so a process exposes what it measures and nothing
else, and servers built side by side in one test process do not share counts. Names follow
vLLM's under an `epd:` prefix; a Counter named `epd:x` is exposed as `epd:x_total`. Every series
carries vLLM's `model_name` label, the model the process serves, so that dashboards written for
vLLM, which filter on it, find epd's too.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from fastapi import APIRouter, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import Metric

# Seconds: from a fast GPU step to a queued request on a busy CPU.
LATENCY_BUCKETS = (
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Tokens of one request, vLLM's 1-2-5 steps: from a one-token reply to a million-token prompt.
TOKEN_BUCKETS = (*(m * 10**e for e in range(6) for m in (1, 2, 5)), 10**6)


class Labelled:
    """Another registry's samples, each with `labels` added (a Prometheus collector)."""

    def __init__(self, source: CollectorRegistry, labels: dict[str, str]) -> None:
        self.source, self.labels = source, labels

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [
                sample._replace(labels={**self.labels, **sample.labels})
                for sample in family.samples
            ]
            yield labelled


class RoleMetrics:
    """A role's metrics in a registry of its own; names get the `epd:` prefix here.

    `registry` is what GET /metrics serves: every series labelled `model_name`. The metrics
    themselves are made without it (in `unlabelled`), so that no call site has to name it."""

    def __init__(self, model_name: str) -> None:
        self.unlabelled = CollectorRegistry()
        self.registry = CollectorRegistry()
        self.registry.register(Labelled(self.unlabelled, {"model_name": model_name}))

    def counter(self, name: str, about: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(f"epd:{name}", about, labels, registry=self.unlabelled)

    def gauge(self, name: str, about: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(f"epd:{name}", about, labels, registry=self.unlabelled)

    def histogram(self, name: str, about: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(f"epd:{name}", about, buckets=buckets, registry=self.unlabelled)

    def seconds(self, name: str, about: str) -> Histogram:
        return self.histogram(name, about, LATENCY_BUCKETS)

    def sizes(self, name: str, about: str) -> Histogram:
        return self.histogram(name, about, BATCH_BUCKETS)

    def tokens(self, name: str, about: str) -> Histogram:
        return self.histogram(name, about, TOKEN_BUCKETS)


def metrics_router(registry: CollectorRegistry) -> APIRouter:
    """GET /metrics: the registry in Prometheus' text format (open, like /health)."""
    router = APIRouter()

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return router
