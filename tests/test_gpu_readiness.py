"""What the CUDA paths promise, checked on the CPU where the logic allows and on CUDA
(``gpu`` marker) where it does not: host synchronisations of an exact search, the export
graph's reverse edges from the search's own scores, copies of foreign arrays, in-memory PIFA,
a deterministic vote sum and the CUDA memory budget."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pefa_gpu as pg
from pefa_gpu import arrays
from pefa_gpu.index import exact as exact_mod
from pefa_gpu.index.exact import ExactIndex, TIE_MARGIN
from conftest import DEVICES, cuda_syncs, unit_rows


class DLPackOnly:
    """An array torch can read only through DLPack (as cupy's arrays are read)."""

    def __init__(self, t: torch.Tensor):
        self.t = t

    def __dlpack__(self, *args, **kwargs):
        return self.t.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


# -- 1. host synchronisations of an exact search ---------------------------------------------

@pytest.mark.parametrize("n,k,second_pass", [(40, 5, True), (40, 32, False), (40, 40, False),
                                             (9, 1, False), (10, 1, True)])
def test_a_second_pass_is_looked_for_only_when_candidates_miss_part_of_the_index(
        monkeypatch, n, k, second_pass):
    """rescan (the one host synchronisation on CUDA) exists exactly when k + TIE_MARGIN < n."""
    seen = []
    real_pass = ExactIndex._pass

    def spy(self, q, kk, w):
        out = real_pass(self, q, kk, w)
        if w == self._pass_width(kk):  # a first pass
            seen.append(out[2] is not None)
        return out

    monkeypatch.setattr(ExactIndex, "_pass", spy)
    rng = np.random.default_rng(0)
    x = unit_rows(rng, n, 8)
    x[3:] = x[2]  # ties across every boundary
    ExactIndex(device="cpu").build(x).search(unit_rows(rng, 6, 8), k)
    assert seen and all(s == second_pass for s in seen)
    assert second_pass == (k + TIE_MARGIN < n)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol", [("float16", 5e-4), ("bfloat16", 3e-3)])
def test_cuda_exact_16bit_storage_against_a_float64_reference(dtype, atol):
    """fp16 / bf16 storage on CUDA (a GEMM reading the 16-bit rows, float32 accumulation):
    scores within the queries' rounding of the float64 scores of the stored rows, the same
    top-k wherever the k-th and (k+1)-th reference scores are further apart than that."""
    rng = np.random.default_rng(8)
    x, q, k = unit_rows(rng, 3000, 64), unit_rows(rng, 50, 64), 10
    index = ExactIndex({"dtype": dtype}, device="cuda").build(torch.from_numpy(x).cuda())
    s, i = index.search(torch.from_numpy(q).cuda(), k)
    s, i = s.cpu().numpy(), i.cpu().numpy()
    ref = q.astype(np.float64) @ index.vectors.float().cpu().numpy().astype(np.float64).T
    order = np.argsort(-ref, axis=1, kind="stable")
    clear = 0
    for r in range(len(q)):
        np.testing.assert_allclose(s[r], ref[r, i[r]], atol=atol)
        if ref[r, order[r, k - 1]] - ref[r, order[r, k]] > 2 * atol:
            clear += 1
            assert set(i[r]) == set(order[r, :k])
    assert clear >= 5


# -- 6. foreign arrays are copied with copy=True ---------------------------------------------

def test_as_tensor_copies_a_dlpack_array_when_asked():
    t = torch.zeros(3, 2)
    assert arrays.as_tensor(DLPackOnly(t)).data_ptr() == t.data_ptr()  # read in place
    got = arrays.as_tensor(DLPackOnly(t), copy=True)
    assert got.data_ptr() != t.data_ptr()
    t[0] = 1.0
    assert got[0].abs().sum() == 0


def test_as_embeddings_copies_a_dlpack_array_when_asked():
    t = torch.from_numpy(unit_rows(np.random.default_rng(1), 4, 3))
    got = arrays.as_embeddings(DLPackOnly(t), "cpu", "P", copy=True)
    t[0] = 0.0
    assert got[0].abs().sum() > 0.5


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dlpack", "cupy"])
def test_cuda_foreign_array_is_copied_and_the_model_keeps_its_own(kind):
    p = torch.from_numpy(unit_rows(np.random.default_rng(2), 30, 8)).cuda()
    before = p.clone()
    if kind == "cupy":
        cupy = pytest.importorskip("cupy")
        src = cupy.from_dlpack(p)
    else:
        src = DLPackOnly(p)
    got = arrays.as_embeddings(src, "cuda", "P", copy=True)
    model = pg.ERM(device="cuda").fit(src)
    p.zero_()
    assert torch.equal(got, before)
    assert torch.equal(model.index.vectors.float(), before)


# -- 2. the export graph ranks reverse edges by the search's scores -------------------------

def _reference_graph(x: np.ndarray, degree: int) -> np.ndarray:
    """The knn graph of pefa_gpu.export's docstring in float64, one row at a time."""
    s = x.astype(np.float64) @ x.astype(np.float64).T
    n, half = len(x), max(1, degree // 2)
    fwd = []
    for i in range(n):
        order = [j for j in np.lexsort((np.arange(n), -s[i])) if j != i]
        fwd.append(order[:degree])
    rev = [[] for _ in range(n)]
    for i in range(n):
        for j in fwd[i][:half]:
            rev[j].append(i)
    out = np.full((n, degree), -1, np.int64)
    for j in range(n):
        back = sorted(rev[j], key=lambda i: (-s[i, j], i))[:half]
        row = []
        for c in fwd[j][:half] + back + fwd[j][half:]:
            if c not in row:
                row.append(c)
        out[j, :min(degree, len(row))] = row[:degree]
    return out


@pytest.mark.parametrize("n,degree", [(120, 8), (60, 6), (7, 16)])
def test_knn_graph_equals_a_float64_reference(n, degree):
    from pefa_gpu.export import knn_graph

    x = unit_rows(np.random.default_rng(n), n, 12)
    x[5] = x[4]  # a duplicate pair
    got = knn_graph(x, degree, "cpu").numpy()
    np.testing.assert_array_equal(got, _reference_graph(x, degree))


def test_knn_graph_gathers_no_rows_for_its_reverse_edges(monkeypatch):
    """The reverse edges' scores come from the forward search: no (n M, d) gather."""
    from pefa_gpu import export

    x = torch.from_numpy(unit_rows(np.random.default_rng(3), 50, 8))
    gathered = []
    getitem = torch.Tensor.__getitem__

    def spy(self, key):
        out = getitem(self, key)
        if self.data_ptr() == x.data_ptr() and isinstance(key, torch.Tensor):
            gathered.append(key.numel())
        return out

    monkeypatch.setattr(torch.Tensor, "__getitem__", spy)
    export.knn_graph(x, 8, "cpu")
    assert gathered == []


# -- 3. in-memory PIFA: Y transposed on the device, torch's CSR product ----------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,n,density", [(300, 500, 0.02), (40, 7, 0.5), (5, 9, 0.0),
                                         (0, 4, 0.0)])
