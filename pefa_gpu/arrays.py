"""The one place where arrays change type or device: in through :func:`as_tensor` (numpy,
torch, cupy, DLPack, ``__array__``), out to numpy through :func:`to_numpy`."""

from __future__ import annotations

import math
import warnings
from typing import Any, Sequence

import numpy as np
import torch

from .errors import InputError
from .params import check_positive

# what enters the library as an array: numpy, torch (any device), nested sequences (and
# anything with __dlpack__ or __array__, which as_tensor reads as well)
ArrayLike = np.ndarray | torch.Tensor | Sequence[Any]
DeviceLike = str | int | torch.device | None  # None: CUDA when available, else the CPU


def _torch_device(device: DeviceLike) -> torch.device:
    try:
        return device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:  # 2**70: 'Overflow when unpacking'
        raise InputError(f"device={device!r} is not a valid torch device") from exc


def resolve_device(device: DeviceLike = None) -> torch.device:
    """``None`` -> CUDA when available, else CPU; strings and ``torch.device`` pass through."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = _torch_device(device)
    if dev.type not in ("cpu", "cuda"):
        raise InputError(f"device={device!r}: only cpu and cuda devices are supported")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device={device!r} asked for CUDA, but torch sees no CUDA device")
    return dev


def cuda_index(device: DeviceLike) -> int:
    """The CUDA ordinal of ``device`` for faiss / cupy / cuVS: 'cuda' without an index is
    torch's current device (where its tensors go), not GPU 0; InputError if not CUDA."""
    dev = _torch_device(device)
    if dev.type != "cuda":
        raise InputError(f"device={device!r} is not a CUDA device")
    return dev.index if dev.index is not None else torch.cuda.current_device()


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32, and so on."""
    return str(dtype).replace("torch.", "")


def is_bfloat16(dtype: Any) -> bool:
    """True for a numpy bfloat16 dtype (ml_dtypes'; numpy has none of its own)."""
    dt = np.dtype(dtype)
    return dt.itemsize == 2 and dt.name == "bfloat16"  # itemsize first: .name costs ~5 us


def as_tensor(x: ArrayLike, device: DeviceLike = None, dtype: torch.dtype | None = None,
              name: str = "array", copy: bool = False) -> torch.Tensor:
    """Any array-like (torch, numpy, cupy, DLPack, nested sequences) -> a torch tensor on
    ``device`` (and ``dtype`` when given), zero-copy where the device and dtype match unless
    ``copy`` (then it never shares memory with ``x``)."""
    dev = resolve_device(device) if device is not None else None
    t = _as_torch(x, name)
    if t.dtype == torch.bool or t.is_complex() or t.is_quantized:  # qint8: torch's own error
        raise InputError(f"{name} has dtype {t.dtype}; a real-valued array is needed")
    if t.is_nested:  # torch's 'Internal error: NestedTensorImpl doesn't support sizes'
        raise InputError(f"{name} is a nested (ragged) tensor; pass a dense array")
    if t.layout != torch.strided or t.is_meta:  # torch.sparse_coo / _csr, or holding no data
        raise InputError(f"{name} is a {t.layout} tensor on {t.device}; pass a dense array")
    if (dev is None or t.device == dev) and (dtype is None or t.dtype == dtype):
        # nothing to move (skips a torch dispatch: this runs on every search); read-only numpy
        # rows are copied, torch tensors being writable. Only numpy rows _as_torch did not copy
        # (order, byte order) share memory for sure; torch, cupy, DLPack: copied to be safe
        if isinstance(x, np.ndarray):
            copy = (copy or not x.flags.writeable) and \
                x.__array_interface__["data"][0] == t.data_ptr()
        if copy:
            return host_clone(t) if t.device.type == "cpu" else t.clone()
        return t
    # copy: 'cuda' and t's 'cuda:0' differ above, yet .to() returns t itself between them
    return t.to(device=dev if dev is not None else t.device, dtype=dtype or t.dtype, copy=copy)


def _as_torch(x: Any, name: str) -> torch.Tensor:
    """``x`` as a torch tensor where it lies (zero-copy where possible); see :func:`as_tensor`."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        bf16 = is_bfloat16(x.dtype)
        if x.dtype.kind not in "biufc" and not bf16:  # object, strings, datetimes, structured
            raise InputError(f"{name} has dtype {x.dtype}; pass a numeric array")
        if x.dtype.char in "gG":  # long double: torch.from_numpy's TypeError named no array
            raise InputError(f"{name} has dtype {x.dtype}, which torch does not read; pass "
                             f"float64 or float32")
        if np.ma.is_masked(x):  # numpy reads a masked array's data, masked entries included
            raise InputError(f"{name} is a masked array with masked entries: fill them "
                             f"({name}.filled(value)) or drop their rows first")
        # C order, native byte order (torch reads no big-endian '>f4', as np.load may give),
        # no negative stride (numpy calls a reversed (1, d) view C-contiguous; torch refuses it)
        a = x if x.flags.c_contiguous and x.dtype.isnative and min(x.strides, default=0) >= 0 \
            else np.array(x, order="C", dtype=x.dtype.newbyteorder("="))
        if a.dtype.char == "Q":  # numpy's ulonglong (2**63 and up in a list): torch reads uint64
            a = a.view(np.uint64)
        if not a.flags.writeable:  # a read-only view: as_tensor reads it, never returns it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return _from_numpy(a, bf16)
        return _from_numpy(a, bf16)
    if hasattr(x, "__dlpack__"):
        try:
            return torch.from_dlpack(x)
        except Exception as exc:  # foreign producer that torch cannot read
            raise InputError(f"{name} ({type(x).__name__}) could not be read through DLPack: "
                             f"{exc}") from exc
    if hasattr(x, "__array__") or isinstance(x, (list, tuple)):
        try:
            a = np.asarray(x)
        except (TypeError, ValueError) as exc:
            raise InputError(f"{name} could not be turned into a numeric array: {exc}") from exc
        return _as_torch(a, name)
    raise InputError(f"{name} must be an array (numpy, torch, cupy or DLPack), "
                     f"got {type(x).__name__}")


def _from_numpy(a: np.ndarray, bf16: bool) -> torch.Tensor:
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if bf16 else torch.from_numpy(a)


def to_numpy(x: ArrayLike, name: str = "array") -> np.ndarray:
    """Any array-like -> numpy array on the host (detached, copied only when needed); ``name``
    for :func:`as_tensor`'s errors."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, torch.Tensor):
        t = x.detach() if x.requires_grad else x  # each skipped call saves ~1 us per search
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.float()
        return (t if t.device.type == "cpu" else t.cpu()).numpy()
    if hasattr(x, "get") and type(x).__module__.startswith("cupy"):
        return x.get()
    return to_numpy(as_tensor(x, name=name))


def as_embeddings(x: Any, device: DeviceLike, name: str, dim: int | None = None,
                  dtype: torch.dtype = torch.float32, check_norm: bool = True,
                  copy: bool = False, check_finite: bool = True,
                  dim_from: str = "the dimension the model was fitted with") -> torch.Tensor:
    """A checked (rows, d) ``dtype`` matrix on ``device``: InputError on a wrong rank, d = 0, d !=
    ``dim`` (``dim_from`` says where it comes from) or NaN / inf (``check_finite``: no device
    sync when False); a warning for rows not L2-normalised (``check_norm``). ``copy``: never
    shares memory with ``x``."""
    t = as_tensor(x, device=device, dtype=dtype, name=name, copy=copy)
    if t.ndim == 1 and dim is not None:  # one vector (another length: 'has dimension 3, ...'
        t = t.unsqueeze(0)  # below, not 'must be 2-D')
    if t.ndim != 2:
        raise InputError(f"{name} must be 2-D (rows, dim), got shape {tuple(t.shape)}")
    if t.shape[1] == 0:
        raise InputError(f"{name} has dimension 0")
    if dim is not None and t.shape[1] != dim:
        raise InputError(f"{name} has dimension {t.shape[1]}, expected {dim} ({dim_from})")
    if check_finite and t.numel() and not all_finite(t):
        src = as_tensor(x, name=name)  # finite before the cast: values past dtype's range
        if src.dtype != t.dtype and src.is_floating_point() and all_finite(src):
            raise InputError(f"{name} holds values past {dtype_name(dtype)}'s range (largest "
                             f"magnitude {src.abs().max().item():.3g}); scale its rows first")
        require_finite(t, name)
    if check_norm and t.shape[0]:
        norms = torch.linalg.vector_norm(t.float(), dim=1)
        off = (norms - 1).abs() > 1e-2
        if bool(off.any()):  # the extreme rows' norms in float64 (float32's: inf past 1e19)
            ends = t[torch.stack([norms.argmin(), norms.argmax()])].double()
            lo, hi = torch.linalg.vector_norm(ends, dim=1).tolist()
            warnings.warn(f"{name}: {int(off.sum())} of {t.shape[0]} rows are not L2-normalised "
                          f"(norms from {lo:.3g} to {hi:.3g}); PEFA expects unit-norm "
                          f"embeddings", UserWarning, stacklevel=3)
    return t


def require_finite(x: torch.Tensor | np.ndarray, name: str) -> None:
    """InputError naming the first rows of ``x`` (rows, d) that hold NaN / inf; a numpy array
    (a read-only memory map too) is read where it lies."""
    t = _as_torch(x, name) if isinstance(x, np.ndarray) else x
    if t.numel() and not all_finite(t):
        bad = (~torch.isfinite(t)).any(dim=1).nonzero().flatten()[:5].tolist()
        raise InputError(f"{name} contains NaN or inf (rows {bad}...)")


def all_finite(t: torch.Tensor) -> bool:
    """No NaN / inf in ``t``; from 2^24 entries on from its min and max (NaN propagates), with
    no temporary of its size."""
    t = t.detach()
    if t.device.type == "cpu" and t.dtype == torch.float32 and t.numel() <= 1 << 16:
        return bool(np.isfinite(t.numpy()).all())
    if t.numel() < 1 << 24:
        return bool(torch.isfinite(t).all())
    lo, hi = torch.aminmax(t)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def finite_array(a: np.ndarray) -> bool:
    """No NaN / inf in a numpy array (any view), read from its min and max (NaN propagates): no
    temporary of its size."""
    return not a.size or bool(np.isfinite([a.min(), a.max()]).all())


def host_clone(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor ``t`` in memory numpy allocates (transparent huge pages
    from 4 MiB on, which torch's allocator does not ask for: faster full scans)."""
    if t.numel() == 0:
        return t.clone(memory_format=torch.contiguous_format)
    raw = np.empty(t.numel() * t.element_size(), np.uint8)
    return torch.from_numpy(raw).view(t.dtype).view(t.shape).copy_(t)


def host_empty(numel: int) -> torch.Tensor:
    """An uninitialised (numel,) float32 CPU tensor in memory numpy allocates (huge pages, see
    :func:`host_clone`)."""
    return torch.from_numpy(np.empty(numel, np.float32))


MAX_PADDED_TOPK = 10_000  # ranks a search pads with -1 / -inf beyond the documents it holds


def check_topk(k: Any, n: int, name: str = "topk") -> int:
    """``k`` as an int in [1, max(n, MAX_PADDED_TOPK)] (ranks beyond the ``n`` rows are -1 /
    -inf padding), else InputError."""
    k, top = check_positive(k, name), max(int(n), MAX_PADDED_TOPK)
    if k > top:
        raise InputError(f"{name}={k} but there are only {n} documents to rank: ask for at most "
                         f"{top} (the larger of {MAX_PADDED_TOPK} and the number of documents; "
                         f"ranks beyond the documents are -1 padded)")
    return k
