import pytest
import torch

from epd.model import attention as kernels
from epd.model.attention import (
    MIN_PRODUCT_QUERIES,
    causal_products,
    fused_latent_attention,
    latent_attention,
)
from epd.model.config import TextConfig
from epd.model.mla import MLAttention
from epd.model.rope import rotor, text_angles


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
    monkeypatch.setattr(kernels.cpu, "has_amx", lambda: amx)
    monkeypatch.setattr(kernels.cpu, "runs_bfloat16", lambda: native_bfloat16)
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


@pytest.mark.parametrize("products", [False, True], ids=["fused", "products"])
def test_a_prompt_attends_alike_through_either_kernel_whole_and_in_chunks(monkeypatch, products):
    """Two prompts packed, the second also prefilled in two chunks, its second after a past:
    each kernel (`prompt_products`) gives what float32 gives, to bfloat16's precision."""
    monkeypatch.setattr(  # float32, the reference, stays fused
        "epd.model.mla.prompt_products",
        lambda q, keys: causal_products if products and q.dtype == torch.bfloat16 else None,
    )
    attention = bfloat16_attention()
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(200, 64, generator=generator).bfloat16()
    angles = rotor(text_angles(torch.cat((torch.arange(60), torch.arange(140))), 8, 10000.0))
    with torch.inference_mode():
        out, rows = attention.prefill(x, angles, lengths=[60, 140])
        first, past = attention.prefill(x[60:150], angles[60:150])
        second, _ = attention.prefill(x[150:], angles[150:], pasts=[past])
        exact, _ = attention.float().prefill(x.float(), angles, lengths=[60, 140])
    assert out.shape == (200, 64) and rows.shape == (200, 40)
    torch.testing.assert_close(out.float(), exact, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(torch.cat((first, second)), out[60:], atol=3e-2, rtol=3e-2)
