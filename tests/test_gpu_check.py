"""benchmarks/gpu_check.py, the one-call GPU check, dry-run on the CPU: its stages and its
summary work before they first meet a GPU (the numbers themselves come from a GPU run)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_check():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny(tmp_path) -> argparse.Namespace:
    return argparse.Namespace(device="cpu", stream_m=3000, triton_n=400, faiss_n=3000,
                              queries=1, tmp=str(tmp_path), gpu_n=0, gpu_xl_n=0, gpu_agg_m=0)


@pytest.mark.slow  # ~10 s: imports everything the GPU machine may have; Triton's interpreter
def test_stages_run_on_the_cpu(gpu_check, tmp_path):
    args = tiny(tmp_path)
    env = gpu_check.stage_env(args)
    assert env["torch"] and "faiss_gpu" in env
    stream = gpu_check.stage_stream(args)
    for name in ("float32", "float16"):
        assert stream["dtypes"][name]["ok"], stream
    tri = gpu_check.stage_triton(args)
    assert tri["max_abs_err_vs_float64"] < 1e-3 and tri["pairs"] == 500
    fa = gpu_check.stage_faiss(args)
    assert "skipped" in fa["cagra"]  # no CAGRA on the CPU
    assert "skipped" in fa["ivf"] or fa["ivf"]["on_gpu"]
    assert list(tmp_path.iterdir()) == []  # streamed files removed


def test_summary_from_a_junit_report(gpu_check, tmp_path):
    cases = [{"id": "test_exact.py::test_search[cuda]", "outcome": "passed", "message": ""},
             {"id": "test_backends.py::test_agrees[ivf-cuda]", "outcome": "skipped",
              "message": "could not import 'faiss'"},
             {"id": "test_triton_rowdots.py::test_kernel[cuda]", "outcome": "failed",
              "message": "AssertionError: boom"}]
    tests = {"command": "-m pytest", "wall_s": 1.0, "cases": cases,
             "counts": {"passed": 1, "failed": 1, "error": 0, "skipped": 1}}
    env = {"gpus": ["X"], "torch": "2.11", "torch_cuda": "13.0", "faiss": None,
           "faiss_gpu": False}
    paths = {row[0]: row[1] for row in gpu_check.path_status(tests, env)}
    assert paths[gpu_check.CUDA_PATHS[0][0]] == "ran, passed"
    triton = next(p for p in paths if p.startswith("Triton"))
    assert paths[triton] == "FAILED"
    ivf = next(p for p in paths if p.startswith("faiss GPU"))
    assert paths[ivf].startswith("not run: faiss is not installed")
    md = gpu_check.summary_md({"env": env, "tests": tests, "benchmarks": {
        "faiss": {"ivf": {"skipped": "no faiss"}}, "scale": {"failed": "exit code 1",
                                                             "log_tail": ["Traceback"]}},
        "paths": gpu_check.path_status(tests, env)})
    assert "AssertionError: boom" in md and "could not import 'faiss': 1" in md
    assert "failed: exit code 1" in md
