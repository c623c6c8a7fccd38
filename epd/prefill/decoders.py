"""Which decoder takes a request: the one that holds most of its prompt, weighed against how
full and how busy each one is.

A decoder that holds a prompt's leading blocks is handed only the rows after them
(`DecoderBlocks`), so the choice saves wire time and decode's copy; a full or busy decoder
slows every sequence it runs. Each live decoder gets a score from three parts in [0, 1], as
llm-d's scheduler weighs its scorers: the share of the prompt's blocks it holds (weight 2; of
the blocks some candidate lacks, since those every one holds are sent to none: once every
decoder held a shared system prompt, a later turn's own history weighed too little against
idleness, and moved, its KV sent whole again), its
KV cache left free as it last reported it (1), and how few of this prefill's requests stream
from it against the busiest (1). The highest score wins; among equals the first, and callers
pass the live decoders rotated, so that equal decoders take turns (round-robin where nothing
tells them apart).

The idle part is bounded, so a decoder that held a prompt outscored an idle one however many
streams it ran: eight concurrent repeats of earlier prompts all went to one of two decoders.
So, as SGLang's router guards its cache-aware choice, where the loads are out of balance (the
busiest runs over BALANCE_ABS more than the least busy, and over BALANCE_REL times as many) the
least busy decoders are the only candidates; the score picks among them. At 2 streams apart
the guard moved conversations' later turns off the decoder that held them, whose KV then went
whole again (hand-offs of later turns 1.35× their new tokens in one round); at 4, a decode
batch a few streams larger costs little beside that.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX_WEIGHT = 2.0
FREE_KV_WEIGHT = 1.0
IDLE_WEIGHT = 1.0
BALANCE_ABS, BALANCE_REL = 4, 1.5  # streams; a ratio
# Blocks apart below which the prefix share is counted against this many: one block of
# difference must not outweigh a decoder nearly full and busier (16 tokens saved).
PREFIX_FLOOR = 8


@dataclass(frozen=True)
class Candidate:
    address: str
    held: int  # the prompt's leading blocks it holds, as prefill believes (`DecoderBlocks`)
    kv_usage: float  # its KV cache's use (0 to 1), as it last reported it; 0 before it has
    running: int  # this prefill's requests streaming from it


def choose(candidates: list[Candidate], blocks: int) -> Candidate:
    """The best candidate for a prompt of `blocks` full blocks (see the module's docstring);
    the first among equals."""
    busiest, calmest = max(c.running for c in candidates), min(c.running for c in candidates)
    if busiest - calmest > BALANCE_ABS and busiest > BALANCE_REL * calmest:
        candidates = [c for c in candidates if c.running == calmest]

    least = min(c.held for c in candidates)  # held by every candidate: sent to none of them

    def score(c: Candidate) -> float:
        prefix = (c.held - least) / max(blocks - least, PREFIX_FLOOR) if blocks > least else 0.0
        idle = 1.0 - c.running / busiest if busiest else 1.0
        return PREFIX_WEIGHT * prefix + FREE_KV_WEIGHT * (1.0 - c.kv_usage) + IDLE_WEIGHT * idle

    return max(candidates, key=score)  # the first of the highest
