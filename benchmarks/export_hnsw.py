"""HNSW export on the CPU: faiss' own HNSW builder (the default now) against the exact top-2M
k-NN graph made navigable CAGRA-style (the previous CPU path, ``method="knn"``), side by side
in one run on the same vectors.

    .venv/bin/python benchmarks/export_hnsw.py                  # n = 50,000, d = 384
    .venv/bin/python benchmarks/export_hnsw.py --n 20000 --d 128

Both write the index with ``pg.export.export_hnsw`` (M = 32, efConstruction = 500, efSearch =
300, the paper's settings); recall@10 of each written index (read back with
``faiss.read_index``) against an exact float64 search, for 1,000 held-out queries. The machine's
load average is recorded before and after (other processes share the cores).
Results: benchmarks/results/export_hnsw.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import md_table, write_results  # noqa: E402

from pefa_gpu import export  # noqa: E402
from pefa_gpu.synthetic import make_synthetic  # noqa: E402


def exact_top(x: np.ndarray, q: np.ndarray, k: int) -> np.ndarray:
    out = []
    for s in range(0, len(q), 250):
        scores = q[s:s + 250].astype(np.float64) @ x.astype(np.float64).T
        out.append(np.argsort(-scores, axis=1, kind="stable")[:, :k])
    return np.concatenate(out)


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(found, truth)]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=50_000)
    ap.add_argument("--d", type=int, default=384)
    ap.add_argument("--queries", type=int, default=1000)
    args = ap.parse_args()
    import faiss

    data = make_synthetic(n=args.n, m=10, d=args.d, n_test=args.queries, seed=0)
    x, q = data.P, data.Q_test
    truth = exact_top(x, q, 10)
    threads = torch.get_num_threads()
    rows, results = [], {}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for method, what in (("knn", "exact top-64 graph + reverse edges (previous CPU path)"),
                             ("hnsw", "faiss IndexHNSWFlat builder (CPU default now)")):
            path = Path(tmp) / f"{method}.faiss"
            t0 = time.perf_counter()
            export.export_hnsw(x, path, M=32, ef_search=300, method=method, device="cpu")
            build = time.perf_counter() - t0
            index = faiss.read_index(str(path))
            t0 = time.perf_counter()
            _, ids = index.search(q, 10)
            search = time.perf_counter() - t0
            r = recall(ids, truth)
            results[method] = {"what": what, "index": type(index).__name__, "build_s": build,
                               "recall@10": r, "search_s": search,
                               "qps": len(q) / search}
            rows.append([method, what, type(index).__name__, round(build, 1), r,
                         round(len(q) / search)])
            print(rows[-1], flush=True)
    load_after = os.getloadavg()
    ratio = results["knn"]["build_s"] / results["hnsw"]["build_s"]
    table = md_table(["method", "graph", "written as", "build + write s", "recall@10 (ef 300)",
                      "QPS"], rows)
    table += (f"\n{args.n} synthetic clustered documents (pefa_gpu.synthetic, seed 0), d = "
              f"{args.d}, {args.queries} test queries; M = 32, efConstruction = 500, "
              f"efSearch = 300; torch / faiss threads: {threads} / {faiss.omp_get_max_threads()}."
              f"\nThe previous CPU path takes {ratio:.2f}x the time of faiss' builder. "
              f"Load average (1, 5, 15 min) before: {load_before[0]:.2f}, {load_before[1]:.2f}, "
              f"{load_before[2]:.2f}; after: {load_after[0]:.2f}, {load_after[1]:.2f}, "
              f"{load_after[2]:.2f} (other processes share the cores).\n")
    write_results("export_hnsw", {"n": args.n, "d": args.d, "queries": args.queries,
                                  "threads": threads, "results": results,
                                  "knn_over_hnsw_build": ratio,
                                  "loadavg_before": load_before, "loadavg_after": load_after},
                  table)
    print(table)


if __name__ == "__main__":
    main()
