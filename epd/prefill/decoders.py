"""Which decoder takes a request: the one that holds most of its prompt, weighed against how
full and how busy each one is.

A decoder that holds a prompt's leading blocks is handed only the rows after them
(`DecoderBlocks`), so the choice saves wire time and decode's copy; a full or busy decoder
slows every sequence it runs. Each live decoder gets a score from three parts in [0, 1], as
llm-d's scheduler weighs its scorers: the share of the prompt's blocks it holds (weight 2), its
KV cache left free as it last reported it (1), and how few of this prefill's requests stream
from it against the busiest (1). The highest score wins; among equals the first, and callers
pass the live decoders rotated, so that equal decoders take turns (round-robin where nothing
tells them apart).
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX_WEIGHT = 2.0
FREE_KV_WEIGHT = 1.0
IDLE_WEIGHT = 1.0


@dataclass(frozen=True)
class Candidate:
    address: str
    held: int  # the prompt's leading blocks it holds, as prefill believes (`DecoderBlocks`)
    kv_usage: float  # its KV cache's use (0 to 1), as it last reported it; 0 before it has
    running: int  # this prefill's requests streaming from it


def choose(candidates: list[Candidate], blocks: int) -> Candidate:
    """The best candidate for a prompt of `blocks` full blocks (see the module's docstring);
    the first among equals."""
    busiest = max(c.running for c in candidates)

    def score(c: Candidate) -> float:
        prefix = c.held / blocks if blocks else 0.0
        idle = 1.0 - c.running / busiest if busiest else 1.0
        return PREFIX_WEIGHT * prefix + FREE_KV_WEIGHT * (1.0 - c.kv_usage) + IDLE_WEIGHT * idle

    return max(candidates, key=score)  # the first of the highest
