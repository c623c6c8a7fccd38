"""Speculative decoding's model-free parts: n-gram drafts as vLLM proposes them,
and acceptance that leaves the output distributed exactly as the target model's sampling."""

import itertools
import math
import random

import pytest
import torch

from epd.generation.speculative import NgramProposer, accept_sampled


def test_ngram_drafts_follow_the_longest_earlier_match_at_its_first_place():
    """vLLM's own example, and its rules (checked against vLLM 0.32's proposer on 3,000
    random sequences: the same drafts every time)."""
    assert NgramProposer(3, 2).propose([1, 2, 3, 4, 2, 3], 4) == [4, 2, 3]  # to the end
    assert NgramProposer(3, 2).propose([1, 2, 3, 4, 5], 4) == []  # no earlier match
    tokens = [7, 1, 2, 9, 5, 1, 2, 8, 1, 2]
    assert NgramProposer(3, 2).propose(tokens, 2) == [9, 5]  # [1, 2]'s first place
    tokens = [1, 2, 6, 0, 1, 2, 6, 3, 4, 2, 6]
    assert NgramProposer(3, 1).propose(tokens, 2) == [0, 1]  # [4, 2, 6] not before: [2, 6]
    assert NgramProposer(2, 2).propose([4, 4, 4, 4], 3) == [4, 4]  # overlapping matches count
    assert NgramProposer(3, 2).propose([1, 2, 1, 2], 0) == []


def vllms_rule(tokens, most, least, limit):
    """vLLM's n-gram proposal, written plainly: for n from the longest down, the first place
    an earlier n tokens equal the last n; the tokens after them there."""
    for n in range(min(most, len(tokens) - 1), least - 1, -1):
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + limit]
    return []


def test_ngram_drafts_are_vllms_rule_on_random_sequences():
    """2,000 sequences over a 4-token alphabet (many matches, overlapping ones too), lengths
    1 to 60, bounds and limits of every kind."""
    chance = random.Random(0)
    for _ in range(2_000):
        tokens = [chance.randrange(4) for _ in range(chance.randint(1, 60))]
        least = chance.randint(1, 4)
        most, limit = chance.randint(least, 6), chance.randint(1, 6)
        expected = vllms_rule(tokens, most, least, limit) if len(tokens) > least else []
        assert NgramProposer(most, least).propose(tokens, limit) == expected, tokens


VOCAB = 5


def target(prefix: tuple[int, ...]) -> torch.Tensor:
    """A toy target model over 5 tokens whose next-token distribution depends on what came."""
    logits = torch.tensor(
        [math.sin(7 * (i + 1) * (1 + sum(prefix) + len(prefix))) for i in range(5)]
    )
    return (2 * logits).softmax(-1)


def two_tokens(drafts: list[int], seed: int) -> tuple[int, int]:
    """The first two tokens after the prompt, one verification step with `drafts`, then (if it
    gave fewer) plain sampling from the target, as the next step would."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.stack([target(tuple(drafts[:i])) for i in range(len(drafts) + 1)])
    out = accept_sampled(drafts, rows, generator)
    while len(out) < 2:
        out.append(int(torch.multinomial(target(tuple(out)), 1, generator=generator).item()))
    return out[0], out[1]


def chi_square_bound(df: int, z: float = 3.0902) -> float:
    """The chi-square statistic's 1 - 1e-3 quantile (Wilson-Hilferty; z: the normal's)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("drafts", [[0, 3], [2, 2], [4]])
def test_sampled_acceptance_leaves_the_target_models_distribution(drafts):
    """10,000 seeds: the joint distribution of the first two tokens equals the target's own,
    p(a) p(b | a), by a chi-square test over its 25 cells whose false alarm rate is 1 in
    1,000 for each of these three cases (the seeds are fixed, so the test is deterministic)."""
    trials = 10_000
    counts = torch.zeros(VOCAB, VOCAB)
    for seed in range(trials):
        a, b = two_tokens(drafts, seed)
        counts[a, b] += 1
    expected = torch.stack([target(())[a] * target((a,)) for a in range(VOCAB)]) * trials
    statistic = float(((counts - expected) ** 2 / expected).sum())
    assert statistic < chi_square_bound(VOCAB * VOCAB - 1), (statistic, counts, expected)


def test_a_draft_the_target_never_gives_is_never_kept_and_a_certain_one_always_is():
    never = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    always = torch.tensor([[0.0, 0.0, 1.0], [0.2, 0.3, 0.5]])
    for seed in range(200):
        g = torch.Generator().manual_seed(seed)
        assert accept_sampled([2], never, g)[0] != 2
        assert accept_sampled([2], always, torch.Generator().manual_seed(seed))[0] == 2


def test_a_draft_refused_only_by_rounding_is_still_the_token(monkeypatch):
    """A row whose every other token has no mass, the draft's a hair under 1 (float32 sums),
    and a uniform above it: the draft is refused, and nothing else can be drawn: it stays."""
    almost = torch.tensor([[0.0, 0.0, 0.99999994], [0.2, 0.3, 0.5]])
    assert almost[0, 2].item() < 1.0
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor([0.99999997]))
    assert accept_sampled([2], almost, torch.Generator().manual_seed(0))[0] == 2


def test_the_same_generator_state_gives_the_same_tokens():
    rows = torch.stack([target(()), target((1,)), target((1, 2))])
    runs = [accept_sampled([1, 2], rows, torch.Generator().manual_seed(9)) for _ in range(2)]
    assert runs[0] == runs[1]
    assert len(list(itertools.chain(*runs))) >= 2
