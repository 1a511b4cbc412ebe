"""PIFA aggregation: A = Yᵀ Q, the sum of each document's training-query embeddings."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from .arrays import DeviceLike, as_embeddings, as_tensor, is_bfloat16, resolve_device
from .errors import InputError
from .params import check_flag
from .relevance import as_relevance
from .aggregate_stream import check_initial, pifa_streamed
from .stream import RowSource, row_source

_BLOCK = 1 << 14  # rows per step of pefa_xs and normalize_rows_ (their temporaries)


def normalize_rows(x: Any) -> torch.Tensor:
    """Π(x) = x / ‖x‖ row-wise, Π(0) = 0: (rows, d) float (numpy, torch, ...) -> a new (rows,
    d) float32 where x lies."""
    t = as_tensor(x, name="x")  # a tensor as it is; bool / complex / objects refused
    if t.ndim != 2:
        raise InputError(f"normalize_rows takes a (rows, d) matrix, got shape {tuple(t.shape)}")
    if t.dtype == torch.float64 and t.shape[1]:  # float64 rows past float32's range (1e300:
        top = t.abs().amax(dim=1, keepdim=True)  # NaN rows; 1e-300: zero rows) scaled first
        t = t / torch.where(top > 0, top, 1.0)
    return normalize_rows_(t.float().clone(memory_format=torch.contiguous_format))


def normalize_rows_(a: torch.Tensor) -> torch.Tensor:
    """Π in place on a (rows, d) float32 tensor, overflow-safe (each row first divided by its
    largest |entry|); rows holding inf / NaN become NaN (named in a warning on the CPU)."""
    for s in range(0, a.shape[0], _BLOCK):
        b = a[s:s + _BLOCK]
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


def pefa_xs(p: torch.Tensor, sums: torch.Tensor, lam: float) -> torch.Tensor:
    """PEFA-XS documents e_j = lam p_j + (1 - lam) Π(a_j): p, sums (r, d) -> (r, d) float32,
    row by row (one result and a block of temporaries)."""
    e = normalize_rows(sums).mul_(1.0 - lam)
    for s in range(0, e.shape[0], _BLOCK):
        e[s:s + _BLOCK] += lam * p[s:s + _BLOCK].float()
    return e


def pifa(Y: Any, Q: Any, normalize: bool = True, device: DeviceLike = None,
         memory_budget: int | None = None, initial: torch.Tensor | None = None) -> torch.Tensor:
    """Yᵀ Q: (m x n) relevance, (m, d) queries -> (n, d) float32 on ``device``, rows
    L2-normalised when ``normalize`` (documents without queries stay 0); float32 sums. ``Q`` a
    ``.npy`` path, a memory map, an iterator of (rows, d) chunks or any array on the CPU streams
    in row chunks within ``memory_budget`` bytes (default 512 MiB plus the output). ``initial``:
    a contiguous (n, d) float32 tensor on ``device``, accumulated into in place and returned;
    Q is read once, so an error found in its rows (NaN, too few) may leave it partly summed."""
    dev = resolve_device(device)
    check_flag(normalize, "normalize")
    rel = as_relevance(Y, allow_empty=True)
    m = rel.shape[0]
    src = row_source(Q, "Q")
    if src is None and dev.type == "cpu":  # float arrays are read in place, in their dtype
        host = isinstance(Q, torch.Tensor) and Q.device.type == "cpu" and \
            Q.layout == torch.strided and Q.dtype in (torch.float16, torch.float32, torch.float64)
        x = Q.detach().numpy() if host else Q
        if not (isinstance(x, np.ndarray) and (x.dtype.kind == "f" or is_bfloat16(x.dtype))):
            x = as_embeddings(Q, device=dev, name="Q", check_norm=False,  # the stream checks
                              check_finite=False).detach().numpy()
        src = RowSource(x, "Q")
    if src is not None:
        a = pifa_streamed(rel, src, dev, memory_budget, initial=initial)
        return normalize_rows_(a) if normalize else a
    q = as_embeddings(Q, device=dev, name="Q", check_norm=False).detach()
    if q.shape[0] != m:
        raise InputError(f"Y has {m} rows (queries) but Q has {q.shape[0]} rows")
    check_initial(initial, rel.shape[1], q.shape[1], dev)
    a = transposed_csr(rel.csr, q.device) @ q  # torch's CSR product (cuSPARSE on CUDA)
    a = a if initial is None else initial.add_(a)
    return normalize_rows_(a) if normalize else a


def transposed_csr(y_csr: Any, device: torch.device) -> torch.Tensor:
    """Yᵀ as a torch sparse CSR (n x m) float32 on ``device``: Y's entries copied there once and
    transposed there (a stable sort by column: each row of Yᵀ in query order)."""
    m, n = y_csr.shape
    col = as_tensor(y_csr.indices, device, torch.int64)
    row = torch.repeat_interleave(torch.arange(m, device=device),
                                  as_tensor(np.diff(y_csr.indptr), device, torch.int64),
                                  output_size=col.numel())
    order = torch.argsort(col, stable=True)
    crow = torch.zeros(n + 1, dtype=torch.int64, device=device)
    torch.cumsum(torch.bincount(col, minlength=n), 0, out=crow[1:])
    with warnings.catch_warnings():  # torch's notices: CSR support "in beta", checks off
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta")
        warnings.filterwarnings("ignore", "Sparse invariant checks are implicitly disabled")
        return torch.sparse_csr_tensor(crow, row[order],
                                       as_tensor(y_csr.data, device, torch.float32)[order],
                                       size=(n, m), check_invariants=False)
