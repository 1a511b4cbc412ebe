"""Every index backend through one suite, against a float64 numpy reference; HNSW export."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

import pefa_gpu as pg
from pefa_gpu.errors import FormatError, InputError, MissingDependencyError
from pefa_gpu.index import backend_class, make_index
from pefa_gpu.params import MAX_HNSW_EF, MAX_HNSW_M, MAX_THREADS

from conftest import make_model, run_forked, run_python, unit_rows

try:
    import faiss
except ImportError:  # the cases that need it skip (FAISS); the others run
    faiss = None
FAISS = pytest.mark.skipif(faiss is None, reason="faiss is not installed")



def installed(module: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} is not installed")


HNSWLIB, SCANN = installed("hnswlib"), installed("scann")
GPU = pytest.mark.gpu
BACKENDS = [
    ("exact", "cpu"),
    pytest.param("hnsw", "cpu", marks=FAISS),
    pytest.param("ivf", "cpu", marks=FAISS),
    pytest.param("cagra", "cpu", marks=FAISS),  # a CAGRA save loaded onto the CPU: exact
    pytest.param("hnswlib", "cpu", marks=HNSWLIB),
    pytest.param("scann", "cpu", marks=SCANN),       # small test data: brute force
    pytest.param("scann-tree", "cpu", marks=SCANN),  # tree + AH + re-ordering
    pytest.param("hnsw", "cuda", marks=[GPU, FAISS]),
    pytest.param("ivf", "cuda", marks=[GPU, FAISS]),
    pytest.param("cagra", "cuda", marks=GPU),  # faiss' GPU CAGRA or cuVS (skips without)
    pytest.param("hnswlib", "cuda", marks=[GPU, HNSWLIB]),
    pytest.param("scann-tree", "cuda", marks=[GPU, SCANN]),
]
FAISS_ANN = [b for b in BACKENDS if getattr(b, "values", b)[0] in ("hnsw", "ivf", "cagra")]
# test names of a backend with other settings than its defaults: (backend, build, search).
# scann-tree: a tree on any size; random vectors do not cluster, so it searches 9 of 10 leaves
VARIANTS = {"scann-tree": ("scann", {"brute_force_below": 0, "num_leaves": 10},
                           {"leaves_to_search": 9})}


def backend_of(name: str) -> str:
    return VARIANTS.get(name, (name,))[0]


def new_index(name: str, device: str, **params):
    """An empty index of backend (or variant) ``name``. CAGRA builds only on a GPU with
    faiss-gpu or cuVS (the test skips on one without them); on the CPU it is a CAGRA save
    loaded there, where builds store the vectors and searches are exact."""
    backend, build, search = VARIANTS.get(name, (name, {}, None))
    if backend == "cagra" and device == "cpu":
        with tempfile.TemporaryDirectory() as tmp:
            np.save(Path(tmp) / "vectors.npy", np.zeros((0, 1), np.float32))
            return backend_class("cagra").load(tmp, {**build, **params} or None, "cpu")
    try:
        return make_index(backend, device, {**build, **params} or None, search_params=search)
    except MissingDependencyError as exc:
        if backend != "cagra":
            raise
        pytest.skip(str(exc))


def ref_topk(q: np.ndarray, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """float64 top-k inner products, ties to the lower id."""
    s = q.astype(np.float64) @ x.astype(np.float64).T
    order = np.lexsort((np.broadcast_to(np.arange(x.shape[0]), s.shape), -s), axis=1)[:, :k]
    return np.take_along_axis(s, order, 1), order


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(f) & set(t)) / len(t) for f, t in zip(found, truth)]))


def easy_data(seed: int, n: int = 2000, d: int = 32, b: int = 64):
    rng = np.random.default_rng(seed)
    x = unit_rows(rng, n, d)
    q = x[rng.choice(n, b, replace=False)] + 0.1 * rng.standard_normal((b, d)).astype(np.float32)
    return x, (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)


def check_results(scores: torch.Tensor, ids: torch.Tensor, b: int, k: int, n: int,
                  device: str) -> tuple[np.ndarray, np.ndarray]:
    assert scores.shape == (b, k) and ids.shape == (b, k)
    assert scores.dtype == torch.float32 and ids.dtype == torch.int64
    assert scores.device.type == device and ids.device.type == device
    s, i = scores.cpu().numpy(), ids.cpu().numpy()
    assert ((i == -1) == np.isneginf(s)).all(), "padding must pair id -1 with score -inf"
    assert ((i >= -1) & (i < n)).all()
    for row in i:
        valid = row[row >= 0]
        assert len(set(valid)) == len(valid), "an id appears twice in one row"
        assert (row[len(valid):] == -1).all(), "padding must come last"
    return s, i


@pytest.mark.parametrize("name,device", BACKENDS)
def test_agrees_with_exact_and_scores_are_similarities(name, device):
    x, q = easy_data(1)
    index = new_index(name, device).build(x)
    assert index.ntotal == 2000 and index.dim == 32
    scores, ids = index.search(q, 10)
    s, i = check_results(scores, ids, 64, 10, 2000, device)
    _, truth = ref_topk(q, x, 10)
    assert recall(i, truth) >= 0.95
    ref = np.einsum("bd,bkd->bk", q.astype(np.float64), x.astype(np.float64)[i])
    np.testing.assert_allclose(s, ref, atol=1e-4)
    assert (np.diff(s, axis=1) <= 1e-6).all(), "scores must be sorted, larger first"


@pytest.mark.parametrize("name,device", BACKENDS)
def test_padding_when_k_exceeds_n(name, device):
    x = unit_rows(np.random.default_rng(2), 50, 16)
    index = new_index(name, device).build(x)
    s, i = check_results(*index.search(x[:5], 80), 5, 80, 50, device)
    assert ((i >= 0).sum(1) == 50).all()
    assert (i[:, 0] == np.arange(5)).all()


@pytest.mark.parametrize("name,device", BACKENDS)
def test_add_appends_ids(name, device):
    x, _ = easy_data(3, n=1500)
    index = new_index(name, device).build(x[:1000])
    index.add(torch.from_numpy(x[1000:]))
    assert index.ntotal == 1500
    probe = np.arange(1000, 1500, 25)
    _, ids = index.search(x[probe], 1)
    assert (ids.cpu().numpy()[:, 0] == probe).mean() >= 0.95


@pytest.mark.parametrize("name,device", BACKENDS)
def test_duplicates_and_ties_give_valid_ids(name, device):
    rng = np.random.default_rng(4)
    base = unit_rows(rng, 300, 16)
    x = np.concatenate([base, base, base[:50]])  # every row at least twice
    index = new_index(name, device).build(x)
    s, i = check_results(*index.search(base[:20], 6), 20, 6, len(x), device)
    # the query's own copies are among its best results: at least two with score ~1
    assert ((s > 0.999).sum(1) >= 2).all()
    # equal scores are listed lower id first, as on every other path
    s, i = np.asarray(s), np.asarray(i)
    tied = s[:, 1:] == s[:, :-1]
    assert (i[:, 1:][tied] > i[:, :-1][tied]).all()


@pytest.mark.parametrize("name,device", BACKENDS)
def test_bad_input_is_named(name, device):
    index = new_index(name, device).build(unit_rows(np.random.default_rng(5), 100, 8))
    with pytest.raises(InputError, match="8"):
        index.search(np.zeros((2, 9), np.float32), 3)
    with pytest.raises(InputError, match="k"):
        index.search(np.zeros((2, 8), np.float32), 0)
    s, i = index.search(np.zeros((0, 8), np.float32), 3)
    assert s.shape == (0, 3) and i.shape == (0, 3)


@pytest.mark.parametrize("name,device", FAISS_ANN)
def test_k_above_backend_limit_falls_back(name, device, monkeypatch):
    x, q = easy_data(6, n=600)
    cls = backend_class(name)
    index = new_index(name, device).build(x)
    monkeypatch.setattr(cls, "max_k", 7)
    if name == "ivf":
        monkeypatch.setattr(cls, "gpu_max_k", 7)
    s, i = check_results(*index.search(q, 40), 64, 40, 600, device)
    ref_s, ref_i = ref_topk(q, x, 40)
    assert recall(i, ref_i) >= 0.99
    np.testing.assert_allclose(s, ref_s, atol=1e-4)
    index.add(x[:10])  # the fallback follows later adds
    _, i2 = index.search(x[:3], 40)
    assert i2.shape == (3, 40) and int(i2.max()) >= 600


@pytest.mark.parametrize("name,device", BACKENDS)
def test_save_load_round_trip(name, device, tmp_path):
    x, q = easy_data(7, n=1200)
    index = new_index(name, device).build(x)
    try:
        index.save(tmp_path)
    except NotImplementedError:
        pytest.skip(f"{name} save is not implemented")
    loaded = backend_class(backend_of(name)).load(tmp_path, index.params, device)
    if hasattr(index, "search_params"):  # search settings are not part of a saved index
        loaded.search_params = index.search_params
    assert loaded.ntotal == index.ntotal and loaded.dim == index.dim
    s1, i1 = index.search(q, 10)
    s2, i2 = loaded.search(q, 10)
    if name == "cagra" and device != "cpu":  # the graph is rebuilt on load
        assert recall(i2.cpu().numpy(), i1.cpu().numpy()) >= 0.95
    else:
        assert torch.equal(i1, i2) and torch.equal(s1, s2)
    # into a folder holding something: a link named as its file was written through
    (tmp_path / "again").mkdir()
    (tmp_path / "target.txt").write_text("precious")
    for file in ("index.faiss", "index.bin", "scann.json", "vectors.npy"):
        (tmp_path / "again" / file).symlink_to(tmp_path / "target.txt")
    with pytest.raises(InputError, match="is not empty: an index is saved into an empty folder|"
                                          "tensor file .*vectors.npy is a symbolic link"):
        index.save(tmp_path / "again")
    assert (tmp_path / "target.txt").read_text() == "precious"


@pytest.mark.parametrize("name", [pytest.param("hnsw", marks=FAISS),
                                  pytest.param("ivf", marks=FAISS),
                                  pytest.param("hnswlib", marks=HNSWLIB),
                                  pytest.param("scann", marks=SCANN), "cagra", "exact"])
def test_a_save_or_load_directory_that_is_no_path_is_named(name, tmp_path, monkeypatch):
    # Path(3)'s TypeError named nothing; '' saved into the current folder (empty here)
    monkeypatch.chdir(tmp_path)
    cls = backend_class(name)
    for bad in (3, None):
        with pytest.raises(TypeError, match="directory must be a path"):
            cls.load(bad)
    if name != "cagra":  # built on CUDA only
        index = make_index(name, "cpu", {"nlist": 2} if name == "ivf" else {}).build(
            unit_rows(np.random.default_rng(2), 200, 8))
        with pytest.raises(TypeError, match="directory must be a path"):
            index.save(3)
        with pytest.raises(InputError, match="save directory is ''"):
            index.save("")
        assert not list(tmp_path.iterdir())


@FAISS
@pytest.mark.parametrize("name", ["hnsw", "ivf"])
def test_load_errors(name, tmp_path):
    cls = backend_class(name)
    with pytest.raises(FormatError, match="missing"):
        cls.load(tmp_path, None, "cpu")
    (tmp_path / "index.faiss").write_bytes(b"not a faiss index at all")
    with pytest.raises(FormatError, match="could not be read"):
        cls.load(tmp_path, None, "cpu")
    other = tmp_path / "other"
    other.mkdir()
    x = unit_rows(np.random.default_rng(8), 400, 8)
    (make_index("ivf" if name == "hnsw" else "hnsw", "cpu")).build(x).save(other)
    with pytest.raises(FormatError, match="expected"):
        cls.load(other, None, "cpu")


# -- search settings, apart from build settings ------------------------------------------------

SEARCH_KEY = {"hnsw": "ef_search", "ivf": "nprobe", "cagra": "itopk_size",  # one per ANN
              "hnswlib": "ef_search", "scann": "leaves_to_search"}             # backend


@pytest.mark.parametrize("name,device", [b for b in BACKENDS
                                         if getattr(b, "values", b)[0] not in VARIANTS])
def test_search_params_defaults_per_call_and_errors(name, device):
    x, q = easy_data(16, n=1200)
    index = new_index(name, device).build(x)
    cls = type(index)
    sp = index.search_params
    assert isinstance(sp, cls.SearchParams) and sp == cls.SearchParams()
    assert cls.SearchParams.from_json(sp.to_json()) == sp
    s0, i0 = index.search(q, 10)
    for same in ({}, sp, sp.to_dict()):  # the defaults, spelt three ways
        s1, i1 = index.search(q, 10, params=same)
        assert torch.equal(i0, i1) and torch.equal(s0, s1)
    with pytest.raises(InputError, match=r"unknown keys \['efs'\]; known: \["):
        index.search(q, 10, params={"efs": 3})
    with pytest.raises(TypeError, match="SearchParams or a dict"):
        index.search(q, 10, params=index.params)  # build settings are not search settings
    assert index.search_params is sp  # a call's settings never become the defaults
    index.search_params = sp.to_dict()
    assert index.search_params == sp
    with pytest.raises(InputError, match="unknown"):
        index.search_params = {"efs": 3}
    if name in SEARCH_KEY:  # a search setting among the build settings is named as such
        with pytest.raises(InputError, match=f"{SEARCH_KEY[name]}.*are search settings"):
            make_index(name, device, {SEARCH_KEY[name]: 64})


@FAISS
def test_hnsw_ef_search_per_call():
    rng = np.random.default_rng(17)
    x, q = unit_rows(rng, 4000, 48), unit_rows(rng, 100, 48)  # random rows: hard at a small ef
    index = make_index("hnsw", "cpu", {"M": 8, "ef_construction": 40, "threads": 1}).build(x)
    _, truth = ref_topk(q, x, 10)
    _, low = index.search(q, 10, params={"ef_search": 10})
    s, high = index.search(q, 10, params=backend_class("hnsw").SearchParams(ef_search=400))
    assert recall(low.numpy(), truth) < 0.6 and recall(high.numpy(), truth) >= 0.98
    assert index.search_params.ef_search == 300
    index.search_params = {"ef_search": 10}  # the same as defaults: the same graph walk
    assert torch.equal(index.search(q, 10)[1], low)
    np.testing.assert_allclose(s.numpy(), np.take_along_axis(q @ x.T, high.numpy(), 1),
                               atol=1e-5)


@FAISS
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_ivf_nprobe_per_call(device):
    rng = np.random.default_rng(18)
    x, q = unit_rows(rng, 3000, 32), unit_rows(rng, 64, 32)
    index = make_index("ivf", device, {"nlist": 50, "threads": 1}).build(x)
    ref_s, truth = ref_topk(q, x, 10)
    _, one = index.search(q, 10, params={"nprobe": 1})
    s, every = index.search(q, 10, params={"nprobe": 50})
    np.testing.assert_array_equal(every.cpu().numpy(), truth)  # every list: the exact top-k
    np.testing.assert_allclose(s.cpu().numpy(), ref_s, atol=1e-5)
    assert recall(one.cpu().numpy(), truth) < 0.5
    assert torch.equal(index.search(q, 10, params={"nprobe": 500})[1], every)  # > nlist: all
    assert index.search_params.nprobe == 0 and index.nprobe == 32  # automatic: 5/8, >= 32


@FAISS
@pytest.mark.parametrize("params,match", [
    ({"nlist": 10, "train_size": 5}, r"5 training vectors for nlist=10: k-means needs at "
                                     r"least 10"),
    ({"kind": "pq", "nlist": 4, "pq_m": 4, "pq_nbits": 12}, r"1024 training vectors for "
     r"nlist=4 and 2\^12 codes a sub-quantizer: k-means needs at least 4096"),
    ({"kind": "pq", "nlist": 4, "pq_m": 4, "train_size": 100}, r"needs at least 256"),
    ({"nlist": 2500}, r"nlist=2500 is more than the 2000 vectors to train on")])
def test_ivf_with_fewer_training_vectors_than_centres_is_refused_naming_them(params, match):
    """faiss' own refusal was a RuntimeError naming its source line ('nx >= k')."""
    x = unit_rows(np.random.default_rng(5), 2000, 32)
    with pytest.raises(InputError, match=match):
        make_index("ivf", "cpu", {**params, "threads": 1}).build(x)


