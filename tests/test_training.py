"""Training-loop helpers: differentiable scores (against finite differences and a float64
numpy reference), hard-negative mining (never a positive), CUDA searches' counted host
synchronisations."""

from __future__ import annotations


import numpy as np
import pytest
import scipy.sparse as sp
import torch

import pefa_gpu as pg
from conftest import cuda_syncs, make_model, unit_rows

N, M, D, B = 40, 30, 8, 6


def _data(seed=0):
    rng = np.random.default_rng(seed)
    P, Q, T = unit_rows(rng, N, D), unit_rows(rng, M, D), unit_rows(rng, B, D)
    rows = rng.integers(0, M, size=70)
    cols = rng.integers(0, N - 5, size=70)  # the last 5 documents have no pairs
    w = rng.integers(1, 4, size=70).astype(np.float32)
    Y = sp.csr_matrix((w, (rows, cols)), shape=(M, N))
    return P, Q, Y, T


MODELS = [
    ("erm", {}),
    ("xs", dict(lam=0.3)),
    ("xs", dict(lam=0.7, augment_docs=False)),
    ("xl", dict(lam=0.3, k=4, candidates=6)),
    ("xl", dict(lam=0.6, k=5, candidates=4, rescore=False, knn_norm="none")),
    ("xl", dict(lam=0.2, k=3, candidates=5, augment_docs=False)),
]


def _fit(kind, opts, P, Q, Y, device="cpu"):
    if kind == "erm":
        return pg.ERM(device=device).fit(P)
    cls = pg.PEFAXS if kind == "xs" else pg.PEFAXL
    return make_model(cls, device=device, **opts).fit(P, Q, Y)


def _top(scores, k):
    """Best k columns per row of a float64 matrix, ties to the lower column."""
    return np.stack([np.lexsort((np.arange(s.size), -s))[:k] for s in scores])


def _reference_scores(kind, opts, P, Q, Y, T, ids):
    """float64 numpy PEFA score of each (query, id), written apart from the library."""
    P, Q, T = P.astype(np.float64), Q.astype(np.float64), T.astype(np.float64)
    Yd = Y.toarray().astype(np.float64)
    lam = opts.get("lam", 1.0)
    aug = opts.get("augment_docs", True)
    if kind == "erm":
        E = P
    elif kind == "xs":
        A = Yd.T @ Q + (P if aug else 0)
        nrm = np.linalg.norm(A, axis=1, keepdims=True)
        E = lam * P + (1 - lam) * np.where(nrm > 0, A / np.where(nrm > 0, nrm, 1), 0)
    if kind in ("erm", "xs"):
        full = T @ E.T
    else:
        Qa, Ya = (np.vstack([Q, P]), np.vstack([Yd, np.eye(N)])) if aug else (Q, Yd)
        k = opts["k"]
        S = T @ Qa.T
        nbr = _top(S, k)
        div = k if opts.get("knn_norm", "k") == "k" else 1
        fknn = np.stack([(S[b, nbr[b]] / div) @ Ya[nbr[b]] for b in range(len(T))])
        ferm = T @ P.T
        if not opts.get("rescore", True):
            cand = _top(ferm, opts["candidates"])
            mask = np.zeros_like(ferm)
            for b in range(len(T)):
                mask[b, cand[b]] = 1
            ferm = ferm * mask
        full = lam * ferm + (1 - lam) * fknn
    out = np.take_along_axis(full, np.maximum(ids, 0), 1)
    return np.where(ids >= 0, out, -np.inf)


@pytest.mark.parametrize("kind,opts", MODELS)
def test_score_matches_float64_reference_and_search(kind, opts):
    P, Q, Y, T = _data(1)
    model = _fit(kind, opts, P, Q, Y)
    rng = np.random.default_rng(2)
    ids = rng.integers(-1, N, size=(B, 9))
    ids[:, 0] = -1
    got = model.score(T, ids)
    assert got.shape == (B, 9) and got.dtype == torch.float32
    ref = _reference_scores(kind, opts, P, Q, Y, T, ids)
    np.testing.assert_array_equal(np.isinf(got.numpy()), np.isinf(ref))
    np.testing.assert_allclose(got.numpy(), ref, atol=1e-5)
    # for the ids search returns, score() is the search score
    s, i = model.search(T, topk=10)
    np.testing.assert_allclose(model.score(T, i).numpy(), s.numpy(), atol=1e-6)


