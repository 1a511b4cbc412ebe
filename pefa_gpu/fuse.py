"""PEFA-XL fusion: the one core (:func:`fuse`) behind search, fuse, sweep, tune and the
pipeline's shard servers, and Y's lookups for score.

For queries with ERM candidates C (a passage search, (B, Kp)) and neighbours N (rows of Y,
(B, K), :func:`neighbours`), the fused score of a document j is ``lam f_erm(q, j) + (1 - lam)
sum_{i in N} w(s_i) Y[i, j]``, w(s) = s / divisor, over C ∪ {documents in the neighbours' Y
rows} (DESIGN §1). Per batch: :func:`candidate_table` once (the ERM candidates, a repeated id
keeping its first entry, then the voted documents outside C, each with f_erm: the ERM score,
<q, p_j> where ``rescore`` needs it, 0 outside C without; never a B x n array),
:meth:`CandidateTable.knn_scores` once per k (votes summed in neighbour order), and
:meth:`CandidateTable.topk` once per (lam, k) (ties to the lower id, -1 / -inf padding).

Each step is written once against operations numpy and torch both provide (:class:`_Numpy`,
:class:`_Torch`): CPU batches run on numpy (an operation costs about a microsecond against
torch's five to ten, and torch's CPU sorts are far slower), CUDA batches on torch. Both make
the same float32 operations in the same order (votes summed without atomics; divisions by a
value, never by its reciprocal), so from equal inputs their results are equal to the bit, run
after run. The inputs differ in the last bits between devices where a dot product is summed in
another order (the CUDA re-scoring, the ERM search's GEMM).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import numpy as np
import torch

from .arrays import as_tensor, resolve_device, to_numpy
from .relevance import Relevance
from .topk import merge_topk

Array = Any  # a numpy array or a torch tensor (one kind per call)


class _Numpy:
    """The array operations of the fusion on numpy arrays (methods and plain indexing where
    numpy's functions cost more on small arrays)."""

    float32, int32, int64 = np.float32, np.int32, np.int64
    cat, where = staticmethod(np.concatenate), staticmethod(np.where)
    arange = staticmethod(lambda n, like: np.arange(n, dtype=np.int64))
    repeat = staticmethod(lambda x, counts, total: x.repeat(counts))
    searchsorted = staticmethod(lambda sorted_x, v: sorted_x.searchsorted(v))
    take_along = staticmethod(lambda x, i: x[np.arange(len(i))[:, None], i])  # per row
    cumsum = staticmethod(lambda x: x.cumsum())
    flatnonzero = staticmethod(lambda mask: mask.reshape(-1).nonzero()[0])
    clip_max = staticmethod(np.minimum)
    divide = staticmethod(np.divide)
    argsort_desc = staticmethod(lambda x: np.argsort(-x, axis=1, kind="stable"))
    astype = staticmethod(lambda x, dtype: x.astype(dtype))
    # int32 where the values fit: twice as fast
    sort_rows = staticmethod(lambda x, fits_int32: np.sort(x.astype(np.int32) if fits_int32
                                                           else x, axis=1))

    @staticmethod
    def full(shape: tuple, value: Any, dtype: Any, like: Any) -> np.ndarray:
        out = np.empty(shape, dtype)  # np.full's Python wrapper costs twice this
        out.fill(value)
        return out

    @staticmethod
    def unique(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sorted distinct values and the inverse map (np.unique's, in fewer numpy calls)."""
        s = np.sort(x)
        first = np.empty(len(s), bool)
        first[:1] = True
        np.not_equal(s[1:], s[:-1], out=first[1:])
        u = s[first]
        return u, u.searchsorted(x)


class _Torch:
    """The same operations on torch tensors (any device)."""

    float32, int32, int64 = torch.float32, torch.int32, torch.int64
    cat, where = staticmethod(torch.cat), staticmethod(torch.where)
    arange = staticmethod(lambda n, like: torch.arange(n, device=like.device))
    # ``total`` = counts.sum(): no host sync to find it
    repeat = staticmethod(lambda x, counts, total: torch.repeat_interleave(x, counts,
                                                                           output_size=total))
    searchsorted = staticmethod(torch.searchsorted)
    take_along = staticmethod(lambda x, i: torch.gather(x, 1, i))
    cumsum = staticmethod(lambda x: torch.cumsum(x, 0))
    flatnonzero = staticmethod(lambda mask: mask.reshape(-1).nonzero().squeeze(1))
    clip_max = staticmethod(torch.clamp_max)
    argsort_desc = staticmethod(lambda x: torch.argsort(x, dim=1, descending=True, stable=True))
    astype = staticmethod(lambda x, dtype: x.to(dtype))
    sort_rows = staticmethod(lambda x, fits_int32: torch.sort(x, dim=1).values)
    full = staticmethod(lambda shape, value, dtype, like: torch.full(shape, value, dtype=dtype,
                                                                     device=like.device))
    unique = staticmethod(lambda x: torch.unique(x, sorted=True, return_inverse=True))

    @staticmethod
    def divide(x: torch.Tensor, value: float) -> torch.Tensor:
        """x / value in x's dtype (CUDA divides by a host scalar as x times its reciprocal,
        which may differ in the last bit)."""
        return x / torch.full((), value, dtype=x.dtype, device=x.device)


def ops(x: Array) -> type[_Numpy] | type[_Torch]:
    """The operations for ``x``'s kind of array."""
    return _Numpy if isinstance(x, np.ndarray) else _Torch


class RelevanceRows:
    """Y's derived state, built once where Y changes: the rows the neighbours vote with.

    ``tensors`` (on the model's device) and ``host`` (numpy; on a CPU device the same memory):
    (starts, lengths, indices, data) of the CSR rows, with one empty row appended so that the
    padding row id -1 reads length 0; ``keys``: the sorted int64 keys row * n + column of the
    entries (see :meth:`values`); ``nonnegative``: every entry is >= 0.
    """

    def __init__(self, relevance: Relevance, device: Any):
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

    def arrays(self, like: Array) -> tuple[Array, ...]:
        """(starts, lengths, indices, data) of ``like``'s kind."""
        return self.host if isinstance(like, np.ndarray) else self.tensors

    @functools.cached_property
    def keys(self) -> torch.Tensor:
        starts, lengths, indices, _ = self.tensors
        rows = torch.repeat_interleave(torch.arange(lengths.numel(), device=indices.device),
                                       lengths, output_size=indices.numel())
        return rows * self.shape[1] + indices

    def values(self, rows: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
        """Y[rows[b, i], docs[b, j]] for rows (B, k) and docs (B, K), valid ids -> (B, k, K)
        float32 (0 where Y has no entry). No host synchronisation."""
        keys, data = self.keys, self.tensors[3]
        want = rows.unsqueeze(2) * self.shape[1] + docs.unsqueeze(1)
        if keys.numel() == 0:
            return torch.zeros(want.shape, device=want.device)
        pos = torch.searchsorted(keys, want.reshape(-1)).clamp_max(keys.numel() - 1)
        return torch.where(keys[pos] == want.reshape(-1), data[pos], 0.0).reshape(want.shape)


def votes(knn_rows: Array, rows: RelevanceRows) -> tuple[Array, Array, Array]:
    """The neighbours' Y entries, one per (query, neighbour, document): knn_rows (B, K) Y row
    ids (-1 = padding) -> (slot, doc, y): slot b * K + r of the neighbour (ascending), the
    document and its Y value."""
    xp = ops(knn_rows)
    starts, lengths, indices, data = rows.arrays(knn_rows)
    flat = knn_rows.reshape(-1)
    n_entries = lengths[flat]
    ends = xp.cumsum(n_entries)
    total = int(ends[-1]) if len(ends) else 0
    pos = xp.repeat(starts[flat] - (ends - n_entries), n_entries, total) + \
        xp.arange(total, knn_rows)
    slot = xp.repeat(xp.arange(len(n_entries), knn_rows), n_entries, total)
    return slot, indices[pos], data[pos]


def rowdots(queries: Array, docs: Array, batch: Array, doc: Array) -> Array:
    """<queries[batch[i]], docs[doc[i]]> for flat pairs grouped by query -> (N,) float32.
    numpy: products, then numpy's row sum (its order within a row does not depend on how many
    rows share the call), about 16 MB of rows at a time; CUDA:
    :func:`pefa_gpu.triton_rowdots.rowdots` (the Triton kernel, or torch where it cannot run);
    torch on the CPU: the numpy sums, so that both kinds agree to the bit."""
    if not isinstance(batch, np.ndarray):
        if batch.is_cuda:
            from . import triton_rowdots  # noqa: PLC0415 (imports triton: only on CUDA)
            return triton_rowdots.rowdots(queries, docs, batch, doc)
        return as_tensor(rowdots(*map(to_numpy, (queries, docs, batch, doc))))
    step = max(1, (1 << 22) // max(1, docs.shape[1]))
    cuts = [0, len(batch)] if len(queries) == 1 else \
        [0, *((batch[1:] != batch[:-1]).nonzero()[0] + 1).tolist(), len(batch)]
    parts = [np.multiply(docs[doc[s:min(s + step, hi)]], queries[batch[lo]]).sum(1, np.float32)
             for lo, hi in zip(cuts[:-1], cuts[1:])
             for s in range(lo, hi, step)]  # a query's row broadcast over its run
    return parts[0] if len(parts) == 1 else np.concatenate([np.empty(0, np.float32), *parts])


@dataclasses.dataclass
class CandidateTable:
    """A batch's candidates (see the module docstring), arrays of one kind.

    ids (B, W) int64: ERM candidates in columns < Kp, voted documents outside C after them,
    -1 where there is none (ERM padding, a repeated ERM id, unused slots); erm (B, W) float32
    f_erm (0 where the id is -1); cells (U,) the flat cell b * W + column of every voted
    candidate, extra (U,) whether it lies outside C; entry_cell (V,) the voted candidate
    (index into cells) of every vote entry, entry_slot its neighbour's slot b * K + rank,
    entry_score / entry_y the neighbour's score and the Y value; n_neighbours: K, the
    neighbours per query.
    """

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
        """f_knn from the first ``k`` neighbours: (U,) float32 sums of (s / divisor) * y in
        neighbour order (0 where none of them votes), and (U,) ``dead``: a candidate outside C
        that none of them votes for."""
        at, rank = self.entry_cell, self.entry_slot % max(self.n_neighbours, 1)
        vote = ops(at).divide(self.entry_score, divisor) * self.entry_y
        if isinstance(at, np.ndarray):
            if k < self.n_neighbours:
                use = (rank < k).nonzero()[0]
                at, vote = at[use], vote[use]
            f = np.zeros(len(self.cells), np.float32)
            np.add.at(f, at, vote)  # in the order of ``at``: by rank per candidate
            dead = self.extra.copy()
            dead[at] = False
            return f, dead
        # torch: one round per rank; a candidate gets at most one vote a round (Y has one entry
        # per row and column), so CUDA's atomics cannot reorder the sums, and the + 0.0 the
        # others get changes nothing (f is never -0.0). No host synchronisation.
        f = torch.zeros(len(self.cells), device=at.device)
        for r in range(min(k, self.n_neighbours)):
            f.index_add_(0, at, torch.where(rank == r, vote, 0.0))
        voted = torch.zeros_like(f).index_add_(0, at, (rank < k).float())
        return f, self.extra & (voted == 0)

    def topk(self, lam: float, knn: tuple[Array, Array], topk: int) -> tuple[Array, Array]:
        """The best ``topk`` of lam f_erm + (1 - lam) f_knn (``knn``: :meth:`knn_scores`):
        (B, topk) float32 scores and int64 ids, ties to the lower id, -1 / -inf padded.
        Candidates outside C that no neighbour of ``knn`` voted for are left out."""
        xp = ops(self.ids)
        f_knn, dead = knn
        fused = xp.where(self.ids >= 0, lam * self.erm, float("-inf"))
        flat = fused.reshape(-1)
        # lam f_erm + (1 - lam) f_knn on every voted candidate (f_knn = 0 where nobody voted
        # in C: adding 0 changes no score, -0.0 aside, which select_topk reads as 0.0)
        flat[self.cells] = xp.where(dead, float("-inf"), flat[self.cells] + (1.0 - lam) * f_knn)
        if isinstance(fused, np.ndarray):
            return select_topk(fused, self.ids, topk)
        top, ids = merge_topk(fused + 0.0, self.ids, topk)
        return top, torch.where(top > float("-inf"), ids, -1)


def candidate_table(queries: Array, docs: Array, rows: RelevanceRows,
                    erm: tuple[Array, Array], knn: tuple[Array, Array], *,
                    rescore: bool, erm_exact: bool, distinct: bool = False) -> CandidateTable:
    """Step 1 of the module docstring. queries (B, d) float32; docs (n, d) the document
    embeddings; erm (B, Kp) scores / ids of a passage search, knn (B, K) scores / Y row ids
    (-1 padded). ``rescore``: f_erm = <q, p_j> for every candidate (``erm_exact``: the ERM
    scores already are, so only the voted documents outside C get dot products).
    ``distinct``: no row of the ERM ids repeats an id (an index's own search result), so
    repeats are not looked for."""
    (es, ei), (ks, ki) = erm, knn
    xp = ops(ei)
    b, kp = ei.shape
    n, kn = rows.shape[1], ki.shape[1]
    slot, doc, y = votes(ki, rows)
    # every voted (query, document) once, in (query, document) order, and its column in C
    key, entry_cell = xp.unique((slot // kn) * (n + 1) + doc)
    u_row = key // (n + 1)
    ids, col = _columns_in_c(ei, key, n, distinct)
    extra = col < 0
    x = xp.flatnonzero(extra)
    width = kp
    if len(x):  # voted documents outside C: columns kp, kp + 1, ... of their row
        x_row, x_doc = u_row[x], key[x] % (n + 1)
        rank = xp.arange(len(x), ei) - xp.searchsorted(x_row, x_row)  # among its row's extras
        width += int(rank.max()) + 1
        col[x] = kp + rank
    cells = u_row * width + col
    table_ids = xp.full((b, width), -1, xp.int64, ei)
    table_ids[:, :kp] = ids
    table_erm = xp.full((b, width), 0.0, xp.float32, ei)
    if len(x):
        x_cell = cells[x]
        table_ids.reshape(-1)[x_cell] = x_doc
    if rescore and not erm_exact:
        v = xp.flatnonzero(table_ids >= 0)
        table_erm.reshape(-1)[v] = rowdots(queries, docs, v // width,
                                           table_ids.reshape(-1)[v])
    else:
        table_erm[:, :kp] = xp.where(ids >= 0, es, 0.0)  # cast to float32 on assignment
        if rescore and len(x):
            table_erm.reshape(-1)[x_cell] = rowdots(queries, docs, x_row, x_doc)
    return CandidateTable(table_ids, table_erm, cells, extra, entry_cell, slot,
                          xp.astype(ks, xp.float32).reshape(-1)[slot], y, kn)


# at most this many ERM candidates in a batch of distinct ids: each is searched in the vote
# keys (fewest array calls: a single query); above, the rows are sorted (far less work)
SEARCH_ERM_IDS = 4096


def _columns_in_c(ei: Array, key: Array, n: int, distinct: bool) -> tuple[Array, Array]:
    """ERM ids ei (B, Kp) (-1 = padding, values < n) and the sorted keys b (n + 1) + doc of the
    voted (query, document) pairs (U,) -> ids (B, Kp) int64 with -1 at padding and at every
    repeat of an id but its first column, and col (U,) int64: each pair's column in C, -1
    where the document is not an ERM candidate of its query."""
    xp = ops(ei)
    b, kp = ei.shape
    valid = ei >= 0
    ids = xp.where(valid, ei, -1)
    if not (len(key) and kp):
        return ids, xp.full(key.shape, -1, xp.int64, key)
    if distinct and b * kp <= SEARCH_ERM_IDS:  # padding's key b (n + 1) - 1: never a vote's
        col = xp.full(key.shape, -1, xp.int64, key)
        erm_key = (xp.arange(b, ei)[:, None] * (n + 1) + ids).reshape(-1)
        at = xp.clip_max(xp.searchsorted(key, erm_key), len(key) - 1)
        hit = xp.flatnonzero(key[at] == erm_key)  # cells b * Kp + column
        col[at[hit]] = hit % kp
        return ids, col
    # each row's ids sorted, packed with their column (padding last): repeats sit side by
    # side, and the keys are searched in them
    bits = max(1, (kp - 1).bit_length())
    packed = (xp.where(valid, ei, n) << bits) | xp.arange(kp, ei)
    packed = xp.astype(xp.sort_rows(packed, ((n + 1) << bits) < 2**31), xp.int64)
    s_id, s_col = packed >> bits, packed & ((1 << bits) - 1)
    if not distinct:  # a repeated id keeps its first column
        r, c = _nonzero2((s_id[:, 1:] == s_id[:, :-1]) & (s_id[:, 1:] < n))
        ids[r, s_col[r, c + 1]] = -1
    sorted_keys = (xp.arange(b, ei)[:, None] * (n + 1) + s_id).reshape(-1)
    at = xp.clip_max(xp.searchsorted(sorted_keys, key), b * kp - 1)
    return ids, xp.where(sorted_keys[at] == key, s_col.reshape(-1)[at], -1)


def _nonzero2(mask: Array) -> tuple[Array, Array]:
    """Row and column numbers of the True cells of a (B, C) mask, row-major."""
    xp = ops(mask)
    flat = xp.flatnonzero(mask)
    return flat // max(mask.shape[1], 1), flat % max(mask.shape[1], 1)


def select_topk(scores: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` of each row of a numpy candidate table (torch tables use
    :func:`pefa_gpu.topk.merge_topk`): scores (B, W) float32 (-inf: no candidate), ids (B, W)
    int64 distinct per row, below 2**32 -> (B, k) scores descending, equal scores by ascending
    id (at the k-th place too), and ids; -1 / -inf padded.

    Each cell becomes one int64 key, the score's bits (ordered as the floats, descending) above
    the id, so that the tie rule is the keys' order and one k-smallest per row selects; the
    scores come back from their bits unchanged (-0.0 as 0.0, which it ties with)."""
    b, w = scores.shape
    kk = min(k, w)
    out_s, out_i = _Numpy.full((b, k), -np.inf, np.float32, None), _Numpy.full((b, k), -1,
                                                                               np.int64, None)
    if kk == 0 or b == 0:
        return out_s, out_i
    bits = (scores + 0.0).view(np.int32).astype(np.int64)
    key = ~np.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # ascending as the score descends
    best = np.partition((key << 32) | (ids & (2**32 - 1)), kk - 1, axis=1)[:, :kk]
    best.sort(axis=1)  # id -1 sorts last
    bits = ~(best >> 32)
    top = np.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).astype(np.int32).view(np.float32)
    out_s[:, :kk], out_i[:, :kk] = top, np.where(top > -np.inf, best & (2**32 - 1), -1)
    return out_s, out_i


def fuse(queries: Array, erm: tuple[Array, Array], knn: tuple[Array, Array],
         rows: RelevanceRows, docs: Array, *, lams: Sequence[float], ks: Sequence[int],
         knn_norm: str, rescore: bool, erm_exact: bool, topk: int, distinct: bool = False,
         batch_size: int | None = None) -> dict[tuple[float, int], tuple[Array, Array]]:
    """The fused top-``topk`` of each query for every (lam, k) of ``lams`` x ``ks``
    (arguments as :func:`candidate_table`; ``knn`` with >= max(ks) neighbours; the first k
    vote with w(s) = s / k for ``knn_norm`` "k", else s): {(lam, k): ((B, topk) float32
    scores, int64 ids)} of ``erm``'s kind, ties to the lower id, -1 / -inf padded. Per
    ``batch_size`` queries (default 4096 on numpy, 256 on torch) the candidate table is built
    once, the kNN scores once per k, the mix and top-k once per (lam, k)."""
    xp, n_queries = ops(erm[1]), len(erm[1])
    step = batch_size or (4096 if isinstance(queries, np.ndarray) else 256)
    kmax = max(ks)
    parts: dict[tuple[float, int], list] = {(lam, k): [] for k in ks for lam in lams}
    for s in range(0, n_queries, step):
        b = slice(s, s + step)
        table = candidate_table(queries[b], docs, rows, (erm[0][b], erm[1][b]),
                                (knn[0][b, :kmax], knn[1][b, :kmax]), rescore=rescore,
                                erm_exact=erm_exact, distinct=distinct)
        for k in ks:
            f_knn = table.knn_scores(k, float(k) if knn_norm == "k" else 1.0)
            for lam in lams:
                parts[(lam, k)].append(table.topk(lam, f_knn, topk))
    if not n_queries:
        return {key: (xp.full((0, topk), float("-inf"), xp.float32, erm[1]),
                      xp.full((0, topk), -1, xp.int64, erm[1])) for key in parts}
    return {key: v[0] if len(v) == 1 else
            (xp.cat([x for x, _ in v]), xp.cat([y for _, y in v])) for key, v in parts.items()}


def neighbours(knn: tuple[Array, Array], erm: tuple[Array, Array], m: int, k: int,
               augment_docs: bool) -> tuple[Array, Array]:
    """PEFA-XL's neighbours from a query index top-k ``knn`` (rows < m) and, with
    ``augment_docs``, a passage top-k ``erm`` (document j as row m + j): their top-k, ties to
    the lower row. Both lists are sorted (score descending, ties to the lower id) and every
    query row is below every document row, so one stable sort of the two side by side merges
    them."""
    if not augment_docs:
        return knn
    xp, ids = ops(knn[1]), erm[1][:, :k]
    scores = xp.cat([knn[0], erm[0][:, :k]], 1)  # float32 (a lower precision is promoted)
    rows = xp.cat([knn[1], xp.where(ids >= 0, ids + m, -1)], 1)
    order = xp.argsort_desc(scores)[:, :k]
    return xp.take_along(scores, order), xp.take_along(rows, order)
