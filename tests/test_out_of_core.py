"""Out-of-core PIFA: streamed Q (path, memory map, iterator, array + budget) equals Yᵀ Q."""

from __future__ import annotations

import itertools
import json
import os
import sys
import textwrap

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import pefa_gpu as pg
from pefa_gpu.aggregate_stream import chunk_rows, pifa_streamed
from pefa_gpu.relevance import Relevance
from pefa_gpu.stream import MemmapSource, RowSource, row_source
from conftest import run_forked


def ref_pifa(Y: sp.spmatrix, Q: np.ndarray, normalize: bool) -> np.ndarray:
    """float64 reference: dense Yᵀ Q, rows normalised with Π(0) = 0."""
    a = Y.toarray().astype(np.float64).T @ Q.astype(np.float64)
    if normalize:
        norms = np.linalg.norm(a, axis=1, keepdims=True)
        a = np.divide(a, norms, out=np.zeros_like(a), where=norms > 0)
    return a


def make_data(seed: int, m: int = 300, n: int = 40, d: int = 12):
    """Y with empty query rows, empty documents, a document with many consecutive queries
    (so chunk boundaries fall inside its queries), weights; Q with duplicated rows."""
    rng = np.random.default_rng(seed)
    nnz = 3 * m
    qi = rng.integers(0, m, nnz)
    di = rng.integers(0, n - 3, nnz)  # the last 3 documents get no queries
    qi = np.concatenate([qi, np.arange(50, 170)])  # document 0 owns a long run of queries
    di = np.concatenate([di, np.zeros(120, dtype=np.int64)])
    w = rng.choice([0.5, 1.0, 2.0], qi.size).astype(np.float32)
    Y = sp.coo_matrix((w, (qi, di)), shape=(m, n)).tocsr()
    Y = (sp.diags((np.arange(m) % 7 != 3).astype(np.float32)) @ Y).tocsr()  # empty rows
    Y.eliminate_zeros()
    Q = rng.standard_normal((m, d)).astype(np.float32)
    Q[10:20] = Q[0]  # duplicates
    Q = np.round(Q * 4) / 4  # ties in values
    return Y, Q


def budget_for(rows: int, n: int, d: int, itemsize: int = 4, staged: bool = False) -> int:
    """The budget that gives chunks of ``rows`` rows: the output, plus per row a read buffer
    and a float32 conversion (scipy), or two staging slots, two device copies, the float32
    conversion, a two-row gather workspace and 96 bytes of entry batches (staged)."""
    if staged:
        per_row = d * (4 * itemsize + 4 + 8) + 96
    else:
        per_row = d * (itemsize + (4 if itemsize != 4 else 0))
    b = n * d * 4 + rows * per_row
    assert chunk_rows(b, n, d, itemsize, "index_add" if staged else "scipy") == rows
    if rows > 1:  # the formula is tight: a byte less gives a row less
        assert chunk_rows(b - 1, n, d, itemsize, "index_add" if staged else "scipy") == rows - 1
    return b


@pytest.mark.parametrize("rows", [1, 7, 64, 299, 300, 1000])
@pytest.mark.parametrize("normalize", [False, True])
def test_memmap_equals_reference(tmp_path, rows, normalize):
    Y, Q = make_data(rows)
    np.save(tmp_path / "q.npy", Q)
    mm = np.load(tmp_path / "q.npy", mmap_mode="r")
    out = pg.pifa(Y, mm, normalize=normalize, device="cpu",
                  memory_budget=budget_for(rows, Y.shape[1], Q.shape[1]))
    mem = pg.pifa(Y, Q, normalize=normalize, device="cpu")
    np.testing.assert_allclose(out.numpy(), ref_pifa(Y, Q, normalize), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.numpy(), mem.numpy(), rtol=1e-6, atol=1e-6)
    assert out.dtype == torch.float32 and out.shape == (Y.shape[1], Q.shape[1])
    assert not out[-3:].any()  # documents without queries stay zero


