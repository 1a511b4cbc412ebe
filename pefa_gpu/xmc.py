"""The PEFA authors' data layout (PECOS ``examples/pefa-wsdm24``): an XMC folder of scipy
``save_npz`` matrices (rows: queries of a source, columns: the n documents) and an embedding
folder of one ``.npy`` (rows, d) matrix per source (row i = query row i); see ``FILES``.

Sources: trn / tst real training / test queries, abs document title + abstract, doc document
content, d2q docT5query questions. As in the authors' scripts, embedding rows are
L2-normalised, the passage embeddings are ``P = Π(Y_absᵀ X_abs)``, and the training pairs
stack the sources ``aug`` names (``AUGMENTATIONS``; their ``pefa_xs.py`` / ``pefa_xl.py``
use v5 with ``augment_docs=False``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from .aggregate import normalize_rows, pifa
from .arrays import as_tensor, to_numpy
from .errors import FormatError, InputError
from .params import check_flag
from .relevance import Relevance
from .storage import as_path, load_csr, read_matrix

log = logging.getLogger("pefa_gpu")

# aug_type -> the training sources stacked, in this order
AUGMENTATIONS: dict[str, tuple[str, ...]] = {
    "v0": ("trn",), "v1": ("doc",), "v2": ("d2q",),
    "v3": ("trn", "doc"), "v4": ("trn", "d2q"), "v5": ("trn", "doc", "d2q")}
# source -> (relevance file in the XMC folder, embedding file in the embedding folder)
FILES: dict[str, tuple[str, str]] = {
    "trn": ("Y.trn.npz", "X.trn.npy"),
    "tst": ("Y.tst.npz", "X.tst.npy"),
    "abs": ("Y.trn.abs.npz", "X.trn.abs.npy"),
    "doc": ("Y.trn.doc.npz", "X.trn.doc.npy"),
    "d2q": ("Y.trn.d2q.npz", "X.trn.d2q.npy"),
}


@dataclasses.dataclass
class XMCData:
    """P (n, d), Q (m, d), Q_test (t, d) float32; Y (m x n, the stacked ``aug`` sources) and
    Y_test (t x n, weights as stored); ``sources``: rows per stacked source."""

    name: str
    aug: str
    P: np.ndarray
    Q: np.ndarray
    Y: Relevance
    Q_test: np.ndarray
    Y_test: Relevance
    sources: dict[str, int]

    @property
    def n_docs(self) -> int:
        return int(self.P.shape[0])


def load_xmc(xmc_dir: str | Path, emb_dir: str | Path, aug: str = "v0",
             normalize: bool = True) -> XMCData:
    """Read the files ``aug`` needs (abs, tst and its sources) -> :class:`XMCData`;
    ``normalize=False`` keeps the embedding rows as stored."""
    if not isinstance(aug, str) or aug not in AUGMENTATIONS:  # ['v0']: unhashable type
        raise InputError(f"aug={aug!r} is not one of {sorted(AUGMENTATIONS)} "
                         f"(v0 trn, v1 doc, v2 d2q, v3 trn+doc, v4 trn+d2q, v5 trn+doc+d2q)")
    check_flag(normalize, "normalize")
    xmc_root, emb_root = _folder(xmc_dir, "XMC", "xmc_dir"), _folder(emb_dir, "embedding",
                                                                      "emb_dir")
    wanted = ("abs", "tst", *AUGMENTATIONS[aug])
    ys = {src: read_csr(_inside(xmc_root, FILES[src][0])) for src in wanted}
    xs = {src: read_matrix(_inside(emb_root, FILES[src][1])) for src in wanted}
    y_abs, x_abs = xmc_root / FILES["abs"][0], emb_root / FILES["abs"][1]
    n, d = ys["abs"].shape[1], xs["abs"].shape[1]
    if d == 0:
        raise InputError(f"{x_abs} has dimension 0")
    for src in wanted:  # each Y has its X's rows and the abstracts' columns; each X their dim
        y_path, x_path = xmc_root / FILES[src][0], emb_root / FILES[src][1]
        if ys[src].shape[0] != xs[src].shape[0]:
            raise InputError(f"{y_path} has {ys[src].shape[0]} rows but {x_path} has "
                             f"{xs[src].shape[0]}: row i of both must be the same query")
        if ys[src].shape[1] != n:
            raise InputError(f"{y_path} has {ys[src].shape[1]} document columns but {y_abs} "
                             f"has {n}")
        if xs[src].shape[1] != d:
            raise InputError(f"{x_path} has dimension {xs[src].shape[1]} but {x_abs} has {d}")
        if src != "tst" and ys[src].count_nonzero() == 0:  # nnz counted stored zeros
            raise InputError(f"{y_path} has no (query, document) pair")
    if normalize:
        xs = {src: to_numpy(normalize_rows(as_tensor(x, device="cpu"))) for src, x in xs.items()}
    P = to_numpy(pifa(ys["abs"], xs["abs"], normalize=True, device="cpu"))
    if missing := int(np.count_nonzero(ys["abs"].getnnz(axis=0) == 0)):
        log.warning("%s: %d of %d documents have no abstract row; their passage embedding is "
                    "zero (ERM cannot rank them above 0)", y_abs, missing, n)
    train = AUGMENTATIONS[aug]
    Q = np.ascontiguousarray(np.vstack([xs[s] for s in train]), dtype=np.float32)
    Y = sp.vstack([ys[s] for s in train], format="csr")
    return XMCData(name=xmc_root.name, aug=aug, P=np.ascontiguousarray(P, dtype=np.float32),
                   Q=Q, Y=Relevance(Y), Q_test=xs["tst"], Y_test=Relevance(ys["tst"]),
                   sources={s: int(ys[s].shape[0]) for s in train})


def _folder(path: str | Path, what: str, name: str) -> Path:
    root = Path(os.path.expanduser(as_path(path, name)))  # ~nouser stays: "does not exist"
    if not root.is_dir():
        raise InputError(f"{what} folder {root} does not exist or is not a folder")
    return root


def _inside(root: Path, name: str) -> Path:
    """``root / name``: an existing file inside ``root`` (links resolved)."""
    path = root / name
    if not path.is_file():
        raise InputError(f"{path} " + ("is not a file" if path.exists() else "not found"))
    if not path.resolve().is_relative_to(root.resolve()):
        raise InputError(f"{path} points outside {root} (to {path.resolve()}); the files of "
                         f"the folder must lie inside it")
    return path


def read_csr(path: Path) -> sp.csr_matrix:
    """A checked scipy ``save_npz`` CSR (or CSC) matrix -> float32 CSR (never unpickled; no
    member inflates past what its shape and nnz allow)."""
    try:
        mat = sp.csr_matrix(load_csr(path), dtype=np.float32)
    except FormatError as exc:
        raise FormatError(f"{path} is not a readable scipy sparse matrix (.npz from "
                          f"scipy.sparse.save_npz): {exc}") from None
    if mat.nnz and not np.isfinite(mat.data).all():
        raise FormatError(f"{path} holds NaN or inf entries")
    return mat


__all__ = ["AUGMENTATIONS", "FILES", "XMCData", "load_xmc", "read_csr"]
