import pytest
import torch

from epd.model.mla import fused_latent_attention, latent_attention

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