@pytest.mark.parametrize("rows", [3, 50, 128])
def test_path_iterator_and_array_sources(tmp_path, rows):
    Y, Q = make_data(100 + rows)
    np.save(tmp_path / "q.npy", Q)
    ref = ref_pifa(Y, Q, True)
    budget = budget_for(rows, Y.shape[1], Q.shape[1])
    by_path = pg.pifa(Y, str(tmp_path / "q.npy"), device="cpu", memory_budget=budget)
    by_pathlib = pg.pifa(Y, tmp_path / "q.npy", device="cpu")
    sizes = [rows, 1, 0, 2 * rows, Q.shape[0]]  # uneven chunks, an empty chunk
    bounds = np.minimum(np.cumsum([0] + sizes), Q.shape[0])
    it = (Q[a:b] for a, b in zip(bounds[:-1], bounds[1:]))
    by_iter = pg.pifa(Y, it, device="cpu", memory_budget=budget)
    by_array = pg.pifa(Y, Q, device="cpu", memory_budget=budget)
    for out in (by_path, by_pathlib, by_iter, by_array):
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 13, 300])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, ">f4", ">f2", ">f8"])
def test_index_add_kernel_and_dtypes(tmp_path, rows, dtype):
    """The staged gather + index_add pipeline (the CUDA path), run on the CPU. A big-endian
    .npy (np.save of a '>f4' array) was staged byte for byte and read by torch as native
    floats: garbage sums or 'Q contains NaN or inf' (the scipy kernel converts)."""
    Y, Q = make_data(7)
    Qd = Q.astype(dtype)
    np.save(tmp_path / "q.npy", Qd)
    src = row_source(str(tmp_path / "q.npy"))
    itemsize = np.dtype(dtype).itemsize
    budget = budget_for(rows, Y.shape[1], Q.shape[1], itemsize, staged=True)
    out = pifa_streamed(Relevance(Y), src, torch.device("cpu"), budget, kernel="index_add")
    np.testing.assert_allclose(out.numpy(), ref_pifa(Y, Qd.astype(np.float32), False),
                               rtol=1e-5, atol=1e-5)
    scipy_k = pifa_streamed(Relevance(Y), RowSource(Qd), torch.device("cpu"),
                            budget_for(rows, Y.shape[1], Q.shape[1], itemsize), kernel="scipy")
    np.testing.assert_allclose(out.numpy(), scipy_k.numpy(), rtol=1e-6, atol=1e-6)



def _bfloat16():
    return pytest.importorskip("ml_dtypes").bfloat16


def _stored(Q: np.ndarray, dtype) -> np.ndarray:
    """Q rounded to ``dtype`` (float16 or ml_dtypes' bfloat16), as the file stores it."""
    return Q.astype(dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("how", ["path", "memmap", "iterator"])
def test_staged_pipeline_half_precision(tmp_path, dtype, rows, how):
    """The CUDA pipeline's staging (two host slots read as numpy views of the staging tensors,
    device copies, entry batches) on the CPU, with 2-byte .npy inputs, against float64: a slot
    read into a copy of its staging buffer instead of a view (what ``to_numpy`` gives for
    float16 / bfloat16) would leave the product reading memory nothing wrote."""
    dt = np.float16 if dtype == "float16" else _bfloat16()
    Y, Q = make_data(20 + rows)
    Qd = _stored(Q, dt)
    np.save(tmp_path / "q.npy", Qd)  # bfloat16 is saved as raw 2-byte items ('<V2')
    mm = np.load(tmp_path / "q.npy", mmap_mode="r")
    if dtype == "bfloat16":
        mm = mm.view(dt)
    if how == "path" and dtype == "float16":
        src = row_source(str(tmp_path / "q.npy"))
    elif how == "iterator":
        src = row_source(iter([Qd[:17], Qd[17:40], Qd[40:]]))
    else:
        src = row_source(mm)
    ref = ref_pifa(Y, Qd.astype(np.float64), False)
    assert src.dtype == (np.dtype(np.float32) if how == "iterator" and dtype == "bfloat16"
                         else np.dtype(dt))  # an iterator's bfloat16 chunks are upcast
    budget = budget_for(rows, Y.shape[1], Q.shape[1], src.dtype.itemsize, staged=True)
    out = pifa_streamed(Relevance(Y), src, torch.device("cpu"), budget, kernel="index_add")
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-5)
    if how != "iterator":  # the scipy kernel, on the same input
        src = row_source(str(tmp_path / "q.npy")) if how == "path" and dtype == "float16" \
            else row_source(mm)
        out2 = pifa_streamed(Relevance(Y), src, torch.device("cpu"),
                             budget_for(rows, Y.shape[1], Q.shape[1], 2), kernel="scipy")
        np.testing.assert_allclose(out2.numpy(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32,
                                   torch.float64, torch.int64])
