"""ERM, PEFA-XS and PEFA-XL against the independent float64 reference (DESIGN.md §1)."""

import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import pefa_gpu as pg
from conftest import DEVICES, make_model, unit_rows
import reference as ref


def problem(seed, n=80, m=50, d=16, nnz=120, empty_docs=5, empty_queries=3):
    """Unit-norm data; some documents and training queries have no pairs; duplicate pairs."""
    rng = np.random.default_rng(seed)
    P, Q, T = unit_rows(rng, n, d), unit_rows(rng, m, d), unit_rows(rng, 12, d)
    rows = rng.integers(empty_queries, m, nnz)
    cols = rng.integers(empty_docs, n, nnz)
    rows, cols = np.r_[rows, rows[:10]], np.r_[cols, cols[:10]]  # duplicated pairs
    return P, Q, pg.Relevance.from_pairs(rows, cols, shape=(m, n)), T


def integer_problem(seed, n=60, m=40, d=4):
    """Small-integer vectors: all scores exact in float32, so ties are real and must break to
    the lower id. Vectors are not unit norm (the library warns, and must still be exact)."""
    rng = np.random.default_rng(seed)
    P = rng.integers(-1, 2, (n, d)).astype(np.float32)
    P[P.sum(1) == 0, 0] = 1.0
    P[1] = P[0]  # duplicate documents
    Q = rng.integers(-1, 2, (m, d)).astype(np.float32)
    T = rng.integers(-1, 2, (10, d)).astype(np.float32)
    Y = pg.Relevance.from_pairs(rng.integers(0, m, 70), rng.integers(0, n, 70), shape=(m, n))
    return P, Q, Y, T


def assert_ranking_close(scores, ids, ref_scores, ref_ids, atol=1e-5):
    """Scores equal within fp32 rounding; ids equal wherever the reference has no near-tie."""
    s, i = scores.cpu().numpy(), ids.cpu().numpy()
    ref_scores = np.where(np.isinf(ref_scores), -1e9, ref_scores)
    np.testing.assert_allclose(np.where(np.isinf(s), -1e9, s), ref_scores, atol=atol)
    gap = np.abs(np.diff(ref_scores, axis=1))
    safe = np.ones_like(ref_ids, dtype=bool)
    safe[:, 1:] &= gap > atol
    safe[:, :-1] &= gap > atol
    np.testing.assert_array_equal(i[safe], ref_ids[safe])


@pytest.mark.parametrize("device", DEVICES)
def test_erm_is_exact_search(device):
    P, _, _, T = problem(0)
    scores, ids = pg.ERM(device=device).fit(P).search(T, topk=20)
    assert scores.device.type == device
    assert_ranking_close(scores, ids, *ref.exact_search(P, T, 20))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lam", [0.0, 0.3, 0.9, 1.0])
@pytest.mark.parametrize("augment", [True, False])
def test_xs_matches_reference(device, lam, augment):
    P, Q, Y, T = problem(1)
    model = pg.PEFAXS(lam=lam, augment_docs=augment, device=device).fit(P, Q, Y)
    E = ref.xs_embeddings(P, Q, Y, lam, augment)
    np.testing.assert_allclose(model.xs_embeddings().cpu().numpy(), E, atol=1e-5)
    scores, ids = model.search(T, topk=25)
    assert_ranking_close(scores, ids, *ref.exact_search(E, T, 25))


def test_xs_lam_one_is_erm_and_docs_without_signal_keep_lam_p():
    P, Q, Y, T = problem(2)
    erm = pg.ERM().fit(P).search(T, topk=10)
    xs = pg.PEFAXS(lam=1.0).fit(P, Q, Y).search(T, topk=10)
    assert torch.equal(erm[1], xs[1])
    model = pg.PEFAXS(lam=0.4, augment_docs=False).fit(P, Q, Y)
    empty = np.asarray(Y.csr.sum(0)).ravel() == 0
    np.testing.assert_allclose(model.xs_embeddings().numpy()[empty], 0.4 * P[empty], atol=1e-6)


