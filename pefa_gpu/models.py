"""The three retrieval models: ERM (plain inner product), PEFA-XS and PEFA-XL.

All share one shape::

    model = pg.PEFAXS(lam=0.5, backend="exact", device=None).fit(P, Q, Y)
    scores, ids = model.search(queries, topk=100)   # (B, topk) float32 / int64, -1 padded

Embeddings are stored on ``device`` (default: CUDA when available) as torch tensors; results
come back on that device.

Build settings (``Params``: lam, k, ...; the backend's ``index_params``) are fixed by ``fit``.
Search settings change per call without a refit: the model's own (PEFA-XL ``candidates``) and
the backend's (HNSW ``ef_search``, IVF ``nprobe``, CAGRA ``itopk_size``, ...)::

    xl = pg.PEFAXL(backend="hnsw", search_params={"candidates": 500, "ef_search": 300})
    xl.search(queries, 10, params={"candidates": 300, "ef_search": 500})  # this call only
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

from . import fuse_kernels
from .aggregate import normalize_rows, pifa
from .arrays import (as_embeddings, as_tensor, check_positive_int, csr_tensors, resolve_device,
                     to_numpy)
from .errors import FormatError, InputError
from .fuse import fuse_scores
from .index import Index, backend_class, make_index
from .params import Params, check_choice, check_positive, check_unit_interval
from .relevance import Relevance, as_relevance

log = logging.getLogger("pefa_gpu")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ERMParams(Params):
    """The plain embedding model: no parameters of its own."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class XSParams(Params):
    """lam: weight of the ERM embedding (1 = plain ERM). augment_docs: each document also counts
    as a training query for itself (a_j += p_j)."""

    lam: float = 0.5
    augment_docs: bool = True

    def validate(self) -> None:
        check_unit_interval(self.lam, "lam")
        check_choice(self.augment_docs, "augment_docs", (True, False))


@dataclasses.dataclass(frozen=True, kw_only=True)
class XLParams(Params):
    """lam: weight of the ERM score. k: training-query neighbours. knn_norm: 'k' weighs a
    neighbour by s/k, 'none' by s. rescore: exact <q, p_j> for every candidate (else 0 outside
    the ERM candidates). augment_docs: documents join the query index as queries labelled with
    themselves."""

    lam: float = 0.1
    k: int = 16
    knn_norm: str = "k"
    rescore: bool = True
    augment_docs: bool = True

    def validate(self) -> None:
        check_unit_interval(self.lam, "lam")
        check_positive(self.k, "k")
        check_choice(self.knn_norm, "knn_norm", ("k", "none"))
        check_choice(self.rescore, "rescore", (True, False))
        check_choice(self.augment_docs, "augment_docs", (True, False))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ERMSearchParams(Params):
    """ERM's own search settings: none (its index's are the backend's SearchParams)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class XSSearchParams(Params):
    """PEFA-XS's own search settings: none (its index's are the backend's SearchParams)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class XLSearchParams(Params):
    """PEFA-XL's own search settings. candidates: ERM candidates Kp taken from the passage
    index."""

    candidates: int = 500

    def validate(self) -> None:
        check_positive(self.candidates, "candidates")


