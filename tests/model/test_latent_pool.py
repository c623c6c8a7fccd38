"""Caches in the pool's blocks give what separate caches give, through joins, leaves, growth
and evictions, read either way (gathered every step, or kept gathered as on a CPU), and the
pool never holds more blocks than its budget."""

import pytest
import torch

from epd.checkpoint.weights import load_model
from epd.model.block_manager import BLOCK_TOKENS, PoolFull
from epd.model.cpu_gathered import HEADROOM_BLOCKS, Gathered, KeepGathered, KeptBatch
from epd.model.latent_cache import LatentCache
from epd.model.latent_pool import LatentPool
from epd.model.paged import GatherEachStep, by_length

PROMPTS = [[5, 17, 42, 99], [7, 300, 12, 64, 128, 3, 250], [31, 77], [9] * 20]


@pytest.fixture(scope="module")
def lm(tiny_checkpoint):
    return load_model(tiny_checkpoint, role="language").language_model


def prefilled(lm, ids):
    return lm.prefill(lm.embed(torch.tensor(ids)))[1]


def pool_for(lm, max_tokens=4096, keeps_gathered=False):
    """A pool on the CPU; `keeps_gathered`: read through the CPU's kept copy."""
    config = lm.config
    cpu = torch.device("cpu")
    return LatentPool(
        config.num_hidden_layers,
        config.latent_dim,
        cpu,
        torch.float32,
        max_tokens,
        reader=KeepGathered() if keeps_gathered else GatherEachStep(),
    )


@pytest.mark.parametrize("keeps_gathered", [False, True])
@torch.inference_mode()
def test_steps_over_blocks_equal_steps_over_separate_caches(lm, keeps_gathered):
    pool = pool_for(lm, keeps_gathered=keeps_gathered)
    separate = [prefilled(lm, p) for p in PROMPTS[:3]]
    pooled = [pool.admit(prefilled(lm, p)) for p in PROMPTS[:3]]
    for step in range(20):  # past the first block, so caches take blocks under way
        if step == 5:  # the middle one leaves; its blocks are free
            pool.release(pooled.pop(1))
            separate.pop(1)
        if step == 8:  # a long one joins, into the freed block and new ones
            separate.append(prefilled(lm, PROMPTS[3]))
            pooled.append(pool.admit(prefilled(lm, PROMPTS[3])))
        for cache in pooled:
            pool.make_room(cache)
        tokens = torch.tensor([3 + step] * len(pooled))
        ours = lm.logits(lm.decode(tokens, pool.batch(pooled)))
        expected = lm.logits(lm.decode(tokens, separate))
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    for cache, alone in zip(pooled, separate, strict=True):
        torch.testing.assert_close(cache.tensor(), alone.tensor(), rtol=1e-5, atol=1e-5)
    # 4 + 20 rows, 2 + 20 and 20 + 12: two blocks each, no more
    assert [len(c.blocks) for c in pooled] == [2, 2, 2] and pool.used_blocks == 6


@torch.inference_mode()
def test_any_subset_in_any_order_reads_its_own_blocks(lm):
    pool = pool_for(lm)
    prompts = [*PROMPTS, [8] * 12]
    pooled = [pool.admit(prefilled(lm, p)) for p in prompts]
    order = [3, 4, 0]  # 20 tokens (+ the step's: 2 blocks), 12 (1 block), 4 (1 block)
    batch = pool.batch([pooled[i] for i in order])
    (long, long_blocks, long_seen), (short, short_blocks, short_seen) = batch.tables
    assert long.tolist() == [0, 1] and short.tolist() == [2]  # 21 and 13 rows; 5 apart
    assert long_blocks.tolist() == [*pooled[3].blocks, *pooled[4].blocks, 0]  # the zero block
    assert short_blocks.tolist() == pooled[0].blocks
    # Whole blocks, the rows past each length masked: the products meet a new shape only as a
    # cache takes a block (oneDNN builds a kernel for each, in bfloat16 on a CPU).
    assert long_seen.sum(1).tolist() == [21, 13] and long_seen.shape[1] == 2 * BLOCK_TOKENS
    assert short_seen.sum(1).tolist() == [5] and short_seen.shape[1] == BLOCK_TOKENS
    rows = torch.zeros(3, lm.config.latent_dim)  # this step's, overwritten by the step below
    assert [p.cache.shape[1] for p in batch.append_and_gather(0, rows)] == [32, 16]
    tokens = torch.tensor([9, 4, 7])
    ours = lm.decode(tokens, batch)
    alone = lm.decode(tokens, [prefilled(lm, prompts[i]) for i in order])
    torch.testing.assert_close(ours, alone, rtol=1e-5, atol=1e-5)
    assert pooled[1].length == len(PROMPTS[1])  # not in the step: untouched


