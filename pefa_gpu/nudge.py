"""NUDGE (Zeighami et al., 2024): document embeddings moved toward their training queries.

d_j: unit document rows (n, d); g_j = Σ_i Y[i, j] q_i; ĝ_j = Π(g_j) (0 where g_j = 0).

- NUDGE-M (‖Δ_j‖ <= γ): e_j = d_j + γ ĝ_j.
- NUDGE-N (‖e_j‖ = 1, ‖Δ_j‖² <= γ): e_j = ĝ_j where <d_j, ĝ_j> >= 1 - γ/2; else
  (1 - γ/2) d_j + sqrt(γ - γ²/4) Π(g_j - <d_j, g_j> d_j); d_j is kept where g_j is 0,
  parallel to d_j or <d_j, g_j> < 0 (as the authors' nudge-ft).

γ is chosen on validation queries with the g_j of the fitting queries. NUDGE-M: the smallest
γ >= 0 under which the most validation pairs (q, x) have x as the top-1 (ties win). NUDGE-N:
the first γ of nudge-ft's grid (0, 0.02, ..., 0.48) with the best mean |top-``val_k`` ∩
relevant| / min(|relevant|, ``val_k``) (queries with no relevant document left out).
"""

from __future__ import annotations

import math

import numpy as np
import scipy.sparse as sp
import torch

from .aggregate import normalize_rows
from .arrays import as_tensor
from .errors import InputError
from .params import FLOAT32_MAX, check_positive, is_number
from .topk import topk_rows

N_GAMMAS: tuple[float, ...] = tuple(0.02 * x for x in range(25))  # NUDGE-N's γ grid
BLOCK_CELLS = 2**22  # score cells (queries x documents) per validation step


def nudge_m(d: torch.Tensor, g: torch.Tensor, gamma: float) -> torch.Tensor:
    """NUDGE-M: e = d + γ Π(g). d (n, D) unit rows, g (n, D) query sums -> (n, D) float32."""
    _check_gamma(gamma, FLOAT32_MAX)  # γ scales float32 rows
    _check_tensors("nudge_m", d=d, g=g)
    return d.float() + gamma * normalize_rows(g)


def nudge_n(d: torch.Tensor, g: torch.Tensor, gamma: float) -> torch.Tensor:
    """NUDGE-N (module docstring). d (n, D) unit rows, g (n, D) query sums, 0 <= γ <= 4 ->
    (n, D) float32 unit rows (d where a document does not move)."""
    _check_gamma(gamma, 4.0)  # beyond: math's bare "math domain error"; NaN: NaN rows
    _check_tensors("nudge_n", d=d, g=g)
    d, g = d.float(), g.float()
    if gamma == 0:
        return d.clone()
    v = (d * g).sum(1, keepdim=True)
    g_hat = normalize_rows(g)
    reach = ((d * g_hat).sum(1, keepdim=True) >= 1.0 - gamma / 2) & (g_hat != 0).any(1, True)
    ortho = g - v * d
    stay = (v < 0) | ~(ortho != 0).any(1, keepdim=True)
    moved = (1.0 - gamma / 2) * d + math.sqrt(gamma - gamma * gamma / 4) * normalize_rows(ortho)
    return torch.where(reach, g_hat, torch.where(stay, d, moved))


def _check_gamma(gamma: float, top: float) -> None:
    if not is_number(gamma) or not 0.0 <= gamma <= top:
        raise InputError(f"gamma must be a finite number in [0, {top:g}], got {gamma!r}")


def _check_tensors(who: str, **xs: torch.Tensor) -> None:
    """TypeError naming the arguments that are no torch tensor (numpy's: 'no attribute float')."""
    bad = {k: type(x).__name__ for k, x in xs.items() if not isinstance(x, torch.Tensor)}
    if bad:
        raise TypeError(f"{who}: {', '.join(bad)} must be torch.Tensor, got "
                        f"{', '.join(bad.values())}")


