"""How the cost grows: aggregation, index build, search and XL fusion as n, m and nnz(Y) grow.

    .venv/bin/python benchmarks/scale.py                 # CPU grid, a few minutes
    .venv/bin/python benchmarks/scale.py --sizes 10000,100000,1000000 --d 128
    .venv/bin/python benchmarks/scale.py --gpu-only      # only the GPU section (needs CUDA)

CPU section, per size n (m = 3n training queries, synthetic data from
pefa_gpu.synthetic): wall time and peak RSS growth (VmHWM, reset per stage) of PIFA, exact
index build, ERM search (top-Kp) and query-index search (top-k). ANN build/search (hnsw) when
faiss is installed and ``--ann``.

Fusion section, per synthetic size and for a product-search shape (54,667 documents, 7,800
training queries with ~1.1 relevant documents each, ~6% of the documents with any, 1,949 test
queries, d=384, Kp=500, k=16): ``PEFAXL.fuse`` on precomputed searches (passage top-Kp and
``PEFAXL.neighbours``), without rescoring (the authors' semantics) and with it, next to the
authors' scipy merge of the same searches (knn_csr @ Y + lam-weighted ERM matrix, per-row
top-k), interleaved, best of several; the ids (row by row) and scores (bitwise) of the fusion
without rescoring against the scipy merge's; the load average.

GPU section (when torch sees CUDA): bf16 GEMM rate measured first, then exact bf16 search
(n=1M, d=768, batch 4096) against half that rate; XL end-to-end vs ERM-alone throughput;
streamed aggregation bandwidth vs measured host-to-device copy bandwidth; PEFAXL.fuse (no
rescoring) vs the CPU scipy merge, and their ids. Results: benchmarks/results/scale.{json,md,png}.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import RESULTS, md_table, write_results  # noqa: E402

import pefa_gpu as pg  # noqa: E402
from pefa_gpu.synthetic import make_synthetic  # noqa: E402


def _status() -> dict[str, int]:
    t = open("/proc/self/status").read()
    return {k: int(re.search(k + r":\s+(\d+)", t).group(1)) * 1024 for k in ("VmRSS", "VmHWM")}


def measure(fn, repeats: int = 1):
    """(result, best wall seconds, peak RSS growth in bytes) of ``fn()``."""
    try:
        open("/proc/self/clear_refs", "w").write("5")
    except OSError:
        pass
    base = _status()["VmRSS"]
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return out, best, max(_status()["VmHWM"] - base, 0)


def scipy_merge(erm, knn, Y: sp.csr_matrix, lam: float, k: int, topk: int):
    """The authors' merge (PEFA's pefa_xl.py): sparse kNN scores times Y rows plus the
    lam-weighted ERM candidates, then PECOS's ``smat_util.sorted_csr`` (column indices sorted,
    then a stable argsort of each row by score: ties to the lower id), keeping the first
    ``topk`` -> (B, topk) float32 scores and int64 ids, -inf / -1 padded. erm (B, Kp) and knn
    (B, K) (scores, ids) CPU tensors, no padding in knn."""
    es, ei = erm[0].numpy(), erm[1].numpy()
    ks, ki = knn[0].numpy(), knn[1].numpy()
    b, kp = ei.shape
    kk = ki.shape[1]
    kc = sp.csr_matrix(((ks / k).ravel(), ki.ravel(), np.arange(0, b * kk + 1, kk)),
                       shape=(b, Y.shape[0]))
    ec = sp.csr_matrix((es.ravel(), ei.ravel(), np.arange(0, b * kp + 1, kp)),
                       shape=(b, Y.shape[1]))
    fused = (lam * ec + (1 - lam) * (kc @ Y)).tocsr()
    fused.sort_indices()
    scores = np.full((b, topk), -np.inf, np.float32)
    ids = np.full((b, topk), -1, np.int64)
    for r in range(b):
        lo, hi = fused.indptr[r], fused.indptr[r + 1]
        o = np.argsort(-fused.data[lo:hi], kind="stable")[:topk]
        scores[r, :len(o)], ids[r, :len(o)] = fused.data[lo:hi][o], fused.indices[lo:hi][o]
    return scores, ids


def time_fusion(data, kp: int, k: int, topk: int, lam: float, repeats: int) -> dict:
    """PEFAXL.fuse on a precomputed passage search and neighbour search of ``data.Q_test``
    (model defaults otherwise: augment_docs on, exact backend, CPU), with and without
    rescoring, next to :func:`scipy_merge` of the same searches: interleaved, best of
    ``repeats`` (at least 5); and whether the results agree (ids row by row, scores bitwise)."""
    xl = pg.PEFAXL(device="cpu", lam=lam, k=k, rescore=False).fit(data.P, data.Q, data.Y)
    xl_r = pg.PEFAXL(device="cpu", lam=lam, k=k, rescore=True).fit(data.P, data.Q, data.Y)
    T = torch.from_numpy(data.Q_test)
    erm = xl.index.search(T, kp)
    knn = xl.neighbours(T, k, erm)
    Y = xl.relevance.csr
    t_f, t_s, t_r = [], [], []
    for _ in range(max(repeats, 5)):
        for out, fn in ((t_f, lambda: xl.fuse(T, erm, knn, topk)),
                        (t_s, lambda: scipy_merge(erm, knn, Y, lam, k, topk)),
                        (t_r, lambda: xl_r.fuse(T, erm, knn, topk))):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    fs, fi = (x.numpy() for x in xl.fuse(T, erm, knn, topk))
    ss, si = scipy_merge(erm, knn, Y, lam, k, topk)
    return {"batch": len(T), "kp": kp, "k": k, "topk": topk, "lam": lam,
            "votes": int(np.diff(Y.indptr)[knn[1].numpy()].sum()),
            "fuse_s": min(t_f), "scipy_merge_s": min(t_s), "fuse_rescore_s": min(t_r),
            "fuse_vs_scipy": min(t_f) / min(t_s),
            "rows_ids_equal": int((fi == si).all(1).sum()),
            "scores_equal": bool(np.array_equal(fs, ss)),
            "load_avg": os.getloadavg()[0]}


def fusion_row(name: str, data, f: dict) -> list:
    y = data.Y.csr
    return [name, y.shape[1], y.shape[0], f"{y.nnz / y.shape[0]:.2f}", data.P.shape[1],
            f["batch"], f["kp"], f["k"], f["topk"], f"{f['fuse_s'] * 1e3:.1f}",
            f"{f['scipy_merge_s'] * 1e3:.1f}", f"{f['fuse_vs_scipy']:.2f}",
            f"{f['fuse_rescore_s'] * 1e3:.1f}", f"{f['rows_ids_equal']}/{f['batch']}",
            "yes" if f["scores_equal"] else "no", f"{f['load_avg']:.1f}"]


FUSION_HEAD = ["shape", "n docs", "m train queries", "pairs / query", "d", "B", "Kp", "k",
               "topk", "XL fuse ms", "scipy merge ms", "fuse / scipy", "fuse+rescore ms",
               "rows with equal ids", "scores bitwise equal", "load avg"]


def cpu_section(sizes, d, b, kp, k, topk, lam, repeats, ann):
    rows, recs, frows = [], [], []
    for n in sizes:
        m = 3 * n
        data = make_synthetic(n, m, d, b, seed=n)
        P, Q, T = (torch.from_numpy(x) for x in (data.P, data.Q, data.Q_test))
        Y = data.Y.csr
        rec = {"shape": "synthetic", "n": n, "m": m, "d": d, "nnz": int(Y.nnz), "batch": b}
        _, rec["pifa_s"], rec["pifa_peak"] = measure(
            lambda: pg.pifa(data.Y, data.Q, device="cpu"), repeats)
        _, rec["pifa_stream_s"], rec["pifa_stream_peak"] = measure(
            lambda: pg.pifa(data.Y, data.Q, device="cpu",
                            memory_budget=n * d * 4 + 32 * 2**20), repeats)
        pidx, rec["build_s"], rec["build_peak"] = measure(
            lambda: pg.make_index("exact", "cpu").build(P))
        qidx = pg.make_index("exact", "cpu").build(Q)
        _, rec["erm_search_s"], rec["erm_search_peak"] = measure(
            lambda: pidx.search(T, kp), repeats)
        _, rec["knn_search_s"], rec["knn_search_peak"] = measure(
            lambda: qidx.search(T, k), repeats)
        rec.update(time_fusion(data, kp, k, topk, lam, repeats))
        if ann:
            try:
                h, rec["hnsw_build_s"], rec["hnsw_build_peak"] = measure(
                    lambda: pg.make_index("hnsw", "cpu").build(P))
                _, rec["hnsw_search_s"], _ = measure(lambda: h.search(T, kp), repeats)
            except Exception as exc:  # faiss missing or backend params differ
                rec["hnsw_error"] = str(exc)
        recs.append(rec)
        rows.append([n, m, rec["nnz"], f"{rec['pifa_s']:.3f}", f"{rec['pifa_stream_s']:.3f}",
                     f"{rec['build_s']:.3f}", f"{rec['erm_search_s']:.3f}",
                     f"{rec['knn_search_s']:.3f}",
                     f"{max(rec['pifa_peak'], rec['erm_search_peak']) / 2**20:.0f}"])
        frows.append(fusion_row("synthetic", data, rec))
        print(frows[-1], flush=True)
    head = ["n", "m", "nnz(Y)", "PIFA s", "PIFA streamed s", "build s", "ERM search s",
            "kNN search s", "peak MiB"]
    return recs, rows, head, frows


def product_section(args) -> tuple[dict, list]:
    """A product-search shape: many documents, about one relevant document per training
    query, few documents with any training query."""
    data = make_synthetic(args.product_n, args.product_m, args.product_d, args.product_test,
                          rel_exponent=4.0, seed=7)
    covered = float((np.diff(data.Y.csr.tocsc().indptr) > 0).mean())
    rec = {"shape": "product search", "n": args.product_n, "m": args.product_m,
           "d": args.product_d, "nnz": int(data.Y.nnz), "coverage": covered,
           **time_fusion(data, args.kp, args.product_k, args.topk, args.lam, args.repeats)}
    print(rec, flush=True)
    return rec, fusion_row(f"product search ({covered:.0%} docs covered)", data, rec)


def plot(recs, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    nnz = [r["nnz"] for r in recs]
    n = [r["n"] for r in recs]
    ax = axes[0]
    ax.loglog(nnz, [r["pifa_s"] for r in recs], "o-", label="PIFA in memory")
    ax.loglog(nnz, [r["pifa_stream_s"] for r in recs], "s-", label="PIFA streamed")
    ax.loglog(nnz, [recs[0]["pifa_s"] * x / nnz[0] for x in nnz], "k:", label="linear")
    ax.set(xlabel="nnz(Y) (m = 3n)", ylabel="seconds", title="aggregation")
    ax.legend()
    ax = axes[1]
    ax.loglog(n, [r["build_s"] for r in recs], "o-", label="exact build")
    ax.loglog(n, [r["erm_search_s"] / r["batch"] for r in recs], "s-", label="exact search / query")
    if all("hnsw_search_s" in r for r in recs):
        ax.loglog(n, [r["hnsw_build_s"] for r in recs], "^-", label="hnsw build")
        ax.loglog(n, [r["hnsw_search_s"] / r["batch"] for r in recs], "v-",
                  label="hnsw search / query")
    ax.set(xlabel="n documents", ylabel="seconds", title="index")
    ax.legend()
    ax = axes[2]  # candidates per batch are ~B·Kp at every n: fusion should stay flat in n
    ax.loglog(n, [r["fuse_s"] for r in recs], "o-", label="PEFAXL.fuse")
    ax.loglog(n, [r["fuse_rescore_s"] for r in recs], "^-", label="PEFAXL.fuse, rescore")
    ax.loglog(n, [r["scipy_merge_s"] for r in recs], "s-", label="scipy merge (authors)")
    ax.set(xlabel=f"n documents (B·Kp = {recs[0]['batch'] * recs[0]['kp']:,} ERM "
           "candidates per batch)", ylabel="seconds", title="XL fusion")
    ax.legend()
    for a in axes:
        a.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def gpu_section(args) -> tuple[dict, str]:
    """bf16 GEMM rate, exact bf16 search, XL vs ERM, aggregation vs copy bandwidth."""
    dev = torch.device("cuda")
    out: dict = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count()}

    def cuda_time(fn, reps=5):
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / reps

    n, d, b = args.gpu_n, 768, 4096
    a = torch.randn(b, d, device=dev, dtype=torch.bfloat16)
    x = torch.randn(n, d, device=dev, dtype=torch.bfloat16)
    x = x / x.float().norm(dim=1, keepdim=True).to(torch.bfloat16)
    chunk = x[: min(n, 65536)]
    t = cuda_time(lambda: torch.mm(a, chunk.T, out_dtype=torch.float32))
    out["bf16_tflops"] = 2 * b * chunk.shape[0] * d / t / 1e12
    idx = pg.make_index("exact", dev, {"dtype": "bfloat16", "memory_budget": 4 << 30}).build(x)
    q = torch.nn.functional.normalize(torch.randn(b, d, device=dev), dim=1)
    t = cuda_time(lambda: idx.search(q, 100), reps=3)
    out["search_s"] = t
    out["search_tflops"] = 2 * b * n * d / t / 1e12
    out["search_vs_half_gemm"] = out["search_tflops"] / (0.5 * out["bf16_tflops"])
    # XL vs ERM throughput (synthetic, on the GPU)
    data = make_synthetic(args.gpu_xl_n, 3 * args.gpu_xl_n, 128, b, seed=1)
    erm = pg.ERM(device=dev).fit(data.P)
    xl = pg.PEFAXL(device=dev, lam=0.5, k=32, search_params=pg.XLSearchParams(
        candidates=100)).fit(data.P, data.Q, data.Y)
    qt = torch.from_numpy(data.Q_test).to(dev)
    t_erm = cuda_time(lambda: erm.search(qt, 100), reps=3)
    t_xl = cuda_time(lambda: xl.search(qt, 100), reps=3)
    out.update(erm_qps=b / t_erm, xl_qps=b / t_xl, xl_vs_erm=t_erm / t_xl)
    # fusion alone on the GPU (authors' semantics: no rescoring) vs the CPU scipy merge on
    # the same candidates, and the same ids
    xl_f = pg.PEFAXL(device=dev, lam=0.5, k=32, rescore=False).fit(data.P, data.Q, data.Y)
    e = xl_f.index.search(qt, 100)
    kn = xl_f.neighbours(qt, 32, e)
    t_fuse = cuda_time(lambda: xl_f.fuse(qt, e, kn, 100), reps=3)
    ec = tuple(v.cpu() for v in e)
    kc = tuple(v.cpu() for v in kn)
    t0 = time.perf_counter()
    _, scipy_ids = scipy_merge(ec, kc, xl_f.relevance.csr, 0.5, 32, 100)
    out.update(gpu_fuse_s=t_fuse, cpu_scipy_merge_s=time.perf_counter() - t0)
    out["fuse_speedup_vs_cpu_scipy"] = out["cpu_scipy_merge_s"] / t_fuse
    gpu_ids = xl_f.fuse(qt, e, kn, 100)[1].cpu().numpy()
    out["gpu_rows_ids_equal_scipy"] = int((gpu_ids == scipy_ids).all(1).sum())
    # aggregation bandwidth vs host->device copy bandwidth
    host = torch.empty(1 << 28, dtype=torch.uint8).pin_memory()
    devbuf = torch.empty_like(host, device=dev)
    t = cuda_time(lambda: devbuf.copy_(host, non_blocking=True))
    out["h2d_gb_s"] = host.numel() / t / 1e9
    m_agg, d_agg = args.gpu_agg_m, 128
    Qh = np.random.default_rng(0).random((m_agg, d_agg), dtype=np.float32)
    Yagg = make_synthetic(100_000, m_agg, 8, 0, seed=2).Y
    t0 = time.perf_counter()
    pg.pifa(Yagg, Qh, normalize=False, device=dev, memory_budget=1 << 30)
    torch.cuda.synchronize()
    t = time.perf_counter() - t0
    touched = Qh.nbytes + Yagg.nnz * 12 + 100_000 * d_agg * 4
    out.update(agg_s=t, agg_gb_s=touched / t / 1e9, agg_pairs=int(Yagg.nnz),
               agg_vs_copy=touched / t / 1e9 / out["h2d_gb_s"])
    rows = [["bf16 GEMM TFLOP/s (measured)", f"{out['bf16_tflops']:.1f}", "-"],
            [f"exact bf16 search n={n} d=768 B=4096, TFLOP/s", f"{out['search_tflops']:.1f}",
             f">= {0.5 * out['bf16_tflops']:.1f} (half GEMM)"],
            ["XL / ERM throughput", f"{out['xl_vs_erm']:.2f}", ">= 0.7"],
            ["GPU fusion speed-up vs CPU scipy merge", f"{out['fuse_speedup_vs_cpu_scipy']:.1f}",
             ">= 20"],
            ["rows where GPU fusion ids = scipy merge ids",
             f"{out['gpu_rows_ids_equal_scipy']}/{b}", f"{b}"],
            ["streamed aggregation GB/s (bytes touched)", f"{out['agg_gb_s']:.1f}",
             f">= {0.5 * out['h2d_gb_s']:.1f} (half of measured H2D copy)"]]
    return out, md_table(["GPU figure", "measured", "target"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="5000,20000,80000")
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--kp", type=int, default=500)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--topk", type=int, default=100)
    ap.add_argument("--lam", type=float, default=0.3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ann", action="store_true", help="also time the faiss hnsw backend")
    ap.add_argument("--product-n", type=int, default=54_667,
                    help="documents of the product-search shape (0: skip it)")
    ap.add_argument("--product-m", type=int, default=7_800)
    ap.add_argument("--product-test", type=int, default=1_949)
    ap.add_argument("--product-d", type=int, default=384)
    ap.add_argument("--product-k", type=int, default=16)
    ap.add_argument("--gpu-only", action="store_true")
    ap.add_argument("--gpu-n", type=int, default=1_000_000)
    ap.add_argument("--gpu-xl-n", type=int, default=200_000)
    ap.add_argument("--gpu-agg-m", type=int, default=4_000_000)
    args = ap.parse_args()
    data: dict = {"args": vars(args)}
    md = ""
    if not args.gpu_only:
        sizes = [int(s) for s in args.sizes.split(",")]
        recs, rows, head, frows = cpu_section(sizes, args.d, args.batch, args.kp, args.k,
                                              args.topk, args.lam, args.repeats, args.ann)
        data["cpu"] = recs
        if args.product_n:
            data["product"], row = product_section(args)
            frows.append(row)
        md += "## CPU: stages\n\n" + md_table(head, rows)
        md += "\n## CPU: XL fusion\n\n" + md_table(FUSION_HEAD, frows)
        md += ("\nfuse / scipy: PEFAXL.fuse (everything after the two searches, authors' "
               "semantics: no rescoring; numpy on the CPU) over the authors' scipy merge of "
               "the same searches, both timed interleaved in this run, best of "
               f"{max(args.repeats, 5)} (target <= 1). Equal ids / scores: the fusion without "
               "rescoring against the scipy merge (ties to the lower id in both). Synthetic "
               f"rows: lam={args.lam}, m = 3n.\n")
        RESULTS.mkdir(parents=True, exist_ok=True)
        plot(recs, RESULTS / "scale.png")
        md += "\n![scale](scale.png)\n"
    if torch.cuda.is_available():
        data["gpu"], table = gpu_section(args)
        md += f"\n## GPU ({data['gpu']['device']})\n\n" + table
    else:
        md += "\n## GPU\n\nNot measured: torch sees no CUDA device on this machine.\n"
    write_results("scale", data, md)


if __name__ == "__main__":
    main()
