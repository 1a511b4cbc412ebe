"""PEFA-XL's search sequence, written once (fuse.searches) for the model and the pipeline: the
widths it asks of the two indices, and its neighbours against a float64 reference over
[Q; P], ties included."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import pefa_gpu as pg
from pefa_gpu import fuse
from reference import topk as ref_topk

pytestmark = pytest.mark.filterwarnings("ignore:.*L2-normalised")


@pytest.mark.parametrize("kp,k,m,n,augment,want", [
    (500, 16, 40, 900, True, (500, 16)),    # the passage search serves the neighbours
    (5, 16, 40, 900, True, (16, 16)),       # fewer candidates than neighbours
    (5, 16, 10, 900, True, (16, 10)),       # fewer training queries than k
    (30, 16, 40, 8, True, (30, 16)),        # fewer documents than k
    (5, 16, 40, 900, False, (5, 16)),
    (0, 16, 40, 900, False, (0, 16)),       # neighbours only (PEFAXL.neighbours)
    (500, 16, 0, 900, True, (500, 0)),      # no training queries
])
def test_widths_asked_of_the_indices(kp, k, m, n, augment, want):
    asked = []

    def search(q, w_erm, w_knn):
        asked.append((w_erm, w_knn))
        b = q.shape[0]
        erm = (torch.zeros(b, w_erm), torch.arange(w_erm).repeat(b, 1) % max(n, 1))
        return erm, (torch.zeros(b, w_knn), torch.arange(w_knn).repeat(b, 1))
    erm, knn = fuse.searches(torch.zeros(3, 4), search, kp=kp, k=k, m=m, n=n,
                             augment_docs=augment)
    assert asked == [want]
    assert knn[1].shape == (3, min(k, m + n if augment else m))


@pytest.mark.parametrize("augment", [True, False])
@pytest.mark.parametrize("candidates", [3, 40])
def test_neighbours_equal_a_float64_top_k_over_queries_and_documents(augment, candidates):
    rng = np.random.default_rng(7)
    n, m, d, b, k = 60, 30, 6, 25, 9
    # a 1/4 grid: exact float32 products, many ties; duplicated rows across Q and P
    P, Q, T = (rng.integers(-2, 3, (r, d)).astype(np.float32) / 4 for r in (n, m, b))
    Q[:5] = P[:5]
    Y = sp.random(m, n, density=0.05, random_state=7, format="csr", dtype=np.float32)
    xl = pg.PEFAXL(device="cpu", k=k, augment_docs=augment,
                   search_params=pg.XLSearchParams(candidates=candidates)).fit(P, Q, Y)
    erm, knn = xl._searches(torch.from_numpy(T), candidates, k, None)
    rows = np.vstack([Q, P]) if augment else Q
    want_s, want_i = ref_topk(T.astype(np.float64) @ rows.T.astype(np.float64), k)
    np.testing.assert_array_equal(knn[1].numpy(), want_i)
    np.testing.assert_array_equal(knn[0].numpy(), want_s.astype(np.float32))
    assert erm[1].shape[1] >= candidates
    got = xl.neighbours(torch.from_numpy(T), k)
    assert torch.equal(got[1], knn[1]) and torch.equal(got[0], knn[0])


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("rescore", [True, False])
def test_fuse_without_queries_gives_empty_tables_of_the_input_kind(kind, rescore):
    rng = np.random.default_rng(3)
    docs = rng.standard_normal((30, 8)).astype(np.float32)
    Y = sp.random(12, 30, density=0.2, random_state=3, format="csr", dtype=np.float32)
    rows = fuse.RelevanceRows(pg.Relevance(Y), "cpu")
    arrays = [np.zeros((0, 8), np.float32), np.zeros((0, 10), np.float32),
              np.zeros((0, 10), np.int64), np.zeros((0, 5), np.float32),
              np.zeros((0, 5), np.int64), docs]
    if kind == "torch":
        arrays = [torch.from_numpy(a) for a in arrays]
    q, es, ei, ks, ki, p = arrays
    out = fuse.fuse(q, (es, ei), (ks, ki), rows, p, lams=(0.2, 0.9), ks=(2, 5), knn_norm="k",
                    rescore=rescore, erm_exact=False, topk=7)
    assert sorted(out) == [(0.2, 2), (0.2, 5), (0.9, 2), (0.9, 5)]
    for s, i in out.values():
        assert s.shape == i.shape == (0, 7)
        assert isinstance(s, np.ndarray if kind == "numpy" else torch.Tensor)
        assert str(s.dtype).endswith("float32") and str(i.dtype).endswith("int64")


@pytest.mark.parametrize("bad,match", [({"lam": 1.5}, "lam must be a number in"),
                                       ({"lam": True}, "lam must be"),
                                       ({"k": 0}, "k must be a positive integer"),
                                       ({"k": 2.0}, "k must be a positive integer"),
                                       ({"batch_size": 0}, "batch_size must be a positive"),
                                       ({"batch_size": -3}, "batch_size must be a positive")])
def test_fuse_names_a_bad_lam_or_k(bad, match):
    rng = np.random.default_rng(5)
    P, Q, T = (rng.standard_normal((r, 6)).astype(np.float32) for r in (40, 20, 3))
    Y = sp.random(20, 40, density=0.1, random_state=5, format="csr", dtype=np.float32)
    xl = pg.PEFAXL(device="cpu", k=4).fit(P, Q, Y)
    q = torch.from_numpy(T)
    erm = xl.index.search(q, 10)
    with pytest.raises(pg.InputError, match=match):
        xl.fuse(q, erm, xl.neighbours(q, 4, erm), 5, **bad)


@pytest.mark.parametrize("kind", ["numpy", "torch", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_long_row_of_y_narrows_the_fusion_batches_and_keeps_the_results(kind, monkeypatch):
    """Training query 0 is relevant to every document and the first neighbour of every test
    query: one batch would hold 40 x 600 votes; with 1 vote a query allowed, each batch's table
    stays within 4096 cells beyond C, and the results equal the float64 reference. numpy: the
    CPU fusion; torch: the same core on CPU tensors (what CUDA runs)."""
    import reference as ref

    rng = np.random.default_rng(8)
    n, m, d = 600, 40, 8
    P, Q = rng.standard_normal((n, d)), rng.standard_normal((m, d))
    Q[0] = 5.0 * np.ones(d)  # near every test query
    T = np.ones((40, d)) + 0.3 * rng.standard_normal((40, d))
    P, Q, T = (np.float32(x / np.linalg.norm(x, axis=1, keepdims=True)) for x in (P, Q, T))
    rows, cols = np.r_[np.zeros(n), np.arange(1, m)], np.r_[np.arange(n), rng.integers(0, n, m - 1)]
    Y = sp.csr_matrix((np.ones(n + m - 1, np.float32), (rows, cols)), shape=(m, n))
    dev = "cuda" if kind == "cuda" else "cpu"
    model = pg.PEFAXL(device=dev, k=6, lam=0.4, search_params=pg.XLSearchParams(candidates=20))
    model.fit(P, Q, Y)
    monkeypatch.setattr(fuse, "VOTES_PER_QUERY", 1)
    real, widths = fuse.candidate_table, []

    def spy(queries, *args, **kwargs):
        table = real(queries, *args, **kwargs)
        widths.append((table.ids.shape, type(table.ids)))
        return table
    monkeypatch.setattr(fuse, "candidate_table", spy)
    t = torch.from_numpy(T).to(dev)
    erm, knn = model.index.search(t, 20), model.neighbours(t, 6)
    if kind == "numpy":
        s, i = model.fuse(T, tuple(x.numpy() for x in erm), knn, 10)
    else:  # the core itself: the model hands CPU tensors to numpy
        s, i = fuse.fuse(t, erm, knn, model.relevance_rows, model.doc_embeddings, lams=(0.4,),
                         ks=(6,), knn_norm="k", rescore=True, erm_exact=True, topk=10)[(0.4, 6)]
    assert {kind_ for _, kind_ in widths} == {np.ndarray if kind == "numpy" else torch.Tensor}
    assert len(widths) > 1 and sum(shape[0] for shape, _ in widths) == len(T)
    assert all(b * (w - 20) <= 4096 for (b, w), _ in widths)
    want_s, want_i = ref.xl_search(P, Q, Y, T, lam=0.4, k=6, candidates=20, topk_out=10)
    np.testing.assert_array_equal(np.asarray(i.cpu()), want_i)
    np.testing.assert_allclose(np.asarray(s.cpu()), want_s, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_only_the_batch_holding_a_long_row_narrows(kind, monkeypatch):
    """Neighbour rows: query 100 votes through a row of 1,000 documents, the others through
    rows of one (-1: padding, no votes). With room for 4,096 cells, the batches cut around
    query 100 alone: 100 queries, then query 100 with 3 more (4 x 1,000 <= 4,096), the rest."""
    y = sp.csr_matrix((np.ones(1300, np.float32),
                       (np.r_[np.zeros(1000, int), np.arange(1, 301)],
                        np.r_[np.arange(1000), np.arange(300)])), shape=(301, 2000))
    rows = fuse.RelevanceRows(pg.Relevance(y), "cpu")
    knn = np.ones((201, 2), np.int64)
    knn[:, 1], knn[100, 0] = -1, 0
    knn = knn if kind == "numpy" else torch.from_numpy(knn)
    monkeypatch.setattr(fuse, "VOTES_PER_QUERY", 1)
    assert fuse.batches(knn, rows, 4096) == [slice(0, 100), slice(100, 104), slice(104, 201)]
    assert fuse.batches(knn[:0], rows, 4096) == [slice(0, 4096)]  # one empty batch
    monkeypatch.setattr(fuse, "VOTES_PER_QUERY", 256)
    assert fuse.batches(knn, rows, 4096) == [slice(0, 4096)]  # no long row: one batch
    assert fuse.batches(knn, rows, 64)[:2] == [slice(0, 64), slice(64, 100)]  # cut before 100


def test_neighbours_drop_nan_and_minus_inf_scores_alike_in_numpy_and_torch():
    """A neighbour scored NaN or -inf (unchecked data) is no neighbour on either path (numpy:
    CPU batches; torch: CUDA and training), so both vote alike."""
    knn = (np.array([[np.nan, 1.0], [0.5, -np.inf]], np.float32), np.array([[0, 1], [2, 3]]))
    erm = (np.array([[-np.inf, 0.2], [0.9, 0.1]], np.float32), np.array([[7, 4], [5, 6]]))
    got_np = fuse.neighbours(knn, erm, 10, 3, augment_docs=True)
    got_t = fuse.neighbours(tuple(map(torch.from_numpy, knn)), tuple(map(torch.from_numpy, erm)),
                            10, 3, augment_docs=True)
    np.testing.assert_array_equal(got_t[1].numpy(), got_np[1])
    np.testing.assert_array_equal(got_np[1], [[-1, 1, 14], [15, 2, 16]])  # NaN: first, as -1


def test_neighbours_give_the_same_bits_in_numpy_and_torch_at_signed_zeros():
    """Neighbours scored -0.0 and +0.0 tie (the lower row first) and come back as +0.0 on both
    paths, so numpy (CPU batches) and torch (CUDA, training) give the same bits."""
    knn = (np.array([[-0.0, -0.5, 0.25], [0.0, -0.0, -0.0]], np.float32),
           np.array([[3, 1, 2], [4, 0, 5]]))
    erm = (np.array([[0.0, -0.0], [-0.0, -1.0]], np.float32), np.array([[7, 4], [5, 6]]))
    got_np = fuse.neighbours(knn, erm, 10, 4, augment_docs=True)
    got_t = fuse.neighbours(tuple(map(torch.from_numpy, knn)), tuple(map(torch.from_numpy, erm)),
                            10, 4, augment_docs=True)
    np.testing.assert_array_equal(got_np[1], [[2, 3, 14, 17], [0, 4, 5, 15]])
    np.testing.assert_array_equal(got_t[1].numpy(), got_np[1])
    np.testing.assert_array_equal(got_np[0], [[0.25, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(got_t[0].numpy().view(np.int32), got_np[0].view(np.int32))
    assert not np.signbit(got_np[0]).any()
