"""CAGRA graph search on the GPU (faiss ``GpuIndexCagra`` or cuVS), candidates re-scored
exactly from the rows kept on the device; k above ``max_k``, corpora no larger than the
intermediate degree and saves loaded where no engine runs are searched exactly."""

from __future__ import annotations

import dataclasses
import importlib
import logging
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..arrays import DeviceLike, as_tensor, check_topk, cuda_index
from ..errors import FormatError, InputError, MissingDependencyError
from ..params import check_nonnegative, check_positive, checked
from ..storage import load_tensor
from ..topk import PAD_ID, PAD_SCORE, merge_topk
from ._faiss import (device_float32, faiss_pointer, faiss_search_parameters, import_faiss,
                     on_current_stream, optional_faiss, search_tensors)
from .base import IndexParams, VectorIndex, check_budget
from .exact import ExactIndex

log = logging.getLogger("pefa_gpu")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CagraParams(IndexParams):
    """Build settings. graph_degree / intermediate_graph_degree: of the final and the
    pre-pruning k-NN graph. memory_budget: bytes of a re-scoring block and exact searches."""

    graph_degree: int = checked(64, check_positive)
    intermediate_graph_degree: int = checked(128, check_positive)
    memory_budget: int = checked(256 * 2**20, check_budget)

    def validate(self) -> None:
        super().validate()
        if self.intermediate_graph_degree < self.graph_degree:
            raise InputError(f"intermediate_graph_degree={self.intermediate_graph_degree} "
                             f"must be >= graph_degree={self.graph_degree}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CagraSearchParams(IndexParams):
    """CAGRA's search settings. itopk_size: the internal list (raised to k). search_width:
    nodes expanded per iteration."""

    itopk_size: int = checked(128, check_positive)
    search_width: int = checked(1, check_positive)
    max_iterations: int = checked(0, check_nonnegative, "automatic")


def _engine(device: torch.device) -> str | None:
    """'faiss' or 'cuvs', whichever builds CAGRA on the (resolved) ``device``; None if neither."""
    if device.type != "cuda":
        return None
    faiss = optional_faiss()
    if faiss is not None and hasattr(faiss, "GpuIndexCagra") and faiss.get_num_gpus() > 0:
        return "faiss"
    try:
        importlib.import_module("cuvs.neighbors.cagra")
        return "cuvs"
    except ImportError:
        return None


def _install_message(device: torch.device) -> str:
    return ("backend 'cagra' needs a CUDA device and faiss-gpu with cuVS (`conda install -c "
            "pytorch -c nvidia -c rapidsai faiss-gpu-cuvs`) or cuVS (`pip install cuvs-cu12`)"
            + ("" if device.type == "cuda" else f"; device is {device}"))


def rescore(q: torch.Tensor, vectors: torch.Tensor, ids: torch.Tensor,
            memory_budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, d) float32, vectors (n, d) float32, candidate ids (B, C) int64 (invalid: < 0 or
    >= n; repeats allowed) -> (B, C) exact scores and ids with the tie rule, invalid and
    repeated ids (-inf, -1) at the end."""
    n, d = vectors.shape
    b, c = ids.shape
    ids = ids.masked_fill((ids < 0) | (ids >= n), n).sort(dim=1).values  # repeats adjacent
    bad = ids == n
    bad[:, 1:] |= ids[:, 1:] == ids[:, :-1]
    ids = ids.masked_fill(bad, PAD_ID)
    step = max(1, memory_budget // max(1, c * d * 4))
    scores = torch.empty((b, c), dtype=torch.float32, device=ids.device)
    for s in range(0, b, step):
        rows = vectors[ids[s:s + step].clamp_min(0)]  # (rows, C, d)
        scores[s:s + step] = torch.einsum("bd,bcd->bc", q[s:s + step], rows)
    return merge_topk(scores.masked_fill(bad, PAD_SCORE), ids, c)


class CagraIndex(VectorIndex):
    """GPU CAGRA, candidates re-scored exactly; built on CUDA only, a save loads anywhere."""

    name = "cagra"
    Params = CagraParams
    SearchParams = CagraSearchParams
    max_k: ClassVar[int] = 1024
    exact_scores = True  # candidates are re-scored exactly

    def __init__(self, params: CagraParams | dict | None = None, device: DeviceLike = None,
                 need_engine: bool = True):
        super().__init__(params, device)
        self.engine = _engine(self.device)  # None: exact search over the stored vectors
        if self.engine is None and need_engine:
            raise MissingDependencyError(_install_message(self.device))
        self.vectors = torch.empty(0, 0, device=self.device)
        self._graph: Any = None
        self._res: Any = None  # faiss: StandardGpuResources; cuVS: {stream: Resources}
        self._exact = ExactIndex({"memory_budget": self.params.memory_budget}, self.device)

    def build(self, vectors: Any) -> "CagraIndex":
        v = device_float32(vectors, "vectors", self.device)
        if v.shape[1] == 0:
            raise InputError(f"vectors must be 2-D (n, d) with d > 0, got {tuple(v.shape)}")
        self.vectors = v  # never changed in place: a graph may refer to it
        self._exact.build(v)  # the same tensor
        self._graph = None
        if self.engine is not None and self.ntotal > self.params.intermediate_graph_degree:
            self._graph = self._build_graph()
        return self

    def add(self, vectors: Any) -> None:
        """Append rows; CAGRA graphs are immutable, so the graph is rebuilt."""
        v = device_float32(vectors, "vectors", self.device, self.dim if self.ntotal else None)
        self.build(torch.cat([self.vectors, v]) if self.ntotal else v)

    def _build_graph(self) -> Any:
        p = self.params
        dev = cuda_index(self.device)
        if self.engine == "faiss":
            faiss = import_faiss()
            self._res = self._res or faiss.StandardGpuResources()
            cfg = faiss.GpuIndexCagraConfig()
            cfg.graph_degree = p.graph_degree
            cfg.intermediate_graph_degree = p.intermediate_graph_degree
            cfg.device = dev
            index = faiss.GpuIndexCagra(self._res, self.dim, faiss.METRIC_INNER_PRODUCT, cfg)
            with on_current_stream(faiss, self._res, self.device):
                index.train_c(self.ntotal, faiss_pointer(faiss, self.vectors))
            return index
        from cuvs.neighbors import cagra  # noqa: PLC0415

        ip = cagra.IndexParams(metric="inner_product", graph_degree=p.graph_degree,
                               intermediate_graph_degree=p.intermediate_graph_degree)
        with torch.cuda.device(dev):
            return cagra.build(ip, self.vectors, resources=self._cuvs_resources())

    def _cuvs_resources(self) -> Any:
        """cuVS resources on torch's current stream of the index's device (one per stream)."""
        from cuvs.common import Resources  # noqa: PLC0415

        stream = torch.cuda.current_stream(cuda_index(self.device)).cuda_stream
        self._res = self._res if isinstance(self._res, dict) else {}
        if stream not in self._res:
            self._res[stream] = Resources(stream=stream)
        return self._res[stream]

    def _candidate_ids(self, q: torch.Tensor, k: int, params: CagraSearchParams) -> torch.Tensor:
        """(B, k) int64 candidate ids from the graph (invalid: < 0 or >= ntotal)."""
        settings = {"itopk_size": max(params.itopk_size, k), "search_width": params.search_width,
                    "max_iterations": params.max_iterations}
        if self.engine == "faiss":
            sp = faiss_search_parameters("SearchParametersCagra", **settings)
            return search_tensors(import_faiss(), self._graph, q, k, sp, self._res)[1]
        from cuvs.neighbors import cagra  # noqa: PLC0415

        neighbours = torch.empty((q.shape[0], k), dtype=torch.uint32, device=q.device)
        distances = torch.empty((q.shape[0], k), dtype=torch.float32, device=q.device)
        with torch.cuda.device(cuda_index(self.device)):
            cagra.search(cagra.SearchParams(**settings), self._graph, q, k,
                         neighbors=neighbours, distances=distances,
                         resources=self._cuvs_resources())
        return neighbours.to(torch.int64)  # invalid: 2**32 - 1 >= ntotal

    def search(self, queries: Any, k: int, params: CagraSearchParams | dict | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        sp = self.resolve_search_params(params)
        k = check_topk(k, self.ntotal, "k")
        q = as_tensor(queries, device=self.device, dtype=torch.float32,
                      name="queries").detach()  # (cuVS reads no tensor that needs grad)
        self.check_queries(q)
        if self._graph is None or k > self.max_k or k >= self.ntotal:
            return self._exact.search(q, k)
        q = q.contiguous()
        return rescore(q, self.vectors, self._candidate_ids(q, k, sp), self.params.memory_budget)

    @classmethod
    def load(cls, directory: str | Path, params: CagraParams | dict | None = None,
             device: DeviceLike = None) -> "CagraIndex":
        """Read ``vectors.npy`` and rebuild the graph (exact search where no engine runs)."""
        path = cls._saved_file(directory, "vectors.npy")
        vectors = load_tensor(path)
        out = cls(params, device, need_engine=False)
        if out.engine is None and out.device.type == "cuda":
            log.warning("cagra: %s; serving exact search from the stored vectors instead",
                        _install_message(out.device))
        if vectors.shape == (0, 0):  # saved before it was built
            return out
        try:
            return out.build(vectors)
        except InputError as exc:  # NaN rows, not (n, d): the file's fault, not the caller's
            raise FormatError(f"{path}: {exc}") from exc
