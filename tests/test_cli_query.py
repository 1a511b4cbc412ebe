"""The query side (adapter, prf, adapter+xs) through the pefa-gpu command."""

from __future__ import annotations

import json

import numpy as np
import pytest

import pefa_gpu as pg
from pefa_gpu.builds import load_build
from pefa_gpu.cli import main
from pefa_gpu.methods import REGISTRY
from pefa_gpu.sweep import Config
from test_cli import _run, data  # noqa: F401 (data: the toy BEIR folder fixture)
from textdata import bow_unit


def _arrays(root):
    ds = pg.load_beir(root)
    P, Qa = ds.embeddings("bow")
    tr, Ytr = ds.qrels("train")
    te, Yte = ds.qrels("test", keep_empty=True)
    return P, Qa[tr], Ytr, Qa[te], Yte


def test_eval_query_methods_equal_the_library(data, tmp_path, capsys):
    out_json = tmp_path / "eval.json"
    _run(capsys, "eval", data, "--embeddings", "bow", "--methods", "erm,adapter,prf,adapter+xs",
         "--lam", "0.4", "--device", "cpu", "--json", out_json, "-q")
    rows = json.loads(out_json.read_text())["results"]
    assert [(r["method"], r["lam"]) for r in rows] == [
        ("erm", None), ("adapter", None), ("prf", None), ("adapter+xs", 0.4)]
    P, Q, Y, T, Yt = _arrays(data)
    for r in rows:
        model = pg.fit_config(Config(r["method"], r["lam"]), P, Q, Y, device="cpu")
        want = pg.evaluate(model.search(T, 100)[1], Yt)
        assert r["recall@10"] == pytest.approx(want["recall@10"], abs=1e-12)
        assert r["ndcg@10"] == pytest.approx(want["ndcg@10"], abs=1e-12)
    assert rows[1]["recall@10"] != rows[0]["recall@10"]  # the adapter changes the ranking


def test_tune_chooses_among_every_family(data, tmp_path, capsys):
    out_json = tmp_path / "tune.json"
    _run(capsys, "tune", data, "--embeddings", "bow", "--lam", "0.3,0.7", "--k", "4",
         "--candidates", "30", "--device", "cpu", "--json", out_json, "-q")
    res = json.loads(out_json.read_text())
    assert {r["method"] for r in res["validation"]} == set(REGISTRY)
    erm = next(r for r in res["validation"] if r["method"] == "erm")["objective"]
    chosen = [r["objective"] for r in res["validation"]
              if (r["method"], r["lam"], r["k"]) == tuple(res["chosen"].values())]
    assert chosen[0] >= erm


def test_build_and_search_adapter_xs(data, tmp_path, capsys):
    model_dir = tmp_path / "model"
    _run(capsys, "build", data, "--method", "adapter+xs", "--lam", "0.3", "--model",
         "textdata:BowEncoder", "--cache-dir", tmp_path / "c", "--device", "cpu", "--out",
         model_dir, "-q")
    model, doc_ids, info = load_build(model_dir, device="cpu")
    assert info["method"] == "adapter+xs" and isinstance(model, pg.QueryModel)
    assert isinstance(model.model, pg.PEFAXS) and model.model.params.lam == 0.3
    P, Q, Y, _, _ = _arrays(data)
    ref = pg.fit_config(Config("adapter+xs", 0.3), P, Q, Y, device="cpu")
    # (the build encoded the texts; the precomputed "bow" embeddings differ in the last bits)
    np.testing.assert_allclose(model.adapter.W.numpy(), ref.adapter.W.numpy(), atol=1e-5)
    assert model.adapter.fitted_alpha == ref.adapter.fitted_alpha
    text = pg.load_beir(data).corpus_texts[4]
    out = _run(capsys, "search", model_dir, text, "--topk", "3", "--format", "json",
               "--device", "cpu", "--model", "textdata:BowEncoder", "--cache-dir",
               tmp_path / "c", "-q")
    _, ids = ref.search(bow_unit([text]).astype(np.float32), 3)
    assert [r["doc_id"] for r in json.loads(out.out)[0]["results"]] == \
        [doc_ids[int(j)] for j in ids[0]]
    code = main(["search", str(model_dir), text, "--candidates", "5", "--device", "cpu",
                 "--model", "textdata:BowEncoder", "--cache-dir", str(tmp_path / "c"), "-q"])
    assert code == 2 and "--candidates: no effect on this adapter+xs build" in \
        capsys.readouterr().err  # was an AttributeError: QueryModel has no SearchParams


@pytest.mark.parametrize("argv", [
    ["eval", "--methods", "adapter,prf", "--lam", "0.5"],
    ["eval", "--methods", "adapter", "--no-augment"],
    ["eval", "--methods", "erm,prf", "--ray", "local"],
    ["build", "--method", "prf", "--lam", "0.3", "--out", "m"],
    ["eval", "--methods", "adapter+xx"],
])
def test_options_the_query_side_does_not_use_are_refused(data, tmp_path, capsys, argv):
    argv = [a if a != "m" else str(tmp_path / "m") for a in argv]
    with pytest.raises(SystemExit) if "adapter+xx" in argv else _nothing():
        assert main([argv[0], str(data), "--embeddings", "bow", "-q", *argv[1:]]) == 2
    assert "error" in capsys.readouterr().err


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
