"""Exact search's top-w candidates without its (B, n) score matrix: a Triton GEMM of 16-bit
queries and rows whose epilogue keeps, per query and tile of ``BN`` rows, the best ``KEEP``
scores with their ids and the next score (:func:`tile_topw`). On CUDA only (``ON_CPU``: under
TRITON_INTERPRET=1 too, for the tests)."""

from __future__ import annotations

import contextlib
import math
import warnings

import torch

from .triton_rowdots import rowdots

try:
    import triton
    import triton.language as tl
except ImportError:  # the score blocks serve
    triton = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton before 3.4: pointer loads
    TensorDescriptor = None

BM, BN, BK, WARPS, STAGES = 128, 256, 64, 8, 3  # queries / rows / dimensions a step, per program
KEEP = 2  # best scores (with their ids) kept per query and tile of rows
UNSETTLED_SHARE = 0.02  # at most this share of rows expected unsettled (rows in random order)
REDO_SHARE = 0.04  # of the queries, at most, get their worst tiles scored in full
REDO_TILES = 2  # ... that many of them
ON_CPU = False  # tests: the kernel serves CPU rows as well (Triton's interpreter)

if triton is not None:
    @triton.jit
    def _tile_best_kernel(q, x, val_ptr, idx_ptr, next_ptr, b, n, d, tiles, qblocks,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                          KEEP: tl.constexpr, PROGRAMS: tl.constexpr, TMA: tl.constexpr):
        # persistent: programs PROGRAMS apart walk the (query block, row tile) pairs, query blocks
        # fastest (each tile of rows is read by every query block in turn); the loop flattened
        # so that the next pair's loads overlap this one's selection
        for t in tl.range(tl.program_id(0), qblocks * tiles, PROGRAMS, flatten=True):
            qb, tb = t % qblocks, t // qblocks
            rm, cols = qb * BM + tl.arange(0, BM), tl.arange(0, BN)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            if TMA:  # q, x: tensor descriptors; rows and queries out of range load as zeros
                for k0 in range(0, d, BK):
                    acc = tl.dot(q.load([qb * BM, k0]), x.load([tb * BN, k0]).T, acc)
            else:  # q, x: pointers, 64-bit offsets (row * d past 2^31)
                rq, rx, rk = rm.to(tl.int64), (tb * BN + cols).to(tl.int64), tl.arange(0, BK)
                for k0 in range(0, d, BK):
                    a = tl.load(q + rq[:, None] * d + (k0 + rk)[None, :],
                                mask=(rq[:, None] < b) & ((k0 + rk)[None, :] < d), other=0.0)
                    xt = tl.load(x + rx[None, :] * d + (k0 + rk)[:, None],
                                 mask=(rx[None, :] < n) & ((k0 + rk)[:, None] < d), other=0.0)
                    acc = tl.dot(a, xt, acc)
            # each query's best KEEP scores with their row ids, then the next score; a NaN score
            # as +inf (its query is then unsettled), rows past n as -inf
            acc = tl.where(acc == acc, acc, float("inf"))
            if tb * BN + BN > n:  # the last tile only
                acc = tl.where(tb * BN + cols[None, :] < n, acc, float("-inf"))
            out, ok = rm.to(tl.int64) * tiles + tb, rm < b
            for j in tl.static_range(KEEP):
                v, i = tl.max(acc, axis=1, return_indices=True)  # of equal ones, the lowest column
                acc = tl.where(cols[None, :] == i[:, None], float("-inf"), acc)
                tl.store(val_ptr + KEEP * out + j, v, mask=ok)
                tl.store(idx_ptr + KEEP * out + j, tb * BN + i, mask=ok)
            tl.store(next_ptr + out, tl.max(acc, axis=1), mask=ok)

_FAILED: dict[tuple[str, torch.dtype], str] = {}  # (device, dtype) -> why the kernel failed


