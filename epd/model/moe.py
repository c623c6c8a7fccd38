"""DeepSeek-V3 feed-forward: a gated MLP, and the noaux_tc mixture of experts built from it."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from epd.model.config import TextConfig

# Routing stays in float32 whatever the serving dtype, as in the reference implementation.
FLOAT32_TENSOR_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """noaux_tc top-k routing.

    Scores are sigmoid(logits) in float32. Experts are *chosen* on scores + e_score_correction_bias
    (restricted to the best `topk_group` of `n_group` groups, each group ranked by the sum of its
    two best biased scores), but *weighted* by their unbiased scores, normalised to sum to 1 and
    multiplied by `routed_scaling_factor`.
    """

    e_score_correction_bias: torch.Tensor

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        experts = config.n_routed_experts or 0
        self.top_k, self.n_group, self.topk_group = (
            config.num_experts_per_tok,
            config.n_group,
            config.topk_group,
        )
        self.normalise, self.scale = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, D) → weights (T, k) float32, expert ids (T, k)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # (T, E)
        biased = scores + self.e_score_correction_bias
        if self.n_group > 1:
            biased = self.keep_best_groups(biased)
        ids = biased.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.normalise:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids

    def keep_best_groups(self, biased: torch.Tensor) -> torch.Tensor:
        groups = biased.unflatten(-1, (self.n_group, -1))  # (T, G, E/G)
        group_scores = groups.topk(2, dim=-1).values.sum(-1)  # (T, G)
        best = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return groups.masked_fill(~keep[..., None], float("-inf")).flatten(1)


class Experts(nn.Module):
    """The routed experts' gated MLPs, stacked so that two grouped matmuls run them all.

    gate_up_proj (E, 2H, D): expert e's gate_proj.weight in rows [0, H), up_proj.weight in [H, 2H)
    down_proj    (E, D, H):  expert e's down_proj.weight

    The state dict still names each expert's matrices as checkpoints do (`{e}.gate_proj.weight`,
    `{e}.up_proj.weight`, `{e}.down_proj.weight`), as views into the stacks, so loading stays a
    lookup by name.
    """

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(experts, dim, hidden))
        self.register_state_dict_post_hook(per_expert_names)
        self.register_load_state_dict_pre_hook(stack_per_expert)

    def __len__(self) -> int:
        return self.down_proj.shape[0]

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert (S, D), rows per expert (E,) → each row through its expert (S, D).

        `counts` stays on the device: no host sync (torch's grouped matmul reads the offsets
        on the GPU; its fallback for other devices and dtypes loops over the groups).
        """
        ends = counts.cumsum(0).to(torch.int32)
        gate_up = F.grouped_mm(x, self.gate_up_proj.transpose(1, 2), offs=ends)  # (S, 2H)
        gate, up = gate_up.split(self.hidden, dim=-1)
        return F.grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=ends)

    def mix(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared: MLP | None = None
    ) -> torch.Tensor:
        """x (T, D), weights and expert ids (T, k) → Σ_k weight_k · expert_k(x) (T, D), plus
        shared(x) if a shared expert is given."""
        counts = torch.bincount(ids.flatten(), minlength=len(self))
        out = self.mix_sorted(x, weights, ids, counts)
        return out if shared is None else out + shared(x)

    def mix_sorted(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """`mix`, given the rows per expert (E,): the rows sorted by expert run through it."""
        tokens, k = ids.shape
        order = ids.flatten().argsort(stable=True)  # (T·k,) slots grouped by expert
        y = self.gathered(x, order // k, counts)  # (T·k, D), in slot order
        # Each token's j-th choice at (j, t): summed over the leading dim, the k choices add up
        # along whole contiguous rows (over the middle dim of (T, k, D), a CPU's bfloat16 sum
        # runs a slow strided kernel). The fixed order of the sum keeps the result
        # deterministic.
        landed = order.argsort().view(tokens, k).t().flatten()  # (k·T,) rows of y
        per_choice = y.index_select(0, landed).view(k, tokens, x.shape[-1])  # (k, T, D)
        return weighted_sum(per_choice, weights)

    def gathered(self, x: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (T, D), the row of each slot sorted by expert (S,), rows per expert (E,) → each
        slot's row through its expert (S, D)."""
        return self(x.index_select(0, rows), counts)


def weighted_sum(per_choice: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each token's k expert outputs (k, T, D), weighted by its routing weights (T, k) in their
    dtype and summed in that fixed order → (T, D): every path through the experts combines
    them here, so a row rounds alike whichever path ran it."""
    return (per_choice * weights.t().to(per_choice.dtype)[..., None]).sum(0)


def per_expert_names(
    module: nn.Module, state: dict[str, Any], prefix: str, metadata: dict[str, Any]
) -> None:
    """State-dict hook: the stacks as per-expert tensors named as in checkpoints (views)."""
    assert isinstance(module, Experts)
    gate_up, down = state.pop(prefix + "gate_up_proj"), state.pop(prefix + "down_proj")
    for e in range(len(module)):
        state[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, : module.hidden]
        state[f"{prefix}{e}.up_proj.weight"] = gate_up[e, module.hidden :]
        state[f"{prefix}{e}.down_proj.weight"] = down[e]


def stack_per_expert(module: nn.Module, state: dict[str, Any], prefix: str, *_: object) -> None:
    """Load pre-hook: stack checkpoint-named per-expert tensors into the module's parameters.

    Names that are missing are left alone, so strict loading still reports each one.
    """
    assert isinstance(module, Experts)
    names = [
        [f"{prefix}{e}.{m}.weight" for e in range(len(module))]
        for m in ("gate_proj", "up_proj", "down_proj")
    ]
    if not all(n in state for group in names for n in group):
        return
    gate, up, down = ([state.pop(n) for n in group] for group in names)
    state[prefix + "gate_up_proj"] = torch.cat([torch.stack(gate), torch.stack(up)], dim=1)
    state[prefix + "down_proj"] = torch.stack(down)


class MoE(nn.Module):
    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        dim, hidden = config.hidden_size, config.moe_intermediate_size
        self.gate = Router(config)
        self.experts = Experts(config.n_routed_experts or 0, dim, hidden)
        if config.n_shared_experts:
            self.shared_experts = MLP(dim, hidden * config.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, D) → (T, D): Σ_k weight_k · expert_k(x) + shared(x)."""
        weights, ids = self.gate(x)
        return self.experts.mix(x, weights, ids, getattr(self, "shared_experts", None))

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x (T, D), weights and expert ids (T, k) → Σ_k weight_k · expert_k(x) (T, D)."""
        return self.experts.mix(x, weights, ids)
