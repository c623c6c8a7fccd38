"""ShareGPT conversations as a benchmark's prompts, chosen by the rules `vllm bench serve` uses.

A ShareGPT file is a JSON list of `{"conversations": [{"from": "human", "value": ...},
{"from": "gpt", "value": ...}, ...]}`. A conversation gives one request: its first human turn
is the prompt, and the first gpt turn after it the reply whose length is the request's
max_tokens. As in vLLM's benchmark, conversations of fewer than two turns are dropped, the rest
shuffled by the seed and taken in that order, leaving out a pair whose prompt or reply is under
4 tokens, whose prompt is over 1024 or whose two lengths add up to over 2048; too few pairs
are repeated. vLLM counts tokens with the model's tokenizer; `epd bench`, made for any server,
has none, so here a token is a word or a punctuation mark (English text's BPE tokens come to
about as many), and the lengths at the edges may differ from vLLM's by a little.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIN_TOKENS = 4
MAX_PROMPT_TOKENS = 1024
MAX_TOTAL_TOKENS = 2048
PIECES = re.compile(r"\w+|[^\w\s]")


@dataclass(frozen=True)
class Sample:
    """One request's prompt and its max_tokens."""

    prompt: str
    output_tokens: int


def tokens(text: str) -> int:
    """About the text's tokens: its words and punctuation marks."""
    return len(PIECES.findall(text))


def read(path: str, seed: int, output_tokens: int = 0) -> list[Sample]:
    """Every usable pair of the file's conversations, in the seed's order; `output_tokens`
    (0: each reply's length) as every request's max_tokens."""
    entries = [e for e in load(path) if len(turns_of(e)) >= 2]
    random.Random(seed).shuffle(entries)
    samples = [s for e in entries if (s := sample(e, output_tokens)) is not None]
    if not samples:
        raise ValueError(
            f"{path}: no conversation has a human turn and a gpt reply of usable lengths "
            f"(at least {MIN_TOKENS} tokens each, a prompt of at most {MAX_PROMPT_TOKENS}, "
            f"{MAX_TOTAL_TOKENS} in all)"
        )
    return samples


def load(path: str) -> list[Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"cannot read the dataset {path}: {e.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"the dataset {path} is not JSON: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"the dataset {path} must hold a list of conversations, as ShareGPT's")
    return data


def turns_of(entry: Any) -> list[Any]:
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    return turns if isinstance(turns, list) else []


def first_exchange(entry: Any) -> tuple[str, str] | None:
    """The first human turn's text and the first gpt turn's after it, if there are both."""
    prompt = None
    for turn in turns_of(entry):
        if not (isinstance(turn, dict) and isinstance(turn.get("value"), str)):
            continue
        if prompt is None and turn.get("from") == "human":
            prompt = turn["value"]
        elif prompt is not None and turn.get("from") == "gpt":
            return prompt, turn["value"]
    return None


def sample(entry: Any, output_tokens: int) -> Sample | None:
    exchange = first_exchange(entry)
    if exchange is None:
        return None
    prompt, reply = exchange
    prompt_tokens, asked = tokens(prompt), output_tokens or tokens(reply)
    # A length given for every request is not the reply's, so only the prompt can be too short.
    too_short = prompt_tokens < MIN_TOKENS or (not output_tokens and asked < MIN_TOKENS)
    too_long = prompt_tokens > MAX_PROMPT_TOKENS or prompt_tokens + asked > MAX_TOTAL_TOKENS
    return None if too_short or too_long else Sample(prompt, asked)
