"""Out-of-core PIFA: A = Yᵀ Q with Q streamed in row chunks R, ``A += Y[R]ᵀ Q[R]``, by scipy's
CSC kernel in place (CPU) or ``index_add`` (CUDA; on the CPU on request), fed through two host
staging slots (pinned on CUDA) uploaded on a side stream. ``memory_budget`` bytes cover the
(n, d) float32 output and every buffer allocated here (not Y, already in memory)."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from .arrays import as_tensor, finite_array
from .errors import InputError
from .params import check_memory, check_positive
from .relevance import Relevance
from .stream import Chunks, RowSource

try:  # scipy's in-place CSC kernel (private: where it is missing, index_add runs on the CPU)
    from scipy.sparse._sparsetools import csc_matvecs
except ImportError:
    csc_matvecs = None

DEFAULT_BUDGET = 512 * 2**20
# one entry of a staged batch: document id and row (int64) + weight (float32), in 2 host and 2
# device slots, plus the host's row lookup (two int64 temporaries)
_ENTRY_BYTES = 4 * 20 + 16


def chunk_rows(budget: int, n: int, dim: int, itemsize: int, kernel: str) -> int:
    """Rows of Q per chunk such that the output and the ``kernel``'s buffers fit in ``budget``
    bytes (index_add's: staging slots, device copies, gather space, entries); else InputError."""
    out_bytes = n * dim * 4
    if kernel == "index_add":
        per_row = dim * (4 * itemsize + 4 + 8) + _ENTRY_BYTES
    else:
        per_row = dim * (itemsize + (4 if itemsize != 4 else 0))
    left = budget - out_bytes
    if left < per_row:
        raise InputError(f"memory_budget={budget} bytes is too small: the output alone is "
                         f"{n} x {dim} float32 = {out_bytes} bytes, and one row of Q needs "
                         f"{per_row} more")
    return left // per_row


def check_initial(initial: torch.Tensor | None, n: int, d: int, device: torch.device) -> None:
    """InputError unless ``initial`` is None or a contiguous (n, d) float32 tensor on
    ``device``'s type that does not require grad (it is written in place)."""
    if initial is None:
        return
    tensor = isinstance(initial, torch.Tensor)  # a numpy array or a list: named, not read
    if not tensor or (tuple(initial.shape) != (n, d) or initial.dtype != torch.float32
                      or initial.device.type != device.type
                      or not initial.is_contiguous() or initial.requires_grad):
        got = (f"{tuple(initial.shape)} {initial.dtype} on {initial.device}"
               f"{' requiring grad' if initial.requires_grad else ''}" if tensor
               else f"a {type(initial).__name__}")
        raise InputError(f"initial must be a contiguous ({n}, {d}) float32 tensor on {device} "
                         f"that does not require grad, got {got}")


def pifa_streamed(rel: Relevance, src: RowSource, device: torch.device,
                  memory_budget: int | None, kernel: str = "auto",
                  initial: torch.Tensor | None = None) -> torch.Tensor:
    """Yᵀ Q: (m x n) relevance, ``src`` (m, d) -> (n, d) float32 on ``device``, summed into
    ``initial`` if given; ``kernel``: 'auto' (CPU: scipy, CUDA: index_add), 'scipy', 'index_add'."""
    (m, n), d = rel.shape, src.dim
    budget = max(DEFAULT_BUDGET, n * d * 4 + DEFAULT_BUDGET // 2) if memory_budget is None \
        else check_positive(memory_budget, "memory_budget")
    if src.rows is not None and src.rows != m:
        raise InputError(f"Y has {m} rows (queries) but Q has {src.rows} rows")
    if d == 0 and src.rows is None:  # chunks of 0 columns (arrays of them are refused)
        raise InputError("Q has dimension 0")
    if d == 0:  # an empty iterator, for a Y without rows
        return torch.zeros(n, 0, device=device)
    kernels = ("scipy", "index_add") if device.type == "cpu" and csc_matvecs else ("index_add",)
    kernel = kernels[0] if kernel == "auto" else kernel
    if kernel not in kernels:
        raise InputError(f"kernel={kernel!r} is not available on {device}")
    rows = int(min(chunk_rows(budget, n, d, src.dtype.itemsize, kernel), max(m, 1)))
    check_initial(initial, n, d, device)
    if initial is None and device.type == "cpu":  # Y (1, 2^31 - 1): torch's bare RuntimeError
        check_memory(n * d * 4, f"pifa: the ({n}, {d}) float32 sums Yᵀ Q need", "memory")
    a = torch.zeros((n, d), dtype=torch.float32, device=device) if initial is None else initial
    if kernel == "index_add":
        _stream_staged(src, rows, rel.csr, a)
    else:
        _stream_scipy(src, rows, rel.csr, a.numpy())
    return a


def _read_rows(src: RowSource, rows: int, m: int, buffers: list[np.ndarray]) -> Chunks:
    """``src.chunks(rows, buffers)``; InputError when Q has more rows than Y, or fewer."""
    seen = 0
    for start, chunk in src.chunks(rows, buffers):
        seen = start + chunk.shape[0]
        if seen > m:
            raise InputError(f"Y has {m} rows (queries) but Q has more than {m} rows")
        yield start, chunk
    if seen != m:
        raise InputError(f"Y has {m} rows (queries) but Q has {seen} rows")


def _stream_scipy(src: RowSource, rows: int, y: Any, a: np.ndarray) -> None:
    """scipy's CSC product accumulates each chunk into ``a`` (n, d); ``y``: Y's scipy CSR."""
    (m, n), d = y.shape, a.shape[1]
    indptr = y.indptr.astype(y.indices.dtype, copy=False)  # the kernel's one index type
    buffers = [np.empty((rows, d), dtype=src.dtype)]  # untouched (no memory) but by a memmap
    conv = None
    for start, chunk in _read_rows(src, rows, m, buffers):
        r = chunk.shape[0]
        if chunk.dtype == np.float32:
            x = np.ascontiguousarray(chunk)
        else:  # into one float32 buffer, made at the first chunk that needs it
            conv = np.empty((rows, d), dtype=np.float32) if conv is None else conv
            x = conv[:r]
            with np.errstate(over="ignore"):  # refused below, by name
                np.copyto(x, chunk, casting="unsafe")
        if not finite_array(x):  # from its min and max: no temporary
            bad = np.flatnonzero(~np.isfinite(x).all(axis=1))[:5] + start
            raise InputError(f"Q contains NaN or inf (rows {bad.tolist()}...) or values "
                             f"beyond float32's range (±3.4e38)")
        ptr = indptr[start:start + r + 1]
        # A += (Y[rows])ᵀ x in place; Y[rows] CSR = Y[rows]ᵀ CSC
        csc_matvecs(n, r, d, ptr, y.indices, y.data, x.reshape(-1), a.reshape(-1))


class Staging:
    """Two slots in rotation of named host buffers (pinned on CUDA; ``views``: numpy over them)
    and device twins; ``buffers``: name -> (row width or 0 for 1-D, numpy dtype). On CUDA the
    uploads run on ``copier`` (a side stream), ordered by events; on the CPU, plain copies."""

    def __init__(self, rows: int, buffers: dict[str, tuple[int, Any]], device: torch.device,
                 copier: Any = None):
        self.copier = copier
        self.host = [{k: torch.empty((rows, w) if w else (rows,), device="cpu",
                                     dtype=as_tensor(np.empty(0, dt)).dtype,
                                     pin_memory=device.type == "cuda")
                      for k, (w, dt) in buffers.items()} for _ in range(2)]
        self.views = [{k: t.view(torch.uint8).numpy().view(buffers[k][1]) for k, t in h.items()}
                      for h in self.host]
        self.dev = [{k: torch.empty_like(t, device=device) for k, t in h.items()}
                    for h in self.host]
        self._copied: list[Any] = [None, None]    # event: the slot's last copy is done
        self._consumed: list[Any] = [None, None]  # event: the device stopped reading the slot

    def wait_host(self, slot: int) -> None:
        """Block until the slot's last copy has left its host buffers (they may be rewritten)."""
        if self._copied[slot] is not None:
            self._copied[slot].synchronize()

    def upload(self, slot: int, r: int) -> dict[str, torch.Tensor]:
        """Rows [:r] of the slot's buffers on the device, ready for the current stream."""
        host, dev, cuda = self.host[slot], self.dev[slot], self.copier is not None
        with torch.cuda.stream(self.copier) if cuda else contextlib.nullcontext():
            if self._consumed[slot] is not None:  # (only on CUDA)
                self.copier.wait_event(self._consumed[slot])
            for k, t in host.items():
                dev[k][:r].copy_(t[:r], non_blocking=cuda)
            if cuda:
                self._copied[slot] = self.copier.record_event()
        if cuda:
            torch.cuda.current_stream().wait_event(self._copied[slot])
        return {k: t[:r] for k, t in dev.items()}

    def release(self, slot: int) -> None:
        """The current stream has queued every read of the slot's device buffers."""
        if self.copier is not None:
            self._consumed[slot] = torch.cuda.current_stream().record_event()


def _stream_staged(src: RowSource, rows: int, y: Any, a: torch.Tensor) -> None:
    """The index_add kernel: ``a += Y[R]ᵀ Q[R]`` per chunk R of ``src``; ``y``: Y's scipy CSR."""
    device = a.device  # a tensor's: on CUDA with its index
    cuda = device.type == "cuda"
    with torch.cuda.device(device) if cuda else contextlib.nullcontext():
        copier = torch.cuda.Stream(device) if cuda else None
        q = Staging(rows, {"q": (src.dim, src.dtype)}, device, copier)
        entries = Staging(rows, {"doc": (0, np.int64), "row": (0, np.int64),
                                 "w": (0, np.float32)}, device, copier)
        finite = torch.ones((), dtype=torch.bool, device=device)
        batch = 0
        try:
            for i, (start, chunk) in enumerate(_read_rows(src, rows, y.shape[0],
                                                          [v["q"] for v in q.views])):
                slot, r = i % 2, chunk.shape[0]
                host = q.views[slot]["q"]
                if chunk.ctypes.data != host.ctypes.data:  # an iterator's or an array's chunk
                    np.copyto(host[:r], chunk, casting="unsafe")
                if not host.dtype.isnative:  # a big-endian .npy: the bytes torch reads as
                    host[:r].byteswap(inplace=True)  # native ones (were garbage or 'NaN')
                x = q.upload(slot, r)["q"].float()
                finite &= torch.isfinite(x).all()
                ptr = y.indptr[start:start + r + 1]
                for e0 in range(int(ptr[0]), int(ptr[-1]), rows):
                    e1 = min(e0 + rows, int(ptr[-1]))
                    e_slot, e = batch % 2, e1 - e0
                    entries.wait_host(e_slot)
                    v = entries.views[e_slot]
                    v["doc"][:e] = y.indices[e0:e1]
                    v["w"][:e] = y.data[e0:e1]
                    # each entry's row in the chunk: the last row starting at or before it
                    np.subtract(np.searchsorted(ptr, np.arange(e0, e1), side="right"), 1,
                                out=v["row"][:e])
                    t = entries.upload(e_slot, e)
                    a.index_add_(0, t["doc"], x[t["row"]] * t["w"][:, None])
                    entries.release(e_slot)
                    batch += 1
                q.release(slot)
                # before the source refills the other slot, its previous copy must be done
                q.wait_host((i + 1) % 2)
        finally:  # also on an error: no copy may still be writing when the buffers are freed
            if copier is not None:
                copier.synchronize()
        if not bool(finite):
            raise InputError("Q contains NaN or inf or values beyond float32's range (±3.4e38)")
