"""`epd bench-plot`: one line per label against load, every y axis from 0."""

import json

import pytest

from epd.bench.plot import PANELS, figure, load
from epd.cli import main

pytest.importorskip("matplotlib")  # the dev extras have it; `epd[bench]` for users


def run(tmp_path, label, concurrency, throughput, ttft, itl):
    """A run's JSON as `epd bench --json` writes it (the fields the plot reads)."""
    record = {
        "label": label,
        "config": {"rate": None, "concurrency": concurrency},
        "summary": {
            "output_throughput": throughput,
            "ttft_ms": {"p50": ttft},
            "itl_ms": {"p99": itl},
        },
    }
    path = tmp_path / f"{label}-{concurrency}.json"
    path.write_text(json.dumps(record))
    return str(path)


@pytest.fixture
def runs(tmp_path):
    """Values far from 0, where matplotlib alone would start each axis near the lowest."""
    return [
        run(tmp_path, "epd", 1, 1000.0, 400.0, 30.0),
        run(tmp_path, "epd", 8, 1100.0, 420.0, 31.0),
        run(tmp_path, "vllm", 1, 1050.0, 410.0, 30.5),
    ]


def test_runs_are_lines_by_label_sorted_by_load(runs):
    lines = load(runs[::-1])
    assert sorted(lines) == ["epd", "vllm"] and [x for x, _ in lines["epd"]] == [1, 8]


def test_every_y_axis_starts_at_zero_and_fits_the_lines(runs):
    axes = figure(runs).axes
    assert len(axes) == len(PANELS)
    for axis, highest in zip(axes, (1100.0, 420.0, 31.0), strict=True):
        bottom, top = axis.get_ylim()
        assert bottom == 0 and top >= highest
        assert len(axis.get_lines()) == 2  # one per label


def test_bench_plot_writes_a_png(runs, tmp_path):
    out = tmp_path / "bench.png"
    main(["bench-plot", *runs, "-o", str(out)])
    assert out.read_bytes().startswith(b"\x89PNG")
