"""What the encode process measures."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from epd.runtime.metrics import BATCH_BUCKETS, LATENCY_BUCKETS


class EncodeMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.images = Counter("epd:encode_images", "Images encoded.", registry=r)
        self.seconds = Histogram(
            "epd:encode_seconds",
            "Time to encode a batch of request parts (decode, preprocess, vision tower, "
            "projector), observed once per request in it.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.embedding_bytes = Counter(
            "epd:embedding_bytes_sent", "Bytes of image embeddings sent to prefills.", registry=r
        )
        self.batch_size = Histogram(
            "epd:encode_batch_size",
            "Encode requests in one forward.",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.failures = Counter(
            "epd:encode_failures", "Encode requests answered with a Failure.", registry=r
        )
