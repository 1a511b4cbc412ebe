"""Every CUDA check in one call, for a GPU machine: the tests marked gpu (and triton), the GPU
sections of the benchmarks, and a summary of which CUDA paths ran, passed, failed or were
skipped (with the reason).

    python3 benchmarks/gpu_check.py            # from the repository root; <= 540 s
    python3 benchmarks/gpu_check.py --quick    # smaller benchmark sizes
    python3 benchmarks/gpu_check.py --all-tests --time-limit 1500   # the whole suite too

Needs torch with CUDA; uses what is there: cupy, triton, faiss (a faiss-cpu wheel may be
carried in; faiss-gpu / cuVS parts are reported as skipped, with the reason, where they are
missing), pytest, ml_dtypes. Nothing is installed and no network is used; the repository is
imported from its folder (no pip install needed). Each stage runs in its own process with a
time limit, so a crash or hang in one (a CUDA fault, say) is reported and the rest still run.

Writes benchmarks/results/gpu.json (everything) and gpu.md (the summary), and
benchmarks/results/gpu_pytest.xml (pytest's JUnit report).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
from _common import RESULTS, md_table, write_results  # noqa: E402

# CUDA paths of the library and the tests that run them (node id patterns: file::name)
CUDA_PATHS: list[tuple[str, list[str]]] = [
    ("exact search on CUDA (fp32 / fp16 / bf16 storage, one GEMM per block)",
     ["test_exact.py::"]),
    ("PIFA on CUDA in memory (cuSPARSE through cupy, else torch sparse; torch's stream)",
     ["test_aggregate.py::", "test_gpu_paths.py::test_pifa_in_memory"]),
    ("streamed PIFA (pinned staging slots, copy stream, entry batches)",
     ["test_out_of_core.py::"]),
    ("models on CUDA: ERM / PEFA-XS / PEFA-XL search and XL fusion (fuse)",
     ["test_models.py::", "test_scale.py::"]),
    ("Triton re-scoring kernel (triton_rowdots: device guard, current stream)",
     ["test_triton_rowdots.py::"]),
    ("faiss GPU IVF (device pointers, torch's stream, reconstruct, nprobe limit)",
     ["test_backends.py::*ivf-cuda", "test_gpu_paths.py::test_ivf_"]),
    ("CAGRA (faiss GpuIndexCagra or cuVS; re-scoring; loads without CAGRA)",
     ["test_backends.py::*cagra", "test_gpu_paths.py::test_cagra_", "test_persist.py::*cagra"]),
    ("CPU indices (hnsw, hnswlib, ScaNN) serving a CUDA model",
     ["test_backends.py::*hnsw-cuda", "test_backends.py::*hnswlib-cuda",
      "test_backends.py::*scann-tree-cuda"]),
    ("saves: CUDA -> CPU -> CUDA", ["test_persist.py::test_save_on_cuda"]),
    ("several GPUs: sharded index", ["test_sharded.py::"]),
    ("training helpers on CUDA (score, mine_negatives)", ["test_training.py::"]),
    ("HNSW export of a graph built on the GPU", ["test_backends.py::test_export_graph"]),
]


# -- stages (each runs in a child process: --stage NAME --out FILE) ------------------------------

def stage_env(args: argparse.Namespace) -> dict[str, Any]:
    import platform

    import torch

    out: dict[str, Any] = {
        "python": sys.version.split()[0], "platform": platform.platform(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
    if torch.cuda.is_available():
        out["capability"] = list(torch.cuda.get_device_capability(0))
    for mod in ("numpy", "scipy", "cupy", "triton", "faiss", "cuvs", "ml_dtypes", "pytest",
                "sentence_transformers"):
        try:
            out[mod] = getattr(__import__(mod), "__version__", "installed")
        except Exception as exc:  # noqa: BLE001 (any import failure is a finding)
            out[mod] = None
            out[mod + "_error"] = f"{type(exc).__name__}: {exc}"
    if out["cupy"]:
        try:
            import cupy

            out["cupy_ok"] = float(cupy.arange(4, dtype=cupy.float32).sum()) == 6.0
        except Exception as exc:  # noqa: BLE001
            out["cupy_ok"] = False
            out["cupy_error"] = f"{type(exc).__name__}: {exc}"
    if out["faiss"]:
        from pefa_gpu.index._faiss import faiss_has_gpu, import_faiss

        faiss = import_faiss()
        out["faiss_gpu"] = faiss_has_gpu(faiss)
        out["faiss_cagra"] = hasattr(faiss, "GpuIndexCagra") and out["faiss_gpu"]
    else:
        out["faiss_gpu"] = out["faiss_cagra"] = False
    return out


def stage_scale(args: argparse.Namespace) -> dict[str, Any]:
    """benchmarks/scale.py's GPU section, as it is."""
    import scale

    ns = argparse.Namespace(gpu_n=args.gpu_n, gpu_xl_n=args.gpu_xl_n, gpu_agg_m=args.gpu_agg_m)
    figures, table = scale.gpu_section(ns)
    return {"figures": figures, "table_md": table}


