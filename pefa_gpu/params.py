"""Frozen, keyword-only parameter objects that round-trip through JSON and reject unknown keys."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, TypeVar

import numpy as np

from .errors import InputError

T = TypeVar("T", bound="Params")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Params:
    """Base of every params object: ``to_dict`` / ``from_dict`` / ``to_json`` / ``from_json``.

    Subclasses check their values in ``validate`` (called on construction).
    """

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # numpy scalars (np.int64(16), ...) -> int / float
            value = getattr(self, f.name)
            if isinstance(value, np.generic):
                object.__setattr__(self, f.name, value.item())
        self.validate()

    def validate(self) -> None:
        """Raise InputError on a bad value; subclasses override."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        cls._check_keys(data)
        return cls(**data)

    @classmethod
    def _check_keys(cls, data: dict[str, Any]) -> None:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InputError(f"{cls.__name__} got unknown keys {unknown}; known: {sorted(known)}")

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls: type[T], text: str) -> T:
        return cls.from_dict(json.loads(text))

    def replace(self: T, **changes: Any) -> T:
        """A copy with ``changes``, checked as on construction (unknown keys: InputError)."""
        self._check_keys(changes)
        return dataclasses.replace(self, **changes)

    @classmethod
    def coerce(cls: type[T], value: "Params | dict | None", what: str = "params") -> T:
        """``value`` as a ``cls``: None -> the defaults, a dict -> :meth:`from_dict`, a ``cls``
        as it is; anything else is a TypeError naming ``what``."""
        if value is None:
            return cls()
        if isinstance(value, dict):
            return cls.from_dict(value)
        if isinstance(value, cls):
            return value
        raise TypeError(f"{what} must be a {cls.__name__} or a dict, got {type(value).__name__}")


def check_unit_interval(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise InputError(f"{name} must be a number in [0, 1], got {value!r}")


def check_positive(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InputError(f"{name} must be a positive integer, got {value!r}")


def check_choice(value: Any, name: str, choices: tuple) -> None:
    if value not in choices:
        raise InputError(f"{name} must be one of {list(choices)}, got {value!r}")


def check_nonnegative(value: Any, name: str, zero: str = "") -> None:
    """An int >= 0; ``zero`` says what 0 means, for the error message."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InputError(f"{name} must be an int >= 0{f' ({zero})' if zero else ''}, "
                         f"got {value!r}")
