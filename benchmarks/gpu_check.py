"""Every CUDA check in one call, for a GPU machine: the card's own rates, the tests marked gpu
(and triton), and the benchmarks as ratios against those rates and against torch.

    python3 benchmarks/gpu_check.py --out DIR            # from the repository root; <= 540 s
    python3 benchmarks/gpu_check.py --out DIR --dry-run  # on the CPU: every stage, tiny shapes

Stages, in this order (``--dry-run`` prints them):
1. ``env``: versions, GPUs, what is installed (cupy, triton, faiss GPU, cuVS).
2. ``card``: an 8192^3 bf16 GEMM (torch.mm) and a 1 GiB device-to-device copy,
   timed with CUDA events: 3 warm-ups, the median of 10. Every rate below is a share of these.
3. ``tests``: pytest -m "gpu or triton", in a time box that leaves ``--bench-reserve`` seconds
   for the benchmarks; pytest's JUnit report is parsed into one line per CUDA path.
4. Benchmarks (3 warm-ups, median of 10, CUDA events): ``exact`` (n = 1M, d = 768, bf16
   storage, B = 4096, k = 100) against torch ``mm + topk`` and the card's GEMM rate; ``xl``
   (PEFA-XL search and its host synchronisations against ERM); ``pifa`` (in memory: end to end, and
   its sparse product alone) and ``stream`` (out of core, warm) against the card's and the host's copy
   rates; ``triton`` (XL re-scoring) against the copy rate and its torch path; ``ann`` (the
   exact knn export graph against the GEMM rate; faiss GPU IVF and CAGRA where faiss GPU or
   cuVS is present, else skipped with the reason).

Each stage runs in its own process with a time limit, so a crash or hang (a CUDA fault, say) is
reported and the rest still run. DIR gets ``gpu.json`` (everything) and ``gpu.md`` (the
summary) after every stage, so a cut run still returns what it measured, and
``gpu_pytest.xml`` / ``gpu_pytest.log`` (pytest's report and its log, written as it runs). Nothing is installed and no network is used; the repository is imported
from its folder.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
from _common import md_table, stamp, stamp_line  # noqa: E402

# sizes of a real run and of a dry run (CPU, seconds)
FULL = dict(gemm=8192, copy_bytes=1 << 30, exact_n=1_000_000, d=768, batch=4096, k=100,
            xl_n=200_000, xl_d=128, pifa_m=1_000_000, stream_m=1_000_000, triton_n=1_000_000,
            triton_per_query=500, ann_n=200_000, ann_d=384, export_m=32)
DRY = dict(gemm=256, copy_bytes=1 << 20, exact_n=5000, d=32, batch=64, k=10, xl_n=2000,
           xl_d=16, pifa_m=3000, stream_m=3000, triton_n=400, triton_per_query=20, ann_n=1500,
           ann_d=16, export_m=4)
WARMUPS, REPS = 3, 10

# CUDA paths of the library and the tests that run them (node id patterns: file::name)
CUDA_PATHS: list[tuple[str, list[str]]] = [
    ("exact search on CUDA (fp32 / fp16 / bf16 storage, one GEMM per block)",
     ["test_exact.py::", "test_gpu_readiness.py::test_cuda_exact"]),
    ("PIFA on CUDA in memory (transposed on the device, torch's cuSPARSE CSR product)",
     ["test_aggregate.py::", "test_gpu_paths.py::test_pifa_in_memory",
      "test_gpu_readiness.py::test_in_memory_pifa"]),
    ("streamed PIFA (pinned staging slots, copy stream, entry batches)",
     ["test_out_of_core.py::"]),
    ("models on CUDA: ERM / PEFA-XS / PEFA-XL search and XL fusion (fuse)",
     ["test_models.py::", "test_scale.py::", "test_fuse_searches.py::",
      "test_gpu_readiness.py::test_cuda_vote"]),
    ("Triton re-scoring kernel (triton_rowdots: device guard, current stream)",
     ["test_triton_rowdots.py::"]),
    ("Triton top-k GEMM (triton_topk: exact search's candidates without its score matrix)",
     ["test_triton_topk.py::"]),
    ("faiss GPU IVF (device pointers, torch's stream, reconstruct, nprobe limit)",
     ["test_backends.py::*ivf-cuda", "test_gpu_paths.py::test_ivf_"]),
    ("CAGRA (faiss GpuIndexCagra or cuVS; re-scoring; loads without CAGRA)",
     ["test_backends.py::*cagra", "test_gpu_paths.py::test_cagra_", "test_persist.py::*cagra"]),
    ("CPU indices (hnsw, hnswlib, ScaNN) serving a CUDA model",
     ["test_backends.py::*hnsw-cuda", "test_backends.py::*hnswlib-cuda",
      "test_backends.py::*scann-tree-cuda"]),
    ("saves: CUDA -> CPU -> CUDA", ["test_persist.py::test_save_on_cuda"]),
    ("several GPUs: sharded index", ["test_sharded.py::"]),
    ("training helpers on CUDA (score, mine_negatives, counted syncs)",
     ["test_training.py::"]),
    ("foreign CUDA arrays copied (cupy, DLPack); default device",
     ["test_gpu_readiness.py::test_cuda_foreign", "test_gpu_readiness.py::test_the_default"]),
    ("HNSW export of a graph built on the GPU", ["test_backends.py::test_export_graph"]),
]


# -- timing ------------------------------------------------------------------------------------

def median_seconds(fn: Callable[[], Any], device: Any, reps: int = REPS) -> float:
    """Median seconds of ``fn`` over ``reps`` calls after ``WARMUPS`` calls: CUDA events
    around each call on CUDA (the device's time, its queue drained after each), wall time on
    the CPU."""
    import torch

    for _ in range(WARMUPS):
        fn()
    times = []
    for _ in range(reps):
        if torch.device(device).type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def mm_f32(a: Any, b: Any) -> Any:
    """(B, d) x (n, d) in their dtype -> (B, n) float32 (torch's bf16 GEMM with float32 output
    where it has one)."""
    import torch

    try:
        return torch.mm(a, b.T, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return a.float() @ b.float().T


def unit(rows: int, d: int, device: Any, seed: int) -> Any:
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(rows, d, device=device, generator=g), dim=1)


def count_syncs(fn: Callable[[], Any], device: Any) -> int | None:
    """Host synchronisations ``fn`` makes on CUDA (torch's sync debug mode), None elsewhere."""
    import warnings

    import torch

    if torch.device(device).type != "cuda":
        fn()
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)


# -- stages (each runs in a child process) -----------------------------------------------------

def stage_env(s: dict, device: str) -> dict[str, Any]:
    import platform

    import torch

    out: dict[str, Any] = {
        "python": sys.version.split()[0], "platform": platform.platform(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
    try:  # the driver's version and clocks, where nvidia-smi is there
        out["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,"
             "clocks.max.sm,clocks.mem", "--format=csv"], capture_output=True, text=True,
            timeout=20).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError) as exc:
        out["nvidia_smi"] = f"{type(exc).__name__}: {exc}"
    if torch.cuda.is_available():
        out["capability"] = list(torch.cuda.get_device_capability(0))
        out["free_bytes"], out["total_bytes"] = torch.cuda.mem_get_info(0)
    for mod in ("numpy", "scipy", "cupy", "triton", "faiss", "cuvs", "ml_dtypes", "pytest"):
        try:
            out[mod] = getattr(__import__(mod), "__version__", "installed")
        except Exception as exc:  # noqa: BLE001 (any import failure is a finding)
            out[mod] = None
            out[mod + "_error"] = f"{type(exc).__name__}: {exc}"
    out["faiss_gpu"] = False
    if out["faiss"]:
        from pefa_gpu.index._faiss import faiss_has_gpu, import_faiss

        out["faiss_gpu"] = bool(faiss_has_gpu(import_faiss()))
    return out


def stage_card(s: dict, device: str) -> dict[str, Any]:
    """The card's bf16 GEMM rate and device-to-device copy rate."""
    import torch

    n = s["gemm"]
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    t_mm = median_seconds(lambda: torch.mm(a, b), device)
    del a, b
    src = torch.empty(s["copy_bytes"], dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t_cp = median_seconds(lambda: dst.copy_(src), device)
    return {"gemm": f"{n}^3 bf16 GEMM", "gemm_s": t_mm,
            "bf16_tflops": 2 * n ** 3 / t_mm / 1e12, "copy_bytes": src.numel(),
            "copy_s": t_cp, "d2d_gb_s": 2 * src.numel() / t_cp / 1e9}  # read + write


def stage_exact(s: dict, device: str) -> dict[str, Any]:
    """ExactIndex, bf16 storage, against torch mm + topk on the same bf16 rows."""
    import torch

    import pefa_gpu as pg

    n, d, b, k = s["exact_n"], s["d"], s["batch"], s["k"]
    x = unit(n, d, device, 0).to(torch.bfloat16)
    q = unit(b, d, device, 1)
    index = pg.make_index("exact", device, {"dtype": "bfloat16"}).build(x)
    t = median_seconds(lambda: index.search(q, k), device)
    syncs = count_syncs(lambda: index.search(q, k), device)
    ids = index.search(q, k)[1]
    qb = q.to(torch.bfloat16)
    t_ref = median_seconds(lambda: torch.topk(mm_f32(qb, x), k, dim=1), device)
    ref = torch.topk(mm_f32(qb, x), k, dim=1).indices
    same = (torch.sort(ids, 1).values == torch.sort(ref, 1).values).float().mean()
    return {"n": n, "d": d, "batch": b, "k": k, "search_s": t, "torch_mm_topk_s": t_ref,
            "vs_torch_mm_topk": t_ref / t, "tflops": 2 * b * n * d / t / 1e12,
            "budget_bytes": index.memory_budget, "host_syncs": syncs,
            "same_id_sets_share": float(same)}


def stage_xl(s: dict, device: str) -> dict[str, Any]:
    """PEFA-XL search (exact backend) against ERM on synthetic data (m = 3n training queries);
    its two searches and its fusion apart; the fusion against a scipy sparse-product merge of
    the same searches (CPU); XL's host syncs."""
    import torch

    import pefa_gpu as pg
    from pefa_gpu.synthetic import make_synthetic

    n, b, k, kn = s["xl_n"], s["batch"], s["k"], 32
    data = make_synthetic(n, 3 * n, s["xl_d"], b, seed=1)
    erm = pg.ERM(device=device).fit(data.P)
    xl = pg.PEFAXL(device=device, lam=0.5, k=kn, search_params=pg.XLSearchParams(
        candidates=2 * k)).fit(data.P, data.Q, data.Y)
    q = torch.from_numpy(data.Q_test).to(device)
    t_erm = median_seconds(lambda: erm.search(q, k), device)
    t_xl = median_seconds(lambda: xl.search(q, k), device)
    t_searches = median_seconds(lambda: xl.neighbours(q, kn, erm=xl.index.search(q, 2 * k)),
                                device)
    found = xl.index.search(q, 2 * k)
    knn = xl.neighbours(q, kn, erm=found)
    t_fuse = median_seconds(lambda: xl.fuse(q, found, knn, k), device)
    host = [tuple(t.cpu().numpy() for t in pair) for pair in (found, knn)]
    t = time.perf_counter()
    scipy_merge(host[0], host[1], xl.relevance.csr, 0.5, kn, k)
    t_scipy = time.perf_counter() - t
    return {"n": n, "m": 3 * n, "queries": b, "k": k, "erm_s": t_erm, "xl_s": t_xl,
            "xl_vs_erm": t_erm / t_xl, "xl_qps": b / t_xl, "xl_searches_s": t_searches,
            "xl_vs_its_searches": t_searches / t_xl, "fuse_s": t_fuse,
            "scipy_merge_s": t_scipy, "fuse_vs_scipy_merge": t_scipy / t_fuse,
            "xl_host_syncs": count_syncs(lambda: xl.search(q, k), device)}


def scipy_merge(erm: tuple, knn: tuple, y: Any, lam: float, k: int, topk: int) -> tuple:
    """PEFA-XL's fusion as one sparse product and a sorted merge on the CPU (numpy / scipy):
    lam E + (1 - lam) / k S Y from the same searches (no re-scoring), each row's top ``topk``
    by one lexsort of the nonzeros -> (scores, columns) of the kept entries, row by row."""
    import numpy as np
    import scipy.sparse as sp

    (es, ei), (ks, ki) = erm, knn
    b = ei.shape[0]

    def csr(vals, cols, width):
        ok = cols >= 0
        rows = np.broadcast_to(np.arange(b)[:, None], cols.shape)
        return sp.csr_matrix((vals[ok], (rows[ok], cols[ok])), shape=(b, width))
    fused = (lam * csr(es, ei, y.shape[1]) +
             ((1 - lam) / k) * (csr(ks[:, :k], ki[:, :k], y.shape[0]) @ y)).tocsr()
    rows = np.repeat(np.arange(b), np.diff(fused.indptr))
    order = np.lexsort((fused.indices, -fused.data, rows))
    keep = order[np.arange(len(order)) - fused.indptr[rows[order]] < topk]
    return fused.data[keep], fused.indices[keep]


def _relevance(m: int, n: int, per: int, seed: int) -> Any:
    import numpy as np
    import scipy.sparse as sp

    rng = np.random.default_rng(seed)
    return sp.csr_matrix((np.ones(m * per, np.float32),
                          (np.repeat(np.arange(m), per), rng.integers(0, n, m * per))),
                         shape=(m, n))


def stage_pifa(s: dict, device: str) -> dict[str, Any]:
    """In-memory PIFA (Y^T Q): end to end (Y checked and copied, transposed on the device),
    and its sparse product alone against the card's copy rate."""
    import pefa_gpu as pg
    from pefa_gpu.aggregate import transposed_csr

    m, n, d = s["pifa_m"], s["pifa_m"] // 4, s["d"]
    y = _relevance(m, n, 3, 0)
    q = unit(m, d, device, 2)
    yt = transposed_csr(y, q.device)
    t_spmm = median_seconds(lambda: yt @ q, device)
    return {"m": m, "n": n, "d": d, "nnz": int(y.nnz),
            "s": median_seconds(lambda: pg.pifa(y, q, normalize=False, device=device), device),
            "spmm_s": t_spmm,
            "gb_s": (y.nnz + n) * d * 4 / t_spmm / 1e9}  # rows of Q gathered, rows of A written


def _read_file(path: Path, drop: bool) -> float:
    """Seconds to read ``path`` with os.preadv into one 64 MiB buffer; ``drop``: each piece's
    pages dropped from the page cache after it (posix_fadvise DONTNEED), as the stream does."""
    buf = memoryview(bytearray(64 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        t, pos = time.perf_counter(), 0
        while (k := os.preadv(fd, [buf], pos)) > 0:
            if drop:
                os.posix_fadvise(fd, pos, k, os.POSIX_FADV_DONTNEED)
            pos += k
        return time.perf_counter() - t
    finally:
        os.close(fd)


def stage_stream(s: dict, device: str) -> dict[str, Any]:
    """Out-of-core PIFA from a .npy memory map against the pinned host-to-device copy rate and
    against reading its file (os.preadv, 64 MiB at a time) from the page cache and as the stream
    reads it (each piece's pages dropped after it, so repeated reads come from disk), float32 and
    bfloat16 files."""
    import numpy as np
    import torch

    import pefa_gpu as pg
    from pefa_gpu.stream import row_source

    m, d, budget = s["stream_m"], 128, 512 << 20
    n = max(1, m // 10)
    y = _relevance(m, n, 3, 1)
    host = torch.empty(s["copy_bytes"], dtype=torch.uint8,
                       pin_memory=torch.device(device).type == "cuda")
    dev = torch.empty_like(host, device=device)
    h2d = host.numel() / median_seconds(lambda: dev.copy_(host, non_blocking=True), device) / 1e9
    del dev
    out: dict[str, Any] = {"m": m, "n": n, "d": d, "h2d_gb_s": h2d, "dtypes": {}}
    q32 = np.random.default_rng(0).standard_normal((m, d), dtype=np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("float32", "bfloat16"):
            try:
                dt = np.dtype(name) if name == "float32" else __import__("ml_dtypes").bfloat16
            except ImportError:
                out["dtypes"][name] = {"skipped": "ml_dtypes is not installed"}
                continue
            path = Path(tmp) / f"q_{name}.npy"
            np.save(path, q32.astype(dt))
            mm = np.load(path, mmap_mode="r")
            mm = mm.view(dt) if name == "bfloat16" else mm
            t = median_seconds(lambda: pg.pifa(y, mm, normalize=False, device=device,
                                               memory_budget=budget), device, reps=3)
            ref = pg.pifa(y, mm, normalize=False, device="cpu", memory_budget=budget)
            got = pg.pifa(y, mm, normalize=False, device=device, memory_budget=budget).cpu()
            err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
            size = path.stat().st_size
            gb_s = size / t / 1e9
            _read_file(path, drop=False)  # into the page cache
            cached = size / statistics.median(_read_file(path, False) for _ in range(3)) / 1e9
            dropped = size / statistics.median(_read_file(path, True) for _ in range(3)) / 1e9
            # reads the file itself (False: the map is copied, slower: its inode not found)
            direct = getattr(row_source(mm, "Q"), "_file", None) is not None
            out["dtypes"][name] = {"s": t, "file_gb_s": gb_s, "vs_h2d": gb_s / h2d,
                                   "read_cached_gb_s": cached, "read_dropped_gb_s": dropped,
                                   "vs_read_dropped": gb_s / dropped, "max_rel_diff_vs_cpu": err,
                                   "reads_file_directly": direct}
            del mm
    return out


def stage_triton(s: dict, device: str) -> dict[str, Any]:
    """XL's re-scoring dot products (Triton on CUDA) against its torch path."""
    import torch

    from pefa_gpu import triton_rowdots as tr

    n, d, b, c = s["triton_n"], s["d"], s["batch"], s["triton_per_query"]
    docs = unit(n, d, device, 3).to(torch.bfloat16)
    q = unit(b, d, device, 4)
    batch = torch.arange(b, device=device).repeat_interleave(c)
    g = torch.Generator(device=device).manual_seed(5)
    doc = torch.randint(0, n, (b * c,), device=device, generator=g)
    t = median_seconds(lambda: tr.rowdots(q, docs, batch, doc), device)
    t_torch = median_seconds(lambda: tr.torch_rowdots(q, docs, batch, doc), device)
    got, ref = tr.rowdots(q, docs, batch, doc), tr.torch_rowdots(q, docs, batch, doc)
    return {"available": tr.available(torch.device(device)), "pairs": b * c, "d": d,
            "s": t, "torch_s": t_torch, "vs_torch": t_torch / t,
            "gb_s": b * c * d * 2 / t / 1e9,  # document rows read
            "max_abs_diff_vs_torch": float((got - ref).abs().max()),
            "fell_back": [" ".join(map(str, key)) for key in tr._FAILED]}


def stage_ann(s: dict, device: str) -> dict[str, Any]:
    """The exact knn export graph (always), faiss GPU IVF and CAGRA (where present)."""
    import numpy as np
    import torch

    import pefa_gpu as pg
    from pefa_gpu.export import knn_graph

    n, d, b, k = s["ann_n"], s["ann_d"], s["batch"], s["k"]
    x = unit(n, d, device, 6)
    q = unit(b, d, device, 7)
    t = median_seconds(lambda: knn_graph(x, 2 * s["export_m"], device), device, reps=3)
    out: dict[str, Any] = {"knn_export": {"n": n, "d": d, "M": s["export_m"], "s": t,
                                          "tflops": 2 * n * n * d / t / 1e12}}
    truth = pg.make_index("exact", device).build(x).search(q, k)[1].cpu().numpy()

    def recall(ids: Any) -> float:
        ids = ids.cpu().numpy()
        return float(np.mean([len(set(a) & set(c)) / k for a, c in zip(ids, truth)]))

    for name, params, search in (("ivf", {"nlist": 1024}, {"nprobe": 32}),
                                 ("cagra", None, None)):
        try:
            index = pg.make_index(name, device, params, search_params=search)
            if name == "ivf" and not getattr(index, "on_gpu", False):
                out[name] = {"skipped": "faiss has no GPU support here"}
                continue
            build = time.perf_counter()
            index.build(x)
            build = time.perf_counter() - build
        except (pg.MissingDependencyError, pg.InputError) as exc:
            out[name] = {"skipped": f"{type(exc).__name__}: {exc}"}
            continue
        except Exception as exc:  # noqa: BLE001 (a faiss / cuVS failure is a finding)
            out[name] = {"failed_build": f"{type(exc).__name__}: {exc}"}
            continue
        try:
            ts = median_seconds(lambda: index.search(q, k), device)
            out[name] = {"build_s": build, "search_s": ts, "qps": b / ts,
                         "recall": recall(index.search(q, k)[1]),
                         "engine": str(getattr(index, "engine", ""))}
        except Exception as exc:  # noqa: BLE001
            out[name] = {"failed_search": f"{type(exc).__name__}: {exc}"}
    return out


STAGES: dict[str, Callable[[dict, str], dict[str, Any]]] = {
    "env": stage_env, "card": stage_card, "exact": stage_exact, "xl": stage_xl,
    "pifa": stage_pifa, "stream": stage_stream, "triton": stage_triton, "ann": stage_ann}
BENCHMARKS = ["exact", "xl", "pifa", "stream", "triton", "ann"]


def run_stage(name: str, args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    """One stage in a child process: its JSON, or {'failed': why, 'log_tail': [...]}."""
    with tempfile.TemporaryDirectory() as tmp:
        dest = Path(tmp) / "out.json"
        cmd = [sys.executable, __file__, "--stage", name, "--stage-out", str(dest),
               "--device", args.device] + (["--dry-run"] if args.dry_run else [])
        t = time.perf_counter()
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1, timeout),
                                 env=_env(args))
        except subprocess.TimeoutExpired:
            return {"failed": f"timed out after {timeout:.0f} s"}
        took = time.perf_counter() - t
        if res.returncode != 0 or not dest.is_file():
            tail = (res.stderr or res.stdout).strip().splitlines()[-15:]
            return {"failed": f"exit code {res.returncode}", "log_tail": tail, "wall_s": took}
        out = json.loads(dest.read_text())
        out["wall_s"] = took
        return out


def _env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if not args.dry_run:
        env.pop("TRITON_INTERPRET", None)  # compiled kernels here
    return env


def ratios(name: str, res: dict[str, Any], card: dict[str, Any]) -> None:
    """Add each benchmark's shares of the card's measured rates to ``res``."""
    tf, cp = card.get("bf16_tflops"), card.get("d2d_gb_s")
    if not tf or not cp or "failed" in res:
        return
    if name == "exact":
        res["vs_card_gemm"] = res["tflops"] / tf
    elif name in ("pifa", "triton"):
        res["vs_card_copy"] = res["gb_s"] / cp
    elif name == "ann":
        res["knn_export"]["vs_card_gemm"] = res["knn_export"]["tflops"] / tf


# -- the tests -----------------------------------------------------------------------------------

def run_tests(args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    """pytest -m "gpu or triton" (dry run: -m gpu, which skips on the CPU) with a JUnit
    report in the output folder, parsed; its verbose log goes to ``gpu_pytest.log`` there as it
    runs, so that a run cut by the time box still reports the cases it finished."""
    junit, log = Path(args.out) / "gpu_pytest.xml", Path(args.out) / "gpu_pytest.log"
    cmd = [sys.executable, "-m", "pytest", "-v", "-rfEs", "-p", "no:cacheprovider",
           f"--junitxml={junit}", "-m", "gpu" if args.dry_run else "gpu or triton"]
    if timeout < 30:
        return {"failed": f"not run: {timeout:.0f} s left for the tests"}
    t = time.perf_counter()
    out: dict[str, Any] = {"command": " ".join(cmd[1:])}
    with open(log, "w") as sink:
        try:
            out["exit_code"] = subprocess.run(cmd, cwd=ROOT, stdout=sink,
                                              stderr=subprocess.STDOUT, timeout=timeout,
                                              env=_env(args)).returncode
        except subprocess.TimeoutExpired:
            out["cut"] = f"pytest stopped by the {timeout:.0f} s time box"
    out["wall_s"] = time.perf_counter() - t
    lines = log.read_text(errors="replace").splitlines()
    out["tail"] = lines[-5:]
    if "cut" in out or not junit.is_file():
        return _cases_from_log(out, lines)
    cases = []
    for tc in ET.parse(junit).getroot().iter("testcase"):
        file = tc.get("classname", "").replace(".", "/").rsplit("/", 1)[-1] + ".py"
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            el = tc.find(kind)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                lines = (el.get("message") or el.text or "").strip().splitlines()
                message = lines[0][:300] if lines else ""
                break
        cases.append({"id": f"{file}::{tc.get('name')}", "outcome": outcome,
                      "message": message, "s": float(tc.get("time") or 0)})
    out["cases"] = cases
    out["counts"] = {k: sum(c["outcome"] == k for c in cases)
                     for k in ("passed", "failed", "error", "skipped")}
    return out


def _cases_from_log(out: dict[str, Any], lines: list[str]) -> dict[str, Any]:
    """The cases pytest -v logged (``tests/f.py::name PASSED``) when it left no report."""
    kinds = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped",
             "XFAIL": "skipped", "XPASS": "passed"}
    cases = []
    for line in lines:
        parts = line.split(" ")
        if len(parts) >= 2 and "::" in parts[0] and parts[1] in kinds:
            cases.append({"id": parts[0].split("/")[-1], "outcome": kinds[parts[1]],
                          "message": "(from the log)"})
    if not cases:
        out["failed"] = out.get("cut", "pytest wrote no report")
        out["log_tail"] = lines[-20:]
        return out
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


def path_status(tests: dict[str, Any], env: dict[str, Any]) -> list[list[Any]]:
    """One row per CUDA path: what its tests did here."""
    cases = tests.get("cases", [])
    rows = []
    for path, patterns in CUDA_PATHS:
        mine = [c for c in cases if any(_matches(c["id"], p) for p in patterns)]
        n = {k: sum(c["outcome"] == k for c in mine)
             for k in ("passed", "failed", "error", "skipped")}
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
        seconds = sum(c.get("s", 0.0) for c in mine)
        rows.append([path, status, n["passed"], n["failed"] + n["error"], n["skipped"],
                     round(seconds, 1)])
    return rows


# -- the summary ---------------------------------------------------------------------------------

def _scalars(res: dict[str, Any], prefix: str = "") -> list[list[Any]]:
    rows = []
    for key, value in res.items():
        if isinstance(value, dict):
            rows += _scalars(value, f"{prefix}{key}.")
        elif key not in ("log_tail", "cases") and not isinstance(value, list):
            rows.append([prefix + key, value])
    return rows


def summary_md(data: dict[str, Any]) -> str:
    env, card = data.get("env", {}), data.get("card", {})
    lines = ["# GPU check" + (" (dry run on the CPU: tiny shapes, no meaning)"
                              if data["args"]["dry_run"] else ""), ""]
    if "stamp" in data:
        lines += [stamp_line(data["stamp"]), ""]
    if "failed" in env:
        lines += [f"The environment stage failed: {env['failed']}", ""]
    elif env:
        lines += [f"GPUs: {', '.join(env.get('gpus', [])) or 'none'} · torch {env.get('torch')}"
                  f" (CUDA {env.get('torch_cuda')}) · cupy {env.get('cupy')} · triton "
                  f"{env.get('triton')} · faiss {env.get('faiss')} (GPU: {env.get('faiss_gpu')})"
                  f" · cuVS {env.get('cuvs')}", ""]
        if isinstance(env.get("nvidia_smi"), list):
            lines += ["nvidia-smi: " + " / ".join(env["nvidia_smi"]), ""]
    if card:
        lines += ["## The card", ""]
        lines += ([f"failed: {card['failed']}", ""] if "failed" in card else
                  [f"{card['gemm']}: {card['bf16_tflops']:.1f} TFLOP/s · device-to-device copy "
                   f"{card['d2d_gb_s']:.0f} GB/s (read + write; median of {REPS} after "
                   f"{WARMUPS} warm-ups)", ""])
    tests = data.get("tests")
    if tests is not None:
        lines += ["## Tests", ""]
        if "counts" in tests:
            c = tests["counts"]
            lines += [f"`{tests['command']}`: {c['passed']} passed, {c['failed']} failed, "
                      f"{c['error']} errors, {c['skipped']} skipped ({tests['wall_s']:.0f} s)"
                      + (f"; {tests['cut']}, the cases read from its log." if "cut" in tests
                         else "."), "", md_table(["CUDA path", "status", "passed", "failed", "skipped", "s"],
                                   data["paths"])]
            bad = [x for x in tests["cases"] if x["outcome"] in ("failed", "error")]
            if bad:
                lines += ["### Failures", ""]
                lines += [f"- `{x['id']}`: {x['message']}" for x in bad] + [""]
            reasons: dict[str, int] = {}
            for x in tests["cases"]:
                if x["outcome"] == "skipped":
                    reasons[x["message"]] = reasons.get(x["message"], 0) + 1
            if reasons:
                lines += ["### Skipped (reason: count)", ""]
                lines += [f"- {r or '(no reason given)'}: {k}" for r, k in
                          sorted(reasons.items(), key=lambda kv: -kv[1])] + [""]
        else:
            lines += [f"pytest did not report: {tests.get('failed')}", "", "```",
                      *tests.get("log_tail", []), "```", ""]
    bench = data.get("benchmarks", {})
    if bench:
        lines += ["## Benchmarks", "",
                  "Ratios: vs_card_* = a share of the card's measured rate above; vs_torch* = "
                  "torch's time / ours (above 1: faster than torch); xl_vs_erm = ERM's time / "
                  "XL's.", ""]
    for name, res in bench.items():
        lines += [f"### {name}", ""]
        if "failed" in res:
            lines += [f"failed: {res['failed']}", "", "```", *res.get("log_tail", []), "```", ""]
        else:
            lines += [md_table(["measure", "value"], _scalars(res))]
    return "\n".join(lines)


def write(out: Path, data: dict[str, Any]) -> None:
    """gpu.json and gpu.md into ``out``, each written to a temporary file and renamed."""
    for name, text in (("gpu.json", json.dumps(data, indent=2, default=str) + "\n"),
                       ("gpu.md", summary_md(data) + "\n")):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="folder for gpu.json, gpu.md, gpu_pytest.xml (created)")
    ap.add_argument("--dry-run", action="store_true",
                    help="on the CPU: list the stages and run each with tiny shapes")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--time-limit", type=int, default=540,
                    help="seconds for the whole check (a device machine's command limit is 600)")
    ap.add_argument("--bench-reserve", type=int, default=260,
                    help="seconds the test stage leaves for the benchmarks")
    ap.add_argument("--stage-timeout", type=int, default=120)
    ap.add_argument("--stage", choices=sorted(STAGES), help=argparse.SUPPRESS)
    ap.add_argument("--stage-out", help=argparse.SUPPRESS)
    ap.add_argument("--device", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.device = args.device or ("cpu" if args.dry_run else "cuda")
    sizes = DRY if args.dry_run else FULL
    if args.stage:  # a child: one stage, its JSON
        Path(args.stage_out).write_text(json.dumps(STAGES[args.stage](sizes, args.device),
                                                   default=str))
        return
    if not args.out:
        ap.error("--out DIR is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.time_limit
    plan = ["env", "card"] + ([] if args.skip_tests else ["tests"]) + \
        ([] if args.skip_bench else BENCHMARKS)
    print("gpu_check stages: " + ", ".join(plan) + (" (dry run: CPU, tiny shapes)"
                                                   if args.dry_run else ""), flush=True)
    data: dict[str, Any] = {"args": {k: v for k, v in vars(args).items()
                                     if k not in ("stage", "stage_out")},
                            "sizes": sizes, "stamp": stamp(), "benchmarks": {}}

    def left() -> float:
        return deadline - time.monotonic()

    for name in ("env", "card"):
        print(f"gpu_check: {name}", flush=True)
        data[name] = run_stage(name, args, min(args.stage_timeout, left()))
        write(out, data)
    if not data["env"].get("cuda_available") and not args.dry_run:
        print("gpu_check: torch sees no CUDA device; the stages below report that", flush=True)
    if "tests" in plan:
        box = min(left() - (0 if args.skip_bench else args.bench_reserve), left() - 10)
        print(f"gpu_check: tests (at most {box:.0f} s)", flush=True)
        data["tests"] = run_tests(args, box)
        data["paths"] = path_status(data["tests"], data["env"])
        write(out, data)
    for name in BENCHMARKS if "exact" in plan else []:
        budget = min(args.stage_timeout, left())
        if budget < 15:
            data["benchmarks"][name] = {"failed": f"not run: --time-limit {args.time_limit} s "
                                                  f"reached"}
        else:
            print(f"gpu_check: benchmark {name} (at most {budget:.0f} s)", flush=True)
            data["benchmarks"][name] = res = run_stage(name, args, budget)
            ratios(name, res, data.get("card", {}))
        write(out, data)
    print((out / "gpu.md").read_text())
    print(f"gpu_check: wrote {out / 'gpu.json'} and {out / 'gpu.md'}", flush=True)


if __name__ == "__main__":
    main()
