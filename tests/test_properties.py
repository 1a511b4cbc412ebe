"""Property tests: random shapes, dtypes, layouts, magnitudes and duplicates thrown at
Relevance, pifa, PEFAXS, PEFAXL and evaluate. Each call either raises a clear InputError /
TypeError or returns what a float64 reference written here computes, and never writes the
caller's arrays."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import pefa_gpu as pg  # noqa: E402
from pefa_gpu.errors import InputError  # noqa: E402

import reference as ref  # noqa: E402

SETTINGS = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))
DTYPES = ["float16", "float32", "float64", "int32", "int64", "bool"]
LAYOUTS = ["csr", "csc", "coo", "dense", "torch"]
FLAWS = [None] * 6 + ["complex", "nan", "id out of range", "indptr"]


class Y:
    """A random relevance matrix as a caller would pass it (``value``) and its meaning as a
    dense float64 array (``dense``): duplicates add up (a bool matrix's are one True)."""

    def __init__(self, draw, m: int, n: int, log_scale: int | None = None):
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        self.dtype, self.layout = draw(st.sampled_from(DTYPES)), draw(st.sampled_from(LAYOUTS))
        if log_scale is not None or (self.dtype == "float16" and self.layout not in
                                     ("dense", "torch")):  # scipy has no float16 matrices
            self.dtype = "float64" if self.dtype in ("float64", "int64") else "float32"
        e = draw(st.integers(0, 3 * m))
        rows, cols = rng.integers(0, m, e), rng.integers(0, n, e)
        dups = draw(st.integers(0, e))
        rows, cols = np.r_[rows, rows[:dups]], np.r_[cols, cols[:dups]]
        if log_scale is None:
            log_scale = {"float16": draw(st.integers(-4, 4)),
                         "int32": draw(st.integers(0, 6)), "int64": draw(st.integers(0, 12)),
                         "bool": 0}.get(self.dtype, draw(st.integers(-30, 30)))
        if self.dtype == "bool":
            vals = rng.random(rows.size) < 0.8
        elif self.dtype.startswith("int"):
            vals = rng.integers(0, 4, rows.size) * 10**log_scale
        else:
            vals = rng.uniform(0.5, 2.0, rows.size) * 10.0**log_scale
        vals = vals.astype(self.dtype)
        vals[rng.random(vals.size) < 0.2] = 0                            # explicit zeros
        self.flaw = draw(st.sampled_from(FLAWS))
        if self.layout in ("dense", "torch"):
            d = np.zeros((m, n), self.dtype)
            if self.dtype == "bool":
                d[rows, cols] = vals
            else:
                np.add.at(d, (rows, cols), vals)
            self.dense = d.astype(np.float64)
            self.value = d if self.layout == "dense" else torch.from_numpy(d)
        else:
            self.dense = np.zeros((m, n))
            if self.dtype == "bool":
                self.dense[rows[vals], cols[vals]] = 1.0
            else:
                np.add.at(self.dense, (rows, cols), vals.astype(np.float64))
            self.value = self._sparse(rng, vals, rows, cols, m, n)
        if self.flaw == "complex":
            self.value = (self.value * (1 + 1j) if self.layout != "torch"
                          else self.value.to(torch.complex64))
        elif self.flaw == "nan" and self.dtype.startswith("float") and e:
            if self.layout in ("dense", "torch"):
                self.value[int(rows[0]), int(cols[0])] = float("nan")
            else:
                self.value.data[0] = np.nan
        elif self.flaw in ("id out of range", "indptr") and self.layout in ("csr", "csc") \
                and e:
            if self.flaw == "indptr":
                self.value.indptr[-1] += 5
            else:
                self.value.indices[0] = draw(st.sampled_from([-1, max(m, n), 10**8]))
        else:
            self.flaw = None

    def _sparse(self, rng, vals, rows, cols, m, n):
        if self.layout == "coo":
            return sp.coo_matrix((vals, (rows, cols)), shape=(m, n))
        major, minor, size = (rows, cols, m) if self.layout == "csr" else (cols, rows, n)
        order = np.lexsort((rng.random(major.size), major))              # unsorted ids
        indptr = np.r_[0, np.cumsum(np.bincount(major, minlength=size))].astype(np.int32)
        cls = sp.csr_matrix if self.layout == "csr" else sp.csc_matrix
        return cls((vals[order], minor[order].astype(np.int32), indptr), shape=(m, n))

    def expected_error(self):
        return TypeError if self.flaw == "complex" else (InputError if self.flaw else None)


def snapshot(*xs) -> list:
    out = []
    for x in xs:
        if isinstance(x, torch.Tensor):
            out.append((str(x.dtype), x.numpy().tobytes()))
        elif isinstance(x, np.ndarray):
            out.append((str(x.dtype), x.tobytes()))
        else:
            names = ("row", "col", "data") if x.format == "coo" else ("indptr", "indices", "data")
            out.extend((str(getattr(x, a).dtype), getattr(x, a).tobytes()) for a in names)
    return out


def raises_or_returns(y: Y, call, needs_pairs: bool = False):
    """call() raises y's expected error (with a message) or returns its value.
    ``needs_pairs``: an empty Y is an InputError too (fit)."""
    err = y.expected_error()
    if err is None and needs_pairs and not y.dense.any():
        err = InputError
    if err is None:
        return call()
    with pytest.raises(err) as info:
        call()
    assert str(info.value)
    return None


def embeddings(draw, rows: int, dim: int, log_scale: int = 0) -> np.ndarray:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = rng.standard_normal((rows, dim))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    if rows > 2 and draw(st.booleans()):
        x[-1] = x[0]                                                     # a copy: exact ties
    return (x * 10.0**log_scale).astype(np.float32)


def assert_ranking(ids: np.ndarray, scores: np.ndarray, truth: np.ndarray, tol: np.ndarray):
    """``ids`` / ``scores`` (B, k) from a search are the float64 ``truth`` (B, n)'s top k up to
    ``tol`` (B,) of rounding: the scores are right, ids are the reference's wherever it has
    no near-tie, and equal scores list the lower id first."""
    k = ids.shape[1]
    full = ref.topk(truth, k + 1)[0]
    want_s, want_i = full[:, :k], ref.topk(truth, k)[1]
    got = np.where(ids >= 0, np.take_along_axis(truth, np.maximum(ids, 0), 1), -np.inf)
    finite = np.isfinite(want_s)
    assert (np.isfinite(got) == finite).all()
    t = np.broadcast_to(tol[:, None], want_s.shape)
    assert (np.abs(got[finite] - want_s[finite]) <= t[finite]).all()
    assert (np.abs(scores[finite] - want_s[finite]) <= t[finite]).all()
    ext = np.concatenate([np.full_like(full[:, :1], np.inf), full], 1)
    with np.errstate(invalid="ignore"):  # -inf - -inf: padding, never clear
        before, after = ext[:, :k] - ext[:, 1:k + 1], ext[:, 1:k + 1] - ext[:, 2:]
        clear = (before > 2 * t) & (after > 2 * t) & finite
    np.testing.assert_array_equal(ids[clear], want_i[clear])
    same = (scores[:, 1:] == scores[:, :-1]) & (ids[:, 1:] >= 0)
    assert (ids[:, 1:][same] > ids[:, :-1][same]).all()


# -- Relevance ------------------------------------------------------------------------------

@SETTINGS
@given(st.data())
def test_relevance_equals_the_float64_meaning_or_refuses(data):
    m, n = data.draw(st.integers(1, 9)), data.draw(st.integers(1, 11))
    y = Y(data.draw, m, n)
    before = snapshot(y.value)
    rel = raises_or_returns(y, lambda: pg.Relevance(y.value))
    assert snapshot(y.value) == before
    if rel is None:
        return
    c = rel.csr
    assert c.dtype == np.float32 and c.has_canonical_format and (c.data != 0).all()
    np.testing.assert_allclose(c.toarray(), y.dense, rtol=2e-6, atol=0)
    assert pg.as_relevance(y.value, allow_empty=True).csr.nnz == c.nnz
    r = data.draw(st.integers(-2, m + 1))
    if 0 <= r < m:
        np.testing.assert_allclose(rel.rows([r]).csr.toarray(), y.dense[[r]], rtol=2e-6)
    else:
        with pytest.raises(InputError, match=f"rows \\[{r}\\] out of range"):
            rel.rows([r])


# -- pifa -----------------------------------------------------------------------------------

@SETTINGS
@given(st.data())
@pytest.mark.filterwarnings("ignore:normalising rows")  # sums beyond float32: checked apart
def test_pifa_equals_the_float64_reference_at_any_magnitude(data):
    m, n, d = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 10)), data.draw(
        st.integers(1, 6))
    ly = data.draw(st.integers(-30, 30))
    lq = data.draw(st.integers(max(-30 - ly, -30), min(30 - ly, 30)))  # products in range
    y = Y(data.draw, m, n, log_scale=ly if data.draw(st.booleans()) else None)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    Q = (rng.uniform(0.1, 1.0, (m, d)) * 10.0**lq).astype(np.float32)  # >= 0: no cancelling
    q_in = Q if data.draw(st.booleans()) else torch.from_numpy(Q)
    before = snapshot(y.value, q_in)
    A = raises_or_returns(y, lambda: pg.pifa(y.value, q_in, device="cpu"))
    assert snapshot(y.value, q_in) == before
    if A is None:
        return
    a64 = y.dense.T @ Q.astype(np.float64)
    if np.abs(a64).max(initial=0) > 3e38 or (0 < np.abs(a64[a64 != 0]).min(initial=1)
                                               < 1e-37):
        return  # the sums themselves leave float32's normal range: covered elsewhere
    np.testing.assert_allclose(A.numpy(), ref.normalize(a64), rtol=2e-5, atol=1e-7)


