"""Prometheus metrics: what every role shares (buckets, the GET /metrics route).

Each role keeps its metrics in a registry of its own (`epd.prefill.metrics`,
`epd.encode.metrics`, `epd.decode.metrics`), so a process exposes what it measures and nothing
else, and servers built side by side in one test process do not share counts. Names follow
vLLM's under an `epd:` prefix; a Counter named `epd:x` is exposed as `epd:x_total`. Every series
carries vLLM's `model_name` label, the model the process serves, so that dashboards written for
vLLM, which filter on it, find epd's too, and a `role` label (encode, prefill, decode). As in
vLLM, no `_created` series.

Prefill's GET /metrics also serves the series of the peers it is told of (`peer_metrics`, set by
`epd serve` to its encoder's and decoder's), so one scrape target carries the whole stack: a
metric that two roles expose (`epd:kv_cache_usage_perc`) is one family with a series per role.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterable, Iterator, Sequence

import httpx
from fastapi import APIRouter, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)
disable_created_metrics()  # as vLLM: a `_created` series per counter and histogram, unplotted
PEER_TIMEOUT_S = 1.0  # a peer's metrics not back by then are left out of this scrape
FRESH_S = 1.0  # how long a scrape of the stack is served again

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

    `registry` is what GET /metrics serves: every series labelled `model_name` and `role`. The
    metrics themselves are made without them (in `unlabelled`), so that no call site names
    them."""

    role = ""  # each role's own class names it

    def __init__(self, model_name: str) -> None:
        self.unlabelled = CollectorRegistry()
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "role": self.role}
        self.registry.register(Labelled(self.unlabelled, labels))

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


def metrics_router(
    registry: CollectorRegistry, peers: Sequence[str] = (), timeout_s: float = PEER_TIMEOUT_S
) -> APIRouter:
    """GET /metrics: the registry in Prometheus' text format (open, like /health), and the
    series the `peers`' GET /metrics URLs give (`StackScrape`)."""
    router, stack = APIRouter(), StackScrape(registry, tuple(peers), timeout_s)

    @router.get("/metrics")
    async def metrics() -> Response:
        text = await stack.text() if peers else generate_latest(registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return router


class StackScrape:
    """A role's series, and its peers' as they last gave them, each peer within `timeout_s` (one
    that does not answer is left out: its series' absence says so, and the log once). The
    role's own are read at every scrape; the peers' texts are kept for `FRESH_S`, so a client
    that asks for /metrics in a loop costs the event loop one fetch from the peers a second,
    not one a request. The peers are on the loopback or named by the operator: no proxy of
    the environment is asked."""

    def __init__(self, registry: CollectorRegistry, peers: tuple[str, ...], timeout_s: float):
        self.registry, self.peers, self.timeout_s = registry, peers, timeout_s
        self.lock, self.fetched, self.texts = asyncio.Lock(), -math.inf, [""] * len(peers)
        self.silent: set[str] = set()  # peers whose last scrape failed (logged once)

    async def text(self) -> bytes:
        async with self.lock:
            if time.monotonic() - self.fetched > FRESH_S:
                self.texts, self.fetched = await self.fetch(), time.monotonic()
        # Parsed anew each time: merging adds samples to the families it is given.
        theirs = [family for text in self.texts for family in parsed(text)]
        return generate_latest(Families(merged([*self.registry.collect(), *theirs])))

    async def fetch(self) -> list[str]:
        async with httpx.AsyncClient(timeout=self.timeout_s, trust_env=False) as client:
            return await asyncio.gather(*(self.peer(client, url) for url in self.peers))

    async def peer(self, client: httpx.AsyncClient, url: str) -> str:
        """A peer's metrics in Prometheus' text format; "" where it does not answer so."""
        try:
            response = await client.get(url)
            response.raise_for_status()
            parsed(response.text)  # checked once here, where a failure can be told
        except (httpx.HTTPError, ValueError) as e:
            if url not in self.silent:
                log.warning("metrics of %s left out of /metrics: %s", url, e)
            self.silent.add(url)
            return ""
        self.silent.discard(url)
        return response.text


def parsed(text: str) -> list[Metric]:
    return list(text_string_to_metric_families(text))


def merged(families: Iterable[Metric]) -> list[Metric]:
    """One family per name, holding the samples of every family of that name and type (the
    same metric from several roles, told apart by their `role` label)."""
    by_name: dict[str, Metric] = {}
    for family in families:
        first = by_name.setdefault(family.name, family)
        if first is not family and first.type == family.type:
            first.samples += family.samples
    return list(by_name.values())


class Families:
    """Metric families already collected, as a collector `generate_latest` takes."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families
