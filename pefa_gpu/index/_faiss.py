"""Shared plumbing of the faiss backends: lazy import, array hand-off,
result normalisation (similarities, -1 / -inf padding) and the k-limit fallback.

Every faiss backend subclasses :class:`FaissBackend` and implements ``_raw_search`` (one
call into faiss with ``k`` within ``max_k`` and the call's search settings, returning faiss' own
(D, I)) and ``_stored_vectors`` (the indexed rows, for the fallback). A request with ``k``
above the backend's ``max_k`` (faiss GPU: 2048, CAGRA: 1024) never fails: it is answered by an
exact search over the stored vectors on the index's device (never worse recall than the ANN
search would have had).

A faiss index on the GPU (``on_gpu``) is searched with torch tensors on its device: faiss gets
their device pointers and runs on torch's current stream there (:func:`search_tensors`, as
faiss' ``contrib/torch_utils`` does, but per call and without patching faiss' classes), so
the queries never leave the GPU. CPU indices take numpy arrays.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any, ClassVar, Iterator

import numpy as np
import torch

from ..arrays import as_tensor, check_topk, cuda_index, to_numpy
from ..errors import FormatError, InputError, MissingDependencyError
from ..params import Params
from ..topk import PAD_ID, PAD_SCORE, merge_topk, order_ties
from .base import Index
from .exact import ExactIndex, faiss_threads  # exact search: the k-limit fallback

INDEX_FILE = "index.faiss"


def import_faiss() -> Any:
    """The faiss module, or MissingDependencyError saying how to install it."""
    try:
        import faiss  # noqa: PLC0415 (lazy on purpose)
    except ImportError as exc:
        raise MissingDependencyError(
            "this backend needs faiss: `pip install faiss-cpu` (CPU) or "
            "`conda install -c pytorch faiss-gpu` (GPU); or `pip install pefa_gpu[faiss]`"
        ) from exc
    return faiss


def faiss_has_gpu(faiss: Any) -> bool:
    """True when this faiss build has GPU support and sees at least one GPU."""
    get = getattr(faiss, "get_num_gpus", None)
    try:
        return bool(get is not None and get() > 0 and hasattr(faiss, "StandardGpuResources"))
    except Exception:  # a faiss build that cannot talk to the driver
        return False


@functools.lru_cache(maxsize=256)
def faiss_search_parameters(kind: str, **fields: Any) -> Any:
    """A ``faiss.<kind>`` search-parameters object with ``fields`` set (e.g.
    ``("SearchParametersHNSW", efSearch=300)``), made once per value: creating one costs ~15 us,
    a tenth of a single-query search. Shared, so never modified after creation."""
    out = getattr(import_faiss(), kind)()
    for name, value in fields.items():
        setattr(out, name, value)
    return out


def host_float32(x: Any, name: str, dim: int | None = None,
                 check_finite: bool = True) -> np.ndarray:
    """(rows, d) C-contiguous float32 numpy array for faiss; checks rank, dim and (unless
    ``check_finite`` is False: values already checked by the caller) finiteness."""
    a = to_numpy(x if isinstance(x, (np.ndarray, torch.Tensor)) else as_tensor(x, name=name))
    a = np.ascontiguousarray(a, dtype=np.float32)
    if a.ndim != 2:
        raise InputError(f"{name} must be 2-D (rows, dim), got shape {a.shape}")
    if dim is not None and a.shape[1] != dim:
        raise InputError(f"{name} must have shape (rows, {dim}), got {a.shape}")
    if check_finite and a.size and not np.isfinite(a).all():
        raise InputError(f"{name} contains NaN or inf")
    return a


def normalise_results(scores: np.ndarray, ids: np.ndarray,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """faiss (D, I) for an inner-product index -> float32 / int64 tensors on ``device`` with
    the library's padding (id -1, score -inf) wherever faiss found nothing."""
    scores, ids = normalise_results_host(scores, ids)
    return as_tensor(scores, device=device), as_tensor(ids, device=device)


