"""Which prefill takes a request: the order to try them in, best first (a refusal goes to the
next), and why the first was chosen.

- cache-aware (llm-d's precise prefix-cache scorer beside its load scorer): the share of the
  prompt's blocks a prefill holds, weight 2, and 1 / (1 + its load), weight 1. A conversation's
  next turn goes where its blocks are, unless that prefill is far busier than another;
  prompts no one holds (or whose blocks cannot be named) go to the least loaded.
- least-loaded: fewest requests in flight (the router's own count, or what the prefill
  reports, whichever is higher: other routers' requests count too).
- round-robin: each in turn.
Equals take turns, so that an idle fleet still spreads its first requests. Where the loads are
out of balance (the busiest has over BALANCE_ABS more requests than the least busy, and over
BALANCE_REL times as many), cache-aware routing goes by load alone, as SGLang's router guards
its own: four streams of one prompt, come together, all went to the prefill whose events had
just named its block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PREFIX_WEIGHT, LOAD_WEIGHT = 2.0, 1.0
BALANCE_ABS, BALANCE_REL = 2, 1.5  # requests; a ratio
CACHE_HIT, LOAD, ROUND_ROBIN = "cache_hit", "load", "round_robin"


@dataclass(frozen=True)
class Candidate:
    url: str
    load: int  # requests in flight on it
    matched: int = 0  # of the prompt's first blocks, those it holds


def order(
    candidates: Sequence[Candidate], routing: str, blocks: int, turn: int
) -> tuple[list[Candidate], str]:
    """The candidates, best first, and why the first leads (`CACHE_HIT`, `LOAD`,
    `ROUND_ROBIN`); `blocks`: the prompt's named blocks; `turn` rotates equals."""
    if not candidates:
        return [], LOAD
    start = turn % len(candidates)
    rotated = [*candidates[start:], *candidates[:start]]
    if routing == "round-robin":
        return rotated, ROUND_ROBIN
    if routing == "least-loaded" or out_of_balance(candidates):
        return sorted(rotated, key=lambda c: c.load), LOAD

    def score(c: Candidate) -> float:
        prefix = c.matched / blocks if blocks else 0.0
        return PREFIX_WEIGHT * prefix + LOAD_WEIGHT / (1 + c.load)

    ranked = sorted(rotated, key=score, reverse=True)  # stable: equals keep their turn
    return ranked, CACHE_HIT if ranked[0].matched else LOAD


def out_of_balance(candidates: Sequence[Candidate]) -> bool:
    loads = [c.load for c in candidates]
    return max(loads) - min(loads) > BALANCE_ABS and max(loads) > BALANCE_REL * min(loads)
