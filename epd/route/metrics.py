"""What the router measures: where requests went and why, and what failed."""

from __future__ import annotations

from epd.runtime.metrics import RoleMetrics


class RouterMetrics(RoleMetrics):
    role = "router"

    def __init__(self, model_name: str) -> None:
        super().__init__(model_name)
        self.routed = self.counter(
            "router_requests",
            "Requests sent to a prefill, by prefill and why it was chosen: cache_hit (it held "
            "the longest prefix), load, round_robin, or retry (another refused or failed first).",
            ("prefill", "reason"),
        )
        self.matched_blocks = self.counter(
            "router_matched_blocks", "Prompt blocks the chosen prefill held, as the index says."
        )
        self.prompt_blocks = self.counter(
            "router_prompt_blocks", "Prompt blocks of the requests routed, where named."
        )
        self.failed = self.counter(
            "router_failures",
            "Requests the router answered with an error itself: no_prefill (none live or all "
            "refused) or upstream (a prefill failed mid-reply).",
            ("reason",),
        )
        self.live = self.gauge("router_prefills_live", "Prefills whose /health says ok.")
