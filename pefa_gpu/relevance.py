"""The relevance matrix Y: queries x documents, sparse, binary by default, weights allowed."""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

from .arrays import ArrayLike, to_numpy
from .errors import InputError

# Y's rows (queries) and columns (documents) at most: its row pointers (and Yᵀ's) stay int32
MAX_ROWS = 2**31 - 1


class Relevance:
    """A (m queries x n documents) float32 CSR relevance matrix: a checked copy (the caller's
    arrays are never written), explicit zeros dropped, duplicates summed."""

    def __init__(self, csr: Any, name: str = "Y"):
        # a Relevance: a copy of its matrix
        self.csr = _own_csr(csr.csr if isinstance(csr, Relevance) else csr, name)

    @classmethod
    def from_pairs(cls, query_ids: ArrayLike, doc_ids: ArrayLike, weights: ArrayLike | None = None,
                   shape: tuple[int, int] | None = None) -> "Relevance":
        """Y from parallel (query index, document index[, weight]) arrays: binary without
        ``weights``, else repeated pairs add up. ``shape``: default (max ids + 1)."""
        qi = _index_array(query_ids, "query_ids")
        di = _index_array(doc_ids, "doc_ids")
        if qi.shape != di.shape:
            raise InputError(f"query_ids has {qi.size} entries but doc_ids has {di.size}")
        if shape is None:
            shape = (_inferred_size(qi, "query_ids"), _inferred_size(di, "doc_ids"))
        if not isinstance(shape, (tuple, list)) or len(shape) != 2 or any(  # not a dict's keys
                isinstance(s, bool) or not isinstance(s, (int, np.integer)) for s in shape):
            raise InputError(f"shape must be two integers (queries, documents), got {shape!r}")
        m, n = int(shape[0]), int(shape[1])
        if m < 0 or n < 0 or m > MAX_ROWS or n > MAX_ROWS:
            raise InputError(f"shape={tuple(shape)} is not a usable (queries, documents) shape "
                             f"(at most {MAX_ROWS} queries and documents)")
        qi = _checked_ids(qi, m, "from_pairs", "query")
        di = _checked_ids(di, n, "from_pairs", "document")
        w = np.ones(qi.size, bool) if weights is None else _float32(  # bool: duplicates are 1
            _array(weights, "weights"), "weights").ravel()
        if w.shape != qi.shape:
            raise InputError(f"weights has {w.size} entries but there are {qi.size} pairs")
        return cls(sp.csr_matrix((w, (qi, di)), shape=(m, n)))

    @property
    def shape(self) -> tuple[int, int]:
        return self.csr.shape

    @property
    def nnz(self) -> int:
        return int(self.csr.nnz)

    def __repr__(self) -> str:
        return f"Relevance(shape={self.shape}, nnz={self.nnz})"

    def rows(self, index: Any) -> "Relevance":
        """The sub-matrix of the given query rows (0-based positions, or a boolean mask)."""
        m = self.shape[0]
        idx = _array(index, "rows")
        if idx.dtype == bool and idx.shape != (m,):
            raise InputError(f"rows: a boolean mask needs {m} entries (Y's rows), got shape "
                             f"{idx.shape}")
        idx = np.flatnonzero(idx) if idx.dtype == bool else idx
        if idx.ndim > 1:
            raise InputError(f"rows takes a 1-D array of row positions, got shape {idx.shape}")
        if idx.size and idx.dtype.kind not in "iu":
            raise InputError(f"rows takes integer row positions, got dtype {idx.dtype}")
        bad = idx[(idx < 0) | (idx >= m)] if idx.size else idx
        if bad.size:
            raise InputError(f"rows {bad[:5].tolist()} out of range: Y has {m} rows (queries)")
        return Relevance(self.csr[idx.astype(np.int64)])

    def transpose(self) -> sp.csr_matrix:
        """Yᵀ as (n x m) float32 CSR."""
        return self.csr.T.tocsr()


RelevanceLike = Relevance | sp.spmatrix | sp.sparray | ArrayLike