@SCANN
def test_scann_with_fewer_training_vectors_than_leaves_is_refused_naming_them():
    """ScaNN's own refusal was an untyped RuntimeError."""
    x = unit_rows(np.random.default_rng(6), 600, 16)
    with pytest.raises(InputError, match=r"50 training vectors for num_leaves=100: k-means "
                                         r"needs at least 100"):
        make_index("scann", "cpu", {"num_leaves": 100, "train_size": 50,
                                    "brute_force_below": 10, "threads": 1}).build(x)


def test_ivf_pq_nbits_past_faiss_limit_is_refused():
    with pytest.raises(InputError, match="pq_nbits"):
        backend_class("ivf").Params(pq_nbits=25)
    assert backend_class("ivf").Params(pq_nbits=24).pq_nbits == 24


@FAISS
def test_ivf_few_training_vectors_warn_through_the_log_not_faiss_stderr(capfd, caplog):
    """IVF-PQ on 3,000 vectors printed faiss' 'WARNING clustering 3000 points to 256
    centroids' to stderr once per sub-quantizer, even under --quiet; now one log line (the
    index as before: faiss' minimum only warns)."""
    x = unit_rows(np.random.default_rng(8), 3000, 8)
    with caplog.at_level("WARNING", logger="pefa_gpu"):
        index = make_index("ivf", "cpu", {"kind": "pq", "nlist": 8, "threads": 1}).build(x)
    assert "WARNING clustering" not in capfd.readouterr().err
    assert [r.getMessage() for r in caplog.records] == [
        "ivf: 2048 training vectors for 256 k-means centres (faiss suggests 9984): raise "
        "train_size, or lower nlist / pq_nbits"]
    assert index.ntotal == 3000


