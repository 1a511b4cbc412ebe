"""The logic of the CUDA paths, run on the CPU where it can be (device resolution, tensors
created on the inputs' device, the faiss device-pointer search, the IVF GPU bookkeeping,
CAGRA's re-scoring), and the same paths on a GPU (tests marked gpu)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import pefa_gpu as pg
from pefa_gpu.arrays import cuda_index
from pefa_gpu.errors import InputError
from pefa_gpu.index import backend_class, make_index

from conftest import unit_rows

PACKAGE = Path(pg.__file__).resolve().parent


# -- one place resolves a CUDA device to its index ---------------------------------------------

def test_cuda_index_resolves_the_current_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert cuda_index("cuda") == 3  # where torch puts device="cuda" tensors: not GPU 0
    assert cuda_index(torch.device("cuda")) == 3
    assert cuda_index("cuda:1") == 1
    assert cuda_index(torch.device("cuda", 0)) == 0
    with pytest.raises(InputError, match="not a CUDA device"):
        cuda_index("cpu")
    with pytest.raises(InputError, match="not a valid torch device"):
        cuda_index("gpu:0")


def test_no_device_index_defaults_to_gpu_0_in_the_package():
    """``device.index or 0`` puts faiss / cupy / cuVS work on GPU 0 for device='cuda' while
    torch's tensors sit on the current device; every such place goes through cuda_index
    (arrays.py, which defines it, is the one file not read)."""
    pattern = re.compile(r"\.index\s+or\s+0|\.index\s+if\s+.*\.index\s+is\s+not\s+None")
    found = [f"{p.relative_to(PACKAGE)}:{n}" for p in PACKAGE.rglob("*.py")
             if p.name != "arrays.py"
             for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found


# -- tensors are made on the inputs' device ------------------------------------------------------
# Inside ``with torch.device("meta")`` every tensor made without a device lands on "meta": a
# factory call that forgets ``device=`` then meets the CPU inputs and fails, as it would meet
# CUDA inputs on a GPU (where it would land on the CPU).

def _small(seed: int = 2):
    rng = np.random.default_rng(seed)
    P, Q, test = unit_rows(rng, 60, 8), unit_rows(rng, 40, 8), unit_rows(rng, 12, 8)
    P[7] = P[3]
    Y = sp.random(40, 60, density=0.05, random_state=seed, format="csr", dtype=np.float32)
    Y.data[:] = 1
    Yt = sp.random(12, 60, density=0.05, random_state=9, format="csr", dtype=np.float32)
    Yt.data[:] = 1
    return P, Q, Y, test, Yt


XL10 = pg.XLSearchParams(candidates=10)
PATHS = {
    "erm": lambda P, Q, Y, T, Yt: pg.ERM(device="cpu").fit(P).search(T, 5),
    "xs": lambda P, Q, Y, T, Yt: pg.PEFAXS(device="cpu").fit(P, Q, Y).search(T, 5),
    "xl": lambda P, Q, Y, T, Yt: pg.PEFAXL(device="cpu", k=4, search_params=XL10).fit(P, Q, Y)
    .search(np.concatenate([T] * 3), 5),  # > 16 queries: the torch fusion
    "xl-hnsw": lambda P, Q, Y, T, Yt: pg.PEFAXL(device="cpu", backend="hnsw", k=4,
                                                search_params=XL10).fit(P, Q, Y).search(T, 5),
    "xl-score": lambda P, Q, Y, T, Yt: pg.PEFAXL(device="cpu", k=4, search_params=XL10)
    .fit(P, Q, Y).score(torch.from_numpy(T), torch.zeros(12, 3, dtype=torch.long,
                                                           device="cpu")),
    "pifa-staged": lambda P, Q, Y, T, Yt: pg.aggregate_stream.pifa_streamed(
        pg.relevance.Relevance(Y), pg.stream.RowSource(Q), torch.device("cpu"), 1 << 20,
        kernel="index_add"),
    "sweep-k10": lambda P, Q, Y, T, Yt: pg.sweep(P, Q, Y, T, Yt, lams=(0.5,), ks=(4,),
                                                 metric_ks=(10,), device="cpu",
                                                 show_progress=False),
    "sweep-k1": lambda P, Q, Y, T, Yt: pg.sweep(P, Q, Y, T, Yt, lams=(0.5,), ks=(4,),
                                                metric_ks=(1,), device="cpu",
                                                show_progress=False),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_no_tensor_is_made_off_the_inputs_device(path):
    pytest.importorskip("faiss") if path == "xl-hnsw" else None
    import pefa_gpu.aggregate_stream  # noqa: F401
    import pefa_gpu.stream  # noqa: F401

    data = _small()
    with torch.device("meta"):
        PATHS[path](*data)


# -- faiss: torch tensors in and out through device pointers ------------------------------------

def _ivf(x, monkeypatch=None, **params):
    return make_index("ivf", "cpu", {"nlist": 20, "threads": 1, **params}).build(x)


def _as_gpu_index(monkeypatch):
    """Run the IVF backend's GPU code on a CPU faiss index: ``on_gpu`` true, and faiss'
    whole-index copy to the host counted (the CPU copy is a clone)."""
    faiss = pytest.importorskip("faiss")
    from pefa_gpu.index.ivf import IVFIndex

    copies = []

    def to_cpu(index):
        copies.append(index.ntotal)
        return faiss.clone_index(index)

    monkeypatch.setattr(IVFIndex, "on_gpu", property(lambda self: True))
    monkeypatch.setattr(faiss, "index_gpu_to_cpu", to_cpu, raising=False)
    return copies


def test_search_tensors_equals_numpy_search():
    faiss = pytest.importorskip("faiss")
    from pefa_gpu.index._faiss import search_tensors

    rng = np.random.default_rng(1)
    x, q = unit_rows(rng, 500, 16), unit_rows(rng, 9, 16)
    index = faiss.IndexHNSWFlat(16, 8, faiss.METRIC_INNER_PRODUCT)
    index.add(x)
    sp_ = faiss.SearchParametersHNSW()
    sp_.efSearch = 40
    d_ref, i_ref = index.search(q, 7, params=sp_)
    qt = torch.from_numpy(np.asfortranarray(q))  # not contiguous: made so for faiss
    d, i = search_tensors(faiss, index, qt, 7, sp_)
    assert d.dtype == torch.float32 and i.dtype == torch.int64 and d.shape == (9, 7)
    np.testing.assert_array_equal(i.numpy(), i_ref)
    np.testing.assert_array_equal(d.numpy(), d_ref)


def test_library_results_normalised_with_the_tie_rule():
    pytest.importorskip("faiss")
    from pefa_gpu.index._faiss import normalise_results

    rng = np.random.default_rng(2)
    scores = rng.choice([0.5, 0.25, 0.0, -1.0], (50, 8)).astype(np.float32)
    scores = -np.sort(-scores, axis=1)  # faiss' order: by score, ties in any order
    ids = rng.permutation(400)[:400].reshape(50, 8).astype(np.int64)
    ids[::5, 6:] = -1  # nothing found
    scores[::5, 6:] = -3.4e38
    s, i = normalise_results(torch.from_numpy(scores), torch.from_numpy(ids), 10)
    assert s.shape == i.shape == (50, 10) and s.dtype == torch.float32
    for b in range(50):  # reference: by score, then id; (-inf, -1) for nothing found
        found = ids[b] >= 0
        order = np.lexsort((ids[b][found], -scores[b][found].astype(np.float64)))
        n = int(found.sum())
        np.testing.assert_array_equal(i[b, :n].numpy(), ids[b][found][order])
        np.testing.assert_array_equal(s[b, :n].numpy(), scores[b][found][order])
        assert (i[b, n:] == -1).all() and torch.isneginf(s[b, n:]).all()
    tied = (s[:, 1:] == s[:, :-1]) & (i[:, 1:] >= 0)
    assert tied.any() and (i[:, 1:][tied] > i[:, :-1][tied]).all()


def test_faiss_stream_is_set_and_restored():
    from pefa_gpu.index._faiss import faiss_stream

    class Res:
        def __init__(self):
            self.streams = {0: "default-0", 1: "default-1"}

        def getDefaultStream(self, device):
            return self.streams[device]

        def setDefaultStream(self, device, stream):
            self.streams[device] = stream

    class Faiss:
        @staticmethod
        def cast_integer_to_cudastream_t(ptr):
            return f"stream-{ptr}"

    res = Res()
    with faiss_stream(Faiss, res, 1, 1234):
        assert res.streams == {0: "default-0", 1: "stream-1234"}
    assert res.streams == {0: "default-0", 1: "default-1"}
    with pytest.raises(KeyError):
        with faiss_stream(Faiss, res, 0, 99):
            raise KeyError("faiss failed")
    assert res.streams == {0: "default-0", 1: "default-1"}


def test_ivf_gpu_search_path_equals_the_host_path(monkeypatch):
    """The GPU search (tensors, device pointers, results normalised as tensors) on a CPU
    faiss index gives the host path's ids and scores, ties and padding included."""
    pytest.importorskip("faiss")
    rng = np.random.default_rng(3)
    x = unit_rows(rng, 1500, 16)
    x[100:110] = x[99]  # equal scores
    q = np.concatenate([x[99:100], unit_rows(rng, 30, 16)])
    index = _ivf(x)
    host = [index.search(q, 12, params={"nprobe": p}) for p in (1, 20)]
    far = index.search(q, 1400, params={"nprobe": 1})  # few lists: padded
    _as_gpu_index(monkeypatch)
    assert index.on_gpu
    for p, (s_ref, i_ref) in zip((1, 20), host):
        s, i = index.search(torch.from_numpy(q), 12, params={"nprobe": p})
        assert torch.equal(i, i_ref) and torch.equal(s, s_ref)
    s, i = index.search(q, 1400, params={"nprobe": 1})
    assert (i == -1).any() and torch.equal(i, far[1]) and torch.equal(s, far[0])


