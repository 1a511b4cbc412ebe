"""Retrieval metrics of (B, K) ranked ids (-1 padding; a repeated id counts at its first rank)
against a (B x n) relevance matrix. Queries without a relevant document are skipped (the
paper's convention), or counted as 0 with ``count_empty`` (trec_eval's)."""

from __future__ import annotations

import logging
from typing import Iterable

import numpy as np

from .arrays import ArrayLike, to_numpy
from .errors import InputError
from .params import check_flag
from .relevance import RelevanceLike, as_relevance

log = logging.getLogger("pefa_gpu")


def _gains(ids: ArrayLike, Y_test: RelevanceLike, name: str = "Y_test"
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(B, K) gains of the ranked ids, (B,) relevant counts, and (B, min(R, K)) sorted ideal
    gains (R: the most relevant documents of a query)."""
    ids = np.asarray(to_numpy(ids, "ids"))
    if ids.ndim != 2:
        raise InputError(f"ids must be 2-D (queries, ranks), got shape {ids.shape}")
    rel = as_relevance(Y_test, name=name, allow_empty=True).csr
    b, n = rel.shape
    if ids.shape[0] != b:
        raise InputError(f"ids has {ids.shape[0]} rows but {name} has {b} queries")
    if ids.dtype.kind not in "iuf":  # bool, complex, objects, strings
        raise InputError(f"ids must be integer document ids, got dtype {ids.dtype}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer) and \
            not (np.all(np.isfinite(ids)) and np.all(ids == np.round(ids))):
        raise InputError(f"ids must be integer document ids, got dtype {ids.dtype} with "
                         f"non-integer values")
    if ids.size and ids.min() < -1:  # checked in their own dtype: 1e20 or 2**64 - 1 are
        raise InputError(f"ids contain {int(ids.min())}: only -1 marks padding")  # not wrapped
    if ids.size and ids.max() >= n:
        raise InputError(f"ids contain document {int(ids.max())} but {name} has {n} documents")
    ids = ids.astype(np.int64)
    # first occurrence of each id in a row only
    order = np.argsort(ids, axis=1, kind="stable")
    first = np.empty_like(ids, dtype=bool)
    np.put_along_axis(first, order, np.diff(np.take_along_axis(ids, order, 1), axis=1,
                                            prepend=-2) != 0, 1)
    valid = (ids >= 0) & first
    rows = np.repeat(np.arange(b), ids.shape[1])
    cols = np.where(valid, ids, 0).ravel()
    picked = rel[rows, cols] if ids.size and n else np.zeros(ids.size)  # scipy: 1 x 0 for none
    gains = np.asarray(picked).reshape(ids.shape) * valid
    positive = rel.maximum(0)  # explicit zeros and negative grades dropped
    n_rel = np.diff(positive.indptr)
    # each query's grades in descending order, its first K only (a query may have n of them)
    ideal = np.zeros((b, max(min(int(n_rel.max(initial=0)), ids.shape[1]), 1)))
    row = np.repeat(np.arange(b), n_rel)
    order = np.lexsort((-positive.data, row))
    rank = np.arange(row.size) - positive.indptr[row]
    top = rank < ideal.shape[1]
    ideal[row[top], rank[top]] = positive.data[order][top]
    return np.maximum(gains, 0), n_rel, ideal


def evaluate(ids: ArrayLike, Y_test: RelevanceLike, ks: Iterable[int] = (10, 100),
             count_empty: bool = False) -> dict[str, float]:
    """{"recall@k", "ndcg@k" (graded gains), "mrr@k" for each k; "n_queries" averaged over,
    "n_skipped", "n_empty" (without a relevant document)}: ids (B, K >= every k), Y_test (B x n)."""
    ks = check_ks(ks)
    check_flag(count_empty, "count_empty")
    gains, n_rel, ideal = _gains(ids, Y_test)
    width = gains.shape[1]
    if max(ks) > width:
        raise InputError(f"ids have {width} ranks per query, fewer than k = {max(ks)}: "
                         f"@{max(ks)} metrics need a search with topk >= {max(ks)}")
    keep = n_rel > 0
    n_empty = int((~keep).sum())
    out: dict[str, float] = {"n_queries": int(keep.size if count_empty else keep.sum()),
                             "n_skipped": 0 if count_empty else n_empty, "n_empty": n_empty}
    if n_empty:
        log.info("metrics: %d of %d queries have no relevant document and are %s", n_empty,
                 keep.size, "counted as 0" if count_empty else "skipped")
    g, nr, ideal = gains[keep], n_rel[keep], ideal[keep]
    discount = 1.0 / np.log2(np.arange(2, max(ks) + 2))  # not width: ids (0, 2**40) hold none
    hit = g > 0
    denom = max(out["n_queries"], 1)
    for k in ks:
        out[f"recall@{k}"] = float(np.sum(hit[:, :k].sum(1) / nr) / denom)
        dcg = (g[:, :k] * discount[:k]).sum(1)
        idcg = ideal[:, :k] @ discount[:ideal[:, :k].shape[1]]
        out[f"ndcg@{k}"] = float(np.sum(dcg / idcg) / denom)
        first_hit = np.where(hit[:, :k].any(1), hit[:, :k].argmax(1) + 1, np.inf)
        out[f"mrr@{k}"] = float(np.sum(1.0 / first_hit) / denom)
    return out


def recall_at_k(ids: ArrayLike, Y_test: RelevanceLike, ks: Iterable[int] = (10, 100)
                ) -> dict[int, float]:
    """{k: Recall@k}: |relevant ∩ top-k| / |relevant|, averaged over queries with a relevant
    document."""
    return _metric("recall", ids, Y_test, ks)


def ndcg_at_k(ids: ArrayLike, Y_test: RelevanceLike, ks: Iterable[int] = (10,)) -> dict[int, float]:
    """{k: nDCG@k} with linear gains Y_test[q, j] and log2 discounts."""
    return _metric("ndcg", ids, Y_test, ks)


def mrr_at_k(ids: ArrayLike, Y_test: RelevanceLike, ks: Iterable[int] = (10,)) -> dict[int, float]:
    """{k: MRR@k}: mean reciprocal rank of the first relevant document in the top k (0 if none)."""
    return _metric("mrr", ids, Y_test, ks)


def _metric(name: str, ids: ArrayLike, Y_test: RelevanceLike, ks: Iterable[int]
            ) -> dict[int, float]:
    """{k: ``name``@k} of :func:`evaluate` (``ks`` read once: an iterator serves)."""
    ks = check_ks(ks)
    res = evaluate(ids, Y_test, ks)
    return {k: res[f"{name}@{k}"] for k in ks}


def check_ks(ks: Iterable[int]) -> tuple[int, ...]:
    """``ks`` (positive ints, or one) as a tuple; else InputError."""
    try:
        ks = (ks,) if isinstance(ks, (int, np.integer)) else tuple(ks)
    except TypeError:  # None, a float: not iterable
        raise InputError(f"ks must be positive integers, got {ks!r}") from None
    if not ks or any(isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k <= 0
                     for k in ks):
        raise InputError(f"ks must be positive integers, got {ks!r}")
    return tuple(int(k) for k in ks)
