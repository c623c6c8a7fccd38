import pytest
import torch
import torch.nn.functional as F

from epd.model import attention
from epd.model.attention import (
    BLOCK_SCORES,
    MAX_PROMPT_PRODUCT_KEYS,
    PROMPT_BLOCK_QUERIES,
    blocked_products,
    causal_products,
    fused_latent_attention,
    latent_attention,
    prompt_products,
)

# Kimi-VL's latent rows: kv_lora_rank 512 + qk_rope_head_dim 64; 16 heads.
HEADS, WIDTH = 16, 576


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_fused_kernel_equals_the_two_products_over_each_querys_own_rows(dtype, tolerance):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(5, HEADS, WIDTH, generator=generator).to(dtype)
    cache = torch.randn(5, 300, WIDTH, generator=generator).to(dtype)
    lengths = torch.tensor([1, 17, 150, 299, 300])  # a decode step: each its own length
    visible = torch.arange(300)[None, :] < lengths[:, None]
    fused = fused_latent_attention(q, cache, visible, 0.05)
    products = latent_attention(q, cache, visible, 0.05)
    assert fused.shape == products.shape == (5, HEADS, WIDTH)
    torch.testing.assert_close(fused.float(), products.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_fused_kernel_equals_the_two_products_over_shared_rows(dtype, tolerance):
    """A chunk of 7 new tokens after a past of 93: query i sees the past and new rows to i."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(7, HEADS, WIDTH, generator=generator).to(dtype)
    rows = torch.randn(100, WIDTH, generator=generator).to(dtype)
    visible = torch.ones(7, 100, dtype=torch.bool).tril(100 - 7)
    fused = fused_latent_attention(q, rows, visible, 0.05)
    products = latent_attention(q, rows, visible, 0.05)
    assert fused.shape == products.shape == (7, HEADS, WIDTH)
    torch.testing.assert_close(fused.float(), products.float(), atol=tolerance, rtol=tolerance)


def reference_causal(q, k, v, scale):
    """Straightforward float32 attention, query i seeing rows up to K - T + i."""
    q, k, v = q.float(), k.float(), v.float()
    queries, rows = q.shape[1], k.shape[1]
    scores = q @ k.mT * scale  # (H, T, K)
    seen = torch.arange(rows)[None, :] <= torch.arange(rows - queries, rows)[:, None]
    return scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("queries", [1, PROMPT_BLOCK_QUERIES, 2 * PROMPT_BLOCK_QUERIES + 45])
@pytest.mark.parametrize("past", [0, 37])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_causal_products_equal_plain_causal_attention(queries, past, dtype, tolerance):
    """Blocks of queries, the last one short, after a past or none; values narrower than keys."""
    generator = torch.Generator().manual_seed(queries + past)
    q = torch.randn(3, queries, 24, generator=generator).to(dtype)
    k = torch.randn(3, past + queries, 24, generator=generator).to(dtype)
    v = torch.randn(3, past + queries, 16, generator=generator).to(dtype)
    out = causal_products(q, k, v, 0.2)
    assert out.shape == (3, queries, 16) and out.dtype == dtype
    expected = reference_causal(q, k, v, 0.2)
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def test_causal_products_match_the_fused_kernel_they_replace():
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, 300, 32, generator=generator).bfloat16() for _ in range(3))
    fused = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.1)[0]
    torch.testing.assert_close(causal_products(q[0], k[0], v[0], 0.1), fused, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    ("dtype", "keys", "amx", "native_bfloat16", "products"),
    [
        (torch.bfloat16, 240, False, True, causal_products),
        (torch.bfloat16, MAX_PROMPT_PRODUCT_KEYS, False, True, causal_products),
        (torch.bfloat16, MAX_PROMPT_PRODUCT_KEYS + 1, False, True, None),
        (torch.bfloat16, 240, True, True, None),
        (torch.bfloat16, 240, False, False, None),
        (torch.float32, 240, True, False, blocked_products),
        (torch.float32, MAX_PROMPT_PRODUCT_KEYS + 1, False, True, None),
        (torch.float16, 240, False, True, None),
    ],
)
def test_prompts_take_the_products_only_where_they_were_measured_faster(
    monkeypatch, dtype, keys, amx, native_bfloat16, products
):
    monkeypatch.setattr(attention.cpu, "has_amx", lambda: amx)
    monkeypatch.setattr(attention.cpu, "runs_bfloat16", lambda: native_bfloat16)
    monkeypatch.setattr(attention.cpu, "vendor", lambda: "AuthenticAMD")
    assert prompt_products(torch.zeros(8, 2, 4, dtype=dtype), keys) is products


@pytest.mark.parametrize(
    ("vendor", "products"),
    [("AuthenticAMD", blocked_products), ("GenuineIntel", blocked_products), ("", None)],
)
def test_float32_prompts_take_the_products_only_on_cpus_they_were_measured_on(
    monkeypatch, vendor, products
):
    monkeypatch.setattr(attention.cpu, "vendor", lambda: vendor)
    assert prompt_products(torch.zeros(8, 2, 4), 240) is products
    assert prompt_products(torch.zeros(8, 2, 4, dtype=torch.float16), 240) is None


@pytest.mark.parametrize(
    ("queries", "past"),
    [(1, 0), (1, 500), (40, 0), (300, 0), (170, 700), (600, 37)],
)
def test_blocked_products_equal_plain_causal_attention(queries, past):
    """One block or two (a block scores at most BLOCK_SCORES: 600 queries over 637 rows in
    blocks of 411), the last one short, after a past or none; values narrower than keys."""
    assert BLOCK_SCORES // (4 * 637) == 411
    generator = torch.Generator().manual_seed(queries + past)
    q = torch.randn(4, queries, 24, generator=generator)
    k = torch.randn(4, past + queries, 24, generator=generator)
    v = torch.randn(4, past + queries, 16, generator=generator)
    out = blocked_products(q, k, v, 0.2)
    assert out.shape == (4, queries, 16) and out.dtype == torch.float32
    torch.testing.assert_close(out, reference_causal(q, k, v, 0.2), atol=1e-5, rtol=1e-5)


def test_blocked_products_run_several_blocks_for_a_long_prompt(monkeypatch):
    monkeypatch.setattr(attention, "BLOCK_SCORES", 4 * 600 * 50)  # 50 queries over 600 rows
    calls = []
    real = torch.baddbmm
    monkeypatch.setattr(
        attention.torch, "baddbmm", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    q, k, v = torch.randn(4, 500, 8), torch.randn(4, 600, 8), torch.randn(4, 600, 8)
    out = blocked_products(q, k, v, 0.3)
    assert len(calls) == 10
    torch.testing.assert_close(out, reference_causal(q, k, v, 0.3), atol=1e-5, rtol=1e-5)


def test_blocked_products_take_larger_blocks_after_a_past_as_long_as_their_queries(monkeypatch):
    """Blocks after a long past skip few rows: the past's keys are read once per block, so
    there the blocks' scores go up to PAST_BLOCK_SCORES."""
    monkeypatch.setattr(attention, "BLOCK_SCORES", 4 * 600 * 50)  # 50 queries over 600 rows
    monkeypatch.setattr(attention, "PAST_BLOCK_SCORES", 4 * 600 * 200)  # 200 over 600
    calls = []
    real = torch.baddbmm
    monkeypatch.setattr(
        attention.torch, "baddbmm", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    k, v = torch.randn(4, 600, 8), torch.randn(4, 600, 8)
    for queries, blocks in ((300, 2), (301, 7)):  # after 300 rows of past, and after 299
        calls.clear()
        q = torch.randn(4, queries, 8)
        out = blocked_products(q, k, v, 0.3)
        assert len(calls) == blocks
        torch.testing.assert_close(out, reference_causal(q, k, v, 0.3), atol=1e-5, rtol=1e-5)


def test_blocked_products_refuse_more_queries_than_rows_and_take_none():
    with pytest.raises(ValueError, match="last of them"):
        blocked_products(torch.zeros(2, 5, 4), torch.zeros(2, 4, 4), torch.zeros(2, 4, 4), 1.0)
    empty = blocked_products(torch.zeros(2, 0, 4), torch.zeros(2, 0, 4), torch.zeros(2, 0, 3), 1.0)
    assert empty.shape == (2, 0, 3)


def test_causal_products_meet_few_shapes_whatever_the_prompts_length(monkeypatch):
    """oneDNN builds a kernel per shape: blocks of queries and the rows they score come in
    steps, so prompts of 300 lengths, after a past or not, meet a handful of shapes."""
    shapes = set()
    matmul = torch.matmul

    def recorded(a, b):
        shapes.add((tuple(a.shape), tuple(b.shape)))
        return matmul(a, b)

    monkeypatch.setattr(attention.torch, "matmul", recorded)
    for queries in range(1, 301):
        for past in (0, 45):
            q = torch.zeros(2, queries, 8)
            causal_products(
                q, torch.zeros(2, past + queries, 8), torch.zeros(2, past + queries, 4), 1.0
            )
    blocks = {a[1] for a, b in shapes if b[1] == 8}  # the scores' products: (H, size, d)
    rows = {b[2] for a, b in shapes if b[1] == 8}  # (H, d, seen)
    assert blocks == {32, 64, 96, 128}
    assert all(r % 64 == 0 for r in rows) and len(rows) <= 6
