"""The offline pipeline as functions over shards: encode, aggregate, build, search, evaluate.

    from pefa_gpu import pipeline as pp
    pp.encode(corpus_texts, "work/docs")                  # or pp.write_rows(P, "work/docs")
    pp.encode(train_texts, "work/queries")
    pp.write_relevance(Y, "work/pairs", rows=100_000)     # Y: (m x n), split by query ranges
    pp.aggregate("work/queries", "work/pairs", "work/docs", "work/xs", lam=0.5)
    pp.build("xs", "work/xs-index", docs="work/docs", embeddings="work/xs")
    scores, ids = pp.search("work/xs-index", test_queries, topk=100)
    pg.evaluate(ids, Y_test)

Every stage reads shards from folders and writes its output as shards into a folder of its
own. The functions here run in one process; ``runner=`` (:class:`LocalRunner` by default, or
:class:`pefa_gpu.distributed.RayRunner`) decides where each shard task runs and moves the
results, and nothing else. The shard tasks are the same functions either way, called on the
same shards in the same order of reduction, so a cluster run gives the answers of a
one-process run by construction (bit for bit on the CPU).

A stage folder holds ``stage.json`` (written last: the stage's commit point, listing its shards
with their row ranges and each shard's manifest checksum) and one folder per shard. A shard is
a save in :mod:`pefa_gpu.storage`'s layout (``pefa_shard.json`` + a ``pefa-data-<hex>``
folder, written by :func:`~pefa_gpu.storage.writing_save`): a worker killed while writing
leaves no partial shard visible, and the next write removes its leftovers. Reading a stage
checks every shard against ``stage.json``, so a stage half rewritten by an interrupted rerun
is refused instead of mixed.

What each stage writes:

- ``write_rows`` / ``encode``: ``shard-NNNNN`` with ``embeddings.npy`` ((rows, d) float32;
  L2-normalised when encoded). ``encode`` skips shards already written for the same texts
  and model, and encodes through :func:`pefa_gpu.encode` with its cache keys.
- ``write_relevance``: ``shard-NNNNN`` with ``relevance.npz``, the rows of Y of one query
  range (all n columns). Its shards are the aggregation's map tasks.
- ``aggregate``: ``doc-NNNNN`` per document range with ``sums.npy`` (Yᵀ Q, + P with
  augment_docs) and, given ``lam``, ``embeddings.npy`` (the PEFA-XS E).
- ``build``: ``doc-NNNNN`` per document range with a model save (``model/``: ERM over P or
  over E, or a PEFA-XL shard), ``query-NNNNN`` per query range for PEFA-XL (an ERM over those
  training queries: the shard of XL's query index), optionally ``hnsw.faiss`` per document
  shard (:meth:`export_hnsw <pefa_gpu.models.ERM.export_hnsw>`, for CPU serving).
- ``search``: returns the merged top-k; :func:`evaluate_configs` turns it into metrics.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import stat
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import scipy.sparse as sp
import torch

from .aggregate import pefa_xs, pifa
from .arrays import as_embeddings, as_tensor, check_positive_int, check_topk, to_numpy
from .errors import FormatError, InputError
from .fuse import neighbours
from .methods import REGISTRY
from .relevance import as_relevance
from .storage import (load_csr, load_tensor, open_save, save_csr, save_tensor,
                      write_output_file, writing_save)
from .topk import merge_topk

log = logging.getLogger("pefa_gpu")

STAGE_FILE = "stage.json"
STAGE_FORMAT = "pefa-gpu-stage"
SHARD_MANIFEST = "pefa_shard.json"
SHARD_FORMAT = "pefa-gpu-shard"
METHODS = tuple(m for m in REGISTRY if REGISTRY[m].pipeline)  # ("erm", "xs", "xl")
DEFAULT_ROWS = 100_000      # rows per shard (documents, queries, texts)
DEFAULT_BATCH = 1024        # test queries per search round


# ------------------------------------------------------------------------------ shards

def write_shard(path: str | Path, fields: dict[str, Any],
                tensors: dict[str, Any] | None = None,
                matrices: dict[str, sp.spmatrix] | None = None,
                model: Any = None, export_hnsw: bool = False) -> str:
    """Write one shard atomically: ``fields`` (JSON) in its manifest, ``tensors`` as .npy,
    ``matrices`` as CSR .npz, ``model`` as a model save in ``model/`` (and its HNSW export as
    ``hnsw.faiss`` with ``export_hnsw``). Returns the manifest's checksum."""
    with writing_save(path, SHARD_MANIFEST, SHARD_FORMAT) as w:
        tmeta = {name: save_tensor(w.data / name, as_tensor(t, name=name))
                 for name, t in (tensors or {}).items()}
        mmeta = {name: save_csr(w.data / name, m) for name, m in (matrices or {}).items()}
        if model is not None:
            model.save(w.data / "model")
            if export_hnsw:
                model.export_hnsw(w.data / "hnsw.faiss")
        manifest = w.commit({**fields, "tensors": tmeta, "matrices": mmeta,
                             "model": "model" if model is not None else None,
                             "hnsw": "hnsw.faiss" if model is not None and export_hnsw
                             else None})
    return manifest["manifest_sha256"]


@dataclasses.dataclass
class Shard:
    """A shard read back: its manifest ``fields``, tensors, CSR matrices and model."""

    fields: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    matrices: dict[str, sp.csr_matrix]
    model: Any = None


def read_shard(path: str | Path, device: Any = "cpu", mmap: bool = True,
               expect_sha: str | None = None) -> Shard:
    """Read and verify a shard written by :func:`write_shard`. ``mmap`` maps the tensors and
    checks sizes and headers (else every file's sha256 is checked). ``expect_sha``: the
    manifest checksum a stage recorded for it (FormatError when the shard has changed since)."""
    save = open_save(path, SHARD_MANIFEST, SHARD_FORMAT, checksums=not mmap)
    fields = save.manifest
    if expect_sha is not None and fields["manifest_sha256"] != expect_sha:
        raise FormatError(f"{path} was rewritten after its stage's {STAGE_FILE} was written "
                          f"(a rerun in progress, or an interrupted one): run the stage again")
    tensors = {name: load_tensor(save.file(meta["file"]), device, mmap=mmap, meta=meta)
               for name, meta in fields.get("tensors", {}).items()}
    matrices = {name: load_csr(save.file(meta["file"]), meta)
                for name, meta in fields.get("matrices", {}).items()}
    model = None
    if fields.get("model"):
        from .persist import load

        model = load(save.folder(fields["model"]), device=device, mmap=mmap, verify=False)
    return Shard(fields, tensors, matrices, model)


