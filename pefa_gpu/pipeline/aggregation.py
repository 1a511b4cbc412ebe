"""The aggregate stage, PIFA Yᵀ Q (and PEFA-XS's E) per document range: a map per query shard
(:func:`split_queries`, also PEFA-XL's build's) and a reduce per range (:func:`reduce_sums`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import scipy.sparse as sp
import torch

from ..aggregate import pefa_xs, pifa
from ..errors import FormatError, InputError
from ..params import check_flag, check_unit_interval
from .runner import LocalRunner
from .shards import (DEFAULT_ROWS, Entry, Rows, Stage, check_folders, check_stage_out,
                     open_entry, read_stage, remove_shard, shard_name, split, write_shard,
                     write_stage)


@dataclasses.dataclass
class Part:
    """A query shard's pairs in a document range: queries (T,) int64 rows, y (T x n_range) CSR."""

    queries: np.ndarray
    y: sp.csr_matrix

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.queries, self.y.data, self.y.indices, self.y.indptr))


def read_pairs(relevance: str | Path, queries: str | Path, docs: Rows, doc_rows: int
               ) -> tuple[Stage, list[tuple[int, int]]]:
    """The relevance stage of Y (checked against Q and P) and the ranges of ``doc_rows`` docs."""
    rel, q = read_stage(relevance, "relevance"), Rows(queries)
    if q.n != rel.m or docs.n != rel.n:
        raise InputError(f"Y is {rel.m} x {rel.n} but there are {q.n} query and "
                         f"{docs.n} document embeddings")
    if q.dim != docs.dim:
        raise InputError(f"queries have dimension {q.dim}, documents {docs.dim}")
    return rel, split(rel.n, doc_rows)


def split_queries(queries: str | Path, relevance: str | Path, shard: int,
                  doc_ranges: Sequence[tuple[int, int]], spill: str | Path | None = None
                  ) -> list[Any]:
    """Map task of query shard ``shard``: a :class:`Part` per document range; with ``spill``
    instead each range's partial Yᵀ Q (docs-<s> (U,) int64 local rows, sums-<s> (U, d)
    float32) in the shard ``spill/part-<shard>``, and per range its entry (None: empty)."""
    info = read_stage(relevance, "relevance")
    entry = info.shards[shard]
    lo, hi = entry.rows
    y = open_entry(relevance, entry).matrices.get("relevance")
    if y is None or y.shape != (hi - lo, info.n):  # forged: a raw KeyError, or wrong sums
        raise FormatError(f"{Path(relevance) / entry.name} holds no relevance matrix of its "
                          f"rows and the stage's documents ({hi - lo} x {info.n})")
    y_csc = y.tocsc()
    blocks = []
    for d_lo, d_hi in doc_ranges:
        block = y_csc[:, d_lo:d_hi].tocsr()
        touched = np.flatnonzero(np.diff(block.indptr))  # queries with a pair in the range
        blocks.append(Part((touched + lo).astype(np.int64), block[touched]))
    if spill is None:
        return blocks
    q, sums = Rows(queries).read(lo, hi), {}
    for s, part in enumerate(blocks):
        docs = np.unique(part.y.indices).astype(np.int64)  # the range's documents with a pair
        if docs.size:
            sums[f"docs-{s}"] = torch.from_numpy(docs)
            sums[f"sums-{s}"] = pifa(part.y[:, docs], q[part.queries - lo], normalize=False,
                                     device="cpu")
    path = Path(spill) / shard_name("part", shard)
    written = write_shard(path, {"stage": "part", "rows": [lo, hi]}, sums)
    return [written if f"docs-{s}" in sums else None for s in range(len(doc_ranges))]


def reduce_sums(parts: Sequence[Entry | None], docs: str | Path, doc_range: tuple[int, int],
                out: str | Path, index: int, lam: float | None,
                augment_docs: bool) -> tuple[Entry, int]:
    """Reduce task of a document range: P (``augment_docs``) plus the partial sums in
    query-shard order (and E, given ``lam``) as ``out/doc-<index>``; (entry, bytes received)."""
    p = Rows(docs).read(*doc_range)
    acc = p.copy() if augment_docs else np.zeros_like(p)
    moved = 0
    for part in filter(None, parts):
        t = open_entry(out, part).tensors
        rows, sums = t[f"docs-{index}"].numpy(), t[f"sums-{index}"].numpy()
        with np.errstate(over="ignore"):  # refused below, by name
            acc[rows] += sums
        moved += rows.nbytes + sums.nbytes
    if not np.isfinite(acc).all():  # E was NaN (a warning), then build('xs') blamed 'P'
        bad = np.flatnonzero(~np.isfinite(acc).all(axis=1))[:5] + doc_range[0]
        raise InputError(f"the sums Yᵀ Q of documents {bad.tolist()}... overflow float32: "
                         f"scale the query embeddings or Y's weights down")
    tensors: dict[str, Any] = {"sums": torch.from_numpy(acc)}
    if lam is not None:
        tensors["embeddings"] = pefa_xs(torch.from_numpy(p), tensors["sums"], lam)
    return write_shard(Path(out) / shard_name("doc", index),
                       {"stage": "aggregate", "rows": list(doc_range), "lam": lam,
                        "augment_docs": augment_docs}, tensors), moved


def aggregate(queries: str | Path, relevance: str | Path, docs: str | Path,
              out: str | Path, lam: float | None = None, augment_docs: bool = True,
              doc_rows: int = DEFAULT_ROWS, runner: Any = None) -> Path:
    """PIFA Yᵀ Q (and PEFA-XS's E, given ``lam``) per range of ``doc_rows`` documents from row
    stages of Q (m, d) and P (n, d) and a relevance stage of Y; no task holds more than one
    query shard or one range, the partial sums wait on disk (``out/part-<r>``, removed)."""
    check_folders(queries=queries, relevance=relevance, docs=docs, out=out)
    prows = Rows(docs)
    rel, ranges = read_pairs(relevance, queries, prows, doc_rows)
    if lam is not None:
        check_unit_interval(lam, "lam")
        lam = float(lam)  # a numpy float was 'the manifest cannot be written as JSON'
    augment_docs = check_flag(augment_docs, "augment_docs")  # 'no' was taken as True
    check_stage_out(out, "aggregate")
    maps = [(str(queries), str(relevance), r, ranges, str(out)) for r in range(len(rel.shards))]
    reduces = [(str(docs), rng, str(out), s, lam, augment_docs)
               for s, rng in enumerate(ranges)]
    try:
        entries, moved = zip(*(runner or LocalRunner()).map_reduce(split_queries, maps,
                                                                    reduce_sums, reduces))
    finally:
        for r in range(len(rel.shards)):
            remove_shard(Path(out) / shard_name("part", r))
    return write_stage(out, Stage(stage="aggregate", shards=entries, n=rel.n, dim=prows.dim,
                                  lam=lam, augment_docs=augment_docs,
                                  bytes_shuffled=sum(moved)))
