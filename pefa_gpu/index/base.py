"""The index protocol every backend follows: build settings ``Params`` apart from search
settings ``SearchParams``; scores are similarities, ids row numbers in insertion order."""

from __future__ import annotations

import abc
import dataclasses
import importlib
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..arrays import DeviceLike, as_tensor, resolve_device
from ..errors import FormatError, InputError, MissingDependencyError
from ..params import Params
from ..storage import as_path, save_tensor
from ..topk import PAD_ID, PAD_SCORE


@dataclasses.dataclass(frozen=True, kw_only=True)
class IndexParams(Params):
    """A backend's build or search settings (``params.checked`` fields checked)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoSearchParams(IndexParams):
    """The search settings of a backend that has none to tune."""


class Index(abc.ABC):
    """Base class of all backends: subclasses set ``name``, ``Params`` and ``SearchParams``."""

    name: ClassVar[str]
    Params: ClassVar[type[Params]]
    SearchParams: ClassVar[type[Params]] = NoSearchParams
    copies_rows: bool = False  # True: build / add keep no reference to their rows

    def __init__(self, params: Params | dict | None = None, device: DeviceLike = None):
        if isinstance(params, dict):
            fields = [{f.name for f in dataclasses.fields(c)} for c in (self.SearchParams,
                                                                         self.Params)]
            search_keys = sorted(set(params) & fields[0] - fields[1])
            if search_keys:
                raise InputError(f"{search_keys} are search settings of backend {self.name!r}, "
                                 f"not build settings: give them as search_params (the "
                                 f"defaults) or per call, search(queries, k, params=...)")
        self.params = self.Params.coerce(params, f"{type(self).__name__} params")
        self.search_params = None
        self.device = resolve_device(device)

    @property
    def search_params(self) -> Params:
        """The defaults of :meth:`search`: a ``SearchParams``, a dict or None may be assigned."""
        return self._search_params

    @search_params.setter
    def search_params(self, value: Params | dict | None) -> None:
        self._search_params = self.SearchParams.coerce(
            value, f"{type(self).__name__} search_params")

    def resolve_search_params(self, params: Params | dict | None) -> Params:
        """One search's settings: a dict completes :attr:`search_params`, None is it."""
        if params is None or params is self._search_params:
            return self._search_params
        if isinstance(params, dict):
            return self._search_params.replace(**params) if params else self._search_params
        return self.SearchParams.coerce(params, f"{type(self).__name__}.search params")

    @abc.abstractmethod
    def build(self, vectors: torch.Tensor) -> "Index":
        """Replace the contents with ``vectors`` (n, d) float; returns self."""

    @abc.abstractmethod
    def add(self, vectors: torch.Tensor) -> None:
        """Append rows; their ids continue after the existing ones."""

    @abc.abstractmethod
    def search(self, queries: torch.Tensor, k: int, params: Params | dict | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, d) queries -> (B, k) float32 scores, (B, k) int64 ids on ``self.device``, -1 /
        -inf padded (``arrays.check_topk`` bounds k); ``params``: this call's settings."""

    def update(self, ids: torch.Tensor, vectors: torch.Tensor) -> None:
        """Overwrite the rows ``ids`` (r,) int64 with ``vectors`` (r, d) (callers rebuild where a
        backend cannot)."""
        raise NotImplementedError(f"backend {self.name!r} cannot overwrite rows in place")

    def reconstruct(self, ids: torch.Tensor) -> torch.Tensor:
        """Stored rows ``ids`` (any shape, int64) -> (*ids.shape, d) float32 on the device."""
        raise NotImplementedError(f"backend {self.name!r} cannot return its stored vectors")

    def rows_unchecked(self, ids: torch.Tensor) -> torch.Tensor:
        """:meth:`reconstruct` of int64 ids on the device known to be valid (a backend that
        can skip its id check says so by overriding this)."""
        return self.reconstruct(ids)

    @property
    @abc.abstractmethod
    def ntotal(self) -> int:
        """Number of indexed rows."""

    @property
    @abc.abstractmethod
    def dim(self) -> int:
        """Vector dimension (0 before build)."""

    def save(self, directory: str | Path) -> None:
        """Write the index into an existing, empty directory."""
        raise NotImplementedError(f"backend {self.name!r} cannot be saved yet")

    @classmethod
    def load(cls, directory: str | Path, params: Params, device: DeviceLike = None) -> "Index":
        """Read an index written by :meth:`save` (search settings are not part of it)."""
        raise NotImplementedError(f"backend {cls.name!r} cannot be loaded yet")

    def check_queries(self, q: Any) -> None:
        """InputError unless ``q`` is (B, dim) (any width while the index is empty)."""
        if q.ndim != 2 or (self.ntotal and q.shape[1] != self.dim):
            raise InputError(f"queries must have shape (B, {self.dim}), got {tuple(q.shape)}")

    def check_rows(self, v: Any) -> None:
        """InputError unless ``v`` is (rows, dim)."""
        if v.ndim != 2 or v.shape[1] != self.dim:
            raise InputError(f"vectors must have shape (rows, {self.dim}), got {tuple(v.shape)}")

    def _save_dir(self, directory: str | Path, empty_ok: bool = False) -> Path:
        """``directory``; InputError unless it exists, empty, and (or ``empty_ok``) the index is
        built."""
        if directory == "":  # Path(''): the current folder
            raise InputError("save directory is '': give the folder to save into")
        directory = as_path(directory, "directory")
        if not directory.is_dir():
            raise InputError(f"save directory {directory} does not exist")
        if any(directory.iterdir()):  # its files were replaced, a link's target written
            raise InputError(f"save directory {directory} is not empty: an index is saved into "
                             f"an empty folder")
        if not empty_ok and self.dim == 0:
            raise InputError(f"{type(self).__name__} is empty: build it before saving")
        return directory

    @classmethod
    def _saved_file(cls, directory: str | Path, name: str) -> Path:
        """``directory / name``; FormatError when it is not a file."""
        path = as_path(directory, "directory") / name
        if not path.is_file():
            raise FormatError(f"{path} is missing: not a saved {cls.name!r} index")
        return path

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(ntotal={self.ntotal}, dim={self.dim}, "
                f"device={self.device}, params={self.params}, "
                f"search_params={self.search_params})")