class _Model:
    """Shared plumbing: params, search params, device, backend, the search entry point.

    Constructor: the model's build settings as keywords (``Params``); ``backend`` and
    ``index_params`` (its build settings); ``search_params``: the defaults of :meth:`search`,
    in any form :meth:`search` takes as ``params``. Keywords of the model's ``SearchParams``
    (``PEFAXL(candidates=300)``) and search keys inside a dict ``index_params``
    (``index_params={"ef_search": 500}`` for hnsw) are taken as search settings too, as before
    build and search settings were apart.
    """

    Params: type[Params] = ERMParams
    SearchParams: type[Params] = ERMSearchParams
    # attributes model.save() writes and pefa_gpu.load() restores (stored by type: see persist.py)
    _saved: tuple[str, ...] = ("dim", "n_docs", "index")
    _indices: tuple[str, ...] = ("index",)  # attributes holding this model's indices

    def __init__(self, *, backend: str = "exact", device: Any = None,
                 index_params: Params | dict | None = None,
                 search_params: Params | dict | list | tuple | None = None, **params: Any):
        legacy = {k: params.pop(k) for k in list(params) if k in _field_names(self.SearchParams)}
        try:
            self.params = self.Params(**params)
        except TypeError as exc:
            raise InputError(f"{type(self).__name__}: {exc}") from exc
        self.backend = backend
        self.device = resolve_device(device)
        if isinstance(index_params, dict):
            index_params, index_search = backend_class(backend).split_params(index_params)
            legacy.update(index_search)
        self.index_params = index_params
        probe = make_index(backend, self.device, index_params)  # fail early on bad settings
        self._index_search_class = probe.SearchParams
        self.search_params = self.SearchParams()
        if legacy:
            twice = sorted(set(legacy) & _search_keys(search_params))
            if twice:
                raise InputError(f"{type(self).__name__}: {twice} given twice (as keywords or "
                                 f"in index_params, and in search_params)")
            search_params = [legacy, *(search_params if isinstance(search_params, (list, tuple))
                                       else [search_params])]
        self.search_params, index_search = self._split_search_params(search_params)
        self.index_search_params = probe.resolve_search_params(index_search)
        self.dim = 0
        self.n_docs = 0

    def __getattr__(self, name: str) -> Any:
        for holder in ("params", "_search_params"):
            params = self.__dict__.get(holder)
            if params is not None and name in _field_names(type(params)):
                return getattr(params, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __repr__(self) -> str:
        settings = {**self.params.to_dict(), **self.search_params.to_dict()}
        fields = ", ".join(f"{k}={v!r}" for k, v in settings.items())
        return (f"{type(self).__name__}({fields}{', ' if fields else ''}backend={self.backend!r},"
                f" device='{self.device}', n_docs={self.n_docs})")

    @property
    def search_params(self) -> Params:
        """The model's own search settings (its ``SearchParams``; PEFA-XL: ``candidates``),
        the defaults of :meth:`search`. Assign a ``SearchParams`` or a dict of its keys."""
        return self._search_params

    @search_params.setter
    def search_params(self, value: Params | dict | None) -> None:
        self._search_params = self.SearchParams.coerce(
            value, f"{type(self).__name__}.search_params")

    @property
    def index_search_params(self) -> Params:
        """The backend's search settings (e.g. HNSWSearchParams), the defaults of every index
        search the model makes (PEFA-XL: of both indices; read from the passage index once
        fitted). Assign the backend's ``SearchParams`` or a dict of its keys: all the model's
        indices take it."""
        index = self.__dict__.get("index")
        return index.search_params if index is not None else self._index_search_params

    @index_search_params.setter
    def index_search_params(self, value: Params | dict | None) -> None:
        value = self._index_search_class.coerce(
            value, f"{type(self).__name__}.index_search_params")
        self._index_search_params = value
        for name in self._indices:
            index = self.__dict__.get(name)
            if index is not None:
                index.search_params = value

    def _split_search_params(self, params: Any) -> tuple[Params, Params | dict | None]:
        """``params`` as :meth:`search` takes it -> (the model's SearchParams, completed from
        :attr:`search_params`; the backend's: None when not given, a dict of changes that
        each index applies to its own defaults, or a SearchParams)."""
        own_keys = _field_names(self.SearchParams)
        index_keys = _field_names(self._index_search_class)
        own, index = self.search_params, None
        for item in params if isinstance(params, (list, tuple)) else [params]:
            if item is None:
                continue
            if isinstance(item, self.SearchParams):
                own = item
            elif isinstance(item, self._index_search_class):
                index = item
            elif isinstance(item, dict):
                unknown = sorted(set(item) - own_keys - index_keys)
                if unknown:
                    raise InputError(
                        f"{type(self).__name__} search got unknown settings {unknown}; valid: "
                        f"{sorted(own_keys)} ({self.SearchParams.__name__}) and "
                        f"{sorted(index_keys)} ({self._index_search_class.__name__}, backend "
                        f"{self.backend!r})")
                own = own.replace(**{k: v for k, v in item.items() if k in own_keys})
                changes = {k: v for k, v in item.items() if k not in own_keys}
                if changes:
                    index = index.replace(**changes) if isinstance(index, Params) else \
                        {**(index or {}), **changes}
            else:
                raise TypeError(f"{type(self).__name__} search params must be a dict, a "
                                f"{self.SearchParams.__name__}, a "
                                f"{self._index_search_class.__name__} or a list of them, got "
                                f"{type(item).__name__}")
        if isinstance(index, dict):  # values checked now, not in the middle of a search
            self._index_search_class.coerce(index)
        return own, index

    def _new_index(self) -> Index:
        return make_index(self.backend, self.device, self.index_params,
                          search_params=self.index_search_params)

    def _check_fitted(self) -> None:
        if not self.n_docs:
            raise InputError(f"{type(self).__name__} is not fitted: call fit() first")

    def _queries(self, queries: Any, check: bool | None = None) -> torch.Tensor:
        self._check_fitted()
        if check is None:  # reading the values would synchronise a CUDA device: not there
            check = not (isinstance(queries, torch.Tensor) and queries.is_cuda)
        q = as_embeddings(queries, self.device, "queries", dim=self.dim, check_norm=False,
                          check_finite=check)
        return q.detach()

    def _embeddings(self, P: Any, Q: Any = None, Y: Any = None):
        p = as_embeddings(P, self.device, "P", copy=True).detach()
        if p.shape[0] == 0:
            raise InputError("P has no rows: there are no documents to index")
        if Q is None:
            return p, None, None
        q = as_embeddings(Q, self.device, "Q", dim=p.shape[1], copy=True).detach()
        rel = as_relevance(Y, shape=(q.shape[0], p.shape[0]))
        return p, q, rel

    def search(self, queries: Any, topk: int = 100, check: bool | None = None, *,
               params: Params | dict | list | tuple | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, d) queries -> (B, topk) float32 scores and int64 ids (-1 padded) on the device.

        ``params``: search settings for this call only (the defaults, :attr:`search_params`
        and :attr:`index_search_params`, stay as they are): a dict of the model's keys (PEFA-XL
        ``candidates``) and the backend's (hnsw ``ef_search`` / ``full_scan_factor``, ivf
        ``nprobe``, cagra ``itopk_size`` / ``search_width`` / ``max_iterations``), keys left
        out keep their defaults (each index its own); or the model's ``SearchParams`` (e.g.
        XLSearchParams) or the backend's (e.g. HNSWSearchParams), which replace those defaults
        whole; or a list of these, applied in order. Unknown keys are an InputError naming the
        valid ones. PEFA-XL applies the backend's settings to both its indices.

        The queries are detached (no autograd graph is kept). ``check`` tests them for NaN /
        inf, by default only when they are not already a CUDA tensor: ERM and PEFAXS then search
        a CUDA batch with no device-to-host synchronisation at all. PEFAXL's fusion does
        synchronise (candidate sets of data-dependent size: torch.unique, masks, the widest
        row), a few times per batch of 256 queries; its :meth:`score` does not.
        """
        topk = check_positive_int(topk, "topk")
        model_sp, index_sp = (self.search_params, None) if params is None else \
            self._split_search_params(params)
        if check is None:  # reading the values would synchronise a CUDA device: not there
            check = not (isinstance(queries, torch.Tensor) and queries.is_cuda)
        return self._search(self._queries(queries, check), topk, model_sp, index_sp,
                            checked=check)

    def _search(self, q: torch.Tensor, topk: int, model_sp: Params, index_sp: Params | None,
                checked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``model_sp`` / ``index_sp``: the model's and the backend's search settings (None:
        each index's defaults). ``checked``: ``q`` has been tested for NaN / inf already."""
        return self.index.search(q, topk, index_sp)

    def score(self, queries: Any, ids: Any, check: bool | None = None) -> torch.Tensor:
        """(B, d) queries (may require grad), (B, K) int64 ids (-1 = padding) -> (B, K) PEFA
        scores, differentiable w.r.t. the queries, -inf at padding. See pefa_gpu.training."""
        from .training import score

        return score(self, queries, ids, check=check)

    def add_documents(self, P_new: Any) -> "_Model":
        """Append (r, d) documents (ids n .. n+r-1) without a refit. See pefa_gpu.updates."""
        from .updates import add_documents

        return add_documents(self, P_new)

    def add_pairs(self, Q_new: Any, Y_new: Any) -> "_Model":
        """PEFAXS / PEFAXL: add training queries (m', d) with relevance (m' x n) without a
        refit; equal to refitting on all the data. See pefa_gpu.updates."""
        from .updates import add_pairs

        return add_pairs(self, Q_new, Y_new)

    def export_hnsw(self, path: str | Path, **kwargs: Any) -> Path:
        """Write a faiss IndexHNSWCagra (graph built on the model's device) that a CPU-only
        machine opens with ``faiss.read_index``; PEFAXL writes a directory with both indices.
        See :func:`pefa_gpu.export.export_model` (kwargs: M, method, ef_search, ...)."""
        from .export import export_model

        return export_model(self, path, **kwargs)

    def save(self, directory: str | Path) -> None:
        """Write the fitted model into ``directory`` atomically (replacing an earlier save
        there only once the new one is complete); read it back with :func:`pefa_gpu.load`."""
        from .persist import save_model

        save_model(self, directory)

    @classmethod
    def load(cls, directory: str | Path, device: Any = None, mmap: bool = False) -> "_Model":
        """Like :func:`pefa_gpu.load`, but the save must hold this class (else FormatError)."""
        from .persist import load_model

        return load_model(directory, device=device, mmap=mmap, expect=cls)

    def _restore(self) -> None:
        """Rebuild state derived from the ``_saved`` attributes after a load."""


