"""Serving benchmark, side by side in one run: epd, transformers serve, and the one-process path.

    .venv/bin/python scripts/bench_serving.py [--out bench-results] [--quick] [--dtype bfloat16]

Makes a random `small` checkpoint, starts `epd serve` on it and times it with `epd bench` (text
at 1, 4, 16 and 32 concurrent streams; one 448×448 image at 1 and 8; a repeated 896×896 image),
then `transformers serve` on the same language model (exported as a DeepSeek-V3 checkpoint;
it has no Kimi-VL, so text only) at 1 and 16, then the one-process path (`LocalPipeline`) one
request at a time, all three in --dtype (default float32). Then, as a noisy machine's speed
drifts between runs minutes apart, epd's 16-stream against 1-stream ratio again from --rounds
(default 3) pairs of runs back to back, with the CPU each role (and the client) spent per request
at 16 streams, and the time to first token at one request, served and through the one-process
path, on the same prompts taken in turn while the server idles. Every run's JSON lands in
--out; the summary table is printed as Markdown for docs/benchmarks.md.
Not a test: it takes about twenty minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests

from epd.bench.client import Timing, read
from epd.bench.config import BenchConfig
from epd.bench.workload import bodies
from epd.checkpoint.export import export_language_model
from epd.checkpoint.synthetic import make_checkpoint
from epd.dtypes import MODEL_DTYPES, model_dtype
from epd.local import Completion, LocalPipeline

TEXT = {"prompt_tokens": 90, "output_tokens": 64}  # about 240 prompt tokens with this tokenizer
IMAGE = {"prompt_tokens": 20, "output_tokens": 64, "images": 1}
# Time to first token, served against the one-process path: prompts in turn, 16 tokens each.
SHORT: dict[str, Any] = TEXT | {"output_tokens": 16}
TTFT_PAIRS = 40
# Before each side's request of a TTFT pair: an idle process's OpenMP threads spin for ~5 ms
# after its last op (4.4-6.7 ms of CPU in 50 ms idle after each one-process request, measured
# here), and on two cores that spin takes one from whatever starts next.
SETTLE_S = 0.05


def start(command: list[str], url: str, log: Path) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{url}/models", timeout=2).status_code == 200:
                return process
        except requests.RequestException:
            pass
        if process.poll() is not None:
            break
        time.sleep(1)
    raise RuntimeError(f"{command[0]} did not come up; see {log}")


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()


def bench(url: str, out: Path, name: str, **settings: Any) -> dict[str, Any]:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items() if not isinstance(v, bool)]
    flags += [
        f"--{'' if v else 'no-'}{k.replace('_', '-')}"
        for k, v in settings.items()
        if isinstance(v, bool)
    ]
    path = out / f"{name}.json"
    subprocess.run(
        [sys.executable, "-m", "epd.cli", "bench", "--base-url", url, "--json", str(path), *flags],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    summary: dict[str, Any] = json.loads(path.read_text())["summary"]
    return summary


# Requests per stream. A run opens with all its streams' prompts at once and ends with its last
# streams finishing alone: at 4 per stream, 16 streams' tokens/s between the two came out a
# median 19% above the whole run's (docs/benchmarks.md, "Longer runs"). transformers serve
# takes one request at a time, so its runs keep 4 per stream or would take many minutes.
PER_STREAM, PER_STREAM_TRANSFORMERS = 10, 4


def requests_for(concurrency: int, per_stream: int = PER_STREAM) -> int:
    return max(12, per_stream * concurrency)


def epd_runs(
    checkpoint: Path, out: Path, quick: bool, dtype: str, rounds: int
) -> tuple[dict[str, dict[str, Any]], list[dict[str, float]], dict[str, dict[str, float]]]:
    """epd's runs by name, its 16-stream against 1-stream ratio and CPU budget in each of
    `rounds` pairs, and its time to first token at one request beside the one-process path's."""
    url = "http://127.0.0.1:8300/v1"
    command = [sys.executable, "-m", "epd.cli", "serve", "--model", str(checkpoint)]
    command += ["--dtype", dtype]
    command += ["--port", "8300", "--internal-base-port", "7400"]
    server = start(command, url, out / "epd.log")
    try:
        runs = text_runs(url, out, quick) | image_runs(url, out)
        scaling = scaling_rounds(url, out, rounds, server)
        return runs, scaling, ttft_pairs(url, checkpoint, dtype, TTFT_PAIRS)
    finally:
        stop(server)


