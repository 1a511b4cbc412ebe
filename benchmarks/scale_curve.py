"""How cost grows from 100k to 5M documents on one machine, next to the authors' PECOS path.

    python benchmarks/scale_curve.py all [--sizes 100000,300000,...] [--data DIR]
    python benchmarks/scale_curve.py point --n 1000000 --path model   # one point, one process
    python benchmarks/scale_curve.py report                           # json / md / png only

Data (written chunk by chunk under ``--data``, outside the repository, deleted after each point):
n documents (clustered unit vectors, sqrt(n) clusters), m = n training queries, each its target
document plus noise, targets drawn with Zipf popularity (exponent 1.1) over the documents, so
that few documents have queries (the product-search shape); 2,000 test queries alike; d = 384.
Two relevance shapes: ``product`` (each query: its target) and ``dense`` (its target and 4
more documents of the target's cluster).

Paths, each a process of its own per n (the peak RSS of one never counts in another):
- ``model``: the library in memory (``pg.pifa``, ``ERM`` / ``PEFAXS`` / ``PEFAXL`` fit and a
  batch search of the test queries, top-100, XL with k = 16 and 500 candidates), on the exact
  backend (float32, and float16 storage as a second row), and on the hnsw backend (M = 32,
  efConstruction = 500, efSearch = 300; up to ``--hnsw-max`` documents for ERM and
  ``--hnsw-xl-max`` for XS / XL); the save's bytes on disk. A stage whose arrays would not fit
  in this machine's memory is skipped and said so.
- ``dense``: PIFA, PEFA-XS and PEFA-XL fit and exact search on the dense shape.
- ``pipeline``: the out-of-core path (``pefa_gpu.pipeline``: shards on disk, aggregation
  streamed), PEFA-XS and PEFA-XL from the row files to the test queries' top-100.
- ``pecos``: the authors' path (libpecos HNSW, scipy PIFA and the scipy merge, as in
  ``benchmarks/peers.py``), run in its own virtual environment (``--pecos-python``).

Per stage: wall seconds and CPU seconds (exact fits: the best of 3, searches too up to 1M, each
result freed before the next), bytes read from storage (all repeats), peak RSS growth (VmHWM,
reset before the stage) and the peak of anonymous memory (RssAnon, sampled every 20 ms:
memory-mapped input files do not count), the bytes of the arrays the stage must hold, and the
load average. ``report`` fits the exponent of
time and memory in n per stage (least squares on log-log over the points measured) and writes
results/scale_curve.{json,md,png}.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
RAW = RESULTS / "scale_curve.json"
SIZES = (100_000, 300_000, 1_000_000, 3_000_000, 5_000_000)
D, N_TEST, TOPK, CHUNK = 384, 2000, 100, 250_000
M, EFC, EFS = 32, 500, 300
XS_LAM, XL_LAM, XL_K, XL_KP = 0.5, 0.1, 16, 500
DENSE_EXTRA = 4  # dense shape: relevant documents besides the target
METHODS = ("erm", "xs", "xl")
BACKENDS = ("exact", "float16", "hnsw", "hnswlib")  # float16: exact with float16 storage
F16_MAX = 1_000_000  # float16 rows up to this n (on the CPU a 16-bit search is several times
# slower than float32: it converts each block)


# -- data ---------------------------------------------------------------------------------------

def _unit(x: np.ndarray) -> np.ndarray:
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def make_data(n: int, folder: Path, seed: int = 0) -> None:
    """Write P.npy (n, d), Q.npy (n, d), T.npy (N_TEST, d) float32 unit rows and the two
    relevance matrices Y_product.npz / Y_dense.npz (n x n CSR) into ``folder``, a chunk of
    CHUNK rows at a time."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    c = int(np.sqrt(n))
    centres = _unit(rng.standard_normal((c, D), dtype=np.float32))
    lo = np.arange(c + 1) * n // c                       # cluster j: documents lo[j]..lo[j+1]-1
    P = np.lib.format.open_memmap(folder / "P.npy", "w+", np.float32, (n, D))
    for s in range(0, n, CHUNK):
        r = np.arange(s, min(s + CHUNK, n))
        noise = rng.standard_normal((len(r), D), dtype=np.float32) * (0.6 / np.sqrt(D))
        P[r[0]:r[-1] + 1] = _unit(centres[np.searchsorted(lo, r, side="right") - 1] + noise)
    P.flush()
    pop = 1.0 / np.arange(1, n + 1) ** 1.1
    cum = np.cumsum(rng.permutation(pop))
    cum /= cum[-1]

    def queries(count: int, out: np.ndarray) -> np.ndarray:
        targets = np.minimum(np.searchsorted(cum, rng.random(count)), n - 1)
        for s in range(0, count, CHUNK):
            t = targets[s:s + CHUNK]
            order = np.argsort(t, kind="stable")           # read P in file order
            rows = np.empty((len(t), D), dtype=np.float32)
            rows[order] = P[t[order]]
            noise = rng.standard_normal(rows.shape, dtype=np.float32) * (0.8 / np.sqrt(D))
            out[s:s + len(t)] = _unit(rows + noise)
        return targets

    Q = np.lib.format.open_memmap(folder / "Q.npy", "w+", np.float32, (n, D))
    targets = queries(n, Q)
    Q.flush()
    T = np.lib.format.open_memmap(folder / "T.npy", "w+", np.float32, (N_TEST, D))
    queries(N_TEST, T)
    T.flush()
    ones = np.ones(n, dtype=np.float32)
    sp.save_npz(folder / "Y_product.npz", sp.csr_matrix(
        (ones, targets, np.arange(n + 1)), shape=(n, n)), compressed=False)
    cl = np.searchsorted(lo, targets, side="right") - 1
    size = lo[cl + 1] - lo[cl]
    steps = np.arange(DENSE_EXTRA + 1)
    cols = lo[cl, None] + (targets[:, None] - lo[cl, None] + steps) % size[:, None]
    cols.sort(axis=1)
    k = DENSE_EXTRA + 1
    sp.save_npz(folder / "Y_dense.npz", sp.csr_matrix(
        (np.ones(n * k, dtype=np.float32), cols.ravel(), np.arange(0, n * k + 1, k)),
        shape=(n, n)), compressed=False)


