"""PEFA-XL exact candidate pruning (PEFAXL._search): the same results, to the bit, as the
unpruned search, for batches and single queries."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import pefa_gpu as pg


def _xl(candidates, backend="exact", **params):
    return pg.PEFAXL(backend=backend, device="cpu", **params,
                     search_params=pg.XLSearchParams(candidates=candidates))


def _data(seed, quantized, n=240, m=160, d=12, b=60, negative_y=False):
    rng = np.random.default_rng(seed)
    if quantized:  # 1/4 grid: float32 dot products are exact, so many exact ties
        P, Q, T = (rng.integers(-2, 3, (r, d)).astype(np.float32) / 4 for r in (n, m, b))
        P[7] = P[3]  # duplicate documents
        T[:5] = np.abs(T[:5])  # some queries with mostly non-negative similarities
        P[:60] = np.abs(P[:60])
        Q[:60] = np.abs(Q[:60])
    else:
        P, Q, T = (rng.standard_normal((r, d)).astype(np.float32) for r in (n, m, b))
        P, Q, T = (x / np.linalg.norm(x, axis=1, keepdims=True) for x in (P, Q, T))
        P[:, 0] += 2.0  # a shared direction: most similarities positive, some not
        Q[:, 0] += 2.0
        T[: b // 2, 0] += 2.0
    Y = sp.random(m, n, density=0.02, random_state=seed, format="csr", dtype=np.float32)
    Y.data[:] = rng.choice([1.0, 2.0, 0.5], Y.nnz)
    if negative_y:
        Y.data[::7] *= -1.0
    return P, Q, T, Y


def _assert_same(ps, pi, fs, fi, exact=True):
    """Same ids; same scores to the bit when every dot product is exact (quantized data),
    else to within the last bit of a float32 dot product: a voted document outside C' gets
    f_erm from the fusion's own dot product instead of the index's matrix product."""
    assert torch.equal(pi, fi)
    if exact:
        assert torch.equal(ps, fs)
    else:
        np.testing.assert_allclose(ps.numpy(), fs.numpy(), rtol=1e-6, atol=1e-7)


class _Spy:
    """Wraps an index and records the k of every search."""

    def __init__(self, index):
        self.index, self.ks = index, []

    def __getattr__(self, name):
        found = getattr(self.index, name)
        if name != "search_host":
            return found

        def search_host(q, k, **kwargs):  # faiss backends' numpy search on the CPU
            self.ks.append(k)
            return found(q, k, **kwargs)
        return search_host

    def search(self, q, k, params=None):
        self.ks.append(k)
        return self.index.search(q, k, params)


def _both(model, T, topk, one_at_a_time=False):
    spy = _Spy(model.index)
    model.index = spy
    try:
        def run():
            if one_at_a_time:
                out = [model.search(T[i:i + 1], topk) for i in range(len(T))]
                return torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])
            return model.search(T, topk)

        model.prune_candidates = True
        pruned = run()
        ks = list(spy.ks)
        model.prune_candidates = False
        full = run()
    finally:
        model.index = spy.index
        model.prune_candidates = True
    return pruned, full, ks


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("quantized", [True, False])
@pytest.mark.parametrize("lam,knn_norm", [(0.1, "k"), (0.5, "none"), (1.0, "k"), (0.0, "k")])
@pytest.mark.filterwarnings("ignore:.*L2-normalised")
def test_pruned_equals_unpruned(seed, quantized, lam, knn_norm):
    P, Q, T, Y = _data(seed, quantized)
    model = _xl(80, lam=lam, k=8, knn_norm=knn_norm).fit(P, Q, Y)
    for one in (False, True):
        (ps, pi), (fs, fi), ks = _both(model, T, 10, one_at_a_time=one)
        _assert_same(ps, pi, fs, fi, exact=quantized)
        if lam == 0.0:
            assert set(ks) == {80}  # lam = 0 never prunes
        else:
            assert 18 in ks  # topk + margin asked for at least once


@pytest.mark.parametrize("rows", [60, 16])
def test_pruning_falls_back_per_query(rows):
    P, Q, T, Y = _data(5, quantized=False)
    model = _xl(80, lam=0.3, k=8).fit(P, Q, Y)
    tq = torch.from_numpy(T)
    knn_s, _ = model.neighbours(tq, 8, model.index.search(tq, 8))
    negative = (knn_s < 0).any(1).numpy()
    neg = np.flatnonzero(negative)[:rows // 2]
    pick = np.concatenate([neg, np.flatnonzero(~negative)[:rows - len(neg)]])
    T, negative = T[np.sort(pick)], negative[np.sort(pick)]
    assert len(T) == rows and negative.any() and not negative.all()  # a mixed batch
    (ps, pi), (fs, fi), ks = _both(model, T, 10)
    _assert_same(ps, pi, fs, fi, exact=False)
    assert ks == [18, 80]  # the safe rows with K', the rest with Kp


@pytest.mark.filterwarnings("ignore:.*L2-normalised")
def test_no_pruning_with_negative_weights_or_without_rescore():
    P, Q, T, Y = _data(6, quantized=True, negative_y=True)
    model = _xl(80, lam=0.3, k=8).fit(P, Q, Y)
    (ps, pi), (fs, fi), ks = _both(model, T, 10)
    assert set(ks) == {80} and torch.equal(pi, fi) and torch.equal(ps, fs)
    P, Q, T, Y = _data(6, quantized=True)
    model = _xl(80, lam=0.3, k=8, rescore=False).fit(P, Q, Y)
    (ps, pi), (fs, fi), ks = _both(model, T, 10)
    assert set(ks) == {80} and torch.equal(pi, fi) and torch.equal(ps, fs)
    model = _xl(20, lam=0.3, k=8).fit(P, Q, Y)
    (_, pi), (_, fi), ks = _both(model, T, 15)  # topk + margin >= candidates: nothing to prune
    assert set(ks) == {20} and torch.equal(pi, fi)


@pytest.mark.filterwarnings("ignore:.*L2-normalised")
def test_pruning_tie_at_the_boundary_falls_back():
    """Many documents with one ERM score around position topk: fl(lam e) ties there, so the
    bound fails and the query is searched with Kp (a tie goes to the lower id, which may lie
    beyond K')."""
    d, n = 4, 200
    P = np.zeros((n, d), np.float32)
    P[:, 0] = 0.5
    P[150:, 0] = 1.0  # 50 better documents with high ids
    Q = np.ones((30, d), np.float32) / 2
    Y = sp.csr_matrix((np.ones(30, np.float32), (np.arange(30), np.arange(30) + 100)),
                      shape=(30, n))
    T = np.array([[1.0, 0.0, 0.0, 0.0]], np.float32)
    model = _xl(120, lam=0.5, k=4).fit(P, Q, Y)
    (ps, pi), (fs, fi), ks = _both(model, T, 60)
    assert ks == [68, 120]
    assert torch.equal(pi, fi) and torch.equal(ps, fs)


@pytest.mark.filterwarnings("ignore:.*L2-normalised")
def test_pruning_rounding_collision_falls_back():
    """Distinct ERM scores e < e' with fl(lam e) == fl(lam e'): documents 100.. score e' and
    fill C', documents 0..49 score e and lie outside it, but after the lam product they tie
    with the top and win the tie by their lower ids. The bound sees the collision and the
    query is searched with Kp, so the result is the unpruned one."""
    lo = np.float32(0.9)
    hi = np.nextafter(lo, np.float32(2))
    assert np.float32(0.3) * lo == np.float32(0.3) * hi and lo < hi
    n = 200
    P = np.full((n, 1), lo, np.float32)
    P[100:100 + 40] = hi
    Q = np.ones((4, 1), np.float32)
    Y = sp.csr_matrix((np.ones(4, np.float32), (np.arange(4), [199, 198, 197, 196])),
                      shape=(4, n))
    T = np.ones((1, 1), np.float32)
    model = _xl(120, lam=0.3, k=2, augment_docs=False).fit(P, Q, Y)
    (ps, pi), (fs, fi), ks = _both(model, T, 20)
    assert ks == [28, 120]
    assert torch.equal(pi, fi) and torch.equal(ps, fs)
    assert set(range(18)) <= set(pi[0].tolist())  # the low ids won the rounded ties
    # without the bound, pruning would have returned a different top-20:
    e = model.index.search(torch.from_numpy(T), 28)
    knn = model.neighbours(torch.from_numpy(T), 2, e)
    wrong = model.fuse(torch.from_numpy(T), e, knn, 20)
    assert not torch.equal(wrong[1], fi)
    # the same query beside one that prunes safely (distinct scores along a second axis):
    # only the first is searched and fused again, and its row of the result is replaced
    P2 = np.hstack([P, np.linspace(0.1, 0.9, n, dtype=np.float32)[:, None]])
    Q2 = np.hstack([Q, np.zeros((4, 1), np.float32)])
    T2 = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    model = _xl(120, lam=0.3, k=2, augment_docs=False).fit(P2, Q2, Y)
    (ps, pi), (fs, fi), ks = _both(model, T2, 20)
    assert ks == [28, 120]
    assert torch.equal(pi, fi) and torch.equal(ps, fs)


@pytest.mark.parametrize("backend,module", [("hnsw", "faiss"), ("hnswlib", "hnswlib"),
                                            ("scann", "scann")])
def test_pruning_with_ann_backends_keeps_recall(backend, module):
    pytest.importorskip(module)
    P, Q, T, Y = _data(7, quantized=False)
    model = _xl(80, lam=0.3, k=8, backend=backend).fit(P, Q, Y)
    (_, pi), (_, fi), ks = _both(model, T, 10)
    assert 18 in ks
    overlap = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(pi.tolist(), fi.tolist())])
    assert overlap > 0.98  # same up to the ANN's own approximation (tiny index: exact here)