class ERM(_Model):
    """The embedding model alone: inner-product search over the document embeddings P."""

    Params = ERMParams
    SearchParams = ERMSearchParams
    _saved = _Model._saved + ("doc_embeddings",)

    def fit(self, P: Any) -> "ERM":
        """P: (n, d) document embeddings."""
        p, _, _ = self._embeddings(P)
        self.doc_embeddings = p  # for score() and add_documents()
        self.index = self._new_index().build(p)
        self.dim, self.n_docs = p.shape[1], p.shape[0]
        return self


class PEFAXS(_Model):
    """PEFA-XS: one index over e_j = lam p_j + (1 - lam) Π(a_j), a_j = sum_i Y[i, j] q_i
    (+ p_j with augment_docs)."""

    Params = XSParams
    SearchParams = XSSearchParams
    _saved = _Model._saved + ("doc_embeddings", "doc_sums")

    def fit(self, P: Any, Q: Any, Y: Any) -> "PEFAXS":
        """P: (n, d) documents, Q: (m, d) training queries, Y: (m, n) relevance."""
        p, q, rel = self._embeddings(P, Q, Y)
        if self.params.augment_docs:  # p_j as the first query of document j: add_pairs then
            # continues each sum in the same order and equals a refit to the bit (CPU)
            eye = sp.identity(p.shape[0], dtype="float32", format="csr")
            rel, q = Relevance(sp.vstack([eye, rel.csr], format="csr")), torch.cat([p, q])
        sums = pifa(rel, q, normalize=False, device=self.device)
        self.doc_embeddings, self.doc_sums = p, sums
        self.index = self._new_index().build(self.xs_embeddings())
        self.dim, self.n_docs = p.shape[1], p.shape[0]
        return self

    def xs_embeddings(self, lam: float | None = None) -> torch.Tensor:
        """E = lam P + (1 - lam) Π(A): (n, d) float32; ``lam`` defaults to the model's."""
        lam = self.params.lam if lam is None else lam
        check_unit_interval(lam, "lam")
        return lam * self.doc_embeddings.float() + (1.0 - lam) * normalize_rows(self.doc_sums)


