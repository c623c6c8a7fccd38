"""epd's model core beside vLLM's engine, in process, on the same checkpoint and machine.

    .venv/bin/python scripts/bench_forward.py [--rounds 3] [--checkpoint DIR]
        [--vllm-venv /work/vllm/venv] [--profile DIR]

What the serving benchmark (`scripts/bench_serving.py`) cannot separate: how much of a gap is
the model's own arithmetic and how much the serving around it. Each round runs both sides in
fresh processes, one after the other, the first side alternating: epd's prefill forward of a
240- and a 1,024-token prompt (and the last token's logits) and its decode step at 1 and 16
rows over ~300-token caches in a `BlockPool`, as its roles run them, and the forward of 176
new tokens after a 2,304-token past that a prefix cache holds (a conversation's next turn);
vLLM's one-token generations of the same lengths (the last one after a prefix cache hit) and
its time per output token at 1 and 16 requests (`scripts/vllm/forward.py`). Both in float32
on every core. Prints each side's median over the rounds and the median of the rounds' ratios
(epd ÷ vLLM). vLLM's times are its engine's whole step (scheduling, sampling, the hand-offs
between its processes) where epd's are the forward alone, so the ratios lean in epd's favour;
--profile writes both sides' torch op tables into DIR, where vLLM's forward alone can be read.
Not a test, never in CI.
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

import torch

from epd.checkpoint.synthetic import make_checkpoint
from epd.checkpoint.weights import load_model
from epd.runtime.process import reuse_freed_memory

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_model import best_seconds, decode_step_seconds  # noqa: E402  (scripts beside this one)
from bench_serving import VLLM_ENV, vllm_copy  # noqa: E402

PROMPT_LENGTHS = (240, 1024)
BATCHES = (1, 16)
CONTEXT = 300  # decode's cache rows: vLLM's requests hold 240-305 while they decode
CACHED_PAST, CACHED_NEW = 2304, 176  # a next turn: new tokens after a cached prefix


def epd_side(checkpoint: Path, profile: Path | None) -> dict[str, dict[int, float]]:
    """epd's prefill forward (best of 5) and decode step (median of 40), in milliseconds."""
    lm = load_model(checkpoint, role="language").language_model
    vocab = lm.config.vocab_size

    def prefill(tokens: int, past: int = 0) -> float:
        """The forward of `tokens` new tokens after `past` whose rows are given, as a prefix
        cache hit gives them: only the new tokens are computed."""
        pasts = [lm.prefill(lm.embed(torch.randint(0, vocab, (past,))))[1]] if past else None
        embeds = lm.embed(torch.randint(0, vocab, (tokens,)))
        return best_seconds(lambda: lm.logits(lm.prefill(embeds, pasts=pasts)[0][-1]), 5)

    with torch.inference_mode():
        result = {
            "prefill": {n: prefill(n) for n in PROMPT_LENGTHS},
            "decode": {b: decode_step_seconds(lm, b, CONTEXT, 40) for b in BATCHES},
            "cached": {CACHED_NEW: prefill(CACHED_NEW, CACHED_PAST)},
        }
        if profile is not None:
            with torch.profiler.profile() as recorded:
                prefill(PROMPT_LENGTHS[0])
                decode_step_seconds(lm, 1, CONTEXT, 64)
            table = recorded.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
            (profile / "epd.txt").write_text(table)
    return {part: {k: round(s * 1e3, 2) for k, s in t.items()} for part, t in result.items()}


def run_side(
    side: str, checkpoint: Path, copy: Path, venv: Path, profile: Path | None
) -> dict[str, Any]:
    """One side in a fresh process (vLLM's on `copy`, the checkpoint as it serves it): its
    JSON line."""
    flags = ["--profile", str(profile)] if profile else []
    if side == "epd":
        command = [sys.executable, __file__, "--side", "epd", "--checkpoint", str(checkpoint)]
        env = None
    else:
        command = [str(venv / "bin" / "python"), str(HERE / "vllm" / "forward.py"), str(copy)]
        env = os.environ | VLLM_ENV
    done = subprocess.run([*command, *flags], check=True, capture_output=True, text=True, env=env)
    # vLLM logs to stdout as well: the result is the line that starts the JSON object
    line = next(x for x in reversed(done.stdout.splitlines()) if x.startswith('{"prefill"'))
    result: dict[str, Any] = json.loads(line)
    return result


def table(rounds: list[dict[str, dict[str, Any]]]) -> str:
    lines = [
        "| step | epd ms: the forward | vLLM ms: its engine's step | epd ÷ vLLM (rounds' median) |",
        "|---|---|---|---|",
    ]
    for part, keys, what in (
        ("prefill", PROMPT_LENGTHS, "prefill, {}-token prompt"),
        ("decode", BATCHES, "decode step, {} rows"),
        ("cached", (CACHED_NEW,), f"prefill, {{}} tokens after {CACHED_PAST:,} cached"),
    ):
        for key in keys:
            epd = [r["epd"][part][str(key)] for r in rounds]
            vllm = [r["vllm"][part][str(key)] for r in rounds]
            ratio = statistics.median(e / v for e, v in zip(epd, vllm, strict=True))
            lines.append(
                f"| {what.format(key)} | {statistics.median(epd):.1f} | "
                f"{statistics.median(vllm):.1f} | {ratio:.2f}× |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--checkpoint", type=Path, help="default: make the small one, seed 3")
    parser.add_argument("--vllm-venv", type=Path, default=Path("/work/vllm/venv"))
    parser.add_argument("--profile", type=Path, help="a directory for both sides' profiles")
    parser.add_argument("--side", choices=["epd"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side == "epd":  # a round's epd process, its memory kept as a served role's
        reuse_freed_memory()
        print(json.dumps(epd_side(args.checkpoint, args.profile)))
        return
    small = Path("bench-results") / "small"
    checkpoint = (args.checkpoint or make_checkpoint(small, "small", seed=3)).resolve()
    copy = vllm_copy(checkpoint, args.vllm_venv)  # made once, for every round
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    rounds = []
    for index in range(args.rounds):
        order = ("epd", "vllm") if index % 2 == 0 else ("vllm", "epd")
        started = time.strftime("%H:%M:%S")
        result = {
            side: run_side(
                side, checkpoint, copy, args.vllm_venv, args.profile if index == 0 else None
            )
            for side in order
        }
        print(f"round {index + 1} ({started}, {order[0]} first): {json.dumps(result)}")
        rounds.append(result)
    print(table(rounds))


if __name__ == "__main__":
    main()
