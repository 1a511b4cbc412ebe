"""``model.save(dir)`` and ``pefa_gpu.load(dir)``: a :func:`storage.writing_save` folder whose
manifest holds the class, params, backend and a ``state`` entry per name in the class's ``_saved``
(tensor .npy, Relevance / CSR .npz, index folder or JSON value). Classes load only when given to
:func:`register_model`; a changed storage of an attribute bumps ``storage.FORMAT_VERSION``.
"""

from __future__ import annotations

import datetime
import importlib
import inspect
import json
import logging
from pathlib import Path
from typing import Any

import scipy.sparse as sp
import torch

from . import storage
from ._version import __version__
from .arrays import DeviceLike, resolve_device
from .errors import FormatError, InputError, MissingDependencyError
from .index import ExactIndex, Index, backend_class, backend_names
from .protocol import Model
from .relevance import Relevance

log = logging.getLogger("pefa_gpu")

_MODELS: dict[str, type] = {}  # class name -> model class (see register_model)


def register_model(cls: type) -> None:
    """Make saves of class ``cls.__name__`` load as ``cls`` (the first class of a name stays)."""
    _MODELS.setdefault(cls.__name__, cls)


def save_model(model: Model, directory: str | Path) -> None:
    """Write a fitted model to ``directory`` atomically (:func:`storage.writing_save`)."""
    model.check_fitted()
    if missing := [name for name in type(model)._saved if not hasattr(model, name)]:
        raise InputError(f"{type(model).__name__} lists {missing} in _saved but has no such "
                         f"attribute")
    with storage.writing_save(directory) as w:
        values = {name: getattr(model, name) for name in type(model)._saved}
        state = {name: _save_value(w.data, name, value, values) for name, value in values.items()}
        w.commit({
            "library_version": __version__,
            "class": type(model).__name__,
            "params": model.params.to_dict(),
            "search_params": model.search_params.to_dict(),
            "backend": model.backend,
            "index_params": model.index.params.to_dict(),
            "index_search_params": model.index.search_params.to_dict(),
            "saved_on": str(model.device),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "state": state,
        })
    log.info("saved %s to %s", type(model).__name__, directory)


def load_model(directory: str | Path, device: DeviceLike = None, mmap: bool = False,
               verify: bool | None = None, expect: type | None = None) -> Any:
    """The model saved at ``directory`` on ``device`` (default: CUDA when available). mmap: map
    tensors copy-on-write; verify: check every sha256 (default: not with mmap; sizes, headers,
    shapes and the manifest checksum always); expect: a class the save must be (a subclass of).
    ``pefa_gpu.load`` is this function."""
    return storage.read_unchanged(directory, lambda: _load_model(directory, device, mmap,
                                                                 verify, expect))


