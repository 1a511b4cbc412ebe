"""The ``Model`` protocol: what training, persist, builds and query read of a model
(ERM, PEFAXS, PEFAXL and NUDGE in pefa_gpu.models satisfy it)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import torch

    from .arrays import ArrayLike
    from .index import Index
    from .params import Params
    from .relevance import RelevanceLike


class Model(Protocol):
    """A fitted retrieval model: settings, an index over n_docs documents of dimension dim,
    search, score, updates, export and save."""

    _saved: ClassVar[tuple[str, ...]]  # attributes save() writes and load() restores
    params: Params
    backend: str
    device: torch.device
    dim: int
    n_docs: int
    index: Index
    search_params: Params  # the model's SearchParams defaults
    index_search_params: Params  # the backend's SearchParams defaults

    def check_fitted(self) -> None: ...

    def as_queries(self, queries: ArrayLike, check: bool | None = None) -> torch.Tensor: ...

    def search(self, queries: ArrayLike, topk: int = 100, check: bool | None = None, *,
               params: Params | None = None, index_params: Params | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def score(self, queries: ArrayLike, ids: ArrayLike, check: bool | None = None
              ) -> torch.Tensor: ...

    def add_documents(self, P_new: ArrayLike) -> Model: ...

    def add_pairs(self, Q_new: ArrayLike, Y_new: RelevanceLike) -> Model: ...

    def export_hnsw(self, path: str | Path, **kwargs: Any) -> Path: ...

    def save(self, directory: str | Path) -> None: ...

    def _saved_shapes(self) -> dict[str, tuple[int | None, int]]: ...

    def _restore(self) -> None: ...


def check_model(model: Any, who: str, reads: tuple[str, ...]) -> None:
    """TypeError naming ``who`` unless ``model`` has the attributes ``reads`` that it reads."""
    if not all(hasattr(model, a) for a in reads):
        raise TypeError(f"{who}: model must be a pefa_gpu model (ERM, PEFAXS, ...), got "
                        f"{type(model).__name__}")
