"""Inverted-file search: faiss IVF-Flat or IVF-PQ, inner product; on the GPU for a CUDA
device when faiss has GPU support (k <= 2048, else exact search), else on the CPU."""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from ..arrays import DeviceLike, as_tensor, cuda_index, finite_array, to_numpy
from ..errors import FormatError, InputError
from ..params import (FLOAT32_MAX, MAX_THREADS, check_at_most, check_choice, check_nonnegative,
                      checked)
from .base import IndexParams
from ._faiss import faiss_has_gpu, faiss_search_parameters, host_float32
from ._host import FaissBackend, check_row_norms

MAX_TRAIN_NORM = math.sqrt(FLOAT32_MAX)  # a product of two such rows: float32 max

log = logging.getLogger("pefa_gpu")


@dataclasses.dataclass(frozen=True, kw_only=True)
class IVFParams(IndexParams):
    """Build settings. kind: 'flat' or 'pq'. nlist, pq_m: 0 = :func:`auto_nlist`,
    :func:`auto_pq_m`. train_size: seeded sample (0 = min(n, 256 nlist)); ``add`` does not
    retrain."""

    kind: str = checked("flat", check_choice, ("flat", "pq"))
    nlist: int = checked(0, check_nonnegative, "automatic")
    pq_m: int = checked(0, check_nonnegative, "automatic")
    pq_nbits: int = checked(8, check_at_most, 24)  # faiss' limit; 2^pq_nbits codes a sub-quantizer
    train_size: int = checked(0, check_nonnegative, "automatic")
    seed: int = checked(0, check_nonnegative)
    threads: int = checked(0, check_nonnegative, "all cores", MAX_THREADS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class IVFSearchParams(IndexParams):
    """nprobe: lists visited per query (0 = :func:`auto_nprobe`; at most nlist, and 2048 on
    the GPU, lowered with a warning)."""

    nprobe: int = checked(0, check_nonnegative, "automatic")


def auto_nlist(n: int) -> int:
    """4 sqrt(n), at most n / 39 (faiss' minimum points per centroid), at least 1."""
    return int(max(1, min(round(4 * math.sqrt(max(n, 1))), n // 39, 65536)))


def auto_nprobe(nlist: int) -> int:
    """5/8 of the lists (rounded up), at least 32, at most 2048 and nlist."""
    return int(min(nlist, 2048, max(32, -(-5 * nlist // 8))))


def auto_pq_m(d: int) -> int:
    """The largest divisor of d that is at most d / 4 (at least 1)."""
    target = max(1, d // 4)
    return max(m for m in range(1, target + 1) if d % m == 0)


class IVFIndex(FaissBackend):
    """faiss IVF-Flat / IVF-PQ, inner product; GPU when available for a CUDA device."""

    name = "ivf"
    Params = IVFParams
    SearchParams = IVFSearchParams
    gpu_max_k: ClassVar[int] = 2048
    gpu_max_nprobe: ClassVar[int] = 2048  # faiss GPU's k-selection limit (without cuVS)
    saved_kinds = {"IndexIVFFlat": "flat", "IndexIVFPQ": "pq"}

    def __init__(self, params: IVFParams | dict | None = None, device: DeviceLike = None):
        super().__init__(params, device)
        self._rows: torch.Tensor | None = None  # GPU: the stored rows on the device, once read
        self._nprobe_warned = False
        self._want_gpu = self.device.type == "cuda" and faiss_has_gpu(self._faiss)
        self.exact_scores = self.params.kind == "flat"  # IVF-PQ scores are approximations

    def _to_device(self, cpu_index: Any) -> Any:
        """Move a CPU faiss index to the GPU when wanted; on failure stay on the CPU."""
        self._gpu_res = None
        if not self._want_gpu:
            return cpu_index
        # faiss refuses to copy an index whose nprobe is above its GPU limit (a save's nprobe)
        cpu_index.nprobe = min(int(cpu_index.nprobe), self.gpu_max_nprobe)
        try:
            res = self._faiss.StandardGpuResources()
            gpu_index = self._faiss.index_cpu_to_gpu(res, cuda_index(self.device), cpu_index)
        except Exception as exc:  # e.g. a PQ layout the GPU does not support
            log.warning("ivf: could not move the index to the GPU (%s); staying on the CPU", exc)
            return cpu_index
        self._gpu_res = res
        return gpu_index

    def _new_index(self, x: Any) -> Any:
        """Train on a seeded sample of ``x`` (n, d) and add them all."""
        (n, d), p, f = x.shape, self.params, self._faiss
        nlist = p.nlist or auto_nlist(n)
        if nlist > n:
            raise InputError(f"nlist={nlist} is more than the {n} vectors to train on")
        size = min(n, p.train_size or 256 * nlist)
        need = max(nlist, 2**p.pq_nbits if p.kind == "pq" else 0)  # k-means: points >= centres
        if size < need:
            raise InputError(f"{size} training vectors for nlist={nlist}" + (
                f" and 2^{p.pq_nbits} codes a sub-quantizer" if p.kind == "pq" else "") +
                f": k-means needs at least {need}; raise train_size, or lower nlist / pq_nbits")
        if p.kind == "flat":
            spec = f"IVF{nlist},Flat"
        else:
            m = p.pq_m or auto_pq_m(d)
            if d % m:
                raise InputError(f"pq_m={m} must divide the dimension {d}")
            spec = f"IVF{nlist},PQ{m}x{p.pq_nbits}np"  # np: no polysemous training (unused)
        index = self._to_device(f.index_factory(d, spec, f.METRIC_INNER_PRODUCT))
        for holder in (index, getattr(index, "pq", None)):  # k-means' stderr line, past -q:
            if hasattr(holder, "cp"):  # the log line below instead (min only warns in faiss)
                holder.cp.min_points_per_centroid = 1
        if size < 39 * need:
            log.warning("ivf: %d training vectors for %d k-means centres (faiss suggests %d): "
                        "raise train_size, or lower nlist / pq_nbits", size, need, 39 * need)
        if not self.on_gpu and not isinstance(x, np.ndarray):  # the move to the GPU failed
            x = host_float32(x, "vectors", check_finite=False)
        rows = np.sort(np.random.default_rng(p.seed).choice(n, size=size, replace=False))
        sample = to_numpy(x[rows])
        check_row_norms(sample, MAX_TRAIN_NORM, "ivf's float32 k-means")  # else inf, an abort
        self._rows = None
        self._call(index, "train", sample)  # faiss GPU trains IVF on the CPU
        self._call(index, "add", x)
        return index

    def _append(self, x: Any) -> None:
        super()._append(x)
        if self._rows is not None:  # IVF-Flat stores the rows as given; PQ codes differ
            self._rows = torch.cat([self._rows, x]) if self.exact_scores else None

    @property
    def nprobe(self) -> int:
        """Lists a search at the default ``search_params`` visits."""
        return self._nprobe(self.search_params)

    def _nprobe(self, params: IVFSearchParams) -> int:
        nlist = int(self._index.nlist)
        nprobe = min(params.nprobe or auto_nprobe(nlist), nlist)
        if self.on_gpu and nprobe > self.gpu_max_nprobe:
            if not self._nprobe_warned:
                log.warning("ivf: nprobe=%d is above faiss GPU's limit of %d lists per query; "
                            "searching %d lists", nprobe, self.gpu_max_nprobe,
                            self.gpu_max_nprobe)
                self._nprobe_warned = True
            nprobe = self.gpu_max_nprobe
        return nprobe

    def _faiss_params(self, params: IVFSearchParams, k: int) -> Any:
        return faiss_search_parameters("SearchParametersIVF", nprobe=self._nprobe(params))

    def _read_rows(self, ids: np.ndarray) -> np.ndarray:
        cpu = self._cpu_index()
        cpu.make_direct_map()  # keeps itself up to date on later adds
        return cpu.reconstruct_batch(ids)

    def _stored_vectors(self) -> torch.Tensor:
        """The rows (IVF-PQ: decoded) on the device; on the GPU read once and kept."""
        if not self.on_gpu:
            return super()._stored_vectors()
        if self._rows is None or self._rows.shape[0] != self.ntotal:
            rows = self._cpu_index().reconstruct_n(0, self.ntotal)
            self._rows = as_tensor(rows, device=self.device)
        return self._rows

    def _set_search_defaults(self, index: Any) -> None:
        index.nprobe = self.nprobe

    def _read_index(self, path: Path) -> Any:
        """faiss' read, once a read that maps the lists from the file (not allocating the sizes
        the file claims, as faiss' read does first) finds them within the file."""
        f = self._faiss  # read-only: on-disk lists (refused in _adopt) open their file for writes
        flags = f.IO_FLAG_READ_ONLY | f.IO_FLAG_SKIP_PRECOMPUTE_TABLE  # an L2 quantizer's: 2 GiB
        mapped = super()._read_index(path, f.IO_FLAG_MMAP | flags)
        lists = getattr(mapped, "invlists", None)  # None: not an IVF index, refused after
        if lists is not None and sum(lists.list_size(i) for i in range(lists.nlist)) * (
                lists.code_size + 8) > path.stat().st_size:
            raise FormatError("its inverted lists claim more entries than the file holds")
        return super()._read_index(path, flags)

    def _adopt(self, index: Any, kind: str, directory: str | Path) -> Any:
        """FormatError unless the saved index is of ``params.kind`` with one centroid a list
        (faiss 1.13's search aborted on more), IVF-PQ codes of the lists' size and the ids
        0..ntotal-1 in its lists, each once; then moved to the GPU where wanted."""
        if kind != self.params.kind:
            raise FormatError(f"{directory}: the saved index is IVF-{kind}, params say "
                              f"kind={self.params.kind!r}")
        lists, n, q = index.invlists, int(index.ntotal), index.quantizer
        if lists is None or type(
                self._faiss.downcast_InvertedLists(lists)).__name__ != "ArrayInvertedLists":
            raise FormatError(f"{directory}: the saved IVF lists are not held in the index file "
                              f"(none, or on-disk lists naming another file): a forged index")
        codes = getattr(index, "pq", index)  # IVF-Flat: its own
        if (q.ntotal, q.d, lists.nlist, codes.d, codes.code_size, q.metric_type) != (
                index.nlist, index.d, index.nlist, index.d, index.code_size, index.metric_type):
            raise FormatError(f"{directory}: the saved IVF index has {q.ntotal} centroids of "
                              f"dimension {q.d}, {lists.nlist} lists and codes of "
                              f"{codes.code_size} bytes for nlist={index.nlist}, d={index.d}, "
                              f"code size {index.code_size} (quantizer metric {q.metric_type}, "
                              f"index {index.metric_type}): a forged or corrupted index")
        ids = [self._faiss.rev_swig_ptr(lists.get_ids(i), lists.list_size(i))
               for i in range(index.nlist) if lists.list_size(i)]
        ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        if not np.array_equal(np.sort(ids), np.arange(n)):
            span = f"{ids.min()}..{ids.max()}" if ids.size else "-..-"
            raise FormatError(f"{directory}: the IVF lists hold {ids.size} ids ({span}), not "
                              f"each of 0..{n - 1} once: a forged or corrupted index")
        f, centroids = self._faiss, self._faiss.downcast_index(q)  # views: searches dropped NaN
        arrays = [f.rev_swig_ptr(centroids.codes.data(), centroids.codes.size())] + [
            f.rev_swig_ptr(lists.get_codes(i), lists.list_size(i) * lists.code_size)
            for i in range(index.nlist) if kind == "flat" and lists.list_size(i)]
        if kind == "pq":  # its codebooks: NaN ones dropped rows or gave no results at all
            arrays.append(f.rev_swig_ptr(codes.centroids.data(), codes.centroids.size()))
        if not all(finite_array(a.view(np.float32)) for a in arrays):
            raise FormatError(f"{directory}: the saved centroids or vectors hold NaN or inf: a "
                              f"forged or corrupted index")
        return self._to_device(index)
