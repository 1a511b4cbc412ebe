"""Row-pair dot products for the PEFA-XL re-scoring: ``out[i] = <q[batch[i]], p[doc[i]]>``.

On CUDA a Triton kernel gathers both rows and accumulates in float32, reading each stored
dtype with no converted copy of the corpus, under a device guard for the tensors' GPU and on
torch's current stream there. Elsewhere, and wherever Triton is missing or the kernel fails to
compile or launch, torch gives the same numbers (:func:`torch_rowdots`); a failure warns once
and keeps that device and dtype pair on torch. On the CPU the kernel runs only under Triton's
interpreter (``TRITON_INTERPRET=1`` before triton is imported: the tests). Importing this
module imports triton: only where the kernel may run.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import torch

from .errors import InputError

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path serves
    triton = None

BLOCK_N = 64  # pairs per program
BLOCK_D = 64  # dimensions per step of the inner loop

if triton is not None:
    @triton.jit
    def _rowdots_kernel(q_ptr, p_ptr, b_ptr, j_ptr, out_ptr, n, d,
                        q_row, q_col, p_row, p_col,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """out[i] = sum_k q[b[i], k] * p[j[i], k] for i in this program's block of pairs;
        any float storage, float32 accumulation, any strides."""
        pid = tl.program_id(0)
        offs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = offs < n
        bi = tl.load(b_ptr + offs, mask=mask, other=0)
        ji = tl.load(j_ptr + offs, mask=mask, other=0)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for d0 in range(0, d, BLOCK_D):
            dd = d0 + tl.arange(0, BLOCK_D)
            m2 = mask[:, None] & (dd < d)[None, :]
            qv = tl.load(q_ptr + bi[:, None] * q_row + dd[None, :] * q_col, mask=m2, other=0.0)
            pv = tl.load(p_ptr + ji[:, None] * p_row + dd[None, :] * p_col, mask=m2, other=0.0)
            acc += tl.sum(qv.to(tl.float32) * pv.to(tl.float32), axis=1)
        tl.store(out_ptr + offs, acc, mask=mask)


_FAILED: dict[tuple[str, torch.dtype, torch.dtype], str] = {}  # (device, q, p) -> why


def interpreted() -> bool:
    """True when Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(device: torch.device) -> bool:
    """True when the kernel can run on ``device``: triton imports, and the device is CUDA (a
    compiled kernel) or the interpreter is on. Compilation is tried on first use; a failure
    there falls back to torch (see :func:`rowdots`)."""
    if triton is None:
        return False
    if device.type == "cuda":
        return torch.cuda.is_available() and not interpreted()
    return device.type == "cpu" and interpreted()


def torch_rowdots(queries: torch.Tensor, docs: torch.Tensor, batch: torch.Tensor,
                  doc: torch.Tensor) -> torch.Tensor:
    """:func:`rowdots` in torch: float32 products of the gathered rows, summed, ~16 MB of
    gathered rows at a time."""
    step = max(1, (1 << 22) // max(1, docs.shape[1]))
    out = torch.empty(batch.numel(), dtype=torch.float32, device=docs.device)
    for s in range(0, batch.numel(), step):
        e = s + step
        out[s:e] = (queries[batch[s:e]].float() * docs[doc[s:e]].float()).sum(1)
    return out


def rowdots(queries: torch.Tensor, docs: torch.Tensor, batch: torch.Tensor,
            doc: torch.Tensor) -> torch.Tensor:
    """``out[i] = <queries[batch[i]], docs[doc[i]]>`` -> (N,) float32 on the tensors' device.

    queries (B, d) and docs (n, d) in any float dtype (stored as they are, any strides), batch
    and doc (N,) int64 valid row ids (not checked: no host synchronisation). The Triton kernel
    where :func:`available`, else torch; float32 accumulation either way.
    """
    _check(queries, docs, batch, doc)
    key = (str(docs.device), queries.dtype, docs.dtype)
    if batch.numel() == 0 or not available(docs.device) or key in _FAILED:
        return torch_rowdots(queries, docs, batch, doc)
    try:
        return _launch(queries, docs, batch, doc)
    except Exception as exc:  # a compiler or launcher error: this pair stays on torch
        _FAILED[key] = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"pefa_gpu: the Triton re-scoring kernel failed on {docs.device} for "
                      f"{queries.dtype} queries and {docs.dtype} documents ({_FAILED[key]}); "
                      f"using torch instead", RuntimeWarning, stacklevel=2)
        return torch_rowdots(queries, docs, batch, doc)


def _launch(queries: torch.Tensor, docs: torch.Tensor, batch: torch.Tensor,
            doc: torch.Tensor) -> torch.Tensor:
    n, d = batch.numel(), docs.shape[1]
    out = torch.empty(n, dtype=torch.float32, device=docs.device)
    guard: Any = torch.cuda.device(docs.device) if docs.is_cuda else contextlib.nullcontext()
    with guard:  # the kernel's pointers belong to docs' GPU, whichever device is current
        grid = (triton.cdiv(n, BLOCK_N),)
        _rowdots_kernel[grid](queries, docs, batch.contiguous(), doc.contiguous(), out, n, d,
                              queries.stride(0), queries.stride(1), docs.stride(0),
                              docs.stride(1), BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D)
    return out


def _check(queries: torch.Tensor, docs: torch.Tensor, batch: torch.Tensor,
           doc: torch.Tensor) -> None:
    """Shapes, dtypes and devices (never values: that would synchronise)."""
    shapes = f"{tuple(queries.shape)} {queries.dtype} and {tuple(docs.shape)} {docs.dtype}"
    if queries.ndim != 2 or docs.ndim != 2 or queries.shape[1] != docs.shape[1] \
            or not (queries.is_floating_point() and docs.is_floating_point()):
        raise InputError(f"rowdots needs float queries (B, d) and docs (n, d), got {shapes}")
    if batch.shape != doc.shape or batch.ndim != 1 or {batch.dtype, doc.dtype} != {torch.int64}:
        raise InputError(f"rowdots needs batch and doc of one shape (N,), int64, got "
                         f"{tuple(batch.shape)} {batch.dtype} and {tuple(doc.shape)} {doc.dtype}")
    devices = {t.device for t in (queries, docs, batch, doc)}
    if len(devices) > 1:
        raise InputError(f"rowdots needs all tensors on one device, got {sorted(map(str, devices))}")