def text_runs(url: str, out: Path, quick: bool) -> dict[str, dict[str, Any]]:
    # Not counted: a server that has just started meets its first shapes (oneDNN builds a kernel
    # for each, in bfloat16 most of all), which would slow whichever run came first.
    bench(url, out, "epd-warm-text", concurrency=16, requests=32, **TEXT)
    runs = {}
    for c in (1, 4, 16) if quick else (1, 4, 16, 32):
        runs[f"epd text c{c}"] = bench(
            url, out, f"epd-text-c{c}", label="epd", concurrency=c, requests=requests_for(c), **TEXT
        )
    for c in (1, 16):
        runs[f"epd text c{c} eos"] = bench(
            url,
            out,
            f"epd-text-eos-c{c}",
            label="epd (eos)",
            concurrency=c,
            requests=requests_for(c),
            ignore_eos=False,
            **TEXT,
        )
    return runs


def scaling_rounds(
    url: str, out: Path, rounds: int, server: subprocess.Popen[bytes]
) -> list[dict[str, float]]:
    """Output tokens/s at 16 streams over that at 1, from runs back to back, once per round,
    and what the 16 streams cost the machine (`cpu_budget`)."""
    results = []
    for r in range(1, rounds + 1):
        one = round_run(url, out, r, 1)
        before = roles_cpu_s(server)
        many = round_run(url, out, r, 16)
        used = {role: s - before.get(role, 0.0) for role, s in roles_cpu_s(server).items()}
        ratio = many["output_throughput"] / one["output_throughput"]
        results.append({"ratio": ratio} | cpu_budget(used, many, one))
    return results


def round_run(url: str, out: Path, round_: int, concurrency: int) -> dict[str, Any]:
    name = f"epd-round{round_}-c{concurrency}"
    return bench(
        url,
        out,
        name,
        label="epd",
        concurrency=concurrency,
        requests=requests_for(concurrency),
        **TEXT,
    )


