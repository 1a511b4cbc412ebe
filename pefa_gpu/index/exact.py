"""Exact maximum-inner-product search: blocked matmul + top-k, on CPU or CUDA.

Every path returns the exact top-k of float32 inner products, ties to the lower id:

- A first pass by value. Each (query batch x corpus chunk) block of scores is reduced to its
  top-(k + ``TIE_MARGIN``) by value alone (equal values in any order) and the per-chunk lists
  are merged the same way.
  * CPU, float32 storage, faiss installed, and a batch large enough for faiss' BLAS path (or
    a single query on one thread): faiss' exhaustive inner-product search (BLAS blocks and a
    heap, what ``faiss.IndexFlatIP`` runs) asked for k + ``TIE_MARGIN`` results. On its BLAS
    path, OpenBLAS gives copies of one document scores a few ulps apart, depending on where they
    sit in its blocks, so copies among the candidates whose scores lie within the scoring
    error (:func:`tie_ulps`) of a neighbour's are rescored pair by pair
    (:func:`canonical_scores`, a function of the two vectors alone) and the row re-sorted.
  * Otherwise (CUDA, 16-bit storage, no faiss, smaller CPU batches): torch matmul blocks and
    ``torch.topk``. On the CPU, batches of 2 or more queries are scored rows x queries in
    GEMMs of one shape (:func:`_row_scores`: faster for few queries, and MKL then scores
    copies alike in every block and shard; fewer than 16 queries padded to a power of two),
    and for 16 queries or more over a long index each block after the first is screened
    against the running top-w (:func:`_above`: one max pass, then only the groups of rows
    that can enter it), instead of a full ``torch.topk`` per block.
- The tie rule. A row whose k-th and (k+1)-th scores differ has its top-k set fixed by value;
  equal scores inside it are put in id order on the (B, k) result. A row whose k-th and
  (k+1)-th scores are equal, and whose last candidate scores lower (by more than twice the
  scoring error after faiss), holds every column of that score among its candidates: the tie
  rule picks from them (pefa_gpu.topk.merge_topk).
- Other rows (more than ``TIE_MARGIN`` equal scores at the boundary: duplicated documents,
  say) are searched again from scratch with torch blocks, :func:`pefa_gpu.topk.topk_rows` and
  :func:`merge_topk` (scores recomputed: BLAS results may differ in the last bit with the
  batch shape, so the first pass's k-th value is not reused). On CUDA, finding those rows is
  the one host synchronisation of a search: exactly one when k + ``TIE_MARGIN`` < n, none
  otherwise (the candidates then hold the whole index).

``ExactParams.memory_budget`` bounds the working memory of a search besides its (B, k) result:
score blocks, the float32 query batch, top-k lists and every top-k workspace (torch's CPU top-k
queue, faiss' score tile and reservoirs); see :meth:`ExactIndex._work_bytes`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from ..arrays import as_tensor, check_topk, host_empty, resolve_dtype, to_numpy
from ..errors import FormatError, InputError
from ..params import Params, check_choice
from ..storage import load_tensor, save_tensor
from ..topk import (PAD_ID, PAD_SCORE, boundary_tied, masked, merge_topk, order_ties,
                    pad_topk, topk_rows)
from .base import Index


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExactParams(Params):
    """dtype: storage of the vectors ('float32', 'float16', 'bfloat16'); scores are always
    accumulated in float32. memory_budget: bytes a search may hold besides its (B, k) result
    (score blocks, query batch, top-k lists and workspaces); the B x n score matrix is never
    materialised beyond it. None: :func:`default_memory_budget` of the index's device at each
    search (256 MiB on the CPU, a share of the free memory on CUDA)."""

    dtype: str = "float32"
    memory_budget: int | None = None

    def validate(self) -> None:
        check_choice(self.dtype, "dtype", ("float32", "float16", "bfloat16"))
        if self.memory_budget is not None and (
                isinstance(self.memory_budget, bool) or not isinstance(self.memory_budget, int)
                or self.memory_budget < 2**16):
            raise InputError(f"memory_budget must be None or an int >= 65536 bytes, "
                             f"got {self.memory_budget!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExactSearchParams(Params):
    """An exact search has no search settings."""


class ExactIndex(Index):
    """Brute-force inner-product search. Ties go to the lower id."""

    name = "exact"
    distinct_ids = True  # a top-k over the stored rows
    Params = ExactParams
    SearchParams = ExactSearchParams

    @property
    def exact_scores(self) -> bool:
        """True when search scores are exact fp32 inner products of the given vectors."""
        return self.params.dtype == "float32"

    def __init__(self, params: ExactParams | dict | None = None, device: Any = None):
        super().__init__(params, device)
        self._dtype = resolve_dtype(self.params.dtype)
        self.vectors = torch.empty(0, 0, dtype=self._dtype, device=self.device)
        self._stats: tuple[float, torch.Tensor, torch.Tensor] | None = None  # see _row_stats

    @property
    def ntotal(self) -> int:
        return int(self.vectors.shape[0])

    @property
    def memory_budget(self) -> int:
        """The working-memory budget of a search now: ``params.memory_budget``, or when that is
        None :func:`default_memory_budget` of the device."""
        given = self.params.memory_budget
        return default_memory_budget(self.device) if given is None else given

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[1])

    def build(self, vectors: torch.Tensor) -> "ExactIndex":
        v = as_tensor(vectors, device=self.device, name="vectors").detach()
        if v.ndim != 2:
            raise InputError(f"vectors must be 2-D, got shape {tuple(v.shape)}")
        self.vectors = v.to(self._dtype).contiguous()
        self._stats = None
        self._owned = False  # may share memory with the caller's tensor: update() copies first
        return self

    def add(self, vectors: torch.Tensor) -> None:
        v = as_tensor(vectors, device=self.device, name="vectors").detach().to(self._dtype)
        if self.ntotal == 0 and self.dim == 0:
            self.build(v)
            return
        if v.ndim != 2 or v.shape[1] != self.dim:
            raise InputError(f"vectors must have shape (rows, {self.dim}), got {tuple(v.shape)}")
        self.vectors = torch.cat([self.vectors, v])
        self._stats = None
        self._owned = True

    def update(self, ids: torch.Tensor, vectors: torch.Tensor) -> None:
        """Overwrite rows ``ids`` (r,) with ``vectors`` (r, d): O(r d), plus one copy of the
        whole matrix the first time if it may share memory with the array it was built from."""
        i = as_tensor(ids, device=self.device, name="ids").detach().flatten()
        v = as_tensor(vectors, device=self.device, name="vectors").detach()
        if i.is_floating_point():
            raise InputError(f"ids must be integers, got dtype {i.dtype}")
        if v.ndim != 2 or v.shape != (i.numel(), self.dim):
            raise InputError(f"vectors must have shape ({i.numel()}, {self.dim}) for "
                             f"{i.numel()} ids, got {tuple(v.shape)}")
        i = i.long()
        if i.numel() and (int(i.min()) < 0 or int(i.max()) >= self.ntotal):
            bad = i[(i < 0) | (i >= self.ntotal)][:5].tolist()
            raise InputError(f"ids out of range [0, {self.ntotal}): {bad}")
        if i.unique().numel() != i.numel():
            raise InputError("ids must not repeat")
        if not getattr(self, "_owned", False):
            self.vectors = self.vectors.clone()
            self._owned = True
        self.vectors[i] = v.to(self._dtype)
        self._stats = None

    def reconstruct(self, ids: torch.Tensor) -> torch.Tensor:
        """Stored rows ``ids`` (any shape, valid int64 ids, not checked: no host sync) ->
        (*ids.shape, d) float32."""
        return self.vectors[ids].float()

    def search(self, queries: torch.Tensor, k: int, params: Params | dict | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``params``: exact search has no search settings (only ``{}`` or None)."""
        self.resolve_search_params(params)
        k = check_topk(k, self.ntotal, "k")
        q = as_tensor(queries, device=self.device, name="queries").detach()
        if q.ndim != 2 or (self.ntotal and q.shape[1] != self.dim):
            raise InputError(f"queries must have shape (B, {self.dim}), got {tuple(q.shape)}")
        b, n = q.shape[0], self.ntotal
        if b == 0 or n == 0:
            return (torch.full((b, k), PAD_SCORE, device=self.device),
                    torch.full((b, k), PAD_ID, dtype=torch.long, device=self.device))
        kk = min(k, n)
        faiss, q_batch, chunk = self._plan(b, kk)
        # the CPU score blocks of every batch share one buffer: allocated once, a block maps
        # no fresh pages (and freeing one before the next could leave two resident)
        buf = None if faiss or q.is_cuda else host_empty(min(q_batch, b) * min(chunk, n))
        if q_batch >= b:  # one batch: no copy into a preallocated result
            vals, ids, rescan = self._first_pass(faiss, q, kk, chunk, buf)
        else:
            vals = torch.full((b, k), PAD_SCORE, device=self.device)
            ids = torch.full((b, k), PAD_ID, dtype=torch.long, device=self.device)
            rescan = torch.zeros(b, dtype=torch.bool, device=self.device) \
                if self._pass_width(kk) < n else None
            for s in range(0, b, q_batch):
                v, i, t = self._first_pass(faiss, q[s:s + q_batch], kk, chunk, buf)
                vals[s:s + q_batch, :kk], ids[s:s + q_batch, :kk] = v, i
                if t is not None:
                    rescan[s:s + q_batch] = t
        if rescan is not None:
            rows = rescan.nonzero().squeeze(1)  # on CUDA: the one host synchronisation
            if rows.numel():
                vals[rows, :kk], ids[rows, :kk] = self._exact_rows(q[rows], kk)
        return pad_topk(vals, ids, k)

    def _first_pass(self, faiss: Any, q: torch.Tensor, kk: int, chunk: int,
                    buf: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(B, d) queries -> (B, kk) scores sorted descending, ids with the tie rule, and
        ``rescan`` (B,) bool: rows whose run of scores equal to the kk-th reaches past the
        candidates, so that their top-kk needs another pass (None when the candidates
        hold the whole index: no row needs it). ``buf``: see :meth:`_torch_pass`."""
        tol = torch.zeros((), device=self.device)
        if faiss is None:
            vals, ids = self._torch_pass(q, kk, chunk, buf)  # MKL scores copies alike
        else:
            vals, ids = self._faiss_pass(faiss, q, kk)
            if q.shape[0] * self.dim >= faiss.cvar.distance_compute_blas_threshold:
                # faiss' BLAS blocks score copies of a document apart: rescore near ties
                qf = q.float()
                tol = self._tie_tolerance(qf)
                vals, ids = self._rescore_near_ties(qf, vals, ids, tol)
        if vals.shape[1] == kk:
            return (*order_ties(vals, ids), None)
        tied = boundary_tied(vals, kk)
        # A row holds every column that may score its kk-th score or more when its last
        # candidate scores lower by more than two scoring errors (torch: lower); a tied row
        # that does is settled from its candidates, the others are searched again.
        rescan = vals[:, kk - 1] - vals[:, -1] <= 2 * tol.squeeze(-1) \
            if vals.shape[1] < self.ntotal else None
        settle = tied if rescan is None else tied & ~rescan
        if masked(vals):  # every row under a mask (CUDA): no synchronisation
            vals, ids = settle_masked(vals, ids, settle, kk)
        else:
            rows = settle.nonzero().squeeze(1)
            top_v, top_i = vals[:, :kk], ids[:, :kk]
            if rows.numel():
                v, i = merge_topk(vals[rows], ids[rows], kk)
                top_v, top_i = top_v.index_copy(0, rows, v), top_i.index_copy(0, rows, i)
            vals, ids = top_v, top_i
        return (*order_ties(vals, ids), rescan)

    def _tie_tolerance(self, q: torch.Tensor) -> torch.Tensor:
        """(B, d) float32 queries -> (B, 1) float32 bound on how far a first-pass score may lie
        from another computation of the same inner product: ``tie_ulps(d)`` units in the last
        place of |q| max |x| (a blocked BLAS sum differed from the float64 value by at most ~4
        of them on the shapes measured, OpenBLAS and MKL alike)."""
        max_norm = self._row_stats()[0]
        qn = torch.linalg.vector_norm(q, dim=1, keepdim=True)
        return qn * (max_norm * tie_ulps(self.dim) * 2.0**-24)

    def _row_stats(self) -> tuple[float, torch.Tensor, torch.Tensor]:
        """(largest stored row norm, (n,) int64 key of each row: an integer sum of the bits of
        ``KEY_DIMS`` of its coordinates, so equal rows have equal keys and other rows almost
        never do; a shared key only costs a rescoring, (n,) bool: the rows whose key another
        row shares), computed on first use in blocks within the memory budget (besides one
        sort of the keys: 16 bytes a row, once) and kept with the index (9 bytes a row)."""
        if self._stats is None:
            step = max(1, self.memory_budget // (8 * self.dim))
            dims = torch.linspace(0, self.dim - 1, min(KEY_DIMS, self.dim)).long().to(self.device)
            weights = torch.randint(-2**62, 2**62, (dims.numel(),), device=self.device,
                                    generator=torch.Generator(self.device).manual_seed(0))
            norms, parts = [], []
            for s in range(0, self.ntotal, step):
                rows = self.vectors[s:s + step].float()
                norms.append(float(torch.linalg.vector_norm(rows, dim=1).max()))
                bits = (rows[:, dims] + 0.0).view(torch.int32).long()  # + 0.0: -0.0 -> 0.0
                parts.append((bits * weights).sum(1))
            keys = torch.cat(parts)
            sk = torch.sort(keys).values
            repeated = sk[1:][sk[1:] == sk[:-1]].unique()
            del sk
            shared = torch.cat([torch.isin(keys[s:s + step], repeated)
                                for s in range(0, self.ntotal, step)])
            self._stats = (max(norms), keys, shared)
        return self._stats

    def _rescore_near_ties(self, q: torch.Tensor, vals: torch.Tensor, ids: torch.Tensor,
                           tol: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """CPU first-pass candidates (B, w), sorted descending, of (B, d) float32 queries ->
        the same, re-sorted, with the scores of copies (equal rows) that lie within ``tol``
        (B, 1) of a neighbour's replaced by :func:`canonical_scores`.

        A BLAS GEMM's score for a pair can depend in its last bits on where the pair sits in
        the blocks (OpenBLAS, hence faiss' BLAS path, gives copies of one document scores up
        to a few ulps apart), so equal vectors would not tie; a canonical score is a function
        of the two vectors alone. Copies always lie within ``tol`` of each other, and so of
        every candidate between them; other near ties keep their first-pass order (float32
        cannot order them either)."""
        if vals.shape[1] < 2:
            return vals, ids
        near = _both_sides(vals[:, :-1] - vals[:, 1:] <= tol)
        if not bool(near.any()):
            return vals, ids
        _, row_keys, shared = self._row_stats()
        near &= shared[ids]  # only a row whose key another row shares can have a copy
        if not bool(near.any()):
            return vals, ids
        keys = row_keys[ids] & (2**62 - 1)
        keys = torch.where(near, keys, -1 - torch.arange(vals.shape[1]))  # others: unique
        sk, pos = torch.sort(keys, dim=1)
        copy = _both_sides(sk[:, 1:] == sk[:, :-1])
        rows, cols = torch.zeros_like(near).scatter_(1, pos, copy).nonzero(as_tuple=True)
        if not rows.numel():
            return vals, ids
        vals = vals.clone()
        step = max(1, self.memory_budget // (RESCORE_PAIR_BYTES * self.dim))
        for s in range(0, rows.numel(), step):
            r, c = rows[s:s + step], cols[s:s + step]
            vals[r, c] = canonical_scores(q[r], self.vectors[ids[r, c]])
        vals, pos = torch.sort(vals, dim=1, descending=True, stable=True)
        return vals, ids.gather(1, pos)

    def _torch_pass(self, q: torch.Tensor, kk: int, chunk: int, buf: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-w by value (w = :meth:`_pass_width`) of each query over the index: (B, w) scores
        sorted descending, equal values in any order, and their ids. Blocks of (B, chunk)
        scores, each reduced by one ``torch.topk`` and merged by another (CUDA: no host
        synchronisation), or on the CPU, for an index long enough (:meth:`_screens`),
        :meth:`_screened_pass`. CPU blocks are written into ``buf`` (at least B min(chunk, n)
        float32) when given."""
        n = self.ntotal
        w = self._pass_width(kk)
        q = q.float()
        if self._screens(w, q.shape[0]):
            return self._screened_pass(q, w, chunk, buf)
        if chunk >= n:
            return torch.topk(_scores(q, self.vectors, buf), w, dim=1)
        best_v = best_i = None
        for c in range(0, n, chunk):
            block = _scores(q, self.vectors[c:c + chunk], buf)
            v, i = torch.topk(block, min(w, block.shape[1]), dim=1, sorted=False)
            del block  # CUDA: freed before the next block is allocated
            best_v, best_i = _merge_by_value(best_v, best_i, v, i + c, w)
        best_v, pos = torch.sort(best_v, dim=1, descending=True)
        return best_v, best_i.gather(1, pos)

    def _screens(self, w: int, b: int) -> bool:
        """Whether a CPU first pass of ``b`` queries for top-w lists screens its blocks
        (:meth:`_screened_pass`): for ``SCREEN_MIN_BATCH`` queries or more (scored rows x
        queries) over an index of at least ``SCREEN_ROWS_PER_W`` w rows, so that most blocks
        come after the running top-w has settled."""
        return self.device.type == "cpu" and b >= SCREEN_MIN_BATCH and \
            self.ntotal >= SCREEN_ROWS_PER_W * w

    def _screened_pass(self, q: torch.Tensor, w: int, chunk: int, buf: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_torch_pass` on the CPU for (B, d) float32 queries: blocks of (chunk, B)
        scores (:func:`_row_scores`); the first reduced by ``torch.topk``, a later one only
        where a group of ``GROUP_ROWS`` rows holds a score above the query's running w-th
        best (one max pass over the block: for a query, later blocks rarely beat its running
        top-w), or by ``torch.topk`` again when many groups do."""
        b = q.shape[0]
        best_v = best_i = thr = None
        for c in range(0, self.ntotal, chunk):
            rows = self.vectors[c:c + chunk]
            m = rows.shape[0]
            block = _row_scores(rows, q, torch.empty(m, b, device=q.device) if buf is None
                                else buf)
            found = None if thr is None else _above(block, thr)
            if found is None:
                v, i = torch.topk(block, min(w, m), dim=0, sorted=False)
                v, i = v.T, i.T
            elif found[0].numel() == 0:
                continue
            else:
                v, i = found
            best_v, best_i = _merge_by_value(best_v, best_i, v, i + c, w)
            if best_v.shape[1] == w:  # NaN ranks first (as in torch.topk): not a threshold
                thr = torch.where(best_v.isnan(), float("inf"), best_v).amin(1)
        best_v, pos = torch.sort(best_v, dim=1, descending=True)
        return best_v, best_i.gather(1, pos)

    def _faiss_pass(self, faiss: Any, q: torch.Tensor, kk: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_torch_pass` by faiss' exhaustive inner-product search (CPU, float32)."""
        n, d = self.ntotal, self.dim
        w = self._pass_width(kk)
        qn = np.ascontiguousarray(to_numpy(q), dtype=np.float32)
        xb = to_numpy(self.vectors)
        dist = np.empty((qn.shape[0], w), np.float32)
        ids = np.empty((qn.shape[0], w), np.int64)
        with faiss_threads(faiss, torch.get_num_threads()):
            faiss.knn_inner_product(faiss.swig_ptr(qn), faiss.swig_ptr(xb), d, qn.shape[0], n, w,
                                    faiss.swig_ptr(dist), faiss.swig_ptr(ids))
        return as_tensor(dist), as_tensor(ids)

    def _exact_rows(self, q: torch.Tensor, kk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(R, d) queries -> (R, kk) exact top-kk with the tie rule, every block reduced by
        :func:`topk_rows` and merged by :func:`merge_topk` (for the few rows whose first pass
        could not settle the kk-th place)."""
        n = self.ntotal
        q_batch, chunk = self._block_shape(q.shape[0], kk, exact=True)
        out_v, out_i = [], []
        for s in range(0, q.shape[0], q_batch):
            qb = q[s:s + q_batch].float()
            best_v = best_i = None
            for c in range(0, n, chunk):
                v, i = topk_rows(_scores(qb, self.vectors[c:c + chunk]), kk, offset=c)
                if best_v is not None:
                    v, i = merge_topk(torch.cat([best_v, v], 1), torch.cat([best_i, i], 1), kk)
                best_v, best_i = v, i
            out_v.append(best_v)
            out_i.append(best_i)
        return torch.cat(out_v), torch.cat(out_i)

    def save(self, directory: str | Path) -> None:
        """Write ``vectors.npy`` (ntotal, dim) in the storage dtype into ``directory``."""
        save_tensor(Path(directory) / "vectors", self.vectors)

    @classmethod
    def load(cls, directory: str | Path, params: ExactParams | dict | None = None,
             device: Any = None, mmap: bool = False) -> "ExactIndex":
        """Read ``vectors.npy``; ``mmap=True`` maps it (copy-on-write) on a CPU device."""
        out = cls(params, device)
        v = load_tensor(Path(directory) / "vectors.npy", out.device, mmap=mmap)
        if v.ndim != 2 or v.dtype != out._dtype:
            raise FormatError(f"{Path(directory) / 'vectors.npy'} holds {v.dtype} shape "
                              f"{tuple(v.shape)}; expected a 2-D {out.params.dtype} matrix")
        out.vectors = v
        out._stats = None
        return out

    def _plan(self, b: int, kk: int) -> tuple[Any, int, int]:
        """(faiss module or None, query batch, corpus chunk) of the first pass.

        faiss runs it on the CPU for float32 storage when it is installed and either its BLAS
        path applies (``batch d >= faiss.cvar.distance_compute_blas_threshold``, 128000 in faiss
        1.15: faiss' heap beats ``torch.topk`` after the same GEMM) or a single query runs on
        one thread (faiss' SIMD loop reads the corpus faster than MKL's GEMV on the CPUs
        measured). In between faiss scores query by query, reading the corpus once per query,
        and the torch pass (one GEMM per block) is several times faster
        (benchmarks/results/exact.md)."""
        faiss = _faiss_module() if self.device.type == "cpu" and \
            self._dtype == torch.float32 else None
        if faiss is not None:
            q_batch = self._faiss_batch(b, kk)
            if q_batch * self.dim >= faiss.cvar.distance_compute_blas_threshold or \
                    (q_batch == 1 and torch.get_num_threads() == 1):
                return faiss, q_batch, self.ntotal
        return (None, *self._block_shape(b, kk))

    def _pass_width(self, kk: int) -> int:
        """Candidates per query of a first pass: kk + ``TIE_MARGIN``, at most the index."""
        return min(kk + TIE_MARGIN, self.ntotal)

    def _block_shape(self, b: int, kk: int, exact: bool = False) -> tuple[int, int]:
        """Query batch and corpus chunk of a torch pass whose working memory
        (:meth:`_work_bytes`) fits the budget; w = :meth:`_pass_width`. CPU: chunks of
        ``CPU_CHUNK`` rows, or ``CHUNK_PER_K`` w for large k (GEMM blocks that stay in cache,
        per-chunk top-k rows long enough to be cheap), as many queries as fit (up to
        ``CPU_BATCH``); a screened pass takes at least ``SCREEN_CHUNK_PER_W`` w and
        ``CPU_BLOCK`` / B rows (fewer blocks before the running top-w settles), an unscreened
        one, when every query fits, longer chunks; for batches scored by :func:`_row_scores`
        a multiple of ``SUB_ROWS`` rows. CUDA: up to ``CUDA_BATCH`` queries and the longest
        chunk that fits. Floor: one query against min(n, max(w,
        ``MIN_CHUNK``)) rows, whatever the budget."""
        n, budget = self.ntotal, self.memory_budget
        w = self._pass_width(kk)
        cell, per_query, per_row = self._costs(w, exact)
        floor = min(n, max(w, MIN_CHUNK))

        def batch_for(chunk: int) -> int:
            return (budget - per_row * chunk) // (cell * chunk + per_query)

        def chunk_for(q_batch: int) -> int:
            return (budget - per_query * q_batch) // (cell * q_batch + per_row)

        if self.device.type == "cuda":
            q_batch = min(b, CUDA_BATCH)
            chunk = min(n, max(floor, chunk_for(q_batch)))
            q_batch = max(1, min(q_batch, batch_for(chunk)))
            return q_batch, chunk
        screens = not exact and self._screens(w, b)
        chunk = min(n, max(CPU_CHUNK, CHUNK_PER_K * w) if not screens else
                    max(CPU_CHUNK, SCREEN_CHUNK_PER_W * w, CPU_BLOCK // b))
        if batch_for(chunk) < 1:
            chunk = max(floor, min(chunk, chunk_for(1)))
        q_batch = max(1, min(b, CPU_BATCH, batch_for(chunk)))
        if q_batch == b and not screens:
            chunk = min(n, max(chunk, chunk_for(b)))
        if chunk < n and q_batch >= ROWS_FIRST_BATCH:  # whole GEMMs: no padded tail a chunk
            chunk = max(floor, chunk - chunk % SUB_ROWS)
        return q_batch, chunk

    def _work_bytes(self, q_batch: int, chunk: int, w: int, exact: bool = False) -> int:
        """Bytes a torch pass holds at once for (q_batch x chunk) score blocks and top-w lists
        (see :meth:`_costs`)."""
        cell, per_query, per_row = self._costs(w, exact)
        return cell * q_batch * chunk + per_query * q_batch + per_row * chunk

    def _costs(self, w: int, exact: bool) -> tuple[int, int, int]:
        """Bytes of a torch pass per score of a block (float32; plus ``FILTER_CELL_BYTES`` for
        :func:`_above` where a pass may be screened, or on the ``exact`` path
        ``EXACT_CELL_BYTES`` for :func:`topk_rows`' scratch), per query (its float32 row,
        ``LIST_SLOT_BYTES`` per slot of its top-w lists: running, per chunk, concatenated,
        merged, sorted, tie-ordered, twice as many slots on the exact path, whose merges take
        two full lists; CPU: two float32 columns of ``SUB_ROWS`` for :func:`_scores`) and per
        corpus row of a chunk (CPU: torch's top-k queue of each thread; 16-bit storage upcast
        to float32)."""
        cpu = self.device.type == "cpu"
        upcast = self._dtype != torch.float32 and (cpu or not _MM_OUT_DTYPE.get(
            str(self.device), True))
        screens = self._screens(w, SCREEN_MIN_BATCH)  # for some batch size
        cell = 4 + (EXACT_CELL_BYTES if exact else FILTER_CELL_BYTES * screens)
        per_query = 4 * self.dim + LIST_SLOT_BYTES * w * (2 if exact else 1) + \
            8 * SUB_ROWS * cpu
        per_row = 4 * self.dim * upcast + (TOPK_QUEUE_BYTES * torch.get_num_threads() if cpu else 0)
        return cell, per_query, per_row

    def _faiss_batch(self, b: int, kk: int) -> int:
        """Queries per faiss call: the most whose :meth:`_faiss_bytes` fit the budget (>= 1)."""
        w = self._pass_width(kk)
        budget = self.memory_budget
        if self._faiss_bytes(b, w) <= budget:
            return b
        lo, hi = 1, b  # _faiss_bytes grows with the batch
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self._faiss_bytes(mid, w) <= budget else (lo, mid - 1)
        return lo

    def _faiss_bytes(self, q_batch: int, w: int) -> int:
        """Bytes one faiss first pass holds for ``q_batch`` queries and top-w lists: the float32
        queries, ``LIST_SLOT_BYTES`` + ``RESCORE_SLOT_BYTES`` per list slot (faiss' (D, I)
        result, near-tie rescoring, the tie check and ordering), and faiss' own workspaces
        (``faiss/utils/distances.cpp``, 1.15): from ``nq d >= distance_compute_blas_threshold``
        on, a (tile x 1024) float32 score block for tiles of up to 4096 queries; from w >= 100
        on, a reservoir of ((2 w + 15) & ~15) (score, id) pairs per query of a tile (per thread
        on the query-by-query path)."""
        cv = _faiss_module().cvar
        blas = q_batch * self.dim >= cv.distance_compute_blas_threshold
        tile = min(q_batch, cv.distance_compute_blas_query_bs) if blas else \
            torch.get_num_threads()
        reservoir = ((2 * w + 15) & ~15) * 12 if w >= cv.distance_compute_min_k_reservoir else 0
        scores = 4 * cv.distance_compute_blas_database_bs if blas else 0
        return q_batch * (4 * self.dim + (LIST_SLOT_BYTES + RESCORE_SLOT_BYTES) * w) + \
            tile * (scores + reservoir)


def default_memory_budget(device: torch.device) -> int:
    """Bytes a search may use when ``ExactParams.memory_budget`` is None: ``CPU_BUDGET`` on the
    CPU; on CUDA 1 / ``CUDA_BUDGET_SHARE`` of what the device has free now (its free memory
    plus the blocks torch's allocator holds unused), at least 64 KiB (a fixed 256 MiB held a
    CUDA block of 4096 queries to ~12k rows of a 768-d index: 80 GEMM + top-k rounds at 1M)."""
    if device.type != "cuda":
        return CPU_BUDGET
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return max(2**16, (free + cached) // CUDA_BUDGET_SHARE)


def canonical_scores(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(..., d) queries and (..., d) stored rows (broadcast) -> (...) float32 inner products
    computed pair by pair (float64 products and sum, rounded once): the same two vectors
    always get the same score, wherever they sit in a batch."""
    return (q.double() * x.double()).sum(-1).float()


def _merge_by_value(best_v: torch.Tensor | None, best_i: torch.Tensor | None, v: torch.Tensor,
                    i: torch.Tensor, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Running top-w (B, <= w) and new candidates (B, c) -> top-w of both by value (unsorted,
    equal values in any order)."""
    if best_v is None:
        return v, i
    v, pos = torch.topk(torch.cat([best_v, v], 1), min(w, best_v.shape[1] + v.shape[1]),
                        dim=1, sorted=False)
    return v, torch.cat([best_i, i], 1).gather(1, pos)


def _above(block: torch.Tensor, thr: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A CPU score block (m, B) and each query's running w-th best score (B,) -> (B, c) scores
    and block rows of every group of ``GROUP_ROWS`` rows that holds a score above it or NaN (-inf,
    row 0 where a query has fewer; c = 0 when none does), or None when a query's groups would
    cover more than 1 / ``FILTER_SHARE`` of the block's rows (then a plain top-k is cheaper,
    and the (B, c) lists stay small)."""
    m, b = block.shape
    full = m - m % GROUP_ROWS
    top = block[:full].view(-1, GROUP_ROWS, b).amax(1)
    if full < m:
        top = torch.cat([top, block[full:].amax(0, keepdim=True)])
    hits = (top > thr) | top.isnan()  # (groups, B); a NaN score ranks first
    per_query = hits.sum(0)
    width = int(per_query.max()) * GROUP_ROWS
    if width * FILTER_SHARE > m:
        return None
    if width == 0:
        return block.new_empty(b, 0), block.new_empty(b, 0, dtype=torch.long)
    query, group = hits.T.nonzero(as_tuple=True)  # by query, then group
    span = torch.arange(GROUP_ROWS, device=block.device)
    slot = torch.arange(query.numel(), device=block.device) - \
        (torch.cumsum(per_query, 0) - per_query)[query]
    rows = group.unsqueeze(1) * GROUP_ROWS + span  # (hits, GROUP_ROWS)
    inside = rows < m
    rows = torch.where(inside, rows, 0)
    at = slot.unsqueeze(1) * GROUP_ROWS + span
    query = query.unsqueeze(1)
    vals = block.new_full((b, width), float("-inf"))
    ids = block.new_zeros((b, width), dtype=torch.long)
    vals[query, at] = torch.where(inside, block[rows, query], float("-inf"))
    ids[query, at] = rows
    return vals, ids


def _both_sides(pairs: torch.Tensor) -> torch.Tensor:
    """(B, w - 1) bool over neighbouring pairs -> (B, w) bool: both members of each marked
    pair."""
    out = torch.zeros((pairs.shape[0], pairs.shape[1] + 1), dtype=torch.bool, device=pairs.device)
    out[:, :-1] |= pairs
    out[:, 1:] |= pairs
    return out


def tie_ulps(dim: int) -> float:
    """Scoring-error allowance of :meth:`ExactIndex._tie_tolerance`, in ulps of |q| |x|: 32,
    or 2 sqrt(d) for d > 256 (rounding errors of a sum grow like its square root)."""
    return max(32.0, 2.0 * dim ** 0.5)


def settle_masked(vals: torch.Tensor, ids: torch.Tensor, settle: torch.Tensor, kk: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """First-pass candidates (B, w) sorted descending -> (B, kk): the rows where ``settle``
    (B,) bool by :func:`merge_topk` (the tie rule over the candidates), the others cut to kk;
    computed for every row under the mask (CUDA: no host synchronisation)."""
    v, i = merge_topk(vals, ids, kk)
    return (torch.where(settle.unsqueeze(1), v, vals[:, :kk]),
            torch.where(settle.unsqueeze(1), i, ids[:, :kk]))


# Working-memory model of a search (ExactIndex._work_bytes, _faiss_bytes), checked against
# measured peak resident memory in tests/test_exact_memory.py.
LIST_SLOT_BYTES = 128  # per (query, top-k slot): ~10 float32 / int64 copies of the lists
RESCORE_SLOT_BYTES = 40  # per slot of a faiss pass: near-tie masks, row keys, their sort
RESCORE_PAIR_BYTES = 8 * 36  # per pair and dimension rescored at once: an eighth of the budget
                             # for the gathered rows, their float64 copies and products
FILTER_CELL_BYTES = 5  # per score of a CPU block: the screen's group maxima, mask, candidates
GROUP_ROWS = 8         # rows of a CPU block screened by one maximum (_above) ...
FILTER_SHARE = 8       # ... while a query's screened groups cover at most 1/8 of its rows
TOPK_QUEUE_BYTES = 16  # per chunk row and thread: torch's CPU top-k (value, int64 index) queue
EXACT_CELL_BYTES = 16  # per score on the exact path: a copy of tied rows, masks, int32 keys
KEY_DIMS = 16          # coordinates a row's copy key reads (ExactIndex._row_stats)
TIE_MARGIN = 8         # first-pass candidates beyond k (see the module docstring)
SUB_ROWS = 1024        # rows per CPU GEMM (_row_scores) ...
ROWS_FIRST_BATCH = 2   # ... for batches of at least 2 queries (one query: a GEMV) ...
PAD_BATCH = 16         # ... padded to a power of two below 16 queries (_pad_batch)
CPU_CHUNK = 4096       # corpus rows per CPU block ...
CHUNK_PER_K = 8        # ... and at least 8 w (the first pass's candidates per query)
CPU_BLOCK = 2**20      # ... and a screened one at least 2^20 scores a block
SCREEN_MIN_BATCH = 16  # screened CPU passes: batches of at least 16 queries, ...
SCREEN_ROWS_PER_W = 256  # ... indices of at least 256 w rows, ...
SCREEN_CHUNK_PER_W = 32  # ... in chunks of at least 32 w rows
CPU_BATCH = 4096       # queries per CPU block, at most
CUDA_BATCH = 8192      # queries per CUDA block, at most
MIN_CHUNK = 1024
CPU_BUDGET = 256 * 2**20  # default search budget on the CPU (default_memory_budget) ...
CUDA_BUDGET_SHARE = 4     # ... and on CUDA: a quarter of the free device memory

@contextlib.contextmanager
def faiss_threads(faiss: Any, threads: int) -> Iterator[None]:
    """Run the block with faiss' OpenMP pool set to ``threads`` (0 = leave as is)."""
    if not threads:
        yield
        return
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(int(threads))
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)


_FAISS: list[Any] = []  # [the faiss module, or None when it is not installed]


def _faiss_module() -> Any:
    """faiss, imported on first use, or None when it is not installed."""
    if not _FAISS:
        try:
            import faiss  # noqa: PLC0415 (optional, imported lazily)
        except ImportError:
            faiss = None
        _FAISS.append(faiss)
    return _FAISS[0]


_MM_OUT_DTYPE: dict[str, bool] = {}  # device -> torch.mm(..., out_dtype=float32) works there


def _scores(q: torch.Tensor, rows: torch.Tensor, buf: torch.Tensor | None = None) -> torch.Tensor:
    """(B, d) float32 queries x (c, d) stored rows -> (B, c) float32 inner products, written
    into ``buf`` (a flat float32 CPU buffer of at least B c elements, reused by every block so
    that each block does not map fresh pages) when given.

    CPU, at least ``ROWS_FIRST_BATCH`` queries: :func:`_row_scores`, each part transposed into
    place; a batch of fewer than ``PAD_BATCH`` queries is scored as the next power of two
    (zero queries added, their scores dropped). One query, or CUDA with float32 storage: one
    GEMM (rows upcast on the CPU).
    16-bit storage on CUDA: one GEMM that reads both operands in the storage dtype
    (queries rounded to it), accumulates in float32 and writes float32
    (``torch.mm(..., out_dtype=float32)``), where this torch has it; otherwise the chunk is
    upcast.
    """
    if not rows.is_cuda and q.shape[0] >= ROWS_FIRST_BATCH:
        b, c = q.shape[0], rows.shape[0]
        out = torch.empty(b, c, device=q.device) if buf is None else buf[:b * c].view(b, c)
        qp = _pad_batch(q)
        part = torch.empty(SUB_ROWS, qp.shape[0], device=q.device)
        for s in range(0, c, SUB_ROWS):
            got = _row_scores(rows[s:s + SUB_ROWS], qp, part)
            out[:, s:s + got.shape[0]] = got[:, :b].T
        return out
    if rows.dtype == torch.float32 or not rows.is_cuda:
        if buf is None:
            return q @ rows.float().T
        out = buf[:q.shape[0] * rows.shape[0]].view(q.shape[0], rows.shape[0])
        return torch.mm(q, rows.float().T, out=out)
    key = str(rows.device)
    if _MM_OUT_DTYPE.get(key, True):
        try:
            return torch.mm(q.to(rows.dtype), rows.T, out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_OUT_DTYPE[key] = False
    return q @ rows.float().T


def _pad_batch(q: torch.Tensor) -> torch.Tensor:
    """(B, d) float32 CPU queries -> the same with zero rows added up to the next power of two
    when B < ``PAD_BATCH`` (MKL's rows x queries GEMM, 2 threads, AMD EPYC, 200k x 384: 12-15
    queries took 1.4-1.8x the time of 16, 3 queries 1.2x that of 4); other batches as they
    are."""
    b = q.shape[0]
    target = 1 << (b - 1).bit_length()
    if b >= PAD_BATCH or target == b:
        return q
    return torch.cat([q, q.new_zeros(target - b, q.shape[1])])


def _row_scores(rows: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """CPU (c, d) stored rows x (B, d) float32 queries -> (c, B) float32 inner products in
    ``out`` (at least c B elements, contiguous): one GEMM of exactly ``SUB_ROWS`` rows (a
    short tail zero-padded, rows upcast to float32) per ``SUB_ROWS`` rows.

    Every CPU score of a batch of ``ROWS_FIRST_BATCH`` or more queries is computed here, so
    a pair is scored by one GEMM shape for a given (d, B) whatever the pass, block or shard:
    MKL scores a pair alike wherever its row sits in one shape, not always across shapes, so
    copies of a document tie and sharded searches equal unsharded ones bit for bit. Rows x
    queries is also the faster product for few queries (MKL, 2 threads: up to 2x at B = 64,
    2-3.5x at B = 2-11 over 200k x 384)."""
    c, b = rows.shape[0], q.shape[0]
    res = out.view(-1)[:c * b].view(c, b)
    for s in range(0, c, SUB_ROWS):
        part = rows[s:s + SUB_ROWS].float()
        if part.shape[0] == SUB_ROWS:
            torch.mm(part, q.T, out=res[s:s + SUB_ROWS])
        else:
            padded = torch.zeros(SUB_ROWS, part.shape[1], device=q.device)
            padded[:part.shape[0]] = part
            res[s:] = (padded @ q.T)[:part.shape[0]]
    return res
