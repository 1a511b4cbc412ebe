"""PEFA-XL fusion (DESIGN §1), one core for numpy arrays (CPU batches) and torch tensors (CUDA):
the same float32 operations in the same order (equal bits on both)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import numpy as np
import torch

from .arrays import DeviceLike, as_tensor, resolve_device, to_numpy
from .params import check_positive
from .relevance import Relevance
from .topk import merge_topk

Array = Any  # a numpy array or a torch tensor (one kind per call)


def ops(x: Array) -> Any:
    """The array module of ``x``: numpy or torch (the calls here are spelled alike in both)."""
    return np if isinstance(x, np.ndarray) else torch


def _repeat(x: Array, counts: Array, total: int) -> Array:
    """x[i] repeated counts[i] times: (total,) with total = counts.sum()."""
    if isinstance(x, np.ndarray):
        return x.repeat(counts)
    return torch.repeat_interleave(x, counts, output_size=total)


def nonzero(mask: Array) -> Array:
    """Flat positions of the True entries of ``mask`` (int64)."""
    return ops(mask).where(mask.reshape(-1))[0]


class RelevanceRows:
    """Y's rows as ``tensors`` (model device) and ``host`` (numpy): (starts, lengths, indices
    int64, data float32), an empty row appended for the padding row -1."""

    def __init__(self, relevance: Relevance, device: DeviceLike):
        csr = relevance.csr
        self.shape: tuple[int, int] = csr.shape
        indptr = np.asarray(csr.indptr, dtype=np.int64)
        host = (np.append(indptr[:-1], 0), np.append(np.diff(indptr), 0),
                np.asarray(csr.indices, dtype=np.int64), np.asarray(csr.data, dtype=np.float32))
        self.tensors = tuple(as_tensor(a, device=resolve_device(device)) for a in host)
        self.nonnegative = bool((host[3] >= 0).all())

    @functools.cached_property
    def host(self) -> tuple[np.ndarray, ...]:
        return tuple(map(to_numpy, self.tensors))

    @functools.cached_property
    def keys(self) -> torch.Tensor:
        """(nnz,) int64 row * n + column of the entries, ascending."""
        starts, lengths, indices, _ = self.tensors
        rows = _repeat(torch.arange(lengths.numel(), device=indices.device), lengths,
                       indices.numel())
        return rows * self.shape[1] + indices

    def values(self, rows: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
        """Y[rows[b, i], docs[b, j]] of rows (B, k), docs (B, K) -> (B, k, K) float32."""
        keys, data = self.keys, self.tensors[3]
        want = rows.unsqueeze(2) * self.shape[1] + docs.unsqueeze(1)
        if keys.numel() == 0:
            return torch.zeros(want.shape, device=want.device)
        pos = torch.searchsorted(keys, want.reshape(-1)).clamp_max(keys.numel() - 1)
        return torch.where(keys[pos] == want.reshape(-1), data[pos], 0.0).reshape(want.shape)


def votes(knn_rows: Array, rows: RelevanceRows) -> tuple[Array, Array, Array]:
    """knn_rows (B, K) Y rows (-1 padding) -> per vote (slot b * K + rank ascending, doc, y)."""
    xp = ops(knn_rows)
    starts, lengths, indices, data = rows.host if xp is np else rows.tensors
    flat = knn_rows.reshape(-1)
    n_entries = lengths[flat]
    ends = n_entries.cumsum(0)
    total = int(ends[-1]) if len(ends) else 0
    at = xp.arange(total, device=flat.device)
    pos = _repeat(starts[flat] - (ends - n_entries), n_entries, total) + at
    slot = _repeat(xp.arange(len(flat), device=flat.device), n_entries, total)
    return slot, indices[pos], data[pos]


def rowdots(queries: Array, docs: Array, batch: Array, doc: Array) -> Array:
    """<queries[batch[i]], docs[doc[i]]> for pairs grouped by query -> (N,) float32: numpy's
    row sums (CPU tensors too: equal bits), on CUDA the Triton kernel."""
    if not isinstance(batch, np.ndarray):
        if batch.is_cuda:
            from . import triton_rowdots  # noqa: PLC0415 (imports triton: only on CUDA)
            return triton_rowdots.rowdots(queries, docs, batch, doc)
        return as_tensor(rowdots(*map(to_numpy, (queries, docs, batch, doc))))
    step = max(1, (1 << 22) // max(1, docs.shape[1]))
    cuts = [0, *(np.flatnonzero(batch[1:] != batch[:-1]) + 1).tolist(), len(batch)]
    parts = [np.multiply(docs[doc[s:min(s + step, hi)]], queries[batch[lo]]).sum(1, np.float32)
             for lo, hi in zip(cuts[:-1], cuts[1:]) for s in range(lo, hi, step)]
    return np.concatenate([np.empty(0, np.float32), *parts])


@dataclasses.dataclass
class CandidateTable:
    """ids (B, W): C in columns < Kp, then the voted documents outside C (-1: none); erm (B, W)
    f_erm; cells / extra (U,): each voted candidate's flat cell / outside C; per vote:
    entry_cell (into cells), entry_slot (b * K + rank), entry_score, entry_y; n_neighbours: K."""

    ids: Array
    erm: Array
    cells: Array
    extra: Array
    entry_cell: Array
    entry_slot: Array
    entry_score: Array
    entry_y: Array
    n_neighbours: int

    def knn_scores(self, k: int, divisor: float) -> tuple[Array, Array]:
        """(U,) f_knn from the first ``k`` neighbours (float32, summed by rank) and (U,) dead:
        outside C and voted by none of them."""
        at, rank = self.entry_cell, self.entry_slot % max(self.n_neighbours, 1)
        xp = ops(at)
        # by a float32 array: CUDA would multiply by a host scalar's reciprocal
        vote = self.entry_score / xp.asarray(divisor, dtype=xp.float32, device=at.device) \
            * self.entry_y
        if isinstance(at, np.ndarray):
            if k < self.n_neighbours:
                at, vote = at[rank < k], vote[rank < k]
            f = np.zeros(len(self.cells), np.float32)
            np.add.at(f, at, vote)  # in rank order per candidate
            dead = self.extra.copy()
            dead[at] = False
            return f, dead
        # one round per rank: a candidate gets one vote a round, so atomics cannot reorder
        f = torch.zeros(len(self.cells), device=at.device)
        for r in range(min(k, self.n_neighbours)):
            f.index_add_(0, at, torch.where(rank == r, vote, 0.0))
        voted = torch.zeros_like(f).index_add_(0, at, (rank < k).float())
        return f, self.extra & (voted == 0)

    def topk(self, lam: float, knn: tuple[Array, Array], topk: int) -> tuple[Array, Array]:
        """Top ``topk`` of lam f_erm + (1 - lam) f_knn (``knn`` from :meth:`knn_scores`):
        (B, topk) float32 scores, int64 ids, ties to the lower id, -1 / -inf padded."""
        f_knn, dead = knn
        xp = ops(self.ids)
        fused = xp.where(self.ids >= 0, lam * self.erm, float("-inf"))
        flat = fused.reshape(-1)
        flat[self.cells] = xp.where(dead, float("-inf"), flat[self.cells] + (1.0 - lam) * f_knn)
        return select_topk(fused, self.ids, topk)


def candidate_table(queries: Array, docs: Array, rows: RelevanceRows,
                    erm: tuple[Array, Array], knn: tuple[Array, Array], *,
                    rescore: bool, erm_exact: bool) -> CandidateTable:
    """queries (B, d), docs (n, d), erm (B, Kp) and knn (B, K) (scores, ids / Y rows). f_erm:
    <q, p_j> with ``rescore`` (computed for the extras only if ``erm_exact``), else 0 outside C."""
    (es, ei), (ks, ki) = erm, knn
    xp = ops(ei)
    b, kp = ei.shape
    n, kn = rows.shape[1], ki.shape[1]
    slot, doc, y = votes(ki, rows)
    key, entry_cell = xp.unique((slot // kn) * (n + 1) + doc, return_inverse=True)  # voted
    u_row = key // (n + 1)
    ids, col = _columns_in_c(ei, key, n)
    extra = col < 0
    x = nonzero(extra)
    x_row, x_doc = u_row[x], key[x] % (n + 1)
    # an extra's rank among its row's extras gives its column after C
    rank = xp.arange(len(x), device=ei.device) - xp.searchsorted(x_row, x_row)
    width = kp + (int(rank.max()) + 1 if len(x) else 0)
    col[x] = kp + rank
    cells = u_row * width + col
    table_ids = xp.full((b, width), -1, dtype=xp.int64, device=ei.device)
    table_ids[:, :kp] = ids
    table_ids.reshape(-1)[cells[x]] = x_doc
    table_erm = xp.full((b, width), 0.0, dtype=xp.float32, device=ei.device)
    table_erm[:, :kp] = xp.where(ids >= 0, es, 0.0)  # cast to float32 on assignment
    if rescore:  # <q, p_j> for the extras, or for every candidate unless the ERM's are exact
        v = cells[x] if erm_exact else nonzero(table_ids >= 0)
        table_erm.reshape(-1)[v] = rowdots(queries, docs, v // width, table_ids.reshape(-1)[v])
    return CandidateTable(table_ids, table_erm, cells, extra, entry_cell, slot,
                          xp.asarray(ks, dtype=xp.float32).reshape(-1)[slot], y, kn)


def _columns_in_c(ei: Array, key: Array, n: int) -> tuple[Array, Array]:
    """ERM ids (B, Kp) and sorted keys b (n + 1) + doc (U,) -> ids with -1 at padding and at
    each repeat of an id after its first column, and (U,) each key's column in C (-1: none)."""
    xp = ops(ei)
    b, kp = ei.shape
    valid = ei >= 0
    ids = xp.where(valid, ei, -1)
    if kp == 0:
        return ids, xp.full(key.shape, -1, dtype=xp.int64, device=key.device)
    # each row's ids packed above their column and sorted (padding last): repeats adjacent
    bits = max(1, (kp - 1).bit_length())
    packed = (xp.where(valid, ei, n) << bits) | xp.arange(kp, device=ei.device)
    if xp is np and ((n + 1) << bits) < 2**31:  # int32 sorts twice as fast
        packed = packed.astype(np.int32)
    packed = xp.asarray(np.sort(packed, 1) if xp is np else torch.sort(packed, 1).values,
                        dtype=xp.int64)
    s_id, s_col = packed >> bits, packed & ((1 << bits) - 1)
    r = nonzero((s_id[:, 1:] == s_id[:, :-1]) & (s_id[:, 1:] < n))
    w = max(kp - 1, 1)
    ids[r // w, s_col[r // w, r % w + 1]] = -1  # a repeated id keeps its first column
    sorted_keys = (xp.arange(b, device=ei.device)[:, None] * (n + 1) + s_id).reshape(-1)
    at = xp.searchsorted(sorted_keys, key).clip(max=b * kp - 1)
    return ids, xp.where(sorted_keys[at] == key, s_col.reshape(-1)[at], -1)


def select_topk(scores: Array, ids: Array, k: int) -> tuple[Array, Array]:
    """:func:`pefa_gpu.topk.merge_topk` of scores (B, W) float32, ids (B, W) int64 distinct per
    row -> (B, k) of their kind, id -1 at a -inf / NaN score, +0.0 for -0.0."""
    host = isinstance(scores, np.ndarray)
    if host:
        scores, ids = torch.from_numpy(scores), torch.from_numpy(ids)
    top, ids = merge_topk(scores + 0.0, ids, k)
    ids = torch.where(top > float("-inf"), ids, -1)
    return (top.numpy(), ids.numpy()) if host else (top, ids)


def fuse(queries: Array, erm: tuple[Array, Array], knn: tuple[Array, Array],
         rows: RelevanceRows, docs: Array, *, lams: Sequence[float], ks: Sequence[int],
         knn_norm: str, rescore: bool, erm_exact: bool, topk: int, batch_size: int | None = None
         ) -> dict[tuple[float, int], tuple[Array, Array]]:
    """{(lam, k): ((B, topk) float32 scores, int64 ids)} of ``erm``'s kind; the first k of
    ``knn`` vote with w(s) = s / k (``knn_norm`` "k") or s; batch_size: 4096 (:func:`batches`)."""
    xp, knn = ops(erm[1]), (knn[0][:, :max(ks)], knn[1][:, :max(ks)])
    parts: dict[tuple[float, int], list] = {(lam, k): [] for k in ks for lam in lams}
    step = 4096 if batch_size is None else check_positive(batch_size, "batch_size")
    for b in batches(knn[1], rows, step):
        table = candidate_table(queries[b], docs, rows, (erm[0][b], erm[1][b]),
                                (knn[0][b], knn[1][b]), rescore=rescore, erm_exact=erm_exact)
        for k in ks:
            f_knn = table.knn_scores(k, float(k) if knn_norm == "k" else 1.0)
            for lam in lams:
                parts[(lam, k)].append(table.topk(lam, f_knn, topk))
    return {key: v[0] if len(v) == 1 else tuple(map(xp.concatenate, zip(*v)))
            for key, v in parts.items()}


VOTES_PER_QUERY = 256  # a batch's table: at most batch_size * this many cells beyond C


def batches(knn_rows: Array, rows: RelevanceRows, step: int) -> list[slice]:
    """Ranges of <= ``step`` queries (or one) whose count times their widest vote count stays
    within ``step`` * VOTES_PER_QUERY: a long row of Y narrows only its batch."""
    lengths = rows.host[1] if isinstance(knn_rows, np.ndarray) else rows.tensors[1]
    counts, cap = to_numpy(lengths[knn_rows].sum(1)), step * VOTES_PER_QUERY
    if not len(counts) or min(step, len(counts)) * int(counts.max()) <= cap:  # no long row
        return [slice(s, s + step) for s in range(0, max(len(counts), 1), step)]
    out, start, widest = [], 0, 0
    for i, c in enumerate(counts.tolist()):
        widest = max(widest, c)
        if i > start and (i - start == step or (i + 1 - start) * widest > cap):
            out.append(slice(start, i))
            start, widest = i, c
    return [*out, slice(start, len(counts))]


def neighbours(knn: tuple[Array, Array], erm: tuple[Array, Array], m: int, k: int,
               augment_docs: bool) -> tuple[Array, Array]:
    """The query index's top-k ``knn`` (rows < m), with ``augment_docs`` merged with the
    passage top-k ``erm`` (document j as row m + j), ties to the lower row."""
    if not augment_docs:
        return knn
    xp, ids = ops(knn[1]), erm[1][:, :k]
    scores = xp.concatenate([knn[0], erm[0][:, :k]], 1)  # float32 (a lower precision is promoted)
    rows = xp.concatenate([knn[1], xp.where(ids >= 0, ids + m, -1)], 1)
    return select_topk(scores, rows, k)


def searches(q: Array, search: Any, *, kp: int, k: int, m: int, n: int, augment_docs: bool
             ) -> tuple[tuple[Array, Array], tuple[Array, Array]]:
    """PEFA-XL's two searches via ``search(q, w_erm, w_knn)`` (a width may be 0) -> passages
    (B, >= kp) and :func:`neighbours` (B, <= k)."""
    kn = min(k, m + n if augment_docs else m)
    erm, knn = search(q, max(kp, min(kn, n)) if augment_docs else kp, min(kn, m))
    return erm, neighbours(knn, erm, m, kn, augment_docs)
