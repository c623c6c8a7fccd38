"""vLLM's `--speculative-config` (decode's): its JSON form, for the methods epd runs. Off
unless given, as vLLM's; anything epd cannot run is a ValueError that names it, at start."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram",)
DEFAULT_LOOKUP = 5  # vLLM's n-gram length when neither bound is given
MOST_TOKENS = 64  # drafts a step verifies per sequence, at most: each a row of every forward


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` for the methods epd runs: its JSON keys and rules, and
    vLLM 0.x's `disable_by_batch_size` (no drafts while that many sequences or more run: where
    a wider forward costs more than the tokens it saves; 0.32 has no such key)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = DEFAULT_LOOKUP
    prompt_lookup_min: int = DEFAULT_LOOKUP
    disable_by_batch_size: int | None = None

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig | None:
        """The config `text` gives (None where it is empty: off, as vLLM's default); a
        ValueError says what is wrong with it."""
        if not text.strip():
            return None
        try:
            given: Any = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON ({e})") from None
        if not isinstance(given, dict):
            raise ValueError("must be a JSON object")
        known = {
            "method",
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "disable_by_batch_size",
        }
        if unknown := sorted(set(given) - known):
            raise ValueError(
                f"epd does not take {', '.join(unknown)} (it takes {', '.join(sorted(known))})"
            )
        method = given.get("method")
        if method not in METHODS:
            raise ValueError(f"method {method!r}: epd drafts by {', '.join(METHODS)}")
        for key in known - {"method"}:
            value = given.get(key)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{key} must be a whole number ≥ 1")
        if given.get("num_speculative_tokens") is None:
            raise ValueError("num_speculative_tokens is required")
        if given["num_speculative_tokens"] > MOST_TOKENS:
            raise ValueError(f"num_speculative_tokens must be ≤ {MOST_TOKENS}")
        # vLLM's rule: neither bound given, both 5; one given, the other the same.
        most, least = given.get("prompt_lookup_max"), given.get("prompt_lookup_min")
        most = most if most is not None else least if least is not None else DEFAULT_LOOKUP
        least = least if least is not None else most
        if least > most:
            raise ValueError(f"prompt_lookup_min={least} must be ≤ prompt_lookup_max={most}")
        tokens, off_at = given["num_speculative_tokens"], given.get("disable_by_batch_size")
        return cls(method, tokens, most, least, off_at)

    def drafts_at(self, running: int) -> bool:
        """Whether a step of `running` sequences drafts at all."""
        return self.disable_by_batch_size is None or running < self.disable_by_batch_size
