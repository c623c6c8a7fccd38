import numpy as np
import pytest
import torch

from epd.multimodal.grids import (
    grid_rows,
    grid_tensor,
    kimi_vl_grids,
    patch_count,
    split_embeddings,
    token_count,
)


def test_kimi_vl_counts():
    assert patch_count([40, 60]) == 2400
    assert token_count([40, 60]) == 600


def test_split_by_grids():
    pieces = split_embeddings(torch.randn(800, 8), [[40, 60], [20, 40]])
    assert [p.shape[0] for p in pieces] == [600, 200]


def test_split_refuses_wrong_total():
    with pytest.raises(ValueError, match="799 rows"):
        split_embeddings(torch.randn(799, 8), [[40, 60], [20, 40]])


def test_k25_grids():
    assert patch_count([1, 40, 60], "kimi_k25") == 2400
    assert token_count([1, 40, 60], "kimi_k25") == 600
    assert patch_count([2, 12, 16], "kimi_k25") == 384
    assert token_count([2, 12, 16], "kimi_k25") == 48


def test_qwen_grids_count_time():
    assert token_count([2, 12, 16], "qwen") == 96


@pytest.mark.parametrize(
    "grids",
    [np.array([[40, 60], [20, 40]]), torch.tensor([[40, 60], [20, 40]]), [(40, 60), [20, 40]]],
)
def test_any_input_comes_back_as_plain_ints(grids):
    rows = grid_rows(grids)
    assert rows == ((40, 60), (20, 40))
    assert all(type(v) is int for row in rows for v in row)
    assert grid_tensor(grids).dtype == torch.int64


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