@pytest.mark.slow
def test_ivf_gpu_reconstruct_copies_the_index_once(monkeypatch):
    """On the GPU, reconstruct reads a device copy of the rows made once (faiss GPU has no
    fast read-back), extended by later adds; IVF-PQ's copy is remade after an add."""
    pytest.importorskip("faiss")
    rng = np.random.default_rng(4)
    x, more = unit_rows(rng, 1200, 16), unit_rows(rng, 50, 16)
    flat = _ivf(x)
    pq = _ivf(x, kind="pq", pq_m=4)
    copies = _as_gpu_index(monkeypatch)
    ids = torch.tensor([[0, 5], [1199, 5]])
    for _ in range(3):
        got = flat.reconstruct(ids)
        np.testing.assert_array_equal(got.numpy(), x[ids.numpy()])
    assert copies == [1200]  # one whole-index copy, not one per call
    flat.add(torch.from_numpy(more))
    got = flat.reconstruct(torch.tensor([1200, 1249, 3]))
    np.testing.assert_array_equal(got.numpy(), np.stack([more[0], more[49], x[3]]))
    assert copies == [1200]  # the added rows were appended, not read back
    assert pq.reconstruct(ids).shape == (2, 2, 16)
    pq.add(more)
    pq.reconstruct(ids)
    assert copies == [1200, 1200, 1250]  # PQ codes: read back again after an add
    with pytest.raises(InputError, match="ids must lie"):
        flat.reconstruct(torch.tensor([1250]))


