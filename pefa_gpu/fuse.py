"""PEFA-XL fusion (DESIGN §1): the one core (:func:`fuse`) behind search, fuse, sweep, tune and
the pipeline, on torch tensors of any one device."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import numpy as np
import torch

from .arrays import as_tensor, resolve_device, to_numpy
from .relevance import Relevance
from .topk import merge_topk

Pair = tuple[torch.Tensor, torch.Tensor]  # (B, w) scores and ids


class RelevanceRows:
    """Y's rows for the votes, built where Y changes: ``tensors`` (model device) = (starts,
    lengths, indices int64, data float32), one empty row appended for the padding row -1;
    ``nonnegative``: every entry >= 0."""

    def __init__(self, relevance: Relevance, device: Any):
        csr = relevance.csr
        self.shape: tuple[int, int] = csr.shape
        indptr = np.asarray(csr.indptr, dtype=np.int64)
        host = (np.append(indptr[:-1], 0), np.append(np.diff(indptr), 0),
                np.asarray(csr.indices, dtype=np.int64), np.asarray(csr.data, dtype=np.float32))
        self.tensors = tuple(as_tensor(a, device=resolve_device(device)) for a in host)
        self.nonnegative = bool((host[3] >= 0).all())

    @functools.cached_property
    def keys(self) -> torch.Tensor:
        """(nnz,) int64 row * n + column of the entries, ascending."""
        starts, lengths, indices, _ = self.tensors
        return _repeat(torch.arange(lengths.numel(), device=indices.device), lengths,
                       indices.numel()) * self.shape[1] + indices

    def values(self, rows: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
        """Y[rows[b, i], docs[b, j]] for valid rows (B, k) and docs (B, K) -> (B, k, K) float32
        (0 without an entry)."""
        keys, data = self.keys, self.tensors[3]
        want = rows.unsqueeze(2) * self.shape[1] + docs.unsqueeze(1)
        if keys.numel() == 0:
            return torch.zeros(want.shape, device=want.device)
        pos = torch.searchsorted(keys, want.reshape(-1)).clamp_max(keys.numel() - 1)
        return torch.where(keys[pos] == want.reshape(-1), data[pos], 0.0).reshape(want.shape)


def _repeat(x: torch.Tensor, counts: torch.Tensor, total: int) -> torch.Tensor:
    return torch.repeat_interleave(x, counts, output_size=total)


def votes(knn_rows: torch.Tensor, rows: RelevanceRows) -> tuple[torch.Tensor, ...]:
    """knn_rows (B, K) Y rows (-1 padding) -> (slot, doc, y) per vote: slot b * K + rank
    ascending, the document and Y's value."""
    starts, lengths, indices, data = rows.tensors
    flat = knn_rows.reshape(-1)
    n_entries = lengths[flat]
    ends = n_entries.cumsum(0)
    total = int(ends[-1]) if len(ends) else 0
    pos = _repeat(starts[flat] - (ends - n_entries), n_entries, total) + \
        torch.arange(total, device=flat.device)
    slot = _repeat(torch.arange(len(flat), device=flat.device), n_entries, total)
    return slot, indices[pos], data[pos]


