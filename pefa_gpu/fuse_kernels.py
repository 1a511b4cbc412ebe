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
        out = fused_topk_host(queries, doc_vectors, y_indptr, y_indices, y_data, erm_scores,
                              erm_ids, knn_scores, knn_ids, lam=lam,
                              knn_weight_divisor=knn_weight_divisor, rescore=rescore, topk=topk,
                              erm_exact=erm_exact)
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


# CPU batches up to this size run the same algorithm with numpy (a few microseconds per op
# instead of torch's ~5-10: a single query's fusion is ~30 small ops). Same float32 arithmetic
# in the same order (the rescoring dot products are torch's, as in the torch path), so the
# results are equal to the bit; larger CPU batches keep torch (multi-threaded top-k).
NUMPY_MAX_BATCH = 16


def fused_topk_host(queries: torch.Tensor, doc_vectors: torch.Tensor,
                    y_indptr: Any, y_indices: Any, y_data: Any, erm_scores: Any, erm_ids: Any,
                    knn_scores: Any, knn_ids: Any, *, lam: float, knn_weight_divisor: float,
                    rescore: bool, topk: int,
                    erm_exact: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`fused_topk` for small CPU batches, step for step with numpy; numpy results.
    ``queries`` and ``doc_vectors`` are CPU torch tensors (the rescoring dot products are
    torch's, as in the torch path), the other arrays numpy or CPU tensors."""
    n_docs = doc_vectors.shape[0]
    if n_docs >= _DOC or len(erm_ids) == 0:
        return None
    with np.errstate(invalid="ignore"):  # 0 * -inf at padding, masked out as in torch
        return _fused_topk_host(queries, doc_vectors, y_indptr, y_indices, y_data, erm_scores,
                                erm_ids, knn_scores, knn_ids, lam=lam,
                                knn_weight_divisor=knn_weight_divisor, rescore=rescore,
                                topk=topk, erm_exact=erm_exact, n_key=max(int(n_docs), 1))


def _fused_topk_host(queries: torch.Tensor, doc_vectors: torch.Tensor,
                     y_indptr: Any, y_indices: Any, y_data: Any, erm_scores: Any, erm_ids: Any,
                     knn_scores: Any, knn_ids: Any, *, lam: float,
                     knn_weight_divisor: float, rescore: bool, topk: int, erm_exact: bool,
                     n_key: int) -> tuple[np.ndarray, np.ndarray] | None:
    indptr, indices, ydata = to_numpy(y_indptr), to_numpy(y_indices), to_numpy(y_data)
    eids, kids = to_numpy(erm_ids), to_numpy(knn_ids)
    b, kp = eids.shape
    kk = kids.shape[1]
    lam32, rest32 = np.float32(lam), np.float32(1.0 - lam)

    # 1. neighbours' Y entries -> unique (query, doc) keys with summed weights
    flat = kids.reshape(-1)
    rows = np.maximum(flat, 0)
    starts = indptr[rows]
    lengths = np.where(flat >= 0, indptr[rows + 1] - starts, 0)
    owner = np.repeat(np.arange(rows.size), lengths)
    pos = starts[owner] + np.arange(owner.size) - (np.cumsum(lengths) - lengths)[owner]
    knn_key = (owner // kk) * n_key + indices[pos]
    ks = to_numpy(knn_scores).reshape(-1)[owner].astype(np.float32, copy=False)
    knn_val = (ks / np.float32(knn_weight_divisor)) * ydata[pos]
    ukey, inv = np.unique(knn_key, return_inverse=True)
    uval = np.zeros(ukey.size, np.float32)
    np.add.at(uval, inv.reshape(-1), knn_val)

    # 2. ERM candidates look themselves up among the neighbour keys
    erm_valid = eids >= 0
    if rescore and not erm_exact:
        erm_f = to_numpy(_dots(queries, doc_vectors, as_tensor(np.maximum(eids, 0)))).reshape(-1)
    else:
        erm_f = to_numpy(erm_scores).astype(np.float32, copy=False).reshape(-1)
    erm_fused = lam32 * erm_f
    matched = np.zeros(ukey.size, dtype=bool)
    if ukey.size:
        erm_key = np.where(erm_valid, np.arange(b)[:, None] * n_key + eids, -1).reshape(-1)
        at = np.minimum(np.searchsorted(ukey, erm_key), ukey.size - 1)
        hit = np.flatnonzero(ukey[at] == erm_key)
        at = at[hit]
        erm_fused[hit] = lam32 * erm_f[hit] + rest32 * uval[at]
        matched[at] = True
    erm_fused = erm_fused.reshape(b, kp)

    # extra candidates: neighbour documents that are not ERM candidates
    extra = ~matched
    x_key = ukey[extra]
    x_batch, x_doc = x_key // n_key, x_key % n_key
    x_knn = uval[extra]
    if rescore and x_key.size:
        x_erm = to_numpy(_rowdots(queries, doc_vectors, as_tensor(x_batch), as_tensor(x_doc)))
    else:
        x_erm = np.zeros_like(x_knn)
    x_fused = lam32 * x_erm + rest32 * x_knn
    counts = np.bincount(x_batch, minlength=b)
    width = int(counts.max()) if x_batch.size else 0

    # 3. one int64 key per candidate: ascending key = descending score, then ascending id
    keys = np.full((b, kp + width), _PAD_KEY, dtype=np.int64)
    keys[:, :kp] = np.where(erm_valid, _sort_key_np(erm_fused, eids), _PAD_KEY)
    if width:
        x_col = np.arange(x_key.size) - (np.cumsum(counts) - counts)[x_batch]
        keys[x_batch, kp + x_col] = _sort_key_np(x_fused, x_doc)
    kk_top = min(topk, keys.shape[1])
    if kk_top < keys.shape[1]:
        keys = np.partition(keys, kk_top - 1, axis=1)[:, :kk_top]
    best = np.sort(keys, axis=1)
    if kp > 1:  # a repeated ERM id shows as two equal keys next to each other
        dup = (best[:, 1:] == best[:, :-1]) & (best[:, 1:] != _PAD_KEY)
        if dup.any() and _erm_has_duplicates(as_tensor(eids)):
            return None
    pad = best == _PAD_KEY
    ids = np.where(pad, -1, best & (_DOC - 1))
    ordered = ~((best >> 31) - (1 << 31)).astype(np.int32)
    scores = np.where(pad, np.float32(-np.inf),
                      (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).view(np.float32))
    if kk_top < topk:
        ids = np.concatenate([ids, np.full((b, topk - kk_top), -1, np.int64)], 1)
        scores = np.concatenate([scores, np.full((b, topk - kk_top), -np.inf, np.float32)], 1)
    return scores, ids


def _sort_key_np(score: np.ndarray, doc: np.ndarray) -> np.ndarray:
    """numpy twin of :func:`_sort_key`."""
    bits = (score.astype(np.float32, copy=False) + np.float32(0.0)).view(np.int32)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    desc = (~ordered).astype(np.int64) + (1 << 31)
    return (desc << 31) | doc


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
    if ids.is_cuda and _triton_ok():
        b, c = ids.shape
        return _triton_rowdots(queries, docs, torch.arange(b, device=ids.device)
                               .repeat_interleave(c), ids.reshape(-1)).reshape(b, c)
    q = queries.float().unsqueeze(2)  # (B, d, 1)
    out = torch.empty(ids.shape, device=ids.device)
    step = max(1, (1 << 22) // max(1, ids.shape[1] * docs.shape[1]))  # ~16 MB of gathered rows
    for s in range(0, ids.shape[0], step):
        g = docs[ids[s:s + step]].float()  # (b, C, d)
        out[s:s + step] = torch.bmm(g, q[s:s + step]).squeeze(2)
    return out


def _rowdots(queries: torch.Tensor, docs: torch.Tensor, batch: torch.Tensor,
             doc: torch.Tensor) -> torch.Tensor:
    """<q_batch[i], p_doc[i]> for flat index pairs -> (N,) float32."""
    if batch.is_cuda and _triton_ok():
        return _triton_rowdots(queries, docs, batch, doc)
    return (queries.float()[batch] * docs[doc].float()).sum(1)


_TRITON: dict[str, object] = {}


def _triton_ok() -> bool:
    """True when triton imports (checked once); the kernel is compiled on first use."""
    if "ok" not in _TRITON:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401
            _TRITON["ok"] = True
        except Exception:
            _TRITON["ok"] = False
    return bool(_TRITON["ok"])


def _triton_rowdots(queries: torch.Tensor, docs: torch.Tensor, batch: torch.Tensor,
                    doc: torch.Tensor) -> torch.Tensor:
    """Triton: out[i] = sum_d q[batch[i], d] * p[doc[i], d], fp32 accumulation, any storage."""
    import triton
    import triton.language as tl

    if "kernel" not in _TRITON:
        @triton.jit
        def rowdots(q_ptr, p_ptr, b_ptr, j_ptr, out_ptr, n, d, sq, sp,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
            pid = tl.program_id(0)
            offs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = offs < n
            bi = tl.load(b_ptr + offs, mask=mask, other=0)
            ji = tl.load(j_ptr + offs, mask=mask, other=0)
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for d0 in range(0, d, BLOCK_D):
                dd = d0 + tl.arange(0, BLOCK_D)
                dm = dd < d
                qv = tl.load(q_ptr + bi[:, None] * sq + dd[None, :],
                             mask=mask[:, None] & dm[None, :], other=0.0).to(tl.float32)
                pv = tl.load(p_ptr + ji[:, None] * sp + dd[None, :],
                             mask=mask[:, None] & dm[None, :], other=0.0).to(tl.float32)
                acc += tl.sum(qv * pv, axis=1)
            tl.store(out_ptr + offs, acc, mask=mask)

        _TRITON["kernel"] = rowdots
    q = queries.contiguous()
    p = docs.contiguous()
    n = batch.numel()
    out = torch.empty(n, device=batch.device, dtype=torch.float32)
    if n == 0:
        return out
    block_n, block_d = 64, 64
    grid = (triton.cdiv(n, block_n),)
    _TRITON["kernel"][grid](q, p, batch.contiguous(), doc.contiguous(), out, n, q.shape[1],
                            q.stride(0), p.stride(0), BLOCK_N=block_n, BLOCK_D=block_d)
    return out
