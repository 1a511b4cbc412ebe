"""Exact search and the top-k tie rule against the float64 reference."""

import warnings

import numpy as np
import pytest
import torch

from pefa_gpu.index import ExactIndex, make_index
from pefa_gpu.topk import merge_topk, topk_rows
from conftest import DEVICES, unit_rows
import reference as ref


def integer_vectors(rng, rows, dim, low=-2, high=3):
    """Small integer vectors: inner products are exact in float32, so ties are real ties."""
    return rng.integers(low, high, (rows, dim)).astype(np.float32)


@pytest.mark.parametrize("k", [1, 3, 7, 50])
def test_topk_rows_ties_go_to_lower_column(k):
    rng = np.random.default_rng(k)
    s = rng.integers(0, 4, (20, 30)).astype(np.float32)  # heavy ties
    vals, ids = topk_rows(torch.from_numpy(s), k)
    rv, ri = ref.topk(s.astype(np.float64), k)
    np.testing.assert_array_equal(ids.numpy(), ri)
    np.testing.assert_array_equal(vals.numpy(), rv.astype(np.float32))


def test_merge_topk_orders_by_score_then_id_and_pads():
    vals = torch.tensor([[1.0, 2.0, 2.0, float("-inf")]])
    ids = torch.tensor([[5, 9, 3, -1]])
    v, i = merge_topk(vals, ids, 5)
    assert i.tolist() == [[3, 9, 5, -1, -1]]
    assert v[0, :3].tolist() == [2.0, 2.0, 1.0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("budget", [2**16, 2**26])
def test_exact_matches_reference_with_ties(device, budget):
    rng = np.random.default_rng(3)
    X = integer_vectors(rng, 3000, 6)
    T = integer_vectors(rng, 40, 6)
    index = ExactIndex({"memory_budget": budget}, device=device).build(X)
    for k in (1, 10, 1500):
        scores, ids = index.search(T, k)
        rv, ri = ref.exact_search(X, T, k)
        assert scores.dtype == torch.float32 and ids.dtype == torch.int64
        assert scores.device.type == device
        np.testing.assert_array_equal(ids.cpu().numpy(), ri)
        np.testing.assert_array_equal(scores.cpu().numpy(), rv.astype(np.float32))


@pytest.mark.parametrize("dtype,tol", [("float16", 2e-3), ("bfloat16", 1e-2)])
def test_exact_low_precision_storage(dtype, tol):
    rng = np.random.default_rng(5)
    X, T = unit_rows(rng, 500, 32), unit_rows(rng, 20, 32)
    scores, ids = ExactIndex({"dtype": dtype}, device="cpu").build(X).search(T, 10)
    assert scores.dtype == torch.float32
    rounded = torch.from_numpy(X).to(getattr(torch, dtype)).double().numpy()
    rv, _ = ref.exact_search(rounded, T, 10)
    # scores are fp32 accumulations of the rounded vectors
    np.testing.assert_allclose(scores.numpy(), rv, atol=1e-5)
    full, _ = ref.exact_search(X, T, 10)
    np.testing.assert_allclose(scores.numpy(), full, atol=tol)


def test_exact_pads_when_k_exceeds_n_and_add_appends():
    X = np.eye(3, dtype=np.float32)
    index = make_index("exact", device="cpu").build(X)
    scores, ids = index.search(X[:1], 5)
    assert ids.tolist() == [[0, 1, 2, -1, -1]]
    assert torch.isinf(scores[0, 3:]).all()
    index.add(np.array([[2.0, 0, 0]], dtype=np.float32))
    assert index.search(X[:1], 1)[1].tolist() == [[3]]
    assert index.ntotal == 4


def test_exact_bad_input():
    index = make_index("exact", device="cpu").build(np.eye(3, dtype=np.float32))
    with pytest.raises(ValueError, match=r"\(B, 3\)"):
        index.search(np.ones((2, 4), dtype=np.float32), 2)
    with pytest.raises(ValueError, match="positive integer"):
        index.search(np.ones((2, 3), dtype=np.float32), 0)
    with pytest.raises(ValueError, match="dtype"):
        make_index("exact", params={"dtype": "int8"})
    with pytest.raises(ValueError, match="unknown keys"):
        make_index("exact", params={"bogus": 1})
    with pytest.raises(ValueError, match="backend"):
        make_index("nope")
