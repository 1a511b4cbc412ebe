"""The search stage: shard servers (:class:`ShardServer`) answer each query batch on their
device; :func:`search_batch` merges their top-k. :func:`evaluate_configs`: every stage."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch

from ..arrays import DeviceLike, as_embeddings, check_topk
from ..errors import FormatError, InputError
from ..fuse import searches
from ..methods import REGISTRY
from ..metrics import evaluate
from ..models import ERM, PEFAXL
from ..params import (XLParams, XLSearchParams, check_choice, check_positive,
                      check_unit_interval)
from ..protocol import Model
from ..sweep import Config
from ..topk import merge_lists
from .aggregation import aggregate
from .indexing import METHODS, build
from .runner import LocalRunner
from .shards import (Entry, Rows, Stage, check_folders, open_entry, read_stage,
                     write_relevance, write_rows)

DEFAULT_BATCH = 8192        # test queries per search round (each round reads every shard)
Result = tuple[torch.Tensor, torch.Tensor]
_CHECKS = {"lam": check_unit_interval, "k": check_positive, "candidates": check_positive}


class _Loaded(NamedTuple):
    lo: int
    hi: int
    model: Model
    query_rows: torch.Tensor | None  # a PEFA-XL shard's training queries (global rows)

    def search(self, q: torch.Tensor, k: int, params: dict | None) -> Result:
        """Its (PEFA-XL: passage) index's top-k; ``params``: search settings (None: its own)."""
        return self.model.index.search(q.to(self.model.device), k, params)


def _load(folder: Path, entry: Entry, device: DeviceLike, info: Stage, xl: bool) -> _Loaded:
    """A build shard, checked: an ERM (``xl``: a PEFAXL and its sorted query rows) of its rows."""
    shard = open_entry(folder, entry, device=device)
    model, rows, (lo, hi) = shard.model, shard.tensors.get("query_rows"), entry.rows
    want = PEFAXL if xl else ERM
    ok = type(model) is want and model.n_docs == hi - lo and model.dim == info.dim
    if ok and xl:  # global training-query rows, at most one per row of the model
        ok = rows is not None and rows.dtype == torch.int64 and rows.ndim == 1 \
            and rows.numel() <= model.n_train_queries \
            and bool(((rows >= 0) & (rows < info.m)).all() and (rows.diff() > 0).all())
    if not ok:
        raise FormatError(f"{folder / entry.name} does not hold the {want.__name__} of its "
                          f"{hi - lo} rows, dimension {info.dim}"
                          f"{' (and its query rows)' if xl else ''}")
    return _Loaded(lo, hi, model, None if rows is None else rows.to(model.device))


def _gather(shards: Sequence[_Loaded], k: int,
            search: Callable[[_Loaded, int], Result]) -> Result | None:
    """``search(shard, min(k, its size))`` on each shard, ids global, merged to k (None: none)."""
    out = None
    for s in shards:
        sc, i = search(s, min(k, s.model.n_docs))
        out = merge_lists([out, (sc, torch.where(i >= 0, i + s.lo, i))], k, as_is=True)
    return out


class ShardServer:
    """Some shards of a :func:`build` stage on ``device``; a search round's merged top-k."""

    def __init__(self, build: str | Path, doc_shards: Sequence[int],
                 query_shards: Sequence[int] = (), device: DeviceLike = None):
        folder = Path(build)
        self.info = read_stage(folder, "build")
        xl = self.info.method == "xl"
        for name, picked, n in (("doc_shards", doc_shards, len(self.info.shards)),
                                ("query_shards", query_shards, len(self.info.query_shards))):
            if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool)
                       and 0 <= i < n for i in picked) or len(set(picked)) < len(picked):
                raise InputError(f"{name} must be distinct shard numbers in [0, {n}), got "
                                 f"{list(picked)!r}")  # [0, 0]: each result twice; -1 the last
        self.docs = [_load(folder, self.info.shards[s], device, self.info, xl)
                     for s in doc_shards]
        self.queries = [_load(folder, self.info.query_shards[r], device, self.info, False)
                        for r in query_shards]

    def erm(self, q: torch.Tensor, k: int, params: dict | None = None) -> Result | None:
        """Top-k over the document shards (XL's: the passage index)."""
        return _gather(self.docs, k, lambda s, kk: s.search(q, kk, params))

    def knn(self, q: torch.Tensor, k: int, params: dict | None = None) -> Result | None:
        """Top-k training queries over this server's query shards (global rows)."""
        return _gather(self.queries, k, lambda s, kk: s.search(q, kk, params))

    def fuse(self, q: torch.Tensor, erm: Result, knn: Result, topk: int, lam: float,
             k: int) -> Result | None:
        """PEFA-XL's fused top-``topk`` over this server's documents: each shard fuses the
        global candidates and neighbours in its own numbering (-1 where not its own)."""
        def one(s: _Loaded, kk: int) -> Result:
            dev, e_ids = s.model.device, erm[1].to(s.model.device)
            e_local = torch.where((e_ids >= s.lo) & (e_ids < s.hi), e_ids - s.lo, -1)
            k_local = _local_rows(knn[1].to(dev), self.info.m, s)
            return s.model.fuse(q.to(dev), (erm[0].to(dev), e_local), (knn[0].to(dev), k_local),
                                kk, lam=lam, k=k)
        return _gather(self.docs, topk, one)


