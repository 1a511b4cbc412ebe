"""Scale paths: the fused XL kernel against a float64 reference and the general fusion, the
synthetic generator."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import pefa_gpu as pg
from pefa_gpu.arrays import csr_tensors
from pefa_gpu.fuse import fuse_scores
from pefa_gpu.fuse_kernels import _key_score, _sort_key, fused_topk
from pefa_gpu.synthetic import make_synthetic
from tests.conftest import DEVICES


def ref_fuse(q, P, Y, erm_s, erm_i, knn_s, knn_i, lam, div, rescore, topk, erm_exact=False):
    """float64 reference of DESIGN §1 PEFA-XL fusion on given search results."""
    Yd = Y.toarray().astype(np.float64)
    b = q.shape[0]
    out_s = np.full((b, topk), -np.inf)
    out_i = np.full((b, topk), -1, dtype=np.int64)
    for r in range(b):
        c = {int(j): float(s) for s, j in zip(erm_s[r], erm_i[r]) if j >= 0}
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("rescore,erm_exact", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("lam,div,topk", [(0.5, 4.0, 5), (0.25, 1.0, 30), (0.0, 2.0, 10),
                                          (1.0, 4.0, 7)])
def test_fused_kernel_equals_reference(device, seed, rescore, erm_exact, lam, div, topk):
    q, P, Y, erm_s, erm_i, knn_s, knn_i = fusion_inputs(seed)
    t = lambda x: torch.as_tensor(x, device=device)  # noqa: E731
    args = (t(q), t(P), *csr_tensors(Y, device), t(erm_s), t(erm_i), t(knn_s), t(knn_i))
    kw = dict(lam=lam, knn_weight_divisor=div, rescore=rescore, topk=topk, erm_exact=erm_exact)
    got = fused_topk(*args, **kw)
    assert got is not None
    ref_s, ref_i = ref_fuse(q, P, Y, erm_s, erm_i, knn_s, knn_i, lam, div, rescore, topk,
                            erm_exact)
    np.testing.assert_array_equal(got[1].cpu().numpy(), ref_i)
    np.testing.assert_array_equal(got[0].cpu().numpy(), ref_s.astype(np.float32))
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.int64
    general = fuse_scores(*args, **kw, kernel="general")
    assert torch.equal(general[1], got[1]) and torch.equal(general[0], got[0])
    auto = fuse_scores(*args, **kw)
    assert torch.equal(auto[1], got[1]) and torch.equal(auto[0], got[0])


@pytest.mark.parametrize("seed", [3, 4])
@pytest.mark.parametrize("rescore", [False, True])
def test_fused_kernel_continuous_data(seed, rescore):
    q, P, Y, erm_s, erm_i, knn_s, knn_i = fusion_inputs(seed, quantized=False)
    args = (torch.from_numpy(q), torch.from_numpy(P), *csr_tensors(Y, "cpu"),
            *map(torch.from_numpy, (erm_s, erm_i, knn_s, knn_i)))
    got = fused_topk(*args, lam=0.3, knn_weight_divisor=6.0, rescore=rescore, topk=15)
    ref_s, ref_i = ref_fuse(q, P, Y, erm_s, erm_i, knn_s, knn_i, 0.3, 6.0, rescore, 15)
    np.testing.assert_allclose(got[0].numpy(), ref_s, rtol=1e-5, atol=1e-6)
    assert (got[1].numpy() == ref_i).mean() > 0.99


def test_fused_kernel_falls_back_on_duplicate_erm_ids():
    q, P, Y, erm_s, erm_i, knn_s, knn_i = fusion_inputs(0)
    erm_i[2, 1] = erm_i[2, 0]
    erm_s[2, 1] = erm_s[2, 0]
    args = (torch.from_numpy(q), torch.from_numpy(P), *csr_tensors(Y, "cpu"),
            *map(torch.from_numpy, (erm_s, erm_i, knn_s, knn_i)))
    kw = dict(lam=0.5, knn_weight_divisor=4.0, rescore=False)
    assert fused_topk(*args, **kw, topk=80) is None  # both copies would be listed
    got = fused_topk(*args, **kw, topk=1)  # the duplicate is not in the top 1 of any row
    ref = fuse_scores(*args, **kw, topk=1, kernel="general")
    if got is not None:
        assert torch.equal(got[1], ref[1]) and torch.equal(got[0], ref[0])
    auto = fuse_scores(*args, **kw, topk=80)  # falls back to the general path
    ref = fuse_scores(*args, **kw, topk=80, kernel="general")
    assert torch.equal(auto[1], ref[1]) and torch.equal(auto[0], ref[0])
    with pytest.raises(pg.InputError, match="kernel"):
        fuse_scores(*args, **kw, topk=3, kernel="triton")


def test_sort_key_round_trip_and_order():
    s = torch.tensor([0.0, -0.0, 1.5, -1.5, 3e38, -3e38, 1e-40, -1e-40, float("-inf"), 2.0])
    doc = torch.arange(s.numel())
    key = _sort_key(s, doc)
    back = _key_score(key)
    assert torch.equal(back, s + 0.0)
    assert torch.equal(key & ((1 << 31) - 1), doc) and bool((key >= 0).all())
    order = torch.argsort(key).numpy()
    ref = np.lexsort((doc.numpy(), -(s.double().numpy())))
    np.testing.assert_array_equal(order, ref)


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
