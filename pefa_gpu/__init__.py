"""pefa_gpu: PEFA, parameter-free adapters for embedding-based retrieval, on GPU and CPU.

    import pefa_gpu as pg
    xs = pg.PEFAXS(lam=0.5).fit(P, Q, Y)
    scores, ids = xs.search(queries, topk=100)
    pg.recall_at_k(ids, Y_test, ks=(10, 100))
"""

from __future__ import annotations

import sys
import types
from importlib import import_module
from typing import Any

from ._version import __version__
from .errors import FormatError, InputError, MissingDependencyError, PefaError

# name -> the module that defines it; imported on first use, so that `import pefa_gpu` (and
# the `pefa-gpu` command before it has parsed its arguments) does not import torch
_LAZY = {
    **dict.fromkeys(("normalize_rows", "pifa"), "aggregate"),
    **dict.fromkeys(("BeirDataset", "Pairs", "load_beir", "load_pairs"), "datasets"),
    "encode": "encode", "load": "persist",
    **dict.fromkeys(("Index", "make_index"), "index"),
    **dict.fromkeys(("evaluate", "mrr_at_k", "ndcg_at_k", "recall_at_k"), "metrics"),
    **dict.fromkeys(("ERM", "NUDGE", "PEFAXL", "PEFAXS"), "models"),
    **dict.fromkeys(("ERMParams", "ERMSearchParams", "NUDGEParams", "NUDGESearchParams",
                     "XLParams", "XLSearchParams", "XSParams", "XSSearchParams"), "params"),
    **dict.fromkeys(("QueryAdapter", "QueryModel", "VectorPRF"), "query"),
    **dict.fromkeys(("Relevance", "as_relevance"), "relevance"),
    **dict.fromkeys(("Config", "SweepResult", "sweep"), "sweep"),
    **dict.fromkeys(("SyntheticData", "make_synthetic"), "synthetic"),
    "mine_negatives": "training",
    **dict.fromkeys(("TuneResult", "fit_config", "tune"), "tune"),
    **dict.fromkeys(("XMCData", "load_xmc"), "xmc"),
}


def __getattr__(name: str) -> Any:
    """A public name on first use; else a submodule (``pefa_gpu.arrays``), as when every
    submodule was imported with the package."""
    if name in _LAZY:
        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    try:
        return import_module(f".{name}", __name__)
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module 'pefa_gpu' has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        """Importing the submodules encode, sweep, tune sets them as attributes of the package;
        the functions of those names stay what ``pefa_gpu.encode`` & co. are."""
        if not (isinstance(value, types.ModuleType) and _LAZY.get(name) == name):
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = [*_LAZY, "PefaError", "InputError", "MissingDependencyError", "FormatError",
           "__version__"]
