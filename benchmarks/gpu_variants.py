"""Variants timed side by side on a GPU, to choose designs for the GPU check's targets:
exact search's top-k selection, PEFA-XL's cost split (its two searches, the fusion by batch
size, a scipy sparse-product merge of the same searches), PIFA's host and device parts, and
where host synchronisations happen, a kernel-level profile of an exact and an XL search, and
the host's time before exact search's Triton launch (``host``).

    python3 benchmarks/gpu_variants.py --out DIR            # on CUDA (about 2 minutes)
    python3 benchmarks/gpu_variants.py --out DIR --dry-run  # on the CPU, tiny shapes

Times: the median of 10 after 3 warm-ups, CUDA events (gpu_check.median_seconds). Each part
runs on its own; a failure is recorded and the next part runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import scipy.sparse as sp
import torch

from gpu_check import _relevance, median_seconds, mm_f32, scipy_merge, unit

import pefa_gpu as pg
from pefa_gpu.relevance import as_relevance
from pefa_gpu.topk import topk_wide

FULL = dict(n=1_000_000, d=768, batch=4096, k=100, xl_n=200_000, xl_d=128, pifa_m=1_000_000)
DRY = dict(n=6_400, d=32, batch=64, k=10, xl_n=2000, xl_d=16, pifa_m=3000)


def sync_sites(fn: Callable[[], Any]) -> dict[str, int]:
    """Where ``fn``'s host synchronisations happen: 'file:line < caller < ...' -> count."""
    sites: collections.Counter = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            stack = [f"{Path(f.filename).name}:{f.lineno}" for f in traceback.extract_stack()
                     if "pefa_gpu" in f.filename or "gpu_variants" in f.filename]
            sites[" < ".join(reversed(stack[-4:]))] += 1

    if not torch.cuda.is_available():
        fn()
        return {}
    old = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = old
    return dict(sites)


