"""The common class of the faiss backends (see :mod:`pefa_gpu.index._faiss` for the plumbing).

Every faiss backend subclasses :class:`FaissBackend` and implements ``_raw_search`` (one
call into faiss with ``k`` within ``max_k`` and the call's search settings, returning faiss' own
(D, I)) and ``_stored_vectors`` (the indexed rows, for the fallback). A request with ``k``
above the backend's ``max_k`` (faiss GPU: 2048, CAGRA: 1024) never fails: it is answered by an
exact search over the stored vectors on the index's device (never worse recall than the ANN
search would have had).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from ..arrays import as_tensor, check_topk, to_numpy
from ..errors import FormatError, InputError
from ..params import Params
from ._faiss import (empty_results, host_float32, import_faiss, normalise_results,
                     normalise_results_host, normalise_results_tensors, search_tensors)
from .base import Index, check_row_ids
from .exact import ExactIndex  # exact search: the k-limit fallback

INDEX_FILE = "index.faiss"


class FaissBackend(Index):
    """Common shape of the faiss backends (see module docstring).

    ``max_k`` (class attribute, ``None`` = no limit) is the largest k the native search
    accepts; tests lower it to exercise the fallback on CPU.
    """

    max_k: ClassVar[int | None] = None

    def __init__(self, params: Any = None, device: Any = None):
        super().__init__(params, device)
        self._faiss = import_faiss()
        self._index: Any = None
        self._dim = 0
        self._fallback: Index | None = None

    # -- protocol ---------------------------------------------------------------------------
    @property
    def on_gpu(self) -> bool:
        """True when the faiss index lives on the GPU (searched with device tensors)."""
        return False

    @property
    def ntotal(self) -> int:
        return int(self._index.ntotal) if self._index is not None else 0

    @property
    def dim(self) -> int:
        return self._dim

    def search(self, queries: Any, k: int, params: Params | dict | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, d) queries -> (B, k) float32 similarities, int64 ids (-1 / -inf padded).
        ``params``: this call's search settings (None: ``search_params``)."""
        sp = self.resolve_search_params(params)
        k = check_topk(k, self.ntotal, "k")
        if self.on_gpu:  # faiss reads the tensor where it is: no host copy, values not read
            q = as_tensor(queries, device=self.device, dtype=torch.float32,
                          name="queries").detach()
        else:
            q = host_float32(queries, "queries")
        if q.ndim != 2 or (self.ntotal and q.shape[1] != self.dim):
            raise InputError(f"queries must have shape (B, {self.dim}), got {tuple(q.shape)}")
        if q.shape[0] == 0 or self.ntotal == 0:
            return empty_results(q.shape[0], k, self.device)
        limit = self._k_limit()
        if limit is not None and k > limit:
            return self._search_beyond_limit(q, k)
        if self.on_gpu:  # on torch's current stream; results normalised on the device
            return normalise_results_tensors(*search_tensors(
                self._faiss, self._index, q, k, self._faiss_params(sp), self._gpu_resources()))
        return normalise_results(*self._raw_search(q, k, sp), self.device)

    def search_host(self, queries: Any, k: int, check_finite: bool = True,
                    params: Params | dict | None = None) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`search` with numpy results on the host (for small CPU batches: no torch
        hand-off). ``check_finite=False``: the caller has already tested the queries for NaN /
        inf."""
        sp = self.resolve_search_params(params)
        k = check_topk(k, self.ntotal, "k")
        q = host_float32(queries, "queries", check_finite=check_finite)
        if self.ntotal and q.shape[1] != self.dim:
            raise InputError(f"queries must have shape (B, {self.dim}), got {q.shape}")
        limit = self._k_limit()
        if q.shape[0] == 0 or self.ntotal == 0 or (limit is not None and k > limit):
            return tuple(map(to_numpy, self.search(q, k, sp)))
        return normalise_results_host(*self._raw_search(q, k, sp))

    def _k_limit(self) -> int | None:
        return self.max_k

    def _search_beyond_limit(self, queries: Any, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k above ``max_k``: exact search over the stored vectors on the index's device."""
        if self._fallback is None or self._fallback.ntotal != self.ntotal:
            self._fallback = ExactIndex(device=self.device).build(self._stored_vectors())
        return self._fallback.search(as_tensor(queries, device=self.device).float(), k)

    def _invalidate(self) -> None:
        self._fallback = None

    def reconstruct(self, ids: Any) -> torch.Tensor:
        """Stored rows ``ids`` (any shape, int64) -> (*ids.shape, d) float32 on the device."""
        i = check_row_ids(as_tensor(ids, device=self.device, name="ids"), self.ntotal)
        flat = np.ascontiguousarray(to_numpy(i.flatten()), dtype=np.int64)
        rows = self._cpu_reader().reconstruct_batch(flat) if flat.size else \
            np.zeros((0, self.dim), np.float32)
        return as_tensor(rows, device=self.device).reshape(*i.shape, self.dim)

    def _cpu_reader(self) -> Any:
        """A CPU faiss index whose ``reconstruct_batch`` returns the stored rows."""
        raise NotImplementedError

    # -- to implement -----------------------------------------------------------------------
    def _raw_search(self, q: np.ndarray, k: int, params: Params) -> tuple[np.ndarray, np.ndarray]:
        """One faiss search, k within ``max_k``, with the search settings ``params`` (this
        backend's SearchParams): faiss' (D, I) as numpy arrays."""
        raise NotImplementedError

    def _faiss_params(self, params: Params) -> Any:
        """The faiss ``SearchParameters`` object for this backend's ``params`` (GPU indices)."""
        raise NotImplementedError

    def _gpu_resources(self) -> Any:
        """The faiss GPU resources of a GPU index (None on the CPU)."""
        return None

    def _stored_vectors(self) -> torch.Tensor:
        raise NotImplementedError

    # -- persistence helpers ----------------------------------------------------------------
    def _write(self, index: Any, directory: str | Path) -> None:
        self._faiss.write_index(index, str(self._save_dir(directory) / INDEX_FILE))

    @classmethod
    def _read(cls, directory: str | Path) -> Any:
        path = Path(directory) / INDEX_FILE
        if not path.is_file():
            raise FormatError(f"{path} is missing: not a saved {cls.name!r} index")
        faiss = import_faiss()
        try:
            return faiss.read_index(str(path))
        except Exception as exc:  # faiss raises RuntimeError on a corrupt file
            raise FormatError(f"{path} could not be read by faiss: {exc}") from exc
