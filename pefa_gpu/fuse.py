"""PEFA-XL score fusion, batched on the device.

For a batch of B queries, given the ERM candidates C (top-Kp of the passage index) and the k
nearest training queries N (top-k of the query index), the fused score of a candidate document
j is ``lam * f_erm(q, j) + (1 - lam) * sum_{i in N} w(s_i) Y[i, j]``. The candidates are the
union of C and the documents of the neighbours' Y rows. Work and memory are
O(B * (Kp + k * deg)); no B x n array is ever formed.
"""

from __future__ import annotations

import torch

from .errors import InputError
from .fuse_kernels import _rowdots, fused_topk, neighbour_entries
from .topk import topk_rows


def fuse_scores(queries: torch.Tensor, doc_vectors: torch.Tensor,
                y_indptr: torch.Tensor, y_indices: torch.Tensor, y_data: torch.Tensor,
                erm_scores: torch.Tensor, erm_ids: torch.Tensor,
                knn_scores: torch.Tensor, knn_ids: torch.Tensor, *,
                lam: float, knn_weight_divisor: float, rescore: bool,
                topk: int, erm_exact: bool = False,
                kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Fused top-``topk`` of each query. All tensors on one device.

    queries (B, d) float32; doc_vectors (n, d) the document embeddings (n sizes the keys,
    ``rescore`` reads the rows); Y as CSR tensors (indptr (m+1,), indices (nnz,) int64,
    data (nnz,) float32) over the neighbour rows;
    erm_* (B, Kp) passage-search results and knn_* (B, k) neighbours (PEFAXL.neighbours: rows
    of Y), -1 padded. A neighbour of score s
    contributes ``s / knn_weight_divisor`` times its Y row. ``rescore``: f_erm = <q, p_j> for
    every candidate; otherwise the ERM score where j is in C and 0 elsewhere. ``erm_exact``:
    the erm scores already are <q, p_j> (exact or flat-storage backends), so ``rescore``
    computes dot products only for the candidates outside C (O(B k deg d), not O(B Kp d)).
    Returns (B, topk) float32 scores and int64 ids, ties to the lower id, -1 padded.
    ``kernel``: 'auto' runs :func:`pefa_gpu.fuse_kernels.fused_topk` (same ids, no sort over
    the ERM candidates), which hands back to the general sort-based path below when an ERM row
    repeats an id; 'general' forces that path.
    """
    if kernel == "auto":
        fast = fused_topk(queries, doc_vectors, y_indptr, y_indices, y_data, erm_scores,
                          erm_ids, knn_scores, knn_ids, lam=lam,
                          knn_weight_divisor=knn_weight_divisor, rescore=rescore, topk=topk,
                          erm_exact=erm_exact)
        if fast is not None:
            return fast
    elif kernel != "general":
        raise InputError(f"kernel must be 'auto' or 'general', got {kernel!r}")
    device = erm_ids.device
    b = erm_ids.shape[0]
    n_docs = doc_vectors.shape[0]
    n_key = max(int(n_docs), 1)

    # neighbours' Y rows, flattened: one entry per (query, neighbour, document)
    owner, pos = neighbour_entries(knn_ids, y_indptr)
    knn_batch = owner // knn_ids.shape[1]
    knn_doc = y_indices[pos]
    knn_val = (knn_scores.flatten()[owner].float() / knn_weight_divisor) * y_data[pos]

    # ERM candidates
    erm_valid = erm_ids >= 0
    erm_batch = torch.arange(b, device=device).unsqueeze(1).expand_as(erm_ids)[erm_valid]
    erm_doc = erm_ids[erm_valid]
    erm_val = erm_scores[erm_valid].float()

    keys = torch.cat([knn_batch * n_key + knn_doc, erm_batch * n_key + erm_doc])
    uniq, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    n_knn = knn_doc.numel()
    f_knn = torch.zeros(uniq.numel(), device=device).index_add_(0, inverse[:n_knn], knn_val)
    cand_batch, cand_doc = uniq // n_key, uniq % n_key
    if rescore and not erm_exact:
        f_erm = _rowdots(queries, doc_vectors, cand_batch, cand_doc)
    else:
        f_erm = torch.zeros(uniq.numel(), device=device).index_put_(
            (inverse[n_knn:],), erm_val)
        if rescore:  # only the kNN-only candidates lack their exact ERM score
            in_c = torch.zeros(uniq.numel(), dtype=torch.bool, device=device)
            rest = (~in_c.index_fill_(0, inverse[n_knn:], True)).nonzero().squeeze(1)
            f_erm[rest] = _rowdots(queries, doc_vectors, cand_batch[rest], cand_doc[rest])
    fused = lam * f_erm + (1.0 - lam) * f_knn

    # per-query top-k over variable-length segments (keys sorted => docs ascending per query)
    counts = torch.bincount(cand_batch, minlength=b)
    seg_start = torch.cumsum(counts, 0) - counts
    col = torch.arange(uniq.numel(), device=device) - seg_start[cand_batch]
    width = max(int(counts.max()) if b else 0, 1)
    table = torch.full((b, width), float("-inf"), device=device)
    table[cand_batch, col] = fused
    doc_table = torch.full((b, width), -1, dtype=torch.long, device=device)
    doc_table[cand_batch, col] = cand_doc
    scores, cols = topk_rows(table, topk)
    ids = torch.where(cols >= 0, doc_table.gather(1, cols.clamp_min(0)), -1)
    scores = torch.where(ids >= 0, scores, float("-inf"))
    return scores, ids
