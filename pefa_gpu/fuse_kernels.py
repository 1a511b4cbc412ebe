"""Fast PEFA-XL fusion: the same scores and ids as :func:`pefa_gpu.fuse.fuse_scores`, with no
sort over the ERM candidates and a single top-k.

1. The neighbours' Y entries (few: B * k * deg) are reduced to unique (query, doc) keys.
2. Each ERM candidate looks its key up there (``searchsorted``): matched ones get f_knn added,
   unmatched neighbour documents become the extra candidates.
3. Each candidate gets one int64 sort key, (descending score bits) << 31 | doc id, so one
   ``topk(largest=False)`` over a (B, Kp + extra) table gives the best ``topk`` with ties to
   the lower id.

Works on any device with torch ops (no Python loop over queries). On CUDA with triton
installed, the per-candidate rescoring dot products run in a Triton kernel. Returns None when
an ERM row holds a duplicate id (the caller then uses the general path).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from .arrays import as_tensor, to_numpy

_HI = 1 << 32
_DOC = 1 << 31  # doc ids take the low 31 bits of a sort key
_PAD_KEY = torch.iinfo(torch.int64).max


def neighbour_entries(knn_ids: torch.Tensor,
                      y_indptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Y entries of every neighbour, flattened: one per (query, neighbour, document).

    knn_ids (B, K) Y row ids (-1 = padding), y_indptr (m+1,) int64 -> (owner, pos): owner is
    the flat neighbour slot b * K + r of each entry, pos its index into Y's indices / data.
    """
    rows = knn_ids.clamp_min(0).reshape(-1)
    starts = y_indptr[rows]
    lengths = torch.where(knn_ids.reshape(-1) >= 0, y_indptr[rows + 1] - starts, 0)
    owner = torch.repeat_interleave(torch.arange(rows.numel(), device=knn_ids.device), lengths)
    first = torch.cumsum(lengths, 0) - lengths
    pos = starts[owner] + torch.arange(owner.numel(), device=knn_ids.device) - first[owner]
    return owner, pos


