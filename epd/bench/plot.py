"""`epd bench-plot`: latency and throughput against load, from the JSON of several runs.

Each run is placed by its load: the request rate of Poisson arrivals, else the requests in
flight (the concurrency, or every request where they were all sent at once). Runs are lines by
label and by whatever settings they do not share with the other runs; the settings every run
shares (dataset, lengths, endpoint, images, ...) are the title. TTFT and TPOT are drawn at p50
(solid) and p99 (dashed). A run saved before a setting existed is read with its default.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # matplotlib is optional: imported only to draw
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

Measure = Callable[[dict[str, Any]], float]
PERCENTILE_STYLES = {"p50": "o-", "p99": "s--"}


def percentiles(key: str) -> dict[str, Measure]:
    def at(percentile: str) -> Measure:
        return lambda summary: float(summary[key].get(percentile, 0.0))

    return {percentile: at(percentile) for percentile in PERCENTILE_STYLES}


# Each panel: its title and its measures, by the name that sets their line style.
PANELS: tuple[tuple[str, dict[str, Measure]], ...] = (
    ("TTFT (ms): p50 solid, p99 dashed", percentiles("ttft_ms")),
    ("TPOT (ms): p50 solid, p99 dashed", percentiles("tpot_ms")),
    ("output tokens/s", {"p50": lambda s: s["output_throughput"]}),
    ("ITL p99 (ms)", {"p50": lambda s: s["itl_ms"].get("p99", 0.0)}),
)


@dataclass(frozen=True)
class Run:
    label: str
    load: float
    poisson: bool  # load is arrivals a second, else requests in flight
    settings: dict[str, str]  # what it sent, in words
    summary: dict[str, Any]


def read_run(path: str) -> Run:
    record = json.loads(Path(path).read_text())
    config = record["config"]
    rate = float(config.get("rate") or 0.0)  # "inf" too, as vLLM and epd bench write it
    poisson = 0 < rate < math.inf
    in_flight = config.get("concurrency") or (config.get("requests", 1) if rate else 1)
    return Run(
        record["label"],
        rate if poisson else in_flight,
        poisson,
        settings(config),
        record["summary"],
    )


def settings(config: dict[str, Any]) -> dict[str, str]:
    """A run's settings beside its load, in words; those at their defaults left out."""
    said = {"dataset": "random prompts"}
    if config.get("dataset") == "sharegpt":
        said["dataset"] = f"ShareGPT {Path(config['dataset_path']).name}"
        out = config.get("sharegpt_output_tokens") or "its replies' lengths"
        said["lengths"] = f"output {out}"
    elif "prompt_tokens" in config:
        said["lengths"] = f"input {config['prompt_tokens']} / output {config['output_tokens']}"
    said["endpoint"] = config.get("endpoint", "/v1/chat/completions")
    if images := config.get("images"):
        size = f"{config['image_width']}×{config['image_height']}"
        said["images"] = f"{images} image{'s' if images > 1 else ''} {size}"
    if config.get("turns", 1) > 1:
        said["turns"] = f"{config['turns']} turns"
    if config.get("system_prompt_tokens"):
        said["system"] = f"system prompt {config['system_prompt_tokens']}"
    if config.get("rate") and config.get("concurrency"):
        said["in flight"] = f"at most {config['concurrency']} in flight"
    return said


def group(runs: list[Run]) -> tuple[dict[str, list[Run]], str]:
    """Lines (by label and the settings that differ between runs), sorted by load; and the
    settings every run shares, as a title."""
    keys = dict.fromkeys(k for run in runs for k in run.settings)  # in the order they are said
    shared = {
        k: v for k, v in runs[0].settings.items() if all(r.settings.get(k) == v for r in runs)
    }
    lines: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        own = [run.settings.get(k, "") for k in keys if k not in shared]
        lines[", ".join([run.label, *filter(None, own)])].append(run)
    sorted_lines = {name: sorted(line, key=lambda r: r.load) for name, line in lines.items()}
    return sorted_lines, " · ".join(shared.values())


def x_label(runs: list[Run]) -> str:
    if all(run.poisson for run in runs):
        return "requests/s (Poisson arrivals)"
    if not any(run.poisson for run in runs):
        return "concurrency (requests in flight)"
    return "concurrency, or requests/s where arrivals are Poisson"


def plot(paths: list[str], out: str) -> None:
    figure(paths).savefig(out, dpi=120)


def figure(paths: list[str]) -> Figure:
    """A panel per measure, its y axis from 0: a change is seen at its true size. A Figure of
    its own, not pyplot's: no display and no global state."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError("epd bench-plot needs matplotlib: pip install 'epd[bench]'") from None

    runs = [read_run(path) for path in paths]
    lines, shared = group(runs)
    drawn = Figure(figsize=(11, 8.5), layout="constrained")
    for axis, (title, measures) in zip(drawn.subplots(2, 2).flat, PANELS, strict=True):
        draw(axis, lines, measures)
        axis.set_title(title)
        axis.set_xlabel(x_label(runs))
    drawn.suptitle(f"epd bench: {shared}" if shared else "epd bench")
    handles = drawn.axes[0].get_legend_handles_labels()[0]  # a p50 and a p99 per line
    drawn.legend(
        handles[:: len(PERCENTILE_STYLES)],
        list(lines),
        loc="outside lower center",
        ncols=min(len(lines), 3),
    )
    return drawn


def draw(axis: Axes, lines: dict[str, list[Run]], measures: dict[str, Measure]) -> None:
    for color, (name, line) in enumerate(lines.items()):
        for percentile, value in measures.items():
            axis.plot(
                [run.load for run in line],
                [value(run.summary) for run in line],
                PERCENTILE_STYLES[percentile],
                color=f"C{color}",
                label=f"{name} {percentile}",
            )
    axis.set_ylim(bottom=0)  # after the lines: the top still fits them
    axis.grid(alpha=0.3)
