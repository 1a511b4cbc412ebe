"""The retrieval models: ERM, PEFA-XS, PEFA-XL and NUDGE (-M / -N); the math is DESIGN §1.

    model = pg.PEFAXS(lam=0.5, backend="exact", device=None).fit(P, Q, Y)
    scores, ids = model.search(queries, topk=100)   # (B, topk) float32 / int64, -1 padded
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Sequence, TypeVar

import numpy as np
import scipy.sparse as sp
import torch

from . import export, nudge, persist, training
from .aggregate import normalize_rows, pefa_xs, pifa
from .arrays import (ArrayLike, DeviceLike, as_embeddings, as_tensor, check_topk, require_finite,
                     resolve_device, to_numpy)
from .errors import FormatError, InputError
from .fuse import Array, RelevanceRows, fuse, nonzero, searches
from .index import Index, make_index
from .params import (ERMParams, ERMSearchParams, NUDGEParams, NUDGESearchParams, Params,
                     XLParams, XLSearchParams, XSParams, XSSearchParams, check_grid,
                     check_positive)
from .relevance import Relevance, RelevanceLike, as_relevance
from .splits import split_queries

log = logging.getLogger("pefa_gpu")

DEFAULT_MEMORY_BUDGET = 256 * 2**20  # bytes: ExactParams.memory_budget's default
SP = TypeVar("SP", bound=Params)  # a SearchParams class
M = TypeVar("M", bound="_Model")


class _Model:
    """Shared plumbing. Keywords: the model's ``Params`` fields, ``backend``, ``index_params``,
    and the search defaults ``search_params`` / ``index_search_params`` (typed)."""

    Params: type[Params] = ERMParams
    SearchParams: type[Params] = ERMSearchParams
    # attributes model.save() writes and pefa_gpu.load() restores (stored by type: see persist.py)
    _saved: tuple[str, ...] = ("dim", "n_docs", "index")
    _indices: tuple[str, ...] = ("index",)  # attributes holding this model's indices

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.__name__.startswith("_"):  # a shared base is never saved
            persist.register_model(cls)  # pefa_gpu.load finds the class by its name

    def __init__(self, *, backend: str = "exact", device: DeviceLike = None,
                 index_params: Params | dict | None = None, search_params: Params | None = None,
                 index_search_params: Params | None = None, **params: Any):
        try:
            self.params = self.Params(**params)
        except TypeError as exc:
            raise InputError(f"{type(self).__name__}: {exc} (search settings: search_params="
                             f"{self.SearchParams.__name__}(...), index_search_params=the "
                             f"backend's SearchParams)") from exc
        self.backend = backend
        self.device = resolve_device(device)
        self.index_params = index_params
        probe = make_index(backend, self.device, index_params)  # fail early on bad settings
        self._index_search_class = probe.SearchParams
        self.search_params = search_params
        self.index_search_params = index_search_params
        self.dim = self.n_docs = 0

    def __getattr__(self, name: str) -> Any:
        for holder in ("params", "_search_params"):
            params = self.__dict__.get(holder)
            if params is not None and name in {f.name for f in dataclasses.fields(params)}:
                return getattr(params, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __repr__(self) -> str:
        settings = {**self.params.to_dict(), **self.search_params.to_dict()}
        fields = ", ".join(f"{k}={v!r}" for k, v in {**settings, "backend": self.backend}.items())
        return f"{type(self).__name__}({fields}, device='{self.device}', n_docs={self.n_docs})"

    @property
    def search_params(self) -> Params:
        """The model's own search defaults (its ``SearchParams``, or None: the defaults)."""
        return self._search_params

    @search_params.setter
    def search_params(self, value: Params | None) -> None:
        self._search_params = self._typed(self.SearchParams, value, "search_params") \
            or self.SearchParams()

    @property
    def index_search_params(self) -> Params:
        """The backend's ``SearchParams`` (None: the defaults) for every index of the model."""
        index = self.__dict__.get("index")
        return index.search_params if index is not None else self._index_search_params

    @index_search_params.setter
    def index_search_params(self, value: Params | None) -> None:
        value = self._typed(self._index_search_class, value, "index_search_params") \
            or self._index_search_class()
        self._index_search_params = value
        for name in self._indices:
            index = self.__dict__.get(name)
            if index is not None:
                index.search_params = value

    def _typed(self, cls: type[SP], value: SP | None, what: str) -> SP | None:
        """``value`` if it is a ``cls`` or None, else a TypeError naming ``what``."""
        if value is not None and not isinstance(value, cls):
            raise TypeError(f"{type(self).__name__}.{what} must be {cls.__name__} or None, got "
                            f"{type(value).__name__}")
        return value

    def new_index(self) -> Index:
        """An empty index of the model's backend, settings and device."""
        return make_index(self.backend, self.device, self.index_params,
                          search_params=self.index_search_params)

    def check_fitted(self) -> None:
        if not self.n_docs:
            raise InputError(f"{type(self).__name__} is not fitted: call fit() first")

    def as_queries(self, queries: ArrayLike, check: bool | None = None,
                   name: str = "queries") -> torch.Tensor:
        """Queries as searched: (B, d) float32 on the device, detached."""
        self.check_fitted()
        return as_embeddings(queries, self.device, name, dim=self.dim, check_norm=False,
                             check_finite=training.check_default(queries, check)).detach()

    def _embeddings(self, P: ArrayLike, Q: ArrayLike | None = None,
                    Y: RelevanceLike | None = None, copy_queries: bool = True):
        """(p, q, relevance): p a checked copy; q a checked copy, or with ``copy_queries=False``
        as given (a host numpy array, unchecked: a memory map stays one)."""
        p = as_embeddings(P, self.device, "P", copy=True).detach()
        if p.shape[0] == 0:
            raise InputError("P has no rows: there are no documents to index")
        if Q is None:
            return p, None, None
        host = not copy_queries and self.device.type == "cpu" and isinstance(Q, np.ndarray) \
            and Q.ndim == 2 and Q.shape[1] == p.shape[1]
        q = Q if host else as_embeddings(Q, self.device, "Q", dim=p.shape[1],
                                         copy=copy_queries).detach()
        return p, q, as_relevance(Y, shape=(q.shape[0], p.shape[0]))

    def search(self, queries: ArrayLike, topk: int = 100, check: bool | None = None, *,
               params: Params | None = None, index_params: Params | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, d) queries -> (B, topk) float32 scores, int64 ids (-1 padded) on the device.

        ``params`` / ``index_params``: the model's / backend's ``SearchParams`` for this call
        (None: the defaults). ``check``: test for NaN / inf (default: unless on CUDA)."""
        topk = check_topk(topk, self.n_docs)
        model_sp = self._typed(self.SearchParams, params, "search params") or self.search_params
        index_sp = self._typed(self._index_search_class, index_params, "search index_params")
        check = training.check_default(queries, check)
        self.check_fitted()
        rows = max(1, self._memory_budget() // self._query_bytes(topk, model_sp))
        if isinstance(queries, (np.ndarray, torch.Tensor)) and queries.ndim == 2 \
                and not getattr(queries, "is_nested", False) \
                and queries.shape[0] > rows:  # query blocks: conversion, checks, fusion
            b = queries.shape[0]
            scores = torch.empty((b, topk), device=self.device)
            ids = torch.empty((b, topk), dtype=torch.long, device=self.device)
            for lo in range(0, b, rows):
                q = self.as_queries(queries[lo:lo + rows], check, f"queries[{lo}:]")
                scores[lo:lo + rows], ids[lo:lo + rows] = self._search(
                    q, topk, model_sp, index_sp, checked=check)
            return scores, ids
        return self._search(self.as_queries(queries, check), topk, model_sp, index_sp,
                            checked=check)

    def _memory_budget(self) -> int:
        """Bytes a search may hold: the index's ``memory_budget``, else the exact default."""
        return getattr(self.index.params, "memory_budget", None) or DEFAULT_MEMORY_BUDGET

    def _query_bytes(self, topk: int, model_sp: Params) -> int:
        """Working bytes per query besides the index's: its copy and the NaN check's."""
        return 16 * self.dim

    def _search(self, q: torch.Tensor, topk: int, model_sp: Params, index_sp: Params | None,
                checked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`search` of checked queries (``checked``: tested for NaN / inf)."""
        return self.index.search(q, topk, index_sp)

    def score(self, queries: ArrayLike, ids: ArrayLike, check: bool | None = None) -> torch.Tensor:
        """(B, d) queries (float32 / float64, may require grad), (B, K) int64 ids (-1: padding)
        -> (B, K) differentiable scores in the queries' dtype, -inf at padding (training.py);
        ``check``: ids in range and queries finite (default: unless on CUDA; else NaN there)."""
        self.check_fitted()
        chk = training.check_default(queries, check)
        dtype = torch.float64 if (isinstance(queries, torch.Tensor)
                                  and queries.dtype == torch.float64) else torch.float32
        q = as_embeddings(queries, self.device, "queries", dim=self.dim, dtype=dtype,
                          check_norm=False, check_finite=chk)
        i = training.as_ids(ids, q.shape[0], self.n_docs, self.device, chk)
        if i.numel() == 0:  # no queries or no ids
            return torch.empty(i.shape, dtype=q.dtype, device=q.device)
        s = self._score(q, i.clamp(0, self.n_docs - 1)).masked_fill(i < 0, float("-inf"))
        # unchecked ids out of range: NaN (indexing with them was a CUDA device assert)
        return s.masked_fill((i < -1) | (i >= self.n_docs), float("nan"))

    def _fitted(self: M, p: torch.Tensor, rows: torch.Tensor) -> M:
        """Take documents p (n, d) and index ``rows`` (n, d); returns the fitted model."""
        self.doc_embeddings = p
        self.index = self.new_index().build(rows)
        self.dim, self.n_docs = p.shape[1], p.shape[0]
        return self

    def _new_rows(self, X: ArrayLike, name: str) -> torch.Tensor:
        self.check_fitted()
        return as_embeddings(X, self.device, name, dim=self.dim, copy=True).detach()

    def add_documents(self, P_new: ArrayLike) -> "_Model":
        """Append (r, d) documents (ids n .. n+r-1) without a refit."""
        p = self._new_rows(P_new, "P_new")
        if p.shape[0]:
            self._append_documents(p)
            self.n_docs += p.shape[0]
        return self

    def add_pairs(self, Q_new: ArrayLike, Y_new: RelevanceLike) -> "_Model":
        """Add training queries Q_new (m', d) with relevance Y_new (m' x n) without a refit
        (with the exact backend: equal to a refit on all the data, to the bit on the CPU)."""
        q = self._new_rows(Q_new, "Q_new")
        rel = as_relevance(Y_new, shape=(q.shape[0], self.n_docs), name="Y_new",
                           allow_empty=True)
        if q.shape[0]:
            self._append_pairs(q, rel)
        return self

    def export_hnsw(self, path: str | Path, **kwargs: Any) -> Path:
        """Write faiss HNSW file(s) for CPU serving (kwargs: :func:`export.export_parts`)."""
        self.check_fitted()
        kwargs.setdefault("device", self.device)
        try:
            parts = self._exported()
        except NotImplementedError as exc:  # ScaNN keeps no rows to return
            raise InputError(f"{type(self).__name__}.export_hnsw needs the indexed vectors: "
                             f"{exc} (fit with another backend to export)") from exc
        return export.export_parts(parts, path, **kwargs)

    def save(self, directory: str | Path) -> None:
        """Write the fitted model into ``directory`` atomically (:func:`pefa_gpu.load`)."""
        persist.save_model(self, directory)

    @classmethod
    def load(cls, directory: str | Path, device: DeviceLike = None, mmap: bool = False) -> "_Model":
        """:func:`pefa_gpu.load` of a save that must hold this class (else FormatError)."""
        return persist.load_model(directory, device=device, mmap=mmap, expect=cls)

    # -- hooks: what each model does its own way

    def _score(self, q: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """(B, d) queries, (B, K) valid ids -> (B, K) scores, differentiable w.r.t. ``q``."""
        return training.inner(q, self.doc_embeddings[ids])

    def _append_documents(self, p: torch.Tensor) -> None:
        """Take (r, d) new documents (the caller sets n_docs); rows shared with the index stay
        one tensor."""
        v, d = getattr(self.index, "vectors", None), self.doc_embeddings
        shared = v is not None and v.data_ptr() == d.data_ptr() and v.shape == d.shape \
            and v.dtype == d.dtype
        self.index.add(p)
        self.doc_embeddings = self.index.vectors if shared else torch.cat([d, p])

    def _append_pairs(self, q: torch.Tensor, rel: Relevance) -> None:
        raise InputError(f"add_pairs() needs a PEFAXS, PEFAXL or NUDGE model, got "
                         f"{type(self).__name__} (ERM has no training pairs)")

    def _exported(self) -> tuple[torch.Tensor, Index] | dict[str, Any]:
        """(vectors, index) for one file, or {file name: (vectors, index) / matrix / JSON}."""
        return export.index_vectors(self.index), self.index

    def _saved_shapes(self) -> dict[str, tuple[int | None, int]]:
        """(rows or None, columns) of each saved array or index, checked on load."""
        return {"index": (self.n_docs, self.dim), "doc_embeddings": (self.n_docs, self.dim)}

    def _restore(self) -> None:
        """Rebuild derived state after a load."""


class ERM(_Model):
    """The embedding model alone: inner-product search over the document embeddings P."""

    Params = ERMParams
    SearchParams = ERMSearchParams
    _saved = _Model._saved + ("doc_embeddings",)

    def fit(self, P: ArrayLike) -> "ERM":
        """P: (n, d) document embeddings."""
        p, _, _ = self._embeddings(P)
        return self._fitted(p, p)

    def _exported(self) -> tuple[torch.Tensor, Index]:
        try:
            return super()._exported()
        except NotImplementedError:  # ScaNN keeps no rows to return: the index's are P
            return self.doc_embeddings, self.index


class _AdaptedDocuments(_Model):
    """One index over float32 rows ``_adapt(p, g)`` (r, d) of the documents ``doc_embeddings``
    and their training-query sums ``doc_sums`` (g_j = sum_i Y[i, j] q_i): PEFA-XS and NUDGE."""

    _saved = _Model._saved + ("doc_embeddings", "doc_sums")

    def _sums(self, rel: Relevance | sp.csr_matrix, q: torch.Tensor,
              initial: torch.Tensor | None = None) -> torch.Tensor:
        """g = Yᵀ q (+ ``initial``): (n, d) float32, refused where it overflows float32 (the
        index then blamed its rows: 'vectors hold NaN or inf')."""
        sums = pifa(rel, q, normalize=False, device=self.device, initial=initial)
        bad = ~torch.isfinite(sums).all(1)
        if bool(bad.any()):
            raise InputError(f"Yᵀ Q overflows float32 (±3.4e38) for documents "
                             f"{bad.nonzero()[:5, 0].tolist()}: scale Y's weights or Q down")
        return sums

    def _adapted_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Index rows of valid ``ids`` (any shape) -> (*ids.shape, d) float32."""
        flat = ids.reshape(-1)
        e = self._adapt(self.doc_embeddings[flat], self.doc_sums[flat])
        return e.reshape(*ids.shape, -1)

    def _append_documents(self, p: torch.Tensor) -> None:
        # PEFA-XS' augment_docs: p_j is document j's first query, as in fit
        sums = p if getattr(self.params, "augment_docs", False) else torch.zeros_like(p)
        self.index.add(self._adapt(p, sums))  # first: rows it refuses leave the model as it was
        self.doc_embeddings = torch.cat([self.doc_embeddings, p])
        self.doc_sums = torch.cat([self.doc_sums, sums])

    def _score(self, q: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return training.inner(q, self._adapted_rows(ids))

    def _append_pairs(self, q: torch.Tensor, rel: Relevance) -> None:
        """The pairs join ``doc_sums`` of the documents they touch (summed as fit sums them:
        in query order); those index rows are rewritten (or rebuilt)."""
        cols = np.unique(rel.csr.indices)
        if not cols.size:
            return
        touched = as_tensor(cols.astype(np.int64), device=self.device)
        # sums past float32's range are refused before doc_sums changes: the rows are finite
        self.doc_sums[touched] = self._sums(rel.csr[:, cols], q, self.doc_sums[touched])
        try:
            self.index.update(touched, self._adapted_rows(touched))
        except NotImplementedError:
            log.info("backend %r cannot update rows: rebuilding the index of %d documents for %d "
                     "changed ones", self.backend, self.n_docs, touched.numel())
            self.index = self.new_index().build(self._adapt(self.doc_embeddings, self.doc_sums))

    def _exported(self) -> tuple[torch.Tensor, Index] | dict[str, Any]:
        return self._adapt(self.doc_embeddings, self.doc_sums), self.index

    def _saved_shapes(self) -> dict[str, tuple[int | None, int]]:
        return {**super()._saved_shapes(), "doc_sums": (self.n_docs, self.dim)}


class PEFAXS(_AdaptedDocuments):
    """PEFA-XS: one index over e_j = lam p_j + (1 - lam) Π(a_j), a_j = sum_i Y[i, j] q_i
    (+ p_j with augment_docs)."""

    Params = XSParams
    SearchParams = XSSearchParams

    def fit(self, P: ArrayLike, Q: ArrayLike, Y: RelevanceLike) -> "PEFAXS":
        """P: (n, d) documents, Q: (m, d) training queries, Y: (m, n) relevance."""
        p, q, rel = self._embeddings(P, Q, Y, copy_queries=False)
        # p_j as document j's first query: add_pairs then equals a refit to the bit (CPU)
        start = p.clone() if self.params.augment_docs else torch.zeros_like(p)
        self.doc_sums = self._sums(rel, q, start)
        return self._fitted(p, self._adapt(p, self.doc_sums))

    def xs_embeddings(self, lam: float | None = None) -> torch.Tensor:
        """E = lam P + (1 - lam) Π(A): (n, d) float32; ``lam`` defaults to the model's."""
        # checked as the params check it (a numpy scalar, np.float32(0.3), was refused)
        lam = self.params.lam if lam is None else self.params.replace(lam=lam).lam
        return pefa_xs(self.doc_embeddings, self.doc_sums, lam)

    def _adapt(self, p: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
        return pefa_xs(p, sums, self.params.lam)


class NUDGE(_AdaptedDocuments):
    """NUDGE (Zeighami et al., 2024): documents moved toward their training queries by a step
    gamma chosen on validation queries (pefa_gpu.nudge); ``fitted_gamma`` is the step taken."""

    Params = NUDGEParams
    SearchParams = NUDGESearchParams
    _saved = _AdaptedDocuments._saved + ("fitted_gamma",)

    def fit(self, P: ArrayLike, Q: ArrayLike, Y: RelevanceLike, Q_val: ArrayLike | None = None,
            Y_val: RelevanceLike | None = None) -> "NUDGE":
        """P: (n, d) documents, Q: (m, d) training queries, Y: (m, n) relevance; Q_val (v, d),
        Y_val (v, n): validation queries for gamma (default: a seeded ``val_fraction`` of Q,
        with g_j from the rest; the documents then move along g_j of all of Q)."""
        p, q, rel = self._embeddings(P, Q, Y)
        gamma, sums = self.params.gamma, self._sums(rel, q)
        if (Q_val is None) != (Y_val is None):
            raise InputError("NUDGE.fit: Q_val and Y_val go together")
        if gamma is not None and Q_val is not None:
            raise InputError(f"NUDGE.fit: gamma={gamma!r} is fixed, so Q_val / Y_val would not "
                             f"be used; set gamma=None to choose it on them")
        if gamma is None and Q_val is not None:
            q_val = as_embeddings(Q_val, self.device, "Q_val", dim=p.shape[1]).detach()
            y_val = as_relevance(Y_val, shape=(q_val.shape[0], p.shape[0]), name="Y_val",
                                 allow_empty=True)
            g_fit = sums
        elif gamma is None:
            if q.shape[0] < 2:
                raise InputError(f"NUDGE chooses gamma on held-out training queries and needs "
                                 f"at least 2 of them, got {q.shape[0]}: give Q_val / Y_val "
                                 f"or set gamma")
            fit, val = split_queries(q.shape[0], self.params.val_fraction, self.params.seed)
            g_fit = pifa(rel.rows(fit), q[fit], normalize=False, device=self.device)
            q_val, y_val = q[val], rel.rows(val)
        if gamma is None and not (y_val.csr.data > 0).any():  # choose_gamma counts these
            log.warning("NUDGE: the %d validation queries have no relevant document, so gamma "
                        "is 0: the documents do not move", y_val.shape[0])
        if gamma is None:
            gamma = nudge.choose_gamma(self.params.variant, normalize_rows(p), g_fit, q_val,
                                       y_val.csr, self.params.val_k)
        self.fitted_gamma, self.doc_sums = float(gamma), sums
        return self._fitted(p, self._adapt(p, sums))

    def nudge_embeddings(self, gamma: float | None = None) -> torch.Tensor:
        """The adapted documents E (n, d) float32; ``gamma`` defaults to ``fitted_gamma``."""
        if gamma is not None:  # checked as the params check it (NUDGE-N: 5 was a math error)
            self.params.replace(gamma=gamma)
        return self._adapt(self.doc_embeddings, self.doc_sums, gamma)

    def _adapt(self, p: torch.Tensor, sums: torch.Tensor, gamma: float | None = None
               ) -> torch.Tensor:
        # new pairs keep fitted_gamma (a refit at that gamma); new documents enter as Π(p_j)
        moved = nudge.nudge_m if self.params.variant == "M" else nudge.nudge_n
        return moved(normalize_rows(p), sums, self.fitted_gamma if gamma is None else gamma)

    def _restore(self) -> None:
        g = self.fitted_gamma
        try:  # the variant's range (N: 5 was a math error once documents were added)
            self.params.replace(gamma=float("nan") if g is None else g)  # None: refused too
        except InputError:
            raise FormatError(f"NUDGE save: fitted_gamma must be a finite number in NUDGE-"
                              f"{self.params.variant}'s range, got {g!r}") from None


class PEFAXL(_Model):
    """PEFA-XL: a passage index and a training-query index; the k nearest training queries
    vote for their relevant documents, mixed with the ERM score."""

    Params = XLParams
    SearchParams = XLSearchParams
    _saved = _Model._saved + ("doc_embeddings", "relevance", "query_index")
    _indices = ("index", "query_index")

    def fit(self, P: ArrayLike, Q: ArrayLike, Y: RelevanceLike) -> "PEFAXL":
        """P: (n, d) documents, Q: (m, d) training queries, Y: (m, n) relevance; with
        ``augment_docs`` document j is also row m + j of Y (labelled with itself)."""
        query_index = self.new_index()  # one that copies its rows needs no copy of Q first
        p, q, rel = self._embeddings(P, Q, Y, copy_queries=not query_index.copies_rows)
        if isinstance(q, np.ndarray):  # Q as given (a memory map stays one): checked in place
            require_finite(q, "Q")
        self._fitted(p, p)
        self.query_index = query_index.build(q)
        self._set_relevance(rel.csr)
        return self

    def _set_relevance(self, y_train: sp.csr_matrix) -> None:
        """Y from its training block (m x n), over the identity with ``augment_docs``."""
        if self.params.augment_docs:  # row m + j: document j
            eye = sp.identity(y_train.shape[1], dtype="float32", format="csr")
            y_train = sp.vstack([y_train, eye], format="csr")
        self.relevance = Relevance(y_train)
        self.relevance_rows = RelevanceRows(self.relevance, self.device)

    def _train_block(self, n_cols: int) -> sp.csr_matrix:
        """The training block of Y (m x n_cols, the columns beyond n_docs empty)."""
        y = self.relevance.csr[:self.n_train_queries]
        return sp.csr_matrix((y.data, y.indices, y.indptr), shape=(y.shape[0], n_cols))

    @property
    def n_train_queries(self) -> int:
        """m: the training queries (rows 0 .. m-1 of ``relevance``; the query index rows)."""
        return self.relevance.shape[0] - (self.n_docs if self.params.augment_docs else 0)

    def neighbours(self, q: torch.Tensor, k: int,
                   erm: tuple[torch.Tensor, torch.Tensor] | None = None,
                   params: Params | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The k nearest training queries (documents as rows m + j with ``augment_docs``):
        (B, <= k) scores and Y rows, -1 padded; ``erm``: a passage search already made."""
        params = self._typed(self._index_search_class, params, "neighbours params")
        k = check_positive(k, "k")
        self.check_fitted()
        q = q if isinstance(q, (np.ndarray, torch.Tensor)) else as_tensor(q, name="q")
        if q.ndim != 2 or q.shape[1] != self.dim:  # as the searches check it; then no NaN
            raise InputError(f"q must have shape (B, {self.dim}), got {tuple(q.shape)}")
        if training.check_default(q, None):  # as search's default: on CUDA a check would sync
            require_finite(q, "q")  # numpy q was searched unchecked (the searches trust _search's)
        if erm is not None:  # (its ids become rows m + j: one beyond n was a wrong neighbour)
            erm = self._checked_pair("erm", erm, q, self.n_docs)
        return self._searches(q, 0, k, params, erm)[1]

    def _searches(self, q: Array, kp: int, k: int, params: Params | None,
                  erm: tuple[Array, Array] | None = None, checked: bool = True
                  ) -> tuple[tuple[Array, Array], tuple[Array, Array]]:
        """:func:`pefa_gpu.fuse.searches` on this model's indices (numpy results for numpy
        queries); ``erm`` serves where it is wide enough."""
        def search(x: Array, w_erm: int, w_knn: int) -> tuple[Any, tuple[Array, Array]]:
            e = erm if erm is not None and erm[1].shape[1] >= w_erm else \
                _index_search(self.index, x, w_erm, params, checked) if w_erm else None
            return e, _index_search(self.query_index, x, w_knn, params, checked)
        return searches(q, search, kp=kp, k=k, m=self.n_train_queries, n=self.n_docs,
                        augment_docs=self.params.augment_docs)

    # rows that _unprunable allows fuse the top topk + PRUNE_MARGIN passages instead of
    # ``candidates`` (the same result); False: always ``candidates``
    prune_candidates: bool = True
    PRUNE_MARGIN = 8

    def _search(self, q: torch.Tensor, topk: int, model_sp: XLSearchParams,
                index_sp: Params | None, checked: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Searches and fusion (a CPU batch as numpy arrays), with fewer passages where
        pruning applies: rescore, lam > 0, votes >= 0, exact ERM scores."""
        p, q = self.params, to_numpy(q) if q.device.type == "cpu" else q
        kp = min(model_sp.candidates, self.index.ntotal)
        kt = max(topk + self.PRUNE_MARGIN, p.k)
        prune = (self.prune_candidates and p.rescore and p.lam > 0 and kt < kp
                 and getattr(self.index, "exact_scores", False)
                 and self.relevance_rows.nonnegative)
        erm, knn = self._searches(q, kt if prune else kp, p.k, index_sp, None, checked)
        rest = _unprunable(erm, knn, topk, p.lam) if prune else []
        if prune and len(rest) == q.shape[0]:  # no row prunes (one query, say): one full search
            erm, rest = _index_search(self.index, q, kp, index_sp, checked), []
        key = (p.lam, p.k)  # fused unchecked: these searches are this model's own
        s, i = self._fuse_grid(q, (erm[0][:, :kp], erm[1][:, :kp]), knn, (p.lam,), (p.k,),
                               topk)[key]
        if len(rest):  # the neighbours stay; only the passages widen to kp
            full = _index_search(self.index, q[rest], kp, index_sp, checked)
            s[rest], i[rest] = self._fuse_grid(q[rest], full, (knn[0][rest], knn[1][rest]),
                                               (p.lam,), (p.k,), topk)[key]
        return s, i

    def _query_bytes(self, topk: int, model_sp: Params) -> int:
        """Besides the query: Kp passages, the candidate table (~48 bytes an entry: Kp + k x
        Y's mean row length) and the top-k (24 bytes an entry)."""
        kp = min(model_sp.candidates, self.index.ntotal)
        votes = self.params.k * self.relevance.nnz / max(1, self.relevance.shape[0])
        return super()._query_bytes(topk, model_sp) + int(48 * (kp + votes) + 24 * topk)

    def fuse(self, q: torch.Tensor, erm: tuple[torch.Tensor, torch.Tensor],
             knn: tuple[torch.Tensor, torch.Tensor], topk: int, lam: float | None = None,
             k: int | None = None, batch_size: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fuse a passage search erm (B, Kp) and :meth:`neighbours` knn (B, >= k) -> (B, topk)
        scores and ids; ``lam`` / ``k`` override the model's."""
        p = self.params if lam is None and k is None else self.params.replace(
            lam=self.params.lam if lam is None else lam, k=self.params.k if k is None else k)
        return self.fuse_grid(q, erm, knn, (p.lam,), (p.k,), topk, batch_size)[(p.lam, p.k)]

    def fuse_grid(self, q: Array, erm: tuple[Array, Array], knn: tuple[Array, Array],
                  lams: Sequence[float], ks: Sequence[int], topk: int,
                  batch_size: int | None = None
                  ) -> dict[tuple[float, int], tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`fuse` for every (lam, k) of ``lams`` x ``ks`` (``knn`` with max(ks)
        neighbours): {(lam, k): ((B, topk) float32, int64)} on q's device (numpy: the CPU)."""
        self.check_fitted()
        lams, ks = check_grid(lams, ks)
        if _kind(q) != "f" or q.ndim != 2 or q.shape[1] != self.dim:
            raise InputError(f"q must be a (B, {self.dim}) float array, got "
                             f"{type(q).__name__} {getattr(q, 'shape', '')}")
        q = to_numpy(q) if isinstance(q, np.ndarray) or q.device.type == "cpu" else q
        erm = self._checked_pair("erm", erm, q, self.n_docs)
        knn = self._checked_pair("knn", knn, q, self.relevance.shape[0])
        topk = check_topk(topk, self.n_docs)
        if knn[1].shape[1] < min(max(ks), self.relevance.shape[0]):  # the rows there are
            raise InputError(f"k={max(ks)} but only {knn[1].shape[1]} neighbours were searched")
        return self._fuse_grid(q, erm, knn, lams, ks, topk, batch_size)

    def _checked_pair(self, name: str, pair: Any, q: Any, top: int) -> tuple[Array, Array]:
        """``pair`` (scores, ids) of (B, w) float / signed integer arrays, ids in [-1, top), as
        q's kind of array (on q's device)."""
        pair = pair if isinstance(pair, (tuple, list)) else (pair,)
        ok = len(pair) == 2 and _kind(pair[0]) == "f" and _kind(pair[1]) in ("i", "u") \
            and pair[0].ndim == 2 and pair[0].shape == pair[1].shape and len(pair[0]) == len(q)
        if not ok:
            got = ", ".join(f"{type(a).__name__} {getattr(a, 'dtype', '')} "
                            f"{getattr(a, 'shape', '')}" for a in pair)
            raise InputError(f"{name} must be (scores, ids): float and integer arrays of one "
                             f"shape (B={q.shape[0]}, w), got {got}")
        ids = pair[1]
        if _kind(ids) == "u":
            raise InputError(f"{name} ids must be signed integers (-1: padding), got {ids.dtype}")
        if bool(((ids < -1) | (ids >= top)).any()):  # on CUDA: one synchronisation
            raise InputError(f"{name} ids must be in [-1, {top}) (-1: padding), got "
                             f"{int(ids.min())} .. {int(ids.max())}")
        host = isinstance(q, np.ndarray)
        return tuple(to_numpy(a) if host else as_tensor(a, device=q.device) for a in pair)

    def _fuse_grid(self, q: Array, erm: tuple[Array, Array], knn: tuple[Array, Array],
                   lams: Sequence[float], ks: Sequence[int], topk: int,
                   batch_size: int | None = None
                   ) -> dict[tuple[float, int], tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`fuse_grid` of checked arguments, of one kind (a CPU batch: numpy arrays)."""
        p = self.params
        docs = to_numpy(self.doc_embeddings) if isinstance(q, np.ndarray) else self.doc_embeddings
        out = fuse(q, erm, knn, self.relevance_rows, docs, lams=lams, ks=ks, topk=topk,
                   knn_norm=p.knn_norm, rescore=p.rescore, batch_size=batch_size,
                   erm_exact=bool(getattr(self.index, "exact_scores", False)))
        return {key: (as_tensor(s), as_tensor(i)) for key, (s, i) in out.items()}

    def _score(self, q: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """lam f_erm + (1 - lam) f_knn, differentiable in the weights w(s_i) and f_erm =
        <q, p_j>; the neighbours (and, without rescore, the candidates C) chosen without it."""
        p = self.params
        f_erm = training.inner(q, self.doc_embeddings[ids])
        if not p.rescore:  # f_erm is 0 outside the ERM candidates C
            kp = min(self.search_params.candidates, self.index.ntotal)
            _, cand = _index_search(self.index, q.detach(), kp, None)
            in_c = (ids.unsqueeze(2) == cand.unsqueeze(1)).any(2)
            f_erm = torch.where(in_c, f_erm, torch.zeros((), dtype=q.dtype, device=q.device))
        _, nbr = self._searches(q.detach(), 0, p.k, None)[1]            # (B, K), -1 padded
        rows, m = nbr.clamp_min(0), self.n_train_queries
        flat = rows.reshape(-1).clamp_max(m - 1)  # valid: no id check
        try:
            vecs = self.query_index.rows_unchecked(flat).reshape(*rows.shape, -1)
        except NotImplementedError as exc:  # ScaNN keeps no rows to return
            raise InputError(f"PEFAXL.score needs the training queries' vectors: {exc} (fit "
                             f"with another backend to score)") from exc
        if p.augment_docs:  # row m + j: document j
            docs = self.doc_embeddings[(rows - m).clamp_min(0)].float()
            vecs = torch.where((rows >= m).unsqueeze(2), docs, vecs)
        s = training.inner(q, vecs)                                      # (B, K), with grad
        w = torch.where(nbr >= 0, s / (float(p.k) if p.knn_norm == "k" else 1.0), 0.0)
        y = self.relevance_rows.values(rows, ids).to(q.dtype)  # (B, K, K')
        return p.lam * f_erm + (1.0 - p.lam) * (w.unsqueeze(2) * y).sum(1)

    def _append_documents(self, p: torch.Tensor) -> None:
        y_train = self._train_block(self.n_docs + p.shape[0])
        super()._append_documents(p)
        self._set_relevance(y_train)

    def _append_pairs(self, q: torch.Tensor, rel: Relevance) -> None:
        y_train = sp.vstack([self._train_block(self.n_docs), rel.csr], format="csr")
        self.query_index.add(q)
        self._set_relevance(y_train)

    def _exported(self) -> tuple[torch.Tensor, Index] | dict[str, Any]:
        return {"passages.faiss": (self.doc_embeddings, self.index),
                "queries.faiss": (export.index_vectors(self.query_index), self.query_index),
                "relevance.npz": self.relevance.csr,
                "export.json": {
                    "model": "PEFAXL", "params": self.params.to_dict(), "n_docs": self.n_docs,
                    "dim": self.dim, "passages": "passages.faiss", "queries": "queries.faiss",
                    "relevance": "relevance.npz", "n_train_queries": self.n_train_queries,
                    "documents_are_queries": self.params.augment_docs}}

    def _saved_shapes(self) -> dict[str, tuple[int | None, int]]:
        return {**super()._saved_shapes(), "query_index": (None, self.dim),
                "relevance": (None, self.n_docs)}

    def _restore(self) -> None:
        if self.query_index.ntotal != self.n_train_queries:
            raise FormatError(f"PEFAXL save: the query index holds {self.query_index.ntotal} "
                              f"rows but Y has {self.n_train_queries} training queries (a save "
                              f"from an older pefa_gpu that indexed the documents twice): refit")
        self.relevance_rows = RelevanceRows(self.relevance, self.device)


def _index_search(index: Index, q: Array, k: int, params: Params | None,
                  checked: bool = True) -> tuple[Array, Array]:
    """``index.search(q, k, params)`` as q's kind of array (``checked``: q has no NaN / inf)."""
    host = isinstance(q, np.ndarray)
    if host and hasattr(index, "search_host"):
        scores, ids = index.search_host(q, k, check_finite=not checked, params=params)
    else:
        scores, ids = index.search(as_tensor(q), k, params)
        scores, ids = (to_numpy(scores), to_numpy(ids)) if host else (scores, ids)
    if bool(((ids < -1) | (ids >= index.ntotal)).any()):  # a corrupted index
        raise FormatError(f"the {index.name!r} index returned ids outside [0, {index.ntotal}) "
                          f"(a corrupted or forged index)")
    return scores, ids


def _kind(x: Any) -> str:
    """x's dtype kind as numpy names it ('f', 'i', 'u', 'b', 'c'), '' for a non-array."""
    if isinstance(x, torch.Tensor):
        return "f" if x.is_floating_point() else "c" if x.is_complex() else \
            "b" if x.dtype == torch.bool else "i" if x.dtype.is_signed else "u"
    return x.dtype.kind if isinstance(x, np.ndarray) else ""


def _unprunable(erm: tuple[Array, Array], knn: tuple[Array, Array], topk: int,
                lam: float) -> Array:
    """Rows where a top-K' passage search ``erm`` may miss a fused top-``topk`` document: a
    negative neighbour score, or fl(lam e_K') not below fl(lam e_topk) (float32, as fused)."""
    scores, ids = erm
    bound = (ids[:, -1] >= 0) & (lam * scores[:, -1] < lam * scores[:, topk - 1])
    return nonzero(~(((knn[0] >= 0) | (knn[1] < 0)).all(1) & bound))
