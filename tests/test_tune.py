"""pefa_gpu.tune: query-disjoint seeded split, never below ERM on validation, refit."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

import pefa_gpu as pg
from pefa_gpu.errors import InputError
from pefa_gpu.sweep import Config
from pefa_gpu.tune import per_query_recall, split_queries, tune
from textdata import bow_unit, write_beir

SMALL = dict(lams=(0.2, 0.5, 0.8), ks=(4, 8), device="cpu", show_progress=False,
             candidates=20)


def _arrays(root):
    ds = pg.load_beir(root)
    P = bow_unit(ds.corpus_texts).astype(np.float32)
    Qa = bow_unit(ds.query_texts).astype(np.float32)
    tr, Ytr = ds.qrels("train")
    te, Yte = ds.qrels("test")
    return P, Qa[tr], Ytr, Qa[te], Yte


def _val_objective(res, cfg):
    for r in res.validation.rows:
        if (r["method"], r["lam"], r["k"]) == (cfg.method, cfg.lam, cfg.k):
            return r["objective"]
    assert cfg.method == "erm"
    return res.erm_objective


def test_split_is_seeded_and_disjoint():
    a_fit, a_val = split_queries(50, 0.2, seed=3)
    b_fit, b_val = split_queries(50, 0.2, seed=3)
    assert np.array_equal(a_val, b_val) and a_val.size == 10
    assert not set(a_fit) & set(a_val) and set(a_fit) | set(a_val) == set(range(50))
    assert not np.array_equal(split_queries(50, 0.2, seed=4)[1], a_val)
    with pytest.raises(InputError):
        split_queries(1)
    for bad in (1.5, 0, True, "0.2", float("nan")):  # a string or bool: the same InputError
        with pytest.raises(InputError, match="val_fraction"):
            split_queries(10, bad)
    with pytest.raises(InputError, match="seed"):
        split_queries(10, 0.2, seed=1.5)


def test_per_query_recall_matches_loop():
    rng = np.random.default_rng(0)
    ids = rng.integers(-1, 30, size=(20, 12))
    ids[0, :3] = [5, 5, 5]                               # repeats count once
    Y = sp.random(20, 30, density=0.1, random_state=1, format="lil")
    Y[1, :] = 0                                          # no relevant: NaN
    Y = Y.tocsr()
    got = per_query_recall(ids, Y, (5, 10))
    dense = Y.toarray() > 0
    for i in range(20):
        rel = set(np.nonzero(dense[i])[0])
        if not rel:
            assert np.isnan(got[i])
            continue
        exp = np.mean([len(rel & set(ids[i, :k]) - {-1}) / len(rel) for k in (5, 10)])
        assert got[i] == pytest.approx(exp)


def test_tune_picks_pefa_when_training_signal_helps(tmp_path):
    P, Q, Y, Qt, Yt = _arrays(write_beir(tmp_path / "d", n_topics=8, docs_per_topic=6,
                                         train_per_doc=3, seed=1, mismatch=True))
    res = tune(P, Q, Y, seed=0, methods=("erm", "xs", "xl"), **SMALL)
    spaced = tune(P, Q, Y, seed=0, methods="xs, XL", **SMALL)  # as sweep reads the string
    assert spaced.chosen == res.chosen and spaced.validation.rows == res.validation.rows
    assert res.n_fit + res.n_val == Q.shape[0]
    assert _val_objective(res, res.chosen) >= res.erm_objective
    assert res.chosen.method in ("xs", "xl"), res.reason
    assert res.best_objective > res.erm_objective
    assert len(res.validation.rows) == 1 + 3 + 6
    model = pg.fit_config(res.chosen, P, Q, Y, device="cpu", candidates=20)
    assert isinstance(model, pg.PEFAXS if res.chosen.method == "xs" else pg.PEFAXL)


@pytest.mark.parametrize("kind", ["noise", "uncovered"])
def test_tune_never_below_erm_on_validation(tmp_path, kind):
    kw = {"noise_train": True} if kind == "noise" else {"cover_test": False}
    P, Q, Y, Qt, Yt = _arrays(write_beir(tmp_path / kind, seed=2, **kw))
    for seed in range(3):
        res = tune(P, Q, Y, seed=seed, **SMALL)
        assert _val_objective(res, res.chosen) >= res.erm_objective
        if res.chosen.method == "erm":
            assert res.chosen == Config("erm", 1.0, None)
            assert "ERM (λ = 1) is kept" in res.reason


def test_noise_keeps_erm(tmp_path):
    """Labels that are pure noise: nothing beats ERM by more than chance, ERM is kept."""
    P, Q, Y, Qt, Yt = _arrays(write_beir(tmp_path / "n", n_topics=10, docs_per_topic=10,
                                         seed=2, noise_train=True))
    for seed in range(3):
        res = tune(P, Q, Y, seed=seed, **SMALL)
        assert res.chosen.method == "erm", res.reason


def test_min_z_makes_it_conservative(tmp_path):
    P, Q, Y, Qt, Yt = _arrays(write_beir(tmp_path / "d", n_topics=8, docs_per_topic=6,
                                         train_per_doc=3, seed=1, mismatch=True))
    res = tune(P, Q, Y, seed=0, min_z=1e9, **SMALL)
    assert res.chosen.method == "erm" and "standard errors" in res.reason


def test_bad_metric():
    with pytest.raises(InputError, match="recall@K"):
        tune(np.eye(3, dtype=np.float32), np.eye(3, dtype=np.float32),
             sp.identity(3, format="csr"), metric="ndcg@10")
    from pefa_gpu.tune import parse_metric
    for k in ("1" * 5000, "0" * 4400 + "1"):  # were int()'s ValueError: 'Exceeds the limit (4300
        with pytest.raises(InputError, match="recall@K terms"):  # digits) ...', no name
            parse_metric(f"recall@10,recall@{k}")
    assert parse_metric("recall@000000000000000010") == (10,)


def test_match_coverage_lowers_validation_coverage_for_cold_test_queries(tmp_path):
    from pefa_gpu.tune import match_coverage
    P, Q, Y, Qt, Yt = _arrays(write_beir(tmp_path / "c", n_topics=8, docs_per_topic=6,
                                         seed=3, cover_test=False))
    fit, val = split_queries(Q.shape[0], 0.3, seed=0)
    # test queries aimed at documents nobody trained on: their plain top-1 are those documents
    cold_docs = np.setdiff1d(np.arange(P.shape[0]), Y.csr.indices)
    queries = P[cold_docs[:10]]
    y_fit, info = match_coverage(P, Q[val], Y.rows(fit), Y.rows(val), Y, queries, seed=0,
                                 device="cpu")
    assert info["proxy_test"] == 0.0 and info["test_coverage_estimate"] == 0.0
    assert info["matched_coverage"] <= info["test_coverage_estimate"] + 1e-9
    assert info["val_coverage"] > 0.5
    # no fitting pair is left on a validation document
    yv = Y.rows(val).csr
    assert not set(y_fit.csr.indices) & set(yv.indices)
    # queries like the training ones: nothing changes
    warm_docs = np.unique(Y.csr.indices)
    same, info2 = match_coverage(P, Q[val], Y.rows(fit), Y.rows(val), Y, P[warm_docs],
                                 seed=0, device="cpu")
    assert info2["matched_coverage"] == info2["val_coverage"]
    assert (same.csr != Y.rows(fit).csr).nnz == 0


def test_tune_with_cold_test_queries_keeps_erm(tmp_path):
    """Training pairs cover half of each topic's documents; the test queries look for the
    other half: the coverage estimate drops and the choice does not lose to ERM on test."""
    P, Q, Y, Qt, Yt = _arrays(write_beir(tmp_path / "d", n_topics=8, docs_per_topic=6,
                                         train_per_doc=3, seed=1, cover_test=False))
    res = tune(P, Q, Y, seed=0, test_queries=Qt, **SMALL)
    assert res.coverage["test_coverage_estimate"] < res.coverage["val_coverage"]
    assert _val_objective(res, res.chosen) >= res.erm_objective
    model = pg.fit_config(res.chosen, P, Q, Y, device="cpu", candidates=20)
    erm = pg.ERM(device="cpu").fit(P)
    r_model = pg.evaluate(model.search(Qt, 100)[1], Yt)["recall@10"]
    r_erm = pg.evaluate(erm.search(Qt, 100)[1], Yt)["recall@10"]
    assert r_model >= r_erm - 1e-12, res.reason


def test_tune_refuses_a_negative_seed_and_a_min_z_that_is_not_a_number():
    """seed=-1 was numpy's bare 'expected non-negative integer' ValueError; min_z=NaN was
    taken (every gain then 'not significant'), min_z='x' a bare TypeError."""
    rng = np.random.default_rng(0)
    P, Q = (rng.standard_normal((n, 8)).astype(np.float32) for n in (30, 20))
    Y = sp.csr_matrix((np.ones(20, np.float32), (np.arange(20), np.arange(20))), shape=(20, 30))
    for kw, match in [({"seed": -1}, "seed must be an int >= 0, got -1"),
                      ({"min_z": float("nan")}, "min_z must be a finite number >= 0, got nan"),
                      ({"min_z": "x"}, "min_z must be a finite number >= 0, got 'x'"),
                      ({"min_z": -1.0}, "min_z must be a finite number >= 0")]:
        with pytest.raises(InputError, match=match):
            tune(P, Q, Y, **{**SMALL, **kw})
    with pytest.raises(InputError, match="seed must be an int >= 0"):
        split_queries(10, 0.2, seed=-1)


def test_tune_refuses_a_validation_split_without_a_relevant_document():
    """Every held-out query without a pair gave NaN objectives (numpy's 'mean of empty slice'
    warnings) and the reason 'no configuration beats ERM ... the training signal does not
    help', which nothing had measured."""
    rng = np.random.default_rng(0)
    P, Q = (rng.standard_normal((n, 8)).astype(np.float32) for n in (30, 20))
    fit_rows, _ = split_queries(20, 0.2, seed=0)
    Y = sp.csr_matrix((np.ones(fit_rows.size, np.float32), (fit_rows, fit_rows)), shape=(20, 30))
    with pytest.raises(InputError, match="none of the 4 held-out training queries has a rel"):
        tune(P, Q, Y, **SMALL)


