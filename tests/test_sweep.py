"""pefa_gpu.sweep: every grid point equals fitting it on its own, and a float64 reference."""

from __future__ import annotations

import re

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import pefa_gpu as pg
from pefa_gpu.errors import InputError
from pefa_gpu.sweep import Config, grid, sweep_search
from conftest import unit_rows

LAMS = (0.0, 0.3, 0.7, 1.0)
KS = (2, 5)


def _data(seed=0, n=60, m=40, b=12, d=8):
    rng = np.random.default_rng(seed)
    P = unit_rows(rng, n, d)
    P[7] = P[3]                       # duplicate documents: exact ties
    P[20] = P[3]
    Q = unit_rows(rng, m, d)
    Q[5] = Q[4]                       # duplicate training queries
    Y = sp.random(m, n, density=0.05, random_state=seed, format="csr", dtype=np.float32)
    Y.data[:] = 1
    Y = Y.tolil()
    Y[3, :] = 0                       # a training query with no pair
    Y[:, 7] = Y[:, 3]                 # documents 3 and 7 are equal in P and in Y: XS ties too
    Y = Y.tocsr()
    Y.eliminate_zeros()
    test = unit_rows(rng, b, d)
    test[0] = P[3]                    # a query tied between duplicates
    return P, Q, Y, test


def _topk_ref(scores, k):
    """float64 top-k, ties to the lower id: (B, k) ids and scores."""
    order = np.lexsort((np.broadcast_to(np.arange(scores.shape[1]), scores.shape), -scores),
                       axis=1)[:, :k]
    return order, np.take_along_axis(scores, order, 1)


def _xs_ref(P, Q, Y, lam):
    P, Q = P.astype(np.float64), Q.astype(np.float64)
    A = Y.T.astype(np.float64) @ Q + P
    norms = np.linalg.norm(A, axis=1, keepdims=True)
    PiA = np.where(norms > 0, A / np.where(norms > 0, norms, 1), 0)
    return lam * P + (1 - lam) * PiA


def _xl_ref(P, Q, Y, q, lam, k, kp, topk):
    """PEFA-XL in float64, one query at a time, augment_docs, knn_norm='k', rescore."""
    P, Q, q = P.astype(np.float64), Q.astype(np.float64), q.astype(np.float64)
    Qa = np.vstack([Q, P])
    Ya = sp.vstack([Y, sp.identity(P.shape[0])]).tocsr().astype(np.float64)
    out_ids, out_scores = [], []
    for x in q:
        sp_ = P @ x
        C, _ = _topk_ref(sp_[None], kp)
        N, sN = _topk_ref((Qa @ x)[None], k)
        f_knn = (sN[0] / k) @ Ya[N[0]].toarray()
        cand = sorted(set(C[0].tolist()) | set(np.nonzero(Ya[N[0]].sum(0).A1)[0].tolist()))
        fused = np.full(P.shape[0], -np.inf)
        fused[cand] = lam * sp_[cand] + (1 - lam) * f_knn[cand]
        ids, sc = _topk_ref(fused[None], topk)
        ids = np.where(np.isfinite(sc), ids, -1)
        out_ids.append(ids[0])
        out_scores.append(sc[0])
    return np.array(out_ids), np.array(out_scores)


