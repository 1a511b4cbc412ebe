"""Shards (a storage save each), stages (a folder of shards committed by its ``stage.json``,
:class:`Stage`), the row stages (:func:`write_rows`, :func:`encode`) and :func:`write_relevance`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import scipy.sparse as sp
import torch

from ..arrays import DeviceLike, as_embeddings, as_tensor
from ..encode import (EncoderLike, _check_texts, cache_folder, encode as encode_texts,
                      resolve_model)
from ..errors import FormatError, InputError
from ..params import (XLParams, XLSearchParams, check_flag, check_nonnegative,
                      check_positive, check_unit_interval)
from ..persist import load as load_model
from ..protocol import Model
from ..relevance import as_relevance
from ..storage import (PendingSave, SaveDir, as_path, check_output_file, load_csr,
                       load_tensor, open_save, read_json, save_csr, save_tensor,
                       write_output_file, writing_save)
from .runner import LocalRunner

log = logging.getLogger("pefa_gpu")

STAGE_FILE = "stage.json"
STAGE_FORMAT = "pefa-gpu-stage"
SHARD_MANIFEST = "pefa_shard.json"
SHARD_FORMAT = "pefa-gpu-shard"
DEFAULT_ROWS = 100_000      # rows per shard (documents, queries, texts)
_NOT_ROWS = ("relevance", "build")  # the stages that hold no rows (Rows refuses them)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One shard of a stage: its folder's name, rows [lo, hi) and manifest checksum."""

    name: str
    rows: tuple[int, int]
    manifest_sha256: str

    @classmethod
    def of(cls, path: str | Path, manifest: dict[str, Any]) -> "Entry":
        """The entry of the shard at ``path`` with this (read or written) manifest."""
        lo, hi = manifest["rows"]
        if Path(path).name in ("", ".", ".."):  # the stage folder or its parent
            raise ValueError(f"a shard is named {str(path)!r}, not a folder in the stage")
        if type(lo) is not int or type(hi) is not int:
            raise TypeError(f"shard {Path(path).name!r} has rows {manifest['rows']!r}, not ints")
        return cls(Path(path).name, (lo, hi), str(manifest["manifest_sha256"]))


_TYPES = {"str": str, "bool": bool, "float | None": (int, float, type(None)),
          "str | None": (str, type(None)), "dict[str, Any] | None": (dict, type(None))}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage:
    """A ``stage.json``: its kind, shards (tiling its rows), what they hold; checked when made."""

    stage: str
    shards: tuple[Entry, ...]
    n: int                      # rows; documents for aggregate / build, Y's columns for relevance
    dim: int = 0
    m: int = 0                  # Y's rows, the training queries (relevance, PEFA-XL build)
    nnz: int = 0                # Y's pairs (relevance)
    lam: float | None = None    # PEFA-XS's (aggregate, xs build)
    augment_docs: bool = True   # PEFA-XS's (aggregate, xs build)
    bytes_shuffled: int = 0     # sent from the map to the reduce tasks
    model: str | None = None    # the encoder's identity (encode)
    normalize: bool = True      # the encoder's normalisation (encode)
    method: str = ""            # a build's method, backend and index settings
    backend: str = "exact"
    index_params: dict[str, Any] | None = None
    params: XLParams | None = None       # a PEFA-XL build's settings, candidates, query shards
    candidates: int = 0
    query_shards: tuple[Entry, ...] = ()

    def __post_init__(self) -> None:
        fields = dataclasses.fields(self)
        bad = [f.name for f in fields if f.type in _TYPES
               and not isinstance(getattr(self, f.name), _TYPES[f.type])]
        if bad:
            raise TypeError(f"stage fields {bad} have the wrong type")
        counts = {f.name: getattr(self, f.name) for f in fields if f.type == "int"}
        if bad := {k: v for k, v in counts.items() if type(v) is not int or not 0 <= v < 2**63}:
            raise ValueError(f"{bad} must be ints >= 0")
        if self.lam is not None:
            check_unit_interval(self.lam, "lam")
        if self.method == "xl":  # its params and valid candidates (a forged -5 was searched)
            if self.params is None:
                raise ValueError("a PEFA-XL build without its params")
            XLSearchParams(candidates=self.candidates)
        _check_tiling(self)

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> "Stage":
        """A read stage file's Stage (ValueError / TypeError: not a valid one)."""
        fields = {key: v for key, v in body.items() if key not in ("format", "format_version")}
        for key in ("shards", "query_shards"):
            fields[key] = tuple(Entry.of(e["name"], e) for e in body.get(key, ()))
        if fields.get("params") is not None:
            fields["params"] = XLParams.from_dict(fields["params"])
        return cls(**fields)

    def to_json(self) -> str:
        body = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default}
        return json.dumps({"format": STAGE_FORMAT, "format_version": 1, **body}, indent=1,
                          sort_keys=True, default=dataclasses.asdict) + "\n"