def test_metric_ks_and_relevance_widths_are_checked():
    """metric='recall@²' was int()'s bare ValueError (str.isdigit takes '²'); per_query_recall
    with ks=() divided by zero and with ks=(0,) / (-1,) cut the ranks silently; a Y with fewer
    columns than P's documents was refused as 'ids contain document 19 but Y_test has 5
    documents'; match_coverage with a y_fit narrower than P was numpy's IndexError."""
    rng = np.random.default_rng(0)
    P, Q = (rng.standard_normal((n, 8)).astype(np.float32) for n in (20, 30))
    P /= np.linalg.norm(P, axis=1, keepdims=True)
    Y = sp.csr_matrix((np.ones(30, np.float32), (np.arange(30), np.arange(30) % 20)))
    with pytest.raises(InputError, match="recall@K terms"):
        tune(P, Q, Y, metric="recall@²", **SMALL)
    for ks in ((), (0,), (-1,), None):
        with pytest.raises(InputError, match="ks must be positive integers"):
            per_query_recall(np.array([[3, 0]]), sp.csr_matrix(np.eye(1, 5)), ks)
    with pytest.raises(InputError, match="ids have 2 ranks per query, fewer than k = 5"):
        per_query_recall(np.array([[3, 0]]), sp.csr_matrix(np.eye(1, 5)), (1, 5))  # was 1.0
    for ids, match in (([[3], [0]], "ids has 2 rows but Y has 1 queries"),  # were named Y_test,
                       ([[7]], "ids contain document 7 but Y has 5 documents")):  # evaluate's
        with pytest.raises(InputError, match=match):
            per_query_recall(np.array(ids), sp.csr_matrix(np.eye(1, 5)), (1,))
    with pytest.raises(InputError, match="Y contains NaN"):
        per_query_recall(np.array([[0]]), sp.csr_matrix([[np.nan]]), (1,))
    with pytest.raises(InputError, match="Y has 5 columns .documents. but there are 20"):
        tune(P, Q, Y[:, :5], **SMALL)
    from pefa_gpu.tune import match_coverage
    for y_fit, y_val, match in [(Y[:20, :5], Y[20:], "y_fit has 5 columns"),
                                (Y[:20], Y[20:], "y_val has 10 rows .queries. but there are 5")]:
        with pytest.raises(InputError, match=match):
            match_coverage(P, Q[20:25], y_fit, y_val, Y, Q[:3], device="cpu")


