"""vLLM's spellings of epd's settings, so that a `vllm serve` command line starts `epd serve`.

A field of a role's dataclass names the vLLM flag it stands for (`option(..., vllm=...)`);
`sources` makes that flag an alias of epd's own, and the README's table shows it. The few
values vLLM writes otherwise than epd are read here.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
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


def one_device(text: str) -> int:
    """`--tensor-parallel-size`: each epd role runs on one device, so 1 is all it can be."""
    if text.strip() != "1":
        raise argparse.ArgumentTypeError(
            f"{text}: epd runs each role on one device; for more capacity run more replicas of "
            "a role (`epd plan` says how many)"
        )
    return 1


def add_compatible_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags that set nothing in epd but are accepted where their value is epd's way."""
    parser.add_argument(
        "-tp",
        "--tensor-parallel-size",
        type=one_device,
        default=argparse.SUPPRESS,
        metavar="1",
        help="vLLM's flag, accepted as 1 only: epd runs each role on one device",
    )
