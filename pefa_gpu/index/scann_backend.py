"""ScaNN (PyPI ``scann``, numpy API, no TensorFlow), dot product, on the CPU: a k-means tree,
4-bit AH codes and the best ``reorder`` re-scored in float32. No :meth:`reconstruct`."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
from pathlib import Path
from typing import Any

import numpy as np

from ..arrays import DeviceLike, finite_array
from ..errors import FormatError, InputError
from ..params import (FLOAT32_MAX, MAX_THREADS, check_at_most, check_nonnegative, check_number,
                      checked)
from ..storage import read_npy
from .base import IndexParams, import_optional
from ._host import HostBackend, check_row_norms, read_description, write_description

META_FILE, ASSETS_FILE, PICKLE_FILE = "scann.json", "scann_assets.pbtxt", "scann_docids.pkl"
META_FORMAT = "pefa_gpu-scann"
# a tree's k-means: |x - c|^2 <= 4 max|x|^2 in float32 (rows of norm 1.8e19 aborted the process
# in ScaNN's C++, 'Check failed: cluster_idx < num_clusters'; an add of 1e30 rows segfaulted)
MAX_TREE_NORM = math.sqrt(FLOAT32_MAX) / 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScannParams(IndexParams):
    """Build settings. num_leaves: tree leaves (0 = :func:`auto_num_leaves`). dims_per_block:
    dimensions per 4-bit AH code. anisotropic_threshold: ScaNN's (0.2 for dot products; None =
    plain k-means codes). train_size: training sample (0 = min(n, 100000)).
    brute_force_below: fewer rows are searched by brute force. threads: 0 = every core."""

    num_leaves: int = checked(0, check_nonnegative, "automatic")
    dims_per_block: int = checked(2, check_at_most, 2**31 - 1)  # a C int: 2^31 aborted ScaNN
    anisotropic_threshold: float | None = checked(0.2, check_number, True)
    train_size: int = checked(0, check_nonnegative, "automatic")
    brute_force_below: int = checked(4096, check_nonnegative)
    threads: int = checked(0, check_nonnegative, "every core", MAX_THREADS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScannSearchParams(IndexParams):
    """leaves_to_search: leaves scored per query, reorder: candidates re-scored exactly (at
    least k); 0: :func:`auto_leaves_to_search`, :func:`auto_reorder`."""

    leaves_to_search: int = checked(0, check_nonnegative, "automatic")
    reorder: int = checked(0, check_nonnegative, "automatic")


def auto_num_leaves(n: int) -> int:
    """sqrt(n) leaves, at least 1, at most n / 50 (ScaNN's minimum leaf size)."""
    return int(max(1, min(round(math.sqrt(n)), n // 50)))


def auto_leaves_to_search(num_leaves: int) -> int:
    """Three quarters of the leaves, rounded up."""
    return int(-(-3 * num_leaves // 4))


def auto_reorder(k: int) -> int:
    """max(4k, 100) candidates re-scored exactly."""
    return max(4 * k, 100)


class ScannIndex(HostBackend):
    """ScaNN tree + AH + exact re-ordering (or brute force), inner product, on the CPU."""

    name = "scann"
    Params = ScannParams
    SearchParams = ScannSearchParams
    exact_scores = True  # float32 re-ordering (or float32 brute force) scores every result

    def __init__(self, params: ScannParams | dict | None = None, device: DeviceLike = None):
        super().__init__(params, device)
        package = import_optional("scann.scann_ops.py", "backend 'scann' needs ScaNN: `pip "
                                  "install scann` (wheels for Linux x86-64), or `pip install "
                                  "pefa_gpu[scann]`")
        # ScaNN's numpy searcher module (never TensorFlow)
        self._scann = importlib.import_module(package.__name__ + ".scann_ops_pybind")
        self.num_leaves = 0  # leaves of the trained tree (0: a brute-force searcher)

    def _count(self) -> int:
        return int(self._index.size())

    def _new_index(self, x: np.ndarray) -> Any:
        n, p = x.shape[0], self.params
        builder = self._scann.builder(x, 10, "dot_product")
        builder.set_n_training_threads(self.threads)
        if n < p.brute_force_below:
            leaves = 0
            builder = builder.score_brute_force(False)
        else:
            check_row_norms(x, MAX_TREE_NORM, "scann's float32 tree")
            leaves = p.num_leaves or auto_num_leaves(n)
            if leaves > n:
                raise InputError(f"num_leaves={leaves} is more than the {n} vectors")
            sample = min(n, p.train_size or 100_000)
            if sample < leaves:
                raise InputError(f"{sample} training vectors for num_leaves={leaves}: k-means "
                                 f"needs at least {leaves}; raise train_size or lower num_leaves")
            threshold = float("nan") if p.anisotropic_threshold is None else p.anisotropic_threshold
            builder = (builder
                       .tree(num_leaves=leaves, num_leaves_to_search=auto_leaves_to_search(leaves),
                             training_sample_size=sample, random_init=False)
                       .score_ah(p.dims_per_block, anisotropic_quantization_threshold=threshold,
                                 training_sample_size=sample)
                       .reorder(auto_reorder(10)))
        searcher = builder.build()
        searcher.set_num_threads(self.threads)
        self.num_leaves = leaves
        return searcher

    def _append(self, x: np.ndarray) -> None:
        if self.num_leaves:  # rows join the tree's leaves
            check_row_norms(x, MAX_TREE_NORM, "scann's float32 tree")
        self._index.searcher.upsert([None] * x.shape[0], list(x), min(x.shape[0], 256))

    def _raw_search(self, q: np.ndarray, k: int, params: ScannSearchParams
                    ) -> tuple[np.ndarray, np.ndarray]:
        if self.num_leaves and k >= self.ntotal:  # every row asked for: score them all
            leaves, reorder = self.num_leaves, k
        elif self.num_leaves:
            leaves = min(params.leaves_to_search or auto_leaves_to_search(self.num_leaves),
                         self.num_leaves)
            # at most every row (k < ntotal here): ScaNN takes a C int (2^31 was a TypeError)
            reorder = min(max(params.reorder or auto_reorder(k), k), self.ntotal)
        else:
            leaves = reorder = -1  # brute force: no tree, every score exact already
        parallel = q.shape[0] > 1 and self.threads > 1
        search = self._index.search_batched_parallel if parallel else self._index.search_batched
        ids, dist = search(q, k, reorder, leaves)
        dist = np.asarray(dist, dtype=np.float32)
        # ScaNN pads with NaN distances (and id 0)
        return dist, np.where(np.isnan(dist), -1, np.asarray(ids, dtype=np.int64))

    def save(self, directory: str | Path) -> None:
        """ScaNN's assets (relative paths) and ``scann.json`` into ``directory``."""
        directory = self._save_dir(directory)
        self._index.serialize(str(directory), relative_path=True)
        write_description(directory / META_FILE, META_FORMAT, dim=self.dim,
                          ntotal=self.ntotal, num_leaves=self.num_leaves)

    @classmethod
    def load(cls, directory: str | Path, params: ScannParams | dict | None = None,
             device: DeviceLike = None) -> "ScannIndex":
        """Read an index written by :meth:`save`, its files checked first."""
        meta_path = cls._saved_file(directory, META_FILE)
        directory = meta_path.parent
        meta = read_description(meta_path, META_FORMAT)
        dim, ntotal, leaves = meta["dim"], meta["ntotal"], meta.get("num_leaves")
        # a tree has at most a leaf a row (2^31 was pybind's TypeError at every search)
        if type(leaves) is not int or not 0 <= leaves <= ntotal:  # (a bool is not)
            raise FormatError(f"{meta_path}: num_leaves must be an int in [0, ntotal={ntotal}], "
                              f"got {leaves!r}")
        if (directory / PICKLE_FILE).exists():
            raise FormatError(f"{directory / PICKLE_FILE} is a pickle: a saved index is data, "
                              f"never code; refusing to load {directory}")
        assets = _check_assets(directory)
        if "DATASET_NPY" not in assets:  # every save lists it (a tree without: ScaNN's abort)
            raise FormatError(f"{directory / ASSETS_FILE} lists no DATASET_NPY asset (the "
                              f"vectors): not a pefa_gpu save")
        _check_arrays(assets, dim, ntotal, leaves)
        out = cls(params, device)
        try:
            searcher = out._scann.load_searcher(str(directory), assets_backcompat_shim=False)
        except (RuntimeError, ValueError, IndexError) as exc:  # IndexError: a C++ range check
            raise FormatError(f"{directory} could not be read by ScaNN: {exc}") from exc
        if searcher.size() != ntotal:
            raise FormatError(f"{directory} holds {searcher.size()} vectors; {meta_path} says "
                              f"{ntotal}")
        searcher.set_num_threads(out.threads)
        out._index, out._dim, out.num_leaves = searcher, dim, leaves
        try:  # a config ScaNN loads may fail every search (AH blocks short of the dimension)
            out._raw_search(np.zeros((1, dim), np.float32), 1, out.search_params)
        except RuntimeError as exc:
            raise FormatError(f"{directory} could not be searched by ScaNN: {exc}") from exc
        return out


def _check_assets(directory: Path) -> dict[str, Path]:
    """{asset type (e.g. "TOKENIZATION_NPY"): path} of ``scann_assets.pbtxt``, each a plain
    file name inside ``directory``."""
    path = ScannIndex._saved_file(directory, ASSETS_FILE)
    from google.protobuf import text_format  # noqa: PLC0415 (ScaNN's dependency)
    from scann.scann_ops import scann_assets_pb2  # noqa: PLC0415

    try:
        assets = text_format.Parse(path.read_text(), scann_assets_pb2.ScannAssets())
    except (text_format.ParseError, UnicodeDecodeError) as exc:
        raise FormatError(f"{path} is not a ScaNN asset list: {exc}") from exc
    root = directory.resolve()
    found = {}
    for asset in assets.assets:
        name = asset.asset_path
        target = (directory / name).resolve()
        if not name or Path(name).name != name or target.parent != root or not target.is_file():
            raise FormatError(f"{path} lists asset {name!r}, which is not a file inside "
                              f"{directory}")
        kind = asset.DESCRIPTOR.fields_by_name["asset_type"].enum_type
        found[kind.values_by_number[asset.asset_type].name] = directory / name
    return found


def _check_arrays(assets: dict[str, Path], dim: int, ntotal: int, leaves: int) -> None:
    """FormatError unless the arrays ScaNN trusts fit: vectors (ntotal, dim) float32, leaves
    in [0, num_leaves), 4-bit codes below 16."""
    def array(kind: str, dtype: str, shape: tuple) -> np.ndarray | None:
        if kind not in assets:
            return None
        a = read_npy(assets[kind], mmap_mode="r")
        if a.dtype != np.dtype(dtype) or a.shape[:len(shape)] != shape:  # (or fewer dims)
            want = ", ".join([*map(str, shape), *["..."] * (a.ndim > len(shape))])
            raise FormatError(f"{assets[kind]} holds {a.dtype} of shape {a.shape}, expected "
                              f"{dtype} of shape ({want})")
        return a

    rows = array("DATASET_NPY", "float32", (ntotal, dim))  # listed: load checked
    top = MAX_TREE_NORM if leaves else math.inf  # a tree's build and add refuse rows beyond
    norms = np.einsum("ij,ij->i", rows, rows, dtype=np.float64)
    if not (finite_array(rows) and norms.max(initial=0.0) <= top ** 2):
        raise FormatError(f"{assets['DATASET_NPY']} holds NaN or inf" + (
            f", or a row norm beyond what a tree holds ({top:.3g})" if leaves else ""))
    tokens = array("TOKENIZATION_NPY", "int32", (ntotal,))
    if tokens is not None and tokens.size and (tokens.min() < 0 or tokens.max() >= leaves):
        raise FormatError(f"{assets['TOKENIZATION_NPY']} assigns rows to leaves "
                          f"{tokens.min()}..{tokens.max()}; the tree has {leaves}")
    if "PARTITIONER" in assets or leaves:
        _check_tree(assets.get("PARTITIONER", assets["DATASET_NPY"].parent / ASSETS_FILE),
                    dim, leaves)
    codes = array("AH_DATASET_NPY", "uint8", (ntotal,))
    if codes is not None and codes.size and codes.max() >= 16:
        raise FormatError(f"{assets['AH_DATASET_NPY']} holds code {codes.max()}; 4-bit codes "
                          f"are below 16")


def _check_tree(path: Path, dim: int, leaves: int) -> None:
    """FormatError unless ScaNN's partitioner (trusted: a NaN centre segfaulted a search) is one
    level of ``leaves`` finite centres of dimension ``dim`` over the leaves 0..leaves-1."""
    from google.protobuf.message import DecodeError  # noqa: PLC0415 (ScaNN's dependency)
    from scann.partitioning import partitioner_pb2  # noqa: PLC0415

    tree = partitioner_pb2.SerializedPartitioner()
    with contextlib.suppress(DecodeError, OSError):  # an empty tree, refused below
        tree.ParseFromString(path.read_bytes())
    root = tree.kmeans.kmeans_tree.root
    centres = [np.asarray(c.dimension, np.float64) for c in root.centers]
    if (tree.n_tokens, len(centres), sorted(c.leaf_id for c in root.children)) != (
            leaves, leaves, list(range(leaves))) or any(c.children or c.centers for c in
                                                       root.children) or not all(
            c.shape == (dim,) and np.isfinite(c).all() for c in centres):
        raise FormatError(f"{path}: ScaNN's tree is not {leaves} finite centres of dimension "
                          f"{dim} over leaves 0..{leaves - 1} (forged, damaged or missing)")
