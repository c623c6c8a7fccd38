"""CPU weights in oneDNN's blocked layout, applied around a loaded model (as gpt-fast applies
quantisation): `pack_for_cpu(model)` swaps each `Experts` for a `PackedExperts` and each large
`nn.Linear` for a `PackedLinear`, over the same parameters; `bucket_rows(model)` swaps the
plain linears of bfloat16 weights for `RowBucketedLinear`s.

Why: a decode step multiplies a few rows by each weight (1-16 by the dense ones, ~4 by each
expert at batch 16), and MKL runs such products from row-major weights well below the
memory bandwidth they are bound by; oneDNN runs them faster from weights reordered once at
load. Small linears stay as they are: below `MIN_PACKED_LINEAR` weights, oneDNN's fixed cost
per call outweighs what it saves. Products of many rows (prefill's) run plain:
oneDNN keeps a kernel per row count it meets (`MAX_PACKED_ROWS`); only a prompt's expert
products in bfloat16, a few hundred rows each, run packed (`MAX_PACKED_EXPERT_ROWS`), and
float32 ones of any count where MKL is slow (`packs_many_rows`: CPUs not Intel's). The
packed copies are extra memory (those weights twice, bfloat16 experts three times:
`PackedExperts`): the parameters stay, because state dicts name them (docs/benchmarks.md).

oneDNN also runs the plain products of bfloat16 weights on a CPU, and builds a kernel for each
row count it meets, which costs more than the product it is built for: a prompt of each
length would pay for its own. So their products of more than MAX_PACKED_ROWS
rows get their rows padded (`bucket`): to a multiple of 32 below 512 rows, then of an eighth of
the power of two below them, so 14 kernels per weight shape up to 512 rows and 8 more a
doubling, and at most 1/8 more rows past 256 (docs/benchmarks.md, "bfloat16 on a CPU").
float16 is left as it is: not measured.
"""

from __future__ import annotations

import functools
import logging
import platform
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from epd.memory import available_memory
from epd.model import cpu
from epd.model.attention import round_up
from epd.model.moe import MLP, Experts, weighted_sum

PACKED_DTYPES = (torch.float32, torch.bfloat16)
# Linears of fewer weights run faster unpacked (a (512, 256) one gains; docs/benchmarks.md).
MIN_PACKED_LINEAR = 256 * 512
# oneDNN builds and keeps a kernel for every row count a packed weight meets, 0.5-1.6 MiB each,
# up to 1024 of them: products run packed only for the few rows of a decode step, their counts
# rounded up, so a process meets at most 15 counts per weight shape (docs/benchmarks.md); where
# float32 products of any count run packed (`packs_many_rows`), 14 more up to 512 rows and 8 a
# doubling past it, as many as bfloat16's plain products meet (`bucket`).
MAX_PACKED_ROWS, ROW_STEP = 64, 8
# An expert's products in bfloat16, and in float32 where MKL is slow (`packs_many_rows`), run
# packed up to this many rows, padded to a multiple of ROW_STEP (24 more kernels per shape past
# MAX_PACKED_ROWS; `expert_rows`): a prompt's ~T·k/E rows per expert run faster so than from the
# plain weight (docs/benchmarks.md). In float32 on an Intel CPU the plain weight was as fast,
# and the prefill slower packed.
MAX_PACKED_EXPERT_ROWS = 256
# Up to this many rows, every expert runs at once when at least half have rows (`mix`); past
# it the products the tokens do not need cost more than the calls it saves. Only in bfloat16:
# in float32 a decode step gained nothing measurable, so it keeps no second copy.
MAX_ALL_EXPERTS_ROWS = 32
ALL_EXPERTS_DTYPES = (torch.bfloat16,)
assert MAX_ALL_EXPERTS_ROWS <= MAX_PACKED_ROWS  # those products run packed (`packed_product`)
ROW_BUCKET = 32  # the finest step plain bfloat16 products pad their rows to (`bucket`)
# Linears whose weight the model reads itself instead of calling them on rows: decode folds
# kv_b_proj into its queries and outputs (mla.py), so a packed copy of it would go unused.
READ_DIRECTLY = ("kv_b_proj",)

