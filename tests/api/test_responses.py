"""Chat and legacy completion bodies and chunks: which stop ended each choice, the prompt
echoed."""

import json

from epd.api.responses import Echo, Reply, TextReply, prompt_logprobs_json
from epd.generation.params import TokenLogprob, TopLogprob
from epd.generation.sampling import Scored
from epd.wire.messages import TokenDelta


def entry(token: str, logprob: float) -> TokenLogprob:
    return TokenLogprob(token, logprob, tuple(token.encode()), (TopLogprob(token, logprob, ()),))


ECHO = Echo("Hi there", "Hi", (entry(" there", -1.5),))
DELTAS = [
    TokenDelta("r", (7,), " you", 1, None, (entry(" you", -0.5),)),
    TokenDelta("r", (8,), "!", 2, "length", (entry("!", -0.25),)),
]


def test_each_choice_begins_with_the_prompt_and_its_scores():
    reply = TextReply("r", "m", 2, want_logprobs=True, echoes=[ECHO])
    (choice,) = reply.completion(DELTAS)["choices"]
    assert choice["text"] == "Hi there you!"
    assert choice["logprobs"] == {
        "tokens": ["Hi", " there", " you", "!"],
        "token_logprobs": [None, -1.5, -0.5, -0.25],
        "top_logprobs": [None, {" there": -1.5}, {" you": -0.5}, {"!": -0.25}],
        "text_offset": [0, 2, 8, 12],
    }


def test_a_stream_echoes_the_prompt_of_each_choice_once_in_its_first_chunk():
    prompts = [ECHO, Echo("Yo", "Yo")]
    reply = TextReply("r", "m", 3, want_logprobs=True, echoes=prompts, n=2)
    sent = [
        json.loads(reply.delta_chunk(d)[len("data: ") :])["choices"][0]
        for index in (3, 0)  # choice 3 is prompt 1's second, choice 0 prompt 0's first
        for d in (
            TokenDelta("r", (7,), " you", 1, None, (entry(" you", -0.5),), index),
            TokenDelta("r", (8,), "!", 2, "length", (entry("!", -0.25),), index),
        )
    ]
    assert [c["text"] for c in sent] == ["Yo you", "!", "Hi there you", "!"]
    assert sent[0]["logprobs"]["token_logprobs"] == [None, -0.5]
    assert sent[0]["logprobs"]["text_offset"] == [0, 2]
    assert sent[1]["logprobs"]["text_offset"] == [6]  # after "Yo you"
    assert sent[2]["logprobs"]["tokens"] == ["Hi", " there", " you"]
    assert sent[3]["logprobs"]["text_offset"] == [12]


def test_offsets_stay_in_the_text_where_a_token_is_part_of_a_character():
    """Two byte tokens of one character each spell "\ufffd" though the text holds the
    character once: offsets never point past the text, and the generated text's tokens begin
    where it does, after the prompt's text."""
    echo = Echo("日", "\ufffd", (entry("\ufffd", -1.0),))
    reply = TextReply("r", "m", 2, want_logprobs=True, echoes=[echo])
    (choice,) = reply.completion(DELTAS[:1])["choices"]
    assert choice["text"] == "日 you"
    assert choice["logprobs"]["text_offset"] == [0, 1, 1]


def test_generated_tokens_of_one_character_begin_where_it_does():
    """Decode sends no text for a token that ends inside a character, then the whole
    character with the token that completes it: both tokens begin at the character."""
    deltas = [
        TokenDelta("r", (7,), "", 1, None, (entry("\ufffd", -0.5),)),
        TokenDelta("r", (8,), "日", 2, None, (entry("\ufffd", -0.5),)),
        TokenDelta("r", (9,), " you", 3, "length", (entry(" you", -0.5),)),
    ]
    reply = TextReply("r", "m", 2, want_logprobs=True, echoes=[ECHO])
    (choice,) = reply.completion(deltas)["choices"]
    assert choice["text"] == "Hi there日 you"
    assert choice["logprobs"]["text_offset"] == [0, 2, 8, 8, 9]
    streamed = TextReply("r", "m", 2, want_logprobs=True)
    sent = [json.loads(streamed.delta_chunk(d)[len("data: ") :]) for d in deltas]
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in sent] == [[0], [0], [1]]
    # Several tokens in one delta (prefill's first, with others): spelt, within its text.
    together = TokenDelta(
        "r", (7, 8, 9), "日 you", 3, "length", sum((d.logprobs for d in deltas), ())
    )
    (choice,) = TextReply("r", "m", 2, want_logprobs=True).completion([together])["choices"]
    assert choice["logprobs"]["text_offset"] == [0, 1, 2]


