"""HNSW on the CPU: faiss ``IndexHNSWFlat`` with the inner-product metric.

The graph lives in host memory; results are moved to the index's device, so a GPU model can
serve from a CPU HNSW. Defaults are the paper's: M=32, efConstruction=500 (build settings,
:class:`HNSWParams`), efSearch=300 (a search setting, :class:`HNSWSearchParams`). A search with
k > ef_search uses ef = k (faiss needs ef >= k).

Small graphs are scanned instead of walked: when the index holds at most
``full_scan_factor * ef`` rows, the search is an exact scan of the stored vectors (faiss'
flat storage under the graph, no copy). The graph walk would not save work there: measured on
SciFact vectors (M=32, d=384, k=16), a search at ef=300 computes as many distances as there
are rows up to n = 4 ef (96-100% of n) and still 77% at n = 8 ef; one query on one thread
takes 2.9x the scan's time at n = 4 ef, 1.7x at 8 ef, 1.4x at 12 ef, 1.1x at 17 ef (batches on
two threads: 3.4x, 1.9x, 1.5x, 1.2x; the same crossover at ef=100). The default 12 stops
where the scan is still ~1.4x faster, a margin for machines where the walk fares better. The
scan's results are exact, so recall can only rise. ``full_scan_factor=0`` always walks. The
factor is a search setting: it decides per search, not at build.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..arrays import as_tensor
from ..errors import FormatError, InputError
from .base import IndexParams, count, positive
from ._faiss import faiss_search_parameters, faiss_threads, host_float32, import_faiss
from ._faiss_backend import FaissBackend


@dataclasses.dataclass(frozen=True, kw_only=True)
class HNSWParams(IndexParams):
    """Build settings. M: graph degree (level 0 has 2M links). ef_construction: beam width at
    build time. threads: OpenMP threads for faiss during build and search (0 = faiss' default,
    all cores)."""

    M: int = positive(32)
    ef_construction: int = positive(500)
    threads: int = count(0, "all cores")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HNSWSearchParams(IndexParams):
    """Search settings. ef_search: beam width (raised to k when smaller). full_scan_factor:
    indices of at most this many times ef rows are searched by an exact scan (see the module
    docstring; 0 = never)."""

    ef_search: int = positive(300)
    full_scan_factor: float = 12.0

    def validate(self) -> None:
        super().validate()
        if isinstance(self.full_scan_factor, bool) or \
                not isinstance(self.full_scan_factor, (int, float)) or \
                not 0 <= self.full_scan_factor < float("inf"):
            raise InputError(f"full_scan_factor must be a finite number >= 0, got "
                             f"{self.full_scan_factor!r}")


class HNSWIndex(FaissBackend):
    """faiss HNSW (flat storage, inner product) on the CPU; results on ``device``."""

    name = "hnsw"
    distinct_ids = True  # the walk keeps a visited set; the scan is a top-k over the rows
    Params = HNSWParams
    SearchParams = HNSWSearchParams
    exact_scores = True  # flat storage: returned scores are fp32 <q, x_j>

    def build(self, vectors: Any) -> "HNSWIndex":
        """vectors: (n, d) float -> a fresh graph over them; returns self."""
        x = host_float32(vectors, "vectors")
        if x.shape[1] == 0:
            raise InputError("vectors have dimension 0")
        f = self._faiss
        index = f.IndexHNSWFlat(x.shape[1], self.params.M, f.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = self.params.ef_construction
        index.hnsw.efSearch = self.search_params.ef_search  # for direct users of faiss_index
        self._index, self._dim = index, x.shape[1]
        self._invalidate()
        self._add(x)
        return self

    def add(self, vectors: Any) -> None:
        """Append rows (ids continue after the existing ones)."""
        if self._index is None:
            self.build(vectors)
            return
        self._add(host_float32(vectors, "vectors", dim=self.dim))
        self._invalidate()

    def _add(self, x: np.ndarray) -> None:
        if x.shape[0]:
            with faiss_threads(self._faiss, self.params.threads):
                self._index.add(x)

    def _raw_search(self, q: np.ndarray, k: int,
                    params: HNSWSearchParams) -> tuple[np.ndarray, np.ndarray]:
        ef = max(params.ef_search, k)
        if self.ntotal <= params.full_scan_factor * ef:  # a walk would visit it all
            with faiss_threads(self._faiss, self.params.threads):
                return self._storage().search(q, k)
        sp = faiss_search_parameters("SearchParametersHNSW", efSearch=ef)
        with faiss_threads(self._faiss, self.params.threads):
            return self._index.search(q, k, params=sp)

    def _stored_vectors(self) -> torch.Tensor:
        return as_tensor(self._storage().reconstruct_n(0, self.ntotal), device=self.device)

    def _cpu_reader(self) -> Any:
        return self._storage()

    def _storage(self) -> Any:
        """The flat storage under the graph: faiss makes a new SWIG proxy at each
        ``index.storage`` (a few microseconds of a single-query search), so one is kept per
        graph."""
        if getattr(self, "_storage_of", None) is not self._index:
            self._storage_proxy, self._storage_of = self._index.storage, self._index
        return self._storage_proxy

    @property
    def faiss_index(self) -> Any:
        """The underlying ``faiss.IndexHNSWFlat`` (None before build)."""
        return self._index

    def save(self, directory: str | Path) -> None:
        """Write ``index.faiss`` into the existing, empty ``directory`` (with efSearch set to
        ``search_params.ef_search`` for readers of the file; this index's own searches always
        pass theirs)."""
        if self._index is not None:
            self._index.hnsw.efSearch = self.search_params.ef_search
        self._write(self._index, directory)

    @classmethod
    def load(cls, directory: str | Path, params: HNSWParams | dict | None = None,
             device: Any = None) -> "HNSWIndex":
        index = cls._read(directory)
        faiss = import_faiss()
        if not isinstance(index, faiss.IndexHNSWFlat) or \
                index.metric_type != faiss.METRIC_INNER_PRODUCT:
            raise FormatError(f"{directory}: expected an inner-product IndexHNSWFlat, "
                              f"found {type(index).__name__}")
        out = cls(params, device)
        if index.hnsw.nb_neighbors(1) != out.params.M:
            raise FormatError(f"{directory}: the saved graph has M={index.hnsw.nb_neighbors(1)},"
                              f" params say M={out.params.M}")
        out._index, out._dim = index, int(index.d)
        return out