def test_staging_views_are_the_staging_memory(dtype):
    """Every staging slot's numpy view is the staging tensor's own memory, for every dtype."""
    from pefa_gpu.aggregate_stream import Staging

    np_dt = {torch.bfloat16: None, torch.float16: np.float16, torch.float32: np.float32,
             torch.float64: np.float64, torch.int64: np.int64}[dtype]
    if np_dt is None:
        np_dt = _bfloat16()
    st = Staging(6, {"x": (3, np_dt), "i": (0, np.int64)}, torch.device("cpu"))
    for slot in (0, 1):
        view, host = st.views[slot]["x"], st.host[slot]["x"]
        assert view.dtype == np.dtype(np_dt) and view.shape == (6, 3)
        assert host.dtype == dtype and view.ctypes.data == host.data_ptr()
        view[:4] = np.arange(12, dtype=np.float64).reshape(4, 3).astype(np_dt)
        st.views[slot]["i"][:4] = [5, 4, 3, 2]
        got = st.upload(slot, 4)
        assert got["x"].shape == (4, 3) and got["i"].tolist() == [5, 4, 3, 2]
        np.testing.assert_array_equal(got["x"].double().numpy(),
                                      np.arange(12, dtype=np.float64).reshape(4, 3))
        st.release(slot)