def test_in_memory_pifa_transposes_on_the_device(device, m, n, density):
    """Yᵀ Q by torch's CSR product after a transpose on the device: float64 reference, with
    queries and documents without entries, an empty Y and no queries at all."""
    import scipy.sparse as sp

    from pefa_gpu.aggregate import transposed_csr
    from reference import pifa as ref_pifa

    rng = np.random.default_rng(m + n)
    q = rng.standard_normal((m, 16)).astype(np.float32)
    y = sp.random(m, n, density=density, random_state=4, format="csr", dtype=np.float32)
    y.data[:] = rng.uniform(-2, 3, y.nnz).astype(np.float32)
    q_dev = torch.from_numpy(q).to(device)
    got = transposed_csr(y, q_dev.device) @ q_dev
    assert got.shape == (n, 16) and got.dtype == torch.float32 and got.device == q_dev.device
    np.testing.assert_allclose(got.cpu().numpy(), ref_pifa(y, q, normalize_rows=False),
                               rtol=1e-5, atol=1e-5)
    assert np.array_equal(q_dev.cpu().numpy(), q)  # the input is read, not written


# -- 4. the fusion's vote sums: the same bits on numpy and torch, any device -----------------

def _vote_table(device, seed=5, b=5, kp=6, kn=12, n=60, m=40, d=8):
    """A candidate table with many votes per cell (dense Y, real-valued entries)."""
    import scipy.sparse as sp

    from pefa_gpu import fuse
    from pefa_gpu.relevance import as_relevance

    rng = np.random.default_rng(seed)
    y = sp.random(m, n, density=0.6, random_state=seed, format="csr", dtype=np.float32)
    y.data = rng.uniform(0.1, 3.0, y.nnz).astype(np.float32)
    q, docs = unit_rows(rng, b, d), unit_rows(rng, n, d)
    ei = np.stack([rng.choice(n, kp, replace=False) for _ in range(b)])
    es = np.sort(rng.standard_normal((b, kp)).astype(np.float32), 1)[:, ::-1].copy()
    ki = np.stack([rng.choice(m, kn, replace=False) for _ in range(b)])
    ks = rng.uniform(0.2, 1.0, (b, kn)).astype(np.float32)
    arrays_ = [q, docs, es, ei, ks, ki]
    if device is not None:
        arrays_ = [torch.from_numpy(a).to(device) for a in arrays_]
    q, docs, es, ei, ks, ki = arrays_
    rows = fuse.RelevanceRows(as_relevance(y), device or "cpu")
    table = fuse.candidate_table(q, docs, rows, (es, ei), (ks, ki), rescore=True,
                                 erm_exact=False)
    return table, y.toarray().astype(np.float64), ki, ks


