"""faiss plumbing: the lazy import, its thread pool, array hand-off and result normalisation
(similarities, -1 / -inf padding, the tie rule). The faiss backends' common class:
:mod:`pefa_gpu.index._faiss_backend`.

A faiss index on the GPU (``on_gpu``) is searched with torch tensors on its device: faiss gets
their device pointers and runs on torch's current stream there (:func:`search_tensors`, as
faiss' ``contrib/torch_utils`` does, but per call and without patching faiss' classes), so
the queries never leave the GPU. CPU indices take numpy arrays.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import numpy as np
import torch

from ..arrays import as_tensor, cuda_index, to_numpy
from ..errors import InputError, MissingDependencyError
from ..topk import PAD_ID, PAD_SCORE, merge_topk, order_ties
from .base import import_optional


def import_faiss() -> Any:
    """The faiss module, or MissingDependencyError saying how to install it."""
    return import_optional("faiss", "this backend needs faiss: `pip install faiss-cpu` (CPU) or "
                           "`conda install -c pytorch faiss-gpu` (GPU); or `pip install "
                           "pefa_gpu[faiss]`")


@functools.lru_cache(maxsize=1)
def optional_faiss() -> Any:
    """The faiss module, or None when it is not installed."""
    try:
        return import_faiss()
    except MissingDependencyError:
        return None


@contextlib.contextmanager
def faiss_threads(faiss: Any, threads: int) -> Iterator[None]:
    """Run the block with faiss' OpenMP pool set to ``threads`` (0 = leave as is)."""
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(int(threads) or before)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)


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
    """(B, k) results with nothing found: scores -inf, ids -1."""
    return (torch.full((b, k), PAD_SCORE, device=device),
            torch.full((b, k), PAD_ID, dtype=torch.long, device=device))
