"""Each MoonViT step against straightforward reference code, and batch-vs-single equality."""

import math

import pytest
import torch
import torch.nn.functional as F

from epd.checkpoint.weights import load_model
from epd.model.moonvit import merge_patches
from epd.model.rope import rotate, vision_angles

GRIDS = [(4, 6), (2, 2), (6, 4)]


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(tiny_checkpoint, role="encode")


def pixels(grids, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(h * w for h, w in grids), 3, 14, 14, generator=g)


def reference_rope(x, h, w):
    """Complex-number 2-D RoPE, one token at a time: pair 2i turns by col·θ_i, 2i+1 by row·θ_i."""
    head_dim = x.shape[-1]
    out = torch.empty_like(x)
    for n in range(h * w):
        row, col = divmod(n, w)
        angles = []
        for pair in range(head_dim // 2):
            theta = 1.0 / 10000 ** (4 * (pair // 2) / head_dim)
            angles.append((col if pair % 2 == 0 else row) * theta)
        turn = torch.polar(torch.ones(head_dim // 2), torch.tensor(angles))
        pairs = torch.view_as_complex(x[n].reshape(*x.shape[1:-1], -1, 2).contiguous())
        out[n] = torch.view_as_real(pairs * turn).reshape(x.shape[1:])
    return out


def reference_block(block, x, h, w):
    heads = block.heads
    y = F.layer_norm(x, x.shape[-1:], block.norm0.weight, block.norm0.bias, 1e-5)
    qkv = y @ block.wqkv.weight.T + block.wqkv.bias
    d = x.shape[-1]
    q, k, v = (qkv[:, i * d : (i + 1) * d].reshape(-1, heads, d // heads) for i in range(3))
    q, k = reference_rope(q, h, w), reference_rope(k, h, w)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d // heads)
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(-1, d)
    x = x + attn @ block.wo.weight.T + block.wo.bias
    y = F.layer_norm(x, x.shape[-1:], block.norm1.weight, block.norm1.bias, 1e-5)
    hidden = F.gelu(y @ block.mlp.fc0.weight.T + block.mlp.fc0.bias, approximate="tanh")
    return x + hidden @ block.mlp.fc1.weight.T + block.mlp.fc1.bias


def reference_merge(x, h, w):
    rows = []
    for i in range(h // 2):
        for j in range(w // 2):
            window = [(2 * i) * w + 2 * j, (2 * i) * w + 2 * j + 1]
            window += [(2 * i + 1) * w + 2 * j, (2 * i + 1) * w + 2 * j + 1]
            rows.append(x[window])
    return torch.stack(rows)


def reference_image(model, patches, h, w):
    tower, proj = model.vision_tower, model.multi_modal_projector
    conv = tower.patch_embed.proj
    x = patches.flatten(1) @ conv.weight.flatten(1).T + conv.bias  # conv with kernel = stride
    table = tower.patch_embed.pos_emb.weight.permute(2, 0, 1)[None]
    x = x + F.interpolate(table, size=(h, w), mode="bicubic", align_corners=False)[0].flatten(1).T
    for block in tower.encoder.blocks:
        x = reference_block(block, x, h, w)
    final = tower.encoder.final_layernorm
    x = F.layer_norm(x, x.shape[-1:], final.weight, final.bias, 1e-5)
    windows = reference_merge(x, h, w)  # (h·w/4, 4, D)
    y = F.layer_norm(windows, windows.shape[-1:], proj.pre_norm.weight, proj.pre_norm.bias, 1e-5)
    y = F.gelu(y.flatten(1) @ proj.linear_1.weight.T + proj.linear_1.bias)  # exact erf GELU
    return y @ proj.linear_2.weight.T + proj.linear_2.bias


def test_rope_matches_complex_reference():
    x = torch.randn(4 * 6, 2, 16)
    assert torch.allclose(
        rotate(x, vision_angles(4, 6, 16, x.device)), reference_rope(x, 4, 6), atol=1e-6
    )


def test_rope_dims_follow_column_then_row():
    x = torch.randn(2 * 3, 1, 8)
    out = rotate(x, vision_angles(2, 3, 8, x.device))
    # Token 1 sits at row 0, col 1: only the column pairs (dims 0,1 and 4,5) turn.
    torch.testing.assert_close(out[1, 0, 2:4], x[1, 0, 2:4])
    assert not torch.allclose(out[1, 0, 0:2], x[1, 0, 0:2])
    # Token 3 sits at row 1, col 0: only the row pairs (dims 2,3 and 6,7) turn.
    torch.testing.assert_close(out[3, 0, 0:2], x[3, 0, 0:2])
    assert not torch.allclose(out[3, 0, 2:4], x[3, 0, 2:4])


def test_merge_matches_reference_windows():
    x = torch.arange(4 * 6 * 3, dtype=torch.float32).view(24, 3)
    torch.testing.assert_close(merge_patches(x, [(4, 6)], (2, 2)), reference_merge(x, 4, 6))


@torch.inference_mode()
def test_each_image_matches_reference(model):
    for h, w in GRIDS:
        patches = pixels([(h, w)], seed=h * 10 + w)
        ours = model.encode_images(patches, [(h, w)])
        torch.testing.assert_close(
            ours, reference_image(model, patches, h, w), rtol=1e-4, atol=1e-5
        )


@torch.inference_mode()
def test_batch_gives_each_image_what_it_gets_alone(model):
    patches = pixels(GRIDS)
    together = model.encode_images(patches, GRIDS)
    pieces = together.split([h * w // 4 for h, w in GRIDS])
    for piece, chunk, grid in zip(
        pieces, patches.split([h * w for h, w in GRIDS]), GRIDS, strict=True
    ):
        torch.testing.assert_close(piece, model.encode_images(chunk, [grid]), rtol=1e-5, atol=1e-6)


@torch.inference_mode()
def test_position_table_used_as_is_at_its_own_size(model):
    table = model.vision_tower.patch_embed.pos_emb
    h, w = table.weight.shape[:2]
    torch.testing.assert_close(table([(h, w)]), table.weight.flatten(0, 1))
