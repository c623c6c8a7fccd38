"""Speculative decoding's model-free parts: the drafts (`Proposer`: n-gram prompt lookup
first; a draft model or an MTP head later, behind the same seam) and the rule that accepts a
draft by the target model's own distribution (`verify`). The config is `epd.config.speculative`.

A decode step that verifies k drafts runs the target model over the last token and the k
drafts at once: k + 1 rows of logits, row i the target's for the token after draft i - 1 (row
0: after the last token). Position by position, a draft is kept while the target agrees with
it (greedy: it is the argmax; sampled: `verify`), and the first position it does not, or the
one after the last draft, gives a token of the target's own: a step yields 1 to k + 1 tokens,
distributed exactly as without drafts (`accept_sampled` is the rule over a whole step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from epd.config.speculative import SpeculativeConfig


class Proposer(Protocol):
    """Drafts for one sequence: at most `limit` tokens likely to follow `tokens` (its prompt
    and output so far); none where it has no guess."""

    def propose(self, tokens: Sequence[int] | np.ndarray, limit: int) -> list[int]: ...


class NgramProposer:
    """Prompt lookup, as vLLM's n-gram method: the longest suffix of the tokens, of
    `least`..`most` tokens, that occurs earlier in them, at its earliest occurrence; the drafts
    are the tokens that followed it there (up to `limit`, and up to the end)."""

    def __init__(self, most: int, least: int) -> None:
        self.most, self.least = most, least

    def propose(self, tokens: Sequence[int] | np.ndarray, limit: int) -> list[int]:
        if limit < 1 or len(tokens) <= self.least:
            return []
        ids = np.asarray(tokens, dtype=np.int64)
        last = len(ids) - 1
        # The earlier places of the last token: where a suffix may end again (one pass over
        # the tokens, not one per length: a 128k context is looked up every step).
        ends = np.flatnonzero(ids[:last] == ids[last])  # ascending
        longest = min(self.most, last)
        matched = np.ones(ends.size, dtype=np.int64)  # how far back each match runs
        going = np.ones(ends.size, dtype=bool)
        for back in range(1, longest):
            before = ends - back
            going &= (before >= 0) & (ids[np.maximum(before, 0)] == ids[last - back])
            matched += going
        for n in range(longest, self.least - 1, -1):
            found = np.flatnonzero(matched >= n)
            if found.size:  # its earliest place: the first end
                start = int(ends[found[0]]) + 1
                return ids[start : start + limit].tolist()
        return []


def proposer(config: SpeculativeConfig) -> Proposer:
    """The drafts a config asks for (vLLM's methods; n-gram so far)."""
    return NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)


def verify(draft: int, probs: torch.Tensor, generator: torch.Generator) -> int:
    """The token at a draft's position, by rejection sampling for a deterministic draft (as
    vLLM's n-gram drafts are): the draft, kept with the target's probability p of it, or else
    a token drawn from the target's distribution without it (renormalised). `probs`: (vocab,),
    the request's processed distribution there (temperature, top-k/p, min-p), on the CPU (one
    copy for a step, not a device sync per draft); `generator`: the request's own.

    One float32 uniform u decides both: kept where u < p, else the rest's inverse CDF at
    (u - p) / (1 - p), itself uniform once u ≥ p. So every token takes one draw, drafted or
    not, as plain sampling's do, and a moved request's generator is advanced past its reply
    exactly (`sampling.advanced`)."""
    u, p = torch.rand(1, generator=generator).item(), probs[draft].item()
    if u < p:
        return draft
    rest = probs.clone()
    rest[draft] = 0.0
    # Nothing left: the draft held all the mass, refused only by rounding (p a hair under 1).
    return at(rest, (u - p) / (1 - p)) if rest.sum() > 0 else draft


def accept_sampled(
    drafts: Sequence[int], probs: torch.Tensor, generator: torch.Generator
) -> list[int]:
    """The tokens a sampled step yields: each draft `verify`-ed in turn until one is refused
    (replaced), or all kept and one more drawn from the last row. `probs`: (len(drafts) + 1,
    vocab). Each token is then distributed exactly as the target's own sampling gives it."""
    probs = probs.cpu()
    out = []
    for draft, row in zip(drafts, probs, strict=False):
        out.append(verify(draft, row, generator))
        if out[-1] != draft:
            return out
    out.append(at(probs[len(drafts)], torch.rand(1, generator=generator).item()))
    return out


def at(weights: torch.Tensor, uniform: float) -> int:
    """The token whose share of the weights (need not sum to 1) holds `uniform` in [0, 1): the
    inverse CDF, in float64."""
    cdf = weights.double().cumsum(0)
    chosen = int(torch.searchsorted(cdf, uniform * cdf[-1], right=True).item())
    return min(chosen, int((weights > 0).nonzero()[-1].item()))  # u·total rounded to the total