def load_data(folder: Path, shape: str = "product"):
    """(P, Q, T) read-only memory maps and Y (scipy CSR)."""
    P, Q, T = (np.load(folder / f"{x}.npy", mmap_mode="r") for x in "PQT")
    return P, Q, T, sp.load_npz(folder / f"Y_{shape}.npz").tocsr()


# -- measuring ----------------------------------------------------------------------------------

def _status(key: str) -> int:
    text = open("/proc/self/status").read()
    return int(re.search(key + r":\s+(\d+)", text).group(1)) * 1024


def read_bytes() -> int:
    """Bytes this process has read from storage (page cache hits do not count)."""
    return int(re.search(r"read_bytes:\s+(\d+)", open("/proc/self/io").read()).group(1))


def available_bytes() -> int:
    text = open("/proc/meminfo").read()
    return int(re.search(r"MemAvailable:\s+(\d+)", text).group(1)) * 1024


class Stage:
    """``with Stage(rec, name, holds=bytes): ...`` records wall seconds, VmHWM growth and the
    sampled peak of RssAnon growth of the block into ``rec`` (a list of dicts)."""

    def __init__(self, rec: list, name: str, holds: int, **extra):
        self.rec, self.name, self.holds, self.extra = rec, name, int(holds), extra

    def _sample(self) -> None:
        while not self.done.wait(0.02):
            self.anon = max(self.anon, _status("RssAnon"))

    def __enter__(self) -> "Stage":
        try:
            open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
        except OSError:
            pass
        self.rss0, self.anon0 = _status("VmRSS"), _status("RssAnon")
        self.anon, self.done, self.best = self.anon0, threading.Event(), None
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        self.load = os.getloadavg()[0]
        self.t, self.cpu, self.read = time.perf_counter(), time.process_time(), read_bytes()
        return self

    def repeat(self, fn, times: int):
        """Run ``fn`` ``times`` times; the stage's seconds are the best of them (a shared
        machine's load comes and goes, and so does the kernel's compaction of memory for the
        huge pages of a fresh allocation), wall and CPU each. Returns the last result (each
        result is freed before the next call)."""
        result = None
        for _ in range(times):
            result = None
            t, c = time.perf_counter(), time.process_time()
            result = fn()
            wall, cpu = time.perf_counter() - t, time.process_time() - c
            best = self.best or (wall, cpu)
            self.best = (min(best[0], wall), min(best[1], cpu))
        return result

    def __exit__(self, *exc) -> None:
        seconds, cpu = self.best or (time.perf_counter() - self.t, time.process_time() - self.cpu)
        self.done.set()
        self.thread.join()
        self.anon = max(self.anon, _status("RssAnon"))
        if exc[0] is None:
            row = dict(stage=self.name, seconds=round(seconds, 3), cpu_seconds=round(cpu, 3),
                       peak_rss=_status("VmHWM") - self.rss0, peak_anon=self.anon - self.anon0,
                       holds=self.holds, load=round(self.load, 2),
                       read_bytes=read_bytes() - self.read, **self.extra)
            record(self.rec, row)


