"""Out-of-core PIFA: A = Yᵀ Q with Q streamed in row chunks under a memory budget.

For each chunk of rows R of Q: ``A += Y[R]ᵀ @ Q[R]``, using only the CSR entries of those rows.
On the CPU the product accumulates in place (scipy's CSC kernel over the rows of Y, no n x d
temporary); on CUDA the chunk goes through two pinned host buffers and a copy stream, so the
read of chunk i+1 and its host-to-device copy overlap the product of chunk i.

Memory: ``memory_budget`` bytes cover the output (n x d float32) and every buffer this call
allocates (read buffers, pinned and device copies, the float32 conversion, the gather
workspace); Y itself (already in memory) is not counted.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from .arrays import as_tensor, to_numpy
from .errors import InputError
from .relevance import Relevance
from .stream import RowSource

log = logging.getLogger("pefa_gpu")

DEFAULT_BUDGET = 512 * 2**20
_MIN_ROWS = 1


def chunk_rows(budget: int, n: int, dim: int, itemsize: int, device: torch.device,
               gather: bool) -> int:
    """Rows of Q per chunk so that output + buffers fit in ``budget`` bytes (InputError if not).
    ``gather``: the index_add kernel's workspace (two float32 rows per entry, entries batched
    by the chunk's row count) is counted too."""
    out_bytes = n * dim * 4
    if device.type == "cuda":  # 2 pinned + 2 device raw + fp32 copy
        per_row = dim * (2 * itemsize + 2 * itemsize + 4)
    else:  # read buffer + fp32 conversion (when the file is not float32)
        per_row = dim * (itemsize + (4 if itemsize != 4 else 0))
    if gather:
        per_row += dim * 8
    left = budget - out_bytes
    if left < per_row * _MIN_ROWS:
        raise InputError(f"memory_budget={budget} bytes is too small: the output alone is "
                         f"{n} x {dim} float32 = {out_bytes} bytes, and one row of Q needs "
                         f"{per_row} more")
    return max(_MIN_ROWS, left // per_row)


def pifa_streamed(rel: Relevance, src: RowSource, device: torch.device,
                  memory_budget: int | None, kernel: str = "auto") -> torch.Tensor:
    """Yᵀ Q for a streamed Q: (m x n) relevance, ``src`` (m, d) -> (n, d) float32 on ``device``.

    ``kernel``: 'auto' (scipy in-place on the CPU, gather + index_add on CUDA), 'scipy' or
    'index_add' (the device-independent path, also used to test the CUDA arithmetic on CPU).
    """
    m, n = rel.shape
    d = src.dim
    budget = DEFAULT_BUDGET if memory_budget is None else _check_budget(memory_budget)
    if memory_budget is None:
        budget = max(budget, n * d * 4 + DEFAULT_BUDGET // 2)
    if d == 0:  # an empty iterator
        if m:
            raise InputError(f"Y has {m} rows (queries) but Q has 0 rows")
        return torch.zeros(n, 0, device=device)
    if src.rows is not None and src.rows != m:
        raise InputError(f"Y has {m} rows (queries) but Q has {src.rows} rows")
    if kernel == "auto":
        kernel = "scipy" if device.type == "cpu" and _csc_matvecs() is not None else "index_add"
    if kernel not in ("scipy", "index_add") or (kernel == "scipy" and device.type != "cpu"):
        raise InputError(f"kernel={kernel!r} is not available on {device}")
    rows = chunk_rows(budget, n, d, src.dtype.itemsize, device, gather=kernel == "index_add")
    rows = int(min(rows, max(m, 1)))
    csr = rel.csr
    indices = csr.indices
    indptr = csr.indptr.astype(indices.dtype, copy=False)
    if device.type == "cuda":
        a, seen = _stream_cuda(src, rows, indptr, indices, csr.data, n, m, device)
    else:
        a, seen = _stream_cpu(src, rows, indptr, indices, csr.data, n, m, kernel)
    if seen != m:
        raise InputError(f"Y has {m} rows (queries) but Q has {seen} rows")
    return a


def normalize_rows_(a: torch.Tensor) -> torch.Tensor:
    """In-place Π on a (rows, d) float32 tensor (same values as ``normalize_rows``, Π(0) = 0)."""
    norms = torch.linalg.vector_norm(a, dim=1, keepdim=True)
    return a.div_(norms.clamp_min_(torch.finfo(torch.float32).tiny))


def _check_budget(budget: Any) -> int:
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget <= 0:
        raise InputError(f"memory_budget must be a positive number of bytes, got {budget!r}")
    return int(budget)


def _csc_matvecs():
    try:
        from scipy.sparse import _sparsetools
        return _sparsetools.csc_matvecs
    except (ImportError, AttributeError):
        return None


def _check_rows(start: int, r: int, m: int) -> None:
    if start + r > m:
        raise InputError(f"Y has {m} rows (queries) but Q has more than {m} rows")


def _stream_cpu(src: RowSource, rows: int, indptr: np.ndarray, indices: np.ndarray,
                data: np.ndarray, n: int, m: int, kernel: str) -> tuple[torch.Tensor, int]:
    d = src.dim
    a = np.zeros((n, d), dtype=np.float32)
    buffers = [np.empty((rows, d), dtype=src.dtype)] if src.owns_reads else []
    conv = np.empty((rows, d), dtype=np.float32) if src.dtype != np.float32 else None
    matvecs = _csc_matvecs() if kernel == "scipy" else None
    a_t = as_tensor(a)  # shares memory with ``a``
    seen = 0
    for start, chunk in src.chunks(rows, buffers):
        r = chunk.shape[0]
        _check_rows(start, r, m)
        if chunk.dtype != np.float32:
            if conv is None or conv.shape[0] < r:
                conv = np.empty((r, d), dtype=np.float32)
            x = conv[:r]
            np.copyto(x, chunk, casting="unsafe")
        else:
            x = np.ascontiguousarray(chunk)
        if x.size and not np.isfinite(x.min() + x.max()):  # no temporary of x's size
            bad = np.flatnonzero(~np.isfinite(x).all(axis=1))[:5] + start
            raise InputError(f"Q contains NaN or inf (rows {bad.tolist()}...)")
        ptr = indptr[start:start + r + 1]
        if matvecs is not None:  # A += (Y[rows])ᵀ x in place; Y[rows] CSR = Y[rows]ᵀ CSC
            matvecs(n, r, d, ptr, indices, data, x.reshape(-1), a.reshape(-1))
        else:
            _index_add(a_t, as_tensor(x), ptr, indices, data, max(rows, 1))
        seen = start + r
    return a_t, seen


def _index_add(a: torch.Tensor, x: torch.Tensor, ptr: np.ndarray, indices: np.ndarray,
               data: np.ndarray, batch: int) -> None:
    """A[doc] += w * x[row] for the CSR entries of the chunk, in batches of ``batch`` entries.
    ``ptr`` (r+1,) slices the global ``indices`` / ``data``; x (r, d) float32 on A's device."""
    p0, p1 = int(ptr[0]), int(ptr[-1])
    if p1 == p0:
        return
    counts = np.diff(ptr).astype(np.int64)
    local = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    dev = a.device
    docs = as_tensor(indices[p0:p1], device=dev, dtype=torch.long)
    wts = as_tensor(data[p0:p1], device=dev, dtype=torch.float32)
    loc = as_tensor(local, device=dev)
    for e in range(0, p1 - p0, batch):
        sl = slice(e, e + batch)
        a.index_add_(0, docs[sl], x[loc[sl]] * wts[sl, None])


def _stream_cuda(src: RowSource, rows: int, indptr: np.ndarray, indices: np.ndarray,
                 data: np.ndarray, n: int, m: int,
                 device: torch.device) -> tuple[torch.Tensor, int]:
    """Double-buffered pipeline: host read -> pinned buffer -> copy stream -> compute stream."""
    d = src.dim
    tdtype = as_tensor(np.empty(0, dtype=src.dtype)).dtype
    dev = torch.device("cuda", device.index if device.index is not None
                       else torch.cuda.current_device())
    with torch.cuda.device(dev):
        compute = torch.cuda.current_stream(dev)
        copier = torch.cuda.Stream(dev)
        pinned = [torch.empty((rows, d), dtype=tdtype, pin_memory=True) for _ in range(2)]
        host = [to_numpy(p) for p in pinned]  # numpy views of the pinned memory
        raw = [torch.empty((rows, d), dtype=tdtype, device=dev) for _ in range(2)]
        copied = [torch.cuda.Event() for _ in range(2)]
        consumed: list[torch.cuda.Event | None] = [None, None]
        a = torch.zeros((n, d), dtype=torch.float32, device=dev)
        finite = torch.ones((), dtype=torch.bool, device=dev)
        seen = 0
        chunks = src.chunks(rows, host if src.owns_reads else [])
        for i, (start, chunk) in enumerate(chunks):
            slot, r = i % 2, chunk.shape[0]
            _check_rows(start, r, m)
            if chunk.ctypes.data != host[slot].ctypes.data:  # iterator / array chunk
                np.copyto(host[slot][:r], chunk, casting="unsafe")
            with torch.cuda.stream(copier):
                if consumed[slot] is not None:
                    copier.wait_event(consumed[slot])
                raw[slot][:r].copy_(pinned[slot][:r], non_blocking=True)
                copied[slot].record(copier)
            compute.wait_event(copied[slot])
            x = raw[slot][:r].float()
            finite &= torch.isfinite(x).all()
            _index_add(a, x, indptr[start:start + r + 1], indices, data, rows)
            ev = torch.cuda.Event()
            ev.record(compute)
            consumed[slot] = ev
            seen = start + r
            # before the generator refills the other slot, its previous copy must be done
            copied[(i + 1) % 2].synchronize()
        compute.synchronize()
        if not bool(finite):
            raise InputError("Q contains NaN or inf")
    return a, seen