@pytest.mark.gpu
def test_cagra_search_params_per_call():
    x, q = easy_data(19, n=5000)
    index = new_index("cagra", "cuda").build(x)
    _, truth = ref_topk(q, x, 10)
    _, low = index.search(q, 10, params={"itopk_size": 16})
    _, high = index.search(q, 10, params={"itopk_size": 256, "search_width": 4})
    assert recall(high.cpu().numpy(), truth) >= max(0.95, recall(low.cpu().numpy(), truth))
    assert index.search_params == backend_class("cagra").SearchParams()


@pytest.mark.parametrize("rows", [np.full((4, 8), np.nan, np.float32), np.ones(8, np.float32)],
                         ids=["nan", "1-D"])
def test_a_cagra_save_of_bad_rows_is_a_format_error(tmp_path, rows):
    # was the InputError of build ('vectors contains NaN or inf'), as if the caller gave them
    np.save(tmp_path / "vectors.npy", rows)
    with pytest.raises(FormatError, match=r"vectors\.npy: vectors"):
        backend_class("cagra").load(tmp_path, None, "cpu")



def test_an_unbuilt_cagra_save_loads_empty(tmp_path):
    """save() accepts an index not built yet (vectors (0, 0)); its load was the FormatError
    'vectors must be 2-D (n, d) with d > 0'."""
    from pefa_gpu.index.cagra import CagraIndex
    CagraIndex(device="cpu", need_engine=False).save(tmp_path)
    index = backend_class("cagra").load(tmp_path, None, "cpu")
    assert (index.ntotal, index.dim) == (0, 0)
    index.build(np.eye(3, 4, dtype=np.float32))  # usable as a new one
    assert index.search(np.eye(1, 4, dtype=np.float32), 1)[1].tolist() == [[0]]

@pytest.mark.parametrize("backend", ["hnsw", "hnswlib"])
def test_an_hnsw_degree_of_one_is_refused(backend):
    """M=1: the level multiplier 1 / log M is infinite; faiss segfaulted building the graph,
    hnswlib said 'Not enough memory: addPoint failed to allocate linklist'."""
    with pytest.raises(InputError, match="M must be at least 2 .*, got 1"):
        backend_class(backend).Params(M=1)
    with pytest.raises(InputError, match="M must be at least 2"):
        make_index(backend, "cpu", {"M": np.int64(1)})
    assert backend_class(backend).Params(M=2).M == 2


def test_an_hnswlib_seed_beyond_a_size_t_is_refused():
    """hnswlib's seed is a size_t: 2^64 was pybind's TypeError listing init_index's overloads
    after the index was made; 2^64 - 1 builds the same graph as any seed would, searchable."""
    pytest.importorskip("hnswlib")
    with pytest.raises(InputError, match="seed must be at most 18446744073709551615"):
        make_index("hnswlib", "cpu", {"seed": 2**64})
    x = np.eye(4, 8, dtype=np.float32)
    index = make_index("hnswlib", "cpu", {"seed": 2**64 - 1}).build(torch.from_numpy(x))
    assert index.search(torch.from_numpy(x), 1)[1].reshape(-1).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("backend", ["hnsw", "hnswlib"])