def as_relevance(y: RelevanceLike, shape: tuple[int | None, int | None] = (None, None),
                 name: str = "Y", allow_empty: bool = False) -> Relevance:
    """A :class:`Relevance` from a Relevance, a scipy sparse matrix or a dense 2-D array;
    ``shape`` entries that are not None must match; empty only with ``allow_empty``."""
    if not isinstance(shape, (tuple, list)) or len(shape) != 2 or any(  # zip: (3,) checks rows
            s is not None and (isinstance(s, bool) or not isinstance(s, (int, np.integer)))
            for s in shape):
        raise InputError(f"shape must be (queries, documents), each an int or None, got "
                         f"{shape!r}")
    rel = y if isinstance(y, Relevance) else Relevance(y, name)
    for have, want, what, of in zip(rel.shape, shape, ("rows (queries)", "columns (documents)"),
                                    ("query", "document")):
        if want is not None and have != want:
            raise InputError(f"{name} has {have} {what} but there are {want} {of} embeddings")
    if rel.nnz == 0 and not allow_empty:
        raise InputError(f"{name} has no nonzero entries: PEFA needs at least one (query, "
                         f"document) pair")
    return rel


def _own_csr(y: RelevanceLike, name: str) -> sp.csr_matrix:
    """A new float32 CSR matrix (duplicates summed, zeros dropped, columns sorted) from a sparse
    matrix (index arrays checked before scipy's native code sees them) or a dense 2-D array."""
    if not sp.issparse(y):
        if isinstance(y, torch.Tensor):
            # bfloat16 widened; a meta tensor (no data: torch's NotImplementedError) is named
            y = to_numpy(y) if y.layout == torch.strided and not y.is_meta else y
        if not isinstance(y, np.ndarray) or y.ndim != 2:
            raise InputError(f"{name} must be a scipy sparse matrix, a pefa_gpu.Relevance or a "
                             f"2-D numpy array or torch tensor, got {type(y).__name__} of shape "
                             f"{getattr(y, 'shape', '?')}")
    elif y.ndim != 2:
        raise InputError(f"{name} must be 2-D, got shape {y.shape}")
    m, n = (int(s) for s in y.shape)  # dense too: a (2**40, 0) array holds no data
    if m > MAX_ROWS or n > MAX_ROWS:  # converting allocates row pointers of that length
        raise InputError(f"{name} has shape {y.shape}: at most {MAX_ROWS} rows (queries) and "
                         f"columns (documents)")
    if not sp.issparse(y):
        rows, cols = y.nonzero()  # as scipy reads a dense array, with the weights checked
        csr = sp.csr_matrix((_float32(y[rows, cols], name), (rows, cols)), shape=y.shape)
    elif y.format in ("csr", "csc"):
        csr = _compressed_csr(y, m, n, name)
    else:
        try:
            coo = y if y.format == "coo" else y.tocoo()
        except (ValueError, IndexError) as exc:
            raise InputError(f"{name} ({y.format}) is malformed: {exc}") from None
        rows, cols, data = np.asarray(coo.row), np.asarray(coo.col), coo.data
        if not rows.shape == cols.shape == data.shape:
            raise InputError(f"{name} (coo): row, col and data must have one length each, got "
                             f"{rows.shape}, {cols.shape}, {data.shape}")
        rows = _checked_ids(rows, m, name, "row (query)")
        cols = _checked_ids(cols, n, name, "column (document)")
        csr = sp.csr_matrix((_float32(np.asarray(data), name), (rows, cols)), shape=(m, n))
    csr.sum_duplicates()  # sorts the column ids too
    csr.eliminate_zeros()
    if y.dtype == bool:  # a bool matrix's duplicates are one True (as scipy reads it)
        csr.data[:] = 1.0
    return _finite(csr, name)


