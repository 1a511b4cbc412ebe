"""Row-chunk sources for out-of-core inputs (a ``.npy`` path, a memory map, an array, an
iterator of chunks) read in order into caller-owned buffers: files with ``os.pread``, other
memory maps a piece at a time, their pages released (``madvise``) after each."""

from __future__ import annotations

import contextlib
import mmap
import os
from typing import Any, Iterator

import numpy as np
from numpy.lib.array_utils import byte_bounds

from .arrays import is_bfloat16, to_numpy
from .errors import InputError
from .storage import read_npy

_FLOATS = (np.float16, np.float32, np.float64)  # and ml_dtypes' bfloat16 (see RowSource)
_RELEASE_BYTES = 1 << 20  # a memory map is copied and released in pieces of about this size
_EMPTY_CHUNKS = 1 << 16  # an iterator's empty chunks allowed (more: one that never ends?)

Chunks = Iterator[tuple[int, np.ndarray]]  # (first row, (r, d) chunk)


class RowSource:
    """(rows, d) floats in row order (here a 2-D float array ``x``, in views; ``rows`` None for
    an iterator until it ends). ``chunks(max_rows, buffers)`` yields (start, (r <= max_rows, d)
    chunk); one read into ``buffers`` (in rotation) is valid until its buffer comes round."""

    rows: int | None

    def __init__(self, x: np.ndarray, name: str = "Q"):
        dt = x.dtype
        if x.ndim != 2:
            raise InputError(f"{name} must be 2-D (rows, dim), got shape {x.shape}")
        if x.shape[1] == 0:
            raise InputError(f"{name} has dimension 0")
        if not (dt.type in _FLOATS or is_bfloat16(dt)):
            if dt.kind == "V" and dt.itemsize == 2 and dt.names is None:
                raise InputError(f"{name} has dtype {dt.str} (2-byte raw items): that is how "
                                 f"numpy saves bfloat16, and a .npy file does not say so; pass "
                                 f"np.load(path, mmap_mode='r').view(ml_dtypes.bfloat16) instead")
            raise InputError(f"{name} has dtype {dt}; float16, float32, float64 or bfloat16 "
                             f"(ml_dtypes) is needed")
        self.x, self.dtype = x, dt
        self.rows, self.dim = x.shape

    def chunks(self, max_rows: int, buffers: list[np.ndarray]) -> Chunks:
        for s in range(0, self.rows, max_rows):
            yield s, self.x[s:s + max_rows]


class MemmapSource(RowSource):
    """A numpy memory map: read from its file with pread where its rows lie there in order,
    else copied into the buffers piece by piece, the mapped pages released after each. A
    copy-on-write map may hold changes its file lacks: only copied, its pages kept."""

    def __init__(self, x: np.memmap, name: str):
        super().__init__(x, name)
        self._mm = getattr(x, "_mmap", None) if getattr(x, "mode", "c") != "c" else None
        self._base = None if self._mm is None else np.frombuffer(self._mm, np.uint8).ctypes.data
        self._file = None if self._base is None else self._locate()
        if not hasattr(self._mm, "madvise"):
            self._base = None

    def _locate(self) -> tuple[str, int, int | None] | None:
        """(file, byte offset of row 0, inode) when the rows can be read from the file directly."""
        x, fname = self.x, getattr(self.x, "filename", None)
        if fname is None or not x.flags.c_contiguous or x.size == 0:
            return None
        start = int(x.offset) - int(x.offset) % mmap.ALLOCATIONGRANULARITY  # the map's in file
        pos, inode = x.ctypes.data - self._base + start, _mapped_inode(self._base)
        try:  # check the guess on the first row before trusting it
            with open(fname, "rb") as f:  # and that the name still leads to the mapped file
                f.seek(pos)  # (one replaced since, even with the same first row, was read)
                ok = inode in (None, os.fstat(f.fileno()).st_ino) \
                    and f.read(x[0].nbytes) == x[0].tobytes()
        except OSError:
            ok = False
        return (fname, pos, inode) if ok else None

    def chunks(self, max_rows: int, buffers: list[np.ndarray]) -> Chunks:
        if self._file is not None:
            yield from self._pread(max_rows, buffers)
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

    def _pread(self, max_rows: int, buffers: list[np.ndarray]) -> Chunks:
        """The rows read from the map's file into ``buffers``, kept out of the page cache."""
        (path, offset, inode), rows = self._file, self.rows
        row_bytes = self.dim * self.dtype.itemsize
        fd = os.open(path, os.O_RDONLY)
        try:
            if inode not in (None, os.fstat(fd).st_ino):
                raise InputError(f"{path} was replaced after it was mapped: the map and the "
                                 f"file hold different rows")
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            for i, s in enumerate(range(0, rows, max_rows)):
                r = min(max_rows, rows - s)
                buf = buffers[i % len(buffers)][:r]
                mv = memoryview(buf.reshape(-1).view(np.uint8))
                pos, want, got = offset + s * row_bytes, r * row_bytes, 0
                while got < want:
                    k = os.preadv(fd, [mv[got:]], pos + got)
                    if k <= 0:
                        raise InputError(f"{path}: unexpected end of file at byte {pos + got}")
                    got += k
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, pos, want, os.POSIX_FADV_DONTNEED)
                yield s, buf
        finally:
            os.close(fd)

    def _release(self, view: np.ndarray) -> None:
        if self._base is None or view.size == 0:
            return
        lo, hi = byte_bounds(view)
        start = lo - self._base - (lo - self._base) % mmap.PAGESIZE
        try:
            self._mm.madvise(mmap.MADV_DONTNEED, start, hi - self._base - start)
        except (OSError, ValueError):  # not fatal: resident memory may just grow
            self._base = None


