"""faiss plumbing: the lazy import, its thread pool, arrays in and results out; a GPU index
reads torch tensors through device pointers on torch's current stream."""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import sys
from typing import Any, Iterator

import numpy as np
import torch

from ..arrays import as_tensor, cuda_index, is_bfloat16, require_finite, to_numpy
from ..errors import InputError, MissingDependencyError
from ..topk import PAD_SCORE, order_ties, pad_topk
from .base import import_optional


MIN_FAISS = (1, 14)  # from 1.14 faiss checks a saved HNSW graph's links as it reads it


def import_faiss() -> Any:
    """The faiss module (>= 1.14), or MissingDependencyError saying how to install it."""
    install = ("`pip install faiss-cpu` (CPU) or `conda install -c pytorch faiss-gpu` "
               "(GPU); or `pip install pefa_gpu[faiss]`")
    faiss = import_optional("faiss", f"this backend needs faiss: {install}")
    version = str(getattr(faiss, "__version__", None) or "0")
    if tuple(int(x) for x in re.findall(r"\d+", version)[:2]) < MIN_FAISS:
        raise MissingDependencyError(f"faiss {version} is too old: pefa_gpu needs faiss >= 1.14 "
                                     f"(older faiss reads forged graphs out of bounds); {install}")
    return faiss


@functools.lru_cache(maxsize=1)
def optional_faiss() -> Any:
    """The faiss module, or None when it is not installed (or too old: warned once)."""
    try:
        return import_faiss()
    except MissingDependencyError as exc:
        if "faiss" in sys.modules:  # imported, but too old
            logging.getLogger("pefa_gpu").warning("%s; carrying on without it", exc)
        return None


_GENERIC_BLAS = ("prescott", "core2", "nehalem", "generic")  # OpenBLAS cores without AVX


@functools.lru_cache(maxsize=1)
def faiss_blas_is_tuned() -> bool:
    """False where faiss' OpenBLAS runs a generic kernel (a CPU model it does not know, as on
    some VMs: its GEMM then runs 2-4x below torch's); True when unknown (no threadpoolctl)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return True
    return not any(lib.get("internal_api") == "openblas" and "faiss" in lib.get("filepath", "")
                   and str(lib.get("architecture", "")).lower() in _GENERIC_BLAS
                   for lib in threadpool_info())


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
    """A ``faiss.<kind>`` search-parameters object with ``fields`` set (cached: never modify)."""
    out = getattr(import_faiss(), kind)()
    for name, value in fields.items():
        setattr(out, name, value)
    return out


def host_float32(x: Any, name: str, dim: int | None = None,
                 check_finite: bool = True) -> np.ndarray:
    """(rows, d) C-contiguous float32 numpy array; checks rank, dim and finiteness."""
    a = to_numpy(x if isinstance(x, (np.ndarray, torch.Tensor)) else as_tensor(x, name=name))
    if a.dtype.kind not in "iuf" and not is_bfloat16(a.dtype):  # as as_tensor refuses them
        raise InputError(f"{name} has dtype {a.dtype}; a real-valued array is needed")
    a = np.ascontiguousarray(a, dtype=np.float32)
    if a.ndim != 2 or (dim is not None and a.shape[1] != dim):
        raise InputError(f"{name} must have shape (rows, {dim or 'dim'}), got {a.shape}")
    if check_finite and a.size and not np.isfinite(a).all():
        raise InputError(f"{name} contains NaN or inf")
    return a


def device_float32(x: Any, name: str, device: torch.device, dim: int | None = None) -> torch.Tensor:
    """:func:`host_float32` as a contiguous float32 tensor on ``device`` (for GPU indices)."""
    t = as_tensor(x, device=device, dtype=torch.float32, name=name).detach()
    if t.ndim != 2 or (dim is not None and t.shape[1] != dim):
        raise InputError(f"{name} must have shape (rows, {dim if dim is not None else 'd'}), "
                         f"got {tuple(t.shape)}")
    require_finite(t, name)
    return t.contiguous()


def normalise_results(scores: torch.Tensor, ids: torch.Tensor, k: int = 0
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """A library's (B, w) similarities sorted descending and ids (-1: none found) -> (B,
    max(w, k)) float32 / int64, padded with (-inf, -1), equal scores listed by id."""
    ids = ids.long()
    return pad_topk(*order_ties(scores.float().masked_fill(ids < 0, PAD_SCORE), ids), k)


def faiss_pointer(faiss: Any, t: torch.Tensor) -> Any:
    """A faiss SWIG pointer to the contiguous float32 or int64 tensor ``t`` (CPU or CUDA)."""
    if not t.is_contiguous():
        raise InputError("faiss_pointer needs a contiguous tensor")
    cast = {torch.float32: "float", torch.int64: "idx_t"}.get(t.dtype)
    if cast is None:
        raise TypeError(f"faiss_pointer takes float32 or int64 tensors, got {t.dtype}")
    return getattr(faiss, f"cast_integer_to_{cast}_ptr")(t.data_ptr())


@contextlib.contextmanager
def faiss_stream(faiss: Any, res: Any, device: int, stream: int) -> Iterator[None]:
    """faiss GPU work through ``res`` on GPU ``device`` runs on ``stream`` (a ``cudaStream_t``
    as an int) inside the block."""
    before = res.getDefaultStream(device)
    res.setDefaultStream(device, faiss.cast_integer_to_cudastream_t(stream))
    try:
        yield
    finally:
        res.setDefaultStream(device, before)


def on_current_stream(faiss: Any, res: Any, device: torch.device
                      ) -> contextlib.AbstractContextManager:
    """:func:`faiss_stream` with torch's current stream on the CUDA ``device`` (CPU: no-op)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    dev = cuda_index(device)
    return faiss_stream(faiss, res, dev, torch.cuda.current_stream(dev).cuda_stream)


def search_tensors(faiss: Any, index: Any, q: torch.Tensor, k: int, params: Any = None,
                   res: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One faiss search: ``q`` (B, d) float32 on the index's device (``res``: its resources on
    CUDA) -> faiss' (D (B, k) float32, I (B, k) int64) there."""
    q = q.contiguous()
    scores = torch.empty((q.shape[0], k), dtype=torch.float32, device=q.device)
    ids = torch.empty((q.shape[0], k), dtype=torch.int64, device=q.device)
    with on_current_stream(faiss, res, q.device):
        index.search_c(q.shape[0], faiss_pointer(faiss, q), k, faiss_pointer(faiss, scores),
                       faiss_pointer(faiss, ids), params)
    return scores, ids