def _load_model(directory: str | Path, device: DeviceLike, mmap: bool, verify: bool | None,
                expect: type | None) -> Any:
    save = storage.open_save(directory, checksums=not mmap if verify is None else verify)
    manifest, where = save.manifest, save.where
    for module in ("models", "query"):  # the classes register as these modules define them;
        importlib.import_module(f"{__package__}.{module}")  # both import this one: not at the top
    if not isinstance(name := manifest.get("class"), str) or name not in _MODELS:
        raise FormatError(f"{where} holds class {name!r}, which is not a pefa_gpu model "
                          f"(known: {sorted(_MODELS)})")
    cls = _MODELS[name]
    if expect is not None and not issubclass(cls, expect):
        raise FormatError(f"{where}: the save holds a {cls.__name__}, not a {expect.__name__}")
    device = resolve_device(device)  # a bad device is the caller's error, not the save's
    try:  # params that are not a table: "argument after ** must be a mapping"
        if hasattr(cls, "_from_save"):  # a query-side part (pefa_gpu.query): its own layout
            return cls._from_save(save, device=device, mmap=mmap)
        state = manifest.get("state")
        if not isinstance(state, dict):
            raise FormatError(f"{where} has no 'state' table")
        if missing := [name for name in cls._saved if name not in state]:
            raise FormatError(f"{where} lacks saved attributes {missing} that {cls.__name__} "
                              f"needs")
        if extra := sorted(set(state) - set(cls._saved)):
            raise FormatError(f"{where} holds attributes {extra} that a {cls.__name__} does "
                              f"not save (a save of another class?)")
        backend = manifest.get("backend")
        _backend(backend, where)
        model = cls(backend=backend, device=device, index_params=manifest.get("index_params"),
                    search_params=cls.SearchParams.coerce(manifest.get("search_params")),
                    **manifest.get("params"))
        model.index_search_params = model.index_search_params.coerce(
            manifest.get("index_search_params"))
    except (InputError, TypeError) as exc:  # the one place for it, pefa_gpu.query's parts too
        raise FormatError(f"{where}: the saved params do not fit {cls.__name__}: {exc}") from exc
    loaded: dict[str, Any] = {}
    indices_last = sorted(cls._saved, key=lambda k: isinstance(state[k], dict) and
                          state[k].get("kind") == "index")  # one may be over a loaded tensor
    for name in indices_last:
        loaded[name] = _load_value(save, name, state[name], model.device, mmap, loaded)
        setattr(model, name, loaded[name])
    _check_shapes(model, where)
    model._restore()
    return model


def _check_shapes(model: Model, where: Path) -> None:
    """n_docs and dim agree with every loaded array and index (else FormatError)."""
    n, d = model.n_docs, model.dim
    if not all(type(v) is int and v > 0 for v in (n, d)):  # JSON values: not bool
        raise FormatError(f"{where}: n_docs and dim must be positive integers, got {n!r}, {d!r}")
    for name, (rows, cols) in model._saved_shapes().items():  # each a name in _saved
        value = getattr(model, name)
        kind = Index if name.endswith("index") else Relevance if name == "relevance" else \
            torch.Tensor  # what the models save under each name
        if not isinstance(value, kind):
            raise FormatError(f"{where}: {name} is a {type(value).__name__}, not a "
                              f"{kind.__name__}")
        shape = (value.ntotal, value.dim) if isinstance(value, Index) else tuple(value.shape)
        if len(shape) != 2 or (rows is not None and shape[0] != rows) or shape[1] != cols:
            want = ("?" if rows is None else rows, cols)
            raise FormatError(f"{where}: {name} has shape {shape}, but n_docs = {n} and dim = "
                              f"{d} make it {want}")


# ---------------------------------------------------------------------------- one attribute

def _save_value(folder: Path, name: str, value: Any, values: dict[str, Any]) -> dict[str, Any]:
    """Store one attribute under ``folder``; returns its manifest entry (an index over another
    of the saved ``values`` names it instead of writing it again)."""
    if isinstance(value, torch.Tensor):
        return {"kind": "tensor", **storage.save_tensor(folder / name, value)}
    if isinstance(value, Relevance):
        return {"kind": "relevance", **storage.save_csr(folder / name, value.csr)}
    if sp.issparse(value):
        return {"kind": "csr", **storage.save_csr(folder / name, value)}
    if isinstance(value, Index):
        backend = getattr(value, "name", None)  # registered as this very class
        if backend not in backend_names() or backend_class(backend) is not type(value):
            raise InputError(f"{type(value).__name__} is not registered as backend {backend!r}; "
                             f"register_backend() it before saving")
        entry = {"kind": "index", "backend": backend, "params":
                 value.params.to_dict(), "search_params": value.search_params.to_dict(),
                 "ntotal": value.ntotal, "dim": value.dim}
        if shared := [k for k, t in values.items() if _vectors_of(value, t)]:
            return {**entry, "vectors": shared[0]}
        (folder / name).mkdir()
        value.save(folder / name)
        return {**entry, "dir": name}
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # numpy / torch scalars
        value = value.item()
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        raise InputError(f"attribute {name!r} ({type(value).__name__}) cannot be saved: not a "
                         f"tensor, Relevance, sparse matrix, Index or JSON value") from None
    return {"kind": "json", "value": value}


