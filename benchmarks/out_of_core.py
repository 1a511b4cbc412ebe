"""Out-of-core PIFA check: a memory-mapped Q of several GB aggregated under a memory budget.

    .venv/bin/python benchmarks/out_of_core.py --gb 4 --budget-mb 512 [--dir /tmp]

Writes Q (m x d float32, ``--gb`` GB) under ``--dir`` (deleted afterwards), then in a fresh
subprocess per mode ('memmap': ``np.load(mmap_mode="r")``, 'path': the .npy path) runs
``pg.pifa(Y, Q, memory_budget=...)`` and records wall time and peak resident memory (VmHWM,
reset after the imports). Correctness: the full result is checked against a float64 sketch
(A @ v = Yᵀ (Q @ v) for a random v, Q @ v streamed in float64), and rows 0..m/20 are compared
with the in-memory path. Results: benchmarks/results/out_of_core.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import md_table, write_results  # noqa: E402

CHILD = r"""
import json, re, sys, time
import numpy as np, scipy.sparse as sp
import pefa_gpu as pg

def status():
    t = open("/proc/self/status").read()
    return {k: int(re.search(k + r":\s+(\d+)", t).group(1)) * 1024 for k in ("VmRSS", "VmHWM")}

qpath, ypath, mode, budget, vpath = sys.argv[1:6]
Y = sp.load_npz(ypath).tocsr()
pg.pifa(Y[:8], np.ones((8, 4), np.float32), device="cpu", memory_budget=1 << 24)  # warm-up
Q = np.load(qpath, mmap_mode="r") if mode == "memmap" else qpath
try:
    open("/proc/self/clear_refs", "w").write("5")
    reset = True
except OSError:
    reset = False
before = status()
t = time.perf_counter()
A = pg.pifa(Y, Q, normalize=False, device="cpu", memory_budget=int(budget))
secs = time.perf_counter() - t
after = status()
v = np.load(vpath)
sketch = A.double().numpy() @ v
sub = int(Y.shape[0]) // 20
A_sub = pg.pifa(Y[:sub], np.load(qpath, mmap_mode="r")[:sub], normalize=False, device="cpu", memory_budget=int(budget))
print(json.dumps({"seconds": secs, "before": before, "after": after, "peak_reset": reset,
                  "sketch": sketch.tolist(), "sub_sum": float(A_sub.double().sum()),
                  "out_bytes": A.numel() * 4}))
"""

SUB_CHILD = r"""
import json, sys
import numpy as np, scipy.sparse as sp
import pefa_gpu as pg
qpath, ypath = sys.argv[1:3]
Y = sp.load_npz(ypath).tocsr()
sub = int(Y.shape[0]) // 20
Q = np.load(qpath, mmap_mode="r")[:sub]
A = pg.pifa(Y[:sub], np.ascontiguousarray(Q), normalize=False, device="cpu")
print(json.dumps({"sub_sum": float(A.double().sum())}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--budget-mb", type=int, default=512)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--n", type=int, default=100_000, help="documents")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--modes", default="memmap,path")
    args = ap.parse_args()
    d, n = args.d, args.n
    m = int(args.gb * 1e9) // (d * 4)
    work = Path(tempfile.mkdtemp(prefix="pefa_ooc_", dir=args.dir))
    qpath, ypath, vpath = work / "q.npy", work / "y.npz", work / "v.npy"
    rng = np.random.default_rng(0)
    v = rng.standard_normal(d)
    np.save(vpath, v)
    try:
        t = time.perf_counter()
        qv = np.empty(m)
        mm = np.lib.format.open_memmap(qpath, mode="w+", dtype=np.float32, shape=(m, d))
        step = 1 << 16
        for s in range(0, m, step):
            block = rng.random((min(step, m - s), d), dtype=np.float32) - np.float32(0.5)
            mm[s:s + block.shape[0]] = block
            qv[s:s + block.shape[0]] = block.astype(np.float64) @ v
            mm.flush()
            mm._mmap.madvise(__import__("mmap").MADV_DONTNEED)  # keep the writer's RSS small
        del mm
        write_s = time.perf_counter() - t
        # power-law Y: 1..8 documents per query, Zipf document popularity
        per_q = np.minimum(rng.zipf(2.5, m), 8)
        qi = np.repeat(np.arange(m), per_q)
        di = np.minimum(rng.zipf(1.3, qi.size) - 1, n - 1)
        Y = sp.csr_matrix((np.ones(qi.size, np.float32), (qi, di)), shape=(m, n))
        Y.sum_duplicates()
        Y.data[:] = 1.0
        sp.save_npz(ypath, Y)
        ref_sketch = Y.T.astype(np.float64) @ qv  # Aᵀ-free check of the whole result
        sub = subprocess.run([sys.executable, "-c", SUB_CHILD, str(qpath), str(ypath)],
                             capture_output=True, text=True, check=True)
        sub_ref = json.loads(sub.stdout.strip().splitlines()[-1])["sub_sum"]
        rows = []
        out = {"gb": qpath.stat().st_size / 1e9, "m": m, "n": n, "d": d, "nnz": int(Y.nnz),
               "budget_bytes": args.budget_mb * 2**20, "write_seconds": write_s, "modes": {}}
        for mode in args.modes.split(","):
            res = subprocess.run([sys.executable, "-c", CHILD, str(qpath), str(ypath), mode,
                                  str(args.budget_mb * 2**20), str(vpath)],
                                 capture_output=True, text=True)
            if res.returncode:
                raise SystemExit(res.stderr)
            rec = json.loads(res.stdout.strip().splitlines()[-1])
            sketch = np.asarray(rec.pop("sketch"))
            err = float(np.abs(sketch - ref_sketch).max() / max(np.abs(ref_sketch).max(), 1e-30))
            peak = rec["after"]["VmHWM"]
            grew = peak - rec["before"]["VmRSS"]
            rec.update(peak_rss_bytes=peak, peak_growth_bytes=grew, sketch_rel_err=err,
                       sub_rel_err=abs(rec["sub_sum"] - sub_ref) / max(abs(sub_ref), 1e-30),
                       read_gb_per_s=out["gb"] / rec["seconds"])
            out["modes"][mode] = rec
            rows.append([mode, f"{out['gb']:.2f}", args.budget_mb, f"{peak / 2**20:.0f}",
                         f"{grew / 2**20:.0f}", f"{rec['seconds']:.1f}",
                         f"{rec['read_gb_per_s']:.2f}", f"{err:.1e}", f"{rec['sub_rel_err']:.1e}",
                         "yes" if peak < 2**30 else "NO"])
            print(mode, rows[-1], flush=True)
        table = md_table(["Q source", "Q GB", "budget MiB", "peak RSS MiB (process)",
                          "peak growth MiB", "seconds", "GB/s", "full-result sketch rel err",
                          "5% rows vs in-memory rel err", "peak < 1 GiB"], rows)
        table += (f"\nm={m:,} queries, d={d}, n={n:,} documents, nnz(Y)={Y.nnz:,}; output "
                  f"{n * d * 4 / 2**20:.0f} MiB counts inside the budget. Peak RSS is the whole "
                  f"process (python + torch + scipy + Y ≈ the 'before' figure) measured by VmHWM "
                  f"in a fresh subprocess.\n")
        write_results("out_of_core", out, table)
    finally:
        for p in (qpath, ypath, vpath):
            p.unlink(missing_ok=True)
        work.rmdir()


if __name__ == "__main__":
    main()
