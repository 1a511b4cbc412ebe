"""Shared shape of the backends that wrap a CPU library with a numpy API (hnswlib, ScaNN).

A subclass implements ``_raw_search(q, k, params)``: one call into its library for a (B, d)
C-contiguous float32 batch and a ``k`` of at most ``ntotal``, returning (B, k) float32
similarities and int64 ids with -1 where the library found nothing. This class does the rest
of the protocol: query checks, the search-time settings (``SearchParams``; ``None`` means
``index.search_params``), -1 / -inf padding when ``k`` exceeds what the library returned,
equal scores listed by id, and the hand-off to the index's device (the libraries have no GPU
path: a CUDA model searches on the host and gets its results back on its device).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..arrays import as_tensor, check_topk
from ..errors import FormatError, InputError
from ..params import Params
from ..storage import strict_json
from ..topk import PAD_ID, PAD_SCORE
from ._faiss import host_float32, normalise_results_host
from .base import Index


def resolve_threads(threads: int) -> int:
    """``threads`` (0 = every core) -> a positive thread count."""
    return threads if threads > 0 else (os.cpu_count() or 1)


def write_description(path: Path, fmt: str, **fields: Any) -> None:
    """A saved index's JSON description: ``fmt`` (version 1) and ``fields``."""
    path.write_text(json.dumps({"format": fmt, "format_version": 1, **fields}, indent=2) + "\n")


def read_description(path: Path, fmt: str, **expected: Any) -> dict[str, Any]:
    """The description at ``path``, which must be ``fmt`` version 1 with int fields ``dim``
    and ``ntotal`` > 0 and every ``expected`` field equal to its value; else FormatError."""
    if not path.is_file():
        raise FormatError(f"{path} is missing: not a saved index of this backend")
    try:
        meta = strict_json(path.read_text())
        ok = (isinstance(meta, dict) and meta.get("format") == fmt
              and meta.get("format_version") == 1
              and all(type(meta.get(k)) is int and meta[k] > 0 for k in ("dim", "ntotal"))
              and all(meta.get(k) == v for k, v in expected.items()))
    except (ValueError, UnicodeDecodeError, RecursionError):
        ok = False
    if not ok:
        want = ", ".join(["dim", "ntotal", *(f"{k}={v!r}" for k, v in expected.items())])
        raise FormatError(f"{path} is not a {fmt!r} version 1 description ({want})")
    return meta


class HostBackend(Index):
    """Base of the CPU-library backends (see the module docstring)."""

    def __init__(self, params: Params | dict | None = None, device: Any = None):
        super().__init__(params, device)
        self._dim = 0

    @property
    def dim(self) -> int:
        return self._dim

    def add(self, vectors: Any) -> None:
        """Append rows (ids continue after the existing ones); into an empty index: build."""
        if self._dim == 0:
            self.build(vectors)
            return
        x = host_float32(vectors, "vectors", dim=self.dim)
        if x.shape[0]:
            self._append(x)

    def _append(self, x: np.ndarray) -> None:
        """Add the (r, d) float32 rows ``x`` (r > 0) after the existing ones."""
        raise NotImplementedError

    def search(self, queries: Any, k: int, params: Params | dict | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, d) queries -> (B, k) float32 similarities and int64 ids on ``device``, -1 / -inf
        padded. ``params``: this call's search settings (default ``self.search_params``)."""
        scores, ids = self.search_host(queries, k, params=params)
        return as_tensor(scores, device=self.device), as_tensor(ids, device=self.device)

    def search_host(self, queries: Any, k: int, check_finite: bool = True,
                    params: Params | dict | None = None) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`search` with numpy results (no torch hand-off: small CPU batches).
        ``check_finite=False``: the caller has tested the queries for NaN / inf already."""
        k = check_topk(k, self.ntotal, "k")
        sp = self.resolve_search_params(params)
        q = host_float32(queries, "queries", check_finite=check_finite)
        if self.ntotal and q.shape[1] != self.dim:
            raise InputError(f"queries must have shape (B, {self.dim}), got {q.shape}")
        b, found = q.shape[0], min(k, self.ntotal)
        if b == 0 or found == 0:
            return (np.full((b, k), PAD_SCORE, np.float32), np.full((b, k), PAD_ID, np.int64))
        scores, ids = normalise_results_host(*self._raw_search(q, found, sp))
        if found < k:
            scores = np.pad(scores, ((0, 0), (0, k - found)), constant_values=PAD_SCORE)
            ids = np.pad(ids, ((0, 0), (0, k - found)), constant_values=PAD_ID)
        return scores, ids

    def _raw_search(self, q: np.ndarray, k: int, params: Params
                    ) -> tuple[np.ndarray, np.ndarray]:
        """One library call, 1 <= k <= ntotal: (B, k) float32 similarities, int64 ids (-1 where
        nothing was found)."""
        raise NotImplementedError