def _timed(fn: Callable[[], Any], reps: int = 3) -> float:
    """Seconds per call of ``fn`` after one warm-up, the GPU's queue drained around it."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t) / reps


def stage_stream(args: argparse.Namespace) -> dict[str, Any]:
    """The staged PIFA pipeline on CUDA with float32 / float16 / bfloat16 memory maps, against
    the CPU scipy kernel on the same file, and the measured host-to-device copy rate."""
    import numpy as np
    import scipy.sparse as sp
    import torch

    import pefa_gpu as pg

    m, n, d = args.stream_m, 100_000, 128
    rng = np.random.default_rng(0)
    per = 3
    Y = sp.csr_matrix((np.ones(m * per, np.float32),
                       (np.repeat(np.arange(m), per), rng.integers(0, n, m * per))),
                      shape=(m, n))
    dev = torch.device(args.device)
    host = torch.empty(1 << 28, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    devbuf = torch.empty_like(host, device=dev)
    h2d = host.numel() / _timed(lambda: devbuf.copy_(host, non_blocking=True)) / 1e9
    out: dict[str, Any] = {"m": m, "n": n, "d": d, "nnz": int(Y.nnz), "h2d_gb_s": h2d,
                           "budget_bytes": 512 << 20, "dtypes": {}}
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        q32 = rng.standard_normal((m, d), dtype=np.float32)
        for name in ("float32", "float16", "bfloat16"):
            if name == "bfloat16":
                try:
                    import ml_dtypes
                except ImportError:
                    out["dtypes"][name] = {"skipped": "ml_dtypes is not installed"}
                    continue
                dt = ml_dtypes.bfloat16
            else:
                dt = np.dtype(name)
            path = Path(tmp) / f"q_{name}.npy"
            np.save(path, q32.astype(dt))
            mm = np.load(path, mmap_mode="r")
            if name == "bfloat16":
                mm = mm.view(dt)
            t = time.perf_counter()
            a = pg.pifa(Y, mm, normalize=False, device=dev, memory_budget=512 << 20)
            float(a[0, 0])  # waits for the device
            t_gpu = time.perf_counter() - t
            t = time.perf_counter()
            ref = pg.pifa(Y, mm, normalize=False, device="cpu", memory_budget=512 << 20)
            t_cpu = time.perf_counter() - t
            err = float((a.cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
            out["dtypes"][name] = {"gpu_s": t_gpu, "cpu_scipy_s": t_cpu,
                                   "file_gb_s": path.stat().st_size / t_gpu / 1e9,
                                   "vs_h2d": path.stat().st_size / t_gpu / 1e9 / h2d,
                                   "max_rel_diff_vs_cpu": err, "ok": err < 1e-5}
            del mm
    return out


def stage_triton(args: argparse.Namespace) -> dict[str, Any]:
    """triton_rowdots on CUDA against its torch path and a float64 sample."""
    import numpy as np
    import torch

    from pefa_gpu import triton_rowdots as tr

    dev = torch.device(args.device)
    out: dict[str, Any] = {"available": tr.available(dev)}
    n, d, b, c = args.triton_n, 768, args.queries, 500
    g = torch.Generator(device=dev).manual_seed(0)
    docs = torch.randn(n, d, device=dev, generator=g).to(torch.bfloat16)
    q = torch.randn(b, d, device=dev, generator=g)
    batch = torch.arange(b, device=dev).repeat_interleave(c)
    doc = torch.randint(0, n, (b * c,), device=dev, generator=g)
    got = tr.rowdots(q, docs, batch, doc)
    out["fell_back"] = dict((f"{k[0]} {k[1]} {k[2]}", v) for k, v in tr._FAILED.items())
    sample = torch.randint(0, b * c, (2000,), device=dev, generator=g)
    ref = np.einsum("id,id->i", q[batch[sample]].double().cpu().numpy(),
                    docs[doc[sample]].double().cpu().numpy())
    out["max_abs_err_vs_float64"] = float(np.abs(got[sample].cpu().numpy() - ref).max())
    t_k = _timed(lambda: tr.rowdots(q, docs, batch, doc))
    t_t = _timed(lambda: tr.torch_rowdots(q, docs, batch, doc))
    out.update(pairs=b * c, d=d, n_docs=n, kernel_s=t_k, torch_s=t_t,
               speedup_vs_torch=t_t / t_k,
               kernel_gb_s=b * c * d * 2 / t_k / 1e9)  # document bytes read
    return out


def stage_faiss(args: argparse.Namespace) -> dict[str, Any]:
    """faiss GPU IVF through device pointers vs faiss' numpy API (host round trip), and
    CAGRA; skipped with the reason where faiss-gpu / cuVS are missing."""
    import numpy as np
    import torch

    import pefa_gpu as pg

    out: dict[str, Any] = {}
    try:
        from pefa_gpu.index._faiss import faiss_has_gpu, import_faiss

        faiss = import_faiss()
    except pg.MissingDependencyError as exc:
        faiss = None
        out["ivf"] = {"skipped": f"faiss is not installed: {exc}"}
    dev = torch.device(args.device)
    rng = np.random.default_rng(0)
    n, d, b, k = args.faiss_n, 128, args.queries, 100
    x = rng.standard_normal((n, d), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    q = torch.from_numpy(x[rng.choice(n, b, replace=False)]).to(dev)
    if faiss is not None and not faiss_has_gpu(faiss):
        out["ivf"] = {"skipped": f"faiss {faiss.__version__} has no GPU support here "
                                 f"(faiss-cpu): the faiss GPU IVF path was not run"}
    elif faiss is not None:
        index = pg.make_index("ivf", dev, {"nlist": 1024}, {"nprobe": 32}).build(x)
        fp = faiss.SearchParametersIVF()
        fp.nprobe = 32
        t_dev = _timed(lambda: index.search(q, k))
        t_host = _timed(lambda: index._index.search(q.cpu().numpy(), k, params=fp))
        ids_dev = index.search(q, k)[1].cpu().numpy()
        ids_host = index._index.search(q.cpu().numpy(), k, params=fp)[1]
        out["ivf"] = {"on_gpu": index.on_gpu, "n": n, "queries": b, "k": k,
                      "device_path_s": t_dev, "numpy_path_s": t_host,
                      "speedup": t_host / t_dev,
                      "same_ids_share": float(np.mean([len(set(a) & set(c)) / k for a, c in
                                                       zip(ids_dev, ids_host)]))}
    try:
        cagra = pg.make_index("cagra", dev)
    except pg.MissingDependencyError as exc:
        out["cagra"] = {"skipped": str(exc)}
        return out
    xt = torch.from_numpy(x).to(dev)
    build_s = _timed(lambda: cagra.build(xt), reps=1)
    t = _timed(lambda: cagra.search(q, k))
    exact = pg.make_index("exact", dev).build(xt)
    truth = exact.search(q, k)[1].cpu().numpy()
    got = cagra.search(q, k)[1].cpu().numpy()
    out["cagra"] = {"engine": cagra.engine, "build_s": build_s, "search_s": t,
                    "qps": b / t, "recall": float(np.mean([len(set(a) & set(c)) / k
                                                           for a, c in zip(got, truth)]))}
    return out


STAGES = {"env": stage_env, "scale": stage_scale, "stream": stage_stream,
          "triton": stage_triton, "faiss": stage_faiss}


def run_stage(name: str, args: argparse.Namespace, timeout: int) -> dict[str, Any]:
    """Run one stage in a child process; its JSON, or {'failed': why}."""
    with tempfile.TemporaryDirectory() as tmp:
        dest = Path(tmp) / "out.json"
        cmd = [sys.executable, __file__, "--stage", name, "--out", str(dest), *_size_args(args)]
        t = time.perf_counter()
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                 env=_env())
        except subprocess.TimeoutExpired:
            return {"failed": f"timed out after {timeout} s"}
        took = time.perf_counter() - t
        if res.returncode != 0 or not dest.is_file():
            tail = (res.stderr or res.stdout).strip().splitlines()[-15:]
            return {"failed": f"exit code {res.returncode}", "log_tail": tail, "wall_s": took}
        out = json.loads(dest.read_text())
        out["wall_s"] = took
        return out


def _size_args(args: argparse.Namespace) -> list[str]:
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
            ("gpu_n", "gpu_xl_n", "gpu_agg_m", "stream_m", "triton_n", "faiss_n", "queries",
             "tmp", "device")]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in
                                                       env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.pop("TRITON_INTERPRET", None)  # compiled kernels here
    return env


# -- the tests -------------------------------------------------------------------------------------

def run_tests(args: argparse.Namespace) -> dict[str, Any]:
    """pytest (``-m "gpu or triton"``, or everything) with a JUnit report, parsed."""
    junit = RESULTS / "gpu_pytest.xml"
    RESULTS.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
           f"--junitxml={junit}", *([] if args.all_tests else ["-m", "gpu or triton"])]
    t = time.perf_counter()
    try:
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                             timeout=args.test_timeout, env=_env())
    except subprocess.TimeoutExpired:
        return {"failed": f"pytest timed out after {args.test_timeout} s", "command": cmd}
    out: dict[str, Any] = {"command": " ".join(cmd[1:]), "exit_code": res.returncode,
                           "wall_s": time.perf_counter() - t,
                           "tail": res.stdout.strip().splitlines()[-5:]}
    if not junit.is_file():
        out["failed"] = "pytest wrote no report"
        out["log_tail"] = (res.stderr or res.stdout).strip().splitlines()[-20:]
        return out
    cases = []
    for tc in ET.parse(junit).getroot().iter("testcase"):
        file = tc.get("classname", "").replace(".", "/").rsplit("/", 1)[-1] + ".py"
        node = f"{file}::{tc.get('name')}"
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            el = tc.find(kind)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                message = (el.get("message") or el.text or "").strip().splitlines()
                message = message[0][:300] if message else ""
                break
        cases.append({"id": node, "outcome": outcome, "message": message})
    out["cases"] = cases
    out["counts"] = {k: sum(c["outcome"] == k for c in cases)
                     for k in ("passed", "failed", "error", "skipped")}
    return out


def _matches(node: str, pattern: str) -> bool:
    file, _, rest = pattern.partition("::")
    if not node.startswith(file + "::"):
        return False
    name = node.split("::", 1)[1]
    return rest[1:] in name if rest.startswith("*") else name.startswith(rest)


def path_status(tests: dict[str, Any], env: dict[str, Any]) -> list[list[str]]:
    """One row per CUDA path: what its tests did here."""
    cases = tests.get("cases", [])
    rows = []
    for path, patterns in CUDA_PATHS:
        mine = [c for c in cases if any(_matches(c["id"], p) for p in patterns)]
        n = {k: sum(c["outcome"] == k for c in mine) for k in ("passed", "failed", "error",
                                                                "skipped")}
        if n["failed"] or n["error"]:
            status = "FAILED"
        elif n["passed"]:
            status = "ran, passed" + (" (some skipped)" if n["skipped"] else "")
        elif n["skipped"]:
            reasons = sorted({c["message"] for c in mine if c["outcome"] == "skipped"})
            status = "skipped: " + "; ".join(reasons)[:200]
        else:
            status = "no test collected"
        if path.startswith("faiss GPU") and not env.get("faiss_gpu"):
            status = "not run: " + ("faiss has no GPU support here" if env.get("faiss")
                                    else "faiss is not installed") + f" ({status})"
        rows.append([path, status, n["passed"], n["failed"] + n["error"], n["skipped"]])
    return rows


# -- the summary ------------------------------------------------------------------------------------

def summary_md(data: dict[str, Any]) -> str:
    env, tests, bench = data["env"], data["tests"], data["benchmarks"]
    lines = ["# GPU check", ""]
    if "failed" in env:
        lines += [f"The environment stage failed: {env['failed']}", ""]
    else:
        lines += [f"GPUs: {', '.join(env['gpus']) or 'none'} · torch {env['torch']} (CUDA "
                  f"{env['torch_cuda']}) · cupy {env.get('cupy')} · triton {env.get('triton')}"
                  f" · faiss {env.get('faiss')} (GPU: {env.get('faiss_gpu')}) · cuVS "
                  f"{env.get('cuvs')} · ml_dtypes {env.get('ml_dtypes')}", ""]
    lines += ["## Tests", ""]
    if "counts" in tests:
        c = tests["counts"]
        lines += [f"`{tests['command']}`: {c['passed']} passed, {c['failed']} failed, "
                  f"{c['error']} errors, {c['skipped']} skipped ({tests['wall_s']:.0f} s).", ""]
        lines += [md_table(["CUDA path", "status", "passed", "failed", "skipped"],
                           data["paths"])]
        bad = [x for x in tests["cases"] if x["outcome"] in ("failed", "error")]
        if bad:
            lines += ["### Failures", ""] + [f"- `{x['id']}`: {x['message']}" for x in bad] + [""]
        reasons: dict[str, int] = {}
        for x in tests["cases"]:
            if x["outcome"] == "skipped":
                reasons[x["message"]] = reasons.get(x["message"], 0) + 1
        if reasons:
            lines += ["### Skipped (reason: count)", ""]
            lines += [f"- {r or '(no reason given)'}: {k}" for r, k in
                      sorted(reasons.items(), key=lambda kv: -kv[1])] + [""]
    elif "skipped" in tests:
        lines += [f"Not run ({tests['skipped']}).", ""]
    else:
        lines += [f"pytest did not report: {tests.get('failed')}", "", "```",
                  *tests.get("log_tail", []), "```", ""]
    lines += ["## Benchmarks", ""]
    for name, res in bench.items():
        lines += [f"### {name}", ""]
        if "failed" in res:
            lines += [f"failed: {res['failed']}", "", "```", *res.get("log_tail", []), "```", ""]
        elif name == "scale":
            lines += [res["table_md"], ""]
        else:
            lines += ["```json", json.dumps({k: v for k, v in res.items() if k != "wall_s"},
                                            indent=1), "```", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", choices=sorted(STAGES), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="smaller benchmark sizes")
    ap.add_argument("--all-tests", action="store_true", help="the whole suite, not only gpu")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--test-timeout", type=int, default=300)
    ap.add_argument("--stage-timeout", type=int, default=180)
    ap.add_argument("--time-limit", type=int, default=540,
                    help="seconds for the whole check (stages left over are reported as not "
                         "run); a device machine's command limit is 600")
    ap.add_argument("--gpu-n", type=int, default=1_000_000)
    ap.add_argument("--gpu-xl-n", type=int, default=200_000)
    ap.add_argument("--gpu-agg-m", type=int, default=4_000_000)
    ap.add_argument("--stream-m", type=int, default=2_000_000)
    ap.add_argument("--triton-n", type=int, default=1_000_000)
    ap.add_argument("--faiss-n", type=int, default=1_000_000)
    ap.add_argument("--queries", type=int, default=4096, help="query batch (triton, faiss)")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: a dry run
    ap.add_argument("--tmp", default=tempfile.gettempdir(), help="folder for streamed files")
    args = ap.parse_args()
    if args.stage:  # a child: run one stage, write its JSON
        Path(args.out).write_text(json.dumps(STAGES[args.stage](args), default=str))
        return
    if args.quick:
        args.gpu_n, args.gpu_xl_n, args.gpu_agg_m = 200_000, 50_000, 1_000_000
        args.stream_m, args.triton_n, args.faiss_n = 500_000, 200_000, 200_000
    deadline = time.monotonic() + args.time_limit
    data: dict[str, Any] = {"args": {k: v for k, v in vars(args).items()
                                     if k not in ("stage", "out")}}
    print("gpu_check: environment", flush=True)
    data["env"] = run_stage("env", args, 120)
    if not data["env"].get("cuda_available"):
        print("gpu_check: torch sees no CUDA device; the checks below will skip", flush=True)
    data["tests"] = {"skipped": "--skip-tests"} if args.skip_tests else None
    if data["tests"] is None:
        print("gpu_check: tests", flush=True)
        args.test_timeout = int(min(args.test_timeout, deadline - time.monotonic() - 60))
        data["tests"] = run_tests(args)
    data["paths"] = path_status(data["tests"], data["env"])
    data["benchmarks"] = {}
    if not args.skip_bench and data["env"].get("cuda_available"):
        for name in ("stream", "triton", "faiss", "scale"):
            left = int(min(args.stage_timeout, deadline - time.monotonic()))
            if left < 20:
                data["benchmarks"][name] = {"failed": f"not run: --time-limit "
                                                      f"{args.time_limit} s reached"}
                continue
            print(f"gpu_check: benchmark {name} (at most {left} s)", flush=True)
            data["benchmarks"][name] = run_stage(name, args, left)
            write_results("gpu", data, summary_md(data))  # kept up to date as stages end
    path = write_results("gpu", data, summary_md(data))
    print((RESULTS / "gpu.md").read_text())
    print(f"gpu_check: wrote {path} and {RESULTS / 'gpu.md'}", flush=True)


if __name__ == "__main__":
    main()