def test_hnsw_sizes_are_bounded_naming_the_setting_and_the_bound(backend):
    cls = backend_class(backend)  # the params only: neither faiss nor hnswlib is reached
    p = cls.Params(M=MAX_HNSW_M, ef_construction=np.int64(MAX_HNSW_EF))  # the bounds are taken
    assert (p.M, p.ef_construction) == (MAX_HNSW_M, MAX_HNSW_EF) and type(p.M) is int
    assert cls.SearchParams(ef_search=MAX_HNSW_EF).ef_search == MAX_HNSW_EF
    for make, name, top in [(cls.Params, "M", MAX_HNSW_M),
                            (cls.Params, "ef_construction", MAX_HNSW_EF),
                            (cls.SearchParams, "ef_search", MAX_HNSW_EF)]:
        for bad in (top + 1, 10**9, np.int64(2**40)):
            with pytest.raises(InputError, match=f"{name} must be at most {top}, got {int(bad)}"):
                make(**{name: bad})
    with pytest.raises(InputError, match=f"M must be at most {MAX_HNSW_M}"):
        make_index(backend, "cpu", {"M": 10**9})
    p = cls.Params(M=8)
    with pytest.raises(InputError, match=f"M must be at most {MAX_HNSW_M}"):
        p.replace(M=10**9)


@pytest.mark.parametrize("backend", ["hnsw", "ivf", "hnswlib", "scann"])
def test_threads_beyond_a_c_int_are_refused_naming_the_setting(backend):
    cls = backend_class(backend)  # were passed to faiss / hnswlib / ScaNN: a raw OverflowError
    assert cls.Params(threads=MAX_THREADS).threads == MAX_THREADS
    for bad in (MAX_THREADS + 1, 2**31, 2**63, 10**400):
        with pytest.raises(InputError, match=f"threads must be at most {MAX_THREADS}, got"):
            cls.Params(threads=bad)


@FAISS
def test_hnsw_params_and_errors(tmp_path):
    p = backend_class("hnsw").Params()
    assert (p.M, p.ef_construction, p.threads) == (32, 500, 0)
    assert type(p).from_json(p.to_json()) == p
    assert backend_class("hnsw").SearchParams().ef_search == 300
    with pytest.raises(InputError, match="unknown"):
        make_index("hnsw", "cpu", {"M": 8, "efs": 3})
    with pytest.raises(InputError, match="M"):
        make_index("hnsw", "cpu", {"M": 0})
    index = make_index("hnsw", "cpu", {"M": 8, "threads": 1}).build(
        unit_rows(np.random.default_rng(9), 200, 8))
    index.save(tmp_path)
    with pytest.raises(FormatError, match="M=8"):
        backend_class("hnsw").load(tmp_path, {"M": 16}, "cpu")


@FAISS
@pytest.mark.full_scan
def test_hnsw_scans_small_indices_exactly_and_walks_large_ones():
    assert backend_class("hnsw").SearchParams().full_scan_factor == 12.0  # the library default
    rng = np.random.default_rng(11)
    # small-integer vectors: float32 dot products are exact, so scores tie exactly
    x = rng.integers(-2, 3, (120, 6)).astype(np.float32)
    x[60:70] = x[5]  # duplicates of row 5: ten exact ties with it
    q = rng.integers(-2, 3, (9, 6)).astype(np.float32)
    q[0] = x[5]
    ref_s, ref_i = ref_topk(q, x, 25)
    index = make_index("hnsw", "cpu", {"M": 8, "threads": 1}, {"ef_search": 15}).build(x)
    # k=25 > ef_search, so ef = 25 and the scan covers n <= factor * 25; one graph, the factor
    # set per search
    for factor, walks in [(12.0, False), (120 / 25, False), (119 / 25, True), (0.0, True)]:
        faiss.cvar.hnsw_stats.reset()
        s, i = index.search(q, 25, params={"full_scan_factor": factor})
        walked = faiss.cvar.hnsw_stats.ndis > 0
        assert walked == walks
        if not walked:  # the scan is exact: every score, every id above the k-th score
            np.testing.assert_array_equal(s.numpy(), ref_s.astype(np.float32))
            above = ref_s > ref_s[:, -1:]
            np.testing.assert_array_equal(i.numpy()[above], ref_i[above])
            full = q.astype(np.float64) @ x.astype(np.float64).T
            for r in range(len(q)):  # the rest: ids tied at the k-th score, ascending
                rest = i.numpy()[r][~above[r]]
                assert (full[r, rest] == ref_s[r, -1]).all() and (np.diff(rest) > 0).all()
    index.search_params = {"ef_search": 15, "full_scan_factor": 4.0}
    faiss.cvar.hnsw_stats.reset()
    index.search(q, 5)  # ef = 15: 120 > 4 * 15, so the graph is walked
    assert faiss.cvar.hnsw_stats.ndis > 0
    for bad in (-1, float("inf"), "8", True):
        with pytest.raises(InputError, match="full_scan_factor"):
            make_index("hnsw", "cpu", search_params={"full_scan_factor": bad})
        with pytest.raises(InputError, match="full_scan_factor"):
            index.search(q, 5, params={"full_scan_factor": bad})


@FAISS
@pytest.mark.slow
def test_ivf_pq_and_auto_sizes():
    from pefa_gpu.index.ivf import auto_nlist, auto_nprobe, auto_pq_m

    assert auto_nprobe(10) == 10 and auto_nprobe(40) == 32 and auto_nprobe(132) == 83
    assert auto_nprobe(4000) == 2048
    with pytest.raises(InputError, match="nprobe"):
        make_index("ivf", "cpu", search_params={"nprobe": -1})

    assert auto_nlist(10) == 1 and auto_nlist(5183) == 132 and auto_nlist(10**8) == 40000
    assert auto_pq_m(384) == 96 and auto_pq_m(30) == 6 and auto_pq_m(2) == 1
    x, q = easy_data(10, n=3000)
    index = make_index("ivf", "cpu", {"kind": "pq"}, {"nprobe": 64}).build(x)
    s, i = check_results(*index.search(q, 10), 64, 10, 3000, "cpu")
    assert recall(i, ref_topk(q, x, 10)[1]) >= 0.5  # PQ codes: approximate by design
    with pytest.raises(InputError, match="divide"):
        make_index("ivf", "cpu", {"kind": "pq", "pq_m": 7}).build(x)


@FAISS
def test_ivf_pq_skips_faiss_polysemous_training():
    """index_factory's IVF-PQ trains a polysemous code order that no search here uses: 50 s of a
    54 s build at 5,183 x 384, pq_m 24. Without it faiss finds the same scores and ids."""
    x, q = easy_data(12, n=600)
    found = []
    for spec in ("IVF4,PQ4x4", "IVF4,PQ4x4np"):
        ref = faiss.index_factory(x.shape[1], spec, faiss.METRIC_INNER_PRODUCT)
        ref.train(x)
        ref.add(x)
        ref.nprobe = 4
        found.append(ref.search(q, 10))
    assert found[0][1].tolist() == found[1][1].tolist()
    assert found[0][0].tolist() == found[1][0].tolist()
    index = make_index("ivf", "cpu", {"kind": "pq", "pq_m": 4, "pq_nbits": 4, "nlist": 4},
                       {"nprobe": 4}).build(x)
    assert index._index.do_polysemous_training is False
    np.testing.assert_array_equal(index.search(q, 10)[0].numpy(), found[0][0])


