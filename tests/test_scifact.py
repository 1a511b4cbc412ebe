"""End to end on SciFact's precomputed embeddings: the published ERM baseline and PEFA's gain."""

import pytest

import pefa_gpu as pg


@pytest.fixture(scope="module")
def scifact(request):
    from conftest import SCIFACT
    if not (SCIFACT / "corpus.jsonl").exists():
        pytest.skip(f"SciFact not found at {SCIFACT}")
    ds = pg.load_beir(SCIFACT)
    P, Qall = ds.embeddings("all-MiniLM-L6-v2")
    train_rows, Ytr = ds.qrels("train")
    test_rows, Yte = ds.qrels("test")
    assert not set(train_rows) & set(test_rows)
    return P, Qall[train_rows], Ytr, Qall[test_rows], Yte


def test_erm_baseline(scifact):
    P, _, _, T, Yte = scifact
    _, ids = pg.ERM(device="cpu").fit(P).search(T, topk=100)
    res = pg.evaluate(ids, Yte, ks=(10, 100))
    assert res["recall@10"] == pytest.approx(0.7833, abs=5e-4)
    assert res["recall@100"] == pytest.approx(0.9250, abs=5e-4)
    assert res["ndcg@10"] == pytest.approx(0.645, abs=1e-3)
    assert res["n_queries"] == 300 and res["n_skipped"] == 0


def test_pefa_improves_recall(scifact):
    P, Q, Ytr, T, Yte = scifact
    erm = pg.recall_at_k(pg.ERM().fit(P).search(T, 100)[1], Yte)
    xs = pg.recall_at_k(pg.PEFAXS(lam=0.5).fit(P, Q, Ytr).search(T, 100)[1], Yte)
    xl = pg.recall_at_k(pg.PEFAXL(lam=0.5, k=16).fit(P, Q, Ytr).search(T, 100)[1], Yte)
    assert xs[10] > erm[10] + 0.05
    assert xl[10] > erm[10] + 0.02
