"""ExactParams.memory_budget is a promise: the working memory of a search stays within ~1.5x
of it, the (B, k) result aside.

Measured: the peak resident memory (VmHWM, reset through /proc/self/clear_refs) that a search
adds in a child process, after a warm-up search (thread pools, BLAS buffers), minus the
bytes of the result. This counts torch's and faiss' allocations alike (tracemalloc sees
neither), and any allocator slack. The analytic model the block shapes are chosen by is checked
separately against the budget over a grid of shapes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import run_forked
from pefa_gpu.index import ExactIndex
from pefa_gpu.index.exact import TIE_MARGIN

CHILD = r"""
import json, re, sys
import numpy as np, torch
import pefa_gpu.index.exact as ex
from pefa_gpu.index import ExactIndex

def status():
    t = open("/proc/self/status").read()
    return {k: int(re.search(k + r":\s+(\d+)", t).group(1)) * 1024 for k in ("VmRSS", "VmHWM")}

engine, n, d, b, k, budget, dtype = sys.argv[1], *map(int, sys.argv[2:7]), sys.argv[7]
if engine == "torch":
    ex.optional_faiss = lambda: None
ex.faiss_blas_is_tuned = lambda: True  # the faiss case: its BLAS path, whatever this CPU
rng = np.random.default_rng(0)
X = rng.standard_normal((n, d), dtype=np.float32)
T = torch.from_numpy(rng.standard_normal((b, d), dtype=np.float32))
index = ExactIndex({"memory_budget": budget, "dtype": dtype}).build(X)
faiss_used = index._plan(b, min(k, n))[0] is not None
index.search(T[:400], 50)  # warm-up
open("/proc/self/clear_refs", "w").write("5")  # the peak restarts from the current RSS
before = status()
s, i = index.search(T, k)
after = status()
print(json.dumps({"grew": after["VmHWM"] - before["VmRSS"],
                  "result": s.numel() * 4 + i.numel() * 8, "faiss": faiss_used}))
"""

MiB = 2**20


def _clear_refs_works() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists() or not _clear_refs_works(),
                    reason="needs Linux /proc/self/status and clear_refs to measure peak RSS")
@pytest.mark.parametrize("engine,n,d,b,k,budget,dtype", [
    ("faiss", 20000, 384, 2000, 1000, 64 * MiB, "float32"),   # the topk = 1000 case
    ("torch", 20000, 64, 2000, 1000, 64 * MiB, "float32"),
    ("torch", 50000, 64, 4000, 10, 16 * MiB, "float32"),      # score blocks dominate
    ("torch", 20000, 128, 2000, 100, 16 * MiB, "bfloat16"),   # upcast chunks
    ("torch", 300000, 16, 64, 10, 64 * MiB, "float32"),       # wide blocks: topk_wide's groups
])
def test_peak_memory_within_budget(engine, n, d, b, k, budget, dtype):
    if engine == "faiss":
        pytest.importorskip("faiss")
    res = run_forked(CHILD, engine, n, d, b, k, budget, dtype)
    rec = json.loads(res.stdout.strip().splitlines()[-1])
    assert rec["faiss"] == (engine == "faiss")
    work = rec["grew"] - rec["result"]
    # without the budget these searches hold 2-12x it (a (b, n) block, faiss' reservoirs)
    assert work <= 1.5 * budget, (work / MiB, budget / MiB, rec)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("budget", [2**16, 2**20, 64 * MiB, 256 * MiB])
def test_block_shapes_fit_the_budget_model(dtype, budget):
    """The chosen (query batch, chunk) fit the working-memory model whenever the floor (one
    query against max(k + TIE_MARGIN, 1024) rows) does; the faiss batch likewise."""
    index = ExactIndex({"dtype": dtype, "memory_budget": budget})
    index.vectors = torch.empty(300_000, 384, dtype=index._dtype)  # shapes only
    for b in (1, 64, 2000, 100_000):
        for k in (1, 10, 100, 1000, 10_000):
            w = k + TIE_MARGIN  # the first pass's candidates per query
            for width in (w, 4 * w):  # a first pass, a wider one
                q_batch, chunk = index._block_shape(b, k, width)
                assert 1 <= q_batch <= b and 1 <= chunk <= 300_000
                floor = index._work_bytes(1, max(width, 1024), width)
                if floor <= budget:
                    assert index._work_bytes(q_batch, chunk, width) <= budget
                else:
                    assert q_batch == 1 and chunk == max(width, 1024)
            faiss, q_batch, chunk = index._plan(b, k)
            if faiss is not None:
                assert chunk == 300_000
                assert q_batch == 1 or index._work_bytes(q_batch, 0, w, faiss=True) <= budget
