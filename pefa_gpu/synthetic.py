"""Seeded synthetic retrieval data for scale runs: clustered unit documents; each query is a
Zipf-popular target document plus noise, with a power-law number of relevant documents (the
target and others of its cluster)."""

from __future__ import annotations

import dataclasses

import numpy as np

from .errors import InputError
from .params import check_memory, check_nonnegative, check_positive, is_number
from .relevance import Relevance

MAX_NOISE = 1e6  # noise norms: past it a row is noise alone, and float32 squares overflow


@dataclasses.dataclass(frozen=True)
class SyntheticData:
    """P (n, d), Q (m, d), Q_test (t, d): float32 unit rows; Y (m x n), Y_test (t x n)."""

    P: np.ndarray
    Q: np.ndarray
    Y: Relevance
    Q_test: np.ndarray
    Y_test: Relevance


def make_synthetic(n: int, m: int, d: int = 64, n_test: int = 1000, *, clusters: int | None = None,
                   popularity: float = 1.1, rel_exponent: float = 2.5, max_rel: int = 50,
                   doc_noise: float = 0.6, query_noise: float = 0.8,
                   seed: int = 0) -> SyntheticData:
    """``n`` documents, ``m`` training and ``n_test`` test queries in ``d`` dimensions. Zipf
    exponents: ``popularity`` of the targets, ``rel_exponent`` of the relevant documents per
    query (at most ``max_rel``); noise norms relative to the unit centre / target."""
    n, m, d = (check_positive(v, k) for v, k in ((n, "n"), (m, "m"), (d, "d")))
    n_test, max_rel = check_nonnegative(n_test, "n_test"), check_positive(max_rel, "max_rel")
    real = all(isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)
               for x in (popularity, rel_exponent))  # '1' was '<=''s TypeError, NaN taken
    if not (real and popularity > 0 and rel_exponent > 1):
        raise InputError(f"popularity must be > 0 and rel_exponent > 1, got {popularity!r}, "
                         f"{rel_exponent!r}")
    for name, v in (("doc_noise", doc_noise), ("query_noise", query_noise)):
        if not (is_number(v) and 0 <= v <= MAX_NOISE):  # NaN / 1e38: NaN or zero rows
            raise InputError(f"{name} must be a number in [0, {MAX_NOISE:g}] (a norm relative "
                             f"to the unit signal), got {v!r}")
    # None: the default (clusters=0 / False were taken as not given)
    c = check_positive(clusters, "clusters") if clusters is not None else max(1, int(np.sqrt(n)))
    sizes = f"make_synthetic(n={n}, m={m}, d={d}, n_test={n_test}, clusters={c}"
    # P, Q, Q_test and the centres as float32: numpy's MemoryError (or the OOM killer) otherwise
    check_memory(4 * d * (n + m + n_test + c), f"{sizes}) needs", "float32 rows")
    rng = np.random.default_rng(check_nonnegative(seed, "seed"))
    centres = _unit(rng.standard_normal((c, d), dtype=np.float32))
    # cluster sizes are uneven (Zipf-like); documents sorted by cluster
    weights = 1.0 / np.arange(1, c + 1) ** 0.8
    doc_cluster = np.sort(rng.choice(c, size=n, p=weights / weights.sum()))
    P = _unit(centres[doc_cluster]
              + doc_noise / np.sqrt(d) * rng.standard_normal((n, d), dtype=np.float32))
    start = np.searchsorted(doc_cluster, np.arange(c))
    size = np.bincount(doc_cluster, minlength=c)  # documents per cluster
    pop = 1.0 / np.arange(1, n + 1) ** popularity
    cum = np.cumsum(rng.permutation(pop))
    cum /= cum[-1]

    def queries(count: int) -> tuple[np.ndarray, Relevance]:
        target = np.minimum(np.searchsorted(cum, rng.random(count)), n - 1)
        n_rel = np.minimum(rng.zipf(rel_exponent, count), min(max_rel, 2**62))  # (int64)
        pairs = n_rel.sum(dtype=np.float64)  # no int64 overflow for a huge max_rel
        check_memory(48 * pairs, f"{sizes}, max_rel={max_rel}, rel_exponent={rel_exponent}) "
                      f"drew {pairs:.4g} relevant pairs: about", "index arrays")
        owner = np.repeat(np.arange(count), n_rel - 1)
        z = doc_cluster[target[owner]]
        others = start[z] + (rng.random(owner.size) * size[z]).astype(np.int64)
        qi = np.concatenate([np.arange(count), owner])
        di = np.concatenate([target, others])
        Y = Relevance.from_pairs(qi, di, shape=(count, n))
        Q = _unit(P[target] + query_noise / np.sqrt(d)
                  * rng.standard_normal((count, d), dtype=np.float32))
        return Q, Y

    Q, Y = queries(m)
    Q_test, Y_test = queries(n_test)
    return SyntheticData(P=P, Q=Q, Y=Y, Q_test=Q_test, Y_test=Y_test)


def _unit(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32, copy=False)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), np.float32(1e-12))
