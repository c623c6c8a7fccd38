import numpy as np
import pytest
import torch

from epd.multimodal.grids import grid_rows, kimi_vl_grids


@pytest.mark.parametrize(
    "grids",
    [np.array([[40, 60], [20, 40]]), torch.tensor([[40, 60], [20, 40]]), [(40, 60), [20, 40]]],
)
def test_any_input_comes_back_as_plain_ints(grids):
    rows = grid_rows(grids)
    assert rows == ((40, 60), (20, 40))
    assert all(type(v) is int for row in rows for v in row)


def test_numpy_scalars_become_ints():
    rows = grid_rows([np.int64(40), np.int32(60)])
    assert rows == ((40, 60),) and type(rows[0][0]) is int


def test_kimi_vl_normalises_single_frame_3d_rows():
    assert kimi_vl_grids(np.array([[1, 40, 60]])) == ((40, 60),)
    with pytest.raises(ValueError, match="t=2"):
        kimi_vl_grids([[2, 40, 60]])


@pytest.mark.parametrize(
    "bad",
    [[40], [0, 60], [41, 60], [1, 2, 4, 6], [40, -2], [40.0, 60.0], [True, 2], [40, 512], "40x60"],
)
def test_bad_rows_are_refused_naming_the_forms(bad):
    with pytest.raises(ValueError, match=r"\(h, w\) or \(t, h, w\)"):
        grid_rows(bad)
