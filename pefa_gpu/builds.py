"""The folder ``pefa-gpu build`` writes and ``pefa-gpu search`` reads: a storage save whose
manifest ``pefa_build.json`` (dataset, method, λ, k, encoder record) lists ``model/`` (a model
save), ``doc_ids.json`` ({"doc_ids": [...]}) and ``doc_text.json`` ({"titles", "snippets"}).
The encoder record ``{"kind", "name"}``: kind ``default``, ``hub``, ``folder``, ``callable``
or ``precomputed``; search takes only the default model or a hub name from it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Sequence

from .arrays import DeviceLike
from .datasets import record_id
from .encode import DEFAULT_MODEL, is_default_model
from .errors import FormatError, InputError
from .protocol import Model
from .storage import open_save, read_unchanged, sha256_file, writing_save

BUILD_MANIFEST = "pefa_build.json"
BUILD_FORMAT = "pefa-gpu-build"
SNIPPET_CHARS = 200  # characters of a document's text a build keeps for search to show
_HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?\Z")


def save_build(model: Model, out: str | Path, doc_ids: Sequence[str], info: dict,
               titles: Sequence[str] | None = None, texts: Sequence[str] | None = None
               ) -> Path:
    """Write a build folder at ``out`` atomically (``info``: manifest fields; of ``texts`` a
    snippet is kept); the ids, titles and texts are checked as :func:`load_build` checks them."""
    # checked here: a build load_build refuses (ids repeated, miscounted) was written
    tables = {"doc_ids": {"doc_ids": check_doc_ids(doc_ids, model.n_docs, "doc_ids")}}
    if titles is not None and texts is not None:
        titles, texts = (_strings(col, model.n_docs, name)
                         for name, col in (("titles", titles), ("texts", texts)))
        tables["doc_text"] = {"titles": [one_line(t) for t in titles],
                              "snippets": [one_line(t, SNIPPET_CHARS) for t in texts]}
    with writing_save(out, BUILD_MANIFEST, BUILD_FORMAT) as w:
        model.save(w.data / "model")
        for field, table in tables.items():
            (w.data / f"{field}.json").write_text(json.dumps(table) + "\n", encoding="utf-8")
        w.commit({**info, "model": "model", **{field: f"{field}.json" for field in tables}})
    return Path(out)


def one_line(text: str, limit: int | None = None) -> str:
    """``text`` with each whitespace run as one space, cut to ``limit`` characters ("…")."""
    flat = " ".join(text.split())
    return flat if limit is None or len(flat) <= limit else flat[:limit - 1].rstrip() + "…"


def load_doc_text(path: str | Path, n_docs: int, info: dict | None = None
                  ) -> tuple[list[str], list[str]] | None:
    """(titles, snippets) of a build's ``n_docs`` documents (checked), or None without them;
    ``info``: the manifest :func:`load_build` returned (a build replaced since is refused)."""
    save = open_save(Path(path), BUILD_MANIFEST, BUILD_FORMAT, checksums=False)
    if info is not None and save.manifest != info:  # its texts would label the old ids
        raise FormatError(f"{path} changed since its model was loaded; search again")
    rel = save.manifest.get("doc_text")
    if rel is None:
        return None
    file = save.file(rel)
    if sha256_file(file) != save.manifest["files"][rel]["sha256"]:
        raise FormatError(f"{file} is corrupted: its sha256 does not match the manifest")
    titles, snippets = _json_fields(file, "a document text table", "titles", "snippets")
    for name, col in (("titles", titles), ("snippets", snippets)):
        if not isinstance(col, list) or len(col) != n_docs \
                or not all(isinstance(t, str) for t in col):
            raise FormatError(f'{file}: "{name}" must be a list of {n_docs} strings')
    return [one_line(t) for t in titles], [one_line(t) for t in snippets]


def load_build(path: str | Path, device: DeviceLike = None) -> tuple[Model, list[str], dict]:
    """(model, document ids, build info) from a build folder, every file checked (read again
    once if replaced meanwhile)."""
    return read_unchanged(path, lambda: _load_build(path, device), BUILD_MANIFEST)


def _load_build(path: str | Path, device: DeviceLike) -> tuple[Model, list[str], dict]:
    from .persist import load_model

    root = Path(path)
    if not root.exists():
        raise InputError(f"{root} does not exist (give the folder `pefa-gpu build --out` wrote)")
    if not root.is_dir():  # e.g. its pefa_build.json: it said 'pefa_build.json missing'
        raise InputError(f"{root} is {'a file' if root.is_file() else 'not a folder'}; give the "
                         f"folder `pefa-gpu build --out` wrote")  # a FIFO is not a file
    save = open_save(root, BUILD_MANIFEST, BUILD_FORMAT)
    info = save.manifest
    ids_file = save.file(info.get("doc_ids"))
    model = load_model(save.folder(info.get("model")), device=device, verify=False)
    doc_ids, = _json_fields(ids_file, 'a document id list {"doc_ids": ["id", ...]}', "doc_ids")
    if not isinstance(doc_ids, list):
        raise FormatError(f'{ids_file}: "doc_ids" must be a list of strings')
    try:
        return model, check_doc_ids(doc_ids, model.n_docs, str(ids_file)), info
    except InputError as exc:
        raise FormatError(str(exc)) from None


def check_doc_ids(doc_ids: Sequence[str], n_docs: int, where: str) -> list[str]:
    """``doc_ids`` as a list if they are ``n_docs`` distinct strings :func:`record_id` takes;
    else InputError naming ``where``."""
    ids = _strings(doc_ids, None, where)
    if len(set(ids)) != len(ids):
        raise InputError(f"{where}: the document ids are not unique")
    for i, d in enumerate(ids):
        record_id(d, f"{where}: entry {i}", "document")
    if len(ids) != n_docs:
        raise InputError(f"{where}: {len(ids)} document ids for a model of {n_docs} documents")
    return ids


def _strings(values: Sequence[str], n: int | None, where: str) -> list[str]:
    """``values`` as a list of (``n``) strings; else InputError naming ``where``."""
    out = list(values) if not isinstance(values, (str, set, frozenset, dict)) \
        and hasattr(values, "__iter__") else None  # a set: in an order no document has
    if out is None or not all(isinstance(v, str) for v in out) or n not in (None, len(out)):
        many = "" if n is None else f"{n} "
        raise InputError(f"{where} must be a list of {many}strings (one a document)")
    return out


def _json_fields(file: Path, what: str, *keys: str) -> list:
    """The ``keys`` of the JSON object in ``file``; else FormatError saying it is not ``what``."""
    try:
        table = json.loads(file.read_text(encoding="utf-8"))
        return [table[key] for key in keys]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise FormatError(f"{file} is not {what} ({type(exc).__name__}: {exc})") from None


def encoder_record(model: str | None, embeddings: str | None) -> dict[str, str]:
    """What made a build's embeddings, from ``--model`` / ``--embeddings``."""
    if embeddings:
        return {"kind": "precomputed", "name": embeddings}
    if model is None or is_default_model(model):
        return {"kind": "default", "name": DEFAULT_MODEL}
    if Path(model).exists():
        return {"kind": "folder", "name": str(Path(model).resolve())}
    if ":" in model:
        return {"kind": "callable", "name": model}
    return {"kind": "hub", "name": model}


