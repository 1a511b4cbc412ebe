"""The index protocol every backend follows.

An index holds row vectors and answers maximum-inner-product queries::

    index = make_index("exact", device="cpu").build(X)      # X: (n, d)
    scores, ids = index.search(queries, k)                   # (B, k) float32, (B, k) int64

Scores are similarities (larger is better, never ``1 - ip`` distances), ids are row numbers in
insertion order, and missing results are padded with id -1 and score -inf. Results live on the
index's device. ``add`` appends rows; ``save`` / ``load`` persist the index in a directory;
``update`` overwrites rows and ``reconstruct`` reads them back (optional: the default raises
NotImplementedError).
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..arrays import resolve_device
from ..params import Params


class Index(abc.ABC):
    """Base class of all backends. Subclasses set ``name`` and ``Params``."""

    name: ClassVar[str]
    Params: ClassVar[type[Params]]

    def __init__(self, params: Params | dict | None = None, device: Any = None):
        if params is None:
            params = self.Params()
        elif isinstance(params, dict):
            params = self.Params.from_dict(params)
        elif not isinstance(params, self.Params):
            raise TypeError(f"{type(self).__name__} takes {self.Params.__name__} or a dict, "
                            f"got {type(params).__name__}")
        self.params = params
        self.device = resolve_device(device)

    @abc.abstractmethod
    def build(self, vectors: torch.Tensor) -> "Index":
        """Replace the contents with ``vectors`` (n, d) float; returns self."""

    @abc.abstractmethod
    def add(self, vectors: torch.Tensor) -> None:
        """Append rows; their ids continue after the existing ones."""

    @abc.abstractmethod
    def search(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, d) queries -> (B, k) float32 scores, (B, k) int64 ids, on ``self.device``."""

    def update(self, ids: torch.Tensor, vectors: torch.Tensor) -> None:
        """Overwrite the rows ``ids`` (r,) int64 with ``vectors`` (r, d); other rows and all ids
        stay as they are. Backends that cannot change rows in place raise NotImplementedError
        (callers then rebuild; see pefa_gpu.updates)."""
        raise NotImplementedError(f"backend {self.name!r} cannot overwrite rows in place")

    def reconstruct(self, ids: torch.Tensor) -> torch.Tensor:
        """The stored rows ``ids`` (any shape, int64, valid ids) -> (*ids.shape, d) float32, on
        ``self.device``, as the index scores them. Raises NotImplementedError where a backend
        does not keep its vectors."""
        raise NotImplementedError(f"backend {self.name!r} cannot return its stored vectors")

    @property
    @abc.abstractmethod
    def ntotal(self) -> int:
        """Number of indexed rows."""

    @property
    @abc.abstractmethod
    def dim(self) -> int:
        """Vector dimension (0 before build)."""

    def save(self, directory: str | Path) -> None:
        """Write the index into an existing, empty directory (called by the model's save)."""
        raise NotImplementedError(f"backend {self.name!r} cannot be saved yet")

    @classmethod
    def load(cls, directory: str | Path, params: Params, device: Any = None) -> "Index":
        """Read an index written by :meth:`save`."""
        raise NotImplementedError(f"backend {cls.name!r} cannot be loaded yet")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(ntotal={self.ntotal}, dim={self.dim}, "
                f"device={self.device}, params={self.params})")
