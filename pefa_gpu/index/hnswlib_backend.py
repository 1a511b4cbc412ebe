"""HNSW with hnswlib (PyPI ``hnswlib``), inner product, on the CPU; results on the index's
device. A search sets ef when it differs from the last (concurrent ones with different ef are
not safe)."""

from __future__ import annotations

import dataclasses
import logging
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np

from ..arrays import DeviceLike, finite_array, to_numpy
from ..errors import FormatError
from ..params import (MAX_HNSW_EF, MAX_THREADS, check_at_most, check_hnsw_m, check_nonnegative,
                      checked)
from .base import IndexParams, import_optional
from ._host import HostBackend, read_description, write_description

log = logging.getLogger("pefa_gpu")

INDEX_FILE, META_FILE = "index.bin", "hnswlib.json"
META_FORMAT = "pefa_gpu-hnswlib"
# hnswlib's file header (hnswalg.h saveIndex): offsetLevel0, max_elements, cur_element_count,
# size_data_per_element, label_offset, offsetData (size_t), maxlevel (int), enterpoint (uint),
# maxM, maxM0, M (size_t), mult (double), ef_construction (size_t)
_HEADER = struct.Struct("<6QiI3QdQ")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HnswlibParams(IndexParams):
    """Build settings. M: graph degree (level 0 has 2M links). ef_construction: beam width
    while inserting. seed: of the level assignment. threads: for inserting and searching (0 =
    every core; more than one makes the graph depend on thread timing)."""

    M: int = checked(32, check_hnsw_m)
    ef_construction: int = checked(500, check_at_most, MAX_HNSW_EF)
    seed: int = checked(100, check_nonnegative, "", 2**64 - 1)  # a size_t in hnswlib
    threads: int = checked(0, check_nonnegative, "every core", MAX_THREADS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HnswlibSearchParams(IndexParams):
    """Search settings. ef_search: beam width (hnswlib uses max(ef_search, k))."""

    ef_search: int = checked(300, check_at_most, MAX_HNSW_EF)


class HnswlibIndex(HostBackend):
    """hnswlib HNSW, inner product, on the CPU; results on ``device``."""

    name = "hnswlib"
    Params = HnswlibParams
    SearchParams = HnswlibSearchParams
    exact_scores = True  # 1 - fl(1 - <q, x>) in float64: within 6e-8 of <q, x>

    def __init__(self, params: HnswlibParams | dict | None = None, device: DeviceLike = None):
        super().__init__(params, device)
        self._hnswlib = import_optional("hnswlib", "backend 'hnswlib' needs hnswlib: `pip "
                                        "install hnswlib` (builds with g++), or `pip install "
                                        "pefa_gpu[hnswlib]`")
        self._ef = 0  # the ef last set on the hnswlib index

    def _count(self) -> int:
        return int(self._index.get_current_count())

    def _new_index(self, x: np.ndarray) -> Any:
        p = self.params
        index = self._hnswlib.Index(space="ip", dim=x.shape[1])
        index.init_index(max_elements=x.shape[0], M=p.M, ef_construction=p.ef_construction,
                         random_seed=p.seed)
        index.add_items(x, np.arange(x.shape[0]), num_threads=self.threads)
        self._ef = 0
        return index

    def _append(self, x: np.ndarray) -> None:
        n = self.ntotal
        self._index.resize_index(n + x.shape[0])
        self._index.add_items(x, np.arange(n, n + x.shape[0]), num_threads=self.threads)

    def _read_rows(self, ids: np.ndarray) -> np.ndarray:
        return np.asarray(self._index.get_items(ids, return_type="numpy"), dtype=np.float32)

    def _raw_search(self, q: np.ndarray, k: int, params: HnswlibSearchParams
                    ) -> tuple[np.ndarray, np.ndarray]:
        ef = max(params.ef_search, k)
        if ef != self._ef:
            self._index.set_ef(ef)
            self._ef = ef
        try:
            labels, dist = self._index.knn_query(q, k=k, num_threads=self.threads)
        except RuntimeError as exc:  # "Cannot return the results in a contiguous 2D array"
            log.info("hnswlib found fewer than k=%d results (%s); answering exactly", k, exc)
            return tuple(map(to_numpy, self._exact_search(q, k)))
        scores = (1.0 - dist.astype(np.float64)).astype(np.float32)
        return scores, labels.astype(np.int64)

    def save(self, directory: str | Path) -> None:
        """Write ``index.bin`` (hnswlib's format) and ``hnswlib.json``."""
        directory = self._save_dir(directory)
        self._index.save_index(str(directory / INDEX_FILE))
        write_description(directory / META_FILE, META_FORMAT, space="ip", dim=self.dim,
                          ntotal=self.ntotal)

    @classmethod
    def load(cls, directory: str | Path, params: HnswlibParams | dict | None = None,
             device: DeviceLike = None) -> "HnswlibIndex":
        """Read an index written by :meth:`save`; its header must agree with ``hnswlib.json``
        and with ``params.M`` (else FormatError)."""
        meta = read_description(cls._saved_file(directory, META_FILE), META_FORMAT, space="ip")
        dim, ntotal = meta["dim"], meta["ntotal"]
        index_path = cls._saved_file(directory, INDEX_FILE)
        out = cls(params, device)
        _check_header(index_path, dim, ntotal, out.params.M)
        index = out._hnswlib.Index(space="ip", dim=dim)
        try:
            index.load_index(str(index_path), max_elements=ntotal)
        except RuntimeError as exc:
            raise FormatError(f"{index_path} could not be read by hnswlib: {exc}") from exc
        out._index, out._dim = index, dim
        return out


def _check_header(path: Path, dim: int, ntotal: int, M: int) -> None:
    """FormatError unless the hnswlib file agrees with the description (rows, dim, M) and with
    itself (layout, labels 0..n-1, every link to a node of its level): hnswlib trusts it."""
    size = path.stat().st_size
    if size < _HEADER.size:
        raise FormatError(f"{path} is truncated: {size} bytes, shorter than hnswlib's header")
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    (offset0, _, count, per_element, label_offset, data_offset, maxlevel, enter, max_m, max_m0,
     m, mult, _) = _HEADER.unpack(raw[:_HEADER.size].tobytes())
    if count != ntotal or label_offset - data_offset != 4 * dim:
        raise FormatError(f"{path} holds {count} vectors of {(label_offset - data_offset) / 4:g}"
                          f" floats; {path.parent / META_FILE} says {ntotal} of {dim}")
    if m != M:
        raise FormatError(f"{path}: the saved graph has M={m}, params say M={M}")
    links0 = 4 + 4 * max_m0  # a level-0 list: count (uint16 + 2 bytes), max_m0 uint32 ids
    if (offset0, max_m, max_m0, data_offset, per_element) != \
            (0, M, 2 * M, links0, links0 + 4 * dim + 8) or not 0 <= maxlevel or enter >= count \
            or not math.isclose(mult, 1 / math.log(M)):  # NaN: the next add asked for ~2^31
        raise FormatError(f"{path}: hnswlib's header is inconsistent (offsets, M, maxM, maxM0, "
                          f"entry point, top level or level multiplier do not fit {count} "
                          f"vectors of {dim} floats with M={M})")
    end0 = _HEADER.size + count * per_element
    # upper levels: per node a uint32 byte count, then `level` lists of count + max_m ids
    links = 4 + 4 * max_m
    levels, blocks = _upper_levels(path, raw, count, end0, links)  # (level 0 truncated: too)
    if levels[enter] != maxlevel:
        raise FormatError(f"{path}: the entry point {enter} is on level {levels[enter]}, the "
                          f"header says the top level is {maxlevel}")
    level0 = raw[_HEADER.size:end0].reshape(count, per_element)
    labels = np.ascontiguousarray(level0[:, label_offset:label_offset + 8]).view("<u8").ravel()
    if labels.size and (labels.max() >= count or np.unique(labels).size != count):
        raise FormatError(f"{path}: the labels are not the ids 0..{count - 1}")
    rows = np.ndarray((count, dim), "<f4", raw, _HEADER.size + data_offset, (per_element, 4))
    if not finite_array(rows):  # (a view: nothing copied)
        raise FormatError(f"{path}: the stored vectors hold NaN or inf: a forged or corrupted "
                          f"index")
    if level0[:, 2:4].any():  # hnswlib's deleted mark: searches skip the row, get_items raises
        raise FormatError(f"{path}: rows are marked deleted, which pefa_gpu never does: a "
                          f"forged or corrupted graph")
    step = 1 << 16
    for start in range(0, count, step):
        _check_lists(path, level0[start:start + step, :links0], max_m0, 0, levels, start)
    if blocks:
        rows = np.concatenate([np.asarray(raw[at:at + levels[node] * links]).reshape(-1, links)
                               for node, at in blocks])
        level = np.concatenate([np.arange(1, levels[node] + 1) for node, _ in blocks])
        _check_lists(path, rows, max_m, level, levels, None)


def _upper_levels(path: Path, raw: np.ndarray, count: int, start: int, links: int
                  ) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Each node's top level and (node, offset) of its upper-level lists, read from ``start``
    to the end of the file (FormatError where they do not fit)."""
    size = raw.size
    levels = np.zeros(count, np.int64)
    blocks, pos = [], start
    view = memoryview(raw)
    for node in range(count):
        if pos + 4 > size:
            raise FormatError(f"{path} is truncated in the link lists of node {node}")
        nbytes = struct.unpack_from("<I", view, pos)[0]
        pos += 4
        if nbytes:
            if nbytes % links or pos + nbytes > size:
                raise FormatError(f"{path}: node {node} has a malformed upper-level link list")
            levels[node] = nbytes // links
            blocks.append((node, pos))
            pos += nbytes
    if pos != size:
        raise FormatError(f"{path} is longer than its link lists ({size - pos} bytes more)")
    return levels, blocks


def _check_lists(path: Path, lists: np.ndarray, width: int, level: Any, levels: np.ndarray,
                 first: int | None) -> None:
    """(rows, 4 + 4 width) uint8 link lists (uint16 count, 2 bytes, width uint32 ids) on
    ``level`` (int or per row): count <= width, every id a node reaching that level."""
    lists = np.ascontiguousarray(lists)
    counts = lists[:, :2].view("<u2").ravel()
    ids = lists[:, 4:].view("<u4")
    if counts.size and counts.max() > width:
        raise FormatError(f"{path}: a link list holds {counts.max()} links, more than {width}")
    listed = np.arange(width) < counts[:, None]
    bad = listed & (ids >= levels.size)
    if not bad.any():
        reach = levels[np.where(listed, ids, 0)]
        bad = listed & (reach < np.asarray(level).reshape(-1, 1))
    if bad.any():
        row, col = np.argwhere(bad)[0]
        where = f"node {first + row}" if first is not None else "an upper-level list"
        raise FormatError(f"{path}: {where} links to {int(ids[row, col])}, which is not a node "
                          f"of that level ({levels.size} nodes): a forged or corrupted graph")
