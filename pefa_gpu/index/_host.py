"""Backends searched through a library (hnswlib, ScaNN, faiss). A subclass implements
``_new_index(x)`` ((n, d) float32 -> the library's index over them), ``_append(x)`` ((r, d)
float32, r > 0), ``_count()``, ``_raw_search(q, k, params)`` ((B, d) float32, 1 <= k <= ntotal
-> (B, k) similarities sorted descending, ids, -1: none) and, where it can, ``_read_rows``."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from ..arrays import DeviceLike, as_tensor, check_topk, to_numpy
from ..errors import FormatError, InputError
from ..params import Params
from ..storage import read_json
from ._faiss import (device_float32, faiss_pointer, faiss_threads, host_float32, import_faiss,
                     normalise_results, on_current_stream, search_tensors)
from .base import Index, check_row_ids, empty_results
from .exact import ExactIndex

FAISS_FILE = "index.faiss"


def write_description(path: Path, fmt: str, **fields: Any) -> None:
    """A saved index's JSON description: ``fmt`` (version 1) and ``fields``."""
    path.write_text(json.dumps({"format": fmt, "format_version": 1, **fields}, indent=2) + "\n")


def read_description(path: Path, fmt: str, **expected: Any) -> dict[str, Any]:
    """The description at ``path`` (a file): ``fmt`` version 1, int ``dim`` and ``ntotal`` > 0,
    every ``expected`` field equal to its value; else FormatError."""
    meta = read_json(path, "description")
    ok = (isinstance(meta, dict) and meta.get("format") == fmt
          and meta.get("format_version") == 1
          and all(type(meta.get(k)) is int and meta[k] > 0 for k in ("dim", "ntotal"))
          and all(meta.get(k) == v for k, v in expected.items()))
    if not ok:
        want = ", ".join(["dim", "ntotal", *(f"{k}={v!r}" for k, v in expected.items())])
        raise FormatError(f"{path} is not a {fmt!r} version 1 description ({want})")
    return meta


def check_row_norms(x: np.ndarray, top: float, what: str) -> None:
    """InputError when a row of ``x`` (rows, d) has a norm above ``top``, what ``what`` holds."""
    norm = float(np.sqrt(np.einsum("ij,ij->i", x, x, dtype=np.float64).max()))
    if norm > top:
        raise InputError(f"vectors: a row norm of {norm:.3g} is beyond what {what} holds "
                         f"({top:.3g}): normalise the rows")


