"""The caller's data is only read, index arrays are checked before native code, sizes a user
names are bounded, and extreme magnitudes normalise like float64."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import pefa_gpu as pg
from pefa_gpu.errors import InputError

from conftest import make_model, run_forked, unit_rows
import reference as ref

M, N, D = 12, 30, 8


def messy(rng: np.random.Generator, m: int, n: int, dtype, fmt: str):
    """An (m x n) scipy matrix of ``dtype`` in ``fmt`` with explicit zeros, duplicate entries
    and unsorted ids (not in scipy's canonical format)."""
    e = 4 * m
    rows, cols = rng.integers(0, m, e), rng.integers(0, n, e)
    rows, cols = np.r_[rows, rows[:6]], np.r_[cols, cols[:6]]          # duplicates
    if np.dtype(dtype) == bool:
        vals = rng.random(rows.size) < 0.8
    elif np.dtype(dtype).kind in "iu":
        vals = rng.integers(0, 4, rows.size)
    else:
        vals = rng.uniform(0.5, 2.0, rows.size)
    vals = vals.astype(dtype)
    vals[::7] = 0                                                        # explicit zeros
    if fmt == "coo":
        return sp.coo_matrix((vals, (rows, cols)), shape=(m, n))
    major, minor, size = (rows, cols, m) if fmt == "csr" else (cols, rows, n)
    order = np.lexsort((rng.random(major.size), major))                  # ids unsorted
    indptr = np.r_[0, np.cumsum(np.bincount(major, minlength=size))]
    cls = sp.csr_matrix if fmt == "csr" else sp.csc_matrix
    y = cls((vals[order], minor[order], indptr), shape=(m, n))
    assert not y.has_canonical_format
    return y


def buffers(y) -> list[tuple[str, bytes]]:
    """The bytes (and dtype) of every array a scipy matrix, numpy array or tensor holds."""
    if isinstance(y, torch.Tensor):
        return [(str(y.dtype), y.detach().cpu().numpy().tobytes())]
    if isinstance(y, np.ndarray):
        return [(str(y.dtype), y.tobytes())]
    names = ("row", "col", "data") if y.format == "coo" else ("indptr", "indices", "data")
    return [(str(getattr(y, a).dtype), getattr(y, a).tobytes()) for a in names]


def data(seed: int = 0, dtype=np.float64, fmt: str = "csr"):
    rng = np.random.default_rng(seed)
    P, Q, T = unit_rows(rng, N, D), unit_rows(rng, M, D), unit_rows(rng, 5, D)
    return P, Q, T, messy(rng, M, N, dtype, fmt)


LAYOUTS = [(dt, fmt) for dt in (np.float64, np.int64, bool) for fmt in ("csr", "csc", "coo")]


# -- 1. inputs are read, never written -----------------------------------------------------

def _calls():
    """(name, f(P, Q, T, Y)) for every public entry point that takes a Y."""
    def xs(P, Q, T, Y):
        return pg.PEFAXS(lam=0.5, device="cpu").fit(P, Q, Y)

    def fitted_xs(P, Q, T, Y):
        return pg.PEFAXS(lam=0.5, device="cpu").fit(P, Q, np.eye(M, N))

    def ids_of(T, Y):
        return np.argsort(-(T[:, :1] * np.arange(N)), axis=1)[:, :10]  # any ranking

    return [
        ("Relevance", lambda P, Q, T, Y: pg.Relevance(Y)),
        ("as_relevance", lambda P, Q, T, Y: pg.as_relevance(Y)),
        ("pifa", lambda P, Q, T, Y: pg.pifa(Y, Q, device="cpu")),
        ("pifa streamed", lambda P, Q, T, Y: pg.pifa(Y, Q, device="cpu", memory_budget=1 << 20)),
        ("PEFAXS.fit", xs),
        ("PEFAXL.fit", lambda P, Q, T, Y: make_model(pg.PEFAXL, device="cpu", k=4, candidates=8)
         .fit(P, Q, Y)),
        ("NUDGE.fit", lambda P, Q, T, Y: pg.NUDGE(device="cpu", gamma=0.1).fit(P, Q, Y)),
        ("NUDGE.fit val", lambda P, Q, T, Y: pg.NUDGE(device="cpu").fit(P, Q, Y, Q, Y)),
        ("add_pairs", lambda P, Q, T, Y: fitted_xs(P, Q, T, Y).add_pairs(Q, Y)),
        ("evaluate", lambda P, Q, T, Y: pg.evaluate(ids_of(Q, Y), Y, ks=(5,))),
        ("recall_at_k", lambda P, Q, T, Y: pg.recall_at_k(ids_of(Q, Y), Y, ks=(5,))),
        ("ndcg_at_k", lambda P, Q, T, Y: pg.ndcg_at_k(ids_of(Q, Y), Y, ks=(5,))),
        ("mrr_at_k", lambda P, Q, T, Y: pg.mrr_at_k(ids_of(Q, Y), Y, ks=(5,))),
        ("mine_negatives", lambda P, Q, T, Y: pg.mine_negatives(fitted_xs(P, Q, T, Y), Q, Y, n=3)),
    ]


@pytest.mark.parametrize("dtype,fmt", LAYOUTS)
def test_no_entry_point_writes_the_callers_y(dtype, fmt):
    P, Q, T, Y = data(1, dtype, fmt)
    want = ref.dense(Y.copy())
    for name, call in _calls():
        before = buffers(Y) + buffers(P) + buffers(Q) + buffers(T)
        call(P, Q, T, Y)
        assert buffers(Y) + buffers(P) + buffers(Q) + buffers(T) == before, name
    np.testing.assert_allclose(pg.Relevance(Y).csr.toarray(), want, rtol=1e-6)


def test_embedding_buffers_are_read_only_in_models_search_and_score():
    P, Q, T, Y = data(2)
    Pt, Qt, Tt = torch.from_numpy(P.copy()), torch.from_numpy(Q.copy()), torch.from_numpy(T.copy())
    for model in (pg.ERM(device="cpu").fit(Pt), pg.PEFAXS(device="cpu").fit(Pt, Qt, Y),
                  make_model(pg.PEFAXL, device="cpu", k=4, candidates=8).fit(Pt, Qt, Y),
                  pg.NUDGE(device="cpu", gamma=0.2).fit(Pt, Qt, Y)):
        for queries in (T, Tt, T.astype(np.float64)):
            before = buffers(queries)
            _, ids = model.search(queries, topk=5)
            model.score(queries, ids)
            pg.mine_negatives(model, queries, ids[:, :1], n=2)
            assert buffers(queries) == before
    assert (buffers(Pt), buffers(Qt)) == (buffers(torch.from_numpy(P)),
                                          buffers(torch.from_numpy(Q)))


def test_evaluate_twice_on_a_column_permuted_y_gives_the_same_result():
    """Y[:, perm] is a float64 CSR with unsorted column ids: the first call used to sort the
    caller's indices (sharing them with its float32 copy) without moving the data."""
    rng = np.random.default_rng(3)
    y = sp.random(20, 50, density=0.1, random_state=3, format="csr", dtype=np.float64)
    y.data[:] = rng.integers(1, 4, y.nnz)
    perm = rng.permutation(50)
    yp = y[:, perm]
    ids = np.argsort(-yp.toarray() - np.arange(50) * 1e-9, axis=1)[:, :10]  # the ideal order
    first, second = pg.evaluate(ids, yp, ks=(10,)), pg.evaluate(ids, yp, ks=(10,))
    assert first == second
    assert first["ndcg@10"] == pytest.approx(ref.ndcg(ids, yp, 10))
    assert first["ndcg@10"] == pytest.approx(1.0)


# -- 2. index arrays are checked before native code ----------------------------------------

_FORGED = textwrap.dedent("""
    import sys, numpy as np, scipy.sparse as sp, pefa_gpu as pg
    rng = np.random.default_rng(0)
    P = rng.standard_normal((6, 4)).astype(np.float32)
    Q = rng.standard_normal((5, 4)).astype(np.float32)
    def forged(fmt, bad):
        y = sp.csr_matrix(np.eye(5, 6)) if fmt == "csr" else (
            sp.csc_matrix(np.eye(5, 6)) if fmt == "csc" else sp.coo_matrix(np.eye(5, 6)))
        if fmt == "coo":
            y.col[2] = bad
        else:
            y.indices[2] = bad
        return y
    calls = {"pifa": lambda y: pg.pifa(y, Q, device="cpu"),
             "xs": lambda y: pg.PEFAXS(device="cpu").fit(P, Q, y),
             "xl": lambda y: pg.PEFAXL(device="cpu", k=2, search_params=pg.XLSearchParams(
                 candidates=3)).fit(P, Q, y),
             "evaluate": lambda y: pg.evaluate(np.zeros((5, 1), np.int64), y, ks=(1,))}
    for name, call in calls.items():
        for fmt in ("csr", "csc", "coo"):
            for bad in (10**8, -1, 6, 7):
                try:
                    call(forged(fmt, bad))
                    print(name, fmt, bad, "accepted", flush=True)
                except pg.InputError as exc:
                    print(name, fmt, bad, "InputError", str(exc).replace(" ", "_"), flush=True)
                except Exception as exc:
                    print(name, fmt, bad, "raw", type(exc).__name__, flush=True)
    for indptr in ([0, 1, 3, 2, 4, 5], [1, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 10**9], [0, 1]):
        y = sp.csr_matrix(np.eye(5, 6))
        y.indptr = np.asarray(indptr, dtype=y.indptr.dtype)
        try:
            pg.pifa(y, Q, device="cpu")
            print("indptr", indptr[-1], "accepted", flush=True)
        except pg.InputError:
            print("indptr", indptr[-1], "InputError", flush=True)
        except Exception as exc:
            print("indptr", indptr[-1], "raw", type(exc).__name__, flush=True)
""")


def test_out_of_range_ids_and_broken_indptr_are_input_errors_not_crashes():
    """Run apart: on the unchecked code some of these segfault or abort the process."""
    run = run_forked(_FORGED)
    lines = run.stdout.split("\n")[:-1]
    assert len(lines) == 4 * 3 * 4 + 4
    for line in lines:
        assert line.split()[2 if line.startswith("indptr") else 3] == "InputError", line
    # the messages name the ids that are wrong
    assert any("10000000" in line and "out_of_range" in line for line in lines)


def test_a_checked_relevance_equals_the_reference_for_column_ids_at_the_edges():
    y = sp.csr_matrix((np.ones(3), np.array([0, 29, 29]), np.array([0, 2, 3])), shape=(2, 30))
    np.testing.assert_array_equal(pg.Relevance(y).csr.toarray(), ref.dense(y))
    assert pg.Relevance(y).csr[0, 29] == 1 and pg.Relevance(y).csr[1, 29] == 1


# -- 4. sizes a user names are bounded ----------------------------------------------------

BACKENDS = ["exact", "hnsw", "ivf", "hnswlib"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_huge_topk_is_refused_before_allocation_and_padding_stays(backend):
    if backend == "hnswlib":
        pytest.importorskip("hnswlib")
    rng = np.random.default_rng(4)
    P, Q, T = unit_rows(rng, 100, D), unit_rows(rng, 20, D), unit_rows(rng, 3, D)
    Y = sp.csr_matrix(np.eye(20, 100))
    kw = {"ivf": {"index_params": {"nlist": 4}}}.get(backend, {})
    models = [pg.ERM(backend=backend, device="cpu", **kw).fit(P),
              pg.PEFAXS(backend=backend, device="cpu", **kw).fit(P, Q, Y),
              make_model(pg.PEFAXL, backend=backend, device="cpu", k=4, candidates=20, **kw)
              .fit(P, Q, Y),
              pg.NUDGE(backend=backend, device="cpu", gamma=0.1, **kw).fit(P, Q, Y)]
    for model in models:
        for topk in (3 * 10**8, 10**4 + 1):
            with pytest.raises(InputError, match=f"topk={topk} but there are only 100"):
                model.search(T, topk=topk)
        with pytest.raises(InputError, match="k=300000000 but there are only 100"):
            model.index.search(torch.from_numpy(T), 3 * 10**8)
        s, i = model.search(T, topk=10**4)  # padding up to the bound, as documented
        assert i.shape == (3, 10**4) and (i[:, 100:] == -1).all()
        assert torch.isinf(s[:, 100:]).all()
        found = i[0][i[0] >= 0].tolist()
        assert i[0, :len(found)].tolist() == found and len(set(found)) == len(found)
        if not isinstance(model, pg.PEFAXL):  # XL ranks its candidates and their votes only
            assert sorted(found) == list(range(100))


def test_a_huge_topk_is_refused_on_a_sharded_index_but_a_shard_size_topk_is_padded():
    rng = np.random.default_rng(5)
    P, T = unit_rows(rng, 30, D), unit_rows(rng, 2, D)
    model = pg.ERM(backend="sharded", device="cpu", index_params={"devices": ["cpu"] * 3}).fit(P)
    with pytest.raises(InputError, match="there are only 30"):
        model.search(T, 3 * 10**8)
    s, i = model.search(T, 25)
    want_s, want_i = ref.exact_search(P, T, 25)
    np.testing.assert_array_equal(i.numpy(), want_i)


def test_xl_candidates_and_k_beyond_what_exists_equal_the_reference():
    rng = np.random.default_rng(6)
    P, Q, T = unit_rows(rng, N, D), unit_rows(rng, M, D), unit_rows(rng, 4, D)
    Y = sp.csr_matrix((rng.random((M, N)) < 0.15).astype(np.float64))
    xl = make_model(pg.PEFAXL, device="cpu", lam=0.3, k=10**9, candidates=10**9).fit(P, Q, Y)
    s, i = xl.search(T, topk=10)
    want_s, want_i = ref.xl_search(P, Q, Y, T, lam=0.3, k=10**9, candidates=10**9, topk_out=10)
    np.testing.assert_array_equal(i.numpy(), want_i)
    np.testing.assert_allclose(s.numpy(), want_s, rtol=1e-4, atol=1e-6)


def test_an_xl_k_beyond_what_a_float_holds_is_refused_naming_it():
    P, Q, T, Y = data(7)  # fuse divides by k and sized its memory with k: a raw OverflowError
    for bad in (2**53 + 1, 10**400):
        with pytest.raises(InputError, match=f"k must be at most {2**53}, got {bad}"):
            pg.PEFAXL(device="cpu", k=bad)
    xl = pg.PEFAXL(device="cpu", k=2**53).fit(P, Q, Y)
    assert xl.search(T, 5)[1].shape == (T.shape[0], 5)


def test_mine_negatives_clamps_skip_top_and_bounds_n():
    P, Q, T, Y = data(7)
    xs = pg.PEFAXS(device="cpu").fit(P, Q, Y)
    negs = pg.mine_negatives(xs, Q, Y, n=3, skip_top=10**9)
    assert negs.shape == (M, 3) and (negs == -1).all()
    negs = pg.mine_negatives(xs, Q, Y, n=N + 5, skip_top=0)  # every non-positive, then -1
    y = ref.dense(Y) != 0
    for r in range(M):
        got = negs[r][negs[r] >= 0].tolist()
        assert sorted(got) == np.flatnonzero(~y[r]).tolist()
    with pytest.raises(InputError, match="n=1000000000 but there are only 30"):
        pg.mine_negatives(xs, Q, Y, n=10**9)


# -- 5. extreme magnitudes -----------------------------------------------------------------

SCALES = [1e-30, 1e-19, 1e-10, 1.0, 1e10, 1e19, 1e30]


def test_normalize_rows_equals_float64_at_every_magnitude_float32_holds():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((len(SCALES) + 3, 16))
    x[:len(SCALES)] *= np.asarray(SCALES)[:, None]
    x[-3] *= 1e-40                               # subnormal in float32
    x[-2] = 0.0
    x[-1, :] = 0.0
    x[-1, 3] = 3e38                              # near float32's maximum
    x32 = x.astype(np.float32)
    out = pg.normalize_rows(torch.from_numpy(x32)).numpy()
    want = ref.normalize(x32.astype(np.float64))
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=1e-7)
    assert (np.abs(np.linalg.norm(out[:-2], axis=1) - 1) < 1e-5).all()


@pytest.mark.parametrize("weight", SCALES)
def test_pifa_and_xs_equal_float64_for_extreme_weights(weight):
    P, Q, T, Y = data(9)
    Y = sp.csr_matrix(Y.toarray() != 0).astype(np.float64) * weight
    A = pg.pifa(Y, Q, device="cpu").numpy()
    np.testing.assert_allclose(A, ref.pifa(Y, Q), rtol=1e-5, atol=1e-6)
    xs = pg.PEFAXS(lam=0.5, device="cpu").fit(P, Q, Y)
    np.testing.assert_allclose(xs.xs_embeddings().numpy(), ref.xs_embeddings(P, Q, Y, 0.5),
                               rtol=1e-5, atol=1e-6)
    _, ids = xs.search(T, topk=10)
    np.testing.assert_array_equal(
        ids.numpy(), ref.exact_search(ref.xs_embeddings(P, Q, Y, 0.5), T, 10)[1])


@pytest.mark.parametrize("norm", SCALES + [1e-40])
def test_pifa_and_xs_equal_float64_for_extreme_query_and_document_norms(norm):
    P, Q, T, Y = data(10)
    Y = sp.csr_matrix(Y.toarray() != 0)  # binary: products with subnormal rows stay exact
    Qs = (Q.astype(np.float64) * norm).astype(np.float32)
    Ps = (P.astype(np.float64) * norm).astype(np.float32)  # 1e-40: subnormal P
    with np.errstate(under="ignore"):
        np.testing.assert_allclose(pg.pifa(Y, Qs, device="cpu").numpy(), ref.pifa(Y, Qs),
                                   rtol=1e-5, atol=1e-6)
        xs = pg.PEFAXS(lam=0.5, device="cpu").fit(Ps, Q, Y)
        want = ref.xs_embeddings(Ps, Q, Y, 0.5)
    np.testing.assert_allclose(xs.xs_embeddings().numpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("budget", [None, 1 << 20])
def test_an_overflowing_sum_warns_naming_its_rows(budget):
    Q = np.full((2, 4), 3e38, np.float32)  # finite, though min + max overflows
    Y = sp.csr_matrix(np.array([[1.0, 0, 1], [1.0, 0, 0]]))  # document 0: 2 x 3e38 = inf
    with pytest.warns(RuntimeWarning, match=r"rows \[0\]"):
        A = pg.pifa(Y, Q, device="cpu", memory_budget=budget).numpy()
    assert np.isnan(A[0]).all() and (A[1] == 0).all()
    np.testing.assert_allclose(A[2], ref.pifa(Y, Q.astype(np.float64))[2], rtol=1e-6)


# -- 11. smaller ones ----------------------------------------------------------------------

def test_from_pairs_refuses_a_shape_that_is_not_two_integers():
    for shape in ((2.7, 3.9), (2.0, 3), (2, 3, 4), (True, 3)):
        with pytest.raises(InputError, match="shape must be two integers"):
            pg.Relevance.from_pairs([0, 1], [0, 2], shape=shape)
    assert pg.Relevance.from_pairs([0, 1], [0, 2], shape=(np.int64(2), 3)).shape == (2, 3)


def test_complex_y_is_a_type_error_naming_its_dtype():
    y = np.eye(3, 4) * (1 + 2j)
    for bad in (y, sp.csr_matrix(y), sp.coo_matrix(y), torch.from_numpy(y)):
        with pytest.raises(TypeError, match="complex128"):
            pg.as_relevance(bad)
    with pytest.raises(TypeError, match="complex"):
        pg.Relevance.from_pairs([0], [1], weights=[1 + 1j])
    with pytest.raises(TypeError, match="complex128"):
        pg.evaluate(np.zeros((3, 1), np.int64), sp.csr_matrix(y), ks=(1,))


def test_rows_out_of_range_name_the_row():
    rel = pg.Relevance(sp.csr_matrix(np.eye(4, 5)))
    for bad in ([100], [0, -1], [4]):
        with pytest.raises(InputError, match=rf"rows \[{bad[-1]}\] out of range: Y has 4 rows"):
            rel.rows(bad)
    with pytest.raises(InputError, match="integer row positions"):
        rel.rows([0.5])
    np.testing.assert_array_equal(rel.rows([3, 0]).csr.toarray(), np.eye(4, 5)[[3, 0]])
    np.testing.assert_array_equal(rel.rows(np.array([1, 0, 0, 1], bool)).csr.toarray(),
                                  np.eye(4, 5)[[0, 3]])


def test_mine_negatives_refuses_positive_ids_outside_the_documents():
    P, Q, T, Y = data(11)
    xs = pg.PEFAXS(device="cpu").fit(P, Q, Y)
    for bad in ([[0, N]], [[-2]], [[10**8]]):
        with pytest.raises(InputError, match=r"positives hold document ids out of range"):
            pg.mine_negatives(xs, Q[:1], bad, n=2)
    with pytest.raises(InputError, match="positives hold document ids out of range"):
        pg.mine_negatives(xs, Q[:1], np.array([[N + 3]]), n=2)
    wide = sp.csr_matrix(([1.0], ([0], [N + 2])), shape=(1, N + 5))
    with pytest.raises(InputError, match="out of range"):
        pg.mine_negatives(xs, Q[:1], wide, n=2)
    assert pg.mine_negatives(xs, Q[:1], [[-1, 3]], n=2).shape == (1, 2)


def test_a_masked_array_with_masked_entries_is_refused():
    """numpy hands over a masked array's data: a masked 5.0 was indexed as P's value."""
    R = unit_rows(np.random.default_rng(0), 6, D)
    P = np.ma.masked_array(R.copy())
    assert pg.ERM().fit(P).search(R[:2], 1)[1].reshape(-1).tolist() == [0, 1]  # nothing masked
    P[0, 0] = np.ma.masked
    P.data[0, 0] = 5.0
    with pytest.raises(InputError, match=r"P is a masked array with masked entries"):
        pg.ERM().fit(P)
    with pytest.raises(InputError, match=r"queries is a masked array"):
        pg.ERM().fit(R).search(P, 1)
