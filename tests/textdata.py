"""Small text datasets in BEIR layout and a tiny deterministic text encoder, for the tests of
encode / datasets / sweep / tune / cli. Nothing here needs a real model."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np


class BowEncoder:
    """Hashed bag of words: each word adds ±1 to one of ``dim`` coordinates (not normalised).
    Counts its calls and the texts it saw."""

    cache_key = "tests.textdata.BowEncoder/v1"
    total_seen = 0  # over all instances (the CLI makes its own)

    def __init__(self, dim: int = 48):
        self.dim = dim
        self.calls = 0
        self.seen = 0

    def __call__(self, texts):
        self.calls += 1
        self.seen += len(texts)
        BowEncoder.total_seen += len(texts)
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, t in enumerate(texts):
            for w in t.lower().split():
                h = int(hashlib.sha256(w.encode()).hexdigest(), 16)
                out[i, h % self.dim] += 1.0 if (h >> 20) & 1 else -1.0
        return out


def bow_unit(texts, dim: int = 48) -> np.ndarray:
    """BowEncoder rows L2-normalised in float64 (zero rows stay zero): the reference."""
    x = BowEncoder(dim)(texts).astype(np.float64)
    n = np.linalg.norm(x, axis=1, keepdims=True)
    return np.where(n > 0, x / np.where(n > 0, n, 1), 0.0)


def write_beir(root: Path, n_topics: int = 6, docs_per_topic: int = 5, train_per_doc: int = 2,
               test_per_topic: int = 3, seed: int = 0, cover_test: bool = True,
               noise_train: bool = False, mismatch: bool = False) -> Path:
    """A BEIR folder of topical documents and queries.

    Each topic has its own words; a document mixes its topic's words with shared ones. Training
    queries use words of a document's topic and are labelled with that document (``noise_train``:
    with a random document instead). Test queries (ids disjoint from training ones) are
    labelled with documents of their topic; ``cover_test=False`` labels them only with
    documents that no training query points to. ``mismatch``: queries use their own topic
    words, never found in documents (plain embedding search is then weak, training pairs help).
    """
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    (root / "qrels").mkdir(exist_ok=True)
    shared = [f"common{i}" for i in range(30)]
    topic_words = [[f"t{t}w{i}" for i in range(12)] for t in range(n_topics)]
    query_words = ([[f"q{t}w{i}" for i in range(6)] for t in range(n_topics)] if mismatch
                   else topic_words)
    docs = []
    for t in range(n_topics):
        for j in range(docs_per_topic):
            words = list(rng.choice(topic_words[t], 5)) + list(rng.choice(shared, 6))
            docs.append((f"d{t}_{j}", t, f"title {t}", " ".join(words)))
    with open(root / "corpus.jsonl", "w") as f:
        for did, _, title, text in docs:
            f.write(json.dumps({"_id": did, "title": title, "text": text}) + "\n")
    queries, train, test = [], [], []
    n_docs = len(docs)
    covered = set()
    for di, (did, t, _, _) in enumerate(docs):
        if not cover_test and di % docs_per_topic >= docs_per_topic // 2:
            continue  # the second half of each topic's documents gets no training query
        for r in range(train_per_doc):
            qid = f"tr{di}_{r}"
            words = list(rng.choice(query_words[t], 3)) + list(rng.choice(shared, 2))
            queries.append((qid, " ".join(words)))
            target = docs[int(rng.integers(n_docs))][0] if noise_train else did
            train.append((qid, target, 1))
            covered.add(target)
    for t in range(n_topics):
        for r in range(test_per_topic):
            qid = f"te{t}_{r}"
            words = list(rng.choice(query_words[t], 3)) + list(rng.choice(shared, 2))
            queries.append((qid, " ".join(words)))
            cands = [d[0] for d in docs if d[1] == t and (cover_test or d[0] not in covered)]
            for did in rng.choice(cands, min(2, len(cands)), replace=False):
                test.append((qid, str(did), int(rng.integers(1, 3))))
    with open(root / "queries.jsonl", "w") as f:
        for qid, text in queries:
            f.write(json.dumps({"_id": qid, "text": text}) + "\n")
    for name, rows in (("train", train), ("test", test)):
        with open(root / "qrels" / f"{name}.tsv", "w") as f:
            f.write("query-id\tcorpus-id\tscore\n")
            for q, d, s in rows:
                f.write(f"{q}\t{d}\t{s}\n")
    return root


def write_embeddings(root: Path, name: str = "bow", dim: int = 48) -> None:
    """Precomputed embeddings/NAME/{corpus,queries}.npy made with :class:`BowEncoder`."""
    corpus = [json.loads(l) for l in open(root / "corpus.jsonl")]
    queries = [json.loads(l) for l in open(root / "queries.jsonl")]
    folder = root / "embeddings" / name
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "corpus.npy",
            bow_unit([f"{c['title']} {c['text']}" for c in corpus], dim).astype(np.float32))
    np.save(folder / "queries.npy", bow_unit([q["text"] for q in queries], dim).astype(np.float32))
