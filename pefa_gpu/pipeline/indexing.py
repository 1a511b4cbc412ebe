"""The build stage: an index per document shard (ERM over P or PEFA-XS's E, or a PEFA-XL
shard) and PEFA-XL's query index shards."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import scipy.sparse as sp
import torch

from ..arrays import DeviceLike
from ..errors import InputError
from ..index import backend_class
from ..methods import REGISTRY
from ..models import ERM, PEFAXL
from ..params import XLParams, XLSearchParams, check_choice, check_flag
from ..storage import writing_save
from .aggregation import Part, read_pairs, split_queries
from .runner import LocalRunner
from .shards import (DEFAULT_ROWS, SHARD_FORMAT, SHARD_MANIFEST, Entry, Rows, Stage,
                     check_folders, check_stage_out, commit_shard, in_stage, read_stage,
                     shard_name, split, write_shard, write_stage)

METHODS = tuple(m for m in REGISTRY if REGISTRY[m].pipeline)  # ("erm", "xs", "xl")


def build_rows_shard(vectors: str | Path, rows: tuple[int, int], out: str | Path, name: str,
                     backend: str, index_params: Any, device: DeviceLike, export_hnsw: bool,
                     tensor: str = "embeddings") -> Entry:
    """An ERM over rows lo .. hi-1 of a row stage (P, E or Q) saved as ``out/<name>``."""
    x = Rows(vectors, tensor).read(*rows)
    with warnings.catch_warnings():  # PEFA-XS's E is not unit-norm, by design
        warnings.filterwarnings("ignore", message=".*not L2-normalised", category=UserWarning)
        model = ERM(backend=backend, device=device, index_params=index_params).fit(x)
    return write_shard(Path(out) / name, {"stage": "build", "rows": list(rows)}, model=model,
                       export_hnsw=export_hnsw)


def build_xl_shard(parts: Sequence[Part], queries: str | Path, docs: str | Path,
                   doc_range: tuple[int, int], out: str | Path, index: int, params: XLParams,
                   candidates: int, backend: str, index_params: Any, device: DeviceLike,
                   export_hnsw: bool) -> tuple[Entry, int]:
    """Reduce task of PEFA-XL's build for a document range: a PEFAXL over its P, the queries
    with a pair there and their Y as ``out/doc-<index>`` with their rows (``query_rows``; no
    pairs: its first document as the query); (entry, bytes received)."""
    lo, hi = doc_range
    p = Rows(docs).read(lo, hi)  # a view of the map: the model's copy is the only one in memory
    rows = np.concatenate([pt.queries for pt in parts]) if parts else np.zeros(0, np.int64)
    path = Path(out) / shard_name("doc", index)
    with writing_save(in_stage(path), SHARD_MANIFEST, SHARD_FORMAT) as w:
        if rows.size:  # its queries (many in a popular range) on disk, in the unfinished save
            q = Rows(queries).take(rows, np.lib.format.open_memmap(
                w.data / "q.npy", "w+", np.float32, (rows.size, p.shape[1])))
            y = sp.vstack([pt.y for pt in parts], format="csr")
        else:
            q = p[:1]
            y = sp.csr_matrix(([1.0], ([0], [0])), shape=(1, hi - lo), dtype=np.float32)
        model = PEFAXL(backend=backend, device=device, index_params=index_params,
                       search_params=XLSearchParams(candidates=candidates),
                       **params.to_dict()).fit(p, q, y)
        (w.data / "q.npy").unlink(missing_ok=True)
        manifest = commit_shard(w, {"stage": "build", "rows": [lo, hi]},
                                {"query_rows": torch.from_numpy(rows.astype(np.int64))},
                                model=model, export_hnsw=export_hnsw)
    return Entry.of(path, manifest), sum(pt.nbytes for pt in parts)


def build(method: str, out: str | Path, docs: str | Path, *,
          embeddings: str | Path | None = None, queries: str | Path | None = None,
          relevance: str | Path | None = None, doc_rows: int = DEFAULT_ROWS,
          backend: str = "exact", index_params: Any = None, device: DeviceLike = None,
          lam: float = 0.1, k: int = 16, candidates: int = 500, knn_norm: str = "k",
          rescore: bool = True, augment_docs: bool = True, export_hnsw: bool = False,
          runner: Any = None) -> Path:
    """An index per document shard: ``erm`` over ``docs``, ``xs`` over ``embeddings``
    (:func:`aggregate`'s E), ``xl`` a :func:`build_xl_shard` per range and an ERM per query
    shard; XL's settings as :class:`pefa_gpu.PEFAXL`'s; ``export_hnsw``: an HNSW file too."""
    check_choice(method, "method", METHODS)
    check_folders(out=out, docs=docs, embeddings=embeddings, queries=queries,
                  relevance=relevance)
    export_hnsw = check_flag(export_hnsw, "export_hnsw")  # 'no' exported one per shard
    run, prows = runner or LocalRunner(), Rows(docs)
    check_stage_out(out, "build")
    ix_params = backend_class(backend).Params.coerce(index_params, "index_params")
    stage = dict(stage="build", method=method, n=prows.n, dim=prows.dim, backend=backend,
                 index_params=None if index_params is None else ix_params.to_dict())
    index = (backend, ix_params, device)
    if method == "xl":
        if queries is None or relevance is None:
            raise InputError("build('xl') needs queries= and relevance= (the training queries "
                             "and their pairs)")
        params = XLParams(lam=lam, k=k, knn_norm=knn_norm, rescore=rescore,
                          augment_docs=augment_docs)
        candidates = XLSearchParams(candidates=candidates).candidates
        rel, ranges = read_pairs(relevance, queries, prows, doc_rows)
        maps = [(str(queries), str(relevance), r, ranges) for r in range(len(rel.shards))]
        reduces = [(str(queries), str(docs), rng, str(out), s, params, candidates, *index,
                    export_hnsw) for s, rng in enumerate(ranges)]
        shards, moved = zip(*run.map_reduce(split_queries, maps, build_xl_shard, reduces,
                                            gpu=True))
        calls = [(str(queries), e.rows, str(out), shard_name("query", r), *index, False)
                 for r, e in enumerate(rel.shards)]
        return write_stage(out, Stage(
            **stage, shards=shards, query_shards=tuple(run.map(build_rows_shard, calls, gpu=True)),
            params=params, candidates=candidates, m=rel.m, bytes_shuffled=sum(moved)))
    if method == "xs":
        if embeddings is None:
            raise InputError("build('xs') needs embeddings= (the folder aggregate() wrote)")
        agg = read_stage(embeddings, "aggregate")
        if agg.lam is None:
            raise InputError(f"{embeddings} holds sums only: run aggregate() with lam=")
        if agg.n != prows.n:
            raise InputError(f"{embeddings} has {agg.n} rows, {docs} {prows.n}")
        source, ranges = embeddings, [e.rows for e in agg.shards]
        stage.update(lam=agg.lam, augment_docs=agg.augment_docs)
    else:
        source, ranges = docs, split(prows.n, doc_rows)
    calls = [(str(source), rng, str(out), shard_name("doc", s), *index, export_hnsw)
             for s, rng in enumerate(ranges)]
    shards = tuple(run.map(build_rows_shard, calls, gpu=True))
    return write_stage(out, Stage(**stage, shards=shards))
