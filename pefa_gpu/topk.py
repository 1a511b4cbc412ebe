"""Row-wise top-k with one tie rule: equal scores go to the lower id, also at the k-th place
(-0.0 equals +0.0; NaN ranks above every number; padding (-inf, -1) after every real id). On
CUDA the tie passes run on every row under a mask (no host synchronisation)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .params import check_nonnegative

PAD_ID = -1
PAD_SCORE = float("-inf")

# tie passes: every row under a mask (True) or the tied rows picked on the host (False);
# None: masks on CUDA only (tests set True to run the CUDA strategy on CPU tensors)
MASKED: bool | None = None


def topk_rows(scores: torch.Tensor, k: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``scores`` (B, N) float -> (B, k) scores sorted descending and int64 ids (column +
    ``offset``) with the tie rule, padded with (-inf, -1) when N < k."""
    return merge_topk(scores, None, k, offset)


def topk_wide(scores: torch.Tensor, w: int, group: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(scores, w, dim=1, sorted=False)`` of (B, c) scores, for wide rows within the
    best w groups of ``group`` columns (default :func:`group_size`) by their maxima: the same w
    scores; only ids of scores tied at the w-th place may differ."""
    b, c = scores.shape
    g = group or group_size(c, w, scores.is_cuda)
    if not g or c // g < w:
        return torch.topk(scores, min(w, c), dim=1, sorted=False)
    main = c - c % g
    best = scores[:, :main].unflatten(1, (main // g, g)).amax(2)
    groups = torch.topk(best, w, dim=1, sorted=False).indices
    cols = (groups.unsqueeze(2) * g + torch.arange(g, device=scores.device)).reshape(b, -1)
    if main < c:  # the last c % g columns are always candidates
        cols = torch.cat([cols, torch.arange(main, c, device=scores.device).expand(b, -1)], 1)
    v, pos = torch.topk(scores.gather(1, cols), w, dim=1, sorted=False)
    return v, cols.gather(1, pos)


def group_size(c: int, w: int, cuda: bool) -> int:
    """:func:`topk_wide`'s columns a group for rows of c scores and w kept: at most 256, about
    c / 12w on CUDA and c / 48w on the CPU (each the faster by measurement); 0 (one
    torch.topk) under 64."""
    g = min(256, c // ((12 if cuda else 48) * max(w, 1)))
    return g if g >= 64 else 0


def merge_topk(vals: torch.Tensor, ids: torch.Tensor | None, k: int, offset: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Best k of candidates ``vals`` (B, C) float / ``ids`` (B, C) int64 (any order; repeats
    kept; None: the columns + ``offset``) -> (B, k) with the tie rule (-1 last), padded with
    (-inf, -1) when C < k."""
    k = check_nonnegative(k, "k")  # k > C is padding (a sweep's last block is narrower)
    b, w = vals.shape
    kk = min(k, w)
    if kk == 0 or b == 0:
        return pad_topk(vals.new_empty(b, 0), vals.new_empty(b, 0, dtype=torch.long), k)
    top, cols = _select(vals, kk, None if ids is None else _id_key(ids))
    return pad_topk(*order_ties(top, cols + offset if ids is None else ids.gather(1, cols)), k)


def merge_lists(parts: Sequence[tuple[torch.Tensor, torch.Tensor] | None], k: int,
                as_is: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_topk` of (scores, ids) (B, w_i) on one device (None skipped), scores as
    float32; ``as_is``: a lone list at least k wide is only cut to k (its ties kept: HNSW's)."""
    parts = [(p[0].float(), p[1]) for p in parts if p is not None]
    if as_is and len(parts) == 1 and parts[0][1].shape[1] >= k:
        return parts[0][0][:, :k], parts[0][1][:, :k]
    return merge_topk(torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1), k)


def order_ties(vals: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, w) scores sorted descending and int64 ids -> contiguous lists with each run of equal
    scores in ascending id order (-1 last)."""
    if vals.numel() and vals.shape[1] > 1:
        same = _same(vals[:, 1:], vals[:, :-1])
        vals, ids = _redo_rows(same.any(1), _order_runs, (vals, ids), vals, ids, same)
    return vals.contiguous(), ids.contiguous()


def boundary_tied(vals: torch.Tensor, k: int) -> torch.Tensor:
    """(B,) bool: rows of ``vals`` (B, > k), sorted descending, whose k-th and (k+1)-th values
    are equal."""
    return _same(vals[:, k - 1], vals[:, k])


def pad_topk(vals: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, w) lists -> (B, max(w, k)): columns w .. k-1 filled with (-inf, -1)."""
    short = k - vals.shape[1]
    if short <= 0:
        return vals, ids
    return F.pad(vals, (0, short), value=PAD_SCORE), F.pad(ids, (0, short), value=PAD_ID)


def _select(table: torch.Tensor, kk: int,
            keys: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, kk) best values of ``table`` (B, W) sorted descending and their columns; of those
    equal to the kk-th, the lowest ``keys`` (None: columns) are kept."""
    if kk >= table.shape[1]:
        return torch.topk(table, kk, dim=1)
    vals, cols = torch.topk(table, kk + 1, dim=1)
    tied = boundary_tied(vals, kk)
    vals, cols = vals[:, :kk], cols[:, :kk]
    return _redo_rows(tied, _lowest_equal, (vals, cols), table, vals, cols, keys)


def _redo_rows(redo: torch.Tensor, fn: Callable[..., tuple], old: tuple,
               *args: torch.Tensor | None) -> tuple:
    """``old`` tensors (B, ...) with the rows where ``redo`` (B,) bool replaced by those of
    ``fn(*args)``: computed on every row under a mask (see ``MASKED``), or on the picked rows
    of ``args`` only."""
    if old[0].is_cuda if MASKED is None else MASKED:
        return tuple(torch.where(redo.unsqueeze(1), n, o) for n, o in zip(fn(*args), old))
    rows = redo.nonzero().squeeze(1)
    if rows.numel() == 0:
        return old
    new = fn(*(None if a is None else a[rows] for a in args))
    return tuple(o.index_copy(0, rows, n) for o, n in zip(old, new))


def _lowest_equal(table: torch.Tensor, vals: torch.Tensor, cols: torch.Tensor,
                  keys: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(vals, cols) (R, kk), a top-kk of ``table`` (R, W), with the entries equal to the kk-th
    value replaced by the columns holding it with the lowest ``keys`` (None: columns)."""
    w, kk = table.shape[1], vals.shape[1]
    kth = vals[:, -1:]
    eq = _same(table, kth)
    if keys is None:
        rank_dtype = torch.int32 if w < 2**31 else torch.long
        key = torch.where(eq, torch.arange(w, 0, -1, device=table.device, dtype=rank_dtype), 0)
    else:
        key = torch.where(eq, -keys, torch.iinfo(torch.long).min)
    low = torch.topk(key, kk, dim=1).indices  # the columns holding the kk-th value, lowest first
    above = (~_same(vals, kth)).sum(1, keepdim=True)  # sorted: entries above it come first
    j = torch.arange(kk, device=table.device).unsqueeze(0)
    new_c = torch.where(j < above, cols, low.gather(1, (j - above).clamp_min(0)))
    return table.gather(1, new_c), new_c


def _order_runs(vals: torch.Tensor, ids: torch.Tensor,
                same: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort (R, w) lists by (run of equal values, id); ``same`` (R, w-1) marks a value equal to
    the one before it (runs by ==: CUDA's radix sorts put -0.0 before +0.0)."""
    run = F.pad((~same).long().cumsum(1), (1, 0))  # each entry's run number, from 0
    o = torch.argsort(_id_key(ids), dim=1, stable=True)
    o = o.gather(1, torch.argsort(run.gather(1, o), dim=1, stable=True))
    return vals.gather(1, o), ids.gather(1, o)


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a == b, with NaN equal to NaN (and -0.0 to +0.0, as == has it)."""
    return (a == b) | (a.isnan() & b.isnan())


def _id_key(ids: torch.Tensor) -> torch.Tensor:
    """ids, with the padding id -1 after every real id."""
    return torch.where(ids < 0, torch.iinfo(torch.long).max, ids)
