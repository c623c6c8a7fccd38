"""A choice being generated: what drafts are looked up in is its prompt and reply, as they
grow, whatever the reply's length."""

import pytest
import torch

from epd.checkpoint.tokenizer import load_tokenizer
from epd.generation.params import SamplingParams
from epd.generation.sequence import Sequence


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return load_tokenizer(tiny_checkpoint)


def test_history_is_the_prompt_and_the_reply_so_far(tokenizer):
    prompt = torch.tensor([4, 8, 15, 16, 23, 42], dtype=torch.int32)
    sequence = Sequence(
        "r",
        SamplingParams(500, ignore_eos=True),
        torch.Generator(),
        None,
        None,
        tokenizer,
        [],
        prompt,
    )
    assert sequence.history().tolist() == prompt.tolist()
    for token in range(300):  # past several doublings of its buffer
        sequence.accept(100 + token % 7)
        if token % 37 == 0 or token > 290:
            assert sequence.history().tolist() == prompt.tolist() + sequence.tokens
    assert sequence.history().dtype.name == "int64"
