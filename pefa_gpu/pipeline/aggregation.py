"""The aggregate stage: PIFA Yᵀ Q (and PEFA-XS's E) per document range, as a map over query
shards (:func:`split_queries`, also PEFA-XL's build's map) and a reduce per document range
(:func:`reduce_sums`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import scipy.sparse as sp
import torch

from ..aggregate import pefa_xs, pifa
from ..arrays import to_numpy
from ..errors import InputError
from ..params import check_unit_interval
from .runner import local
from .shards import (DEFAULT_ROWS, Entry, Rows, Stage, open_entry, read_stage, shard_name,
                     split, write_shard, write_stage)


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


def nbytes(parts: Sequence[Part]) -> int:
    """The bytes of ``parts``' arrays (what the map tasks sent)."""
    arrays = [a for p in parts for a in (p.docs, p.sums, p.queries, p.vectors, p.y)
              if a is not None]
    return int(sum(a.data.nbytes + a.indices.nbytes + a.indptr.nbytes if sp.issparse(a)
                   else a.nbytes for a in arrays))


def check_pairs(rel: Stage, queries: Rows, docs: Rows) -> None:
    """Y (a relevance stage) must be (queries x documents), both of one dimension."""
    if queries.n != rel.m or docs.n != rel.n:
        raise InputError(f"Y is {rel.m} x {rel.n} but there are {queries.n} query and "
                         f"{docs.n} document embeddings")
    if queries.dim != docs.dim:
        raise InputError(f"queries have dimension {queries.dim}, documents {docs.dim}")


def split_queries(queries: str | Path, relevance: str | Path, shard: int,
                  doc_ranges: Sequence[tuple[int, int]], pairs: bool = False) -> list[Part]:
    """Map task of query shard ``shard`` (a shard of the relevance stage): read its rows of Y
    and Q, and for every document range return a :class:`Part`: the partial Yᵀ Q of the
    documents its pairs touch (computed by :func:`pefa_gpu.pifa`), or with ``pairs`` the
    touching queries, their embeddings and pairs."""
    entry = read_stage(relevance, "relevance").shards[shard]
    lo, hi = entry.rows
    y_csc = open_entry(relevance, entry).matrices["relevance"].tocsc()
    q = Rows(queries).read(lo, hi)
    out = []
    for d_lo, d_hi in doc_ranges:
        block = y_csc[:, d_lo:d_hi].tocsr()
        touched = np.flatnonzero(np.diff(block.indptr))  # queries with a pair in the range
        block, q_t = block[touched], q[touched]
        if pairs:
            out.append(Part(queries=(touched + lo).astype(np.int64), vectors=q_t, y=block))
            continue
        docs = np.flatnonzero(np.diff(block.tocsc().indptr)).astype(np.int64)
        sums = (to_numpy(pifa(block[:, docs], q_t, normalize=False, device="cpu"))
                if docs.size else np.zeros((0, q.shape[1]), np.float32))
        out.append(Part(docs=docs, sums=sums))
    return out


def reduce_sums(parts: Sequence[Part], docs: str | Path, doc_range: tuple[int, int],
                out: str | Path, index: int, lam: float | None,
                augment_docs: bool) -> tuple[Entry, int]:
    """Reduce task of one document range: P (with ``augment_docs``) plus the partial sums of
    every query shard, added in query-shard order; then E = ``pefa_xs(P, sums, lam)``
    (:mod:`pefa_gpu.aggregate`), as PEFAXS computes it. Writes ``out/doc-<index>``; returns
    its stage entry and the bytes it received."""
    lo, hi = doc_range
    p = Rows(docs).read(lo, hi)
    acc = p.copy() if augment_docs else np.zeros_like(p)
    for part in parts:
        if part.docs.size:
            acc[part.docs] += part.sums
    tensors: dict[str, Any] = {"sums": torch.from_numpy(acc)}
    if lam is not None:
        tensors["embeddings"] = pefa_xs(torch.from_numpy(p), tensors["sums"], lam)
    entry = write_shard(Path(out) / shard_name("doc", index),
                        {"stage": "aggregate", "rows": [lo, hi], "lam": lam,
                         "augment_docs": augment_docs}, tensors)
    return entry, nbytes(parts)


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
    Bytes moved: README, "Beyond one machine (Ray)", Aggregate.
    """
    rel, prows = read_stage(relevance, "relevance"), Rows(docs)
    check_pairs(rel, Rows(queries), prows)
    if lam is not None:
        check_unit_interval(lam, "lam")
    ranges = split(rel.n, doc_rows)
    maps = [(str(queries), str(relevance), r, ranges) for r in range(len(rel.shards))]
    reduces = [(str(docs), rng, str(out), s, lam, bool(augment_docs))
               for s, rng in enumerate(ranges)]
    entries, moved = zip(*local(runner).map_reduce(split_queries, maps, reduce_sums, reduces))
    return write_stage(out, Stage(stage="aggregate", shards=entries, n=rel.n, dim=prows.dim,
                                  lam=lam, augment_docs=bool(augment_docs),
                                  bytes_shuffled=sum(moved)))
