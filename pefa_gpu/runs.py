"""``pefa-gpu search``'s files: queries read from .jsonl, .tsv or plain lines, results written as
TSV, JSON or a TREC run."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Sequence

import numpy as np

from .datasets import check_utf8, json_record, record_id, text_lines
from .errors import InputError
from .storage import as_path


def query_id(text: str) -> str:
    """A stable id for a query given without one: one id per text (lone surrogates too)."""
    return "q-" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:10]


def read_queries(path: str | Path) -> list[tuple[str, str]]:
    """(id, text) pairs from .jsonl (_id/text), .tsv (id<TAB>text) or plain lines (ids from
    :func:`query_id`); a bad line: InputError naming file:line."""
    p = as_path(path, "path")
    if not p.is_file():
        raise InputError(f"queries file {p} " + ("is not a file" if p.exists() else "not found"))
    out, suffix = [], p.suffix.lower()  # Q.JSONL too (its lines were taken as query texts)
    for lineno, line in text_lines(p, data=True):
        where = f"{p}:{lineno}"
        if suffix == ".jsonl":
            rec = json_record(line, where, "text")
            if not isinstance(rec["text"], str):
                raise InputError(f"{where}: expected a JSON object with a 'text' string")
            check_utf8(rec["text"], where, "text")  # was encode's "text 0 is not valid Unicode"
            qid = record_id(rec["_id"], where, "query") if "_id" in rec else query_id(rec["text"])
            out.append((qid, rec["text"]))
        elif suffix == ".tsv":
            parts = line.split("\t")
            if len(parts) != 2:
                raise InputError(f"{where}: expected 'id<TAB>text', got {len(parts)} fields")
            out.append((record_id(parts[0], where, "query"), parts[1]))
        else:
            out.append((query_id(line), line))
        if not out[-1][1].strip():  # a slip (an unset variable?): refused, not searched
            raise InputError(f"{where}: empty query text {out[-1][1]!r}")
    return out


def queries(texts: Sequence[str], path: str | Path | None = None) -> list[tuple[str, str]]:
    """(id, text) of ``texts``, then of the file ``path``, each once; one id with two texts:
    InputError. An empty (or whitespace) text: InputError naming its position."""
    if not isinstance(texts, (list, tuple)):  # a str was searched letter by letter
        raise TypeError(f"texts must be a list of query texts, got {type(texts).__name__}")
    for i, text in enumerate(texts, start=1):
        if not isinstance(text, str):
            raise TypeError(f"QUERY text {i} must be a str, got {type(text).__name__}")
        if not text.strip():
            raise InputError(f"QUERY text {i} is empty ({text!r}): give a text or leave it out")
    seen: dict[str, str] = {}
    for qid, text in [(query_id(t), t) for t in texts] + (read_queries(path) if path else []):
        if seen.setdefault(qid, text) != text:
            raise InputError(f"query id {qid!r} is given twice with different texts")
    if not seen:
        raise InputError("no queries" + (f": the queries file {path} holds none" if path else ""))
    return list(seen.items())


def _check_run(fmt: str, queries: Sequence[tuple[str, str]], scores: np.ndarray,
               ids: np.ndarray, n_docs: int, tag: str,
               doc_text: tuple[Sequence[str], Sequence[str]] | None) -> None:
    """format_results' InputErrors: fmt, tag, doc_text, scores / ids (shapes, id range, NaN)."""
    n_queries = len(queries)
    _check_dtypes(scores, ids)
    if fmt not in ("tsv", "json", "trec"):
        raise InputError(f"fmt must be 'tsv', 'json' or 'trec', got {fmt!r}")
    if fmt == "trec" and (not isinstance(tag, str) or not tag or any(c.isspace() for c in tag)):
        raise InputError(f"tag must be one word (a TREC run field), got {tag!r}")
    if doc_text is not None and any(len(part) != n_docs for part in doc_text):  # IndexError
        raise InputError(f"doc_text must be (titles, texts) of the {n_docs} documents, got "
                         f"{' and '.join(str(len(part)) for part in doc_text)}")
    if np.shape(ids) != np.shape(scores) or np.ndim(ids) != 2 or len(ids) != n_queries \
            or np.size(ids) and not -1 <= int(np.min(ids)) <= int(np.max(ids)) < n_docs:
        raise InputError(f"scores and ids must be ({n_queries}, k) arrays (ids below the "
                         f"{n_docs} documents, -1 for no result), got shapes "
                         f"{np.shape(scores)} and {np.shape(ids)}")
    bad = np.flatnonzero((~np.isfinite(np.asarray(scores, float)) & (np.asarray(ids) >= 0))
                         .any(1)) if fmt == "json" and np.size(ids) else []
    if len(bad):
        raise InputError(f"query {queries[bad[0]][0]!r} has a result scored NaN or inf "
                         f"(embeddings beyond float32's range?); JSON cannot hold it: use "
                         f"--format tsv")


def _check_dtypes(scores: np.ndarray, ids: np.ndarray) -> None:
    """InputError unless ids are integers and scores real numbers (a NaN id was a bare
    ValueError, 1.7 read as document 1, True as document 1, a str score a bare ValueError)."""
    for name, value, kinds in (("ids", ids, "iu"), ("scores", scores, "iuf")):
        if np.size(value) and np.asarray(value).dtype.kind not in kinds:
            raise InputError(f"{name} must be an array of "
                             f"{'integers' if name == 'ids' else 'real numbers'}, got dtype "
                             f"{np.asarray(value).dtype}")


def format_results(fmt: str, queries: Sequence[tuple[str, str]], scores: np.ndarray,
                   ids: np.ndarray, doc_ids: Sequence[str], tag: str,
                   doc_text: tuple[Sequence[str], Sequence[str]] | None = None) -> str:
    """The run as text: ``fmt`` 'tsv', 'json' or 'trec'; scores / ids (B, k) float32 / int64
    rows (-1: no result), one per query; doc_text: (titles, text snippets) of the documents,
    shown in TSV columns / JSON fields."""
    _check_run(fmt, queries, scores, ids, len(doc_ids), tag, doc_text)
    hits = [(qid, t, [(r + 1, doc_ids[int(i)], float(s), {} if doc_text is None else
                       {"title": doc_text[0][int(i)], "text": doc_text[1][int(i)]})
                      for r, (i, s) in enumerate(zip(ids[b], scores[b])) if i >= 0])
            for b, (qid, t) in enumerate(queries)]
    if fmt == "json":
        return json.dumps([{"query_id": qid, "query": t, "results": [
            {"rank": r, "doc_id": d, "score": s, **more} for r, d, s, more in rows]}
            for qid, t, rows in hits], indent=2) + "\n"
    flat = [(qid, *row) for qid, _, rows in hits for row in rows]
    if fmt == "trec":
        for qid, _, d, _, _ in flat:
            for what, value in (("query", qid), ("document", d)):
                if any(c.isspace() for c in value):
                    raise InputError(f"the TREC run format cannot hold ids with spaces: "
                                     f"{what} id {value!r} (use --format tsv or json)")
        return "".join(f"{qid} Q0 {d} {r} {s:.6f} {tag}\n" for qid, r, d, s, _ in flat)
    lines = ["query_id\trank\tdoc_id\tscore" + ("\ttitle\ttext" if doc_text else "")]
    lines += [f"{qid}\t{r}\t{d}\t{s:.6f}" + "".join(f"\t{v}" for v in more.values())
              for qid, r, d, s, more in flat]
    return "\n".join(lines) + "\n"
