"""The pipeline's stages on a Ray cluster: the runner that :mod:`pefa_gpu.pipeline` takes.

    from pefa_gpu import distributed, pipeline as pp
    with distributed.connect("local", workers=2) as runner:     # or "auto", "ray://head:10001"
        scores, ids = pp.search(build, queries, runner=runner)  # every stage takes runner=

This module only decides where shard tasks run and moves their results; the tasks are the
pipeline's own functions (so a cluster run equals a one-process run by construction):

- encode: a Ray Data actor pool (``ActorPoolStrategy``), one actor per GPU (``num_gpus=1``)
  where the cluster has GPUs, else one CPU actor per worker; one shard of texts per call.
- aggregate / build: Ray tasks; a map task returns one object per document range
  (``num_returns``), which Ray hands to that range's reduce task (the shuffle goes through
  Ray's object store, spilling to disk when it fills; only the stages' outputs are files).
- search: one actor per worker, each loading a block of the build's shards (a
  :class:`pefa_gpu.pipeline.ShardServer`); the driver merges each query batch's results.
  Without GPUs the actors stay up between searches (a new Ray worker costs a process start
  and the torch import, seconds); with GPUs each search's actors hold a GPU and end with it.

Failures: a task whose worker dies is retried (``max_retries``), an actor that dies is restarted
and its calls retried (``max_restarts`` / ``max_task_retries``); Ray Data restarts its actors
itself. Every task is a function of its shards, and every write atomic, so a retry gives the
same result. Paths given to the stages must be on storage every node sees (NFS, a mounted
bucket); ``local`` (a cluster on this machine) needs nothing of the kind.

Ray (``pip install 'pefa_gpu[ray]'``) is imported only when this module is used.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from .arrays import check_positive_int
from .errors import InputError, MissingDependencyError
from .pipeline.runner import Fanout

# search actors kept between searches on clusters without GPUs, per Ray connection
_KEPT: dict[tuple[str, str], list[Any]] = {}


def _session() -> tuple[str, str]:
    """This connection: (the driver's node id, its job id); a new cluster or a new connection
    gets a new key."""
    ctx = _ray().get_runtime_context()
    return ctx.get_node_id(), ctx.get_job_id()


def _ray():
    try:
        import ray
    except ImportError as exc:
        raise MissingDependencyError("the distributed pipeline needs Ray: pip install "
                                     "'pefa_gpu[ray]' (ray[data])") from exc
    return ray


@contextlib.contextmanager
def connect(address: str = "local", workers: int | None = None,
            **init_kwargs: Any) -> Iterator["RayRunner"]:
    """Connect to a Ray cluster and yield a :class:`RayRunner`.

    ``address``: ``"local"`` starts a cluster on this machine with ``workers`` CPUs (default:
    all); anything else goes to ``ray.init(address=...)`` (``"auto"``, ``"ray://host:10001"``,
    ``"host:6379"``). When Ray is initialised already (e.g. by the caller), that cluster is used
    and left running (with the search actors kept for later searches: :meth:`RayRunner.close`
    stops them); a connection made here is shut down on exit, and everything with it."""
    ray = _ray()
    if not isinstance(address, str) or not address:
        raise InputError(f"address must be 'local' or a Ray address, got {address!r}")
    if workers is not None:
        check_positive_int(workers, "workers")
    started = False
    if not ray.is_initialized():
        # the workers' output and Ray's INFO lines stay in Ray's log files (pass
        # log_to_driver=True, logging_level=logging.INFO to see them)
        init_kwargs = {"log_to_driver": False, "logging_level": logging.WARNING, **init_kwargs}
        if address == "local":
            ray.init(num_cpus=workers, include_dashboard=False, **init_kwargs)
        else:
            ray.init(address=address, **init_kwargs)
        started = True
    try:
        yield RayRunner(workers)
    finally:
        if started:
            ray.shutdown()


class RayRunner:
    """Runs the pipeline's shard tasks on the Ray cluster this process is connected to.

    workers: encoder and search actors (default: the cluster's GPUs, else its CPUs);
    max_retries: retries of a task whose worker died, restarts of a dead actor. Tasks take one
    CPU each; build tasks, encoders and search actors one GPU each where the cluster has GPUs."""

    def __init__(self, workers: int | None = None, max_retries: int = 3):
        ray = _ray()
        if not ray.is_initialized():
            raise InputError("RayRunner needs a connected Ray cluster: use "
                             "pefa_gpu.distributed.connect(...) or ray.init(...) first")
        res = ray.cluster_resources()
        self.gpus = int(res.get("GPU", 0))
        self.workers = int(workers or self.gpus or max(int(res.get("CPU", 1)), 1))
        self.max_retries = max_retries

    def _task(self, fn: Callable, gpu: bool, **options: Any):
        return _ray().remote(fn).options(num_cpus=1, num_gpus=1 if gpu and self.gpus else 0,
                                         max_retries=self.max_retries, **options)

    def map(self, fn: Callable, calls: Sequence[tuple], gpu: bool = False) -> list:
        """[fn(*args) for args in calls] as Ray tasks."""
        task = self._task(fn, gpu)
        return _ray().get([task.remote(*args) for args in calls])

    def map_reduce(self, map_fn: Callable, map_calls: Sequence[tuple], reduce_fn: Callable,
                   reduce_calls: Sequence[tuple], gpu: bool = False) -> list:
        """As :meth:`pefa_gpu.pipeline.LocalRunner.map_reduce`: map tasks return one object
        per reduce task (``num_returns``); reduce task s receives part s of every map, in map
        order, through the object store."""
        ray = _ray()
        n = len(reduce_calls)
        mapper = self._task(_map_parts, False, num_returns=n)
        refs = [mapper.remote(map_fn, n, *args) for args in map_calls]
        if n == 1:
            refs = [[r] for r in refs]
        reducer = self._task(_reduce_parts, gpu)
        return ray.get([reducer.remote(reduce_fn, len(refs), *[r[s] for r in refs], *args)
                        for s, args in enumerate(reduce_calls)])

    def encode(self, fn: Callable, calls: Sequence[dict[str, Any]],
               show_progress: bool = True) -> None:
        """``fn(**kw)`` (:func:`pefa_gpu.pipeline.encode_shard` with the stage's settings) for
        each call (texts, index, lo, fingerprint), on a Ray Data actor pool (one shard per
        actor call)."""
        ray = _ray()
        import ray.data
        from tqdm.auto import tqdm

        # "" for no fingerprint: Ray Data would hand a None column back as NaN
        rows = [{**c, "fingerprint": c["fingerprint"] or "", "texts": list(c["texts"])}
                for c in calls]
        ctx = ray.data.DataContext.get_current()
        bars = ctx.enable_progress_bars
        ctx.enable_progress_bars = False
        try:
            ds = ray.data.from_items(rows, override_num_blocks=len(rows))
            ds = ds.map_batches(_ShardEncoder, fn_constructor_kwargs={"fn": fn},
                                batch_size=1, batch_format="numpy",
                                compute=ray.data.ActorPoolStrategy(
                                    size=min(self.workers, len(rows))),
                                num_cpus=1, num_gpus=1 if self.gpus else 0)
            with tqdm(total=len(rows), desc="encode", unit="shard",
                      disable=not show_progress) as bar:
                for _ in ds.iter_rows():
                    bar.update(1)
        finally:
            ctx.enable_progress_bars = bars

    def servers(self, server: Callable, build: str | Path,
                groups: Sequence[tuple[list[int], list[int]]], device: Any = None) -> "RayFanout":
        """Search actors, one per group of shards, each a ``server(build, doc shards, query
        shards, device)`` (:class:`pefa_gpu.pipeline.ShardServer`). Without GPUs the actors
        are kept for the next search (they take no logical CPU, so they never block the tasks
        of other stages, and are spread over the nodes): a Ray worker imports torch and
        pefa_gpu once, not once per search. With GPUs each holds one until the search ends."""
        ray = _ray()
        actor = ray.remote(_ServerActor).options(
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
        """Stop the search actors kept between searches (they also end with the Ray
        connection, e.g. when :func:`connect` shuts down the cluster it started)."""
        ray = _ray()
        for a in _KEPT.pop(_session(), []):
            ray.kill(a)


def _map_parts(fn: Callable, n: int, *args: Any):
    parts = fn(*args)
    if len(parts) != n:
        raise RuntimeError(f"{fn.__name__} returned {len(parts)} parts, expected {n}")
    return parts[0] if n == 1 else tuple(parts)


def _reduce_parts(fn: Callable, n_parts: int, *values: Any):
    return fn(list(values[:n_parts]), *values[n_parts:])


class _ShardEncoder:
    """A Ray Data actor: encodes one shard of texts per call into its stage folder."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        for index, lo, fp, texts in zip(batch["index"], batch["lo"], batch["fingerprint"],
                                        batch["texts"]):
            self.fn([str(t) for t in texts], index=int(index), lo=int(lo),
                    fingerprint=str(fp) or None)
        return {"index": batch["index"]}


class _ServerActor:
    """A search actor: a :class:`pefa_gpu.pipeline.ShardServer` for whichever shards a call
    names. Every call carries its shards' key (the server class and its arguments), so an
    actor restarted after a crash (with no state) loads them again and answers the retried
    call the same way. Results come back on the CPU (the driver merges them)."""

    def __init__(self):
        self.key: tuple | None = None  # the server's class and arguments
        self.server: Any = None

    def call(self, key: tuple, method: str, *args: Any) -> Any:
        if key != self.key:
            self.server, self.key = None, None
            self.server, self.key = key[0](*key[1:]), key
        out = getattr(self.server, method)(*args)
        return None if out is None else tuple(t.cpu() for t in out)

    def release(self) -> None:
        self.server, self.key = None, None


class RayFanout(Fanout):
    """Calls a method on every search actor (each with its shards' key); each argument is put
    into the object store once, whatever the number of actors."""

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
