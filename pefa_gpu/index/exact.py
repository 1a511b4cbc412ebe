"""Exact maximum-inner-product search: chunked matmul + top-k, on CPU or CUDA."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from ..arrays import as_tensor, check_positive_int, resolve_dtype
from ..errors import FormatError, InputError
from ..params import Params, check_choice
from ..storage import load_tensor, save_tensor
from ..topk import merge_topk, topk_rows
from .base import Index


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExactParams(Params):
    """dtype: storage of the vectors ('float32', 'float16', 'bfloat16'); scores are always
    accumulated in float32. memory_budget: bytes for one block of scores (query batch x corpus
    chunk); the B x n score matrix is never materialised beyond it."""

    dtype: str = "float32"
    memory_budget: int = 256 * 2**20

    def validate(self) -> None:
        check_choice(self.dtype, "dtype", ("float32", "float16", "bfloat16"))
        if not isinstance(self.memory_budget, int) or self.memory_budget < 2**16:
            raise InputError(f"memory_budget must be an int >= 65536 bytes, "
                             f"got {self.memory_budget!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExactSearchParams(Params):
    """An exact search has no search settings."""


class ExactIndex(Index):
    """Brute-force inner-product search. Ties go to the lower id."""

    name = "exact"
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

    @property
    def ntotal(self) -> int:
        return int(self.vectors.shape[0])

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[1])

    def build(self, vectors: torch.Tensor) -> "ExactIndex":
        v = as_tensor(vectors, device=self.device, name="vectors").detach()
        if v.ndim != 2:
            raise InputError(f"vectors must be 2-D, got shape {tuple(v.shape)}")
        self.vectors = v.to(self._dtype).contiguous()
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

    def reconstruct(self, ids: torch.Tensor) -> torch.Tensor:
        """Stored rows ``ids`` (any shape, valid int64 ids, not checked: no host sync) ->
        (*ids.shape, d) float32."""
        return self.vectors[ids].float()

    def search(self, queries: torch.Tensor, k: int, params: Params | dict | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``params``: exact search has no search settings (only ``{}`` or None)."""
        self.resolve_search_params(params)
        k = check_positive_int(k, "k")
        q = as_tensor(queries, device=self.device, name="queries").detach().float()
        if q.ndim != 2 or (self.ntotal and q.shape[1] != self.dim):
            raise InputError(f"queries must have shape (B, {self.dim}), got {tuple(q.shape)}")
        b, n = q.shape[0], self.ntotal
        if b == 0 or n == 0:
            return (torch.full((b, k), float("-inf"), device=self.device),
                    torch.full((b, k), -1, dtype=torch.long, device=self.device))
        q_batch, chunk = self._block_shape(b, n, k)
        out_v, out_i = [], []
        for s in range(0, b, q_batch):
            qb = q[s:s + q_batch]
            best_v = best_i = None
            for c in range(0, n, chunk):
                block = _scores(qb, self.vectors[c:c + chunk])  # (qb, chunk) fp32
                v, i = topk_rows(block, k, offset=c)
                if best_v is None:
                    best_v, best_i = v, i
                else:
                    best_v, best_i = merge_topk(torch.cat([best_v, v], 1),
                                                torch.cat([best_i, i], 1), k)
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
        return out

    def _block_shape(self, b: int, n: int, k: int) -> tuple[int, int]:
        """Query batch and corpus chunk so that one fp32 score block fits the budget."""
        cells = max(self.params.memory_budget // 16, 1)  # scores + top-k workspace (~4 copies)
        q_batch = min(b, 4096)
        chunk = max(cells // q_batch, k, 1024)
        if chunk * q_batch > cells:
            q_batch = max(1, cells // chunk)
        return q_batch, min(chunk, n)


_MM_OUT_DTYPE: dict[str, bool] = {}  # device -> torch.mm(..., out_dtype=float32) works there


def _scores(q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(B, d) float32 queries x (c, d) stored rows -> (B, c) float32 inner products.

    float32 storage, or the CPU: the rows are upcast and multiplied in float32. 16-bit storage
    on CUDA: one GEMM that reads both operands in the storage dtype (queries rounded to it),
    accumulates in float32 and writes float32 (``torch.mm(..., out_dtype=float32)``), where
    this torch has it; otherwise the chunk is upcast.
    """
    if rows.dtype == torch.float32 or not rows.is_cuda:
        return q @ rows.float().T
    key = str(rows.device)
    if _MM_OUT_DTYPE.get(key, True):
        try:
            return torch.mm(q.to(rows.dtype), rows.T, out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_OUT_DTYPE[key] = False
    return q @ rows.float().T
