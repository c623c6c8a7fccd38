"""Speculative decoding's parts that need no model: vLLM's `--speculative-config`, the drafts
(`Proposer`: n-gram prompt lookup first; a draft model or an MTP head later, behind the same
seam), and the rule that accepts drafts by the target model's own distribution (`accept`).

A decode step that verifies k drafts runs the target model over the last token and the k
drafts at once: k + 1 rows of probabilities, row i the target's distribution for the token
after draft i - 1 (row 0: after the last token). `accept` keeps the longest run of drafts the
target agrees with and adds one token of the target's own, so a step yields 1 to k + 1 tokens
and the output is distributed exactly as without drafts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

METHODS = ("ngram",)
DEFAULT_LOOKUP = 5  # vLLM's n-gram length when neither bound is given


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` for the methods epd runs: its JSON keys and rules."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = DEFAULT_LOOKUP
    prompt_lookup_min: int = DEFAULT_LOOKUP

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig | None:
        """The config `text` gives (None where it is empty: off, as vLLM's default); a
        ValueError says what is wrong with it."""
        if not text.strip():
            return None
        try:
            given: Any = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not JSON ({e})") from None
        if not isinstance(given, dict):
            raise ValueError("speculative_config: must be a JSON object")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        if unknown := sorted(set(given) - known):
            raise ValueError(
                f"speculative_config: epd does not take {', '.join(unknown)} "
                f"(it takes {', '.join(sorted(known))})"
            )
        method = given.get("method")
        if method not in METHODS:
            raise ValueError(
                f"speculative_config: method {method!r}: epd drafts by {', '.join(METHODS)}"
            )
        for key in known - {"method"}:
            value = given.get(key)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"speculative_config: {key} must be a whole number ≥ 1")
        if given.get("num_speculative_tokens") is None:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        # vLLM's rule: neither bound given, both 5; one given, the other the same.
        most, least = given.get("prompt_lookup_max"), given.get("prompt_lookup_min")
        most = most if most is not None else least if least is not None else DEFAULT_LOOKUP
        least = least if least is not None else most
        if least > most:
            raise ValueError(
                f"speculative_config: prompt_lookup_min={least} must be ≤ prompt_lookup_max={most}"
            )
        return cls(method, given["num_speculative_tokens"], most, least)


class Proposer(Protocol):
    """Drafts for one sequence: at most `limit` tokens likely to follow `tokens` (its prompt
    and output so far); none where it has no guess."""

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]: ...


class NgramProposer:
    """Prompt lookup, as vLLM's n-gram method: the longest suffix of the tokens, of
    `least`..`most` tokens, that occurs earlier in them, at its earliest occurrence; the drafts
    are the tokens that followed it there (up to `limit`, and up to the end)."""

    def __init__(self, most: int, least: int) -> None:
        self.most, self.least = most, least

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        if limit < 1 or len(tokens) <= self.least:
            return []
        ids = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.most, len(ids) - 1), self.least - 1, -1):
            # Every n-gram that starts before the suffix does: (len - n, n) windows.
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
            found = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if found.size:
                start = int(found[0]) + n
                return ids[start : start + limit].tolist()
        return []


def accept_greedy(drafts: Sequence[int], argmax: Sequence[int]) -> list[int]:
    """The tokens a greedy step yields: the drafts while each equals the target's argmax at
    its position, then the target's argmax after the last one accepted. `argmax`: one per
    position, len(drafts) + 1."""
    out = []
    for draft, best in zip(drafts, argmax, strict=False):
        if draft != best:
            break
        out.append(draft)
    out.append(argmax[len(out)])
    return out


def accept_sampled(
    drafts: Sequence[int], probs: torch.Tensor, generator: torch.Generator
) -> list[int]:
    """The tokens a sampled step yields, by rejection sampling for a deterministic draft (as
    vLLM's n-gram drafts are): draft i is kept with the target's probability of it, and the
    first one refused is replaced by a token drawn from the target's distribution without it
    (renormalised); all kept, one more is drawn from the last row. Each token is then
    distributed exactly as the target's own sampling would give it. `probs`: (len(drafts) + 1,
    vocab), each row the request's processed distribution (temperature, top-k/p, min-p);
    `generator`: the request's own (on the CPU, as the rows are made to be: one copy, not a
    device sync per draft)."""
    probs = probs.cpu()
    out = []
    for i, draft in enumerate(drafts):
        if torch.rand(1, generator=generator).item() < probs[i, draft].item():
            out.append(draft)
            continue
        rest = probs[i].clone()
        rest[draft] = 0.0
        # Nothing left: the draft held all the mass, refused only by rounding (p a hair under 1).
        out.append(draw(rest, generator) if rest.sum() > 0 else draft)
        return out
    out.append(draw(probs[len(drafts)], generator))
    return out


def draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One token by its weight (need not sum to 1): the inverse CDF at one uniform."""
    cdf = weights.double().cumsum(0)
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    chosen = int(torch.searchsorted(cdf, u, right=True).item())
    return min(chosen, int((weights > 0).nonzero()[-1].item()))  # u·total rounded to the total
