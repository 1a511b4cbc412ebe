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


# -- NUDGE (Zeighami et al., 2024), from the paper's closed forms, in float64 ---------------

def nudge_sums(P, Q, Y):
    """(unit documents D, query sums G = Yᵀ Q), float64."""
    return normalize(np.asarray(P, np.float64)), dense(Y).T @ np.asarray(Q, np.float64)


def nudge_m(D, G, gamma):
    """argmax Σ_j <g_j, Δ_j> s.t. ‖Δ_j‖ <= γ: Δ_j = γ g_j / ‖g_j‖ (0 when g_j = 0)."""
    return D + gamma * normalize(G)


def nudge_n(D, G, gamma):
    """argmax <g_j, e_j> over unit e_j with ‖e_j - d_j‖² <= γ, by angles: the allowed cap is
    the angle θ = arccos(1 - γ/2) around d_j; e_j = ĝ_j inside it, else d_j turned by θ toward
    g_j. Documents with g_j = 0, g_j ∥ d_j or <d_j, g_j> < 0 keep d_j unless ĝ_j is in reach
    (the authors' code)."""
    out = D.copy()
    if gamma == 0:
        return out
    theta = np.arccos(np.clip(1 - gamma / 2, -1, 1))
    for j in range(D.shape[0]):
        d, g = D[j], G[j]
        gn = np.linalg.norm(g)
        if gn == 0:
            continue
        phi = np.arccos(np.clip(d @ g / gn, -1, 1))
        if phi <= theta + 1e-12:
            out[j] = g / gn
            continue
        perp = g - (d @ g) * d
        if d @ g < 0 or np.linalg.norm(perp) < 1e-12 * gn:
            continue
        out[j] = np.cos(theta) * d + np.sin(theta) * perp / np.linalg.norm(perp)
    return out


def nudge_gamma_m(D, G, Qv, Yv, tol=1e-9):
    """The smallest γ >= 0 maximising the validation pairs (q, x) whose x is a top-1 of
    <q, d_j + γ ĝ_j> (ties win), by trying every γ where two scores cross."""
    Qv, Gh, Yd = np.asarray(Qv, np.float64), normalize(G), dense(Yv)
    S, T = Qv @ D.T, Qv @ Gh.T
    pairs = np.argwhere(Yd > 0)
    cands = {0.0}
    for qi, x in pairs:
        dt = T[qi] - T[qi, x]
        ds = S[qi] - S[qi, x]
        nz = dt != 0
        cands.update(float(c) for c in (-ds[nz] / dt[nz]) if c >= 0)
    best, best_count = 0.0, 0
    for c in sorted(cands):
        sc = S + c * T
        wins = sum(sc[qi, x] >= sc[qi].max() - tol for qi, x in pairs)
        if wins > best_count:
            best, best_count = c, wins
    return best


def nudge_gamma_n(D, G, Qv, Yv, val_k=1):
    """The first γ of 0, 0.02, ..., 0.48 with the best mean |top-val_k ∩ relevant| /
    min(|relevant|, val_k) over validation queries with a relevant document."""
    Qv, Yd = np.asarray(Qv, np.float64), dense(Yv) > 0
    keep = Yd.sum(1) > 0
    best, best_acc = 0.0, -1.0
    for x in range(25):
        gamma = 0.02 * x
        _, ids = exact_search(nudge_n(D, G, gamma), Qv[keep], val_k)
        hits = np.take_along_axis(Yd[keep], ids, 1).sum(1)
        acc = np.mean(hits / np.minimum(Yd[keep].sum(1), val_k))
        if acc > best_acc + 1e-12:
            best, best_acc = gamma, acc
    return best
