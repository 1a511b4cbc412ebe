"""Exact search against the float64 reference (tests/reference.py): both first passes (faiss on
the CPU, torch blocks), ties at the k-th place, duplicates, several chunks and batches, 16-bit
storage, empty inputs. The top-k functions themselves: tests/test_topk.py; memory:
tests/test_exact_memory.py."""

from contextlib import nullcontext

import numpy as np
import pytest
import torch

import pefa_gpu.index.exact as exact_module
from pefa_gpu.errors import InputError
from pefa_gpu.index import ExactIndex, make_index
from pefa_gpu.topk import merge_topk, order_ties, topk_rows
from conftest import DEVICES, run_python, unit_rows
import reference as ref


@pytest.fixture(params=["torch", "faiss"])
def engine(request, monkeypatch):
    """The first pass on the CPU: 'torch' blocks, or 'faiss' (its BLAS path for every batch
    size: its threshold lowered to 1)."""
    if request.param == "torch":
        monkeypatch.setattr(exact_module, "optional_faiss", lambda: None)
    else:
        force_faiss_blas(monkeypatch)
    return request.param


def force_faiss_blas(monkeypatch):
    """faiss' BLAS path for every batch size (its threshold 1), its BLAS taken as tuned."""
    faiss = pytest.importorskip("faiss")
    monkeypatch.setattr(exact_module, "optional_faiss", lambda: faiss)
    monkeypatch.setattr(exact_module, "faiss_blas_is_tuned", lambda: True)
    monkeypatch.setattr(faiss.cvar, "distance_compute_blas_threshold", 1)
    return faiss


def uses_faiss(index, b, k):
    return index._plan(b, min(k, index.ntotal))[0] is not None


def integer_vectors(rng, rows, dim, low=-2, high=3):
    """Small integer vectors: inner products are exact in float32, so ties are real ties."""
    return rng.integers(low, high, (rows, dim)).astype(np.float32)


@pytest.mark.parametrize("k", [1, 3, 7, 50])
def test_topk_rows_ties_go_to_lower_column(k):
    rng = np.random.default_rng(k)
    s = rng.integers(0, 4, (20, 30)).astype(np.float32)  # heavy ties
    vals, ids = topk_rows(torch.from_numpy(s), k)
    rv, ri = ref.topk(s.astype(np.float64), k)
    np.testing.assert_array_equal(ids.numpy(), ri)
    np.testing.assert_array_equal(vals.numpy(), rv.astype(np.float32))


