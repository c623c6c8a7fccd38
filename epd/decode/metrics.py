"""What the decode process measures."""

from __future__ import annotations

from epd.runtime.metrics import RoleMetrics


class DecodeMetrics(RoleMetrics):
    role = "decode"

    def __init__(self, model_name: str) -> None:
        super().__init__(model_name)
        self.batch_size = self.sizes("decode_batch_size", "Sequences advanced by one decode step.")
        self.step_seconds = self.seconds("decode_step_seconds", "Time of one decode step.")
        self.handoff_bytes = self.counter(
            "kv_handoff_bytes_received", "Bytes of KV caches taken from prefills."
        )
        self.running = self.gauge("num_sequences_running", "Sequences (choices) being decoded.")
        self.waiting = self.gauge(
            "num_sequences_waiting", "Sequences waiting for room in the batch or the KV cache."
        )
        self.kv_usage = self.gauge(
            "kv_cache_usage_perc",
            "Fraction (0 to 1) of the KV cache's blocks held by running sequences (vLLM's name).",
        )
        self.prefix_cache_queries = self.counter(
            "prefix_cache_queries", "Prompt tokens of the hand-offs taken (vLLM's name)."
        )
        self.prefix_cache_hits = self.counter(
            "prefix_cache_hits",
            "Prompt tokens whose KV decode held already, cached, so that no hand-off carried it.",
        )
        self.preemptions = self.counter(
            "num_preemptions", "Running sequences sent back to wait for KV cache blocks."
        )
        # Speculative decoding, by vLLM's names
        self.drafts = self.counter(
            "spec_decode_num_drafts", "Sequences' steps that verified drafts (vLLM's name)."
        )
        self.draft_tokens = self.counter(
            "spec_decode_num_draft_tokens", "Draft tokens verified (vLLM's name)."
        )
        self.accepted_tokens = self.counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted (vLLM's name)."
        )
        self.accepted_per_position = self.counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position in the draft, from 0 (vLLM's name).",
            ("position",),
        )
