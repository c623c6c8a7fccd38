"""Two epd trees side by side (say main and a change), on the same checkpoint, machine and client.

    .venv/bin/python scripts/bench_commits.py BASE_TREE [--tree .] [--checkpoint DIR]
        [--rows text-c1,image-c1] [--rounds 3] [--out bench-commits]

BASE_TREE is another checkout of epd (`git worktree add ../base main`). Each tree's `epd serve`
runs from its own sources (PYTHONPATH), both up at once, with the `bench_serving.py` workloads
run interleaved as there (the first side alternating by round). Prints per row each side's
median output tokens/s, TTFT p50, TPOT p50 and ITL p99 and the median of the rounds' ratios
(tree ÷ base). The stack not being measured idles beside the other (under 0.03 of a core),
which the roles' judgement of idle cores sees. Not a test, never in CI.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_serving import ROWS, run_rows, start, stop, table  # noqa: E402

PORTS = {"base": (8310, 7500), "tree": (8311, 7600)}  # API port, internal base port


def serve(name: str, tree: Path, checkpoint: Path, out: Path) -> tuple[str, Any]:
    """`epd serve` from `tree`'s sources: its API's URL and its process."""
    port, internal = PORTS[name]
    command = [sys.executable, "-m", "epd.cli", "serve", str(checkpoint), "--dtype", "float32"]
    command += ["--port", str(port), "--internal-base-port", str(internal)]
    url = f"http://127.0.0.1:{port}/v1"
    # Run from the tree, with it on the path: `python -m` puts the working directory first, so
    # from any other checkout both sides would run that checkout's code.
    tree = tree.resolve()
    return url, start(command, url, out / f"{name}.log", {"PYTHONPATH": str(tree)}, cwd=tree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path, help="the other epd checkout")
    parser.add_argument("--tree", type=Path, default=HERE.parent)
    demo = HERE.parent / "checkpoints" / "kimi-vl-shapes"
    parser.add_argument("--checkpoint", type=Path, default=demo)
    parser.add_argument("--rows", default="text-c1,image-c1", help=f"of {', '.join(ROWS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench-commits"))
    args = parser.parse_args()
    args.out, args.checkpoint = args.out.resolve(), args.checkpoint.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    running: dict[str, tuple[str, Any]] = {}
    try:
        for name, tree in (("base", args.base), ("tree", args.tree)):
            running[name] = serve(name, tree, args.checkpoint, args.out)
        results = run_rows(running, args.rows.split(","), args.rounds, args.out)
    finally:
        for _, process in running.values():
            stop(process)
    print(table(results, ("tree", "base"), "tree / base"))
    print(f"\n(base {args.base}, tree {args.tree}; {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