def _compressed_csr(y: RelevanceLike, m: int, n: int, name: str) -> sp.csr_matrix:
    """A new float32 CSR matrix from a CSR / CSC matrix whose index arrays are checked first."""
    major, minor, what, cls = (m, n, "column (document)", sp.csr_matrix) if y.format == "csr" \
        else (n, m, "row (query)", sp.csc_matrix)
    indptr, indices = np.asarray(y.indptr), np.asarray(y.indices)
    if indices.ndim != 1 or np.ndim(y.data) != 1:
        raise InputError(f"{name} ({y.format}): indices and data must be 1-D, got shapes "
                         f"{indices.shape} and {np.shape(y.data)}")
    if indptr.ndim != 1 or indptr.shape[0] != major + 1 or indptr.dtype.kind not in "iu":
        raise InputError(f"{name} ({y.format}): indptr must be {major + 1} integers, got "
                         f"{indptr.dtype} shape {indptr.shape}")
    nnz = int(indptr[-1])
    if int(indptr[0]) != 0 or np.any(indptr[1:] < indptr[:-1]) \
            or nnz > min(indices.shape[0], y.data.shape[0]):
        raise InputError(f"{name} ({y.format}): indptr must rise from 0 to at most the "
                         f"{indices.shape[0]} stored entries, got {indptr[:5].tolist()}...")
    ids = _checked_ids(indices[:nnz], minor, name, what)
    return cls((_float32(np.asarray(y.data[:nnz]), name), ids, indptr.astype(np.int64)),
               shape=(m, n)).tocsr()  # copies (CSC -> CSR: new ones)


def _checked_ids(ids: np.ndarray, size: int, name: str, what: str) -> np.ndarray:
    """A copy of ``ids`` as signed integers (scipy's index dtypes), each in [0, ``size``)."""
    if ids.dtype.kind not in "iu":
        raise InputError(f"{name}: {what} ids must be integers, got {ids.dtype}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= size):
        bad = ids[(ids < 0) | (ids >= size)]
        raise InputError(f"{name} holds {what} ids out of range [0, {size}): "
                         f"{bad[:5].tolist()}")
    return np.array(ids, dtype=ids.dtype if ids.dtype.kind == "i" else np.int64)


def _float32(data: np.ndarray, name: str) -> np.ndarray:
    """A float32 copy of bool / integer / float ``data`` (complex: TypeError, else InputError);
    wider floats that round to 0 there (|w| < 1e-45: dropped as explicit zeros) InputError."""
    if data.dtype.kind not in "biuf":
        err = TypeError if data.dtype.kind == "c" else InputError
        raise err(f"{name} has dtype {data.dtype}; relevance weights must be real numbers "
                  f"(bool, integer or float)")
    out = np.array(data, dtype=np.float32)
    if data.dtype.kind == "f" and data.dtype.itemsize > 4 \
            and np.count_nonzero(out) != np.count_nonzero(data):
        tiny = data[(out == 0) & (data != 0)]
        raise InputError(f"{name} holds weights too small for float32 (nonzero, |w| < 1e-45, "
                         f"e.g. {tiny[:3].tolist()}): scale them up")
    return out


def _finite(csr: sp.csr_matrix, name: str) -> sp.csr_matrix:
    if csr.nnz and not np.isfinite(csr.data).all():
        raise InputError(f"{name} contains NaN or inf weights (or weights beyond float32's "
                         f"range, ±3.4e38)")
    return csr


def _inferred_size(ids: np.ndarray, name: str) -> int:
    """max id + 1, for ids meant as 0-based row / column numbers."""
    top = int(ids.max()) if ids.size else -1
    if top >= MAX_ROWS:
        raise InputError(f"{name} holds {top}, so without shape= Y would have {top + 1} rows "
                         f"or columns; map raw ids to 0-based positions, or pass shape=")
    return top + 1


def _array(x: Any, name: str) -> np.ndarray:
    """``x`` as numpy: numpy, torch (bfloat16 widened, CUDA copied), cupy through to_numpy,
    else np.asarray; what numpy cannot read (a ragged list) is an InputError naming ``name``."""
    if hasattr(x, "__dlpack__"):
        return to_numpy(x, name)
    try:
        return np.asarray(x)
    except ValueError as exc:  # 'inhomogeneous shape'
        raise InputError(f"{name} could not be read as an array: {exc}") from None


def _index_array(x: Any, name: str) -> np.ndarray:
    a = _array(x, name).ravel()
    if a.size and a.dtype.kind not in "iu" and not (a.dtype.kind == "f"
                                                    and np.all(a == np.round(a))):
        raise InputError(f"{name} must hold integer indices, got dtype {a.dtype}")
    if a.size and (a.max() >= 2**63 or a.min() < -2**63):  # int64's cast wraps them
        bad = a[(a >= 2**63) | (a < -2**63)]
        raise InputError(f"{name} holds ids beyond int64: {bad[:5].tolist()}")
    return a.astype(np.int64, copy=False)  # copied by _checked_ids
