import math
from dataclasses import dataclass

import pytest
import torch

from epd.generation.logits import adjust, presence
from epd.generation.params import SamplingParams
from epd.generation.sampling import sample_batch

VOCAB = 50
EOS = (7, 8)


@dataclass
class Row:
    sampling: SamplingParams
    prompt_ids: torch.Tensor
    tokens: list[int]
    matcher: object = None
    also_allowed: tuple[int, ...] = ()
    grammar_waits: bool = False

    def prompt_presence(self, vocab, device):
        return presence(self.prompt_ids, vocab, device)


def row(tokens=(), prompt=(1, 2, 3), **params):
    sampling = SamplingParams(**({"max_tokens": 20} | params))
    return Row(sampling, torch.tensor(prompt, dtype=torch.int64), list(tokens))


def reference(logits: torch.Tensor, r: Row) -> torch.Tensor:
    """The controls one token at a time, as their definitions read."""
    out = logits.clone()
    s = r.sampling
    seen = set(r.prompt_ids.tolist()) | set(r.tokens)
    for token in range(VOCAB):
        value = float(out[token])
        if token in seen:
            value = value / s.repetition_penalty if value > 0 else value * s.repetition_penalty
        count = r.tokens.count(token)
        value -= s.frequency_penalty * count + s.presence_penalty * (count > 0)
        value += sum(bias for t, bias in s.logit_bias if t == token)
        if len(r.tokens) < s.min_tokens and (token in EOS or token in s.stop_token_ids):
            value = -math.inf
        out[token] = value
    return out


ROWS = [
    row(),
    row(tokens=(4, 4, 9), repetition_penalty=1.3),
    row(tokens=(4, 4, 9, 10), presence_penalty=0.7, frequency_penalty=0.4),
    row(tokens=(11,), presence_penalty=-1.0, frequency_penalty=2.0, repetition_penalty=0.8),
    row(logit_bias=((5, -100.0), (6, 30.0), (5, 2.0))),
    row(tokens=(1,), min_tokens=3, stop_token_ids=(20, 21)),
    row(tokens=(1, 2, 3), min_tokens=3, stop_token_ids=(20,)),  # reached: nothing banned
]


def test_each_control_matches_its_definition_row_by_row_in_one_batch():
    logits = torch.randn(len(ROWS), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    adjusted = adjust(logits, ROWS, EOS)
    for i, r in enumerate(ROWS):
        torch.testing.assert_close(adjusted[i], reference(logits[i], r), rtol=1e-6, atol=1e-6)
        alone = adjust(logits[i : i + 1], [r], EOS)[0]
        assert torch.equal(adjusted[i], alone)  # a row's controls ignore its neighbours
    assert torch.equal(adjusted[0], logits[0]) and torch.equal(adjusted[6], logits[6])


def test_rows_without_controls_are_the_same_tensor():
    logits = torch.randn(2, VOCAB)
    assert adjust(logits, [row(), row(tokens=(3,))], EOS) is logits


def test_a_ban_and_a_negative_bias_change_greedy_output():
    logits = torch.zeros(3, VOCAB)
    logits[:, 7] = 5.0  # eos is the likeliest
    logits[:, 12] = 4.0
    rows = [
        row(temperature=0),
        row(temperature=0, min_tokens=1),
        row(temperature=0, logit_bias=((7, -100.0),)),
    ]
    tokens = sample_batch(adjust(logits, rows, EOS), [r.sampling for r in rows], [None] * 3)
    assert tokens.tolist() == [7, 12, 12]


def test_repetition_penalty_covers_the_prompt():
    logits = torch.full((1, VOCAB), 2.0)
    logits[0, 30] = 2.5  # in the prompt: 2.5 / 2 = 1.25 falls below the others
    (adjusted,) = adjust(logits, [row(prompt=(30,), repetition_penalty=2.0)], EOS)
    assert adjusted[30] == pytest.approx(1.25) and int(adjusted.argmax()) != 30


def test_a_grammar_waiting_for_its_answer_bans_the_end():
    """A reasoning model still reasoning under a grammar may not end: its answer is missing."""
    waiting = row(stop_token_ids=(9,))
    waiting.grammar_waits = True
    out = adjust(torch.zeros(2, VOCAB), [waiting, row()], EOS)
    assert torch.isinf(out[0, [7, 8, 9]]).all() and torch.isfinite(out[0, :7]).all()
    assert torch.isfinite(out[1]).all()
