"""Live updates: add documents and (query, document) pairs to a fitted model without a refit.

With the exact backend the model after any sequence of updates holds the same arrays (to the
bit on the CPU) as a model fitted from scratch on all the data, in this order: documents in the
order they were added (first ``fit``'s, then each ``add_documents``), training queries in the
order they were added (``fit``'s, then each ``add_pairs``), so search results are equal.

What each update costs and re-indexes:

- ``ERM.add_documents(P_new)``: appends r rows to the index (``Index.add``).
- ``PEFAXS.add_documents(P_new)``: appends r rows e_j = lam p_j + (1 - lam) Π(p_j) (or lam p_j
  without ``augment_docs``) to the index and to ``doc_sums``.
- ``PEFAXS.add_pairs(Q_new, Y_new)``: adds the new pairs to the unnormalised ``doc_sums`` of the
  t documents they touch (O(nnz d)), re-normalises those t rows and overwrites them in the index
  (``Index.update``, O(t d) for exact). Backends without ``update`` (the faiss ANN ones)
  are rebuilt from all n rows: a full index build.
- ``PEFAXL.add_documents(P_new)``: appends to the passage index; Y gains r columns (and, with
  ``augment_docs``, r identity rows): O(nnz) on the host.
- ``PEFAXL.add_pairs(Q_new, Y_new)``: appends to the query index (which holds the training
  queries only: documents are found as neighbours through the passage index) and rebuilds Y on
  the host, O(nnz).

Each model appends in its own way (its ``_append_documents`` / ``_append_pairs``); this module
holds the sparse update of the PIFA sums that PEFA-XS and NUDGE share (:func:`accumulate_pairs`).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch

from .arrays import as_tensor


def accumulate_pairs(sums: torch.Tensor, Y: sp.spmatrix, Q: torch.Tensor) -> torch.Tensor:
    """sums[j] += Y[i, j] * Q[i] for every entry of Y, in place, pair by pair in ascending i for
    each document, in float32: the order and rounding of scipy's sparse product that ``fit``
    uses on the CPU, so that updating equals refitting to the bit there. sums (n, d) float32,
    Y (m x n) scipy sparse, Q (m, d). Returns the touched document ids (t,) int64, ascending."""
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

