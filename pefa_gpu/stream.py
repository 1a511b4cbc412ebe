"""Row-chunk sources for out-of-core inputs: a ``.npy`` path, a memory map, an array, or an
iterator of chunks, read in order into caller-owned buffers.

Host memory stays bounded: a path is read with ``os.pread`` into the buffer (the page cache is
not mapped into the process), and a memory map is copied a chunk at a time, after which its
pages are released with ``madvise(MADV_DONTNEED)`` so they stop counting toward resident memory.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from .arrays import is_bfloat16, to_numpy
from .errors import InputError

_FLOATS = (np.float16, np.float32, np.float64)  # and ml_dtypes' bfloat16 (see _check_float)
_RELEASE_BYTES = 1 << 20  # a memory map is copied and released in pieces of about this size


class RowSource:
    """A (rows, d) float matrix read in row order. ``rows`` is None for an iterator until it ends.

    ``chunks(max_rows, buffers)`` yields ``(start, chunk)`` with ``chunk`` a (r, d) numpy view,
    r <= max_rows for the sources that own their reading (paths, memory maps, arrays). Chunks
    copied into ``buffers`` (numpy arrays of shape (max_rows, d), used in rotation) stay valid
    until that buffer comes round again.
    """

    rows: int | None
    dim: int
    dtype: np.dtype
    owns_reads: bool = True

    def chunks(self, max_rows: int, buffers: list[np.ndarray]) -> Iterator[tuple[int, np.ndarray]]:
        raise NotImplementedError


class ArraySource(RowSource):
    """An in-memory (rows, d) array (numpy or CPU torch): chunks are views, or copies into the
    buffers when ``copy`` (so that a pinned buffer can feed an asynchronous device copy)."""

    def __init__(self, x: np.ndarray, name: str):
        self.x = x
        self.rows, self.dim = x.shape
        self.dtype = x.dtype

    def chunks(self, max_rows, buffers, copy=False):
        for i, s in enumerate(range(0, self.rows, max_rows)):
            view = self.x[s:s + max_rows]
            if copy and buffers:
                buf = buffers[i % len(buffers)][:view.shape[0]]
                np.copyto(buf, view)
                view = buf
            yield s, view


class MemmapSource(ArraySource):
    """A numpy memory map (``np.memmap`` or ``np.load(..., mmap_mode="r")``): each chunk is
    copied into a buffer, then the mapped pages are released."""

    def __init__(self, x: np.memmap, name: str):
        super().__init__(x, name)
        self._mm = getattr(x, "_mmap", None)
        self._base = None
        self._file: tuple[str, int] | None = None
        if self._mm is not None:
            self._base = np.frombuffer(self._mm, dtype=np.uint8).ctypes.data
            self._file = self._locate()
        if not hasattr(self._mm, "madvise"):
            self._base = None

    def _locate(self) -> tuple[str, int] | None:
        """(file, byte offset of row 0) when the rows can be read from the file directly."""
        x, fname = self.x, getattr(self.x, "filename", None)
        if fname is None or not x.flags.c_contiguous or x.size == 0:
            return None
        start = int(x.offset) - int(x.offset) % mmap.ALLOCATIONGRANULARITY
        pos = x.ctypes.data - self._base + start
        try:  # check the guess on the first row before trusting it
            with open(fname, "rb") as f:
                f.seek(pos)
                ok = f.read(x[0].nbytes) == x[0].tobytes()
        except OSError:
            ok = False
        return (fname, pos) if ok else None

    def chunks(self, max_rows, buffers, copy=True):
        if self._file is not None:  # pread: the mapped pages are never touched
            yield from _pread_chunks(self._file[0], self._file[1], self.rows, self.dim,
                                     self.dtype, max_rows, buffers)
            return
        step = max(1, _RELEASE_BYTES // max(1, self.dim * self.dtype.itemsize))
        for i, s in enumerate(range(0, self.rows, max_rows)):
            r = min(max_rows, self.rows - s)
            buf = buffers[i % len(buffers)][:r]
            for t in range(0, r, step):  # few mapped pages resident at any time
                view = self.x[s + t:s + min(r, t + step)]
                np.copyto(buf[t:t + view.shape[0]], view)
                self._release(view)
            yield s, buf

    def _release(self, view: np.ndarray) -> None:
        if self._base is None or view.size == 0:
            return
        lo, hi = _byte_bounds(view)
        start = lo - self._base
        page = mmap.PAGESIZE
        aligned = start - start % page
        try:
            self._mm.madvise(mmap.MADV_DONTNEED, aligned, hi - self._base - aligned)
        except (OSError, ValueError):  # not fatal: resident memory may just grow
            self._base = None


class NpyFileSource(RowSource):
    """A C-ordered 2-D ``.npy`` file read with ``os.pread`` (nothing is memory-mapped)."""

    def __init__(self, path: str | Path, name: str):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                version = np.lib.format.read_magic(f)
                read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                        else np.lib.format.read_array_header_2_0)
                shape, fortran, dtype = read(f)
                self.offset = f.tell()
        except (OSError, ValueError) as exc:
            raise InputError(f"{name}: cannot read a .npy header from {self.path}: {exc}") from exc
        if len(shape) != 2:
            raise InputError(f"{name}: {self.path} holds shape {shape}; a 2-D (rows, d) array "
                             f"is needed")
        if fortran and shape[0] > 1 and shape[1] > 1:
            raise InputError(f"{name}: {self.path} is Fortran-ordered; rows cannot be streamed "
                             f"(save it C-ordered)")
        self.rows, self.dim = int(shape[0]), int(shape[1])
        self.dtype = np.dtype(dtype)
        _check_float(self.dtype, name)
        size = os.path.getsize(self.path)
        need = self.offset + self.rows * self.dim * self.dtype.itemsize
        if size < need:
            raise InputError(f"{name}: {self.path} is truncated ({size} bytes, header says "
                             f"{need})")

    def chunks(self, max_rows, buffers, copy=True):
        yield from _pread_chunks(self.path, self.offset, self.rows, self.dim, self.dtype,
                                 max_rows, buffers)


def _pread_chunks(path: str | Path, offset: int, rows: int, dim: int, dtype: np.dtype,
                  max_rows: int, buffers: list[np.ndarray]) -> Iterator[tuple[int, np.ndarray]]:
    """Read C-ordered rows at ``offset`` of ``path`` into ``buffers`` (in rotation)."""
    row_bytes = dim * dtype.itemsize
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        for i, s in enumerate(range(0, rows, max_rows)):
            r = min(max_rows, rows - s)
            buf = buffers[i % len(buffers)][:r]
            mv = memoryview(buf.reshape(-1).view(np.uint8))
            pos, want = offset + s * row_bytes, r * row_bytes
            got = 0
            while got < want:
                k = os.preadv(fd, [mv[got:]], pos + got)
                if k <= 0:
                    raise InputError(f"{path}: unexpected end of file at byte {pos + got}")
                got += k
            if hasattr(os, "posix_fadvise"):  # keep the page cache from growing either
                os.posix_fadvise(fd, pos, want, os.POSIX_FADV_DONTNEED)
            yield s, buf
    finally:
        os.close(fd)


class IteratorSource(RowSource):
    """An iterator of (r, d) chunks, used as they come (their memory is the caller's)."""

    owns_reads = False

    def __init__(self, it: Iterator[Any], name: str):
        self._it = iter(it)
        self.name = name
        self.rows = None
        first = next(self._it, None)
        self._first = None if first is None else self._check(first, 0)
        self.dim = 0 if self._first is None else self._first.shape[1]
        self.dtype = np.dtype(np.float32) if self._first is None else self._first.dtype

    def _check(self, chunk: Any, start: int) -> np.ndarray:
        c = to_numpy(chunk)
        if c.ndim != 2:
            raise InputError(f"{self.name}: the chunk at row {start} has shape {c.shape}; "
                             f"(rows, d) chunks are needed")
        if c.dtype.type not in _FLOATS:
            c = c.astype(np.float32)
        return c

    def chunks(self, max_rows, buffers, copy=False):
        start = 0
        chunk = self._first
        while chunk is not None:
            if chunk.shape[1] != self.dim:
                raise InputError(f"{self.name}: the chunk at row {start} has dimension "
                                 f"{chunk.shape[1]}, the first had {self.dim}")
            for s in range(0, chunk.shape[0], max_rows):  # split only for the buffers' size
                yield start + s, chunk[s:s + max_rows]
            start += chunk.shape[0]
            nxt = next(self._it, None)
            chunk = None if nxt is None else self._check(nxt, start)
        self.rows = start


def row_source(x: Any, name: str = "Q") -> RowSource | None:
    """A streaming source for ``x`` (a ``.npy`` path, a memory map or an iterator of chunks),
    or None when ``x`` is an ordinary array (numpy, torch, cupy...)."""
    if isinstance(x, (str, os.PathLike)):
        if not str(x).endswith(".npy"):
            raise InputError(f"{name}: {x!s} is not a .npy file path")
        return NpyFileSource(x, name)
    if isinstance(x, np.memmap):
        if x.ndim != 2:
            raise InputError(f"{name} must be 2-D (rows, dim), got shape {x.shape}")
        _check_float(x.dtype, name)
        return MemmapSource(x, name)
    if isinstance(x, (np.ndarray, torch.Tensor, list, tuple)) or hasattr(x, "__dlpack__") \
            or hasattr(x, "__array__"):
        return None
    if hasattr(x, "__iter__") or hasattr(x, "__next__"):
        return IteratorSource(x, name)
    return None


def array_source(x: np.ndarray, name: str = "Q") -> ArraySource:
    """A source over an in-memory 2-D float numpy array."""
    if x.ndim != 2:
        raise InputError(f"{name} must be 2-D (rows, dim), got shape {x.shape}")
    _check_float(x.dtype, name)
    return ArraySource(x, name)


def _check_float(dtype: np.dtype, name: str) -> None:
    dt = np.dtype(dtype)
    if dt.type in _FLOATS or is_bfloat16(dt):
        return
    if dt.kind == "V" and dt.itemsize == 2 and dt.names is None:
        raise InputError(f"{name} has dtype {dt.str} (2-byte raw items): that is how numpy "
                         f"saves bfloat16, and a .npy file does not say so; pass "
                         f"np.load(path, mmap_mode='r').view(ml_dtypes.bfloat16) instead")
    raise InputError(f"{name} has dtype {dtype}; float16, float32, float64 or bfloat16 "
                     f"(ml_dtypes) is needed")


def _byte_bounds(a: np.ndarray) -> tuple[int, int]:
    try:
        from numpy.lib.array_utils import byte_bounds
    except ImportError:  # numpy < 2
        byte_bounds = np.byte_bounds
    return byte_bounds(a)
