"""Where the shard tasks run: :class:`LocalRunner` (this process; its :class:`Fanout` of
shard servers). :class:`pefa_gpu.distributed.RayRunner` has the same methods."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence


class LocalRunner:
    """Runs every shard task in this process, one after another."""

    workers = 1

    def map(self, fn: Callable, calls: Sequence[tuple], gpu: bool = False) -> list:
        """[fn(*args) for args in calls] (``gpu``: the tasks would use a GPU given one)."""
        return [fn(*args) for args in calls]

    def map_reduce(self, map_fn: Callable, map_calls: Sequence[tuple], reduce_fn: Callable,
                   reduce_calls: Sequence[tuple], gpu: bool = False) -> list:
        """Reduce task s gets [map 0's part s, map 1's part s, ...] and its own args."""
        parts = [map_fn(*args) for args in map_calls]
        return [reduce_fn([p[s] for p in parts], *args) for s, args in enumerate(reduce_calls)]

    def encode(self, fn: Callable, calls: Sequence[dict[str, Any]],
               show_progress: bool = True) -> None:
        """``fn(**kw)`` (an encoder task) for each call."""
        from tqdm.auto import tqdm

        for kw in tqdm(calls, desc="encode", unit="shard", disable=not show_progress):
            fn(**kw)

    def servers(self, server: Callable, build: Any, groups: Sequence[tuple[list[int], list[int]]],
                device: Any = None) -> "Fanout":
        """One in-process ``server(build, doc shards, query shards, device)`` per group."""
        return Fanout([server(build, d, q, device) for d, q in groups])


class Fanout(contextlib.AbstractContextManager):
    """Calls a method on every shard server and returns the results in server order."""

    def __init__(self, servers: Sequence[Any]):
        self.servers = list(servers)

    def call(self, *calls: tuple[str, tuple]) -> list[list[Any]]:
        """For each (method, args): the list of every server's result."""
        return [[getattr(s, method)(*args) for s in self.servers] for method, args in calls]

    def close(self) -> None:
        self.servers = []

    def __exit__(self, *exc: Any) -> None:
        self.close()