def import_optional(module: str, install: str) -> Any:
    """The optional library ``module``, or MissingDependencyError saying ``install``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(install) from exc


def check_budget(value: Any, name: str, none_ok: bool = False) -> None:
    """A memory budget: an int >= 64 KiB (or, if ``none_ok``, None)."""
    if none_ok and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 2**16:
        raise InputError(f"{name} must be {'None or ' * none_ok}an int >= 65536 bytes, got "
                         f"{value!r}")


def check_row_ids(ids: torch.Tensor, ntotal: int, distinct: bool = False) -> torch.Tensor:
    """Integer row ids (any shape) -> int64; InputError naming ids outside [0, ntotal) (and
    repeats if ``distinct``)."""
    if ids.is_floating_point():
        raise InputError(f"ids must be integers, got dtype {ids.dtype}")
    if ids.dtype == torch.uint64 and bool((ids.view(torch.int64) < 0).any()):  # .long() wraps
        raise InputError(f"ids hold values beyond int64 ({ids.dtype})")
    i = ids.long()
    if i.numel() and (int(i.min()) < 0 or int(i.max()) >= ntotal):
        bad = i[(i < 0) | (i >= ntotal)][:5].tolist()
        raise InputError(f"ids must lie in [0, {ntotal}); out of range: {bad}")
    if distinct and i.unique().numel() != i.numel():
        raise InputError("ids must not repeat")
    return i


def empty_results(b: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, k) results with nothing found: scores -inf, ids -1."""
    return (torch.full((b, k), PAD_SCORE, device=device),
            torch.full((b, k), PAD_ID, dtype=torch.long, device=device))


class VectorIndex(Index):
    """An index that keeps its rows as the tensor ``vectors`` (n, d)."""

    vectors: torch.Tensor

    def reconstruct(self, ids: Any) -> torch.Tensor:
        """Stored rows ``ids`` (any shape) -> (*ids.shape, d) float32 (ids checked: 2 syncs)."""
        i = check_row_ids(as_tensor(ids, device=self.device, name="ids"), self.ntotal)
        return self.rows_unchecked(i)

    def rows_unchecked(self, ids: torch.Tensor) -> torch.Tensor:
        return self.vectors[ids].float()  # no check

    @property
    def ntotal(self) -> int:
        return int(self.vectors.shape[0])

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[1])

    def save(self, directory: str | Path) -> None:
        """Write ``vectors.npy`` (ntotal, dim) in the storage dtype (a CAGRA graph is rebuilt
        on load)."""
        save_tensor(self._save_dir(directory, empty_ok=True) / "vectors", self.vectors)
