"""oneDNN-packed experts against the plain per-expert loop, and the swap around a loaded model."""

import pytest
import torch

from epd.checkpoint.synthetic import make_checkpoint
from epd.checkpoint.weights import load_model
from epd.model import packed
from epd.model.moe import Experts
from epd.model.packed import PackedExperts, can_pack, pack_for_cpu

from .test_deepseek_oracle import rel_err
from .test_moe import experts_of, moe_of, reference_routed

pytestmark = pytest.mark.skipif(
    not can_pack(torch.zeros(1)), reason="this torch build has no oneDNN packed linear"
)

# Experts 1 and 3 get no token; 0, 2 and 4 get products of 4, 7 and 5 rows.
IDS = torch.tensor([[0, 2], [2, 0], [4, 2], [2, 4], [0, 4], [2, 0], [4, 2], [2, 4]])


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@torch.inference_mode()
def test_packed_experts_equal_a_plain_loop_including_unused_experts(dtype, tolerance):
    moe = pack_for_cpu(moe_of(experts_of().to(dtype)))
    assert isinstance(moe.experts, PackedExperts) and len(moe.experts.down) == 5
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(8, 16, generator=generator).to(dtype)
    weights = torch.rand(8, 2, generator=generator)
    got = moe.routed(x, weights, IDS)
    want = reference_routed(experts_of(), x.float(), weights, IDS)
    assert got.dtype == dtype and rel_err(got.float(), want) <= tolerance


def test_the_swap_keeps_parameters_and_checkpoint_names():
    moe = moe_of(experts_of())
    before, stacks = moe.state_dict(), moe.experts.gate_up_proj
    pack_for_cpu(moe)
    assert isinstance(moe.experts, PackedExperts) and moe.experts.gate_up_proj is stacks
    after = moe.state_dict()
    assert after.keys() == before.keys()
    # The very same memory (MoE's other weights are uninitialised here, so may hold NaN).
    assert all(after[n].data_ptr() == before[n].data_ptr() for n in before)


@torch.inference_mode()
def test_moving_the_model_repacks_its_experts():
    moe = pack_for_cpu(moe_of(experts_of())).to(torch.bfloat16)
    assert moe.experts.down[0].dtype == torch.bfloat16
    x = torch.randn(8, 16).bfloat16()
    got = moe.routed(x, torch.ones(8, 2), IDS)
    want = moe_of(experts_of().to(torch.bfloat16)).routed(x, torch.ones(8, 2), IDS)
    assert rel_err(got.float(), want.float()) <= 2e-2


@torch.inference_mode()
def test_inference_runs_the_packed_path(monkeypatch):
    moe = pack_for_cpu(moe_of(experts_of()))
    monkeypatch.setattr(Experts, "forward", lambda *_: pytest.fail("fell back"))
    assert moe.routed(torch.randn(8, 16), torch.ones(8, 2), IDS).shape == (8, 16)


def test_gradients_still_flow_through_the_grouped_matmul():
    packed, plain = pack_for_cpu(moe_of(experts_of())), moe_of(experts_of())
    for x in (torch.randn(8, 16, requires_grad=True), torch.randn(8, 16)):  # input or weights
        for moe in (packed, plain):
            moe.zero_grad()
            moe.routed(x, torch.ones(8, 2), IDS).square().sum().backward()
        assert torch.allclose(packed.experts.down_proj.grad, plain.experts.down_proj.grad)


@torch.inference_mode()
def test_loading_new_weights_repacks():
    moe, other = pack_for_cpu(moe_of(experts_of())), moe_of(experts_of())
    with torch.no_grad():
        other.experts.down_proj.mul_(-2)
    moe.load_state_dict(other.state_dict())
    x, weights = torch.randn(8, 16), torch.rand(8, 2)
    assert rel_err(moe.routed(x, weights, IDS), other.routed(x, weights, IDS)) <= 1e-6


@torch.inference_mode()
def test_what_onednn_cannot_pack_runs_the_grouped_matmul(monkeypatch):
    half = pack_for_cpu(moe_of(experts_of())).half()
    assert isinstance(half.experts, PackedExperts) and half.experts.down == []
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    bf16 = pack_for_cpu(moe_of(experts_of().to(torch.bfloat16)))
    assert type(bf16.experts) is Experts


def test_loading_for_a_cpu_packs_the_routed_experts(tmp_path):
    make_checkpoint(tmp_path, "tiny", seed=0)
    layers = load_model(tmp_path, role="language").language_model.model.layers
    experts = [layer.mlp.experts for layer in layers if hasattr(layer.mlp, "experts")]
    assert experts and all(isinstance(e, PackedExperts) and e.down for e in experts)


def test_experts_stay_unpacked_where_their_copy_would_not_fit(monkeypatch, caplog):
    moe = moe_of(experts_of())
    copy = moe.experts.gate_up_proj.nbytes + moe.experts.down_proj.nbytes
    monkeypatch.setattr(packed, "available_memory", lambda: 2 * copy - 1)
    pack_for_cpu(moe)
    assert type(moe.experts) is Experts and "not packed" in caplog.text
    monkeypatch.setattr(packed, "available_memory", lambda: 2 * copy)
    assert isinstance(pack_for_cpu(moe).experts, PackedExperts)