def encoder_from_record(record: object, where: Path) -> str | None:
    """None (the default model) or a hub name from a build's record; else InputError asking
    for --model."""
    if not isinstance(record, dict) or not isinstance(record.get("name"), str):
        raise FormatError(f"{where}: no valid 'encoder' record (got {record!r})")
    kind, name = record.get("kind"), record["name"]
    if kind == "default":
        return None
    if kind == "hub":
        if not _HUB_NAME.match(name) or ".." in name:
            raise FormatError(f"{where}: encoder {name!r} is not a hub model name")
        if Path(name).exists():
            raise InputError(f"{where} names the hub model {name!r}, but a local path of that "
                             f"name exists here; pass --model explicitly")
        return name
    if kind == "precomputed":
        raise InputError(f"{where}: the build used precomputed embeddings {name!r} and does "
                         f"not record which encoder made them; pass --model (e.g. --model "
                         f"all-MiniLM-L6-v2 if that model made them) to search from text")
    if kind in ("callable", "folder"):
        raise InputError(f"{where}: the build was encoded with --model {name!r}; pass --model "
                         f"{name!r} again (a build folder never names code to run or a folder "
                         f"to load)")
    raise InputError(f"{where}: the build names the encoder {name!r}, which may be a model or "
                     f"the name of precomputed embeddings; pass --model to search from text")
