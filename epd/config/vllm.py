"""vLLM's spellings of epd's settings, so that a `vllm serve` command line starts `epd serve`.

A field of a role's dataclass names the vLLM flag it stands for (`option(..., vllm=...)`);
`sources` makes that flag an alias of epd's own, and the README's table shows it. The few
values vLLM writes otherwise than epd are read here (`32k`, `half`, `image=4`), and the vLLM
flags no setting stands for are accepted where they ask for what epd does anyway, or refused
with what epd does instead (`ACCEPTED`, `REFUSED`).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VllmFlag:
    """The vLLM flag a setting stands for, and how to read its value where vLLM's form is not
    epd's (`parse`, and `form` in words; None: the same form, so the flag is another name)."""

    name: str
    parse: Callable[[str], Any] | None = None
    form: str = ""


def image_limit(text: str) -> int:
    """`--limit-mm-per-prompt` as epd's images per request: `image=N` (as in Kimi-VL's
    recipe, `,video=0` and so on beside it) or vLLM's JSON form `{"image": N}`."""
    try:
        limits = json.loads(text) if text.lstrip().startswith("{") else pairs(text)
    except ValueError:
        limits = None
    if not isinstance(limits, dict):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not image=N or a JSON object such as '{{\"image\": 16}}'"
        )
    others = {k: v for k, v in limits.items() if k != "image" and v != 0}
    if others:
        raise argparse.ArgumentTypeError(f"epd takes images only, not {others}")
    count = limits.get("image")
    if type(count) is not int:
        raise argparse.ArgumentTypeError(f"{text!r} gives no whole number of images")
    return count


def pairs(text: str) -> dict[str, int]:
    """`image=16,video=2` as a mapping; ValueError where it is not that form."""
    found = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(item)
        found[key.strip()] = int(value)
    return found


DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def readable_int(text: str) -> int:
    """A count as vLLM writes it: 32768, or with a suffix: lower case is decimal (`32k` is
    32,000, `1.5k` 1,500), upper case binary (`32K` 32,768, `1M` 1,048,576, whole numbers);
    `auto` or -1 (vLLM's automatic length) is epd's automatic 0."""
    if text.strip() in ("auto", "-1"):
        return 0
    match = re.fullmatch(r"(-?\d+(?:\.\d+)?)([kmgtKMGT]?)", text.strip())
    number, suffix = match.groups() if match else ("", "")
    if match and suffix in DECIMAL:
        return int(float(number) * DECIMAL[suffix])
    if match and "." not in number:
        return int(number) * BINARY.get(suffix, 1)
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a whole number such as 32768, 32k (32,000) or 32K (32,768)"
    )


DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's other names


def dtype_name(text: str) -> str:
    """`--dtype` as epd names it: vLLM's `half` is float16 and `float` float32."""
    return DTYPE_ALIASES.get(text, text)


@dataclass(frozen=True)
class Accepted:
    """A vLLM flag that asks for what epd does anyway: a switch, or one of `values`."""

    names: tuple[str, ...]
    why: str
    values: tuple[str, ...] = ()


@dataclass(frozen=True)
class Refused:
    """A vLLM flag for something epd does not do: an error that says what it does instead."""

    names: tuple[str, ...]
    instead: str