@pytest.mark.parametrize("kind,opts", MODELS)
def test_score_gradient_matches_finite_differences(kind, opts):
    P, Q, Y, T = _data(3)
    model = _fit(kind, opts, P, Q, Y)
    _, ids = model.search(T, topk=7)
    ids = torch.cat([ids.clamp_min(0), torch.arange(N - 3, N).expand(B, 3)], 1)  # + unretrieved
    q = torch.from_numpy(T).double().requires_grad_()
    out = model.score(q, ids)
    assert out.dtype == torch.float64
    w = torch.from_numpy(np.random.default_rng(4).standard_normal(out.shape))
    (grad,) = torch.autograd.grad((out * w).sum(), q)
    eps = 1e-6
    num = torch.zeros_like(q)
    with torch.no_grad():
        for b in range(B):
            for c in range(D):
                dq = torch.zeros_like(q)
                dq[b, c] = eps
                diff = model.score(q + dq, ids) - model.score(q - dq, ids)
                num[b, c] = (diff * w).sum() / (2 * eps)
    torch.testing.assert_close(grad, num, atol=1e-6, rtol=1e-6)


def test_score_padding_is_minus_inf_without_gradient():
    P, Q, Y, T = _data(5)
    xl = _fit("xl", dict(k=4, candidates=6), P, Q, Y)
    q = torch.from_numpy(T).requires_grad_()
    out = xl.score(q, torch.full((B, 3), -1))
    assert torch.isneginf(out).all()
    logits = torch.cat([xl.score(q, torch.zeros(B, 1, dtype=torch.long)), out], 1)
    loss = torch.nn.functional.cross_entropy(logits, torch.zeros(B, dtype=torch.long))
    loss.backward()
    assert torch.isfinite(q.grad).all() and loss.item() == 0


@pytest.mark.parametrize("kind,opts", MODELS + [("nudge", dict(variant="M", gamma=0.3))])
def test_score_of_no_ids_or_no_queries_is_empty(kind, opts):
    P, Q, Y, T = _data(8)
    model = pg.NUDGE(**opts).fit(P, Q, Y) if kind == "nudge" else _fit(kind, opts, P, Q, Y)
    for queries, ids in ((T, np.zeros((B, 0), np.int64)), (T[:0], np.zeros((0, 3), np.int64))):
        out = model.score(torch.from_numpy(queries).double(), ids)
        assert out.shape == ids.shape and out.dtype == torch.float64


def test_score_errors():
    P, Q, Y, T = _data(6)
    xs = _fit("xs", {}, P, Q, Y)
    with pytest.raises(pg.InputError, match="out of range"):
        xs.score(T, np.full((B, 2), N))
    with pytest.raises(pg.InputError, match="shape"):
        xs.score(T, np.zeros((B + 1, 2), np.int64))
    with pytest.raises(pg.InputError, match="integers"):
        xs.score(T, np.zeros((B, 2)))
    with pytest.raises(pg.InputError, match="NaN"):
        xs.score(np.full((1, D), np.nan, np.float32), np.zeros((1, 1), np.int64))


@pytest.mark.parametrize("kind,opts", MODELS)
def test_unchecked_ids_out_of_range_score_nan_not_a_crash(kind, opts):
    """score(check=False), the default on CUDA, indexed the documents with ids >= n or < -1:
    numpy's IndexError here, a device-side assert (the CUDA context lost) on a GPU; those
    scores are NaN now, the others as checked."""
    P, Q, Y, T = _data(9)
    model = _fit(kind, opts, P, Q, Y)
    ids = np.tile(np.array([3, N, -1, N + 7, -5, 0]), (B, 1))
    got = model.score(torch.from_numpy(T).requires_grad_(), ids, check=False)
    bad = (ids >= N) | (ids < -1)
    assert torch.isnan(got[torch.from_numpy(bad)]).all()
    fine = np.where(bad, -1, ids)
    assert torch.equal(got[torch.from_numpy(~bad)], model.score(T, fine)[torch.from_numpy(~bad)])
    got.nan_to_num(0.0, 0.0, 0.0).sum().backward()  # masked scores pass no gradient