def test_ivf_gpu_nprobe_above_faiss_limit_is_lowered_with_one_warning(monkeypatch, caplog):
    pytest.importorskip("faiss")
    from pefa_gpu.index.ivf import IVFIndex

    rng = np.random.default_rng(5)
    x, q = unit_rows(rng, 1500, 16), unit_rows(rng, 20, 16)
    index = _ivf(x)
    s4, i4 = index.search(q, 10, params={"nprobe": 4})
    _as_gpu_index(monkeypatch)
    monkeypatch.setattr(IVFIndex, "gpu_max_nprobe", 4)
    with caplog.at_level(logging.WARNING, logger="pefa_gpu"):
        s, i = index.search(q, 10, params={"nprobe": 20})
        index.search(q, 10, params={"nprobe": 15})
    assert torch.equal(i, i4) and torch.equal(s, s4)
    warned = [r for r in caplog.records if "limit" in r.getMessage()]
    assert len(warned) == 1 and "nprobe=20" in warned[0].getMessage()


# -- CAGRA's exact re-scoring ---------------------------------------------------------------------

@pytest.mark.parametrize("budget", [1, 600, 1 << 30])  # one query row at a time .. all at once
def test_cagra_rescore_against_float64(budget):
    from pefa_gpu.index.cagra import rescore

    rng = np.random.default_rng(6)
    x, q = unit_rows(rng, 80, 12), unit_rows(rng, 9, 12)
    x[41] = x[40] = x[7]  # equal scores
    cand = rng.integers(0, 80, (9, 15))
    cand[:, :3] = [41, 7, 40]  # ties given in an order other than by id
    cand[0, 5], cand[1, 6], cand[2, 7] = -1, 80, 10 ** 9  # invalid ids
    cand[3, 8] = cand[3, 9]  # a repeated candidate
    s, i = rescore(torch.from_numpy(q), torch.from_numpy(x), torch.from_numpy(cand), budget)
    x64 = x.astype(np.float64)
    for b in range(9):
        valid = sorted({int(c) for c in cand[b] if 0 <= c < 80})
        sc = x64[valid] @ q[b].astype(np.float64)
        order = np.lexsort((valid, -sc))
        want_i = np.array(valid)[order]
        n = len(want_i)
        np.testing.assert_array_equal(i[b, :n].numpy(), want_i)
        np.testing.assert_allclose(s[b, :n].numpy(), sc[order], atol=1e-6)
        assert (i[b, n:] == -1).all() and torch.isneginf(s[b, n:]).all()
    assert i.dtype == torch.int64 and s.dtype == torch.float32 and s.shape == (9, 15)


