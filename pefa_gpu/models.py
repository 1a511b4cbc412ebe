"""The three retrieval models: ERM (plain inner product), PEFA-XS and PEFA-XL.

All share one shape::

    model = pg.PEFAXS(lam=0.5, backend="exact", device=None).fit(P, Q, Y)
    scores, ids = model.search(queries, topk=100)   # (B, topk) float32 / int64, -1 padded

Embeddings are stored on ``device`` (default: CUDA when available) as torch tensors; results
come back on that device.
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
from .index import Index, make_index
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
    """lam: weight of the ERM score. k: training-query neighbours. candidates: ERM candidates
    (Kp). knn_norm: 'k' weighs a neighbour by s/k, 'none' by s. rescore: exact <q, p_j> for every
    candidate (else 0 outside the ERM candidates). augment_docs: documents join the query index
    as queries labelled with themselves."""

    lam: float = 0.1
    k: int = 16
    candidates: int = 500
    knn_norm: str = "k"
    rescore: bool = True
    augment_docs: bool = True

    def validate(self) -> None:
        check_unit_interval(self.lam, "lam")
        check_positive(self.k, "k")
        check_positive(self.candidates, "candidates")
        check_choice(self.knn_norm, "knn_norm", ("k", "none"))
        check_choice(self.rescore, "rescore", (True, False))
        check_choice(self.augment_docs, "augment_docs", (True, False))


class _Model:
    """Shared plumbing: params, device, backend, the search entry point."""

    Params: type[Params] = ERMParams
    # attributes model.save() writes and pefa_gpu.load() restores (stored by type: see persist.py)
    _saved: tuple[str, ...] = ("dim", "n_docs", "index")

    def __init__(self, *, backend: str = "exact", device: Any = None,
                 index_params: Params | dict | None = None, **params: Any):
        try:
            self.params = self.Params(**params)
        except TypeError as exc:
            raise InputError(f"{type(self).__name__}: {exc}") from exc
        self.backend = backend
        self.index_params = index_params
        self.device = resolve_device(device)
        make_index(backend, self.device, index_params)  # fail early on a bad backend / params
        self.dim = 0
        self.n_docs = 0

    def __getattr__(self, name: str) -> Any:
        params = self.__dict__.get("params")
        if params is not None and name in {f.name for f in dataclasses.fields(params)}:
            return getattr(params, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.params.to_dict().items())
        return (f"{type(self).__name__}({fields}{', ' if fields else ''}backend={self.backend!r},"
                f" device='{self.device}', n_docs={self.n_docs})")

    def _new_index(self) -> Index:
        return make_index(self.backend, self.device, self.index_params)

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

    def search(self, queries: Any, topk: int = 100,
               check: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, d) queries -> (B, topk) float32 scores and int64 ids (-1 padded) on the device.

        The queries are detached (no autograd graph is kept). ``check`` tests them for NaN /
        inf, by default only when they are not already a CUDA tensor: ERM and PEFAXS then search
        a CUDA batch with no device-to-host synchronisation at all. PEFAXL's fusion does
        synchronise (candidate sets of data-dependent size: torch.unique, masks, the widest
        row), a few times per batch of 256 queries; its :meth:`score` does not.
        """
        topk = check_positive_int(topk, "topk")
        if check is None:  # reading the values would synchronise a CUDA device: not there
            check = not (isinstance(queries, torch.Tensor) and queries.is_cuda)
        return self._search(self._queries(queries, check), topk, checked=check)

    def _search(self, q: torch.Tensor, topk: int,
                checked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``checked``: ``q`` has been tested for NaN / inf already."""
        return self.index.search(q, topk)

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
    _saved = _Model._saved + ("doc_embeddings", "relevance", "query_index")

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
                   erm: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The k nearest training queries N of each query: (B, k) scores and ``relevance`` row
        ids (-1 padded), ties to the lower row.

        Without ``augment_docs`` this is the query index's top-k. With it, the candidate rows
        are the training queries (rows < m) and the documents (row m + j), and the top-k over
        both is the merge of the query index's top-k and the passage index's top-k, which is
        exactly the top-k of one index over [Q; P]. ``erm``: a passage search already made with
        at least k results (its first k are used), else one is made here.
        """
        s_q, i_q = self.query_index.search(q, k)
        if not self.params.augment_docs:
            return s_q, i_q
        if erm is None or erm[1].shape[1] < k:
            erm = self.index.search(q, k)
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

    def _search(self, q: torch.Tensor, topk: int,
                checked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Passage search, neighbours, fusion, with exact candidate pruning.

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
        p = self.params
        kt = max(topk + self.PRUNE_MARGIN, p.k)
        prunable = (self.prune_candidates and p.rescore and p.lam > 0 and kt < p.candidates
                    and getattr(self.index, "exact_scores", False)
                    and self._relevance_nonnegative())
        if q.shape[0] and _host_batch(q):
            return self._search_host(q, topk, prunable, kt, checked)
        erm = self.index.search(q, kt if prunable else p.candidates)
        knn = self.neighbours(q, p.k, erm)
        out = self.fuse(q, erm, knn, topk)
        if not prunable:
            return out
        rest = self._unprunable(erm, knn, topk)  # (c) or (d) fails: these get all Kp candidates
        if rest.numel():
            qr = q[rest]
            out[0][rest], out[1][rest] = self.fuse(qr, self.index.search(qr, p.candidates),
                                                   (knn[0][rest], knn[1][rest]), topk)
        return out

    def _search_host(self, q: torch.Tensor, topk: int, prunable: bool, kt: int,
                     checked: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_search` for a small CPU batch (1 .. NUMPY_MAX_BATCH queries), step for step
        on numpy arrays (same results to the bit): searches, neighbour merge, fusion and the
        pruning test each cost a few microseconds per op instead of torch's ~5-10, and the
        result becomes a tensor once, at the end."""
        p = self.params
        qn = to_numpy(q)
        erm = _index_search_host(self.index, q, qn, kt if prunable else p.candidates, checked)
        knn = _index_search_host(self.query_index, q, qn, p.k, checked)
        if p.augment_docs:
            if erm[1].shape[1] < p.k:
                erm_k = _index_search_host(self.index, q, qn, p.k, checked)
            else:
                erm_k = erm
            knn = _merge_neighbours_host(knn, erm_k, self.n_train_queries, p.k)
        rest = np.zeros(0, dtype=np.int64)
        if prunable:  # rows where pruning is not provably exact get all Kp candidates
            rest = _unprunable_host(erm, knn, topk, p.lam, self.index.ntotal <= erm[1].shape[1])
            if rest.size == len(qn):  # all of them (a single query, say): one search, one fusion
                erm = _index_search_host(self.index, q, qn, p.candidates, checked)
                rest = rest[:0]
        out = self._fuse_host(qn, erm, knn, topk)
        if rest.size:
            qr = q[as_tensor(rest)]
            s, i = self._fuse_host(
                qn[rest], _index_search_host(self.index, qr, qn[rest], p.candidates, checked),
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


def _index_search_host(index: Index, q: torch.Tensor, qn: np.ndarray, k: int,
                       checked: bool) -> tuple[np.ndarray, np.ndarray]:
    """``index.search(q, k)`` as numpy arrays for a CPU batch ``q`` (``qn``: its numpy view;
    ``checked``: already tested for NaN / inf); faiss backends skip the torch hand-off."""
    if hasattr(index, "search_host"):
        return index.search_host(qn, k, check_finite=not checked)
    return tuple(map(to_numpy, index.search(q, k)))


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
