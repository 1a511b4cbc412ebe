"""Frozen, keyword-only parameter objects that round-trip through JSON and reject unknown keys."""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
import sys
from typing import Any, Callable, TypeVar

import numpy as np

from .errors import InputError

T = TypeVar("T", bound="Params")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Params:
    """Base of every params object (JSON round trip); subclasses check values in ``validate``."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # numpy scalars (np.int64(16), ...) -> int / float
            value = getattr(self, f.name)
            if isinstance(value, np.generic):
                object.__setattr__(self, f.name, value.item())
        self.validate()

    def validate(self) -> None:
        """Check each field made by :func:`checked` (InputError); subclasses add their own."""
        for f in dataclasses.fields(self):
            if "check" in f.metadata:
                check, *extra = f.metadata["check"]
                check(getattr(self, f.name), f.name, *extra)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        if not isinstance(data, dict):  # None: a bare 'NoneType' object is not iterable
            raise TypeError(f"{cls.__name__}.from_dict takes a dict, got {type(data).__name__}")
        cls._check_keys(data)
        return cls(**data)

    @classmethod
    def _check_keys(cls, data: dict[str, Any]) -> None:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known, key=repr)  # {1: .., 'x': ..}: '<' of int and str
        if unknown:
            raise InputError(f"{cls.__name__} got unknown keys {unknown}; known: {sorted(known)}")

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls: type[T], text: str) -> T:
        if not isinstance(text, (str, bytes, bytearray)):  # json's TypeError named no argument
            raise TypeError(f"{cls.__name__}.from_json takes a str, got {type(text).__name__}")
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError; '[' * 10**5: recursion
            raise InputError(f"{cls.__name__}.from_json: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise InputError(f"{cls.__name__}.from_json: expected a JSON object, got {text!r:.80}")
        return cls.from_dict(data)

    def replace(self: T, **changes: Any) -> T:
        """A copy with ``changes``, checked as on construction (unknown keys: InputError)."""
        self._check_keys(changes)
        return dataclasses.replace(self, **changes)

    @classmethod
    def coerce(cls: type[T], value: "Params | dict | None", what: str = "params") -> T:
        """``value`` (None: the defaults, a dict, a ``cls``) as a ``cls``; else a TypeError."""
        if value is None:
            return cls()
        if isinstance(value, dict):
            return cls.from_dict(value)
        if isinstance(value, cls):
            return value
        raise TypeError(f"{what} must be a {cls.__name__} or a dict, got {type(value).__name__}")


def checked(default: Any, check: Callable[..., None], *extra: Any, **metadata: Any) -> Any:
    """A field checked by ``check(value, name, *extra)``; ``metadata``: the CLI's help / flag."""
    return dataclasses.field(default=default, metadata={"check": (check, *extra), **metadata})


def is_number(value: Any) -> bool:
    """A finite Python or numpy int or float (not a bool) that a float holds (not 10**400)."""
    value = value.item() if isinstance(value, np.generic) else value
    return not isinstance(value, bool) and isinstance(value, (int, float)) and \
        -sys.float_info.max <= value <= sys.float_info.max


def check_unit_interval(value: Any, name: str) -> None:
    if not is_number(value) or not 0.0 <= value <= 1.0:
        raise InputError(f"{name} must be a number in [0, 1], got {value!r}")


def _check_int(value: Any, name: str, low: int, want: str, top: int | None = None) -> int:
    """``value`` (a Python or numpy int in [``low``, ``top``], not a bool) as a Python int, else
    InputError: "{name} must be {want}" below ``low``, "at most {top}" above ``top``."""
    if not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_)) \
            or value < low:
        raise InputError(f"{name} must be {want}, got {value!r}")
    if top is not None and int(value) > top:
        raise InputError(f"{name} must be at most {top}, got {int(value)!r}")
    return int(value)


def check_positive(value: Any, name: str) -> int:
    """``value`` (a Python or numpy int > 0) as a Python int, else InputError."""
    return _check_int(value, name, 1, "a positive integer")


