"""The memory budget covers every pass a model's search makes over its queries: their float32
copy, the NaN / inf check, and PEFA-XL's passage results and fusion tables. Large batches are
searched in query blocks that fit the budget, with the results of one unblocked search.

Peak memory is measured as in tests/test_exact_memory.py: the peak resident memory a search
adds in a child process (VmHWM, reset through /proc/self/clear_refs), minus its result."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

import pefa_gpu as pg
from conftest import make_model, run_forked, unit_rows
from reference import exact_search, xl_search
from test_exact_memory import _clear_refs_works

MiB = 2**20

CHILD = r"""
import json, re, sys
import numpy as np, scipy.sparse as sp
import pefa_gpu as pg

def status():
    t = open("/proc/self/status").read()
    return {k: int(re.search(k + r":\s+(\d+)", t).group(1)) * 1024 for k in ("VmRSS", "VmHWM")}

model, dtype, b, topk, budget = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
rng = np.random.default_rng(0)
unit = lambda x: (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
if model == "erm":
    P = unit(rng.standard_normal((5000, 384)))
    m = pg.ERM(device="cpu", index_params={"memory_budget": budget}).fit(P)
    T = rng.standard_normal((b, 384)).astype(dtype)
else:  # the issue's PEFA-XL case: topk 1000, k 200, 2000 candidates
    n = q = 20000
    P, Q = unit(rng.standard_normal((n, 64))), unit(rng.standard_normal((q, 64)))
    Y = sp.csr_matrix((np.ones(3 * q, np.float32),
                       (np.repeat(np.arange(q), 3), rng.integers(0, n, 3 * q))), shape=(q, n))
    m = pg.PEFAXL(device="cpu", k=200, search_params=pg.XLSearchParams(candidates=2000),
                  index_params={"memory_budget": budget}).fit(P, Q, Y)
    T = unit(rng.standard_normal((b, 64))).astype(dtype)
m.search(T[:50], topk)  # warm-up
open("/proc/self/clear_refs", "w").write("5")
before = status()
s, i = m.search(T, topk)
after = status()
print(json.dumps({"grew": after["VmHWM"] - before["VmRSS"],
                  "result": s.numel() * 4 + i.numel() * 8}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists() or not _clear_refs_works(),
                    reason="needs Linux /proc/self/status and clear_refs to measure peak RSS")
@pytest.mark.parametrize("model,dtype,b,topk,budget", [
    ("erm", "float32", 20000, 10, 4 * MiB),    # d6866eb: +40 MiB (the NaN check's temporaries)
    ("erm", "float64", 20000, 10, 4 * MiB),    # d6866eb: +70 MiB (and the float32 copy)
    ("xl", "float32", 1000, 1000, 16 * MiB),   # d6866eb: +101 MiB (fusion tables)
])
def test_a_search_keeps_to_the_budget_over_its_queries(model, dtype, b, topk, budget):
    res = run_forked(CHILD, model, dtype, b, topk, budget)
    rec = json.loads(res.stdout.strip().splitlines()[-1])
    work = rec["grew"] - rec["result"]
    assert work <= 1.5 * budget, (work / MiB, budget / MiB)


# ---------------------------------------------------------------------------- blocks: same results

@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(8)
    n, m, d = 300, 200, 8
    P, Q = unit_rows(rng, n, d), unit_rows(rng, m, d)
    P[[10, 200]] = P[4]  # ties across blocks of documents
    Y = sp.csr_matrix((rng.choice([1.0, 2.0], 2 * m).astype(np.float32),
                       (np.repeat(np.arange(m), 2), rng.integers(0, n, 2 * m))), shape=(m, n))
    T = unit_rows(rng, 1500, d).astype(np.float64)
    T[700] = P[4]
    return P, Q, Y, T


def test_erm_in_query_blocks_equals_the_reference(data):
    P, _, _, T = data
    model = pg.ERM(device="cpu", index_params={"memory_budget": 2**16}).fit(P)
    assert model._memory_budget() // model._query_bytes(10, model.search_params) < len(T) / 2
    s, i = model.search(T, 10)
    want_s, want_i = exact_search(P, T.astype(np.float32), 10)
    np.testing.assert_array_equal(i.numpy(), want_i)
    np.testing.assert_allclose(s.numpy(), want_s, rtol=0, atol=1e-6)


def test_xl_in_query_blocks_equals_the_reference_and_one_unblocked_search(data):
    P, Q, Y, T = data
    T = T[:300]
    params = dict(device="cpu", lam=0.3, k=4, candidates=20)
    small = make_model(pg.PEFAXL, **params, index_params={"memory_budget": 2**16}).fit(P, Q, Y)
    rows = small._memory_budget() // small._query_bytes(10, small.search_params)
    assert rows < len(T) / 3
    s, i = small.search(T, 10)
    want = xl_search(P, Q, Y, T.astype(np.float32), lam=0.3, k=4, candidates=20, topk_out=10)
    np.testing.assert_array_equal(i.numpy(), want[1])
    small._query_bytes = lambda *args: 1  # one block: the same indices, the same search
    one_s, one_i = small.search(T, 10)
    np.testing.assert_array_equal(i.numpy(), one_i.numpy())
    # BLAS may round the last row of a batch differently (a batch of 41 on d6866eb too)
    np.testing.assert_allclose(s.numpy(), one_s.numpy(), rtol=0, atol=1e-6)


def test_a_nan_in_a_later_block_is_named_and_nothing_is_returned(data):
    P, _, _, T = data
    T = T.copy()
    T[1234, 3] = np.nan
    model = pg.ERM(device="cpu", index_params={"memory_budget": 2**16}).fit(P)
    with pytest.raises(pg.InputError, match=r"queries\[\d+:\] contains NaN or inf"):
        model.search(T, 5)
    assert np.isnan(T[1234, 3])  # the caller's array as it was
