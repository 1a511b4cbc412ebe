"""The common class of the faiss backends (plumbing: :mod:`pefa_gpu.index._faiss`).

A subclass implements ``_raw_search`` (one faiss call on the host, faiss' own (D, I)),
``_append`` and ``_read_rows``; a GPU index (``on_gpu``) also ``_faiss_params`` and
``_gpu_resources`` and is searched with device tensors. k above the limit (faiss GPU: 2048)
is answered by an exact search over the stored rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..arrays import as_tensor, check_topk
from ..errors import FormatError
from ..params import Params
from ._faiss import import_faiss, normalise_results_tensors, search_tensors
from ._host import HostBackend
from .base import empty_results

INDEX_FILE = "index.faiss"


class FaissBackend(HostBackend):
    """Common shape of the faiss backends (see the module docstring)."""

    def __init__(self, params: Any = None, device: Any = None):
        super().__init__(params, device)
        self._faiss = import_faiss()
        self._index: Any = None

    @property
    def on_gpu(self) -> bool:
        """True when the faiss index lives on the GPU (searched with device tensors)."""
        return False

    @property
    def ntotal(self) -> int:
        return int(self._index.ntotal) if self._index is not None else 0

    def search(self, queries: Any, k: int, params: Params | dict | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.on_gpu:
            return super().search(queries, k, params)
        sp = self.resolve_search_params(params)
        k = check_topk(k, self.ntotal, "k")
        # faiss reads the tensor where it is: no host copy, values not read
        q = as_tensor(queries, device=self.device, dtype=torch.float32, name="queries").detach()
        self.check_queries(q)
        if q.shape[0] == 0 or self.ntotal == 0:
            return empty_results(q.shape[0], k, self.device)
        limit = self._k_limit()
        if limit is not None and k > limit:
            return self._exact_search(q, k)
        return normalise_results_tensors(*search_tensors(
            self._faiss, self._index, q, k, self._faiss_params(sp), self._gpu_resources()))

    def _faiss_params(self, params: Params) -> Any:
        """The faiss ``SearchParameters`` object for ``params`` (GPU indices)."""
        raise NotImplementedError

    def _gpu_resources(self) -> Any:
        """The faiss GPU resources of a GPU index (None on the CPU)."""
        return None

    def _write(self, index: Any, directory: str | Path) -> None:
        self._faiss.write_index(index, str(self._save_dir(directory) / INDEX_FILE))

    @classmethod
    def _read(cls, directory: str | Path) -> Any:
        path = cls._saved_file(directory, INDEX_FILE)
        try:
            return import_faiss().read_index(str(path))
        except Exception as exc:  # faiss raises RuntimeError on a corrupt file
            raise FormatError(f"{path} could not be read by faiss: {exc}") from exc