class HostBackend(Index):
    """``_index``: the library's index (None before build); ``max_k`` (``gpu_max_k`` on the
    GPU): the largest k the library answers (tests lower it), larger k: exact search."""

    max_k: ClassVar[int] = 2**62
    gpu_max_k: ClassVar[int] = 2**62
    builds_empty: ClassVar[bool] = False  # whether build takes (0, d) vectors
    on_gpu = False  # True: searched with tensors on the device (a faiss GPU index)
    _want_gpu = False  # True: built onto the GPU
    copies_rows = True  # the library holds its own copy

    def __init__(self, params: Params | dict | None = None, device: DeviceLike = None):
        super().__init__(params, device)
        self._index: Any = None
        self._dim = 0
        self._fallback: ExactIndex | None = None

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def ntotal(self) -> int:
        return 0 if self._index is None else self._count()

    @property
    def threads(self) -> int:
        """``params.threads``, 0 meaning every core."""
        return self.params.threads or os.cpu_count() or 1

    def _float32(self, vectors: Any, dim: int | None = None) -> Any:
        """Rows to give the library: (rows, d) float32, checked; device rows for an index on
        (or, building, bound for) the GPU, else numpy."""
        if self.on_gpu if dim is not None else self._want_gpu:
            return device_float32(vectors, "vectors", self.device, dim)
        return host_float32(vectors, "vectors", dim=dim)

    def build(self, vectors: Any) -> "HostBackend":
        """vectors: (n, d) float -> a fresh index over them; returns self."""
        x = self._float32(vectors)
        if x.shape[1] == 0 or (x.shape[0] == 0 and not self.builds_empty):
            raise InputError(f"{self.name} needs a non-empty (n, d) matrix, got {tuple(x.shape)}")
        self._fallback = None
        self._index, self._dim = self._new_index(x), x.shape[1]
        return self

    def add(self, vectors: Any) -> None:
        """Append rows (ids continue after the existing ones); into an empty index: build."""
        if self._index is None:
            self.build(vectors)
            return
        x = self._float32(vectors, self.dim)
        if x.shape[0]:
            self._append(x)  # (the exact fallback sees the new count and is rebuilt)

    def search(self, queries: Any, k: int, params: Params | dict | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        scores, ids = self._search(queries, k, params)
        return scores.to(self.device), ids.to(self.device)

    def search_host(self, queries: Any, k: int, check_finite: bool = True,
                    params: Params | dict | None = None) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`search` with numpy results (small CPU batches). ``check_finite=False``: the
        caller has tested the queries for NaN / inf."""
        scores, ids = self._search(queries, k, params, check_finite)
        return to_numpy(scores), to_numpy(ids)

    def _search(self, queries: Any, k: int, params: Params | dict | None,
                check_finite: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`search`'s results where the library leaves them (the CPU or the GPU)."""
        k = check_topk(k, self.ntotal, "k")
        sp = self.resolve_search_params(params)
        if self.on_gpu:  # faiss reads the tensor where it is: no host copy, values not read
            q = as_tensor(queries, device=self.device, dtype=torch.float32,
                          name="queries").detach()
        else:
            q = host_float32(queries, "queries", check_finite=check_finite)
        self.check_queries(q)
        if q.shape[0] == 0 or self.ntotal == 0:
            return empty_results(q.shape[0], k, self.device)
        if k > (self.gpu_max_k if self.on_gpu else self.max_k):
            return self._exact_search(q, k)
        scores, ids = self._raw_search(q, min(k, self.ntotal), sp)
        return normalise_results(as_tensor(scores), as_tensor(ids), k)

    def _exact_search(self, q: Any, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An exact search over the stored rows, on the index's device."""
        if self._fallback is None or self._fallback.ntotal != self.ntotal:
            self._fallback = ExactIndex(device=self.device).build(self._stored_vectors())
        return self._fallback.search(as_tensor(q, device=self.device).float(), k)

    def reconstruct(self, ids: Any) -> torch.Tensor:
        """On the GPU a gather from the device copy of the rows (:meth:`_stored_vectors`)."""
        where = self.device if self.on_gpu else "cpu"
        i = check_row_ids(as_tensor(ids, device=where, name="ids"), self.ntotal)
        if self._index is None:  # nothing built: only empty ids pass the check
            return torch.zeros((*i.shape, self.dim), device=self.device)
        if self.on_gpu:
            return self._stored_vectors()[i]
        rows = self._read_rows(to_numpy(i.flatten()))  # int64, contiguous
        return as_tensor(rows, device=self.device).reshape(*i.shape, self.dim)

    def _read_rows(self, ids: np.ndarray) -> np.ndarray:
        """The stored rows ``ids`` (r,) int64 -> (r, d) float32."""
        return Index.reconstruct(self, ids)

    def _stored_vectors(self) -> torch.Tensor:
        """Every stored row, (ntotal, d) float32 on the device."""
        return as_tensor(self._read_rows(np.arange(self.ntotal)), device=self.device)


_READ_LOCK = threading.Lock()  # faiss' vector size limit is one for the process


class FaissBackend(HostBackend):
    """A faiss index; ``_faiss_params(params, k)``: a search's faiss settings,
    ``_set_search_defaults(index)``: ``search_params`` written into the faiss index;
    ``saved_kinds``: faiss class names a save may hold -> their kinds, ``_adopt(index, kind,
    directory)``: a read index checked against ``params`` (FormatError), as it will be held."""

    def __init__(self, params: Any = None, device: DeviceLike = None):
        super().__init__(params, device)
        self._faiss = import_faiss()
        self._gpu_res: Any = None  # the faiss GPU resources of an index on the GPU

    @property
    def on_gpu(self) -> bool:
        """True when the faiss index lives on the GPU (searched with device tensors)."""
        return self._gpu_res is not None

    def _count(self) -> int:
        return int(self._index.ntotal)

    def _raw_search(self, q: Any, k: int, params: Params) -> tuple[Any, Any]:
        if self.on_gpu:
            return search_tensors(self._faiss, self._index, q, k, self._faiss_params(params, k),
                                  self._gpu_res)
        with faiss_threads(self._faiss, self.params.threads):
            return self._index.search(q, k, params=self._faiss_params(params, k))

    def _append(self, x: Any) -> None:
        self._call(self._index, "add", x)

    def _call(self, index: Any, method: str, x: Any) -> None:
        """``index.train`` / ``add`` the rows ``x``: numpy, or a device tensor by its pointer."""
        with faiss_threads(self._faiss, self.params.threads):
            if isinstance(x, np.ndarray):
                getattr(index, method)(x)
                return
            with on_current_stream(self._faiss, self._gpu_res, x.device):
                getattr(index, method + "_c")(x.shape[0], faiss_pointer(self._faiss, x))

    def _cpu_index(self) -> Any:
        """The index itself on the CPU; a CPU copy of all of it (through the host) on the GPU."""
        return self._faiss.index_gpu_to_cpu(self._index) if self.on_gpu else self._index

    def save(self, directory: str | Path) -> None:
        """Write ``index.faiss``: a CPU copy whose search settings are ``search_params``."""
        directory = self._save_dir(directory)
        cpu = self._cpu_index()
        self._set_search_defaults(cpu)
        self._faiss.write_index(cpu, str(directory / FAISS_FILE))

    def _read_index(self, path: Path, flags: int = 0) -> Any:
        """faiss' read of ``path`` with no vector in it larger than the file (faiss allocates
        the size a file claims before reading: a forged one took gigabytes)."""
        f = self._faiss
        with _READ_LOCK:
            limit = f.get_deserialization_vector_byte_limit()
            f.set_deserialization_vector_byte_limit(min(limit, path.stat().st_size))
            try:
                return f.read_index(str(path), flags)
            finally:
                f.set_deserialization_vector_byte_limit(limit)

    @classmethod
    def load(cls, directory: str | Path, params: Params | dict | None = None,
             device: DeviceLike = None) -> "FaissBackend":
        """Read ``index.faiss``: an inner-product index of a class in ``saved_kinds`` that
        :meth:`_adopt` accepts, else FormatError (search settings are not part of it)."""
        path = cls._saved_file(directory, FAISS_FILE)
        out = cls(params, device)
        try:
            index = out._read_index(path)
        except Exception as exc:  # faiss raises RuntimeError on a corrupt file
            raise FormatError(f"{path} could not be read by faiss: {exc}") from exc
        kind = cls.saved_kinds.get(type(index).__name__)
        if kind is None or index.metric_type != out._faiss.METRIC_INNER_PRODUCT:
            raise FormatError(f"{directory}: expected an inner-product "
                              f"{' or '.join(cls.saved_kinds)}, found {type(index).__name__}")
        out._index, out._dim = out._adopt(index, kind, directory), int(index.d)
        return out