XL_OPTIONS = [
    dict(lam=0.1, k=16, candidates=30, knn_norm="k", rescore=True, augment_docs=True),
    dict(lam=0.5, k=4, candidates=5, knn_norm="none", rescore=True, augment_docs=False),
    dict(lam=0.3, k=8, candidates=10, knn_norm="k", rescore=False, augment_docs=True),
    dict(lam=0.7, k=3, candidates=3, knn_norm="none", rescore=False, augment_docs=False),
    dict(lam=0.0, k=5, candidates=1, knn_norm="k", rescore=True, augment_docs=True),
    dict(lam=1.0, k=5, candidates=200, knn_norm="k", rescore=True, augment_docs=True),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opts", XL_OPTIONS, ids=lambda o: "-".join(map(str, o.values())))
def test_xl_matches_reference(device, opts):
    P, Q, Y, T = problem(3)
    model = make_model(pg.PEFAXL, device=device, **opts).fit(P, Q, Y)
    scores, ids = model.search(T, topk=15)
    assert scores.shape == (len(T), 15) and ids.dtype == torch.int64
    assert_ranking_close(scores, ids, *ref.xl_search(P, Q, Y, T, topk_out=15, **opts))


@pytest.mark.parametrize("opts", XL_OPTIONS[:4], ids=lambda o: "-".join(map(str, o.values())))
def test_xl_exact_ties_break_to_lower_id(opts):
    opts = {**opts, "lam": 0.5, "k": 4}  # dyadic weights: fused scores exact in float32
    P, Q, Y, T = integer_problem(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = make_model(pg.PEFAXL, **opts).fit(P, Q, Y)
        scores, ids = model.search(T, topk=12)
    rs, ri = ref.xl_search(P, Q, Y, T, topk_out=12, **opts)
    np.testing.assert_array_equal(ids.numpy(), ri)
    np.testing.assert_array_equal(scores.numpy(), rs.astype(np.float32))


def test_xs_and_erm_exact_ties_break_to_lower_id():
    P, Q, Y, T = integer_problem(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        _, ids = pg.ERM().fit(P).search(T, topk=20)
    np.testing.assert_array_equal(ids.numpy(), ref.exact_search(P, T, 20)[1])


def test_xl_pads_when_few_candidates():
    P, Q, Y, T = problem(6, n=20)
    xl = make_model(pg.PEFAXL, candidates=3, k=2, augment_docs=False).fit(P, Q, Y)
    _, ids = xl.search(T, topk=30)
    _, ri = ref.xl_search(P, Q, Y, T, lam=0.1, k=2, candidates=3, augment_docs=False,
                          topk_out=30)
    np.testing.assert_array_equal(ids.numpy() == -1, ri == -1)
    assert (ids.numpy() == -1).any()


@pytest.mark.parametrize("make", [lambda: pg.ERM(), lambda: pg.PEFAXS(), lambda: pg.PEFAXL()])
def test_topk_larger_than_n_is_padded(make):
    P, Q, Y, T = problem(7, n=30)
    model = make()
    model.fit(P) if isinstance(model, pg.ERM) else model.fit(P, Q, Y)
    scores, ids = model.search(T, topk=40)
    assert ids.shape == (len(T), 40)
    assert (ids[:, 30:] == -1).all() and torch.isinf(scores[:, 30:]).all()
    assert (ids[:, :30] >= 0).all()
    assert all(len(set(r)) == 30 for r in ids[:, :30].tolist())


class _SearchSpy:
    """Wraps an index and records the k of every search (torch or numpy)."""

    def __init__(self, index, ks):
        self.index, self.ks = index, ks

    def __getattr__(self, name):
        found = getattr(self.index, name)
        if name != "search_host":
            return found
        return lambda q, k, **kw: (self.ks.append(k), found(q, k, **kw))[1]

    def search(self, q, k, params=None):
        self.ks.append(k)
        return self.index.search(q, k, params)


@pytest.mark.parametrize("backend", ["exact", "hnsw"])
@pytest.mark.parametrize("big", [500, 10**12])
@pytest.mark.parametrize("augment,rescore", [(True, True), (False, False)])
def test_xl_k_and_candidates_beyond_the_indices_are_clamped(backend, big, augment, rescore):
    """k and candidates beyond what the indices hold search only what they hold (10**12: any
    array of that width would take terabytes); the kNN weight stays s / k for the given k."""
    if backend == "hnsw":
        pytest.importorskip("faiss")
    P, Q, Y, T = problem(3)
    model = make_model(pg.PEFAXL, lam=0.3, k=big, candidates=big, augment_docs=augment,
                       rescore=rescore, backend=backend, device="cpu").fit(P, Q, Y)
    ks: list[int] = []
    model.index, model.query_index = _SearchSpy(model.index, ks), _SearchSpy(model.query_index,
                                                                            ks)
    scores, ids = model.search(T, topk=15)
    assert ks and max(ks) <= len(P)
    assert_ranking_close(scores, ids, *ref.xl_search(P, Q, Y, T, lam=0.3, k=big, candidates=big,
                                                     augment_docs=augment, rescore=rescore,
                                                     topk_out=15))
    rows = len(Q) + (len(P) if augment else 0)
    assert model.neighbours(torch.from_numpy(T), big)[1].shape == (len(T), rows)
    np.testing.assert_allclose(model.score(T, ids).numpy(), scores.numpy(), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("cls", [pg.ERM, pg.PEFAXS, pg.PEFAXL])
def test_zero_queries_give_empty_results(cls):
    P, Q, Y, T = problem(4)
    model = cls(device="cpu")
    model.fit(P) if cls is pg.ERM else model.fit(P, Q, Y)
    none = np.zeros((0, P.shape[1]), np.float32)
    scores, ids = model.search(none, topk=7)
    assert scores.shape == ids.shape == (0, 7)
    assert scores.dtype == torch.float32 and ids.dtype == torch.int64
    out = model.score(none, np.zeros((0, 3), np.int64))
    assert out.shape == (0, 3) and out.dtype == torch.float32
    if cls is pg.PEFAXL:
        q = torch.from_numpy(none)
        erm = model.index.search(q, 20)
        knn = model.neighbours(q, model.params.k, erm)
        fused = model.fuse(q, erm, knn, 7)
        assert fused[0].shape == fused[1].shape == (0, 7)


def test_fuse_takes_numpy_searches_like_tensors():
    P, Q, Y, T = problem(6)
    model = pg.PEFAXL(device="cpu").fit(P, Q, Y)
    q = torch.from_numpy(T)
    erm = model.index.search(q, 20)
    knn = model.neighbours(q, model.params.k, erm)
    want = model.fuse(q, erm, knn, 7)
    got = model.fuse(T, tuple(x.numpy() for x in erm), tuple(x.numpy() for x in knn), 7)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


@pytest.mark.parametrize("kind", ["numpy", "torch", "dlpack", "list"])
def test_inputs_of_any_array_kind(kind):
    P, Q, Y, T = problem(8)

    class DLPackOnly:
        def __init__(self, a):
            self.t = torch.from_numpy(a)

        def __dlpack__(self, **kw):
            return self.t.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    conv = {"numpy": lambda a: a, "torch": torch.from_numpy, "dlpack": DLPackOnly,
            "list": lambda a: a.tolist()}[kind]
    model = pg.PEFAXS(lam=0.5).fit(conv(P), conv(Q), Y)
    _, ids = model.search(conv(T), topk=5)
    _, expect = pg.PEFAXS(lam=0.5).fit(P, Q, Y).search(T, topk=5)
    assert torch.equal(ids, expect)


def test_scipy_relevance_accepted():
    P, Q, Y, T = problem(9)
    a = pg.PEFAXL().fit(P, Q, sp.coo_matrix(Y.csr)).search(T, 10)
    b = pg.PEFAXL().fit(P, Q, Y).search(T, 10)
    assert torch.equal(a[1], b[1])


def test_models_do_not_alias_caller_arrays():
    P, Q, Y, T = problem(10)
    before = pg.PEFAXS(lam=0.5).fit(P, Q, Y).search(T, 5)
    Pc, Qc = P.copy(), torch.from_numpy(Q.copy())
    model = pg.PEFAXS(lam=0.5).fit(Pc, Qc, Y)
    Pc[:] = 0
    Qc.zero_()
    assert torch.equal(model.search(T, 5)[1], before[1])


def test_repr_lists_the_settings_backend_device_and_size():
    P, Q, Y, _ = problem(11)
    erm = pg.ERM(device="cpu").fit(P)
    assert repr(erm) == f"ERM(backend='exact', device='cpu', n_docs={len(P)})"
    xl = pg.PEFAXL(lam=0.2, k=3, device="cpu", search_params=pg.XLSearchParams(candidates=9))
    assert repr(xl) == ("PEFAXL(lam=0.2, k=3, knn_norm='k', rescore=True, augment_docs=True, "
                        "candidates=9, backend='exact', device='cpu', n_docs=0)")


@pytest.mark.parametrize("model", [pg.PEFAXS, pg.NUDGE])
def test_document_sums_past_float32s_range_name_y_and_the_documents(model):
    """Finite Y and Q whose Yᵀ Q overflows: PEFAXS.fit blamed its index rows ('vectors hold NaN
    or inf as float32'), arguments the caller never gave."""
    P = np.eye(4, 3, dtype=np.float32)
    Q = np.tile(np.float32([[1, 0, 0]]), (2, 1))
    Y = sp.csr_matrix(np.float32([[0, 0, 3e38, 0]] * 2))  # document 2: 6e38
    with pytest.raises(pg.InputError, match=r"Yᵀ Q overflows float32 .* for documents \[2\]"):
        model(device="cpu", gamma=1.0).fit(P, Q, Y) if model is pg.NUDGE else \
            model(device="cpu").fit(P, Q, Y)