def _check_tiling(stage: Stage) -> None:
    """ValueError unless the shards (and a PEFA-XL build's query shards) tile their rows."""
    xl, rows = stage.method == "xl", stage.m if stage.stage == "relevance" else stage.n
    for key, entries, total in (("shards", stage.shards, rows),
                                ("query_shards", stage.query_shards, stage.m)):
        ranges = [e.rows for e in entries]  # split() makes one shard at least
        ends = [0, *(hi for _, hi in ranges)]
        if (entries or key == "shards" or xl) and not (
                entries and [lo for lo, _ in ranges] == ends[:-1] and ends[-1] == total
                and all(lo <= hi for lo, hi in ranges)):
            raise ValueError(f"its {key} hold rows {ranges[:5]}..., not 0 .. {total} in order")


def write_shard(path: str | Path, fields: dict[str, Any],
                tensors: dict[str, Any] | None = None,
                matrices: dict[str, sp.spmatrix] | None = None,
                model: Model | None = None, export_hnsw: bool = False) -> Entry:
    """Write a shard atomically (manifest ``fields`` with ``rows`` [lo, hi]); its stage entry."""
    rows = fields.get("rows") if isinstance(fields, dict) else None
    if not (isinstance(rows, (list, tuple)) and len(rows) == 2
            and all(type(r) is int for r in rows) and 0 <= rows[0] <= rows[1]):
        raise InputError(f"a shard's fields need 'rows': [lo, hi], ints with 0 <= lo <= hi; "
                         f"got {rows!r}")
    if as_path(path, "path").name in ("", ".."):  # was saved, then Entry.of's ValueError
        raise InputError(f"a shard is named {str(path)!r}, not a folder in the stage")
    with writing_save(in_stage(Path(path)), SHARD_MANIFEST, SHARD_FORMAT) as w:
        return Entry.of(path, commit_shard(w, fields, tensors, matrices, model, export_hnsw))


def commit_shard(w: PendingSave, fields: dict[str, Any], tensors: dict[str, Any] | None = None,
                 matrices: dict[str, sp.spmatrix] | None = None, model: Model | None = None,
                 export_hnsw: bool = False) -> dict[str, Any]:
    """:func:`write_shard` into a shard being written (``writing_save``); its manifest."""
    for name in [*(tensors or {}), *(matrices or {})]:  # files in the shard's data folder
        if not isinstance(name, str) or not name.strip(".") or Path(name).name != name \
                or "\\" in name:
            raise InputError(f"a shard's tensor or matrix name must be a plain file name, got "
                             f"{name!r}")
    tmeta = {name: save_tensor(w.data / name, as_tensor(t, name=name))
             for name, t in (tensors or {}).items()}
    mmeta = {name: save_csr(w.data / name, m) for name, m in (matrices or {}).items()}
    if model is not None:
        model.save(w.data / "model")
        if export_hnsw:
            model.export_hnsw(w.data / "hnsw.faiss")
    return w.commit({**fields, "tensors": tmeta, "matrices": mmeta,
                     "model": "model" if model is not None else None,
                     "hnsw": "hnsw.faiss" if model is not None and export_hnsw else None})


@dataclasses.dataclass
class Shard:
    """A shard read back: its manifest ``fields``, tensors, CSR matrices and model."""

    fields: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    matrices: dict[str, sp.csr_matrix]
    model: Model | None = None