def check_grid(lams: Any, ks: Any, empty_ok: tuple[bool, bool] = (False, False)
               ) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """lams (numbers in [0, 1]) and ks (positive ints) as tuples with each value once (a repeat
    fused its queries twice); an axis may be empty where ``empty_ok`` says so."""
    try:
        lams, ks = tuple(lams), tuple(ks)
    except TypeError:  # a lone number
        raise InputError(f"lams and ks must be sequences, got {lams!r} and {ks!r}") from None
    for axis, values, check, ok, want in (
            ("lam", lams, check_unit_interval, empty_ok[0], "one λ in [0, 1]"),
            ("k", ks, check_positive, empty_ok[1], "one k > 0")):
        if not values and not ok:
            raise InputError(f"{axis}s is empty: give at least {want}")
        for value in values:
            check(value, axis)
    # numpy scalars as Python numbers, as Params take them (np.float32(0.5) was refused); -0.0
    # as 0.0 (tables showed 'λ=-0')
    return tuple(dict.fromkeys(float(x) + 0.0 for x in lams)), tuple(dict.fromkeys(map(int, ks)))


# HNSW degree M (docs use 4 to 64) and beam widths ef (hundreds to thousands): far larger ones
# only allocate enormous buffers (or overflow C ints), so they are refused up front.
MAX_HNSW_M = 2048
MAX_HNSW_EF = 2**20
MAX_THREADS = 4096  # CPU threads of a backend: faiss, hnswlib and ScaNN take a C int


def check_at_most(value: Any, name: str, top: int) -> int:
    """``value`` (a Python or numpy int in [1, ``top``]) as a Python int, else InputError."""
    return _check_int(value, name, 1, "a positive integer", top)


def check_hnsw_m(value: Any, name: str) -> int:
    """An HNSW degree M in [2, ``MAX_HNSW_M``] as a Python int (M = 1: faiss segfaulted)."""
    value = check_at_most(value, name, MAX_HNSW_M)
    if value < 2:
        raise InputError(f"{name} must be at least 2 (an HNSW graph's degree), got {value!r}")
    return value


def check_number(value: Any, name: str, none_ok: bool = False) -> None:
    """A finite int or float (>= 0 unless ``none_ok``, which also allows None)."""
    if none_ok and value is None:
        return
    if not is_number(value) or (not none_ok and value < 0):
        want = "a finite number or None" if none_ok else "a finite number >= 0"
        raise InputError(f"{name} must be {want}, got {value!r}")


FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_scale(value: Any, name: str) -> None:
    """A finite number >= 0 that float32 holds: it scales float32 rows (1e39 made them inf)."""
    if not is_number(value) or not 0 <= value <= FLOAT32_MAX:
        raise InputError(f"{name} must be a finite number >= 0, got {value!r} (at most "
                         f"float32's {FLOAT32_MAX:.4g})")


def check_choice(value: Any, name: str, choices: tuple) -> None:
    """``value`` one of ``choices`` and of their type (of boolean choices only a bool, not 1; of
    strings only a str, not a numpy array)."""
    if not isinstance(value, type(choices[0])) or value not in choices:
        raise InputError(f"{name} must be one of {list(choices)}, got {value!r}")


