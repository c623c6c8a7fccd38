"""Speculative decoding through the three-process stack (real processes, the openai client):
with n-gram drafts, greedy replies are the one-process path's without them, token for token,
logprobs to 1e-4: text, an image, a grammar, stops, n=2, streamed; and decode's /health and
/metrics say how many drafts it kept."""

from __future__ import annotations

import json
import urllib.request

import pytest
from PIL import Image

from .stack import cluster, data_url, health, image_part, text_part

NGRAM = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
)
BIASED = {"logit_bias": {"42": 6.0, "99": 5.5, "17": 5.0}, "frequency_penalty": 0.5}  # loops
REQUESTS = {
    "text": {
        "messages": [{"role": "user", "content": "Say it again: one two three, one two three"}],
        "max_tokens": 24,
        "logprobs": True,
        "top_logprobs": 2,
    },
    "image": {
        "messages": [
            {
                "role": "user",
                "content": [
                    image_part(data_url(Image.new("RGB", (84, 56), "red"))),
                    text_part("?"),
                ],
            }
        ],
        "max_tokens": 16,
        "logprobs": True,
    },
    "looping": {
        "messages": [{"role": "user", "content": "Count."}],
        "max_tokens": 40,
        "logprobs": True,
        **BIASED,
    },
    "stopped": {
        "messages": [{"role": "user", "content": "Count."}],
        "max_tokens": 40,
        "stop": ["<stop>"],  # replaced below by a piece of the looping reply
        **BIASED,
    },
    "grammar": {
        "messages": [{"role": "user", "content": "Yes or no?"}],
        "max_tokens": 12,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": {"enum": ["yes", "no", "yes yes yes"]}},
        },
    },
    "two": {"messages": [{"role": "user", "content": "Two of them."}], "max_tokens": 20, "n": 2},
}


@pytest.fixture(scope="module")
def expected(local):
    """The one-process path's replies, without drafts."""
    found = {}
    looping = local.chat({"model": "m", "temperature": 0, **REQUESTS["looping"]})
    REQUESTS["stopped"]["stop"] = [looping.choices[0].text[20:23]]
    for name, body in REQUESTS.items():
        found[name] = local.chat({"model": "m", "temperature": 0, **body})
    return found


def test_greedy_replies_with_drafts_are_the_one_process_paths_without(tiny_checkpoint, expected):
    flags = ("--dtype", "float32")
    role_flags = {"decode": ("--speculative-config", NGRAM)}
    with cluster(tiny_checkpoint, flags=flags, role_flags=role_flags) as (_, client, base):
        for name, body in REQUESTS.items():
            extra = {k: body[k] for k in ("logit_bias", "frequency_penalty") if k in body}
            rest = {k: v for k, v in body.items() if k not in extra}
            reply = client.chat.completions.create(model="tiny", temperature=0, **rest, **extra)
            local = expected[name]
            assert len(reply.choices) == len(local.choices), name
            for ours, theirs in zip(reply.choices, local.choices, strict=True):
                assert ours.message.content == theirs.text, name
                assert ours.finish_reason == theirs.finish_reason, name
                if ours.logprobs:
                    assert [t.token for t in ours.logprobs.content] == [
                        e.token for d in theirs.deltas for e in d.logprobs
                    ], name
                    assert [t.logprob for t in ours.logprobs.content] == pytest.approx(
                        [e.logprob for d in theirs.deltas for e in d.logprobs], abs=1e-4
                    ), name
            assert reply.usage.completion_tokens == sum(len(c.token_ids) for c in local.choices)
        streamed = client.chat.completions.create(
            model="tiny", temperature=0, stream=True, **REQUESTS["looping"]
        )
        chunks = [c.choices[0] for c in streamed if c.choices]
        looping = expected["looping"].choices[0]
        assert "".join(c.delta.content or "" for c in chunks) == looping.text
        tokens = [t.logprob for c in chunks if c.logprobs for t in c.logprobs.content]
        assert tokens == pytest.approx(
            [e.logprob for d in looping.deltas for e in d.logprobs], abs=1e-4
        )
        assert any(len(c.logprobs.content) > 1 for c in chunks if c.logprobs)  # drafts kept
        assert expected["stopped"].choices[0].finish_reason == "stop"
        _, status = health(base + 12)
        drafts = status["speculative"]
        assert drafts["accepted_tokens"] > 0 and 0 < drafts["acceptance_rate"] <= 1
        metrics = metrics_text(base + 12)
        assert "epd:spec_decode_num_accepted_tokens_total" in metrics


def metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()
