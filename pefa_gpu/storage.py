"""Files on disk: tensors and CSR matrices as .npy / .npz, checksummed save folders, output
files written atomically.

The building blocks of :mod:`pefa_gpu.persist` and of the index backends' ``save`` / ``load``::

    meta = save_tensor(path / "vectors", t)         # writes vectors.npy, returns its dtype / shape
    t = load_tensor(path / "vectors.npy", "cpu", mmap=True)

    with writing_save("model") as w:                # files go into a fresh data folder
        save_tensor(w.data / "vectors", t)
        w.commit({...})                             # manifest: files table, checksum; written last
    save = open_save("model")                       # verified; save.file("vectors.npy")

    write_output_file("out.json", text)             # temp file + rename onto a regular file only

A save folder holds ``manifest.json`` and one ``pefa-data-<16 hex>`` folder with the files it
lists (size + sha256 each); the manifest's own ``manifest_sha256`` covers everything in it.
Tensors are plain ``.npy`` files that numpy reads directly. Dtypes numpy lacks are stored
losslessly under a one-field structured dtype naming them: bfloat16 as ``[('bfloat16', '<u2')]``
(the raw bits), bool as ``[('bool', 'u1')]``. Nothing is ever pickled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import re
import secrets
import shutil
import stat
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import scipy.sparse as sp
import torch

from .arrays import DeviceLike, as_tensor, dtype_name, to_numpy
from .errors import FormatError, InputError

log = logging.getLogger("pefa_gpu")

FORMAT = "pefa_gpu"
# 3: files in a data folder, manifest checksummed, search settings apart from build settings;
# only this version loads (older ones: 2 without the search settings, 1 flat and unchecked)
FORMAT_VERSION = 3
MANIFEST = "manifest.json"
CHECKSUM_KEY = "manifest_sha256"
DATA_PREFIX = "pefa-data-"
DATA_MARKER = ".pefa-data"  # in every data folder, holding its name: proof that it is ours
_TMP_TAG = ".pefa-tmp-"
_DATA_NAME = re.compile(r"pefa-data-[0-9a-f]{16}\Z")

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


def load_tensor(path: PathLike, device: DeviceLike = None, mmap: bool = False,
                meta: dict[str, Any] | None = None) -> torch.Tensor:
    """Read a ``.npy`` written by :func:`save_tensor` onto ``device``.

    ``mmap=True`` maps the file copy-on-write instead of reading it (a CPU tensor then shares
    the pages with the file; on CUDA it only saves a host copy). ``meta`` (the dict
    :func:`save_tensor` returned) is checked against the file: a different dtype or shape, a
    truncated or malformed file raise :class:`FormatError` naming the file.
    """
    p = _npy(path)
    arr = read_npy(p, mmap_mode="c" if mmap else None)
    if not arr.dtype.isnative:
        raise FormatError(f"{p} holds {arr.dtype} in non-native byte order; pefa_gpu writes "
                          f"native (little-endian) arrays")
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


def read_npy(path: PathLike, mmap_mode: str | None = None) -> np.ndarray:
    """``np.load`` of a ``.npy`` file that never unpickles and names the file in every error:
    a missing file, one that is not .npy at all (e.g. text), a truncated one, or one holding
    Python objects raise :class:`FormatError` saying which."""
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            magic = fh.read(6)
            header = None
            if magic == b"\x93NUMPY":
                fh.seek(0)
                version = np.lib.format.read_magic(fh)
                if version in ((1, 0), (2, 0)):
                    read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                            else np.lib.format.read_array_header_2_0)
                    header = (*read(fh), fh.tell())
    except FileNotFoundError:
        raise FormatError(f"{p} is missing") from None
    except IsADirectoryError:
        raise FormatError(f"{p} is a directory, not a .npy file") from None
    except PermissionError as exc:
        raise FormatError(f"{p} cannot be read: {exc.strerror}") from None
    except (ValueError, OSError, EOFError) as exc:
        raise FormatError(f"{p} has a malformed .npy header: {exc}") from None
    if magic != b"\x93NUMPY":
        looks = "text" if magic and all(32 <= b < 127 or b in b"\t\r\n" for b in magic) else \
            "something else"
        raise FormatError(f"{p} is not a .npy file (it does not start with the .npy magic "
                          f"bytes; it looks like {looks})")
    if header is not None:
        shape, _, dtype, offset = header
        if dtype.hasobject:
            raise FormatError(f"{p} holds Python objects (dtype {dtype}), not numbers; "
                              f"pefa_gpu never unpickles files")
        want = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        size = p.stat().st_size
        if size < want:
            raise FormatError(f"{p} is truncated: {size} bytes, its header (shape {shape}, "
                              f"dtype {dtype}) needs {want}")
    try:
        return np.load(p, mmap_mode=mmap_mode, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise FormatError(f"{p} is truncated or not a valid .npy file: {exc}") from exc


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
    """Read a matrix written by :func:`save_csr`; malformed files raise :class:`FormatError`.
    With ``meta`` (its manifest entry: shape, nnz) no member is decompressed past the bytes
    that shape and nnz allow (a small file inflating to gigabytes is refused as it is read)."""
    p = _npz(path)
    if not p.is_file():
        raise FormatError(f"{p} is missing")
    limits = dict.fromkeys(("indptr", "indices", "data", "shape"))
    if meta is not None:
        try:
            rows, nnz = int(meta["shape"][0]), int(meta["nnz"])
        except (KeyError, IndexError, TypeError, ValueError):
            raise FormatError(f"{p}: its manifest entry has no shape and nnz") from None
        # npy header (at most 64 KiB) + elements of at most 16 bytes (complex128)
        limits.update(indptr=2**16 + 8 * (rows + 1), indices=2**16 + 8 * nnz,
                      data=2**16 + 16 * nnz, shape=2**16 + 16)
    try:
        with zipfile.ZipFile(p) as z:
            parts = {k: _npz_member(z, k, limit, p) for k, limit in limits.items()}
        csr = sp.csr_matrix((parts["data"], parts["indices"], parts["indptr"]),
                            shape=tuple(int(s) for s in parts["shape"]))
        csr.check_format(full_check=True)
    except FormatError:
        raise
    except (ValueError, OSError, EOFError, KeyError, zipfile.BadZipFile) as exc:
        raise FormatError(f"{p} is truncated or not a valid CSR .npz file: {exc}") from exc
    if meta is not None and (list(csr.shape) != list(meta.get("shape", [])) or
                             csr.nnz != meta.get("nnz")):
        raise FormatError(f"{p} holds shape {csr.shape} nnz {csr.nnz}, but the manifest says "
                          f"shape {tuple(meta.get('shape', []))} nnz {meta.get('nnz')}")
    return csr


def _npz_member(z: zipfile.ZipFile, name: str, limit: int | None, p: Path) -> np.ndarray:
    """The array ``name`` of an open .npz, decompressing at most ``limit`` bytes (None: what
    the zip directory declares)."""
    info = z.getinfo(f"{name}.npy")
    if limit is not None and info.file_size > limit:
        raise FormatError(f"{p}: member {name} declares {info.file_size} bytes, more than its "
                          f"manifest entry allows ({limit})")
    with z.open(info) as fh:
        raw = fh.read(info.file_size if limit is None else limit + 1)
    if limit is not None and len(raw) > limit:
        raise FormatError(f"{p}: member {name} inflates past the {limit} bytes its manifest "
                          f"entry allows")
    return np.lib.format.read_array(io.BytesIO(raw), allow_pickle=False)


# ---------------------------------------------------------------------------- checksums

def sha256_file(path: PathLike, block: int = 4 * 2**20) -> str:
    """Hex sha256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            h.update(chunk)
    return h.hexdigest()


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """sha256 of the canonical JSON (sorted keys, no spaces, ASCII) of ``manifest`` without its
    own ``manifest_sha256`` field. It detects edits and corruption, not forgery: whoever can
    write the file can recompute it."""
    body = {k: v for k, v in manifest.items() if k != CHECKSUM_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _walk_files(root: Path) -> Iterator[tuple[str, os.stat_result]]:
    """(relative posix path, lstat) of every non-directory entry under ``root``, in sorted
    order, without following links; data-folder markers are left out."""
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        base = Path(dirpath)
        for name in sorted(filenames) + [d for d in dirnames if (base / d).is_symlink()]:
            if name == DATA_MARKER:
                continue
            yield (base / name).relative_to(root).as_posix(), os.lstat(base / name)


def describe_files(root: PathLike) -> dict[str, dict[str, Any]]:
    """``{relative posix path: {"bytes", "sha256"}}`` for every file under ``root`` (a save's
    data folder being written). Links and special files are refused: a save holds regular
    files only."""
    root = Path(root)
    out = {}
    for rel, st in _walk_files(root):
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{root / rel} is not a regular file (a link, device, FIFO or "
                             f"socket); a save holds regular files only")
        out[rel] = {"bytes": st.st_size, "sha256": sha256_file(root / rel)}
    return out


def verify_files(root: PathLike, files: dict[str, dict[str, Any]], checksums: bool = True,
                 where: PathLike | None = None) -> None:
    """Check that every file listed in a manifest is a regular file inside ``root`` (no link
    followed on the way) with its size and, with ``checksums``, its sha256; raise
    :class:`FormatError` naming the first file that is not."""
    root = Path(root)
    where = where or root / MANIFEST
    for rel, info in files.items():
        p = safe_path(root, rel, where, kind="file")
        if not isinstance(info, dict) or not isinstance(info.get("bytes"), int) \
                or not isinstance(info.get("sha256"), str):
            raise FormatError(f"{where}: the entry of {rel!r} lacks its size or sha256")
        size = p.stat().st_size
        if size != info["bytes"]:
            what = "truncated" if size < info["bytes"] else "longer than saved"
            raise FormatError(f"{p} is {what}: {size} bytes, the manifest says {info['bytes']}")
        if checksums and sha256_file(p) != info["sha256"]:
            raise FormatError(f"{p} is corrupted: its sha256 does not match the manifest")


# ---------------------------------------------------------------------------- paths in a save

def safe_path(root: PathLike, rel: Any, where: PathLike, kind: str = "file") -> Path:
    """``root / rel`` for a path a manifest names, checked to stay inside ``root``: a relative
    posix path without ``..`` or empty parts, every part a real folder or (last) a regular
    ``kind`` ("file" / "dir"), no symbolic link anywhere. Raises :class:`FormatError`."""
    _check_relpath(rel, where)
    cur = Path(root)
    parts = rel.split("/")
    for i, part in enumerate(parts):
        cur = cur / part
        try:
            mode = os.lstat(cur).st_mode
        except FileNotFoundError:
            raise FormatError(f"{cur} is missing (listed in {where})") from None
        if stat.S_ISLNK(mode):
            raise FormatError(f"{cur} is a symbolic link; links inside a save are never "
                              f"followed (listed in {where})")
        last = i == len(parts) - 1
        if (not last or kind == "dir") and not stat.S_ISDIR(mode):
            raise FormatError(f"{cur} is not a folder (listed in {where})")
        if last and kind == "file" and not stat.S_ISREG(mode):
            raise FormatError(f"{cur} is not a regular file (listed in {where})")
    return cur


def _check_relpath(rel: Any, where: PathLike) -> None:
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel \
            or any(part in ("", ".", "..") for part in rel.split("/")):
        raise FormatError(f"{where} names an unsafe path {rel!r} (a save names only relative "
                          f"paths inside itself)")


def _unlisted(root: Path, files: dict[str, Any], under: str = "") -> list[str]:
    """Entries under ``root / under`` that ``files`` does not list (links and special files
    included)."""
    base = root / under if under else root
    prefix = f"{under}/" if under else ""
    return [prefix + rel for rel, st in _walk_files(base)
            if prefix + rel not in files or not stat.S_ISREG(st.st_mode)]


# ---------------------------------------------------------------------------- manifest

def strict_json(text: str) -> Any:
    """``json.loads`` that refuses NaN and Infinity (ValueError), as the writers never write
    them; nesting too deep raises RecursionError."""
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON number")
    return json.loads(text, parse_constant=refuse)


def read_manifest(root: PathLike, name: str = MANIFEST, fmt: str = FORMAT) -> dict[str, Any]:
    """Read and check ``root / name``: a ``fmt`` manifest of the format version this library
    writes, whose ``manifest_sha256`` matches its contents. Raises :class:`FormatError` for a
    foreign, malformed, edited, older or newer one."""
    root = Path(root)
    path = root / name
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise FormatError(f"{root} is not a {fmt} save: it has no {name}") from None
    if not stat.S_ISREG(mode):
        raise FormatError(f"{path} is not a regular file (links are never followed)")
    try:
        manifest = strict_json(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise FormatError(f"{path} is not valid JSON (truncated or corrupted?): "
                          f"{'nested too deeply' if isinstance(exc, RecursionError) else exc}"
                          ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != fmt:
        raise FormatError(f"{path} is not a {fmt} manifest (format="
                          f"{manifest.get('format') if isinstance(manifest, dict) else None!r})")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise FormatError(f"{path} has no integer format_version (got {version!r})")
    if version > FORMAT_VERSION:
        raise FormatError(f"{path} has format_version {version}, newer than this pefa_gpu reads "
                          f"({FORMAT_VERSION}); upgrade pefa_gpu to load it")
    if version < FORMAT_VERSION:
        raise FormatError(f"{path} has format_version {version}, older than this pefa_gpu reads "
                          f"({FORMAT_VERSION}); build or save it again with this version")
    if not isinstance(manifest.get("files"), dict):
        raise FormatError(f"{path} has no 'files' table")
    if manifest.get(CHECKSUM_KEY) != manifest_checksum(manifest):
        raise FormatError(f"{path} was changed after it was written: its {CHECKSUM_KEY} does "
                          f"not match its contents (an edited class, params, state or file "
                          f"table would change what loads); restore it or save again")
    if not isinstance(manifest.get("data"), str) or not _DATA_NAME.match(manifest["data"]):
        raise FormatError(f"{path} names no valid data folder (got {manifest.get('data')!r})")
    return manifest


# ---------------------------------------------------------------------------- reading a save

@dataclasses.dataclass
class SaveDir:
    """A verified save: ``root`` holds the manifest, ``data`` the files it lists. Paths into
    it go through :meth:`file` and :meth:`folder`."""

    root: Path
    data: Path
    manifest: dict[str, Any]
    where: Path  # the manifest file, for messages

    def file(self, rel: Any) -> Path:
        """A listed regular file inside the save."""
        _check_relpath(rel, self.where)
        if rel not in self.manifest["files"]:
            raise FormatError(f"{self.where} uses {rel!r}, which its files table does not list")
        return safe_path(self.data, rel, self.where, kind="file")

    def folder(self, rel: Any) -> Path:
        """A folder inside the save whose every file is listed (and checked)."""
        path = safe_path(self.data, rel, self.where, kind="dir")
        extra = _unlisted(self.data, self.manifest["files"], rel)
        if extra:
            raise FormatError(f"{path} holds {extra[:5]}, which {self.where} does not list")
        return path


def open_save(directory: PathLike, name: str = MANIFEST, fmt: str = FORMAT,
              checksums: bool = True) -> SaveDir:
    """Find, read and verify a save: manifest checksum, data folder, every listed file (size,
    and sha256 with ``checksums``), and no unlisted file in the data folder. Raises
    :class:`FormatError` naming what is wrong."""
    root = resolve_save(directory)
    manifest = read_manifest(root, name, fmt)
    where = root / name
    data = safe_path(root, manifest["data"], where, kind="dir")
    if not _marker_ok(data):
        raise FormatError(f"{data / DATA_MARKER} is missing or wrong: {data} is not a pefa_gpu "
                          f"data folder")
    verify_files(data, manifest["files"], checksums=checksums, where=where)
    extra = _unlisted(data, manifest["files"])
    if extra:
        raise FormatError(f"{data} holds {extra[:5]}, which {where} does not list")
    return SaveDir(root, data, manifest, where)


def read_unchanged(directory: PathLike, read: Callable[[], Any], name: str = MANIFEST) -> Any:
    """``read()``, a function reading the save at ``directory``, retried once when it fails
    while the save there is replaced (its manifest changed: another process saved again); when
    that happens twice, :class:`FormatError` says the folder changed while it was read. A save
    is replaced file by file never: a read that succeeds read one save."""
    def stamp() -> bytes | None:
        try:
            return (Path(directory) / name).read_bytes()
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


def resolve_save(directory: PathLike) -> Path:
    """The directory to read for a save at ``directory``, links resolved."""
    path = Path(directory)
    if path.is_dir():
        return Path(os.path.realpath(path))
    if os.path.lexists(path):
        raise FormatError(f"{path} is not a directory: a pefa_gpu save is a directory")
    raise FileNotFoundError(f"no pefa_gpu save at {path}")


# ---------------------------------------------------------------------------- writing a save

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


def _marker_ok(folder: Path) -> bool:
    """``folder`` is a data folder pefa_gpu made: named ``pefa-data-<16 hex>``, a real folder,
    with a regular ``.pefa-data`` file holding that name."""
    marker = folder / DATA_MARKER
    try:
        if not _DATA_NAME.match(folder.name) or not stat.S_ISDIR(os.lstat(folder).st_mode) \
                or not stat.S_ISREG(os.lstat(marker).st_mode):
            return False
        return marker.read_text(encoding="ascii").strip() == folder.name
    except (OSError, UnicodeDecodeError):
        return False


def _ours(root: Path, entry: str, name: str) -> bool:
    """An entry of a save folder that pefa_gpu wrote: a data folder (name + marker) or a
    manifest being written (name)."""
    if entry.startswith(f".{name}{_TMP_TAG}"):
        return os.path.isfile(root / entry) and not os.path.islink(root / entry)
    return _marker_ok(root / entry) or _unmarked(root / entry)


def _unmarked(folder: Path) -> bool:
    """A data folder whose marker was never fully written (a save killed or out of space right
    after creating it): named ``pefa-data-<16 hex>``, empty or holding only a part of its
    marker."""
    marker = folder / DATA_MARKER
    try:
        if not _DATA_NAME.match(folder.name) or not stat.S_ISDIR(os.lstat(folder).st_mode):
            return False
        entries = os.listdir(folder)
        if not entries:
            return True
        return entries == [DATA_MARKER] and stat.S_ISREG(os.lstat(marker).st_mode) and \
            (folder.name + "\n").startswith(marker.read_text(encoding="ascii"))
    except (OSError, UnicodeDecodeError):
        return False


def _save_root(target: PathLike) -> Path:
    """The real folder a save to ``target`` writes into (links resolved, never replaced)."""
    p = Path(target)
    if os.path.islink(p) and not p.exists():
        raise InputError(f"cannot save to {p}: it is a symbolic link to {os.readlink(p)!r}, "
                         f"which does not exist")
    return Path(os.path.realpath(p))


def _current_data(root: Path, name: str, fmt: str) -> str | None:
    """The data folder of the save now at ``root`` (None when there is none yet); raises
    :class:`InputError` unless saving there replaces only pefa_gpu's own files."""
    if not os.path.lexists(root):
        return None
    if not root.is_dir():
        raise InputError(f"cannot save to {root}: it exists and is not a directory")
    if os.path.lexists(root / name):
        try:
            manifest = read_manifest(root, name, fmt)
        except FormatError as exc:
            raise InputError(f"refusing to save into {root}: its {name} is not an intact "
                             f"{fmt} manifest of this version ({exc}); move it away or choose "
                             f"another directory") from None
        return manifest["data"]
    others = sorted(e for e in os.listdir(root) if not _ours(root, e, name))
    if others:
        raise InputError(f"refusing to save into {root}: it is a non-empty directory that is "
                         f"not a {fmt} save (it holds {others[:5]})")
    return None


def _remove_stale(root: Path, name: str, keep: str | None) -> None:
    """Delete what earlier saves into ``root`` left behind and no manifest names any more:
    data folders proven ours by name and marker, manifests being written. Never raises."""
    for entry in os.listdir(root):
        if entry == keep or not _ours(root, entry, name):
            continue
        try:
            if entry.startswith("."):
                os.unlink(root / entry)
            else:
                shutil.rmtree(root / entry)
        except OSError as exc:  # e.g. mapped files on Windows: the next save tries again
            log.warning("could not remove %s left by an earlier save: %s", root / entry, exc)


def check_save_target(target: PathLike, name: str = MANIFEST, fmt: str = FORMAT) -> Path:
    """Check, before any work, that :func:`writing_save` could write to ``target``: what it
    would refuse raises :class:`InputError` here, and so does a folder without write access.
    Returns the real folder."""
    root = _save_root(target)
    _current_data(root, name, fmt)
    _check_writable_folder(root, f"cannot save to {target}")
    return root


def _check_writable_folder(path: Path, what: str) -> None:
    """``path`` (a folder, existing or to be created) can be written: its nearest existing
    ancestor is a folder we may write in."""
    folder = path.absolute()
    while not os.path.exists(folder) and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise InputError(f"{what}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"{what}: no write permission in {folder}")


class PendingSave:
    """A save being written by :func:`writing_save`: put files into ``data``, then
    :meth:`commit`."""

    def __init__(self, root: Path, data: Path, name: str, fmt: str):
        self.root, self.data, self.name, self.fmt = root, data, name, fmt
        self.committed = False

    def commit(self, fields: dict[str, Any]) -> dict[str, Any]:
        """Write the manifest (``fields`` + format, version, data folder, files table,
        checksum) and swap it in by one rename; then remove the previous save's data folder.
        Returns the manifest."""
        files = describe_files(self.data)
        _link_duplicates(self.data, files)
        fsync_tree(self.data)
        full = {**fields, "format": self.fmt, "format_version": FORMAT_VERSION,
                "data": self.data.name, "files": files}
        try:
            full[CHECKSUM_KEY] = manifest_checksum(full)
            text = json.dumps(full, indent=1, sort_keys=True, allow_nan=False) + "\n"
        except (TypeError, ValueError) as exc:
            raise InputError(f"the manifest cannot be written as JSON: {exc}") from exc
        _current_data(self.root, self.name, self.fmt)  # nothing foreign appeared meanwhile
        tmp = self.root / f".{self.name}{_TMP_TAG}{self.data.name[len(DATA_PREFIX):]}"
        try:
            with open(tmp, "x", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.root / self.name)  # the commit point
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.committed = True
        _fsync_dir(self.root)
        _remove_stale(self.root, self.name, keep=self.data.name)
        return full


@contextlib.contextmanager
def writing_save(target: PathLike, name: str = MANIFEST, fmt: str = FORMAT
                 ) -> Iterator[PendingSave]:
    """Write a save into the folder ``target`` (created if needed; a symbolic link to a
    folder is written through, never replaced)::

        with writing_save("model") as w:
            save_tensor(w.data / "x", t)          # files go into a fresh data folder
            w.commit({"class": ...})              # the manifest is written last

    The new files go into a fresh ``pefa-data-<16 hex>`` folder inside ``target``; the
    manifest, renamed over the old one, is the commit point, and only then is the previous
    save's data folder removed. A crash at any point leaves a complete save: the old one
    before the rename, the new one after it. Leftovers of crashed saves (data folders proven
    ours by their name and marker file, or data-named folders holding no more than a cut-short
    marker) are removed by the next save. Only a folder that is empty or holds a save of the
    same kind is written into, and nothing there but pefa_gpu's own entries is touched. On an
    error (a full disk included) nothing is replaced and the new data folder is removed, and so
    is ``target`` when this save created it. Concurrent saves to one folder are not supported.
    """
    root = _save_root(target)
    current = _current_data(root, name, fmt)
    pending = data = None
    made_root = not os.path.lexists(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale(root, name, keep=current)
        fresh = root / f"{DATA_PREFIX}{secrets.token_hex(8)}"
        fresh.mkdir()
        data = fresh  # ours from here on: removed on any error, the marker write's included
        (data / DATA_MARKER).write_text(data.name + "\n", encoding="ascii")
        pending = PendingSave(root, data, name, fmt)
        yield pending
        if not pending.committed:
            raise RuntimeError("writing_save: the block ended without commit()")
    except OSError as exc:  # disk full, permissions: say where, and that nothing was lost
        msg = (f"could not write the save to {root}: {exc}; nothing was replaced (a previous "
               f"save there is intact)")
        raise (OSError(exc.errno, msg) if exc.errno else OSError(msg)) from exc
    finally:
        if not (pending is not None and pending.committed):
            if data is not None:
                shutil.rmtree(data, ignore_errors=True)
            if made_root:  # the folder this save made, if nothing else was put there
                with contextlib.suppress(OSError):
                    root.rmdir()


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
        if os.path.samefile(first[key], dup):  # linked already (rename would keep the spare)
            continue
        spare = dup.with_name(dup.name + ".link")
        try:
            os.link(first[key], spare)
            os.replace(spare, dup)
        except OSError:
            spare.unlink(missing_ok=True)


# ---------------------------------------------------------------------------- output files

def check_output_file(path: PathLike, what: str = "output") -> Path:
    """Check, before any work, that ``path`` can be written as a regular file: it is absent or
    a regular file (not a link, folder, device, FIFO or socket) and its folder exists (or can
    be created) and is writable. Returns the path; raises :class:`InputError` saying why not."""
    p = Path(path)
    try:
        mode = os.lstat(p).st_mode
    except (FileNotFoundError, NotADirectoryError):
        mode = None
    if mode is not None:
        if stat.S_ISLNK(mode):
            raise InputError(f"{what} {p} is a symbolic link (to {os.readlink(p)!r}); outputs "
                             f"are written only to regular files: name the file itself")
        if stat.S_ISDIR(mode):
            raise InputError(f"{what} {p} is a directory; give a file name")
        if not stat.S_ISREG(mode):
            raise InputError(f"{what} {p} is not a regular file (a device, FIFO or socket); "
                             f"outputs replace only regular files")
    _check_writable_folder(p.absolute().parent, f"cannot write {what} {p}")
    return p


def write_output_file(path: PathLike, content: str | bytes | Callable[[Path], Any],
                      what: str = "output") -> Path:
    """Write ``content`` (text, bytes, or a function that writes a given path) to the regular
    file ``path`` atomically: into a temporary file in the same folder, then renamed over
    ``path`` (which keeps its permissions). Refuses what :func:`check_output_file` refuses; on
    an error ``path`` is untouched and the temporary file removed."""
    p = check_output_file(path, what)
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(os.stat(p).st_mode)
    except FileNotFoundError:
        mode = None
    tmp = p.with_name(f".{p.name}{_TMP_TAG}{secrets.token_hex(6)}{p.suffix}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # umask applies
        with os.fdopen(fd, "wb") as fh:
            if isinstance(content, str):
                fh.write(content.encode("utf-8"))
            elif isinstance(content, bytes):
                fh.write(content)
        if callable(content):
            content(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        check_output_file(p, what)  # still a regular file (or absent) right before the rename
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(p.parent)
    return p
