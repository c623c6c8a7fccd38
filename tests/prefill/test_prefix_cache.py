"""A prompt begun from cached blocks gets what it gets prefilled from its start: prefill's
prefix cache, the full blocks its pool keeps after each prompt."""

import asyncio
import random
from dataclasses import dataclass, replace

import pytest
import torch

from epd.generation.params import SamplingParams
from epd.kv.hashing import BLOCK_TOKENS, image_spans, salt_digest
from epd.kv.pool import BlockPool
from epd.prefill.batcher import PrefillBatcher
from epd.prefill.engine import Prompt

GREEDY = SamplingParams(4, temperature=0, logprobs=True, top_logprobs=3)
rng = random.Random(0)
SYSTEM = [rng.randrange(5, 400) for _ in range(40)]


@dataclass
class Cache:
    """The engine's pool, caching, and the tokens its batchers looked up and found."""

    pool: BlockPool
    queries: int = 0
    hits: int = 0


@pytest.fixture
def kept(engine):
    """A caching pool for the engine (16 MiB), put back as it was after the test."""
    kept = engine.kv
    engine.kv = caching_pool(engine, 1 << 24)
    yield Cache(engine.kv)
    engine.kv = kept


def caching_pool(engine, max_bytes):
    config, dtype = engine.lm.config, engine.lm.lm_head.weight.dtype
    per_token = config.num_hidden_layers * config.latent_dim * dtype.itemsize
    layers, width = config.num_hidden_layers, config.latent_dim
    cached = max_bytes // per_token
    return BlockPool(layers, width, engine.device, dtype, 1 << 16, max_cached_tokens=cached)


def served(engine, prompts, kept, max_tokens=512):
    """Each prompt through a batcher on the engine's pool, one after another; the blocks of
    each let go once it is prefilled, as its hand-off would be taken."""
    return run_batcher(engine, prompts, kept, max_tokens, together=False)[0]


def run_batcher(engine, prompts, kept, max_tokens, together, min_chunk=0):
    """The prompts through a batcher on the engine's pool, one after another or all at once:
    each one's hand-off (its blocks let go once prefilled), and the prompts each forward ran."""

    async def main():
        batcher = PrefillBatcher(engine, max_tokens, reply_to="", min_chunk=min_chunk)
        runner = asyncio.create_task(batcher.run())
        if together:
            results = await asyncio.gather(*(batcher.prefill(p) for p in prompts))
        else:
            results = [await batcher.prefill(p) for p in prompts]
        for result in results:
            if result.table is not None:
                batcher.on_engine(engine.kv.release, result.table)
        runner.cancel()
        batcher.close()
        kept.queries += batcher.queries
        kept.hits += batcher.hits
        return [r.handoff for r in results], list(batcher.sizes)

    return asyncio.run(main())


def assert_as_alone(engine, prompt, handoff):
    alone = engine.run_batch([replace(prompt, block_hashes=())])[0].handoff
    assert handoff.first_tokens == alone.first_tokens
    for mine, its in zip(handoff.first_logprobs, alone.first_logprobs, strict=True):
        assert mine.logprob == pytest.approx(its.logprob, abs=1e-5)
        assert [t.token for t in mine.top_logprobs] == [t.token for t in its.top_logprobs]
    torch.testing.assert_close(handoff.cache, alone.cache, atol=1e-5, rtol=1e-5)


def named(engine, prompt):
    """The prompt with its blocks' hashes, as the coordinator gives them."""
    if not prompt.cacheable:
        return prompt
    hashes = engine.hashes(prompt.prompt_ids, prompt.image_spans or (), prompt.salt)
    return replace(prompt, block_hashes=hashes)


def text(engine, request_id, ids, sampling=GREEDY, salt=None):
    return named(engine, Prompt(request_id, ids, None, sampling, salt=salt_digest(salt)))


def test_the_next_turn_prefills_only_what_follows_the_cached_blocks(engine, kept):
    first = text(engine, "a", [*SYSTEM, 11, 12, 13])
    second = text(engine, "b", [*first.prompt_ids, 21, 22, *range(30, 60)])
    handoffs = served(engine, [first, second], kept)
    assert kept.hits == 2 * BLOCK_TOKENS  # the first turn's whole blocks
    assert kept.queries == len(first.prompt_ids) + len(second.prompt_ids)
    assert_as_alone(engine, second, handoffs[1])


def served_together(engine, prompts, kept, max_tokens=512, min_chunk=0):
    """The prompts submitted at once, as concurrent requests are: each one's hand-off, and
    the prompts each forward ran."""
    return run_batcher(engine, prompts, kept, max_tokens, together=True, min_chunk=min_chunk)


