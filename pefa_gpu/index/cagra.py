"""CAGRA graph search on the GPU: faiss ``GpuIndexCagra`` (faiss-gpu built with cuVS), or
cuVS' own ``cuvs.neighbors.cagra`` where faiss has no GPU support.

Needs a CUDA device and one of the two packages; elsewhere construction raises
MissingDependencyError. The vectors are also kept as a torch tensor on the device: CAGRA's
candidate ids are re-scored there with exact inner products (so scores are similarities
whatever the engine's distance convention), ``add`` rebuilds the graph, and k above
``max_k`` = 1024 (CAGRA's limit) is answered exactly. Corpora no larger than the
intermediate graph degree are searched exactly (CAGRA needs more points than neighbours).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from ..arrays import as_tensor, check_positive_int, to_numpy
from ..errors import FormatError, InputError, MissingDependencyError
from ..params import Params, check_positive
from ..topk import PAD_ID, PAD_SCORE
from .base import Index
from .exact import ExactIndex

_INSTALL = ("backend 'cagra' needs a CUDA device and faiss-gpu with cuVS "
            "(`conda install -c pytorch -c nvidia -c rapidsai faiss-gpu-cuvs`) or cuVS "
            "(`pip install cuvs-cu12`)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CagraParams(Params):
    """Build settings. graph_degree / intermediate_graph_degree: of the final and the
    pre-pruning k-NN graph."""

    graph_degree: int = 64
    intermediate_graph_degree: int = 128

    def validate(self) -> None:
        check_positive(self.graph_degree, "graph_degree")
        check_positive(self.intermediate_graph_degree, "intermediate_graph_degree")
        if self.intermediate_graph_degree < self.graph_degree:
            raise InputError(f"intermediate_graph_degree={self.intermediate_graph_degree} "
                             f"must be >= graph_degree={self.graph_degree}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CagraSearchParams(Params):
    """Search settings (CAGRA's own, same names in faiss and cuVS). itopk_size: the internal
    search list (raised to k when smaller). search_width: graph nodes expanded per iteration.
    max_iterations: 0 = CAGRA's automatic choice."""

    itopk_size: int = 128
    search_width: int = 1
    max_iterations: int = 0

    def validate(self) -> None:
        check_positive(self.itopk_size, "itopk_size")
        check_positive(self.search_width, "search_width")
        if isinstance(self.max_iterations, bool) or not isinstance(self.max_iterations, int) \
                or self.max_iterations < 0:
            raise InputError(f"max_iterations must be an int >= 0 (0 = automatic), got "
                             f"{self.max_iterations!r}")


def _engine_name() -> str:
    """'faiss' or 'cuvs', whichever can build CAGRA here; else MissingDependencyError."""
    if not torch.cuda.is_available():
        raise MissingDependencyError(_INSTALL + "; torch sees no CUDA device")
    try:
        import faiss  # noqa: PLC0415

        if hasattr(faiss, "GpuIndexCagra") and faiss.get_num_gpus() > 0:
            return "faiss"
    except ImportError:
        pass
    try:
        from cuvs.neighbors import cagra  # noqa: F401, PLC0415

        return "cuvs"
    except ImportError:
        pass
    raise MissingDependencyError(_INSTALL)


class CagraIndex(Index):
    """GPU CAGRA; scores re-computed exactly for the returned ids. CUDA devices only."""

    name = "cagra"
    Params = CagraParams
    SearchParams = CagraSearchParams
    max_k: ClassVar[int] = 1024
    exact_scores = True  # candidates are re-scored exactly

    def __init__(self, params: CagraParams | dict | None = None, device: Any = None):
        super().__init__(params, device)
        if self.device.type != "cuda":
            raise MissingDependencyError(_INSTALL + f"; device is {self.device}")
        self.engine = _engine_name()
        self.vectors = torch.empty(0, 0, device=self.device)
        self._graph: Any = None
        self._res: Any = None
        self._exact: ExactIndex | None = None

    @property
    def ntotal(self) -> int:
        return int(self.vectors.shape[0])

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[1])

    def build(self, vectors: Any) -> "CagraIndex":
        v = as_tensor(vectors, device=self.device, dtype=torch.float32, name="vectors").detach()
        if v.ndim != 2 or v.shape[1] == 0:
            raise InputError(f"vectors must be 2-D (n, d) with d > 0, got {tuple(v.shape)}")
        if v.numel() and not bool(torch.isfinite(v).all()):
            raise InputError("vectors contain NaN or inf")
        self.vectors = v.contiguous()
        self._exact = None
        self._graph = None
        if self.ntotal > self.params.intermediate_graph_degree:
            self._graph = self._build_graph()
        return self

    def add(self, vectors: Any) -> None:
        """Append rows; CAGRA graphs are immutable, so the graph is rebuilt."""
        v = as_tensor(vectors, device=self.device, dtype=torch.float32, name="vectors")
        if self.ntotal == 0:
            self.build(v)
            return
        if v.ndim != 2 or v.shape[1] != self.dim:
            raise InputError(f"vectors must have shape (rows, {self.dim}), got {tuple(v.shape)}")
        self.build(torch.cat([self.vectors, v]))

    def reconstruct(self, ids: Any) -> torch.Tensor:
        """Stored rows ``ids`` (any shape, int64) -> (*ids.shape, d) float32 on the device."""
        i = as_tensor(ids, device=self.device, name="ids").long()
        if i.numel() and (int(i.min()) < 0 or int(i.max()) >= self.ntotal):
            raise InputError(f"ids must lie in [0, {self.ntotal})")
        return self.vectors[i]

    def _build_graph(self) -> Any:
        p = self.params
        if self.engine == "faiss":
            import faiss  # noqa: PLC0415

            self._res = self._res or faiss.StandardGpuResources()
            cfg = faiss.GpuIndexCagraConfig()
            cfg.graph_degree = p.graph_degree
            cfg.intermediate_graph_degree = p.intermediate_graph_degree
            cfg.device = self.device.index or 0
            index = faiss.GpuIndexCagra(self._res, self.dim, faiss.METRIC_INNER_PRODUCT, cfg)
            index.train(to_numpy(self.vectors))
            return index
        from cuvs.neighbors import cagra  # noqa: PLC0415

        ip = cagra.IndexParams(metric="inner_product", graph_degree=p.graph_degree,
                               intermediate_graph_degree=p.intermediate_graph_degree)
        return cagra.build(ip, self.vectors)

    def _candidate_ids(self, q: torch.Tensor, k: int,
                       params: CagraSearchParams) -> torch.Tensor:
        """(B, k) int64 candidate ids from the graph, on the device (invalid ones < 0)."""
        settings = {"itopk_size": max(params.itopk_size, k), "search_width": params.search_width,
                    "max_iterations": params.max_iterations}
        if self.engine == "faiss":
            import faiss  # noqa: PLC0415

            sp = faiss.SearchParametersCagra()
            for name, value in settings.items():
                setattr(sp, name, value)
            _, ids = self._graph.search(to_numpy(q), k, params=sp)
            ids = np.asarray(ids, dtype=np.int64)
        else:
            from cuvs.neighbors import cagra  # noqa: PLC0415

            _, nb = cagra.search(cagra.SearchParams(**settings), self._graph, q, k)
            ids = np.asarray(nb.copy_to_host(), dtype=np.int64)
        return as_tensor(ids, device=self.device)

    def search(self, queries: Any, k: int, params: CagraSearchParams | dict | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, d) queries -> (B, k) float32 scores, int64 ids; ``params``: this call's search
        settings (None: ``search_params``)."""
        sp = self.resolve_search_params(params)
        k = check_positive_int(k, "k")
        q = as_tensor(queries, device=self.device, dtype=torch.float32, name="queries")
        if q.ndim != 2 or (self.ntotal and q.shape[1] != self.dim):
            raise InputError(f"queries must have shape (B, {self.dim}), got {tuple(q.shape)}")
        if self._graph is None or k > self.max_k or k >= self.ntotal:
            if self._exact is None:
                self._exact = ExactIndex(device=self.device).build(self.vectors)
            return self._exact.search(q, k)
        ids = self._candidate_ids(q.contiguous(), k, sp)
        bad = (ids < 0) | (ids >= self.ntotal)
        ids = ids.masked_fill(bad, PAD_ID)
        scores = torch.einsum("bd,bkd->bk", q, self.vectors[ids.clamp_min(0)])
        scores = scores.masked_fill(bad, PAD_SCORE)
        order = torch.argsort(scores, dim=1, descending=True, stable=True)
        return scores.gather(1, order), ids.gather(1, order)

    def save(self, directory: str | Path) -> None:
        """Write ``vectors.npy`` (the graph is rebuilt on load, CAGRA builds are fast)."""
        directory = Path(directory)
        if not directory.is_dir():
            raise InputError(f"save directory {directory} does not exist")
        np.save(directory / "vectors.npy", to_numpy(self.vectors))

    @classmethod
    def load(cls, directory: str | Path, params: CagraParams | dict | None = None,
             device: Any = None) -> "CagraIndex":
        path = Path(directory) / "vectors.npy"
        if not path.is_file():
            raise FormatError(f"{path} is missing: not a saved 'cagra' index")
        try:
            vectors = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise FormatError(f"{path} could not be read: {exc}") from exc
        return cls(params, device).build(vectors)
