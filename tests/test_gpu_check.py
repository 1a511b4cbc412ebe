"""benchmarks/gpu_check.py, the one-call GPU check, dry-run on the CPU: every stage and the
summary work before they first meet a GPU (the numbers themselves come from a GPU run)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from conftest import ROOT, run_python


@pytest.fixture(scope="module")
def gpu_check():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow  # ~1-2 min: every stage in its own process, and pytest -m gpu collecting
def test_dry_run_runs_every_stage_and_writes_both_files(tmp_path):
    out = tmp_path / "out"
    res = run_python(ROOT / "benchmarks" / "gpu_check.py", "--dry-run", "--out", out,
                     cwd=tmp_path, timeout=600)
    assert "gpu_check stages: env, card, tests, exact, xl, pifa, stream, triton, ann" in res.stdout
    data = json.loads((out / "gpu.json").read_text())
    md = (out / "gpu.md").read_text()
    for name in ("env", "card", "tests"):
        assert "failed" not in data[name], data[name]
    assert data["card"]["bf16_tflops"] > 0 and data["card"]["d2d_gb_s"] > 0
    assert data["tests"]["counts"]["failed"] == data["tests"]["counts"]["error"] == 0
    assert list(data["benchmarks"]) == ["exact", "xl", "pifa", "stream", "triton", "ann"]
    for name, bench in data["benchmarks"].items():
        assert "failed" not in bench, (name, bench)
    assert data["benchmarks"]["exact"]["same_id_sets_share"] > 0.99
    assert data["benchmarks"]["exact"]["vs_card_gemm"] > 0
    assert data["benchmarks"]["stream"]["dtypes"]["float32"]["max_rel_diff_vs_cpu"] < 1e-5
    assert data["benchmarks"]["stream"]["dtypes"]["float32"]["reads_file_directly"]  # not copied
    assert "cagra" in data["benchmarks"]["ann"]  # skipped with a reason on the CPU
    assert "## The card" in md and "### ann" in md and (out / "gpu_pytest.xml").is_file()
    assert sorted(p.name for p in out.iterdir()) == ["gpu.json", "gpu.md", "gpu_pytest.log",
                                                     "gpu_pytest.xml"]


def test_median_seconds_warms_up_then_takes_the_median(gpu_check):
    calls = []
    t = gpu_check.median_seconds(lambda: calls.append(1), "cpu")
    assert len(calls) == gpu_check.WARMUPS + gpu_check.REPS >= 13 and t >= 0


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
    card = {"gemm": "8192^3 bf16 GEMM", "bf16_tflops": 700.0, "d2d_gb_s": 3000.0}
    exact = {"tflops": 350.0, "search_s": 0.1}
    gpu_check.ratios("exact", exact, card)
    assert exact["vs_card_gemm"] == 0.5
    data = {"args": {"dry_run": False}, "env": env, "card": card, "tests": tests,
            "paths": gpu_check.path_status(tests, env),
            "benchmarks": {"exact": exact, "ann": {"cagra": {"skipped": "no cuVS"}},
                           "xl": {"failed": "exit code 1", "log_tail": ["Traceback"]}}}
    gpu_check.write(tmp_path, data)
    md = (tmp_path / "gpu.md").read_text()
    assert "AssertionError: boom" in md and "could not import 'faiss': 1" in md
    assert "700.0 TFLOP/s" in md and "| vs_card_gemm | 0.5000 |" in md
    assert "| cagra.skipped | no cuVS |" in md and "failed: exit code 1" in md
    assert json.loads((tmp_path / "gpu.json").read_text())["card"]["d2d_gb_s"] == 3000.0


def test_a_test_run_cut_by_the_time_box_reports_the_cases_it_logged(gpu_check):
    lines = ["============ test session starts ============",
             "tests/test_exact.py::test_search[cuda] PASSED                  [  1%]",
             "tests/test_triton_rowdots.py::test_kernel[cuda] FAILED         [  2%]",
             "tests/test_backends.py::test_agrees[ivf-cuda] SKIPPED (no faiss) [  3%]"]
    out = gpu_check._cases_from_log({"cut": "pytest stopped by the 9 s time box"}, lines)
    assert out["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    assert out["cases"][0]["id"] == "test_exact.py::test_search[cuda]"
    assert gpu_check._cases_from_log({"cut": "x"}, lines[:1])["failed"] == "x"