@pytest.mark.parametrize("k,divisor", [(12, 12.0), (7, 7.0), (3, 1.0)])
def test_vote_sums_equal_numpy_to_the_bit_on_torch(k, divisor):
    t_np, y, ki, ks = _vote_table(None)
    t_t, _, _, _ = _vote_table("cpu")
    f_np, dead_np = t_np.knn_scores(k, divisor)
    f_t, dead_t = t_t.knn_scores(k, divisor)
    np.testing.assert_array_equal(f_t.numpy().view(np.int32), f_np.view(np.int32))
    np.testing.assert_array_equal(dead_t.numpy(), dead_np)
    # float32 sums in neighbour order, and the float64 value, written here
    width = t_np.ids.shape[1]
    row, doc = t_np.cells // width, t_np.ids.reshape(-1)[t_np.cells]
    assert (f_np > 0).sum() > len(f_np) // 2  # most candidates are voted for, many thrice
    for u in range(len(f_np)):
        acc, exact = np.float32(0.0), 0.0
        for r in range(k):
            v = y[ki[row[u], r], doc[u]]
            if v:
                acc = np.float32(acc + np.float32(np.float32(ks[row[u], r]) /
                                                  np.float32(divisor)) * np.float32(v))
                exact += ks[row[u], r] / divisor * v
        assert f_np[u] == acc
        assert abs(f_np[u] - exact) <= 1e-5 * max(1.0, exact)


@pytest.mark.gpu
@pytest.mark.parametrize("k,divisor", [(12, 12.0), (7, 7.0)])
def test_cuda_vote_sums_equal_numpy_to_the_bit_run_after_run(k, divisor):
    t_np, _, _, _ = _vote_table(None)
    f_np = t_np.knn_scores(k, divisor)[0]
    for _ in range(3):
        t_c, _, _, _ = _vote_table("cuda")
        f_c = t_c.knn_scores(k, divisor)[0].cpu().numpy()
        np.testing.assert_array_equal(f_c.view(np.int32), f_np.view(np.int32))


