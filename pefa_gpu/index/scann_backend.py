"""ScaNN (PyPI ``scann``: numpy + protobuf, TensorFlow not needed), dot-product search.

The paper names ScaNN among the ANN libraries PEFA sits on. The searcher is ScaNN's usual
tree + asymmetric hashing + exact re-ordering: a k-means tree of ``num_leaves`` leaves, of
which ``leaves_to_search`` are scored per query, with 4-bit anisotropic product quantisation
of ``dims_per_block`` dimensions per code, and the best ``reorder`` of those re-scored
exactly in float32, so returned scores are float32 inner products (``exact_scores``). The
tree is seeded by k-means++ (ScaNN's random seeding gave a different tree, and a different
Recall@10, in every process): the same vectors give the same index. Indices of fewer than
``brute_force_below`` rows are a float32 brute-force ScaNN searcher instead (exact).

Build settings are :class:`ScannParams`, search settings :class:`ScannSearchParams` (0 means
automatic, from the index size and k: :func:`auto_num_leaves`, :func:`auto_leaves_to_search`,
:func:`auto_reorder`). ``add`` appends rows to the trained tree without retraining (like IVF).
ScaNN does not hand back its vectors: no :meth:`reconstruct` (PEFA-XL's ``score`` /
``mine_negatives`` need it; search does not).

A saved index is ScaNN's own serialisation (protobuf and ``.npy`` assets, listed in
``scann_assets.pbtxt`` with paths relative to the folder) plus ``scann.json``. On load every
asset path must name a file inside the folder, and a folder holding ScaNN's pickled
``scann_docids.pkl`` is refused (a saved folder is data, never code).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import FormatError, InputError
from .base import IndexParams, count, import_optional, positive
from ._faiss import host_float32
from ._host import HostBackend, read_description, resolve_threads, write_description

META_FILE, ASSETS_FILE, PICKLE_FILE = "scann.json", "scann_assets.pbtxt", "scann_docids.pkl"
META_FORMAT = "pefa_gpu-scann"


def import_scann() -> Any:
    """ScaNN's numpy searcher module (never TensorFlow)."""
    package = import_optional("scann.scann_ops.py", "backend 'scann' needs ScaNN: `pip "
                              "install scann` (wheels for Linux x86-64), or `pip install "
                              "pefa_gpu[scann]`")
    return importlib.import_module(package.__name__ + ".scann_ops_pybind")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScannParams(IndexParams):
    """Build settings. num_leaves: k-means tree leaves (0 = :func:`auto_num_leaves`).
    dims_per_block: dimensions per 4-bit AH code. anisotropic_threshold: ScaNN's anisotropic
    quantisation threshold (its recommended 0.2 for dot products; None = plain k-means codes).
    train_size: rows sampled to train the tree and codebooks (0 = min(n, 100000)).
    brute_force_below: indices with fewer rows are an exact brute-force searcher.
    threads: for training and searching (0 = every core)."""

    num_leaves: int = count(0, "automatic")
    dims_per_block: int = positive(2)
    anisotropic_threshold: float | None = 0.2
    train_size: int = count(0, "automatic")
    brute_force_below: int = count(4096)
    threads: int = count(0, "every core")

    def validate(self) -> None:
        super().validate()
        t = self.anisotropic_threshold
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                              or not math.isfinite(t)):
            raise InputError(f"anisotropic_threshold must be a finite number or None, got {t!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScannSearchParams(IndexParams):
    """Search settings. leaves_to_search: tree leaves scored per query (0 =
    :func:`auto_leaves_to_search`). reorder: candidates re-scored exactly (0 =
    :func:`auto_reorder`; never fewer than k)."""

    leaves_to_search: int = count(0, "automatic")
    reorder: int = count(0, "automatic")


def auto_num_leaves(n: int) -> int:
    """sqrt(n) leaves (ScaNN's rule of thumb), at least 1 and at most n / 50 (its minimum
    leaf size)."""
    return int(max(1, min(round(math.sqrt(n)), n // 50)))


def auto_leaves_to_search(num_leaves: int) -> int:
    """Three quarters of the leaves, rounded up.

    Near-exact by default, as the ivf backend's nprobe: 384-d text embeddings do not fall into
    well-separated leaves. Held-out SciFact training queries (not the test split) find this
    share of the exact top-10 (ERM / PEFA-XS vectors, 5183 rows, 72 leaves): 1/2 searched
    98.5% / 98.6%, 5/8 99.4% / 99.5%, 2/3 99.6% / 99.6%, 3/4 99.8% / 99.8% (of the top-100:
    97.1 / 97.3, 98.8 / 98.7, 99.1 / 99.0, 99.5 / 99.5%). Lower it for speed:
    benchmarks/peers.py plots recall against QPS over it.
    """
    return int(-(-3 * num_leaves // 4))


def auto_reorder(k: int) -> int:
    """max(4k, 100) candidates re-scored exactly."""
    return max(4 * k, 100)


class ScannIndex(HostBackend):
    """ScaNN tree + AH + exact re-ordering (or brute force for small indices), inner product,
    on the CPU; results on ``device``."""

    name = "scann"
    Params = ScannParams
    SearchParams = ScannSearchParams
    exact_scores = True  # float32 re-ordering (or float32 brute force) scores every result

    def __init__(self, params: ScannParams | dict | None = None, device: Any = None):
        super().__init__(params, device)
        self._scann = import_scann()
        self._searcher: Any = None
        self._leaves = 0  # 0: a brute-force searcher

    @property
    def ntotal(self) -> int:
        return int(self._searcher.size()) if self._searcher is not None else 0

    @property
    def num_leaves(self) -> int:
        """Leaves of the trained tree (0 for a brute-force searcher)."""
        return self._leaves

    def build(self, vectors: Any) -> "ScannIndex":
        """vectors: (n, d) float, n >= 1 -> a freshly trained searcher; returns self."""
        x = host_float32(vectors, "vectors")
        n, d = x.shape
        if n == 0 or d == 0:
            raise InputError(f"scann needs a non-empty (n, d) matrix, got {x.shape}")
        p = self.params
        builder = self._scann.builder(x, 10, "dot_product")
        builder.set_n_training_threads(resolve_threads(p.threads))
        if n < p.brute_force_below:
            leaves = 0
            builder = builder.score_brute_force(False)
        else:
            leaves = p.num_leaves or auto_num_leaves(n)
            if leaves > n:
                raise InputError(f"num_leaves={leaves} is more than the {n} vectors")
            sample = min(n, p.train_size or 100_000)
            threshold = float("nan") if p.anisotropic_threshold is None else \
                p.anisotropic_threshold
            builder = (builder
                       .tree(num_leaves=leaves, num_leaves_to_search=auto_leaves_to_search(leaves),
                             training_sample_size=sample, random_init=False)
                       .score_ah(p.dims_per_block, anisotropic_quantization_threshold=threshold,
                                 training_sample_size=sample)
                       .reorder(auto_reorder(10)))
        searcher = builder.build()
        searcher.set_num_threads(resolve_threads(p.threads))
        self._searcher, self._dim, self._leaves = searcher, d, leaves
        return self

    def _append(self, x: np.ndarray) -> None:
        """Into the trained searcher (no retraining)."""
        self._searcher.searcher.upsert([None] * x.shape[0], list(x), min(x.shape[0], 256))

    def _raw_search(self, q: np.ndarray, k: int, params: ScannSearchParams
                    ) -> tuple[np.ndarray, np.ndarray]:
        if self._leaves and k >= self.ntotal:  # every row asked for: score them all
            leaves, reorder = self._leaves, k
        elif self._leaves:
            leaves = min(params.leaves_to_search or auto_leaves_to_search(self._leaves),
                         self._leaves)
            reorder = max(params.reorder or auto_reorder(k), k)
        else:
            leaves = reorder = -1  # brute force: no tree, every score exact already
        if q.shape[0] > 1 and resolve_threads(self.params.threads) > 1:
            ids, dist = self._searcher.search_batched_parallel(q, k, reorder, leaves)
        else:
            ids, dist = self._searcher.search_batched(q, k, reorder, leaves)
        ids, dist = np.asarray(ids), np.asarray(dist, dtype=np.float32)
        missing = np.isnan(dist)  # ScaNN pads with NaN distances (and id 0)
        ids = np.where(missing, -1, ids.astype(np.int64))
        return dist, ids

    # -- persistence ---------------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        """ScaNN's assets (relative paths) and ``scann.json`` into the existing, empty
        ``directory``."""
        directory = self._save_dir(directory)
        self._searcher.serialize(str(directory), relative_path=True)
        write_description(directory / META_FILE, META_FORMAT, dim=self.dim,
                          ntotal=self.ntotal, num_leaves=self._leaves)

    @classmethod
    def load(cls, directory: str | Path, params: ScannParams | dict | None = None,
             device: Any = None) -> "ScannIndex":
        """Read an index written by :meth:`save` (see the module docstring for the checks)."""
        directory = Path(directory)
        meta_path = directory / META_FILE
        meta = read_description(meta_path, META_FORMAT)
        dim, ntotal, leaves = meta["dim"], meta["ntotal"], meta.get("num_leaves")
        if isinstance(leaves, bool) or not isinstance(leaves, int) or leaves < 0:
            raise FormatError(f"{meta_path}: num_leaves must be an int >= 0, got {leaves!r}")
        if (directory / PICKLE_FILE).exists():
            raise FormatError(f"{directory / PICKLE_FILE} is a pickle: a saved index is data, "
                              f"never code; refusing to load {directory}")
        _check_arrays(_check_assets(directory), dim, ntotal, leaves)
        out = cls(params, device)
        try:
            searcher = out._scann.load_searcher(str(directory), assets_backcompat_shim=False)
        except (RuntimeError, ValueError, IndexError) as exc:  # IndexError: a C++ range check
            raise FormatError(f"{directory} could not be read by ScaNN: {exc}") from exc
        if searcher.size() != ntotal:
            raise FormatError(f"{directory} holds {searcher.size()} vectors; {meta_path} says "
                              f"{ntotal}")
        searcher.set_num_threads(resolve_threads(out.params.threads))
        out._searcher, out._dim, out._leaves = searcher, dim, leaves
        return out


def _check_assets(directory: Path) -> dict[str, Path]:
    """Every asset ``scann_assets.pbtxt`` lists is a plain file name inside ``directory``;
    returns {asset type name (e.g. "TOKENIZATION_NPY"): path}."""
    path = directory / ASSETS_FILE
    if not path.is_file():
        raise FormatError(f"{path} is missing: not a saved 'scann' index")
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
        if (not name or os.path.isabs(name) or Path(name).name != name
                or target.parent != root or not target.is_file()):
            raise FormatError(f"{path} lists asset {name!r}, which is not a file inside "
                              f"{directory}")
        kind = asset.DESCRIPTOR.fields_by_name["asset_type"].enum_type
        found[kind.values_by_number[asset.asset_type].name] = directory / name
    return found


def _check_arrays(assets: dict[str, Path], dim: int, ntotal: int, leaves: int) -> None:
    """The arrays ScaNN indexes with, before it reads them (it trusts them): the vectors
    (ntotal, dim) float32; with a tree, every row's leaf in [0, num_leaves) and every 4-bit
    code below the codebook's size; else FormatError naming the file."""
    from ..storage import read_npy  # noqa: PLC0415

    def array(kind: str, dtype: str, shape: tuple) -> np.ndarray | None:
        if kind not in assets:
            return None
        a = read_npy(assets[kind], mmap_mode="r")
        if a.dtype != np.dtype(dtype) or a.shape[:len(shape)] != shape or a.ndim < len(shape):
            want = ", ".join([*map(str, shape), *["..."] * (a.ndim > len(shape))])
            raise FormatError(f"{assets[kind]} holds {a.dtype} of shape {a.shape}, expected "
                              f"{dtype} of shape ({want})")
        return a

    array("DATASET_NPY", "float32", (ntotal, dim))
    tokens = array("TOKENIZATION_NPY", "int32", (ntotal,))
    if tokens is not None and tokens.size and (tokens.min() < 0 or tokens.max() >= leaves):
        raise FormatError(f"{assets['TOKENIZATION_NPY']} assigns rows to leaves "
                          f"{tokens.min()}..{tokens.max()}; the tree has {leaves}")
    codes = array("AH_DATASET_NPY", "uint8", (ntotal,))
    if codes is not None and codes.size and codes.max() >= 16:
        raise FormatError(f"{assets['AH_DATASET_NPY']} holds code {codes.max()}; 4-bit codes "
                          f"are below 16")