def _local_rows(r: torch.Tensor, m: int, s: _Loaded) -> torch.Tensor:
    """Global relevance rows (queries < m, document j as m + j) -> the shard model's rows
    (its training queries, then its documents), -1 where a row is not its own."""
    local_ = torch.full_like(r, -1)
    rows = s.query_rows
    if rows.numel():
        pos = torch.searchsorted(rows, r.clamp(0, max(m - 1, 0))).clamp_max(rows.numel() - 1)
        local_ = torch.where((r >= 0) & (r < m) & (rows[pos] == r), pos, local_)
    if s.model.params.augment_docs:
        mine = (r >= m + s.lo) & (r < m + s.hi)  # document r - m, one of the shard's
        local_ = torch.where(mine, s.model.n_train_queries + r - m - s.lo, local_)
    return local_


def search_batch(fan: Any, info: Stage, q: torch.Tensor, topk: int,
                 lam: float | None = None, k: int | None = None,
                 candidates: int | None = None, params: dict | None = None) -> Result:
    """One round of queries (B, d) float32 over the servers of ``fan``: the merged top-k;
    PEFA-XL merges the passage and query searches, then each document shard fuses."""
    if info.method != "xl":
        (parts,) = fan.call(("erm", (q, topk, params)))
        return merge_lists(parts, topk, as_is=True)
    p = info.params
    lam = p.lam if lam is None else lam
    k = p.k if k is None else k
    kp = min(info.candidates if candidates is None else candidates, info.n)

    def search(x: torch.Tensor, w_erm: int, w_knn: int) -> tuple[Result, Result]:
        erm, knn = fan.call(("erm", (x, w_erm, params)), ("knn", (x, w_knn, params)))
        return merge_lists(erm, w_erm, as_is=True), merge_lists(knn, w_knn, as_is=True)
    erm, knn = searches(q, search, kp=kp, k=k, m=info.m, n=info.n, augment_docs=p.augment_docs)
    (parts,) = fan.call(("fuse", (q, (erm[0][:, :kp], erm[1][:, :kp]), knn, topk, lam, k)))
    return merge_lists(parts, topk, as_is=True)


