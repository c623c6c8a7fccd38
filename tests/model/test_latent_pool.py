"""Caches read in place from the pool give what separate caches give, through admits, releases
and growth."""

import pytest
import torch

from epd.checkpoint.weights import load_model
from epd.model.latent_cache import LatentCache
from epd.model.latent_pool import LatentPool, PooledBatch

PROMPTS = [[5, 17, 42, 99], [7, 300, 12, 64, 128, 3, 250], [31, 77], [9] * 20]


@pytest.fixture(scope="module")
def lm(tiny_checkpoint):
    return load_model(tiny_checkpoint, role="language").language_model


def prefilled(lm, ids):
    return lm.prefill(lm.embed(torch.tensor(ids)))[1]


def pool_for(lm):
    config = lm.config
    return LatentPool(
        config.num_hidden_layers, config.latent_dim, torch.device("cpu"), torch.float32
    )


@torch.inference_mode()
def test_steps_read_in_place_equal_steps_over_separate_caches(lm):
    pool = pool_for(lm)
    separate = [prefilled(lm, p) for p in PROMPTS[:3]]
    pooled = [pool.admit(prefilled(lm, p)) for p in PROMPTS[:3]]
    for step in range(20):  # past the first capacity (16 rows), so the pool grows under way
        if step == 5:  # the middle one leaves; the last moves into its slot
            pool.release(pooled.pop(1))
            separate.pop(1)
        if step == 8:  # a long one joins
            separate.append(prefilled(lm, PROMPTS[3]))
            pooled.append(pool.admit(prefilled(lm, PROMPTS[3])))
        tokens = torch.tensor([3 + step] * len(pooled))
        batch = pool.batch(pooled)
        assert isinstance(batch, PooledBatch)  # every slot, in order: no gather
        ours = lm.logits(lm.decode(tokens, batch))
        expected = lm.logits(lm.decode(tokens, separate))
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    for cache, alone in zip(pooled, separate, strict=True):
        torch.testing.assert_close(cache.tensor(), alone.tensor(), rtol=1e-5, atol=1e-5)
    assert pool.storage.shape[1:3] == (4, 32)  # slots 1 → 2 → 4; rows 16 → 32 (20-token prompt)


@torch.inference_mode()
def test_a_subset_or_another_order_is_gathered_and_stays_in_the_pool(lm):
    pool = pool_for(lm)
    pooled = [pool.admit(prefilled(lm, p)) for p in PROMPTS[:3]]
    alone = LatentCache.from_tensor(prefilled(lm, PROMPTS[2]).tensor().clone())
    batch = pool.batch([pooled[2]])  # e.g. one sequence run alone after a failed step
    assert not isinstance(batch, PooledBatch)
    torch.testing.assert_close(
        lm.decode(torch.tensor([9]), batch), lm.decode(torch.tensor([9]), [alone])
    )
    assert pooled[2].data.data_ptr() == pool.storage[:, 2].data_ptr()  # not moved out
    assert pool.in_order([pooled[2], pooled[0]]) == [1, 0]
    pool.clear()
    assert len(pool) == 0 and pool.storage.numel() == 0


@torch.inference_mode()
def test_a_released_cache_full_of_nan_leaves_nothing_behind(lm):
    """Rows past a cache's length are read, masked, by every step: they must be zeros, or a
    departed request's NaN would reach its successors through 0 × NaN."""
    pool = pool_for(lm)
    short, poisoned, moved = (prefilled(lm, p) for p in (PROMPTS[2], PROMPTS[3], PROMPTS[0]))
    kept = pool.admit(short)
    bad = pool.admit(poisoned)
    last = pool.admit(moved)
    bad.data[:, : bad.length] = float("nan")  # e.g. a request whose step overflowed
    pool.release(bad)  # `last` moves into its slot; the slot it left is freed
    newcomer = pool.admit(prefilled(lm, PROMPTS[1]))  # into that freed slot
    tokens = torch.tensor([4, 5, 6])
    logits = lm.logits(lm.decode(tokens, pool.batch([kept, last, newcomer])))
    assert torch.isfinite(logits).all()
    separate = [prefilled(lm, p) for p in (PROMPTS[2], PROMPTS[0], PROMPTS[1])]
    torch.testing.assert_close(logits, lm.logits(lm.decode(tokens, separate)))


@torch.inference_mode()
def test_the_last_slot_freed_full_of_nan_is_zeros_for_the_next_one(lm):
    pool = pool_for(lm)
    kept = pool.admit(prefilled(lm, PROMPTS[3]))  # as long as the one that leaves: a step reads
    bad = pool.admit(prefilled(lm, PROMPTS[3]))  # every slot that far
    bad.data[:, : bad.length] = float("nan")
    pool.release(bad)  # the last slot: nothing moves, the slot is freed
    newcomer = pool.admit(prefilled(lm, PROMPTS[0]))  # shorter than what was there
    logits = lm.logits(lm.decode(torch.tensor([4, 5]), pool.batch([kept, newcomer])))
    assert torch.isfinite(logits).all()


@torch.inference_mode()
def test_memory_goes_back_when_the_long_ones_leave(lm):
    pool, config = pool_for(lm), lm.config
    short = pool.admit(prefilled(lm, PROMPTS[0]))
    long = pool.admit(
        LatentCache.from_tensor(torch.zeros(config.num_hidden_layers, 300, config.latent_dim))
    )
    assert pool.capacity >= 301
    pool.release(long)  # the longest left fits a quarter: halved to twice it, at least 16
    assert pool.capacity == 16 and short.tensor().shape[1] == 4
    torch.testing.assert_close(short.tensor(), prefilled(lm, PROMPTS[0]).tensor())
    pool.release(short)
    assert pool.storage.numel() == 0  # the last one out gives it all back
    cpu, layers, width = torch.device("cpu"), config.num_hidden_layers, config.latent_dim
    capped = LatentPool(layers, width, cpu, torch.float32, max_length=40)
    capped.admit(prefilled(lm, PROMPTS[3]))  # 20 rows (+ a step's): capacity 21
    capped.admit(prefilled(lm, [9] * 30))  # 31 needed: doubling would give 42, past the context
    assert capped.capacity == 40
