"""Seeded, query-disjoint splits of training queries (tune's and NUDGE's validation sets)."""

from __future__ import annotations

import numpy as np

from .errors import InputError
from .params import check_held_out, check_nonnegative


def split_queries(n_queries: int, val_fraction: float = 0.2, seed: int = 0
                  ) -> tuple[np.ndarray, np.ndarray]:
    """A seeded split of query rows 0..n-1 into (fit rows, validation rows), both sorted int64
    and disjoint; at least one row on each side."""
    check_held_out(val_fraction, seed)
    n_queries = check_nonnegative(n_queries, "n_queries", top=2**31 - 1)  # Y's most rows
    if n_queries < 2:
        raise InputError(f"a validation split needs at least 2 training queries, got {n_queries}")
    n_val = min(max(1, int(round(val_fraction * n_queries))), n_queries - 1)
    perm = np.random.default_rng(seed).permutation(n_queries)
    return np.sort(perm[n_val:]).astype(np.int64), np.sort(perm[:n_val]).astype(np.int64)
