"""Stop rules: eos, stop strings (held back while they may still form), max_tokens."""

import pytest
import torch

from epd.checkpoint.tokenizer import load_tokenizer
from epd.generation.params import SamplingParams
from epd.generation.sequence import Sequence
from epd.model.latent_cache import LatentCache


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return load_tokenizer(tiny_checkpoint)


def sequence(tokenizer, **params):
    cache = LatentCache(torch.zeros(1, 1, 1), 0)
    sampling = SamplingParams(**({"max_tokens": 100} | params))
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    prompt = torch.tensor([1, 2, 3])
    return Sequence("r", sampling, torch.Generator(), cache, tokenizer, eos, prompt)


def feed(seq, tokenizer, text):
    """Accept the tokens of `text` until the sequence finishes."""
    deltas = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        deltas.append(seq.accept(token))
        if seq.finish_reason:
            break
    return deltas


def test_eos_finishes_with_stop_and_no_text(tokenizer):
    seq = sequence(tokenizer)
    feed(seq, tokenizer, "red circle")
    delta = seq.accept(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    assert delta.finish_reason == "stop" and delta.text == "" and delta.completion_tokens == 3


def test_ignore_eos_goes_on_to_max_tokens(tokenizer):
    seq = sequence(tokenizer, max_tokens=4, ignore_eos=True)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    outputs = [seq.accept(end) for _ in range(4)]
    assert [o.finish_reason for o in outputs] == [None, None, None, "length"]
    assert "".join(o.text for o in outputs) == ""  # the eos token adds no text


def test_max_tokens_finishes_with_length(tokenizer):
    seq = sequence(tokenizer, max_tokens=2)
    deltas = feed(seq, tokenizer, "one two three four")
    assert [d.finish_reason for d in deltas] == [None, "length"]


def test_stop_string_cuts_the_reply_before_it(tokenizer):
    seq = sequence(tokenizer, stop=("three",))
    deltas = feed(seq, tokenizer, "one two three four")
    assert "".join(d.text for d in deltas) == "one two "
    assert deltas[-1].finish_reason == "stop"


def test_text_that_may_become_a_stop_string_is_held_back(tokenizer):
    seq = sequence(tokenizer, stop=("ab!",))
    texts = [d.text for d in feed(seq, tokenizer, "xa")]
    assert "".join(texts) == "x"  # "a" could start "ab!"
    texts += [d.text for d in feed(seq, tokenizer, "c")]
    assert "".join(texts) == "xac"  # "ac" cannot: released


def test_released_text_is_the_whole_reply_when_nothing_stops(tokenizer):
    seq = sequence(tokenizer, stop=("zzz",), max_tokens=50)
    deltas = feed(seq, tokenizer, "hello world, what shape is this?")
    assert "".join(d.text for d in deltas) == "hello world, what shape is this?"


def test_a_stop_token_id_finishes_like_eos_even_with_ignore_eos(tokenizer):
    stop = tokenizer.encode(" two", add_special_tokens=False)[0]
    seq = sequence(tokenizer, stop_token_ids=(stop,), ignore_eos=True)
    deltas = feed(seq, tokenizer, "one two three")
    assert deltas[-1].finish_reason == "stop" and "".join(d.text for d in deltas) == "one"


def test_stop_strings_wait_for_min_tokens(tokenizer):
    early = sequence(tokenizer, stop=("one",), min_tokens=3)
    deltas = feed(early, tokenizer, "one two three four")
    assert "".join(d.text for d in deltas) == "one two three four"
    assert early.finish_reason is None
    assert (
        feed(sequence(tokenizer, stop=("one",)), tokenizer, "one two")[-1].finish_reason == "stop"
    )


def test_special_tokens_are_spelled_out_when_not_skipped(tokenizer):
    special = tokenizer.convert_tokens_to_ids("<|im_middle|>")
    kept, skipped = sequence(tokenizer, skip_special_tokens=False), sequence(tokenizer)
    assert kept.accept(special).text == "<|im_middle|>" and skipped.accept(special).text == ""