def test_search_of_a_query_that_requires_grad_keeps_no_graph():
    P, Q, Y, T = _data(7)
    q = torch.from_numpy(T).requires_grad_()
    for kind, opts in MODELS[:4]:
        s, i = _fit(kind, opts, P, Q, Y).search(q * 2, topk=5)
        assert s.grad_fn is None and not s.requires_grad and i.grad_fn is None


def _reference_negatives(model, T, pos_lists, n, skip_top):
    _, ranked = model.search(T, topk=N)
    out = np.full((len(T), n), -1)
    for b, row in enumerate(ranked.numpy()):
        keep = [j for j in row if j >= 0 and j not in set(pos_lists[b])][skip_top:skip_top + n]
        out[b, :len(keep)] = keep
    return out


@pytest.mark.parametrize("kind,opts", MODELS[:5])
def test_mine_negatives_never_returns_a_positive(kind, opts):
    P, Q, Y, T = _data(8)
    model = _fit(kind, opts, P, Q, Y)
    rng = np.random.default_rng(9)
    _, top = model.search(T, topk=6)
    pos_lists = [list(rng.choice(top[b].numpy(), size=b % 4, replace=False)) for b in range(B)]
    pos_lists[-1] = list(range(0, N, 2))  # many positives
    width = max(len(p) for p in pos_lists)
    padded = np.full((B, width), -1)
    for b, p in enumerate(pos_lists):
        padded[b, :len(p)] = p
    csr = sp.csr_matrix((np.ones(sum(map(len, pos_lists))),
                         (np.repeat(np.arange(B), [len(p) for p in pos_lists]),
                          np.concatenate([np.asarray(p, np.int64) for p in pos_lists]))),
                        shape=(B, N))
    for n, skip in [(5, 0), (3, 2), (N, 0)]:
        want = _reference_negatives(model, T, pos_lists, n, skip)
        for positives in (pos_lists, padded, torch.from_numpy(padded), csr,
                          pg.Relevance(csr)):
            for bs in (1, 4, 1024):
                got = pg.mine_negatives(model, T, positives, n=n, skip_top=skip, batch_size=bs)
                assert got.shape == (B, n) and got.dtype == torch.int64
                np.testing.assert_array_equal(got.numpy(), want)
                for b in range(B):
                    assert not set(got[b].tolist()) & set(pos_lists[b])
    # n larger than what is left: -1 padding
    got = pg.mine_negatives(model, T, pos_lists, n=N)
    assert (got[-1] == -1).sum() >= N // 2


def test_mine_negatives_takes_only_positive_grades_of_a_matrix():
    """A matrix's entries <= 0 (a -1 grade: judged not relevant; an explicit 0) counted as
    positives, so those documents, the surest negatives, were never mined."""
    P, Q, Y, T = _data(10)
    model = _fit("erm", {}, P, Q, Y)
    _, top = model.search(T, topk=3)
    top = top.numpy()
    rows = np.repeat(np.arange(B), 3)
    grades = np.tile(np.array([1.0, -1.0, 0.0], np.float32), B)
    graded = sp.csr_matrix((grades, (rows, top.reshape(-1))), shape=(B, N))
    assert graded.nnz == 3 * B  # the zeros stored
    want = _reference_negatives(model, T, [[row[0]] for row in top], 4, 0)
    for positives in (graded, pg.Relevance(graded)):
        got = pg.mine_negatives(model, T, positives, n=4).numpy()
        np.testing.assert_array_equal(got, want)
        assert (got[:, 0] == top[:, 1]).all()  # the -1 graded document, mined first


def test_mine_negatives_errors():
    P, Q, Y, T = _data(10)
    xs = _fit("xs", {}, P, Q, Y)
    with pytest.raises(pg.InputError, match="n must"):
        pg.mine_negatives(xs, T, [[0]] * B, n=0)
    with pytest.raises(pg.InputError, match="skip_top"):
        pg.mine_negatives(xs, T, [[0]] * B, n=2, skip_top=-1)
    with pytest.raises(pg.InputError, match="rows"):
        pg.mine_negatives(xs, T, [[0]] * (B - 1), n=2)
    with pytest.raises(pg.InputError, match="positives"):
        pg.mine_negatives(xs, T, np.zeros((B, 2)), n=2)