POINT: dict = {}  # n, path and the output file of the point this process measures


def record(rec: list, row: dict) -> None:
    """Keep ``row``, print it, and append it to the point's output file at once (a point
    killed later, e.g. for memory, keeps the stages it finished)."""
    rec.append(row)
    print(json.dumps(row), flush=True)
    if POINT:
        with open(POINT["out"], "a") as f:
            f.write(json.dumps({**row, "n": POINT["n"], "path": POINT["path"]}) + "\n")


def repeats(n: int) -> int:
    """Timed repetitions of a search at n documents (best of them reported)."""
    return 3 if n <= 1_000_000 else 1


def skip(rec: list, name: str, why: str, **extra) -> None:
    record(rec, dict(stage=name, skipped=why, **extra))


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def fits(holds: int) -> bool:
    """Whether ``holds`` bytes fit in the memory available now, with 15% to spare."""
    return holds * 1.15 < available_bytes()


def held_bytes(n: int, nnz: int, method: str, backend: str, dtype: str) -> int:
    """Bytes of the arrays a fitted model must hold: ERM P; PEFA-XS P, the sums and its index
    of E; PEFA-XL P, its two indices (on exact float32 they share P and a copy of Q) and Y
    with the identity block, twice (the CSR and its per-row copy), 12 bytes per entry. An
    index's own copy of the vectors: none for exact float32 built from a kept array, half for
    float16, a whole one plus the level-0 graph (2M links of 4 bytes per row) for hnsw."""
    row = n * D * 4
    own = {"float16": 0.5 * row}.get(dtype, 0) if backend == "exact" else row + n * M * 2 * 4
    y = 2 * 12 * (nnz + n)
    return int({"erm": row + own, "xs": 2 * row + (own or row) + 12 * (nnz + n),
                "xl": row + (2 * own or row) + y}[method])


# -- the library in memory ------------------------------------------------------------------------

