"""n-gram speculative decoding in epd's decode, measured: on against off, and beside vLLM's.

    .venv/bin/python scripts/bench_speculative.py [--out bench-speculative] [--rounds 2]
        [--checkpoint DIR] [--vllm-venv /work/vllm/venv]
        [--sides epd-off,epd-on,vllm-on[,vllm-off]]

The workload is one whose answers repeat text: the `small` checkpoint (random weights, made as
bench_serving.py makes it, unless one is given) decoding greedily (`epd bench` asks for
temperature 0) falls into loops, a few tokens said again and again, and every request runs to
its 128 tokens (ignore_eos), so the loops make up most of each answer. Prompt lookup (vLLM's
"ngram" method: the reply's last 2 to 5 tokens found earlier in the prompt or the reply, and
the 5 tokens after them proposed) catches them. Prompts are 90 random words, ~230 tokens with
the chat template.

Servers side by side on the same checkpoint: epd without and with `--speculative-config
SPECULATIVE` (below) and vLLM's CPU build (`scripts/vllm/setup.sh`) with the same flag; with
`--sides ...,vllm-off` vLLM without it too (3-4 minutes more). Each is warmed, then every round
runs 1 stream and 16 streams on each side back to back (bench_serving's rounds: the order
reverses from round to round, and each pair compared, epd on and off, epd and vLLM speculating,
vLLM on and off, is run one right after the other). Prints Markdown tables of the median over
rounds of output tokens/s, TTFT p50, TPOT p50 and ITL p99 and the median of the rounds' ratios
(epd on ÷ off, epd ÷ vLLM both speculating, vLLM on ÷ off), and each speculating side's
acceptance rate: accepted ÷ draft tokens, as its counters (`epd:` or
`vllm:spec_decode_num_*_total` on /metrics) grew over the warm-ups and the rounds. Where vLLM's
CPU build does not start with the flag, it says so and goes on without that side. The client is
`epd bench` for all. Every run's JSON and every server's log land in --out.
Not a test, never in CI: 10-13 minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from epd.checkpoint.synthetic import make_checkpoint
from epd.checkpoint.weights import load_model
from epd.kv.pool import BlockPool

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_serving  # noqa: E402  (a script beside this one)
from bench_serving import VLLM_ENV, run_rows, start, stop, table, vllm_copy  # noqa: E402

SPECULATIVE = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 5, "prompt_lookup_min": 2}
)
LOOPS = {"prompt_tokens": 90, "output_tokens": 128}
ROWS: dict[str, dict[str, Any]] = {
    "loops-c1": LOOPS | {"concurrency": 1, "requests": 6},
    "loops-c4": LOOPS | {"concurrency": 4, "requests": 12},
    "loops-c16": LOOPS | {"concurrency": 16, "requests": 32},
}
# The decode forward alone (`step_costs`): sequences of a step, and rows each (1 + drafts)
STEP_BATCHES, STEP_ROWS, STEP_CONTEXT = (1, 4, 16), (1, 3, 6), 300
# Each side's API port, in a round's order: the sides compared are neighbours in it.
SIDES = {"epd-off": 8330, "epd-on": 8331, "vllm-on": 8332, "vllm-off": 8333}
COMPARED = {  # a table's heading: its sides (first ÷ second) and their labels
    "epd, speculating ÷ not": (("epd-on", "epd-off"), "on / off"),
    "epd ÷ vLLM, both speculating": (("epd-on", "vllm-on"), "epd / vLLM"),
    "vLLM, speculating ÷ not": (("vllm-on", "vllm-off"), "on / off"),
}
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def serve(side: str, checkpoint: Path, copy: Path | None, venv: Path, out: Path) -> Any:
    """One side's server, once it answers; `copy` is vLLM's copy of the checkpoint."""
    port = SIDES[side]
    flags = ["--dtype", "float32", "--port", str(port)]
    if side.endswith("-on"):
        flags += ["--speculative-config", SPECULATIVE]
    url, log = f"http://127.0.0.1:{port}/v1", out / f"{side}.log"
    if side.startswith("epd"):
        command = [sys.executable, "-m", "epd.cli", "serve", str(checkpoint), *flags]
        internal = 7800 + 100 * list(SIDES).index(side)  # each uses N..N+30
        return start([*command, "--internal-base-port", str(internal)], url, log)
    command = [str(venv / "bin" / "vllm"), "serve", str(copy), "--trust-remote-code", *flags]
    return start(command, url, log, VLLM_ENV)


@torch.inference_mode()
def step_costs(checkpoint: Path) -> str:
    """A Markdown table: the decode forward alone, in this process, before any server starts,
    for B sequences of STEP_CONTEXT tokens each feeding 1 + k rows (a verify step), its median
    ms over 15 steps and ÷ the same B at one row: what verifying drafts costs the model."""
    torch.set_num_threads(os.cpu_count() or 2)
    lm = load_model(checkpoint, role="language").language_model
    config = lm.config
    pool = BlockPool(
        config.num_hidden_layers,
        config.latent_dim,
        torch.device("cpu"),
        lm.lm_head.weight.dtype,
        64 * 1024,
    )
    reader = lm.block_reader()
    lines = [
        "| sequences | " + " | ".join(f"{r} rows each" for r in STEP_ROWS) + " |",
        "|---" * (1 + len(STEP_ROWS)) + "|",
    ]
    for batch in STEP_BATCHES:
        tables = [pool.table() for _ in range(batch)]
        for cache in tables:
            pool.write(
                cache, torch.randn(config.num_hidden_layers, STEP_CONTEXT, config.latent_dim)
            )
        cells, one = [], 0.0
        for rows in STEP_ROWS:
            times = []
            for _ in range(15):
                for cache in tables:
                    pool.make_room(cache, rows)
                paged = reader.batch(pool.storage, tables, pool.max_bytes, [rows] * batch)
                ids = torch.randint(0, config.vocab_size, (rows * batch,))
                start = time.perf_counter()
                lm.logits(lm.decode(ids, paged))
                times.append(time.perf_counter() - start)
                paged.keep([1] * batch)
                for cache in tables:  # back to where it began: the same context each step
                    pool.truncate(cache, STEP_CONTEXT)
            ms = 1000 * statistics.median(times)
            one = one or ms
            cells.append(f"{ms:.1f} ms ({ms / one:.2f}×)")
        lines.append(f"| {batch} | " + " | ".join(cells) + " |")
        for cache in tables:
            pool.release(cache)
        reader.forget()
    return "\n".join(lines)


def counters(side: str) -> dict[str, float]:
    """A side's speculative-decoding counters (`epd:` or `vllm:spec_decode_*_total`), each
    summed over its series; those its /metrics does not show are missing."""
    url = f"http://127.0.0.1:{SIDES[side]}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    found = {}
    for name in COUNTERS:
        pattern = rf"^{prefix(side)}:spec_decode_{name}_total(?:\{{[^}}]*\}})? (\S+)$"
        if values := re.findall(pattern, text, re.M):
            found[name] = sum(map(float, values))
    return found


def acceptance(side: str, before: dict[str, float], after: dict[str, float]) -> str:
    """A table row: the counters' growth, accepted ÷ draft tokens, and the tokens a step that
    drafted made (1 + accepted ÷ drafts, vLLM's mean acceptance length)."""
    if set(after) != set(COUNTERS):
        return f"| {side} | no `{prefix(side)}:spec_decode_*_total` counters on /metrics | | | | |"
    drafts, tokens, accepted = (after[k] - before.get(k, 0.0) for k in COUNTERS)
    rate = f"{accepted / tokens:.1%}" if tokens else "no draft tokens"
    per_step = f"{1 + accepted / drafts:.2f}" if drafts else "-"
    return f"| {side} | {drafts:.0f} | {tokens:.0f} | {accepted:.0f} | {rate} | {per_step} |"


def start_all(
    sides: list[str], checkpoint: Path, copy: Path | None, venv: Path, out: Path, stack: ExitStack
) -> dict[str, tuple[str, Any]]:
    """The sides' servers, one after another (at once is no faster on two cores), by side: their
    API's URL and their process, each stopped as `stack` closes. vLLM speculating is left out,
    saying why, where it does not start."""
    running: dict[str, tuple[str, Any]] = {}
    for side in sides:
        try:
            process = serve(side, checkpoint, copy, venv, out)
        except RuntimeError:
            if side != "vllm-on":
                raise
            print(
                f"vLLM's CPU build ({venv}) did not start with --speculative-config "
                f"{SPECULATIVE}; it is left out. The end of {out / 'vllm-on.log'}:\n"
                + tail(out / "vllm-on.log"),
                flush=True,
            )
            continue
        stack.callback(stop, process)
        running[side] = (f"http://127.0.0.1:{SIDES[side]}/v1", process)
    return running


def prefix(side: str) -> str:
    return side.split("-")[0]  # epd or vllm, as its metrics' names begin


def tail(log: Path, lines: int = 4) -> str:
    """A log's last lines, indented."""
    kept = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return "\n".join("    " + line for line in kept[-lines:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-speculative"))
    parser.add_argument("--checkpoint", type=Path, help="default: make the small one, seed 3")
    parser.add_argument("--vllm-venv", type=Path, default=Path("/work/vllm/venv"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sides", default="epd-off,epd-on,vllm-on", help=f"of {', '.join(SIDES)}")
    args = parser.parse_args()
    if unknown := set(args.sides.split(",")) - set(SIDES):
        parser.error(f"unknown sides {sorted(unknown)}; choose from {', '.join(SIDES)}")
    sides = [side for side in SIDES if side in args.sides.split(",")]  # in a round's order
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    checkpoint = (args.checkpoint or make_checkpoint(out / "small", "small", seed=3)).resolve()
    copy = vllm_copy(checkpoint, args.vllm_venv) if any("vllm" in s for s in sides) else None
    bench_serving.ROWS.update(ROWS)  # run_rows finds its workloads there, by name
    costs = step_costs(checkpoint)
    print(f"the decode forward alone, k drafts a sequence ({checkpoint.name}):\n\n{costs}\n")
    with ExitStack() as stack:  # every server stopped, however this ends
        running = start_all(sides, checkpoint, copy, args.vllm_venv, out, stack)
        before = {side: counters(side) for side in running}
        results = run_rows(running, list(ROWS), args.rounds, out)
        after = {side: counters(side) for side in running}
    record = {"runs": results, "counters": {"before": before, "after": after}, "steps": costs}
    (out / "summary.json").write_text(json.dumps(record, indent=1))
    print(f"\nspeculative config: {SPECULATIVE}; workload: {json.dumps(ROWS)}")
    for heading, (pair, labels) in COMPARED.items():
        if set(pair) <= set(running):
            print(f"\n{heading}:\n\n{table(results, pair, labels)}")
    if speculating := [side for side in running if side.endswith("-on")]:
        print(
            "\nacceptance over the warm-ups and every round (tokens/step: 1 + accepted ÷ drafts):\n"
        )
        heads = ("side", "drafts", "draft tokens", "accepted", "acceptance rate", "tokens/step")
        print("| " + " | ".join(heads) + " |\n" + "|---" * len(heads) + "|")
        for side in speculating:
            print(acceptance(side, before[side], after[side]))


if __name__ == "__main__":
    main()