def test_check_must_be_a_bool_or_none():
    """check='no' was bool('no'), a check; check='' / 0 / [] skipped it silently (NaN queries
    gave NaN scores); numpy bools stay bools."""
    P, Q, Y, T = _data(3)
    xs = _fit("xs", {}, P, Q, Y)
    a = pg.QueryAdapter(alpha=1.0, device="cpu").fit(Q, Y, P)
    for bad in ("no", "", 0, []):
        for call in (lambda c: xs.search(T * np.nan, 3, check=c),
                     lambda c: xs.score(T, np.zeros((B, 1), int), check=c),
                     lambda c: pg.mine_negatives(xs, T, [[0]] * B, n=2, check=c),
                     lambda c: a(T, check=c)):
            with pytest.raises(pg.InputError, match="check must be True, False or None"):
                call(bad)
    assert xs.search(T, 3, check=np.bool_(False))[1].shape == (B, 3)


MINE_MEMORY = r"""
import resource, numpy as np, scipy.sparse as sp, pefa_gpu as pg
from conftest import unit_rows
rng = np.random.default_rng(0)
N, B = 5000, 100
model = pg.ERM(device="cpu").fit(unit_rows(rng, N, 16))
T = unit_rows(rng, B, 16)
rows, cols = np.r_[np.zeros(2000, int), np.arange(1, B)], np.r_[np.arange(2000), np.arange(1, B)]
Y = sp.csr_matrix((np.ones(rows.size, np.float32), (rows, cols)), shape=(B, N))
pg.mine_negatives(model, T[:2], Y[:2, :], n=3)  # warm-up
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
negs = pg.mine_negatives(model, T, Y, n=3)
assert not np.isin(negs[0].numpy(), np.arange(2000)).any()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_mine_negatives_memory_does_not_grow_with_depth_times_positives():
    """Positives were compared with every candidate in a (batch, depth, P) tensor, depth
    itself n + P for every batch: one query with 2000 positives made 100 queries over 5000
    documents take 400 MB more (now ~30 MB: a binary search in the sorted positives)."""
    from conftest import run_forked
    grew_mb = int(run_forked(MINE_MEMORY).stdout.split()[-1])
    assert grew_mb < 120, grew_mb


@pytest.mark.gpu
def test_cuda_search_synchronises_once_score_and_backward_never():
    P, Q, Y, T = _data(11)
    erm = _fit("erm", {}, P, Q, Y, device="cuda")
    xs = _fit("xs", {"lam": 0.4}, P, Q, Y, device="cuda")
    xl = _fit("xl", {"k": 4, "candidates": 6}, P, Q, Y, device="cuda")
    enc = torch.nn.Linear(D, D, device="cuda", dtype=torch.float32)
    x = torch.from_numpy(T).cuda()
    pos = torch.from_numpy(np.arange(B)[:, None]).cuda()
    xl.score(x, pos)  # warm-up: caches the Y keys
    torch.cuda.synchronize()
    q = torch.nn.functional.normalize(enc(x), dim=1)
    assert q.requires_grad
    for model in (erm, xs):
        # exact backend: one synchronisation when k + TIE_MARGIN (8) < n, none otherwise
        (s, ids), syncs = cuda_syncs(lambda: model.search(q, topk=5))
        assert syncs == 1 and not s.requires_grad and ids.device.type == "cuda"
        _, syncs = cuda_syncs(lambda: model.search(q, topk=N - 8))
        assert syncs == 0
        neg, syncs = cuda_syncs(lambda: pg.mine_negatives(model, q, pos, n=3))
        assert syncs == 1  # its one search (one batch)
        cand = torch.cat([pos, neg], 1)
        xl_scores, syncs = cuda_syncs(lambda: xl.score(q, cand))
        _, search_syncs = cuda_syncs(lambda: xl.neighbours(q.detach(), 4))
        assert syncs == search_syncs and xl_scores.requires_grad  # those of its kNN search
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = torch.nn.functional.cross_entropy(model.score(q, cand) / 0.05,
                                                     torch.zeros(B, dtype=torch.long,
                                                                 device="cuda"))
            loss.backward(retain_graph=True)
            xl_scores.sum().backward(retain_graph=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert enc.weight.grad is not None


def test_ragged_positives_must_hold_integer_ids():
    """A ragged row of strings was int()'s bare ValueError, an id past int64 an OverflowError,
    and a float id was truncated silently ([[0.5]] mined as if document 0 were a positive); a row
    holding a list ([0, [1]]) was numpy's bare ValueError ('inhomogeneous shape')."""
    rng = np.random.default_rng(11)
    erm = pg.ERM(device="cpu").fit(unit_rows(rng, 30, 8))
    q = unit_rows(rng, 2, 8)
    for bad, what in [([[0, "a"], [1]], "<U"), ([[2**70], [1]], "object"),
                      ([[0.5], [1]], "float64"), ([[0, [1]], [1]], "object")]:
        with pytest.raises(pg.InputError, match=f"positives row 0 must hold integer document "
                                                f"ids, got {what}"):
            pg.mine_negatives(erm, q, bad, 3)
    assert pg.mine_negatives(erm, q, [[], [np.int32(1)]], 3).shape == (2, 3)