def normalise_results_host(scores: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`normalise_results` with numpy float32 / int64 arrays as the result."""
    scores = np.ascontiguousarray(scores, dtype=np.float32)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if ids.size and ids.min() < 0:  # on the host: cheaper than torch ops for small B
        missing = ids < 0
        scores = np.where(missing, np.float32(PAD_SCORE), scores)
        ids = np.where(missing, np.int64(PAD_ID), ids)
    # faiss leaves equal scores in any order: the tie rule lists them by id
    scores, ids = order_ties(torch.from_numpy(scores), torch.from_numpy(ids))
    return scores.numpy(), ids.numpy()


def normalise_results_tensors(scores: torch.Tensor, ids: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`normalise_results` for faiss results that are already tensors on the index's
    device: padding (id -1, score -inf) where faiss found nothing, equal scores listed by id,
    padding last; no host synchronisation."""
    missing = ids < 0
    scores = scores.masked_fill(missing, PAD_SCORE)
    ids = ids.masked_fill(missing, PAD_ID)
    return merge_topk(scores, ids, ids.shape[1])


def faiss_pointer(faiss: Any, t: torch.Tensor) -> Any:
    """A faiss SWIG pointer to the memory of the contiguous float32 or int64 tensor ``t`` (CPU
    or CUDA)."""
    if not t.is_contiguous():
        raise InputError("faiss_pointer needs a contiguous tensor")
    if t.dtype == torch.float32:
        return faiss.cast_integer_to_float_ptr(t.data_ptr())
    if t.dtype == torch.int64:
        return faiss.cast_integer_to_idx_t_ptr(t.data_ptr())
    raise TypeError(f"faiss_pointer takes float32 or int64 tensors, got {t.dtype}")


@contextlib.contextmanager
def faiss_stream(faiss: Any, res: Any, device: int, stream: int) -> Iterator[None]:
    """faiss GPU work through the resources ``res`` on GPU ``device`` runs on the CUDA stream
    ``stream`` (a ``cudaStream_t`` as an int: torch's ``current_stream().cuda_stream``) inside
    the block; the stream before it is put back afterwards, also on an error."""
    before = res.getDefaultStream(device)
    res.setDefaultStream(device, faiss.cast_integer_to_cudastream_t(stream))
    try:
        yield
    finally:
        res.setDefaultStream(device, before)


def on_current_stream(faiss: Any, res: Any, device: torch.device
                      ) -> contextlib.AbstractContextManager:
    """:func:`faiss_stream` with torch's current stream on the CUDA ``device`` (a block that
    does nothing for the CPU)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    dev = cuda_index(device)
    return faiss_stream(faiss, res, dev, torch.cuda.current_stream(dev).cuda_stream)


def search_tensors(faiss: Any, index: Any, q: torch.Tensor, k: int, params: Any = None,
                   res: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One faiss search with tensors in and out, no host copy: ``q`` (B, d) float32 on the
    index's device (CUDA for a GPU index, with its ``res``ources; the CPU for a CPU index) ->
    faiss' own (D (B, k) float32, I (B, k) int64) on the same device. On CUDA faiss runs on
    torch's current stream, so the results are ordered before later torch work."""
    q = q.contiguous()
    scores = torch.empty((q.shape[0], k), dtype=torch.float32, device=q.device)
    ids = torch.empty((q.shape[0], k), dtype=torch.int64, device=q.device)
    with on_current_stream(faiss, res, q.device):
        index.search_c(q.shape[0], faiss_pointer(faiss, q), k, faiss_pointer(faiss, scores),
                       faiss_pointer(faiss, ids), params)
    return scores, ids


def empty_results(b: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.full((b, k), PAD_SCORE, device=device),
            torch.full((b, k), PAD_ID, dtype=torch.long, device=device))


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
        i = as_tensor(ids, device=self.device, name="ids").long()
        if i.numel() and (int(i.min()) < 0 or int(i.max()) >= self.ntotal):
            raise InputError(f"ids must lie in [0, {self.ntotal}), got {int(i.min())}.."
                             f"{int(i.max())}")
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
        directory = Path(directory)
        if not directory.is_dir():
            raise InputError(f"save directory {directory} does not exist")
        if self._index is None:
            raise InputError(f"{type(self).__name__} is empty: build it before saving")
        self._faiss.write_index(index, str(directory / INDEX_FILE))

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
