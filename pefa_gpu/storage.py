"""Files on disk: tensors and CSR matrices as .npy / .npz, checksums, atomic directories.

The building blocks of :mod:`pefa_gpu.persist` and of the index backends' ``save`` / ``load``::

    meta = save_tensor(tmp / "vectors", t)          # writes vectors.npy, returns its dtype / shape
    t = load_tensor(tmp / "vectors.npy", "cpu", mmap=True)

    with atomic_directory("model") as tmp:          # write into tmp; on success it becomes model/
        ...
        write_manifest(tmp, {...})                  # adds a sha256 + size for every file

Tensors are plain ``.npy`` files that numpy reads directly. Dtypes numpy lacks are stored
losslessly under a one-field structured dtype naming them: bfloat16 as ``[('bfloat16', '<u2')]``
(the raw bits), bool as ``[('bool', 'u1')]``. Nothing is ever pickled.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import uuid
import zipfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import scipy.sparse as sp
import torch

from .arrays import as_tensor, dtype_name, to_numpy
from .errors import FormatError, InputError

log = logging.getLogger("pefa_gpu")

FORMAT = "pefa_gpu"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
BACKUP_SUFFIX = ".pefa-backup"
_TMP_TAG = ".pefa-tmp-"

# torch dtypes numpy cannot hold (or that as_tensor refuses): (field name, raw numpy dtype)
_WRAPPED = {torch.bfloat16: ("bfloat16", np.dtype("<u2")), torch.bool: ("bool", np.dtype("u1"))}
_BY_FIELD = {field: (tdtype, raw) for tdtype, (field, raw) in _WRAPPED.items()}

PathLike = str | os.PathLike


# ---------------------------------------------------------------------------- tensors

def _npy(path: PathLike) -> Path:
    p = Path(path)
    return p if p.suffix == ".npy" else p.with_name(p.name + ".npy")


def save_tensor(path: PathLike, tensor: torch.Tensor) -> dict[str, Any]:
    """Write ``tensor`` (any shape, dtype, device) to ``path`` + ``.npy``.

    Returns ``{"file": name, "dtype": torch dtype name, "shape": [...]}`` for a manifest.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"save_tensor takes a torch.Tensor, got {type(tensor).__name__}")
    out = _npy(path)
    t = tensor.detach()
    if t.dtype in _WRAPPED:
        field, raw = _WRAPPED[t.dtype]
        signed = torch.int16 if raw.itemsize == 2 else torch.uint8
        arr = to_numpy(t.contiguous().view(signed)).view(raw).view([(field, raw)])
    elif t.dtype == torch.float16:  # to_numpy widens half precision; keep it bit-exact
        arr = to_numpy(t.contiguous().view(torch.int16)).view(np.float16)
    else:
        arr = to_numpy(t)
    with open(out, "wb") as fh:
        np.save(fh, arr, allow_pickle=False)
    return {"file": out.name, "dtype": dtype_name(t.dtype), "shape": list(t.shape)}