# vLLM serve's flags that a Kimi-VL user plausibly passes and no epd setting stands for.
ACCEPTED = (
    Accepted(
        ("-tp", "--tensor-parallel-size"),
        "epd runs each role on one device; for more "
        "capacity run more replicas of a role (`epd plan` says how many)",
        ("1",),
    ),
    Accepted(("-pp", "--pipeline-parallel-size"), "epd runs each role on one device", ("1",)),
    Accepted(
        ("-dp", "--data-parallel-size"),
        "epd runs each role on one device; run more replicas of a role instead",
        ("1",),
    ),
    Accepted(("--enforce-eager",), "epd captures no CUDA graphs: every step runs eagerly"),
    Accepted(("--disable-log-stats",), "epd logs no periodic stats; GET /metrics has them"),
    Accepted(
        ("--enable-chunked-prefill",),
        "a prompt longer than --max-num-batched-tokens always runs in chunks",
    ),
    Accepted(
        ("--enable-auto-tool-choice",),
        'tool_choice "auto" is always allowed; its '
        "replies are text, as Kimi-VL's chat template has no tool-call markup "
        '("required" and a named function are always calls)',
    ),
    Accepted(
        ("--tool-call-parser",),
        "a Kimi model's parser; Kimi-VL's replies carry no "
        "tool-call markup to parse (see --enable-auto-tool-choice)",
        ("kimi_k2",),
    ),
    Accepted(("--kv-cache-dtype",), "the KV cache is kept in the model's dtype", ("auto",)),
    Accepted(("--load-format",), "epd reads safetensors", ("auto", "safetensors")),
    Accepted(("--block-size",), "epd's KV blocks hold 16 tokens", ("16",)),
    Accepted(("--disable-custom-all-reduce",), "epd runs each role on one device"),
    Accepted(
        ("--enable-prompt-tokens-details",),
        "usage always carries prompt_tokens_details.cached_tokens",
    ),
)
REFUSED = (
    Refused(("-q", "--quantization"), "epd runs the checkpoint's weights in --dtype, unquantised"),
    Refused(
        ("--enable-lora", "--lora-modules"),
        "epd serves no LoRA adapters: merge one into the checkpoint and serve that",
    ),
    Refused(
        ("--kv-transfer-config",),
        "epd hands KV from prefill to decode itself: run its "
        "roles (epd encode, epd prefill, epd decode) instead",
    ),
    Refused(("--cpu-offload-gb",), "epd keeps the weights on --device"),
    Refused(("--tokenizer",), "epd reads the tokenizer from the checkpoint directory"),
    Refused(("--hf-overrides",), "epd serves the checkpoint's config as it is"),
)


class Ignore(argparse.Action):
    """Takes the flag (and its checked value) and sets nothing."""

    def __call__(self, *_: Any) -> None:
        pass


class Refuse(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, *_: Any, **__: Any) -> None:
        parser.error(f"{'/'.join(self.option_strings)}: {self.help}")


def one_of(values: tuple[str, ...], why: str) -> Callable[[str], str]:
    def check(text: str) -> str:
        if text.strip() not in values:
            raise argparse.ArgumentTypeError(
                f"{text}: accepted as {' or '.join(values)} only: {why}"
            )
        return text

    return check


def add_compatible_flags(parser: argparse.ArgumentParser, settings: Collection[str]) -> None:
    """vLLM's flags that set nothing in epd: accepted where they ask for what epd does, refused
    with what epd does instead; and `--enable-log-requests`, the inverse of a setting's flag."""
    for flag in ACCEPTED:
        value = {"type": one_of(flag.values, flag.why), "metavar": "|".join(flag.values)}
        kwargs = value if flag.values else {"nargs": 0}
        shown = f"accepted as {' or '.join(flag.values)} only: " if flag.values else "accepted: "
        parser.add_argument(
            *flag.names,
            action=Ignore,
            help=f"vLLM's flag, {shown}{flag.why}",
            default=argparse.SUPPRESS,
            **kwargs,
        )
    for refused in REFUSED:
        parser.add_argument(
            *refused.names,
            action=Refuse,
            nargs="?",
            help=refused.instead,
            default=argparse.SUPPRESS,
            metavar="",
        )
    if "disable_log_requests" in settings:
        parser.add_argument(
            "--enable-log-requests",
            action=argparse.BooleanOptionalAction,
            dest="enable_log_requests",
            default=argparse.SUPPRESS,
            help="vLLM's flag: --no-disable-log-requests (epd logs a line per request by default)",
        )
