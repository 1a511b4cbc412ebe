"""What PEFA-XL's two CPU shortcuts buy, at the shapes they serve (alternating, medians):

1. The fusion core on numpy arrays (what CPU batches run) against the same core on CPU torch
   tensors (what CUDA runs), at an offline evaluation batch (--batch queries).
2. Candidate pruning (``PEFAXL.prune_candidates``) on and off: XL search of a --batch on the
   hnsw and exact backends, and single queries on hnsw.

    .venv/bin/python benchmarks/xl_paths.py [--n 20000 --batch 2000 --repeats 5]
Results: benchmarks/results/xl_paths.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import md_table, write_results  # noqa: E402

import pefa_gpu as pg  # noqa: E402
from pefa_gpu.arrays import to_numpy  # noqa: E402
from pefa_gpu.fuse import fuse  # noqa: E402
from pefa_gpu.synthetic import make_synthetic  # noqa: E402


def seconds(f, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        out.append(time.perf_counter() - t0)
    return out


def alternate(a, b, repeats: int) -> tuple[float, float]:
    """Medians of a and b run in alternation."""
    ta, tb = [], []
    for _ in range(repeats):
        ta += seconds(a, 1)
        tb += seconds(b, 1)
    return statistics.median(ta), statistics.median(tb)


def model(data, backend: str) -> pg.PEFAXL:
    return pg.PEFAXL(backend=backend, device="cpu", lam=0.1, k=16,
                     search_params=pg.XLSearchParams(candidates=500)).fit(data.P, data.Q, data.Y)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=2000)
    ap.add_argument("--singles", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    data = make_synthetic(a.n, a.n // 5, 384, n_test=max(a.batch, a.singles))
    q = torch.from_numpy(data.Q_test[:a.batch])
    rows = []

    xl = model(data, "exact")
    erm = xl.index.search(q, 500)
    knn = xl.neighbours(q, 16, erm)
    arrays = [q, *erm, *knn, xl.doc_embeddings]
    host = [to_numpy(x) for x in arrays]

    def core(arrays):
        return fuse(arrays[0], tuple(arrays[1:3]), tuple(arrays[3:5]), xl.relevance_rows,
                    arrays[5], lams=(0.1,), ks=(16,), knn_norm="k", rescore=True,
                    erm_exact=True, topk=100)
    t_np, t_torch = alternate(lambda: core(host), lambda: core(arrays), a.repeats)
    rows.append(["fusion core, exact candidates", a.batch, t_np, t_torch, t_torch / t_np])

    hnsw = model(data, "hnsw")
    for backend, xl in (("hnsw", hnsw), ("exact", xl)):
        def search(prune: bool, xl=xl):
            xl.prune_candidates = prune
            return xl.search(q, 100)
        t_on, t_off = alternate(lambda: search(True), lambda: search(False), a.repeats)
        rows.append([f"XL search, pruning, {backend}", a.batch, t_on, t_off, t_off / t_on])
    singles = [torch.from_numpy(data.Q_test[i:i + 1]) for i in range(a.singles)]

    def one_by_one(prune: bool):
        hnsw.prune_candidates = prune
        for s in singles:
            hnsw.search(s, 10)
    t_on, t_off = alternate(lambda: one_by_one(True), lambda: one_by_one(False), a.repeats)
    rows.append(["XL single queries, pruning, hnsw", 1, t_on / a.singles, t_off / a.singles,
                 t_off / t_on])
    table = md_table(["what", "queries", "with the shortcut (s)", "without (s)", "gain"], rows)
    print(table)
    write_results("xl_paths", {"args": vars(a), "rows": rows}, table)


if __name__ == "__main__":
    main()
