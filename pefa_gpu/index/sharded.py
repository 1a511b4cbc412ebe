"""An index sharded over devices: contiguous row shards, one backend index per device, their
top-k lists merged with the tie rule; search settings are the shard backend's."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from ..arrays import DeviceLike, as_tensor, check_topk, resolve_device
from ..errors import FormatError, InputError
from ..params import Params
from ..storage import read_json
from ..topk import merge_lists
from .base import Index, VectorIndex, check_row_ids, empty_results


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardedParams(Params):
    """devices: one shard per entry (None: every visible GPU when the index's device is CUDA,
    else the index's device); backend / backend_params: the index of each shard."""

    devices: list[str] | None = None
    backend: str = "exact"
    backend_params: dict[str, Any] | None = None

    def validate(self) -> None:
        super().validate()
        devices = self.devices
        if devices is not None and (not isinstance(devices, (list, tuple)) or not devices
                                    or not all(isinstance(d, str) for d in devices)):
            raise InputError(f"devices must be a non-empty list of device strings, got {devices!r}")
        if self.backend == "sharded":
            raise InputError("backend='sharded' cannot shard itself")
        if self.backend_params is not None and not isinstance(self.backend_params, dict):
            raise InputError(f"backend_params must be a dict, got {self.backend_params!r}")


class ShardedIndex(Index):
    """Rows split over ``params.devices``; ids are global row numbers in insertion order."""

    name = "sharded"
    Params = ShardedParams

    def __init__(self, params: ShardedParams | dict | None = None, device: DeviceLike = None):
        super().__init__(params, device)
        from . import backend_class

        self._cls = backend_class(self.params.backend)
        self.SearchParams = self._cls.SearchParams
        self.search_params = None
        names = self.params.devices or [str(self.device)]
        if self.params.devices is None and self.device.type == "cuda" and self.device.index is None:
            names = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        self.devices = [resolve_device(d) for d in names]
        self.shards: list[Index] = []
        self.offsets: list[int] = []

    @property
    def ntotal(self) -> int:
        return sum(s.ntotal for s in self.shards)

    @property
    def dim(self) -> int:
        return self.shards[0].dim if self.shards else 0

    def build(self, vectors: torch.Tensor) -> "ShardedIndex":
        v = as_tensor(vectors, name="vectors").detach()
        if v.ndim != 2:
            raise InputError(f"vectors must be 2-D, got shape {tuple(v.shape)}")
        n, parts = v.shape[0], len(self.devices)
        if n < parts and not getattr(self._cls, "builds_empty", True):  # was named as (0, d)
            raise InputError(f"{n} vectors cannot fill {parts} shards: backend "
                             f"{self.params.backend!r} cannot build an empty shard")
        bounds = [n * i // parts for i in range(parts + 1)]
        self.shards = [self._cls(self.params.backend_params, dev).build(v[lo:hi])
                       for dev, lo, hi in zip(self.devices, bounds[:-1], bounds[1:])]
        self.offsets = bounds[:-1]
        return self

    def add(self, vectors: torch.Tensor) -> None:
        """Appended rows go to the last shard, so ids stay contiguous per shard."""
        if not self.shards:
            self.build(vectors)
            return
        v = as_tensor(vectors, name="vectors").detach()
        self.check_rows(v)
        self.shards[-1].add(v)

    def search(self, queries: torch.Tensor, k: int, params: Params | dict | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``params``: the shard backend's search settings for this call."""
        sp = self.resolve_search_params(params)
        k = check_topk(k, self.ntotal, "k")
        q = as_tensor(queries, name="queries").detach()
        self.check_queries(q)
        parts = []
        # each shard launched before any result is gathered (GPUs overlap where a shard's
        # search does not wait for its device)
        for shard, off in zip(self.shards, self.offsets):
            if shard.ntotal:
                s, i = shard.search(q.to(shard.device, non_blocking=True), min(k, shard.ntotal), sp)
                parts.append((s, torch.where(i >= 0, i + off, i)))
        if not parts:
            return empty_results(q.shape[0], k, self.device)
        return merge_lists([(s.to(self.device), i.to(self.device)) for s, i in parts], k)

    @property
    def exact_scores(self) -> bool:
        """True when every shard returns exact fp32 inner products."""
        return bool(self.shards) and all(getattr(s, "exact_scores", False) for s in self.shards)

    def _route(self, ids: torch.Tensor):
        """(shard, mask of ids in it, local ids) for each shard."""
        for shard, off in zip(self.shards, self.offsets):
            mask = (ids >= off) & (ids < off + shard.ntotal)
            yield shard, mask, ids - off

    def update(self, ids: torch.Tensor, vectors: torch.Tensor) -> None:
        """Overwrite rows ``ids`` (r,) with ``vectors`` (r, d) in the shards holding them."""
        i = check_row_ids(as_tensor(ids, name="ids").detach().flatten(), self.ntotal)
        v = as_tensor(vectors, name="vectors").detach()
        if v.ndim != 2 or v.shape[0] != i.numel():
            raise InputError(f"vectors must have shape ({i.numel()}, {self.dim}), got "
                             f"{tuple(v.shape)}")
        done = []  # (shard, local ids, their old rows): put back where a later shard refuses
        try:
            for shard, mask, local in self._route(i.to(v.device)):
                if bool(mask.any()):
                    at = local[mask].to(shard.device)
                    # a backend that cannot update says so (scann cannot return rows either)
                    old = shard.rows_unchecked(at) if type(shard).update is not Index.update \
                        else None
                    shard.update(at, v[mask].to(shard.device))
                    done.append((shard, at, old))
        except Exception:
            for shard, at, old in done:
                shard.update(at, old)
            raise

    reconstruct = VectorIndex.reconstruct  # ids checked, then rows_unchecked

    def rows_unchecked(self, ids: torch.Tensor) -> torch.Tensor:
        """:meth:`reconstruct` of valid int64 ids on the device: no check (shards of vectors
        are read without one too)."""
        out = torch.zeros(*ids.shape, self.dim, device=self.device)
        for shard, mask, local in self._route(ids):
            if shard.ntotal:
                local = local.clamp(0, shard.ntotal - 1).to(shard.device)
                out = torch.where(mask.unsqueeze(-1),
                                  shard.rows_unchecked(local).to(self.device), out)
        return out

    def save(self, directory: str | Path) -> None:
        """One sub-directory ``shard_{i}`` per shard plus ``shards.json`` (row offsets)."""
        d = self._save_dir(directory, empty_ok=True)
        for i, shard in enumerate(self.shards):
            (d / f"shard_{i}").mkdir()
            shard.save(d / f"shard_{i}")
        (d / "shards.json").write_text(json.dumps({"offsets": self.offsets,
                                                   "sizes": [s.ntotal for s in self.shards]}))

    @classmethod
    def load(cls, directory: str | Path, params: ShardedParams | dict | None = None,
             device: DeviceLike = None) -> "ShardedIndex":
        """Read what :meth:`save` wrote; shard i goes to the i-th device of the new index."""
        out = cls(params, device)
        d = Path(directory)
        try:
            meta = read_json(d / "shards.json", "shard list")
            offsets, sizes = list(meta["offsets"]), list(meta["sizes"])
        except (OSError, FormatError, KeyError, TypeError) as exc:  # read_json: bounded, no NaN
            raise FormatError(f"{d / 'shards.json'} is missing or unreadable: {exc}") from exc
        if len(offsets) != len(out.devices):
            raise FormatError(f"{d} holds {len(offsets)} shards but the index has "
                              f"{len(out.devices)} devices {[str(x) for x in out.devices]}")
        out.shards = [out._cls.load(d / f"shard_{i}", out.params.backend_params, dev)
                      for i, dev in enumerate(out.devices)]
        if len({s.dim for s in out.shards if s.ntotal}) > 1:  # was searched: 'queries must ...'
            raise FormatError(f"{d}: its shards hold rows of dimensions "
                              f"{[s.dim for s in out.shards]}; one index has one dimension")
        if [s.ntotal for s in out.shards] != sizes:
            raise FormatError(f"{d}: shard sizes {[s.ntotal for s in out.shards]} differ from "
                              f"shards.json {sizes}")
        out.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        if offsets != out.offsets:
            raise FormatError(f"{d}: shards.json offsets {offsets} are not the running sum of "
                              f"the shard sizes {out.offsets}")
        return out
