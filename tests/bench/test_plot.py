"""`epd bench-plot`: TTFT and TPOT at p50 and p99 against load, a line per label and setting,
the runs' settings in the title and the legend, every y axis from 0."""

import json

import pytest

from epd.bench.plot import PANELS, figure, group, read_run
from epd.cli import main

pytest.importorskip("matplotlib")  # the dev extras have it; `epd[bench]` for users

CHAT = {
    "rate": 0.0,
    "concurrency": 1,
    "requests": 64,
    "dataset": "random",
    "prompt_tokens": 256,
    "output_tokens": 64,
    "endpoint": "/v1/chat/completions",
    "images": 1,
    "image_width": 448,
    "image_height": 448,
}


def run(tmp_path, label, load, ttft, tpot, throughput=1000.0, **config):
    """A run's JSON as `epd bench --json` writes it (the fields the plot reads)."""
    record = {
        "label": label,
        "config": CHAT | {"concurrency": load} | config,
        "summary": {
            "output_throughput": throughput,
            "ttft_ms": {"p50": ttft, "p99": 2 * ttft},
            "tpot_ms": {"p50": tpot, "p99": 2 * tpot},
            "itl_ms": {"p99": 3 * tpot},
        },
    }
    path = tmp_path / f"{label}-{load}-{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps(record))
    return str(path)


@pytest.fixture
def runs(tmp_path):
    """Values far from 0, where matplotlib alone would start each axis near the lowest."""
    return [
        run(tmp_path, "epd", 8, 420.0, 31.0, throughput=1100.0),
        run(tmp_path, "epd", 1, 400.0, 30.0),
        run(tmp_path, "vllm", 1, 410.0, 30.5),
    ]


def test_runs_are_lines_by_label_sorted_by_load_under_the_settings_they_share(runs):
    lines, title = group([read_run(path) for path in runs])
    assert sorted(lines) == ["epd", "vllm"] and [r.load for r in lines["epd"]] == [1, 8]
    assert title == (
        "random prompts · input 256 / output 64 · /v1/chat/completions · 1 image 448×448"
    )


def test_settings_that_differ_between_runs_name_their_lines(tmp_path):
    paths = [
        run(tmp_path, "epd", 4, 400.0, 30.0),
        run(tmp_path, "epd", 4, 300.0, 30.0, endpoint="/v1/completions", images=0),
        run(
            tmp_path,
            "epd",
            0,
            300.0,
            30.0,
            rate="inf",
            dataset="sharegpt",
            dataset_path="/d/sg.json",
        ),
    ]
    lines, title = group([read_run(path) for path in paths])
    assert set(lines) == {
        "epd, random prompts, input 256 / output 64, /v1/chat/completions, 1 image 448×448",
        "epd, random prompts, input 256 / output 64, /v1/completions",
        "epd, ShareGPT sg.json, output its replies' lengths, /v1/chat/completions, 1 image 448×448",
    }
    assert title == ""
    # All at once is every request in flight.
    assert [r.load for r in lines[next(k for k in lines if "ShareGPT" in k)]] == [64]


def test_ttft_and_tpot_show_p50_and_p99_every_y_axis_from_zero(runs):
    drawn = figure(runs)
    assert len(drawn.axes) == len(PANELS)
    ttft, tpot = drawn.axes[:2]
    assert "TTFT" in ttft.get_title() and "TPOT" in tpot.get_title()
    for axis in (ttft, tpot):
        assert {line.get_label() for line in axis.get_lines()} == {
            "epd p50",
            "epd p99",
            "vllm p50",
            "vllm p99",
        }
    highest = (2 * 420.0, 2 * 31.0, 1100.0, 3 * 31.0)
    for axis, top in zip(drawn.axes, highest, strict=True):
        bottom, shown = axis.get_ylim()
        assert bottom == 0 and shown >= top
        assert axis.get_xlabel() == "concurrency (requests in flight)"
    assert drawn.get_suptitle().startswith("epd bench: random prompts · input 256 / output 64")
    assert [t.get_text() for t in drawn.legends[0].get_texts()] == ["epd", "vllm"]


def test_bench_plot_writes_a_png(runs, tmp_path):
    out = tmp_path / "bench.png"
    main(["bench-plot", *runs, "-o", str(out)])
    assert out.read_bytes().startswith(b"\x89PNG")
