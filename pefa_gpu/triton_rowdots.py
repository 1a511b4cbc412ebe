"""XL's re-scoring dot products ``out[i] = <q[batch[i]], p[doc[i]]>``: a Triton kernel on CUDA
(float32 sums of any float dtype and strides), torch where it fails (one warning per device and
dtypes) or elsewhere; on the CPU the kernel runs only under ``TRITON_INTERPRET=1`` (the tests)."""

from __future__ import annotations

import contextlib
import os
import warnings

import torch

from .errors import InputError

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path serves
    triton = None

BLOCK_N, BLOCK_D = 64, 64  # pairs per program, dimensions per step

if triton is not None:
    @triton.jit
    def _rowdots_kernel(q_ptr, p_ptr, b_ptr, j_ptr, out_ptr, n, d, q_row, q_col, p_row, p_col,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
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


def available(device: torch.device) -> bool:
    """Triton imports and ``device`` (a tensor's) is CUDA (compiled) or the CPU under the
    interpreter (``TRITON_INTERPRET=1``)."""
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return triton is not None and device.type == ("cpu" if interpreted else "cuda")


def torch_rowdots(queries: torch.Tensor, docs: torch.Tensor, batch: torch.Tensor,
                  doc: torch.Tensor) -> torch.Tensor:
    """:func:`rowdots` in torch, ~16 MB of gathered rows at a time."""
    step = max(1, (1 << 22) // max(1, docs.shape[1]))
    out = torch.empty(batch.numel(), dtype=torch.float32, device=docs.device)
    for s in range(0, batch.numel(), step):
        b, j = batch[s:s + step], doc[s:s + step]
        out[s:s + step] = (queries[b].float() * docs[j].float()).sum(1)
    return out


def rowdots(queries: torch.Tensor, docs: torch.Tensor, batch: torch.Tensor,
            doc: torch.Tensor) -> torch.Tensor:
    """queries (B, d), docs (n, d) any float dtype and strides, batch / doc (N,) int64 valid ids
    (unchecked: no synchronisation) -> (N,) float32 on their device."""
    shapes = f"{tuple(queries.shape)} {queries.dtype} and {tuple(docs.shape)} {docs.dtype}"
    if queries.ndim != 2 or docs.ndim != 2 or queries.shape[1] != docs.shape[1] \
            or not (queries.is_floating_point() and docs.is_floating_point()):
        raise InputError(f"rowdots needs float queries (B, d) and docs (n, d), got {shapes}")
    if batch.shape != doc.shape or batch.ndim != 1 or {batch.dtype, doc.dtype} != {torch.int64}:
        raise InputError(f"rowdots needs batch and doc of one shape (N,), int64, got "
                         f"{tuple(batch.shape)} {batch.dtype} and {tuple(doc.shape)} {doc.dtype}")
    devices = {t.device for t in (queries, docs, batch, doc)}
    if len(devices) > 1:
        raise InputError(f"rowdots needs all tensors on one device, got "
                         f"{sorted(map(str, devices))}")
    key = (str(docs.device), queries.dtype, docs.dtype)
    if batch.numel() == 0 or not available(docs.device) or key in _FAILED:
        return torch_rowdots(queries, docs, batch, doc)
    out = torch.empty(batch.numel(), dtype=torch.float32, device=docs.device)
    try:  # the kernel's pointers belong to docs' GPU, whichever device is current
        with torch.cuda.device(docs.device) if docs.is_cuda else contextlib.nullcontext():
            _rowdots_kernel[(triton.cdiv(batch.numel(), BLOCK_N),)](
                queries, docs, batch.contiguous(), doc.contiguous(), out, batch.numel(),
                docs.shape[1], *queries.stride(), *docs.stride(), BLOCK_N=BLOCK_N,
                BLOCK_D=BLOCK_D)
        return out
    except Exception as exc:  # a compiler or launcher error: this pair stays on torch
        _FAILED[key] = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"pefa_gpu: the Triton re-scoring kernel failed on {docs.device} for "
                      f"{queries.dtype} queries and {docs.dtype} documents ({_FAILED[key]}); "
                      f"using torch instead", RuntimeWarning, stacklevel=2)
        return torch_rowdots(queries, docs, batch, doc)
