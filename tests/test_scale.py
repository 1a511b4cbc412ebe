"""Scale paths: the XL fusion core (numpy and torch, every step) against a float64 reference,
its top-k tie rule, the synthetic generator."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import pefa_gpu as pg
from pefa_gpu.fuse import RelevanceRows, fuse, select_topk
from pefa_gpu.synthetic import make_synthetic


def ref_fuse(q, P, Y, erm_s, erm_i, knn_s, knn_i, lam, div, rescore, topk, erm_exact=False):
    """float64 reference of DESIGN §1 PEFA-XL fusion on given search results (an ERM id
    listed twice in a row keeps its first entry)."""
    Yd = Y.toarray().astype(np.float64)
    b = q.shape[0]
    out_s = np.full((b, topk), -np.inf)
    out_i = np.full((b, topk), -1, dtype=np.int64)
    for r in range(b):
        c: dict[int, float] = {}
        for s, j in zip(erm_s[r], erm_i[r]):
            if j >= 0:
                c.setdefault(int(j), float(s))
        f_knn: dict[int, float] = {}
        for s, i in zip(knn_s[r], knn_i[r]):
            if i < 0:
                continue
            for j in np.flatnonzero(Yd[i]):
                f_knn[int(j)] = f_knn.get(int(j), 0.0) + float(s) / div * Yd[i, j]
        cands = sorted(set(c) | set(f_knn))
        rows = []
        for j in cands:
            if rescore and not (erm_exact and j in c):
                fe = float(np.dot(q[r].astype(np.float64), P[j].astype(np.float64)))
            else:
                fe = c.get(j, 0.0)
            rows.append((-(lam * fe + (1 - lam) * f_knn.get(j, 0.0)), j))
        rows.sort()
        for t, (negs, j) in enumerate(rows[:topk]):
            out_s[r, t], out_i[r, t] = -negs, j
    return out_s, out_i


def fusion_inputs(seed, quantized=True, b=25, n=60, m=40, d=8, kp=12, k=6):
    """Search results with -1 padding, Y with empty rows and weights, duplicate documents."""
    rng = np.random.default_rng(seed)
    if quantized:  # values on a 1/4 grid: every float32 product and sum is exact -> real ties
        P = rng.integers(-2, 3, (n, d)).astype(np.float32) / 4
        Qtr = rng.integers(-2, 3, (m, d)).astype(np.float32) / 4
        q = rng.integers(-2, 3, (b, d)).astype(np.float32) / 4
    else:
        P, Qtr, q = (rng.standard_normal((r, d)).astype(np.float32) for r in (n, m, b))
    P[5] = P[3]  # duplicate documents
    Y = sp.random(m, n, density=0.08, random_state=seed, format="csr", dtype=np.float32)
    Y.data[:] = rng.choice([1.0, 2.0, 0.5], Y.nnz)
    Y = (sp.diags((np.arange(m) % 5 != 0).astype(np.float32)) @ Y).tocsr()  # empty rows
    Y.eliminate_zeros()
    erm_i = np.stack([rng.permutation(n)[:kp] for _ in range(b)])
    erm_s = np.einsum("bd,bkd->bk", q, P[erm_i]).astype(np.float32)
    knn_i = np.stack([rng.permutation(m)[:k] for _ in range(b)])
    knn_s = np.einsum("bd,bkd->bk", q, Qtr[knn_i]).astype(np.float32)
    erm_i[::4, -3:], erm_s[::4, -3:] = -1, -np.inf  # padding
    knn_i[1::3, -2:], knn_s[1::3, -2:] = -1, -np.inf
    knn_i[7] = -1
    knn_s[7] = -np.inf
    return q, P, Y, erm_s, erm_i, knn_s, knn_i


def run_fuse(kind, q, P, Y, erm_s, erm_i, knn_s, knn_i, device="cpu", *, lam, k, norm, **kw):
    """The fusion core on numpy arrays (kind 'numpy') or torch tensors on ``device``, with the
    first ``k`` neighbours weighted by s / k (``norm`` "k") or s ("none"); numpy out."""
    rows = RelevanceRows(pg.Relevance(Y), device)
    arrays = (q, P, erm_s, erm_i, knn_s, knn_i)
    if kind == "torch":
        arrays = tuple(torch.as_tensor(x, device=device) for x in arrays)
    s, i = fuse(arrays[0], arrays[2:4], arrays[4:6], rows, arrays[1], lams=(lam,), ks=(k,),
                knn_norm=norm, **kw)[(lam, k)]
    assert s.dtype in (np.float32, torch.float32) and i.dtype in (np.int64, torch.int64)
    return pg.arrays.to_numpy(s), pg.arrays.to_numpy(i)


KINDS = [("numpy", "cpu"), ("torch", "cpu"), pytest.param("torch", "cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("kind,device", KINDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("rescore,erm_exact", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("lam,k,norm,topk", [(0.5, 4, "k", 5), (0.25, 6, "none", 30),
                                             (0.0, 2, "k", 10), (1.0, 4, "k", 7)])
def test_fusion_equals_reference(kind, device, seed, rescore, erm_exact, lam, k, norm, topk):
    q, P, Y, erm_s, erm_i, knn_s, knn_i = fusion_inputs(seed)
    got = run_fuse(kind, q, P, Y, erm_s, erm_i, knn_s, knn_i, device, lam=lam, k=k, norm=norm,
                   rescore=rescore, erm_exact=erm_exact, topk=topk)
    ref_s, ref_i = ref_fuse(q, P, Y, erm_s, erm_i, knn_s[:, :k], knn_i[:, :k], lam,
                            k if norm == "k" else 1.0, rescore, topk, erm_exact)
    np.testing.assert_array_equal(got[1], ref_i)
    np.testing.assert_array_equal(got[0], ref_s.astype(np.float32))


@pytest.mark.parametrize("seed", [3, 4])
@pytest.mark.parametrize("rescore", [False, True])
def test_fusion_continuous_data(seed, rescore):
    q, P, Y, erm_s, erm_i, knn_s, knn_i = fusion_inputs(seed, quantized=False)
    got = run_fuse("numpy", q, P, Y, erm_s, erm_i, knn_s, knn_i, lam=0.3, k=6, norm="k",
                   rescore=rescore, erm_exact=False, topk=15)
    ref_s, ref_i = ref_fuse(q, P, Y, erm_s, erm_i, knn_s, knn_i, 0.3, 6.0, rescore, 15)
    np.testing.assert_allclose(got[0], ref_s, rtol=1e-5, atol=1e-6)
    assert (got[1] == ref_i).mean() > 0.99


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("quantized", [True, False])
def test_numpy_and_torch_give_the_same_bits(seed, quantized):
    """The CPU runs the core on numpy, CUDA on torch: on the CPU both kinds agree to the bit."""
    q, P, Y, es, ei, ks, ki = fusion_inputs(seed, quantized=quantized, b=12, n=150, m=60,
                                            kp=30, k=8)
    for rescore, exact in [(False, False), (True, False), (True, True)]:
        for lam, k, norm, topk in [(0.5, 4, "k", 5), (0.1, 8, "k", 40), (0.0, 2, "none", 10),
                                   (1.0, 3, "k", 7)]:
            kw = dict(lam=lam, k=k, norm=norm, rescore=rescore, erm_exact=exact, topk=topk)
            a = run_fuse("numpy", q, P, Y, es, ei, ks, ki, **kw)
            b = run_fuse("torch", q, P, Y, es, ei, ks, ki, **kw)
            assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


@pytest.mark.parametrize("kind,device", KINDS)
@pytest.mark.parametrize("rescore,erm_exact", [(False, False), (True, False), (True, True)])
def test_a_repeated_erm_id_keeps_its_first_entry(kind, device, rescore, erm_exact):
    q, P, Y, erm_s, erm_i, knn_s, knn_i = fusion_inputs(0)
    erm_i[2, 1], erm_s[2, 1] = erm_i[2, 0], erm_s[2, 0]       # the same entry twice
    erm_i[3, 4], erm_s[3, 4] = erm_i[3, 1], erm_s[3, 1] + 1.0  # a later, better entry
    erm_i[5, 6:9] = erm_i[5, 2]                               # three more copies
    for topk in (1, 20, 80):  # 80: more places than candidates, so every copy would show
        kw = dict(lam=0.5, k=4, norm="k", rescore=rescore, erm_exact=erm_exact, topk=topk)
        got = run_fuse(kind, q, P, Y, erm_s, erm_i, knn_s, knn_i, device, **kw)
        ref = ref_fuse(q, P, Y, erm_s, erm_i, knn_s[:, :4], knn_i[:, :4], 0.5, 4.0, rescore,
                       topk, erm_exact)
        np.testing.assert_array_equal(got[1], ref[1])
        np.testing.assert_array_equal(got[0], ref[0].astype(np.float32))
        for row in got[1]:
            assert len(set(row[row >= 0].tolist())) == (row >= 0).sum()


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_select_topk_tie_rule(kind):
    """numpy tables and torch ones (through topk.merge_topk): equal scores go to the lower id,
    at the k-th place too, however many tie there; rows with fewer candidates than k are padded;
    -0.0 ties with 0.0 and comes back as 0.0."""
    rng = np.random.default_rng(0)
    b, w = 40, 30
    scores = rng.integers(-2, 3, (b, w)).astype(np.float32) / 2
    scores[::5] = 0.0
    scores[1::5, ::2] = -0.0
    ids = np.stack([rng.permutation(1000)[:w] for _ in range(b)]).astype(np.int64)
    scores[2::5, 10:] = -np.inf  # no candidate there
    ids[2::5, 10:] = -1
    for k in (1, 7, 10, 30, 45):
        if kind == "numpy":
            s, i = select_topk(scores, ids, k)
        else:
            s, i = (t.numpy() for t in select_topk(torch.from_numpy(scores),
                                                   torch.from_numpy(ids), k))
        for r in range(b):
            ref = sorted((-float(v), int(j)) for v, j in zip(scores[r], ids[r]) if j >= 0)[:k]
            want_i = [j for _, j in ref] + [-1] * (k - len(ref))
            want_s = [-v for v, _ in ref] + [-np.inf] * (k - len(ref))
            assert i[r].tolist() == want_i
            assert s[r].tolist() == want_s and not np.signbit(s[r][s[r] == 0]).any()


def test_synthetic_is_seeded_and_structured():
    a = make_synthetic(2000, 5000, 16, 300, seed=3)
    b = make_synthetic(2000, 5000, 16, 300, seed=3)
    c = make_synthetic(2000, 5000, 16, 300, seed=4)
    assert np.array_equal(a.P, b.P) and np.array_equal(a.Q, b.Q)
    assert (a.Y.csr != b.Y.csr).nnz == 0 and not np.array_equal(a.P, c.P)
    for x in (a.P, a.Q, a.Q_test):
        assert x.dtype == np.float32
        np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-5)
    assert a.Y.shape == (5000, 2000) and a.Y_test.shape == (300, 2000)
    per_query = np.diff(a.Y.csr.indptr)
    per_doc = np.bincount(a.Y.csr.indices, minlength=2000)
    assert per_query.min() >= 1 and per_query.max() > 5 * per_query.mean()  # heavy tail
    assert per_doc.max() > 20 * per_doc.mean() and (per_doc == 0).any()
    with pytest.raises(pg.InputError):
        make_synthetic(0, 10)


@pytest.mark.parametrize("sizes", [dict(n=2**40, m=10), dict(n=10, m=2**40),
                                   dict(n=10, m=10, d=2**40), dict(n=10, m=10, n_test=2**40),
                                   dict(n=10, m=10, clusters=2**40)])
def test_synthetic_sizes_beyond_memory_are_a_clear_error(sizes):
    """make_synthetic(2**40, ...) was numpy's MemoryError (8 TiB of float64 popularity), a
    negative clusters or max_rel=0 numpy's ValueError: now InputErrors naming the sizes."""
    with pytest.raises(pg.InputError, match=r"make_synthetic\(n=.*\) needs .* GiB of float32 "
                                            r"rows, more than this machine's .* GiB of memory"):
        make_synthetic(**sizes)
    for bad, msg in ((dict(clusters=-1), "clusters must be"), (dict(max_rel=0), "max_rel must"),
                     (dict(clusters=0), "clusters must be")):  # 0 was taken as the default
        with pytest.raises(pg.InputError, match=msg):
            make_synthetic(10, 10, **bad)


