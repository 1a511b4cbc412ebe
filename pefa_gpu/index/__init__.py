"""Nearest-neighbour backends behind one protocol (:mod:`pefa_gpu.index.base`), registered by
name; optional ones are imported only when asked for."""

from __future__ import annotations

import importlib

from ..arrays import DeviceLike
from ..errors import InputError
from ..params import Params
from .base import Index
from .exact import ExactIndex, ExactParams, ExactSearchParams

# name -> "module:Class"; modules are imported lazily so faiss is needed only when used
_BACKENDS: dict[str, str] = {
    "exact": "pefa_gpu.index.exact:ExactIndex",
    "hnsw": "pefa_gpu.index.hnsw:HNSWIndex",      # faiss, CPU
    "ivf": "pefa_gpu.index.ivf:IVFIndex",         # faiss, GPU when available
    "cagra": "pefa_gpu.index.cagra:CagraIndex",   # faiss-gpu CAGRA or cuVS, CUDA only
    "sharded": "pefa_gpu.index.sharded:ShardedIndex",  # any backend over several devices
    "hnswlib": "pefa_gpu.index.hnswlib_backend:HnswlibIndex",  # hnswlib, CPU
    "scann": "pefa_gpu.index.scann_backend:ScannIndex",        # ScaNN, CPU
}


def register_backend(name: str, target: str | type[Index]) -> None:
    """Make ``backend=name`` resolve to an Index subclass (or a lazy "module:Class" path)."""
    if not isinstance(target, str):
        target = f"{target.__module__}:{target.__qualname__}"
    _BACKENDS[name] = target


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def backend_class(name: str) -> type[Index]:
    """The Index subclass registered as ``name``."""
    if not isinstance(name, str) or name not in _BACKENDS:
        raise InputError(f"backend={name!r} is unknown; choose one of {backend_names()}")
    module, _, cls = _BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def make_index(backend: str, device: DeviceLike = None, params: Params | dict | None = None,
               search_params: Params | dict | None = None) -> Index:
    """A new, empty index: ``params`` its build settings, ``search_params`` its search
    defaults (the backend's Params / SearchParams, or dicts)."""
    index = backend_class(backend)(params, device)
    index.search_params = search_params  # None: the defaults
    return index


__all__ = ["Index", "ExactIndex", "ExactParams", "ExactSearchParams", "make_index",
           "register_backend", "backend_names", "backend_class"]
