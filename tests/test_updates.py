"""Live updates: after any sequence of add_documents / add_pairs the model equals a refit from
scratch on all the data (same arrays, same search results to the bit on the CPU)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import pefa_gpu as pg
from pefa_gpu.index import ExactIndex, register_backend
from conftest import make_model, unit_rows

D = 12
T_QUERIES = 25

MODELS = [
    ("erm", {}),
    ("xs", dict(lam=0.3, augment_docs=True)),
    ("xs", dict(lam=0.6, augment_docs=False)),
    ("xl", dict(lam=0.2, k=4, candidates=6, augment_docs=True, rescore=True)),
    ("xl", dict(lam=0.5, k=3, candidates=5, augment_docs=True, rescore=False, knn_norm="none")),
    ("xl", dict(lam=0.4, k=5, candidates=8, augment_docs=False, rescore=True)),
]


def _make(kind, opts, backend="exact", device="cpu"):
    cls = {"erm": pg.ERM, "xs": pg.PEFAXS, "xl": pg.PEFAXL}[kind]
    return make_model(cls, backend=backend, device=device, **opts)


class Data:
    """All documents, queries and relevance blocks seen so far, for a refit."""

    def __init__(self, rng):
        self.rng = rng
        self.P = unit_rows(rng, 15, D)
        self.Q = np.zeros((0, D), np.float32)
        self.Y = sp.csr_matrix((0, 15), dtype=np.float32)

    def new_docs(self, r):
        P = unit_rows(self.rng, r, D)
        if r > 1:
            P[-1] = self.P[self.rng.integers(len(self.P))]  # a duplicate document: score ties
        self.P = np.vstack([self.P, P])
        self.Y = sp.csr_matrix((self.Y.data, self.Y.indices, self.Y.indptr),
                               shape=(self.Y.shape[0], len(self.P)))
        return P

    def new_pairs(self, r, weighted):
        rng, n = self.rng, len(self.P)
        Q = unit_rows(rng, r, D)
        for i in range(r):  # duplicates of earlier queries / documents: neighbour ties
            u = rng.random()
            if u < 0.2 and len(self.Q):
                Q[i] = self.Q[rng.integers(len(self.Q))]
            elif u < 0.35:
                Q[i] = self.P[rng.integers(n)]
        rows, cols = [], []
        for i in range(r):
            deg = rng.choice([0, 1, 1, 2, 3])  # some queries have no pair at all
            for j in rng.choice(n, size=deg, replace=False):
                rows.append(i)
                cols.append(j)
        if rng.random() < 0.5:  # a document that had no pair before
            rows.append(int(rng.integers(r)))
            cols.append(n - 1)
        w = (rng.integers(1, 4, size=len(rows)).astype(np.float32) if weighted
             else np.ones(len(rows), np.float32))
        Y = sp.csr_matrix((w, (rows, cols)), shape=(r, n))
        Y.sum_duplicates()
        if not weighted:
            Y.data[:] = 1
        self.Q = np.vstack([self.Q, Q])
        self.Y = sp.vstack([self.Y, Y], format="csr")
        return Q, Y


def _refit(kind, opts, data, backend="exact"):
    m = _make(kind, opts, backend)
    return m.fit(data.P) if kind == "erm" else m.fit(data.P, data.Q, data.Y)


def _assert_same_results(a, b, T):
    for topk in (1, 7, 40):
        sa, ia = a.search(T, topk)
        sb, ib = b.search(T, topk)
        assert torch.equal(ia, ib), (topk, ia, ib)
        assert torch.equal(sa, sb)


def _assert_same_state(a, b, kind):
    assert a.n_docs == b.n_docs
    if kind == "xs":
        assert torch.equal(a.doc_sums, b.doc_sums)
        assert torch.equal(a.index.vectors, b.index.vectors)
    if kind == "xl":
        assert torch.equal(a.query_index.vectors, b.query_index.vectors)
        ya, yb = a.relevance.csr, b.relevance.csr
        assert ya.shape == yb.shape and (ya != yb).nnz == 0
        for x, y in zip(a.relevance_rows.tensors, b.relevance_rows.tensors):
            assert torch.equal(x, y)
        assert a.relevance_rows.nonnegative == b.relevance_rows.nonnegative


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind,opts", MODELS)
def test_random_update_sequences_equal_refit(kind, opts, seed):
    rng = np.random.default_rng(100 + seed)
    data = Data(rng)
    weighted = seed % 2 == 1
    Q0, Y0 = data.new_pairs(10, weighted)
    model = _make(kind, opts)
    model = model.fit(data.P) if kind == "erm" else model.fit(data.P, Q0, Y0)
    T = unit_rows(rng, T_QUERIES, D)
    T[:3] = data.P[:3]  # queries equal to documents: exact ties
    for step in range(6):
        if kind == "erm" or rng.random() < 0.4:
            model.add_documents(data.new_docs(int(rng.integers(1, 4))))
        else:
            model.add_pairs(*data.new_pairs(int(rng.integers(1, 5)), weighted))
        ref = _refit(kind, opts, data)
        _assert_same_state(model, ref, kind)
        _assert_same_results(model, ref, T)


def test_xs_update_matches_float64_reference():
    rng = np.random.default_rng(7)
    data = Data(rng)
    Q0, Y0 = data.new_pairs(8, False)
    xs = pg.PEFAXS(lam=0.4, device="cpu").fit(data.P, Q0, Y0)
    xs.add_documents(data.new_docs(3))
    xs.add_pairs(*data.new_pairs(6, False))
    A = data.Y.toarray().astype(np.float64).T @ data.Q.astype(np.float64) + data.P
    norms = np.linalg.norm(A, axis=1, keepdims=True)
    E = 0.4 * data.P + 0.6 * np.where(norms > 0, A / np.where(norms > 0, norms, 1), 0)
    np.testing.assert_allclose(xs.index.vectors.numpy(), E, atol=1e-6)
    np.testing.assert_allclose(xs.doc_sums.numpy(), A, atol=1e-5)


def test_xs_touches_only_the_rows_of_new_pairs():
    rng = np.random.default_rng(3)
    data = Data(rng)
    Q0, Y0 = data.new_pairs(8, False)
    xs = pg.PEFAXS(lam=0.5, device="cpu").fit(data.P, Q0, Y0)
    before = xs.index.vectors.clone()
    Y1 = sp.csr_matrix(([1.0, 1.0], ([0, 1], [2, 5])), shape=(2, len(data.P)))
    xs.add_pairs(unit_rows(rng, 2, D), Y1)
    changed = (xs.index.vectors != before).any(1).nonzero().flatten().tolist()
    assert changed == [2, 5]


def test_fp16_exact_index_updates_equal_refit():
    rng = np.random.default_rng(11)
    data = Data(rng)
    Q0, Y0 = data.new_pairs(8, False)
    ip = {"dtype": "float16"}
    for kind, opts in [("xs", {"lam": 0.3}), ("xl", {"k": 3, "candidates": 5})]:
        m = make_model(_make(kind, opts).__class__, index_params=ip, device="cpu", **opts)
        m.fit(data.P, data.Q, data.Y)
        dd = Data(np.random.default_rng(12))
        dd.P, dd.Q, dd.Y = data.P.copy(), data.Q.copy(), data.Y.copy()
        m.add_documents(dd.new_docs(2))
        m.add_pairs(*dd.new_pairs(3, False))
        ref = make_model(m.__class__, index_params=ip, device="cpu", **opts).fit(dd.P, dd.Q, dd.Y)
        _assert_same_results(m, ref, unit_rows(rng, 10, D))


class _NoUpdateIndex(ExactIndex):
    """An exact index that, like the ANN backends, can neither overwrite nor return rows."""

    name = "_test_no_update"

    def update(self, ids, vectors):
        raise NotImplementedError("no update")

    def reconstruct(self, ids):
        raise NotImplementedError("no reconstruct")


def test_backends_without_update_rebuild_xs_and_append_to_xl():
    register_backend("_test_no_update", _NoUpdateIndex)
    rng = np.random.default_rng(5)
    data = Data(rng)
    Q0, Y0 = data.new_pairs(8, False)
    xs = pg.PEFAXS(lam=0.3, backend="_test_no_update", device="cpu").fit(data.P, Q0, Y0)
    xs.add_pairs(*data.new_pairs(4, False))
    _assert_same_results(xs, _refit("xs", {"lam": 0.3}, data), unit_rows(rng, 10, D))
    xl = pg.PEFAXL(backend="_test_no_update", device="cpu").fit(data.P, data.Q, data.Y)
    xl.add_pairs(*data.new_pairs(2, False))  # the query index holds queries only: an append
    _assert_same_results(xl, _refit("xl", {}, data), unit_rows(rng, 10, D))
    xl2 = pg.PEFAXL(backend="_test_no_update", augment_docs=False, device="cpu")
    xl2.fit(data.P, data.Q, data.Y)
    xl2.add_documents(data.new_docs(2))
    xl2.add_pairs(*data.new_pairs(2, False))
    _assert_same_results(xl2, _refit("xl", {"augment_docs": False}, data), unit_rows(rng, 9, D))


def test_update_errors():
    rng = np.random.default_rng(9)
    data = Data(rng)
    Q0, Y0 = data.new_pairs(8, False)
    n = len(data.P)
    erm = pg.ERM(device="cpu").fit(data.P)
    with pytest.raises(pg.InputError, match="ERM has no training pairs"):
        erm.add_pairs(Q0, Y0)
    xs = pg.PEFAXS(device="cpu").fit(data.P, Q0, Y0)
    with pytest.raises(pg.InputError, match="dimension"):
        xs.add_documents(unit_rows(rng, 2, D + 1))
    with pytest.raises(pg.InputError, match="columns"):
        xs.add_pairs(unit_rows(rng, 2, D), sp.csr_matrix((2, n + 1), dtype=np.float32))
    with pytest.raises(pg.InputError, match="rows"):
        xs.add_pairs(unit_rows(rng, 3, D), sp.csr_matrix((2, n), dtype=np.float32))
    with pytest.raises(pg.InputError, match="NaN"):
        xs.add_documents(np.full((1, D), np.nan, np.float32))
    with pytest.raises(pg.InputError, match="not fitted"):
        pg.PEFAXS(device="cpu").add_documents(data.P)
    # pairs with no entries are fine: XS unchanged, XL gains query rows
    before = xs.index.vectors.clone()
    xs.add_pairs(unit_rows(rng, 2, D), sp.csr_matrix((2, n), dtype=np.float32))
    assert torch.equal(before, xs.index.vectors)


def test_exact_index_update_and_reconstruct():
    rng = np.random.default_rng(2)
    X = torch.from_numpy(unit_rows(rng, 6, D))
    idx = ExactIndex(device="cpu").build(X)
    new = torch.from_numpy(unit_rows(rng, 2, D))
    idx.update(torch.tensor([4, 1]), new)
    assert torch.equal(idx.reconstruct(torch.tensor([1, 4])), new.flip(0))
    assert torch.equal(idx.reconstruct(torch.tensor([[0], [2]]))[:, 0], X[[0, 2]])
    assert not torch.equal(X[1], new[1])  # the caller's tensor is not written through
    s, i = idx.search(new[:1], 1)
    assert i.item() == 4
    for ids, vec, msg in [([6], new[:1], "out of range"), ([1, 1], new, "repeat"),
                          ([1], new, "shape"), ([0.5], new[:1], "integers")]:
        with pytest.raises(pg.InputError, match=msg):
            idx.update(torch.tensor(ids), vec)


def test_a_16_bit_exact_index_refuses_rows_beyond_its_range_on_update():
    idx = ExactIndex({"dtype": "float16"}, device="cpu").build(torch.ones(4, 3))
    with pytest.raises(pg.InputError, match="NaN or inf as float16"):
        idx.update(torch.tensor([2]), torch.full((1, 3), 1e6))  # float16 tops out at 65504
    with pytest.raises(pg.InputError, match="NaN or inf"):
        idx.update(torch.tensor([2]), torch.full((1, 3), float("nan")))
    assert torch.equal(idx.vectors, torch.ones(4, 3, dtype=torch.float16))


@pytest.mark.parametrize("cls", [pg.ERM, pg.PEFAXS, pg.PEFAXL])
def test_documents_the_index_refuses_leave_the_model_as_it_was(cls, tmp_path):
    """PEFAXS appended to doc_embeddings / doc_sums before its index refused the rows: n_docs
    stayed, the arrays grew, so the next add gave document n the refused row's embedding and
    a save would not load."""
    rng = np.random.default_rng(23)
    P, Q = unit_rows(rng, 20, D), unit_rows(rng, 10, D)
    Y = sp.csr_matrix(np.eye(10, 20, dtype=np.float32))
    model = cls(device="cpu", index_params={"dtype": "float16"})
    model = model.fit(P) if cls is pg.ERM else model.fit(P, Q, Y)
    with pytest.raises(pg.InputError, match="NaN or inf as float16"):
        model.add_documents(np.full((2, D), 1e6, np.float32))  # float16 tops out at 65504
    assert model.n_docs == len(model.doc_embeddings) == model.index.ntotal == 20
    assert len(getattr(model, "doc_sums", model.doc_embeddings)) == 20
    model.add_documents(P[:1])
    assert torch.equal(model.doc_embeddings[20], torch.from_numpy(P[0]))
    model.save(tmp_path / "m")
    assert pg.load(tmp_path / "m", device="cpu").n_docs == 21


@pytest.mark.parametrize("backend", ["exact", "hnsw"])  # update in place / rebuild
def test_pairs_the_index_refuses_leave_the_documents_as_they_were(backend):
    """add_pairs wrote doc_sums before the index took the rows: sums beyond float32 (inf) were
    refused there and stayed in doc_sums (score then NaN, every later add_pairs refused). pifa
    now refuses them, naming Yᵀ Q."""
    if backend == "hnsw":
        pytest.importorskip("faiss")
    rng = np.random.default_rng(24)
    P, Q = unit_rows(rng, 20, D), unit_rows(rng, 10, D)
    model = pg.NUDGE(device="cpu", variant="M", gamma=1.0, backend=backend).fit(
        P, Q, sp.csr_matrix(np.eye(10, 20, dtype=np.float32)))
    sums = model.doc_sums.clone()
    with pytest.raises(pg.InputError, match="Yᵀ Q overflows float32"):
        model.add_pairs(unit_rows(rng, 2, D) * 1e38, np.full((2, 20), 3e38, np.float32))
    assert torch.equal(model.doc_sums, sums)


@pytest.mark.parametrize("kind,opts", [MODELS[0], MODELS[1], MODELS[3]])
def test_updates_after_save_and_load_equal_refit(kind, opts, tmp_path):
    rng = np.random.default_rng(21)
    data = Data(rng)
    Q0, Y0 = data.new_pairs(8, False)
    model = _make(kind, opts)
    model = model.fit(data.P) if kind == "erm" else model.fit(data.P, Q0, Y0)
    model.save(tmp_path / "m")
    for mmap in (False, True):
        dd = Data(np.random.default_rng(22))
        dd.P, dd.Q, dd.Y = data.P.copy(), data.Q.copy(), data.Y.copy()
        loaded = pg.load(tmp_path / "m", device="cpu", mmap=mmap)
        loaded.add_documents(dd.new_docs(2))
        if kind != "erm":
            loaded.add_pairs(*dd.new_pairs(3, False))
        _assert_same_results(loaded, _refit(kind, opts, dd), unit_rows(rng, 10, D))
    # the save on disk is untouched by updates of a memory-mapped load
    again = pg.load(tmp_path / "m", device="cpu")
    assert again.n_docs == len(data.P)


@pytest.mark.parametrize("kind,opts", [("xs", {"lam": 0.4}), ("xl", {"k": 3, "candidates": 6})])
def test_hnsw_backend_updates_rebuild_and_match_exact_refit(kind, opts):
    pytest.importorskip("faiss")
    rng = np.random.default_rng(31)
    P, Q = unit_rows(rng, 30, D), unit_rows(rng, 12, D)  # no duplicates: no ties
    cols = np.r_[rng.integers(0, 25, 8), rng.integers(0, 30, 4)]  # fit's pairs: first 25 docs
    Y = sp.csr_matrix((np.ones(12, np.float32), (np.arange(12), cols)), shape=(12, 30))
    model = _make(kind, opts, backend="hnsw").fit(P[:25], Q[:8], Y[:8, :25])
    model.add_documents(P[25:])
    model.add_pairs(Q[8:], Y[8:])
    ref = _make(kind, opts).fit(P, Q, Y)
    T = unit_rows(rng, 10, D)
    s, i = model.search(T, 5)
    sr, ir = ref.search(T, 5)
    assert torch.equal(i, ir)
    np.testing.assert_allclose(s.numpy(), sr.numpy(), atol=1e-5)


@pytest.mark.parametrize("kind,opts", [MODELS[0], MODELS[3]])
def test_added_documents_are_saved_once(kind, opts, tmp_path):
    """After add_documents the exact index and doc_embeddings stay one tensor: the save
    writes P once (the index entry names doc_embeddings) and loads back equal."""
    rng = np.random.default_rng(7)
    data = Data(rng)
    model = _make(kind, opts)
    if kind == "erm":
        model.fit(data.P)
    else:
        data.new_pairs(8, weighted=False)
        model.fit(data.P, data.Q, data.Y)
    new = unit_rows(rng, 4, D)
    model.add_documents(new)
    assert model.doc_embeddings.data_ptr() == model.index.vectors.data_ptr()
    model.save(tmp_path / "m")
    entry = json.loads((tmp_path / "m" / "manifest.json").read_text())["state"]["index"]
    assert entry.get("vectors") == "doc_embeddings" and "dir" not in entry
    loaded = pg.load(tmp_path / "m", device="cpu")
    np.testing.assert_array_equal(loaded.doc_embeddings.numpy()[-4:], new)
    q = unit_rows(rng, 5, D)
    for a, b in zip(model.search(q, 6), loaded.search(q, 6)):
        assert torch.equal(a, b)