def fused_topk(queries: torch.Tensor, doc_vectors: torch.Tensor,
               y_indptr: torch.Tensor, y_indices: torch.Tensor, y_data: torch.Tensor,
               erm_scores: torch.Tensor, erm_ids: torch.Tensor,
               knn_scores: torch.Tensor, knn_ids: torch.Tensor, *, lam: float,
               knn_weight_divisor: float, rescore: bool, topk: int,
               erm_exact: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Arguments and result as :func:`pefa_gpu.fuse.fuse_scores`; None if ERM ids repeat in a
    row or the ids do not fit in 31 bits. ``erm_exact``: the ERM scores already are <q, p_j>,
    so ``rescore`` computes dot products only for the extra candidates."""
    device = erm_ids.device
    b, kp = erm_ids.shape
    n_docs = doc_vectors.shape[0]
    if n_docs >= _DOC or b == 0:
        return None
    n_key = max(int(n_docs), 1)
    if device.type == "cpu" and b <= NUMPY_MAX_BATCH:
        out = fused_topk_host(to_numpy(queries).astype(np.float32, copy=False),
                              host_docs(doc_vectors), HostCSR(y_indptr, y_indices, y_data),
                              *map(to_numpy, (erm_scores, erm_ids, knn_scores, knn_ids)),
                              lam=lam, knn_weight_divisor=knn_weight_divisor, rescore=rescore,
                              topk=topk, erm_exact=erm_exact)
        return None if out is None else (as_tensor(out[0]), as_tensor(out[1]))
    arange_b = torch.arange(b, device=device)

    # 1. neighbours' Y entries -> unique (query, doc) keys with summed weights
    kk = knn_ids.shape[1]
    owner, pos = neighbour_entries(knn_ids, y_indptr)
    knn_key = (owner // kk) * n_key + y_indices[pos]
    knn_val = (knn_scores.reshape(-1)[owner].float() / knn_weight_divisor) * y_data[pos]
    ukey, inv = _unique(knn_key)
    uval = torch.zeros(ukey.numel(), device=device).index_add_(0, inv, knn_val)

    # 2. ERM candidates look themselves up among the neighbour keys; only the hits change
    erm_valid = erm_ids >= 0
    if rescore and not erm_exact:
        erm_f = _dots(queries, doc_vectors, erm_ids.clamp_min(0)).reshape(-1)
    else:
        erm_f = erm_scores.float().reshape(-1)
    erm_fused = lam * erm_f  # == lam * f + (1 - lam) * 0 where no neighbour votes
    matched = torch.zeros(ukey.numel(), dtype=torch.bool, device=device)
    if ukey.numel():
        erm_key = (arange_b[:, None] * n_key + erm_ids).masked_fill_(~erm_valid, -1).reshape(-1)
        at = torch.searchsorted(ukey, erm_key).clamp_max_(ukey.numel() - 1)
        hit = (ukey[at] == erm_key).nonzero().squeeze(1)
        at = at[hit]
        erm_fused[hit] = lam * erm_f[hit] + (1.0 - lam) * uval[at]
        matched[at] = True
    erm_fused = erm_fused.reshape(b, kp)

    # extra candidates: neighbour documents that are not ERM candidates
    extra = ~matched
    x_key = ukey[extra]
    x_batch, x_doc = x_key // n_key, x_key % n_key
    x_knn = uval[extra]
    if rescore:
        x_erm = _rowdots(queries, doc_vectors, x_batch, x_doc)
    else:
        x_erm = torch.zeros_like(x_knn)
    x_fused = lam * x_erm + (1.0 - lam) * x_knn
    counts = torch.bincount(x_batch, minlength=b)
    width = int(counts.max()) if x_batch.numel() else 0
    x_col = torch.arange(x_key.numel(), device=device) - (torch.cumsum(counts, 0) - counts)[x_batch]

    # 3. one int64 key per candidate: ascending key = descending score, then ascending id
    keys = torch.full((b, kp + width), _PAD_KEY, dtype=torch.long, device=device)
    keys[:, :kp] = _sort_key(erm_fused, erm_ids).masked_fill_(~erm_valid, _PAD_KEY)
    if width:
        keys[x_batch, kp + x_col] = _sort_key(x_fused, x_doc)
    kk_top = min(topk, keys.shape[1])
    best, _ = torch.topk(keys, kk_top, dim=1, largest=False, sorted=True)
    if kp > 1:  # a repeated ERM id shows as two equal keys next to each other
        dup = (best[:, 1:] == best[:, :-1]) & (best[:, 1:] != _PAD_KEY)
        if bool(dup.any()) and _erm_has_duplicates(erm_ids):
            return None
    ids = torch.where(best == _PAD_KEY, -1, best & (_DOC - 1))
    scores = _key_score(best)
    if kk_top < topk:
        pad = topk - kk_top
        ids = torch.cat([ids, ids.new_full((b, pad), -1)], 1)
        scores = torch.cat([scores, scores.new_full((b, pad), float("-inf"))], 1)
    return scores, ids


# CPU batches up to this size are fused one query at a time with numpy (about 40 small numpy
# ops per query, each ~1-3 microseconds, where torch's per-op overhead is ~5-10 and a single
# query's fusion is ~30 torch ops). Same float32 arithmetic in the same order, so the results are
# equal to the bit; larger CPU batches keep torch (multi-threaded, one pass for all rows).
NUMPY_MAX_BATCH = 16


class HostCSR:
    """Y on the host for :func:`fused_topk_host`: every row's start and length, plus one empty
    row at the end so that a padding id -1 reads length 0 without a mask. Build once per Y."""

    __slots__ = ("starts", "lengths", "indices", "data")

    def __init__(self, indptr: Any, indices: Any, data: Any):
        ip = to_numpy(indptr).astype(np.int64, copy=False)
        self.starts = np.append(ip[:-1], 0)
        self.lengths = np.append(np.diff(ip), 0)
        self.indices = to_numpy(indices).astype(np.int64, copy=False)
        self.data = to_numpy(data).astype(np.float32, copy=False)


def host_docs(doc_vectors: torch.Tensor) -> np.ndarray | torch.Tensor:
    """CPU document vectors as :func:`fused_topk_host` reads them: a numpy view where numpy has
    the dtype (float32, float16), else the tensor itself (bfloat16: rows converted by torch)."""
    if doc_vectors.dtype in (torch.float32, torch.float16):
        return doc_vectors.detach().cpu().numpy()
    return doc_vectors


def fused_topk_host(queries: np.ndarray, docs: np.ndarray | torch.Tensor, y: HostCSR,
                    erm_scores: np.ndarray, erm_ids: np.ndarray, knn_scores: np.ndarray,
                    knn_ids: np.ndarray, *, lam: float, knn_weight_divisor: float,
                    rescore: bool, topk: int,
                    erm_exact: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`fused_topk` for small CPU batches, one query at a time with numpy: numpy
    (B, topk) results, None as there. ``queries`` (B, d) float32, ``docs`` from
    :func:`host_docs`, ``y`` the relevance rows, the searches numpy arrays (no torch call on
    this path: after a faiss search, each cold torch call costs several microseconds)."""
    if len(docs) >= _DOC:
        return None
    b = len(erm_ids)
    out_s = np.full((b, topk), np.float32(-np.inf))
    out_i = np.full((b, topk), -1, dtype=np.int64)
    lam32, rest32 = np.float32(lam), np.float32(1.0 - lam)
    div32 = np.float32(knn_weight_divisor)
    with np.errstate(invalid="ignore") if lam == 0 else _NO_CONTEXT:  # 0 * -inf at padding
        for r in range(b):
            row = _fuse_row(queries[r], docs, y, erm_scores[r], erm_ids[r], knn_scores[r],
                            knn_ids[r], lam32, rest32, div32, rescore, erm_exact, topk)
            if row is None:
                return None
            out_s[r, :row[0].size], out_i[r, :row[1].size] = row
    return out_s, out_i


_NO_CONTEXT = contextlib.nullcontext()


def _fuse_row(q: np.ndarray, docs: np.ndarray | torch.Tensor, y: HostCSR, es: np.ndarray,
              ei: np.ndarray, ks: np.ndarray, ki: np.ndarray, lam: np.float32,
              rest: np.float32, div: np.float32, rescore: bool, erm_exact: bool,
              topk: int) -> tuple[np.ndarray, np.ndarray] | None:
    """One query of :func:`fused_topk`: q (d,), es / ei (Kp,), ks / ki (K,) -> up to topk
    (scores, ids), best first; None when the top holds a repeated ERM id."""
    if rescore and not erm_exact:
        ef = _rowdots_host(q, docs, np.maximum(ei, 0))
    else:
        ef = es.astype(np.float32, copy=False)
    fused, ids = lam * ef, ei
    lengths = y.lengths[ki]
    ends = lengths.cumsum()
    n_entries = int(ends[-1]) if ends.size else 0
    if n_entries:
        # the neighbours' Y entries -> unique documents with summed weights (entry order)
        pos = np.repeat(y.starts[ki] - (ends - lengths), lengths) + np.arange(n_entries)
        entry_doc = y.indices[pos]
        entry_val = np.repeat(ks.astype(np.float32, copy=False) / div, lengths) * y.data[pos]
        order = entry_doc.argsort(kind="stable")
        entry_doc = entry_doc[order]
        first = np.empty(n_entries, dtype=bool)
        first[0] = True
        np.not_equal(entry_doc[1:], entry_doc[:-1], out=first[1:])
        if first.all():  # no document voted twice: no sums to form (0 + v == v)
            doc, knn = entry_doc, entry_val[order]
        else:
            doc = entry_doc[first]
            knn = np.zeros(doc.size, np.float32)
            np.add.at(knn, first.cumsum() - 1, entry_val[order])
        # ERM candidates voted for get the kNN term (lam e + rest * 0 == lam e elsewhere)
        at = np.minimum(np.searchsorted(doc, ei), doc.size - 1)
        hit = doc[at] == ei
        fused = fused + rest * np.where(hit, knn[at], np.float32(0))
        # the other voted documents join as extra candidates
        extra = np.ones(doc.size, dtype=bool)
        extra[at[hit]] = False
        x_doc = doc[extra]
        if x_doc.size:
            x_erm = _rowdots_host(q, docs, x_doc) if rescore else np.float32(0)
            fused = np.concatenate((fused, lam * x_erm + rest * knn[extra]))
            ids = np.concatenate((ei, x_doc))
    fused = np.where(ids >= 0, fused, np.float32(-np.inf))  # ERM padding (or 0 * -inf)
    best = np.lexsort((ids, -fused))[:topk]  # score descending, ties to the lower id
    scores, ids = fused[best] + np.float32(0.0), ids[best]  # -0.0 -> 0.0, as the keys do
    same = ids[1:] == ids[:-1]
    if same.any() and (same & (scores[1:] == scores[:-1]) & (ids[1:] >= 0)).any():
        return None  # a repeated ERM id (the voted documents are unique)
    return scores, ids


def _rowdots_host(q: np.ndarray, docs: np.ndarray | torch.Tensor,
                  doc: np.ndarray) -> np.ndarray:
    """<q_i, p_doc[i]> on the host, float32: q (d,) or (len(doc), d), ``docs`` from
    :func:`host_docs`. Products, then numpy's row sum, whose order within a row does not depend
    on how many rows share the call (the host and torch CPU paths both use this function, so
    they agree to the bit)."""
    if isinstance(docs, np.ndarray):
        rows = docs[doc].astype(np.float32, copy=False)
    else:  # bfloat16: gather first, convert the gathered rows only
        rows = docs[torch.from_numpy(doc)].float().numpy()
    return np.multiply(rows, q).sum(1, dtype=np.float32)


def _unique(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted unique int64 keys and the inverse map. On the CPU numpy's sort is used (torch's
    CPU sort is several times slower on these sizes)."""
    if keys.device.type == "cpu":
        u, inv = np.unique(to_numpy(keys), return_inverse=True)
        return as_tensor(u), as_tensor(inv.reshape(-1).astype(np.int64, copy=False))
    return torch.unique(keys, sorted=True, return_inverse=True)


def _sort_key(score: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """int64 key >= 0 whose ascending order is (score descending, doc ascending). Scores
    float32 (-0.0 ties with +0.0), doc ids in [0, 2**31)."""
    bits = (score.float() + 0.0).contiguous().view(torch.int32)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # int32 order == float order
    desc = (~ordered).to(torch.int64) + (1 << 31)  # in [0, 2**32), ascending = descending score
    return (desc << 31) | doc


def _key_score(key: torch.Tensor) -> torch.Tensor:
    """Inverse of the score half of :func:`_sort_key`; padding keys give -inf."""
    ordered = ~((key >> 31) - (1 << 31)).to(torch.int32)
    bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
    return torch.where(key == _PAD_KEY, float("-inf"), bits.view(torch.float32))


def _erm_has_duplicates(erm_ids: torch.Tensor) -> bool:
    s, _ = torch.sort(erm_ids, dim=1)
    return bool(((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any())


def _dots(queries: torch.Tensor, docs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """<q_b, p_ids[b, c]> for (B, C) ids -> (B, C) float32."""
    b, c = ids.shape
    rows = torch.arange(b, device=ids.device).repeat_interleave(c)
    return _rowdots(queries, docs, rows, ids.reshape(-1)).reshape(b, c)


def _rowdots(queries: torch.Tensor, docs: torch.Tensor, batch: torch.Tensor,
             doc: torch.Tensor) -> torch.Tensor:
    """<q_batch[i], p_doc[i]> for flat index pairs -> (N,) float32. CUDA:
    :func:`pefa_gpu.triton_rowdots.rowdots` (the Triton kernel, or torch where it cannot run);
    CPU: :func:`_rowdots_host` (the host fusion's own dot products), ~16 MB of rows at a time."""
    if batch.is_cuda:
        from . import triton_rowdots  # noqa: PLC0415 (imports triton: only on CUDA)
        return triton_rowdots.rowdots(queries, docs, batch, doc)
    step = max(1, (1 << 22) // max(1, docs.shape[1]))
    qn = to_numpy(queries).astype(np.float32, copy=False)
    bn, dn = to_numpy(batch), to_numpy(doc)
    hd = host_docs(docs)
    out = np.empty(len(bn), np.float32)
    # runs of one query (the callers list pairs grouped by query): that query's row is
    # broadcast over the run instead of being gathered for every pair
    cuts = np.flatnonzero(bn[1:] != bn[:-1]) + 1
    for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(bn)]):
        for s in range(lo, hi, step):
            e = min(s + step, hi)
            out[s:e] = _rowdots_host(qn[bn[lo]], hd, dn[s:e])
    return as_tensor(out)