def roles_cpu_s(server: subprocess.Popen[bytes]) -> dict[str, float]:
    """CPU seconds so far of each process `epd serve` started, by role (Linux's /proc)."""
    seconds = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text, command = stat.read_text(), (stat.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:  # it ended meanwhile
            continue
        fields = text[text.rfind(")") + 2 :].split()  # after the name, which may hold spaces
        if int(fields[1]) == server.pid and b"epd.cli" in command[:-1]:
            role = command[command.index(b"epd.cli") + 1].decode()
            seconds[role] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return seconds


def cpu_budget(
    used: dict[str, float], many: dict[str, Any], one: dict[str, Any]
) -> dict[str, float]:
    """Milliseconds of CPU per request at 16 streams, by role and for the client; the cores
    they kept busy; and the most output that cost allows on this machine's cores, as a
    multiple of one stream's (`cap`): while the cores are full, 16 streams give no more."""
    served = many["completed"] + many["failed"] + BenchConfig().warmup  # the roles served them
    budget = {f"{role}_ms": 1000 * s / served for role, s in sorted(used.items())}
    budget["client_ms"] = 1000 * many["client_cpu_s"] / max(1, many["completed"])
    total_s = sum(budget.values()) / 1000
    tokens = many["output_throughput"] / many["request_throughput"]  # per request
    cores = len(os.sched_getaffinity(0))
    return budget | {
        "total_ms": 1000 * total_s,
        "busy_cores": total_s * many["request_throughput"],
        "cores": cores,
        "cap": cores / total_s * tokens / one["output_throughput"],
    }


def ttft_pairs(url: str, checkpoint: Path, dtype: str, count: int) -> dict[str, dict[str, float]]:
    """TTFT p50 at one request, served and through the one-process path, and the p50 of each
    prompt's ratio of the two, on the same prompts taken in turn (served, then alone, then the
    next prompt), so that both meet the same seconds of a machine whose speed drifts; the
    one-process path runs in this process while the server idles. Each side starts SETTLE_S
    after the other ends: without the pause, the served forward began while this process's
    threads still spun, and the one-process one long after the server's had stopped (its
    stream ends with decode's steps)."""
    pipeline = LocalPipeline(checkpoint, dtype=model_dtype(dtype))
    local_completions(pipeline, checkpoint.name, 4, seed=1)  # warm, as the server was
    served, alone = [], []
    with requests.Session() as session:  # one kept-alive connection, as `epd bench` keeps
        for body in bodies(BenchConfig(**SHORT, seed=2), checkpoint.name, count):
            time.sleep(SETTLE_S)
            ttft = streamed_ttft_s(session, url, body)
            time.sleep(SETTLE_S)
            completion = pipeline.chat(body | {"stream": False, "stream_options": None})
            if ttft is not None and completion.first_text_s is not None:  # both have text
                served.append(ttft)
                alone.append(completion)
    pairs = list(zip(served, alone, strict=True))
    # A first token that is only part of a UTF-8 character shows text with a later one: served,
    # that token comes from decode, after the hand-off (docs/benchmarks.md).
    at_first = [(s, c) for s, c in pairs if c.first_text_s == c.first_token_s]
    later = [(s, c) for s, c in pairs if c.first_text_s != c.first_token_s]
    groups = {"all": pairs, "text at the first token": at_first, "text later": later}
    return {
        which: {
            "served_ms": statistics.median(s for s, _ in chosen) * 1000,
            "local_ms": ttft_p50_ms([c for _, c in chosen]),
            # Each prompt's own ratio: the two groups' times lie apart, and the median of all
            # on one side can fall in one group while the other side's falls in the other.
            "ratio_p50": statistics.median(s / c.first_text_s for s, c in chosen),
            "prompts": len(chosen),
        }
        for which, chosen in groups.items()
        if chosen
    }


def streamed_ttft_s(session: requests.Session, url: str, body: dict[str, Any]) -> float | None:
    """Seconds from sending a streamed chat request to its first content chunk, read as `epd
    bench` reads its lines (None if it had none)."""
    timing, start = Timing(0.0), time.perf_counter()
    with session.post(f"{url}/chat/completions", json=body | {"stream": True}, stream=True) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            read(line.decode(), timing, time.perf_counter() - start)
    return timing.first_token


def image_runs(url: str, out: Path) -> dict[str, dict[str, Any]]:
    runs = {}
    for c in (1, 8):
        runs[f"epd image c{c}"] = bench(
            url,
            out,
            f"epd-image-c{c}",
            label="epd image",
            concurrency=c,
            requests=requests_for(c),
            **IMAGE,
        )
    large = {"images": 1, "image_width": 896, "image_height": 896, "prompt_tokens": 20}
    # A first 896x896 image (another one) pays the one-time costs of that size.
    bench(url, out, "epd-warm-896", requests=1, warmup=0, seed=8, output_tokens=4, **large)
    repeated = bench(
        url,
        out,
        "epd-repeat-896",
        requests=4,
        warmup=0,
        seed=7,
        output_tokens=16,
        repeat_images=True,
        **large,
    )
    timings = json.loads((out / "epd-repeat-896.json").read_text())["requests"]
    ttfts = [round((t["first_token"] - t["start"]) * 1000) for t in timings]
    runs[f"epd repeated 896 (TTFT first {ttfts[0]} ms, then {ttfts[1:]})"] = repeated
    return runs


def transformers_runs(checkpoint: Path, out: Path, dtype: str) -> dict[str, dict[str, Any]]:
    """transformers serve on the same language model: one request at a time (its continuous
    batching fails on DeepSeek-V3's MLA), no ignore_eos, so both sides run without it."""
    exported = out / "deepseek"
    shutil.rmtree(exported, ignore_errors=True)
    export_language_model(checkpoint, exported)
    url = "http://127.0.0.1:8301/v1"
    command = [
        "transformers",
        "serve",
        str(exported),
        "--device",
        "cpu",
        "--dtype",
        dtype,
        "--port",
        "8301",
    ]
    server = start(
        [str(Path(sys.executable).parent / command[0]), *command[1:]], url, out / "transformers.log"
    )
    runs = {}
    try:
        bench(url, out, "transformers-warm", requests=2, ignore_eos=False, **TEXT)
        for c in (1, 16):
            runs[f"transformers text c{c} eos"] = bench(
                url,
                out,
                f"transformers-text-c{c}",
                label="transformers serve",
                concurrency=c,
                requests=requests_for(c, PER_STREAM_TRANSFORMERS),
                ignore_eos=False,
                **TEXT,
            )
    finally:
        stop(server)
    return runs


def local_completions(
    pipeline: LocalPipeline, model: str, count: int, seed: int = 0, **workload: Any
) -> list[Completion]:
    """`count` requests of the workload (TEXT unless changed), one at a time."""
    config = BenchConfig(**(TEXT | workload), seed=seed)
    return [
        pipeline.chat(body | {"stream": False, "stream_options": None})
        for body in bodies(config, model, count)
    ]


def ttft_p50_ms(completions: list[Completion]) -> float:
    """Timed to the first text, as `epd bench` times the served side: with a random model
    nearly half the first tokens are a piece of a UTF-8 character, which shows only with the
    next token. A reply without text is left out, as `epd bench` leaves out a stream without
    content."""
    times = [c.first_text_s for c in completions if c.first_text_s is not None]
    return statistics.median(times) * 1000


def local_run(checkpoint: Path, dtype: str) -> dict[str, float]:
    """The one-process path, one request at a time, on the whole machine."""
    pipeline = LocalPipeline(checkpoint, dtype=model_dtype(dtype))
    local_completions(pipeline, checkpoint.name, 4, seed=1)  # warm, as the servers
    completions = local_completions(pipeline, checkpoint.name, 8)
    return {
        "ttft_p50_ms": ttft_p50_ms(completions),
        "tokens_per_s": sum(len(c.token_ids) for c in completions)
        / sum(c.total_s for c in completions),
    }


def table(runs: dict[str, dict[str, Any]], local: dict[str, float]) -> str:
    lines = [
        "| run | requests/s | output tok/s | TTFT p50 ms | TPOT p50 ms | ITL p50 / p99 ms |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in runs.items():
        itl = s["itl_ms"]
        lines.append(
            f"| {name} | {s['request_throughput']:.2f} | {s['output_throughput']:.1f} | "
            f"{s['ttft_ms'].get('p50', 0):.0f} | {s['tpot_ms'].get('p50', 0):.1f} | "
            f"{itl.get('p50', 0):.1f} / {itl.get('p99', 0):.1f} |"
        )
    lines.append(
        f"| one-process path, text c1 | — | {local['tokens_per_s']:.1f} | "
        f"{local['ttft_p50_ms']:.0f} | — | — |"
    )
    return "\n".join(lines)


def rounds_table(rounds: list[dict[str, float]]) -> str:
    """16 streams against 1, round by round and their median, with where the cores went."""
    roles = [k for k in rounds[0] if k.endswith("_ms") and k != "total_ms"]
    columns = ["ratio", *roles, "total_ms", "busy_cores", "cap"]
    names = ["16 ÷ 1", *(f"{k[:-3]} ms" for k in roles), "CPU ms", "cores busy", "cores allow"]
    lines = [
        "\n16 streams against 1, back to back; CPU per request at 16 streams:\n",
        "| round | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for name, row in [*((str(i), r) for i, r in enumerate(rounds, 1)), ("median", None)]:
        values = [row[c] if row else statistics.median(r[c] for r in rounds) for c in columns]
        shown = [
            f"{v:.2f}" if c in ("ratio", "busy_cores", "cap") else f"{v:.1f}"
            for c, v in zip(columns, values, strict=True)
        ]
        lines.append(f"| {name} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--quick", action="store_true", help="fewer text runs")
    parser.add_argument("--dtype", default="float32", choices=MODEL_DTYPES, help="every side's")
    parser.add_argument("--rounds", type=int, default=3, help="pairs of 1 and 16 streams")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    checkpoint = make_checkpoint(args.out / "small", "small")
    runs, rounds, ttft = epd_runs(checkpoint, args.out, args.quick, args.dtype, args.rounds)
    runs |= transformers_runs(checkpoint, args.out, args.dtype)
    local = local_run(checkpoint, args.dtype)
    summary = {"runs": runs, "local": local, "rounds_16_to_1": rounds, "ttft_in_turn": ttft}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(table(runs, local))
    if rounds:
        print(rounds_table(rounds))
    for which, group in ttft.items():
        served, alone = group["served_ms"], group["local_ms"]
        print(
            f"TTFT p50 at 1 request, {group['prompts']} prompts in turn ({which}): "
            f"served {served:.1f} ms, one-process {alone:.1f} ms, ratio {served / alone:.2f}; "
            f"prompt by prompt, p50 {group['ratio_p50']:.2f}"
        )


if __name__ == "__main__":
    main()