def _check_against(ids, scores, ref_scores_full, topk, atol=1e-5):
    """ids/scores (torch) are a correct top-k of ref_scores_full (B, n) up to ``atol``."""
    ids, scores = ids.numpy(), scores.numpy()
    ref_ids, ref_sc = _topk_ref(ref_scores_full, topk)
    np.testing.assert_allclose(scores, ref_sc, atol=atol)
    got = np.take_along_axis(ref_scores_full, ids, 1)
    np.testing.assert_allclose(got, ref_sc, atol=atol)
    clear = np.abs(np.diff(np.concatenate([ref_sc, ref_sc[:, -1:] - 1], 1), axis=1)) > 1e-4
    clear &= np.concatenate([np.ones((ref_sc.shape[0], 1), bool), clear[:, :-1]], 1)
    assert (ids[clear] == ref_ids[clear]).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_sweep_equals_separate_fits_and_reference(seed):
    P, Q, Y, test = _data(seed)
    topk, kp = 10, 15
    seen = []
    for cfg, s, i in sweep_search(P, Q, Y, test, lams=LAMS, ks=KS, topk=topk, candidates=kp,
                                  device="cpu", show_progress=False):
        seen.append(cfg)
        assert s.dtype == torch.float32 and i.dtype == torch.int64 and i.shape == (12, topk)
        if cfg.method == "erm":
            s2, i2 = pg.ERM(device="cpu").fit(P).search(test, topk)
            assert torch.equal(i, i2) and torch.equal(s, s2)
            _check_against(i, s, test.astype(np.float64) @ P.T.astype(np.float64), topk)
        elif cfg.method == "xs":
            s2, i2 = pg.PEFAXS(lam=cfg.lam, device="cpu").fit(P, Q, Y).search(test, topk)
            torch.testing.assert_close(s, s2, atol=1e-5, rtol=0)
            E = _xs_ref(P, Q, Y, cfg.lam)
            _check_against(i, s, test.astype(np.float64) @ E.T, topk)
            _check_against(i2, s2, test.astype(np.float64) @ E.T, topk)
            row = i[0].tolist()
            assert 3 in row and 7 in row and row.index(3) + 1 == row.index(7)  # tie: lower id first
            
        else:
            model = pg.PEFAXL(lam=cfg.lam, k=cfg.k, search_params=pg.XLSearchParams(
                candidates=kp), device="cpu").fit(P, Q, Y)
            s2, i2 = model.search(test, topk)
            assert torch.equal(i, i2), cfg
            torch.testing.assert_close(s, s2, atol=1e-6, rtol=0)
            ref_ids, ref_sc = _xl_ref(P, Q, Y, test, cfg.lam, cfg.k, kp, topk)
            np.testing.assert_allclose(s.numpy(), ref_sc, atol=1e-5)
            finite = np.isfinite(ref_sc)
            assert (i.numpy()[~finite] == -1).all()
    assert seen == grid(("erm", "xs", "xl"), LAMS, KS)


@pytest.mark.parametrize("cells", [2048, 256, 2**22])
def test_xs_two_passes_on_larger_blocks_match(cells):
    """The chunked two-pass XS path with several chunks and query batches."""
    from pefa_gpu.sweep import _xs_all_lams
    rng = np.random.default_rng(3)
    P, Q = unit_rows(rng, 500, 16), unit_rows(rng, 200, 16)
    Y = sp.random(200, 500, density=0.01, random_state=3, format="csr", dtype=np.float32)
    test = unit_rows(rng, 33, 16)
    xs = pg.PEFAXS(device="cpu").fit(P, Q, Y)
    res = _xs_all_lams(xs, torch.from_numpy(test), (0.2, 0.9), 20, block_cells=cells)
    for lam, (s, i) in zip((0.2, 0.9), res):
        E = _xs_ref(P, Q, Y, lam)
        _check_against(i, s, test.astype(np.float64) @ E.T, 20)


def test_xl_rescore_false_and_knn_none_match_separate_fits():
    P, Q, Y, test = _data(4)
    for kw in ({"rescore": False}, {"knn_norm": "none"}, {"augment_docs": False}):
        out = list(sweep_search(P, Q, Y, test, methods=("xl",), lams=(0.2, 0.6), ks=(3, 6),
                                topk=8, candidates=10, device="cpu", show_progress=False, **kw))
        for cfg, s, i in out:
            m = pg.PEFAXL(lam=cfg.lam, k=cfg.k, search_params=pg.XLSearchParams(candidates=10),
                          device="cpu", **kw).fit(P, Q, Y)
            s2, i2 = m.search(test, 8)
            assert torch.equal(i, i2), (cfg, kw)
            torch.testing.assert_close(s, s2, atol=1e-6, rtol=0)