def test_cagra_without_gpu_says_what_to_install():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(MissingDependencyError, match="cuVS.*device is cpu"):
        make_index("cagra", "cpu")


@pytest.mark.gpu
def test_cagra_built_on_gpu_serves_exactly_on_cpu(tmp_path):
    x, q = easy_data(20, n=3000)
    x[7] = x[3]  # equal scores: listed by id
    gpu = new_index("cagra", "cuda").build(x)
    gpu.save(tmp_path)
    cpu = backend_class("cagra").load(tmp_path, gpu.params, "cpu")
    assert cpu.engine is None and cpu.device.type == "cpu"
    s, i = check_results(*cpu.search(q, 10), 64, 10, 3000, "cpu")
    ref_s, ref_i = ref_topk(q, x, 10)
    np.testing.assert_array_equal(i, ref_i)
    np.testing.assert_allclose(s, ref_s, atol=1e-5)


def test_missing_faiss_is_a_clear_error(monkeypatch):
    from pefa_gpu.index._faiss import import_faiss

    monkeypatch.setitem(sys.modules, "faiss", None)
    with pytest.raises(MissingDependencyError, match="pip install faiss-cpu"):
        import_faiss()


def test_import_does_not_load_faiss():
    code = ("import sys, pefa_gpu; "
            "print(*[m in sys.modules for m in ('faiss', 'hnswlib', 'scann')])")
    assert run_python("-c", code).stdout.strip() == "False False False"


@pytest.mark.parametrize("name,module,hint", [
    ("hnswlib", "hnswlib", "pip install hnswlib"),
    ("scann", "scann.scann_ops.py", "pip install scann")])
def test_missing_cpu_library_is_a_clear_error(monkeypatch, name, module, hint):
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(MissingDependencyError, match=hint):
        make_index(name, "cpu")


# -- hnswlib ----------------------------------------------------------------------------------

@HNSWLIB
def test_hnswlib_params_and_search_settings():
    cls = backend_class("hnswlib")
    p, sp_ = cls.Params(), cls.SearchParams()
    assert (p.M, p.ef_construction, sp_.ef_search) == (32, 500, 300)  # the paper's HNSW settings
    assert cls.Params.from_json(p.to_json()) == p
    assert cls.SearchParams.from_json(sp_.to_json()) == sp_
    with pytest.raises(InputError, match="are search settings"):
        make_index("hnswlib", "cpu", {"M": 8, "ef_search": 3})
    for bad in ({"M": 0}, {"ef_construction": -1}, {"threads": -1}, {"seed": 1.5}):
        with pytest.raises(InputError, match=next(iter(bad))):
            make_index("hnswlib", "cpu", bad)
    with pytest.raises(InputError, match="ef_search"):
        cls.SearchParams(ef_search=0)

    rng = np.random.default_rng(21)
    x, q = unit_rows(rng, 3000, 48), unit_rows(rng, 60, 48)  # no structure: a hard graph
    index = make_index("hnswlib", "cpu", {"M": 4, "ef_construction": 8, "threads": 1}).build(x)
    assert index.search_params == cls.SearchParams()
    truth = ref_topk(q, x, 10)[1]
    narrow = index.search(q, 10, {"ef_search": 10})
    wide = index.search(q, 10, cls.SearchParams(ef_search=3000))
    assert recall(narrow[1].numpy(), truth) < recall(wide[1].numpy(), truth)
    assert torch.equal(index.search(q, 10)[1], index.search(q, 10, {"ef_search": 300})[1])
    index.search_params = cls.SearchParams(ef_search=10)  # the default of later calls
    assert torch.equal(index.search(q, 10)[1], narrow[1])
    with pytest.raises(InputError, match="unknown"):
        index.search(q, 10, {"efs": 3})
    with pytest.raises(TypeError, match="SearchParams"):
        index.search(q, 10, 300)


@HNSWLIB
def test_hnswlib_scores_are_similarities_and_vectors_come_back():
    rng = np.random.default_rng(22)
    x, q = unit_rows(rng, 500, 16), unit_rows(rng, 20, 16)
    index = make_index("hnswlib", "cpu").build(x)
    s, i = index.search(q, 5)
    ref = np.einsum("bd,bkd->bk", q.astype(np.float64), x.astype(np.float64)[i.numpy()])
    np.testing.assert_allclose(s.numpy(), ref, atol=3e-7)  # 1 - (1 - ip), not a distance
    assert index.exact_scores is True
    ids = torch.tensor([[3, 0, 499], [7, 7, 1]])
    np.testing.assert_array_equal(index.reconstruct(ids).numpy(), x[ids.numpy()])
    assert index.reconstruct(torch.zeros(0, dtype=torch.long)).shape == (0, 16)
    with pytest.raises(InputError, match=r"\[0, 500\)"):
        index.reconstruct(torch.tensor([500]))


@pytest.mark.parametrize("backend,params", [
    ("exact", {}), ("exact", {"dtype": "bfloat16"}),
    pytest.param("hnsw", {"M": 4}, marks=FAISS), pytest.param("ivf", {"nlist": 2}, marks=FAISS),
    pytest.param("hnswlib", {"M": 4}, marks=HNSWLIB)])
def test_reconstruct_returns_rows_and_refuses_ids_outside_the_index(backend, params):
    x = unit_rows(np.random.default_rng(23), 120, 8)
    empty = make_index(backend, "cpu", params)  # unbuilt: the library's index was None
    assert empty.reconstruct(torch.zeros((0, 2), dtype=torch.long)).shape == (0, 2, 0)
    index = make_index(backend, "cpu", params).build(x)
    want = torch.from_numpy(x).to(getattr(torch, params.get("dtype", "float32"))).float()
    ids = torch.tensor([[3, 0, 119], [7, 7, 1]])
    got = index.reconstruct(ids)
    assert got.dtype == torch.float32 and torch.equal(got, want[ids])
    for bad in ([-1], [120], [2, 10**9]):  # -1 is not the last row
        with pytest.raises(InputError, match=r"ids must lie in \[0, 120\)"):
            index.reconstruct(torch.tensor(bad))
    # uint64 2^63 was named as id -9223372036854775808 (cast first); uint8 ids are ids
    with pytest.raises(InputError, match=r"ids hold values beyond int64 \(torch.uint64\)"):
        index.reconstruct(np.array([2**63], np.uint64))
    assert torch.equal(index.reconstruct(np.array([3], np.uint8)), want[[3]])


