"""The one top-k (pefa_gpu.topk) against a float64 / Python reference: ties at and around the
k-th place, signed zeros, NaN, padding, merges of lists from several sources."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pefa_gpu.errors import InputError
from pefa_gpu.topk import boundary_tied, merge_lists, merge_topk, order_ties, topk_rows
from conftest import DEVICES


def ref_topk(scores: np.ndarray, k: int, ids: np.ndarray | None = None):
    """Best k per row by (score descending, id ascending, id -1 last), NaN above every number;
    (-inf, -1) padding. Written with Python sorting, apart from the library."""
    b, n = scores.shape
    ids = np.tile(np.arange(n), (b, 1)) if ids is None else ids
    vals = np.full((b, k), -np.inf)
    out = np.full((b, k), -1, dtype=np.int64)
    for r in range(b):
        if not np.isnan(scores[r]).any():  # numpy's sort: the same order, faster
            id_key = np.where(ids[r] < 0, np.iinfo(np.int64).max, ids[r])
            order = np.lexsort((id_key, -scores[r]))[:k]
            vals[r, :len(order)] = scores[r, order]
            out[r, :len(order)] = ids[r, order]
            continue

        def key(j):
            v = scores[r, j]
            return (0 if np.isnan(v) else 1, 0.0 if np.isnan(v) else -v,
                    ids[r, j] < 0, ids[r, j])
        order = sorted(range(n), key=key)[:k]
        vals[r, :len(order)] = scores[r, order]
        out[r, :len(order)] = ids[r, order]
    return vals, out


def assert_same(got, want):
    v, i = got
    np.testing.assert_array_equal(i.cpu().numpy(), want[1])
    np.testing.assert_array_equal(v.cpu().numpy(), want[0].astype(np.float32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("levels", [2, 4, 50])
def test_topk_rows_every_k_around_the_ties(device, levels):
    """Few distinct values: the k-th place falls inside, at the start and at the end of runs."""
    rng = np.random.default_rng(levels)
    s = rng.integers(0, levels, (37, 23)).astype(np.float32)
    s[5] = 1.0  # one row all tied
    for k in range(1, 27):
        assert_same(topk_rows(torch.from_numpy(s).to(device), k), ref_topk(s, k))


def test_topk_rows_offset_and_wide_rows_with_rare_ties():
    rng = np.random.default_rng(0)
    s = rng.standard_normal((64, 3000)).astype(np.float32)
    s[:, 1500:1503] = s[:, [7]]  # the row's value at column 7 appears four times
    s[::3, 2999] = s[::3].max(1)  # a tie at the top of every third row
    for k in (1, 5, 100, 2999, 3000, 3002):
        want = ref_topk(s, k)
        v, i = topk_rows(torch.from_numpy(s), k, offset=1000)
        np.testing.assert_array_equal(i.numpy(), np.where(want[1] >= 0, want[1] + 1000, -1))
        np.testing.assert_array_equal(v.numpy(), want[0].astype(np.float32))


def test_signed_zeros_tie_and_keep_id_order():
    s = np.array([[0.0, -0.0, 1.0, -0.0, 0.0, -1.0],
                  [-0.0, -0.0, 0.0, 0.0, -0.0, 0.0]], dtype=np.float32)
    for k in range(1, 7):
        v, i = topk_rows(torch.from_numpy(s), k)
        want = ref_topk(s, k)
        np.testing.assert_array_equal(i.numpy(), want[1])
    v, i = topk_rows(torch.from_numpy(s), 3)
    assert i.tolist() == [[2, 0, 1], [0, 1, 2]]


def test_nan_ranks_first_and_ties_by_id():
    nan = float("nan")
    s = np.array([[1.0, nan, 2.0, nan, 2.0, nan],
                  [3.0, 1.0, 3.0, 0.0, 3.0, 3.0]], dtype=np.float32)
    for k in range(1, 7):
        v, i = topk_rows(torch.from_numpy(s), k)
        np.testing.assert_array_equal(i.numpy(), ref_topk(s, k)[1])
    v, i = topk_rows(torch.from_numpy(s), 2)
    assert i.tolist() == [[1, 3], [0, 2]]


def test_rows_shorter_than_k_and_empty_inputs():
    s = np.array([[1.0, 1.0], [0.0, 5.0]], dtype=np.float32)
    v, i = topk_rows(torch.from_numpy(s), 4)
    assert i.tolist() == [[0, 1, -1, -1], [1, 0, -1, -1]]
    assert torch.isinf(v[:, 2:]).all() and (v[:, 2:] < 0).all()
    v, i = topk_rows(torch.empty(0, 5), 3)
    assert v.shape == (0, 3) and i.shape == (0, 3) and i.dtype == torch.int64
    v, i = topk_rows(torch.empty(2, 0), 3)
    assert i.tolist() == [[-1, -1, -1]] * 2
    v, i = merge_topk(torch.empty(2, 0), torch.empty(2, 0, dtype=torch.long), 2)
    assert i.tolist() == [[-1, -1]] * 2


def test_a_negative_or_non_int_k_is_a_clear_error():
    """k = -1 was torch's IndexError (on an empty slice), k = True torch's RuntimeError and
    k = 2.0 a TypeError; k = 0 gives (B, 0) lists as before."""
    s = torch.rand(3, 5)
    for k in (-1, -7, True, 2.0):
        with pytest.raises(InputError, match=f"k must be an int >= 0, got {k}"):
            topk_rows(s, k)
        with pytest.raises(InputError, match=f"k must be an int >= 0, got {k}"):
            merge_topk(s, torch.arange(5).expand(3, 5), k)
    assert topk_rows(s, 0)[1].shape == (3, 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(4))
def test_merge_topk_of_shuffled_sources_with_duplicates_and_padding(device, seed):
    """Lists from several sources side by side, sources in any order, ids with repeats,
    padding (-inf, -1) next to real -inf scores."""
    rng = np.random.default_rng(seed)
    b, c = 29, 40
    vals = rng.integers(-2, 3, (b, c)).astype(np.float32)
    ids = rng.integers(0, 25, (b, c))
    pad = rng.random((b, c)) < 0.2
    vals[pad], ids[pad] = -np.inf, -1
    vals[rng.random((b, c)) < 0.05] = -np.inf  # real ids with -inf scores sort before padding
    for k in (1, 3, 10, 39, 40, 45):
        v, i = merge_topk(torch.from_numpy(vals).to(device), torch.from_numpy(ids).to(device), k)
        assert_same((v, i), ref_topk(vals, k, ids))


def test_merge_of_split_top_lists_equals_one_top_k():
    """The per-chunk lists merged = the top-k of the whole row (what exact search and shards
    rely on), ties at the k-th place across chunk borders included."""
    rng = np.random.default_rng(7)
    s = rng.integers(0, 5, (50, 300)).astype(np.float32)
    for k in (1, 8, 64, 299):
        cuts = [0, 17, 150, 151, 300]
        parts = [topk_rows(torch.from_numpy(s[:, a:z]), k, offset=a)
                 for a, z in zip(cuts[:-1], cuts[1:])]
        parts = parts[::-1]  # sources in any order
        v, i = merge_topk(torch.cat([p[0] for p in parts], 1),
                          torch.cat([p[1] for p in parts], 1), k)
        assert_same((v, i), ref_topk(s, k))


def test_merge_lists_skips_none_casts_scores_and_keeps_a_lone_list_as_is():
    """merge_lists: float64 lists (None skipped) merged as merge_topk's float32; ``as_is``: one
    list at least k wide is cut to k with its ties in its own order (an HNSW's), else merged."""
    rng = np.random.default_rng(3)
    s = rng.integers(0, 4, (20, 90)).astype(np.float64)
    parts = [topk_rows(torch.from_numpy(s[:, a:a + 30]), 12, offset=a) for a in (0, 30, 60)]
    for as_is in (False, True):
        v, i = merge_lists([None, *parts, None], 12, as_is=as_is)
        assert v.dtype == torch.float32 and i.dtype == torch.int64
        assert_same((v, i), ref_topk(s, 12))
    lone = (torch.tensor([[2.0, 1.0, 1.0, 0.5]], dtype=torch.float64), torch.tensor([[4, 9, 2, 1]]))
    v, i = merge_lists([None, lone], 3, as_is=True)
    assert i.tolist() == [[4, 9, 2]] and v.dtype == torch.float32
    assert merge_lists([lone], 3)[1].tolist() == [[4, 2, 9]]  # merged: ties to the lower id
    v, i = merge_lists([lone], 6, as_is=True)  # narrower than k: merged and padded
    assert i.tolist() == [[4, 2, 9, 1, -1, -1]] and v[0, 4:].isneginf().all()


@pytest.mark.parametrize("device", DEVICES)
def test_order_ties_and_boundary_tied(device):
    vals = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0], [5.0, 4.0, 3.0, 2.0, 2.0],
                         [0.0, -0.0, 0.0, -1.0, float("-inf")]], device=device)
    ids = torch.tensor([[4, 9, 1, 5, 0], [1, 2, 3, 8, 7], [6, 2, 4, 0, -1]], device=device)
    v, i = order_ties(vals, ids)
    assert i.tolist() == [[4, 1, 5, 9, 0], [1, 2, 3, 7, 8], [2, 4, 6, 0, -1]]
    assert torch.equal(v.cpu(), vals.cpu())
    assert boundary_tied(vals, 2).tolist() == [True, False, True]
    assert boundary_tied(vals, 4).tolist() == [False, True, False]