def choose_gamma(variant: str, d: torch.Tensor, g: torch.Tensor, q_val: torch.Tensor,
                 y_val: sp.csr_matrix, val_k: int = 1) -> float:
    """γ chosen on validation queries q_val (v, D) with relevance y_val (v x n), for documents
    d (n, D) unit rows with fitting-query sums g (n, D) (module docstring)."""
    if variant not in ("M", "N"):  # anything else was taken as 'N'
        raise InputError(f"variant must be 'M' or 'N', got {variant!r}")
    val_k = check_positive(val_k, "val_k")  # 0 was numpy's reshape error
    _check_tensors("choose_gamma", d=d, g=g, q_val=q_val)
    n, dim = d.shape
    if g.shape != d.shape or q_val.ndim != 2 or q_val.shape[1] != dim \
            or tuple(y_val.shape) != (q_val.shape[0], n):  # were torch's errors, or taken
        raise InputError(f"d, g, q_val, y_val must be (n, D), (n, D), (v, D), (v, n); got "
                         f"{tuple(d.shape)}, {tuple(g.shape)}, {tuple(q_val.shape)}, "
                         f"{tuple(y_val.shape)}")
    y = sp.csr_matrix(y_val > 0, dtype=np.float32)
    if variant == "M":
        return _choose_gamma_m(d.float(), normalize_rows(g), q_val.float(), y)
    return _choose_gamma_n(d.float(), g.float(), q_val.float(), y, val_k)


def _choose_gamma_m(d: torch.Tensor, g_hat: torch.Tensor, q: torch.Tensor,
                    y: sp.csr_matrix) -> float:
    lows, highs, step = [], [], max(1, BLOCK_CELLS // max(d.shape[0], 1))  # no documents: 0
    for s0 in range(0, q.shape[0], step):
        b = slice(s0, s0 + step)
        yb = y[b].tocoo()
        if not yb.nnz:  # (its two (step, n) products would bound no pair)
            continue
        qd, qg = q[b] @ d.T, q[b] @ g_hat.T  # (step, n) <q, d_j>, <q, ĝ_j>
        # (pairs, n) tables ``step`` pairs at a time, not every pair at once (memory)
        for p0 in range(0, yb.nnz, step):
            rows = as_tensor(yb.row[p0:p0 + step].astype(np.int64), device=d.device)
            cols = as_tensor(yb.col[p0:p0 + step].astype(np.int64), device=d.device)[:, None]
            s, t = qd[rows], qg[rows]
            ds, dt = s - s.gather(1, cols), t - t.gather(1, cols)
            # x wins iff ds_j + γ dt_j <= 0 for every j: on one interval [lo, hi] of γ
            ratio = -ds / torch.where(dt == 0, 1.0, dt)
            lo = torch.where(dt < 0, ratio, float("-inf")).amax(1).clamp_min(0.0)
            hi = torch.where(dt > 0, ratio, float("inf")).amin(1)
            ok = ~((dt == 0) & (ds > 0)).any(1) & (lo <= hi)
            lows.append(lo[ok].cpu().double().numpy())
            highs.append(hi[ok].cpu().double().numpy())
    lo, hi = (np.sort(np.concatenate([*x, np.empty(0)])) for x in (lows, highs))
    if not lo.size:
        return 0.0
    cover = np.searchsorted(lo, lo, "right") - np.searchsorted(hi, lo, "left")
    return float(lo[int(np.argmax(cover))])


def _choose_gamma_n(d: torch.Tensor, g: torch.Tensor, q: torch.Tensor, y: sp.csr_matrix,
                    val_k: int) -> float:
    n_rel = np.diff(y.indptr)
    keep = np.flatnonzero(n_rel > 0)
    if not keep.size:
        return 0.0
    q, y = q[as_tensor(keep, device=q.device)], y[keep]
    k = min(val_k, d.shape[0])
    denom = as_tensor(np.minimum(n_rel[keep], k), dtype=torch.float64)
    accs, step = [], max(1, BLOCK_CELLS // d.shape[0])
    for gamma in N_GAMMAS:
        e = nudge_n(d, g, gamma)
        hits = []
        for s in range(0, q.shape[0], step):
            b = slice(s, s + step)
            top = topk_rows(q[b] @ e.T, k)[1].cpu().numpy()  # ties: the lower id
            rows = np.repeat(np.arange(top.shape[0]), k)
            hits.append(np.asarray(y[b][rows, top.ravel()]).reshape(top.shape).sum(1))
        accs.append(float((as_tensor(np.concatenate(hits), dtype=torch.float64) / denom).mean()))
    return N_GAMMAS[int(np.argmax(accs))]  # the first best
