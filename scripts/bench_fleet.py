"""A fleet behind `epd route`, measured: what its cache-aware routing keeps of the prefix cache,
and what the router costs.

    .venv/bin/python scripts/bench_fleet.py [--checkpoint DIR] [--rounds 2] [--out bench-fleet]
        [--only trace,turns,overhead] [--vllm-venv /work/vllm/venv]

- trace: 16 conversations of 4 turns, interleaved (16 at once), a 900-word system prompt they
  share and an image each, through `epd serve` three ways, each started fresh (cold caches)
  and run in turn, round after round: one prefill and two decoders (the ideal: one prefill
  sees every turn), then two prefills and two decoders behind the router, cache-aware, then
  round-robin. For each: the share of prompt tokens the replies' usage says came from cache,
  each prefill's share of the requests, the KV rows handed to decoders against the prompt
  tokens prefilled (not cached), TTFT p50 and output tokens/s. Beside them, where its venv is
  (`scripts/vllm/setup.sh`), the same trace through one vLLM (its CPU build): what a user would
  run instead, its prefix cache's share by its own usage report.
- turns: the KV rows handed to decoders in each turn against the turn's new tokens (prompt
  tokens not served from cache), turn by turn: the same 16 conversations sent one turn at a
  time (all 16 at once, then the next turn once all are back), so prefill's counters, read
  between turns, tell the turns apart; through two prefills and two decoders, cache-aware, a
  fresh stack each round.
- overhead: one `epd serve` (one prefill, no prefix cache) and an `epd route` in front of it,
  given it under two names so that it names and weighs every request as in a fleet; `epd
  bench` at 1 and 16 streams straight to the prefill and through the router, alternately (the
  first side alternating by round): TTFT and TPOT through it ÷ straight.

Not a test, never in CI.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_serving import VLLM_ENV, bench, start, stop, vllm_copy  # noqa: E402

PORT, INTERNAL = 8320, 7700
TRACE = {
    "system_prompt_tokens": 900,
    "images": 1,
    "turns": 4,
    "prompt_tokens": 30,
    "output_tokens": 32,
    "concurrency": 16,
    "requests": 64,
    "warmup": 0,
}
SETUPS = {
    "one prefill (ideal)": ["--prefills", "1", "--decoders", "2"],
    "cache-aware": ["--prefills", "2", "--decoders", "2", "--routing", "cache-aware"],
    "round-robin": ["--prefills", "2", "--decoders", "2", "--routing", "round-robin"],
}
STREAMS = {
    "1 stream": {"prompt_tokens": 90, "output_tokens": 64, "concurrency": 1, "requests": 12},
    "16 streams": {"prompt_tokens": 90, "output_tokens": 64, "concurrency": 16, "requests": 96},
}


def serve(checkpoint: Path, flags: list[str], log: Path) -> Any:
    command = [sys.executable, "-m", "epd.cli", "serve", str(checkpoint), "--dtype", "float32"]
    command += ["--port", str(PORT), "--internal-base-port", str(INTERNAL), *flags]
    return start(command, f"http://127.0.0.1:{PORT}/v1", log)


def prefill_ports(prefills: int) -> list[int]:
    return [PORT] if prefills == 1 else [INTERNAL + 100 * i + 21 for i in range(prefills)]


def wait_for_prefills(prefills: int, seconds: float = 180.0) -> None:
    """Until every prefill's /health answers 200."""
    deadline = time.monotonic() + seconds
    for port in prefill_ports(prefills):
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


def prefill_counters(prefills: int) -> dict[str, float]:
    """Each prefill's own hand-off counters, summed (its /metrics: role="prefill" series)."""
    ports = prefill_ports(prefills)
    totals: dict[str, float] = {}
    for port in ports:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
        for name in ("kv_handoff_tokens_total", "kv_handoff_reused_tokens_total"):
            pattern = rf'^epd:{name}\{{[^}}]*role="prefill"[^}}]*\}} (\S+)$'
            totals[name] = totals.get(name, 0.0) + sum(map(float, re.findall(pattern, text, re.M)))
    return totals


