"""What the prefill process measures (it fronts every request, so the request-level metrics
are here), named as vLLM names them under `epd:`, plus what only EPD has."""

from __future__ import annotations

from collections.abc import Callable

from epd.runtime.metrics import RoleMetrics


class PrefillMetrics(RoleMetrics):
    def __init__(self) -> None:
        super().__init__()
        seconds, counter, gauge = self.seconds, self.counter, self.gauge
        # Requests, as vLLM names them.
        self.ttft = seconds("time_to_first_token_seconds", "Arrival to the first token sent.")
        self.itl = seconds("inter_token_latency_seconds", "Time between a choice's deltas.")
        self.e2e = seconds("e2e_request_latency_seconds", "Arrival to the last token sent.")
        self.queue_time = seconds(
            "request_queue_time_seconds", "Time a prompt waited for a prefill forward."
        )
        self.prefill_time = seconds(
            "request_prefill_time_seconds",
            "From a prompt's first forward starting to its last ending (its chunks, packed with "
            "other prompts, and any forwards between them).",
        )
        self.prompt_tokens = counter(
            "prompt_tokens", "Prompt tokens prefilled (image tokens included)."
        )
        self.generation_tokens = counter(
            "generation_tokens", "Tokens generated, every choice counted."
        )
        self.success = counter(
            "request_success", "Requests answered in full, by finish reason.", ["finished_reason"]
        )
        self.failure = counter(
            "request_failure", "Requests that ended in an error, by status.", ["status"]
        )
        self.running = gauge("num_requests_running", "Requests handed to decode, not ended.")
        self.waiting = gauge(
            "num_requests_waiting",
            "Requests fetching images, encoding or waiting for prefill (bounded by "
            "max_queued_requests).",
        )
        self.refused = counter(
            "requests_refused",
            "Requests refused with 503 at once, by reason (overloaded, encode_backlog, draining).",
            ["reason"],
        )
        # What only EPD has.
        self.images = counter("images", "Images in requests.")
        self.image_cache_hits = counter(
            "image_cache_hits", "Images whose embeddings came from the cache."
        )
        self.encode_wait = seconds(
            "encode_wait_seconds", "From sending images to encode until their embeddings came."
        )
        self.embedding_bytes = counter(
            "embedding_bytes_received", "Bytes of image embeddings from encoders."
        )
        self.handoff_bytes = counter("kv_handoff_bytes", "Bytes of KV caches handed to decoders.")
        self.handoff_seconds = seconds(
            "kv_handoff_seconds",
            "From handing a KV cache to a decoder until its first delta came back: transfer, "
            "admission, any wait for a batch slot or KV blocks, and one decode step (the first "
            "token is prefill's own).",
        )
        self.peer_up = gauge(
            "peer_up", "1 while a peer answers (heartbeats), else 0.", ["role", "address"]
        )

    def watch_peer(self, role: str, address: str, is_up: Callable[[str], bool]) -> None:
        """Report a peer's state whenever the metrics are read."""
        self.peer_up.labels(role, address).set_function(lambda: float(is_up(address)))

    def forget_peer(self, role: str, address: str) -> None:
        """A peer no longer used (its service stopped listing it)."""
        self.peer_up.remove(role, address)
