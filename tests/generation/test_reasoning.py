"""A reasoning model's reply split into reasoning and answer, as text grows and token by token
for its grammar."""

import random

import pytest
import torch

from epd.checkpoint.tokenizer import load_tokenizer
from epd.generation.grammar import GrammarError, Grammars, choice_grammar, mask_forbidden
from epd.generation.params import SamplingParams
from epd.generation.reasoning import ANSWER, PARSERS, START, THINKING, Split, gate, opened

KIMI = PARSERS["kimi_vl"]
REPLY = "◁think▷ It is round and red. ◁/think▷The circle is red."


def split_in_pieces(text, sizes, open_=False):
    split, reasoning, answer = Split(KIMI, open_), "", ""
    at = 0
    for size in sizes:
        r, a = split.feed(text[at : at + size])
        reasoning, answer, at = reasoning + r, answer + a, at + size
    r, a = split.finish()
    return reasoning + r, answer + a


@pytest.mark.parametrize("seed", range(20))
def test_any_cut_of_the_text_splits_the_same(seed):
    rng = random.Random(seed)
    sizes = [rng.randint(1, 4) for _ in range(len(REPLY))]
    assert split_in_pieces(REPLY, sizes) == (" It is round and red. ", "The circle is red.")


@pytest.mark.parametrize(
    "text,open_,expected",
    [
        ("The circle is red.", False, ("", "The circle is red.")),  # no reasoning
        ("◁think▷ still thinking ◁/thi", False, (" still thinking ◁/thi", "")),  # cut short
        ("◁thi", False, ("", "◁thi")),  # a start cut short is text
        ("red.◁/think▷Red.", True, ("red.", "Red.")),  # the prompt opened it
        ("◁think▷◁/think▷", False, ("", "")),
        ("x◁think▷y", False, ("", "x◁think▷y")),  # a marker later is the answer's text
    ],
)
def test_replies_with_and_without_reasoning(text, open_, expected):
    assert split_in_pieces(text, [len(text)], open_) == expected
    assert split_in_pieces(text, [1] * len(text), open_) == expected


def test_text_held_back_is_released_once_it_cannot_be_a_marker():
    split = Split(KIMI)
    assert split.feed("◁") == ("", "")
    assert split.feed("thin") == ("", "")
    assert split.feed("k▷ a ◁") == (" a ", "")  # "◁" may begin the end marker
    assert split.feed("x") == ("◁x", "")
    assert split.feed("◁/think▷ ok") == ("", " ok")


def test_a_prompt_opens_the_reasoning_when_its_last_start_is_not_closed():
    assert opened(KIMI, "◁think▷ I see")
    assert not opened(KIMI, "◁think▷ I see ◁/think▷ It is")
    assert not opened(KIMI, "assistant")


@pytest.fixture(scope="module")
def setup(tiny_checkpoint):
    tokenizer = load_tokenizer(tiny_checkpoint)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return tokenizer, Grammars(tokenizer, len(tokenizer), [eos])


def sampling(open_=False):
    grammar = choice_grammar(["circle", "square"])
    return SamplingParams(
        max_tokens=50, grammar=grammar, reasoning=(KIMI.start, KIMI.end), reasoning_open=open_
    )


def allowed(grammars, g):
    logits = torch.zeros(1, grammars.vocab_size)
    mask_forbidden(logits, [0], [g.matcher], [g.also_allowed])
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def test_the_grammar_waits_for_the_reasoning_to_end(setup):
    tokenizer, grammars = setup
    g = gate(grammars, sampling())
    start = allowed(grammars, g)
    first_byte = tokenizer.encode("◁", add_special_tokens=False)[0]
    circle = tokenizer.encode("circle", add_special_tokens=False)[0]
    assert first_byte in start and circle in start  # the marker or the answer
    for token in tokenizer.encode("◁think▷", add_special_tokens=False):
        assert g.state == START and token in allowed(grammars, g)  # only the marker goes on
        assert g.accept(token) is False
    assert g.state == THINKING and g.matcher is None and not g.also_allowed  # nothing masked
    for token in tokenizer.encode(" zebra ◁/think▷", add_special_tokens=False):
        assert g.accept(token) is False
    assert g.state == ANSWER and allowed(grammars, g) == allowed(
        grammars, gate(grammars, SamplingParams(max_tokens=5, grammar=sampling().grammar))
    )
    done = [g.accept(t) for t in tokenizer.encode("circle", add_special_tokens=False)]
    assert done[-1] is True


def test_without_reasoning_the_grammar_applies_from_the_first_token(setup):
    tokenizer, grammars = setup
    g = gate(grammars, sampling())
    tokens = tokenizer.encode("square", add_special_tokens=False)
    assert [g.accept(t) for t in tokens][-1] is True and g.state == ANSWER
    g = gate(grammars, sampling())
    with pytest.raises(GrammarError, match="refused"):
        g.accept(tokenizer.encode("zebra", add_special_tokens=False)[0])


def test_a_begun_marker_must_go_on(setup):
    tokenizer, grammars = setup
    g = gate(grammars, sampling())
    g.accept(tokenizer.encode("◁", add_special_tokens=False)[0])
    only = allowed(grammars, g)
    assert tokenizer.encode("circle", add_special_tokens=False)[0] not in only
    assert all(
        ("◁think▷".encode()[1:]).startswith(grammars.token_bytes(t))
        or grammars.token_bytes(t).startswith("◁think▷".encode()[1:])
        for t in only
    )


def test_an_opened_reasoning_starts_unmasked(setup):
    _, grammars = setup
    g = gate(grammars, sampling(open_=True))
    assert g.state == THINKING and g.matcher is None


def one_token(grammars, data):
    """A gate whose token 0 stands for `data` (a real vocabulary's longer tokens)."""
    return gate(grammars, sampling()), lambda t: data if t == 0 else grammars.token_bytes(t)


def test_the_answer_begun_in_the_token_that_ends_the_reasoning_is_the_grammars(setup):
    tokenizer, grammars = setup
    g, token_bytes = one_token(grammars, "◁think▷ round ◁/think▷\n ci".encode())
    g.token_bytes = token_bytes
    assert g.accept(0) is False and g.state == ANSWER  # start, reasoning, end: one token
    done = [g.accept(t) for t in tokenizer.encode("rcle", add_special_tokens=False)]
    assert done[-1] is True  # "ci" went to the grammar: "circle" is complete
    g, token_bytes = one_token(grammars, "◁think▷ x ◁/think▷zebra".encode())
    g.token_bytes = token_bytes
    with pytest.raises(GrammarError, match="refused"):
        g.accept(0)


def test_a_reply_may_not_end_before_its_answer(setup):
    tokenizer, grammars = setup
    g = gate(grammars, sampling())
    assert not g.waits  # may be the answer already: the grammar says whether it may end
    first, *rest = tokenizer.encode("◁think▷ hmm", add_special_tokens=False)
    g.accept(first)
    assert g.waits
    for token in rest:
        g.accept(token)
    assert g.waits and g.state == THINKING
    for token in tokenizer.encode("◁/think▷", add_special_tokens=False):
        g.accept(token)
    assert not g.waits


def test_markers_no_parser_has_are_refused(setup):
    _, grammars = setup
    odd = SamplingParams(max_tokens=5, grammar=choice_grammar(["a"]), reasoning=("<a>", "</a>"))
    with pytest.raises(GrammarError, match="unknown reasoning markers"):
        gate(grammars, odd)