def test_sweep_result_metrics_and_table():
    P, Q, Y, test = _data(2)
    Yt = sp.random(12, 60, density=0.05, random_state=9, format="csr", dtype=np.float32)
    Yt.data[:] = 1
    res = pg.sweep(P, Q, Y, test, Yt, lams=(0.5,), ks=(4,), device="cpu", show_progress=False)
    assert [r["method"] for r in res.rows] == ["erm", "xs", "xl"]
    erm_ids = pg.ERM(device="cpu").fit(P).search(test, 100)[1]
    assert res.rows[0]["recall@10"] == pg.evaluate(erm_ids, Yt)["recall@10"]
    table = res.to_markdown()
    assert table.count("\n") == 5 and "| XL | 0.5 | 4 |" in table
    assert set(res.timings) == {"erm", "xs", "xl"}
    assert res.best("recall@100")["recall@100"] == max(r["recall@100"] for r in res.rows)
    # a lone metric name was a column per letter ('| r | e | c | ...'); best('lam') / ('k')
    # compared None with a float (bare TypeError), best(['recall@10']) was 'unhashable type';
    # no rows at all said 'no rows for method None'
    assert res.to_markdown("recall@10") == res.to_markdown(["recall@10"])
    for bad in ("lam", "k", "method", ["recall@10"]):
        with pytest.raises(InputError, match=r"metric .* is not one of \['mrr@10'"):
            res.best(bad)
    with pytest.raises(InputError, match="no rows$"):
        pg.SweepResult([], {}).best()


def test_grid_validation():
    P, Q, Y, test = _data(0)
    with pytest.raises(InputError, match="methods"):
        list(sweep_search(P, Q, Y, test, methods=("xx",)))
    with pytest.raises(InputError, match="lam"):
        list(sweep_search(P, Q, Y, test, lams=(1.5,)))
    with pytest.raises(InputError, match="k"):
        list(sweep_search(P, Q, Y, test, ks=(0,)))
    assert grid("erm,xs", (0.5,), ()) == [Config("erm"), Config("xs", 0.5)]


def test_no_test_queries_give_empty_results_for_every_config():
    P, Q, Y, _ = _data(5)
    none = np.zeros((0, P.shape[1]), np.float32)
    out = list(sweep_search(P, Q, Y, none, lams=(0.3, 0.8), ks=(2, 4), topk=6, candidates=20,
                            device="cpu", show_progress=False))
    assert [c for c, _, _ in out] == grid(lams=(0.3, 0.8), ks=(2, 4))
    for _, s, i in out:
        assert s.shape == i.shape == (0, 6)
        assert s.dtype == torch.float32 and i.dtype == torch.int64


def test_a_repeated_lam_or_k_counts_once():
    """A repeat made XS / XL yield results of twice the queries ('ids has 10 rows but Y_test
    has 5 queries' in sweep; pefa-gpu eval --k 4,4 failed the same way)."""
    P, Q, Y, test = _data(3)
    Yt = sp.csr_matrix((np.ones(12, np.float32), (np.arange(12), np.arange(12))), shape=(12, 60))
    once = pg.sweep(P, Q, Y, test, Yt, lams=(0.5, 0.2), ks=(4,), device="cpu",
                    show_progress=False)
    twice = pg.sweep(P, Q, Y, test, Yt, lams=(0.5, 0.2, 0.5, 1 / 2), ks=(4, np.int64(4)),
                     device="cpu", show_progress=False)
    assert twice.rows == once.rows
    assert grid("xl", (0.5, 0.5), (4, 4)) == [Config("xl", 0.5, 4)]
    # -0.0 (first of -0.0 == 0.0) was kept: labels and tables showed 'λ=-0'
    assert [c.label() for c in grid("xs", (-0.0, 0.0), ())] == ["XS λ=0"]


