"""The `epd` command: one subcommand per process, plus `serve`, `bench`, `plan`,
`make-checkpoint` and `keys`."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import sys
from collections.abc import Callable
from typing import Any

from epd.checkpoint.config import CheckpointError
from epd.config.roles import ROLES
from epd.config.sources import (
    add_child_flags,
    add_flags,
    build,
    child_settings,
    flag_values,
    resolve,
)
from epd.config.vllm import add_compatible_flags
from epd.dtypes import MODEL_DTYPES, tensor_dtype

# make-checkpoint's choices, spelt here so that `epd --help` imports no tokenizer library
# (tests/test_cli.py checks them against synthetic_tokenizer.LAYOUTS and published.PUBLISHED).
TOKENIZER_LAYOUTS = ("appended", "inside", "tiktoken", "wordpiece")
PUBLISHED_NAMES = ("Kimi-VL-A3B-Instruct", "Kimi-VL-A3B-Thinking", "Kimi-VL-A3B-Thinking-2506")
HELP = {
    "encode": "run the vision tower: images in, embeddings out",
    "prefill": "run the OpenAI API and the prefill of the language model",
    "decode": "run continuous-batching decode from KV hand-offs",
    "route": "run the OpenAI API in front of several prefills, sending each request where its "
    "prefix is cached",
    "serve": "start encode, prefill and decode here and supervise them",
}


def runner(role: str) -> Callable[[Any], None]:
    """Import a role's entry point only when it runs: each pulls in its own heavy modules."""
    if role == "encode":
        from epd.encode import server as encode

        return encode.run
    if role == "prefill":
        from epd.api import server as prefill

        return prefill.run
    if role == "route":
        from epd.route import keep_torch_out

        keep_torch_out()  # before the tokenizer's imports
        from epd.route import server as route

        return route.run
    from epd.decode import server as decode

    return decode.run


def role_command(args: argparse.Namespace) -> None:
    from epd.checkpoint.hub import on_disk

    if args.command == "serve":
        from epd import serve

        serve.run(*serve.plan(args))
    else:
        runner(args.command)(on_disk(resolve(ROLES[args.command], args.command, args)))


def bench_command(args: argparse.Namespace) -> None:
    from epd.bench.config import BenchConfig
    from epd.bench.runner import main as bench

    summary = bench(build(BenchConfig, flag_values(args, BenchConfig)))
    if not summary.completed:
        sys.exit("epd bench: no request completed")


def bench_plot_command(args: argparse.Namespace) -> None:
    from epd.bench.plot import plot

    plot(args.runs, args.out)
    print(f"wrote {args.out}")


def make_checkpoint_command(args: argparse.Namespace) -> None:
    from epd.checkpoint.published import make_published
    from epd.checkpoint.synthetic import make_checkpoint

    if args.like:
        out = make_published(args.out, args.like, args.layers, seed=args.seed, shards=args.shards)
        print(f"wrote a random checkpoint like {args.like}, {args.layers} layers, to {out}")
        return
    out = make_checkpoint(
        args.out,
        args.preset,
        seed=args.seed,
        q_lora_rank=args.q_lora_rank,
        shards=args.shards,
        dtype=tensor_dtype(args.dtype),
        device=args.device,
        tokenizer=args.tokenizer,
        inv_freq=args.rope_buffers,
    )
    print(f"wrote a random {args.preset} Kimi-VL checkpoint to {out}")


def plan_command(args: argparse.Namespace) -> None:
    from epd.plan import PlanConfig, main

    result = main(build(PlanConfig, flag_values(args, PlanConfig)))
    if result.problems:
        sys.exit(1)


def keys_command(args: argparse.Namespace) -> None:
    from epd.wire.curve import make_keys

    folder = make_keys(args.out, args.if_missing)
    print(
        f"wrote ZeroMQ CURVE keys to {folder}: copy the directory to every node, keep it "
        "private, and pass --zmq-curve-keys to every process"
    )


