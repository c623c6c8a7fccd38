"""`epd bench-plot`: latency and throughput against load, from the JSON of several runs.

Runs are grouped by label (one line per server or setting) and placed by their load: the
request rate for Poisson runs, else the concurrency.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # matplotlib is optional: imported only to draw
    from matplotlib.figure import Figure

PANELS = (
    ("output tokens/s", lambda s: s["output_throughput"]),
    ("TTFT p50 (ms)", lambda s: s["ttft_ms"].get("p50", 0.0)),
    ("ITL p99 (ms)", lambda s: s["itl_ms"].get("p99", 0.0)),
)


def load(paths: list[str]) -> dict[str, list[tuple[float, dict[str, Any]]]]:
    """{label: [(load, summary), ...] sorted by load}."""
    runs: dict[str, list[tuple[float, dict[str, Any]]]] = defaultdict(list)
    for path in paths:
        record = json.loads(Path(path).read_text())
        config = record["config"]
        runs[record["label"]].append(
            (config["rate"] or config["concurrency"] or 1, record["summary"])
        )
    return {label: sorted(points, key=lambda p: p[0]) for label, points in runs.items()}


def plot(paths: list[str], out: str) -> None:
    figure(paths).savefig(out, dpi=120)


def figure(paths: list[str]) -> Figure:
    """One panel per measure, its y axis from 0: a change is seen at its true size. A Figure
    of its own, not pyplot's: no display and no global state."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError("epd bench-plot needs matplotlib: pip install 'epd[bench]'") from None

    runs = load(paths)
    drawn = Figure(figsize=(5 * len(PANELS), 4))
    axes = drawn.subplots(1, len(PANELS))
    for axis, (title, value) in zip(axes, PANELS, strict=True):
        for label, points in runs.items():
            axis.plot([x for x, _ in points], [value(s) for _, s in points], "o-", label=label)
        axis.set_ylim(bottom=0)  # after the lines: the top still fits them
        axis.set_title(title)
        axis.set_xlabel("concurrency (or requests/s)")
        axis.grid(alpha=0.3)
    axes[0].legend()
    drawn.tight_layout()
    return drawn
