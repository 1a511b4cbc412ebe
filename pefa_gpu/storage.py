"""Files on disk: tensors (.npy) and CSR matrices (.npz), checksummed save folders
(:func:`writing_save` / :func:`open_save`), output files written atomically.

A save folder holds ``manifest.json`` (a files table of size + sha256 each, checksummed as a
whole by ``manifest_sha256``) and one ``pefa-data-<16 hex>`` folder with the files. Dtypes numpy
lacks are stored as one-field structured dtypes: bfloat16 as ``[('bfloat16', '<u2')]`` (raw
bits), bool as ``[('bool', 'u1')]``. Nothing is ever pickled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import stat
import tokenize
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import scipy.sparse as sp
import torch

try:
    import fcntl
except ImportError:  # Windows: saves into one folder are not serialised
    fcntl = None

from .arrays import DeviceLike, as_tensor, dtype_name, finite_array, to_numpy
from .errors import FormatError, InputError

log = logging.getLogger("pefa_gpu")

FORMAT = "pefa_gpu"
FORMAT_VERSION = 3  # only this version loads
MANIFEST = "manifest.json"
CHECKSUM_KEY = "manifest_sha256"
DATA_PREFIX = "pefa-data-"
DATA_MARKER = ".pefa-data"  # in every data folder, holding its name: proof that it is ours
_TMP_TAG = ".pefa-tmp-"
MAX_MANIFEST_BYTES = 64 * 2**20  # a manifest lists files: ~200 bytes each
_DATA_NAME = re.compile(r"pefa-data-[0-9a-f]{16}\Z")

# torch dtypes stored bit-exact -> (their bits in torch, their numpy dtype): to_numpy widens
# float16; numpy lacks bfloat16 and as_tensor refuses bool, so those two are one-field dtypes
_BITS = {torch.float16: (torch.int16, np.dtype(np.float16)),
         torch.bfloat16: (torch.int16, np.dtype([("bfloat16", "<u2")])),
         torch.bool: (torch.uint8, np.dtype([("bool", "u1")]))}
_BY_WRAPPED = {raw: tdtype for tdtype, (_, raw) in _BITS.items() if raw.names}

PathLike = str | os.PathLike
_PENDING: dict[Path, dict[str, tuple[tuple, str]]] = {}  # data folder -> its save's known files


def as_path(value: Any, name: str) -> Path:
    """``value`` (a str or os.PathLike) as a Path, else TypeError naming ``name``."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (str or os.PathLike), got {type(value).__name__}")
    if "\0" in str(value):  # os calls: a ValueError 'embedded null byte' naming nothing
        raise InputError(f"{name} holds a NUL character, which no path can: {str(value)!r}")
    try:  # a lone surrogate: os calls' UnicodeEncodeError
        os.fsencode(value)
    except UnicodeEncodeError as exc:
        raise InputError(f"{name} {str(value)!r} cannot be a file name here: {exc}") from None
    return Path(value)


def _with_suffix(path: PathLike, suffix: str) -> Path:
    p = Path(path)
    return p if p.suffix == suffix else p.with_name(p.name + suffix)


# ---------------------------------------------------------------------------- tensors

