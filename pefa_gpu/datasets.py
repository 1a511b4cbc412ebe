"""Dataset loaders: the BEIR layout (corpus.jsonl, queries.jsonl, qrels/{split}.tsv).

    ds = load_beir("../shared/datasets/scifact")
    rows, Y = ds.qrels("train")        # query row numbers, Relevance (len(rows) x n_docs)
    P, Qall = ds.embeddings("all-MiniLM-L6-v2")   # precomputed .npy, if the folder has them
"""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import numpy as np

from .errors import InputError
from .relevance import Relevance


@dataclasses.dataclass
class BeirDataset:
    """A BEIR-layout dataset held in memory. Documents are encoded as ``title + " " + text``."""

    root: Path
    corpus_ids: list[str]
    corpus_texts: list[str]
    query_ids: list[str]
    query_texts: list[str]

    def __post_init__(self) -> None:
        self.doc_index = {d: i for i, d in enumerate(self.corpus_ids)}
        self.query_index = {q: i for i, q in enumerate(self.query_ids)}

    @property
    def name(self) -> str:
        return self.root.name

    def qrels(self, split: str, min_score: float = 1, binary: bool = True
              ) -> tuple[np.ndarray, Relevance]:
        """Relevance of ``split``: (query rows into ``query_ids``, sorted, int64) and Y
        (len(rows) x n_docs). Pairs with score < ``min_score`` are not positives; ``binary``
        sets every positive to 1, else Y holds the graded scores (for nDCG)."""
        path = self.root / "qrels" / f"{split}.tsv"
        if not path.exists():
            have = sorted(p.stem for p in (self.root / "qrels").glob("*.tsv"))
            raise InputError(f"{path} not found; splits here: {have}")
        qrows, docs, scores = [], [], []
        with open(path, newline="", encoding="utf-8") as f:
            for lineno, row in enumerate(csv.reader(f, delimiter="\t"), start=1):
                if not row or (lineno == 1 and row[0].strip().lower() in ("query-id", "query_id", "qid")):
                    continue
                if len(row) not in (2, 3, 4):
                    raise InputError(f"{path}:{lineno}: expected 'query-id<TAB>corpus-id<TAB>"
                                     f"score', got {len(row)} fields")
                qid, did = row[0], row[1] if len(row) != 4 else row[2]
                raw = row[-1] if len(row) >= 3 else "1"
                try:
                    score = float(raw)
                except ValueError:
                    raise InputError(f"{path}:{lineno}: score {raw!r} is not a number") from None
                if qid not in self.query_index:
                    raise InputError(f"{path}:{lineno}: query id {qid!r} is not in queries.jsonl")
                if did not in self.doc_index:
                    raise InputError(f"{path}:{lineno}: document id {did!r} is not in "
                                     f"corpus.jsonl")
                if score >= min_score:
                    qrows.append(self.query_index[qid])
                    docs.append(self.doc_index[did])
                    scores.append(score)
        if not qrows:
            raise InputError(f"{path}: no (query, document) pair with score >= {min_score}")
        rows, local = np.unique(np.asarray(qrows, dtype=np.int64), return_inverse=True)
        weights = None if binary else np.asarray(scores, dtype=np.float32)
        if weights is not None:  # a repeated pair keeps its largest grade, not the sum
            key = local * len(self.corpus_ids) + np.asarray(docs)
            order = np.lexsort((-weights, key))
            keep = order[np.r_[True, key[order][1:] != key[order][:-1]]]
            local, docs, weights = local[keep], np.asarray(docs)[keep], weights[keep]
        y = Relevance.from_pairs(local, docs, weights, shape=(rows.size, len(self.corpus_ids)))
        return rows, y

    def embeddings(self, model: str = "all-MiniLM-L6-v2") -> tuple[np.ndarray, np.ndarray]:
        """Precomputed (corpus, queries) float32 embeddings from ``embeddings/{model}/``."""
        folder = self.root / "embeddings" / model
        out = []
        for part, rows in (("corpus", len(self.corpus_ids)), ("queries", len(self.query_ids))):
            path = folder / f"{part}.npy"
            if not path.exists():
                raise InputError(f"{path} not found: no precomputed embeddings for {model!r}")
            arr = np.load(path, mmap_mode="r")
            if arr.ndim != 2 or arr.shape[0] != rows:
                raise InputError(f"{path} has shape {arr.shape}, expected ({rows}, d) to match "
                                 f"{part}.jsonl")
            out.append(np.asarray(arr, dtype=np.float32))
        return out[0], out[1]


def _read_jsonl(path: Path, kind: str) -> tuple[list[str], list[str]]:
    if not path.exists():
        raise InputError(f"{path} not found (a BEIR folder has corpus.jsonl, queries.jsonl and "
                         f"qrels/)")
    ids, texts, seen = [], [], set()
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(rec, dict) or "_id" not in rec:
                raise InputError(f"{path}:{lineno}: a record needs an '_id' field")
            rid = str(rec["_id"])
            if rid in seen:
                raise InputError(f"{path}:{lineno}: duplicate {kind} id {rid!r}")
            seen.add(rid)
            text = str(rec.get("text", ""))
            if kind == "document":
                title = str(rec.get("title", "") or "")
                text = f"{title} {text}" if title else text
            ids.append(rid)
            texts.append(text)
    if not ids:
        raise InputError(f"{path}: no records")
    return ids, texts


def load_beir(data_dir: str | Path) -> BeirDataset:
    """Read a BEIR folder: corpus.jsonl, queries.jsonl (qrels are read per split)."""
    root = Path(data_dir)
    if not root.is_dir():
        raise InputError(f"{root} is not a directory")
    cids, ctexts = _read_jsonl(root / "corpus.jsonl", "document")
    qids, qtexts = _read_jsonl(root / "queries.jsonl", "query")
    return BeirDataset(root, cids, ctexts, qids, qtexts)
