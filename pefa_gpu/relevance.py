"""The relevance matrix Y: queries x documents, sparse, binary by default, weights allowed."""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.sparse as sp

from .errors import InputError

MAX_ROWS = 2**31  # Y rows (queries) a Relevance may have; its CSR row pointers are int64


class Relevance:
    """A (m queries x n documents) sparse relevance matrix, stored as float32 CSR.

    Build it from index pairs with :meth:`from_pairs`, or wrap any scipy sparse matrix with
    :func:`as_relevance`. Entries are the weights ``Y[i, j]``; explicit zeros are dropped.
    """

    def __init__(self, csr: sp.csr_matrix):
        csr = sp.csr_matrix(csr, dtype=np.float32)
        csr.sum_duplicates()
        csr.eliminate_zeros()
        csr.sort_indices()
        if csr.nnz and not np.isfinite(csr.data).all():
            raise InputError("relevance matrix contains NaN or inf weights")
        self.csr = csr

    @classmethod
    def from_pairs(cls, query_ids: Any, doc_ids: Any, weights: Any = None,
                   shape: tuple[int, int] | None = None) -> "Relevance":
        """Y from parallel arrays of (query index, document index[, weight]).

        Without ``weights`` Y is binary: a pair listed twice is still 1. With ``weights`` the
        weights of repeated pairs add up. ``shape`` defaults to (max query + 1, max doc + 1).
        """
        qi = _index_array(query_ids, "query_ids")
        di = _index_array(doc_ids, "doc_ids")
        if qi.shape != di.shape:
            raise InputError(f"query_ids has {qi.size} entries but doc_ids has {di.size}")
        if shape is None:
            shape = (_inferred_size(qi, "query_ids"), _inferred_size(di, "doc_ids"))
        m, n = int(shape[0]), int(shape[1])
        if m < 0 or n < 0 or m > MAX_ROWS:
            raise InputError(f"shape={tuple(shape)} is not a usable (queries, documents) shape "
                             f"(at most {MAX_ROWS} queries: Y's row pointers alone take 8 bytes "
                             f"per query)")
        if qi.size and (qi.min() < 0 or qi.max() >= m):
            bad = qi[(qi < 0) | (qi >= m)][:5].tolist()
            raise InputError(f"query ids out of range [0, {m}): {bad}")
        if di.size and (di.min() < 0 or di.max() >= n):
            bad = di[(di < 0) | (di >= n)][:5].tolist()
            raise InputError(f"document ids out of range [0, {n}): {bad}")
        if weights is None:
            w = np.ones(qi.size, dtype=np.float32)
            coo = sp.coo_matrix((w, (qi, di)), shape=(m, n)).tocsr()
            coo.sum_duplicates()
            coo.data[:] = 1.0
            return cls(coo)
        w = np.asarray(weights, dtype=np.float32).ravel()
        if w.shape != qi.shape:
            raise InputError(f"weights has {w.size} entries but there are {qi.size} pairs")
        return cls(sp.coo_matrix((w, (qi, di)), shape=(m, n)).tocsr())

    @property
    def shape(self) -> tuple[int, int]:
        return self.csr.shape

    @property
    def nnz(self) -> int:
        return int(self.csr.nnz)

    def __repr__(self) -> str:
        return f"Relevance(shape={self.shape}, nnz={self.nnz})"

    def rows(self, index: Any) -> "Relevance":
        """The sub-matrix of the given query rows."""
        return Relevance(self.csr[np.asarray(index)])

    def transpose(self) -> sp.csr_matrix:
        """Yᵀ as (n x m) float32 CSR."""
        return self.csr.T.tocsr()


def as_relevance(y: Any, shape: tuple[int | None, int | None] = (None, None),
                 name: str = "Y", allow_empty: bool = False) -> Relevance:
    """A :class:`Relevance` from a Relevance, a scipy sparse matrix or a dense 2-D array.

    ``shape`` entries that are not None must match; an empty Y raises unless ``allow_empty``.
    """
    if isinstance(y, Relevance):
        rel = y
    elif sp.issparse(y):
        if y.ndim != 2:
            raise InputError(f"{name} must be 2-D, got shape {y.shape}")
        rel = Relevance(y)
    elif isinstance(y, np.ndarray) and y.ndim == 2:
        if y.dtype.kind not in "biuf":
            raise InputError(f"{name} has dtype {y.dtype}; a dense Y must hold numbers (0/1 or "
                             f"weights)")
        rel = Relevance(sp.csr_matrix(y))
    else:
        raise InputError(f"{name} must be a scipy sparse matrix, a pefa_gpu.Relevance or a 2-D "
                         f"numpy array, got {type(y).__name__}")
    m, n = rel.shape
    if shape[0] is not None and m != shape[0]:
        raise InputError(f"{name} has {m} rows (queries) but there are {shape[0]} query "
                         f"embeddings")
    if shape[1] is not None and n != shape[1]:
        raise InputError(f"{name} has {n} columns (documents) but there are {shape[1]} "
                         f"document embeddings")
    if rel.nnz == 0 and not allow_empty:
        raise InputError(f"{name} has no nonzero entries: PEFA needs at least one (query, "
                         f"document) pair")
    return rel


def _inferred_size(ids: np.ndarray, name: str) -> int:
    """max id + 1, for ids meant as 0-based row / column numbers."""
    if not ids.size:
        return 0
    top = int(ids.max())
    if top >= MAX_ROWS:
        raise InputError(f"{name} holds {top}, so without shape= Y would have {top + 1} rows "
                         f"or columns; ids are 0-based positions (map raw ids to 0..m-1 "
                         f"first), or pass shape= explicitly")
    return top + 1


def _index_array(x: Any, name: str) -> np.ndarray:
    from .arrays import to_numpy

    a = np.asarray(to_numpy(x) if not isinstance(x, (list, tuple, range)) else x).ravel()
    if a.size and not np.issubdtype(a.dtype, np.integer):
        if np.issubdtype(a.dtype, np.floating) and np.all(a == np.round(a)):
            a = a.astype(np.int64)
        else:
            raise InputError(f"{name} must hold integer indices, got dtype {a.dtype}")
    return a.astype(np.int64)
