"""Exact search against what a user would pick instead, side by side in one run.

    .venv/bin/python benchmarks/exact.py            # the full grid (tens of minutes on 2 cores)
    .venv/bin/python benchmarks/exact.py --quick    # a small grid, to check the script

CPU (``--threads``, default 2): n in {50k, 200k} random unit documents, d in {384, 768},
B in {1, 4, 64, 2000} random unit queries, k in {10, 100, 500}; then a single query on 1 thread.
Per shape, in alternation (the order rotated every repeat, so that no method always runs
after the same one), best of ``--repeats`` (B = 4 and 64: 3x as many: a 30 ms shape moves by 10%
between runs on a shared 2-core machine). B = 1 is single-query latency: each timed sample
searches ``SINGLE_QUERIES`` distinct queries one at a time and reports the time per query,
best of 2x ``--repeats`` samples:

- pefa_gpu: ``pg.ERM(device="cpu").fit(P).search(q, k)`` (the exact backend; ties to the
  lower id),
- faiss: ``faiss.IndexFlatIP`` (``index.search(q, k)``),
- torch: ``torch.topk(q @ P.T, k)``,
- sentence-transformers: ``util.semantic_search(q, P, top_k=k)``,

and the ratios pefa_gpu / each. Ids are compared with faiss' (random real-valued data: ties
are rare, so they should agree; the share of equal ids is recorded).

GPU (when torch sees CUDA): n = 1M, d = 768, bfloat16 storage, B = 4096, k = 100: pefa_gpu end
to end (``memory_budget`` 2 GiB) and torch mm + topk on the same bf16 matrix, as TFLOP/s
(2 B n d / time), against an 8192^3 bf16 matmul measured in the same run.

Results: benchmarks/results/exact.{json,md,png} (``--quick``: exact_quick.*).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import RESULTS, md_table, write_results  # noqa: E402

import pefa_gpu as pg  # noqa: E402

METHODS = ("pefa_gpu", "faiss", "torch", "st")
SINGLE_QUERIES = 8  # B = 1: queries per timed sample, searched one at a time


def unit_rows(rng: np.random.Generator, rows: int, d: int) -> np.ndarray:
    x = rng.standard_normal((rows, d), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def best_times(fns: dict[str, Callable[[], Any]], repeats: int) -> tuple[dict[str, float], dict]:
    """Each function ``repeats`` times in alternation, the order rotated every repeat; the best
    wall time of each (seconds) and the last result of each."""
    times: dict[str, list[float]] = {m: [] for m in fns}
    out: dict[str, Any] = {}
    names = list(fns)
    for r in range(repeats):
        for m in names[r % len(names):] + names[:r % len(names)]:
            f = fns[m]
            t = time.perf_counter()
            out[m] = f()
            times[m].append(time.perf_counter() - t)
    return {m: min(v) for m, v in times.items()}, out


def cpu_shape(P: np.ndarray, Pt: torch.Tensor, erm: pg.ERM, flat: Any, Q: np.ndarray, k: int,
              repeats: int, single: bool) -> dict[str, Any]:
    """Times of one (n, d, B, k) shape: ``Q`` (B, d) searched in one call, or when ``single``,
    its rows one at a time (time per query)."""
    from sentence_transformers import util

    Qt = torch.from_numpy(Q)
    fns = {
        "pefa_gpu": lambda q, qt: erm.search(qt, k)[1].numpy(),
        "faiss": lambda q, qt: flat.search(q, k)[1],
        "torch": lambda q, qt: torch.topk(qt @ Pt.T, k, dim=1),
        "st": lambda q, qt: util.semantic_search(qt, Pt, top_k=k),
    }
    if single:  # one query at a time: (SINGLE_QUERIES, d) queries, seconds per query
        calls = {m: (lambda f=f: [f(Q[i:i + 1], Qt[i:i + 1]) for i in range(len(Q))])
                 for m, f in fns.items()}
    else:
        calls = {m: (lambda f=f: [f(Q, Qt)]) for m, f in fns.items()}
    secs, out = best_times(calls, repeats)
    secs = {m: t / len(out[m]) for m, t in secs.items()}
    same = float((np.concatenate(out["pefa_gpu"]) == np.concatenate(out["faiss"])).mean())
    rec: dict[str, Any] = {f"{m}_ms": secs[m] * 1e3 for m in METHODS}
    rec.update({f"vs_{m}": secs["pefa_gpu"] / secs[m] for m in METHODS[1:]})
    rec["ids_equal_faiss"] = same
    return rec


def run_cpu(ns, ds, bs, ks, threads: int, repeats: int, single_thread: bool,
            log: Callable[[str], None]) -> list[dict[str, Any]]:
    import faiss

    rows = []
    rng = np.random.default_rng(0)
    for n in ns:
        for d in ds:
            P = unit_rows(rng, n, d)
            Pt = torch.from_numpy(P)
            erm = pg.ERM(device="cpu").fit(P)
            flat = faiss.IndexFlatIP(d)
            flat.add(P)
            plan = [(threads, b) for b in bs] + ([(1, 1)] if single_thread else [])
            for th, b in plan:
                torch.set_num_threads(th)
                faiss.omp_set_num_threads(th)
                Q = unit_rows(rng, SINGLE_QUERIES if b == 1 else b, d)
                reps = repeats * (2 if b == 1 else 3 if b <= 64 else 1)
                for k in ks:
                    rec = {"n": n, "d": d, "B": b, "k": k, "threads": th,
                           **cpu_shape(P, Pt, erm, flat, Q, k, reps, b == 1)}
                    rows.append(rec)
                    log(f"n={n} d={d} B={b} k={k} threads={th}: " + " ".join(
                        f"{m}={rec[m + '_ms']:.1f}ms" for m in METHODS)
                        + f" vs faiss {rec['vs_faiss']:.2f} vs torch {rec['vs_torch']:.2f}"
                        + f" ids=faiss {rec['ids_equal_faiss']:.4f}")
            del erm, flat, P, Pt
    return rows


def run_gpu(log: Callable[[str], None], repeats: int) -> dict[str, Any]:
    """n = 1M, d = 768, bf16 storage, B = 4096, k = 100 on the first CUDA device."""
    dev = torch.device("cuda")
    n, d, b, k = 1_000_000, 768, 4096, 100
    g = torch.Generator(device=dev).manual_seed(0)
    P = torch.nn.functional.normalize(torch.randn(n, d, device=dev, generator=g), dim=1)
    Pb = P.to(torch.bfloat16)
    del P
    Q = torch.nn.functional.normalize(torch.randn(b, d, device=dev, generator=g), dim=1)
    index = pg.make_index("exact", dev, {"dtype": "bfloat16", "memory_budget": 2 * 2**30})
    index.build(Pb)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def timed(f: Callable[[], Any]) -> float:
        f()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            f()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return best

    t_gemm = timed(lambda: a @ a)
    t_pefa = timed(lambda: index.search(Q, k))
    t_torch = timed(lambda: torch.topk(Q.to(torch.bfloat16) @ Pb.T, k, dim=1))
    flops = 2.0 * b * n * d
    rec = {"n": n, "d": d, "B": b, "k": k, "dtype": "bfloat16", "memory_budget": 2 * 2**30,
           "gemm_8192_tflops": 2 * 8192**3 / t_gemm / 1e12,
           "pefa_gpu_ms": t_pefa * 1e3, "pefa_gpu_tflops": flops / t_pefa / 1e12,
           "torch_ms": t_torch * 1e3, "torch_tflops": flops / t_torch / 1e12}
    rec["pefa_share_of_gemm"] = rec["pefa_gpu_tflops"] / rec["gemm_8192_tflops"]
    rec["vs_torch"] = t_pefa / t_torch
    log(f"GPU: {rec}")
    return rec


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["B"], r["threads"]) for r in rows}, key=lambda x: (x[1] != 1, x[0]))
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 4), squeeze=False)
    for ax, (b, th) in zip(axes[0], groups):
        sub = [r for r in rows if r["B"] == b and r["threads"] == th]
        x = np.arange(len(sub))
        for m in ("faiss", "torch", "st"):
            ax.plot(x, [r[f"vs_{m}"] for r in sub], "o-", label=f"pefa_gpu / {m}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(x, [f"{r['n'] // 1000}k,{r['d']},{r['k']}" for r in sub], rotation=70,
                      fontsize=7)
        ax.set_yscale("log")
        ax.set_title(f"B = {b}, {th} thread{'s' if th > 1 else ''}")
        ax.set_xlabel("n, d, k")
    axes[0][0].set_ylabel("time ratio (< 1: pefa_gpu faster)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="n=20k, d=384, B in {1, 4, 64, 500}, "
                    "k in {10, 100}: checks the script in about a minute")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-gpu", action="store_true")
    args = ap.parse_args()
    if args.quick:
        ns, ds, bs, ks, name = [20_000], [384], [1, 4, 64, 500], [10, 100], "exact_quick"
    else:
        ns, ds, bs, ks, name = [50_000, 200_000], [384, 768], [1, 4, 64, 2000], [10, 100, 500], \
            "exact"
    load_before = os.getloadavg()
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    rows = run_cpu(ns, ds, bs, ks, args.threads, args.repeats, True, log)
    gpu = run_gpu(log, args.repeats) if torch.cuda.is_available() and not args.no_gpu else None
    load_after = os.getloadavg()

    md = (f"CPU: pefa_gpu exact (`ERM(device='cpu').fit(P).search(q, k)`) vs faiss IndexFlatIP,"
          f" torch mm + topk, sentence-transformers util.semantic_search; random unit vectors;"
          f" best of {args.repeats} in alternation, order rotated every repeat (B = 4, 64:"
          f" {3 * args.repeats}; B = 1: time per query of {SINGLE_QUERIES} searched one at a time,"
          f" best of {2 * args.repeats}); ratios < 1: "
          f"pefa_gpu faster. Load average (1, 5, 15 min) before {load_before[0]:.2f} "
          f"{load_before[1]:.2f} {load_before[2]:.2f}, after {load_after[0]:.2f} "
          f"{load_after[1]:.2f} {load_after[2]:.2f}; wall {time.perf_counter() - t0:.0f} s.\n\n")
    headers = ["n", "d", "B", "k", "threads", "pefa_gpu ms", "faiss ms", "torch ms", "st ms",
               "/faiss", "/torch", "/st", "ids = faiss"]
    table = [[r["n"], r["d"], r["B"], r["k"], r["threads"], f"{r['pefa_gpu_ms']:.1f}",
              f"{r['faiss_ms']:.1f}", f"{r['torch_ms']:.1f}", f"{r['st_ms']:.1f}",
              f"{r['vs_faiss']:.2f}", f"{r['vs_torch']:.2f}", f"{r['vs_st']:.2f}",
              f"{r['ids_equal_faiss']:.4f}"] for r in rows]
    md += md_table(headers, table)
    big = [r for r in rows if r["B"] >= 64]
    single = [r for r in rows if r["B"] == 1 and r["threads"] == 1]
    targets = {
        "max_vs_faiss_B_ge_64": max(r["vs_faiss"] for r in big) if big else None,
        "max_vs_torch_B_ge_64": max(r["vs_torch"] for r in big) if big else None,
        "max_vs_faiss_single_query_1_thread": max(r["vs_faiss"] for r in single)
        if single else None,
    }
    md += (f"\nTargets: B >= 64: worst pefa_gpu / faiss {targets['max_vs_faiss_B_ge_64']:.2f} "
           f"(target <= 1.0), worst pefa_gpu / torch {targets['max_vs_torch_B_ge_64']:.2f} "
           f"(<= 1.0); single query, 1 thread: worst / faiss "
           f"{targets['max_vs_faiss_single_query_1_thread']:.2f} (<= 1.2).\n")
    if gpu:
        md += "\nGPU\n\n" + md_table(list(gpu), [list(gpu.values())])
    else:
        md += "\nGPU: no CUDA device in this run.\n"
    png = RESULTS / f"{name}.png"
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(rows, png)
    md += f"\n![{name}]({png.name})\n"
    write_results(name, {"cpu": rows, "gpu": gpu, "targets": targets, "threads": args.threads,
                         "repeats": args.repeats, "load_before": load_before,
                         "load_after": load_after}, md)
    print(md)


if __name__ == "__main__":
    main()