def check_memory(need: float, what: str, of: str) -> None:
    """InputError if ``need`` bytes exceed physical memory (where the OS tells it)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not POSIX: unknown, unchecked
        return
    if need > memory:
        raise InputError(f"{what} {need / 2**30:.4g} GiB of {of}, more than this machine's "
                         f"{memory / 2**30:.4g} GiB of memory")


def check_flag(value: Any, name: str, want: str = "True or False") -> bool:
    """A Python or numpy bool as a bool, else InputError (the string 'no' is truthy)."""
    if not isinstance(value, (bool, np.bool_)):
        raise InputError(f"{name} must be {want}, got {value!r}")
    return bool(value)


def check_nonnegative(value: Any, name: str, zero: str = "", top: int | None = None) -> int:
    """A Python or numpy int >= 0 (and <= ``top``) as a Python int; ``zero``: what 0 means, for
    the message."""
    return _check_int(value, name, 0, f"an int >= 0{f' ({zero})' if zero else ''}", top)


# The models' own settings (pefa_gpu.models): here, so that the CLI reads their defaults
# without importing torch.
BOOLS = (True, False)
LAM_HELP = "λ in [0, 1], weight of the ERM score"
AUGMENT_FLAG = {"flag": "--no-augment",
                "help": "do not count each document as a training query for itself"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ERMParams(Params):
    """The plain embedding model: no parameters of its own."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class XSParams(Params):
    """lam: weight of the ERM embedding (1 = plain ERM). augment_docs: each document also counts
    as a training query for itself (a_j += p_j)."""

    lam: float = checked(0.5, check_unit_interval, help=LAM_HELP, metavar="L")
    augment_docs: bool = checked(True, check_choice, BOOLS, **AUGMENT_FLAG)


@dataclasses.dataclass(frozen=True, kw_only=True)
class XLParams(Params):
    """lam: weight of the ERM score. k: training-query neighbours. knn_norm: 'k' weighs a
    neighbour by s/k, 'none' by s. rescore: exact <q, p_j> for every candidate (else 0 outside
    the ERM candidates). augment_docs: documents also join as queries labelled with themselves."""

    lam: float = checked(0.1, check_unit_interval, help=LAM_HELP, metavar="L")
    k: int = checked(16, check_at_most, 2**53, help="XL neighbours",  # fuse divides by k
                     metavar="K")
    knn_norm: str = checked("k", check_choice, ("k", "none"))
    rescore: bool = checked(True, check_choice, BOOLS)
    augment_docs: bool = checked(True, check_choice, BOOLS, **AUGMENT_FLAG)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NUDGEParams(Params):
    """variant: 'M' or 'N' (pefa_gpu.nudge). gamma: the step, or None: chosen on fit's Q_val /
    Y_val, else on a seeded (``seed``) ``val_fraction`` of the training queries held out.
    val_k: NUDGE-N's validation top-k (nudge-ft's default 1)."""

    variant: str = checked("N", check_choice, ("M", "N"))
    gamma: float | None = None
    val_fraction: float = 0.2
    seed: int = 0
    val_k: int = checked(1, check_positive)

    def validate(self) -> None:
        super().validate()
        top = 4.0 if self.variant == "N" else FLOAT32_MAX  # M: γ scales float32 rows
        if self.gamma is not None and not (is_number(self.gamma) and 0.0 <= self.gamma <= top):
            raise InputError(f"gamma must be None or a number in [0, {top:g}] for NUDGE-"
                             f"{self.variant}, got {self.gamma!r}")
        check_held_out(self.val_fraction, self.seed)


def check_held_out(val_fraction: Any, seed: Any) -> None:
    """InputError unless 0 < ``val_fraction`` < 1 (a number) and ``seed`` is an int >= 0."""
    if not is_number(val_fraction) or not 0.0 < val_fraction < 1.0:
        raise InputError(f"val_fraction must lie strictly between 0 and 1, got {val_fraction!r}")
    check_nonnegative(seed, "seed")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ERMSearchParams(Params):
    """ERM's own search settings: none (its index's are the backend's SearchParams)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class XSSearchParams(Params):
    """PEFA-XS's own search settings: none (its index's are the backend's SearchParams)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class NUDGESearchParams(Params):
    """NUDGE's own search settings: none (its index's are the backend's SearchParams)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class XLSearchParams(Params):
    """PEFA-XL's own search settings. candidates: ERM candidates Kp from the passage index."""

    candidates: int = checked(500, check_positive, metavar="KP",
                              help="PEFA-XL: ERM candidates taken from the passage index")
