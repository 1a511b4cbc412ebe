"""The λ × k grid of ERM / PEFA-XS / PEFA-XL (NUDGE, the query side), each expensive search made
once: ``pg.sweep(P, Q, Y, test_queries, Y_test).best("recall@10")``."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, Iterator, Sequence

import torch

from .aggregate import normalize_rows
from .arrays import ArrayLike, DeviceLike, as_embeddings, check_topk, resolve_device
from .errors import InputError
from .methods import REGISTRY, takes
from .metrics import check_ks, evaluate
from .models import ERM, NUDGE, PEFAXL, PEFAXS
from .query import QueryAdapter, VectorPRF
from .params import XLParams, XLSearchParams, check_flag, check_grid, check_positive
from .relevance import RelevanceLike, as_relevance
from .topk import merge_lists, topk_rows

log = logging.getLogger("pefa_gpu")

PAPER_LAMS: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
PAPER_KS: tuple[int, ...] = (16, 32, 64)
DEFAULT_METHODS: tuple[str, ...] = ("erm", "xs", "xl")
METHODS: tuple[str, ...] = tuple(REGISTRY)  # every method a grid can name (tune's default)
TABLE_METRICS: tuple[str, ...] = ("recall@10", "recall@100", "ndcg@10")  # markdown columns


@dataclasses.dataclass(frozen=True)
class Config:
    """A grid point: a REGISTRY method, lam / k (None off its axes); gamma: a NUDGE fit's step
    (not part of a config's identity)."""

    method: str
    lam: float | None = None
    k: int | None = None
    gamma: float | None = dataclasses.field(default=None, compare=False)

    def label(self) -> str:
        parts = (self.method.upper(), self.lam is not None and f"λ={self.lam:g}",
                 self.k is not None and f"k={self.k}",
                 self.gamma is not None and f"γ={self.gamma:.4g}")
        return " ".join(x for x in parts if x)


@dataclasses.dataclass
class SweepResult:
    """rows: one dict per configuration: method, lam, k and the metrics of
    :func:`pefa_gpu.evaluate`; timings: seconds per stage ('erm', 'xs', 'xl' fit + search)."""

    rows: list[dict[str, Any]]
    timings: dict[str, float]

    def best(self, metric: str = "recall@10", method: str | None = None) -> dict[str, Any]:
        """The row with the largest ``metric`` (first in grid order on ties)."""
        rows = [r for r in self.rows if method is None or r["method"] == method]
        if not rows:
            raise InputError("no rows" + (f" for method {method!r}" if method else ""))
        metrics = sorted(set(rows[0]) - {f.name for f in dataclasses.fields(Config)})
        if not isinstance(metric, str) or metric not in metrics:  # 'lam': None > float
            raise InputError(f"metric {metric!r} is not one of {metrics}")
        return max(rows, key=lambda r: r[metric])

    def to_markdown(self, metrics: Sequence[str] = TABLE_METRICS) -> str:
        return markdown_table(self.rows, metrics)


def markdown_table(rows: Sequence[dict[str, Any]], metrics: Sequence[str] = TABLE_METRICS) -> str:
    """Rows of method / lam / k / metrics as a markdown table (4 decimals); a γ column when a
    row has a NUDGE step ("gamma")."""
    metrics = _names([metrics] if isinstance(metrics, str) else metrics,  # not one per letter
                     "metrics must be metric names (a str or a sequence of them)")
    if rows and (absent := [m for m in metrics if not any(m in r for r in rows)]):
        known = sorted({m for r in rows for m, v in r.items() if isinstance(v, float)})
        raise InputError(f"metric {absent[0]!r} is in no row (a blank column); the rows hold "
                         f"{known}")
    gamma = any(r.get("gamma") is not None for r in rows)
    head = ["method", "λ", "k", *(["γ"] if gamma else []), *metrics]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    formats = {"lam": "g", "k": "", **({"gamma": ".4g"} if gamma else {})}  # blank for None
    for r in rows:
        cells = [r["method"].upper(),
                 *("" if r.get(c) is None else format(r[c], f) for c, f in formats.items()),
                 *(f"{r[m]:.4f}" if m in r else "" for m in metrics)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def grid(methods: Sequence[str] = DEFAULT_METHODS, lams: Sequence[float] = PAPER_LAMS,
         ks: Sequence[int] = PAPER_KS) -> list[Config]:
    """The configurations of a sweep, in the order it reports them."""
    methods, lams, ks = check_sweep_grid(methods, lams, ks)
    return [Config(m, lam, k) for m in methods  # None on an axis the method has not
            for k in (ks if "k" in REGISTRY[m].axes else (None,))
            for lam in (lams if "lam" in REGISTRY[m].axes else (None,))]


def sweep_search(P: ArrayLike, Q: ArrayLike, Y: RelevanceLike, queries: ArrayLike,
                 methods: Sequence[str] = DEFAULT_METHODS,
                 lams: Sequence[float] = PAPER_LAMS, ks: Sequence[int] = PAPER_KS,
                 topk: int = 100, device: DeviceLike = None, backend: str = "exact",
                 candidates: int = XLSearchParams.candidates, knn_norm: str = XLParams.knn_norm,
                 rescore: bool = XLParams.rescore, augment_docs: bool = XLParams.augment_docs,
                 show_progress: bool = True, timings: dict[str, float] | None = None
                 ) -> Iterator[tuple[Config, torch.Tensor, torch.Tensor]]:
    """Yield (config, scores (B, topk) float32, ids (B, topk) int64) for every grid point of
    P (n, d) documents, Q (m, d) training queries, Y (m, n) relevance and queries (B, d);
    ``timings`` (when given) accumulates seconds per method."""
    from tqdm.auto import tqdm

    methods, lams, ks = check_sweep_grid(methods, lams, ks)
    topk = check_positive(topk, "topk")
    candidates = XLSearchParams(candidates=candidates).candidates  # before it is compared
    check_flag(show_progress, "show_progress")
    timings = {} if timings is None else timings
    if not isinstance(timings, dict):  # a list failed after the first method's search
        raise InputError(f"timings must be a dict (it collects seconds per method) or None, "
                         f"got {type(timings).__name__}")
    dev = resolve_device(device)
    q = as_embeddings(queries, dev, "queries", check_norm=False).detach().float()
    common = dict(backend=backend, device=dev)
    # exact backend: ERM's top-k is the prefix of XL's passage search (same index, same tie
    # rule), so with both methods the passage index is built and searched once
    reuse = "erm" in methods and "xl" in methods and backend == "exact" and candidates >= topk

    @functools.cache  # the query side's ERM and adapter, made once
    def query_side(name: str) -> Any:
        return ERM(**common).fit(P) if name == "erm" else QueryAdapter(device=dev).fit(Q, Y, P)

    @functools.cache  # XL's model, queries and passage search, made once
    def passage() -> tuple[PEFAXL, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        xl = PEFAXL(lam=lams[0], k=max(ks), knn_norm=knn_norm, rescore=rescore,
                    augment_docs=augment_docs, **common,
                    search_params=XLSearchParams(candidates=candidates)).fit(P, Q, Y)
        qq = xl.as_queries(q)  # candidates beyond the documents clamped, as PEFAXL.search's
        return xl, qq, xl.index.search(qq, min(candidates, max(xl.index.ntotal, topk)))
    with tqdm(total=len(grid(methods, lams, ks)), desc="sweep", unit="config",
              disable=not show_progress) as bar:
        for method in methods:
            t0 = time.perf_counter()
            spec = REGISTRY[method]
            if spec.model == "NUDGE":
                nudge = NUDGE(**dict(spec.fixed), **common).fit(P, Q, Y)
                out = [(Config(method, gamma=nudge.fitted_gamma), *nudge.search(q, topk))]
            elif spec.model == "PEFAXS":  # the plain or the adapted queries
                xs = PEFAXS(lam=lams[0], augment_docs=augment_docs, **common).fit(P, Q, Y)
                # as_queries: queries of another dimension were a bare matmul RuntimeError
                qq = query_side("adapter")(q) if spec.query else xs.as_queries(q)
                results = (_xs_all_lams(xs, qq, lams, topk) if backend == "exact" else
                           [xs.new_index().build(xs.xs_embeddings(lam)).search(qq, topk)
                            for lam in lams])  # other backends: one index over E(λ) per λ
                out = [(Config(method, lam), s, i) for lam, (s, i) in zip(lams, results)]
            elif spec.query:  # ERM over the adapted or fed-back queries
                erm = query_side("erm")
                qq = query_side("adapter")(q) if "adapter" in spec.query else VectorPRF()(q, erm)
                out = [(Config(method), *erm.search(qq, topk))]
            elif method == "erm":
                s, i = passage()[2] if reuse else ERM(**common).fit(P).search(q, topk)
                # copies: a caller writing them wrote the passage search XL fuses after them
                s, i = (x[:, :topk].clone(memory_format=torch.contiguous_format) for x in (s, i))
                out = [(Config("erm"), s, i)]
            else:
                xl, qq, erm = passage()
                fused = xl.fuse_grid(qq, erm, xl.neighbours(qq, max(ks), erm), lams, ks, topk)
                out = [(Config("xl", lam, k), s, i) for (lam, k), (s, i) in fused.items()]
            timings[method] = timings.get(method, 0.0) + time.perf_counter() - t0
            for item in out:
                bar.update(1)
                yield item


# bytes a cell of a score block costs in _xs_all_lams: its two float32 scores, their maximum
# and the kept mask (13), with room for the mixed tables of the kept cells (a quarter cell)
XS_CELL_BYTES = 16


def _xs_all_lams(xs: PEFAXS, q: torch.Tensor, lams: Sequence[float], topk: int,
                 block_cells: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Exact top-k of ``λ <q,P> + (1-λ) <q,Π(A)>`` for every λ from two score passes, in blocks
    of at most ``block_cells`` float32 cells (default: ``memory_budget`` / XS_CELL_BYTES)."""
    topk = check_topk(topk, xs.n_docs)  # bounded before any (B, topk) table
    if block_cells is None:  # xs has the exact backend here
        block_cells = max(1, xs.index.memory_budget // XS_CELL_BYTES)
    p, a = xs.doc_embeddings.float(), normalize_rows(xs.doc_sums)
    b, n = q.shape[0], p.shape[0]
    q_batch = max(1, min(b, block_cells // max(min(n, 4096), 1)))
    chunk = max(block_cells // q_batch, topk, 1)
    batches = []  # per query batch, per λ: (scores, ids)
    for s in range(0, max(b, 1), q_batch):  # one empty batch without queries
        qb = q[s:s + q_batch]
        best = [(qb.new_empty(len(qb), 0), qb.new_empty(len(qb), 0, dtype=torch.long))] * len(lams)
        for c in range(0, n, chunk):
            tops = _xs_block_topk(qb @ p[c:c + chunk].T, qb @ a[c:c + chunk].T, lams, topk,
                                  max(1, block_cells // 4))
            best = [merge_lists([top, (v, torch.where(i >= 0, i + c, -1))], topk)
                    for top, (v, i) in zip(best, tops)]
        batches.append(best)
    return [tuple(map(torch.cat, zip(*part))) for part in zip(*batches)]


def _xs_block_topk(sp_: torch.Tensor, sa_: torch.Tensor, lams: Sequence[float], topk: int,
                   table_cells: int = 2**24) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Top-k columns of ``λ sp_ + (1-λ) sa_`` (B, N) for every λ, ties to the lower column,
    over the columns whose max(sp_, sa_) reaches every λ's k-th best seed mix (less rounding)."""
    b, n = sp_.shape
    kk = min(topk, n)
    if kk == 0 or b == 0 or 4 * kk >= n:
        return [topk_rows(lam * sp_ + (1.0 - lam) * sa_, topk) for lam in lams]
    seeds = torch.sort(torch.cat([torch.topk(sp_, kk, dim=1).indices,
                                  torch.topk(sa_, kk, dim=1).indices], 1), dim=1).values
    dup = torch.zeros_like(seeds, dtype=torch.bool)
    dup[:, 1:] = seeds[:, 1:] == seeds[:, :-1]
    w_p, w_a = (torch.tensor(w, dtype=torch.float32, device=sp_.device).view(-1, 1, 1)
                for w in ([float(x) for x in lams], [1.0 - float(x) for x in lams]))
    mix = w_p * sp_.gather(1, seeds) + w_a * sa_.gather(1, seeds)  # (L, B, 2 kk)
    low = torch.topk(mix.masked_fill_(dup, float("-inf")), kk, dim=2).values[:, :, -1:].amin(0)
    keep = torch.maximum(sp_, sa_) >= low - low.abs() * 2**-20  # the mixes' rounding
    rows, cols = keep.nonzero(as_tuple=True)          # row-major: columns ascend per row
    counts = keep.sum(1)
    pos = torch.arange(rows.numel(), device=sp_.device) - (torch.cumsum(counts, 0) - counts)[rows]
    width = int(counts.max())
    col_table = torch.full((b, width), -1, dtype=torch.long, device=sp_.device)
    col_table[rows, pos] = cols
    a_k, b_k = sp_[rows, cols], sa_[rows, cols]
    out = []
    group = max(1, min(len(lams), table_cells // max(b * width, 1)))  # λs per mixed table
    for g in range(0, len(lams), group):
        n_g = len(lams[g:g + group])
        table = torch.full((n_g, b, width), float("-inf"), device=sp_.device)
        table[:, rows, pos] = w_p[g:g + group, :, 0] * a_k + w_a[g:g + group, :, 0] * b_k
        v, j = topk_rows(table.reshape(-1, width), topk)
        i = torch.where(j >= 0, col_table.repeat(n_g, 1).gather(1, j.clamp_min(0)), -1)
        out += zip(v.reshape(n_g, b, -1), i.reshape(n_g, b, -1))
    return out


def sweep(P: ArrayLike, Q: ArrayLike, Y: RelevanceLike, queries: ArrayLike, Y_test: RelevanceLike,
          methods: Sequence[str] = DEFAULT_METHODS, lams: Sequence[float] = PAPER_LAMS,
          ks: Sequence[int] = PAPER_KS, metric_ks: Sequence[int] = (10, 100),
          device: DeviceLike = None, **kwargs: Any) -> SweepResult:
    """Every grid configuration evaluated on (queries, Y_test (B x n) relevance, graded gains
    allowed): a :class:`SweepResult`; other keyword arguments go to :func:`sweep_search`."""
    metric_ks = check_ks(metric_ks)
    if clash := sorted(set(kwargs) & {"topk", "timings"}):  # was 'multiple values' TypeError
        raise InputError(f"sweep sets {clash[0]} itself (topk: the largest metric_ks; timings: "
                         f"SweepResult.timings); drop {clash[0]}")
    if _rows(P) is not None:  # not sweep_search's "topk=K", a name the caller never gave
        check_topk(max(metric_ks), _rows(P), "metric_ks: k")
    # a Y_test of other columns than documents was scored as if it fitted (before any fit)
    Y_test = as_relevance(Y_test, (_rows(queries), _rows(P)), "Y_test", allow_empty=True)
    timings: dict[str, float] = {}
    rows = [{**dataclasses.asdict(cfg), **evaluate(ids, Y_test, metric_ks)}
            for cfg, _, ids in sweep_search(P, Q, Y, queries, methods, lams, ks,
                                            topk=max(metric_ks), device=device,
                                            timings=timings, **kwargs)]
    return SweepResult(rows, timings)


def _rows(x: Any) -> int | None:
    """Rows of a 2-D array-like that has a shape (numpy, torch, cupy), else None."""
    shape = getattr(x, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) == 2 else None


def check_sweep_grid(methods: Sequence[str], lams: Sequence[float], ks: Sequence[int]
                     ) -> tuple[tuple[str, ...], tuple[float, ...], tuple[int, ...]]:
    """Methods (names, or one comma-separated string), λs and ks as tuples, each once."""
    if isinstance(methods, str):
        methods = [m for m in methods.split(",") if m.strip()]
    methods = _names(methods, f"methods must be a non-empty subset of {list(METHODS)} (a "
                              f"sequence of names or one comma-separated string)")
    methods = tuple(dict.fromkeys(m.strip().lower() for m in methods))
    if not methods or not set(methods) <= set(METHODS):
        raise InputError(f"methods must be a non-empty subset of {list(METHODS)}, got "
                         f"{list(methods)}")
    return (methods, *check_grid(lams, ks, (not takes(methods, "lam"), not takes(methods, "k"))))


def _names(value: Any, must: str) -> tuple[str, ...]:
    """``value`` (a sequence of str) as a tuple, else InputError "{must}, got {value!r}"."""
    try:  # None / 5 were tuple()'s bare TypeError, [['recall@10']] 'unhashable type'
        names = tuple(value)
    except TypeError:
        names = (None,)
    if not all(isinstance(m, str) for m in names):
        raise InputError(f"{must}, got {value!r:.100}")
    return names