def run_model(folder: Path, shape: str, hnsw_max: int, hnsw_xl_max: int, tmp: Path,
              chosen: tuple[str, ...] = BACKENDS, methods: tuple[str, ...] = METHODS) -> list:
    import torch

    import pefa_gpu as pg

    P, Q, T, Y = load_data(folder, shape)
    n, row = P.shape[0], P.shape[1] * 4
    y_bytes = Y.data.nbytes + Y.indices.nbytes + Y.indptr.nbytes
    t = torch.from_numpy(np.array(T))
    rec: list = []
    with Stage(rec, "read", 0):  # the maps' pages, so that the first stage does not pay them
        for x in (P, Q):
            x.reshape(-1).view(np.uint8)[::4096].sum()
    with Stage(rec, "pifa", n * row + y_bytes):
        buffer = min(2**28, n * row // 4)  # read buffer: a fixed 256 MiB was 2x Q at 100k
        pg.pifa(Y, Q, normalize=False, device="cpu", memory_budget=n * row + buffer)
    graph = {"M": M, "ef_construction": EFC}
    kinds = {"exact": ("exact", "float32", {}), "hnsw": ("hnsw", "float32", graph),
             "float16": ("exact", "float16", {"dtype": "float16"}),
             "hnswlib": ("hnswlib", "float32", graph)}
    upto = {"exact": n, "float16": F16_MAX, "hnsw": hnsw_max, "hnswlib": hnsw_max}
    backends = [kinds[b] for b in chosen if n <= upto[b] and (shape == "product" or b == "exact")]
    for backend, dtype, iparams in backends:
        nnz = Y.nnz
        holds = {method: held_bytes(n, nnz, method, backend, dtype) for method in methods
                 if shape == "product" or method != "erm"}
        for method, holding in holds.items():
            tag = dict(method=method, backend=backend, dtype=dtype)
            if backend.startswith("hnsw") and method != "erm" and n > hnsw_xl_max:
                skip(rec, "fit", f"n > --hnsw-xl-max={hnsw_xl_max} (build time)", **tag)
                continue
            if not fits(holding):
                skip(rec, "fit", f"needs {holding / 2**30:.1f} GiB, "
                     f"{available_bytes() / 2**30:.1f} GiB available", **tag)
                continue
            kw = dict(backend=backend, device="cpu", index_params=iparams)
            fit = {"erm": lambda: pg.ERM(**kw).fit(P),
                   "xs": lambda: pg.PEFAXS(lam=XS_LAM, **kw).fit(P, Q, Y),
                   "xl": lambda: pg.PEFAXL(lam=XL_LAM, k=XL_K, **kw).fit(P, Q, Y)}[method]
            with Stage(rec, "fit", holding, **tag) as st:
                model = st.repeat(fit, 1 if backend.startswith("hnsw") else 3)
            if backend.startswith("hnsw"):
                model.index_search_params = model.index_search_params.replace(ef_search=EFS)
            model.search(t[:10], TOPK)  # warm-up
            with Stage(rec, "search", holding + N_TEST * (XL_KP + XL_K) * 12, **tag) as st:
                st.repeat(functools.partial(model.search, t, TOPK), repeats(n))
            if shape == "product" and dtype == "float32" and backend == "exact":
                out = tmp / "save"
                model.save(out)
                skip(rec, "save", "", bytes_on_disk=dir_bytes(out), **tag)
                shutil.rmtree(out)
            del model
    return rec


# -- the out-of-core pipeline -------------------------------------------------------------------

def max_range_queries(Y: sp.csr_matrix, rows: int) -> int:
    """The most queries with a pair in one range of ``rows`` documents."""
    ranges = -(-Y.shape[1] // rows)
    query = np.repeat(np.arange(Y.shape[0], dtype=np.int64), np.diff(Y.indptr))
    return int(np.bincount(np.unique(query * ranges + Y.indices // rows) % ranges).max())


def run_pipeline(folder: Path, tmp: Path, stages: tuple[str, ...] = ("aggregate", "xs", "xl"),
                 times: int = 0) -> list:
    """``stages``: "aggregate", "xs" (its build and search; needs "aggregate"), "xl" (build and
    search); ``times``: repetitions of a search (0: :func:`repeats`)."""
    from pefa_gpu import pipeline as pp

    P, Q, T, Y = load_data(folder, "product")
    row, rows = P.shape[1] * 4, 250_000
    rec: list = []
    work = tmp / "pipeline"
    with Stage(rec, "write", rows * row * 2):
        pp.write_rows(P, work / "docs", rows=rows)
        pp.write_rows(Q, work / "queries", rows=rows)
        pp.write_relevance(Y, work / "pairs", rows=rows)
    if "aggregate" in stages:
        with Stage(rec, "aggregate", rows * row * 4, method="xs", backend="exact",
                   dtype="float32"):
            pp.aggregate(work / "queries", work / "pairs", work / "docs", work / "xs",
                         lam=XS_LAM, doc_rows=rows)
    for method in [m for m in ("xs", "xl") if m in stages]:
        tag = dict(method=method, backend="exact", dtype="float32")
        if method == "xs":
            with Stage(rec, "build", rows * row, **tag):
                pp.build("xs", work / "build-xs", work / "docs", embeddings=work / "xs",
                         doc_rows=rows)
        else:  # a range's reduce holds its rows and those of every query with a pair there
            with Stage(rec, "build", (rows + max_range_queries(Y, rows)) * row, **tag):
                pp.build("xl", work / "build-xl", work / "docs", queries=work / "queries",
                         relevance=work / "pairs", doc_rows=rows, lam=XL_LAM, k=XL_K,
                         candidates=XL_KP)
        with Stage(rec, "search", rows * row * 2, **tag) as st:
            st.repeat(lambda: pp.search(work / f"build-{method}", np.array(T), topk=TOPK),
                      times or repeats(P.shape[0]))
        skip(rec, "save", "", bytes_on_disk=dir_bytes(work / f"build-{method}"), **tag)
        shutil.rmtree(work / f"build-{method}")
        shutil.rmtree(work / "xs", ignore_errors=True)  # (disk: 5M needs ~55 GB at most)
    shutil.rmtree(work)
    return rec


# -- the authors' path (libpecos; runs in its own virtual environment) --------------------------

def run_pecos(folder: Path, methods: list[str]) -> list:
    from pecos.ann.hnsw import HNSW

    P, Q, T, Y = load_data(folder, "product")
    n, row = P.shape[0], P.shape[1] * 4
    threads = os.cpu_count() or 1
    graph = n * M * 2 * 4
    rec: list = []

    def train(X):
        tp = HNSW.TrainParams(M=M, efC=EFC, metric_type="ip", threads=threads)
        return HNSW.train(X, tp)

    def knn(model, k, searchers):
        ids, dist = model.predict(np.array(T), HNSW.PredParams(efS=max(EFS, k), topk=k),
                                  searchers=searchers, ret_csr=False)
        return ids.astype(np.int64), 1.0 - dist              # "ip" distance is 1 - <q, x>

    for method in methods:
        tag = dict(method=method, backend="pecos-hnsw", dtype="float32")
        with Stage(rec, "fit", n * row * (2 if method == "xl" else 1) + graph, **tag):
            Pm = np.array(P)
            if method == "xs":
                A = np.asarray(Y.T @ np.array(Q)) + Pm                # PIFA, augment_docs
                A /= np.maximum(np.linalg.norm(A, axis=1, keepdims=True), 1e-12)
                Pm = XS_LAM * Pm + (1 - XS_LAM) * A
                del A
            passages = train(Pm)
            del Pm
            if method == "xl":
                queries = train(np.vstack([np.asarray(Q), np.asarray(P)]))
                Yx = sp.vstack([Y, sp.identity(n, format="csr", dtype=np.float32)],
                               format="csr").astype(np.float32)
        with Stage(rec, "search", n * row + graph, **tag):
            ps = passages.searchers_create(threads)
            if method != "xl":
                knn(passages, TOPK, ps)
            else:
                qs = queries.searchers_create(threads)
                b = N_TEST
                ip, sp_ = knn(passages, XL_KP, ps)
                iq, sq = knn(queries, XL_K, qs)
                erm = sp.csr_matrix((sp_.ravel(), ip.ravel(), np.arange(0, b * XL_KP + 1, XL_KP)),
                                    shape=(b, n))
                w = sp.csr_matrix(((sq / XL_K).ravel(), iq.ravel(),
                                   np.arange(0, b * XL_K + 1, XL_K)), shape=(b, Yx.shape[0]))
                fused = (XL_LAM * erm + (1 - XL_LAM) * (w @ Yx)).tocsr()
                for r in range(b):                               # per-row top-k
                    vals = fused.data[fused.indptr[r]:fused.indptr[r + 1]]
                    if len(vals) > TOPK:
                        np.argpartition(-vals, TOPK - 1)
        del passages
        if method == "xl":
            del queries
    return rec


# -- driver -------------------------------------------------------------------------------------

def point(args) -> None:
    """One (n, path) point in this process: its stage rows appended to the raw results."""
    folder = Path(args.data) / f"n{args.n}"
    tmp = Path(tempfile.mkdtemp(dir=args.data))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    POINT.update(n=args.n, path=args.path, out=args.out)
    try:
        if args.path == "model":
            run_model(folder, "product", args.hnsw_max, args.hnsw_xl_max, tmp,
                      tuple(args.backends.split(",")), tuple(args.methods.split(",")))
        elif args.path == "dense":
            run_model(folder, "dense", 0, 0, tmp)
        elif args.path == "pipeline":
            run_pipeline(folder, tmp, tuple(args.pipeline_stages.split(",")), args.repeats)
        else:
            methods = ["erm"] + (["xs", "xl"] if args.n <= args.hnsw_xl_max else [])
            methods = [m for m in methods if m in args.pecos_methods.split(",")]
            run_pecos(folder, methods if args.n <= args.hnsw_max else [])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_all(args) -> None:
    common = ["--backends", args.backends, "--methods", args.methods, "--data", args.data,
              "--out", args.out, "--hnsw-max", str(args.hnsw_max),
              "--hnsw-xl-max", str(args.hnsw_xl_max)]
    for n in args.sizes:
        folder = Path(args.data) / f"n{n}"
        t = time.perf_counter()
        make_data(n, folder)
        print(json.dumps(dict(n=n, stage="data", seconds=round(time.perf_counter() - t, 1),
                              bytes=dir_bytes(folder))), flush=True)
        for path in args.paths:
            python = args.pecos_python if path == "pecos" else sys.executable
            if path == "pecos" and not (python and Path(python).exists()):
                print(f"no --pecos-python: skipping the authors' path at n={n}")
                continue
            cmd = [python, __file__, "point", "--n", str(n), "--path", path, *common]
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=False)
        shutil.rmtree(folder)


# -- report -------------------------------------------------------------------------------------

GiB = 2**30


def exponent(ns: list[int], values: list[float]) -> float | None:
    """Least-squares slope of log(value) against log(n) (None below 2 distinct n)."""
    pts = [(n, v) for n, v in zip(ns, values) if v > 0]
    if len({n for n, _ in pts}) < 2:
        return None
    return float(np.polyfit(np.log([p[0] for p in pts]), np.log([p[1] for p in pts]), 1)[0])


def _key(r: dict) -> tuple:
    return (r["path"], r["stage"], r.get("method", ""), r.get("backend", ""), r.get("dtype", ""))


def _held(r: dict) -> int:
    """The bytes a row's stage must hold (recomputed for the library's fit and search rows
    from :func:`held_bytes`, so that every point is held to the same count)."""
    if r["path"] in ("model", "dense") and r["stage"] in ("fit", "search"):
        nnz = r["n"] * (1 if r["path"] == "model" else DENSE_EXTRA + 1)
        return held_bytes(r["n"], nnz, r["method"], r["backend"], r["dtype"])
    return r["holds"]


def curves(rows: list[dict]) -> list[dict]:
    """One entry per (path, stage, method, backend, dtype): its points and fitted exponents."""
    groups: dict = {}
    for r in rows:  # (the "read" rows only bring the input maps' pages in)
        if "seconds" in r and r["stage"] != "read":
            groups.setdefault(_key(r), {})[r["n"]] = r   # a later run of a point replaces it
    out = []
    for k, pts in sorted(groups.items()):
        rs = [pts[n] for n in sorted(pts)]
        ns = [r["n"] for r in rs]
        timed = [r for r in rs if r.get("cpu_seconds")]
        out.append(dict(zip(("path", "stage", "method", "backend", "dtype"), k), n=ns,
                        seconds=[r["seconds"] for r in rs],
                        peak_anon=[r["peak_anon"] for r in rs],
                        peak_over_held=[round(r["peak_anon"] / max(_held(r), 1), 2)
                                        for r in rs],
                        load=[r["load"] for r in rs],
                        cpu_seconds=[r.get("cpu_seconds") for r in rs],
                        time_exponent=exponent(ns, [r["seconds"] for r in rs]),
                        cpu_exponent=exponent([r["n"] for r in timed],
                                              [r["cpu_seconds"] for r in timed]),
                        memory_exponent=exponent(ns, [r["peak_anon"] for r in rs])))
    return out


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def _points(c: dict, values: list, fmt: str) -> str:
    return ", ".join(f"{n // 1000:,}k: {format(v, fmt)}" for n, v in zip(c["n"], values))


def pecos_table(rows: list[dict]) -> list[list]:
    """Our hnsw rows next to the authors' PECOS rows measured at the same n."""
    ours: dict = {}
    for r in rows:  # a later run of a point replaces it
        if "seconds" in r and r.get("backend") in ("hnsw", "hnswlib") and r["path"] == "model":
            ours[(r["n"], r["method"], r["stage"], r["backend"])] = r
    theirs = {(r["n"], r["method"], r["stage"]): r for r in rows
              if "seconds" in r and r["path"] == "pecos"}
    out = []
    for (n, method, stage, backend), o in sorted(ours.items()):
        r = theirs.get((n, method, stage))
        if r is not None:
            out.append([f"{n:,}", method, stage, backend, f"{o['seconds']:.1f}",
                        f"{r['seconds']:.1f}", f"{o['seconds'] / r['seconds']:.2f}",
                        f"{o.get('cpu_seconds', 0) / r['cpu_seconds']:.2f}"
                        if r.get("cpu_seconds") and o.get("cpu_seconds") else "",
                        f"{o['peak_anon'] / GiB:.2f}", f"{r['peak_anon'] / GiB:.2f}",
                        f"{o['load']:.1f} / {r['load']:.1f}"])
    return out


def extrapolate(cs: list[dict], n_to: float) -> list[list]:
    """This machine's seconds per stage at ``n_to`` from the largest measured point and the
    fitted exponent (exact backend, float32)."""
    out = []
    for c in cs:
        if c["time_exponent"] is None or c["dtype"] not in ("float32", "") or \
                c["backend"] not in ("exact", ""):
            continue
        e = c["time_exponent"]
        s = c["seconds"][-1] * (n_to / c["n"][-1]) ** max(e, 1.0)
        out.append([c["path"], c["stage"], c["method"], _fmt(e), f"{c['n'][-1]:,}",
                    f"{c['seconds'][-1]:.1f}", f"{s / 3600:.2f}"])
    return out


def limits(rows: list[dict]) -> str:
    """The largest n each path completed, the first it could not, and the n at which the
    arrays the in-memory models hold reach this machine's memory."""
    total = int(re.search(r"MemTotal:\s+(\d+)", open("/proc/meminfo").read()).group(1)) * 1024
    lines = []
    for path, method in (("model", "xs"), ("model", "xl"), ("pipeline", "xs"),
                         ("pipeline", "xl")):
        done = [r["n"] for r in rows if r["path"] == path and r.get("method") == method and
                r["stage"] == "search" and r.get("backend") == "exact" and
                r.get("dtype") == "float32" and "seconds" in r]
        why = [r for r in rows if r["path"] == path and r.get("method") == method and
               r.get("skipped") and r.get("backend") == "exact" and r.get("dtype") == "float32"]
        what = "in memory" if path == "model" else "out of core (pipeline)"
        line = f"- PEFA-{method.upper()} {what}: largest n fitted and searched " \
               f"{max(done):,}" if done else f"- PEFA-{method.upper()} {what}: none"
        if why:
            line += f"; n = {why[0]['n']:,} not run: {why[0]['skipped']}"
        lines.append(line)
    for method in ("xs", "xl"):
        per_doc = held_bytes(1_000_000, 1_000_000, method, "exact", "float32") / 1e6
        lines.append(f"- PEFA-{method.upper()} in memory holds {per_doc:,.0f} bytes per document "
                     f"(d = {D}, one pair per query): this machine's {total / GiB:.1f} GiB end "
                     f"near n = {0.85 * total / per_doc / 1e6:.1f}M (85% of it)")
    return "\n".join(lines) + "\n"


def report(args) -> None:
    sys.path.insert(0, str(HERE))
    from _common import md_table, write_results

    rows = [json.loads(line) for f in args.raw for line in open(f) if line.strip()]
    cs = curves(rows)
    md = ["Synthetic product-search data, d = 384, m = n training queries, 2,000 test queries, "
          "top-100; one process per (n, path); the machine was shared (load average per point "
          "in the json). Peak: the sampled peak of anonymous resident memory the stage added; "
          "held: the bytes of the arrays the stage must hold.\n",
          "## Stages\n",
          md_table(["path", "stage", "method", "backend", "dtype", "seconds (n: s)",
                    "time exp.", "CPU seconds (n: s)", "CPU exp.", "peak GiB (n: GiB)",
                    "memory exp.", "peak / held"],
                   [[c["path"], c["stage"], c["method"], c["backend"], c["dtype"],
                     _points(c, c["seconds"], ".1f"), _fmt(c["time_exponent"]),
                     ", ".join(f"{n // 1000:,}k: {v:.1f}" for n, v in zip(c["n"], c["cpu_seconds"])
                               if v), _fmt(c["cpu_exponent"]),
                     _points(c, [a / GiB for a in c["peak_anon"]], ".2f"),
                     _fmt(c["memory_exponent"]), ", ".join(map(str, c["peak_over_held"]))]
                    for c in cs])]
    pt = pecos_table(rows)
    if pt:
        md += ["\n## HNSW (M = 32, efConstruction = 500, efSearch = 300): ours and the authors' "
               "PECOS path\n",
               md_table(["n", "method", "stage", "our backend", "ours s", "PECOS s",
                         "ours / PECOS", "CPU time ours / PECOS",
                         "ours peak GiB", "PECOS peak GiB", "load ours / PECOS"], pt)]
    disk = list({(r["path"], r["n"], r["method"]): r for r in rows
                 if r.get("bytes_on_disk")}.values())  # a later run of a point replaces it
    if disk:
        md += ["\n## Bytes on disk of a save\n",
               md_table(["path", "n", "method", "GiB", "bytes per document"],
                        [[r["path"], f"{r['n']:,}", r["method"], f"{r['bytes_on_disk'] / GiB:.2f}",
                          f"{r['bytes_on_disk'] / r['n']:.0f}"]
                         for r in sorted(disk, key=lambda r: (r["path"], r["method"], r["n"]))])]
    def point_key(r: dict) -> tuple:
        return tuple(r.get(f) for f in ("path", "n", "stage", "method", "backend", "dtype"))

    measured = {point_key(r) for r in rows if "seconds" in r}
    skipped = list({point_key(r): r for r in rows  # a point measured later is not listed
                    if r.get("skipped") and point_key(r) not in measured}.values())
    if skipped:
        md += ["\n## Not measured\n",
               md_table(["path", "n", "stage", "method", "backend", "dtype", "why"],
                        [[r["path"], f"{r['n']:,}", r["stage"], r.get("method", ""),
                          r.get("backend", ""), r.get("dtype", ""), r["skipped"]]
                         for r in skipped])]
    md += ["\n## Where one machine ends\n", limits(rows)]
    md += ["\n## This machine at 30M documents (the fitted exponents carried from the largest "
           "point, an exponent below 1 taken as 1; estimates, not measurements)\n",
           md_table(["path", "stage", "method", "time exp.", "largest n measured", "seconds there",
                     "hours at 30M"], extrapolate(cs, 30e6))]
    _plot(cs)
    md.append("\n![scale curve](scale_curve.png)\n")
    write_results("scale_curve", dict(rows=rows, curves=cs), "\n".join(md))
    print("\n".join(md))


def _plot(cs: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 6))
    for c in cs:
        if len(c["n"]) < 2 or c["stage"] == "write":
            continue
        label = f"{c['path']} {c['method']} {c['stage']} {c['backend']} {c['dtype']}".strip()
        style = "--" if c["path"] == "pecos" else (":" if c["path"] == "pipeline" else "-")
        a.loglog(c["n"], c["seconds"], style, marker="o", ms=3, label=label)
        b.loglog(c["n"], [max(x / GiB, 1e-3) for x in c["peak_anon"]], style, marker="o", ms=3)
    a.set(xlabel="documents n (= training queries m)", ylabel="seconds", title="time per stage")
    b.set(xlabel="documents n (= training queries m)", ylabel="GiB",
          title="peak anonymous memory per stage")
    b.axhline(24, color="grey", lw=0.8)
    fig.legend(*a.get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=6)
    fig.tight_layout(rect=(0, 0.18, 1, 1))
    fig.savefig(RESULTS / "scale_curve.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("all", "point", "report", "data"))
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--paths", default="model,dense,pipeline,pecos")
    ap.add_argument("--n", type=int)
    ap.add_argument("--backends", default=",".join(BACKENDS),
                    help="the model path's backends (float16: exact with float16 storage)")
    ap.add_argument("--methods", default=",".join(METHODS), help="the model path's methods")
    ap.add_argument("--path", choices=("model", "dense", "pipeline", "pecos"))
    ap.add_argument("--data", default="/tmp/pefa-scale-curve")
    ap.add_argument("--out", default="/tmp/pefa-scale-curve/curve.jsonl",
                    help="where each stage's row is appended (all, point)")
    ap.add_argument("--raw", default="", help="report: the comma-separated row files to read "
                    "(default: --out)")
    ap.add_argument("--pipeline-stages", default="aggregate,xs,xl",
                    help="the pipeline path's stages: aggregate, xs (needs aggregate), xl")
    ap.add_argument("--repeats", type=int, default=0,
                    help="timed repetitions of a search (0: 3 up to 1M documents, else 1)")
    ap.add_argument("--hnsw-max", type=int, default=1_000_000)
    ap.add_argument("--hnsw-xl-max", type=int, default=300_000)
    ap.add_argument("--pecos-python", default=os.environ.get("PECOS_PYTHON", ""))
    ap.add_argument("--pecos-methods", default="erm,xs,xl",
                    help="the PECOS path's methods (point: e.g. xs,xl where erm was measured)")
    args = ap.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.paths = args.paths.split(",")
    args.raw = args.raw.split(",") if args.raw else [args.out]
    if args.mode == "point":
        point(args)
    elif args.mode == "all":
        run_all(args)
    elif args.mode == "data":
        for n in args.sizes:
            make_data(n, Path(args.data) / f"n{n}")
    else:
        report(args)


if __name__ == "__main__":
    main()
