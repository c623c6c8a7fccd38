"""A prompt begun from cached blocks gets what it gets prefilled from its start."""

import asyncio
import random

import pytest
import torch

from epd.generation.params import SamplingParams
from epd.model.block_manager import BLOCK_TOKENS
from epd.prefill.batcher import PrefillBatcher
from epd.prefill.engine import Prompt
from epd.prefill.prefix_cache import PrefixCache, image_spans

GREEDY = SamplingParams(4, temperature=0, logprobs=True, top_logprobs=3)
rng = random.Random(0)
SYSTEM = [rng.randrange(5, 400) for _ in range(40)]


def cache_for(engine, max_bytes=1 << 24):
    config = engine.lm.config
    dtype = engine.lm.lm_head.weight.dtype
    return PrefixCache(config.num_hidden_layers, config.latent_dim, dtype, engine.device, max_bytes)


def served(engine, prompts, cache, max_tokens=512):
    """Each prompt through a batcher with the cache, one after another."""

    async def main():
        batcher = PrefillBatcher(engine, max_tokens, reply_to="", prefix_cache=cache)
        runner = asyncio.create_task(batcher.run())
        results = [await batcher.prefill(p) for p in prompts]
        runner.cancel()
        batcher.close()
        return [r.handoff for r in results]

    return asyncio.run(main())


def assert_as_alone(engine, prompt, handoff):
    alone = engine.run_batch([prompt])[0].handoff
    assert handoff.first_tokens == alone.first_tokens
    for mine, its in zip(handoff.first_logprobs, alone.first_logprobs, strict=True):
        assert mine.logprob == pytest.approx(its.logprob, abs=1e-5)
        assert [t.token for t in mine.top_logprobs] == [t.token for t in its.top_logprobs]
    torch.testing.assert_close(handoff.cache, alone.cache, atol=1e-5, rtol=1e-5)


def text(request_id, ids, sampling=GREEDY, salt=None):
    return Prompt(request_id, ids, None, sampling, cache_salt=salt)


def test_the_next_turn_prefills_only_what_follows_the_cached_blocks(engine):
    cache = cache_for(engine)
    first = text("a", [*SYSTEM, 11, 12, 13])
    second = text("b", [*first.prompt_ids, 21, 22, *range(30, 60)])
    handoffs = served(engine, [first, second], cache)
    assert cache.hits == 2 * BLOCK_TOKENS  # the first turn's whole blocks
    assert cache.queries == len(first.prompt_ids) + len(second.prompt_ids)
    assert_as_alone(engine, second, handoffs[1])


def test_only_prompts_of_the_same_cache_salt_share_blocks(engine):
    """A tenant that salts its requests cannot time whether another sent a prompt."""
    cache = cache_for(engine)
    ids = [*SYSTEM, 11, 12, 13]
    served(engine, [text("a", ids, salt="t-1"), text("b", ids, salt="t-2"), text("c", ids)], cache)
    assert cache.hits == 0  # the unsalted and each salt miss the others' blocks
    again = [text("d", ids, salt="t-2"), text("e", ids), text("f", ids, salt="t-1")]
    handoffs = served(engine, again, cache)
    assert cache.hits == 3 * 2 * BLOCK_TOKENS  # each its own blocks
    assert_as_alone(engine, again[0], handoffs[0])


def test_a_prompt_its_first_token_ends_is_cached_too(engine):
    """max_tokens 1 hands nothing off: its rows are kept from the forward itself."""
    cache = cache_for(engine)
    ids = [*SYSTEM, 11, 12, 13]
    (handoff,) = served(engine, [text("a", ids, SamplingParams(1, temperature=0))], cache)
    assert handoff is None and cache.blocks.cached == 2
    handoffs = served(engine, [text("b", ids)], cache)
    assert cache.hits == 2 * BLOCK_TOKENS
    assert_as_alone(engine, text("b", ids), handoffs[0])