def usable(rows: torch.Tensor, w: int) -> bool:
    """Whether :func:`tile_topw` serves top-w over ``rows`` (n, d): 16-bit, on CUDA (or the CPU
    under ``ON_CPU``), the kernel working there, w finite candidates in the whole tiles, and
    at most ``UNSETTLED_SHARE`` of queries expected unsettled (some tile holding more than KEEP
    of their top w, rows in random order: about w^(KEEP+1) (BN/n)^KEEP / (KEEP+1)!)."""
    n = rows.shape[0]
    return triton is not None and (rows.is_cuda or ON_CPU) and n < 2**31 and \
        rows.dtype in (torch.float16, torch.bfloat16) and \
        (str(rows.device), rows.dtype) not in _FAILED and KEEP * (n // BN) >= w and \
        w ** (KEEP + 1) * (BN / n) ** KEEP / math.factorial(KEEP + 1) <= UNSETTLED_SHARE


def _tma(q: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether the kernel loads through TMA: Triton's tensor descriptors, 16-byte aligned rows,
    an NVIDIA GPU of compute capability 9 (Hopper) or later, or the CPU (the interpreter)."""
    aligned = all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
                  for t in (q, rows))
    return TensorDescriptor is not None and aligned and (not rows.is_cuda or (
        torch.version.hip is None and torch.cuda.get_device_capability(rows.device)[0] >= 9))


def tile_topw(q: torch.Tensor, rows: torch.Tensor, w: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(B, d) float queries, (n, d) 16-bit rows -> (B, w) float32 scores sorted descending
    (ties in any order), int64 ids, and (B,) bool unsettled; None where the kernel fails
    (warned once)."""
    (b, d), n, key = q.shape, rows.shape[0], (str(rows.device), rows.dtype)
    tiles = triton.cdiv(n, BN)
    vals = torch.empty(b, tiles, KEEP, device=rows.device)
    ids = torch.empty(b, tiles, KEEP, device=rows.device, dtype=torch.int32)
    after = torch.empty(b, tiles, device=rows.device)  # the (KEEP + 1)-th score of each tile
    if rows.is_cuda:  # the kernel is launched first, the queries checked after it
        q = q.to(rows.dtype)
    else:  # Triton's interpreter: float32 (exact products), its bfloat16 dots are wrong
        q, rows = q.float().to(rows.dtype).float(), rows.float()
    q, rows = q.contiguous(), rows.contiguous()
    qblocks = triton.cdiv(b, BM)
    programs = torch.cuda.get_device_properties(rows.device).multi_processor_count \
        if rows.is_cuda else 4  # the loop's stride (one compile a device); fewer may start
    try:  # the kernel's pointers belong to rows' GPU, whichever device is current
        with torch.cuda.device(rows.device) if rows.is_cuda else contextlib.nullcontext():
            tma = _tma(q, rows)
            loads = [TensorDescriptor(t, list(t.shape), list(t.stride()), [bm, BK])
                     for t, bm in ((q, BM), (rows, BN))] if tma else [q, rows]
            _tile_best_kernel[(min(programs, qblocks * tiles),)](
                *loads, vals, ids, after, b, n, d, tiles, qblocks, BM=BM, BN=BN,
                BK=BK, KEEP=KEEP, PROGRAMS=programs, TMA=tma, num_warps=WARPS, num_stages=STAGES)
    except Exception as exc:  # a compiler or launcher error: score blocks serve from now on
        _FAILED[key] = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"pefa_gpu: the Triton top-k kernel failed on {key[0]} for {key[1]} rows "
                      f"({_FAILED[key]}); using score blocks instead", RuntimeWarning,
                      stacklevel=2)
        return None
    top, pos = torch.topk(vals.view(b, -1), w, dim=1)
    top, ids, unsettled = _score_worst_tiles(q, rows, top, ids.view(b, -1).gather(1, pos).long(),
                                             after)
    odd = ~torch.isfinite(q).all(1)  # NaN / inf queries (in rows' dtype): scored by the caller
    top = top.masked_fill(odd.unsqueeze(1), 0.0)  # (their lists: any order, NaN first or not)
    return top, ids, unsettled | odd | ~torch.isfinite(top).all(1)


def _score_worst_tiles(q: torch.Tensor, rows: torch.Tensor, top: torch.Tensor, ids: torch.Tensor,
                       after: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-w lists (B, w) from the kept scores, and each tile's next score ``after`` (B, tiles)
    -> the lists with the ``REDO_TILES`` worst tiles (highest next scores) of up to
    ``REDO_SHARE`` of the queries, unsettled ones first, scored in full, and (B,) bool
    unsettled: some other tile's next score reaches the w-th (the caller scores those)."""
    (b, w), tiles = top.shape, after.shape[1]
    unsettled = after.amax(1) >= top[:, -1]
    r = torch.sort((~unsettled).byte(), stable=True).indices[:math.ceil(REDO_SHARE * b)]
    hit, redo = unsettled[r, None], min(REDO_TILES, tiles)
    nxt, worst = torch.topk(after[r], min(redo + 1, tiles), dim=1)
    cols = (worst[:, :redo, None] * BN + torch.arange(BN, device=rows.device)).flatten(1)
    past = cols >= rows.shape[0]  # the last tile's columns past n
    cols = cols.masked_fill(past, 0)
    scores = rowdots(q, rows, r[:, None].expand_as(cols).flatten(), cols.flatten())
    old_v, old_i = top[r], ids[r]
    mine = (old_i[:, :, None] // BN == worst[:, None, :redo]).any(2)  # kept in those tiles
    v = torch.cat([old_v.masked_fill(mine, float("-inf")),
                   scores.view_as(cols).masked_fill(past, float("-inf"))], 1)
    v, pos = torch.topk(v, w, dim=1)  # the kept scores of those tiles replaced by all of theirs
    i = torch.cat([old_i, cols], 1).gather(1, pos)
    top[r], ids[r] = torch.where(hit, v, old_v), torch.where(hit, i, old_i)
    left = nxt[:, redo] if nxt.shape[1] > redo else torch.full_like(v[:, 0], float("-inf"))
    unsettled[r] = hit[:, 0] & (left >= v[:, -1])
    return top, ids, unsettled
