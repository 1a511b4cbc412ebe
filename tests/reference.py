"""Independent float64 numpy references for PEFA (DESIGN.md §1), written apart from the library."""

from __future__ import annotations

import numpy as np


def dense(Y) -> np.ndarray:
    """Relevance / scipy / ndarray -> dense float64 array."""
    if hasattr(Y, "csr"):
        Y = Y.csr
    if hasattr(Y, "toarray"):
        return Y.toarray().astype(np.float64)
    return np.asarray(Y, dtype=np.float64)


def normalize(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    out = np.zeros_like(x)
    nz = norms[:, 0] > 0
    out[nz] = x[nz] / norms[nz]
    return out


def pifa(Y, Q, normalize_rows: bool = True) -> np.ndarray:
    A = dense(Y).T @ np.asarray(Q, dtype=np.float64)
    return normalize(A) if normalize_rows else A


def topk(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise best k, ties to the lower column; pads with (-inf, -1)."""
    b, n = scores.shape
    vals = np.full((b, k), -np.inf)
    ids = np.full((b, k), -1, dtype=np.int64)
    for i in range(b):
        order = np.lexsort((np.arange(n), -scores[i]))[:k]
        vals[i, :order.size] = scores[i, order]
        ids[i, :order.size] = order
    return vals, ids


def exact_search(X, T, k):
    return topk(np.asarray(T, np.float64) @ np.asarray(X, np.float64).T, k)


def xs_embeddings(P, Q, Y, lam, augment_docs=True):
    P = np.asarray(P, np.float64)
    A = dense(Y).T @ np.asarray(Q, np.float64)
    if augment_docs:
        A = A + P
    return lam * P + (1 - lam) * normalize(A)


def xl_search(P, Q, Y, T, *, lam, k, candidates, knn_norm="k", rescore=True,
              augment_docs=True, topk_out=10):
    """PEFA-XL for each test query, one at a time, with Python sets and dicts."""
    P = np.asarray(P, np.float64)
    Q = np.asarray(Q, np.float64)
    Yd = dense(Y)
    n = P.shape[0]
    if augment_docs:
        Q = np.vstack([Q, P])
        Yd = np.vstack([Yd, np.eye(n)])
    out_s = np.full((len(T), topk_out), -np.inf)
    out_i = np.full((len(T), topk_out), -1, dtype=np.int64)
    for b, q in enumerate(np.asarray(T, np.float64)):
        erm = P @ q
        c_order = np.lexsort((np.arange(n), -erm))[:candidates]
        sims = Q @ q
        nbrs = np.lexsort((np.arange(len(Q)), -sims))[:k]
        f_knn: dict[int, float] = {}
        for i in nbrs:
            w = sims[i] / k if knn_norm == "k" else sims[i]
            for j in np.nonzero(Yd[i])[0]:
                f_knn[j] = f_knn.get(j, 0.0) + w * Yd[i, j]
        cands = set(c_order.tolist()) | set(f_knn)
        in_c = set(c_order.tolist())
        fused = []
        for j in cands:
            f_erm = erm[j] if (rescore or j in in_c) else 0.0
            fused.append((-(lam * f_erm + (1 - lam) * f_knn.get(j, 0.0)), j))
        fused.sort()
        for r, (neg, j) in enumerate(fused[:topk_out]):
            out_s[b, r], out_i[b, r] = -neg, j
    return out_s, out_i


def recall(ids: np.ndarray, Y, k: int) -> float:
    Yd = dense(Y)
    vals = []
    for i in range(Yd.shape[0]):
        rel = set(np.nonzero(Yd[i] > 0)[0].tolist())
        if not rel:
            continue
        got = set(int(x) for x in ids[i, :k] if x >= 0)
        vals.append(len(rel & got) / len(rel))
    return float(np.mean(vals))


def ndcg(ids: np.ndarray, Y, k: int) -> float:
    Yd = dense(Y)
    vals = []
    for i in range(Yd.shape[0]):
        if not (Yd[i] > 0).any():
            continue
        seen, dcg = set(), 0.0
        for r, j in enumerate(ids[i, :k]):
            if j >= 0 and j not in seen:
                dcg += max(Yd[i, j], 0) / np.log2(r + 2)
            seen.add(int(j))
        ideal = np.sort(Yd[i][Yd[i] > 0])[::-1][:k]
        idcg = sum(g / np.log2(r + 2) for r, g in enumerate(ideal))
        vals.append(dcg / idcg)
    return float(np.mean(vals))


def mrr(ids: np.ndarray, Y, k: int) -> float:
    Yd = dense(Y)
    vals = []
    for i in range(Yd.shape[0]):
        if not (Yd[i] > 0).any():
            continue
        rr = 0.0
        for r, j in enumerate(ids[i, :k]):
            if j >= 0 and Yd[i, j] > 0:
                rr = 1.0 / (r + 1)
                break
        vals.append(rr)
    return float(np.mean(vals))
