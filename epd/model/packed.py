"""Routed experts' CPU weights in oneDNN's blocked layout, applied around a loaded model (as
gpt-fast applies quantisation): `pack_for_cpu(model)` swaps each `Experts` for a
`PackedExperts` over the same parameters.

Why: a decode step multiplies a few rows by each expert (~4 at batch 16), and MKL runs such
products from row-major weights at a third of this VM's memory bandwidth; oneDNN, from weights
reordered once at load, runs them 1.7-1.9× faster. Other linears stay as they are: their
products are too small for oneDNN's fixed cost per call to pay back at batch 1
(docs/benchmarks.md). The packed copy is extra memory (the routed experts' weights twice):
the dense stacks stay, because state dicts name them.
"""

from __future__ import annotations

import logging
import platform

import torch
import torch.nn.functional as F
from torch import nn

from epd.memory import available_memory
from epd.model.moe import Experts

PACKED_DTYPES = (torch.float32, torch.bfloat16)

log = logging.getLogger(__name__)


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN's packed linear exists in torch's x86 CPU builds, for float32, and for bfloat16
    where the CPU converts it (AVX-512 or AVX-NE-CONVERT; elsewhere reordering raises)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in PACKED_DTYPES
        and torch.backends.mkldnn.is_available()
        and platform.machine().lower() in ("x86_64", "amd64")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and (weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A linear weight (out, in) that `can_pack` → an opaque oneDNN tensor."""
    # The hint is the rows expected per product; measured, it changes little between 1 and 256.
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)


def packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x (..., in) → x @ W.T (..., out), W packed by `pack`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


class PackedExperts(Experts):
    """`Experts` whose forward loops over the experts with rows, through packed weights.

    gate_up: E packed (2H, D); down: E packed (D, H); both empty where the weights cannot be
    packed (another device or dtype), and then the grouped matmul runs instead.
    """

    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__(experts, dim, hidden)
        self.gate_up, self.down = [], []
        # Loading new weights replaces the stacks: the packed copies must follow them.
        self.register_load_state_dict_post_hook(lambda module, _: module.pack())

    @classmethod
    def of(cls, experts: Experts) -> PackedExperts:
        count, dim, hidden = len(experts), experts.down_proj.shape[1], experts.hidden
        with torch.device("meta"):
            new = cls(count, dim, hidden)
        new.gate_up_proj, new.down_proj = experts.gate_up_proj, experts.down_proj
        new.train(experts.training)
        new.pack()
        return new

    def pack(self) -> None:
        packable = can_pack(self.down_proj)
        self.gate_up = [pack(w) for w in self.gate_up_proj] if packable else []
        self.down = [pack(w) for w in self.down_proj] if packable else []

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert (S, D), rows per expert (E,) → each row through its expert (S, D).

        On a CPU the counts are already host memory, so reading them costs no sync.
        """
        if not self.down or self.needs_graph(x):
            return super().forward(x, counts)
        out, end = torch.empty_like(x), 0
        for expert, rows in enumerate(counts.tolist()):
            if rows:
                start, end = end, end + rows
                gate, up = packed_linear(x[start:end], self.gate_up[expert]).split(
                    self.hidden, dim=-1
                )
                out[start:end] = packed_linear(F.silu(gate) * up, self.down[expert])
        return out

    def needs_graph(self, x: torch.Tensor) -> bool:
        """oneDNN's packed product has no backward: autograd needs the grouped matmul."""
        return torch.is_grad_enabled() and (  # checked first: serving never records
            x.requires_grad or self.gate_up_proj.requires_grad or self.down_proj.requires_grad
        )

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # .to(), .cuda(), .half() replace the stacks: the packed copies must follow them.
        super()._apply(fn, recurse)
        self.pack()
        return self


def pack_for_cpu(model: nn.Module) -> nn.Module:
    """Swap, in place, every `Experts` of an inference model for a `PackedExperts` over the same
    parameters; names, state dict and results (to rounding) stay the same.

    The packed copy doubles the routed experts' memory, so where it would take more than half
    of what this process may still use (`available_memory`; nothing where that is unknown) the
    model stays as it is (logged): slower, but it fits.
    """
    found = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is Experts and can_pack(child.down_proj)
    ]
    copy = sum(e.gate_up_proj.nbytes + e.down_proj.nbytes for _, _, e in found)
    room = available_memory()
    if found and copy > room // 2:
        log.warning(
            "routed experts not packed for oneDNN: their copy (%.1f GiB) would take more than "
            "half the memory available (%.1f GiB); decode runs slower without it",
            copy / 2**30,
            room / 2**30,
        )
        return model
    for parent, name, child in found:
        setattr(parent, name, PackedExperts.of(child))
    return model