@HNSWLIB
def test_hnswlib_load_checks_the_files(tmp_path):
    cls = backend_class("hnswlib")
    x = unit_rows(np.random.default_rng(23), 300, 8)
    index = make_index("hnswlib", "cpu", {"M": 8}).build(x)
    with pytest.raises(FormatError, match="missing"):
        cls.load(tmp_path, None, "cpu")
    index.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hnswlib.json", "index.bin"]
    with pytest.raises(FormatError, match="M=8, params say M=16"):
        cls.load(tmp_path, {"M": 16}, "cpu")
    meta = json.loads((tmp_path / "hnswlib.json").read_text())
    for change, match in [({"dim": 16}, "says 300 of 16"), ({"ntotal": 299}, "says 299 of 8"),
                          ({"space": "l2"}, "version 1 description"),
                          ({"format": "other"}, "version 1 description")]:
        (tmp_path / "hnswlib.json").write_text(json.dumps({**meta, **change}))
        with pytest.raises(FormatError, match=match):
            cls.load(tmp_path, {"M": 8}, "cpu")
    (tmp_path / "hnswlib.json").write_text(json.dumps(meta))
    data = (tmp_path / "index.bin").read_bytes()
    _description_is_read_with_bounds(cls, tmp_path / "hnswlib.json", {"M": 8})
    (tmp_path / "index.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(FormatError, match="truncated"):
        cls.load(tmp_path, {"M": 8}, "cpu")
    (tmp_path / "index.bin").write_bytes(data[:96] + b"\xff" * (len(data) - 96))
    with pytest.raises(FormatError, match="could not be read by hnswlib|malformed"):
        cls.load(tmp_path, {"M": 8}, "cpu")
    (tmp_path / "index.bin").write_bytes(data)
    back = cls.load(tmp_path, {"M": 8}, "cpu")
    assert torch.equal(back.search(x[:5], 3)[1], index.search(x[:5], 3)[1])


# -- ScaNN ------------------------------------------------------------------------------------

@SCANN
def test_scann_settings_and_automatic_sizes():
    from pefa_gpu.index.scann_backend import (auto_leaves_to_search, auto_num_leaves,
                                              auto_reorder)

    assert auto_num_leaves(5183) == 72 and auto_num_leaves(800) == 16
    assert auto_num_leaves(49) == 1 and auto_num_leaves(10**6) == 1000
    assert auto_leaves_to_search(72) == 54 and auto_leaves_to_search(1) == 1
    assert auto_leaves_to_search(10) == 8
    assert auto_reorder(10) == 100 and auto_reorder(100) == 400
    cls = backend_class("scann")
    p = cls.Params()
    assert cls.Params.from_json(p.to_json()) == p and p.brute_force_below == 4096
    assert cls.Params(anisotropic_threshold=None).anisotropic_threshold is None
    for bad in ({"num_leaves": -1}, {"dims_per_block": 0}, {"anisotropic_threshold": "0.2"},
                {"anisotropic_threshold": float("nan")}, {"threads": 1.0}):
        with pytest.raises(InputError, match=next(iter(bad))):
            make_index("scann", "cpu", bad)
    with pytest.raises(InputError, match="are search settings"):
        make_index("scann", "cpu", {"leaves_to_search": 3})
    x = unit_rows(np.random.default_rng(24), 600, 8)
    assert make_index("scann", "cpu").build(x).num_leaves == 0  # below brute_force_below
    assert make_index("scann", "cpu", {"brute_force_below": 600}).build(x).num_leaves == 12
    with pytest.raises(InputError, match="num_leaves=700 is more than the 600 vectors"):
        make_index("scann", "cpu", {"brute_force_below": 0, "num_leaves": 700}).build(x)


@SCANN
def test_scann_sizes_beyond_a_c_int_are_refused_or_capped():
    # dims_per_block 2^31 aborted the process in ScaNN's C++; reorder 2^31 was pybind's
    # TypeError not naming it: it now searches as reorder = every row
    code = ("import pefa_gpu as pg, numpy as np; x = np.eye(8, dtype='float32');"
            "pg.make_index('scann', 'cpu', {'dims_per_block': 2**31, 'brute_force_below': 0}"
            ").build(np.tile(x, (40, 1)))")
    out = run_forked(code, returncode=None)
    assert out.returncode == 1 and "dims_per_block must be at most 2147483647" in out.stderr
    x = unit_rows(np.random.default_rng(28), 300, 8)
    index = make_index("scann", "cpu", {"brute_force_below": 0, "num_leaves": 4}).build(x)
    s, i = index.search(x[:3], 5, {"reorder": 2**31, "leaves_to_search": 4})
    s0, i0 = index.search(x[:3], 5, {"reorder": 300, "leaves_to_search": 4})
    assert torch.equal(i, i0) and torch.equal(s, s0)


@SCANN
def test_scann_tree_rows_beyond_float32_k_means_are_refused():
    # build: ScaNN's C++ aborted the process ('Check failed: cluster_idx < num_clusters'); add
    # to a tree: a segfault. A brute-force index (no tree) takes them.
    code = ("import sys, numpy as np, pefa_gpu as pg; from pefa_gpu.errors import InputError\n"
            "x = np.tile(np.eye(8, dtype='float32'), (40, 1)); p = {'brute_force_below': 0}\n"
            "for s in (2e19, 1e30):\n"
            "    try: pg.make_index('scann', 'cpu', p).build(x * s)\n"
            "    except InputError as e: print(e)\n"
            "    i = pg.make_index('scann', 'cpu', p).build(x)\n"
            "    try: i.add(x[:2] * s)\n"
            "    except InputError as e: print(e)\n"
            "    assert i.ntotal == 320\n"
            "pg.make_index('scann', 'cpu').build(x).add(x[:2] * 1e30)\n")
    out = run_forked(code, returncode=None)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("beyond what scann's float32 tree holds") == 4


@SCANN
def test_scann_tree_searching_every_leaf_is_exact():
    rng = np.random.default_rng(25)
    # small-integer vectors: float32 dot products are exact, so scores tie exactly
    x = rng.integers(-2, 3, (900, 6)).astype(np.float32)
    x[500:520] = x[7]
    q = rng.integers(-2, 3, (30, 6)).astype(np.float32)
    q[0] = x[7]
    index = make_index("scann", "cpu", {"brute_force_below": 0, "num_leaves": 12,
                                        "threads": 1}).build(x)
    ref_s, ref_i = ref_topk(q, x, 25)
    s, i = index.search(q, 25, {"leaves_to_search": 12, "reorder": 900})
    s, i = s.numpy(), i.numpy()
    np.testing.assert_array_equal(s, ref_s.astype(np.float32))  # similarities, exact
    above = ref_s > ref_s[:, -1:]
    np.testing.assert_array_equal(i[above], ref_i[above])
    full = q.astype(np.float64) @ x.T.astype(np.float64)
    for r in range(len(q)):  # ids tied at the k-th score: any of them, listed by id
        rest = i[r][~above[r]]
        assert (full[r, rest] == ref_s[r, -1]).all() and (np.diff(rest) > 0).all()
    one = index.search(q, 25, {"leaves_to_search": 1})[1].numpy()
    assert recall(one, ref_i) < recall(i, ref_i)


@SCANN
def test_scann_builds_the_same_tree_in_every_process(tmp_path):
    rng = np.random.default_rng(29)
    x, q = unit_rows(rng, 6000, 16), unit_rows(rng, 40, 16)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "q.npy", q)
    code = ("import sys, numpy as np, pefa_gpu as pg; d = sys.argv[1];"
            "i = pg.make_index('scann', 'cpu', {'threads': 1}).build(np.load(d + '/x.npy'));"
            "np.save(d + '/ids.npy', i.search(np.load(d + '/q.npy'), 10, "
            "{'leaves_to_search': 20})[1].numpy())")
    run_python("-c", code, tmp_path)
    index = make_index("scann", "cpu", {"threads": 1}).build(x)
    assert index.num_leaves == 77
    ids = index.search(q, 10, {"leaves_to_search": 20})[1].numpy()
    np.testing.assert_array_equal(ids, np.load(tmp_path / "ids.npy"))