# -- 5. the CUDA memory budget is a share of the free memory ---------------------------------

def _fake_cuda_memory(monkeypatch, free, reserved, allocated):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * 2**30))
    stats = {"reserved_bytes": {"all": {"current": reserved}},
             "allocated_bytes": {"all": {"current": allocated}}} if reserved else {}
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: stats)


def test_default_budget_is_256_mib_on_cpu_and_a_quarter_of_free_cuda_memory(monkeypatch):
    _fake_cuda_memory(monkeypatch, 40 * 2**30, 6 * 2**30, 2 * 2**30)
    cuda = torch.device("cuda")
    assert exact_mod.default_memory_budget(torch.device("cpu")) == 256 * 2**20
    assert exact_mod.default_memory_budget(cuda) == (40 + 4) * 2**30 // 4
    _fake_cuda_memory(monkeypatch, 1000, 0, 0)
    assert exact_mod.default_memory_budget(cuda) == 2**16
    index = ExactIndex(device="cpu")
    assert index.params.memory_budget is None and index.memory_budget == 256 * 2**20
    assert ExactIndex({"memory_budget": 2**20}).memory_budget == 2**20
    with pytest.raises(pg.InputError, match="memory_budget"):
        ExactIndex({"memory_budget": 100})
    with pytest.raises(pg.InputError, match="memory_budget"):
        ExactIndex({"memory_budget": True})


def test_cuda_block_plan_at_1m_rows_uses_the_free_memory(monkeypatch):
    """The CUDA block plan, run on the CPU: 1M x 768 bf16 rows, B = 4096, k = 100."""
    index = ExactIndex({"dtype": "bfloat16"}, device="cpu")
    index.vectors = torch.zeros(1, 768, dtype=torch.bfloat16).expand(1_000_000, 768)
    index.device = torch.device("cuda")
    _fake_cuda_memory(monkeypatch, 70 * 2**30, 0, 0)
    q_batch, chunk = index._block_shape(4096, 100)
    assert q_batch == 4096 and chunk >= 500_000
    assert index._work_bytes(q_batch, chunk, 108) <= index.memory_budget
    fixed = ExactIndex({"dtype": "bfloat16", "memory_budget": 256 * 2**20}, device="cpu")
    fixed.vectors, fixed.device = index.vectors, index.device
    assert fixed._block_shape(4096, 100)[1] < 20_000  # the old fixed default: 80+ rounds


@pytest.mark.gpu
def test_cuda_votes_synchronise_once_and_vote_sums_never():
    import scipy.sparse as sp

    from pefa_gpu import fuse
    from pefa_gpu.relevance import as_relevance

    table, _, ki, _ = _vote_table("cuda")
    y = sp.random(40, 60, density=0.6, random_state=5, format="csr", dtype=np.float32)
    rows = fuse.RelevanceRows(as_relevance(y), "cuda")
    torch.cuda.synchronize()
    (slot, doc, _), syncs = cuda_syncs(lambda: fuse.votes(ki, rows))
    _, more = cuda_syncs(lambda: fuse.votes(ki.repeat(10, 1), rows))  # none per row
    assert syncs == more == 1 and slot.numel() == doc.numel() > 0  # reading the entry count
    _, syncs = cuda_syncs(lambda: table.knn_scores(table.n_neighbours, 4.0))
    assert syncs == 0


# -- 7. tests mean the CPU unless marked gpu -------------------------------------------------

def test_the_default_device_is_the_cpu_in_a_test_without_the_gpu_marker():
    assert pg.ERM().fit(unit_rows(np.random.default_rng(6), 20, 4)).device.type == "cpu"
    assert arrays.resolve_device(None) == torch.device("cpu")


@pytest.mark.gpu
def test_the_default_device_is_cuda_in_a_gpu_test():
    assert arrays.resolve_device(None).type == "cuda"
