"""DeepSeek-V3 feed-forward: a gated MLP, and the noaux_tc mixture of experts built from it."""

from __future__ import annotations

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


class MoE(nn.Module):
    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        dim, hidden = config.hidden_size, config.moe_intermediate_size
        self.gate = Router(config)
        self.experts = nn.ModuleList(MLP(dim, hidden) for _ in range(config.n_routed_experts or 0))
        if config.n_shared_experts:
            self.shared_experts = MLP(dim, hidden * config.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, D) → (T, D): Σ_k weight_k · expert_k(x) + shared(x)."""
        weights, ids = self.gate(x)
        out = self.routed(x, weights, ids)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        return out

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        k = ids.shape[1]
        order = ids.flatten().argsort()  # (T·k,) slots sorted by expert
        counts = torch.bincount(ids.flatten(), minlength=len(self.experts)).tolist()
        flat_weights = weights.flatten()
        out = torch.zeros_like(x)
        for expert, slots in zip(self.experts, order.split(counts), strict=True):
            if slots.numel() == 0:
                continue
            tokens = slots // k
            y = expert(x[tokens]) * flat_weights[slots, None].to(x.dtype)
            out.index_add_(0, tokens, y)
        return out