class Parser(argparse.ArgumentParser):
    """The `epd` command's parser: an argument its subcommand does not know is that
    subcommand's error, shown with its usage (`epd serve: error: ...`), not the top level's."""

    subcommands: dict[str, argparse.ArgumentParser]

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            where = self.subcommands.get(getattr(parsed, "command", ""), self)
            where.error(f"unrecognized arguments: {' '.join(unknown)}")
        return parsed


def parser() -> Parser:
    root = Parser(prog="epd", description="Encode/prefill/decode serving for Kimi-VL")
    root.add_argument(
        "--version", action="version", version=f"%(prog)s {importlib.metadata.version('epd')}"
    )
    commands = root.add_subparsers(dest="command", required=True)
    for role, config_class in ROLES.items():
        sub = commands.add_parser(role, help=HELP[role])
        sub.add_argument(  # vLLM's form: `vllm serve MODEL`
            "model_path",
            nargs="?",
            default=argparse.SUPPRESS,
            metavar="MODEL",
            help="checkpoint directory, as --model",
        )
        add_flags(sub, config_class)
        settings = {f.name for f in dataclasses.fields(config_class)}
        if role == "serve":
            add_child_flags(sub)
            settings |= child_settings().keys()
        add_compatible_flags(sub, settings)
        sub.set_defaults(run=role_command)
    from epd.bench.config import BenchConfig

    bench = commands.add_parser("bench", help="load an OpenAI-compatible server and time it")
    add_flags(bench, BenchConfig, config_file=False)
    bench.set_defaults(run=bench_command)
    from epd.plan import PlanConfig

    planner = commands.add_parser(
        "plan", help="how many encoders, prefills and decoders a workload needs, from measurements"
    )
    add_flags(planner, PlanConfig, config_file=False)
    planner.set_defaults(run=plan_command)
    plot = commands.add_parser("bench-plot", help="plot latency against load from bench JSONs")
    plot.add_argument("runs", nargs="+", help="JSON files written by epd bench --json")
    plot.add_argument("-o", "--out", default="bench.png", help="image to write")
    plot.set_defaults(run=bench_plot_command)
    make = commands.add_parser(
        "make-checkpoint", help="write a random Kimi-VL checkpoint in the real Hugging Face layout"
    )
    make.add_argument("out", help="directory to write")
    make.add_argument("--preset", choices=["tiny", "small", "a3b"], default="tiny")
    make.add_argument("--dtype", choices=MODEL_DTYPES, default="float32")
    make.add_argument("--device", default="cpu", help="where to draw the weights (e.g. cuda)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--q-lora-rank", type=int, default=None, help="use q_a/q_b projections")
    make.add_argument(
        "--tokenizer",
        choices=TOKENIZER_LAYOUTS,
        default="appended",
        help="the tokenizer's layout: tokenizer.json with the special tokens appended or inside "
        "the vocabulary, Kimi-VL's tiktoken files, or WordPiece (no grammar engine)",
    )
    make.add_argument("--shards", type=int, default=2, help="weight files (1: model.safetensors)")
    make.add_argument(
        "--rope-buffers", action="store_true", help="save rotary_emb.inv_freq, as some do"
    )
    make.add_argument(
        "--like",
        choices=PUBLISHED_NAMES,
        help="in the likeness of a published checkpoint: its config, widths and tokenizer "
        "(the preset, dtype and tokenizer flags do not apply)",
    )
    make.add_argument("--layers", type=int, default=2, help="with --like: its depth")
    make.set_defaults(run=make_checkpoint_command)
    keys = commands.add_parser(
        "keys", help="make the ZeroMQ CURVE keys that let processes in, for --zmq-curve-keys"
    )
    keys.add_argument("out", help="directory to write (created, readable by its owner only)")
    keys.add_argument(
        "--if-missing", action="store_true", help="keep the keys already there (no error)"
    )
    keys.set_defaults(run=keys_command)
    root.subcommands = dict(commands.choices)
    return root


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        args.run(args)
    except (CheckpointError, ValueError) as e:
        sys.exit(f"epd {args.command}: error: {e}")


if __name__ == "__main__":
    main()