def test_sweep_refuses_metric_ks_and_grids_that_are_not_sequences_of_positive_ints():
    """metric_ks=[] was max()'s bare ValueError, metric_ks=None and lams=0.5 / ks=4 bare
    TypeErrors naming no argument."""
    P, Q, Y, test = _data()
    y_test = sp.csr_matrix(np.eye(test.shape[0], P.shape[0], dtype=np.float32))
    for kw, match in [({"metric_ks": []}, "ks must be positive integers, got ()"),
                      ({"metric_ks": None}, "ks must be positive integers, got None"),
                      ({"metric_ks": [0]}, "ks must be positive integers, got (0,)"),
                      # was sweep_search's 'topk=20000 but ...', a name the caller never gave
                      ({"metric_ks": [10, 20000]}, "metric_ks: k=20000 but there are only"),
                      ({"lams": 0.5}, "lams and ks must be sequences"),
                      ({"ks": 4}, "lams and ks must be sequences")]:
        with pytest.raises(InputError, match=re.escape(match)):
            pg.sweep(P, Q, Y, test, y_test, device="cpu", show_progress=False, **kw)


def test_sweep_bounds_xs_topk_and_clamps_xl_candidates_as_the_models_do():
    """XS' two-pass path took topk=10**9 unbounded (a (B, topk) table: 24 GB asked for); XL's
    passage search refused candidates beyond max(n, 10,000) as 'k=...', which PEFAXL clamps."""
    P, Q, Y, test = _data(0)
    with pytest.raises(InputError, match="topk=1000000000"):
        list(sweep_search(P, Q, Y, test, methods=("xs",), lams=(0.5,), topk=10**9,
                          device="cpu", show_progress=False))
    cands = 10**6
    out = list(sweep_search(P, Q, Y, test, methods=("erm", "xl"), lams=(0.5,), ks=(4,),
                            topk=10, candidates=cands, device="cpu", show_progress=False))
    model = pg.PEFAXL(lam=0.5, k=4, search_params=pg.XLSearchParams(candidates=cands),
                      device="cpu").fit(P, Q, Y)
    s2, i2 = model.search(test, 10)
    assert torch.equal(out[1][2], i2)
    torch.testing.assert_close(out[1][1], s2, atol=1e-6, rtol=0)
    assert torch.equal(out[0][2], pg.ERM(device="cpu").fit(P).search(test, 10)[1])


def test_sweep_and_tune_name_methods_that_are_not_names_and_check_y_test_first():
    """methods=None / 5 were bare TypeErrors ('NoneType' object is not iterable; tune: 'Value
    after * must be an iterable'); a Y_test of more columns than documents was scored as if
    it fitted (its extra documents counted as missed), of other rows refused after the first
    fit only. fit_config('xl') was an AttributeError ('str' has no attribute 'method')."""
    P, Q, Y, test = _data(0)
    kw = dict(device="cpu", show_progress=False)
    for bad in (None, 5, [1, 2]):
        with pytest.raises(InputError, match=r"methods must be a non-empty subset.*got"):
            pg.sweep(P, Q, Y, test, sp.csr_matrix((12, 60)), methods=bad, **kw)
        with pytest.raises(InputError, match=r"methods must be a non-empty subset.*got"):
            pg.tune(P, Q, Y, methods=bad, **kw)
    y_test = sp.csr_matrix((np.ones(12), (np.arange(12), np.arange(12) + 50)), shape=(12, 63))
    with pytest.raises(InputError, match="Y_test has 63 columns .* but there are 60 document"):
        pg.sweep(P, Q, Y, test, y_test, methods=("erm",), metric_ks=(5,), **kw)
    with pytest.raises(InputError, match="Y_test has 11 rows .* but there are 12 query"):
        pg.sweep(P, Q, Y, test, y_test[:11, :60], methods=("erm",), metric_ks=(5,), **kw)
    with pytest.raises(TypeError, match="config must be a pefa_gpu.Config"):
        pg.fit_config("xl", P, Q, Y, device="cpu")
    assert pg.sweep(P, Q, Y, test, y_test[:, :60], methods=iter(["erm"]), metric_ks=(5,),
                    **kw).rows[0]["method"] == "erm"


