"""Encoder training helpers: differentiable model scores and hard-negative mining.

    negs = pg.mine_negatives(xs, q, positives, n=7)      # (B, 7) int64, no graph kept
    logits = xs.score(q, torch.cat([pos[:, None], negs], 1)) / tau   # (B, 8), differentiable
"""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

from .arrays import ArrayLike, as_tensor, check_topk
from .errors import InputError
from .params import check_flag, check_nonnegative, check_positive
from .protocol import Model, check_model
from .relevance import Relevance, as_relevance


def check_default(x: ArrayLike, check: bool | None) -> bool:
    """``check`` (a bool), by default True unless ``x`` is a CUDA tensor (a check would sync);
    else InputError ('no' was True, '' or [] False)."""
    if check is None:
        return not (isinstance(x, torch.Tensor) and x.is_cuda)
    return check_flag(check, "check", "True, False or None (the default)")


def as_ids(ids: ArrayLike, batch: int, n_docs: int, device: torch.device, check: bool,
           name: str = "ids") -> torch.Tensor:
    """Ids as a (B, K) int64 tensor on ``device`` ((B,): one column); with ``check``, ids
    outside [-1, n_docs) are an InputError naming ``name``."""
    i = as_tensor(ids, device=device, name=name)
    if i.ndim == 1:
        i = i.unsqueeze(1)
    if i.ndim != 2 or i.shape[0] != batch or i.is_floating_point():
        raise InputError(f"{name} must be integers of shape (B={batch}, K), -1 padded, got "
                         f"{i.dtype} shape {tuple(i.shape)}")
    if i.dtype == torch.uint64 and bool((i.view(torch.int64) < 0).any()):  # .long() wraps
        raise InputError(f"{name} hold ids beyond int64 ({i.dtype})")
    i = i.long()
    if check and i.numel() and (int(i.min()) < -1 or int(i.max()) >= n_docs):
        bad = i[(i < -1) | (i >= n_docs)][:5].tolist()
        raise InputError(f"{name} hold document ids out of range [0, {n_docs}) (-1 is "
                         f"padding): {bad}")
    return i


def inner(q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(B, d) queries, (B, K, d) rows -> (B, K) inner products in q's dtype."""
    return torch.bmm(rows.to(q.dtype), q.unsqueeze(2)).squeeze(2)


def as_positive_ids(positives: ArrayLike, batch: int, device: torch.device,
                    n_docs: int | None = None) -> torch.Tensor:
    """A (B x n) Relevance / scipy matrix (entries > 0), a list of id lists or a (B, P) -1 padded
    int array -> (B, P >= 1) int64 on ``device``, -1 padded; ids off [-1, n_docs): InputError."""
    if isinstance(positives, Relevance) or sp.issparse(positives):
        csr = as_relevance(positives, name="positives", allow_empty=True).csr
        graded = csr.data > 0  # a grade <= 0 (e.g. -1: judged not relevant) is no positive
        positives = [csr.indices[lo:hi][graded[lo:hi]]
                     for lo, hi in zip(csr.indptr[:-1].tolist(), csr.indptr[1:].tolist())]
    if isinstance(positives, (list, tuple)) and all(
            isinstance(r, (list, tuple, np.ndarray)) for r in positives):  # ragged rows
        rows = [_id_row(r, i) for i, r in enumerate(positives)]
        if len(rows) != batch:
            raise InputError(f"positives has {len(rows)} rows but there are {batch} queries")
        positives = np.full((batch, max([r.size for r in rows] + [1])), -1, dtype=np.int64)
        for r, cols in enumerate(rows):
            positives[r, :cols.size] = cols
    out = as_ids(positives, batch, n_docs or 0, device, n_docs is not None, "positives")
    # no ids ((B, 0); or (0, 2**40): torch sorts that in 8 TiB): one column of padding
    return out if out.numel() else torch.full((batch, 1), -1, dtype=torch.long, device=device)


def _id_row(row: Any, i: int) -> np.ndarray:
    """Row ``i`` of ragged positives as int64 ids; floats, strings, ids past int64: InputError."""
    try:
        a = np.asarray(row).ravel()
    except ValueError:  # a row holding a list ([0, [1]]): numpy's 'inhomogeneous shape'
        a = np.asarray(row, dtype=object).ravel()
    if a.size and (a.dtype.kind not in "iu" or a.dtype == np.uint64 and a.max() >= 2**63):
        raise InputError(f"positives row {i} must hold integer document ids, got {a.dtype} "
                         f"{a[:5].tolist()}")
    return a.astype(np.int64)


def mine_negatives(model: Model, queries: ArrayLike, positives: ArrayLike, n: int = 8,
                   skip_top: int = 0, batch_size: int = 1024, check: bool | None = None
                   ) -> torch.Tensor:
    """(B, n) int64 ids, best first, -1 where too few: per query (B, d) the best documents
    of ``model.search`` that are not its positives (:func:`as_positive_ids`), after skipping
    ``skip_top`` of them (likely false negatives); ``batch_size`` queries per search."""
    check_model(model, "mine_negatives", ("as_queries", "search", "n_docs", "device"))
    skip_top = check_nonnegative(skip_top, "skip_top")
    batch_size = check_positive(batch_size, "batch_size")
    chk = check_default(queries, check)
    q = model.as_queries(queries, check=chk)
    n = check_topk(n, model.n_docs, "n")
    skip_top = min(skip_top, model.n_docs)
    pos = as_positive_ids(positives, q.shape[0], model.device, model.n_docs if chk else None)
    pos = pos.sort(1).values  # -1 padding first; each id found by a binary search
    # positives per query, for each batch's search depth: one host sync, only for several batches
    counts = (pos >= 0).sum(1).cpu() if q.shape[0] > batch_size else None
    neg = torch.full((q.shape[0], n + 1), -1, dtype=torch.long, device=model.device)
    for s in range(0, q.shape[0], batch_size):
        p = pos[s:s + batch_size]
        # enough that n non-positives survive if they exist; never more than every document
        most = pos.shape[1] if counts is None else int(counts[s:s + batch_size].max())
        depth = min(n + skip_top + most, model.n_docs)
        _, ids = model.search(q[s:s + batch_size], topk=depth, check=False)
        ids = ids.contiguous()
        at = torch.searchsorted(p, ids).clamp_max(p.shape[1] - 1)
        keep = (ids >= 0) & (p.gather(1, at) != ids)
        rank = keep.long().cumsum(1) - 1 - skip_top
        take = keep & (rank >= 0) & (rank < n)  # column n: the rest, cut off below
        neg[s:s + batch_size].scatter_(1, torch.where(take, rank, n), torch.where(take, ids, -1))
    return neg[:, :n].contiguous()
