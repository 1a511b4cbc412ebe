"""HNSW on the CPU: faiss ``IndexHNSWFlat``, inner product (the paper's M=32,
efConstruction=500, efSearch=300); results on the index's device."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from ..arrays import finite_array
from ..errors import FormatError
from ..params import (MAX_HNSW_EF, MAX_THREADS, check_at_most, check_hnsw_m, check_nonnegative,
                      check_number, checked)
from .base import IndexParams
from ._faiss import faiss_search_parameters, faiss_threads
from ._host import FaissBackend


@dataclasses.dataclass(frozen=True, kw_only=True)
class HNSWParams(IndexParams):
    """Build settings. M: graph degree (level 0 has 2M links). ef_construction: beam width at
    build time. threads: faiss' OpenMP threads for build and search (0 = all cores)."""

    M: int = checked(32, check_hnsw_m)
    ef_construction: int = checked(500, check_at_most, MAX_HNSW_EF)
    threads: int = checked(0, check_nonnegative, "all cores", MAX_THREADS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HNSWSearchParams(IndexParams):
    """Search settings. ef_search: beam width (raised to k). full_scan_factor: indices of at
    most this many times ef rows are scanned exactly, where a walk would visit them all (0 =
    never)."""

    ef_search: int = checked(300, check_at_most, MAX_HNSW_EF)
    full_scan_factor: float = checked(12.0, check_number)


class HNSWIndex(FaissBackend):
    """faiss HNSW (flat storage, inner product) on the CPU; results on ``device``."""

    name = "hnsw"
    Params = HNSWParams
    SearchParams = HNSWSearchParams
    exact_scores = True  # flat storage: returned scores are fp32 <q, x_j>
    builds_empty = True
    saved_kinds = {"IndexHNSWFlat": "hnsw"}

    def _new_index(self, x: np.ndarray) -> Any:
        f = self._faiss
        index = f.IndexHNSWFlat(x.shape[1], self.params.M, f.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = self.params.ef_construction
        self._set_search_defaults(index)  # for direct users of faiss_index
        self._call(index, "add", x)
        return index

    def _set_search_defaults(self, index: Any) -> None:
        index.hnsw.efSearch = self.search_params.ef_search

    def _faiss_params(self, params: HNSWSearchParams, k: int) -> Any:
        return faiss_search_parameters("SearchParametersHNSW", efSearch=max(params.ef_search, k))

    def _raw_search(self, q: np.ndarray, k: int,
                    params: HNSWSearchParams) -> tuple[np.ndarray, np.ndarray]:
        if self.ntotal <= params.full_scan_factor * max(params.ef_search, k):
            with faiss_threads(self._faiss, self.params.threads):
                return self._storage().search(q, k)
        return super()._raw_search(q, k, params)

    def _read_rows(self, ids: np.ndarray) -> np.ndarray:
        return self._storage().reconstruct_batch(ids)

    def _storage(self) -> Any:
        """The flat storage under the graph (one SWIG proxy kept per graph: faiss makes a new
        one at each ``index.storage``)."""
        if getattr(self, "_storage_of", None) is not self._index:
            self._storage_proxy, self._storage_of = self._index.storage, self._index
        return self._storage_proxy

    @property
    def faiss_index(self) -> Any:
        """The underlying ``faiss.IndexHNSWFlat`` (None before build)."""
        return self._index

    def _adopt(self, index: Any, kind: str, directory: str | Path) -> Any:
        if index.hnsw.nb_neighbors(1) != self.params.M:
            raise FormatError(f"{directory}: the saved graph has M={index.hnsw.nb_neighbors(1)},"
                              f" params say M={self.params.M}")
        # the level draw of add(): forged, it segfaulted (none) or asked for unbounded memory
        f, fresh = self._faiss, self._faiss.HNSW(self.params.M)
        if any(not np.array_equal(f.vector_to_array(getattr(index.hnsw, name)),
                                  f.vector_to_array(getattr(fresh, name)))
               for name in ("assign_probas", "cum_nneighbor_per_level")):
            raise FormatError(f"{directory}: the saved graph's level probabilities or links per "
                              f"level are not faiss' for M={self.params.M} (forged or damaged)")
        flat = f.downcast_index(index.storage)  # its rows, viewed: searches dropped NaN ones
        rows = f.rev_swig_ptr(flat.codes.data(), flat.codes.size()).view(np.float32)
        if not finite_array(rows):
            raise FormatError(f"{directory}: the saved vectors hold NaN or inf (forged or damaged)")
        return index