def _vectors_of(index: Index, t: Any) -> bool:
    """``t`` is the float32 exact ``index``'s matrix itself (the same memory)."""
    v = index.vectors if type(index) is ExactIndex else None
    return isinstance(t, torch.Tensor) and v is not None and v.dtype == torch.float32 and (
        t.dtype, t.device, t.shape, t.stride(), t.data_ptr()) == (
        v.dtype, v.device, v.shape, v.stride(), v.data_ptr())


def _load_value(save: storage.SaveDir, name: str, entry: Any, device: torch.device,
                mmap: bool, loaded: dict[str, Any]) -> Any:
    kind = entry.get("kind") if isinstance(entry, dict) else None
    if kind == "json":
        return entry.get("value")
    if kind in ("tensor", "relevance", "csr"):
        path = save.file(entry.get("file"))  # listed, inside the save, no link followed
        if kind == "tensor":
            return storage.load_tensor(path, device, mmap=mmap, meta=entry)
        csr = storage.load_csr(path, meta=entry)
        return Relevance(csr) if kind == "relevance" else csr
    if kind == "index":
        return _load_index(save, name, entry, device, mmap, loaded)
    raise FormatError(f"{save.where}: attribute {name!r} has unknown kind {kind!r}")


def _load_index(save: storage.SaveDir, name: str, entry: dict, device: torch.device,
                mmap: bool, loaded: dict[str, Any]) -> Index:
    """An index from its folder, or a float32 exact index over the loaded tensor its entry's
    ``vectors`` names (no copy)."""
    where, shared = save.where, entry.get("vectors")
    cls = _backend(entry.get("backend"), where)
    try:
        params = cls.Params.from_dict(entry.get("params") or {})
        search = cls.SearchParams.coerce(entry.get("search_params"))
    except (InputError, TypeError) as exc:
        raise FormatError(f"{where}: params or search params of index {name!r} do not fit "
                          f"backend {cls.name!r}: {exc}") from exc
    options = {"mmap": mmap} if mmap and "mmap" in inspect.signature(cls.load).parameters \
        else {}
    if shared is None:  # its folder: inside the save, every file in it listed
        index = cls.load(save.folder(entry.get("dir")), params, device, **options)
    else:
        t = loaded.get(shared) if isinstance(shared, str) else None
        if cls is not ExactIndex or params.dtype != "float32" or not isinstance(
                t, torch.Tensor) or t.dtype != torch.float32 or t.ndim != 2:
            raise FormatError(f"{where}: index {name!r} over attribute {shared!r} needs a float32 "
                              f"exact index and a loaded float32 matrix")
        try:
            index = cls(params, device).build(t)
        except InputError as exc:  # rows not finite
            raise FormatError(f"{where}: index {name!r} over attribute {shared!r}: {exc}") from exc
    index.search_params = search
    if (index.ntotal, index.dim) != (entry.get("ntotal"), entry.get("dim")):
        raise FormatError(f"{where}: index {name!r} holds {index.ntotal} vectors of dimension "
                          f"{index.dim}; the manifest says {entry.get('ntotal')!r} of dimension "
                          f"{entry.get('dim')!r}")  # "20": not 20
    return index


# ---------------------------------------------------------------------------- names -> classes

def _backend(name: object, where: Path) -> type[Index]:
    if not isinstance(name, str) or name not in backend_names():
        raise FormatError(f"{where} was saved with backend {name!r}, which is not registered "
                          f"here (known: {backend_names()})")
    try:
        return backend_class(name)
    except ImportError as exc:
        raise MissingDependencyError(f"{where} needs backend {name!r}, which cannot be "
                                     f"imported: {exc}") from exc


load = load_model
