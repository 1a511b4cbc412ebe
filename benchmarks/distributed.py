"""The offline pipeline on Ray (pefa_gpu.distributed) against the same pipeline in one process
and against the library path a user would take on one machine, with a cost model for larger
settings.

    .venv/bin/python benchmarks/distributed.py [--n 100000 --m 200000 --d 64 --test 2000]
                                               [--encode-docs 300] [--repeats 2]

1. Encode (SciFact abstracts, the offline all-MiniLM-L6-v2): pg.encode in this process against
   the encode stage on a local Ray cluster with 1 and 2 workers (Ray actors).
2. A synthetic set (``pg.make_synthetic``; default 100k documents) end to end: write the
   stages, aggregate (PIFA + E), build ERM / XS / XL shards, search the test queries, evaluate;
   per stage, with (a) the library in one process (PEFAXS / PEFAXL fit + search), (b) the
   pipeline in one process (``LocalRunner``), (c) Ray with 1 worker, (d) Ray with 2 workers.
   Ray runs twice per cluster: cold (worker processes importing torch, actors starting) and
   warm; cluster start is reported apart. Metrics must be equal across all four.
3. Bytes moved per stage (measured shuffle sizes; the rest counted from the shapes sent) and
   the naive join-then-group-by's for the aggregation.
4. A cost model (assumptions stated in the output) for ProdSearch-30M and 1B documents on N
   GPU nodes.

The machine is shared: the load average is recorded around every measurement.
Results: benchmarks/results/distributed.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import RESULTS, SCIFACT, md_table, write_results  # noqa: E402

import pefa_gpu as pg  # noqa: E402
from pefa_gpu import pipeline as pp  # noqa: E402
from pefa_gpu.sweep import Config  # noqa: E402

CONFIGS = [Config("erm"), Config("xs", 0.5), Config("xl", 0.1, 16)]
KS = (10, 100)
STAGES = ("write", "aggregate", "build_erm", "build_xs", "build_xl", "search_erm", "search_xs",
          "search_xl")


def load() -> float:
    return os.getloadavg()[0]


# ------------------------------------------------------------------------------ 1. encode

def bench_encode(n_docs: int) -> list[dict]:
    import ray

    from pefa_gpu.distributed import connect

    ds = pg.load_beir(SCIFACT)
    texts = ds.corpus_texts[:n_docs]
    rows = []
    la = load()
    t = time.perf_counter()
    pg.encode(texts, device="cpu", show_progress=False)
    rows.append({"mode": "pg.encode, one process (2 threads)", "seconds": time.perf_counter() - t,
                 "load_before": la, "load_after": load()})
    for workers in (1, 2):
        with connect("local", workers=workers) as run, tempfile.TemporaryDirectory() as w:
            la = load()
            t = time.perf_counter()
            pp.encode(texts, Path(w) / "enc", rows=-(-n_docs // 4), runner=run,
                      show_progress=False)
            rows.append({"mode": f"Ray, {workers} worker{'s' * (workers > 1)} "
                                 f"(1 thread each; actor start + model load included)",
                         "seconds": time.perf_counter() - t, "load_before": la,
                         "load_after": load()})
        assert not ray.is_initialized()
    for r in rows:
        r["texts_per_s"] = n_docs / r["seconds"]
    return rows


# ------------------------------------------------------------------------------ 2. synthetic

def library_run(d, times: dict) -> list[dict]:
    """What a user runs on one machine: fit each model, search, evaluate."""
    out = []
    for cfg in CONFIGS:
        t = time.perf_counter()
        if cfg.method == "erm":
            model = pg.ERM(device="cpu").fit(d.P)
        elif cfg.method == "xs":
            model = pg.PEFAXS(lam=cfg.lam, device="cpu").fit(d.P, d.Q, d.Y)
        else:
            model = pg.PEFAXL(lam=cfg.lam, k=cfg.k, device="cpu", search_params=pg.XLSearchParams(
                candidates=500)).fit(d.P, d.Q, d.Y)
        t1 = time.perf_counter()
        _, ids = model.search(d.Q_test, 100)
        t2 = time.perf_counter()
        times[f"fit_{cfg.method}"] = t1 - t
        times[f"search_{cfg.method}"] = t2 - t1
        out.append(pg.evaluate(ids, d.Y_test, KS))
    return out


def pipeline_run(d, work: Path, runner, times: dict, workers: int) -> tuple[list[dict], dict]:
    """The stages one by one (what evaluate_configs does), timed; returns metrics and the
    stage infos (for the bytes)."""
    def tick(key, t):
        times[key] = time.perf_counter() - t

    t = time.perf_counter()
    rows = max(-(-d.P.shape[0] // workers), 1)
    qrows = max(-(-d.Q.shape[0] // workers), 1)
    docs = pp.write_rows(d.P, work / "docs", rows=rows)
    train = pp.write_rows(d.Q, work / "queries", rows=qrows)
    rel = pp.write_relevance(d.Y, work / "pairs", rows=qrows)
    tick("write", t)
    t = time.perf_counter()
    agg = pp.aggregate(train, rel, docs, work / "xs", lam=0.5, doc_rows=rows, runner=runner)
    tick("aggregate", t)
    builds = {}
    for method, kw in (("erm", {}), ("xs", {"embeddings": agg}),
                       ("xl", {"queries": train, "relevance": rel, "lam": 0.1, "k": 16,
                               "candidates": 500})):
        t = time.perf_counter()
        builds[method] = pp.build(method, work / f"b-{method}", docs, doc_rows=rows,
                                  runner=runner, **kw)
        tick(f"build_{method}", t)
    metrics = []
    for method in ("erm", "xs", "xl"):
        t = time.perf_counter()
        _, ids = pp.search(builds[method], d.Q_test, topk=100, runner=runner)
        tick(f"search_{method}", t)
        metrics.append(pg.evaluate(ids, d.Y_test, KS))
    infos = {"aggregate": pp.read_stage(agg), "build_xl": pp.read_stage(builds["xl"])}
    return metrics, infos


def bench_synthetic(args) -> dict:
    import ray

    from pefa_gpu.distributed import connect

    d = pg.make_synthetic(n=args.n, m=args.m, d=args.d, n_test=args.test, seed=0)
    runs = []
    reference = None
    for rep in range(args.repeats):
        for mode in ("library", "pipeline", "ray-1", "ray-2"):
            entry = {"mode": mode, "repeat": rep, "load_before": load()}
            times: dict[str, float] = {}
            with tempfile.TemporaryDirectory() as w, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if mode == "library":
                    metrics = library_run(d, times)
                    infos = None
                elif mode == "pipeline":
                    metrics, infos = pipeline_run(d, Path(w), None, times, 1)
                else:
                    workers = int(mode[-1])
                    t0 = time.perf_counter()
                    with connect("local", workers=workers) as run:
                        entry["cluster_start_s"] = time.perf_counter() - t0
                        cold: dict[str, float] = {}
                        t1 = time.perf_counter()
                        pipeline_run(d, Path(w) / "cold", run, cold, workers)
                        entry["cold_total_s"] = time.perf_counter() - t1
                        entry["cold"] = cold
                        metrics, infos = pipeline_run(d, Path(w) / "warm", run, times, workers)
                    assert not ray.is_initialized()
            entry["total_s"] = sum(times.values())
            entry["stages"] = times
            entry["load_after"] = load()
            if reference is None:
                reference = metrics
            entry["metrics_equal_library"] = all(
                abs(a[k] - b[k]) < 1e-9 for a, b in zip(metrics, reference) for k in a)
            if infos:
                entry["bytes_shuffled"] = {k: v.bytes_shuffled for k, v in infos.items()}
            entry["metrics"] = metrics
            runs.append(entry)
            print(f"{mode} rep {rep}: {entry['total_s']:.1f} s (load {entry['load_before']:.1f}"
                  f" -> {entry['load_after']:.1f})", flush=True)
    return {"n": args.n, "m": args.m, "d": args.d, "n_test": args.test, "nnz": int(d.Y.nnz),
            "runs": runs}


# ------------------------------------------------------------------------------ 3. bytes

def bytes_table(n: int, m: int, nnz: int, d: int, shuffled: dict, b: int, workers: int,
                kp: int = 500, k: int = 16, topk: int = 100) -> list[list]:
    """(stage, bytes moved, what) for the synthetic run, from its shapes and the measured
    shuffles."""
    f = 4 * d
    y = 12 * nnz
    rows = [
        ["aggregate: map reads Q_r, Y_r", m * f + y, "each query shard once"],
        ["aggregate: partial sums shuffled (measured)", shuffled["aggregate"],
         "U_rs rows of (doc id, d floats)"],
        ["aggregate: naive join-then-group-by shuffle", nnz * (f + 8),
         "one (doc id, query row) per pair"],
        ["aggregate: reduce reads P_s, writes sums + E", 3 * n * f, ""],
        ["build ERM / XS: read P or E, write the index", 2 * n * f, "exact: the vectors"],
        ["build XL: pairs shuffled (measured)", shuffled["build_xl"],
         "per document range (its queries' rows are read from storage)"],
        ["search ERM / XS: queries out, top-100 back", b * workers * (f + topk * 12),
         f"{workers} servers"],
        ["search XL: queries out, Kp + k candidates back and out again, top-100 back",
         b * workers * (2 * f + (kp + k) * 12 * 2 + topk * 12), f"{workers} servers"],
    ]
    return rows


# ------------------------------------------------------------------------------ 4. cost model

ASSUME = {
    "encode_texts_per_s_per_gpu": 2500,   # BERT-base-sized encoder, fp16, ~64 tokens, H100
    "gemm_tflops_per_gpu": 150,           # bf16 dense GEMM actually reached (~20% of peak)
    "hbm_gb_per_s": 2000,                 # sustained HBM bandwidth (SpMM, top-k passes)
    "net_gb_per_s_per_node": 12.5,        # 100 Gb/s per node, each direction
    "storage_gb_per_s_per_node": 2.0,     # shared-storage read/write per node
    "gpus_per_node": 8,
    "gpu_memory_gb": 80,
    "bytes_per_float": 2,                 # embeddings stored and moved in bf16
}


# cost-model stage -> the stage of benchmarks/scale_curve.py whose measured growth it takes
MEASURED = {"aggregate": ("pipeline", "aggregate", "xs"),
            "build (exact shards)": ("pipeline", "build", "xs"),
            "search + evaluate (exact ERM/XS, top-100)": ("model", "search", "erm"),
            "search XL (Kp=500)": ("model", "search", "xl")}


def measured_exponents() -> dict[str, tuple[float, int]]:
    """Cost-model stage -> (time exponent in n, largest n measured) from
    results/scale_curve.json (exact float32 rows), where that file has the stage."""
    path = RESULTS / "scale_curve.json"
    if not path.exists():
        return {}
    curves = json.loads(path.read_text())["curves"]
    out = {}
    for stage, (where, what, method) in MEASURED.items():
        for c in curves:
            if (c["path"], c["stage"], c["method"]) == (where, what, method) and \
                    c["backend"] == "exact" and c["dtype"] == "float32" and c["time_exponent"]:
                out[stage] = (c["time_exponent"], c["n"][-1])
    return out


def cost_model(n: float, m: float, nnz: float, d: int, n_test: float, nodes: int,
               kp: int = 500, exponents: dict | None = None) -> dict:
    """Hours per stage for ``nodes`` GPU nodes: each stage takes the longest of its compute,
    its network and its storage time (all spread evenly over the nodes). ``exponents``
    (:func:`measured_exponents`): a stage measured to grow as n^e up to n0 takes the linear
    estimate times (n / n0)^(e - 1) beyond n0 (e below 1 counts as 1)."""
    a = ASSUME
    g = nodes * a["gpus_per_node"]
    f = d * a["bytes_per_float"]
    net = nodes * a["net_gb_per_s_per_node"] * 1e9
    sto = nodes * a["storage_gb_per_s_per_node"] * 1e9
    hbm = g * a["hbm_gb_per_s"] * 1e9
    texts = n + m + n_test
    # query shards R = GPUs; partial sums <= min(nnz, R n) rows (no repeats assumed: worst)
    shuffle = min(nnz, g * n) * (f + 8)
    stages = {
        "encode": max(texts / (g * a["encode_texts_per_s_per_gpu"]), texts * f / sto),
        "aggregate": max(nnz * f * 2 / hbm, (m * f + 12 * nnz + 3 * n * f) / sto,
                         shuffle / net),
        "build (exact shards)": max(2 * n * f / sto, n * f / hbm),
        "search + evaluate (exact ERM/XS, top-100)": max(
            2 * n_test * n * d / (g * a["gemm_tflops_per_gpu"] * 1e12),
            n_test * g * (f + 1200) / net),
        "search XL (Kp=500)": max(2 * n_test * (n + m) * d /
                                  (g * a["gemm_tflops_per_gpu"] * 1e12),
                                  n_test * g * (2 * f + 2 * (kp + 16) * 12 + 1200) / net),
    }
    for k, (e, n0) in (exponents or {}).items():
        stages[k] *= max(n / n0, 1.0) ** max(e - 1.0, 0.0)
    naive = nnz * (f + 8) / net
    out = {k: v / 3600 for k, v in stages.items()}
    out["aggregate, naive join (network only)"] = naive / 3600
    # GPU memory per GPU for the search shards: XS / ERM index; XL passage + query index and
    # the training queries each document shard keeps for its pairs (<= nnz rows in all)
    out["GB per GPU, XS index"] = n * f / g / 1e9
    out["GB per GPU, XL shards"] = (n + m + min(nnz, g * m)) * f / g / 1e9
    return out


def cost_rows() -> tuple[list[list], dict]:
    settings = {"ProdSearch-30M": dict(n=30e6, m=100e6, nnz=500e6, d=768, n_test=1e6),
                "1B documents": dict(n=1e9, m=3e9, nnz=15e9, d=768, n_test=10e6)}
    rows, data, exponents = [], {}, measured_exponents()
    for name, s in settings.items():
        for nodes in (1, 4, 16, 64):
            c = cost_model(nodes=nodes, exponents=exponents, **s)
            data[f"{name} / {nodes} nodes"] = c
            rows.append([name, nodes, *[f"{v:.2f}" if "GB" not in k else f"{v:.0f}"
                                        for k, v in c.items()]])
    return rows, {"settings": settings, "assumptions": ASSUME, "hours": data,
                  "measured_exponents": exponents}


# ------------------------------------------------------------------------------ main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--m", type=int, default=200_000)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--test", type=int, default=2_000)
    ap.add_argument("--encode-docs", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-encode", action="store_true")
    ap.add_argument("--cost-only", action="store_true",
                    help="keep the measurements of results/distributed.json, redo the cost model "
                    "(after a new results/scale_curve.json)")
    args = ap.parse_args()

    if args.cost_only:
        old = json.loads((RESULTS / "distributed.json").read_text())
        args = argparse.Namespace(**old["args"])
        enc, syn = old["encode"], old["synthetic"]
        measured_on = old.get("measured_on") or old["stamp"]["date"]
    else:
        enc = [] if args.skip_encode else bench_encode(args.encode_docs)
        syn, measured_on = bench_synthetic(args), None
    cost, cost_data = cost_rows()

    md = []
    if enc:
        md.append(f"## Encode: {args.encode_docs} SciFact abstracts, all-MiniLM-L6-v2 (CPU)\n")
        md.append(md_table(["mode", "seconds", "texts/s", "load avg before → after"],
                           [[r["mode"], f"{r['seconds']:.1f}", f"{r['texts_per_s']:.1f}",
                             f"{r['load_before']:.1f} → {r['load_after']:.1f}"] for r in enc]))
    best = {}
    for r in syn["runs"]:
        if r["mode"] not in best or r["total_s"] < best[r["mode"]]["total_s"]:
            best[r["mode"]] = r
    md.append(f"\n## Synthetic: n = {args.n:,} documents, m = {args.m:,} training queries, "
              f"nnz = {syn['nnz']:,} pairs, d = {args.d}, {args.test:,} test queries\n")
    md.append("Seconds per stage, best of "
              f"{args.repeats} (Ray: warm cluster; cold run and cluster start apart). The "
              "library path fits each model (`fit_*`, aggregation included) and searches.\n")
    heads = ["stage", *best]
    keys = sorted({k for r in best.values() for k in r["stages"]},
                  key=lambda k: (k not in STAGES, STAGES.index(k) if k in STAGES else 0, k))
    table = [[k, *[f"{r['stages'][k]:.2f}" if k in r["stages"] else "" for r in best.values()]]
             for k in keys]
    table.append(["**total**", *[f"{r['total_s']:.2f}" for r in best.values()]])
    table.append(["Ray cold run (imports, actors)",
                  *[f"{r['cold_total_s']:.2f}" if "cold_total_s" in r else ""
                    for r in best.values()]])
    table.append(["Ray cluster start", *[f"{r['cluster_start_s']:.2f}" if "cluster_start_s"
                                         in r else "" for r in best.values()]])
    table.append(["metrics equal to the library", *[str(r["metrics_equal_library"])
                                                    for r in best.values()]])
    table.append(["load avg before → after", *[f"{r['load_before']:.1f} → "
                                               f"{r['load_after']:.1f}" for r in best.values()]])
    md.append(md_table(heads, table))
    ratio = {k: best[k]["total_s"] / best["pipeline"]["total_s"] for k in best}
    ratio_lib = {k: best[k]["total_s"] / best["library"]["total_s"] for k in best}
    md.append("\nTotal time relative to the pipeline in one process: " + ", ".join(
        f"{k} {v:.2f}x" for k, v in ratio.items()) + "; relative to the library path: " +
        ", ".join(f"{k} {v:.2f}x" for k, v in ratio_lib.items()) + ".\n")
    r2 = best["ray-2"]
    md.append("\n## Bytes moved (synthetic run, 2 workers)\n")
    md.append(md_table(["stage", "bytes", "note"],
                       [[a, f"{b / 1e6:.1f} MB", c] for a, b, c in bytes_table(
                           args.n, args.m, syn["nnz"], args.d, r2["bytes_shuffled"], args.test,
                           2)]))
    md.append("\n## Cost model (hours per stage, GB per GPU; estimates, not measurements)\n")
    md.append("Assumptions: " + ", ".join(f"{k} = {v}" for k, v in ASSUME.items()) +
              ". Each stage takes the longest of its compute, network and storage time, "
              "spread evenly over the nodes; query shards = GPUs; the partial-sum shuffle is "
              "taken at its worst (no document repeated within a query shard). ProdSearch-30M: "
              "n = 30M, m = 100M, nnz = 500M, d = 768, 1M test queries; 1B documents: m = 3B, "
              "nnz = 15B, 10M test queries.\n")
    if cost_data["measured_exponents"]:
        md.append("Re-fit to the growth measured on one machine from 100k to 5M documents "
                  "(benchmarks/results/scale_curve.md): a stage measured to grow as n^e up to "
                  "n0 takes the linear estimate times (n / n0)^(e - 1) beyond n0 (e below 1 "
                  "counts as 1): " + ", ".join(
                      f"{k}: e = {e:.2f} to n0 = {n0:,}"
                      for k, (e, n0) in cost_data["measured_exponents"].items()) + ".\n")
    if measured_on:
        md.append(f"(Cost model redone with --cost-only; the measurements above are of "
                  f"{measured_on}.)\n")
    md.append(md_table(["setting", "nodes", *cost_data["hours"][next(iter(cost_data["hours"]))]],
                       cost))
    write_results("distributed", {"args": vars(args), "encode": enc, "synthetic": syn,
                                  "ratios_vs_pipeline": ratio, "ratios_vs_library": ratio_lib,
                                  "cost_model": cost_data, "measured_on": measured_on},
                  "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
