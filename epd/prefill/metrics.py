"""What the prefill process measures (it fronts every request, so the request-level metrics
are here), named as vLLM names them under `epd:`, plus what only EPD has.

Times are taken as the API passes each delta on to its reply (`Timeline`), so a request's
time per output token is what its client sees, whichever process made the tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from epd.runtime.metrics import RoleMetrics


@dataclass
class Timeline:
    """When one request's tokens reached the API, choice by choice (perf_counter seconds)."""

    arrived: float
    first: float | None = None  # the request's first token
    # Each choice's first delta (when, and the tokens it brought), and its latest (when).
    began: dict[int, tuple[float, int]] = field(default_factory=dict)
    last: dict[int, float] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)  # each choice's tokens so far

    @property
    def generated(self) -> int:
        return sum(self.tokens.values())

    def per_token(self) -> list[float]:
        """Each choice's mean time per output token after its first (vLLM's TPOT: decode time
        over the tokens after the first), for the choices that have such tokens."""
        return [
            (self.last[index] - start) / (self.tokens[index] - first_tokens)
            for index, (start, first_tokens) in self.began.items()
            if self.tokens[index] > first_tokens
        ]


class PrefillMetrics(RoleMetrics):
    role = "prefill"

    def __init__(self, model_name: str) -> None:
        super().__init__(model_name)
        seconds, counter, gauge, tokens = self.seconds, self.counter, self.gauge, self.tokens
        # Requests, as vLLM names them.
        self.ttft = seconds("time_to_first_token_seconds", "Arrival to the first token sent.")
        self.itl = seconds("inter_token_latency_seconds", "Time between a choice's deltas.")
        self.tpot = seconds(
            "time_per_output_token_seconds",
            "Time between a choice's deltas (vLLM's older name of the inter-token latency).",
        )
        self.request_tpot = seconds(
            "request_time_per_output_token_seconds",
            "Per choice of a request that ended: from its first token to its last, over its "
            "tokens after the first.",
        )
        self.decode_time = seconds(
            "request_decode_time_seconds",
            "Per request that ended: from its first token sent to its last.",
        )
        self.e2e = seconds("e2e_request_latency_seconds", "Arrival to the last token sent.")
        self.request_prompt_tokens = tokens(
            "request_prompt_tokens",
            "Prompt tokens of a request that ended (image tokens included; a legacy "
            "completion's prompts added up).",
        )
        self.request_generation_tokens = tokens(
            "request_generation_tokens", "Tokens generated for a request that ended, every choice."
        )
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
            "Requests refused with 503, by reason: at once (overloaded, encode_backlog, "
            "draining, bodies: while their bodies arrive), or while their images wait "
            "(encode_late).",
            ["reason"],
        )
        self.migrations = counter(
            "migrations",
            "Streams moved off a peer that died, by its role and how it went: resumed (on "
            "another, from the tokens sent), failed (none could take it, or it moved too often).",
            ["role", "outcome"],
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache."
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
        self.handoff_tokens = counter(
            "kv_handoff_tokens", "Prompt tokens whose KV rows went to decoders (resent ones too)."
        )
        self.handoff_reused_tokens = counter(
            "kv_handoff_reused_tokens",
            "Prompt tokens whose KV the chosen decoder held already, so no hand-off carried it.",
        )
        self.handoff_seconds = seconds(
            "kv_handoff_seconds",
            "From handing a KV cache to a decoder until its first delta came back: transfer, "
            "admission, any wait for a batch slot or KV blocks, and one decode step (the first "
            "token is prefill's own).",
        )
        self.peer_up = gauge(
            "peer_up", "1 while a peer answers (heartbeats), else 0.", ["peer_role", "address"]
        )
        self.kv_usage = gauge(
            "kv_cache_usage_perc",
            "Fraction (0 to 1) of a decoder's KV cache blocks in use, as it reported with its "
            "latest delta to this prefill.",
            ["decoder"],
        )
        self.reporting: set[str] = set()  # decoders with a kv_usage series

    def delta(self, timeline: Timeline, index: int, tokens: int, now: float) -> None:
        """A delta of choice `index`, which has `tokens` in all with it, reached the API."""
        if timeline.first is None:
            timeline.first = now
            self.ttft.observe(now - timeline.arrived)
        elif index in timeline.last:
            self.itl.observe(now - timeline.last[index])
            self.tpot.observe(now - timeline.last[index])
        timeline.began.setdefault(index, (now, tokens))
        timeline.last[index] = now
        timeline.tokens[index] = tokens

    def ended(self, timeline: Timeline, prompt_tokens: int, reason: str, now: float) -> None:
        """The request is over: finished for `reason` (abort: its client left), or failed
        (""), which `request_failure` counts where its status is decided."""
        self.generation_tokens.inc(timeline.generated)
        if not reason:
            return
        self.success.labels(reason).inc()
        self.e2e.observe(now - timeline.arrived)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(timeline.generated)
        if timeline.first is not None:
            self.decode_time.observe(max(timeline.last.values()) - timeline.first)
        for seconds in timeline.per_token():
            self.request_tpot.observe(seconds)

    def decoder_reported(self, decoder: str, kv_usage: float) -> None:
        self.kv_usage.labels(decoder).set(kv_usage)
        self.reporting.add(decoder)

    def watch_peer(self, role: str, address: str, is_up: Callable[[str], bool]) -> None:
        """Report a peer's state whenever the metrics are read."""
        self.peer_up.labels(role, address).set_function(lambda: float(is_up(address)))

    def forget_peer(self, role: str, address: str) -> None:
        """A peer no longer used (its service stopped listing it)."""
        self.peer_up.remove(role, address)
        if address in self.reporting:
            self.reporting.discard(address)
            self.kv_usage.remove(address)