def _shard_fields(path: Path) -> dict[str, Any] | None:
    """The manifest of a complete shard at ``path`` (sizes checked), or None when there is
    none there yet (or only the leftovers of an interrupted write)."""
    try:
        return open_save(path, SHARD_MANIFEST, SHARD_FORMAT, checksums=False).manifest
    except (FormatError, FileNotFoundError):
        return None


# ------------------------------------------------------------------------------ stages

def split(n: int, rows: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of at most ``rows`` rows covering 0 .. n (one empty range for n = 0)."""
    rows = check_positive_int(rows, "rows")
    return [(lo, min(lo + rows, n)) for lo in range(0, n, rows)] or [(0, 0)]


def _name(kind: str, i: int) -> str:
    return f"{kind}-{i:05d}"


def write_stage(folder: str | Path, stage: str, shards: Sequence[dict[str, Any]],
                **fields: Any) -> Path:
    """Write ``folder/stage.json`` (atomically, last): the stage's commit point.
    ``shards``: {"name", "rows": [lo, hi], "manifest_sha256"} each (more lists may be given
    as fields, e.g. ``query_shards``)."""
    path = Path(folder) / STAGE_FILE
    _check_stage_file(path)
    body = {"format": STAGE_FORMAT, "format_version": 1, "stage": stage,
            "shards": list(shards), **fields}
    write_output_file(path, json.dumps(body, indent=1, sort_keys=True) + "\n", STAGE_FILE)
    return Path(folder)


def _check_stage_file(path: Path) -> None:
    """A stage.json may be replaced only when it is ours (InputError otherwise)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    ok = stat.S_ISREG(mode)
    if ok:
        try:
            ok = json.loads(path.read_text(encoding="utf-8")).get("format") == STAGE_FORMAT
        except (OSError, ValueError, AttributeError):
            ok = False
    if not ok:
        raise InputError(f"refusing to replace {path}: it is not a pefa_gpu stage file")


def read_stage(folder: str | Path, stage: str | None = None) -> dict[str, Any]:
    """``folder/stage.json`` as a dict (FormatError when the stage is missing, incomplete or
    of another kind than ``stage``)."""
    path = Path(folder) / STAGE_FILE
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FormatError(f"{folder} holds no complete stage ({STAGE_FILE} missing: not run "
                          f"yet, or interrupted)") from None
    except (OSError, ValueError) as exc:
        raise FormatError(f"{path} is unreadable: {exc}") from None
    if not isinstance(info, dict) or info.get("format") != STAGE_FORMAT:
        raise FormatError(f"{path} is not a pefa_gpu stage file")
    if stage is not None and info.get("stage") != stage:
        raise FormatError(f"{folder} holds a {info.get('stage')!r} stage, not {stage!r}")
    return info


def _open(folder: Path, entry: dict[str, Any], device: Any = "cpu",
          mmap: bool = True) -> Shard:
    return read_shard(folder / entry["name"], device=device, mmap=mmap,
                      expect_sha=entry["manifest_sha256"])


class Rows:
    """The rows of a row stage (``write_rows`` / ``encode`` / ``aggregate`` output), read
    by range from the shards that hold them (memory-mapped; only those shards are opened).

    ``tensor``: the name of the tensor in each shard (default ``embeddings``)."""

    def __init__(self, folder: str | Path, tensor: str = "embeddings"):
        self.folder = Path(folder)
        self.info = read_stage(self.folder)
        self.tensor = tensor
        self.shards = self.info["shards"]
        self.bounds = np.array([s["rows"][0] for s in self.shards] +
                               [self.shards[-1]["rows"][1] if self.shards else 0])
        self.n = int(self.bounds[-1])
        self.dim = int(self.info.get("dim", 0))

    def __len__(self) -> int:
        return self.n

    def _part(self, i: int) -> np.ndarray:
        t = _open(self.folder, self.shards[i]).tensors.get(self.tensor)
        if t is None:
            raise FormatError(f"{self.folder / self.shards[i]['name']} holds no "
                              f"{self.tensor!r}")
        return t.numpy()

    def read(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Rows lo .. hi-1 as a (hi-lo, d) float32 array."""
        hi = self.n if hi is None else hi
        if not 0 <= lo <= hi <= self.n:
            raise InputError(f"rows [{lo}, {hi}) are outside {self.folder} (0 .. {self.n})")
        parts = []
        first = int(np.searchsorted(self.bounds, lo, side="right")) - 1
        for i in range(max(first, 0), len(self.shards)):
            s_lo, s_hi = self.shards[i]["rows"]
            if s_lo >= hi:
                break
            a, b = max(lo, s_lo), min(hi, s_hi)
            if a < b:
                parts.append(self._part(i)[a - s_lo:b - s_lo])
        if not parts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)

    def take(self, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` (any order) as a (len(ids), d) float32 array."""
        ids = np.asarray(ids, dtype=np.int64)
        out = np.empty((ids.size, self.dim), dtype=np.float32)
        if ids.size and (ids.min() < 0 or ids.max() >= self.n):
            raise InputError(f"row ids outside {self.folder} (0 .. {self.n})")
        which = np.searchsorted(self.bounds, ids, side="right") - 1
        for i in np.unique(which):
            sel = which == i
            out[sel] = self._part(int(i))[ids[sel] - self.shards[i]["rows"][0]]
        return out


def write_rows(x: Any, out: str | Path, rows: int = DEFAULT_ROWS, stage: str = "rows",
               name: str = "embeddings") -> Path:
    """Write a (n, d) float matrix (numpy, memmap, torch...) as a row stage of shards of
    ``rows`` rows (converted to float32 one shard at a time)."""
    if not hasattr(x, "shape") or len(x.shape) != 2:
        raise InputError(f"write_rows takes a 2-D array, got {type(x).__name__}")
    n, d = int(x.shape[0]), int(x.shape[1])
    out = Path(out)
    shards = []
    for i, (lo, hi) in enumerate(split(n, rows)):
        t = as_embeddings(x[lo:hi], "cpu", name, check_norm=False)
        sha = write_shard(out / _name("shard", i), {"stage": stage, "rows": [lo, hi]},
                          {name: t})
        shards.append({"name": _name("shard", i), "rows": [lo, hi], "manifest_sha256": sha})
    return write_stage(out, stage, shards, n=n, dim=d)


def read_rows(folder: str | Path, lo: int = 0, hi: int | None = None,
              tensor: str = "embeddings") -> np.ndarray:
    """Rows lo .. hi-1 of a row stage as a float32 array (all rows by default)."""
    return Rows(folder, tensor).read(lo, hi)


# ------------------------------------------------------------------------------ runners

class LocalRunner:
    """Runs every shard task in this process, one after another (the default runner).

    :class:`pefa_gpu.distributed.RayRunner` has the same methods and runs the same tasks on
    a Ray cluster."""

    workers = 1

    def map(self, fn: Callable, calls: Sequence[tuple], gpu: bool = False) -> list:
        """[fn(*args) for args in calls] (``gpu``: the tasks would use a GPU given one)."""
        return [fn(*args) for args in calls]

    def map_reduce(self, map_fn: Callable, map_calls: Sequence[tuple], reduce_fn: Callable,
                   reduce_calls: Sequence[tuple], gpu: bool = False) -> list:
        """Each map task returns one part per reduce task; reduce task s gets the parts
        [map 0's part s, map 1's part s, ...] (in map order) and its own args. Every part is
        held in memory until the reduces run (on one machine, ``pg.pifa(...,
        memory_budget=)`` streams Q instead)."""
        parts = [map_fn(*args) for args in map_calls]
        return [reduce_fn([p[s] for p in parts], *args) for s, args in enumerate(reduce_calls)]

    def encode(self, calls: Sequence[dict[str, Any]], show_progress: bool = True) -> None:
        """Run :func:`encode_shard` for each call (keyword arguments)."""
        from tqdm.auto import tqdm

        for kw in tqdm(calls, desc="encode", unit="shard", disable=not show_progress):
            encode_shard(**kw)

    def servers(self, build: str | Path, groups: Sequence[tuple[list[int], list[int]]],
                device: Any = None) -> "Fanout":
        """One in-process :class:`ShardServer` per (doc shards, query shards) group."""
        return Fanout([ShardServer(build, d, q, device) for d, q in groups])


class Fanout:
    """Calls a method on every shard server and returns the results in server order."""

    def __init__(self, servers: Sequence[Any]):
        self.servers = list(servers)

    def call(self, *calls: tuple[str, tuple]) -> list[list[Any]]:
        """For each (method, args): the list of every server's result."""
        return [[getattr(s, method)(*args) for s in self.servers] for method, args in calls]

    def close(self) -> None:
        self.servers = []

    def __enter__(self) -> "Fanout":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _runner(runner: Any) -> Any:
    return LocalRunner() if runner is None else runner


# ------------------------------------------------------------------------------ 1. encode

def encode_fingerprint(texts: Sequence[str], identity: str | None, normalize: bool) -> str | None:
    """What an encode shard is a function of: the model's identity (that of
    :func:`pefa_gpu.encode`'s cache), the normalisation and each text's SHA-256."""
    if identity is None:
        return None
    h = hashlib.sha256(f"{identity}|normalize={bool(normalize)}|{len(texts)}".encode())
    for t in texts:
        h.update(hashlib.sha256(t.encode("utf-8")).digest())
    return h.hexdigest()


def encode_shard(texts: Sequence[str], out: str | Path, index: int, lo: int,
                 fingerprint: str | None, model: Any = None, batch_size: int = 64,
                 device: Any = None, cache_dir: str | Path | None = None,
                 normalize: bool = True) -> dict[str, Any]:
    """Encode one shard of texts (rows lo .. lo+len-1) into ``out/shard-<index>``, unless a
    complete shard with the same ``fingerprint`` is there already. Encodes with
    :func:`pefa_gpu.encode` (same cache keys under ``cache_dir``). Returns its stage entry."""
    from .encode import encode

    path = Path(out) / _name("shard", index)
    fields = _shard_fields(path)
    if fingerprint is not None and fields is not None \
            and fields.get("fingerprint") == fingerprint:
        return {"name": path.name, "rows": fields["rows"],
                "manifest_sha256": fields["manifest_sha256"], "encoded": False}
    emb = encode(list(texts), model=model, batch_size=batch_size, device=device,
                 normalize=normalize, cache_dir=cache_dir, show_progress=False)
    sha = write_shard(path, {"stage": "encode", "rows": [lo, lo + len(texts)],
                             "fingerprint": fingerprint}, {"embeddings": emb.cpu()})
    return {"name": path.name, "rows": [lo, lo + len(texts)], "manifest_sha256": sha,
            "encoded": True}


def encode(texts: Sequence[str], out: str | Path, model: Any = None,
           rows: int = 10_000, batch_size: int = 64, device: Any = None,
           cache_dir: str | Path | None = None, normalize: bool = True,
           show_progress: bool = True, runner: Any = None) -> Path:
    """Encode ``texts`` into a row stage at ``out``: shards of ``rows`` texts, each encoded by
    :func:`encode_shard` (on the runner's workers). Resumable: shards already written for the
    same texts and model are kept; with ``cache_dir`` the texts are looked up in (and added to)
    :func:`pefa_gpu.encode`'s cache, so local and distributed runs reuse each other's work.
    ``model``: as for :func:`pefa_gpu.encode`, picklable for a cluster (None, a name or
    path, or a callable with a ``cache_key``; one without is re-encoded every run)."""
    from .encode import _check_texts, resolve_model

    texts = _check_texts(texts)
    out = Path(out)
    identity = resolve_model(model, "cpu").identity
    if identity is None:
        log.warning("encode: the model has no stable identity (give it a `cache_key`): every "
                    "shard is encoded again on every run")
    ranges = split(len(texts), rows)
    plan = [dict(texts=texts[lo:hi], out=str(out), index=i, lo=lo,
                 fingerprint=encode_fingerprint(texts[lo:hi], identity, normalize),
                 model=model, batch_size=batch_size, device=device,
                 cache_dir=None if cache_dir is None else str(cache_dir),
                 normalize=normalize) for i, (lo, hi) in enumerate(ranges)]
    pending = [kw for kw in plan if not _is_done(out, kw)]
    if len(pending) < len(plan):
        log.info("encode: %d of %d shards of %s are written already", len(plan) - len(pending),
                 len(plan), out)
    if pending:
        _runner(runner).encode(pending, show_progress=show_progress)
    shards, dim = [], 0
    for kw in plan:
        fields = _shard_fields(out / _name("shard", kw["index"]))
        if fields is None or fields.get("fingerprint") != kw["fingerprint"]:
            raise FormatError(f"encode: shard {kw['index']} of {out} is missing after the run")
        dim = dim or (fields["tensors"]["embeddings"]["shape"][1] if kw["texts"] else 0)
        shards.append({"name": _name("shard", kw["index"]), "rows": fields["rows"],
                       "manifest_sha256": fields["manifest_sha256"]})
    return write_stage(out, "encode", shards, n=len(texts), dim=dim, model=identity,
                       normalize=normalize)


def _is_done(out: Path, kw: dict[str, Any]) -> bool:
    fields = _shard_fields(out / _name("shard", kw["index"]))
    return (kw["fingerprint"] is not None and fields is not None
            and fields.get("fingerprint") == kw["fingerprint"])


# ------------------------------------------------------------------------------ relevance

def write_relevance(Y: Any, out: str | Path, rows: int = DEFAULT_ROWS) -> Path:
    """Write Y (m x n: scipy sparse, Relevance, dense) as shards of ``rows`` query rows.
    These query ranges are the aggregation's and PEFA-XL's query shards."""
    rel = as_relevance(Y)
    m, n = rel.shape
    out = Path(out)
    shards = []
    for i, (lo, hi) in enumerate(split(m, rows)):
        sha = write_shard(out / _name("shard", i), {"stage": "relevance", "rows": [lo, hi]},
                          matrices={"relevance": rel.csr[lo:hi]})
        shards.append({"name": _name("shard", i), "rows": [lo, hi], "manifest_sha256": sha})
    return write_stage(out, "relevance", shards, m=m, n=n, nnz=rel.nnz)


# ------------------------------------------------------------------------------ 2. aggregate

@dataclasses.dataclass
class Part:
    """What one query shard sends to one document range.

    docs (U,) int64 local document rows touched, sums (U, d) float32 their partial Yᵀ Q;
    queries (T,) int64 global query rows with a pair in the range, vectors (T, d) float32
    their embeddings, y (T x n_range) float32 CSR their pairs (PEFA-XL's build)."""

    docs: np.ndarray | None = None
    sums: np.ndarray | None = None
    queries: np.ndarray | None = None
    vectors: np.ndarray | None = None
    y: sp.csr_matrix | None = None

    @property
    def nbytes(self) -> int:
        arrays = (self.docs, self.sums, self.queries, self.vectors)
        size = sum(a.nbytes for a in arrays if a is not None)
        if self.y is not None:
            size += self.y.data.nbytes + self.y.indices.nbytes + self.y.indptr.nbytes
        return int(size)


def split_queries(queries: str | Path, relevance: str | Path, shard: int,
                  doc_ranges: Sequence[tuple[int, int]], sums: bool = True,
                  pairs: bool = False) -> list[Part]:
    """Map task of query shard ``shard`` (a shard of the relevance stage): read its rows of Y
    and Q, and for every document range return a :class:`Part`: with ``sums`` the partial
    Yᵀ Q of the documents its pairs touch (computed by :func:`pefa_gpu.pifa`), with ``pairs``
    the touching queries, their embeddings and pairs."""
    rinfo = read_stage(relevance, "relevance")
    entry = rinfo["shards"][shard]
    lo, hi = entry["rows"]
    y = _open(Path(relevance), entry).matrices["relevance"]
    q = Rows(queries).read(lo, hi)
    y_csc = y.tocsc()
    out = []
    for d_lo, d_hi in doc_ranges:
        block = y_csc[:, d_lo:d_hi].tocsr()
        touched = np.flatnonzero(np.diff(block.indptr))  # queries with a pair in the range
        block, q_t = block[touched], q[touched]
        part = Part()
        if sums:
            docs = np.flatnonzero(np.diff(block.tocsc().indptr))
            part.docs = docs.astype(np.int64)
            part.sums = (to_numpy(pifa(block[:, docs], q_t, normalize=False, device="cpu"))
                         if docs.size else np.zeros((0, q.shape[1]), np.float32))
        if pairs:
            part.queries = (touched + lo).astype(np.int64)
            part.vectors, part.y = q_t, block
        out.append(part)
    return out


def reduce_sums(parts: Sequence[Part], docs: str | Path, doc_range: tuple[int, int],
                out: str | Path, index: int, lam: float | None,
                augment_docs: bool) -> dict[str, Any]:
    """Reduce task of one document range: P (with ``augment_docs``) plus the partial sums of
    every query shard, added in query-shard order; then E = ``pefa_xs(P, sums, lam)``
    (:mod:`pefa_gpu.aggregate`), as PEFAXS computes it. Writes ``out/doc-<index>`` and
    returns its stage entry."""
    lo, hi = doc_range
    p = Rows(docs).read(lo, hi)
    acc = p.copy() if augment_docs else np.zeros_like(p)
    for part in parts:
        if part.docs.size:
            acc[part.docs] += part.sums
    sums = torch.from_numpy(acc)
    tensors = {"sums": sums}
    if lam is not None:
        tensors["embeddings"] = pefa_xs(torch.from_numpy(p), sums, lam)
    path = Path(out) / _name("doc", index)
    sha = write_shard(path, {"stage": "aggregate", "rows": [lo, hi], "lam": lam,
                             "augment_docs": augment_docs}, tensors)
    return {"name": path.name, "rows": [lo, hi], "manifest_sha256": sha,
            "bytes_in": int(sum(p.nbytes for p in parts))}


def aggregate(queries: str | Path, relevance: str | Path, docs: str | Path,
              out: str | Path, lam: float | None = None, augment_docs: bool = True,
              doc_rows: int = DEFAULT_ROWS, runner: Any = None) -> Path:
    """PIFA Yᵀ Q (and the PEFA-XS embeddings E, given ``lam``) per document range.

    queries: row stage of Q (m, d); relevance: :func:`write_relevance` stage of Y (m x n),
    whose query ranges are the map tasks; docs: row stage of P (n, d); ``doc_rows``: rows per
    document range (the reduce tasks and the output shards).

    Map (one task per query shard r, :func:`split_queries`): read Q_r and Y_r, return for
    every document range s the partial sums Y_r[:, s]ᵀ Q_r of the documents r touches there.
    Reduce (one task per range s, :func:`reduce_sums`): P_s (augment_docs) plus the partials
    of s, in query-shard order; normalise; write. No task holds more than one query shard of
    Q, or more than one document range of the n x d output.

    Bytes moved (d-dim float32 rows, 4d bytes; nnz pairs; U_rs = documents of range s that
    query shard r touches): each map reads its Q_r and Y_r once (4dm + 12 nnz in all) and
    sends sum_rs U_rs (4d + 8) bytes to the reduces; each reduce reads its P_s and writes E_s
    (8dn in all, 12dn with the sums kept). sum_rs U_rs <= min(nnz, R n) for R query shards:
    repeated documents within a query shard are summed before they travel. A naive
    join-then-group-by instead joins every pair with its query row and shuffles it to its
    document: 4d nnz bytes after the join, plus 4dm + 12 nnz to partition Q and the pairs for
    the join. ProdSearch-30M (m = 100M, nnz = 500M, n = 30M, d = 768): the naive shuffle moves
    1.54 TB; partial sums move at most min(nnz, R n) rows, 0.74 TB with R = 8 query shards
    and far less when popular documents repeat (see benchmarks/distributed.py).
    """
    rinfo = read_stage(relevance, "relevance")
    qrows, prows = Rows(queries), Rows(docs)
    m, n = rinfo["m"], rinfo["n"]
    if qrows.n != m or prows.n != n:
        raise InputError(f"Y is {m} x {n} but there are {qrows.n} query and {prows.n} "
                         f"document embeddings")
    if qrows.dim != prows.dim:
        raise InputError(f"queries have dimension {qrows.dim}, documents {prows.dim}")
    if lam is not None:
        from .params import check_unit_interval
        check_unit_interval(lam, "lam")
    ranges = split(n, doc_rows)
    maps = [(str(queries), str(relevance), r, ranges, True, False)
            for r in range(len(rinfo["shards"]))]
    reduces = [(str(docs), rng, str(out), s, lam, bool(augment_docs))
               for s, rng in enumerate(ranges)]
    entries = _runner(runner).map_reduce(split_queries, maps, reduce_sums, reduces)
    moved = sum(e.pop("bytes_in") for e in entries)
    return write_stage(out, "aggregate", entries, n=n, dim=prows.dim, lam=lam,
                       augment_docs=bool(augment_docs), bytes_shuffled=moved)


# ------------------------------------------------------------------------------ 3. build

def build_rows_shard(vectors: str | Path, rows: tuple[int, int], out: str | Path, name: str,
                     backend: str, index_params: Any, device: Any, export_hnsw: bool,
                     tensor: str = "embeddings") -> dict[str, Any]:
    """One ERM index over rows lo .. hi-1 of a row stage (P, E or Q), saved as
    ``out/<name>``; returns its stage entry."""
    from .models import ERM

    lo, hi = rows
    x = Rows(vectors, tensor).read(lo, hi)
    with warnings.catch_warnings():  # PEFA-XS's E is not unit-norm, by design
        warnings.filterwarnings("ignore", message=".*not L2-normalised", category=UserWarning)
        model = ERM(backend=backend, device=device, index_params=index_params).fit(x)
    sha = write_shard(Path(out) / name, {"stage": "build", "rows": [lo, hi]}, model=model,
                      export_hnsw=export_hnsw)
    return {"name": name, "rows": [lo, hi], "manifest_sha256": sha}


def build_xl_shard(parts: Sequence[Part], docs: str | Path, doc_range: tuple[int, int],
                   out: str | Path, index: int, params: dict[str, Any], backend: str,
                   index_params: Any, device: Any, export_hnsw: bool) -> dict[str, Any]:
    """Reduce task of PEFA-XL's build for one document range: a PEFAXL over P_s and the
    training queries with a pair in s (their rows of Y restricted to s), saved as
    ``out/doc-<index>`` with their global query rows (``query_rows``). Its passage index is
    the shard of XL's passage index, and :meth:`PEFAXL.fuse` on it scores the range's
    candidates (see :class:`ShardServer`). A range without pairs gets one inert placeholder
    query (the range's first document, labelled with itself), which no neighbour maps to."""
    from .models import PEFAXL, XLSearchParams

    lo, hi = doc_range
    p = Rows(docs).read(lo, hi)
    rows = np.concatenate([pt.queries for pt in parts]) if parts else np.zeros(0, np.int64)
    if rows.size:
        q = np.concatenate([pt.vectors for pt in parts])
        y = sp.vstack([pt.y for pt in parts], format="csr")
    else:
        q, y = p[:1], sp.csr_matrix(([1.0], ([0], [0])), shape=(1, hi - lo), dtype=np.float32)
    build = {key: v for key, v in params.items() if key != "candidates"}
    model = PEFAXL(backend=backend, device=device, index_params=index_params, **build,
                   search_params=XLSearchParams(candidates=params["candidates"])).fit(p, q, y)
    path = Path(out) / _name("doc", index)
    sha = write_shard(path, {"stage": "build", "rows": [lo, hi]},
                      {"query_rows": torch.from_numpy(rows.astype(np.int64))}, model=model,
                      export_hnsw=export_hnsw)
    return {"name": path.name, "rows": [lo, hi], "manifest_sha256": sha,
            "bytes_in": int(sum(pt.nbytes for pt in parts))}


def build(method: str, out: str | Path, docs: str | Path, *,
          embeddings: str | Path | None = None, queries: str | Path | None = None,
          relevance: str | Path | None = None, doc_rows: int = DEFAULT_ROWS,
          backend: str = "exact", index_params: Any = None, device: Any = None,
          lam: float = 0.1, k: int = 16, candidates: int = 500, knn_norm: str = "k",
          rescore: bool = True, augment_docs: bool = True, export_hnsw: bool = False,
          runner: Any = None) -> Path:
    """One index per document shard (any backend), saved as normal pefa_gpu saves.

    - ``erm``: an ERM over each range of ``docs`` (P).
    - ``xs``: an ERM over each shard of ``embeddings``, the E of :func:`aggregate` (PEFA-XS
      is one index over E), so its document shards are the aggregation's ranges.
    - ``xl``: per document range a PEFAXL shard (passage index + the range's pairs, see
      :func:`build_xl_shard`), from a map over the query shards of ``relevance`` that sends
      each range its pairs and their query embeddings; per query shard an ERM over those
      training queries (XL's query index, sharded the same way). ``lam`` / ``k`` are the
      defaults of :func:`search`; ``candidates``, ``knn_norm``, ``rescore`` and
      ``augment_docs`` as for :class:`pefa_gpu.PEFAXL`.

    ``export_hnsw`` also writes a faiss HNSW file per document shard (ERM / XS).
    """
    if method not in METHODS:
        raise InputError(f"method must be one of {METHODS}, got {method!r}")
    run = _runner(runner)
    out = Path(out)
    prows = Rows(docs)
    fields: dict[str, Any] = dict(method=method, n=prows.n, dim=prows.dim, backend=backend,
                                  index_params=_jsonable(index_params))
    query_entries: list[dict[str, Any]] = []
    if method == "erm":
        calls = [(str(docs), rng, str(out), _name("doc", s), backend, index_params, device,
                  export_hnsw) for s, rng in enumerate(split(prows.n, doc_rows))]
        entries = run.map(build_rows_shard, calls, gpu=True)
    elif method == "xs":
        if embeddings is None:
            raise InputError("build('xs') needs embeddings= (the folder aggregate() wrote)")
        einfo = read_stage(embeddings, "aggregate")
        if einfo.get("lam") is None:
            raise InputError(f"{embeddings} holds sums only: run aggregate() with lam=")
        if einfo["n"] != prows.n:
            raise InputError(f"{embeddings} has {einfo['n']} rows, {docs} {prows.n}")
        calls = [(str(embeddings), tuple(e["rows"]), str(out), _name("doc", s), backend,
                  index_params, device, export_hnsw) for s, e in enumerate(einfo["shards"])]
        entries = run.map(build_rows_shard, calls, gpu=True)
        fields.update(lam=einfo["lam"], augment_docs=einfo["augment_docs"])
    else:
        if queries is None or relevance is None:
            raise InputError("build('xl') needs queries= and relevance= (the training queries "
                             "and their pairs)")
        from .params import XLParams, XLSearchParams

        params = XLParams(lam=lam, k=k, knn_norm=knn_norm, rescore=rescore,
                          augment_docs=augment_docs).to_dict()
        candidates = XLSearchParams(candidates=candidates).candidates
        rinfo = read_stage(relevance, "relevance")
        qrows = Rows(queries)
        if rinfo["n"] != prows.n or rinfo["m"] != qrows.n:
            raise InputError(f"Y is {rinfo['m']} x {rinfo['n']} but there are {qrows.n} "
                             f"query and {prows.n} document embeddings")
        ranges = split(prows.n, doc_rows)
        maps = [(str(queries), str(relevance), r, ranges, False, True)
                for r in range(len(rinfo["shards"]))]
        reduces = [(str(docs), rng, str(out), s, {**params, "candidates": candidates},
                    backend, index_params, device, export_hnsw)
                   for s, rng in enumerate(ranges)]
        entries = run.map_reduce(split_queries, maps, build_xl_shard, reduces, gpu=True)
        fields["bytes_shuffled"] = sum(e.pop("bytes_in") for e in entries)
        calls = [(str(queries), tuple(e["rows"]), str(out), _name("query", r), backend,
                  index_params, device, False) for r, e in enumerate(rinfo["shards"])]
        query_entries = run.map(build_rows_shard, calls, gpu=True)
        fields.update(params=params, candidates=candidates, m=rinfo["m"])
    return write_stage(out, "build", entries, query_shards=query_entries, **fields)


def _jsonable(params: Any) -> Any:
    if params is None or isinstance(params, dict):
        return params
    return params.to_dict()


# ------------------------------------------------------------------------------ 4. search

def _merge(parts: Sequence[tuple[torch.Tensor, torch.Tensor] | None],
           k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of several shards' (B, *) results (global ids), ties to the lower id."""
    parts = [p for p in parts if p is not None]
    if len(parts) == 1 and parts[0][1].shape[1] >= k:
        return parts[0][0][:, :k], parts[0][1][:, :k]
    return merge_topk(torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1), k)


def _offset(result: tuple[torch.Tensor, torch.Tensor], lo: int):
    s, i = result
    return s.float().cpu(), torch.where(i >= 0, i + lo, i).cpu()


def _compact(scores: torch.Tensor, ids: torch.Tensor):
    """Valid entries (id >= 0) first in each row, in their order; padding (-1, -inf) after."""
    order = torch.argsort((ids < 0).to(torch.int8), dim=1, stable=True)
    ids = ids.gather(1, order)
    return torch.where(ids >= 0, scores.gather(1, order), float("-inf")), ids


class ShardServer:
    """Some document and query shards of a :func:`build` stage, in memory on ``device``,
    answering one search round each over its shards (results merged over its shards, global
    ids, on the CPU). A Ray actor in :class:`pefa_gpu.distributed.RayRunner`."""

    def __init__(self, build: str | Path, doc_shards: Sequence[int],
                 query_shards: Sequence[int] = (), device: Any = None):
        folder = Path(build)
        self.info = read_stage(folder, "build")
        self.docs = []   # (lo, hi, model, query_rows or None)
        for s in doc_shards:
            entry = self.info["shards"][s]
            shard = _open(folder, entry, device=device)
            rows = shard.tensors.get("query_rows")
            self.docs.append((entry["rows"][0], entry["rows"][1], shard.model,
                              None if rows is None else rows.to(shard.model.device)))
        self.queries = []
        for r in query_shards:
            entry = self.info["query_shards"][r]
            self.queries.append((entry["rows"][0], _open(folder, entry, device=device).model))

    def erm(self, q: torch.Tensor, k: int, params: dict | None = None):
        """Top-k over this server's document shards (ERM / XS scores; XL's passage index);
        ``params``: the backend's search settings (None: each index's own)."""
        if not self.docs:
            return None
        parts = []
        for lo, _, model, rows in self.docs:
            qq = q.to(model.device)
            kk = min(k, model.index.ntotal)  # _merge pads to k
            typed = model.index_search_params.replace(**params) if params else None
            parts.append(_offset(model.index.search(qq, kk, params) if rows is not None
                                 else model.search(qq, kk, index_params=typed), lo))
        return _merge(parts, k)

    def knn(self, q: torch.Tensor, k: int, params: dict | None = None):
        """Top-k training queries over this server's query shards (global rows)."""
        if not self.queries:
            return None
        return _merge([_offset(model.search(q.to(model.device), min(k, model.n_docs),
                                            index_params=model.index_search_params.replace(
                                                **params) if params else None), lo)
                       for lo, model in self.queries], k)

    def fuse(self, q: torch.Tensor, erm: tuple[torch.Tensor, torch.Tensor],
             knn: tuple[torch.Tensor, torch.Tensor], topk: int, lam: float, k: int):
        """PEFA-XL's fused top-``topk`` over this server's documents: for each shard, the
        global ERM candidates and neighbours that concern it, in its local numbering, through
        :meth:`PEFAXL.fuse`. The fused score of a document depends only on q, the
        neighbours, its own embedding and its own column of Y, so the top-k of every shard's
        top-k is the top-k of one model over all documents."""
        if not self.docs:
            return None
        m = int(self.info["m"])
        parts = []
        for lo, hi, model, rows in self.docs:
            dev = model.device
            e_ids = erm[1].to(dev)
            mine = (e_ids >= lo) & (e_ids < hi)
            e_local = _compact(erm[0].to(dev), torch.where(mine, e_ids - lo, -1))
            k_local = _compact(knn[0].to(dev), self._local_rows(knn[1].to(dev), m, lo, hi,
                                                                  rows, model))
            parts.append(_offset(model.fuse(q.to(dev), e_local, k_local, min(topk, model.n_docs),
                                            lam=lam, k=k), lo))
        return _merge(parts, topk)

    @staticmethod
    def _local_rows(r: torch.Tensor, m: int, lo: int, hi: int, rows: torch.Tensor,
                    model: Any) -> torch.Tensor:
        """Global relevance rows (queries < m, document j as m + j) -> the shard model's
        rows (its training queries, then its documents), -1 where a row is not its own."""
        local = torch.full_like(r, -1)
        if rows.numel():
            pos = torch.searchsorted(rows, r.clamp(0, max(m - 1, 0)))
            pos = pos.clamp_max(rows.numel() - 1)
            hit = (r >= 0) & (r < m) & (rows[pos] == r)
            local = torch.where(hit, pos, local)
        if model.params.augment_docs:
            doc = r - m
            mine = (r >= m) & (doc >= lo) & (doc < hi)
            local = torch.where(mine, model.n_train_queries + doc - lo, local)
        return local


def search_batch(fan: Any, info: dict[str, Any], q: torch.Tensor, topk: int,
                 lam: float | None = None, k: int | None = None,
                 candidates: int | None = None,
                 params: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One round of queries (B, d) float32 over every server of ``fan``: ERM / XS merge the
    shards' top-k; PEFA-XL searches the passage and query shards, merges, forms the
    neighbours and fuses per document shard, then merges the fused top-k."""
    if info["method"] != "xl":
        (parts,) = fan.call(("erm", (q, topk, params)))
        return _merge(parts, topk)
    p = info["params"]
    lam = p["lam"] if lam is None else lam
    k = p["k"] if k is None else k
    n, m = _n_docs(info), int(info["m"])
    kp = min(info["candidates"] if candidates is None else candidates, n)
    kn = min(k, m + n if p["augment_docs"] else m)  # the neighbours there are (fused with k)
    width = max(kp, kn) if p["augment_docs"] else kp
    erm_parts, knn_parts = fan.call(("erm", (q, width, params)), ("knn", (q, min(kn, m), params)))
    erm = _merge(erm_parts, width)
    knn = neighbours(_merge(knn_parts, min(kn, m)), erm, m, kn, p["augment_docs"])
    (parts,) = fan.call(("fuse", (q, (erm[0][:, :kp], erm[1][:, :kp]), knn, topk, lam, k)))
    return _merge(parts, topk)


def _n_docs(info: dict[str, Any]) -> int:
    """The documents a build stage holds (its document shards' rows)."""
    return sum(int(e["rows"][1]) - int(e["rows"][0]) for e in info["shards"])


def server_groups(info: dict[str, Any], workers: int) -> list[tuple[list[int], list[int]]]:
    """Contiguous blocks of document and query shards for ``workers`` servers (servers
    without shards are left out)."""
    groups = []
    n_d, n_q = len(info["shards"]), len(info.get("query_shards", []))
    for w in range(workers):
        d = list(range(n_d * w // workers, n_d * (w + 1) // workers))
        q = list(range(n_q * w // workers, n_q * (w + 1) // workers))
        if d or q:
            groups.append((d, q))
    return groups


def search(build: str | Path, queries: Any, topk: int = 100, lam: float | None = None,
           k: int | None = None, candidates: int | None = None,
           batch_size: int = DEFAULT_BATCH, device: Any = None, runner: Any = None,
           show_progress: bool = False,
           params: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Search a :func:`build` stage: (B, d) queries (or a row stage folder) -> (B, topk)
    float32 scores and int64 ids on the CPU, -1 padded, ties to the lower id.

    Query batches of ``batch_size`` fan out to the runner's shard servers (the build's shards
    split over its workers); each returns its top-k, merged here (:func:`search_batch`).
    ``lam`` / ``k`` / ``candidates`` override PEFA-XL's build-time values; ``params``: the
    backend's search settings for every shard's index (e.g. ``{"ef_search": 500}``)."""
    from tqdm.auto import tqdm

    batch_size = check_positive_int(batch_size, "batch_size")
    info = read_stage(build, "build")
    topk = check_topk(topk, _n_docs(info))
    if lam is not None:
        from .params import check_unit_interval
        check_unit_interval(lam, "lam")
    for v, what in ((k, "k"), (candidates, "candidates")):
        if v is not None:
            check_positive_int(v, what)
    source = Rows(queries) if isinstance(queries, (str, Path)) else None
    if source is None:
        qall = as_embeddings(queries, "cpu", "queries", dim=info["dim"], check_norm=False)
        n_q = qall.shape[0]
    else:
        if source.dim != info["dim"]:
            raise InputError(f"queries have dimension {source.dim}, the build {info['dim']}")
        n_q = source.n
    run = _runner(runner)
    out_s, out_i = [], []
    with run.servers(build, server_groups(info, run.workers), device) as fan:
        for lo in tqdm(range(0, n_q, batch_size), desc="search", unit="batch",
                       disable=not show_progress):
            hi = min(lo + batch_size, n_q)
            q = (qall[lo:hi] if source is None else
                 torch.from_numpy(source.read(lo, hi)))
            s, i = search_batch(fan, info, q.contiguous(), topk, lam, k, candidates, params)
            out_s.append(s)
            out_i.append(i)
    if not out_s:
        return torch.empty(0, topk), torch.empty(0, topk, dtype=torch.long)
    return torch.cat(out_s), torch.cat(out_i)


# ------------------------------------------------------------------------------ 5. evaluate

def evaluate_configs(P: Any, Q: Any, Y: Any, queries: Any, Y_test: Any,
                     configs: Sequence[Any], work: str | Path, *, backend: str = "exact",
                     index_params: Any = None, candidates: int = 500, knn_norm: str = "k",
                     rescore: bool = True, augment_docs: bool = True, device: Any = None,
                     ks: Sequence[int] = (10, 100), topk: int = 100, count_empty: bool = False,
                     doc_rows: int | None = None, query_rows: int | None = None,
                     runner: Any = None, show_progress: bool = True) -> list[dict[str, Any]]:
    """From embeddings to metrics through the stages, in ``work`` (a folder on a path every
    worker sees): P (n, d), Q (m, d), queries (B, d) as arrays or row stage folders, Y (m x n)
    and Y_test (B x n) relevance; ``configs``: :class:`pefa_gpu.Config` (method, lam, k).
    Returns one :func:`pefa_gpu.evaluate` dict per config. Each index is built once: XS once
    per λ, XL once (λ and k are applied at search time), ERM once. ``doc_rows`` /
    ``query_rows`` default to an even split over the runner's workers."""
    from tqdm.auto import tqdm

    from .metrics import evaluate

    run = _runner(runner)
    work = Path(work)
    docs = _as_rows(P, work / "docs", "docs")
    train = _as_rows(Q, work / "queries", "queries")
    n, m = len(Rows(docs)), len(Rows(train))
    doc_rows = doc_rows or max(-(-n // run.workers), 1)
    query_rows = query_rows or max(-(-m // run.workers), 1)
    rel = write_relevance(Y, work / "pairs", rows=query_rows)
    common = dict(backend=backend, index_params=index_params, device=device,
                  doc_rows=doc_rows, runner=run)
    built: dict[tuple, Path] = {}
    results = []
    for cfg in tqdm(configs, desc="pipeline", unit="config", disable=not show_progress):
        if cfg.method == "erm":
            key = ("erm",)
            if key not in built:
                built[key] = build("erm", work / "erm", docs, **common)
            s_kw = {}
        elif cfg.method == "xs":
            key = ("xs", cfg.lam)
            if key not in built:
                agg = aggregate(train, rel, docs, work / f"xs-{cfg.lam:g}", lam=cfg.lam,
                                augment_docs=augment_docs, doc_rows=doc_rows, runner=run)
                built[key] = build("xs", work / f"xs-{cfg.lam:g}-index", docs, embeddings=agg,
                                   **common)
            s_kw = {}
        else:
            key = ("xl",)
            if key not in built:
                built[key] = build("xl", work / "xl", docs, queries=train, relevance=rel,
                                   lam=cfg.lam, k=cfg.k, candidates=candidates,
                                   knn_norm=knn_norm, rescore=rescore,
                                   augment_docs=augment_docs, **common)
            s_kw = dict(lam=cfg.lam, k=cfg.k)
        _, ids = search(built[key], queries, topk=topk, device=device, runner=run, **s_kw)
        results.append(evaluate(ids, Y_test, ks, count_empty=count_empty))
    return results


def _as_rows(x: Any, folder: Path, what: str) -> Path:
    """A row stage folder as is; an array written as one under ``folder``."""
    if isinstance(x, (str, Path)):
        read_stage(x)
        return Path(x)
    return write_rows(x, folder, rows=DEFAULT_ROWS, name="embeddings", stage=what)