class PEFAXL(_Model):
    """PEFA-XL: a passage index and a training-query index; the k nearest training queries
    vote for their relevant documents, mixed with the ERM score."""

    Params = XLParams
    SearchParams = XLSearchParams
    _saved = _Model._saved + ("doc_embeddings", "relevance", "query_index")
    _indices = ("index", "query_index")

    def fit(self, P: Any, Q: Any, Y: Any) -> "PEFAXL":
        """P: (n, d) documents, Q: (m, d) training queries, Y: (m, n) relevance.

        The query index holds the m training queries only. With ``augment_docs`` the documents
        are training queries too (rows m .. m+n-1 of ``relevance``, each labelled with itself),
        but they are not indexed twice: their neighbours come from the passage search that XL
        makes anyway (see :meth:`neighbours`).
        """
        p, q, rel = self._embeddings(P, Q, Y)
        n = p.shape[0]
        y = rel.csr
        if self.params.augment_docs:
            y = sp.vstack([y, sp.identity(n, dtype="float32", format="csr")], format="csr")
        self.doc_embeddings = p
        self.relevance = Relevance(y)
        self._y = csr_tensors(self.relevance.csr, self.device)
        self.index = self._new_index().build(p)
        self.query_index = self._new_index().build(q)
        self.dim, self.n_docs = p.shape[1], n
        return self

    @property
    def n_train_queries(self) -> int:
        """m: the training queries (rows 0 .. m-1 of ``relevance``; the query index rows)."""
        return self.relevance.shape[0] - (self.n_docs if self.params.augment_docs else 0)

    def neighbours(self, q: torch.Tensor, k: int,
                   erm: tuple[torch.Tensor, torch.Tensor] | None = None,
                   params: Params | dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The k nearest training queries N of each query: (B, k) scores and ``relevance`` row
        ids (-1 padded), ties to the lower row.

        Without ``augment_docs`` this is the query index's top-k. With it, the candidate rows
        are the training queries (rows < m) and the documents (row m + j), and the top-k over
        both is the merge of the query index's top-k and the passage index's top-k, which is
        exactly the top-k of one index over [Q; P]. ``erm``: a passage search already made with
        at least k results (its first k are used), else one is made here. ``params``: the
        backend's search settings for both indices (None: their defaults).
        """
        s_q, i_q = self.query_index.search(q, k, params)
        if not self.params.augment_docs:
            return s_q, i_q
        if erm is None or erm[1].shape[1] < k:
            erm = self.index.search(q, k, params)
        s_p, i_p = erm[0][:, :k], erm[1][:, :k]
        m = self.n_train_queries
        # both lists are sorted (score descending, ties to the lower row) and every query row
        # is below every document row, so one stable sort of [queries, documents] merges them
        if q.device.type == "cpu":  # numpy: faster than torch's cat / argsort / gather here
            merged = _merge_neighbours_host((to_numpy(s_q), to_numpy(i_q)),
                                            (to_numpy(s_p.float()), to_numpy(i_p)), m, k)
            return tuple(map(as_tensor, merged))
        i_p = torch.where(i_p >= 0, i_p + m, -1)
        scores, rows = torch.cat([s_q, s_p.float()], 1), torch.cat([i_q, i_p], 1)
        order = torch.argsort(scores, dim=1, descending=True, stable=True)[:, :k]
        return scores.gather(1, order), rows.gather(1, order)

    def neighbour_vectors(self, rows: torch.Tensor) -> torch.Tensor:
        """Embeddings of ``relevance`` rows (any shape, valid ids) -> (*rows.shape, d) float32:
        training queries from the query index, documents (rows >= m) from P."""
        m = self.n_train_queries
        flat = rows.reshape(-1)
        out = self.query_index.reconstruct(flat.clamp_max(m - 1)).float()
        if self.params.augment_docs:
            docs = self.doc_embeddings[(flat - m).clamp_min(0)].float()
            out = torch.where((flat >= m).unsqueeze(1), docs, out)
        return out.reshape(*rows.shape, -1)

    def _restore(self) -> None:
        if self.query_index.ntotal != self.n_train_queries:
            raise FormatError(f"PEFAXL save: the query index holds {self.query_index.ntotal} "
                              f"rows but Y has {self.n_train_queries} training queries (a save "
                              f"from an older pefa_gpu that indexed the documents twice): refit")
        self._y = csr_tensors(self.relevance.csr, self.device)

    # search the passage index for topk + PRUNE_MARGIN candidates instead of ``candidates``
    # where that provably gives the same result (see _search); False: always ``candidates``
    prune_candidates: bool = True
    PRUNE_MARGIN = 8

    def _search(self, q: torch.Tensor, topk: int, model_sp: XLSearchParams,
                index_sp: Params | None, checked: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Passage search, neighbours, fusion, with exact candidate pruning. ``model_sp``: the
        model's search settings (``candidates``); ``index_sp``: the backend's, for both indices
        (None: their defaults).

        Let Kp = ``candidates`` and K' = max(topk + PRUNE_MARGIN, k); pruning is tried only
        when K' < Kp. Let C' be the first K' results of the passage search (a prefix of its
        top-Kp list C: ERM score descending, ties to the lower id). Claim: when (a)
        ``rescore`` is on, (b) lam > 0 and (c) every kNN
        contribution w(s_i) Y[i, j] of the neighbours found is >= 0 (neighbour scores >= 0 and
        Y >= 0), and (d) fl(lam e_K') < fl(lam e_topk) for the ERM scores e at positions K'
        and topk of C' (or the index holds fewer than K' rows, all in C'), fusing with C' in
        place of C gives the same top-``topk`` ids, tie rule included, and the same scores up
        to the last float32 bit (a voted document of C \ C' is re-scored by the fusion's own dot
        product instead of taking the index's matmul score; the two may round differently).

        Proof. Both runs have the same candidates except the documents j in C \ C' that no
        neighbour votes for, and give every common candidate the same fused score (rescore:
        f_erm = <q, p_j> whether or not j is an ERM candidate; f_knn does not depend on C). Such
        a j scores fl(lam e_j) (f_knn = 0; the kernel computes exactly fl(lam * e)), and
        e_j <= e_K' since C' is a prefix of C. Every one of the first topk documents j' of C'
        has e_j' >= e_topk and fused score fl(fl(lam e_j') + fl((1 - lam) f_knn(j'))) >=
        fl(lam e_j') >= fl(lam e_topk) > fl(lam e_K') >= fl(lam e_j): rounding is monotone,
        fl((1 - lam) v) >= 0 for v >= 0 (c), and fl(a + b) >= a for b >= 0. So topk
        candidates beat j strictly (no tie, whatever the ids), j is not in the unpruned top-
        ``topk``, and dropping it changes nothing. (d) is where float rounding bites: lam e
        for two close e may round to one value, and a tie would go to the lower id, which
        need not be the better ERM document; (d) is checked on the values themselves. With
        lam = 0, (d) always fails. Where (c) or (d) fails for a query, that query is searched
        with Kp candidates as before (rescore off never prunes: f_erm would drop to 0 for a
        voted document of C \ C').

        Pruning needs the passage index's scores to be f_erm itself (``exact_scores``: exact
        fp32, hnsw, ivf-flat, cagra), else it is off. The claim holds for an exact backend
        (whose top-K' is the prefix of its top-Kp). ANN backends answer the K' search at their
        own settings (HNSW: ef = max(ef_search, K')), the same approximation as any top-K'
        request to them.
        """
        p, kp = self.params, model_sp.candidates
        kt = max(topk + self.PRUNE_MARGIN, p.k)
        prunable = (self.prune_candidates and p.rescore and p.lam > 0 and kt < kp
                    and getattr(self.index, "exact_scores", False)
                    and self._relevance_nonnegative())
        if q.shape[0] and _host_batch(q):
            return self._search_host(q, topk, prunable, kt, kp, index_sp, checked)
        erm = self.index.search(q, kt if prunable else kp, index_sp)
        knn = self.neighbours(q, p.k, erm, index_sp)
        out = self.fuse(q, erm, knn, topk)
        if not prunable:
            return out
        rest = self._unprunable(erm, knn, topk)  # (c) or (d) fails: these get all Kp candidates
        if rest.numel():
            qr = q[rest]
            out[0][rest], out[1][rest] = self.fuse(qr, self.index.search(qr, kp, index_sp),
                                                   (knn[0][rest], knn[1][rest]), topk)
        return out

    def _search_host(self, q: torch.Tensor, topk: int, prunable: bool, kt: int, kp: int,
                     index_sp: Params | None, checked: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_search` for a small CPU batch (1 .. NUMPY_MAX_BATCH queries), step for step
        on numpy arrays (same results to the bit): searches, neighbour merge, fusion and the
        pruning test each cost a few microseconds per op instead of torch's ~5-10, and the
        result becomes a tensor once, at the end."""
        p = self.params
        qn = to_numpy(q)

        def search(index: Index, qt: torch.Tensor, qa: np.ndarray, k: int):
            return _index_search_host(index, qt, qa, k, checked, index_sp)
        erm = search(self.index, q, qn, kt if prunable else kp)
        knn = search(self.query_index, q, qn, p.k)
        if p.augment_docs:
            erm_k = search(self.index, q, qn, p.k) if erm[1].shape[1] < p.k else erm
            knn = _merge_neighbours_host(knn, erm_k, self.n_train_queries, p.k)
        rest = np.zeros(0, dtype=np.int64)
        if prunable:  # rows where pruning is not provably exact get all Kp candidates
            rest = _unprunable_host(erm, knn, topk, p.lam, self.index.ntotal <= erm[1].shape[1])
            if rest.size == len(qn):  # all of them (a single query, say): one search, one fusion
                erm = search(self.index, q, qn, kp)
                rest = rest[:0]
        out = self._fuse_host(qn, erm, knn, topk)
        if rest.size:
            qr = q[as_tensor(rest)]
            s, i = self._fuse_host(qn[rest], search(self.index, qr, qn[rest], kp),
                                   (knn[0][rest], knn[1][rest]), topk)
            out[0][rest], out[1][rest] = s, i
        return as_tensor(out[0], device=self.device), as_tensor(out[1], device=self.device)

    def _fuse_host(self, qn: np.ndarray, erm: tuple[np.ndarray, np.ndarray],
                   knn: tuple[np.ndarray, np.ndarray], topk: int, lam: float | None = None,
                   k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`fuse` on numpy queries and searches (a small CPU batch), numpy (writable)
        result; Y and P come from :meth:`_host_arrays`, built once per model."""
        p = self.params
        lam = p.lam if lam is None else lam
        k = p.k if k is None else k
        divisor = float(k) if p.knn_norm == "k" else 1.0
        exact = bool(getattr(self.index, "exact_scores", False))
        y, docs = self._host_arrays()
        out = fuse_kernels.fused_topk_host(
            qn, docs, y, erm[0], erm[1], knn[0][:, :k], knn[1][:, :k], lam=lam,
            knn_weight_divisor=divisor, rescore=p.rescore, topk=topk, erm_exact=exact)
        if out is None:  # a repeated ERM id (or ids beyond 31 bits): the general path
            t = tuple(map(as_tensor, (qn, *erm, knn[0][:, :k], knn[1][:, :k])))
            out = fuse_scores(t[0], self.doc_embeddings, *self._y, *t[1:], lam=lam,
                              knn_weight_divisor=divisor, rescore=p.rescore, topk=topk,
                              erm_exact=exact, kernel="general")
            out = to_numpy(out[0]), to_numpy(out[1])
        return out

    def _host_arrays(self) -> tuple[fuse_kernels.HostCSR, Any]:
        """Y and the document vectors as the host fusion reads them (cached per Y and P)."""
        cached = self.__dict__.get("_host_cache")
        if cached is None or cached[0] is not self._y or cached[1] is not self.doc_embeddings:
            cached = (self._y, self.doc_embeddings, fuse_kernels.HostCSR(*self._y),
                      fuse_kernels.host_docs(self.doc_embeddings))
            self._host_cache = cached
        return cached[2], cached[3]

    def _relevance_nonnegative(self) -> bool:
        """True when every stored Y entry is >= 0 (cached per Y)."""
        cached = self.__dict__.get("_y_nonneg")
        if cached is None or cached[0] is not self._y:
            cached = (self._y, bool((self._y[2] >= 0).all()))
            self._y_nonneg = cached
        return cached[1]

    def _unprunable(self, erm: tuple[torch.Tensor, torch.Tensor],
                    knn: tuple[torch.Tensor, torch.Tensor], topk: int) -> torch.Tensor:
        """Row numbers (int64) where (c) or (d) of :meth:`_search` fails on a top-K' passage
        search ``erm`` and the neighbours ``knn``. (d) compares fl(lam e) as the fusion computes
        it (float32 lam times the float32 score; numpy and torch round alike)."""
        found_all = self.index.ntotal <= erm[1].shape[1]  # every row is a candidate already
        scores, ids = erm
        lam = self.params.lam
        last = lam * scores[:, -1].float()
        bound = lam * scores[:, topk - 1].float()
        ok = ((knn[0] >= 0) | (knn[1] < 0)).all(1) & torch.where(ids[:, -1] >= 0, last < bound,
                                                                 found_all)
        return (~ok).nonzero().squeeze(1)

    def fuse(self, q: torch.Tensor, erm: tuple[torch.Tensor, torch.Tensor],
             knn: tuple[torch.Tensor, torch.Tensor], topk: int, lam: float | None = None,
             k: int | None = None, batch_size: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fuse precomputed searches: erm = (scores, ids) (B, Kp) from the passage index,
        knn = (scores, relevance rows) (B, K) from :meth:`neighbours` (not the query index
        alone: with augment_docs the documents are neighbours too), K >= k. ``lam`` / ``k``
        override the model's (a sweep searches once at the largest k and fuses many times).
        ``batch_size``: queries per fusion step (default 256 on CUDA, 4096 on the CPU, where
        each step's memory is small and per-step overhead is what counts)."""
        if batch_size is None:
            batch_size = 4096 if q.device.type == "cpu" else 256
        lam = self.params.lam if lam is None else lam
        k = self.params.k if k is None else k
        check_unit_interval(lam, "lam")
        check_positive(k, "k")
        if k > knn[1].shape[1]:
            raise InputError(f"k={k} but only {knn[1].shape[1]} neighbours were searched")
        if q.shape[0] and _host_batch(q):  # the numpy path, with Y prepared once per model
            s, i = self._fuse_host(to_numpy(q), (to_numpy(erm[0]), to_numpy(erm[1])),
                                   (to_numpy(knn[0]), to_numpy(knn[1])), topk, lam, k)
            return as_tensor(s), as_tensor(i)
        divisor = float(k) if self.params.knn_norm == "k" else 1.0
        out_s, out_i = [], []
        for s in range(0, q.shape[0], batch_size):
            sl = slice(s, s + batch_size)
            scores, ids = fuse_scores(
                q[sl], self.doc_embeddings, *self._y, erm[0][sl], erm[1][sl],
                knn[0][sl, :k], knn[1][sl, :k], lam=lam, knn_weight_divisor=divisor,
                rescore=self.params.rescore, topk=topk,
                erm_exact=bool(getattr(self.index, "exact_scores", False)))
            out_s.append(scores)
            out_i.append(ids)
        if len(out_s) == 1:
            return out_s[0], out_i[0]
        if not out_s:
            return (torch.empty(0, topk, device=self.device),
                    torch.empty(0, topk, dtype=torch.long, device=self.device))
        return torch.cat(out_s), torch.cat(out_i)


def _index_search_host(index: Index, q: torch.Tensor, qn: np.ndarray, k: int, checked: bool,
                       params: Params | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``index.search(q, k, params)`` as numpy arrays for a CPU batch ``q`` (``qn``: its numpy
    view; ``checked``: already tested for NaN / inf); faiss backends skip the torch hand-off."""
    if hasattr(index, "search_host"):
        return index.search_host(qn, k, check_finite=not checked, params=params)
    return tuple(map(to_numpy, index.search(q, k, params)))


def _field_names(cls: type[Params]) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _search_keys(params: Any) -> set[str]:
    """The setting names ``params`` (as :meth:`_Model.search` takes it) gives."""
    if isinstance(params, (list, tuple)):
        return set().union(*map(_search_keys, params)) if params else set()
    if isinstance(params, dict):
        return set(params)
    if isinstance(params, Params):
        return _field_names(type(params))
    return set()


def _merge_neighbours_host(knn: tuple[np.ndarray, np.ndarray],
                           erm: tuple[np.ndarray, np.ndarray], m: int,
                           k: int) -> tuple[np.ndarray, np.ndarray]:
    """The numpy merge of :meth:`PEFAXL.neighbours`: query-index top-k ``knn`` and the first
    k passage results ``erm`` (document j is relevance row m + j), numpy arrays -> top-k
    (scores, rows)."""
    i_p = erm[1][:, :k]
    rows_p = i_p + m if i_p[:, -1].min() >= 0 else np.where(i_p >= 0, i_p + m, -1)
    scores = np.concatenate((knn[0], erm[0][:, :k]), 1)
    at = (np.arange(len(scores))[:, None], np.argsort(-scores, axis=1, kind="stable")[:, :k])
    return scores[at], np.concatenate((knn[1], rows_p), 1)[at]


def _unprunable_host(erm: tuple[np.ndarray, np.ndarray], knn: tuple[np.ndarray, np.ndarray],
                     topk: int, lam: float, found_all: bool) -> np.ndarray:
    """The test of :meth:`PEFAXL._unprunable` on numpy searches: row numbers (int64) where it
    fails. A row at a time in Python: for the few rows of a host batch, scalar tests beat
    numpy's per-call overhead. Both searches are sorted, so the last found entry holds the
    smallest score."""
    (s, ids), (ks, ki) = erm, knn
    lam = np.float32(lam)
    bad = []
    for r in range(len(ids)):
        last = int(np.count_nonzero(ki[r] >= 0)) - 1 if ki[r, -1] < 0 else ki.shape[1] - 1
        knn_ok = last < 0 or ks[r, last] >= 0
        bound_ok = lam * s[r, -1] < lam * s[r, topk - 1] if ids[r, -1] >= 0 else found_all
        if not (knn_ok and bound_ok):
            bad.append(r)
    return np.array(bad, dtype=np.int64)


def _host_batch(x: torch.Tensor) -> bool:
    """A CPU batch small enough that numpy beats torch's per-op overhead (the threshold of
    :func:`pefa_gpu.fuse_kernels.fused_topk`'s host path)."""
    return x.device.type == "cpu" and x.shape[0] <= fuse_kernels.NUMPY_MAX_BATCH
