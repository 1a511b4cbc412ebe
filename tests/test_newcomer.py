"""What a first run meets: Ctrl-C during encoding, start-up, log lines, search output with the
documents' text, NUDGE builds, messages; each through the real `pefa-gpu` command."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

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
    proc = subprocess.Popen(_command() + [str(a) for a in run] + ["--cache-dir", str(cache)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    blocked = Path(f"{log}.blocked")
    deadline = time.monotonic() + 120
    while not blocked.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert blocked.exists(), proc.communicate()[1]
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
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
                                  ["sweep", "x", "--lam", "0.5,7"], ["search"]])
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
    loud = _pefa(*run, "--verbose").stderr  # faiss is imported on this path: its lines show
    assert "faiss.loader" in loud or "faiss" not in sys.modules