def save_tensor(path: PathLike, tensor: torch.Tensor) -> dict[str, Any]:
    """Write ``tensor`` to ``path`` + ``.npy``; returns ``{"file", "dtype", "shape"}``."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"save_tensor takes a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_complex():  # load_tensor refuses complex files: a real tensor only
        raise InputError(f"save_tensor stores real tensors, got dtype {dtype_name(tensor.dtype)}")
    out = check_output_file(_with_suffix(path, ".npy"), "tensor file")  # a link: not followed
    t = tensor.detach()
    bits, raw = _BITS.get(t.dtype, (None, None))
    arr = to_numpy(t) if bits is None else to_numpy(t.contiguous().view(bits)).view(raw)
    with open(out, "wb") as fh:
        np.save(fh, arr, allow_pickle=False)
        header = fh.tell() - arr.nbytes
    # the saves being written that hold it take its sha256 here, from the header and memory
    real = Path(os.path.realpath(out))
    folders = [f for f in real.parents if f in _PENDING]
    if folders and (arr.flags.c_contiguous or arr.flags.f_contiguous):
        with open(real, "rb") as fh:
            sha = hashlib.sha256(fh.read(header))
            st = os.fstat(fh.fileno())
        sha.update((arr if arr.flags.c_contiguous else arr.T).reshape(-1).view(np.uint8))
        for folder in folders:
            _PENDING[folder][real.relative_to(folder).as_posix()] = (_stamp(st), sha.hexdigest())
    return {"file": out.name, "dtype": dtype_name(t.dtype), "shape": list(t.shape)}


def _stamp(st: os.stat_result) -> tuple[int, int, int]:
    """What tells a file from a rewritten one: inode, size, mtime."""
    return st.st_ino, st.st_size, st.st_mtime_ns


def load_tensor(path: PathLike, device: DeviceLike = None, mmap: bool = False,
                meta: dict[str, Any] | None = None) -> torch.Tensor:
    """A ``.npy`` of :func:`save_tensor` on ``device`` (``mmap``: mapped copy-on-write) whose
    dtype and shape match ``meta`` (what save_tensor returned)."""
    p = _with_suffix(path, ".npy")
    arr = read_npy(p, mmap_mode="c" if mmap else None)
    dt = arr.dtype
    if not dt.isnative:
        raise FormatError(f"{p} holds {dt} in non-native byte order; pefa_gpu writes "
                          f"native (little-endian) arrays")
    if dt.names:  # a wrapped dtype
        if (tdtype := _BY_WRAPPED.get(dt)) is None:
            raise FormatError(f"{p} holds an unknown structured dtype {dt}")
        t = as_tensor(arr.view(f"i{dt.itemsize}"), device=device, name=str(p))
        t = t.view(tdtype) if tdtype != torch.bool else t.bool()
    elif dt.kind in "iu" or dt.kind == "f" and dt.itemsize <= 8:  # what save_tensor writes
        t = as_tensor(arr, device=device, name=str(p))
    else:  # bool, complex, strings, datetimes, long double
        raise FormatError(f"{p} holds dtype {dt}, which pefa_gpu never writes (real "
                          f"floats and integers only; bool and bfloat16 as one-field records)")
    if meta is not None:
        want = (meta.get("dtype"), meta.get("shape", []))
        if want != (got := (dtype_name(t.dtype), list(t.shape))):
            shape = tuple(want[1]) if isinstance(want[1], list) else want[1]  # forged: any JSON
            raise FormatError(f"{p} holds dtype {got[0]} shape {tuple(got[1])}, but the manifest "
                              f"says dtype {want[0]} shape {shape!r}")
    return t


def read_npy(path: PathLike, mmap_mode: str | None = None) -> np.ndarray:
    """``np.load`` of a ``.npy`` file that never unpickles; a missing, non-.npy, truncated or
    object-holding file raises :class:`FormatError` naming it."""
    p = Path(path)
    try:
        if not stat.S_ISREG(os.stat(p).st_mode):  # open() of a FIFO waits for a writer
            raise OSError("not a regular file")
        with open(p, "rb") as fh:
            if (magic := fh.read(6)) == b"\x93NUMPY":
                fh.seek(0)  # numpy parses the header (and bounds its size)
                read = (np.lib.format.read_array_header_1_0 if np.lib.format.read_magic(fh)
                        == (1, 0) else np.lib.format.read_array_header_2_0)
                shape, _, dtype = read(fh)
                offset = fh.tell()
    except FileNotFoundError:
        raise FormatError(f"{p} is missing") from None
    except (ValueError, OSError, EOFError, tokenize.TokenError) as exc:  # numpy's header filter
        raise FormatError(f"{p} cannot be read or has a malformed .npy header: {exc}") from None
    if magic != b"\x93NUMPY":
        text = magic and all(32 <= b < 127 or b in b"\t\r\n" for b in magic)
        raise FormatError(f"{p} is not a .npy file (it does not start with the .npy magic "
                          f"bytes; it looks like {'text' if text else 'something else'})")
    if dtype.hasobject:
        raise FormatError(f"{p} holds Python objects (dtype {dtype}), not numbers; "
                          f"pefa_gpu never unpickles files")
    want = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if (size := p.stat().st_size) < want:
        raise FormatError(f"{p} is truncated: {size} bytes, its header (shape {shape}, "
                          f"dtype {dtype}) needs {want}")
    try:
        return np.load(p, mmap_mode=mmap_mode, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise FormatError(f"{p} is truncated or not a valid .npy file: {exc}") from exc


def read_matrix(path: PathLike) -> np.ndarray:
    """A (rows, d) real finite ``.npy`` matrix as float32; else :class:`FormatError`."""
    try:
        arr = read_npy(path, mmap_mode="r")
    except FormatError as exc:
        raise FormatError(f"{path} is not a readable .npy array: {exc}") from None
    if arr.ndim != 2 or arr.dtype.kind not in "fiu":
        raise FormatError(f"{path} must hold a 2-D real matrix (rows, dim), got {arr.dtype} "
                          f"shape {arr.shape}")
    with np.errstate(over="ignore"):  # float64 past float32's range: inf, named below
        out = np.ascontiguousarray(arr, dtype=np.float32)
    if not finite_array(out):
        rows = np.flatnonzero(~np.isfinite(out).all(axis=1))[:5].tolist()
        raise FormatError(f"{path} holds NaN or inf (rows {rows}...; or values beyond "
                          f"float32's range, ±3.4e38)")
    return out


# ---------------------------------------------------------------------------- sparse

def save_csr(path: PathLike, matrix: sp.spmatrix | sp.sparray) -> dict[str, Any]:
    """Write a scipy sparse matrix as CSR to ``path`` + ``.npz``; returns its manifest entry."""
    if not sp.issparse(matrix):
        raise TypeError(f"save_csr takes a scipy sparse matrix, got {type(matrix).__name__}")
    csr = sp.csr_matrix(matrix)
    out = check_output_file(_with_suffix(path, ".npz"), "matrix file")  # a link: not followed
    np.savez(out, indptr=csr.indptr, indices=csr.indices, data=csr.data,
             shape=np.asarray(csr.shape, dtype=np.int64))
    return {"file": out.name, "shape": list(csr.shape), "nnz": int(csr.nnz),
            "dtype": str(csr.dtype)}


def load_csr(path: PathLike, meta: dict[str, Any] | None = None) -> sp.csr_matrix:
    """A :func:`save_csr` or scipy ``save_npz`` (CSR or CSC) file as CSR, no member inflating past
    what the shape and nnz (``meta``'s, else the file's) allow; else :class:`FormatError`."""
    p = _with_suffix(path, ".npz")
    if not p.is_file():
        raise FormatError(f"{p} is missing")
    try:
        with zipfile.ZipFile(p) as z:
            fmt = (_npz_member(z, "format", 64, p, "SU").astype(str).item()
                   if "format.npy" in z.namelist() else "csr")
            if fmt not in ("csr", "csc"):
                raise FormatError(f"{p} holds sparse format {fmt!r}; expected 'csr' (or 'csc')")
            shape = tuple(int(s) for s in _npz_member(z, "shape", 16, p))
            if len(shape) != 2 or min(shape) < 0:
                raise FormatError(f"{p} holds shape {shape}, not (rows, columns)")
            if meta is not None and (list(shape) != meta.get("shape")
                                     or not isinstance(meta.get("nnz"), int)):
                raise FormatError(f"{p} holds shape {shape}, but the manifest says shape "
                                  f"{meta.get('shape')} nnz {meta.get('nnz')}")
            indptr = _npz_member(z, "indptr", 8 * (shape[fmt == "csc"] + 1), p)
            nnz = meta["nnz"] if meta is not None else min(int(indptr[-1]), shape[0] * shape[1])
            indices = _npz_member(z, "indices", 16 * nnz, p)
            data = _npz_member(z, "data", 16 * nnz, p, "biuf")
        mat = (sp.csr_matrix if fmt == "csr" else sp.csc_matrix)((data, indices, indptr), shape)
        mat.check_format(full_check=True)
    except FormatError:
        raise
    except (ValueError, TypeError, OSError, EOFError, KeyError, IndexError, OverflowError,
            zipfile.BadZipFile, tokenize.TokenError) as exc:
        raise FormatError(f"{p} is truncated or not a valid CSR .npz file: {exc}") from exc
    csr = mat.tocsr()
    if meta is not None and csr.nnz != nnz:
        raise FormatError(f"{p} holds nnz {csr.nnz}, but the manifest says nnz {nnz}")
    return csr


def _npz_member(z: zipfile.ZipFile, name: str, limit: int, p: Path, kinds: str = "iu"
                ) -> np.ndarray:
    """Array ``name`` of an open .npz, of a dtype kind in ``kinds`` (default: integers),
    inflating at most its ``limit`` bytes of elements plus a header (at most 64 KiB)."""
    limit = 2**16 + max(limit, 0)
    info = z.getinfo(f"{name}.npy")
    if info.file_size > limit:  # zipfile inflates no more than this declared size
        raise FormatError(f"{p}: member {name} inflates past the {limit} bytes its shape and "
                          f"nnz allow")
    with z.open(info) as fh:
        arr = np.lib.format.read_array(fh, allow_pickle=False)
    if arr.dtype.kind not in kinds:
        want = {"iu": "integers", "biuf": "real numbers", "SU": "text"}[kinds]
        raise FormatError(f"{p}: member {name} holds dtype {arr.dtype}; expected {want}")
    return arr


# ---------------------------------------------------------------------------- checksums

def sha256_file(path: PathLike) -> str:
    """Hex sha256 of a file."""
    h, block = hashlib.sha256(), bytearray(2**18)  # hashlib.file_digest is Python >= 3.11
    with open(path, "rb", buffering=0) as fh:
        while size := fh.readinto(block):
            h.update(memoryview(block)[:size])
    return h.hexdigest()


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of ``manifest`` less its ``manifest_sha256``."""
    body = {k: v for k, v in manifest.items() if k != CHECKSUM_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _walk_files(root: Path) -> Iterator[tuple[str, os.stat_result]]:
    """(relative posix path, lstat) of every non-folder entry under ``root`` (links not
    followed, data-folder markers left out), sorted."""
    for path in sorted(root.rglob("*")):  # rglob never descends into a linked folder
        if path.name != DATA_MARKER and (path.is_symlink() or not path.is_dir()):
            yield path.relative_to(root).as_posix(), os.lstat(path)


def describe_files(root: PathLike, known: dict[str, tuple[tuple, str]] | None = None
                   ) -> dict[str, dict[str, Any]]:
    """``{relative path: {"bytes", "sha256"}}`` of the regular files under ``root`` (else
    :class:`InputError`); a file of ``known`` ({path: (stamp, sha256)}) unchanged is not read."""
    root = Path(root)
    out = {}
    for rel, st in _walk_files(root):
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{root / rel} is not a regular file (a link, device, FIFO or "
                             f"socket); a save holds regular files only")
        stamp, sha = (known or {}).get(rel, (None, ""))
        out[rel] = {"bytes": st.st_size,
                    "sha256": sha if stamp == _stamp(st) else sha256_file(root / rel)}
    return out


def _safe_path(root: Path, rel: Any, where: Path, kind: str = "file") -> Path:
    """``root / rel`` (``root`` a real path) for a path a manifest names: relative, no ``..``,
    no link anywhere, a regular ``kind`` ("file" / "dir")."""
    unsafe = FormatError(f"{where} names an unsafe path {rel!r} (a save names only relative "
                         f"paths inside itself)")
    if not isinstance(rel, str) or "\\" in rel or any(
            part in ("", ".", "..") for part in rel.split("/")):
        raise unsafe
    path = root / rel
    try:
        real = Path(os.path.realpath(path))
    except ValueError:  # a NUL, a lone surrogate: no file has that name
        raise unsafe from None
    if real != path:
        raise FormatError(f"{path} leads through a symbolic link; links inside a save are never "
                          f"followed (listed in {where})")
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise FormatError(f"{path} is missing (listed in {where})") from None
    if not (stat.S_ISDIR(mode) if kind == "dir" else stat.S_ISREG(mode)):
        raise FormatError(f"{path} is not a {'folder' if kind == 'dir' else 'regular file'} "
                          f"(listed in {where})")
    return path


# ---------------------------------------------------------------------------- manifest

def read_json(path: Path, what: str) -> Any:
    """The JSON in ``path``, a regular file (links are not followed) of at most
    MAX_MANIFEST_BYTES, NaN / Infinity refused; else FormatError naming it and ``what`` it
    should be. FileNotFoundError where it is absent."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"{path} is not a regular file (links are never followed)")
    if st.st_size > MAX_MANIFEST_BYTES:
        raise FormatError(f"{path} is {st.st_size} bytes, more than a {what}'s "
                          f"{MAX_MANIFEST_BYTES} (not one pefa_gpu wrote)")

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON number")
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:  # as checked, if replaced since: no link followed, no FIFO waited on, no more read
        with open(os.open(path, flags), "rb") as fh:
            raw = fh.read(st.st_size + 1)  # (a larger argument: a buffer of its size)
        if len(raw) > st.st_size:
            raise ValueError(f"it grew past the {st.st_size} bytes checked as it was read")
        return json.loads(raw.decode("utf-8"), parse_constant=refuse)
    except OSError as exc:
        raise FormatError(f"{path} is unreadable: {exc}") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise FormatError(f"{path} is not valid JSON (truncated or corrupted?): "
                          f"{'nested too deeply' if isinstance(exc, RecursionError) else exc}"
                          ) from None


def read_manifest(root: PathLike, name: str = MANIFEST, fmt: str = FORMAT) -> dict[str, Any]:
    """``root / name``: a ``fmt`` manifest of this version with a matching checksum."""
    path = Path(root) / name
    try:
        manifest = read_json(path, "manifest")
    except FileNotFoundError:
        raise FormatError(f"{root} is not a {fmt} save: it has no {name}") from None
    if (got := manifest.get("format") if isinstance(manifest, dict) else None) != fmt:
        raise FormatError(f"{path} is not a {fmt} manifest (format={got!r})")
    version = manifest.get("format_version")
    if type(version) is not int:  # JSON: bool is the only other int
        raise FormatError(f"{path} has no integer format_version (got {version!r})")
    if version != FORMAT_VERSION:
        age, todo = (("newer", "upgrade pefa_gpu to load it") if version > FORMAT_VERSION else
                     ("older", "build or save it again with this version"))
        raise FormatError(f"{path} has format_version {version}, {age} than this pefa_gpu reads "
                          f"({FORMAT_VERSION}); {todo}")
    if not isinstance(manifest.get("files"), dict):
        raise FormatError(f"{path} has no 'files' table")
    if manifest.get(CHECKSUM_KEY) != manifest_checksum(manifest):
        raise FormatError(f"{path} was changed after it was written: its {CHECKSUM_KEY} does "
                          f"not match its contents; restore it or save again")
    if not isinstance(manifest.get("data"), str) or not _DATA_NAME.match(manifest["data"]):
        raise FormatError(f"{path} names no valid data folder (got {manifest.get('data')!r})")
    return manifest


# ---------------------------------------------------------------------------- reading a save

@dataclasses.dataclass
class SaveDir:
    """A verified save: ``root`` holds the manifest ``where``, ``data`` the files it lists."""

    root: Path
    data: Path
    manifest: dict[str, Any]
    where: Path

    def file(self, rel: Any) -> Path:
        """A listed regular file inside the save."""
        path = _safe_path(self.data, rel, self.where, kind="file")
        if rel not in self.manifest["files"]:
            raise FormatError(f"{self.where} uses {rel!r}, which its files table does not list")
        return path

    def folder(self, rel: Any) -> Path:
        """A folder inside the save (:func:`open_save` found every file in it listed)."""
        return _safe_path(self.data, rel, self.where, kind="dir")


def open_save(directory: PathLike, name: str = MANIFEST, fmt: str = FORMAT,
              checksums: bool = True) -> SaveDir:
    """Read and verify a save: manifest, data folder, every listed file's size (and sha256 with
    ``checksums``), nothing unlisted. Raises :class:`FormatError` naming what is wrong."""
    path = as_path(directory, "directory")
    if not path.is_dir():
        if os.path.lexists(path):
            raise FormatError(f"{path} is not a directory: a pefa_gpu save is a directory")
        raise FileNotFoundError(f"no pefa_gpu save at {path}")
    root = Path(os.path.realpath(path))
    manifest = read_manifest(root, name, fmt)
    where = root / name
    data = _safe_path(root, manifest["data"], where, kind="dir")
    if not _data_folder(data):
        raise FormatError(f"{data / DATA_MARKER} is missing or wrong: {data} is not a pefa_gpu "
                          f"data folder")
    for rel, info in manifest["files"].items():
        p = _safe_path(data, rel, where, kind="file")
        if not isinstance(info, dict) or not isinstance(info.get("bytes"), int) \
                or not isinstance(info.get("sha256"), str):
            raise FormatError(f"{where}: the entry of {rel!r} lacks its size or sha256")
        if (size := p.stat().st_size) != info["bytes"]:
            what = "truncated" if size < info["bytes"] else "longer than saved"
            raise FormatError(f"{p} is {what}: {size} bytes, the manifest says {info['bytes']}")
        if checksums and sha256_file(p) != info["sha256"]:
            raise FormatError(f"{p} is corrupted: its sha256 does not match the manifest")
    if extra := [rel for rel, _ in _walk_files(data) if rel not in manifest["files"]]:
        raise FormatError(f"{data} holds {extra[:5]}, which {where} does not list")
    return SaveDir(root, data, manifest, where)


def read_unchanged(directory: PathLike, read: Callable[[], Any], name: str = MANIFEST) -> Any:
    """``read()`` of the save at ``directory``, retried once if it fails while the save is
    replaced; twice is a :class:`FormatError`."""
    directory = as_path(directory, "directory")

    def stamp() -> tuple[int, int, int] | None:  # os.replace gives a new inode
        try:
            return _stamp(os.stat(directory / name))
        except OSError:
            return None

    for _ in range(2):
        before = stamp()
        try:
            return read()
        except Exception as exc:
            if stamp() == before:  # nothing changed: the error is the save's own
                raise
            error = exc
    raise FormatError(f"{directory} changed while it was read (saved again by another process, "
                      f"twice in a row); load it again ({error})") from error


# ---------------------------------------------------------------------------- writing a save

def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # Windows cannot open directories
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_tree(root: PathLike) -> None:
    """fsync every file and folder under ``root`` and ``root`` itself."""
    for p in [*Path(root).rglob("*"), Path(root)]:
        if p.is_file():
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())
        elif p.is_dir():
            _fsync_dir(p)


def _data_folder(folder: Path, partial: bool = False) -> bool:
    """``folder`` is a data folder pefa_gpu made: named ``pefa-data-<16 hex>`` with a marker
    file holding that name (``partial``: or, left by a save cut short, a part of it or none)."""
    marker = folder / DATA_MARKER
    try:
        if not _DATA_NAME.match(folder.name) or not stat.S_ISDIR(os.lstat(folder).st_mode):
            return False
        if partial and not os.listdir(folder):
            return True
        if not stat.S_ISREG(os.lstat(marker).st_mode):
            return False
        text = marker.read_text(encoding="ascii")
        return text.strip() == folder.name or (partial and os.listdir(folder) == [DATA_MARKER]
                                               and (folder.name + "\n").startswith(text))
    except (OSError, UnicodeDecodeError):
        return False


def _ours(root: Path, entry: str, name: str) -> bool:
    """An entry of a save folder that pefa_gpu wrote: a data folder or a manifest being written."""
    if entry.startswith(f".{name}{_TMP_TAG}"):
        return os.path.isfile(root / entry) and not os.path.islink(root / entry)
    return _data_folder(root / entry, partial=True)


def _save_target(target: PathLike, name: str, fmt: str) -> tuple[Path, str | None]:
    """(real folder of ``target``, data folder of the save there or None); :class:`InputError`
    unless saving there replaces only pefa_gpu's own files."""
    p = as_path(target, "directory")
    if target == "":  # Path(''): the save was written into the current folder
        raise InputError("directory is '': give the folder to save into")
    if os.path.islink(p) and not p.exists():
        raise InputError(f"cannot save to {p}: it is a symbolic link to {os.readlink(p)!r}, "
                         f"which does not exist")
    root = Path(os.path.realpath(p))
    if not os.path.lexists(root):
        return root, None
    if not root.is_dir():
        raise InputError(f"cannot save to {root}: it exists and is not a directory")
    if os.path.lexists(root / name):
        try:
            return root, read_manifest(root, name, fmt)["data"]
        except FormatError as exc:
            raise InputError(f"refusing to save into {root}: its {name} is not an intact "
                             f"{fmt} manifest of this version ({exc}); move it away or choose "
                             f"another directory") from None
    if others := sorted(e for e in os.listdir(root) if not _ours(root, e, name)):
        raise InputError(f"refusing to save into {root}: it is a non-empty directory that is "
                         f"not a {fmt} save (it holds {others[:5]})")
    return root, None