# -- PEFA-XS --------------------------------------------------------------------------------

@SETTINGS
@given(st.data())
@pytest.mark.filterwarnings("ignore:.*not L2-normalised")
def test_pefa_xs_search_equals_the_float64_reference(data):
    m, n, d = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 12)), data.draw(
        st.integers(2, 6))
    y = Y(data.draw, m, n)
    lp = data.draw(st.sampled_from([0, 0, -40, -30, -19, 19, 30]))    # -40: subnormal P
    lt = data.draw(st.integers(-20, min(20, 30 - max(lp, 0))))
    P, Q, T = embeddings(data.draw, n, d, lp), embeddings(data.draw, m, d, data.draw(
        st.integers(-5, 5))), embeddings(data.draw, 3, d, lt)
    lam, augment = data.draw(st.sampled_from([0.0, 0.3, 1.0])), data.draw(st.booleans())
    topk = data.draw(st.integers(1, n + 3))
    before = snapshot(y.value, P, Q, T)
    xs = raises_or_returns(y, lambda: pg.PEFAXS(lam=lam, augment_docs=augment,
                                                device="cpu").fit(P, Q, y.value), True)
    if xs is None:
        assert snapshot(y.value, P, Q, T) == before
        return
    s, i = xs.search(T, topk=topk)
    assert snapshot(y.value, P, Q, T) == before
    a = y.dense.T @ Q.astype(np.float64) + (P.astype(np.float64) if augment else 0)
    if np.abs(a).max() > 1e36:
        return
    E = lam * P.astype(np.float64) + (1 - lam) * ref.normalize(a)
    bound = np.abs(y.dense).T @ np.abs(Q.astype(np.float64)) + np.abs(P.astype(np.float64))
    na = np.linalg.norm(a, axis=1)
    scale = np.divide(np.linalg.norm(bound, axis=1), na, out=np.zeros_like(na), where=na > 0)
    # per document, a bound on |error of E_j| (float32 rounding of lam p_j and of Π(a_j))
    e_err = 1e-5 * (lam * np.linalg.norm(P.astype(np.float64), axis=1) + (1 - lam) * (1 + scale))
    assert (np.abs(xs.xs_embeddings().numpy() - E) <= e_err[:, None] + 1e-7).all()
    T64 = T.astype(np.float64)
    tol = np.linalg.norm(T64, axis=1) * (e_err.max() + 1e-5 * np.linalg.norm(E, axis=1).max())
    tol += d * 3e-45  # products below float32's smallest subnormal round to 0
    assert_ranking(i.numpy(), s.numpy().astype(np.float64), T64 @ E.T, tol)