def test_ids_beyond_int64_are_refused_not_wrapped_to_padding():
    """uint64 2**64 - 1 became -1 (padding) in the int64 cast: a positive silently dropped, a
    score id read as 'no document'."""
    rng = np.random.default_rng(12)
    erm = pg.ERM(device="cpu").fit(unit_rows(rng, 30, 8))
    q = unit_rows(rng, 2, 8)
    with pytest.raises(pg.InputError, match="positives row 0 must hold integer document ids"):
        pg.mine_negatives(erm, q, [[2**64 - 1], [1]], 3)
    big = np.array([[2**64 - 1], [1]], dtype=np.uint64)
    with pytest.raises(pg.InputError, match=r"positives hold ids beyond int64"):
        pg.mine_negatives(erm, q, big, 3)
    with pytest.raises(pg.InputError, match=r"ids hold ids beyond int64"):
        erm.score(q, big)
    assert pg.mine_negatives(erm, q, big.clip(max=5), 3).shape == (2, 3)  # small uint64: fine


def test_mine_negatives_names_a_model_that_is_not_one():
    """It was an AttributeError ('str' object has no attribute 'as_queries')."""
    with pytest.raises(TypeError, match="mine_negatives: model must be a pefa_gpu model .*got "
                                        "str"):
        pg.mine_negatives("xs", np.ones((1, 4), np.float32), [[0]], 3)


def test_mine_negatives_through_a_query_model_uses_its_adapted_search():
    """A QueryModel (adapter + PRF over a model) was refused: it had no as_queries. Its
    negatives are the best non-positives of its own search: adapter, then PRF, then the model,
    checked against a float64 reference of those steps."""
    P, Q, Y, T = _data(13)
    erm = pg.ERM(device="cpu").fit(P)
    adapter = pg.QueryAdapter(alpha=1.0, device="cpu").fit(Q, Y, P)
    qm = pg.QueryModel(erm, adapter, pg.VectorPRF(k=2, beta=0.5))
    pos = [[0, 5], [], [7], [1, 2, 3], [9], [11]]
    neg = pg.mine_negatives(qm, T, pos, n=4).numpy()
    a = T.astype(np.float64) @ adapter.W.double().numpy()  # adapter: q W, rows normalised
    a /= np.linalg.norm(a, axis=1, keepdims=True)
    prf_ids = _top(a @ P.T.astype(np.float64), 2)
    a = a + 0.5 * P.astype(np.float64)[prf_ids].mean(1)
    order = _top(a @ P.T.astype(np.float64), N)
    want = np.stack([[j for j in row if j not in set(p)][:4] for row, p in zip(order, pos)])
    np.testing.assert_array_equal(neg, want)
    with pytest.raises(TypeError, match="VectorPRF: model must be a pefa_gpu model"):
        pg.VectorPRF()(T, qm)  # its search would adapt the PRF's queries again


def test_positives_of_no_queries_and_2_40_columns_cost_nothing():
    """Positives of shape (0, 2**40) (no data) were sorted by torch into 8 TiB (RuntimeError
    'can't allocate memory'); no ids are one column of padding, as (B, 0) already was."""
    erm = pg.ERM(device="cpu").fit(np.eye(3, dtype=np.float32))
    none = torch.zeros(0, 2**40, dtype=torch.long)
    assert pg.mine_negatives(erm, np.zeros((0, 3), np.float32), none, n=2).shape == (0, 2)
