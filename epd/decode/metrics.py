"""What the decode process measures."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from epd.runtime.metrics import BATCH_BUCKETS, LATENCY_BUCKETS


class DecodeMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.batch_size = Histogram(
            "epd:decode_batch_size",
            "Sequences advanced by one decode step.",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.step_seconds = Histogram(
            "epd:decode_step_seconds",
            "Time of one decode step.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.handoff_bytes = Counter(
            "epd:kv_handoff_bytes_received", "Bytes of KV caches taken from prefills.", registry=r
        )
        self.running = Gauge(
            "epd:num_sequences_running", "Sequences (choices) being decoded.", registry=r
        )
        self.waiting = Gauge(
            "epd:num_sequences_waiting", "Sequences waiting for room in the batch.", registry=r
        )
