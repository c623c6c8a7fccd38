"""The `epd` command: one subcommand per process, plus `serve` and `make-checkpoint`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from epd.checkpoint.config import CheckpointError
from epd.config import DecodeConfig, EncodeConfig, PrefillConfig, ServeConfig, add_flags, from_args


def make_checkpoint_command(args: argparse.Namespace) -> None:
    from epd.checkpoint.synthetic import make_checkpoint

    out = make_checkpoint(args.out, args.preset, seed=args.seed, q_lora_rank=args.q_lora_rank)
    print(f"wrote a random {args.preset} Kimi-VL checkpoint to {out}")


def role_command(
    config_class: type, runner: Callable[[], Callable[[Any], None]]
) -> Callable[..., None]:
    def command(args: argparse.Namespace) -> None:
        runner()(from_args(config_class, args))

    return command


def _encode() -> Callable[[Any], None]:
    from epd.encode.server import run

    return run


def _prefill() -> Callable[[Any], None]:
    from epd.prefill.server import run

    return run


def _decode() -> Callable[[Any], None]:
    from epd.decode.server import run

    return run


def _serve() -> Callable[[Any], None]:
    from epd.serve import run

    return run


ROLES = {
    "encode": (EncodeConfig, _encode, "run the vision tower: images in, embeddings out"),
    "prefill": (
        PrefillConfig,
        _prefill,
        "run the OpenAI API and the prefill of the language model",
    ),
    "decode": (DecodeConfig, _decode, "run continuous-batching decode from KV hand-offs"),
    "serve": (ServeConfig, _serve, "start encode, prefill and decode here and supervise them"),
}


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="epd", description="Encode/prefill/decode serving for Kimi-VL"
    )
    commands = root.add_subparsers(dest="command", required=True)
    for name, (config_class, runner, help_text) in ROLES.items():
        sub = commands.add_parser(name, help=help_text)
        add_flags(sub, config_class)
        sub.set_defaults(run=role_command(config_class, runner))
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