@SCANN
def test_scann_pads_what_the_searched_leaves_do_not_hold():
    x = unit_rows(np.random.default_rng(26), 1000, 8)
    index = make_index("scann", "cpu", {"brute_force_below": 0, "num_leaves": 10}).build(x)
    s, i = check_results(*index.search(x[:4], 900, {"leaves_to_search": 1}), 4, 900, 1000,
                         "cpu")
    assert (i == -1).any() and not np.isnan(s).any()  # ScaNN's NaN / id 0 filler is gone
    s, i = check_results(*index.search(x[:4], 1000), 4, 1000, 1000, "cpu")
    assert ((i >= 0).sum(1) == 1000).all()  # k covers the index: every leaf is searched


@SCANN
def test_scann_has_no_reconstruct_and_a_clear_error():
    index = make_index("scann", "cpu").build(unit_rows(np.random.default_rng(27), 50, 8))
    with pytest.raises(NotImplementedError, match="scann"):
        index.reconstruct(torch.tensor([0]))


class _Sentinel:
    """Unpickling this creates a file: proof that a loader ran pickled code."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        from pathlib import Path

        return (Path.touch, (self.path,))


@SCANN
def test_scann_load_refuses_pickles_and_paths_outside(tmp_path):
    import pickle

    cls = backend_class("scann")
    x = unit_rows(np.random.default_rng(28), 5000, 8)
    saved = tmp_path / "saved"
    saved.mkdir()
    with pytest.raises(FormatError, match="missing"):
        cls.load(saved, None, "cpu")
    index = make_index("scann", "cpu", {"brute_force_below": 0}).build(x)
    index.save(saved)
    files = {p.name for p in saved.iterdir()}
    assert "scann.json" in files and "scann_assets.pbtxt" in files
    assert not any(name.endswith(".pkl") for name in files)
    back = cls.load(saved, index.params, "cpu")
    assert back.num_leaves == index.num_leaves == 71
    assert torch.equal(back.search(x[:9], 5)[1], index.search(x[:9], 5)[1])

    ran = tmp_path / "pickle-ran"
    (saved / "scann_docids.pkl").write_bytes(pickle.dumps(_Sentinel(ran)))
    with pytest.raises(FormatError, match="pickle"):
        cls.load(saved, None, "cpu")
    assert not ran.exists()
    (saved / "scann_docids.pkl").unlink()

    assets = (saved / "scann_assets.pbtxt").read_text()
    outside = tmp_path / "dataset.npy"
    outside.write_bytes((saved / "dataset.npy").read_bytes())
    for path in ("../dataset.npy", str(outside)):
        (saved / "scann_assets.pbtxt").write_text(
            assets.replace('asset_path: "dataset.npy"', f'asset_path: "{path}"'))
        with pytest.raises(FormatError, match="not a file inside"):
            cls.load(saved, None, "cpu")
    (saved / "scann_assets.pbtxt").write_text("this is { not a proto")
    with pytest.raises(FormatError, match="asset list"):
        cls.load(saved, None, "cpu")
    (saved / "scann_assets.pbtxt").write_text(assets)
    meta = json.loads((saved / "scann.json").read_text())
    (saved / "scann.json").write_text(json.dumps({**meta, "ntotal": 4999}))
    with pytest.raises(FormatError, match="4999"):
        cls.load(saved, None, "cpu")
    (saved / "scann.json").write_text("[]")
    with pytest.raises(FormatError, match="version 1 description"):
        cls.load(saved, None, "cpu")


# -- models on ANN backends -------------------------------------------------------------------

def model_data(seed: int = 11, n: int = 800, m: int = 400, d: int = 32):
    rng = np.random.default_rng(seed)
    p = unit_rows(rng, n, d)
    docs = rng.integers(0, n, m)
    q = p[docs] + 0.3 * rng.standard_normal((m, d)).astype(np.float32)
    q = (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)
    import scipy.sparse as sp

    y = sp.csr_matrix((np.ones(m, np.float32), (np.arange(m), docs)), shape=(m, n))
    t = p[rng.integers(0, n, 50)] + 0.3 * rng.standard_normal((50, d)).astype(np.float32)
    return p, q, y, (t / np.linalg.norm(t, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("backend", [pytest.param("hnsw", marks=FAISS),
                                     pytest.param("hnswlib", marks=HNSWLIB),
                                     pytest.param("scann", marks=SCANN)])
@pytest.mark.parametrize("cls,kw", [(pg.ERM, {}), (pg.PEFAXS, {"lam": 0.5}),
                                    (pg.PEFAXL, {"lam": 0.3, "k": 8, "candidates": 100})])
def test_models_on_ann_backends_match_exact(cls, kw, backend):
    p, q, y, t = model_data()
    args = (p,) if cls is pg.ERM else (p, q, y)
    exact = make_model(cls, device="cpu", **kw).fit(*args)
    ann = make_model(cls, device="cpu", backend=backend, **kw).fit(*args)
    if cls is pg.PEFAXL:
        assert ann.index.name == backend and ann.query_index.name == backend
    _, ie = exact.search(t, 10)
    sa, ia = ann.search(t, 10)
    assert sa.dtype == torch.float32 and ia.dtype == torch.int64
    assert recall(ia.numpy(), ie.numpy()) >= 0.95


# -- HNSW export ------------------------------------------------------------------------------

def test_knn_graph_shape_and_edges():
    from pefa_gpu.export import knn_graph

    x = unit_rows(np.random.default_rng(12), 300, 16)
    x[10] = x[11]  # a duplicate pair
    g = knn_graph(x, 8, "cpu").numpy()
    assert g.shape == (300, 8)
    for r, row in enumerate(g):
        valid = row[row >= 0]
        assert r not in valid and len(set(valid)) == len(valid) and (row < 300).all()
    _, nn = ref_topk(x, x, 2)
    first = np.where(nn[:, 0] == np.arange(300), nn[:, 1], nn[:, 0])
    assert np.mean([f in row for f, row in zip(first, g)]) >= 0.99
    assert 11 in g[10] and 10 in g[11]


@FAISS
@pytest.mark.parametrize("method,kind", [("auto", "IndexHNSWFlat"), ("knn", "IndexHNSWCagra")])
@pytest.mark.parametrize("cls,kw", [(pg.ERM, {}), (pg.PEFAXS, {"lam": 0.5}),
                                    (pg.NUDGE, {"variant": "M", "gamma": 0.3})])
def test_export_hnsw_round_trip(cls, kw, method, kind, tmp_path):
    p, q, y, t = model_data(13)
    model = cls(device="cpu", **kw).fit(*((p,) if cls is pg.ERM else (p, q, y)))
    path = model.export_hnsw(tmp_path / "index.faiss", M=16, method=method)
    index = faiss.read_index(str(path))
    assert isinstance(index, getattr(faiss, kind)) and index.ntotal == 800
    d, i = index.search(t, 10)
    s_ref, i_ref = model.search(t, 10)
    assert recall(i, i_ref.numpy()) >= 0.95
    vec = {pg.PEFAXS: lambda: model.xs_embeddings().numpy(),
           pg.NUDGE: lambda: model.nudge_embeddings().numpy()}.get(cls, lambda: p)()
    np.testing.assert_allclose(d, np.einsum("bd,bkd->bk", t, vec[i]), atol=1e-4)


@FAISS
def test_export_hnsw_xl_directory_loads_in_a_plain_process(tmp_path):
    p, q, y, t = model_data(14)
    model = make_model(pg.PEFAXL, device="cpu", backend="hnsw", k=8, candidates=100).fit(p, q, y)
    out = model.export_hnsw(tmp_path / "xl", M=16)
    np.save(tmp_path / "t.npy", t)
    code = (
        "import faiss, numpy as np, sys; d = sys.argv[1]; t = np.load(sys.argv[2]);"
        "a = faiss.read_index(d + '/passages.faiss'); b = faiss.read_index(d + '/queries.faiss');"
        "print(a.ntotal, b.ntotal, int((a.search(t, 5)[1] >= 0).all()),"
        " int((b.search(t, 5)[1] >= 0).all()))")
    res = run_python("-c", code, out, tmp_path / "t.npy")
    # queries.faiss holds the 400 training queries; documents are neighbours via passages.faiss
    assert res.stdout.split() == ["800", "400", "1", "1"]
    assert (out / "relevance.npz").is_file() and (out / "export.json").is_file()
    with pytest.raises(InputError, match="exists"):
        model.export_hnsw(out)


def test_export_of_unfitted_model_is_an_error(tmp_path):
    with pytest.raises(InputError, match="fit"):
        pg.ERM(device="cpu").export_hnsw(tmp_path / "x.faiss")


@FAISS
@pytest.mark.gpu
def test_export_graph_built_on_gpu_serves_on_cpu(tmp_path):
    from pefa_gpu.export import export_hnsw

    x, q = easy_data(15)
    path = export_hnsw(torch.from_numpy(x).cuda(), tmp_path / "g.faiss", M=16, device="cuda")
    index = faiss.read_index(str(path))
    _, i = index.search(q, 10)
    assert recall(i, ref_topk(q, x, 10)[1]) >= 0.95


@FAISS
def test_ivf_refuses_training_rows_its_float32_k_means_overflows():
    """Finite rows of norm ~1e38 aborted the process inside faiss' k-means ('invalid cluster
    assignment'); from 1e20 the inner products overflowed and searches found nothing."""
    code = ("import numpy as np, pefa_gpu as pg\n"
            "x = np.full((40, 8), 3e38, np.float32)\n"
            "try:\n"
            "    pg.make_index('ivf', 'cpu', {'nlist': 2, 'threads': 1}).build(x)\n"
            "except pg.InputError as exc:\n"
            "    print(exc)\n")
    out = run_forked(code)
    assert "a row norm of 8.49e+38 is beyond what ivf's float32 k-means holds" in out.stdout
    x = unit_rows(np.random.default_rng(7), 40, 8)
    x[5] *= 1e20
    with pytest.raises(InputError, match="normalise the rows"):
        make_index("ivf", "cpu", {"nlist": 2, "threads": 1}).build(x)
    x[5] /= 1e10  # 1e10: the products still fit
    assert make_index("ivf", "cpu", {"nlist": 2, "threads": 1}).build(x).ntotal == 40


