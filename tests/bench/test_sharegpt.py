"""ShareGPT as `vllm bench serve` reads it: the first human turn and its gpt reply, the pairs of
unusable lengths left out, shuffled by the seed; and every way a file can be wrong."""

import json

import pytest

from epd.bench.sharegpt import Sample, read, tokens


def talk(*turns: tuple[str, str]) -> dict:
    return {"id": "x", "conversations": [{"from": who, "value": text} for who, text in turns]}


WORDS = "one two three four five"
FILE = [
    talk(("human", "What is a cat? Tell me."), ("gpt", "A cat is a small animal."), ("human", "x")),
    talk(("gpt", "Hello, how can I help?"), ("human", WORDS), ("gpt", "six seven eight nine")),
    talk(("human", "hi"), ("gpt", "a reply long enough")),  # the prompt is too short
    talk(("human", WORDS), ("gpt", "ok")),  # the reply is too short
    talk(("human", "w " * 1025), ("gpt", WORDS)),  # the prompt is too long
    talk(("human", "w " * 1000), ("gpt", "w " * 1049)),  # 2049 tokens in all
    talk(("human", WORDS)),  # no reply
    "not a conversation",
    {"conversations": "not a list"},
    talk(("human", WORDS), ("gpt", WORDS)) | {"conversations": [{"from": "human"}, 3]},
]


@pytest.fixture
def path(tmp_path):
    written = tmp_path / "sharegpt.json"
    written.write_text(json.dumps(FILE))
    return str(written)


def test_tokens_are_words_and_punctuation_marks():
    assert tokens("What is a cat? Tell me.") == 8 and tokens("") == 0


def test_each_usable_conversation_gives_its_first_human_turn_and_its_replys_length(path):
    samples = read(path, seed=0)
    assert sorted(samples, key=lambda s: s.prompt) == [
        Sample("What is a cat? Tell me.", 7),
        Sample(WORDS, 4),  # the human turn after an opening gpt turn, and the reply after it
    ]


def test_a_length_given_for_every_request_keeps_short_replies(path):
    samples = read(path, seed=0, output_tokens=100)
    assert {s.output_tokens for s in samples} == {100}
    assert [s.prompt for s in samples].count(WORDS) == 2  # "ok"'s prompt kept
    assert len(samples) == 4  # and a prompt of 1000 with 100 to come fits 2048


def test_the_order_is_the_seeds(tmp_path):
    many = tmp_path / "many.json"
    many.write_text(
        json.dumps([talk(("human", f"{WORDS} {i}"), ("gpt", WORDS)) for i in range(20)])
    )
    first, again, other = (read(str(many), seed) for seed in (1, 1, 2))
    assert first == again and first != other and set(first) == set(other)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("{not json", "is not JSON"),
        (json.dumps({"conversations": []}), "must hold a list of conversations"),
        (json.dumps([talk(("human", "hi"), ("gpt", "yo"))]), "no conversation has a human turn"),
    ],
)
def test_a_file_that_gives_no_requests_is_an_error_that_says_why(tmp_path, text, error):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    with pytest.raises(ValueError, match=error):
        read(str(bad), seed=0)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="cannot read the dataset .*nothing.json"):
        read(str(tmp_path / "nothing.json"), seed=0)
