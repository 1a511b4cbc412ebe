"""Choose method, λ and k on held-out training queries, never below ERM.

    res = pg.tune(P, Q, Y)               # res.chosen: Config('xs', 0.3, None) or ERM's
    model = pg.fit_config(res.chosen, P, Q, Y)   # refit on every training pair

Each configuration is fitted on a seeded part of the training queries and scored on the rest
(``val_fraction``). The best by the mean recall of ``metric`` is kept only when its gain over
ERM is at least ``min_z`` standard errors and a sign test passes at that level; else ERM.
With ``test_queries``, fitting pairs are dropped until the validation coverage matches the
test queries' estimated one (the share whose plain top-1 document has a training pair).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Sequence

import numpy as np
import scipy.sparse as sp
from scipy import stats

from .arrays import (ArrayLike, DeviceLike, as_embeddings, check_topk, resolve_device,
                     to_numpy)
from .errors import InputError
from .methods import fit_config
from .models import ERM
from .params import check_nonnegative, check_number
from .relevance import Relevance, RelevanceLike, as_relevance
from .splits import split_queries
from .sweep import (METHODS, PAPER_KS, PAPER_LAMS, Config, SweepResult, _rows,
                    check_sweep_grid, sweep_search)
from .metrics import _gains, check_ks, evaluate

log = logging.getLogger("pefa_gpu")
__all__ = ["TuneResult", "fit_config", "match_coverage", "parse_metric", "per_query_recall",
           "tune"]


@dataclasses.dataclass
class TuneResult:
    """chosen (ERM: lam=1.0, k=None) and why (``reason``); validation: a row of metrics and
    ``objective`` per configuration; gain_se: s.e. of best's gain over ERM; n_fit / n_val:
    training queries fitted on / held out."""

    chosen: Config
    metric: str
    validation: SweepResult
    erm_objective: float
    best: Config
    best_objective: float
    gain_se: float
    reason: str
    n_fit: int
    n_val: int
    seed: int
    coverage: dict[str, float] | None = None


def parse_metric(metric: str) -> tuple[int, ...]:
    """'recall@10,recall@100' -> (10, 100)."""
    ks = []
    for part in str(metric).split(","):
        name, _, k = part.strip().partition("@")
        # isdigit: '²' too; over 18 digits: int()'s ValueError past 4300, and no k reaches them
        if name != "recall" or not k.isdecimal() or len(k) > 18 or int(k) <= 0:
            raise InputError(f"metric must be recall@K terms joined by commas (e.g. "
                             f"'recall@10,recall@100'), got {metric!r}")
        ks.append(int(k))
    return tuple(ks)


def per_query_recall(ids: ArrayLike, Y: RelevanceLike, ks: Sequence[int]) -> np.ndarray:
    """(B,) mean over ``ks`` of |relevant ∩ top-k| / |relevant| (NaN: no relevant document)
    for ids (B, K) int64, -1 padded (a repeat counts once), Y (B x n) (> 0: relevant)."""
    ks = check_ks(ks)  # () divided by zero; 0 or -1 cut the ranks silently
    gains, n_rel, _ = _gains(ids, Y, "Y")  # its name here: not evaluate's Y_test
    if max(ks) > gains.shape[1]:  # as evaluate: a recall@10 of 5 ranks is not one
        raise InputError(f"ids have {gains.shape[1]} ranks per query, fewer than k = {max(ks)}")
    return sum(np.where(n_rel > 0, (gains[:, :k] > 0).sum(1) / np.maximum(n_rel, 1), np.nan)
               for k in ks) / len(ks)


def tune(P: ArrayLike, Q: ArrayLike, Y: RelevanceLike, methods: Sequence[str] = METHODS,
         lams: Sequence[float] = PAPER_LAMS, ks: Sequence[int] = PAPER_KS,
         val_fraction: float = 0.2, seed: int = 0, metric: str = "recall@10,recall@100",
         min_z: float = 2.0, device: DeviceLike = None, test_queries: ArrayLike | None = None,
         **sweep_kwargs: Any) -> TuneResult:
    """Pick method / λ / k (module docstring). P (n, d), Q (m, d), Y (m x n); test_queries
    (t, d): the queries to serve, for coverage matching. ERM is always a candidate.
    ``sweep_kwargs`` go to :func:`pefa_gpu.sweep.sweep_search` (backend, candidates, ...)."""
    rec_ks = parse_metric(metric)
    check_number(min_z, "min_z")
    dev = resolve_device(device)
    q_all = as_embeddings(Q, dev, "Q", check_norm=False)
    rel = as_relevance(Y, shape=(q_all.shape[0], _rows(P)))  # columns: P's documents
    if _rows(P) is not None:  # was sweep's "topk=K" message (P a list: it still is)
        check_topk(max(rec_ks), _rows(P), f"metric {metric!r}: K")
    fit_rows, val_rows = split_queries(q_all.shape[0], val_fraction, seed)
    y_fit, y_val = rel.rows(fit_rows), rel.rows(val_rows)
    if not (y_val.csr.data > 0).any():  # every objective would be NaN: nothing to compare
        raise InputError(f"tune: none of the {val_rows.size} held-out training queries has a "
                         f"relevant document, so no configuration can be compared with ERM: "
                         f"change seed / val_fraction")
    coverage, chosen = None, Config("erm", 1.0, None)
    if test_queries is not None:
        y_fit, coverage = match_coverage(P, q_all[val_rows], y_fit, y_val, rel, test_queries,
                                         seed, dev, sweep_kwargs.get("backend", "exact"))
        if y_fit.nnz == 0:
            reason = ("the training pairs do not reach the documents the test queries look "
                      "for, so ERM (λ = 1) is kept")
            return TuneResult(chosen, metric, SweepResult([], {}), float("nan"), chosen,
                              float("nan"), float("nan"), reason, int(fit_rows.size),
                              int(val_rows.size), seed, coverage)
    methods = ["erm", *check_sweep_grid(methods, lams, ks)[0]]
    topk = max(*rec_ks, 100)
    rows, gains = [], {}
    for cfg, _, ids in sweep_search(P, q_all[fit_rows], y_fit, q_all[val_rows], methods, lams,
                                    ks, topk=topk, device=dev, **sweep_kwargs):
        gains[cfg] = per_q = per_query_recall(ids, y_val, rec_ks)
        rows.append({**dataclasses.asdict(cfg), **evaluate(ids, y_val, sorted({10, 100, *rec_ks})),
                     "objective": float(np.nanmean(per_q))})
    erm_vals = next(v for c, v in gains.items() if c.method == "erm")
    ok = ~np.isnan(erm_vals)
    erm_obj = float(np.mean(erm_vals[ok]))
    # the best by objective; on ties the earlier in grid order (ERM first, then the methods)
    best = max(gains, key=lambda c: np.nanmean(gains[c]))
    diff = gains[best][ok] - erm_vals[ok]
    gain = float(diff.mean())
    se = float(diff.std(ddof=1) / math.sqrt(diff.size)) if diff.size > 1 else float("inf")
    up, down = int((diff > 0).sum()), int((diff < 0).sum())
    p_sign = float(stats.binomtest(up, up + down, alternative="greater").pvalue) \
        if up + down else 1.0
    if best.method == "erm" or gain <= 0:
        reason = (f"no configuration beats ERM on validation ({metric} {erm_obj:.4f}); the "
                  f"training signal does not help here, so ERM (λ = 1) is kept")
    elif gain < min_z * se or p_sign > stats.norm.sf(min_z):
        reason = (f"the best configuration, {best.label()}, gains only {gain:+.4f} ± {se:.4f} "
                  f"(s.e.) over ERM on validation ({metric}; {up} queries up, {down} down, sign "
                  f"test p = {p_sign:.3g}): not significant at {min_z:g} standard errors; ERM "
                  f"(λ = 1) is kept")
    else:
        chosen = best
        reason = (f"{best.label()} gains {gain:+.4f} ± {se:.4f} (s.e.) over ERM on validation "
                  f"({metric}: {erm_obj:.4f} -> {erm_obj + gain:.4f})")
    log.debug("tune: %s", reason)
    return TuneResult(chosen, metric, SweepResult(rows, {}), erm_obj, best, erm_obj + gain, se,
                      reason, int(fit_rows.size), int(val_rows.size), seed, coverage)


def match_coverage(P: ArrayLike, q_val: ArrayLike, y_fit: RelevanceLike, y_val: RelevanceLike,
                   y_all: RelevanceLike, test_queries: ArrayLike, seed: int = 0,
                   device: DeviceLike = None, backend: str = "exact"
                   ) -> tuple[Relevance, dict[str, float]]:
    """(fitting pairs matched to the estimated test coverage, info): ``val_coverage``,
    ``proxy_val`` / ``proxy_test`` (top-1 documents with a training pair),
    ``test_coverage_estimate``, ``matched_coverage`` (module docstring)."""
    seed = check_nonnegative(seed, "seed")  # 1.5 / -2: numpy's errors, only when pairs drop
    erm = ERM(backend=backend, device=device).fit(P)
    n = erm.n_docs  # columns of other widths were an IndexError, or indexed silently
    qv = as_embeddings(q_val, erm.device, "q_val", dim=erm.dim, check_norm=False)
    yf = as_relevance(y_fit, (None, n), "y_fit", allow_empty=True).csr
    yv = as_relevance(y_val, (qv.shape[0], n), "y_val", allow_empty=True).csr
    ya = as_relevance(y_all, (None, n), "y_all").csr
    cov_fit = np.bincount(yf.indices, minlength=n) > 0  # documents with a fitting pair
    cov_all = np.bincount(ya.indices, minlength=n) > 0
    top_val = to_numpy(erm.search(qv, 1)[1])[:, 0]
    tq = as_embeddings(test_queries, erm.device, "test_queries", dim=erm.dim, check_norm=False)
    if not tq.shape[0]:  # a test coverage of 0 dropped every fitting pair
        raise InputError("test_queries is empty: the coverage match estimates from the queries "
                         "to serve; give them, or test_queries=None")
    top_test = to_numpy(erm.search(tq, 1)[1])[:, 0]
    proxy_val = float(cov_fit[top_val[top_val >= 0]].mean()) if (top_val >= 0).any() else 0.0
    proxy_test = float(cov_all[top_test[top_test >= 0]].mean()) if (top_test >= 0).any() else 0.0
    pairs_per_doc = np.bincount(yv.indices, minlength=n)
    covered = int(pairs_per_doc[cov_fit].sum())
    total = max(int(yv.nnz), 1)
    val_cov = covered / total
    target = min(1.0, val_cov * proxy_test / proxy_val) if proxy_val > 0 else val_cov
    info = {"val_coverage": val_cov, "proxy_val": proxy_val, "proxy_test": proxy_test,
            "test_coverage_estimate": target, "matched_coverage": val_cov}
    if target >= val_cov:
        return as_relevance(y_fit, allow_empty=True), info
    drop = np.zeros(n, dtype=bool)
    for i in np.random.default_rng(seed + 1).permutation(yv.shape[0]):
        if covered / total <= target:
            break
        docs = yv.indices[yv.indptr[i]:yv.indptr[i + 1]]
        newly = docs[cov_fit[docs] & ~drop[docs]]
        drop[newly] = True
        covered -= int(pairs_per_doc[newly].sum())
    info["matched_coverage"] = covered / total
    return Relevance(yf @ sp.diags((~drop).astype(np.float32))), info