@pytest.mark.parametrize("backend,params", [
    pytest.param("hnsw", {"M": 4}, marks=FAISS), pytest.param("ivf", {"nlist": 2}, marks=FAISS),
    pytest.param("hnswlib", {"M": 4}, marks=HNSWLIB),
    pytest.param("scann", {"num_leaves": 2}, marks=SCANN)])
def test_host_backends_refuse_bool_complex_object_and_string_rows(backend, params):
    """host_float32 cast them: bool to 0 / 1, complex dropping its imaginary part, objects
    element by element, strings a bare numpy ValueError; as_tensor refuses them all."""
    x = unit_rows(np.random.default_rng(8), 40, 8)
    index = make_index(backend, "cpu", {**params, "threads": 1}).build(x)
    for bad in (x > 0, x.astype(np.complex64), x.astype(object), np.full((40, 8), "x"),
                torch.from_numpy(x > 0), torch.from_numpy(x.astype(np.complex64))):
        dtype = str(bad.dtype).replace("torch.", "").replace("complex64", "complex")
        with pytest.raises(InputError, match=re.escape(f"has dtype {dtype}")):
            make_index(backend, "cpu", {**params, "threads": 1}).build(bad)
        with pytest.raises(InputError, match=re.escape(f"queries has dtype {dtype}")):
            index.search(bad[:3], 2)
        with pytest.raises(InputError, match=re.escape(f"vectors has dtype {dtype}")):
            index.add(bad[:3])
    assert index.ntotal == 40


@SCANN
def test_xl_score_on_scann_says_the_backend_keeps_no_query_vectors():
    """It was the query index's NotImplementedError from inside score's neighbour gather."""
    rng = np.random.default_rng(10)
    P, Q, T = unit_rows(rng, 30, 8), unit_rows(rng, 20, 8), unit_rows(rng, 3, 8)
    Y = pg.Relevance.from_pairs(np.arange(20), np.arange(20), shape=(20, 30))
    xl = pg.PEFAXL(device="cpu", k=4, backend="scann").fit(P, Q, Y)
    with pytest.raises(InputError, match="PEFAXL.score needs the training queries' vectors: "
                                         "backend 'scann' cannot return its stored vectors"):
        xl.score(T, xl.search(T, 5)[1])


def _description_is_read_with_bounds(cls, path, params):
    """A saved index's JSON description was read whole, however large (a forged 8 GB file
    filled memory), through links, and NaN / broken JSON were all 'not a description'."""
    from pefa_gpu import storage

    good = path.read_text()
    path.write_text(good + " " * 100)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(storage, "MAX_MANIFEST_BYTES", len(good) + 99)
        with pytest.raises(FormatError, match=rf"is {len(good) + 100} bytes, more than a "
                                              rf"description's {len(good) + 99}"):
            cls.load(path.parent, params, "cpu")
    (path.parent / "elsewhere.json").write_text(good)
    path.unlink()
    path.symlink_to(path.parent / "elsewhere.json")
    with pytest.raises(FormatError, match="is not a regular file"):
        cls.load(path.parent, params, "cpu")
    path.unlink()
    (path.parent / "elsewhere.json").unlink()
    path.write_text(good[:-2])
    with pytest.raises(FormatError, match="is not valid JSON"):
        cls.load(path.parent, params, "cpu")
    path.write_text(good)