def test_caches_are_grouped_so_none_is_padded_past_twice_its_length():
    assert by_length([5, 21, 12, 11]) == [[1, 2, 3], [0]]
    assert by_length([300, 310, 155, 7000]) == [[3], [1, 0], [2]]
    assert by_length([310, 300, 305]) == [[0, 1, 2]]  # one group keeps the batch's order


@torch.inference_mode()
def test_freed_blocks_full_of_nan_are_zeros_for_the_next_cache(lm):
    """Rows past a cache's length are read, masked, by every step: they must be zeros, or a
    departed request's NaN would reach its successor through 0 × NaN."""
    pool = pool_for(lm)
    kept = pool.admit(prefilled(lm, PROMPTS[3]))
    bad = pool.admit(prefilled(lm, PROMPTS[3]))
    poisoned = list(bad.blocks)
    pool.storage[:, poisoned] = float("nan")  # e.g. a request whose step overflowed
    pool.release(bad)
    # 16 rows: the first block is copied in whole, the second is taken for its next row as
    # the release left it
    newcomer = pool.admit(prefilled(lm, [9] * 16))
    assert sorted(newcomer.blocks) == sorted(poisoned)
    tokens = torch.tensor([4, 5])
    logits = lm.logits(lm.decode(tokens, pool.batch([kept, newcomer])))
    separate = [prefilled(lm, PROMPTS[3]), prefilled(lm, [9] * 16)]
    torch.testing.assert_close(logits, lm.logits(lm.decode(tokens, separate)))


@torch.inference_mode()
def test_the_budget_bounds_the_blocks_and_evicted_caches_come_back_whole(lm):
    pool = pool_for(lm, max_tokens=4 * BLOCK_TOKENS)  # 4 blocks
    long = pool.admit(prefilled(lm, [9] * 40))  # 41 rows with its next: 3 blocks
    assert pool.free_blocks == 1 and not pool.can_admit(len(PROMPTS[0]))  # 1 + a spare for long
    with pytest.raises(PoolFull, match="2 blocks of 16 rows asked for, 1 free of 4"):
        pool.admit(prefilled(lm, [9] * 20))
    assert pool.storage.shape[1] <= 1 + 4  # never past the budget (+ the zero block)
    before = long.tensor().clone()
    kept = pool.evict(long)
    assert isinstance(kept, LatentCache) and kept.tensor().device.type == "cpu"
    torch.testing.assert_close(kept.tensor(), before, rtol=0, atol=0)
    assert len(pool) == 0 and pool.storage.shape[1] == 1  # the last one out gives memory back
    again = pool.admit(kept)
    torch.testing.assert_close(again.tensor(), before, rtol=0, atol=0)


@torch.inference_mode()
def test_a_full_block_takes_a_new_one_only_when_the_next_row_needs_it(lm):
    pool = pool_for(lm, max_tokens=2 * BLOCK_TOKENS)
    cache = pool.admit(prefilled(lm, [9] * (BLOCK_TOKENS - 1)))  # its next row ends block 1
    assert len(cache.blocks) == 1
    pool.make_room(cache)
    assert len(cache.blocks) == 1
    cache.length += 1  # a step wrote it
    pool.make_room(cache)
    assert len(cache.blocks) == 2 and pool.free_blocks == 0
    cache.length += BLOCK_TOKENS
    with pytest.raises(PoolFull):
        pool.make_room(cache)


@torch.inference_mode()
def test_a_cache_that_fails_to_join_leaves_its_blocks_free(lm):
    pool = pool_for(lm, max_tokens=4 * BLOCK_TOKENS)
    kept = pool.admit(prefilled(lm, PROMPTS[0]))
    broken = prefilled(lm, [9] * 40)
    broken.tensor = lambda: (_ for _ in ()).throw(RuntimeError("out of memory"))
    with pytest.raises(RuntimeError, match="out of memory"):
        pool.admit(broken)
    assert pool.free_blocks == 3 and len(pool) == 1
    assert pool.admit(prefilled(lm, [9] * 40)).blocks  # the blocks it had taken
    assert (pool.storage[:, 0] == 0).all() and kept.length == len(PROMPTS[0])