def trace_run(checkpoint: Path, name: str, flags: list[str], out: Path, seed: int) -> dict:
    process = serve(checkpoint, flags, out / f"{slug(name)}-{seed}.log")
    try:
        path = out / f"{slug(name)}-{seed}.json"
        wait_for_prefills(int(flags[1]))
        summary = bench(f"http://127.0.0.1:{PORT}/v1", path, seed, **TRACE)
        counters = prefill_counters(int(flags[1]))
    finally:
        stop(process)
    requests = json.loads(path.read_text())["requests"]
    new = sum(r["prompt_tokens"] - r["cached_tokens"] for r in requests if not r["error"])
    sent = counters["kv_handoff_tokens_total"]  # rows sent: those decode held are not counted
    return {
        "cached": summary["cached_prompt_share"],
        "shares": summary["prefill_share"],
        "kv_per_new": sent / new if new else 0.0,
        "ttft": summary["ttft_ms"].get("p50", 0.0),
        "tok_s": summary["output_throughput"],
        "failed": summary["failed"],
        "counters": counters,
        "new_tokens": new,
    }


VLLM = "vLLM, one instance"


def vllm_trace_run(checkpoint: Path, venv: Path, out: Path, seed: int) -> dict:
    """The same trace through one vLLM (its CPU build, prefix caching on, as by default), what a
    user would run instead of one prefill: its usage reports the cached prompt tokens."""
    copy = vllm_copy(checkpoint, venv)
    command = [str(venv / "bin" / "vllm"), "serve", str(copy), "--dtype", "float32"]
    command += ["--trust-remote-code", "--port", str(PORT), "--enable-prompt-tokens-details"]
    url = f"http://127.0.0.1:{PORT}/v1"
    process = start(command, url, out / f"vllm-{seed}.log", VLLM_ENV)
    try:
        summary = bench(url, out / f"vllm-{seed}.json", seed, **TRACE)
    finally:
        stop(process)
    return {
        "cached": summary["cached_prompt_share"],
        "shares": {},
        "kv_per_new": 0.0,
        "ttft": summary["ttft_ms"].get("p50", 0.0),
        "tok_s": summary["output_throughput"],
        "failed": summary["failed"],
    }


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def trace(checkpoint: Path, rounds: int, out: Path, venv: Path | None) -> None:
    results: dict[str, list[dict]] = {name: [] for name in SETUPS}
    if venv is not None:
        results[VLLM] = []
    for seed in range(rounds):
        for name, flags in SETUPS.items():
            results[name].append(trace_run(checkpoint, name, flags, out, seed))
            print(name, seed, results[name][-1], flush=True)
        if venv is not None:
            results[VLLM].append(vllm_trace_run(checkpoint, venv, out, seed))
            print(VLLM, seed, results[VLLM][-1], flush=True)
    ideal = statistics.median(r["cached"] for r in results["one prefill (ideal)"])
    print(
        "\n| setup | prompt tokens from cache | ÷ ideal | requests per prefill | "
        "KV rows handed ÷ tokens prefilled | TTFT p50 (ms) | output tok/s | failed |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        cached = statistics.median(r["cached"] for r in runs)
        shares = " / ".join("-".join(f"{v:.0%}" for v in r["shares"].values()) or "-" for r in runs)
        print(
            f"| {name} | {cached:.1%} | {cached / ideal:.2f} | {shares} | "
            f"{statistics.median(r['kv_per_new'] for r in runs):.2f} | "
            f"{statistics.median(r['ttft'] for r in runs):.0f} | "
            f"{statistics.median(r['tok_s'] for r in runs):.1f} | "
            f"{sum(r['failed'] for r in runs)} |"
        )


def lockstep_round(checkpoint: Path, seed: int, out: Path) -> list[dict[str, float]]:
    """One fresh fleet; each turn of the 16 conversations at once: its new tokens and the KV
    rows its hand-offs carried."""
    from epd.bench.config import BenchConfig
    from epd.bench.workload import conversations

    settings = {k: v for k, v in TRACE.items() if k not in ("concurrency", "warmup")}
    config = BenchConfig(seed=seed, ignore_eos=True, **settings)
    chats = conversations(config, "epd", TRACE["requests"])
    process = serve(checkpoint, SETUPS["cache-aware"], out / f"turns-{seed}.log")
    rows = []
    try:
        wait_for_prefills(2)  # the router is up once one is; the counters need both
        models = urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v1/models").read()
        model = json.loads(models)["data"][0]["id"]
        for turn in range(TRACE["turns"]):
            before = prefill_counters(2)
            bodies = [chat[turn] | {"stream": False, "model": model} for chat in chats]
            for body in bodies:
                body.pop("stream_options", None)
            with ThreadPoolExecutor(len(bodies)) as pool:
                usages = list(pool.map(ask, bodies))
            after = prefill_counters(2)
            new = sum(u["prompt_tokens"] - cached(u) for u in usages)
            sent = after["kv_handoff_tokens_total"] - before["kv_handoff_tokens_total"]
            reused = after["kv_handoff_reused_tokens_total"]
            reused -= before["kv_handoff_reused_tokens_total"]
            rows.append({"turn": turn + 1, "new": new, "sent": sent, "reused": reused})
            print(seed, rows[-1], flush=True)
    finally:
        stop(process)
    return rows


def ask(body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{PORT}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())["usage"]


def cached(usage: dict[str, Any]) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def turns(checkpoint: Path, rounds: int, out: Path) -> None:
    runs = [lockstep_round(checkpoint, seed, out) for seed in range(rounds)]
    print("\n| turn | new tokens (per round) | KV rows handed | ÷ new tokens | rows decode held |")
    print("|---|---|---|---|---|")
    for turn in range(TRACE["turns"]):
        got = [run[turn] for run in runs]

        def cells(key: str, got: list[dict[str, float]] = got) -> str:
            return ", ".join(f"{g[key]:.0f}" for g in got)

        ratios = ", ".join(f"{g['sent'] / g['new']:.2f}" for g in got)
        print(f"| {turn + 1} | {cells('new')} | {cells('sent')} | {ratios} | {cells('reused')} |")
    later = [sum(r["sent"] for r in run[1:]) / sum(r["new"] for r in run[1:]) for run in runs]
    print(f"\nlater turns, KV rows handed ÷ new tokens: {', '.join(f'{x:.2f}' for x in later)}")


def overhead(checkpoint: Path, rounds: int, out: Path) -> None:
    # No prefix cache: the side that runs second must not find the first one's prompts cached.
    # Every loopback address: the router reaches it as 127.0.0.1 and as 127.0.0.2 (below).
    flags = ["--no-enable-prefix-caching", "--host", "0.0.0.0"]
    backend = serve(checkpoint, flags, out / "overhead-serve.log")
    route_port = PORT + 1
    command = [sys.executable, "-m", "epd.cli", "route", str(checkpoint), "--port", str(route_port)]
    # The one prefill under two names: two prefills to the router, so that it names every
    # request's blocks and weighs them, its whole path.
    urls_given = [f"http://127.0.0.1:{PORT}", f"http://127.0.0.2:{PORT}"]
    command += ["--prefill-urls", *urls_given, "--kv-events-bind", ""]
    urls = {
        "straight": f"http://127.0.0.1:{PORT}/v1",
        "router": f"http://127.0.0.1:{route_port}/v1",
    }
    router = start(command, urls["router"], out / "overhead-route.log")
    ratios: dict[str, dict[str, list[float]]] = {row: {"ttft": [], "tpot": []} for row in STREAMS}
    try:
        for seed in range(rounds):
            for row, settings in STREAMS.items():
                got = {}
                order = ("straight", "router") if seed % 2 == 0 else ("router", "straight")
                for side in order:
                    path = out / f"overhead-{slug(row)}-{side}-{seed}.json"
                    got[side] = bench(urls[side], path, seed, **settings)
                for key, field in (("ttft", "ttft_ms"), ("tpot", "tpot_ms")):
                    through, direct = got["router"][field]["p50"], got["straight"][field]["p50"]
                    ratios[row][key].append(through / direct)
                print(row, seed, {k: v[-1] for k, v in ratios[row].items()}, flush=True)
    finally:
        stop(router)
        stop(backend)
    print("\n| streams | TTFT p50 through ÷ straight (per round) | TPOT p50 through ÷ straight |")
    print("|---|---|---|")
    for row, got in ratios.items():
        cells = [
            f"{statistics.median(v):.3f} ({', '.join(f'{x:.2f}' for x in v)})"
            for v in (got["ttft"], got["tpot"])
        ]
        print(f"| {row} | {cells[0]} | {cells[1]} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    demo = HERE.parent / "checkpoints" / "kimi-vl-shapes"
    parser.add_argument("--checkpoint", type=Path, default=demo)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench-fleet"))
    parser.add_argument("--only", default="trace,turns,overhead")
    parser.add_argument(
        "--vllm-venv", type=Path, default=Path("/work/vllm/venv"), help="where it is: a trace row"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if "trace" in args.only:
        venv = args.vllm_venv if args.vllm_venv.exists() else None
        trace(args.checkpoint.resolve(), args.rounds, args.out.resolve(), venv)
    if "turns" in args.only:
        turns(args.checkpoint.resolve(), args.rounds, args.out.resolve())
    if "overhead" in args.only:
        overhead(args.checkpoint.resolve(), args.rounds, args.out.resolve())


if __name__ == "__main__":
    main()