def rowdots(queries: torch.Tensor, docs: torch.Tensor, batch: torch.Tensor,
            doc: torch.Tensor) -> torch.Tensor:
    """<queries[batch[i]], docs[doc[i]]> for pairs grouped by query -> (N,) float32: the Triton
    kernel on CUDA, numpy's row sums per query on the CPU (faster than torch's gathers)."""
    if batch.is_cuda:
        from . import triton_rowdots  # noqa: PLC0415 (imports triton: only on CUDA)
        return triton_rowdots.rowdots(queries, docs, batch, doc)
    queries, docs, batch, doc = map(to_numpy, (queries, docs, batch, doc))
    step = max(1, (1 << 22) // max(1, docs.shape[1]))
    cuts = [0, len(batch)] if len(queries) == 1 else \
        [0, *(np.flatnonzero(batch[1:] != batch[:-1]) + 1).tolist(), len(batch)]
    parts = [np.multiply(docs[doc[s:min(s + step, hi)]], queries[batch[lo]]).sum(1, np.float32)
             for lo, hi in zip(cuts[:-1], cuts[1:]) for s in range(lo, hi, step)]
    return torch.from_numpy(np.concatenate([np.empty(0, np.float32), *parts]))


@dataclasses.dataclass
class CandidateTable:
    """ids (B, W) int64: C in columns < Kp, then the voted documents outside C, -1 where none
    (padding, a repeated id); erm (B, W) float32 f_erm; cells (U,): flat cell of each voted
    candidate, extra (U,): outside C; per vote: entry_cell (index into cells), entry_slot
    (b * K + rank), entry_score (s_i), entry_y; n_neighbours: K."""

    ids: torch.Tensor
    erm: torch.Tensor
    cells: torch.Tensor
    extra: torch.Tensor
    entry_cell: torch.Tensor
    entry_slot: torch.Tensor
    entry_score: torch.Tensor
    entry_y: torch.Tensor
    n_neighbours: int

    def knn_scores(self, k: int, divisor: float) -> Pair:
        """(U,) f_knn from the first ``k`` neighbours (float32, summed by rank) and (U,) dead:
        outside C and voted by none of them."""
        at, rank = self.entry_cell, self.entry_slot % max(self.n_neighbours, 1)
        # by the value, not times its reciprocal (as CUDA divides by a host scalar)
        vote = self.entry_score / torch.full((), divisor, device=at.device) * self.entry_y
        # CUDA: one round per rank (a candidate gets one vote a round, so atomics cannot
        # reorder); the CPU adds one after another, in rank order per candidate, in one round
        f = torch.zeros(len(self.cells), device=at.device)
        for r in range(min(k, self.n_neighbours)) if at.is_cuda else [-1]:
            f.index_add_(0, at, torch.where(rank == r if r >= 0 else rank < k, vote, 0.0))
        voted = torch.zeros_like(f).index_add_(0, at, (rank < k).float())
        return f, self.extra & (voted == 0)

    def topk(self, lam: float, knn: Pair, topk: int) -> Pair:
        """Top ``topk`` of lam f_erm + (1 - lam) f_knn (``knn`` from :meth:`knn_scores`):
        (B, topk) float32 scores, int64 ids, ties to the lower id, -1 / -inf padded."""
        f_knn, dead = knn
        fused = torch.where(self.ids >= 0, lam * self.erm, float("-inf"))
        flat = fused.reshape(-1)
        flat[self.cells] = torch.where(dead, float("-inf"), flat[self.cells] + (1.0 - lam) * f_knn)
        top, ids = merge_topk(fused + 0.0, self.ids, topk)
        return top, torch.where(top > float("-inf"), ids, -1)


def candidate_table(queries: torch.Tensor, docs: torch.Tensor, rows: RelevanceRows, erm: Pair,
                    knn: Pair, *, rescore: bool, erm_exact: bool) -> CandidateTable:
    """queries (B, d), docs (n, d), erm (B, Kp) passage scores / ids, knn (B, K) scores / Y
    rows (-1 padded). ``rescore``: f_erm = <q, p_j> for every candidate (``erm_exact``: the ERM
    scores are, so only the extras get dot products), else 0 outside C."""
    (es, ei), (ks, ki) = erm, knn
    b, kp = ei.shape
    n, kn, dev = rows.shape[1], ki.shape[1], ei.device
    slot, doc, y = votes(ki, rows)
    key, entry_cell = torch.unique((slot // kn) * (n + 1) + doc, return_inverse=True)
    u_row = key // (n + 1)
    ids, col = _columns_in_c(ei, key, n)
    extra = col < 0
    x = extra.nonzero().squeeze(1)
    x_row, x_doc = u_row[x], key[x] % (n + 1)
    # an extra's rank among its row's extras gives its column after C
    rank = torch.arange(len(x), device=dev) - torch.searchsorted(x_row, x_row)
    width = kp + (int(rank.max()) + 1 if len(x) else 0)
    col[x] = kp + rank
    cells = u_row * width + col
    table_ids = torch.full((b, width), -1, device=dev)
    table_ids[:, :kp] = ids
    table_ids.reshape(-1)[cells[x]] = x_doc
    table_erm = torch.zeros((b, width), device=dev)
    if rescore and not erm_exact:
        v = (table_ids >= 0).reshape(-1).nonzero().squeeze(1)
        table_erm.reshape(-1)[v] = rowdots(queries, docs, v // width, table_ids.reshape(-1)[v])
    else:
        table_erm[:, :kp] = torch.where(ids >= 0, es.float(), 0.0)
        if rescore and len(x):
            table_erm.reshape(-1)[cells[x]] = rowdots(queries, docs, x_row, x_doc)
    return CandidateTable(table_ids, table_erm, cells, extra, entry_cell, slot,
                          ks.float().reshape(-1)[slot], y, kn)


def _columns_in_c(ei: torch.Tensor, key: torch.Tensor, n: int) -> Pair:
    """ERM ids (B, Kp) and sorted keys b (n + 1) + doc (U,) -> ids with -1 at padding and at
    each repeat of an id after its first column, and (U,) each key's column in C (-1: none)."""
    b, kp = ei.shape
    valid = ei >= 0
    ids = torch.where(valid, ei, -1)
    if kp == 0:
        return ids, torch.full(key.shape, -1, device=key.device)
    # each row's ids packed above their column and sorted (padding last): repeats adjacent
    bits = max(1, (kp - 1).bit_length())
    packed = (torch.where(valid, ei, n) << bits) | torch.arange(kp, device=ei.device)
    small = np.int32 if ((n + 1) << bits) < 2**31 else np.int64  # (int32 sorts twice as fast)
    packed = torch.sort(packed, 1).values if packed.is_cuda else \
        torch.from_numpy(np.sort(packed.numpy().astype(small), 1)).long()  # numpy's: ~5x torch's
    s_id, s_col = packed >> bits, packed & ((1 << bits) - 1)
    r = ((s_id[:, 1:] == s_id[:, :-1]) & (s_id[:, 1:] < n)).reshape(-1).nonzero().squeeze(1)
    w = max(kp - 1, 1)
    ids[r // w, s_col[r // w, r % w + 1]] = -1  # a repeated id keeps its first column
    sorted_keys = (torch.arange(b, device=ei.device)[:, None] * (n + 1) + s_id).reshape(-1)
    at = torch.searchsorted(sorted_keys, key).clamp_max(b * kp - 1)
    return ids, torch.where(sorted_keys[at] == key, s_col.reshape(-1)[at], -1)


def fuse(queries: torch.Tensor, erm: Pair, knn: Pair, rows: RelevanceRows, docs: torch.Tensor,
         *, lams: Sequence[float], ks: Sequence[int], knn_norm: str, rescore: bool,
         erm_exact: bool, topk: int, batch_size: int | None = None
         ) -> dict[tuple[float, int], Pair]:
    """{(lam, k): ((B, topk) float32 scores, int64 ids)} for lams x ks (arguments as
    :func:`candidate_table`; the first k of ``knn`` vote with w(s) = s / k for ``knn_norm``
    "k", else s), per ``batch_size`` queries (default 256 on CUDA, 4096 on the CPU)."""
    n_queries = len(erm[1])
    step = batch_size or (256 if erm[1].is_cuda else 4096)
    parts: dict[tuple[float, int], list] = {(lam, k): [] for k in ks for lam in lams}
    for s in range(0, max(n_queries, 1), step):  # one empty batch without queries
        b = slice(s, s + step)
        table = candidate_table(queries[b], docs, rows, (erm[0][b], erm[1][b]),
                                (knn[0][b, :max(ks)], knn[1][b, :max(ks)]), rescore=rescore,
                                erm_exact=erm_exact)
        for k in ks:
            f_knn = table.knn_scores(k, float(k) if knn_norm == "k" else 1.0)
            for lam in lams:
                parts[(lam, k)].append(table.topk(lam, f_knn, topk))
    return {key: v[0] if len(v) == 1 else (torch.cat([x for x, _ in v]),
                                           torch.cat([y for _, y in v]))
            for key, v in parts.items()}


def neighbours(knn: Pair, erm: Pair, m: int, k: int, augment_docs: bool) -> Pair:
    """The query index's top-k ``knn`` (rows < m), with ``augment_docs`` merged with the
    passage top-k ``erm`` (document j as row m + j), ties to the lower row."""
    if not augment_docs:
        return knn
    ids = erm[1][:, :k]
    scores = torch.cat([knn[0], erm[0][:, :k]], 1)  # float32 (a lower precision is promoted)
    return merge_topk(scores, torch.cat([knn[1], torch.where(ids >= 0, ids + m, -1)], 1), k)


def searches(q: torch.Tensor, search: Any, *, kp: int, k: int, m: int, n: int,
             augment_docs: bool) -> tuple[Pair, Pair]:
    """PEFA-XL's two searches through ``search(q, w_erm, w_knn)`` (passage top-w_erm, query
    top-w_knn; a width may be 0) -> passages (B, >= kp) and :func:`neighbours` (B, <= k)."""
    kn = min(k, m + n if augment_docs else m)
    erm, knn = search(q, max(kp, min(kn, n)) if augment_docs else kp, min(kn, m))
    return erm, neighbours(knn, erm, m, kn, augment_docs)
