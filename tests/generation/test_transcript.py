"""Stop rules: eos, stop strings (held back while they may still form), max_tokens, and which
stop ended a reply (`stop_reason`); and a reply that prefill starts and decode continues."""

import pytest
import torch

from epd.checkpoint.tokenizer import load_tokenizer
from epd.generation.params import SamplingParams
from epd.generation.transcript import Transcript


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return load_tokenizer(tiny_checkpoint)


def transcript(tokenizer, **params):
    sampling = SamplingParams(**({"max_tokens": 100} | params))
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", tokenizer.eos_token)]
    return Transcript(sampling, tokenizer, eos, torch.tensor([1, 2, 3]))


def feed(reply, tokenizer, text):
    """Accept the tokens of `text` until the sequence finishes."""
    deltas = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        deltas.append(reply.accept(token))
        if reply.finish_reason:
            break
    return deltas


def test_eos_finishes_with_stop_and_no_text(tokenizer):
    reply = transcript(tokenizer)
    feed(reply, tokenizer, "red circle")
    delta = reply.accept(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    assert delta.finish_reason == "stop" and delta.text == "" and delta.completion_tokens == 3


def test_ignore_eos_goes_on_to_max_tokens(tokenizer):
    reply = transcript(tokenizer, max_tokens=4, ignore_eos=True)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    outputs = [reply.accept(end) for _ in range(4)]
    assert [o.finish_reason for o in outputs] == [None, None, None, "length"]
    assert "".join(o.text for o in outputs) == ""  # the eos token adds no text


def test_max_tokens_finishes_with_length(tokenizer):
    reply = transcript(tokenizer, max_tokens=2)
    deltas = feed(reply, tokenizer, "one two three four")
    assert [d.finish_reason for d in deltas] == [None, "length"]


def test_stop_string_cuts_the_reply_before_it(tokenizer):
    reply = transcript(tokenizer, stop=("three",))
    deltas = feed(reply, tokenizer, "one two three four")
    assert "".join(d.text for d in deltas) == "one two "
    assert deltas[-1].finish_reason == "stop"


def test_include_stop_str_ends_the_reply_with_the_stop_string(tokenizer):
    """vLLM's include_stop_str_in_output: the text up to the stop string's end, not past it
    (" four" was in the same token stream but never accepted)."""
    reply = transcript(tokenizer, stop=("wo thr", "one"), min_tokens=1, include_stop_str=True)
    deltas = feed(reply, tokenizer, "one two three four")
    assert "".join(d.text for d in deltas) == "one"
    reply = transcript(tokenizer, stop=("wo thr",), include_stop_str=True)
    deltas = feed(reply, tokenizer, "one two three four")
    assert "".join(d.text for d in deltas) == "one two thr" and deltas[-1].finish_reason == "stop"


def test_include_stop_str_keeps_a_stop_token_s_text_where_it_has_one(tokenizer):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    two = tokenizer.encode(" two", add_special_tokens=False)[0]
    for params, token, text in [
        ({"stop_token_ids": (two,)}, two, " two"),
        ({"skip_special_tokens": False}, end, "<|im_end|>"),
        ({}, end, ""),  # special tokens are skipped: eos has no text to keep
    ]:
        reply = transcript(tokenizer, include_stop_str=True, **params)
        delta = reply.accept(token)
        assert (delta.text, delta.finish_reason) == (text, "stop")


def test_text_that_may_become_a_stop_string_is_held_back(tokenizer):
    reply = transcript(tokenizer, stop=("ab!",))
    texts = [d.text for d in feed(reply, tokenizer, "xa")]
    assert "".join(texts) == "x"  # "a" could start "ab!"
    texts += [d.text for d in feed(reply, tokenizer, "c")]
    assert "".join(texts) == "xac"  # "ac" cannot: released


def test_released_text_is_the_whole_reply_when_nothing_stops(tokenizer):
    reply = transcript(tokenizer, stop=("zzz",), max_tokens=50)
    deltas = feed(reply, tokenizer, "hello world, what shape is this?")
    assert "".join(d.text for d in deltas) == "hello world, what shape is this?"


def test_a_stop_token_id_finishes_like_eos_even_with_ignore_eos(tokenizer):
    stop = tokenizer.encode(" two", add_special_tokens=False)[0]
    reply = transcript(tokenizer, stop_token_ids=(stop,), ignore_eos=True)
    deltas = feed(reply, tokenizer, "one two three")
    assert deltas[-1].finish_reason == "stop" and "".join(d.text for d in deltas) == "one"


def test_stop_strings_wait_for_min_tokens(tokenizer):
    early = transcript(tokenizer, stop=("one",), min_tokens=3)
    deltas = feed(early, tokenizer, "one two three four")
    assert "".join(d.text for d in deltas) == "one two three four"
    assert early.finish_reason is None
    assert (
        feed(transcript(tokenizer, stop=("one",)), tokenizer, "one two")[-1].finish_reason == "stop"
    )


def test_special_tokens_are_spelled_out_when_not_skipped(tokenizer):
    special = tokenizer.convert_tokens_to_ids("<|im_middle|>")
    kept, skipped = transcript(tokenizer, skip_special_tokens=False), transcript(tokenizer)
    assert kept.accept(special).text == "<|im_middle|>" and skipped.accept(special).text == ""


@pytest.mark.parametrize("stop", [(), ("o t",), ("one",)])
def test_a_reply_started_by_prefill_and_continued_by_decode_is_the_reply_of_one(tokenizer, stop):
    """Prefill sends the first token's output; decode, fed that token again, sends the rest."""
    tokens = tokenizer.encode("one two three", add_special_tokens=False)
    prefill, decode, alone = (transcript(tokenizer, stop=stop, max_tokens=5) for _ in range(3))
    first = prefill.accept(tokens[0])
    assert decode.accept(tokens[0]) == first  # decode does not send it again
    rest = [decode.accept(t) for t in tokens[1:] if decode.finish_reason is None]
    whole = [alone.accept(t) for t in tokens if alone.finish_reason is None]
    assert [first, *rest] == whole


def test_stop_reason_names_the_stop_token_or_string_that_ended_the_reply(tokenizer):
    """vLLM's stop_reason: the stop token id, or the stop string as it matched (one that
    began in an earlier token's text included); None for the tokenizer's eos and max_tokens,
    and generation_config's other eos ids (Kimi's <|im_end|>) by id, as vLLM makes them stop
    token ids."""
    two = tokenizer.encode(" two", add_special_tokens=False)[0]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    by_token = transcript(tokenizer, stop_token_ids=(two,))
    assert feed(by_token, tokenizer, "one two three")[-1].stop_reason == two
    for stops, matched in [(("three", "o t"), "o t"), (("zz", "wo thr"), "wo thr")]:
        for include in (False, True):
            reply = transcript(tokenizer, stop=stops, include_stop_str=include)
            assert feed(reply, tokenizer, "one two three four")[-1].stop_reason == matched
    assert transcript(tokenizer).accept(end).stop_reason == end  # every Kimi turn's end
    primary = tokenizer.eos_token_id
    assert primary != end
    eos = transcript(tokenizer, stop_token_ids=(primary,))  # the eos, also a stop id
    assert eos.accept(primary).stop_reason is None
    assert eos.stop_reason is None
    cut = feed(transcript(tokenizer, max_tokens=2, stop=("zz",)), tokenizer, "one two three")
    assert [o.stop_reason for o in cut] == [None, None] and cut[-1].finish_reason == "length"


def test_a_stop_token_id_is_the_stop_reason_even_when_it_is_an_eos_ignored(tokenizer):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    reply = transcript(tokenizer, stop_token_ids=(end,), ignore_eos=True)
    assert reply.accept(end).stop_reason == end
