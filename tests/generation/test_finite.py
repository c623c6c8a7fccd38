import math

import pytest
import torch

from epd.generation.finite import all_finite, finite_rows

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [1, 7, 64, 1000, 4099])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_one_bad_value_anywhere_is_found(dtype, size, bad):
    # Sizes past and between vector widths, the bad value first, inside and last: a reduction
    # that dropped a lane or the tail would miss one of them.
    for where in sorted({0, size // 2, size - 1}):
        values = torch.randn(size).to(dtype)
        values[where] = bad
        assert not all_finite(values), (size, where)
        assert not all_finite(values.view(1, -1, 1)), (size, where)


@pytest.mark.parametrize("dtype", DTYPES)
def test_finite_values_pass_even_at_the_limits(dtype):
    info = torch.finfo(dtype)
    values = torch.tensor([info.max, -info.max, info.tiny, -info.tiny, 0.0, -0.0], dtype=dtype)
    assert all_finite(values)
    assert all_finite(torch.randn(3, 5, 7).to(dtype))
    assert all_finite(torch.empty(0, 4, dtype=dtype))


def test_a_strided_view_is_checked_where_it_looks():
    base = torch.zeros(4, 6)
    base[:, 1] = math.nan  # outside the view below
    assert all_finite(base[:, ::2])
    assert not all_finite(base[:, 1::2])
    assert not all_finite(base.t())


def test_it_agrees_with_isfinite_on_random_tensors():
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        values = torch.randn(int(torch.randint(1, 300, (1,), generator=generator)))
        for _ in range(int(torch.randint(0, 3, (1,), generator=generator))):
            spot = int(torch.randint(0, values.numel(), (1,), generator=generator))
            values[spot] = [math.nan, math.inf, -math.inf][spot % 3]
        assert all_finite(values) == bool(torch.isfinite(values).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 7, 497, 4099])
def test_finite_rows_finds_each_bad_row_and_only_those(dtype, vocab):
    # A bad value at the start, inside or end of some rows (past and between vector widths);
    # the greatest and least finite values pass.
    logits = torch.randn(6, vocab).to(dtype)
    logits[0, 0] = torch.finfo(dtype).max
    logits[0, -1] = -torch.finfo(dtype).max
    logits[1, vocab // 2] = math.nan
    logits[3, -1] = math.inf
    logits[4, 0] = -math.inf
    logits[5, :] = math.nan
    assert finite_rows(logits) == [True, False, True, False, False, False]
    assert finite_rows(logits) == torch.isfinite(logits).all(-1).tolist()
