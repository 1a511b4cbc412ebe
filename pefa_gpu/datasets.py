"""Dataset loaders: the BEIR layout (corpus.jsonl, queries.jsonl, qrels/{split}.tsv) and pairs
files (TSV or parquet: query text or id, document id, optional weight)::

    ds = load_beir("../shared/datasets/scifact")
    rows, Y = ds.qrels("train", binary=True)   # query rows, Relevance (len(rows) x n_docs)
    pairs = load_pairs("clicks.tsv", ds.corpus_ids)   # pairs.query_texts, pairs.relevance
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import stat
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np

from .errors import InputError, MissingDependencyError
from .params import FLOAT32_MAX, check_flag, check_number, is_number
from .relevance import Relevance
from .storage import as_path, read_matrix


@dataclasses.dataclass
class BeirDataset:
    """A BEIR dataset in memory; a document's text is ``title + " " + text`` (``corpus_titles``:
    the titles alone, "" for none)."""

    root: Path
    corpus_ids: list[str]
    corpus_texts: list[str]
    query_ids: list[str]
    query_texts: list[str]
    corpus_titles: list[str] | None = None

    def __post_init__(self) -> None:
        self.doc_index = {d: i for i, d in enumerate(self.corpus_ids)}
        self.query_index = {q: i for i, q in enumerate(self.query_ids)}

    @property
    def name(self) -> str:
        return self.root.name

    def qrels(self, split: str, min_score: float = 1, binary: bool = False,
              keep_empty: bool = False) -> tuple[np.ndarray, Relevance]:
        """(sorted int64 query rows, Y (rows x n_docs)) of ``split``: pairs scoring >=
        ``min_score``, graded (a repeated pair: its largest score) or ``binary``; queries with
        no such pair kept as empty rows only with ``keep_empty``."""
        if not is_number(min_score):  # any sign: a BEIR score may be negative
            raise InputError(f"min_score must be a finite number, got {min_score!r}")
        check_flag(binary, "binary")
        check_flag(keep_empty, "keep_empty")
        if not isinstance(split, str):  # None was looked for as qrels/None.tsv
            raise TypeError(f"split must be a str (e.g. 'test'), got {type(split).__name__}")
        path = self.root / "qrels" / f"{split}.tsv"
        if not path.exists():
            have = sorted(p.stem for p in (self.root / "qrels").glob("*.tsv"))
            raise InputError(f"{path} not found; splits here: {have}")
        pairs: dict[tuple[int, int], float] = {}
        listed = set()
        for lineno, row in _qrels_rows(path):
            if len(row) not in (2, 3, 4):
                raise InputError(f"{path}:{lineno}: expected 'query-id<TAB>corpus-id<TAB>"
                                 f"score', got {len(row)} fields")
            qid, did = row[0], row[1] if len(row) != 4 else row[2]
            where = f"{path}:{lineno}" + (" (4 fields: TREC's query-id, iteration, corpus-id, "
                                          "score)" if len(row) == 4 else "")
            score = _number(row[-1] if len(row) >= 3 else None, where, "score")
            for rid, known, what, file in ((qid, self.query_index, "query", "queries"),
                                           (did, self.doc_index, "document", "corpus")):
                if rid not in known:
                    raise InputError(f"{where}: {what} id {rid!r} is not in {file}.jsonl")
            key = (self.query_index[qid], self.doc_index[did])
            listed.add(key[0])
            if score >= min_score:
                pairs[key] = max(score, pairs.get(key, score))
        if not pairs:
            raise InputError(f"{path}: no (query, document) pair with score >= {min_score}")
        rows = np.asarray(sorted(listed if keep_empty else {q for q, _ in pairs}), np.int64)
        qi, di = np.asarray(list(pairs), dtype=np.int64).T
        weights = None if binary else np.fromiter(pairs.values(), np.float32, len(pairs))
        return rows, Relevance.from_pairs(np.searchsorted(rows, qi), di, weights,
                                          shape=(rows.size, len(self.corpus_ids)))

    def embeddings(self, model: str = "all-MiniLM-L6-v2") -> tuple[np.ndarray, np.ndarray]:
        """Precomputed (corpus, queries) float32 embeddings from ``embeddings/{model}/``."""
        folder = self.root / "embeddings" / as_path(model, "model")
        out = []
        for part, rows in (("corpus", len(self.corpus_ids)), ("queries", len(self.query_ids))):
            path = folder / f"{part}.npy"
            if not path.exists():
                raise InputError(f"{path} not found: no precomputed embeddings for {model!r}; "
                                 f"encode the texts instead: pg.encode(ds.corpus_texts) and "
                                 f"pg.encode(ds.query_texts)")
            arr = read_matrix(path)  # names the file: text, truncated, objects, NaN
            d = out[0].shape[1] if out else "d >= 1"  # the queries: the corpus' dimension
            bad_dim = arr.shape[1] != d if out else arr.shape[1] == 0
            if arr.shape[0] != rows or bad_dim:
                raise InputError(f"{path} has shape {arr.shape}, expected ({rows}, {d}) to match "
                                 f"{part}.jsonl" + (" and corpus.npy" if out else ""))
            out.append(arr)
        return out[0], out[1]


def _qrels_rows(path: Path):
    """(line number, fields) per row of a qrels TSV, blank rows and a header skipped; ``csv``'s
    errors (an unclosed quote) as InputError naming the line."""
    reader = csv.reader((line for _, line in text_lines(path)), delimiter="\t")
    try:
        for lineno, row in enumerate(reader, start=1):
            if row and not (lineno == 1 and row[0].strip().lower() in ("query-id", "query_id",
                                                                         "qid")):
                yield lineno, row
    except csv.Error as exc:
        raise InputError(f"{path}:{reader.line_num}: {exc} (an unclosed quote?)") from None


def text_lines(path: Path, data: bool = False):
    """(line number, text) per line of a UTF-8 file, a leading BOM dropped; ``data``: non-blank
    lines only, without their line break. Not UTF-8: InputError naming the line and byte."""
    mode = os.stat(path).st_mode  # open() of a FIFO waits for a writer; /dev/zero never ends
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # a folder: open()'s IsADirectoryError
        raise InputError(f"{path} is not a regular file (a FIFO, device or socket); save the "
                         f"data to a file")
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InputError(f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} "
                                 f"at column {exc.start + 1}); save the file as UTF-8"
                                 ) from None
            line = line.removeprefix("\ufeff") if lineno == 1 else line
            if not data or line.strip():
                yield lineno, line.rstrip("\r\n") if data else line


def record_id(value: object, where: str, kind: str) -> str:
    """A non-empty string id (JSON integers: their digits) without control characters or lone
    surrogates (they break TSV / TREC outputs); else InputError naming ``where`` and the id."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise InputError(f"{where}: the {kind} id must be a string, got {value!r}")
    if not value.strip():
        raise InputError(f"{where}: empty {kind} id {value!r}")
    bad = [c for c in value if unicodedata.category(c) in ("Cc", "Zl", "Zp", "Cs")]
    if bad:  # Cs: a lone surrogate (JSON's "\ud800"), which UTF-8 output files cannot hold
        raise InputError(f"{where}: the {kind} id {value!r} holds {bad[0]!r}; control "
                         f"characters and lone surrogates would break the TSV / TREC outputs")
    return value


