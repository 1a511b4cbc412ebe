"""Live updates (``add_documents``, ``add_pairs``): with the exact backend a model after any
updates holds the arrays of a refit on all the data in the order added (to the bit on the CPU).

Costs: ERM / PEFA-XS / NUDGE ``add_documents`` append r index rows; PEFA-XS / NUDGE
``add_pairs`` add to the ``doc_sums`` of the t documents touched (O(nnz d)) and rewrite those
rows (``Index.update``; backends without it are rebuilt); PEFA-XL appends to its indices and
rebuilds Y on the host (O(nnz)).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch

from .arrays import as_tensor


def accumulate_pairs(sums: torch.Tensor, Y: sp.spmatrix, Q: torch.Tensor) -> torch.Tensor:
    """sums (n, d) float32 [j] += Y[i, j] Q[i] in place for Y (m x n) scipy sparse, Q (m, d),
    in ascending i per document (fit's rounding on the CPU) -> touched ids (t,) int64, sorted."""
    yc = sp.csc_matrix(Y, dtype=np.float32)
    yc.sort_indices()
    counts = np.diff(yc.indptr)
    touched = np.flatnonzero(counts)
    if touched.size == 0:
        return as_tensor(np.empty(0, dtype=np.int64), device=sums.device)
    col = np.repeat(np.arange(yc.shape[1]), counts)
    rank = np.arange(yc.nnz) - yc.indptr[col]       # the t-th pair of its document
    order = np.argsort(rank, kind="stable")
    bounds = np.searchsorted(rank[order], np.arange(int(counts.max()) + 1))
    rows = as_tensor(yc.indices[order].astype(np.int64), device=sums.device)
    docs = as_tensor(col[order].astype(np.int64), device=sums.device)
    vals = as_tensor(yc.data[order], device=sums.device, dtype=torch.float32)
    for t in range(len(bounds) - 1):               # one round per rank: documents distinct
        sl = slice(int(bounds[t]), int(bounds[t + 1]))
        d = docs[sl]
        sums[d] = sums[d] + vals[sl].unsqueeze(1) * Q[rows[sl]].float()
    return as_tensor(touched.astype(np.int64), device=sums.device)