def load_tensor(path: PathLike, device: Any = None, mmap: bool = False,
                meta: dict[str, Any] | None = None) -> torch.Tensor:
    """Read a ``.npy`` written by :func:`save_tensor` onto ``device``.

    ``mmap=True`` maps the file copy-on-write instead of reading it (a CPU tensor then shares
    the pages with the file; on CUDA it only saves a host copy). ``meta`` (the dict
    :func:`save_tensor` returned) is checked against the file: a different dtype or shape, a
    truncated or malformed file raise :class:`FormatError` naming the file.
    """
    p = _npy(path)
    if not p.is_file():
        raise FormatError(f"{p} is missing")
    try:
        arr = np.load(p, mmap_mode="c" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise FormatError(f"{p} is truncated or not a valid .npy file: {exc}") from exc
    if arr.dtype.names:  # a wrapped dtype
        field = arr.dtype.names[0]
        if len(arr.dtype.names) != 1 or field not in _BY_FIELD:
            raise FormatError(f"{p} holds an unknown structured dtype {arr.dtype}")
        tdtype, raw = _BY_FIELD[field]
        arr = arr.view(raw)
        signed = np.int16 if raw.itemsize == 2 else np.uint8
        t = as_tensor(arr.view(signed), device=device, name=str(p))
        t = t.view(tdtype) if tdtype != torch.bool else t.bool()
    else:
        t = as_tensor(arr, device=device, name=str(p))
    if meta is not None:
        want = (meta.get("dtype"), list(meta.get("shape", [])))
        got = (dtype_name(t.dtype), list(t.shape))
        if want != got:
            raise FormatError(f"{p} holds dtype {got[0]} shape {tuple(got[1])}, but the manifest "
                              f"says dtype {want[0]} shape {tuple(want[1])}")
    return t


# ---------------------------------------------------------------------------- sparse

def _npz(path: PathLike) -> Path:
    p = Path(path)
    return p if p.suffix == ".npz" else p.with_name(p.name + ".npz")


def save_csr(path: PathLike, matrix: sp.spmatrix | sp.sparray) -> dict[str, Any]:
    """Write a scipy sparse matrix as CSR to ``path`` + ``.npz`` (indptr, indices, data, shape).

    Returns ``{"file", "shape", "nnz", "dtype"}`` for a manifest. Always read fully into memory.
    """
    if not sp.issparse(matrix):
        raise TypeError(f"save_csr takes a scipy sparse matrix, got {type(matrix).__name__}")
    csr = sp.csr_matrix(matrix)
    out = _npz(path)
    with open(out, "wb") as fh:
        np.savez(fh, indptr=csr.indptr, indices=csr.indices, data=csr.data,
                 shape=np.asarray(csr.shape, dtype=np.int64))
    return {"file": out.name, "shape": list(csr.shape), "nnz": int(csr.nnz),
            "dtype": str(csr.dtype)}


def load_csr(path: PathLike, meta: dict[str, Any] | None = None) -> sp.csr_matrix:
    """Read a matrix written by :func:`save_csr`; malformed files raise :class:`FormatError`."""
    p = _npz(path)
    if not p.is_file():
        raise FormatError(f"{p} is missing")
    try:
        with np.load(p, allow_pickle=False) as z:
            parts = {k: z[k] for k in ("indptr", "indices", "data", "shape")}
        csr = sp.csr_matrix((parts["data"], parts["indices"], parts["indptr"]),
                            shape=tuple(int(s) for s in parts["shape"]))
        csr.check_format(full_check=True)
    except (ValueError, OSError, EOFError, KeyError, zipfile.BadZipFile) as exc:
        raise FormatError(f"{p} is truncated or not a valid CSR .npz file: {exc}") from exc
    if meta is not None and (list(csr.shape) != list(meta.get("shape", [])) or
                             csr.nnz != meta.get("nnz")):
        raise FormatError(f"{p} holds shape {csr.shape} nnz {csr.nnz}, but the manifest says "
                          f"shape {tuple(meta.get('shape', []))} nnz {meta.get('nnz')}")
    return csr


# ---------------------------------------------------------------------------- checksums

def sha256_file(path: PathLike, block: int = 4 * 2**20) -> str:
    """Hex sha256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            h.update(chunk)
    return h.hexdigest()


def describe_files(root: PathLike) -> dict[str, dict[str, Any]]:
    """``{relative posix path: {"bytes", "sha256"}}`` for every file under ``root`` except the
    manifest."""
    root = Path(root)
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p != root / MANIFEST:
            rel = p.relative_to(root).as_posix()
            out[rel] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
    return out


def verify_files(root: PathLike, files: dict[str, dict[str, Any]], checksums: bool = True) -> None:
    """Check that every file listed in a manifest exists with its size (and, with ``checksums``,
    its sha256); raise :class:`FormatError` naming the first file that does not."""
    root = Path(root)
    for rel, info in files.items():
        if not isinstance(rel, str) or rel.startswith("/") or ".." in Path(rel).parts:
            raise FormatError(f"{root / MANIFEST} lists an unsafe file name {rel!r}")
        p = root / rel
        if not p.is_file():
            raise FormatError(f"{p} is missing (listed in {MANIFEST})")
        size = p.stat().st_size
        if size != info.get("bytes"):
            what = "truncated" if size < info.get("bytes", 0) else "longer than saved"
            raise FormatError(f"{p} is {what}: {size} bytes, the manifest says {info.get('bytes')}")
        if checksums and sha256_file(p) != info.get("sha256"):
            raise FormatError(f"{p} is corrupted: its sha256 does not match the manifest")


# ---------------------------------------------------------------------------- manifest

def write_manifest(root: PathLike, manifest: dict[str, Any]) -> dict[str, Any]:
    """Write ``manifest.json`` into ``root`` with ``format``, ``format_version`` and a
    ``files`` table (size + sha256 of every other file under ``root``). Returns what it wrote."""
    root = Path(root)
    files = describe_files(root)
    _link_duplicates(root, files)
    full = {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest, "files": files}
    try:
        text = json.dumps(full, indent=1, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InputError(f"the manifest cannot be written as JSON: {exc}") from exc
    (root / MANIFEST).write_text(text + "\n", encoding="utf-8")
    return full


def _link_duplicates(root: Path, files: dict[str, dict[str, Any]]) -> None:
    """Hard-link files with identical contents (e.g. an exact index over the document
    embeddings it also saves), so they take disk space, and page cache when mapped, once.
    Where the file system cannot link, the copies stay."""
    first: dict[tuple[int, str], Path] = {}
    for rel, info in files.items():
        key = (info["bytes"], info["sha256"])
        if info["bytes"] == 0 or key not in first:
            first.setdefault(key, root / rel)
            continue
        dup = root / rel
        spare = dup.with_name(dup.name + ".link")
        try:
            os.link(first[key], spare)
            os.replace(spare, dup)
        except OSError:
            spare.unlink(missing_ok=True)


def read_manifest(root: PathLike) -> dict[str, Any]:
    """Read and check ``manifest.json``: a pefa_gpu save of a format version this library
    reads. Raises :class:`FormatError` for a foreign, malformed or newer directory."""
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        raise FormatError(f"{root} is not a pefa_gpu save: it has no {MANIFEST}")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormatError(f"{path} is not valid JSON (truncated or corrupted?): {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise FormatError(f"{path} is not a pefa_gpu manifest (format="
                          f"{manifest.get('format') if isinstance(manifest, dict) else None!r})")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise FormatError(f"{path} has no integer format_version (got {version!r})")
    if version > FORMAT_VERSION:
        raise FormatError(f"{path} has format_version {version}, newer than this pefa_gpu reads "
                          f"({FORMAT_VERSION}); upgrade pefa_gpu to load it")
    if version < 1:
        raise FormatError(f"{path} has an invalid format_version {version}")
    if not isinstance(manifest.get("files"), dict):
        raise FormatError(f"{path} has no 'files' table")
    return manifest


# ---------------------------------------------------------------------------- atomic directories

def backup_path(target: PathLike) -> Path:
    """Where :func:`atomic_directory` keeps the previous save while swapping in a new one."""
    target = Path(target)
    return target.with_name(target.name + BACKUP_SUFFIX)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms that cannot open directories (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: PathLike) -> None:
    """fsync every file and directory under ``root`` (and ``root`` itself)."""
    root = Path(root)
    for p in root.rglob("*"):
        if p.is_file():
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())
        elif p.is_dir():
            _fsync_dir(p)
    _fsync_dir(root)


def _check_replaceable(target: Path) -> None:
    if not target.exists():
        return
    if not target.is_dir():
        raise InputError(f"cannot save to {target}: it exists and is not a directory")
    if not any(target.iterdir()):
        return
    try:
        read_manifest(target)
    except FormatError as exc:
        raise InputError(f"refusing to replace {target}: it is a non-empty directory that is "
                         f"not a pefa_gpu save ({exc})") from None


@contextlib.contextmanager
def atomic_directory(target: PathLike) -> Iterator[Path]:
    """Yield a fresh temporary directory next to ``target``; when the block ends without an
    error it replaces ``target``, else it is removed and ``target`` is untouched.

    The swap: fsync the new tree, rename an existing ``target`` to ``target.pefa-backup``,
    rename the new tree to ``target``, delete the backup. A crash at any point leaves either
    the old or the new save under ``target``, or the old one under the backup name, which
    :func:`resolve_save` falls back to. A non-empty ``target`` that is not a pefa_gpu save is
    never replaced. Concurrent saves to one target are not supported.
    """
    target = Path(target).absolute()
    _check_replaceable(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # os.mkdir, not tempfile.mkdtemp: the save must get the umask's permissions, not 0700
    tmp = target.parent / f".{target.name}{_TMP_TAG}{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        _check_replaceable(target)
        backup = backup_path(target)
        if target.exists():
            if backup.exists():  # a stale backup from an earlier crash; target is newer
                shutil.rmtree(backup)
            os.replace(target, backup)
            try:
                os.replace(tmp, target)
            except BaseException:
                os.replace(backup, target)  # put the old save back
                raise
            _fsync_dir(target.parent)
            shutil.rmtree(backup)
        else:
            os.replace(tmp, target)
            if backup.exists():  # target was lost between the renames of an earlier crash
                shutil.rmtree(backup)
        _fsync_dir(target.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def resolve_save(directory: PathLike) -> Path:
    """The directory to read for a save at ``directory``: itself, or its backup when a crash
    during a replacing save left only the backup (logged as a warning)."""
    path = Path(directory)
    if path.is_dir():
        return path
    backup = backup_path(path)
    if not path.exists() and (backup / MANIFEST).is_file():
        log.warning("%s is missing but %s exists (a save was interrupted); loading the "
                    "previous save from the backup", path, backup)
        return backup
    if path.exists():
        raise FormatError(f"{path} is not a directory: a pefa_gpu save is a directory")
    raise FileNotFoundError(f"no pefa_gpu save at {path}")
