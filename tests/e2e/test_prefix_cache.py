"""Prompts that begin as earlier ones did take their KV from the prefix cache, and get exactly
what the one-process path (no cache) gives them."""

import re

import pytest
import requests
from PIL import Image

from .stack import data_url, image_part, text_part

PICTURE = data_url(Image.new("RGB", (840, 560), (200, 30, 90)))  # 600 image tokens
LONG_SYSTEM = " ".join(["the quick brown fox jumps over the lazy dog"] * 40)  # ~400 tokens


def metric(base: int, name: str, role: str = "prefill") -> float:
    """A counter of one role, from its own port (the API's scrape holds peers' texts for 1 s)."""
    port = {"prefill": base + 20, "decode": base + 12}[role]
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    pattern = rf'^epd:{name}_total\{{[^}}]*role="{role}"[^}}]*\}} (\S+)$'
    found = re.search(pattern, text, re.M)
    assert found, f"no {name} series of {role}"
    return float(found.group(1))


def hits(base: int) -> float:
    return metric(base, "prefix_cache_hits")


def same_as_local(client, local, model, messages, **params):
    """The stack's reply equals the one-process path's, token for token."""
    params = {"max_tokens": 12, "temperature": 0, "logprobs": True} | params
    reply = client.chat.completions.create(model=model, messages=messages, **params)
    expected = local.chat({"model": model, "messages": messages, **params})
    for choice in reply.choices:
        tokens = [e for d in expected.choices[choice.index].deltas for e in d.logprobs]
        assert [t.token for t in choice.logprobs.content] == [e.token for e in tokens]
        assert [t.logprob for t in choice.logprobs.content] == pytest.approx(
            [e.logprob for e in tokens], abs=1e-4
        )
    assert reply.usage.prompt_tokens == expected.prompt_tokens
    return reply


def test_turns_that_share_a_prefix_hit_the_cache_and_answer_as_without(
    stack, client, model_name, local
):
    _, base = stack
    ask = lambda messages, **params: same_as_local(client, local, model_name, messages, **params)  # noqa: E731
    before = hits(base)
    first = [
        {"role": "system", "content": LONG_SYSTEM},
        {"role": "user", "content": [image_part(PICTURE), text_part("What colour is it?")]},
    ]
    ask(first)
    # The same picture, other words after it: the hit ends inside the image's tokens.
    ask([first[0], {"role": "user", "content": [image_part(PICTURE), text_part("Describe it.")]}])
    after_image = hits(base)
    assert after_image - before >= 400 + 512  # the system prompt and most of the image
    ask(first)  # asked again whole: all but its last token cached
    ask(first, n=2)  # two choices from the one hit
    next_turn = [
        *first,
        {"role": "assistant", "content": "Crimson."},
        {"role": "user", "content": " ".join(["and what else is there to see"] * 80)},
    ]
    sent, reused = metric(base, "kv_handoff_tokens"), metric(base, "kv_handoff_reused_tokens")
    held = metric(base, "prefix_cache_hits", "decode")
    ask(next_turn)  # past the hit, 560 new tokens: prefilled in chunks of 512
    assert hits(base) - after_image >= 3 * (400 + 600)
    # Decode held the first turn's blocks: the hand-off carried the rest only.
    assert metric(base, "kv_handoff_reused_tokens") - reused >= 400 + 600
    assert metric(base, "prefix_cache_hits", "decode") - held >= 400 + 600
    prompt_tokens = local.chat({"model": model_name, "messages": next_turn}).prompt_tokens
    assert metric(base, "kv_handoff_tokens") - sent <= prompt_tokens - (400 + 600)


def image_hits(base: int) -> float:
    text = requests.get(f"http://127.0.0.1:{base + 20}/metrics", timeout=5).text
    found = re.search(r"^epd:image_cache_hits_total\{[^}]*\} (\S+)$", text, re.M)
    assert found, "no image cache hits series"
    return float(found.group(1))


def test_a_cache_salt_keeps_each_tenants_prompts_and_images_its_own(stack, client, model_name):
    """Over the three processes: a prompt and image sent under one salt are cached for that
    salt alone (max_tokens 1: prefill ends each request, and still keeps its blocks)."""
    _, base = stack
    picture = data_url(Image.new("RGB", (280, 280), (10, 160, 40)))  # no other test sends it
    messages = [
        {"role": "system", "content": "Tenants. " + LONG_SYSTEM[:450]},  # ~100 tokens
        {"role": "user", "content": [image_part(picture), text_part("What colour is it?")]},
    ]

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt else {}
        reply = client.chat.completions.create(
            model=model_name, messages=messages, max_tokens=1, extra_body=extra
        )
        return reply.usage.prompt_tokens_details.cached_tokens

    before = image_hits(base)
    assert [cached("tenant-a"), cached("tenant-b"), cached(None)] == [0, 0, 0]
    assert image_hits(base) == before  # each encoded its own
    assert cached("tenant-a") > 100 and image_hits(base) == before + 1  # text and image