def test_cagra_params_memory_budget():
    p = backend_class("cagra").Params()
    assert p.memory_budget == 256 * 2**20
    with pytest.raises(InputError, match="memory_budget"):
        backend_class("cagra").Params(memory_budget=100)


# -- on a GPU ------------------------------------------------------------------------------------

def _faiss_gpu():
    faiss = pytest.importorskip("faiss", reason="faiss is not installed")
    from pefa_gpu.index._faiss import faiss_has_gpu

    if not faiss_has_gpu(faiss):
        pytest.skip("faiss has no GPU support here (faiss-cpu): the faiss GPU paths are not run")
    return faiss


@pytest.mark.gpu
def test_ivf_on_gpu_searches_device_tensors_on_a_side_stream():
    _faiss_gpu()
    rng = np.random.default_rng(7)
    x, q = unit_rows(rng, 5000, 32), unit_rows(rng, 64, 32)
    x[11] = x[10]
    gpu = make_index("ivf", "cuda", {"nlist": 40}).build(torch.from_numpy(x).cuda())
    assert gpu.on_gpu
    cpu = make_index("ivf", "cpu", {"nlist": 40}).build(x)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        qd = torch.from_numpy(q).cuda(non_blocking=True) * 1.0  # written on the side stream
        s, i = gpu.search(qd, 10, params={"nprobe": 40})
        s, i = s.clone(), i.clone()
    side.synchronize()
    assert s.device.type == "cuda"
    s_ref, i_ref = cpu.search(q, 10, params={"nprobe": 40})
    np.testing.assert_array_equal(i.cpu().numpy(), i_ref.numpy())
    np.testing.assert_allclose(s.cpu().numpy(), s_ref.numpy(), atol=1e-5)
    rows = gpu.reconstruct(torch.tensor([[0, 11], [4999, 10]], device="cuda"))
    np.testing.assert_array_equal(rows.cpu().numpy(), x[[[0, 11], [4999, 10]]])