# -- PEFA-XL --------------------------------------------------------------------------------

@settings(SETTINGS, max_examples=150)
@given(st.data())
def test_pefa_xl_search_equals_the_float64_reference(data):
    m, n, d = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 10)), data.draw(
        st.integers(2, 5))
    y = Y(data.draw, m, n, log_scale=data.draw(st.integers(-30, 30)))
    P, Q, T = embeddings(data.draw, n, d), embeddings(data.draw, m, d), embeddings(
        data.draw, 3, d)
    lam, augment = data.draw(st.sampled_from([0.0, 0.5, 1.0])), data.draw(st.booleans())
    rows = m + (n if augment else 0)
    k = rows + data.draw(st.integers(0, 3))       # every training row a neighbour: no
    candidates = n + data.draw(st.integers(0, 3))  # selection by near-equal scores
    topk = data.draw(st.integers(1, n + 2))
    before = snapshot(y.value, P, Q, T)
    xl = raises_or_returns(y, lambda: pg.PEFAXL(lam=lam, k=k, augment_docs=augment, device="cpu",
                                                search_params=pg.XLSearchParams(
                                                    candidates=candidates))
                           .fit(P, Q, y.value), True)
    if xl is None:
        assert snapshot(y.value, P, Q, T) == before
        return
    s, i = xl.search(T, topk=topk)
    assert snapshot(y.value, P, Q, T) == before
    P64, T64 = P.astype(np.float64), T.astype(np.float64)
    Qa, Ya = Q.astype(np.float64), y.dense
    if augment:
        Qa, Ya = np.vstack([Qa, P64]), np.vstack([Ya, np.eye(n)])
    w = (T64 @ Qa.T) / k                                     # (B, rows) neighbour weights
    fused = lam * (T64 @ P64.T) + (1 - lam) * (w @ Ya)
    mag = lam * np.abs(T64 @ P64.T) + (1 - lam) * (np.abs(w) @ np.abs(Ya))
    if mag.max() > 1e36:
        return
    tol = 2e-5 * mag.max(1) + 1e-30
    assert_ranking(i.numpy(), s.numpy().astype(np.float64), fused, tol)


# -- evaluate -------------------------------------------------------------------------------

@SETTINGS
@given(st.data())
def test_evaluate_equals_the_float64_reference(data):
    b, n = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 12))
    y = Y(data.draw, b, n)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    width = data.draw(st.integers(1, 12))
    ids = rng.integers(-1, n, (b, width))                    # -1 padding and repeated ids
    ids_in = ids if data.draw(st.booleans()) else torch.from_numpy(ids)
    ks = tuple(sorted(set(data.draw(st.lists(st.integers(1, width), min_size=1, max_size=3)))))
    before = snapshot(y.value, ids_in)
    out = raises_or_returns(y, lambda: pg.evaluate(ids_in, y.value, ks=ks))
    assert snapshot(y.value, ids_in) == before
    if out is None:
        return
    has = (y.dense > 0).any(1)
    assert out["n_queries"] == int(has.sum()) and out["n_empty"] == int((~has).sum())
    for k in ks:
        for name, f in (("recall", ref.recall), ("ndcg", ref.ndcg), ("mrr", ref.mrr)):
            want = f(ids, y.dense, k) if has.any() else 0.0
            assert out[f"{name}@{k}"] == pytest.approx(want, rel=1e-5, abs=1e-12), (name, k)