def check_utf8(text: str, where: str, field: str | None = None) -> None:
    """InputError naming ``where`` (and ``field``) where ``text`` holds a lone surrogate, which
    no UTF-8 output (nor the encoder) takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad, at = f"the lone surrogate {text[exc.start]!r}", f"at position {exc.start}"
        raise InputError(f"{where}: field {field!r} holds {bad} (a JSON escape without its pair) "
                         f"{at}, which UTF-8 text cannot hold" if field else
                         f"{where} is not valid Unicode: it holds {bad} {at} (text decoded with "
                         f"errors='surrogateescape'? decode it as UTF-8 properly)") from None


def json_record(line: str, where: str, field: str = "_id") -> dict:
    """One JSON object with a ``field`` field, else InputError naming ``where`` (file:line)."""
    try:
        rec = json.loads(line)
    except ValueError as exc:  # JSONDecodeError, or an integer of over 4300 digits
        raise InputError(f"{where}: not valid JSON ({getattr(exc, 'msg', exc)})") from None
    except RecursionError:
        raise InputError(f"{where}: JSON nested too deeply") from None
    if not isinstance(rec, dict) or field not in rec:
        raise InputError(f"{where}: expected a JSON object with a {field!r} field")
    return rec


def _read_jsonl(path: Path, kind: str) -> tuple[list[str], list[str], list[str]]:
    """ids, texts and titles of a .jsonl file."""
    if not path.exists():
        raise InputError(f"{path} not found (a BEIR folder has corpus.jsonl, queries.jsonl and "
                         f"qrels/)")
    records: dict[str, tuple[str, str]] = {}  # id -> (text, title)
    for lineno, line in text_lines(path, data=True):
        rec = json_record(line, f"{path}:{lineno}")
        rid = record_id(rec["_id"], f"{path}:{lineno}", kind)
        for field in ("text", "title"):
            if rec.get(field) is not None and not isinstance(rec[field], str):
                raise InputError(f"{path}:{lineno}: field {field!r} must be a string, got "
                                 f"{type(rec[field]).__name__}")
            check_utf8(rec.get(field) or "", f"{path}:{lineno}", field)
        if rid in records:
            raise InputError(f"{path}:{lineno}: duplicate {kind} id {rid!r}")
        if rec.get("text") is None and (kind == "query" or not rec.get("title")):
            raise InputError(f"{path}:{lineno}: {kind} {rid!r} has no 'text'"
                             + (" and no 'title'" if kind == "document" else ""))
        text, title = rec.get("text") or "", rec.get("title") or ""
        records[rid] = (f"{title} {text}" if title and kind == "document" else text, title)
    if not records:
        raise InputError(f"{path}: no records")
    return list(records), [text for text, _ in records.values()], [t for _, t in records.values()]


def load_beir(data_dir: str | Path) -> BeirDataset:
    """Read a BEIR folder: corpus.jsonl, queries.jsonl (qrels are read per split)."""
    root = as_path(data_dir, "data_dir")
    if not root.is_dir():
        raise InputError(f"{root} is not a directory")
    cids, ctexts, titles = _read_jsonl(root / "corpus.jsonl", "document")
    qids, qtexts, _ = _read_jsonl(root / "queries.jsonl", "query")
    return BeirDataset(root, cids, ctexts, qids, qtexts, titles)


_QUERY_COLS = ("query", "query_text", "query-text", "query_id", "query-id", "qid", "text")
_DOC_COLS = ("doc_id", "doc-id", "corpus-id", "corpus_id", "document", "document_id", "doc",
             "pid", "docid")
_WEIGHT_COLS = ("weight", "score", "label", "clicks", "count")


@dataclasses.dataclass
class Pairs:
    """Pairs read by :func:`load_pairs`: the distinct first-column values in first-seen order
    (``query_keys``), their texts, and Y (len(query_keys) x n_docs) in ``doc_ids`` order."""

    path: Path
    query_keys: list[str]
    query_texts: list[str]
    relevance: Relevance


def load_pairs(path: str | Path, doc_ids: "list[str] | dict[str, int]",
               queries: "dict[str, str] | None" = None, min_score: float | None = None,
               binary: bool = True) -> Pairs:
    """(query text, or id with ``queries``; document id; optional weight >= 0) pairs from a
    TSV (optional header) or parquet file (columns by name, else position); weights below
    ``min_score`` dropped; ``binary``: 1 per pair, else repeated pairs add up."""
    path = as_path(path, "path")
    check_number(min_score, "min_score", none_ok=True)
    check_flag(binary, "binary")
    index = _doc_index(doc_ids, queries)
    if not path.is_file():
        raise InputError(f"pairs file {path} "
                         + ("is not a file" if path.exists() else "not found"))
    read = _parquet_records if path.suffix.lower() in (".parquet", ".pq") else _tsv_records
    keys: dict[str, int] = {}
    qrows, docs, weights = [], [], []
    for where, q, d, w in read(path):
        if not q.strip():
            raise InputError(f"{where}: empty query")
        if queries is not None and q not in queries:
            raise InputError(f"{where}: query id {q!r} is not among the {len(queries)} known "
                             f"queries")
        if queries is not None and not isinstance(queries[q], str):  # was taken as its text
            raise InputError(f"{where}: the text queries gives query {q!r} is of type "
                             f"{type(queries[q]).__name__}, not a string")
        if d not in index:
            raise InputError(f"{where}: document id {d!r} is not in the corpus")
        w = _number(w, where, "weight", at_least=0)
        if (min_score is not None and w < min_score) or w == 0:
            continue
        qrows.append(keys.setdefault(q, len(keys)))
        docs.append(index[d])
        weights.append(w)
    if not qrows:
        raise InputError(f"{path}: no (query, document) pair"
                         + (f" with weight >= {min_score}" if min_score is not None else ""))
    try:
        y = Relevance.from_pairs(np.asarray(qrows), np.asarray(docs),
                                 None if binary else np.asarray(weights, dtype=np.float32),
                                 shape=(len(keys), len(index)))
    except InputError as exc:  # named 'Y', not the file
        raise InputError(f"{path}: the weights of a repeated pair add up beyond float32's "
                         f"range ({exc})") from None
    qkeys = list(keys)  # the texts a list of their own: writing one changed the keys too
    return Pairs(path, qkeys, list(qkeys) if queries is None else [queries[k] for k in qkeys], y)


def _doc_index(doc_ids: Any, queries: Any) -> dict:
    """load_pairs' document id -> column; TypeError for doc_ids that are not a list or dict (a
    str: a corpus of its letters; a set: columns in no order) or queries not a dict or None."""
    if isinstance(doc_ids, (str, bytes, set, frozenset)) or not hasattr(doc_ids, "__iter__"):
        raise TypeError(f"doc_ids must be a list of document ids (or a dict id -> column), got "
                        f"{type(doc_ids).__name__}")
    if queries is not None and not isinstance(queries, dict):
        raise TypeError(f"queries must be a dict query id -> text (or None), got "
                        f"{type(queries).__name__}")
    if isinstance(doc_ids, dict):  # a column out of range was from_pairs' "document ids out of
        n = len(doc_ids)  # range [0, n)", naming neither the id nor doc_ids
        bad = [k for k, v in doc_ids.items() if isinstance(v, bool)
               or not isinstance(v, (int, np.integer)) or not 0 <= v < n]
        if bad:
            raise InputError(f"doc_ids maps {bad[0]!r} to {doc_ids[bad[0]]!r}; the columns of "
                             f"its {n} documents are the integers 0 .. {n - 1}")
        return doc_ids
    doc_ids = list(doc_ids)
    index = {d: i for i, d in enumerate(doc_ids)}
    if len(index) < len(doc_ids):  # the columns after a repeat were shifted past the end
        dup = next(d for i, d in enumerate(doc_ids) if index[d] != i)
        raise InputError(f"doc_ids holds {dup!r} twice: one id per document (column)")
    return index


def _number(raw: Any, where: str, what: str, at_least: float = -math.inf) -> float:
    """A score or weight: 1 for None, else a number >= ``at_least`` that float32 (Y's) holds."""
    try:
        x = 1.0 if raw is None else float(raw)
    except (TypeError, ValueError):
        raise InputError(f"{where}: {what} {raw!r} is not a number") from None
    if not abs(x) <= FLOAT32_MAX or x < at_least:  # NaN, inf, 1e308 (Y is float32)
        raise InputError(f"{where}: {what} {raw!r} must be a finite number"
                         + (f" >= {at_least:g}" if at_least > -math.inf else "")
                         + " within float32's range (±3.4e38)")
    return x


def _tsv_records(path: Path):
    """(where, query, doc, weight-or-None) per data line of a TSV pairs file."""
    for lineno, line in text_lines(path, data=True):
        row = line.split("\t")
        if lineno == 1 and row[0].strip().lower() in _QUERY_COLS and len(row) >= 2 \
                and row[1].strip().lower() in _DOC_COLS:
            continue
        if len(row) not in (2, 3):
            raise InputError(f"{path}:{lineno}: expected 'query<TAB>doc_id[<TAB>weight]', "
                             f"got {len(row)} tab-separated fields")
        yield (f"{path}:{lineno}", row[0], row[1].strip(),
               row[2].strip() if len(row) == 3 else None)


def _parquet_records(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise MissingDependencyError("reading parquet pairs needs pyarrow: pip install pyarrow"
                                     ) from exc
    try:
        table = pq.read_table(path)
    except Exception as exc:
        raise InputError(f"{path}: not a readable parquet file ({exc})") from None
    names = [c.lower() for c in table.column_names]
    # query, doc, weight: the first of their names among the columns, else their position
    picked = [next((names.index(c) for c in choices if c in names), pos) for pos, choices
              in enumerate((_QUERY_COLS, _DOC_COLS, _WEIGHT_COLS))][:len(names)]
    if len(picked) < 2 or len(set(picked)) < len(picked):
        raise InputError(f"{path}: needs columns (query, doc_id[, weight]), has "
                         f"{table.column_names}")
    for row, (q, d, *w) in enumerate(zip(*(table.column(i).to_pylist() for i in picked))):
        where = f"{path}: row {row}"
        if not all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in (q, d)):
            raise InputError(f"{where}: missing query or document id, or one that is not a "
                             f"string or integer: {q!r}, {d!r}")
        if w and w[0] is None:  # None is 'no weight column' below: a null cell was weight 1
            raise InputError(f"{where}: the weight is missing (null); give every pair a weight "
                             f"or drop the weight column (then each pair counts 1)")
        yield where, str(q), str(d).strip(), w[0] if w else None