def test_prompts_that_come_together_compute_their_shared_prefix_once(engine, kept):
    """Three prompts of one system prompt, at once: the first computes it, the others wait a
    forward and find it cached; one of another prefix runs beside the first."""
    shared = [text(engine, r, [*SYSTEM, 50 + i, 60 + i, 70 + i]) for i, r in enumerate("abc")]
    other = text(engine, "d", [*range(200, 240), 1, 2])
    handoffs, sizes = served_together(engine, [*shared, other], kept)
    assert sizes == [2, 2]  # a and d; then b and c, from the cache
    assert kept.hits == 2 * 2 * BLOCK_TOKENS  # the system prompt's 2 whole blocks, twice
    for prompt, handoff in zip([*shared, other], handoffs, strict=True):
        assert_as_alone(engine, prompt, handoff)


def test_a_prompt_waits_only_for_blocks_this_forward_caches(engine, kept):
    """A chunked prompt caches its blocks at its last chunk only: one that shares them and may
    pass it (`min_chunk`) runs now; and with the cache off nothing waits at all."""
    long = text(engine, "l", [*SYSTEM, *range(100, 300)])
    short = text(engine, "s", [*SYSTEM, 7, 8, 9])
    _, sizes = served_together(engine, [long, short], kept, max_tokens=64, min_chunk=16)
    assert sizes[0] == 2  # the long prompt's first chunk, and the short one beside it
    engine.kv = caching_pool(engine, 0)  # no prefix cache (the fixture puts the pool back)
    shared = [text(engine, r, [*SYSTEM, 50 + i, 60 + i]) for i, r in enumerate("ab")]
    _, sizes = served_together(engine, shared, kept)
    assert sizes == [2]


def test_a_prompt_never_cached_waits_beside_cached_ones_unharmed(engine, kept, caplog):
    """A prompt with no named blocks (scored ones are never cached) waiting while the others
    are matched again: it is served, as are they, and the matching had nothing to complain of."""
    plain = Prompt("p", [*SYSTEM, 1, 2, 3], None, GREEDY)  # no block hashes
    long = text(engine, "l", [*SYSTEM, *range(100, 140)])
    handoffs, sizes = served_together(engine, [long, plain], kept, max_tokens=32)
    assert len(sizes) > 2 and all(h is not None for h in handoffs)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    assert_as_alone(engine, plain, handoffs[1])


def test_only_prompts_of_the_same_cache_salt_share_blocks(engine, kept):
    """A tenant that salts its requests cannot time whether another sent a prompt."""
    ids = [*SYSTEM, 11, 12, 13]
    served(
        engine,
        [
            text(engine, "a", ids, salt="t-1"),
            text(engine, "b", ids, salt="t-2"),
            text(engine, "c", ids),
        ],
        kept,
    )
    assert kept.hits == 0  # the unsalted and each salt miss the others' blocks
    again = [
        text(engine, "d", ids, salt="t-2"),
        text(engine, "e", ids),
        text(engine, "f", ids, salt="t-1"),
    ]
    handoffs = served(engine, again, kept)
    assert kept.hits == 3 * 2 * BLOCK_TOKENS  # each its own blocks
    assert_as_alone(engine, again[0], handoffs[0])


def test_a_prompt_its_first_token_ends_is_cached_too(engine, kept):
    """max_tokens 1 hands nothing off: its rows are kept from the forward itself."""
    ids = [*SYSTEM, 11, 12, 13]
    (handoff,) = served(engine, [text(engine, "a", ids, SamplingParams(1, temperature=0))], kept)
    assert handoff is None and kept.pool.blocks.cached == 2
    handoffs = served(engine, [text(engine, "b", ids)], kept)
    assert kept.hits == 2 * BLOCK_TOKENS
    assert_as_alone(engine, text(engine, "b", ids), handoffs[0])