def test_max_tokens_0_gives_the_prompt_alone():
    """The token prefill had to generate is not told, whole or streamed."""
    reply = TextReply("r", "m", 2, want_logprobs=True, echoes=[ECHO], prompt_only=True)
    last = TokenDelta("r", (7,), " you", 1, "length", (entry(" you", -0.5),))
    body = reply.completion([last])
    (choice,) = body["choices"]
    assert choice["text"] == "Hi there" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [None, -1.5]
    assert body["usage"]["completion_tokens"] == 0
    streamed = json.loads(reply.delta_chunk(last)[len("data: ") :])["choices"][0]
    assert streamed["text"] == "Hi there" and streamed["logprobs"]["tokens"] == ["Hi", " there"]
    assert json.loads(reply.usage_chunk(1)[len("data: ") :])["usage"]["completion_tokens"] == 0


def test_prompt_logprobs_name_each_token_and_its_alternatives_by_id():
    """vLLM's layout: None first; then the prompt's own token (its true rank), and the
    alternatives asked for, ranked; a token among its own alternatives appears once."""
    scored = [
        Scored(7, -2.5, 3, ((4, -0.5), (9, -1.0), (7, -2.5))),
        Scored(4, -0.5, 1, ((4, -0.5), (9, -1.0), (7, -2.5))),
    ]
    spell = {4: "a", 7: "b", 9: "c"}.__getitem__
    assert prompt_logprobs_json(scored, 2, spell) == [
        None,
        {
            "7": {"logprob": -2.5, "rank": 3, "decoded_token": "b"},
            "4": {"logprob": -0.5, "rank": 1, "decoded_token": "a"},
            "9": {"logprob": -1.0, "rank": 2, "decoded_token": "c"},
        },
        {
            "4": {"logprob": -0.5, "rank": 1, "decoded_token": "a"},
            "9": {"logprob": -1.0, "rank": 2, "decoded_token": "c"},
        },
    ]
    assert prompt_logprobs_json(scored, 0, spell)[1] == {
        "7": {"logprob": -2.5, "rank": 3, "decoded_token": "b"}
    }


STOPPED = [  # choice 0 ends at a stop string, choice 1 at max_tokens, choice 2 at a stop id
    TokenDelta("r", (7,), "a", 1, None),
    TokenDelta("r", (8,), "b", 2, "stop", stop_reason="END"),
    TokenDelta("r", (7,), "a", 1, "length", index=1),
    TokenDelta("r", (9,), "", 1, "stop", index=2, stop_reason=9),
]


def chunk_choice(chunk: str) -> dict:
    return json.loads(chunk.removeprefix("data: "))["choices"][0]


def test_each_choice_says_which_stop_ended_it_as_vllm_does():
    """vLLM's `stop_reason`: in every whole choice; in a chat stream only the chunk that ends
    a choice has it, in a legacy stream every chunk (null until the end)."""
    for reply in (Reply("r", "m", 2, False), TextReply("r", "m", 2, False)):
        choices = reply.completion(STOPPED)["choices"]
        assert [c["stop_reason"] for c in choices] == ["END", None, 9]
    chat = [chunk_choice(Reply("r", "m", 2, False).delta_chunk(d)) for d in STOPPED]
    assert [c.get("stop_reason", "absent") for c in chat] == ["absent", "END", None, 9]
    legacy = [chunk_choice(TextReply("r", "m", 2, False).delta_chunk(d)) for d in STOPPED]
    assert [c.get("stop_reason", "absent") for c in legacy] == [None, "END", None, 9]


def test_the_fingerprint_is_in_whole_replies_and_the_chunk_that_ends_a_stream():
    """As vLLM: every whole reply; in a stream the chunk that ends each choice, or where the
    stream ends in a usage chunk, that chunk alone."""
    for kind in (Reply, TextReply):
        reply = kind("r", "m", 2, False, system_fingerprint="epd-1-abcdef12")
        assert reply.completion(STOPPED)["system_fingerprint"] == "epd-1-abcdef12"
        chunks = [reply.delta_chunk(d) for d in STOPPED] + [reply.usage_chunk(3)]
        stamped = ["system_fingerprint" in json.loads(c.removeprefix("data: ")) for c in chunks]
        assert stamped == [False, True, True, True, False]
        usage = kind("r", "m", 2, False, True, system_fingerprint="epd-1-abcdef12")
        chunks = [usage.delta_chunk(d) for d in STOPPED] + [usage.usage_chunk(3)]
        stamped = ["system_fingerprint" in json.loads(c.removeprefix("data: ")) for c in chunks]
        assert stamped == [False, False, False, False, True]