def test_bfloat16_npy_path_is_refused_with_the_way_to_read_it(tmp_path):
    bf16 = _bfloat16()
    Y, Q = make_data(2)
    np.save(tmp_path / "q.npy", Q.astype(bf16))
    with pytest.raises(pg.InputError, match=r"bfloat16.*view\(ml_dtypes.bfloat16\)"):
        pg.pifa(Y, str(tmp_path / "q.npy"), device="cpu")
    mm = np.load(tmp_path / "q.npy", mmap_mode="r").view(bf16)
    out = pg.pifa(Y, mm, normalize=False, device="cpu", memory_budget=1 << 20)
    ref = ref_pifa(Y, Q.astype(bf16).astype(np.float64), False)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-5)
    in_memory = pg.pifa(Y, Q.astype(bf16), normalize=False, device="cpu")  # no budget: torch
    np.testing.assert_allclose(in_memory.numpy(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", ">f4"])
def test_staged_pipeline_on_cuda(tmp_path, dtype):
    """The same pipeline with pinned slots, the copy stream and events, on a CUDA device."""
    dt = {"float16": np.float16, "float32": np.float32, ">f4": np.dtype(">f4")}.get(dtype) \
        or _bfloat16()
    Y, Q = make_data(5, m=3000, n=200, d=40)
    Qd = _stored(Q, dt)
    np.save(tmp_path / "q.npy", Qd)
    mm = np.load(tmp_path / "q.npy", mmap_mode="r")
    if dtype == "bfloat16":
        mm = mm.view(dt)
    ref = ref_pifa(Y, Qd.astype(np.float64), False)
    for rows in (1, 37, 3000):
        budget = budget_for(rows, Y.shape[1], Q.shape[1], np.dtype(dt).itemsize, staged=True)
        out = pg.pifa(Y, mm, normalize=False, device="cuda", memory_budget=budget)
        assert out.device.type == "cuda"
        np.testing.assert_allclose(out.cpu().numpy(), ref, rtol=1e-5, atol=1e-5)


def test_empty_relevance_and_no_rows(tmp_path):
    Y = sp.csr_matrix((5, 4), dtype=np.float32)
    Q = np.ones((5, 3), np.float32)
    out = pg.pifa(Y, iter([Q[:2], Q[2:]]), device="cpu")
    assert out.shape == (4, 3) and not out.any()
    out = pg.pifa(sp.csr_matrix((0, 4), dtype=np.float32), iter([]), device="cpu")
    assert out.shape == (4, 0)
    with pytest.raises(pg.InputError, match="Y has 5 rows .queries. but Q has 0 rows"):
        pg.pifa(Y, iter([]), device="cpu")


@pytest.mark.parametrize("kernel", ["scipy", "index_add"])
def test_row_count_is_checked_by_both_kernels(kernel):
    Y, Q = make_data(2)
    m = Y.shape[0]
    budget = budget_for(7, Y.shape[1], Q.shape[1], staged=kernel == "index_add")
    for chunks, says in (([Q, Q[:3]], f"Q has more than {m} rows"),
                         ([Q[:100], Q[100:-1]], f"Q has {m - 1} rows")):
        src = row_source(iter(chunks))
        with pytest.raises(pg.InputError, match=f"Y has {m} rows .queries. but {says}"):
            pifa_streamed(Relevance(Y), src, torch.device("cpu"), budget, kernel=kernel)


def test_an_iterator_of_empty_chunks_without_end_is_refused():
    """An iterator yielding (0, d) chunks forever (from the start, or after Q's rows) hung."""
    Y, Q = make_data(1)
    for it in (itertools.repeat(Q[:0]), itertools.chain([Q], itertools.repeat(Q[:0]))):
        with pytest.raises(pg.InputError, match="Q: more than 65536 empty chunks .*ever end"):
            pg.pifa(Y, it, device="cpu")


def test_errors(tmp_path):
    Y, Q = make_data(1)
    with pytest.raises(pg.InputError, match="rows"):
        pg.pifa(Y, iter([Q, Q[:3]]), device="cpu")
    with pytest.raises(pg.InputError, match="rows"):
        pg.pifa(Y, iter([Q[:10]]), device="cpu")
    with pytest.raises(pg.InputError, match="dimension"):
        pg.pifa(Y, iter([Q[:10], Q[10:, :5]]), device="cpu")
    with pytest.raises(pg.InputError, match="too small"):
        pg.pifa(Y, Q, device="cpu", memory_budget=100)
    with pytest.raises(pg.InputError, match="memory_budget"):
        pg.pifa(Y, Q, device="cpu", memory_budget=-5)
    bad = Q.copy()
    bad[123, 4] = np.nan
    with pytest.raises(pg.InputError, match="NaN"):
        pg.pifa(Y, iter([bad]), device="cpu")
    # chunks of text, complex, objects, bools: were numpy's ValueError, or cast to float32
    # (the imaginary part dropped, 0 / 1 rows)
    for kind in ("U1", np.complex64, object, bool):
        with pytest.raises(pg.InputError, match="Q: the chunk at row 0 has dtype"):
            pg.pifa(Y, iter([Q.astype(kind)]), device="cpu")
    if np.dtype(np.longdouble).itemsize > 8:  # was told 'real numbers are needed'
        with pytest.raises(pg.InputError, match="float128; float16, float32, float64, bfloat16"):
            pg.pifa(Y, iter([Q.astype(np.longdouble)]), device="cpu")
    # a chunk that is no array was 'array must be an array ...', naming neither Q nor the row
    with pytest.raises(pg.InputError, match=r"Q: the chunk at row 50 must be an array .*dict"):
        pg.pifa(Y, iter([Q[:50], {"rows": 1}]), device="cpu")
    np.save(tmp_path / "i.npy", np.ones((4, 3), np.int32))
    with pytest.raises(pg.InputError, match="dtype"):
        pg.pifa(Y, str(tmp_path / "i.npy"), device="cpu")
    np.save(tmp_path / "v.npy", np.ones(4, np.float32))
    with pytest.raises(pg.InputError, match="2-D"):
        pg.pifa(Y, tmp_path / "v.npy", device="cpu")
    with pytest.raises(pg.InputError, match="npy"):
        pg.pifa(Y, str(tmp_path / "q.txt"), device="cpu")
    np.save(tmp_path / "t.npy", Q)
    (tmp_path / "t.npy").write_bytes((tmp_path / "t.npy").read_bytes()[:-8])
    for broken, says in (("t.npy", "t.npy is truncated"), ("none.npy", "none.npy is missing")):
        with pytest.raises(pg.FormatError, match=says):
            pg.pifa(Y, tmp_path / broken, device="cpu")
    np.save(tmp_path / "z.npy", np.ones((Y.shape[0], 0), np.float32))
    # an iterator of such chunks gave (n, 0) sums, whatever its rows
    for q in (np.ones((Y.shape[0], 0), np.float32), tmp_path / "z.npy", "iter", "iter 5"):
        for budget in (None, 1 << 20):
            given = iter([np.ones((Y.shape[0] if q == "iter" else 5, 0), np.float32)]) \
                if isinstance(q, str) else q
            with pytest.raises(pg.InputError, match="Q has dimension 0"):
                pg.pifa(Y, given, device="cpu", memory_budget=budget)


def test_backward_compatible_call():
    Y, Q = make_data(3)
    rel = Relevance(Y)
    out = pg.pifa(rel, torch.from_numpy(Q), normalize=False, device="cpu")
    np.testing.assert_allclose(out.numpy(), ref_pifa(Y, Q, False), rtol=1e-5, atol=1e-5)


_CHILD = textwrap.dedent("""
    import json, re, sys
    import numpy as np, scipy.sparse as sp
    import pefa_gpu as pg

    def status():
        t = open("/proc/self/status").read()
        return {k: int(re.search(k + r":\\s+(\\d+)", t).group(1)) * 1024
                for k in ("VmRSS", "VmHWM")}

    path, mode, m, n, budget = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    rng = np.random.default_rng(0)
    Y = sp.csr_matrix((np.ones(m, np.float32), (np.arange(m), rng.integers(0, n, m))),
                      shape=(m, n))
    Q = np.load(path, mmap_mode="r") if mode == "memmap" else path
    pg.pifa(Y[:4], np.ones((4, 8), np.float32), device="cpu", memory_budget=budget)  # warm-up
    try:
        open("/proc/self/clear_refs", "w").write("5")  # reset the peak to the current RSS
    except OSError:
        pass
    before = status()
    a = pg.pifa(Y, Q, normalize=False, device="cpu", memory_budget=budget)
    after = status()
    print(json.dumps({"before": before, "after": after, "sum": float(a.sum())}))
""")


@pytest.mark.parametrize("mode", ["memmap", "path"])
def test_peak_resident_memory_within_budget(tmp_path, mode):
    """A 96 MiB Q streamed with an 8 MiB budget raises peak RSS by far less than Q's size."""
    m, d, n = 49152, 512, 256
    path = tmp_path / "q.npy"
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(m, d))
    for s in range(0, m, 8192):
        mm[s:s + 8192] = 1.0 / 64
    mm.flush()
    del mm
    budget = 8 * 2**20
    res = run_forked(_CHILD, path, mode, m, n, budget)
    rec = json.loads(res.stdout.strip().splitlines()[-1])
    grew = rec["after"]["VmHWM"] - max(rec["before"]["VmRSS"], 0)
    q_bytes = m * d * 4
    assert grew < budget + 6 * 2**20, (grew, rec)  # budget + allocator / Y-slicing slack
    assert grew < q_bytes / 4
    assert rec["sum"] == pytest.approx(m * d / 64, rel=1e-6)


@pytest.mark.parametrize("rows", [4, 33])
def test_memmap_views(tmp_path, rows):
    """Row-sliced (read from the file at the right offset) and column-sliced (copied from the
    mapping, pages released) memory maps."""
    Y, Q = make_data(11)
    full = np.concatenate([np.full((5, Q.shape[1]), 9.0, np.float32), Q], 0)
    full = np.concatenate([full, np.full((full.shape[0], 3), 7.0, np.float32)], 1)
    np.save(tmp_path / "q.npy", full)
    mm = np.load(tmp_path / "q.npy", mmap_mode="r")
    budget = budget_for(rows, Y.shape[1], Q.shape[1])
    ref = ref_pifa(Y, Q, True)
    rows_view = np.load(tmp_path / "q.npy", mmap_mode="r")[5:, :]
    np.save(tmp_path / "r.npy", full[:, :Q.shape[1]])
    rows_only = np.load(tmp_path / "r.npy", mmap_mode="r")[5:]
    cols_view = mm[5:, :Q.shape[1]]
    assert isinstance(cols_view, np.memmap) and not cols_view.flags.c_contiguous
    out_rows = pg.pifa(Y, rows_only, device="cpu", memory_budget=budget)
    out_cols = pg.pifa(Y, cols_view, device="cpu", memory_budget=budget)
    np.testing.assert_allclose(out_rows.numpy(), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out_cols.numpy(), ref, rtol=1e-5, atol=1e-5)
    out_wide = pg.pifa(Y, rows_view, normalize=False, device="cpu", memory_budget=budget * 2)
    np.testing.assert_allclose(out_wide.numpy(), ref_pifa(Y, full[5:], False), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("cols", [8, 4])
def test_copy_on_write_memmap_is_read_with_its_changes_and_kept(tmp_path, cols):
    """A copy-on-write map holds changes its file lacks: they are summed (not the file's
    values) and still there afterwards (releasing its pages would drop them)."""
    np.save(tmp_path / "c.npy", np.ones((1000, 8), np.float32))
    mm = np.load(tmp_path / "c.npy", mmap_mode="c")
    mm[500:] = 2.0
    Y = sp.csr_matrix(np.ones((1000, 1), np.float32))
    out = pg.pifa(Y, mm[:, :cols], normalize=False, device="cpu", memory_budget=1 << 20)
    np.testing.assert_array_equal(out.numpy(), np.full((1, cols), 1500.0, np.float32))
    assert (mm[500:] == 2.0).all() and (mm[:500] == 1.0).all()


def test_a_memmap_whose_file_was_replaced_is_read_from_the_map(tmp_path):
    """The rows were read from the file by name: one replaced since the map was made (same
    first row) was summed instead of the map's rows. Its own file is still read directly."""
    np.save(tmp_path / "q.npy", np.ones((6, 4), np.float32))
    mm = np.load(tmp_path / "q.npy", mmap_mode="r")
    if sys.platform.startswith("linux"):  # where the mapped file is known: read by pread
        assert MemmapSource(mm, "Q")._file is not None
    new = np.full((6, 4), 100.0, np.float32)
    new[0] = 1.0
    np.save(tmp_path / "new.npy", new)
    os.replace(tmp_path / "new.npy", tmp_path / "q.npy")
    Y = sp.csr_matrix(np.eye(6, dtype=np.float32))
    for kernel in ("scipy", "index_add"):
        out = pifa_streamed(Relevance(Y), row_source(mm), torch.device("cpu"), None, kernel)
        np.testing.assert_array_equal(out.numpy(), np.ones((6, 4), np.float32))
    if sys.platform.startswith("linux"):  # replaced between the check and the read: named
        src = row_source(np.load(tmp_path / "q.npy", mmap_mode="r"))
        np.save(tmp_path / "new.npy", new)
        os.replace(tmp_path / "new.npy", tmp_path / "q.npy")
        with pytest.raises(pg.InputError, match="q.npy was replaced after it was mapped"):
            pifa_streamed(Relevance(Y), src, torch.device("cpu"), None, "scipy")
