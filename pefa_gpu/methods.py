"""The methods by name ('erm', 'xs', 'xl', ...): the model each fits, the settings it takes, how a
grid spans it; read by the CLI, sweep, tune and the pipeline. Imports no torch (fit_config does).
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
    """model: the :mod:`pefa_gpu.models` class it fits with the ``fixed`` params; takes: the
    params fields a caller may set; query: the :mod:`pefa_gpu.query` parts ('adapter', 'prf')
    over that model; pipeline: :mod:`pefa_gpu.pipeline`'s stages can run it."""

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
    if not isinstance(name, str) or name not in REGISTRY:  # a list: 'unhashable type'
        raise InputError(f"unknown method {name!r}; choose one of {list(REGISTRY)}")
    return REGISTRY[name]


def takes(methods: Iterable[str], setting: str) -> bool:
    """Whether any of ``methods`` (names) takes ``setting``."""
    if isinstance(methods, str):  # its letters were taken as names: KeyError 'x'
        raise TypeError(f"takes: methods must be a list of names, got the str {methods!r}")
    return any(setting in method(m).takes for m in methods)


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
    """The command-line settings by name: the models' SearchParams (and, unless ``search``,
    Params) fields whose metadata has a "help" string."""
    pairs = PARAMS.values()
    classes = [sp for _, sp in pairs] + ([] if search else [bp for bp, _ in pairs])
    return {f.name: f for c in classes for f in dataclasses.fields(c) if "help" in f.metadata}


def fit_config(config: Any, P: ArrayLike, Q: ArrayLike | None = None,
               Y: RelevanceLike | None = None, device: DeviceLike = None, backend: str = "exact",
               **params: Any) -> Model | QueryModel:
    """The model ``config`` (a :class:`pefa_gpu.Config`) names, fitted (a QueryModel for the
    query side); settings go to the methods that take them, None takes the params default."""
    if not all(hasattr(config, a) for a in ("method", "lam", "k")):
        raise TypeError(f"fit_config: config must be a pefa_gpu.Config (method, lam, k), got "
                        f"{type(config).__name__}")
    m = method(config.method)
    given = {"lam": config.lam, "k": config.k, **params}
    kw = {key: v for key, v in given.items()  # a setting no method takes: the model refuses it
          if v is not None and (key in m.takes or not takes(REGISTRY, key))}
    _check_given(m, config, params, kw)
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


def _check_given(m: Method, config: Any, params: dict[str, Any], kw: dict[str, Any]) -> None:
    """InputError for a setting of :func:`fit_config` given twice: in ``config`` and ``params``
    (the keyword won silently over config.lam), where method ``m`` fixes it, or search_params
    (the last two were the model's TypeError 'got multiple values for keyword argument')."""
    for a in AXES:
        if getattr(config, a) is not None and params.get(a) is not None:
            raise InputError(f"fit_config: {a} is given twice, config.{a}={getattr(config, a)!r}"
                             f" and {a}={params[a]!r}; give it once")
    if clash := sorted(set(kw) & dict(m.fixed).keys()):
        raise InputError(f"method {m.name!r} fixes {clash[0]}={dict(m.fixed)[clash[0]]!r}; drop "
                         f"{clash[0]} (or choose the method that sets it)")
    if kw.get("search_params") is not None:
        raise InputError("fit_config: give the search settings as keywords (candidates=...), "
                         "not search_params")