def _mapped_inode(address: int) -> int | None:
    """The inode of the file mapped at ``address`` (Linux: /proc/self/maps), else None."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/maps") as f:
        for line in f:
            span, _, _, _, inode = line.split(maxsplit=5)[:5]
            lo, hi = (int(v, 16) for v in span.split("-"))
            if lo <= address < hi:
                return int(inode)
    return None


class IteratorSource(RowSource):
    """An iterator of (r, d) chunks, used as they come (their memory is the caller's)."""

    def __init__(self, it: Iterator[Any], name: str):
        self._it, self.name = iter(it), name
        self._first = self._next(0)
        self.rows = 0 if self._first is None else None  # else known when the iterator ends
        self.dim = 0 if self._first is None else self._first.shape[1]
        self.dtype = np.dtype(np.float32) if self._first is None else self._first.dtype

    def _next(self, start: int) -> np.ndarray | None:  # None: the iterator has ended
        if (chunk := next(self._it, None)) is None:
            return None
        where = f"{self.name}: the chunk at row {start}"
        c = to_numpy(chunk, where)
        if c.ndim != 2:
            raise InputError(f"{where} has shape {c.shape}; (rows, d) chunks are needed")
        if c.dtype.type in _FLOATS:
            return c
        # a cast dropped complex chunks' imaginary part; text was numpy's ValueError
        if c.dtype.kind not in "iu" and not is_bfloat16(c.dtype):
            raise InputError(f"{where} has dtype {c.dtype}; float16, float32, float64, "
                             f"bfloat16 (ml_dtypes) or integers are needed")
        return c.astype(np.float32)

    def chunks(self, max_rows: int, buffers: list[np.ndarray]) -> Chunks:
        start, chunk, empty = 0, self._first, 0
        while chunk is not None:
            if chunk.shape[1] != self.dim:
                raise InputError(f"{self.name}: the chunk at row {start} has dimension "
                                 f"{chunk.shape[1]}, the first had {self.dim}")
            if (empty := empty + (not chunk.shape[0])) > _EMPTY_CHUNKS:
                raise InputError(f"{self.name}: more than {_EMPTY_CHUNKS} empty chunks (the "
                                 f"last at row {start}): does the iterator ever end?")
            for s in range(0, chunk.shape[0], max_rows):  # split only for the buffers' size
                yield start + s, chunk[s:s + max_rows]
            start += chunk.shape[0]
            chunk = self._next(start)
        self.rows = start


def row_source(x: Any, name: str = "Q") -> RowSource | None:
    """A streaming source for ``x`` (a ``.npy`` path, a memory map or an iterator of chunks),
    or None when ``x`` is an ordinary array (numpy, torch, cupy...)."""
    if isinstance(x, (str, os.PathLike)):
        if not str(x).endswith(".npy"):
            raise InputError(f"{name}: {x!s} is not a .npy file path")
        mm = read_npy(x, mmap_mode="r")  # FormatError naming a missing or broken file
        if mm.ndim == 2 and not mm.flags.c_contiguous and min(mm.shape) > 1:
            raise InputError(f"{name}: {x!s} is Fortran-ordered; rows cannot be streamed "
                             f"(save it C-ordered)")
        x = mm
    if isinstance(x, np.memmap):
        return MemmapSource(x, name)
    if isinstance(x, (list, tuple)) or hasattr(x, "__dlpack__") or hasattr(x, "__array__") \
            or not hasattr(x, "__iter__"):
        return None  # an array (as_tensor reads it) or no source at all
    return IteratorSource(x, name)
