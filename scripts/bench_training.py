"""Training speed of the demo model on this machine, in one process and in worker processes.

Trains the shapes model from scratch for --steps steps of the full question mix (no first
stage), once per worker count, and prints seconds per step. Not a test: the results belong in
docs/shapes-training.md.

    python scripts/bench_training.py --steps 300 --workers 1 2
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import torch

from shapes.train import Run, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}")
    for workers in args.workers:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            state = Path(tmp) / "state.pt"
            train(Run(Path(tmp) / "out", args.steps, args.batch_size, 5e-4, 0, state), workers)
            seconds = time.perf_counter() - start
        print(f"workers {workers}: {seconds / args.steps * 1000:.0f} ms/step ({seconds:.0f} s)")


if __name__ == "__main__":
    main()