def read_shard(path: str | Path, device: DeviceLike = "cpu", mmap: bool = True,
               expect_sha: str | None = None) -> Shard:
    """Read a :func:`write_shard` shard (``mmap``: mapped, sizes checked; else sha256 too)
    that has the checksum ``expect_sha`` (its stage's) when given."""
    save = open_save(path, SHARD_MANIFEST, SHARD_FORMAT, checksums=not mmap)
    fields = save.manifest
    if expect_sha is not None and fields["manifest_sha256"] != expect_sha:
        raise FormatError(f"{path} was rewritten after its stage's {STAGE_FILE} was written "
                          f"(a rerun in progress, or an interrupted one): run the stage again")
    tables = [fields.get("tensors", {}), fields.get("matrices", {})]
    if not all(isinstance(t, dict) and all(isinstance(m, dict) for m in t.values())
               for t in tables):  # forged (re-signed): a raw AttributeError / TypeError
        raise FormatError(f"{save.where}: 'tensors' and 'matrices' must be tables of file "
                          f"entries")
    tensors = {name: load_tensor(save.file(meta.get("file")), device, mmap=mmap, meta=meta)
               for name, meta in tables[0].items()}
    matrices = {name: load_csr(save.file(meta.get("file")), meta)
                for name, meta in tables[1].items()}
    model = (load_model(save.folder(fields["model"]), device=device, mmap=mmap, verify=False)
             if fields.get("model") else None)
    return Shard(fields, tensors, matrices, model)


def open_entry(folder: str | Path, entry: Entry, device: DeviceLike = "cpu") -> Shard:
    """The shard of a stage ``folder`` that ``entry`` names, checked against it."""
    path = in_stage(Path(folder) / entry.name, FormatError)
    if not os.path.lexists(path):  # was open_save's raw FileNotFoundError
        raise FormatError(f"{path} is missing: {Path(folder) / STAGE_FILE} lists it (deleted, "
                          f"or not copied with its stage?)")
    return read_shard(path, device=device, expect_sha=entry.manifest_sha256)


def in_stage(path: Path, error: type[Exception] = InputError) -> Path:
    """``path``, a stage's shard, if it resolves inside its stage folder; else ``error``."""
    if not Path(os.path.realpath(path)).is_relative_to(os.path.realpath(path.parent)):
        raise error(f"{path} leads outside its stage folder {path.parent} (a link?)")
    return path


def _complete(path: Path) -> SaveDir | None:
    """The complete shard at ``path`` (sizes checked), else None (a link out of the stage too)."""
    with contextlib.suppress(FormatError, FileNotFoundError, InputError):
        return open_save(in_stage(path), SHARD_MANIFEST, SHARD_FORMAT, checksums=False)
    return None


def remove_shard(path: Path) -> None:
    """Remove the complete shard at ``path`` (manifest, data, the folder when then empty)."""
    if (save := _complete(path)) is not None:
        (save.root / SHARD_MANIFEST).unlink()
        shutil.rmtree(save.data)
        with contextlib.suppress(OSError):
            save.root.rmdir()


def check_folders(**folders: Any) -> None:
    """TypeError naming the first of ``folders`` (name=value; None skipped) that is no path."""
    for name, value in folders.items():
        if value is not None:
            as_path(value, name)


