"""`epd bench` against the running stack, then `epd bench-plot` of what it wrote; and a
`vllm bench serve` command line's flags against its legacy completions route."""

import json
import subprocess
import sys


def test_bench_times_the_stack_and_plots_it(stack, model_name, tmp_path):
    _, base = stack
    out = tmp_path / "run.json"
    result = subprocess.run(
        [
            *(sys.executable, "-m", "epd.cli", "bench"),
            *("--base-url", f"http://127.0.0.1:{base + 20}/v1", "--requests", "4"),
            *("--concurrency", "2", "--prompt-tokens", "10", "--output-tokens", "6"),
            *("--images", "1", "--image-width", "56", "--image-height", "56"),
            *("--goodput-ttft-ms", "60000", "--json", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "output tokens/s" in result.stdout
    record = json.loads(out.read_text())
    assert record["model"] == model_name and record["summary"]["completed"] == 4
    assert all(r["output_tokens"] == 6 and not r["error"] for r in record["requests"])
    assert record["summary"]["goodput"] > 0
    plot = tmp_path / "plot.png"
    subprocess.run(
        [sys.executable, "-m", "epd.cli", "bench-plot", str(out), "-o", str(plot)],
        check=True,
        timeout=120,
    )
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_vllm_bench_command_line_loads_the_legacy_completions_route(stack, tmp_path):
    _, base = stack
    result = subprocess.run(
        [
            *(sys.executable, "-m", "epd.cli", "bench", "--backend", "vllm"),
            *("--base-url", f"http://127.0.0.1:{base + 20}", "--endpoint", "/v1/completions"),
            *("--dataset-name", "random", "--random-input-len", "8", "--random-output-len", "4"),
            *("--num-prompts", "2", "--request-rate", "inf", "--max-concurrency", "2"),
            *("--num-warmups", "0", "--save-result", "--result-dir", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "/v1/completions" in result.stdout and "all at once, at most 2" in result.stdout
    (saved,) = tmp_path.glob("*.json")
    record = json.loads(saved.read_text())
    assert record["summary"]["completed"] == 2 and record["config"]["rate"] == "inf"
    assert all(r["output_tokens"] == 4 and not r["error"] for r in record["requests"])