def test_a_metric_k_beyond_what_a_search_returns_is_named_as_the_metric():
    """recall@20000 over 3 documents was sweep's 'topk=20000 but there are only 3 documents',
    after the coverage match had searched: a topk the caller never gave."""
    eye = np.eye(3, dtype=np.float32)
    with pytest.raises(InputError, match=r"^metric 'recall@10,recall@20000': K=20000 but there "
                                         r"are only 3 documents to rank: ask for at most 10000"):
        tune(eye, eye, sp.identity(3, format="csr"), metric="recall@10,recall@20000",
             test_queries=eye)
    res = tune(eye, eye, sp.identity(3, format="csr"), methods=("xs",), lams=(0.5,),
               metric="recall@10000")  # padded ranks, as before
    assert res.chosen.method in ("erm", "xs")
    res = tune(eye.tolist(), eye, sp.identity(3, format="csr"), methods=("xs",), lams=(0.5,))
    assert res.chosen.method in ("erm", "xs")  # P without a shape: checked by the search


def test_test_queries_are_named_and_none_of_them_is_refused():
    """test_queries of another dimension (or NaN) were named 'queries'; none at all gave a test
    coverage of 0, every fitting pair dropped and ERM kept 'as the training pairs do not reach
    the documents the test queries look for', which nothing had measured."""
    rng = np.random.default_rng(0)
    P, Q = (rng.standard_normal((n, 8)).astype(np.float32) for n in (30, 40))
    P /= np.linalg.norm(P, axis=1, keepdims=True)
    Y = sp.csr_matrix((np.ones(40, np.float32), (np.arange(40), np.arange(40) % 30)))
    for T, match in ((np.ones((3, 9), np.float32), "test_queries has dimension 9, expected 8"),
                     (np.full((2, 8), np.nan, np.float32), "test_queries contains NaN"),
                     (np.zeros((0, 8), np.float32), "test_queries is empty")):
        with pytest.raises(InputError, match=match):
            tune(P, Q, Y, test_queries=T, **SMALL)


def test_match_coverage_checks_q_val_rows_and_seed():
    """A q_val list of other length than y_val's rows was taken (its proxy from other queries);
    seed=1.5 / -2 were numpy's bare TypeError / ValueError, and only when pairs were dropped."""
    from pefa_gpu.tune import match_coverage
    rng = np.random.default_rng(0)
    P, Q = (rng.standard_normal((n, 8)).astype(np.float32) for n in (20, 30))
    P /= np.linalg.norm(P, axis=1, keepdims=True)
    Y = sp.csr_matrix((np.ones(30, np.float32), (np.arange(30), np.arange(30) % 20)))
    with pytest.raises(InputError, match="y_val has 10 rows .queries. but there are 9"):
        match_coverage(P, Q[20:29].tolist(), Y[:20], Y[20:], Y, -P, device="cpu")
    for seed in (1.5, -2, "a"):
        with pytest.raises(InputError, match="seed must be an int >= 0"):
            match_coverage(P, Q[20:], Y[:20], Y[20:], Y, -P, seed=seed, device="cpu")