@pytest.mark.parametrize("length", [2 * BLOCK_TOKENS, 2 * BLOCK_TOKENS + 1])
def test_a_prompt_cached_whole_still_computes_its_last_token(engine, length):
    cache = cache_for(engine)
    ids = SYSTEM[:length] if length <= len(SYSTEM) else [*SYSTEM, 1][:length]
    handoffs = served(engine, [text("a", ids), text("b", ids)], cache)
    # 32 tokens: the first block only (the second holds the last token); 33: both blocks
    assert cache.hits == (length - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    assert_as_alone(engine, text("b", ids), handoffs[1])


def test_a_hit_continues_in_chunks(engine):
    cache = cache_for(engine)
    long = text("b", [*SYSTEM, *range(100, 160)])
    handoffs = served(engine, [text("a", SYSTEM), long], cache, max_tokens=16)
    assert cache.hits == 2 * BLOCK_TOKENS
    assert_as_alone(engine, long, handoffs[1])


def test_choices_share_the_hit(engine):
    cache = cache_for(engine)
    three = SamplingParams(4, temperature=1.0, n=3, seed=5, logprobs=True)
    handoffs = served(engine, [text("a", SYSTEM), text("b", [*SYSTEM, 9, 8, 7], three)], cache)
    assert cache.hits == 2 * BLOCK_TOKENS
    assert_as_alone(engine, text("b", [*SYSTEM, 9, 8, 7], three), handoffs[1])


def with_image(engine, request_id, digest, rows, before=SYSTEM[:20], after=(3, 4, 5), salt=None):
    """A prompt of `before`, 24 image slots (rows (24, hidden)) and `after`."""
    ids = [*before, *[engine.placeholder_id] * len(rows), *after]
    spans = image_spans(ids, engine.placeholder_id, [len(rows)], [digest])
    return Prompt(request_id, ids, rows, GREEDY, image_spans=spans, cache_salt=salt)


def test_the_same_image_hits_and_another_does_not(engine):
    cache = cache_for(engine)
    hidden = engine.lm.config.hidden_size
    picture, other = torch.randn(24, hidden), torch.randn(24, hidden)
    # 20 text tokens, 24 image rows (20-43), 3 more: blocks 0-15 and 16-31 are full; the
    # second ends inside the image
    first = with_image(engine, "a", "aa" * 32, picture)
    again = with_image(engine, "b", "aa" * 32, picture, after=(3, 4, 5, 6))
    changed = with_image(engine, "c", "bb" * 32, other)
    handoffs = served(engine, [first, again, changed], cache)
    assert cache.hits == 2 * BLOCK_TOKENS + BLOCK_TOKENS  # again: both blocks; changed: the first
    assert_as_alone(engine, again, handoffs[1])
    assert_as_alone(engine, changed, handoffs[2])


def test_the_same_image_under_another_salt_does_not_hit(engine):
    cache = cache_for(engine)
    picture = torch.randn(24, engine.lm.config.hidden_size)
    # block 0 is text, block 1 holds the image: neither hits under another salt
    first = with_image(engine, "a", "aa" * 32, picture, salt="t-1")
    others = [
        with_image(engine, r, "aa" * 32, picture, salt=s) for r, s in (("b", "t-2"), ("c", None))
    ]
    served(engine, [first, *others], cache)
    assert cache.hits == 0
    served(engine, [with_image(engine, "d", "aa" * 32, picture, salt="t-1")], cache)
    assert cache.hits == 2 * BLOCK_TOKENS


def test_prompts_that_cannot_be_cached_are_not(engine):
    placeholder = engine.placeholder_id
    scored = Prompt("s", SYSTEM, None, GREEDY, prompt_logprobs=1)
    unknown = Prompt("u", [*SYSTEM, placeholder], torch.zeros(1, 8), GREEDY)  # no spans given
    assert not scored.cacheable and not unknown.cacheable
    assert image_spans([placeholder, 1, placeholder], placeholder, [2], ["00"]) is None
    assert image_spans([placeholder] * 3, placeholder, [2], ["00"]) is None


def test_the_cache_keeps_within_its_budget_evicting_the_least_recently_used(engine):
    config = engine.lm.config
    per_block = config.num_hidden_layers * BLOCK_TOKENS * config.latent_dim * 4
    cache = cache_for(engine, max_bytes=4 * per_block)  # four blocks
    prompts = [text(str(i), [i + 5] * (2 * BLOCK_TOKENS + 1)) for i in range(3)]
    served(engine, prompts, cache)
    assert cache.storage.shape[1] == 5 and cache.blocks.cached == 4  # + the zero block
    served(engine, [text("again", prompts[2].prompt_ids)], cache)
    assert cache.hits == 2 * BLOCK_TOKENS  # the latest prompt's blocks were kept


def test_a_forward_out_of_memory_empties_the_cache_and_runs_again(engine, monkeypatch):
    """The cache holds memory a request needs: the request gets it, and is served."""
    cache = cache_for(engine)
    first = text("a", [*SYSTEM, 11, 12, 13])
    served(engine, [first], cache)
    assert cache.blocks.cached and cache.nbytes > cache.storage[:, :1].nbytes
    real, calls = engine.run_chunks, []

    def short_of_memory_while_cached(chunks, reply_to=""):
        calls.append(cache.nbytes)
        if cache.blocks.cached:
            return [torch.OutOfMemoryError("no memory") for _ in chunks]
        return real(chunks, reply_to)

    monkeypatch.setattr(engine, "run_chunks", short_of_memory_while_cached)
    second = text("b", [*SYSTEM, 21, 22])
    (handoff,) = served(engine, [second], cache)
    one_block = cache.storage[:, :1].nbytes
    assert len(calls) == 2 and calls[0] > one_block  # it ran short with blocks cached,
    assert calls[1] == one_block  # and again on the memory they gave back
    monkeypatch.undo()
    assert_as_alone(engine, second, handoff)
