"""HNSW export for CPU serving: an inner-product faiss file that ``faiss.read_index`` opens.

Builders (``method``): ``"hnsw"`` faiss' ``IndexHNSWFlat`` (efConstruction 500 as in the paper);
``"cagra"`` faiss ``GpuIndexCagra`` on CUDA; ``"knn"`` an exact top-(2M) graph on the device, M
forward then up to M reverse edges per row; the last two as a base-level ``IndexHNSWCagra``.
``"auto"``: cagra, else knn on CUDA, hnsw on the CPU. A model's own same-M ``hnsw`` index is kept.
"""

from __future__ import annotations

import glob
import inspect
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import scipy.sparse as sp
import torch

from .arrays import ArrayLike, DeviceLike, as_tensor, cuda_index, resolve_device, to_numpy
from .errors import InputError
from .index import Index
from .index._faiss import faiss_has_gpu, host_float32, import_faiss
from .index.exact import ExactIndex
from .params import MAX_HNSW_EF, MAX_HNSW_M, check_at_most, check_choice, check_hnsw_m
from .storage import as_path, check_output_file, lock_folder, write_output_file

if TYPE_CHECKING:
    import faiss


def knn_graph(vectors: ArrayLike, degree: int, device: DeviceLike = None) -> torch.Tensor:
    """(n, d) vectors -> (n, degree) int64 exact inner-product neighbours on ``device``, self
    excluded, half forward and half reverse edges, no duplicates, -1 padded (``degree`` at
    most 2 ``MAX_HNSW_M``: an HNSW level 0's links)."""
    degree = check_at_most(degree, "degree", 2 * MAX_HNSW_M)
    dev = resolve_device(device)
    v = as_tensor(vectors, device=dev, dtype=torch.float32, name="vectors")
    n = v.shape[0]
    if n == 0:  # was the exact search's 'k must be a positive integer, got 0'
        raise InputError(f"vectors have shape {tuple(v.shape)}: no rows to link")
    fwd_s, fwd = ExactIndex(device=dev).build(v).search(v, min(degree + 1, n))
    rows = torch.arange(n, device=dev).unsqueeze(1)
    # drop self (wherever it sits among ties: scored -inf, moved last) and keep `degree`
    fwd_s, order = torch.sort(fwd_s.masked_fill(fwd == rows, float("-inf")), dim=1,
                              descending=True, stable=True)
    fwd_s, fwd = fwd_s[:, :degree], fwd.gather(1, order)[:, :degree]
    fwd = fwd.masked_fill(fwd_s == float("-inf"), -1)
    half = max(1, degree // 2)
    # reverse edges i -> j for every forward edge j -> i among j's `half` nearest, ranked by
    # the search's own score of the pair (no (n half, d) gather of the rows)
    ok = fwd[:, :half] >= 0
    src, dst, score = rows.expand_as(ok)[ok], fwd[:, :half][ok], fwd_s[:, :half][ok]
    order = torch.argsort(score, descending=True, stable=True)
    order = order[torch.argsort(dst[order], stable=True)]  # by target, closest first
    src, dst = src[order], dst[order]
    rank = torch.arange(dst.numel(), device=dev) - torch.searchsorted(dst, dst)  # its target's
    keep = rank < half
    rev = torch.full((n, half), -1, dtype=torch.long, device=dev)
    rev[dst[keep], rank[keep]] = src[keep]
    cand = torch.cat([fwd[:, :half], rev, fwd[:, half:]], dim=1)
    return _first_unique(cand, degree)


def _first_unique(ids: torch.Tensor, width: int) -> torch.Tensor:
    """Each row's distinct valid (>= 0) ids in order of first appearance: (n, width), -1
    padded."""
    s, o = torch.sort(ids, dim=1, stable=True)
    first = torch.ones_like(s, dtype=torch.bool)
    first[:, 1:] = s[:, 1:] != s[:, :-1]
    keep = torch.zeros_like(first).scatter_(1, o, first & (s >= 0))
    pos = torch.arange(ids.shape[1], 0, -1, device=ids.device).expand_as(ids)
    kv, kp = torch.topk(torch.where(keep, pos, 0), min(width, ids.shape[1]), dim=1, sorted=True)
    out = torch.where(kv > 0, ids.gather(1, kp), -1)
    return torch.nn.functional.pad(out, (0, width - out.shape[1]), value=-1)


HNSW_METHODS = ("auto", "hnsw", "cagra", "knn")


def build_hnsw(vectors: ArrayLike, *, M: int = 32, device: DeviceLike = None, method: str = "auto",
               ef_search: int = 300, ef_construction: int = 500, entrypoints: int = 32
               ) -> faiss.IndexHNSW:
    """A CPU faiss HNSW index over ``vectors`` (n, d), inner product, built by ``method``
    (``M`` in [2, ``MAX_HNSW_M``]; the ef's and entrypoints at most ``MAX_HNSW_EF``)."""
    # Python ints from here on (faiss' SWIG refuses numpy integers)
    M = check_hnsw_m(M, "M")
    ef_search = check_at_most(ef_search, "ef_search", MAX_HNSW_EF)
    ef_construction = check_at_most(ef_construction, "ef_construction", MAX_HNSW_EF)
    entrypoints = check_at_most(entrypoints, "entrypoints", MAX_HNSW_EF)
    check_choice(method, "method", HNSW_METHODS)
    faiss = import_faiss()
    dev = resolve_device(device)
    if method == "auto":
        method = ("hnsw" if dev.type != "cuda" else
                  "cagra" if faiss_has_gpu(faiss) and hasattr(faiss, "GpuIndexCagra") else "knn")
    x = host_float32(vectors, "vectors")
    (n, d), ip = x.shape, faiss.METRIC_INNER_PRODUCT
    if n == 0 or d == 0:  # d 0: faiss built (and wrote) an index of 0-wide vectors
        raise InputError(f"vectors have shape {x.shape}: nothing to export")
    if method == "hnsw":
        index = faiss.IndexHNSWFlat(d, M, ip)
        index.hnsw.efConstruction = ef_construction
        index.add(x)
    else:  # cagra / knn: a graph of base-level links, every vector on level 0 only
        index = faiss.IndexHNSWCagra(d, M, ip)
        index.base_level_only = True
    if method == "cagra":
        if dev.type != "cuda" or not hasattr(faiss, "GpuIndexCagra"):
            raise InputError("method='cagra' needs a CUDA device and faiss-gpu with cuVS")
        cfg = faiss.GpuIndexCagraConfig()
        cfg.graph_degree, cfg.intermediate_graph_degree = 2 * M, 4 * M
        cfg.device = cuda_index(dev)
        gpu = faiss.GpuIndexCagra(faiss.StandardGpuResources(), d, ip, cfg)
        gpu.train(x)
        gpu.copyTo(index)
    elif method == "knn":  # the exact graph (n, 2M)
        graph = to_numpy(knn_graph(vectors, 2 * M, dev)).astype(np.int32)
        faiss.copy_array_to_vector(np.ones(n, dtype=np.int32), index.hnsw.levels)
        index.hnsw.prepare_level_tab(n, True)
        index.storage.add(x)
        index.ntotal = n
        faiss.copy_array_to_vector(graph.ravel(), index.hnsw.neighbors)
        index.hnsw.entry_point, index.hnsw.max_level = 0, 0
    if method != "hnsw":
        index.num_base_level_search_entrypoints = entrypoints
    index.hnsw.efSearch = ef_search
    return index


def export_hnsw(vectors: ArrayLike, path: str | Path, *, index: Index | None = None,
                **kwargs: Any) -> Path:
    """Write :func:`build_hnsw`'s index (or ``index``'s own graph: an ``hnsw`` backend index
    over ``vectors`` with the same M, method auto / hnsw) to the file ``path`` atomically."""
    faiss = import_faiss()
    check_output_file(path, "export path")
    # checked here too: a kept graph skips build_hnsw (a misspelt keyword: TypeError naming it)
    settings = inspect.signature(build_hnsw).bind(vectors, **kwargs)
    settings.apply_defaults()  # build_hnsw's defaults
    s = settings.arguments
    m = check_hnsw_m(s["M"], "M")
    check_choice(s["method"], "method", HNSW_METHODS)
    for name in ("ef_construction", "entrypoints"):
        check_at_most(s[name], name, MAX_HNSW_EF)
    ef_search = check_at_most(s["ef_search"], "ef_search", MAX_HNSW_EF)
    graph = getattr(index, "faiss_index", None) if getattr(index, "name", None) == "hnsw" \
        else None
    if graph is None or s["method"] not in ("auto", "hnsw") or graph.hnsw.nb_neighbors(1) != m:
        graph = build_hnsw(vectors, **kwargs)
    ef = graph.hnsw.efSearch
    graph.hnsw.efSearch = ef_search  # stored in the file; a reused index's own
    try:                             # searches pass theirs explicitly
        return write_output_file(path, lambda tmp: faiss.write_index(graph, str(tmp)),
                                 "export path")
    finally:
        graph.hnsw.efSearch = ef


def index_vectors(index: Index) -> torch.Tensor:
    """The rows held by a pefa_gpu index (IVF-PQ: decoded; sharded: its shards' rows)."""
    if isinstance(getattr(index, "vectors", None), torch.Tensor):
        return index.vectors
    stored = getattr(index, "_stored_vectors", None)
    if stored is not None:
        return stored()
    try:  # a sharded index (it said it could not, yet gives every row back)
        return index.reconstruct(torch.arange(index.ntotal, device=index.device))
    except NotImplementedError:
        raise InputError(f"cannot read the vectors back from {type(index).__name__}") from None


def export_parts(parts: tuple[torch.Tensor, Index] | dict[str, Any], path: str | Path,
                 **kwargs: Any) -> Path:
    """Write a model's ``_exported()``: (vectors, index) as one file (:func:`export_hnsw`), or
    a dict of file names to (vectors, index), scipy sparse matrices or JSON as a new folder
    (PEFAXL: relevance.npz rows are the training queries, then document j as row m + j)."""
    if isinstance(parts, tuple):
        return export_hnsw(parts[0], path, index=parts[1], **kwargs)
    path = as_path(path, "export path")
    if os.path.lexists(path):
        raise InputError(f"export path {path} exists; an export directory is always new: "
                         f"choose another path or remove it")
    if not path.parent.is_dir():
        raise InputError(f"cannot export to {path}: {path.parent} is not an existing folder")
    # a marked temporary folder, renamed when complete (its name cut as write_output_file's),
    # locked while its export runs: the cleanup removes those of killed exports only
    prefix = f".{path.name[:100]}.pefa-tmp-"
    for old in path.parent.glob(glob.escape(prefix) + "*"):
        if old.is_symlink() or not (old / _EXPORT_MARKER).is_file():
            continue
        held = lock_folder(old, wait=False)  # None: its export runs (or no flock here)
        if held is not None:
            shutil.rmtree(old, ignore_errors=True)
            os.close(held)
    tmp = path.parent / f"{prefix}{secrets.token_hex(6)}"
    tmp.mkdir()
    lock = lock_folder(tmp)
    try:
        (tmp / _EXPORT_MARKER).write_text("")
        for name, part in parts.items():
            if isinstance(part, tuple):
                export_hnsw(part[0], tmp / name, index=part[1], **kwargs)
            elif sp.issparse(part):
                sp.save_npz(tmp / name, part)
            else:
                (tmp / name).write_text(json.dumps(part, indent=2) + "\n")
        (tmp / _EXPORT_MARKER).unlink()
        if os.path.lexists(path):
            raise InputError(f"export path {path} appeared during the export; not replaced")
        os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing there once renamed
        if lock is not None:
            os.close(lock)
    return path


_EXPORT_MARKER = ".pefa-export-tmp"