def split(n: int, rows: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of at most ``rows`` rows covering 0 .. n (one empty range for n = 0)."""
    n, rows = check_nonnegative(n, "n"), check_positive(rows, "rows")  # -5: [(0, 0)]
    return [(lo, min(lo + rows, n)) for lo in range(0, n, rows)] or [(0, 0)]


def shard_name(kind: str, i: int) -> str:
    return f"{kind}-{i:05d}"


def check_stage_out(folder: str | Path, kind: str) -> Path:
    """``folder/stage.json`` if it is absent or a ``kind`` stage file in a writable folder, else
    InputError (an input given as the output folder was replaced)."""
    path = check_output_file(as_path(folder, "out") / STAGE_FILE, STAGE_FILE)  # no link, FIFO
    if os.path.lexists(path):
        body = None
        with contextlib.suppress(OSError, FormatError):  # gone or unreadable: not a stage
            body = read_json(path, "stage file")
        if not isinstance(body, dict) or body.get("format") != STAGE_FORMAT:
            raise InputError(f"refusing to replace {path}: it is not a pefa_gpu stage file")
        if body.get("stage") != kind:
            raise InputError(f"refusing to replace {path}: it holds a {body.get('stage')!r} "
                             f"stage, not a {kind!r} one (an input of this run?); choose "
                             f"another output folder")
    return path


def write_stage(folder: str | Path, stage: Stage) -> Path:
    """Write ``folder/stage.json`` atomically (replacing only a stage file of the same kind),
    the commit point; then remove the complete shards it does not list (an earlier run's)."""
    write_output_file(check_stage_out(folder, stage.stage), stage.to_json(), STAGE_FILE)
    listed = {e.name for e in (*stage.shards, *stage.query_shards)}
    for entry in os.listdir(folder):  # never read (stage.json lists the shards), but kept
        path = Path(folder) / entry    # their disk space: a rerun with fewer shards left them
        if _SHARD_NAME.match(entry) and entry not in listed and not path.is_symlink():
            with contextlib.suppress(OSError):
                remove_shard(path)
    return Path(folder)


_SHARD_NAME = re.compile(r"(shard|doc|query|part)-[0-9]{5,}\Z")  # shard_name's


def read_stage(folder: str | Path, stage: str | None = None) -> Stage:
    """``folder/stage.json`` (FormatError: missing, damaged or not a ``stage`` stage)."""
    path = as_path(folder, "folder") / STAGE_FILE  # (an int: a raw TypeError naming nothing)
    try:
        body = read_json(path, "stage file")  # a FIFO was read forever, /dev/zero without bound
    except FileNotFoundError:
        raise FormatError(f"{folder} holds no complete stage ({STAGE_FILE} missing: not run "
                          f"yet, or interrupted)") from None
    except NotADirectoryError:  # a file given for the folder (a .npy, its stage.json): raw
        raise FormatError(f"{folder} is not a folder: a stage is a folder holding its "
                          f"{STAGE_FILE}") from None
    if not isinstance(body, dict) or body.get("format") != STAGE_FORMAT:
        raise FormatError(f"{path} is not a pefa_gpu stage file")
    if body.get("format_version") != 1:  # the only version written (a newer one: not read)
        raise FormatError(f"{path} has format_version {body.get('format_version')!r}; this "
                          f"pefa_gpu reads stage files of version 1")
    if stage is not None and body.get("stage") != stage:
        raise FormatError(f"{folder} holds a {body.get('stage')!r} stage, not {stage!r}")
    try:
        return Stage.from_dict(body)
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"{path} is damaged: {exc}") from None


class Rows:
    """The rows (``tensor``) of a row stage, read from its memory-mapped shards."""

    def __init__(self, folder: str | Path, tensor: str = "embeddings"):
        self.folder, self.tensor = as_path(folder, "folder"), tensor
        info = read_stage(self.folder)  # its shards tile rows 0 .. n (one shard at least)
        if info.stage in _NOT_ROWS:  # read as 0-wide rows: 'queries have dimension 0, ...'
            raise FormatError(f"{self.folder} holds a {info.stage!r} stage, not rows")
        self.shards, self.n, self.dim = info.shards, info.n, info.dim

    def _part(self, i: int) -> np.ndarray:
        tensors = open_entry(self.folder, self.shards[i]).tensors
        t, (lo, hi) = tensors.get(self.tensor), self.shards[i].rows
        if t is None or tuple(t.shape) != (hi - lo, self.dim):  # tensor='sums' of a row stage
            raise FormatError(f"{self.folder / self.shards[i].name} holds no {self.tensor!r} of "
                              f"its stage's shape ({hi - lo}, {self.dim}); it holds "
                              f"{sorted(tensors)}")
        return t.numpy()

    def read(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Rows lo .. hi-1, (hi-lo, d) float32: a view of the map when one shard holds them."""
        lo = check_nonnegative(lo, "lo")  # a float or str was a raw TypeError from a slice
        hi = self.n if hi is None else check_nonnegative(hi, "hi")
        if not lo <= hi <= self.n:
            raise InputError(f"rows [{lo}, {hi}) are outside {self.folder} (0 .. {self.n})")
        parts = [self._part(i)[max(lo, a) - a:min(hi, b) - a]
                 for i, (a, b) in enumerate(s.rows for s in self.shards) if a < hi and lo < b]
        parts = parts or [np.zeros((0, self.dim), dtype=np.float32)]
        return np.ascontiguousarray(parts[0] if len(parts) == 1 else np.concatenate(parts),
                                    dtype=np.float32)

    def take(self, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The rows at ascending int64 ``rows``, (len, d) float32 (into ``out`` when given)."""
        if getattr(rows, "dtype", np.dtype("O")).kind not in "iu" or rows.ndim != 1:
            raise InputError(f"rows must be a 1-D numpy array of integers, got "
                             f"{getattr(rows, 'dtype', type(rows).__name__)}")
        if rows.size and not 0 <= rows[0] <= rows[-1] < self.n:
            raise InputError(f"rows {rows[0]} .. {rows[-1]} are outside {self.folder} "
                             f"(0 .. {self.n})")
        if (rows[1:] < rows[:-1]).any():  # its shards' cuts: a raw IndexError, or wrong rows
            raise InputError("rows must be in ascending order")  # (np.diff wraps for uint64)
        if out is not None and (not isinstance(out, np.ndarray) or out.dtype != np.float32
                                or out.shape != (len(rows), self.dim)):
            raise InputError(f"out must be a ({len(rows)}, {self.dim}) float32 numpy array, "
                             f"got {getattr(out, 'shape', type(out).__name__)} "
                             f"{getattr(out, 'dtype', '')}")
        cuts = [0, *np.searchsorted(rows, [s.rows[1] for s in self.shards])]
        parts = {i: self._part(i) for i, (a, b) in enumerate(zip(cuts, cuts[1:])) if b > a}
        out = np.empty((len(rows), self.dim), dtype=np.float32) if out is None else out
        for i, part in parts.items():  # shapes checked (a forged dim was allocated first)
            a, b, lo = cuts[i], cuts[i + 1], self.shards[i].rows[0]
            np.take(part, rows[a:b] - lo, axis=0, out=out[a:b])  # no second copy of the rows
        return out


def write_rows(x: Any, out: str | Path, rows: int = DEFAULT_ROWS, stage: str = "rows",
               name: str = "embeddings") -> Path:
    """Write a (n, d) float matrix (numpy, memmap, torch) as ``rows``-row float32 shards."""
    if not hasattr(x, "shape") or len(x.shape) != 2:
        raise InputError(f"write_rows takes a 2-D array, got {type(x).__name__}")
    if not isinstance(stage, str) or not stage or stage in _NOT_ROWS:  # Stage's TypeError
        raise InputError(f"stage must be a non-empty name other than {_NOT_ROWS}, got "
                         f"{stage!r}")
    n, d = int(x.shape[0]), int(x.shape[1])
    check_stage_out(out, stage)
    shards = [write_shard(Path(out) / shard_name("shard", i), {"stage": stage, "rows": [lo, hi]},
                          {name: as_embeddings(x[lo:hi], "cpu", name, check_norm=False)})
              for i, (lo, hi) in enumerate(split(n, rows))]
    return write_stage(out, Stage(stage=stage, shards=tuple(shards), n=n, dim=d))


def read_rows(folder: str | Path, lo: int = 0, hi: int | None = None,
              tensor: str = "embeddings") -> np.ndarray:
    """Rows lo .. hi-1 of a row stage as a float32 array (all rows by default)."""
    return Rows(folder, tensor).read(lo, hi)


def write_relevance(Y: Any, out: str | Path, rows: int = DEFAULT_ROWS) -> Path:
    """Write Y (m x n: scipy sparse, Relevance, dense) as shards of ``rows`` query rows."""
    rel = as_relevance(Y)
    m, n = rel.shape
    check_stage_out(out, "relevance")
    shards = [write_shard(Path(out) / shard_name("shard", i),
                          {"stage": "relevance", "rows": [lo, hi]},
                          matrices={"relevance": rel.csr[lo:hi]})
              for i, (lo, hi) in enumerate(split(m, rows))]
    return write_stage(out, Stage(stage="relevance", shards=tuple(shards), n=n, m=m,
                                  nnz=rel.nnz))


def encode_fingerprint(texts: Sequence[str], identity: str | None, normalize: bool) -> str | None:
    """An encode shard's key: the model's identity, the normalisation, each text's SHA-256."""
    if identity is None:
        return None
    h = hashlib.sha256(f"{identity}|normalize={bool(normalize)}|{len(texts)}".encode())
    for t in texts:
        h.update(hashlib.sha256(t.encode("utf-8", "surrogatepass")).digest())
    return h.hexdigest()


def _written(out: str | Path, texts: Sequence[str], index: int, lo: int,
             fingerprint: str | None) -> dict[str, Any] | None:
    """The manifest of the complete shard ``out/shard-<index>`` of ``texts`` (rows lo ..) encoded
    with ``fingerprint`` and holding their (n, d) embeddings; else None."""
    save, n = _complete(Path(out) / shard_name("shard", index)), len(texts)
    m = save.manifest if save and save.manifest.get("fingerprint") == fingerprint else {}
    meta = m.get("tensors", {}).get("embeddings") if isinstance(m.get("tensors"), dict) else None
    shape = meta.get("shape") if isinstance(meta, dict) else None
    ok = m.get("rows") == [lo, lo + n] and all(type(r) is int for r in m["rows"]) \
        and isinstance(shape, list) and len(shape) == 2 and shape[0] == n and type(shape[1]) is int
    return m if ok else None


def encode_shard(texts: Sequence[str], out: str | Path, index: int, lo: int,
                 fingerprint: str | None, model: EncoderLike = None, batch_size: int = 64,
                 device: DeviceLike = None, cache_dir: str | Path | None = None,
                 normalize: bool = True) -> Entry:
    """Encode texts (rows lo ..) into ``out/shard-<index>`` unless a complete shard with this
    ``fingerprint`` is there; returns its stage entry."""
    path = Path(out) / shard_name("shard", index)
    if fingerprint is not None and (fields := _written(out, texts, index, lo, fingerprint)):
        return Entry.of(path, fields)
    emb = encode_texts(list(texts), model=model, batch_size=batch_size, device=device,
                       normalize=normalize, cache_dir=cache_dir, show_progress=False)
    return write_shard(path, {"stage": "encode", "rows": [lo, lo + len(texts)],
                              "fingerprint": fingerprint}, {"embeddings": emb.cpu()})


def encode(texts: Sequence[str], out: str | Path, model: EncoderLike = None,
           rows: int = 10_000, batch_size: int = 64, device: DeviceLike = None,
           cache_dir: str | Path | None = None, normalize: bool = True,
           show_progress: bool = True, runner: Any = None) -> Path:
    """Encode ``texts`` into a row stage of ``rows``-text shards on the runner's workers,
    keeping shards of the same texts and model (one with a ``cache_key``: picklable)."""
    texts = _check_texts(texts)
    out = as_path(out, "out")
    normalize = check_flag(normalize, "normalize")  # np.bool_ / 1: Stage's TypeError at the end
    check_stage_out(out, "encode")
    identity = resolve_model(model, "cpu").identity
    if identity is None:
        log.warning("encode: the model has no stable identity (give it a `cache_key`): every "
                    "shard is encoded again on every run")
    cache = None if cache_dir is None else str(cache_folder(cache_dir))  # the driver's ~
    task = functools.partial(encode_shard, out=str(out), model=model, batch_size=batch_size,
                             device=device, normalize=normalize, cache_dir=cache)
    plan = [dict(texts=texts[lo:hi], index=i, lo=lo,
                 fingerprint=encode_fingerprint(texts[lo:hi], identity, normalize))
            for i, (lo, hi) in enumerate(split(len(texts), rows))]
    pending = [kw for kw in plan if kw["fingerprint"] is None or _written(out, **kw) is None]
    if len(pending) < len(plan):
        log.info("encode: %d of %d shards of %s are written already", len(plan) - len(pending),
                 len(plan), out)
    if pending:
        (runner or LocalRunner()).encode(task, pending, show_progress=show_progress)
    manifests = [_written(out, **kw) for kw in plan]
    if None in manifests:
        raise FormatError(f"encode: shard {manifests.index(None)} of {out} is missing after "
                          f"the run")
    dims = [f["tensors"]["embeddings"]["shape"][1] for f in manifests]
    if len(set(dims)) > 1:  # was written, then every read said a shard is not of its shape
        raise InputError(f"encode: the model gave {out}'s shards embeddings of dimensions "
                         f"{sorted(set(dims))} (one changed under the same cache_key?)")
    dim = dims[0] if texts else 0
    shards = tuple(Entry.of(shard_name("shard", i), f) for i, f in enumerate(manifests))
    return write_stage(out, Stage(stage="encode", shards=shards, n=len(texts), dim=dim,
                                  model=identity, normalize=normalize))