def test_synthetic_seed_and_relevant_pair_counts_are_checked():
    """seed=-1 was numpy's ValueError (not naming seed); a huge max_rel with rel_exponent near 1
    drew ~4e17 relevant pairs and gave numpy's MemoryError."""
    with pytest.raises(pg.InputError, match="seed must be an int >= 0, got -1"):
        make_synthetic(10, 10, seed=-1)
    with pytest.raises(pg.InputError, match=r"max_rel=1000000000000, rel_exponent=1.0001\) drew "
                                            r".* relevant pairs: about .* GiB of index arrays"):
        make_synthetic(100, 10**6, 4, 0, max_rel=10**12, rel_exponent=1.0001)


def test_synthetic_exponents_and_noise_are_checked():
    """popularity='1' was '<=''s bare TypeError, popularity=NaN taken, rel_exponent=NaN numpy's
    ValueError; doc_noise / query_noise NaN or 1e38 gave NaN rows, a str a ufunc TypeError;
    max_rel=10**30 was numpy's OverflowError."""
    for bad in (dict(popularity="1"), dict(popularity=float("nan")), dict(popularity=True),
                dict(rel_exponent=float("nan")), dict(rel_exponent=None)):
        with pytest.raises(pg.InputError, match="popularity must be > 0 and rel_exponent > 1"):
            make_synthetic(10, 10, 4, 2, **bad)
    for name in ("doc_noise", "query_noise"):
        for v in (float("nan"), 1e38, -1.0, "x"):
            with pytest.raises(pg.InputError, match=f"{name} must be a number in"):
                make_synthetic(10, 10, 4, 2, **{name: v})
    data = make_synthetic(10, 10, 4, 2, max_rel=10**30, popularity=float("inf"))
    assert np.isfinite(data.P).all() and data.Y.nnz >= 10