@pytest.mark.parametrize("length", [2 * BLOCK_TOKENS, 2 * BLOCK_TOKENS + 1])
def test_a_prompt_cached_whole_still_computes_its_last_token(engine, kept, length):
    ids = SYSTEM[:length] if length <= len(SYSTEM) else [*SYSTEM, 1][:length]
    handoffs = served(engine, [text(engine, "a", ids), text(engine, "b", ids)], kept)
    # 32 tokens: the first block only (the second holds the last token); 33: both blocks
    assert kept.hits == (length - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    assert_as_alone(engine, text(engine, "b", ids), handoffs[1])


def test_a_hit_continues_in_chunks(engine, kept):
    long = text(engine, "b", [*SYSTEM, *range(100, 160)])
    handoffs = served(engine, [text(engine, "a", SYSTEM), long], kept, max_tokens=16)
    assert kept.hits == 2 * BLOCK_TOKENS
    assert_as_alone(engine, long, handoffs[1])


def test_choices_share_the_hit(engine, kept):
    three = SamplingParams(4, temperature=1.0, n=3, seed=5, logprobs=True)
    handoffs = served(
        engine, [text(engine, "a", SYSTEM), text(engine, "b", [*SYSTEM, 9, 8, 7], three)], kept
    )
    assert kept.hits == 2 * BLOCK_TOKENS
    assert_as_alone(engine, text(engine, "b", [*SYSTEM, 9, 8, 7], three), handoffs[1])


def with_image(engine, request_id, digest, rows, before=SYSTEM[:20], after=(3, 4, 5), salt=None):
    """A prompt of `before`, 24 image slots (rows (24, hidden)) and `after`."""
    ids = [*before, *[engine.placeholder_id] * len(rows), *after]
    spans = image_spans(ids, engine.placeholder_id, [len(rows)], [digest])
    prompt = Prompt(request_id, ids, rows, GREEDY, image_spans=spans, salt=salt_digest(salt))
    return named(engine, prompt)


def test_the_same_image_hits_and_another_does_not(engine, kept):
    hidden = engine.lm.config.hidden_size
    picture, other = torch.randn(24, hidden), torch.randn(24, hidden)
    # 20 text tokens, 24 image rows (20-43), 3 more: blocks 0-15 and 16-31 are full; the
    # second ends inside the image
    first = with_image(engine, "a", "aa" * 32, picture)
    again = with_image(engine, "b", "aa" * 32, picture, after=(3, 4, 5, 6))
    changed = with_image(engine, "c", "bb" * 32, other)
    handoffs = served(engine, [first, again, changed], kept)
    assert kept.hits == 2 * BLOCK_TOKENS + BLOCK_TOKENS  # again: both blocks; changed: the first
    assert_as_alone(engine, again, handoffs[1])
    assert_as_alone(engine, changed, handoffs[2])


def test_the_same_image_under_another_salt_does_not_hit(engine, kept):
    picture = torch.randn(24, engine.lm.config.hidden_size)
    # block 0 is text, block 1 holds the image: neither hits under another salt
    first = with_image(engine, "a", "aa" * 32, picture, salt="t-1")
    others = [
        with_image(engine, r, "aa" * 32, picture, salt=s) for r, s in (("b", "t-2"), ("c", None))
    ]
    served(engine, [first, *others], kept)
    assert kept.hits == 0
    served(engine, [with_image(engine, "d", "aa" * 32, picture, salt="t-1")], kept)
    assert kept.hits == 2 * BLOCK_TOKENS


def test_prompts_that_cannot_be_cached_are_not(engine, kept):
    placeholder = engine.placeholder_id
    scored = Prompt("s", SYSTEM, None, GREEDY, prompt_logprobs=1)
    unknown = Prompt("u", [*SYSTEM, placeholder], torch.zeros(1, 8), GREEDY)  # no spans given
    assert not scored.cacheable and not unknown.cacheable
    assert image_spans([placeholder, 1, placeholder], placeholder, [2], ["00"]) is None
    assert image_spans([placeholder] * 3, placeholder, [2], ["00"]) is None


def test_the_cache_keeps_within_its_budget_evicting_the_least_recently_used(engine, kept):
    config = engine.lm.config
    per_block = config.num_hidden_layers * BLOCK_TOKENS * config.latent_dim * 4
    engine.kv = kept.pool = caching_pool(engine, 4 * per_block)  # four blocks
    prompts = [text(engine, str(i), [i + 5] * (2 * BLOCK_TOKENS + 1)) for i in range(3)]
    served(engine, prompts, kept)
    assert kept.pool.blocks.cached == 4 and not kept.pool.blocks.held
    served(engine, [text(engine, "again", prompts[2].prompt_ids)], kept)
    assert kept.hits == 2 * BLOCK_TOKENS  # the latest prompt's blocks were kept


def test_a_prefix_hit_shares_the_cached_blocks(engine, kept):
    """No copy: the next turn's table starts with the very blocks the first turn published."""
    first = text(engine, "a", [*SYSTEM, 11, 12, 13])
    served(engine, [first], kept)
    published = dict(kept.pool.blocks.by_hash)
    table = kept.pool.match(first.block_hashes)
    assert table.blocks == [published[h] for h in first.block_hashes]
    assert all(kept.pool.blocks.refs[b] == 1 for b in table.blocks)
    kept.pool.release(table)


def test_a_forward_out_of_memory_empties_the_cache_and_runs_again(engine, kept, monkeypatch):
    """Cached blocks hold memory a request needs: the request gets it, and is served."""
    pool = kept.pool
    served(engine, [text(engine, "a", [*SYSTEM, 11, 12, 13])], kept)
    assert pool.blocks.cached and pool.storage.nbytes > pool.storage[:, :1].nbytes
    real, calls = engine.run_chunks, []

    def short_of_memory_while_cached(chunks, reply_to=""):
        calls.append(pool.storage.nbytes)
        if pool.blocks.unused:
            return [torch.OutOfMemoryError("no memory") for _ in chunks]
        return real(chunks, reply_to)

    monkeypatch.setattr(engine, "run_chunks", short_of_memory_while_cached)
    second = text(engine, "b", [9] * 40)  # no hit: nothing of the cache is held
    (handoff,) = served(engine, [second], kept)
    one_block = pool.storage[:, :1].nbytes
    assert len(calls) == 2 and calls[0] > one_block  # it ran short with blocks cached,
    assert calls[1] == one_block  # and again on the memory they gave back
    monkeypatch.undo()
    assert_as_alone(engine, second, handoff)
