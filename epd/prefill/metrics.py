"""What the prefill process measures (it fronts every request, so the request-level metrics
are here), named as vLLM names them under `epd:`, plus what only EPD has."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from epd.runtime.metrics import LATENCY_BUCKETS


class PrefillMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()

        def seconds(name: str, about: str) -> Histogram:
            return Histogram(f"epd:{name}", about, buckets=LATENCY_BUCKETS, registry=r)

        # Requests, as vLLM names them.
        self.ttft = seconds("time_to_first_token_seconds", "Arrival to the first token sent.")
        self.itl = seconds("inter_token_latency_seconds", "Time between a choice's deltas.")
        self.e2e = seconds("e2e_request_latency_seconds", "Arrival to the last token sent.")
        self.queue_time = seconds(
            "request_queue_time_seconds", "Time a prompt waited for a prefill forward."
        )
        self.prompt_tokens = Counter(
            "epd:prompt_tokens", "Prompt tokens prefilled (image tokens included).", registry=r
        )
        self.generation_tokens = Counter(
            "epd:generation_tokens", "Tokens generated, every choice counted.", registry=r
        )
        self.success = Counter(
            "epd:request_success",
            "Requests answered in full, by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        self.failure = Counter(
            "epd:request_failure",
            "Requests that ended in an error, by status.",
            ["status"],
            registry=r,
        )
        self.running = Gauge(
            "epd:num_requests_running", "Requests handed to decode, not ended.", registry=r
        )
        self.waiting = Gauge(
            "epd:num_requests_waiting",
            "Requests fetching images, encoding or waiting for "
            "prefill (bounded by max_queued_requests).",
            registry=r,
        )
        self.refused = Counter(
            "epd:requests_refused",
            "Requests refused with 503 at once, by reason (overloaded, draining).",
            ["reason"],
            registry=r,
        )
        # What only EPD has.
        self.images = Counter("epd:images", "Images in requests.", registry=r)
        self.image_cache_hits = Counter(
            "epd:image_cache_hits", "Images whose embeddings came from the cache.", registry=r
        )
        self.encode_wait = seconds(
            "encode_wait_seconds", "From sending images to encode until their embeddings came."
        )
        self.embedding_bytes = Counter(
            "epd:embedding_bytes_received", "Bytes of image embeddings from encoders.", registry=r
        )
        self.handoff_bytes = Counter(
            "epd:kv_handoff_bytes", "Bytes of KV caches handed to decoders.", registry=r
        )
        self.handoff_seconds = seconds(
            "kv_handoff_seconds",
            "From handing a KV cache to a decoder until its first delta came back "
            "(transfer, admission and one decode step).",
        )
        self.peer_up = Gauge(
            "epd:peer_up",
            "1 while a peer answers (heartbeats), else 0.",
            ["role", "address"],
            registry=r,
        )

    def watch_peer(self, role: str, address: str, is_up: Callable[[str], bool]) -> None:
        """Report a peer's state whenever the metrics are read."""
        self.peer_up.labels(role, address).set_function(lambda: float(is_up(address)))

    def forget_peer(self, role: str, address: str) -> None:
        """A peer no longer used (its service stopped listing it)."""
        self.peer_up.remove(role, address)
