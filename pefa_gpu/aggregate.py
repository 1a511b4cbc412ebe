"""PIFA aggregation: A = Yᵀ Q, the sum of each document's training-query embeddings."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .arrays import as_embeddings, cuda_index, resolve_device, to_numpy
from .errors import InputError
from .relevance import as_relevance
from .aggregate_stream import normalize_rows_, pifa_streamed
from .stream import array_source, row_source

_BLOCK = 1 << 14  # rows per step of pefa_xs (its temporaries: one such block)


def normalize_rows(x: torch.Tensor) -> torch.Tensor:
    """Π(x) = x / ‖x‖ row-wise, with Π(0) = 0. (rows, d) float -> same shape, float32 (a new
    tensor). Safe at any magnitude float32 holds (see :func:`normalize_rows_`)."""
    return normalize_rows_(x.float().clone(memory_format=torch.contiguous_format))


def pefa_xs(p: torch.Tensor, sums: torch.Tensor, lam: float) -> torch.Tensor:
    """The PEFA-XS documents e_j = lam p_j + (1 - lam) Π(a_j): p (r, d), a (r, d) each
    document's unnormalised sum of training queries (with augment_docs it holds p_j too) ->
    (r, d) float32, row by row (a subset of the rows gives those rows of the whole). Holds
    one (r, d) result and a block of temporaries."""
    e = normalize_rows(sums).mul_(1.0 - lam)
    for s in range(0, e.shape[0], _BLOCK):
        e[s:s + _BLOCK] += lam * p[s:s + _BLOCK].float()
    return e


def pifa(Y: Any, Q: Any, normalize: bool = True, device: Any = None,
         memory_budget: int | None = None, initial: torch.Tensor | None = None) -> torch.Tensor:
    """Yᵀ Q: (m x n) relevance, (m x d) query embeddings -> (n x d) float32 tensor on ``device``.

    Accumulates in float32. On CUDA the product runs as a cuSPARSE SpMM through cupy when cupy
    is installed, else through torch sparse; on the CPU through scipy. With ``normalize`` each
    row is L2-normalised and documents with no queries stay exactly zero.

    Out of core: ``Q`` may also be a path to a C-ordered ``.npy``, a memory map
    (``np.load(path, mmap_mode="r")``) or an iterator of (rows, d) chunks; it is then streamed
    in row chunks (see :mod:`pefa_gpu.aggregate_stream`) with the output and all buffers within
    ``memory_budget`` bytes (default 512 MiB plus the output). A host array with a
    ``memory_budget`` is streamed the same way.

    ``initial``: a contiguous (n, d) float32 tensor on ``device`` the sums start from
    (PEFA-XS: P with augment_docs); it is accumulated into in place, in the order of Y's rows
    on the CPU (a host Q is then streamed, never copied whole), and returned.
    """
    dev = resolve_device(device)
    rel = as_relevance(Y, allow_empty=True)
    m, n = rel.shape
    src = row_source(Q, "Q")
    host = isinstance(Q, torch.Tensor) and Q.device.type == "cpu" and \
        Q.dtype in (torch.float16, torch.float32, torch.float64)
    if src is None and (memory_budget is not None or initial is not None) and \
            dev.type == "cpu" and (isinstance(Q, np.ndarray) or host):
        src = array_source(Q.detach().numpy() if host else Q, "Q")
    if src is not None:
        a = pifa_streamed(rel, src, dev, memory_budget, initial=initial)
        return normalize_rows_(a) if normalize else a
    q = as_embeddings(Q, device=dev, name="Q", check_norm=False).detach()
    if q.shape[0] != m:
        raise InputError(f"Y has {m} rows (queries) but Q has {q.shape[0]} rows")
    a = _spmm_transpose(rel.csr, q)
    if initial is not None:
        a = initial.add_(a)
    return normalize_rows(a) if normalize else a


def _spmm_transpose(y_csr, q: torch.Tensor) -> torch.Tensor:
    """Yᵀ @ q with Y a scipy CSR (m x n) and q (m x d) float32 on its device -> (n x d)."""
    yt = y_csr.T.tocsr()
    if q.device.type == "cpu":
        out = yt.astype(np.float32) @ to_numpy(q)
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))
    try:
        import cupy
        import cupyx.scipy.sparse as csp
    except ImportError:
        cupy = None
    if cupy is not None:  # on q's device and torch's current stream there (no hand-off),
        dev = cuda_index(q.device)  # in memory from torch's allocator (see _torch_allocator)
        with cupy.cuda.Device(dev), \
                cupy.cuda.ExternalStream(torch.cuda.current_stream(dev).cuda_stream), \
                cupy.cuda.using_allocator(_torch_allocator(cupy, q.device, dev)):
            yt_gpu = csp.csr_matrix((cupy.asarray(yt.data, dtype=cupy.float32),
                                     cupy.asarray(yt.indices), cupy.asarray(yt.indptr)),
                                    shape=yt.shape)
            out = yt_gpu @ cupy.from_dlpack(q.contiguous())
            return torch.from_dlpack(cupy.ascontiguousarray(out))
    yt_t = torch.sparse_csr_tensor(torch.from_numpy(yt.indptr.astype(np.int64)),
                                   torch.from_numpy(yt.indices.astype(np.int64)),
                                   torch.from_numpy(yt.data.astype(np.float32)),
                                   size=yt.shape, device=q.device)
    out = yt_t @ q
    return out.to_dense() if out.is_sparse else out


def _torch_allocator(cupy: Any, device: torch.device, device_id: int) -> Any:
    """A cupy allocator (bytes -> ``cupy.cuda.MemoryPointer``) that takes each block from
    torch's caching allocator on ``device`` (a uint8 tensor the block keeps alive), so that
    what cupy frees (its Fortran-order copies of Q and of the product, cuSPARSE's workspace)
    goes back to torch instead of staying in cupy's own pool. Blocks belong to torch's
    current stream, the stream cupy runs on here."""
    def alloc(size: int) -> Any:
        buf = torch.empty(max(int(size), 1), dtype=torch.uint8, device=device)
        return cupy.cuda.MemoryPointer(
            cupy.cuda.UnownedMemory(buf.data_ptr(), buf.numel(), buf, device_id), 0)
    return alloc
