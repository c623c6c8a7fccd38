"""A run's summary: throughput, and TTFT, TPOT, ITL and end-to-end latency percentiles.

TTFT is the time to the first chunk with text; TPOT a request's time per output token after
the first, (end - first token) / (tokens - 1); ITL every gap between chunks, pooled over
requests. Goodput counts the requests per second that met the TTFT and TPOT targets. The
client's own CPU time is there too: a client on the server's machine takes cores from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from epd.bench.client import Timing

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Summary:
    completed: int
    failed: int
    duration_s: float
    request_throughput: float  # completed requests per second
    output_throughput: float  # output tokens per second
    input_throughput: float  # prompt tokens per second
    goodput: float | None  # requests per second that met the targets, if any were given
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    client_cpu_s: float = 0.0  # this process's CPU seconds over the timed requests
    ttft_by_turn_ms: dict[int, float] = field(default_factory=dict)  # p50, turns > 1 only
    # Prompt tokens served from the prefix cache, of all prompt tokens (as replies' usage says).
    cached_prompt_share: float = 0.0
    # Each prefill's share of the requests, where a router's /metrics tells (`epd route`).
    prefill_share: dict[str, float] = field(default_factory=dict)


def spread(values: Sequence[float]) -> dict[str, float]:
    """Mean and percentiles of values in seconds, in milliseconds (empty: no keys)."""
    if not values:
        return {}
    ms = np.asarray(values) * 1000
    stats = {"mean": float(ms.mean())}
    stats |= {f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}
    return stats


def tpot(timing: Timing) -> float | None:
    if timing.output_tokens < 2 or timing.first_token is None or timing.end is None:
        return None
    return (timing.end - timing.first_token) / (timing.output_tokens - 1)


def summarise(timings: Sequence[Timing], ttft_target_ms: float, tpot_target_ms: float) -> Summary:
    done = [t for t in timings if t.ok]
    duration = max(t.end or 0.0 for t in done) - min(t.start for t in timings) if done else 0.0
    per_second = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    ttfts = [(t.first_token or 0.0) - t.start for t in done]
    tpots = [v for t in done if (v := tpot(t)) is not None]
    gaps = [b - a for t in done for a, b in zip(t.chunks, t.chunks[1:], strict=False)]
    goodput = None
    if ttft_target_ms or tpot_target_ms:
        good = [t for t in done if meets(t, ttft_target_ms, tpot_target_ms)]
        goodput = per_second(len(good))
    return Summary(
        completed=len(done),
        failed=len(timings) - len(done),
        duration_s=duration,
        request_throughput=per_second(len(done)),
        output_throughput=per_second(sum(t.output_tokens for t in done)),
        input_throughput=per_second(sum(t.prompt_tokens for t in done)),
        goodput=goodput,
        ttft_ms=spread(ttfts),
        tpot_ms=spread(tpots),
        itl_ms=spread(gaps),
        e2e_ms=spread([(t.end or 0.0) - t.start for t in done]),
        ttft_by_turn_ms=by_turn(done),
        cached_prompt_share=share(
            sum(t.cached_tokens for t in done), sum(t.prompt_tokens for t in done)
        ),
    )


def share(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def by_turn(done: Sequence[Timing]) -> dict[int, float]:
    """TTFT p50 of each turn of the conversations (nothing when they have one turn)."""
    turns = sorted({t.turn for t in done})
    if turns == [0]:
        return {}
    ttft = {
        turn: [(t.first_token or 0.0) - t.start for t in done if t.turn == turn] for turn in turns
    }
    return {turn + 1: float(np.percentile(v, 50)) * 1000 for turn, v in ttft.items()}


def meets(timing: Timing, ttft_target_ms: float, tpot_target_ms: float) -> bool:
    ttft_ms = ((timing.first_token or 0.0) - timing.start) * 1000
    per_token = tpot(timing)
    tpot_ms = 0.0 if per_token is None else per_token * 1000
    ttft_ok = not ttft_target_ms or ttft_ms <= ttft_target_ms
    tpot_ok = not tpot_target_ms or tpot_ms <= tpot_target_ms
    return ttft_ok and tpot_ok


def table(summary: Summary) -> str:
    """The summary as aligned text lines, for the terminal."""
    lines = [
        f"{'completed / failed':<28}{summary.completed} / {summary.failed}",
        f"{'duration (s)':<28}{summary.duration_s:.2f}",
        f"{'requests/s':<28}{summary.request_throughput:.3f}",
        f"{'output tokens/s':<28}{summary.output_throughput:.1f}",
        f"{'prompt tokens/s':<28}{summary.input_throughput:.1f}",
    ]
    if summary.goodput is not None:
        lines.append(f"{'goodput (requests/s)':<28}{summary.goodput:.3f}")
    for name, stats in (
        ("TTFT", summary.ttft_ms),
        ("TPOT", summary.tpot_ms),
        ("ITL", summary.itl_ms),
        ("end to end", summary.e2e_ms),
    ):
        values = "  ".join(f"{k} {v:.1f}" for k, v in stats.items())
        lines.append(f"{name + ' (ms)':<28}{values}")
    if summary.ttft_by_turn_ms:
        turns = "  ".join(f"{k}: {v:.1f}" for k, v in summary.ttft_by_turn_ms.items())
        lines.append(f"{'TTFT p50 by turn (ms)':<28}{turns}")
    lines.append(f"{'prompt tokens from cache':<28}{summary.cached_prompt_share:.1%}")
    for prefill, part in summary.prefill_share.items():
        lines.append(f"{'  requests to ' + prefill:<28}{part:.1%}")
    lines.append(f"{'client CPU (s)':<28}{summary.client_cpu_s:.2f}")
    return "\n".join(lines)