def test_merge_topk_orders_by_score_then_id_and_pads():
    vals = torch.tensor([[1.0, 2.0, 2.0, float("-inf")]])
    ids = torch.tensor([[5, 9, 3, -1]])
    v, i = merge_topk(vals, ids, 5)
    assert i.tolist() == [[3, 9, 5, -1, -1]]
    assert v[0, :3].tolist() == [2.0, 2.0, 1.0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("budget", [2**16, 2**26])
def test_exact_matches_reference_with_ties(device, budget, engine):
    rng = np.random.default_rng(3)
    X = integer_vectors(rng, 3000, 6)
    T = integer_vectors(rng, 40, 6)
    index = ExactIndex({"memory_budget": budget}, device=device).build(X)
    assert uses_faiss(index, 40, 10) == (engine == "faiss" and device == "cpu")
    for k in (1, 10, 1500, 2999, 3000, 3001):
        scores, ids = index.search(T, k)
        rv, ri = ref.exact_search(X, T, k)
        assert scores.dtype == torch.float32 and ids.dtype == torch.int64
        assert scores.device.type == device
        np.testing.assert_array_equal(ids.cpu().numpy(), ri)
        np.testing.assert_array_equal(scores.cpu().numpy(), rv.astype(np.float32))


@pytest.mark.parametrize("dtype,tol", [("float16", 2e-3), ("bfloat16", 1e-2)])
def test_exact_low_precision_storage(dtype, tol):
    rng = np.random.default_rng(5)
    X, T = unit_rows(rng, 500, 32), unit_rows(rng, 20, 32)
    scores, ids = ExactIndex({"dtype": dtype}, device="cpu").build(X).search(T, 10)
    assert scores.dtype == torch.float32
    rounded = torch.from_numpy(X).to(getattr(torch, dtype)).double().numpy()
    rv, _ = ref.exact_search(rounded, T, 10)
    # scores are fp32 accumulations of the rounded vectors
    np.testing.assert_allclose(scores.numpy(), rv, atol=1e-5)
    full, _ = ref.exact_search(X, T, 10)
    np.testing.assert_allclose(scores.numpy(), full, atol=tol)


def test_low_precision_cpu_search_does_not_import_triton():
    """The Triton tile kernel serves CUDA rows only: a CPU search leaves Triton unimported."""
    child = ("import sys, numpy as np; from pefa_gpu.index import make_index; "
             "x = np.eye(300, 16, dtype=np.float32); "
             "make_index('exact', 'cpu', {'dtype': 'bfloat16'}).build(x).search(x[:3], 2); "
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton' "
             "or m.endswith('triton_topk')))")
    assert run_python("-c", child).stdout.strip() == "[]"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_exact_low_precision_rows_from_a_read_only_map_and_overflow(dtype, tmp_path):
    """A read-only memory map is cast straight into the index (never written); a value past
    float16's range (inf after the cast) or a NaN is refused, on build and on add."""
    rng = np.random.default_rng(6)
    X = unit_rows(rng, 300, 16)
    np.save(tmp_path / "X.npy", X)
    mapped = np.load(tmp_path / "X.npy", mmap_mode="r")
    index = ExactIndex({"dtype": dtype}, device="cpu").build(mapped)
    want = torch.from_numpy(X).to(getattr(torch, dtype))
    assert torch.equal(index.vectors, want)
    np.testing.assert_array_equal(np.load(tmp_path / "X.npy"), X)
    big = X[:2] * 1e6
    with pytest.raises(InputError, match="NaN or inf") if dtype == "float16" else nullcontext():
        ExactIndex({"dtype": dtype}, device="cpu").build(big)
    bad = X[:2].copy()
    bad[1, 3] = np.nan
    for call in (ExactIndex({"dtype": dtype}, device="cpu").build, index.add):
        with pytest.raises(InputError, match="NaN or inf"):
            call(bad)
    assert index.ntotal == 300


def test_exact_float32_rows_holding_nan_or_inf_are_refused():
    """ExactIndex alone took float32 rows holding NaN / inf (only 16-bit ones were checked):
    now build, add and update refuse them, and the index is left as it was."""
    X = np.eye(4, dtype=np.float32)
    index = ExactIndex(device="cpu").build(X)
    for value in (np.nan, np.inf, -np.inf):
        bad = X[:2].copy()
        bad[1, 3] = value
        for call in (ExactIndex(device="cpu").build, index.add,
                     lambda v: index.update([0, 1], v)):
            with pytest.raises(InputError, match="vectors hold NaN or inf as float32"):
                call(bad)
    assert index.ntotal == 4 and torch.equal(index.vectors, torch.eye(4))


def test_exact_pads_when_k_exceeds_n_and_add_appends():
    X = np.eye(3, dtype=np.float32)
    index = make_index("exact", device="cpu").build(X)
    scores, ids = index.search(X[:1], 5)
    assert ids.tolist() == [[0, 1, 2, -1, -1]]
    assert torch.isinf(scores[0, 3:]).all()
    index.add(np.array([[2.0, 0, 0]], dtype=np.float32))
    assert index.search(X[:1], 1)[1].tolist() == [[3]]
    assert index.ntotal == 4


def test_exact_bad_input():
    index = make_index("exact", device="cpu").build(np.eye(3, dtype=np.float32))
    with pytest.raises(ValueError, match=r"\(B, 3\)"):
        index.search(np.ones((2, 4), dtype=np.float32), 2)
    with pytest.raises(ValueError, match="positive integer"):
        index.search(np.ones((2, 3), dtype=np.float32), 0)
    with pytest.raises(ValueError, match="dtype"):
        make_index("exact", params={"dtype": "int8"})
    with pytest.raises(ValueError, match="unknown keys"):
        make_index("exact", params={"bogus": 1})
    with pytest.raises(ValueError, match="backend"):
        make_index("nope")
    # rows of dimension 0 were built (ntotal 5, dim 0), then every query was the wrong width
    with pytest.raises(ValueError, match=r"with d > 0, got shape \(5, 0\)"):
        make_index("exact", device="cpu").build(np.zeros((5, 0), np.float32))


def duplicated_documents(rng, n, d, copies=3, low=-2, high=3):
    """Rows on a 1/4 grid (exact float32 scores) where each distinct row appears ``copies``
    times at scattered ids."""
    base = rng.integers(low, high, (n // copies + 1, d)).astype(np.float32) / 4
    X = np.repeat(base, copies, axis=0)[:n]
    return X[rng.permutation(n)]


def test_duplicated_documents_every_k(engine):
    """k at, inside and just past every run of tied scores."""
    rng = np.random.default_rng(11)
    X = duplicated_documents(rng, 300, 5)
    T = rng.integers(-2, 3, (25, 5)).astype(np.float32) / 4
    T[0] = 0.0  # every score of this query ties
    index = ExactIndex().build(X)
    for k in list(range(1, 41)) + [150, 299, 300, 301]:
        scores, ids = index.search(T, k)
        rv, ri = ref.exact_search(X, T, k)
        np.testing.assert_array_equal(ids.numpy(), ri)
        np.testing.assert_array_equal(scores.numpy(), rv.astype(np.float32))


def spy_wider_passes(index, monkeypatch) -> list[int]:
    """The rows of each pass wider than the first (a search again of unsettled rows)."""
    redone, real = [], index._pass

    def spy(q, kk, w):
        if w > index._pass_width(kk):
            redone.append(q.shape[0])
        return real(q, kk, w)

    monkeypatch.setattr(index, "_pass", spy)
    return redone


@pytest.mark.parametrize("copies,rescanned", [(2, False), (12, True)])
def test_many_chunks_and_batches_and_the_exact_redo(engine, monkeypatch, copies, rescanned):
    """A tiny budget splits queries and corpus. Rows tied at the k-th place whose run of equal
    scores fits in the TIE_MARGIN extra candidates (2 copies of each document) are settled
    from them; longer runs (12 copies) are searched again (spied). Every row matches the
    reference either way."""
    rng = np.random.default_rng(12)
    X = duplicated_documents(rng, 6000, 8, copies=copies, low=-20, high=21)
    T = rng.integers(-20, 21, (150, 8)).astype(np.float32) / 4
    index = ExactIndex({"memory_budget": 2**16}).build(X)
    redone = spy_wider_passes(index, monkeypatch)
    boundary_ties = 0
    for k in (1, 7, 100):
        faiss, q_batch, chunk = index._plan(150, k)
        assert q_batch < 150 and (faiss is not None or chunk < 6000)
        scores, ids = index.search(T, k)
        rv, ri = ref.exact_search(X, T, k)
        np.testing.assert_array_equal(ids.numpy(), ri)
        np.testing.assert_array_equal(scores.numpy(), rv.astype(np.float32))
        full = np.sort(T.astype(np.float64) @ X.T.astype(np.float64), axis=1)[:, ::-1]
        boundary_ties += int((full[:, k - 1] == full[:, k]).sum())
    assert boundary_ties > 0  # the data do tie at the k-th place
    if rescanned:  # the exact path ran, and (at k = 100) not for all rows
        assert redone and min(redone) < 150
    else:
        assert redone == []


def test_random_unit_vectors_equal_reference_ids():
    """Real-valued data (ties only from the duplicated rows): both passes agree with float64."""
    rng = np.random.default_rng(13)
    X = unit_rows(rng, 4000, 24)
    X[100:110] = X[3]
    T = unit_rows(rng, 500, 24)
    T[:5] = X[3]
    rv, ri = ref.exact_search(X, T, 50)
    for engine_ in ("torch", "faiss"):
        got = {}
        with pytest.MonkeyPatch.context() as mp:
            if engine_ == "torch":
                mp.setattr(exact_module, "optional_faiss", lambda: None)
            else:
                force_faiss_blas(mp)
            got = ExactIndex().build(X).search(T, 50)
        np.testing.assert_array_equal(got[1].numpy(), ri)
        np.testing.assert_allclose(got[0].numpy(), rv, atol=1e-5)


def test_single_query_on_one_thread_takes_faiss_and_matches():
    faiss = pytest.importorskip("faiss")
    rng = np.random.default_rng(14)
    X = duplicated_documents(rng, 2000, 6)
    T = rng.integers(-2, 3, (3, 6)).astype(np.float32) / 4
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        index = ExactIndex().build(X)
        assert index._plan(1, 10)[0] is faiss
        for r in range(3):
            for k in (1, 9, 10, 11, 600):
                scores, ids = index.search(T[r:r + 1], k)
                rv, ri = ref.exact_search(X, T[r:r + 1], k)
                np.testing.assert_array_equal(ids.numpy(), ri)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("arch,tuned", [("Prescott", False), ("Haswell", True), ("Zen", True)])
def test_batches_take_torch_blocks_where_faiss_blas_runs_a_generic_kernel(monkeypatch, arch,
                                                                         tuned):
    """faiss-cpu's OpenBLAS 0.3.15 runs its Prescott kernel on a CPU model it does not know (a
    VM's 'Intel Xeon Processor'): its BLAS path took 2.2-4.6x the torch blocks' time at 512 and
    2,000 queries. A batch then takes the torch blocks; one query on one thread keeps faiss."""
    faiss = pytest.importorskip("faiss")
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from pefa_gpu.index import _faiss

    libs = [{"internal_api": "openblas", "architecture": arch,
             "filepath": "/x/faiss_cpu.libs/libopenblas.so"},
            {"internal_api": "openblas", "architecture": "Prescott", "filepath": "/x/numpy.so"}]
    monkeypatch.setattr(threadpoolctl, "threadpool_info", lambda: libs)
    _faiss.faiss_blas_is_tuned.cache_clear()
    try:
        assert _faiss.faiss_blas_is_tuned() is tuned
        monkeypatch.setattr(exact_module, "optional_faiss", lambda: faiss)
        index = ExactIndex().build(np.eye(2000, 384, dtype=np.float32))
        assert (index._plan(2000, 10)[0] is faiss) is tuned
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert index._plan(1, 10)[0] is faiss
        finally:
            torch.set_num_threads(before)
    finally:
        _faiss.faiss_blas_is_tuned.cache_clear()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_storage_ties_exact(dtype):
    """Small integers are exact in 16 bits: the ids equal the float64 reference, ties too."""
    rng = np.random.default_rng(15)
    X = duplicated_documents(rng, 3000, 6)
    T = rng.integers(-2, 3, (30, 6)).astype(np.float32)
    index = ExactIndex({"dtype": dtype, "memory_budget": 2**16}).build(X)
    assert index._plan(30, 10)[0] is None  # 16-bit storage: the torch pass
    for k in (1, 10, 400):
        scores, ids = index.search(T, k)
        rv, ri = ref.exact_search(X, T, k)
        np.testing.assert_array_equal(ids.numpy(), ri)
        np.testing.assert_array_equal(scores.numpy(), rv.astype(np.float32))


def test_signed_zero_scores_tie(engine):
    """Documents whose scores are -0.0 or +0.0 tie: lower ids first."""
    X = np.array([[-0.0, 1.0], [0.0, 1.0], [1.0, 0.0], [-0.0, -1.0], [0.0, 0.0], [-1.0, 0.0]],
                 dtype=np.float32)
    T = np.array([[1.0, 0.0], [-1.0, 0.0], [0.0, 0.0]], dtype=np.float32)
    index = ExactIndex().build(X)
    for k in range(1, 8):
        scores, ids = index.search(T, k)
        np.testing.assert_array_equal(ids.numpy(), ref.exact_search(X, T, k)[1])
    assert index.search(T[2:], 3)[1].tolist() == [[0, 1, 2]]


def test_empty_corpus_and_empty_batch(engine):
    index = ExactIndex().build(np.zeros((0, 4), np.float32))
    s, i = index.search(np.ones((3, 4), np.float32), 2)
    assert i.tolist() == [[-1, -1]] * 3 and torch.isinf(s).all()
    index = ExactIndex().build(np.eye(4, dtype=np.float32))
    s, i = index.search(np.zeros((0, 4), np.float32), 5)
    assert s.shape == (0, 5) and i.shape == (0, 5) and i.dtype == torch.int64


def test_order_ties_of_tied_candidates_equals_the_reference():
    """A first pass's settling (both tie strategies: test_masked_strategy reruns it): tied
    candidates sorted descending come back ordered by score, then id (-1 last), so their first
    kk are the tie rule's top kk; against a float64 / id sort of the same candidates."""
    rng = np.random.default_rng(21)
    b, w = 40, 18
    vals = np.sort(rng.integers(0, 6, (b, w)).astype(np.float32), axis=1)[:, ::-1].copy()
    vals[1] = np.arange(w)[::-1]  # no ties
    ids = np.stack([rng.permutation(1000)[:w] for _ in range(b)])
    ids[::7, -1] = -1  # padding
    vals[::7, -1] = -np.inf
    v, i = order_ties(torch.from_numpy(vals), torch.from_numpy(ids))
    for r in range(b):
        order = sorted(range(w), key=lambda c: (-float(vals[r, c]),
                                                ids[r, c] if ids[r, c] >= 0 else 10**9))
        np.testing.assert_array_equal(i[r].numpy(), ids[r, order])
        np.testing.assert_array_equal(v[r].numpy(), vals[r, order])


def reference_with_copies(X, T, k, copies):
    """The float64 reference where each group of ``copies`` (lists of equal rows of X) scores
    exactly the same (a float64 GEMM, too, may give equal rows different last bits)."""
    s = np.asarray(T, np.float64) @ np.asarray(X, np.float64).T
    for group in copies:
        s[:, group] = s[:, group[:1]]
    return ref.topk(s, k)


def copied_unit_rows(rng, n, d, groups):
    """Random unit rows with, for each size in ``groups``, one row copied to that many
    scattered ids; -> (X, list of the copies' ids)."""
    X = unit_rows(rng, n, d)
    ids = rng.permutation(n)
    copies, at = [], 0
    for size in groups:
        group = np.sort(ids[at:at + size])
        X[group] = X[group[0]]
        copies.append(group)
        at += size
    return X, copies


@pytest.mark.parametrize("groups,rescanned", [((2, 3, 5, 8), False), ((12, 20), True)])
def test_real_valued_copies_tie(engine, monkeypatch, groups, rescanned):
    """Copies of real-valued (not grid) documents tie, on every first pass: a BLAS GEMM gives
    copies scores that differ in the last bits with their position (OpenBLAS: faiss' and
    numpy's), so near-tied candidates are rescored pair by pair; runs longer than the
    margin are searched again. Queries near a copied row put the copies at every rank."""
    rng = np.random.default_rng(21)
    X, copies = copied_unit_rows(rng, 3000, 48, groups)
    T = unit_rows(rng, 400, 48)
    for j, group in enumerate(copies):
        T[j::len(copies)] = X[group[0]] + 0.15 * T[j::len(copies)]
    index = ExactIndex().build(X)
    redone = spy_wider_passes(index, monkeypatch)
    for k in (1, 5, 17, 40):
        scores, ids = index.search(T, k)
        rv, ri = reference_with_copies(X, T, k, copies)
        np.testing.assert_array_equal(ids.numpy(), ri)
        np.testing.assert_allclose(scores.numpy(), rv, atol=1e-6)
        assert uses_faiss(index, 400, k) == (engine == "faiss")
    assert bool(redone) == rescanned


@pytest.mark.parametrize("b", [2, 3, 5, 9, 13, 15])
def test_small_batches_tie_copies(monkeypatch, b):
    """Batches of 2-15 queries on the CPU torch pass: real-valued copies scattered over the
    index tie, and ids equal the float64 reference with the tie rule."""
    monkeypatch.setattr(exact_module, "optional_faiss", lambda: None)
    rng = np.random.default_rng(40 + b)
    X, copies = copied_unit_rows(rng, 5000, 48, (2, 5, 9))
    T = unit_rows(rng, b, 48)
    for j in range(b):
        group = copies[j % len(copies)]
        T[j] = X[group[0]] + 0.1 * T[j]
    index = ExactIndex().build(X)
    for k in (1, 4, 10):
        scores, ids = index.search(T, k)
        rv, ri = reference_with_copies(X, T, k, copies)
        np.testing.assert_array_equal(ids.numpy(), ri)
        np.testing.assert_allclose(scores.numpy(), rv, atol=1e-6)


def test_position_dependent_scores_still_tie(monkeypatch):
    """A first pass whose last bits depend on a document's position (as BLAS kernels' edge
    blocks do; here up to 2 ulps by id): copies still tie and ids equal the reference, at
    every k. Without the pair-by-pair rescoring of near ties this fails (checked)."""
    force_faiss_blas(monkeypatch)
    rng = np.random.default_rng(22)
    X, copies = copied_unit_rows(rng, 2000, 32, (3, 4, 6))
    T = np.concatenate([X[[g[0] for g in copies]] + 0.1 * unit_rows(rng, 3, 32),
                        unit_rows(rng, 60, 32)])
    index = ExactIndex().build(X)
    real = index._faiss_pass

    def skewed(faiss_, q, kk):
        v, i = real(faiss_, q, kk)
        return v * (1 + ((i % 5) - 2).float() * 2.0**-23), i

    monkeypatch.setattr(index, "_faiss_pass", skewed)
    for k in (1, 4, 12):
        scores, ids = index.search(T, k)
        rv, ri = reference_with_copies(X, T, k, copies)
        np.testing.assert_array_equal(ids.numpy(), ri)
        np.testing.assert_allclose(scores.numpy(), rv, atol=1e-6)


def test_canonical_scores_ignore_position():
    rng = np.random.default_rng(23)
    x = torch.from_numpy(unit_rows(rng, 1, 300)).expand(50, 300).contiguous()
    q = torch.from_numpy(unit_rows(rng, 7, 300))
    got = exact_module.canonical_scores(q[:, None, :], x[None])
    assert (got == got[:, :1]).all()
    np.testing.assert_allclose(got.numpy(), (q.double() @ x.double().T).numpy(), atol=1e-7)


def test_rows_equal_on_most_coordinates_still_match(monkeypatch):
    """Rows that agree on most coordinates (near ties that are not copies) are rescored like
    copies, and results still equal the reference."""
    force_faiss_blas(monkeypatch)
    rng = np.random.default_rng(24)
    X, copies = copied_unit_rows(rng, 1500, 64, (4, 9))
    dims = np.linspace(0, 63, 16).astype(int)
    X[:300, dims] = X[0, dims]  # 300 rows share 16 coordinates ...
    for group in copies:  # ... and copies stay copies
        X[group] = X[group[0]]
    T = np.concatenate([X[[copies[0][0], copies[1][0], 5]] + 0.05 * unit_rows(rng, 3, 64),
                        unit_rows(rng, 40, 64)])
    index = ExactIndex().build(X)
    for k in (3, 10, 30):
        scores, ids = index.search(T, k)
        rv, ri = reference_with_copies(X, T, k, copies)
        np.testing.assert_array_equal(ids.numpy(), ri)


@pytest.mark.parametrize("k", [1, 10, 100])
def test_many_cpu_blocks_equal_the_reference(monkeypatch, k):
    """The CPU torch pass over many blocks (a short last one: 30,003 rows in blocks of 4096).
    Real-valued rows with copies spread over the blocks, and queries near copied rows; ids
    equal the float64 reference but where float32 cannot order two different rows."""
    monkeypatch.setattr(exact_module, "optional_faiss", lambda: None)
    rng = np.random.default_rng(31)
    X, copies = copied_unit_rows(rng, 30003, 32, (2, 3, 5))
    X[30000:] = X[copies[0][0]]  # copies in the short last block, too
    copies[0] = np.concatenate([copies[0], [30000, 30001, 30002]])
    T = unit_rows(rng, 64, 32)
    T[:30] = X[copies[0][0]] + 0.2 * T[:30]
    index = ExactIndex({"memory_budget": 64 * 4096 * 4 + 2**17}).build(X)
    assert index._plan(64, k)[2] < 30003
    scores, ids = index.search(T, k)
    rv, ri = reference_with_copies(X, T, k, copies)
    ids = ids.numpy()
    np.testing.assert_allclose(scores.numpy(), rv, atol=1e-6)
    own = np.einsum("bd,bkd->bk", T.astype(np.float64), X[ids].astype(np.float64))
    differ = ids != ri
    assert differ.mean() < 0.01
    np.testing.assert_allclose(own[differ], rv[differ], atol=1e-7)
    for group in copies:  # copies: in id order wherever they rank
        for row in ids:
            found = row[np.isin(row, group)]
            np.testing.assert_array_equal(found, np.sort(found))


@pytest.mark.parametrize("rising", [True, False])
def test_rising_and_falling_scores(monkeypatch, rising):
    """Scores that grow with the row id (every block beats the running top-w) or fall with it
    (the first block holds it), over several blocks. Small-integer rows, so ties at the k-th
    place are real. Equal to the reference."""
    monkeypatch.setattr(exact_module, "optional_faiss", lambda: None)
    rng = np.random.default_rng(32)
    n = 12000
    X = rng.integers(-2, 3, (n, 6)).astype(np.float32)
    step = np.arange(n) // 40  # runs of 40 rows share the leading coordinate
    X[:, 0] = step if rising else step.max() - step
    T = rng.integers(-2, 3, (70, 6)).astype(np.float32)
    T[:, 0] = 4
    index = ExactIndex({"memory_budget": 2**21}).build(X)
    assert index._plan(70, 64)[2] < n
    for k in (1, 16, 64):
        scores, ids = index.search(T, k)
        rv, ri = ref.exact_search(X, T, k)
        np.testing.assert_array_equal(ids.numpy(), ri)
        np.testing.assert_array_equal(scores.numpy(), rv.astype(np.float32))


def test_nan_ranks_first():
    """A NaN score ranks first on every path (as torch.topk has it), also when its row sits in
    a later block. The other ids equal the reference without that row."""
    rng = np.random.default_rng(33)
    X = unit_rows(rng, 30003, 16)
    T = unit_rows(rng, 40, 16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(exact_module, "optional_faiss", lambda: None)
        index = ExactIndex({"memory_budget": 2**20}).build(X)
        index.vectors[21000, 3] = np.nan  # build refuses it (a loaded file may not)
        assert index._plan(40, 10)[2] < 21000
        scores, ids = index.search(T, 10)
    assert (ids[:, 0] == 21000).all() and torch.isnan(scores[:, 0]).all()
    rest = np.delete(np.arange(30003), 21000)
    _, ri = ref.exact_search(X[rest], T, 9)
    np.testing.assert_array_equal(ids[:, 1:].numpy(), rest[ri])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["default", "blocks", "bfloat16"])
@pytest.mark.parametrize("k", [5, 44])
def test_runs_of_nan_or_inf_longer_than_the_candidates_keep_the_lowest_ids(device, path, k):
    """A NaN query (every score NaN) or an inf one (+inf for half the rows) ties far more rows
    than a pass keeps (k + 8): the result is still the lowest ids of the run, for each storage,
    with faiss' search on or off."""
    rng = np.random.default_rng(41)
    X = unit_rows(rng, 5000, 8)
    X[:, 0] = np.where(X[:, 0] == 0, 0.5, X[:, 0])  # no 0 * inf
    T = unit_rows(rng, 3, 8)
    T[0, 2], T[1, 0] = np.nan, np.inf
    with pytest.MonkeyPatch.context() as mp:
        if path == "blocks":
            mp.setattr(exact_module, "optional_faiss", lambda: None)
        params = {"dtype": "bfloat16"} if path == "bfloat16" else {}
        scores, ids = make_index("exact", device, params).build(X).search(
            torch.from_numpy(T).to(device), k)
    stored = torch.from_numpy(X).bfloat16().double().numpy() if path == "bfloat16" else X
    assert ids[0].tolist() == list(range(k)) and scores[0].isnan().all()
    assert ids[1].tolist() == np.flatnonzero(stored[:, 0] > 0)[:k].tolist()
    assert (scores[1] == np.inf).all()
    q2 = T[2:]  # on CUDA 16-bit rows meet 16-bit queries
    if path == "bfloat16" and device != "cpu":
        q2 = torch.from_numpy(q2).bfloat16().double().numpy()
    np.testing.assert_array_equal(ids[2].cpu().numpy(), ref.exact_search(stored, q2, k)[1][0])


@pytest.mark.parametrize("faiss_on", [True, False])
def test_a_nan_row_in_the_index_takes_one_pass(faiss_on, monkeypatch):
    """A float32 index may hold a NaN row (from a loaded file, or the caller's shared rows
    written after build, which refuses it): it ranks first where it is a candidate and ends
    its run there, so no query is searched again (it was widened to the whole index)."""
    faiss = pytest.importorskip("faiss") if faiss_on else None
    monkeypatch.setattr(exact_module, "optional_faiss", lambda: faiss)
    rng = np.random.default_rng(8)
    X = unit_rows(rng, 4000, 16)
    T = unit_rows(rng, 300, 16)
    index = ExactIndex().build(X)
    index.vectors[123, 5] = np.nan  # build refuses it (a loaded file may not)
    widths = []
    one_pass = index._pass
    monkeypatch.setattr(index, "_pass", lambda q, kk, w: widths.append(w) or one_pass(q, kk, w))
    for k in (1, 10):
        widths.clear()
        index.search(T, k)
        assert widths == [k + 8]