log = logging.getLogger(__name__)
# An expert's rows in a product (`PackedExperts.spans`): the expert, its first row, the row
# after its last, and the rows its products run on (0: through the plain weight).
Span = tuple[int, int, int, int]


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


def product(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (N, in) → x @ weight.T + bias (N, out): through `packed` (weight packed by `pack`)
    for 1 to MAX_PACKED_ROWS rows, their count above ROW_STEP rounded up to a multiple of it
    (zero rows added, their results dropped); through the plain weight for more rows, unless
    `packs_many_rows`."""
    rows = x.shape[0]
    if 0 < rows <= MAX_PACKED_ROWS:
        return packed_product(x, packed, bias)
    if rows and packs_many_rows(weight.dtype):
        return onednn_linear(padded(x, bucket(rows)), packed, bias)[:rows]
    return bucketed_linear(x, weight, bias)


def packs_many_rows(dtype: torch.dtype) -> bool:
    """Whether products of many rows (a prompt's, an image's patches) in `dtype` run faster
    through packed weights here than through the plain ones: float32 where MKL is slow."""
    return dtype == torch.float32 and blas_is_slow_here()


@functools.cache
def blas_is_slow_here() -> bool:
    """Whether torch's BLAS, MKL, runs float32 products slowly on this CPU: it takes its fast
    kernels on Intel's CPUs only. On an AMD EPYC its products of a prompt's rows were much
    slower than oneDNN's through the packed weight (docs/benchmarks.md, "Kernels that depend
    on the CPU"); on an Intel Xeon the two were as fast. Where MKL is slow, float32 products of
    any row count run packed, their rows bucketed as bfloat16's are (`bucket`)."""
    return torch.backends.mkl.is_available() and cpu.vendor() not in ("GenuineIntel", "")


def packed_product(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x (N, in), 1 ≤ N ≤ MAX_PACKED_ROWS → x @ weight.T + bias (N, out) through `packed`, its
    rows above ROW_STEP rounded up to a multiple of it."""
    rows = x.shape[0]
    return onednn_linear(padded(x, rows if rows <= ROW_STEP else ROW_STEP), packed, bias)[:rows]


def bucketed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x (N, in) → x @ weight.T + bias (N, out), N past MAX_PACKED_ROWS padded up to a multiple
    of `bucket(N)` where oneDNN would otherwise build a kernel for N (see the module's doc)."""
    rows = x.shape[0]
    if rows <= MAX_PACKED_ROWS or not bucketed(weight):
        return F.linear(x, weight, bias)
    return F.linear(padded(x, bucket(rows)), weight, bias)[:rows]


def bucketed(weight: torch.Tensor) -> bool:
    return weight.is_cpu and weight.dtype == torch.bfloat16


def bucket(rows: int) -> int:
    """The step `rows` are padded to a multiple of: ROW_BUCKET, or an eighth of the power of
    two below them once that is larger (300 → 320, 600 → 640, 5000 → 5120)."""
    return max(ROW_BUCKET, 1 << max(0, rows.bit_length() - 4))


def padded(x: torch.Tensor, step: int) -> torch.Tensor:
    """x (N, in) with zero rows added up to a multiple of `step`."""
    extra = -x.shape[0] % step
    return F.pad(x, (0, 0, 0, extra)) if extra else x


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def records_grad(x: torch.Tensor, *parameters: torch.Tensor | None) -> bool:
    """oneDNN's packed product has no backward: where autograd records, the plain path runs."""
    return torch.is_grad_enabled() and (  # checked first: serving never records
        x.requires_grad or any(p is not None and p.requires_grad for p in parameters)
    )


R = TypeVar("R", bound="Repacked")
M = TypeVar("M", bound=nn.Module)


def over_parameters(cls: type[M], sizes: tuple[Any, ...], module: nn.Module) -> M:
    """A `cls(*sizes)` holding `module`'s very parameters (built on meta, then given them, so
    nothing is allocated twice)."""
    with torch.device("meta"):
        new = cls(*sizes)
    for name, parameter in module.named_parameters(recurse=False):
        setattr(new, name, parameter)
    return new.train(module.training)


def linear_sizes(module: Any) -> tuple[int, int, bool]:
    return module.in_features, module.out_features, module.bias is not None


class Repacked(nn.Module):
    """Keeps a module's packed copies in step with the parameters they copy: loading new
    weights and `.to()` / `.cuda()` / `.half()` replace the parameters, and `pack` follows.
    Changing them in place (an optimiser's step) is not followed: these modules are for
    inference, where autograd is off. Packed copies cannot be deep-copied or pickled."""

    copies_kept = 1  # of the weights, packed (1 to `copies`)

    @staticmethod
    def copies(module: nn.Module) -> int:
        """Packed copies of `module`'s weights its packed form keeps where memory allows."""
        return 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register_load_state_dict_post_hook(lambda module, _: module.pack())

    @classmethod
    def of(cls: type[R], module: Any, copies: int = 1, parent: nn.Module | None = None) -> R:
        """The packed form of `module`, over its very parameters (`over_parameters`), keeping
        `copies` packed copies of them (1 to `cls.copies(module)`), in `parent` if given."""
        new = over_parameters(cls, cls.sizes(module), module)
        new.copies_kept = max(1, min(copies, cls.copies(module)))
        if parent is not None:
            new.placed_in(parent)
        new.pack()
        return new

    def placed_in(self, parent: nn.Module) -> None:
        """Take what it packs along from the module that holds it (here: nothing)."""

    @staticmethod
    def sizes(module: Any) -> tuple[Any, ...]:
        """The constructor's arguments that give `module`'s shapes."""
        raise NotImplementedError

    def pack(self) -> None:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        super()._apply(fn, recurse)
        self.pack()
        return self


class RowBucketedLinear(nn.Linear):
    """`nn.Linear` whose products run through `bucketed_linear`."""

    @classmethod
    def of(cls, module: nn.Linear) -> RowBucketedLinear:
        """Over `module`'s very parameters (`over_parameters`)."""
        return over_parameters(cls, linear_sizes(module), module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) → (..., out)."""
        if records_grad(x, self.weight, self.bias):
            return super().forward(x)
        out = bucketed_linear(x.reshape(-1, self.in_features), self.weight, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)


class PackedLinear(Repacked, RowBucketedLinear):
    """`nn.Linear` whose forward runs through its weight packed, where it can be packed."""

    packed: torch.Tensor | None

    sizes = staticmethod(linear_sizes)

    def pack(self) -> None:
        self.packed = pack(self.weight) if can_pack(self.weight) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) → (..., out)."""
        if self.packed is None or records_grad(x, self.weight, self.bias):
            return super().forward(x)
        rows = x.reshape(-1, self.in_features)
        out = product(rows, self.weight, self.packed, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)


class PackedExperts(Repacked, Experts):
    """`Experts` through packed weights: each expert with rows runs its own products, unless, in
    ALL_EXPERTS_DTYPES, at least half the experts have rows among at most MAX_ALL_EXPERTS_ROWS
    (a decode step of many requests): then every expert runs, in two products over all of them
    at once (`mix`).

    gate_up: E packed (2H, D); down: E packed (D, H); in ALL_EXPERTS_DTYPES also gate_up_all:
    packed ((E + n)·2H, D), the experts side by side and then the shared expert's n chunks of
    H (`fold`; n is 0 without one), and down_all: packed (D, (E + n)·H). Empty lists and None
    where the weights cannot be packed (another device or dtype), and then the grouped matmul
    runs.
    """

    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    gate_up_all: torch.Tensor | None
    down_all: torch.Tensor | None
    shared_key: tuple[int, ...]

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__(experts, dim, hidden)
        self.gate_up, self.down, self.gate_up_all, self.down_all = [], [], None, None
        # The shared expert beside them (`placed_in`; held weakly), its chunks of `hidden` in
        # the side-by-side copy (`fold`), and where the weights they copy live (`weights_key`).
        self.shared_expert: Callable[[], MLP | None] = lambda: None
        self.shared_chunks, self.shared_key = 0, ()

    @staticmethod
    def sizes(module: Any) -> tuple[int, int, int]:
        return len(module), module.down_proj.shape[1], module.hidden

    @staticmethod
    def copies(module: nn.Module) -> int:
        """Each expert's weights, and in ALL_EXPERTS_DTYPES all of them side by side too."""
        assert isinstance(module, Experts)
        return 2 if module.down_proj.dtype in ALL_EXPERTS_DTYPES else 1

    @property
    def all_at_once(self) -> bool:
        """Whether the side-by-side copy is kept: where it gains and memory allowed it."""
        return min(self.copies_kept, self.copies(self)) > 1

    def pack(self) -> None:
        packable = can_pack(self.down_proj)
        self.gate_up = [pack(w) for w in self.gate_up_proj] if packable else []
        self.down = [pack(w) for w in self.down_proj] if packable else []
        self.gate_up_all = self.down_all = None
        if packable and self.all_at_once:
            shared = self.shared_expert()
            self.pack_side_by_side(shared if shared is not None and self.can_fold(shared) else None)

    def placed_in(self, parent: nn.Module) -> None:
        """A shared expert beside them is packed with them (`fold`), and any load into it (or
        into one of its linears) folds it in again."""
        shared = getattr(parent, "shared_experts", None)
        if not isinstance(shared, MLP):
            return
        self.shared_expert = weakref.ref(shared)
        experts = weakref.ref(self)  # weakly, so experts swapped out can be freed
        for module in shared.modules():
            module.register_load_state_dict_post_hook(
                lambda *_, experts=experts: (e := experts()) and e.unfold()
            )

    def pack_side_by_side(self, shared: MLP | None) -> None:
        """The experts side by side, and after them the shared expert's chunks of `hidden` as
        more experts (its gate and up rows, its down columns: silu(gate)·up acts row by row,
        and the down product sums over the chunks as over experts)."""
        # The old copy goes first: two at once would be the memory peak. Should packing fail
        # (out of memory), None leaves `mix` to the loop, consistent.
        self.gate_up_all = self.down_all = None
        self.shared_chunks, self.shared_key = 0, ()
        gate_up = [self.gate_up_proj.flatten(0, 1)]  # (E·2H, D)
        # (E, D, H) → (D, E·H): expert e's down_proj in columns [e·H, (e + 1)·H)
        down = [self.down_proj.permute(1, 0, 2).flatten(1)]
        chunks = 0
        if shared is not None:
            gates = shared.gate_proj.weight.split(self.hidden)  # n × (H, D)
            ups = shared.up_proj.weight.split(self.hidden)
            gate_up += [torch.cat(chunk) for chunk in zip(gates, ups, strict=True)]
            down.append(shared.down_proj.weight)  # (D, n·H)
            chunks = len(gates)
        gate_up_all, down_all = pack(torch.cat(gate_up)), pack(torch.cat(down, dim=1))
        self.gate_up_all, self.down_all = gate_up_all, down_all
        if shared is not None:
            self.shared_chunks, self.shared_key = chunks, weights_key(shared)

    def fold(self, shared: MLP | None) -> bool:
        """Whether the shared expert runs in the side-by-side products: put there when packing,
        and again at the first call after its weights change (they load after these, or
        move). Its chunks add their weights' memory to that copy (1/32 of the experts' in
        Kimi-VL)."""
        if shared is None or self.gate_up_all is None:
            return False
        if weights_key(shared) == self.shared_key:  # folded, as it is now
            return True
        if not self.can_fold(shared):
            return False
        self.pack_side_by_side(shared)
        return True

    def can_fold(self, shared: MLP) -> bool:
        """Its weights in the experts' dtype and device, its width a multiple of theirs."""
        gate, up, down = shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight
        mine = (self.down_proj.dtype, self.down_proj.device)
        width = gate.shape[0]
        return (
            all((w.dtype, w.device) == mine for w in (gate, up, down))
            and width % self.hidden == 0
            and up.shape[0] == down.shape[1] == width
        )

    def unfold(self) -> None:
        """The shared expert's weights may have changed: fold them in again at the next call."""
        self.shared_key = ()

    def mix(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared: MLP | None = None
    ) -> torch.Tensor:
        """x (T, D), weights and expert ids (T, k) → Σ_k weight_k · expert_k(x) (T, D), plus
        shared(x) if a shared expert is given.

        Every expert at once when at least half have rows: the weights of the experts a row is
        not routed to are zero, so the down product sums just its k experts. It multiplies
        E/k times the useful products, but one oneDNN call instead of two per expert costs
        less on the few rows of a decode step (docs/benchmarks.md, "Every expert at once").
        The shared expert runs in the same two products (`fold`), weighted 1: three calls
        fewer. Every row then passes through every expert: an expert whose output is not
        finite would spoil rows not routed to it (0 · NaN), where the loop would spoil only
        its own.
        """
        experts, tokens = len(self), x.shape[0]
        counts = torch.bincount(ids.flatten(), minlength=experts)  # (E,) rows per expert
        if (
            self.gate_up_all is None
            or not 0 < tokens <= MAX_ALL_EXPERTS_ROWS
            or records_grad(x, self.gate_up_proj, self.down_proj)
            or 2 * int(counts.count_nonzero()) < experts
        ):
            out, folded = self.mix_sorted(x, weights, ids, counts), False
        else:
            folded = self.fold(shared)
            out = self.all_at_once_product(x, weights, ids, folded)
        return out + shared(x) if shared is not None and not folded else out

    def all_at_once_product(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared: bool
    ) -> torch.Tensor:
        """`mix` through the side-by-side copy, its shared chunks weighted 1 if `shared`."""
        assert self.gate_up_all is not None and self.down_all is not None
        experts, tokens = len(self), x.shape[0]
        columns = experts + self.shared_chunks  # the experts, then any shared chunks
        gate_up = packed_product(x, self.gate_up_all).view(tokens, columns, -1)
        gate, up = gate_up.split(self.hidden, dim=-1)  # (T, E + n, H) each
        # (T, E + n): each token's weight per expert, summed should an expert appear twice;
        # 1 for the shared chunks if the shared expert is asked for, else 0
        mixing = x.new_zeros(tokens, columns)
        mixing[:, :experts].scatter_add_(1, ids, weights.to(x.dtype))
        mixing[:, experts:] = float(shared)
        hidden = F.silu(gate) * up * mixing[..., None]  # (T, E + n, H)
        return packed_product(hidden.flatten(1), self.down_all)

    def mix_sorted(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """`Experts.mix_sorted`; one row (a decode step of one request) runs `one_row`."""
        if x.shape[0] == 1 and self.down and not records_grad(x, self.gate_up_proj, self.down_proj):
            return self.one_row(x, weights, ids)
        return super().mix_sorted(x, weights, ids, counts)

    def one_row(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x (1, D), weights and expert ids (1, k) → Σ_k weight_k · expert_k(x) (1, D): its
        experts one after another, combined by `weighted_sum` as every path is (a request's row
        rounds alike alone and in a batch, and gradients reach the weights). For one row,
        sorting and gathering rows by expert costs more ops than its k products."""
        outputs = []
        for expert in ids[0].tolist():
            gate, up = onednn_linear(x, self.gate_up[expert], None).split(self.hidden, dim=-1)
            outputs.append(onednn_linear(F.silu(gate) * up, self.down[expert], None))
        return weighted_sum(torch.cat(outputs)[:, None], weights)  # (k, 1, D) → (1, D)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert (S, D), rows per expert (E,) → each row through its expert (S, D).

        On a CPU the counts are already host memory, so reading them costs no sync.
        """
        if not self.down or records_grad(x, self.gate_up_proj, self.down_proj):
            return super().forward(x, counts)
        spans, tail = self.spans(counts, x.dtype)
        return self.products(F.pad(x, (0, 0, 0, tail)) if tail else x, spans, tail)

    def gathered(self, x: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (T, D), the row of each slot sorted by expert (S,), rows per expert (E,) → each
        slot's row through its expert (S, D): `forward`, its tail gathered with the rows."""
        if not self.down or records_grad(x, self.gate_up_proj, self.down_proj):
            return super().gathered(x, rows, counts)
        spans, tail = self.spans(counts, x.dtype)
        # The tail repeats row 0: its results are dropped (`products`), and no copy pads x.
        rows = F.pad(rows, (0, tail)) if tail else rows
        return self.products(x.index_select(0, rows), spans, tail)

    @staticmethod
    def spans(counts: torch.Tensor, dtype: torch.dtype) -> tuple[list[Span], int]:
        """Rows per expert (E,) → each expert with rows as (expert, its first row, the row after
        its last, the rows its products run on: `expert_rows`), and how far past all the rows
        the packed products reach (the tail; 0 where none does)."""
        spans, end = [], 0
        for expert, rows in enumerate(counts.tolist()):
            if rows:
                spans.append((expert, end, end + rows, expert_rows(rows, dtype)))
                end += rows
        reach = max((start + run for _, start, _, run in spans if run), default=0)
        return spans, max(0, reach - end)

    def products(self, x: torch.Tensor, spans: list[Span], tail: int) -> torch.Tensor:
        """Rows sorted by expert and then `tail` more (S + tail, D) → the S rows each through
        its expert (S, D).

        An expert's products run on its rows and those after them up to the count oneDNN keeps
        a kernel for (`expert_rows`): the next experts' rows, then the tail. Rows multiply on
        their own, so the results past its own are dropped, and no expert's rows are copied to
        pad them. What lies between the products runs once over all the rows: a decode step's
        experts have a row or a few each, and an op per expert costs more than its rows.
        """
        if not spans:
            return x[:0]
        gate_up = torch.cat(
            [self.run(x, span, self.gate_up_proj, self.gate_up) for span in spans]
            + [x.new_zeros(tail, 2 * self.hidden)]
        )  # (S + tail, 2H), the tail zero
        gate, up = gate_up.split(self.hidden, dim=-1)
        hidden = F.silu(gate) * up  # (S + tail, H)
        return torch.cat([self.run(hidden, span, self.down_proj, self.down) for span in spans])

    @staticmethod
    def run(
        x: torch.Tensor, span: Span, weights: torch.Tensor, packed: list[torch.Tensor]
    ) -> torch.Tensor:
        """An expert's rows of x (N, in) @ its weight.T → (N, out): through its packed weight on
        the rows `span` says (`products`), else through the plain one on its own."""
        expert, start, end, rows = span
        if rows:
            return onednn_linear(x[start : start + rows], packed[expert], None)[: end - start]
        return bucketed_linear(x[start:end], weights[expert])


def expert_rows(rows: int, dtype: torch.dtype) -> int:
    """The rows an expert's product of `rows` (≥ 1) runs on through its packed weight: `rows` up
    to ROW_STEP, then a multiple of ROW_STEP up to MAX_PACKED_EXPERT_ROWS (where its weights'
    dtype runs prompts packed: bfloat16, and float32 where MKL is slow; MAX_PACKED_ROWS
    elsewhere), then a multiple of `bucket(rows)` where any count runs packed; 0 past those, for
    the plain weight."""
    many = dtype == torch.bfloat16 or packs_many_rows(dtype)
    if rows <= ROW_STEP:
        return rows
    if rows <= (MAX_PACKED_EXPERT_ROWS if many else MAX_PACKED_ROWS):
        return round_up(rows, ROW_STEP)
    return round_up(rows, bucket(rows)) if packs_many_rows(dtype) else 0


def weights_key(module: nn.Module) -> tuple[int, ...]:
    """Where a module's parameters live: that changes when they move. Loading new weights
    copies them in place: any load into a shared expert (or into one of its linears) has its
    experts `unfold` (`PackedExperts.placed_in`)."""
    return tuple(p.data_ptr() for p in module.parameters())


def shared_bytes(moe: nn.Module) -> int:
    """Bytes of the shared expert beside a layer's experts, if any."""
    shared = getattr(moe, "shared_experts", None)
    return sum(p.nbytes for p in shared.parameters()) if isinstance(shared, MLP) else 0


def pack_for_cpu(model: nn.Module) -> nn.Module:
    """Swap, in place, every `Experts` and every `nn.Linear` of at least `MIN_PACKED_LINEAR`
    weights in an inference model for its packed form over the same parameters; names, state
    dict and results (to rounding) stay the same.

    Each packed copy adds its weights' memory again (bfloat16 experts keep two: `copies`), so
    copies are made while all of them together take at most half of what this process may
    still use (`available_memory`; nothing where that is unknown): every module's first copy
    before any second, the routed experts first (they gain most); the rest stay as they are
    (logged): slower, but it fits.
    """
    found = [
        (parent, name, child, packed)
        for parent in model.modules()
        for name, child in parent.named_children()
        if (packed := packed_form(name, child))
    ]
    found.sort(key=lambda swap: swap[3] is not PackedExperts)  # stable: experts first
    sizes = [  # bytes of one copy (the experts' with a shared expert beside them: `fold`)
        sum(p.nbytes for n, p in child.named_parameters(recurse=False) if n != "bias")
        + (shared_bytes(parent) if packed is PackedExperts else 0)
        for parent, _, child, packed in found
    ]
    wanted = [packed.copies(child) for _, _, child, packed in found]
    budget = available_memory() // 2
    kept, room = [0] * len(found), budget
    for copy in range(1, max(wanted, default=0) + 1):  # every first copy before any second
        for i, size in enumerate(sizes):
            if kept[i] == copy - 1 and wanted[i] >= copy and size <= room:
                kept[i], room = copy, room - size
    failed: list[str] = []
    for (parent, name, child, packed), copies in zip(found, kept, strict=True):
        if copies:
            try:
                setattr(parent, name, packed.of(child, copies, parent))
            except (RuntimeError, MemoryError) as e:  # an optional copy: the module stays plain
                failed.append(f"{name}: {type(e).__name__}: {e}")
    if failed:
        log.warning(
            "%d weight copies for oneDNN could not be made; those products run plain (%s)",
            len(failed),
            failed[0][:300],
        )
    left = sum((w - k) * size for w, k, size in zip(wanted, kept, sizes, strict=True))
    if left:
        log.warning(
            "%.2f GiB of copies for oneDNN not made (weights not packed, or bfloat16 experts "
            "not also side by side): they would take more than half the memory available "
            "(%.1f GiB); the model runs slower without them",
            left / 2**30,
            2 * budget / 2**30,
        )
    return model


def bucket_rows(model: nn.Module) -> nn.Module:
    """Swap, in place, every plain `nn.Linear` of bfloat16 weights on a CPU for a
    `RowBucketedLinear` over the same parameters (nothing is copied; see the module's doc)."""
    children = [(p, n, c) for p in model.modules() for n, c in p.named_children()]
    for parent, name, child in children:
        if type(child) is nn.Linear and bucketed(child.weight):
            setattr(parent, name, RowBucketedLinear.of(child))
    return model


def packed_form(name: str, module: nn.Module) -> type[Repacked] | None:
    """What packs `module`, if anything: routed experts, and plain linears called on rows and
    large enough to gain, in a dtype oneDNN packs here."""
    if type(module) is Experts and can_pack(module.down_proj):
        return PackedExperts
    if (
        type(module) is nn.Linear
        and name not in READ_DIRECTLY
        and module.weight.numel() >= MIN_PACKED_LINEAR
        and can_pack(module.weight)
    ):
        return PackedLinear
    return None