def _remove_stale(root: Path, name: str, keep: str | None) -> None:
    """Delete what earlier saves left in ``root`` (never raises)."""
    for entry in (e for e in os.listdir(root) if e != keep and _ours(root, e, name)):
        try:  # a manifest being written (a file) or a data folder
            (os.unlink if entry.startswith(".") else shutil.rmtree)(root / entry)
        except OSError as exc:  # e.g. mapped files on Windows: the next save tries again
            log.warning("could not remove %s left by an earlier save: %s", root / entry, exc)


def check_save_target(target: PathLike, name: str = MANIFEST, fmt: str = FORMAT) -> Path:
    """The real folder of ``target``; :class:`InputError` where :func:`writing_save` would fail."""
    root = _save_target(target, name, fmt)[0]
    check_output_file(root / name, "save manifest")  # as commit() checks it
    return root


class PendingSave:
    """A save being written by :func:`writing_save`: files into ``data``, then :meth:`commit`."""

    def __init__(self, root: Path, data: Path, name: str, fmt: str):
        self.root, self.data, self.name, self.fmt = root, data, name, fmt
        self.committed = False

    def commit(self, fields: dict[str, Any]) -> dict[str, Any]:
        """Write the manifest (``fields``, files table, checksum) over the old one; returns it."""
        files = describe_files(self.data, _PENDING.get(self.data))  # save_tensor hashed some
        fsync_tree(self.data)
        full = {**fields, "format": self.fmt, "format_version": FORMAT_VERSION,
                "data": self.data.name, "files": files}
        try:
            full[CHECKSUM_KEY] = manifest_checksum(full)
            text = json.dumps(full, indent=1, sort_keys=True, allow_nan=False) + "\n"
        except (TypeError, ValueError) as exc:
            raise InputError(f"the manifest cannot be written as JSON: {exc}") from exc
        _save_target(self.root, self.name, self.fmt)  # nothing foreign appeared meanwhile
        write_output_file(self.root / self.name, text, "manifest")  # the commit point
        self.committed = True
        _remove_stale(self.root, self.name, keep=self.data.name)
        return full