def server_groups(info: Stage, workers: int) -> list[tuple[list[int], list[int]]]:
    """Contiguous blocks of document and query shards for ``workers`` servers (none empty)."""
    n_d, n_q = len(info.shards), len(info.query_shards)
    groups = [(list(range(n_d * w // workers, n_d * (w + 1) // workers)),
               list(range(n_q * w // workers, n_q * (w + 1) // workers))) for w in range(workers)]
    return [(d, q) for d, q in groups if d or q]


def search(build: str | Path, queries: Any, topk: int = 100, lam: float | None = None,
           k: int | None = None, candidates: int | None = None,
           batch_size: int = DEFAULT_BATCH, device: DeviceLike = None, runner: Any = None,
           show_progress: bool = False, params: dict | None = None) -> Result:
    """Search a :func:`build` stage: (B, d) queries or a row stage -> (B, topk) float32 scores,
    int64 ids on the CPU (-1 padded, ties to the lower id); ``params``: indexes' search settings."""
    from tqdm.auto import tqdm

    batch_size = check_positive(batch_size, "batch_size")
    check_folders(build=build)
    info = read_stage(build, "build")
    topk = check_topk(topk, info.n)
    for name, v in (("lam", lam), ("k", k), ("candidates", candidates)):
        if v is not None:
            _CHECKS[name](v, name)
    if isinstance(queries, (str, os.PathLike)):  # any other PathLike: 'must be an array'
        source = Rows(queries)
        _check_build_dim(build, info, source.dim)
        if source.dim != info.dim:
            raise InputError(f"queries have dimension {source.dim}, the build {info.dim}")
        n_q, read = source.n, lambda lo, hi: as_embeddings(
            source.read(lo, hi), "cpu", f"queries[{lo}:{hi}]", check_norm=False)
    else:
        shape = getattr(queries, "shape", ())
        _check_build_dim(build, info, int(shape[1]) if len(shape) == 2 else info.dim)
        qall = as_embeddings(queries, "cpu", "queries", dim=info.dim, check_norm=False)
        n_q, read = qall.shape[0], lambda lo, hi: qall[lo:hi]
    run = runner or LocalRunner()
    out = [(torch.empty(0, topk), torch.empty(0, topk, dtype=torch.long))]
    with run.servers(ShardServer, build, server_groups(info, run.workers), device) as fan:
        for lo in tqdm(range(0, n_q, batch_size), desc="search", unit="batch",
                       disable=not show_progress):
            q = read(lo, min(lo + batch_size, n_q)).contiguous()
            out.append([t.cpu() for t in search_batch(fan, info, q, topk, lam, k, candidates,
                                                      params)])
    return tuple(map(torch.cat, zip(*out)))


def _check_build_dim(build: str | Path, info: Stage, dim: int) -> None:
    """Where queries of dimension ``dim`` do not fit the build's stage.json: FormatError if the
    build's first shard does not fit it either (a forged or mixed-up file, not the queries)."""
    if dim != info.dim:
        _load(Path(build), info.shards[0], "cpu", info, info.method == "xl")


def evaluate_configs(P: Any, Q: Any, Y: Any, queries: Any, Y_test: Any,
                     configs: Sequence[Any], work: str | Path, *, backend: str = "exact",
                     index_params: Any = None, candidates: int = XLSearchParams.candidates,
                     knn_norm: str = XLParams.knn_norm, rescore: bool = XLParams.rescore,
                     augment_docs: bool = XLParams.augment_docs, device: DeviceLike = None,
                     ks: Sequence[int] = (10, 100), topk: int = 100, count_empty: bool = False,
                     doc_rows: int | None = None, query_rows: int | None = None,
                     runner: Any = None, show_progress: bool = True) -> list[dict[str, Any]]:
    """A :func:`pefa_gpu.evaluate` dict per :class:`pefa_gpu.Config` through the stages in
    ``work`` (seen by every worker): P (n, d), Q (m, d), queries (B, d) arrays or row stages,
    Y (m x n), Y_test (B x n); shards default to an even split over the workers."""
    from tqdm.auto import tqdm

    for cfg in configs:  # before any stage is written (lam None / '0.1': a raw format error)
        if not isinstance(cfg, Config):
            raise InputError(f"configs must hold pefa_gpu.Config's, got {cfg!r}")
        check_choice(cfg.method, "method", METHODS)
        for axis in REGISTRY[cfg.method].axes:  # xs: lam; xl: lam and k
            _CHECKS[axis](getattr(cfg, axis), axis)
    run = runner or LocalRunner()
    check_folders(work=work)
    work = Path(work)
    prows, qrows = (Rows(x if isinstance(x, (str, os.PathLike))
                         else write_rows(x, work / n, stage=n))
                    for x, n in ((P, "docs"), (Q, "queries")))  # arrays written as row stages
    docs, train = prows.folder, qrows.folder
    doc_rows = max(-(-prows.n // run.workers), 1) if doc_rows is None else doc_rows
    query_rows = max(-(-qrows.n // run.workers), 1) if query_rows is None else query_rows
    rel = write_relevance(Y, work / "pairs", rows=query_rows)
    common = dict(backend=backend, index_params=index_params, device=device,
                  doc_rows=doc_rows, runner=run)

    def index(cfg: Any) -> Path:
        if cfg.method == "xs":  # {:g} gave 0.1 and 0.1000001 one folder: the later's index
            name = f"xs-{float(cfg.lam)!r}"  # was then searched for both
            agg = aggregate(train, rel, docs, work / name, lam=cfg.lam,
                            augment_docs=augment_docs, doc_rows=doc_rows, runner=run)
            return build("xs", work / f"{name}-index", docs, embeddings=agg, **common)
        xl = dict(queries=train, relevance=rel, lam=cfg.lam, k=cfg.k, candidates=candidates,
                  knn_norm=knn_norm, rescore=rescore, augment_docs=augment_docs)
        return build(cfg.method, work / cfg.method, docs,
                     **(xl if cfg.method == "xl" else {}), **common)

    built: dict[tuple, Path] = {}
    results = []
    for cfg in tqdm(configs, desc="pipeline", unit="config", disable=not show_progress):
        key = (cfg.method, cfg.lam) if cfg.method == "xs" else (cfg.method,)
        if key not in built:
            built[key] = index(cfg)
        _, ids = search(built[key], queries, topk=topk, lam=cfg.lam, k=cfg.k, device=device,
                        runner=run)
        results.append(evaluate(ids, Y_test, ks, count_empty=count_empty))
    return results
