"""The pipeline's stages on a Ray cluster (README: "Beyond one machine (Ray)"): the same
shard tasks, encoders on a pool of Ray actors, map / reduce tasks through the object store,
search actors per block of shards. Failed tasks and actors are retried (``max_retries``;
writes are atomic). Paths must be on storage every node sees. Ray is imported on use."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from .arrays import DeviceLike
from .params import check_nonnegative, check_positive
from .errors import InputError, MissingDependencyError
from .pipeline.runner import Fanout

# search actors kept between searches on clusters without GPUs, per Ray connection
_KEPT: dict[tuple[str, str], list[Any]] = {}


def _session() -> tuple[str, str]:
    """This connection's key: (the driver's node id, its job id)."""
    ctx = _ray().get_runtime_context()
    return ctx.get_node_id(), ctx.get_job_id()


def _ray():
    try:
        import ray
    except ImportError as exc:
        raise MissingDependencyError("the distributed pipeline needs Ray: pip install "
                                     "'pefa_gpu[ray]'") from exc
    return ray


@contextlib.contextmanager
def connect(address: str = "local", workers: int | None = None,
            **init_kwargs: Any) -> Iterator["RayRunner"]:
    """Yield a :class:`RayRunner` on a Ray cluster: ``"local"`` starts one here with ``workers``
    CPUs (default: all), else ``ray.init(address=...)``. A cluster already initialised is used
    and left running; a connection made here is shut down on exit."""
    ray = _ray()
    if not isinstance(address, str) or not address:
        raise InputError(f"address must be 'local' or a Ray address, got {address!r}")
    cpus = os.cpu_count() or 1  # num_cpus=2**31-1 made ray.init's local cluster hang
    if workers is not None and check_positive(workers, "workers") > cpus and address == "local":
        raise InputError(f"workers must be at most the {cpus} CPUs here for a local cluster, "
                         f"got {workers}")
    started = not ray.is_initialized()
    if started:  # workers' output and INFO lines stay in Ray's log files
        where = ({"num_cpus": workers, "include_dashboard": False} if address == "local"
                 else {"address": address})
        ray.init(**where, **{"log_to_driver": False, "logging_level": logging.WARNING,
                             **init_kwargs})
    try:
        yield RayRunner(workers)
    finally:
        if started:
            ray.shutdown()


class RayRunner:
    """The pipeline's shard tasks on the connected Ray cluster; workers: encoder and search
    actors (default: its GPUs, else CPUs); max_retries: per task and actor (-1: no limit)."""

    def __init__(self, workers: int | None = None, max_retries: int = 3):
        ray = _ray()
        if not ray.is_initialized():
            raise InputError("RayRunner needs a connected Ray cluster: use "
                             "pefa_gpu.distributed.connect(...) or ray.init(...) first")
        if workers is not None:
            check_positive(workers, "workers")
        if max_retries != -1 or isinstance(max_retries, (bool, float)):
            max_retries = check_nonnegative(max_retries, "max_retries", "or -1: no limit")
        res = ray.cluster_resources()
        self.gpus = int(res.get("GPU", 0))
        self.workers = int(workers or self.gpus or max(int(res.get("CPU", 1)), 1))
        self.max_retries = int(max_retries)  # Ray takes no numpy int

    def _task(self, fn: Callable, gpu: bool, **options: Any):
        return _ray().remote(fn).options(num_cpus=1, num_gpus=1 if gpu and self.gpus else 0,
                                         max_retries=self.max_retries, **options)

    def map(self, fn: Callable, calls: Sequence[tuple], gpu: bool = False) -> list:
        """[fn(*args) for args in calls] as Ray tasks (of one remote function)."""
        task = self._task(fn, gpu)
        return _ray().get([task.remote(*args) for args in calls])

    def map_reduce(self, map_fn: Callable, map_calls: Sequence[tuple], reduce_fn: Callable,
                   reduce_calls: Sequence[tuple], gpu: bool = False) -> list:
        """As :meth:`pefa_gpu.pipeline.LocalRunner.map_reduce`, through the object store."""
        n = len(reduce_calls)
        mapper = self._task(_map_parts, False, num_returns=n)
        refs = [mapper.remote(map_fn, n, *args) for args in map_calls]
        if n == 1:
            refs = [[r] for r in refs]
        reducer = self._task(_reduce_parts, gpu)
        return _ray().get([reducer.remote(reduce_fn, len(refs), *[r[s] for r in refs], *args)
                           for s, args in enumerate(reduce_calls)])

    def encode(self, fn: Callable, calls: Sequence[dict[str, Any]],
               show_progress: bool = True) -> None:
        """``fn(**call)`` for each call (texts, index, lo, fingerprint) on a pool of encoder
        actors (restarted and the call retried if one dies), one shard per actor call."""
        from ray.util import ActorPool
        from tqdm.auto import tqdm

        ray = _ray()
        actor = ray.remote(_ShardEncoder).options(
            num_cpus=1, num_gpus=1 if self.gpus else 0, max_restarts=self.max_retries,
            max_task_retries=self.max_retries)
        actors = [actor.remote(fn) for _ in range(min(self.workers, len(calls)))]
        try:  # the actors hold GPUs and a model: stopped here, not when collected
            for _ in tqdm(ActorPool(actors).map_unordered(lambda a, c: a.encode.remote(c), calls),
                          total=len(calls), desc="encode", unit="shard",
                          disable=not show_progress):
                pass
        finally:
            for a in actors:
                ray.kill(a)

    def servers(self, server: Callable, build: str | Path,
                groups: Sequence[tuple[list[int], list[int]]],
                device: DeviceLike = None) -> "RayFanout":
        """Search actors, one per group of shards, each a ``server(build, doc shards, query
        shards, device)``. Without GPUs they are kept for the next search (no logical CPU,
        spread over the nodes); with GPUs each holds one until the search ends."""
        actor = _ray().remote(_ServerActor).options(
            num_cpus=1 if self.gpus else 0, max_restarts=self.max_retries,
            max_task_retries=self.max_retries,
            **({"num_gpus": 1} if self.gpus else {"scheduling_strategy": "SPREAD"}))
        if self.gpus:
            actors = [actor.remote() for _ in groups]
        else:
            kept = _KEPT.setdefault(_session(), [])
            kept.extend(actor.remote() for _ in range(len(groups) - len(kept)))
            actors = kept[:len(groups)]
        keys = [(server, str(build), list(d), list(q), device) for d, q in groups]
        return RayFanout(actors, keys, keep=not self.gpus)

    def close(self) -> None:
        """Stop the search actors kept between searches."""
        for a in _KEPT.pop(_session(), []):
            _ray().kill(a)


def _map_parts(fn: Callable, n: int, *args: Any):
    parts = fn(*args)
    if len(parts) != n:
        raise RuntimeError(f"{fn.__name__} returned {len(parts)} parts, expected {n}")
    return parts[0] if n == 1 else tuple(parts)


def _reduce_parts(fn: Callable, n_parts: int, *values: Any):
    return fn(list(values[:n_parts]), *values[n_parts:])


class _ShardEncoder:
    """An encoder actor: encodes one shard of texts per call into its stage folder."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def encode(self, call: dict[str, Any]) -> None:
        self.fn(**call)


