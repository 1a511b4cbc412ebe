"""Row-wise top-k with a fixed tie rule: equal scores go to the lower id.

All functions work on (B, N) float32 tensors on any device, with no host synchronisation.
Padding is id -1 with score -inf.
"""

from __future__ import annotations

import torch

PAD_ID = -1
PAD_SCORE = float("-inf")


def topk_rows(scores: torch.Tensor, k: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of each row of ``scores`` (B, N); ids are column + ``offset``.

    Returns (B, k) float32 scores sorted descending and int64 ids; where several columns tie
    at the k-th score, the lowest columns are kept, and equal scores are listed by ascending id.
    Rows with N < k are padded with (-inf, -1).
    """
    b, n = scores.shape
    kk = min(k, n)
    if kk == 0:
        return _pad(scores.new_empty(b, 0), scores.new_empty(b, 0, dtype=torch.long), k)
    vals, _ = torch.topk(scores, kk, dim=1, sorted=True)
    kth = vals[:, -1:]
    above = scores > kth
    equal = scores == kth
    need = kk - above.sum(dim=1, keepdim=True)
    take = above | (equal & (equal.cumsum(dim=1) <= need))
    # exactly kk columns per row are taken; pick them in ascending column order
    col = torch.arange(n, 0, -1, device=scores.device, dtype=torch.long)
    key = torch.where(take, col, torch.zeros((), dtype=torch.long, device=scores.device))
    _, idx = torch.topk(key, kk, dim=1, sorted=True)
    vals = scores.gather(1, idx)
    order = torch.argsort(vals, dim=1, descending=True, stable=True)
    vals = vals.gather(1, order)
    ids = idx.gather(1, order) + offset
    return _pad(vals, ids, k)


def merge_topk(vals: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Best k of candidate lists (B, C) that may come from several sources, ties to lower id.

    Duplicate ids in a row are not removed; padding (-1) sorts last.
    """
    big = torch.iinfo(torch.long).max
    id_key = torch.where(ids < 0, torch.full_like(ids, big), ids)
    o = torch.argsort(id_key, dim=1, stable=True)
    vals, ids = vals.gather(1, o), ids.gather(1, o)
    o = torch.argsort(vals, dim=1, descending=True, stable=True)[:, :k]
    return _pad(vals.gather(1, o), ids.gather(1, o), k)


def _pad(vals: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    short = k - vals.shape[1]
    if short <= 0:
        return vals, ids
    b = vals.shape[0]
    vals = torch.cat([vals, vals.new_full((b, short), PAD_SCORE)], dim=1)
    ids = torch.cat([ids, ids.new_full((b, short), PAD_ID)], dim=1)
    return vals, ids