@contextlib.contextmanager
def writing_save(target: PathLike, name: str = MANIFEST, fmt: str = FORMAT
                 ) -> Iterator[PendingSave]:
    """Write a save into the folder ``target`` (links followed): files into a fresh data folder,
    then ``commit()``; a crash leaves the old save or the new one. Only an empty folder or a save
    of the same kind is written into, replacing only pefa_gpu's own entries."""
    root = check_save_target(target, name, fmt)  # under a file: InputError, not mkdir's OSError
    pending = data = lock = None
    made_root = not os.path.lexists(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        # one save at a time: another's cleanup would remove this one's data folder
        lock = lock_folder(root)
        current = _save_target(root, name, fmt)[1]  # read again: maybe another's, committed
        _remove_stale(root, name, keep=current)
        fresh = root / f"{DATA_PREFIX}{secrets.token_hex(8)}"
        fresh.mkdir()
        data = fresh  # ours from here on: removed on any error, the marker write's included
        (data / DATA_MARKER).write_text(data.name + "\n", encoding="ascii")
        pending = PendingSave(root, data, name, fmt)
        _PENDING[data] = {}
        yield pending
        if not pending.committed:
            raise RuntimeError("writing_save: the block ended without commit()")
    except OSError as exc:  # disk full, permissions: say where, and that nothing was lost
        msg = (f"could not write the save to {root}: {exc}; nothing was replaced (a previous "
               f"save there is intact)")
        raise (OSError(exc.errno, msg) if exc.errno else OSError(msg)) from exc
    finally:
        _PENDING.pop(data, None)
        if not (pending is not None and pending.committed):
            if data is not None:
                shutil.rmtree(data, ignore_errors=True)
            if made_root:  # the folder this save made, if nothing else was put there
                with contextlib.suppress(OSError):
                    root.rmdir()
        if lock is not None:
            os.close(lock)


def lock_folder(folder: Path, wait: bool = True) -> int | None:
    """An fd of ``folder`` holding its exclusive flock until closed (``wait``: for another
    holder); None where none is had: no flock here (Windows), a file system refusing it (NFS
    folders), a folder gone or unreadable, or another holder and not ``wait``."""
    if fcntl is None:
        return None
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # gone, or not readable
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BaseException as exc:  # OSError: held or refused; else Ctrl-C while waiting
        os.close(fd)
        if isinstance(exc, OSError):
            return None
        raise
    return fd


# ---------------------------------------------------------------------------- output files

def check_output_file(path: PathLike, what: str = "output") -> Path:
    """``path`` if it is absent or a regular file in a writable folder; else :class:`InputError`."""
    p = as_path(path, what)
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):  # absent: nothing replaced
        mode = os.lstat(p).st_mode
        if stat.S_ISLNK(mode):
            raise InputError(f"{what} {p} is a symbolic link (to {os.readlink(p)!r}); outputs "
                             f"are written only to regular files: name the file itself")
        if stat.S_ISDIR(mode):
            raise InputError(f"{what} {p} is a directory; give a file name")
        if not stat.S_ISREG(mode):
            raise InputError(f"{what} {p} is not a regular file (a device, FIFO or socket); "
                             f"outputs replace only regular files")
    folder = p.absolute().parent  # its nearest existing ancestor must be a writable folder
    while not os.path.exists(folder) and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise InputError(f"cannot write {what} {p}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"cannot write {what} {p}: no write permission in {folder}")
    return p


def write_output_file(path: PathLike, content: str | bytes | Callable[[Path], Any],
                      what: str = "output") -> Path:
    """Write ``content`` (text, bytes, or a function writing a given path) to ``path``
    atomically, keeping its permissions."""
    p = check_output_file(path, what)
    p.parent.mkdir(parents=True, exist_ok=True)
    # a name cut to 100 characters: the whole one (up to 255) made a temporary name over 255
    tmp = p.with_name(f".{p.name[:100]}{_TMP_TAG}{secrets.token_hex(6)}{p.suffix[:16]}")
    try:
        with open(tmp, "xb") as fh:  # O_EXCL, mode 0o666 less the umask
            if not callable(content):
                fh.write(content.encode("utf-8") if isinstance(content, str) else content)
        if callable(content):
            content(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        with contextlib.suppress(FileNotFoundError):  # the permissions of the file replaced
            shutil.copymode(p, tmp)
        check_output_file(p, what)  # still a regular file (or absent) right before the rename
        os.replace(tmp, p)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError):  # named by the output, not by the temporary file
            msg = f"cannot write {what} {p}: {exc.strerror or exc}"
            raise (OSError(exc.errno, msg) if exc.errno else OSError(msg)) from exc
        raise
    _fsync_dir(p.parent)
    return p
