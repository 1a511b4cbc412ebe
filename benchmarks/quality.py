"""Recall@10/100 of ERM, PEFA-XS and PEFA-XL on SciFact (precomputed embeddings), paper style.

    python benchmarks/quality.py [BEIR_DIR] [--embeddings all-MiniLM-L6-v2] [--device cpu]

Writes benchmarks/results/quality.{json,md}. XS: λ ∈ {0.1..0.9}, augment_docs on and off.
XL: k ∈ {16, 32, 64} × λ ∈ {0.1..0.9} (candidates=500, knn_norm="k", rescore=True); XL is
fitted once and re-fused per (λ, k) from one search at the largest k.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pefa_gpu as pg
from _common import SCIFACT, md_table, write_results

LAMS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
KS = [16, 32, 64]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("data_dir", nargs="?", default=str(SCIFACT))
    ap.add_argument("--embeddings", default="all-MiniLM-L6-v2")
    ap.add_argument("--device", default=None)
    args = ap.parse_args()

    t0 = time.perf_counter()
    ds = pg.load_beir(args.data_dir)
    P, Qall = ds.embeddings(args.embeddings)
    train_rows, Ytr = ds.qrels("train")
    test_rows, Yte = ds.qrels("test")
    Q, T = Qall[train_rows], Qall[test_rows]

    rows = []

    def record(method, lam, k, augment, ids):
        r = pg.recall_at_k(ids, Yte, ks=(10, 100))
        rows.append({"method": method, "lam": lam, "k": k, "augment_docs": augment,
                     "recall@10": r[10], "recall@100": r[100]})

    record("ERM", None, None, None, pg.ERM(device=args.device).fit(P).search(T, 100)[1])
    for augment in (True, False):
        for lam in LAMS:
            xs = pg.PEFAXS(lam=lam, augment_docs=augment, device=args.device).fit(P, Q, Ytr)
            record("PEFA-XS", lam, None, augment, xs.search(T, 100)[1])
    xl = pg.PEFAXL(k=max(KS), device=args.device).fit(P, Q, Ytr)
    q = xl.as_queries(T)
    erm = xl.index.search(q, xl.search_params.candidates)
    knn = xl.neighbours(q, max(KS), erm)  # training queries and, augmented, documents
    for k in KS:
        for lam in LAMS:
            record("PEFA-XL", lam, k, True, xl.fuse(q, erm, knn, 100, lam=lam, k=k)[1])

    base = rows[0]
    best_xs = max((r for r in rows if r["method"] == "PEFA-XS"), key=lambda r: r["recall@10"])
    best_xl = max((r for r in rows if r["method"] == "PEFA-XL"), key=lambda r: r["recall@10"])
    summary = [[r["method"], "" if r["lam"] is None else f"{r['lam']:g}", r["k"] or "",
                r["recall@10"], r["recall@100"],
                f"{100 * (r['recall@10'] - base['recall@10']):+.2f}",
                f"{100 * (r['recall@100'] - base['recall@100']):+.2f}"]
               for r in (base, best_xs, best_xl)]
    head = ["method", "λ", "k", "Recall@10", "Recall@100", "Δ@10 (pt)", "Δ@100 (pt)"]
    table = (f"## {ds.name}: ERM vs PEFA (best λ/k picked on the test split, as in the paper's tables — optimistic; `pefa-gpu tune` picks on held-out training queries)\n\n"
             + md_table(head, summary)
             + f"\n{len(test_rows)} test queries, {len(train_rows)} training queries, "
               f"{Ytr.nnz} training pairs, {P.shape[0]} documents, embeddings "
               f"{args.embeddings}.\n\n## Full grid\n\n"
             + md_table(["method", "λ", "k", "augment_docs", "Recall@10", "Recall@100"],
                        [[r["method"], "" if r["lam"] is None else f"{r['lam']:g}", r["k"] or "",
                          r["augment_docs"] if r["augment_docs"] is not None else "",
                          r["recall@10"], r["recall@100"]] for r in rows]))
    write_results("quality", {"dataset": ds.name, "embeddings": args.embeddings,
                              "n_test_queries": len(test_rows), "rows": rows,
                              "seconds": time.perf_counter() - t0}, table)
    print(table)


if __name__ == "__main__":
    main()