# -- topk_wide: wide rows through their best groups of columns ---------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("w,c,levels,nan", [(1, 3072, 3, False), (9, 30_011, 4, False),
                                             (9, 30_011, 1000, True), (40, 200_000, 7, False)])
def test_topk_wide_keeps_the_top_w_scores(device, w, c, levels, nan):
    """Few distinct scores (ties everywhere, also at the w-th place), NaN, a last partial
    group: the w scores are torch.topk's, at distinct ids holding them; the group path ran."""
    from pefa_gpu import topk as topk_module

    assert topk_module.group_size(c, w, device == "cuda")  # groups are used
    rng = np.random.default_rng(c + w + levels)
    scores = rng.integers(0, levels, (6, c)).astype(np.float32)
    scores[1] = 0.0  # one row all tied
    scores[2, rng.integers(0, c, 5)] = np.inf
    scores[4, -1] = levels  # the best score of its row, in the last (partial) group
    if nan:
        scores[3, rng.integers(0, c, 3)] = np.nan
    s = torch.from_numpy(scores).to(device)
    v, i = topk_module.topk_wide(s, w)
    assert v.shape == i.shape == (6, w) and i.dtype == torch.int64
    want = torch.sort(torch.topk(s, w, dim=1).values, 1, descending=True).values
    got = torch.sort(v, 1, descending=True).values
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(s.gather(1, i).nan_to_num(), v.nan_to_num())
    assert all(len(set(row)) == w for row in i.cpu().tolist())


@pytest.mark.parametrize("k", [1, 4])
def test_exact_search_with_topk_wide_keeps_the_tie_rule(monkeypatch, k):
    """A torch-engine exact search whose blocks select through groups, duplicate rows tied at
    the k-th place in different groups: the float64 top-k, ties to the lower id."""
    import pefa_gpu.index.exact as exact_module
    from pefa_gpu.index import ExactIndex
    from pefa_gpu.topk import group_size

    monkeypatch.setattr(exact_module, "optional_faiss", lambda: None)
    rng = np.random.default_rng(k)
    x = rng.integers(-2, 3, (40_000, 4)).astype(np.float32)  # integer scores: many exact ties
    q = rng.integers(-2, 3, (7, 4)).astype(np.float32)
    index = ExactIndex().build(x)
    assert group_size(index._block_shape(7, k)[1], k + 8, False)  # blocks select by groups
    s, i = index.search(torch.from_numpy(q), k)
    want_s, want_i = ref_topk(q.astype(np.float64) @ x.astype(np.float64).T, k)
    np.testing.assert_array_equal(i.numpy(), want_i)
    np.testing.assert_array_equal(s.numpy(), want_s)
