"""Exact search's top-w candidates without its (B, n) score matrix: a Triton GEMM of 16-bit
queries and rows whose epilogue keeps, per query and tile of ``BN`` rows, the best two scores
with their ids and the third score. The best w of those are a row's true top-w, ties included,
unless some tile's third score reaches the w-th or a score is not finite: such a row is
unsettled (the caller scores it in full). On CUDA only (``ON_CPU``: under TRITON_INTERPRET=1
too, for the tests)."""

from __future__ import annotations

import contextlib
import warnings

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the score blocks serve
    triton = None

BM, BN, BK, WARPS, STAGES = 128, 256, 64, 8, 3  # queries / rows / dimensions a step, per program
UNSETTLED_SHARE = 0.02  # at most this share of rows expected unsettled (rows in random order)
ON_CPU = False  # tests: the kernel serves CPU rows as well (Triton's interpreter)

if triton is not None:
    @triton.jit
    def _tile_scores(q_ptr, x_ptr, qb, tb, b, n, d,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """(BM, BN) float32 products of query block ``qb`` and row tile ``tb``; -inf past n."""
        rm = qb * BM + tl.arange(0, BM)
        rn = tb * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, d, BK):
            a = tl.load(q_ptr + rm[:, None] * d + (k0 + rk)[None, :],
                        mask=(rm[:, None] < b) & ((k0 + rk)[None, :] < d), other=0.0)
            x = tl.load(x_ptr + rn[None, :] * d + (k0 + rk)[:, None],
                        mask=(rn[None, :] < n) & ((k0 + rk)[:, None] < d), other=0.0)
            acc = tl.dot(a, x, acc)
        return acc

    @triton.jit
    def _store_best(acc, val_ptr, idx_ptr, third_ptr, qb, tb, b, n, tiles,
                    BM: tl.constexpr, BN: tl.constexpr):
        """Writes each query's best two scores of ``acc`` with their row ids, and its third."""
        rm = qb * BM + tl.arange(0, BM)
        cols = tl.arange(0, BN)[None, :]
        acc = tl.where(tb * BN + cols < n, acc, float("-inf"))
        out, ok = rm * tiles + tb, rm < b
        v1, i1 = tl.max(acc, axis=1, return_indices=True)  # of equal ones, the lowest column
        acc = tl.where(cols == i1[:, None], float("-inf"), acc)
        v2, i2 = tl.max(acc, axis=1, return_indices=True)
        acc = tl.where(cols == i2[:, None], float("-inf"), acc)
        tl.store(val_ptr + 2 * out, v1, mask=ok)
        tl.store(val_ptr + 2 * out + 1, v2, mask=ok)
        tl.store(idx_ptr + 2 * out, tb * BN + i1, mask=ok)
        tl.store(idx_ptr + 2 * out + 1, tb * BN + i2, mask=ok)
        tl.store(third_ptr + out, tl.max(acc, axis=1), mask=ok)

    @triton.jit
    def _tile_best_kernel(q_ptr, x_ptr, val_ptr, idx_ptr, third_ptr, b, n, d, tiles,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # axis 0 (queries) runs fastest: each tile of rows is read by every query block in turn
        qb, tb = tl.program_id(0), tl.program_id(1)
        acc = _tile_scores(q_ptr, x_ptr, qb, tb, b, n, d, BM, BN, BK)
        _store_best(acc, val_ptr, idx_ptr, third_ptr, qb, tb, b, n, tiles, BM, BN)

_FAILED: dict[tuple[str, torch.dtype], str] = {}  # (device, dtype) -> why the kernel failed


def usable(rows: torch.Tensor, w: int) -> bool:
    """Whether :func:`tile_topw` serves top-w over ``rows`` (n, d): 16-bit, on CUDA (or the CPU
    under ``ON_CPU``), the kernel working there, w finite candidates in the whole tiles, and
    so many tiles that at most ``UNSETTLED_SHARE`` of rows are expected unsettled
    (w^3 BN^2 / 6 n^2)."""
    n = rows.shape[0]
    return triton is not None and (rows.is_cuda or ON_CPU) and n < 2**31 and \
        rows.dtype in (torch.float16, torch.bfloat16) and \
        (str(rows.device), rows.dtype) not in _FAILED and \
        2 * (n // BN) >= w and w**3 * BN**2 <= 6 * UNSETTLED_SHARE * n**2


def tile_topw(q: torch.Tensor, rows: torch.Tensor, w: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(B, d) float queries, (n, d) 16-bit rows -> (B, w) float32 scores sorted descending,
    int64 ids, and (B,) bool unsettled; None where the kernel fails (warned once)."""
    b, tiles, key = q.shape[0], triton.cdiv(rows.shape[0], BN), (str(rows.device), rows.dtype)
    vals = torch.empty(b, tiles, 2, device=rows.device)
    ids = torch.empty(b, tiles, 2, device=rows.device, dtype=torch.int32)
    third = torch.empty(b, tiles, device=rows.device)
    odd = ~torch.isfinite(q).all(1)  # NaN / inf queries: scored by the caller, zeros here
    q = q.masked_fill(odd.unsqueeze(1), 0.0)
    if rows.is_cuda:
        q = q.to(rows.dtype)
    else:  # Triton's interpreter: float32 (exact products), its bfloat16 dots are wrong
        q, rows = q.float().to(rows.dtype).float(), rows.float()
    try:  # the kernel's pointers belong to rows' GPU, whichever device is current
        with torch.cuda.device(rows.device) if rows.is_cuda else contextlib.nullcontext():
            _tile_best_kernel[(triton.cdiv(b, BM), tiles)](
                q.contiguous(), rows.contiguous(), vals, ids, third, b,
                rows.shape[0], rows.shape[1], tiles, BM=BM, BN=BN, BK=BK, num_warps=WARPS,
                num_stages=STAGES)
    except Exception as exc:  # a compiler or launcher error: score blocks serve from now on
        _FAILED[key] = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"pefa_gpu: the Triton top-k kernel failed on {key[0]} for {key[1]} rows "
                      f"({_FAILED[key]}); using score blocks instead", RuntimeWarning,
                      stacklevel=2)
        return None
    top, pos = torch.topk(vals.view(b, -1), w, dim=1)
    odd |= ~torch.isfinite(top).all(1)  # an overflow: inf, NaN
    return top, ids.view(b, -1).gather(1, pos).long(), (third >= top[:, -1:]).any(1) | odd
