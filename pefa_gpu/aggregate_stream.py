"""Out-of-core PIFA: A = Yᵀ Q with Q streamed in row chunks under a memory budget.

For each chunk of rows R of Q: ``A += Y[R]ᵀ @ Q[R]``, using only the CSR entries of those rows.
Two kernels:

- ``scipy`` (CPU): scipy's CSC kernel accumulates into A in place, no n x d temporary.
- ``index_add`` (CUDA, and on the CPU on request): a staged pipeline. Each chunk of Q, and each
  batch of its Y entries (document ids, rows within the chunk, weights), is read into one of two
  host staging slots (pinned memory on CUDA) and copied to the device on a side stream, so that
  reading chunk i+1 and its copy overlap the product of chunk i; the product is a gather and an
  ``index_add_`` in float32. On the CPU the same code runs without streams: tests run the CUDA
  path's buffer bookkeeping (slots, views, slices) there.

Memory: ``memory_budget`` bytes cover the output (n x d float32) and every buffer this call
allocates (read buffers, staging slots and their device copies, the float32 conversion, the
gather workspace, the entry batches); Y itself (already in memory) is not counted.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any, Iterator

import numpy as np
import torch

from .arrays import cuda_index, host_view, torch_dtype
from .errors import InputError
from .relevance import Relevance
from .stream import RowSource

log = logging.getLogger("pefa_gpu")

DEFAULT_BUDGET = 512 * 2**20
_MIN_ROWS = 1
# one entry of a staged batch: document id and row (int64) + weight (float32), in 2 host and 2
# device slots, plus the host's row lookup (two int64 temporaries)
_ENTRY_BYTES = 4 * 20 + 16


def chunk_rows(budget: int, n: int, dim: int, itemsize: int, kernel: str) -> int:
    """Rows of Q per chunk so that output + buffers fit in ``budget`` bytes (InputError if not).
    ``kernel``: 'scipy' (a read buffer, plus a float32 conversion when Q is not float32) or
    'index_add' (two staging slots and two device copies of a chunk, its float32 conversion,
    the gather workspace of two float32 rows per entry and the entry batches, both batched by
    the chunk's row count)."""
    out_bytes = n * dim * 4
    if kernel == "index_add":
        per_row = dim * (4 * itemsize + 4 + 8) + _ENTRY_BYTES
    else:
        per_row = dim * (itemsize + (4 if itemsize != 4 else 0))
    left = budget - out_bytes
    if left < per_row * _MIN_ROWS:
        raise InputError(f"memory_budget={budget} bytes is too small: the output alone is "
                         f"{n} x {dim} float32 = {out_bytes} bytes, and one row of Q needs "
                         f"{per_row} more")
    return max(_MIN_ROWS, left // per_row)


def pifa_streamed(rel: Relevance, src: RowSource, device: torch.device,
                  memory_budget: int | None, kernel: str = "auto",
                  initial: torch.Tensor | None = None) -> torch.Tensor:
    """Yᵀ Q for a streamed Q: (m x n) relevance, ``src`` (m, d) -> (n, d) float32 on ``device``.

    ``kernel``: 'auto' (scipy on the CPU, the staged index_add pipeline on CUDA), 'scipy' or
    'index_add' (the CUDA pipeline, which also runs on the CPU: how tests check it there).
    ``initial``: a contiguous (n, d) float32 tensor on ``device`` the sums start from; it is
    accumulated into in place and returned.
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
    if kernel not in ("scipy", "index_add") or \
            (kernel == "scipy" and (device.type != "cpu" or _csc_matvecs() is None)):
        raise InputError(f"kernel={kernel!r} is not available on {device}")
    rows = chunk_rows(budget, n, d, src.dtype.itemsize, kernel)
    rows = int(min(rows, max(m, 1)))
    csr = rel.csr
    indices = csr.indices
    indptr = csr.indptr.astype(indices.dtype, copy=False)
    a = _output(initial, n, d, device)
    if kernel == "index_add":
        seen = _stream_staged(src, rows, indptr, indices, csr.data, m, a)
    else:
        seen = _stream_scipy(src, rows, indptr, indices, csr.data, m, a.numpy())
    if seen != m:
        raise InputError(f"Y has {m} rows (queries) but Q has {seen} rows")
    return a


def _output(initial: torch.Tensor | None, n: int, d: int, device: torch.device) -> torch.Tensor:
    """The (n, d) float32 tensor the sums accumulate into: ``initial`` when given (checked:
    the kernels write into it by raw offsets), else zeros."""
    if initial is None:
        return torch.zeros((n, d), dtype=torch.float32, device=device)
    if tuple(initial.shape) != (n, d) or initial.dtype != torch.float32 or \
            initial.device.type != device.type or not initial.is_contiguous():
        raise InputError(f"initial must be a contiguous ({n}, {d}) float32 tensor on {device}, "
                         f"got {tuple(initial.shape)} {initial.dtype} on {initial.device}")
    return initial


_NORM_BLOCK = 1 << 14  # rows per step of normalize_rows_ (its temporaries: one such block)


def normalize_rows_(a: torch.Tensor) -> torch.Tensor:
    """In-place Π on a (rows, d) float32 tensor: a_i / ‖a_i‖, Π(0) = 0. Each row is first
    divided by its largest |entry|, so that the sum of squares neither overflows (entries up
    to float32's maximum) nor underflows (subnormal rows); rows holding inf or NaN come out
    NaN, with a warning naming them (on the CPU)."""
    for s in range(0, a.shape[0], _NORM_BLOCK):
        b = a[s:s + _NORM_BLOCK]
        top = b.abs().amax(dim=1, keepdim=True) if b.shape[1] else b[:, :1]
        b.div_(torch.where(top > 0, top, 1.0))
        norms = torch.linalg.vector_norm(b, dim=1, keepdim=True)
        b.div_(torch.where(norms > 0, norms, 1.0))
        bad = ~torch.isfinite(norms)
        b.masked_fill_(bad, float("nan"))
        if not a.is_cuda and bool(bad.any()):  # (on CUDA the test would synchronise)
            rows = (bad.squeeze(1).nonzero().squeeze(1) + s)[:10].tolist()
            warnings.warn(f"normalising rows {rows}... (of {a.shape[0]}): they hold inf or NaN "
                          f"(a float32 overflow of their sums?), so their direction is lost: "
                          f"NaN rows", RuntimeWarning, stacklevel=2)
    return a


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


def _stream_scipy(src: RowSource, rows: int, indptr: np.ndarray, indices: np.ndarray,
                  data: np.ndarray, m: int, a: np.ndarray) -> int:
    """The CPU kernel: scipy's CSC product accumulates each chunk into ``a`` (n, d) in place.
    Returns the rows of Q read."""
    n, d = a.shape
    buffers = [np.empty((rows, d), dtype=src.dtype)] if src.owns_reads else []
    conv = np.empty((rows, d), dtype=np.float32) if src.dtype != np.float32 else None
    matvecs = _csc_matvecs()
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
        # A += (Y[rows])ᵀ x in place; Y[rows] CSR = Y[rows]ᵀ CSC
        matvecs(n, r, d, ptr, indices, data, x.reshape(-1), a.reshape(-1))
        seen = start + r
    return seen


class Staging:
    """Two slots used in rotation, each a set of named host buffers (pinned on CUDA) and
    device buffers of the same shapes and dtypes.

    The host writes slot ``s`` through ``views[s]`` (numpy arrays over the host buffers' own
    memory, never copies) after :meth:`wait_host`; :meth:`upload` copies the first r rows of
    every buffer of the slot to the device and returns the device rows, ready for the current
    stream; :meth:`release` marks the slot's device buffers free again once the current stream
    has queued its last read of them. On CUDA the copies run on ``copier`` (a side stream) and
    are ordered by events; on the CPU the same steps are plain copies.
    """

    def __init__(self, rows: int, buffers: dict[str, tuple[int, Any]], device: torch.device,
                 copier: Any = None):
        """``buffers``: name -> (row width, 0 for a 1-D buffer; numpy dtype)."""
        cuda = device.type == "cuda"
        self.copier = copier
        self.host: list[dict[str, torch.Tensor]] = []
        self.views: list[dict[str, np.ndarray]] = []
        self.dev: list[dict[str, torch.Tensor]] = []
        for _ in range(2):
            shapes = {k: ((rows, w) if w else (rows,), torch_dtype(dt), dt)
                      for k, (w, dt) in buffers.items()}
            host = {k: torch.empty(sh, dtype=tdt, device="cpu", pin_memory=cuda)
                    for k, (sh, tdt, _) in shapes.items()}
            self.host.append(host)
            self.views.append({k: host_view(host[k], dt) for k, (_, _, dt) in shapes.items()})
            self.dev.append({k: torch.empty(sh, dtype=tdt, device=device)
                             for k, (sh, tdt, _) in shapes.items()})
        self._copied: list[Any] = [None, None]    # event: the slot's last copy is done
        self._consumed: list[Any] = [None, None]  # event: the device stopped reading the slot

    def wait_host(self, slot: int) -> None:
        """Block until the slot's last copy has left its host buffers (they may be rewritten)."""
        if self._copied[slot] is not None:
            self._copied[slot].synchronize()

    def upload(self, slot: int, r: int) -> dict[str, torch.Tensor]:
        """Rows [:r] of the slot's buffers on the device, ordered before later work on the
        current stream."""
        host, dev = self.host[slot], self.dev[slot]
        if self.copier is None:
            for k, t in host.items():
                dev[k][:r].copy_(t[:r])
            return {k: t[:r] for k, t in dev.items()}
        with torch.cuda.stream(self.copier):
            if self._consumed[slot] is not None:
                self.copier.wait_event(self._consumed[slot])
            for k, t in host.items():
                dev[k][:r].copy_(t[:r], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copier)
        self._copied[slot] = done
        torch.cuda.current_stream().wait_event(done)
        return {k: t[:r] for k, t in dev.items()}

    def release(self, slot: int) -> None:
        """The current stream has queued every read of the slot's device buffers."""
        if self.copier is not None:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream())
            self._consumed[slot] = done


def _on_device(device: torch.device) -> contextlib.AbstractContextManager:
    return torch.cuda.device(cuda_index(device)) if device.type == "cuda" \
        else contextlib.nullcontext()


def _stream_staged(src: RowSource, rows: int, indptr: np.ndarray, indices: np.ndarray,
                   data: np.ndarray, m: int, a: torch.Tensor) -> int:
    """The staged pipeline (module docstring): host read -> staging slot -> device (a side
    stream on CUDA) -> gather + index_add into ``a`` (n, d) on the current stream. Entries are
    batched by ``rows`` (the gather workspace is two (rows, d) float32 arrays). Returns the
    rows of Q read."""
    d, device = src.dim, a.device
    if device.type == "cuda":
        device = torch.device("cuda", cuda_index(device))
    with _on_device(device):
        copier = torch.cuda.Stream(device) if device.type == "cuda" else None
        q = Staging(rows, {"q": (d, src.dtype)}, device, copier)
        entries = Staging(rows, {"doc": (0, np.int64), "row": (0, np.int64),
                                 "w": (0, np.float32)}, device, copier)
        finite = torch.ones((), dtype=torch.bool, device=device)
        try:
            seen = _staged_chunks(src, rows, indptr, indices, data, m, q, entries, a, finite)
        finally:  # also on an error: no copy may still be writing when the buffers are freed
            if copier is not None:
                copier.synchronize()
        if not bool(finite):
            raise InputError("Q contains NaN or inf")
    return seen


def _staged_chunks(src: RowSource, rows: int, indptr: np.ndarray, indices: np.ndarray,
                   data: np.ndarray, m: int, q: Staging, entries: Staging, a: torch.Tensor,
                   finite: torch.Tensor) -> int:
    """The chunk loop of :func:`_stream_staged`: ``a += Y[R]ᵀ Q[R]`` for every chunk R of
    rows, ``finite`` cleared where Q holds NaN / inf; returns the number of rows read."""
    seen, batch = 0, 0
    reads = src.chunks(rows, [v["q"] for v in q.views] if src.owns_reads else [])
    for i, (start, chunk) in enumerate(reads):
        slot, r = i % 2, chunk.shape[0]
        _check_rows(start, r, m)
        host = q.views[slot]["q"]
        if chunk.ctypes.data != host.ctypes.data:  # an iterator's or an array's chunk
            np.copyto(host[:r], chunk, casting="unsafe")
        x = q.upload(slot, r)["q"].float()
        finite &= torch.isfinite(x).all()
        ptr = indptr[start:start + r + 1]
        for e0, e1 in _batches(int(ptr[0]), int(ptr[-1]), rows):
            e_slot, e = batch % 2, e1 - e0
            entries.wait_host(e_slot)
            v = entries.views[e_slot]
            v["doc"][:e] = indices[e0:e1]
            v["w"][:e] = data[e0:e1]
            # the row (within the chunk) of each entry: the last row starting at or before it
            np.subtract(np.searchsorted(ptr, np.arange(e0, e1), side="right"), 1,
                        out=v["row"][:e])
            t = entries.upload(e_slot, e)
            a.index_add_(0, t["doc"], x[t["row"]] * t["w"][:, None])
            entries.release(e_slot)
            batch += 1
        q.release(slot)
        seen = start + r
        # before the source refills the other slot, its previous copy must be done
        q.wait_host((i + 1) % 2)
    return seen


def _batches(lo: int, hi: int, size: int) -> Iterator[tuple[int, int]]:
    for s in range(lo, hi, size):
        yield s, min(s + size, hi)
