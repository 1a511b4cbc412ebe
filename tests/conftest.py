"""Shared fixtures: seeded random data, the SciFact directory, device parametrisation."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

if not torch.cuda.is_available():  # Triton kernels (tests marked triton) run in Triton's
    os.environ.setdefault("TRITON_INTERPRET", "1")  # interpreter; read when triton is imported

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
SHARED = Path(os.environ.get("PEFA_SHARED", ROOT.parent / "shared"))
SCIFACT = SHARED / "datasets" / "scifact"

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test without the ``gpu`` marker means the CPU: there the default device (device=None,
    CUDA when torch sees one) is the CPU, fixtures included, so that a GPU machine runs it as
    CI does (and a CPU result's ``.numpy()`` works)."""
    pin = pytest.MonkeyPatch()
    if "gpu" not in item.keywords:
        pin.setattr(torch.cuda, "is_available", lambda: False)
    try:
        yield
    finally:
        pin.undo()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def scifact_dir() -> Path:
    if not (SCIFACT / "corpus.jsonl").exists():
        pytest.skip(f"SciFact not found at {SCIFACT} (set PEFA_SHARED to the shared/ folder)")
    return SCIFACT


def run_python(*argv, env: dict | None = None, returncode: int | None = 0,
               timeout: float = 300, cwd=None) -> subprocess.CompletedProcess:
    """``python *argv`` (``"-c", code, args...``, a script or ``"-m", module``) in a fresh
    interpreter that imports this checkout and tests/ first, with ``env`` over os.environ; text
    output captured. Asserts the exit status is ``returncode`` (None: unchecked)."""
    path = os.pathsep.join(filter(None, [str(ROOT), str(TESTS), os.environ.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": path, **(env or {})}, timeout=timeout,
                         cwd=cwd)
    assert returncode in (None, res.returncode), (res.returncode, res.stdout[-2000:],
                                                  res.stderr[-3000:])
    return res


def run_forked(code: str, *args, returncode: int | None = 0, timeout: float = 120
               ) -> subprocess.CompletedProcess:
    """``python -c code *args`` in a child forked from a server that imported torch, faiss and
    pefa_gpu once (CUDA untouched): a crash stays in the child, without a fresh interpreter's
    ~3 s of imports. Not for what a fresh interpreter imports, nor for environment variables
    read at import."""
    import multiprocessing
    import tempfile

    import forked_child

    forks = multiprocessing.get_context("forkserver")
    forks.set_forkserver_preload(["torch", "faiss", "pefa_gpu", "pefa_gpu.index", "forked_child"])
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        child = forks.Process(target=forked_child.run, args=(
            code, list(map(str, args)), out, err, dict(os.environ), os.getcwd()))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(["-c", code], timeout)
        res = subprocess.CompletedProcess(["-c", code, *args], child.exitcode,
                                          out.read_text(), err.read_text())
    assert returncode in (None, res.returncode), (res.returncode, res.stdout[-2000:],
                                                  res.stderr[-3000:])
    return res


def unit_rows(rng: np.random.Generator, rows: int, dim: int) -> np.ndarray:
    """Random L2-normalised float32 rows."""
    x = rng.standard_normal((rows, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def small_problem(seed: int, n: int, m: int, d: int, tests: int) -> tuple:
    """(P (n, d), Q (m, d), Y (m x n) CSR with one relevant document per query, T (tests, d))."""
    rng = np.random.default_rng(seed)
    P, Q = unit_rows(rng, n, d), unit_rows(rng, m, d)
    y = sp.csr_matrix((np.ones(m, np.float32), (np.arange(m), rng.integers(0, n, m))),
                      shape=(m, n))
    return P, Q, y, unit_rows(rng, tests, d)


def make_model(cls: type, candidates: int | None = None, **params):
    """``cls(**params)``, PEFA-XL's ``candidates`` (the settings tables the tests share with the
    float64 reference) given as its search_params."""
    import pefa_gpu as pg

    search = None if candidates is None else pg.XLSearchParams(candidates=candidates)
    return cls(search_params=search, **params)


def cuda_syncs(fn) -> tuple:
    """(fn(), the number of host synchronisations it made), counted by torch's sync debug
    mode (one warning per synchronising call). The first synchronising call a process makes in
    that mode warned twice on an H200 (torch 2.11), so one uncounted call goes first."""
    global _SYNC_MODE_PRIMED
    if not _SYNC_MODE_PRIMED:
        _SYNC_MODE_PRIMED = True
        _count_syncs(lambda: torch.zeros(1, device="cuda").item())
    return _count_syncs(fn)


_SYNC_MODE_PRIMED = False


def _count_syncs(fn) -> tuple:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, sum("synchronizing" in str(w.message) for w in caught)


@pytest.fixture(autouse=True)
def hnsw_walks_the_graph(request, monkeypatch):
    """Test data is small, and the HNSW backend scans indices of <= full_scan_factor * ef rows
    instead of walking the graph. So that the suite exercises the graph, the default factor is
    0 here; tests marked ``full_scan`` keep the library's default."""
    if "full_scan" in request.keywords:
        return
    from pefa_gpu.index.hnsw import HNSWSearchParams

    monkeypatch.setitem(HNSWSearchParams.__init__.__kwdefaults__, "full_scan_factor", 0.0)
