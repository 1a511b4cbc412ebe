"""SciFact from text: the paper's λ × k grid, its plots, and what the whole grid costs.

    .venv/bin/python benchmarks/sweep.py                    # encodes once (cached), then fast
    .venv/bin/python benchmarks/sweep.py --threads 1 --repeats 7

1. Encode corpus and queries with the offline all-MiniLM-L6-v2 (``pefa_gpu.encode``, cached
   under --cache-dir, default ~/.cache/pefa_gpu): time, and the largest difference from the
   precomputed embeddings shipped with the dataset.
2. The grid (ERM; XS λ ∈ 0.1..0.9; XL λ × k ∈ {16, 32, 64}) on the test split: table + PNG.
3. Cost, fit + search + fusion (embeddings in memory), median of --repeats runs taken in
   alternation: one configuration of each method (XS λ=0.5, XL λ=0.1 k=16) against the whole
   grid through ``pefa_gpu.sweep``, and against fitting each grid point separately.
4. The same one-configuration / grid comparison on a larger synthetic corpus
   (``pefa_gpu.synthetic``, --scale documents, half as many training queries, 1000 test
   queries, d=384), where searches weigh more than fusion (``--scale 0`` skips it).
Results: benchmarks/results/sweep_scifact.{json,md,png}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import RESULTS, SCIFACT, md_table, write_results  # noqa: E402

import pefa_gpu as pg  # noqa: E402
from pefa_gpu.plots import plot_sweep  # noqa: E402
from pefa_gpu.encode import default_cache_dir  # noqa: E402
from pefa_gpu.sweep import PAPER_KS, PAPER_LAMS, grid, sweep_search  # noqa: E402
from pefa_gpu.tune import fit_config  # noqa: E402


def one_config(P, Q, Y, Qt, device):
    """ERM, XS λ=0.5 and XL λ=0.1 k=16, each fitted and searched once."""
    for cfg in (pg.Config("erm"), pg.Config("xs", 0.5), pg.Config("xl", 0.1, 16)):
        fit_config(cfg, P, Q, Y, device=device).search(Qt, 100)


def full_grid(P, Q, Y, Qt, device):
    for _ in sweep_search(P, Q, Y, Qt, device=device, show_progress=False):
        pass


def separate_fits(P, Q, Y, Qt, device):
    for cfg in grid():
        fit_config(cfg, P, Q, Y, device=device).search(Qt, 100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=str(SCIFACT))
    ap.add_argument("--cache-dir", default=str(default_cache_dir()))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--scale", type=int, default=100_000,
                    help="documents of the synthetic corpus (0: skip)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ds = pg.load_beir(args.data)
    tr, Ytr = ds.qrels("train")
    te, Yte = ds.qrels("test", binary=False)

    t0 = time.perf_counter()
    P = pg.encode(ds.corpus_texts, cache_dir=args.cache_dir, device=args.device)
    Qa = pg.encode(ds.query_texts, cache_dir=args.cache_dir, device=args.device)
    t_encode = time.perf_counter() - t0
    diff = None
    try:
        P_ref, Q_ref = ds.embeddings("all-MiniLM-L6-v2")
        diff = float(max(np.abs(P.cpu().numpy() - P_ref).max(),
                         np.abs(Qa.cpu().numpy() - Q_ref).max()))
    except pg.InputError:
        pass
    Q, Qt = Qa[torch.from_numpy(tr)], Qa[torch.from_numpy(te)]

    res = pg.sweep(P, Q, Ytr, Qt, Yte, device=args.device, show_progress=False)
    rows = [{k: r[k] for k in ("method", "lam", "k", "recall@10", "recall@100", "ndcg@10")}
            for r in res.rows]

    timings = {"one_config": [], "grid": [], "separate_fits": []}
    runs = (("one_config", one_config), ("grid", full_grid), ("separate_fits", separate_fits))
    for fn in (one_config, full_grid):  # warm-up
        fn(P, Q, Ytr, Qt, args.device)
    for rep in range(args.repeats):
        for name, fn in runs:
            if name == "separate_fits" and rep >= 2:
                continue  # slow and only a reference: two runs are enough
            t = time.perf_counter()
            fn(P, Q, Ytr, Qt, args.device)
            timings[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in timings.items()}
    ratio = med["grid"] / med["one_config"]

    scale = None
    if args.scale:
        from pefa_gpu.synthetic import make_synthetic
        syn = make_synthetic(args.scale, args.scale // 2, d=384, n_test=1000, seed=0)
        sP, sQ, sQt = (torch.from_numpy(np.ascontiguousarray(x)) for x in (syn.P, syn.Q,
                                                                          syn.Q_test))
        st = {"one_config": [], "grid": []}
        for rep in range(max(2, args.repeats // 2) + 1):
            for name, fn in runs[:2]:
                t = time.perf_counter()
                fn(sP, sQ, syn.Y, sQt, args.device)
                if rep:  # the first round warms up
                    st[name].append(time.perf_counter() - t)
        smed = {k: statistics.median(v) for k, v in st.items()}
        scale = {"n": args.scale, "m": args.scale // 2, "n_test": 1000, "d": 384,
                 "timings_s": st, "median_s": smed,
                 "grid_over_one_config": smed["grid"] / smed["one_config"]}

    png = RESULTS / "sweep_scifact.png"
    plot_sweep(rows, png, title=f"SciFact (all-MiniLM-L6-v2 from text): λ × k, "
                                f"{len(te)} test queries")
    table = md_table(["method", "λ", "k", "R@10", "R@100", "nDCG@10"],
                     [[r["method"].upper(), "" if r["lam"] is None else f"{r['lam']:g}",
                       "" if r["k"] is None else r["k"], r["recall@10"], r["recall@100"],
                       r["ndcg@10"]] for r in rows])
    best = {m: max((r for r in rows if r["method"] == m), key=lambda r: r["recall@10"])
            for m in ("erm", "xs", "xl")}
    summary = md_table(["best by R@10", "λ", "k", "R@10", "R@100", "nDCG@10"],
                       [[m.upper(), "" if b["lam"] is None else f"{b['lam']:g}",
                         "" if b["k"] is None else b["k"], b["recall@10"], b["recall@100"],
                         b["ndcg@10"]] for m, b in best.items()])
    cost = md_table(["run (fit + search + fusion, 300 test queries)", "median s", "× one config"],
                    [["one configuration (ERM, XS λ=0.5, XL λ=0.1 k=16)", med["one_config"],
                      1.0],
                     [f"whole grid via pefa_gpu.sweep ({len(rows)} configurations)",
                      med["grid"], ratio],
                     ["whole grid, each configuration fitted separately",
                      med["separate_fits"], med["separate_fits"] / med["one_config"]]])
    if scale:
        cost += md_table(
            [f"synthetic: {scale['n']} docs, {scale['m']} training queries, 1000 test queries, "
             f"d=384", "median s", "× one config"],
            [["one configuration (ERM, XS λ=0.5, XL λ=0.1 k=16)", scale["median_s"]["one_config"],
              1.0],
             [f"whole grid via pefa_gpu.sweep ({len(rows)} configurations)",
              scale["median_s"]["grid"], scale["grid_over_one_config"]]])
    md = (f"Encoding {len(ds.corpus_texts)} documents + {len(ds.query_texts)} queries: "
          f"{t_encode:.1f} s (cache: {args.cache_dir}); max |difference| from the shipped "
          f"embeddings: {diff if diff is None else f'{diff:.2e}'}. torch threads: "
          f"{torch.get_num_threads()}, device {args.device}.\n\n"
          + cost + "\n" + summary + "\n" + table
          + f"\n![recall vs λ]({png.name})\n")
    write_results("sweep_scifact", {
        "dataset": "scifact", "n_test_queries": int(len(te)), "encode_s": t_encode,
        "max_abs_diff_vs_shipped_embeddings": diff, "device": args.device,
        "timings_s": timings, "median_s": med, "grid_over_one_config": ratio,
        "synthetic": scale,
        "results": rows, "lams": list(PAPER_LAMS), "ks": list(PAPER_KS)}, md)
    print(md)


if __name__ == "__main__":
    main()