def part_exact(s: dict, dev: str) -> dict[str, Any]:
    """The GEMM alone; topk_wide's group sizes against plain torch.topk on (B, c) score blocks
    of c = the XL shapes' 200k / 600k and 1M columns; ExactIndex under three budgets."""
    n, d, b, k = s["n"], s["d"], s["batch"], s["k"]
    w = k + 8
    x = unit(n, d, dev, 0).to(torch.bfloat16)
    qb = unit(b, d, dev, 1).to(torch.bfloat16)
    out: dict[str, Any] = {"gflop": 2 * b * n * d / 1e9}
    out["mm_s"] = median_seconds(lambda: mm_f32(qb, x), dev)
    full = mm_f32(qb, x)
    for c in (n // 5, 3 * n // 5, n):
        scores = full[:, :c].contiguous() if c < n else full
        row: dict[str, Any] = {"topk": median_seconds(
            lambda: torch.topk(scores, w, dim=1, sorted=False), dev)}
        ref = torch.sort(torch.topk(scores, w, dim=1).indices, 1).values  # no ties: one set
        for g in (None, 16, 32, 64, 128, 256, 512):
            row[f"wide_g{g}"] = median_seconds(lambda: topk_wide(scores, w, g), dev)
            ids = torch.sort(topk_wide(scores, w, g)[1], 1).values
            row[f"wide_g{g}_same_ids"] = bool(torch.equal(ids, ref))
        out[f"select_c{c}"] = row
        scores = None  # freed before the next copy (a del would leave the lambdas' name unbound)
    del full
    for budget_gib in (None, 2, 8):
        params = {"dtype": "bfloat16"} if budget_gib is None else \
            {"dtype": "bfloat16", "memory_budget": budget_gib << 30}
        index = pg.make_index("exact", dev, params).build(x)
        out[f"index_budget{budget_gib}_s"] = median_seconds(
            lambda: index.search(qb.float(), k), dev)
        out[f"index_budget{budget_gib}_plan"] = list(index._block_shape(b, k))
    out["index_sync_sites"] = sync_sites(lambda: index.search(qb.float(), k))
    return out


def part_xl(s: dict, dev: str) -> dict[str, Any]:
    from pefa_gpu.synthetic import make_synthetic

    n, b, k = s["xl_n"], s["batch"], s["k"]
    data = make_synthetic(n, 3 * n, s["xl_d"], b, seed=1)
    xl = pg.PEFAXL(device=dev, lam=0.5, k=32, search_params=pg.XLSearchParams(
        candidates=2 * k)).fit(data.P, data.Q, data.Y)
    q = torch.from_numpy(data.Q_test).to(dev)
    out: dict[str, Any] = {"n": n, "m": 3 * n, "queries": b}
    out["erm_k_s"] = median_seconds(lambda: xl.index.search(q, k), dev)
    out["erm_kp_s"] = median_seconds(lambda: xl.index.search(q, 2 * k), dev)
    out["knn_s"] = median_seconds(lambda: xl.query_index.search(q, 32), dev)
    out["xl_s"] = median_seconds(lambda: xl.search(q, k), dev)
    erm = xl.index.search(q, 2 * k)
    knn = xl.neighbours(q, 32, erm=erm)
    for bs in (256, 1024, 4096):
        out[f"fuse_batch{bs}_s"] = median_seconds(
            lambda: xl.fuse(q, erm, knn, k, batch_size=bs), dev)
    out["fuse_sync_sites"] = sync_sites(lambda: xl.fuse(q, erm, knn, k))
    out["xl_sync_sites"] = sync_sites(lambda: xl.search(q, k))
    host = [tuple(t.cpu().numpy() for t in pair) for pair in (erm, knn)]
    y = xl.relevance.csr
    t = time.perf_counter()
    ref_s, _ = scipy_merge(host[0], host[1], y, 0.5, 32, k)
    out["scipy_merge_s"] = time.perf_counter() - t
    got_s = xl.fuse(q, erm, knn, k)[0].cpu().numpy()
    got = got_s[np.isfinite(got_s)]
    out["scipy_merge_same_score_count"] = bool(len(got) == len(ref_s))
    out["scipy_merge_max_score_diff"] = float(np.abs(np.sort(got) - np.sort(ref_s)).max()) \
        if len(got) == len(ref_s) and len(got) else None
    return out


def part_pifa(s: dict, dev: str) -> dict[str, Any]:
    m, d = s["pifa_m"], s["d"]
    n = m // 4
    y = _relevance(m, n, 3, 0)
    q = unit(m, d, dev, 2)
    out: dict[str, Any] = {"m": m, "n": n, "d": d, "nnz": int(y.nnz),
                           "bytes": (y.nnz + n) * d * 4}
    out["pifa_s"] = median_seconds(lambda: pg.pifa(y, q, normalize=False, device=dev), dev)
    t = time.perf_counter()
    rel = as_relevance(y)
    out["as_relevance_s"] = time.perf_counter() - t
    t = time.perf_counter()
    yt = rel.csr.T.tocsr()
    out["host_transpose_s"] = time.perf_counter() - t
    crow, col = (torch.from_numpy(a.astype(np.int64)).to(dev) for a in (yt.indptr, yt.indices))
    yt_torch = torch.sparse_csr_tensor(crow, col, torch.from_numpy(yt.data).to(dev),
                                       size=yt.shape)
    out["torch_spmm_s"] = median_seconds(lambda: yt_torch @ q, dev)
    try:
        import cupy
        import cupyx.scipy.sparse as csp
    except ImportError:
        return out
    if dev == "cuda":
        yt_gpu = csp.csr_matrix((cupy.asarray(yt.data), cupy.asarray(yt.indices),
                                 cupy.asarray(yt.indptr)), shape=yt.shape)
        qc = cupy.from_dlpack(q)
        out["cupy_spmm_s"] = median_seconds(lambda: yt_gpu @ qc, dev)
        out["cupy_spmm_c_order_s"] = median_seconds(
            lambda: cupy.ascontiguousarray(yt_gpu @ qc), dev)
        rows = torch.from_numpy(np.repeat(np.arange(m), np.diff(y.indptr))).to(dev)
        cols = torch.from_numpy(y.indices.astype(np.int64)).to(dev)
        vals = torch.from_numpy(y.data).to(dev)
        out["index_add_s"] = median_seconds(lambda: torch.zeros(n, d, device=dev).index_add_(
            0, cols, q[rows] * vals[:, None]), dev)
    return out


def part_votes(s: dict, dev: str) -> dict[str, Any]:
    from pefa_gpu import fuse

    rng = np.random.default_rng(3)
    y = sp.random(40, 60, density=0.6, random_state=5, format="csr", dtype=np.float32)
    rows = fuse.RelevanceRows(as_relevance(y), dev)
    ki = torch.from_numpy(rng.integers(-1, 40, (8, 5))).to(dev)
    return {"votes_sync_sites": sync_sites(lambda: fuse.votes(ki, rows))}


def part_tiles(s: dict, dev: str) -> dict[str, Any]:
    """Exact search with and without pefa_gpu.triton_topk (the selection inside the GEMM), and
    tile_topw (the kernel, its candidates' topk and the worst tiles scored in full) and the
    search keeping 2 or 3 scores a tile (KEEP), several shares of queries whose worst tiles are
    scored in full (REDO_SHARE; 0: the unsettled rows before that) and 1 or 2 such tiles."""
    from pefa_gpu import triton_topk as tt

    n, d, b, k = s["n"], s["d"], s["batch"], s["k"]
    w = k + 8
    tt.ON_CPU = dev == "cpu"  # a dry run: under TRITON_INTERPRET=1
    x = unit(n, d, dev, 0).to(torch.bfloat16)
    q = unit(b, d, dev, 1)
    index = pg.make_index("exact", dev, {"dtype": "bfloat16"}).build(x)
    out: dict[str, Any] = {"gflop": 2 * b * n * d / 1e9, "usable": tt.usable(x, w)}
    out["mm_s"] = median_seconds(lambda: mm_f32(q.to(x.dtype), x), dev)
    out["index_tiles_s"] = median_seconds(lambda: index.search(q, k), dev)
    with_tiles = index.search(q, k)[1]
    usable, tt.usable = tt.usable, lambda rows, w: False
    try:
        out["index_blocks_s"] = median_seconds(lambda: index.search(q, k), dev)
        blocks = index.search(q, k)[1]
    finally:
        tt.usable = usable
    out["same_ids_share"] = float((with_tiles == blocks).all(1).float().mean())
    out["tiles_vs_blocks"] = out["index_blocks_s"] / out["index_tiles_s"]
    keep, share, worst = tt.KEEP, tt.REDO_SHARE, tt.REDO_TILES
    try:
        for tt.KEEP, tt.REDO_SHARE, tt.REDO_TILES in [(2, 0.04, 2), (2, 0.0, 2), (2, 0.04, 1),
                                                      (3, 0.04, 2)]:
            name = f"keep{tt.KEEP}_redo{tt.REDO_SHARE}_tiles{tt.REDO_TILES}"
            out[f"{name}_unsettled"] = int(tt.tile_topw(q, x, w)[2].sum())
            out[f"{name}_topw_s"] = median_seconds(lambda: tt.tile_topw(q, x, w), dev)
            out[f"{name}_search_s"] = median_seconds(lambda: index.search(q, k), dev)
            got = index.search(q, k)[1]
            out[f"{name}_same_ids_share"] = float((got == blocks).all(1).float().mean())
    finally:
        tt.KEEP, tt.REDO_SHARE, tt.REDO_TILES = keep, share, worst
    return out


def part_gaps(s: dict, dev: str) -> dict[str, Any]:
    """tile_topw and exact search (bf16 rows) timed three ways: CUDA events around each call
    (as gpu_check), the host's time to queue one tile_topw, and 10 calls queued back to back
    with one synchronisation; and their kernels over 5 calls under torch.profiler. Events
    above back-to-back: host latency; above the kernels' sum: gaps or clocks."""
    from pefa_gpu import triton_topk as tt

    n, d, b, k = s["n"], s["d"], s["batch"], s["k"]
    w = k + 8
    tt.ON_CPU = dev == "cpu"
    x = unit(n, d, dev, 0).to(torch.bfloat16)
    q = unit(b, d, dev, 1)
    index = pg.make_index("exact", dev, {"dtype": "bfloat16"}).build(x)
    out: dict[str, Any] = {}
    for name, fn in [("topw", lambda: tt.tile_topw(q, x, w)),
                     ("search", lambda: index.search(q, k))]:
        out[f"{name}_events_s"] = median_seconds(fn, dev)
        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
        sync()
        t = time.perf_counter()
        fn()
        out[f"{name}_queued_s"] = time.perf_counter() - t
        sync()
        t = time.perf_counter()
        for _ in range(10):
            fn()
        sync()
        out[f"{name}_back_to_back_s"] = (time.perf_counter() - t) / 10
        out[f"{name}_profile_5_calls"] = kernel_table(lambda: [fn() for _ in range(5)], dev, 6)
    return out


def part_timeline(s: dict, dev: str) -> dict[str, Any]:
    """One tile_topw and one exact search (bf16 rows) under torch.profiler, on the device's
    clock: the idle time from the call's start on the host to its first kernel, between
    kernels (the largest gaps, with the kernels either side) and from the last kernel to the
    call's return; kernels and memsets / copies counted alike."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    from pefa_gpu import triton_topk as tt

    n, d, b, k = s["n"], s["d"], s["batch"], s["k"]
    tt.ON_CPU = dev == "cpu"
    x = unit(n, d, dev, 0).to(torch.bfloat16)
    q = unit(b, d, dev, 1)
    index = pg.make_index("exact", dev, {"dtype": "bfloat16"}).build(x)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    out: dict[str, Any] = {}
    for name, fn in [("topw", lambda: tt.tile_topw(q, x, k + 8)),
                     ("search", lambda: index.search(q, k))]:
        fn()
        sync()
        with profile(activities=acts) as prof:
            with record_function("call"):
                fn()
            sync()
        events = prof.events()
        call = next(e.time_range for e in events if e.name == "call")
        ks = sorted((e for e in events if e.device_type == DeviceType.CUDA  # not the
                     and e.name != "call"), key=lambda e: e.time_range.start)  # range's GPU twin
        if not ks:
            out[name] = {"kernels": 0, "call_us": call.end - call.start}
            continue
        gaps = sorted(((ks[i + 1].time_range.start - ks[i].time_range.end, ks[i].name[:60],
                        ks[i + 1].name[:60]) for i in range(len(ks) - 1)), reverse=True)
        out[name] = {"kernels": len(ks), "call_us": call.end - call.start,
                     "busy_us": sum(e.time_range.end - e.time_range.start for e in ks),
                     "before_first_us": ks[0].time_range.start - call.start,
                     "between_us": sum(g[0] for g in gaps),
                     "after_last_us": call.end - ks[-1].time_range.end,
                     "largest_gaps_us": gaps[:12],
                     "first_kernels": [e.name[:60] for e in ks[:4]],
                     "host_launches_us": [(round(e.time_range.start - call.start, 1), e.name)
                                          for e in events if "aunch" in e.name][:12]}
    return out


def part_host(s: dict, dev: str) -> dict[str, Any]:
    """The host's share of one exact search (bf16 rows), after a synchronisation: seconds from
    the call to the Triton kernel's launch, in the launch, and from it to the return (the
    search synchronises once: the device's time too); medians of 10 after 3. The search's
    CUDA-event time beside them, and cProfile's top functions over 10 searches and 10 tile_topw
    calls."""
    import cProfile
    import pstats

    from pefa_gpu import triton_topk as tt

    n, d, b, k = s["n"], s["d"], s["batch"], s["k"]
    tt.ON_CPU = dev == "cpu"
    x = unit(n, d, dev, 0).to(torch.bfloat16)
    q = unit(b, d, dev, 1)
    index = pg.make_index("exact", dev, {"dtype": "bfloat16"}).build(x)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    kernel, stamps, share = tt._tile_best_kernel, [], tt.UNSETTLED_SHARE
    tt.UNSETTLED_SHARE = 1e9 if dev == "cpu" else share  # a dry run's small index: tiles too

    class Stamped:  # the kernel, its launch stamped
        def __getitem__(self, grid):
            launch = kernel[grid]

            def run(*args, **kwargs):
                stamps.append(time.perf_counter())
                launch(*args, **kwargs)
                stamps.append(time.perf_counter())
            return run

    out: dict[str, Any] = {"events_s": median_seconds(lambda: index.search(q, k), dev)}
    tt._tile_best_kernel = Stamped()
    try:
        for name, fn in [("search", lambda: index.search(q, k)),
                         ("topw", lambda: tt.tile_topw(q, x, k + 8))]:
            parts = []
            for _ in range(13):
                sync()
                stamps.clear()
                t = time.perf_counter()
                fn()
                end = time.perf_counter()
                parts.append((stamps[0] - t, stamps[1] - stamps[0], end - stamps[1]))
            for i, what in enumerate(["to_launch_s", "launch_s", "after_launch_s"]):
                out[f"{name}_{what}"] = float(np.median([p[i] for p in parts[3:]]))
    finally:
        tt._tile_best_kernel, tt.UNSETTLED_SHARE = kernel, share
    for name, fn in [("search", lambda: index.search(q, k)),
                     ("topw", lambda: tt.tile_topw(q, x, k + 8))]:
        sync()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(10):
            fn()
        prof.disable()
        sync()
        top = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:15]
        out[f"{name}_cprofile_own_ms_per_call"] = [  # [function, own ms, cumulative ms] a call
            [f"{Path(f).name}:{line} {fn}", round(st[2] * 100, 3), round(st[3] * 100, 3)]
            for (f, line, fn), st in top]  # by own time
    return out


def kernel_table(fn: Callable[[], Any], dev: str, top: int = 12) -> dict[str, Any]:
    """One call of ``fn`` under torch.profiler (after a warm-up): wall ms, the sum of its
    device kernels' ms, and the ``top`` kernels by device time [name, ms, calls] (calls 12
    and 14 counted aten ops beside their kernels: their sums hold some kernels twice)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    if dev == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        fn()
        if dev == "cuda":
            torch.cuda.synchronize()
    wall = time.perf_counter() - t
    from torch.autograd import DeviceType

    rows = [e for e in prof.key_averages()  # kernels only (an aten op repeats its kernels' time)
            if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    rows.sort(key=lambda e: -e.self_device_time_total)
    return {"wall_ms": 1e3 * wall,
            "kernels_ms": sum(e.self_device_time_total for e in rows) / 1e3,
            "launches": sum(e.count for e in rows),
            "top": [[e.key[:90], round(e.self_device_time_total / 1e3, 3), e.count]
                    for e in rows[:top]]}


def part_profile(s: dict, dev: str) -> dict[str, Any]:
    """Where one exact search (bf16 rows, the tiles' kernel) and one PEFA-XL search spend
    their time: device kernels against wall time (the rest: host work and gaps)."""
    from pefa_gpu.synthetic import make_synthetic

    n, d, b, k = s["n"], s["d"], s["batch"], s["k"]
    x = unit(n, d, dev, 0).to(torch.bfloat16)
    q = unit(b, d, dev, 1)
    index = pg.make_index("exact", dev, {"dtype": "bfloat16"}).build(x)
    out: dict[str, Any] = {"exact": kernel_table(lambda: index.search(q, k), dev),
                           "exact_sync_sites": sync_sites(lambda: index.search(q, k))}
    x = index = None  # freed (a del would leave the lambdas' name unbound)
    data = make_synthetic(s["xl_n"], 3 * s["xl_n"], s["xl_d"], b, seed=1)
    xl = pg.PEFAXL(device=dev, lam=0.5, k=32, search_params=pg.XLSearchParams(
        candidates=2 * k)).fit(data.P, data.Q, data.Y)
    qx = torch.from_numpy(data.Q_test).to(dev)
    out["xl"] = kernel_table(lambda: xl.search(qx, k), dev)
    out["erm"] = kernel_table(lambda: xl.index.search(qx, k), dev)
    return out


PARTS = {"votes": part_votes, "exact": part_exact, "xl": part_xl, "pifa": part_pifa,
         "tiles": part_tiles, "profile": part_profile, "gaps": part_gaps,
         "timeline": part_timeline, "host": part_host}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--parts", default=",".join(PARTS))
    args = ap.parse_args()
    dev = "cpu" if args.dry_run else "cuda"
    sizes = DRY if args.dry_run else FULL
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"sizes": sizes}
    for name in args.parts.split(","):
        t = time.perf_counter()
        try:
            results[name] = PARTS[name](sizes, dev)
        except Exception as exc:  # noqa: BLE001 (recorded; the next part runs)
            results[name] = {"failed": f"{type(exc).__name__}: {exc}",
                             "trace": traceback.format_exc().splitlines()[-8:]}
        results[name]["wall_s"] = time.perf_counter() - t
        if dev == "cuda":
            torch.cuda.empty_cache()
        (out_dir / "variants.json").write_text(json.dumps(results, indent=2, default=str))
        print(name, json.dumps(results[name], indent=1, default=str), flush=True)


if __name__ == "__main__":
    main()