class _ServerActor:
    """A search actor: a ShardServer for the shards each call's key names (so a restarted
    actor loads them again); results come back on the CPU."""

    def __init__(self):
        self.key: tuple | None = None  # the server's class and arguments
        self.server: Any = None

    def call(self, key: tuple, method: str, *args: Any) -> Any:
        if key != self.key:
            self.release()  # the old shards' memory first
            self.server, self.key = key[0](*key[1:]), key
        out = getattr(self.server, method)(*args)
        return None if out is None else tuple(t.cpu() for t in out)

    def release(self) -> None:
        self.server, self.key = None, None


class RayFanout(Fanout):
    """Calls a method on every search actor; each argument goes into the object store once."""

    def __init__(self, actors: Sequence[Any], keys: Sequence[tuple], keep: bool):
        self.actors, self.keys, self.keep = list(actors), list(keys), keep

    def call(self, *calls: tuple[str, tuple]) -> list[list[Any]]:
        ray = _ray()
        refs = []
        for method, args in calls:
            put = [ray.put(a) if isinstance(a, (torch.Tensor, tuple)) else a for a in args]
            refs.append([a.call.remote(key, method, *put)
                         for a, key in zip(self.actors, self.keys)])
        return [ray.get(r) for r in refs]

    def close(self) -> None:
        ray = _ray()
        if self.keep:  # free the shards' memory; the processes stay for the next search
            ray.get([a.release.remote() for a in self.actors])
        else:
            for a in self.actors:
                ray.kill(a)
        self.actors = []
