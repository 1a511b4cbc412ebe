"""Exact maximum-inner-product search on CPU or CUDA: the float32 top-k, ties to the lower id.
A first pass keeps k + ``TIE_MARGIN`` candidates per query (torch GEMM blocks, or faiss on the
CPU); rows whose tied run may reach past them are searched again, 4x as wide."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..arrays import DeviceLike, all_finite, as_tensor, check_topk, host_empty, to_numpy
from ..errors import FormatError, InputError
from ..params import check_choice, checked
from ..storage import load_tensor
from ..topk import order_ties, pad_topk, topk_wide
from ._faiss import faiss_blas_is_tuned, faiss_threads, optional_faiss
from .base import (IndexParams, NoSearchParams, VectorIndex, check_budget, check_row_ids,
                   empty_results)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExactParams(IndexParams):
    """dtype: storage of the rows (scores are float32). memory_budget: bytes a search may hold
    besides its (B, k) result (None: :func:`default_memory_budget`)."""

    dtype: str = checked("float32", check_choice, ("float32", "float16", "bfloat16"))
    memory_budget: int | None = checked(None, check_budget, True)


ExactSearchParams = NoSearchParams  # an exact search has no search settings


class ExactIndex(VectorIndex):
    """Brute-force inner-product search. Ties go to the lower id."""

    name = "exact"
    Params = ExactParams
    SearchParams = ExactSearchParams

    def __init__(self, params: ExactParams | dict | None = None, device: DeviceLike = None):
        super().__init__(params, device)
        self._dtype = getattr(torch, self.params.dtype)  # one of ExactParams' dtype choices
        self.exact_scores = self.params.dtype == "float32"  # scores: fp32 <q, x>, exactly
        self.copies_rows = not self.exact_scores  # 16-bit rows are a cast, float32 ones shared
        self._store(torch.empty(0, 0, dtype=self._dtype, device=self.device))

    def _store(self, v: torch.Tensor, owned: bool = False) -> None:
        """Hold ``v`` (n, d); ``owned`` False: it may share the caller's memory (update copies)."""
        self.vectors, self._owned = v, owned
        self._max_norm: float | None = None  # largest stored row norm (_rescore_near_ties)

    @property
    def memory_budget(self) -> int:
        """``params.memory_budget``, or :func:`default_memory_budget`."""
        given = self.params.memory_budget
        return default_memory_budget(self.device) if given is None else given

    def _rows(self, vectors: torch.Tensor, copy: bool) -> torch.Tensor:
        """Rows in the stored dtype (``copy``: never the caller's memory), checked finite (a
        float16 overflow is inf; NaN rows made every score NaN)."""
        v = as_tensor(vectors, device=self.device, dtype=self._dtype, name="vectors",
                      copy=copy).detach()
        if v.numel() and not all_finite(v):
            raise InputError(f"vectors hold NaN or inf as {self.params.dtype} (beyond its range?)")
        return v

    def build(self, vectors: torch.Tensor) -> "ExactIndex":
        """Float32 rows are kept as given (shared), 16-bit ones as the index's own copy."""
        v = self._rows(vectors, copy=self.copies_rows)
        if v.ndim != 2 or v.shape[1] == 0:  # d = 0: built, yet searched as empty (any width)
            raise InputError(f"vectors must be 2-D (n, d) with d > 0, got shape "
                             f"{tuple(v.shape)}")
        self._store(v.contiguous(), owned=self.copies_rows)
        return self

    def add(self, vectors: torch.Tensor) -> None:
        if self.ntotal == 0 and self.dim == 0:
            self.build(vectors)
            return
        v = self._rows(vectors, copy=False)  # (the concatenation copies)
        self.check_rows(v)
        self._store(torch.cat([self.vectors, v]), owned=True)

    def update(self, ids: torch.Tensor, vectors: torch.Tensor) -> None:
        """Overwrite rows ``ids`` (r,) with ``vectors`` (r, d) (first copying rows that may
        share the caller's memory)."""
        i = as_tensor(ids, device=self.device, name="ids").detach().flatten()
        v = self._rows(vectors, copy=False)
        if v.shape != (i.numel(), self.dim):
            raise InputError(f"vectors must have shape ({i.numel()}, {self.dim}) for "
                             f"{i.numel()} ids, got {tuple(v.shape)}")
        i = check_row_ids(i, self.ntotal, distinct=True)
        vectors = self.vectors if self._owned else self.vectors.clone()
        vectors[i] = v
        self._store(vectors, owned=True)

    def search(self, queries: torch.Tensor, k: int, params: NoSearchParams | dict | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``params``: none to give (only ``{}`` or None)."""
        self.resolve_search_params(params)
        k = check_topk(k, self.ntotal, "k")
        q = as_tensor(queries, device=self.device, name="queries").detach()
        self.check_queries(q)
        if q.shape[0] == 0 or self.ntotal == 0:
            return empty_results(q.shape[0], k, self.device)
        kk = min(k, self.ntotal)
        w = self._pass_width(kk)
        vals, ids, rescan = self._pass(q, kk, w)
        rows = torch.arange(q.shape[0], device=self.device)
        while rescan is not None:  # unsettled rows: passes 4x wider until none is left
            rows = rows[rescan.nonzero().squeeze(1)]  # on CUDA: a host synchronisation
            if not rows.numel():
                break
            w = min(self.ntotal, 4 * w)
            vals[rows], ids[rows], rescan = self._pass(q[rows], kk, w)
        return pad_topk(vals, ids, k)

    def _pass(self, q: torch.Tensor, kk: int, w: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(B, d) queries -> (B, kk) scores sorted descending, ids with the tie rule, and
        ``rescan`` (B,) bool: rows whose run of scores equal to the kk-th may reach past their
        top-w candidates (None when w = n)."""
        b = q.shape[0]
        faiss, q_batch, chunk = self._plan(b, kk, w)
        # CPU score blocks share one buffer (a block freed before the next may stay resident)
        buf = None if faiss or q.is_cuda else \
            host_empty(min(q_batch, b) * (min(chunk, self.ntotal) + SUB_ROWS))
        vals, ids, rescan = zip(*[self._settle(*self._candidates(
            faiss, q[s:s + q_batch], w, chunk, buf), kk) for s in range(0, b, q_batch)])
        return torch.cat(vals), torch.cat(ids), None if rescan[0] is None else torch.cat(rescan)

    def _candidates(self, faiss: Any, q: torch.Tensor, w: int, chunk: int,
                    buf: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, d) queries -> (B, w) top-w scores sorted descending, ids, and the scoring error:
        (B, 1) on faiss' BLAS path and where the tiles left rows (inf), 0 elsewhere."""
        if faiss is None:
            return self._torch_pass(q.float(), w, chunk, buf)
        vals, ids = self._faiss_pass(faiss, q, w)
        if q.shape[0] * self.dim < faiss.cvar.distance_compute_blas_threshold:
            return vals, ids, torch.zeros(())
        return self._rescore_near_ties(q.float(), vals, ids)

    def _settle(self, vals: torch.Tensor, ids: torch.Tensor, tol: torch.Tensor, kk: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Candidates (B, w) sorted descending -> the first kk in the tie rule's order, and
        ``rescan``: rows whose last candidate is not two scoring errors below the kk-th score
        (None when w = n)."""
        rescan = None
        if kk < vals.shape[1] < self.ntotal:  # a NaN difference: a run of NaN / inf
            kth, last = vals[:, kk - 1], vals[:, -1]
            rescan = ~(kth - last > 2 * tol.squeeze(-1)) & (last.isnan() | ~kth.isnan())
        vals, ids = order_ties(vals, ids)
        return vals[:, :kk].contiguous(), ids[:, :kk].contiguous(), rescan

    def _rescore_near_ties(self, q: torch.Tensor, vals: torch.Tensor, ids: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """faiss BLAS candidates (B, w) -> the same, re-sorted, scores within ``tol`` (B, 1) of a
        neighbour's replaced by :func:`canonical_scores` (copies then tie), and ``tol``:
        max(32, 2 sqrt(d)) ulps of |q| max |x|."""
        if self._max_norm is None:  # float32 rows: a reduction, no copy; NaN / inf rows left out
            norms = torch.linalg.vector_norm(self.vectors, dim=1)
            self._max_norm = float(norms.nan_to_num(0.0, posinf=0.0).max())
        ulps = max(32.0, 2.0 * self.dim ** 0.5) * 2.0**-24
        tol = torch.linalg.vector_norm(q, dim=1, keepdim=True) * (self._max_norm * ulps)
        pairs = F.pad(vals[:, :-1] - vals[:, 1:] <= tol, (1, 1))  # False beyond both ends
        rows, cols = (pairs[:, :-1] | pairs[:, 1:]).nonzero(as_tuple=True)
        if not rows.numel():
            return vals, ids, tol
        vals = vals.clone()
        step = max(1, self.memory_budget // (RESCORE_PAIR_BYTES * self.dim))
        for s in range(0, rows.numel(), step):
            r, c = rows[s:s + step], cols[s:s + step]
            vals[r, c] = canonical_scores(q[r], self.vectors[ids[r, c]])
        vals, pos = torch.sort(vals, dim=1, descending=True, stable=True)
        return vals, ids.gather(1, pos), tol

    def _torch_pass(self, q: torch.Tensor, w: int, chunk: int, buf: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Top-w of (B, d) float32 queries by (B, chunk) score blocks and :func:`topk_wide`, or
        by :mod:`..triton_topk`'s tiles where they serve a chunk; and the scoring error (B, 1):
        inf for the rows the tiles leave unsettled (searched again), else 0."""
        best_v, best_i, unsettled = None, None, torch.zeros(q.shape[0], dtype=torch.bool,
                                                            device=q.device)
        for c in range(0, self.ntotal, chunk):
            rows = self.vectors[c:c + chunk]
            got = _tile_topw(q, rows, w)
            if got is None:
                block = _scores(q, rows, buf)
                v, i = topk_wide(block, w)
                del block  # CUDA: freed before the next block is allocated
            else:
                v, i, u = got
                unsettled |= u
            if best_v is None:  # the tiles' lists come sorted: one chunk needs no sort
                best_v, best_i, ordered = v, i + c, got is not None
                continue
            best_v, pos = torch.topk(torch.cat([best_v, v], 1),
                                     min(w, best_v.shape[1] + v.shape[1]), dim=1, sorted=False)
            best_i, ordered = torch.cat([best_i, i + c], 1).gather(1, pos), False
        if not ordered:
            best_v, pos = torch.sort(best_v, dim=1, descending=True)
            best_i = best_i.gather(1, pos)
        return best_v, best_i, torch.where(unsettled[:, None], float("inf"), 0.0)

    def _faiss_pass(self, faiss: Any, q: torch.Tensor, w: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_torch_pass` by faiss' exhaustive inner-product search (CPU, float32)."""
        with faiss_threads(faiss, torch.get_num_threads()):
            dist, ids = faiss.knn(to_numpy(q), to_numpy(self.vectors), w,
                                  metric=faiss.METRIC_INNER_PRODUCT)
        return as_tensor(dist), as_tensor(ids)

    @classmethod
    def load(cls, directory: str | Path, params: ExactParams | dict | None = None,
             device: DeviceLike = None, mmap: bool = False) -> "ExactIndex":
        """Read ``vectors.npy``; ``mmap=True`` maps it (copy-on-write) on a CPU device."""
        out, path = cls(params, device), cls._saved_file(directory, "vectors.npy")
        v = load_tensor(path, out.device, mmap=mmap)
        if v.ndim != 2 or v.dtype != out._dtype or (v.numel() and not all_finite(v)):
            raise FormatError(f"{path} holds {v.dtype} shape "
                              f"{tuple(v.shape)}; expected a 2-D {out.params.dtype} matrix of "
                              f"finite numbers")
        out._store(v)
        return out

    # -- the working-memory model (checked in tests/test_exact_memory.py) --------------------
    def _plan(self, b: int, kk: int, w: int | None = None) -> tuple[Any, int, int]:
        """(faiss or None, query batch, corpus chunk) of a pass for top-w lists: faiss on the
        CPU (float32) for its BLAS path (where its BLAS is tuned) or one query on one thread."""
        w = w or self._pass_width(kk)
        faiss = optional_faiss() if self.device.type == "cpu" and \
            self._dtype == torch.float32 else None
        if faiss is not None:
            q_batch = max(1, min(b, self.memory_budget // self._work_bytes(1, 0, w, faiss=True)))
            blas = q_batch * self.dim >= faiss.cvar.distance_compute_blas_threshold
            if blas and faiss_blas_is_tuned() or q_batch == 1 and torch.get_num_threads() == 1:
                return faiss, q_batch, self.ntotal
        return (None, *self._block_shape(b, kk, w))

    def _pass_width(self, kk: int) -> int:
        """Candidates per query of a first pass: kk + ``TIE_MARGIN``, at most the index."""
        return min(kk + TIE_MARGIN, self.ntotal)

    def _block_shape(self, b: int, kk: int, w: int | None = None) -> tuple[int, int]:
        """Up to ``MAX_BATCH`` queries and the longest chunk in the budget; if shorter than
        min(n, max(w, ``MIN_CHUNK``)) rows, that many and the queries that fit (>= 1)."""
        n, budget = self.ntotal, self.memory_budget
        w = w or self._pass_width(kk)
        q_batch, floor = min(b, MAX_BATCH), min(n, max(w, MIN_CHUNK))
        fixed, per_row = self._work_bytes(q_batch, 0, w), self._work_bytes(q_batch, 1, w)
        chunk = min(n, (budget - fixed) // (per_row - fixed))  # the cost is linear in both
        if floor <= chunk < n:  # whole 1024s: aligned rows for the GEMM and topk_wide
            chunk = max(floor, chunk - chunk % MIN_CHUNK)
        if chunk < floor:
            fixed, per_query = self._work_bytes(0, floor, w), self._work_bytes(1, floor, w)
            return max(1, min(q_batch, (budget - fixed) // (per_query - fixed))), floor
        return q_batch, chunk

    def _work_bytes(self, q_batch: int, chunk: int, w: int, faiss: bool = False) -> int:
        """Bytes a pass holds: per query its row, top-w lists and faiss' workspaces, or a torch
        pass's block and its selection, ``SUB_ROWS`` scores (CPU) and per chunk row upcasts and
        top-k queues."""
        per_query = 4 * self.dim + LIST_SLOT_BYTES * w
        if faiss:
            return q_batch * (per_query + FAISS_QUERY_BYTES + FAISS_SLOT_BYTES * w)
        cpu = self.device.type == "cpu"
        upcast = self._dtype != torch.float32 and (cpu or not _MM_OUT_DTYPE.get(
            str(self.device), True))
        per_row = 4 * self.dim * upcast + TOPK_QUEUE_BYTES * torch.get_num_threads() * cpu
        cells = q_batch * chunk  # a block's scores: 4 bytes each, topk_wide < 1 (CPU) / 2 more
        return (5 if cpu else 6) * cells + (per_query + 4 * SUB_ROWS * cpu) * q_batch + \
            per_row * chunk


LIST_SLOT_BYTES = 128   # per (query, top-w slot): ~10 float32 / int64 copies of the lists
FAISS_SLOT_BYTES = 64   # ... more per slot of a faiss pass: its reservoir, near-tie rescoring
FAISS_QUERY_BYTES = 4096  # per query of a faiss pass: its share of faiss' 1024-row score tile
RESCORE_PAIR_BYTES = 8 * 36  # per pair and dimension rescored at once
TOPK_QUEUE_BYTES = 16   # per chunk row and thread: torch's CPU top-k queue
TIE_MARGIN = 8          # first-pass candidates beyond k
MAX_BATCH = 8192        # queries per block, at most
MIN_CHUNK = 1024        # rows per block, at least (or w)
SUB_ROWS = 1024         # rows per CPU GEMM (_scores)


def default_memory_budget(device: torch.device) -> int:
    """256 MiB on the CPU; on CUDA a quarter of the free memory (with torch's unused cached
    blocks), at least 64 KiB."""
    if device.type != "cuda":
        return 256 * 2**20
    free, _ = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats_as_nested_dict(device)  # {} before torch's first allocation
    cached = [stats.get(f"{kind}_bytes", {}).get("all", {}).get("current", 0)
              for kind in ("reserved", "allocated")]
    return max(2**16, (free + cached[0] - cached[1]) // 4)


def canonical_scores(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(..., d) queries and rows (broadcast) -> (...) float32 inner products rounded once from
    float64: the same two vectors always get the same score."""
    return (q.double() * x.double()).sum(-1).float()


def _tile_topw(q: torch.Tensor, rows: torch.Tensor, w: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:func:`..triton_topk.tile_topw` where it serves 16-bit ``rows``, else None (imported
    only then: it imports Triton; CPU rows only where the tests turned its interpreter on)."""
    if rows.dtype == torch.float32 or not (rows.is_cuda or "pefa_gpu.triton_topk" in sys.modules):
        return None
    from .. import triton_topk  # noqa: PLC0415

    return triton_topk.tile_topw(q, rows, w) if triton_topk.usable(rows, w) else None


_MM_OUT_DTYPE: dict[str, bool] = {}  # device -> torch.mm(..., out_dtype=float32) works there


def _scores(q: torch.Tensor, rows: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor:
    """(B, d) float32 queries x (c, d) rows -> (B, c) float32 inner products. CPU: into ``buf``
    (B (c + ``SUB_ROWS``) float32), for B > 1 in GEMMs of exactly ``SUB_ROWS`` rows, so a pair
    scores alike wherever its row sits (copies tie, shards equal the whole). CUDA, 16-bit rows:
    ``torch.mm(..., out_dtype=float32)`` where torch has it."""
    b, c = q.shape[0], rows.shape[0]
    if rows.is_cuda:
        key = str(rows.device)
        if rows.dtype != torch.float32 and _MM_OUT_DTYPE.get(key, True):
            try:
                return torch.mm(q.to(rows.dtype), rows.T, out_dtype=torch.float32)
            except (RuntimeError, TypeError, NotImplementedError):
                _MM_OUT_DTYPE[key] = False
        return q @ rows.float().T
    out = buf[:b * c].view(b, c)
    if b == 1:
        return torch.mm(q, rows.float().T, out=out)
    part = buf[b * c:b * (c + SUB_ROWS)].view(SUB_ROWS, b)
    for s in range(0, c, SUB_ROWS):
        r = rows[s:s + SUB_ROWS].float()
        m = r.shape[0]
        if m < SUB_ROWS:
            r = torch.cat([r, r.new_zeros(SUB_ROWS - m, r.shape[1])])
        out[:, s:s + m] = torch.mm(r, q.T, out=part)[:m].T
    return out
