"""The stacked experts against a plain per-token, per-expert loop, and their checkpoint names."""

import torch
import torch.nn.functional as F

from epd.model.config import TextConfig
from epd.model.moe import Experts, MoE

from .test_deepseek_oracle import rel_err


def experts_of(dim: int = 16, hidden: int = 8, count: int = 5) -> Experts:
    experts = Experts(count, dim, hidden)
    generator = torch.Generator().manual_seed(0)
    for p in experts.parameters():
        p.data = torch.randn(p.shape, generator=generator)
    return experts


def reference_routed(
    experts: Experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Σ_k weight_k · expert_k(x), one token and one expert at a time, from the per-expert
    matrices as a checkpoint names them."""
    state = experts.state_dict()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            gate = state[f"{e}.gate_proj.weight"] @ x[t]
            up = state[f"{e}.up_proj.weight"] @ x[t]
            out[t] += w * (state[f"{e}.down_proj.weight"] @ (F.silu(gate) * up))
    return out


def test_state_dict_names_each_expert_as_checkpoints_do():
    experts = experts_of(count=3)
    names = set(experts.state_dict())
    assert names == {
        f"{e}.{m}.weight" for e in range(3) for m in ("gate_proj", "up_proj", "down_proj")
    }
    assert experts.state_dict()["1.up_proj.weight"].shape == (8, 16)
    assert experts.state_dict()["1.down_proj.weight"].shape == (16, 8)


def test_loading_per_expert_tensors_fills_the_stacks():
    source, target = experts_of(), Experts(5, 16, 8)
    target.load_state_dict({k: v.clone() for k, v in source.state_dict().items()}, strict=True)
    assert torch.equal(target.gate_up_proj, source.gate_up_proj)
    assert torch.equal(target.down_proj, source.down_proj)
    # Row blocks land where forward reads them: gate first, then up.
    assert torch.equal(target.gate_up_proj[2, :8], source.state_dict()["2.gate_proj.weight"])


def test_loading_reports_a_missing_expert_by_name():
    source = {k: v for k, v in experts_of().state_dict().items() if k != "4.down_proj.weight"}
    result = Experts(5, 16, 8).to_empty(device="cpu").load_state_dict(source, strict=False)
    assert "4.down_proj.weight" not in source
    assert "down_proj" in result.missing_keys and "gate_up_proj" in result.missing_keys


def moe_of(experts: Experts) -> MoE:
    """A MoE of 5 experts (D 16, H 8), 2 per token, around the given experts."""
    sizes = dict(vocab_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1)
    config = TextConfig(
        hidden_size=16, kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
        moe_intermediate_size=8, n_routed_experts=5, num_experts_per_tok=2, **sizes,
    )  # fmt: skip
    moe = MoE(config)
    moe.experts = experts
    return moe


@torch.inference_mode()
def test_routed_equals_a_plain_loop_including_unused_experts():
    moe = moe_of(experts_of())
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(7, 16, generator=generator)
    ids = torch.tensor([[0, 2], [2, 0], [4, 2], [2, 4], [0, 4], [2, 0], [4, 0]])  # 1, 3 unused
    weights = torch.rand(7, 2, generator=generator)
    got = moe.routed(x, weights, ids)
    assert rel_err(got, reference_routed(moe.experts, x, weights, ids)) <= 1e-6


@torch.inference_mode()
def test_no_tokens_route_to_no_rows():
    moe = moe_of(experts_of())
    empty = moe.routed(torch.zeros(0, 16), torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.long))
    assert empty.shape == (0, 16)
