"""oneDNN-packed experts and linears against their plain forms, and the swap around a model."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from epd.checkpoint.synthetic import make_checkpoint
from epd.checkpoint.weights import load_model
from epd.model import packed
from epd.model.moe import MLP, Experts
from epd.model.packed import (
    MAX_ALL_EXPERTS_ROWS,
    MIN_PACKED_LINEAR,
    PackedExperts,
    PackedLinear,
    Repacked,
    RowBucketedLinear,
    can_pack,
    pack_for_cpu,
)

from .test_deepseek_oracle import rel_err
from .test_moe import experts_of, moe_of, reference_routed

pytestmark = pytest.mark.skipif(
    not can_pack(torch.zeros(1)), reason="this torch build has no oneDNN packed linear"
)

# bfloat16 packs only where the CPU converts it (AVX-512 or AVX-NE-CONVERT).
BF16 = pytest.mark.skipif(
    not can_pack(torch.zeros(1, dtype=torch.bfloat16)), reason="no oneDNN bfloat16 on this CPU"
)
DTYPES = [(torch.float32, 1e-6), pytest.param(torch.bfloat16, 2e-2, marks=BF16)]

# Experts 1 and 3 get no token; 0, 2 and 4 get products of 4, 7 and 5 rows.
IDS = torch.tensor([[0, 2], [2, 0], [4, 2], [2, 4], [0, 4], [2, 0], [4, 2], [2, 4]])
# Fewer than half the experts get rows: 0 and 2 only.
FEW = torch.tensor([[0, 2], [2, 0]] * 4)
# An expert twice for one token (the router never does this; the sum must still hold).
TWICE = torch.tensor([[0, 0], [1, 1], [2, 2], [3, 4]] * 2)


@pytest.mark.parametrize("ids", [IDS, FEW, TWICE], ids=["most-experts", "few-experts", "twice"])
@pytest.mark.parametrize("dtype, tolerance", DTYPES)
@torch.inference_mode()
def test_packed_experts_equal_a_plain_loop_including_unused_experts(dtype, tolerance, ids):
    moe = pack_for_cpu(moe_of(experts_of().to(dtype)))
    assert isinstance(moe.experts, PackedExperts) and len(moe.experts.down) == 5
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(8, 16, generator=generator).to(dtype)
    weights = torch.rand(8, 2, generator=generator)
    got = moe.routed(x, weights, ids)
    want = reference_routed(experts_of(), x.float(), weights, ids)
    assert got.dtype == dtype and rel_err(got.float(), want) <= tolerance


@pytest.mark.parametrize("ids", [[[4, 1]], [[3, 3]]], ids=["two-experts", "one-twice"])
@pytest.mark.parametrize("dtype, tolerance", DTYPES)
@torch.inference_mode()
def test_one_row_runs_its_experts_one_after_another(monkeypatch, dtype, tolerance, ids):
    """A decode step of one request: no sorting or gathering by expert, the same sum, rounded
    as the sort-and-gather path rounds it."""
    moe = pack_for_cpu(moe_of(experts_of().to(dtype)))
    gathered = []
    real = PackedExperts.gathered
    monkeypatch.setattr(PackedExperts, "gathered", lambda *a: gathered.append(1) or real(*a))
    x, weights, ids = torch.randn(1, 16).to(dtype), torch.rand(1, 2), torch.tensor(ids)
    got = moe.routed(x, weights, ids)
    assert not gathered
    want = reference_routed(experts_of(), x.float(), weights, ids)
    assert rel_err(got.float(), want) <= tolerance
    counts = torch.bincount(ids.flatten(), minlength=5)
    assert torch.equal(got, Experts.mix_sorted(moe.experts, x, weights, ids, counts))


def test_one_rows_routing_weights_get_their_gradients():
    moe = pack_for_cpu(moe_of(experts_of())).requires_grad_(False)
    weights = torch.rand(1, 2, requires_grad=True)
    moe.routed(torch.randn(1, 16), weights, torch.tensor([[4, 1]])).sum().backward()
    assert weights.grad is not None and bool(weights.grad.abs().sum() > 0)


@pytest.mark.parametrize(
    "rows, ids, at_once",
    [
        (8, IDS, True),  # 3 of 5 experts have rows: all 5 run in two products
        (8, FEW, False),  # 2 of 5: each runs its own
        (MAX_ALL_EXPERTS_ROWS, torch.cat([IDS] * 4)[:MAX_ALL_EXPERTS_ROWS], True),
        (MAX_ALL_EXPERTS_ROWS + 1, torch.cat([IDS] * 5)[: MAX_ALL_EXPERTS_ROWS + 1], False),
    ],
)
@pytest.mark.parametrize("dtype, tolerance", DTYPES)
@torch.inference_mode()
def test_every_expert_runs_at_once_only_for_few_rows_and_most_experts_in_bfloat16(
    monkeypatch, rows, ids, at_once, dtype, tolerance
):
    """Only bfloat16 gains from it (docs/benchmarks.md); float32 keeps one packed copy."""
    moe = pack_for_cpu(moe_of(experts_of().to(dtype)))
    at_once = at_once and dtype == torch.bfloat16
    calls = []
    real = PackedExperts.gathered
    monkeypatch.setattr(PackedExperts, "gathered", lambda *a: calls.append(1) or real(*a))
    x, weights = torch.randn(rows, 16).to(dtype), torch.rand(rows, 2)
    want = reference_routed(experts_of(), x.float(), weights, ids)
    assert rel_err(moe.routed(x, weights, ids).float(), want) <= tolerance
    assert bool(calls) is not at_once
    assert (moe.experts.down_all is not None) is (dtype == torch.bfloat16)


def moe_with_shared(dtype: torch.dtype, sign: float = 1.0, width: int = 16) -> nn.Module:
    """`moe_of` with a shared expert `width` wide (16: two experts' 8), its weights seeded."""
    moe = moe_of(experts_of())
    moe.shared_experts = MLP(16, width)
    generator = torch.Generator().manual_seed(5)
    for p in moe.shared_experts.parameters():
        p.data = sign * torch.randn(p.shape, generator=generator)
    return moe.to(dtype)


def plain_moe_output(moe: nn.Module, x: torch.Tensor, weights, ids) -> torch.Tensor:
    """Σ_k weight_k · expert_k(x) + shared(x), in float32, one token and expert at a time."""
    shared = moe.shared_experts
    plain = MLP(16, shared.gate_proj.out_features)
    plain.load_state_dict({k: v.float() for k, v in shared.state_dict().items()})
    return reference_routed(experts_of(), x.float(), weights, ids) + plain(x.float())


@BF16
@torch.inference_mode()
def test_the_shared_expert_runs_inside_the_products_of_every_expert_at_once(monkeypatch):
    moe = pack_for_cpu(moe_with_shared(torch.bfloat16))
    assert moe.experts.shared_chunks == 2  # folded when packed, before any call
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(8, 16, generator=generator).bfloat16()
    weights = torch.rand(8, 2, generator=generator)
    want = plain_moe_output(moe, x, weights, IDS)
    monkeypatch.setattr(moe.gate, "forward", lambda _: (weights, IDS))
    with monkeypatch.context() as m:  # in the experts' two products, never on its own
        m.setattr(MLP, "forward", lambda *_: pytest.fail("the shared expert ran on its own"))
        got = moe(x)
    assert moe.experts.shared_chunks == 2 and rel_err(got.float(), want) <= 2e-2
    # The routed experts alone, from the same copy: the shared chunks weighted 0.
    routed = moe.routed(x, weights, IDS)
    assert rel_err(routed.float(), reference_routed(experts_of(), x.float(), weights, IDS)) <= 2e-2
    # Few rows per expert: the loop, and the shared expert on its own.
    few = moe.experts.mix(x, weights, FEW, moe.shared_experts)
    assert rel_err(few.float(), plain_moe_output(moe, x, weights, FEW)) <= 2e-2
    twice = moe.experts.mix(x, weights, TWICE, moe.shared_experts)  # one expert twice a token
    assert rel_err(twice.float(), plain_moe_output(moe, x, weights, TWICE)) <= 2e-2


@BF16
@torch.inference_mode()
def test_a_shared_expert_that_cannot_fold_runs_on_its_own():
    moe = pack_for_cpu(moe_with_shared(torch.bfloat16, width=12))  # not a multiple of 8
    x, weights = torch.randn(8, 16).bfloat16(), torch.rand(8, 2)
    got = moe.experts.mix(x, weights, IDS, moe.shared_experts)
    assert moe.experts.shared_chunks == 0 and moe.experts.down_all is not None
    assert rel_err(got.float(), plain_moe_output(moe, x, weights, IDS)) <= 2e-2


@BF16
@torch.inference_mode()
def test_new_shared_weights_are_folded_in_again():
    """Loaded with the experts (after they repack) or alone, the shared expert's new weights
    are in the next call's products."""
    other = moe_with_shared(torch.bfloat16, -2)
    x, weights = torch.randn(8, 16).bfloat16(), torch.rand(8, 2)
    want = plain_moe_output(other, x, weights, IDS)
    for load in ("moe", "shared expert", "its linears"):
        moe = pack_for_cpu(moe_with_shared(torch.bfloat16))
        moe.experts.mix(x, weights, IDS, moe.shared_experts)  # folded with the first weights
        if load == "moe":
            moe.load_state_dict(other.state_dict())
        elif load == "shared expert":
            moe.shared_experts.load_state_dict(other.shared_experts.state_dict())
        else:
            for name in ("gate_proj", "up_proj", "down_proj"):
                linear = getattr(moe.shared_experts, name)
                linear.load_state_dict(getattr(other.shared_experts, name).state_dict())
        got = moe.experts.mix(x, weights, IDS, moe.shared_experts)
        assert rel_err(got.float(), want) <= 2e-2, load


def test_the_swap_keeps_parameters_and_checkpoint_names():
    moe = moe_of(experts_of())
    before, stacks = moe.state_dict(), moe.experts.gate_up_proj
    pack_for_cpu(moe)
    assert isinstance(moe.experts, PackedExperts) and moe.experts.gate_up_proj is stacks
    after = moe.state_dict()
    assert after.keys() == before.keys()
    # The very same memory (MoE's other weights are uninitialised here, so may hold NaN).
    assert all(after[n].data_ptr() == before[n].data_ptr() for n in before)


@BF16
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


@pytest.mark.parametrize("slow_blas", [False, True])
def test_loading_for_a_cpu_packs_the_language_model_and_the_vision_where_mkl_is_slow(
    tmp_path, monkeypatch, slow_blas
):
    make_checkpoint(tmp_path, "tiny", seed=0)
    monkeypatch.setattr(packed, "MIN_PACKED_LINEAR", 1)  # the tiny model's linears are small
    monkeypatch.setattr(packed, "blas_is_slow_here", lambda: slow_blas)
    model = load_model(tmp_path, role="all")
    layers = model.language_model.model.layers
    experts = [layer.mlp.experts for layer in layers if hasattr(layer.mlp, "experts")]
    assert experts and all(isinstance(e, PackedExperts) and e.down for e in experts)
    assert isinstance(layers[0].self_attn.o_proj, PackedLinear)
    # Decode folds kv_b_proj's weight into its queries and outputs: a copy would go unused.
    assert type(layers[0].self_attn.kv_b_proj) is nn.Linear
    # The vision tower's products have hundreds of rows: packed only where MKL runs those
    # slowly (float32 on a CPU not Intel's), else no copy for it.
    for part in (model.vision_tower, model.multi_modal_projector):
        assert any(isinstance(m, PackedLinear) for m in part.modules()) is slow_blas
    assert not any(type(m) is RowBucketedLinear for m in model.modules())  # float32: no need


def test_loading_in_bfloat16_buckets_the_rows_of_every_plain_linear(tmp_path):
    make_checkpoint(tmp_path, "tiny", seed=0)
    model = load_model(tmp_path, role="all", dtype=torch.bfloat16)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert any(type(m) is RowBucketedLinear for m in model.vision_tower.modules())
    assert all(isinstance(m, RowBucketedLinear) for m in linears)  # packed ones bucket too


def test_experts_stay_unpacked_where_their_copy_would_not_fit(monkeypatch, caplog):
    moe = moe_of(experts_of())
    copy = moe.experts.gate_up_proj.nbytes + moe.experts.down_proj.nbytes
    monkeypatch.setattr(packed, "available_memory", lambda: 2 * copy - 1)
    pack_for_cpu(moe)
    assert type(moe.experts) is Experts and "not packed" in caplog.text
    monkeypatch.setattr(packed, "available_memory", lambda: 2 * copy)
    assert isinstance(pack_for_cpu(moe).experts, PackedExperts)


@BF16
def test_bfloat16_experts_keep_all_of_them_side_by_side_only_where_both_copies_fit(
    monkeypatch, caplog
):
    copy = sum(p.nbytes for p in experts_of().to(torch.bfloat16).parameters())
    for room, all_at_once in ((2 * copy - 1, False), (2 * copy, True)):  # room for 1, then 2
        moe = moe_of(experts_of().to(torch.bfloat16))
        monkeypatch.setattr(packed, "available_memory", lambda room=room: 2 * room)
        experts = pack_for_cpu(moe).experts
        assert isinstance(experts, PackedExperts) and len(experts.down) == 5
        assert experts.all_at_once is all_at_once
        assert (experts.down_all is not None) is all_at_once
    assert "not packed" in caplog.text  # the first time


@BF16
def test_first_copies_come_before_any_second(monkeypatch):
    """Room for the experts' two copies or for their one and the linear's: the linear wins."""
    block = Block().to(torch.bfloat16)
    experts = block.mlp.experts.gate_up_proj.nbytes + block.mlp.experts.down_proj.nbytes
    linear = block.large.weight.nbytes + block.large.bias.nbytes
    monkeypatch.setattr(packed, "available_memory", lambda: 2 * (experts + linear))
    pack_for_cpu(block)
    assert isinstance(block.large, PackedLinear)
    assert isinstance(block.mlp.experts, PackedExperts)
    assert not block.mlp.experts.all_at_once


def linear_of(bias: bool = True, out: int = 512, dtype: torch.dtype = torch.float32) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(MIN_PACKED_LINEAR // out, out, bias=bias).to(dtype)  # just large enough


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.large, self.small = linear_of(), nn.Linear(16, 8)
        self.mlp = moe_of(experts_of())


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype, tolerance", DTYPES)
@torch.inference_mode()
def test_packed_linear_equals_the_plain_one(bias, dtype, tolerance):
    plain = linear_of(bias, dtype=dtype)
    onednn = PackedLinear.of(plain)
    assert onednn.packed is not None
    # Decode's rows, a count rounded up (15 → 16), more than decode's (100), none at all.
    for shape in [(1,), (16,), (3, 5), (100,), (0,)]:
        x = torch.randn(*shape, plain.in_features).to(dtype)
        bias = None if plain.bias is None else plain.bias.float()
        got, want = onednn(x), F.linear(x.float(), plain.weight.float(), bias)
        assert got.shape == (*shape, plain.out_features) and got.dtype == dtype
        assert got.numel() == 0 or rel_err(got.float(), want) <= tolerance
    strided = torch.randn(4, 2 * plain.in_features).to(dtype)[:, ::2]
    assert rel_err(onednn(strided).float(), plain(strided).float()) <= tolerance


def test_the_swap_packs_large_linears_only_and_keeps_names():
    block = Block()
    before = block.state_dict()
    pack_for_cpu(block)
    assert type(block.large) is PackedLinear and type(block.small) is nn.Linear
    assert isinstance(block.mlp.experts, PackedExperts)
    after = block.state_dict()
    assert after.keys() == before.keys()
    assert all(after[n].data_ptr() == before[n].data_ptr() for n in before)


@pytest.mark.parametrize("inference", [torch.inference_mode, torch.no_grad])
def test_inference_runs_the_packed_linear(monkeypatch, inference):
    block, calls = pack_for_cpu(Block()), []
    real = packed.onednn_linear
    monkeypatch.setattr(nn.Linear, "forward", lambda *_: pytest.fail("fell back"))
    monkeypatch.setattr(packed, "onednn_linear", lambda *args: calls.append(1) or real(*args))
    with inference():
        assert block.large(torch.randn(2, block.large.in_features)).shape == (2, 512)
    assert calls == [1]


def test_gradients_still_flow_through_a_packed_linear():
    onednn, plain = PackedLinear.of(linear_of()), linear_of()
    for x in (torch.randn(4, plain.in_features, requires_grad=True), torch.randn(4, 256)):
        for linear in (onednn, plain):
            linear.zero_grad()
            linear(x).square().sum().backward()
        assert torch.allclose(onednn.weight.grad, plain.weight.grad, rtol=1e-5)


@BF16
@torch.inference_mode()
def test_moving_or_loading_a_packed_linear_repacks():
    onednn, other = PackedLinear.of(linear_of()), linear_of()
    with torch.no_grad():
        other.weight.mul_(-2)
    onednn.load_state_dict(other.state_dict())
    x = torch.randn(3, other.in_features)
    assert rel_err(onednn(x), other(x)) <= 1e-6
    onednn.to(torch.bfloat16)
    assert onednn.packed is not None and onednn.packed.dtype == torch.bfloat16
    assert rel_err(onednn(x.bfloat16()).float(), other(x)) <= 2e-2
    assert onednn.half().packed is None  # oneDNN packs no float16 here: the plain product runs
    assert rel_err(onednn(x.half()).float(), other(x)) <= 2e-2


def test_where_memory_is_short_the_experts_are_packed_first(monkeypatch, caplog):
    block = Block()
    linear = block.large.weight.nbytes + block.large.bias.nbytes  # more than the experts take
    monkeypatch.setattr(packed, "available_memory", lambda: 2 * linear)  # room for one of them
    pack_for_cpu(block)
    assert isinstance(block.mlp.experts, PackedExperts) and type(block.large) is nn.Linear
    assert "not packed" in caplog.text


def packed_row_counts(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """The row counts packed products run with from now on, as they happen."""
    seen: set[int] = set()
    real = packed.onednn_linear

    def recording(x, weight, bias):
        seen.add(x.shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(packed, "onednn_linear", recording)
    return seen


@pytest.mark.parametrize(
    "slow_blas, past_64",  # where MKL is slow, float32 prompts run packed too, rows bucketed
    [(False, set()), (True, set(range(96, 321, 32)))],
)
@torch.inference_mode()
def test_a_process_meets_few_row_counts_per_packed_weight(monkeypatch, slow_blas, past_64):
    """oneDNN keeps a kernel (~0.5-1 MiB) per row count it meets: prefill's many prompt lengths
    must not each leave one behind."""
    monkeypatch.setattr(packed, "blas_is_slow_here", lambda: slow_blas)
    seen = packed_row_counts(monkeypatch)
    linear = PackedLinear.of(linear_of())
    for rows in range(1, 300):
        x = torch.randn(rows, linear.in_features)
        assert rel_err(linear(x), F.linear(x, linear.weight, linear.bias)) <= 1e-6
    assert seen == {*range(1, 9), *range(16, 65, 8), *past_64}


@torch.inference_mode()
def test_experts_with_many_or_rounded_rows_equal_a_plain_loop():
    moe = pack_for_cpu(moe_of(experts_of()))
    ids = torch.tensor([[0, 2]] * 13 + [[1, 3]] * 70)  # 13 rows (run as 16); 70 (past decode's)
    x, weights = torch.randn(83, 16), torch.rand(83, 2)
    want = reference_routed(experts_of(), x, weights, ids)
    assert rel_err(moe.routed(x, weights, ids), want) <= 1e-6


@pytest.mark.parametrize(
    "dtype, tolerance, rows",
    [(torch.float32, 1e-6, 70), pytest.param(torch.bfloat16, 2e-2, 300, marks=BF16)],
)
@torch.inference_mode()
def test_experts_that_all_run_plain_need_no_tail(monkeypatch, dtype, tolerance, rows):
    """Where MKL is fast, float32 experts past 64 rows (bfloat16 past 256) run through the plain
    weights: with every expert so, no packed product reaches past the rows."""
    monkeypatch.setattr(packed, "blas_is_slow_here", lambda: False)
    seen = packed_row_counts(monkeypatch)
    moe = pack_for_cpu(moe_of(experts_of().to(dtype)))
    ids = torch.tensor([0] * rows + [3] * (rows + 5))[:, None]
    x, weights = torch.randn(len(ids), 16).to(dtype), torch.rand(len(ids), 1)
    want = reference_routed(experts_of(), x.float(), weights, ids)
    assert rel_err(moe.routed(x, weights, ids).float(), want) <= tolerance
    assert seen == set()


@pytest.mark.parametrize(
    "dtype, slow_blas, tolerance, packed_rows",
    [  # a prompt's expert products: packed up to 256 rows as a multiple of 8 (65 → 72) in
        # bfloat16 and where MKL is slow, else to 64; past 256 where MKL is slow, bucketed
        # (257 → 288)
        (torch.float32, False, 1e-6, {16, 64}),
        (torch.float32, True, 1e-6, {16, 64, 72, 256, 288}),
        pytest.param(torch.bfloat16, False, 2e-2, {16, 64, 72, 256}, marks=BF16),
        pytest.param(torch.bfloat16, True, 2e-2, {16, 64, 72, 256}, marks=BF16),
    ],
)
@torch.inference_mode()
def test_a_prompts_expert_products_run_packed_where_that_gains(
    monkeypatch, dtype, slow_blas, tolerance, packed_rows
):
    monkeypatch.setattr(packed, "blas_is_slow_here", lambda: slow_blas)
    seen = packed_row_counts(monkeypatch)
    moe = pack_for_cpu(moe_of(experts_of().to(dtype)))
    # Rows per expert: 13 (run as 16), 64, 65, 256 and 257; each runs on the next one's rows
    # up to its count, the last on rows after them all.
    rows = {0: 13, 1: 64, 2: 65, 3: 256, 4: 257}
    ids = torch.tensor([e for e, n in rows.items() for _ in range(n)])[:, None]
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(len(ids), 16, generator=generator).to(dtype)
    weights = torch.rand(len(ids), 1, generator=generator)
    got = moe.routed(x, weights, ids)
    want = reference_routed(experts_of(), x.float(), weights, ids)
    assert got.dtype == dtype and rel_err(got.float(), want) <= tolerance
    assert seen == packed_rows


@pytest.mark.parametrize(
    "dtype, run_as",
    [  # over 64 rows, bfloat16 products run as a multiple of 32 (65 → 96); others as they are
        (torch.bfloat16, {*range(1, 65), 96, 128, 160}),
        (torch.float16, set(range(1, 150))),
        (torch.float32, set(range(1, 150))),
    ],
)
@torch.inference_mode()
def test_plain_products_meet_few_row_counts_in_bfloat16(monkeypatch, dtype, run_as):
    """oneDNN runs bfloat16 products and builds a kernel for every row count it meets (~1 ms):
    prompts of every length must not each build their own."""
    seen = set()

    def recording(x, weight, bias=None):
        seen.add(x.shape[0])
        return real(x, weight, bias)

    real = F.linear
    plain = nn.Linear(32, 48).to(dtype)
    linear = RowBucketedLinear.of(plain)
    assert linear.weight is plain.weight
    monkeypatch.setattr(packed.F, "linear", recording)
    for rows in range(1, 150):
        x = torch.randn(rows, 32).to(dtype)
        got, want = linear(x), real(x.float(), plain.weight.float(), plain.bias.float())
        assert got.shape == (rows, 48) and got.dtype == dtype and rel_err(got.float(), want) < 2e-2
    assert seen == run_as


def test_a_row_bucketed_linear_keeps_its_names_and_gradients():
    plain = nn.Linear(32, 48).bfloat16()
    bucketed = RowBucketedLinear.of(plain)
    assert bucketed.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(100, 32, dtype=torch.bfloat16, requires_grad=True)
    bucketed(x).float().square().sum().backward()
    assert x.grad is not None and bucketed.weight.grad is plain.weight.grad is not None


def test_row_buckets_stay_fine_for_prompts_and_coarse_for_large_images():
    assert [packed.bucket(n) for n in (65, 300, 511, 512, 600, 1100, 5000)] == [
        32,
        32,
        32,
        64,
        64,
        128,
        512,
    ]
    for rows in range(65, 20000):
        padded = -(-rows // packed.bucket(rows)) * packed.bucket(rows)
        assert padded - rows < max(32, rows / 8)  # at most an eighth more past 256 rows


@pytest.mark.parametrize(
    "vendor, slow",
    [("GenuineIntel", False), ("AuthenticAMD", True), ("HygonGenuine", True), ("", False)],
)
def test_float32_prompts_run_packed_where_mkl_takes_its_slow_kernels(monkeypatch, vendor, slow):
    """MKL's fast kernels are Intel's only; an unknown CPU keeps MKL, as before."""
    monkeypatch.setattr(packed.cpu, "vendor", lambda: vendor)
    packed.blas_is_slow_here.cache_clear()
    try:
        assert packed.blas_is_slow_here() is (slow and torch.backends.mkl.is_available())
        assert packed.packs_many_rows(torch.float32) is packed.blas_is_slow_here()
        assert not packed.packs_many_rows(torch.bfloat16)  # oneDNN runs those products anyway
    finally:
        packed.blas_is_slow_here.cache_clear()


@torch.inference_mode()
def test_a_copy_that_cannot_be_made_leaves_its_module_plain(tmp_path, monkeypatch, caplog):
    """Packed copies are optional: one oneDNN cannot make (a missing kernel, no memory) is
    skipped with one warning, and the model loads and gives the same results."""
    make_checkpoint(tmp_path, "tiny", seed=0)
    monkeypatch.setattr(packed, "MIN_PACKED_LINEAR", 1)
    plain = load_model(tmp_path, role="language")
    x = torch.randn(5, plain.config.text.hidden_size)

    def broken(self):
        raise RuntimeError("no oneDNN kernel for this")

    monkeypatch.setattr(PackedExperts, "pack", broken)
    model = load_model(tmp_path, role="language")
    layers = model.language_model.model.layers
    assert all(
        type(layer.mlp.experts) is Experts for layer in layers if hasattr(layer.mlp, "experts")
    )
    assert isinstance(layers[0].self_attn.o_proj, PackedLinear)  # the others are still packed
    assert "could not be made" in caplog.text and "no oneDNN kernel" in caplog.text
    for a, b in zip(plain.language_model.model.layers, layers, strict=True):
        torch.testing.assert_close(a.mlp(x), b.mlp(x))


def test_copies_can_be_turned_off(tmp_path, monkeypatch):
    """--no-cpu-weight-copies: roles that load together on one machine keep only the weights."""
    make_checkpoint(tmp_path, "tiny", seed=0)
    monkeypatch.setattr(packed, "MIN_PACKED_LINEAR", 1)
    model = load_model(tmp_path, role="all", copies=False)
    assert not any(isinstance(m, Repacked) for m in model.modules())
