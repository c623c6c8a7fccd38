"""Grammar-constrained sampling: masks, matchers, the compiled-grammar cache, and random logits
that must still produce output the grammar accepts."""

import json
import re

import jsonschema
import llguidance
import pytest
import torch

from epd.checkpoint.tokenizer import load_tokenizer
from epd.generation.grammar import (
    CACHED_GRAMMARS,
    GrammarError,
    Grammars,
    GrammarUnavailable,
    advance,
    choice_grammar,
    json_schema_grammar,
    lark_grammar,
    mask_forbidden,
    regex_grammar,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 2},
    },
    "required": ["name", "size", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=["appended", "inside", "tiktoken"])
def setup(request, checkpoint_in):
    """Each tokenizer layout: special tokens after the vocabulary, inside it (ids 0-11, which
    kept decode from starting), and Kimi's tiktoken files (llguidance's tiktoken path)."""
    tokenizer = load_tokenizer(checkpoint_in(request.param))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return tokenizer, eos, Grammars(tokenizer, len(tokenizer), [eos])


def follow(setup, grammar, seed, steps=80):
    """Sample from random logits under the grammar until it stops; the text and the ids."""
    tokenizer, eos, grammars = setup
    matcher = grammars.matcher(grammar)
    generator = torch.Generator().manual_seed(seed)
    ids = []
    for _ in range(steps):
        logits = torch.randn(1, len(tokenizer), generator=generator) * 4
        mask_forbidden(logits, [0], [matcher])
        token = int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
        ids.append(token)
        if advance(matcher, token):
            break
    return tokenizer.decode([t for t in ids if t != eos]), ids


@pytest.mark.parametrize("seed", range(5))
def test_random_logits_still_give_valid_compact_json(setup, seed):
    text, _ = follow(setup, json_schema_grammar(SCHEMA), seed)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert not re.search(r"\s", text.replace(json.loads(text)["name"], ""))  # compact


@pytest.mark.parametrize("schema", [True, {}])
def test_the_schema_true_allows_any_json_value(setup, schema):
    text, _ = follow(setup, json_schema_grammar(schema), seed=1)
    json.loads(text)


@pytest.mark.parametrize("seed", range(3))
def test_regex_and_choice(setup, seed):
    text, _ = follow(setup, regex_grammar(r"[a-c]{2,4}-[0-9]{2}"), seed)
    assert re.fullmatch(r"[a-c]{2,4}-[0-9]{2}", text)
    text, _ = follow(setup, choice_grammar(["circle", "square", "triangle"]), seed)
    assert text in ("circle", "square", "triangle")


def test_the_mask_leaves_only_allowed_tokens(setup):
    tokenizer, _, grammars = setup
    matcher = grammars.matcher(choice_grammar(["circle", "square"]))
    logits = torch.zeros(3, len(tokenizer))
    mask_forbidden(logits, [1], [matcher])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed and all(
        any(c.startswith(tokenizer.decode([t])) for c in ("circle", "square")) for t in allowed
    )
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()  # other rows


def test_a_refused_token_and_a_bad_grammar_are_errors(setup):
    tokenizer, _, grammars = setup
    matcher = grammars.matcher(choice_grammar(["circle"]))
    with pytest.raises(GrammarError, match="refused token"):
        advance(matcher, tokenizer.encode("zebra", add_special_tokens=False)[0])
    with pytest.raises(GrammarError, match="unusable grammar"):
        grammars.check(regex_grammar("(unclosed"))


def test_compiled_grammars_are_cached_and_bounded(setup):
    _, _, grammars = setup
    grammar = regex_grammar("[0-9]+")
    first = grammars.matcher(grammar)
    assert grammars.matcher(grammar) is not first  # each request gets its own copy
    assert grammar in grammars.compiled
    for i in range(CACHED_GRAMMARS + 1):
        grammars.check(regex_grammar(f"a{{{i + 1}}}"))
    assert len(grammars.compiled) == CACHED_GRAMMARS and grammar not in grammars.compiled


def test_a_grammar_that_fails_fails_every_time_it_is_asked(setup):
    """A lexer limit reached by one copy is shared by the compiled matcher's later copies: they
    must fail too (not allow only a stop token, an empty reply the grammar does not accept),
    and once the grammar is forgotten a fresh compile fails the same way."""
    tokenizer, eos, grammars = setup
    grammar = regex_grammar("a{999999}")

    def first_token() -> None:
        matcher = grammars.matcher(grammar)
        logits = torch.zeros(1, len(tokenizer))
        mask_forbidden(logits, [0], [matcher])
        allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
        assert eos not in allowed
        advance(matcher, allowed[0])

    with pytest.raises(GrammarError, match="lexer") as failed:
        first_token()
    assert len(str(failed.value)) < 300  # llguidance's parser state is not in the message
    with pytest.raises(GrammarError, match="lexer"):  # the next copy, at its mask
        first_token()
    grammars.forget(grammar)
    assert grammar not in grammars.compiled
    with pytest.raises(GrammarError, match="lexer"):
        first_token()


@pytest.mark.parametrize(
    "grammar,expected",
    [
        (choice_grammar(["<|im_end|> then [EOS]"]), "<|im_end|> then [EOS]"),
        (json_schema_grammar({"enum": ["<|media_pad|>"]}), '"<|media_pad|>"'),
        (regex_grammar(r"<\|im_end\|>x"), "<|im_end|>x"),
    ],
)
def test_forced_text_that_spells_a_special_token_is_written_as_text(setup, grammar, expected):
    """llguidance allowed only the special token where a grammar forced its text, then refused
    that token: the request failed. The text is now written with ordinary tokens."""
    tokenizer, eos, _ = setup
    for seed in range(3):
        text, ids = follow(setup, grammar, seed)
        assert text == expected
        assert not (set(tokenizer.all_special_ids) - {eos}).intersection(ids)


def test_the_tiktoken_layout_takes_llguidances_tiktoken_path(checkpoint_in, monkeypatch):
    calls = []
    original = llguidance.LLTokenizer.from_tiktoken
    monkeypatch.setattr(
        llguidance.LLTokenizer, "from_tiktoken", lambda **kw: calls.append(kw) or original(**kw)
    )
    tokenizer = load_tokenizer(checkpoint_in("tiktoken"))
    Grammars(tokenizer, len(tokenizer), [0]).check(regex_grammar("[a-c]+"))
    assert len(calls) == 1 and len(calls[0]["encoder"]) == len(tokenizer) - 256


def test_a_tokenizer_llguidance_cannot_read_refuses_grammars_with_the_reason(checkpoint_in):
    """The grammar engine is optional: built or not, the process goes on, and each grammar
    asked for is refused with why."""
    tokenizer = load_tokenizer(checkpoint_in("wordpiece"))
    grammars = Grammars(tokenizer, len(tokenizer), [0])
    assert "WordPiece" in grammars.unavailable
    with pytest.raises(GrammarUnavailable, match="structured outputs are unavailable: llguidance"):
        grammars.matcher(regex_grammar("[a-c]+"))


def test_a_grammar_names_special_tokens_by_id(setup):
    _, eos, grammars = setup
    grammars.check(lark_grammar(f'start: "a" <[{eos}]>'))
    with pytest.raises(GrammarError, match=r"name special tokens by id, as <\[12\]>"):
        grammars.check(lark_grammar('start: "a" <|im_end|>'))