@pytest.mark.gpu
def test_ivf_save_with_nprobe_above_the_gpu_limit_loads_onto_the_gpu(tmp_path, caplog):
    _faiss_gpu()
    from pefa_gpu.index.ivf import IVFIndex

    rng = np.random.default_rng(8)
    nlist = IVFIndex.gpu_max_nprobe + 100
    x = unit_rows(rng, nlist * 40, 8)
    cpu = make_index("ivf", "cpu", {"nlist": nlist}, {"nprobe": nlist}).build(x)
    cpu.save(tmp_path)
    gpu = IVFIndex.load(tmp_path, cpu.params, "cuda")
    assert gpu.on_gpu  # faiss refuses to copy an index whose nprobe is above its limit
    gpu.search_params = {"nprobe": nlist}
    with caplog.at_level(logging.WARNING, logger="pefa_gpu"):
        s, i = gpu.search(x[:5], 3)
    assert (i[:, 0].cpu() == torch.arange(5)).all()
    assert any("above faiss GPU's limit" in r.getMessage() for r in caplog.records)


@pytest.mark.gpu
def test_cagra_save_loads_onto_a_gpu_without_cagra(tmp_path, monkeypatch, caplog):
    from pefa_gpu.index import cagra

    rng = np.random.default_rng(9)
    x, q = unit_rows(rng, 500, 16), unit_rows(rng, 8, 16)
    np.save(tmp_path / "vectors.npy", x)
    monkeypatch.setattr(cagra, "_engine", lambda device: None)
    with caplog.at_level(logging.WARNING, logger="pefa_gpu"):
        index = cagra.CagraIndex.load(tmp_path, None, "cuda")
    assert index.engine is None and "exact" in caplog.text
    s, i = index.search(q, 5)
    ref = np.argsort(-(q.astype(np.float64) @ x.astype(np.float64).T), axis=1, kind="stable")
    np.testing.assert_array_equal(i.cpu().numpy(), ref[:, :5])


@pytest.mark.gpu
def test_cagra_on_a_side_stream_matches_the_reference():
    rng = np.random.default_rng(10)
    x, q = unit_rows(rng, 20000, 32), unit_rows(rng, 100, 32)
    try:
        index = make_index("cagra", "cuda").build(torch.from_numpy(x).cuda())
    except pg.MissingDependencyError as exc:
        pytest.skip(str(exc))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        qd = torch.from_numpy(q).cuda(non_blocking=True) * 1.0
        s, i = index.search(qd, 10, params={"itopk_size": 256})
        s, i = s.clone(), i.clone()
    side.synchronize()
    ref = q.astype(np.float64) @ x.astype(np.float64).T
    top = np.argsort(-ref, axis=1, kind="stable")[:, :10]
    hits = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(i.cpu().numpy(), top)])
    assert hits >= 0.95
    np.testing.assert_allclose(s.cpu().numpy(),
                               np.take_along_axis(ref, i.cpu().numpy(), 1), atol=1e-5)


@pytest.mark.gpu
def test_pifa_in_memory_on_a_side_stream_and_the_current_device():
    rng = np.random.default_rng(11)
    Y = sp.random(3000, 500, density=0.01, random_state=11, format="csr", dtype=np.float32)
    Q = rng.standard_normal((3000, 24)).astype(np.float32)
    ref = Y.T.toarray().astype(np.float64) @ Q.astype(np.float64)
    last = torch.cuda.device_count() - 1
    side = torch.cuda.Stream(last)
    with torch.cuda.stream(side):  # current device: the last one; device="cuda" means it
        qd = torch.from_numpy(Q).cuda(non_blocking=True) * 1.0
        a = pg.pifa(Y, qd, normalize=False, device="cuda")
        a = a.clone()
    side.synchronize()
    assert a.device == torch.device("cuda", last)
    np.testing.assert_allclose(a.cpu().numpy(), ref, rtol=1e-5, atol=1e-4)
