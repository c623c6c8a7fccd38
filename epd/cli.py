"""The `epd` command."""

from __future__ import annotations

import argparse
import sys

from epd.checkpoint.config import CheckpointError


def make_checkpoint_command(args: argparse.Namespace) -> None:
    from epd.checkpoint.synthetic import make_checkpoint

    out = make_checkpoint(args.out, args.preset, seed=args.seed, q_lora_rank=args.q_lora_rank)
    print(f"wrote a random {args.preset} Kimi-VL checkpoint to {out}")


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="epd", description=__doc__)
    commands = root.add_subparsers(dest="command", required=True)
    make = commands.add_parser(
        "make-checkpoint", help="write a random Kimi-VL checkpoint in the real Hugging Face layout"
    )
    make.add_argument("out", help="directory to write")
    make.add_argument("--preset", choices=["tiny", "small"], default="tiny")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--q-lora-rank", type=int, default=None, help="use q_a/q_b projections")
    make.set_defaults(run=make_checkpoint_command)
    return root


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        args.run(args)
    except (CheckpointError, ValueError) as e:
        sys.exit(f"epd {args.command}: error: {e}")


if __name__ == "__main__":
    main()
