import pytest
import torch

from epd.model import mla
from epd.model.config import TextConfig
from epd.model.mla import (
    MIN_PRODUCT_QUERIES,
    MLAttention,
    fused_latent_attention,
    latent_attention,
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


@pytest.mark.parametrize(
    ("dtype", "queries", "fused"),
    [
        (torch.bfloat16, 1, True),
        (torch.bfloat16, MIN_PRODUCT_QUERIES - 1, True),
        (torch.bfloat16, MIN_PRODUCT_QUERIES, False),
        (torch.bfloat16, 16, False),
        (torch.float32, 16, True),
        (torch.float16, 16, True),
    ],
)
@pytest.mark.parametrize(
    ("amx", "native_bfloat16"),
    [(False, True), (True, True), (False, False)],
    ids=["avx512-bf16", "amx", "bf16-converted"],
)
def test_a_cpu_decode_step_attends_through_the_faster_kernel_for_its_dtype_and_batch(
    monkeypatch, amx, native_bfloat16, dtype, queries, fused
):
    """bfloat16 steps of a few requests or more take the two products where the CPU runs
    bfloat16 natively without AMX; one request, float32, float16, AMX, a CPU that converts
    bfloat16, and shared rows the fused kernel (`products_win_on_cpu`)."""
    monkeypatch.setattr(mla.cpu, "has_amx", lambda: amx)
    monkeypatch.setattr(mla.cpu, "runs_bfloat16", lambda: native_bfloat16)
    fused = fused or amx or not native_bfloat16
    attention = bfloat16_attention().to(dtype)
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(queries, 4, 40, generator=generator).to(dtype)
    cache = torch.randn(queries, 30, 40, generator=generator).to(dtype)
    visible = torch.arange(30)[None, :] < torch.arange(30 - queries, 30)[:, None]
    expected = (fused_latent_attention if fused else latent_attention)(
        q, cache, visible, attention.scale
    )
    assert torch.equal(attention.attend_latent(q, cache, visible), expected)
    rows = cache[0]  # shared rows: fused whatever the batch
    shared = visible[:, :30]
    assert torch.equal(
        attention.attend_latent(q, rows, shared),
        fused_latent_attention(q, rows, shared, attention.scale),
    )


def bfloat16_attention() -> MLAttention:
    config = TextConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    )
    torch.manual_seed(0)
    return MLAttention(config, 0).to(torch.bfloat16)


def decode_inputs(attention: MLAttention) -> tuple[torch.Tensor, ...]:
    """Queries of 3 requests (nope and rope halves) and their latent caches of 5, 9 and 12 rows."""
    generator = torch.Generator().manual_seed(2)
    heads, width = attention.heads, attention.rank + attention.rope
    q_nope = torch.randn(3, heads, attention.nope, generator=generator).bfloat16()
    q_pe = torch.randn(3, heads, attention.rope, generator=generator).bfloat16()
    cache = torch.randn(3, 12, width, generator=generator).bfloat16()
    visible = torch.arange(12)[None, :] < torch.tensor([5, 9, 12])[:, None]
    return q_nope, q_pe, cache, visible


def by_the_views(attention: MLAttention, *inputs: torch.Tensor) -> torch.Tensor:
    """`through_latent` over views of the weight: where autograd records it."""
    attention.kv_b_proj.weight.requires_grad_(True)
    with torch.enable_grad():
        return attention.through_latent(*inputs).detach()


def test_a_bfloat16_decode_absorbs_through_float32_copies_of_kv_b_proj():
    attention = bfloat16_attention()
    inputs = decode_inputs(attention)
    with torch.inference_mode():
        copied = attention.through_latent(*inputs)
        w_uk, w_uv_t = attention.absorbing()
    assert w_uk.dtype == w_uv_t.dtype == torch.float32
    assert w_uk.is_contiguous() and w_uv_t.is_contiguous()
    assert not w_uk.is_inference()  # usable outside inference mode too
    halves = attention.kv_b_proj.weight.float().unflatten(0, (4, -1)).split([16, 16], dim=1)
    torch.testing.assert_close(w_uk, halves[0], rtol=0, atol=0)
    torch.testing.assert_close(w_uv_t, halves[1].mT, rtol=0, atol=0)
    assert copied.dtype == torch.bfloat16 and copied.shape == (3, 4, 16)
    torch.testing.assert_close(copied, by_the_views(attention, *inputs), rtol=2e-2, atol=2e-2)


def test_new_kv_b_proj_weights_reach_the_next_decode():
    attention = bfloat16_attention()
    inputs = decode_inputs(attention)
    with torch.no_grad():
        before = attention.through_latent(*inputs)
        state = attention.state_dict()
        state["kv_b_proj.weight"] = torch.randn_like(state["kv_b_proj.weight"])
        attention.load_state_dict(state)  # copied into the same memory: only the version moves
        after = attention.through_latent(*inputs)
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, by_the_views(attention, *inputs), rtol=2e-2, atol=2e-2)


def test_gradients_reach_kv_b_proj_through_the_absorbed_products():
    attention = bfloat16_attention()
    attention.through_latent(*decode_inputs(attention)).float().sum().backward()
    assert attention.kv_b_proj.weight.grad is not None
    assert attention.kv_b_proj.weight.grad.abs().sum() > 0
