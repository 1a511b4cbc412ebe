"""The methods by name ('erm', 'xs', 'xl', 'nudge-m', 'nudge-n', 'adapter', 'prf',
'adapter+xs'): the model each fits, the settings it takes, how a grid spans it. The CLI, sweep,
tune and the pipeline read this table instead of naming methods one by one; the CLI's model
options are the settings whose params fields carry a "help" metadata string (:func:`settings`).

Importing this module imports no torch (the CLI checks its options with it); :func:`fit_config`
does.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Iterable

from . import params as p
from .errors import InputError

if TYPE_CHECKING:
    from .arrays import ArrayLike, DeviceLike
    from .protocol import Model
    from .query import QueryModel
    from .relevance import RelevanceLike


AXES = ("lam", "k")  # the settings a grid spans


@dataclasses.dataclass(frozen=True)
class Method:
    """model: the class in :mod:`pefa_gpu.models` it fits, with the ``fixed`` params;
    takes: the fields of that class's Params / SearchParams a caller may set (lam, k,
    candidates, ...; a test holds them to the classes); query: the query-side part
    (:mod:`pefa_gpu.query`: 'adapter' and / or 'prf') searched over that model; pipeline:
    :mod:`pefa_gpu.pipeline`'s stages can run it (the others run in one process)."""

    name: str
    model: str
    takes: tuple[str, ...] = ()
    fixed: tuple[tuple[str, Any], ...] = ()
    query: tuple[str, ...] = ()
    pipeline: bool = False

    @property
    def axes(self) -> tuple[str, ...]:
        """The grid axes of a sweep: () one point, ('lam',) one per λ, ('lam', 'k') per pair."""
        return tuple(a for a in AXES if a in self.takes)


_XS = ("lam", "augment_docs")
REGISTRY: dict[str, Method] = {m.name: m for m in (
    Method("erm", "ERM", pipeline=True),
    Method("xs", "PEFAXS", _XS, pipeline=True),
    Method("xl", "PEFAXL", ("lam", "k", "knn_norm", "rescore", "augment_docs", "candidates"),
           pipeline=True),
    Method("nudge-m", "NUDGE", fixed=(("variant", "M"),)),
    Method("nudge-n", "NUDGE", fixed=(("variant", "N"),)),
    Method("adapter", "ERM", query=("adapter",)),
    Method("prf", "ERM", query=("prf",)),
    Method("adapter+xs", "PEFAXS", _XS, query=("adapter",)),
)}


def method(name: str) -> Method:
    """The registry entry of ``name``; InputError naming the known ones."""
    if name not in REGISTRY:
        raise InputError(f"unknown method {name!r}; choose one of {list(REGISTRY)}")
    return REGISTRY[name]


def takes(methods: Iterable[str], setting: str) -> bool:
    """Whether any of ``methods`` (names) takes ``setting``."""
    return any(setting in REGISTRY[m].takes for m in methods)


def model_class(name: str) -> type:
    """The :mod:`pefa_gpu.models` class method ``name`` fits."""
    from . import models

    return getattr(models, method(name).model)


# model class name -> its (Params, SearchParams), read without importing the models (torch)
PARAMS: dict[str, tuple[type[p.Params], type[p.Params]]] = {
    "ERM": (p.ERMParams, p.ERMSearchParams), "PEFAXS": (p.XSParams, p.XSSearchParams),
    "PEFAXL": (p.XLParams, p.XLSearchParams), "NUDGE": (p.NUDGEParams, p.NUDGESearchParams)}


def defaults(name: str) -> dict[str, Any]:
    """The defaults of the settings method ``name`` takes, from its params classes."""
    build, search = PARAMS[method(name).model]
    both = {**build().to_dict(), **search().to_dict()}
    return {key: both[key] for key in REGISTRY[name].takes}


def settings(search: bool = False) -> dict[str, dataclasses.Field]:
    """The settings offered as command-line options, by name: the fields of the models'
    SearchParams and Params (with ``search``: SearchParams only) whose metadata has a "help"
    string."""
    pairs = PARAMS.values()
    classes = [sp for _, sp in pairs] + ([] if search else [bp for bp, _ in pairs])
    return {f.name: f for c in classes for f in dataclasses.fields(c) if "help" in f.metadata}


def setting_defaults(name: str) -> dict[Any, str]:
    """The defaults of setting ``name`` among the methods that take it: value -> the first
    method with that default."""
    out: dict[Any, str] = {}
    for m in REGISTRY:
        if name in REGISTRY[m].takes:
            out.setdefault(defaults(m)[name], m)
    return out


def fit_config(config: Any, P: ArrayLike, Q: ArrayLike | None = None,
               Y: RelevanceLike | None = None, device: DeviceLike = None, backend: str = "exact",
               candidates: int | None = None, **params: Any) -> Model | QueryModel:
    """A fitted model for ``config`` (a :class:`pefa_gpu.Config`: method, lam, k): an ERM /
    PEFAXS / PEFAXL / NUDGE, or a QueryModel over ERM / PEFAXS for the query side. ``params``
    (augment_docs, knn_norm, rescore, ...) and ``candidates`` go to the methods that take them;
    a setting left None takes the params class's default."""
    m = method(config.method)
    given = {"lam": config.lam, "k": config.k, "candidates": candidates, **params}
    kw = {key: v for key, v in given.items()  # a setting no method takes: the model refuses it
          if v is not None and (key in m.takes or not takes(REGISTRY, key))}
    search = PARAMS[m.model][1]
    own = {key: kw.pop(key) for key in list(kw) if key in search.__dataclass_fields__}
    model = model_class(m.name)(backend=backend, device=device, search_params=search(**own),
                                **dict(m.fixed), **kw)
    model = model.fit(P) if m.model == "ERM" else model.fit(P, Q, Y)
    if not m.query:
        return model
    from .query import QueryAdapter, QueryModel, VectorPRF

    adapter = QueryAdapter(device=model.device).fit(Q, Y, P) if "adapter" in m.query else None
    return QueryModel(model, adapter, VectorPRF() if "prf" in m.query else None)