def test_numpy_scalar_lams_are_taken_as_the_params_take_them():
    """PEFAXS(lam=np.float32(0.5)) and XLParams take numpy scalars; a grid of them was refused
    with 'lam must be a number in [0, 1], got np.float32(0.5)' (sweep, tune, fuse_grid)."""
    P, Q, Y, test = _data(1)
    lam = np.float32(0.5)
    assert grid("xs,xl", (lam,), (np.int32(4),)) == [Config("xs", 0.5), Config("xl", 0.5, 4)]
    xl = pg.PEFAXL(k=4, device="cpu").fit(P, Q, Y)
    q = xl.as_queries(test)
    erm, knn = xl.index.search(q, 20), xl.neighbours(q, 4)
    fused = xl.fuse_grid(q, erm, knn, (lam,), (4,), 10)
    assert torch.equal(fused[(0.5, 4)][1], xl.fuse(q, erm, knn, 10, lam=0.5)[1])


def test_markdown_table_names_metrics_that_are_not_names():
    """to_markdown(None) / (5) were '*''s bare TypeError ('Value after * must be an iterable'),
    [['recall@10']] 'unhashable type: list'; none named metrics."""
    rows = [{"method": "erm", "lam": None, "k": None, "recall@10": 0.5}]
    res = pg.SweepResult(rows, {})
    for bad in (None, 5, [["recall@10"]], [1]):
        with pytest.raises(InputError, match="metrics must be metric names"):
            res.to_markdown(bad)
    assert "| ERM |  |  | 0.5000 |" in res.to_markdown(("recall@10",))
    # a metric no row holds (a typo, or a k not evaluated) was printed as a blank column
    with pytest.raises(InputError, match=r"metric 'recall@5' is in no row .* \['recall@10'\]"):
        res.to_markdown(("recall@10", "recall@5"))


def test_sweep_search_checks_show_progress_and_timings_first():
    """show_progress='no' showed the bar; timings=[] was an AttributeError ('list' object has no
    attribute 'get') after the first method's fit and search."""
    P, Q, Y, test = _data(1)
    for kw, match in ((dict(show_progress="no"), "show_progress must be True or False"),
                      (dict(timings=[]), "timings must be a dict")):
        with pytest.raises(InputError, match=match):
            next(sweep_search(P, Q, Y, test, "erm", device="cpu", **kw))
    # candidates='a' with erm and xl: a bare TypeError ('>=' between str and int)
    for bad in ("a", 0, None):
        with pytest.raises(InputError, match="candidates must be a positive integer"):
            next(sweep_search(P, Q, Y, test, "erm,xl", device="cpu", candidates=bad))


def test_writing_erm_results_leaves_xl_the_shared_passage_search():
    """With candidates == topk ERM's yielded scores / ids were XL's passage search itself (the
    exact backend searches once for both): a caller filling them changed XL's results."""
    P, Q, Y, test = _data(0)

    def xl_ids(write):
        for cfg, s, i in sweep_search(P, Q, Y, test, "erm,xl", (0.5,), (4,), topk=10,
                                      candidates=10, device="cpu", show_progress=False):
            if cfg.method == "xl":
                return i
            if write:
                s.fill_(0.0), i.fill_(-1)

    assert torch.equal(xl_ids(True), xl_ids(False))


def test_xs_queries_of_another_dimension_and_sweeps_own_settings_are_named():
    """XS on the exact backend multiplied queries of another dimension with P: torch's bare
    'mat1 and mat2 shapes cannot be multiplied'; sweep(..., topk=5) was Python's 'got multiple
    values for keyword argument'."""
    P, Q, Y, test = _data(2)
    with pytest.raises(InputError, match=r"queries has dimension 5, expected 8"):
        next(sweep_search(P, Q, Y, test[:, :5], "xs", (0.5,), device="cpu",
                          show_progress=False))
    Yt = sp.csr_matrix((np.ones(12, np.float32), (np.arange(12), np.arange(12))), shape=(12, 60))
    for name in ("topk", "timings"):
        with pytest.raises(InputError, match=f"sweep sets {name} itself"):
            pg.sweep(P, Q, Y, test, Yt, "erm", device="cpu", **{name: None})