@torch.inference_mode()
def test_a_preallocated_pool_never_grows_and_keeps_its_memory(lm, monkeypatch):
    """As on a GPU: growing by doubling would need 1.5x the budget at once."""
    config = lm.config
    pool = LatentPool(
        config.num_hidden_layers, config.latent_dim, torch.device("cpu"), torch.float32, 64, True
    )
    monkeypatch.setattr(pool, "grow", None)  # calling it would fail the test
    storage = pool.storage
    assert storage.shape[1] == 5 and pool.free_blocks == 4
    assert pool.admit(prefilled(lm, PROMPTS[0])).blocks == [1]  # lowest first
    caches = [pool.admit(prefilled(lm, [9] * 20)), pool.admit(prefilled(lm, PROMPTS[2]))]
    tokens = torch.tensor([4, 5])
    separate = [prefilled(lm, [9] * 20), prefilled(lm, PROMPTS[2])]
    torch.testing.assert_close(
        lm.logits(lm.decode(tokens, pool.batch(caches))),
        lm.logits(lm.decode(tokens, separate)),
    )
    storage[:, caches[0].blocks] = float("nan")
    pool.clear()  # as decode's drain does after a failed step, with the caches still held
    assert pool.storage is storage and len(pool) == 0 and pool.free_blocks == 4
    assert (storage == 0).all()
    again = pool.admit(prefilled(lm, PROMPTS[1]))
    torch.testing.assert_close(again.tensor(), prefilled(lm, PROMPTS[1]).tensor())


@torch.inference_mode()
def test_a_kept_copy_serves_until_the_batch_changes_or_outgrows_it(lm):
    pool = pool_for(lm, keeps_gathered=True)
    separate = [prefilled(lm, p) for p in PROMPTS[:3]]
    pooled = [pool.admit(prefilled(lm, p)) for p in PROMPTS[:3]]
    copies = []
    steps = 60  # past a copy's room at least once
    for step in range(steps):
        if step == 5:  # one leaves
            pool.release(pooled.pop(1))
            separate.pop(1)
        if step == 9:  # one joins
            separate.append(prefilled(lm, PROMPTS[3]))
            pooled.append(pool.admit(prefilled(lm, PROMPTS[3])))
        for cache in pooled:
            pool.make_room(cache)
        tokens = torch.tensor([3 + step] * len(pooled))
        batch = pool.batch(pooled)
        copies.append(getattr(batch, "kept", None))
        ours = lm.logits(lm.decode(tokens, batch))
        torch.testing.assert_close(ours, lm.logits(lm.decode(tokens, separate)))
    made = [i for i, kept in enumerate(copies) if i == 0 or kept is not copies[i - 1]]
    # made at the start, when one left, when one joined, and when the longest outgrew its room:
    # it joined with 20 rows, into a copy of blocks_for(21) + HEADROOM_BLOCKS blocks
    room = (2 + HEADROOM_BLOCKS) * BLOCK_TOKENS
    assert made == [0, 5, 9, 9 + room - 20], made
    assert all(kept is not None for kept in copies)
    pool.release(pooled[0])
    assert pool.reader.kept is not None  # the others still run
    for cache in pooled[1:]:
        pool.release(cache)
    assert pool.reader.kept is None  # the memory goes with the last


@torch.inference_mode()
def test_no_copy_is_kept_that_would_take_more_than_the_budget(lm):
    pool = pool_for(lm, max_tokens=8 * BLOCK_TOKENS, keeps_gathered=True)
    pooled = [pool.admit(prefilled(lm, p)) for p in PROMPTS]
    for cache in pooled:
        pool.make_room(cache)
    # 5 blocks in use of 8; a copy needs 2 + HEADROOM_BLOCKS for the longest, 1 + HEADROOM_BLOCKS
    # for each of the others (one part)
    assert Gathered.nbytes_for(pooled, pool.storage) > pool.max_bytes
    batch = pool.batch(pooled)
    assert not isinstance(batch, KeptBatch) and pool.reader.kept is None  # step by step
    tokens = torch.tensor([4] * len(pooled))
    ours = lm.logits(lm.decode(tokens, batch))
    separate = [prefilled(lm, p) for p in PROMPTS]
    torch.testing.assert_close(ours, lm.logits(lm.decode(tokens, separate)))
