"""Saving and loading: storage helpers, model round trips for every backend, atomic replacement,
corrupt / foreign / future saves, device moves, memory mapping, params JSON."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import pefa_gpu as pg
from pefa_gpu import storage
from pefa_gpu.errors import FormatError, InputError, MissingDependencyError
from pefa_gpu.index import ExactIndex, ExactParams, backend_class, backend_names
from pefa_gpu.synthetic import make_synthetic

from conftest import DEVICES, make_model, run_forked, unit_rows

N, M, D = 60, 40, 8


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(7)
    P, Q = unit_rows(rng, N, D), unit_rows(rng, M, D)
    Q[1] = Q[0]  # duplicate training query
    rows = rng.integers(0, M - 3, 120)  # the last queries have no relevant document
    y = sp.coo_matrix((np.ones(120, np.float32), (rows, rng.integers(0, N, 120))),
                      shape=(M, N)).tocsr()
    y.data[:] = 1.0
    tests = unit_rows(rng, 7, D)
    tests[3] = P[5]  # an exact hit
    return P, Q, y, tests


def fit(cls, data, backend="exact", device="cpu", index_params=None, **params):
    P, Q, y, _ = data
    if cls is pg.ERM:
        params = {}
    elif cls is pg.PEFAXL:
        params = {"candidates": 20, "k": 4, **params}
    model = make_model(cls, backend=backend, device=device, index_params=index_params, **params)
    return model.fit(P) if cls is pg.ERM else model.fit(P, Q, y)


def same_results(a, b, queries, topk=10):
    sa, ia = a.search(queries, topk)
    sb, ib = b.search(queries, topk)
    assert torch.equal(ia.cpu(), ib.cpu())
    assert torch.equal(sa.cpu(), sb.cpu())


MODELS = [pg.ERM, pg.PEFAXS, pg.PEFAXL]


@pytest.fixture(scope="module")
def saved_xs(data, tmp_path_factory):
    """One PEFA-XS save shared (read-only) by the loading tests; corrupting tests copy it."""
    model = fit(pg.PEFAXS, data, lam=0.3)
    path = tmp_path_factory.mktemp("saves") / "xs"
    model.save(path)
    return model, path


def copy_save(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def files_of(save: Path) -> Path:
    """The data folder of a save (where its files are)."""
    return save / json.loads((save / "manifest.json").read_text())["data"]


# ---------------------------------------------------------------------------- storage helpers

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                   torch.int64, torch.int32, torch.bool])
@pytest.mark.parametrize("mmap", [False, True])
def test_tensor_round_trip_is_bit_exact(tmp_path, dtype, mmap):
    g = torch.Generator().manual_seed(1)
    t = (torch.randn(5, 7, generator=g) * 100).to(dtype)
    t = t.T  # non-contiguous
    meta = storage.save_tensor(tmp_path / "t", t)
    assert meta == {"file": "t.npy", "dtype": str(dtype).removeprefix("torch."), "shape": [7, 5]}
    back = storage.load_tensor(tmp_path / "t.npy", "cpu", mmap=mmap, meta=meta)
    assert back.dtype == dtype and torch.equal(back, t)
    assert storage.load_tensor(tmp_path / "t", "cpu").dtype == dtype  # extension optional


def test_bfloat16_file_is_plain_numpy_with_raw_bits(tmp_path):
    t = torch.tensor([1.0, -2.5, 3.1415], dtype=torch.bfloat16)
    storage.save_tensor(tmp_path / "b", t)
    arr = np.load(tmp_path / "b.npy", allow_pickle=False)
    assert arr.dtype.names == ("bfloat16",)
    assert np.array_equal(arr["bfloat16"], t.view(torch.int16).numpy().view(np.uint16))


def test_empty_tensor_round_trip(tmp_path):
    storage.save_tensor(tmp_path / "e", torch.empty(0, 4))
    for mmap in (False, True):
        assert storage.load_tensor(tmp_path / "e", "cpu", mmap=mmap).shape == (0, 4)


def test_a_complex_tensor_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(InputError, match="save_tensor stores real tensors, got dtype complex64"):
        storage.save_tensor(tmp_path / "c", torch.zeros(3, dtype=torch.complex64))
    assert list(tmp_path.iterdir()) == []  # was written, then refused by load_tensor


def test_load_tensor_rejects_bad_files(tmp_path):
    meta = storage.save_tensor(tmp_path / "t", torch.ones(100, 10))
    with pytest.raises(FormatError, match="manifest says dtype float32 shape \\(10, 10\\)"):
        storage.load_tensor(tmp_path / "t", "cpu", meta={**meta, "shape": [10, 10]})
    data = (tmp_path / "t.npy").read_bytes()
    (tmp_path / "t.npy").write_bytes(data[: len(data) // 2])
    for mmap in (False, True):
        with pytest.raises(FormatError, match="t.npy is truncated"):
            storage.load_tensor(tmp_path / "t", "cpu", mmap=mmap)
    (tmp_path / "x.npy").write_bytes(b"not numpy at all")
    with pytest.raises(FormatError, match="x.npy"):
        storage.load_tensor(tmp_path / "x.npy", "cpu")
    with pytest.raises(FormatError, match="missing"):
        storage.load_tensor(tmp_path / "nope", "cpu")
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(FormatError, match="obj.npy"):  # never unpickles
        storage.load_tensor(tmp_path / "obj.npy", "cpu")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (POSIX)")
def test_a_npy_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    """open() of a FIFO with no writer blocked forever (an encode cache shard, a --emb file)."""
    os.mkfifo(tmp_path / "t.npy")
    res = run_forked("import sys\nfrom pefa_gpu import storage\n"
                     "try:\n    storage.read_npy(sys.argv[1])\n"
                     "except storage.FormatError as e:\n    print(e)",
                     tmp_path / "t.npy", timeout=60)
    assert "t.npy cannot be read" in res.stdout and "not a regular file" in res.stdout


def test_csr_round_trip_and_errors(tmp_path):
    y = sp.random(9, 13, density=0.3, format="csr", random_state=2, dtype=np.float32)
    y = sp.vstack([y, sp.csr_matrix((2, 13), dtype=np.float32)], format="csr")  # empty rows
    meta = storage.save_csr(tmp_path / "y", y)
    back = storage.load_csr(tmp_path / "y.npz", meta=meta)
    assert back.shape == (11, 13) and (back != y).nnz == 0 and back.dtype == np.float32
    with pytest.raises(FormatError, match="manifest says shape"):
        storage.load_csr(tmp_path / "y", meta={**meta, "shape": [11, 14]})
    raw = (tmp_path / "y.npz").read_bytes()
    (tmp_path / "y.npz").write_bytes(raw[:-40])
    with pytest.raises(FormatError, match="y.npz is truncated"):
        storage.load_csr(tmp_path / "y")


def test_read_npy_names_the_file_and_what_is_wrong(tmp_path):
    (tmp_path / "text.npy").write_text("0.1 0.2 0.3\n")
    with pytest.raises(FormatError, match="text.npy is not a .npy file .*looks like text"):
        storage.read_npy(tmp_path / "text.npy")
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    for mmap in (None, "r"):
        with pytest.raises(FormatError, match="obj.npy holds Python objects"):
            storage.read_npy(tmp_path / "obj.npy", mmap)
    np.save(tmp_path / "t.npy", np.ones((100, 4), np.float32))
    raw = (tmp_path / "t.npy").read_bytes()
    (tmp_path / "t.npy").write_bytes(raw[:-10])
    for mmap in (None, "r"):
        with pytest.raises(FormatError, match="t.npy is truncated: .* needs"):
            storage.read_npy(tmp_path / "t.npy", mmap)


# ---------------------------------------------------------------------------- model round trips

def _backend_or_skip(name: str, device: str = "cpu"):
    if name != "exact":
        pytest.importorskip("faiss")
    try:
        pg.make_index(name, device)
    except (MissingDependencyError, ImportError) as exc:
        pytest.skip(f"backend {name!r} is not usable here: {exc}")
    except InputError as exc:
        if "cuda" in str(exc).lower() or "gpu" in str(exc).lower():
            pytest.skip(f"backend {name!r} needs a GPU here: {exc}")
        raise


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", backend_names())
@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
def test_round_trip_identical_results(tmp_path, data, cls, backend, device):
    _backend_or_skip(backend, device)
    model = fit(cls, data, backend=backend, device=device, lam=0.4)
    model.save(tmp_path / "m")
    back = pg.load(tmp_path / "m", device=device)
    assert type(back) is cls and back.backend == backend and back.device == model.device
    assert back.params == model.params and back.n_docs == N and back.dim == D
    assert back.index.params == model.index.params
    same_results(model, back, data[3])
    assert cls.load(tmp_path / "m", device=device).params == model.params


@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
def test_saved_state_is_what_the_class_lists(tmp_path, data, cls):
    model = fit(cls, data)
    model.save(tmp_path / "m")
    manifest = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert set(manifest["state"]) == set(cls._saved)
    assert manifest["class"] == cls.__name__ and manifest["format_version"] == 3
    assert manifest["library_version"] == pg.__version__
    assert manifest["params"] == model.params.to_dict()
    back = pg.load(tmp_path / "m", device="cpu")
    for name in cls._saved:
        v, w = getattr(model, name), getattr(back, name)
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, w) and v.dtype == w.dtype
        elif isinstance(v, pg.Relevance):
            assert (v.csr != w.csr).nnz == 0
        elif not isinstance(v, pg.Index):
            assert v == w


def test_xl_derived_y_state_is_rebuilt(tmp_path, data):
    model = fit(pg.PEFAXL, data, augment_docs=False, knn_norm="none", rescore=False)
    model.save(tmp_path / "xl")
    back = pg.load(tmp_path / "xl", device="cpu")
    assert back.relevance_rows is not model.relevance_rows
    for a, b in zip(model.relevance_rows.tensors, back.relevance_rows.tensors):
        assert torch.equal(a, b) and a.dtype == b.dtype
    assert torch.equal(model.relevance_rows.keys, back.relevance_rows.keys)
    same_results(model, back, data[3], topk=25)


@pytest.mark.parametrize("mmap", [False, True])
@pytest.mark.parametrize("cls,dtype", [(pg.ERM, "float32"), (pg.PEFAXL, "float32"),
                                       (pg.ERM, "float16")],
                         ids=lambda v: getattr(v, "__name__", v))
def test_a_save_holds_the_documents_once(tmp_path, cls, dtype, mmap):
    """A float32 exact index is the doc_embeddings tensor: one file, one tensor after a load.
    Bytes written: P once, not twice; a float16 index apart."""
    n, m, d = 3000, 500, 32
    s = make_synthetic(n, m, d, n_test=20, seed=3)
    model = cls(device="cpu", index_params={"dtype": dtype})
    model = model.fit(s.P) if cls is pg.ERM else model.fit(s.P, s.Q, s.Y)
    model.save(tmp_path / "s")
    folder = files_of(tmp_path / "s")
    sizes = {f.relative_to(folder).as_posix(): f.stat().st_size
             for f in folder.rglob("*") if f.is_file()}
    docs = sum(b for f, b in sizes.items() if f.startswith(("doc_embeddings", "index/")))
    index_bytes = 0 if dtype == "float32" else n * d * 2
    assert n * d * 4 + index_bytes < docs < n * d * 4 + index_bytes + 512  # + the .npy headers
    assert ("index/vectors.npy" in sizes) == (dtype != "float32")
    if cls is pg.PEFAXL:  # Q is in the query index alone
        assert m * d * 4 < sizes["query_index/vectors.npy"] < m * d * 4 + 256
    back = pg.load(tmp_path / "s", device="cpu", mmap=mmap)
    shared = back.index.vectors.data_ptr() == back.doc_embeddings.data_ptr()
    assert shared == (dtype == "float32") and back.index.params == model.index.params
    same_results(model, back, s.Q_test, topk=25)
    if mmap and sys.platform.startswith("linux"):
        assert str((folder / "doc_embeddings.npy").resolve()) in Path("/proc/self/maps").read_text()


def test_bfloat16_index_round_trip(tmp_path, data):
    model = fit(pg.PEFAXS, data, index_params={"dtype": "bfloat16"})
    model.save(tmp_path / "bf")
    back = pg.load(tmp_path / "bf", device="cpu")
    assert back.index.vectors.dtype == torch.bfloat16
    assert torch.equal(back.index.vectors, model.index.vectors)
    same_results(model, back, data[3])


@pytest.mark.parametrize("backend,index_params", [("hnswlib", {"M": 8}),
                                                  ("scann", {"brute_force_below": 0})])
def test_cpu_library_saves_are_movable_folders(tmp_path, data, backend, index_params):
    """hnswlib / ScaNN files name nothing outside their folder: a save still loads after the
    folder moves (ScaNN asset paths are relative)."""
    _backend_or_skip(backend)
    model = fit(pg.PEFAXL, data, backend=backend, index_params=index_params)
    model.save(tmp_path / "a")
    (tmp_path / "a").rename(tmp_path / "b")
    back = pg.load(tmp_path / "b", device="cpu")
    assert back.index.params == model.index.params
    same_results(model, back, data[3], topk=25)
    for f in (tmp_path / "b").rglob("*"):
        assert f.suffix != ".pkl" and (not f.is_file() or
                                       str(tmp_path / "a").encode() not in f.read_bytes())


def test_save_unfitted_or_unsaveable(tmp_path):
    with pytest.raises(InputError, match="not fitted"):
        pg.PEFAXS(device="cpu").save(tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_an_index_of_an_unregistered_class_is_refused_at_save(tmp_path, data):
    class Unregistered(ExactIndex):  # inherits name "exact", which names another class
        pass

    model = pg.ERM(device="cpu").fit(data[0])
    model.index = Unregistered(device="cpu").build(data[0])
    with pytest.raises(InputError, match="Unregistered is not registered as backend 'exact'"):
        model.save(tmp_path / "x")
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------- verified loads

def _edit_manifest(path: Path, **changes):
    """Change manifest fields and re-sign it (to reach the checks behind the checksum)."""
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.update(changes)
    manifest["manifest_sha256"] = storage.manifest_checksum(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_truncated_file(tmp_path, saved_xs):
    path = copy_save(saved_xs[1], tmp_path / "s")
    f = files_of(path) / "doc_sums.npy"
    f.write_bytes(f.read_bytes()[:-7])
    for mmap in (False, True):
        with pytest.raises(FormatError, match="doc_sums.npy is truncated"):
            pg.load(path, device="cpu", mmap=mmap)


def test_flipped_byte(tmp_path, saved_xs):
    path = copy_save(saved_xs[1], tmp_path / "s")
    f = files_of(path) / "index" / "vectors.npy"
    raw = bytearray(f.read_bytes())
    raw[-5] ^= 0x40
    f.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="vectors.npy is corrupted"):
        pg.load(path, device="cpu")
    with pytest.raises(FormatError, match="vectors.npy is corrupted"):
        pg.load(path, device="cpu", mmap=True, verify=True)
    pg.load(path, device="cpu", mmap=True)  # documented: mmap skips hashing unless verify=True


def test_missing_file(tmp_path, saved_xs):
    path = copy_save(saved_xs[1], tmp_path / "s")
    (files_of(path) / "doc_embeddings.npy").unlink()
    with pytest.raises(FormatError, match="doc_embeddings.npy is missing"):
        pg.load(path, device="cpu")


def test_broken_manifest(tmp_path, saved_xs):
    path = copy_save(saved_xs[1], tmp_path / "s")
    text = (path / "manifest.json").read_text()
    (path / "manifest.json").write_text(text[: len(text) // 2])
    with pytest.raises(FormatError, match="manifest.json is not valid JSON"):
        pg.load(path, device="cpu")


def test_foreign_directories(tmp_path, saved_xs):
    with pytest.raises(FormatError, match="not a pefa_gpu save"):
        pg.load(tmp_path, device="cpu")
    (tmp_path / "manifest.json").write_text(json.dumps({"name": "some other tool"}))
    with pytest.raises(FormatError, match="not a pefa_gpu manifest"):
        pg.load(tmp_path, device="cpu")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FormatError, match="not a directory"):
        pg.load(tmp_path / "file", device="cpu")
    with pytest.raises(FileNotFoundError, match="no pefa_gpu save"):
        pg.load(tmp_path / "nowhere", device="cpu")


def test_future_format_version(tmp_path, saved_xs):
    path = copy_save(saved_xs[1], tmp_path / "s")
    _edit_manifest(path, format_version=storage.FORMAT_VERSION + 1)
    with pytest.raises(FormatError, match="format_version 4, newer than this pefa_gpu reads"):
        pg.load(path, device="cpu")


def test_wrong_or_unknown_class(tmp_path, saved_xs):
    with pytest.raises(FormatError, match="holds a PEFAXS, not a PEFAXL"):
        pg.PEFAXL.load(saved_xs[1], device="cpu")
    with pytest.raises(FormatError, match="not a ERM"):
        pg.ERM.load(saved_xs[1], device="cpu")
    path = copy_save(saved_xs[1], tmp_path / "s")
    _edit_manifest(path, **{"class": "os.system"})
    with pytest.raises(FormatError, match="'os.system', which is not a pefa_gpu model"):
        pg.load(path, device="cpu")


@pytest.mark.parametrize("forged", [["PEFAXS"], {"PEFAXS": 1}, None])
def test_a_class_that_is_not_a_string_is_a_format_error(tmp_path, saved_xs, forged):
    path = copy_save(saved_xs[1], tmp_path / "s")
    _edit_manifest(path, **{"class": forged})  # unhashable JSON: no TypeError from a lookup
    with pytest.raises(FormatError, match="which is not a pefa_gpu model"):
        pg.load(path, device="cpu")


def test_bad_params_or_backend_in_manifest(tmp_path, saved_xs):
    path = copy_save(saved_xs[1], tmp_path / "s")
    _edit_manifest(path, params={"lam": 0.3, "augment_docs": True, "temperature": 2})
    with pytest.raises(FormatError, match="temperature"):
        pg.load(path, device="cpu")
    _edit_manifest(path, params={"lam": 0.3}, backend="annoy")
    with pytest.raises(FormatError, match="backend 'annoy', which is not registered"):
        pg.load(path, device="cpu")


def test_manifest_shape_mismatch(tmp_path, saved_xs):
    path = copy_save(saved_xs[1], tmp_path / "s")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["state"]["doc_sums"]["shape"] = [N + 1, D]
    _edit_manifest(path, state=manifest["state"])
    with pytest.raises(FormatError, match="doc_sums.npy holds dtype float32 shape"):
        pg.load(path, device="cpu")
    manifest["state"]["doc_sums"]["shape"] = [N, D]
    manifest["state"]["index"]["ntotal"] = N + 1
    _edit_manifest(path, state=manifest["state"])
    with pytest.raises(FormatError, match="manifest says 61 of dimension 8"):
        pg.load(path, device="cpu")
    manifest["state"]["index"]["ntotal"] = N
    manifest["files"]["../../etc/passwd"] = {"bytes": 1, "sha256": "0"}
    _edit_manifest(path, state=manifest["state"], files=manifest["files"])
    with pytest.raises(FormatError, match="unsafe path"):
        pg.load(path, device="cpu")


# ---------------------------------------------------------------------------- devices and mmap

@pytest.mark.parametrize("device", ["cpu", "cpu:0", torch.device("cpu")], ids=str)
def test_load_onto_cpu_variants(saved_xs, data, device):
    model, path = saved_xs
    back = pg.load(path, device=device)
    assert back.device.type == "cpu" and back.doc_embeddings.device.type == "cpu"
    same_results(model, back, data[3])


def test_bad_device_is_an_input_error(saved_xs):
    with pytest.raises(InputError, match="device='tpu:7' is not a valid torch device"):
        pg.load(saved_xs[1], device="tpu:7")


@pytest.mark.gpu
@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
def test_save_on_cuda_load_on_cpu_and_back(tmp_path, data, cls):
    on_gpu = fit(cls, data, device="cuda")
    on_gpu.save(tmp_path / "g")
    on_cpu = pg.load(tmp_path / "g", device="cpu")
    assert on_cpu.device.type == "cpu"
    s_g, i_g = on_gpu.search(data[3], 10)
    s_c, i_c = on_cpu.search(data[3], 10)
    assert torch.equal(i_g.cpu(), i_c) and torch.allclose(s_g.cpu(), s_c, atol=1e-5)
    on_cpu.save(tmp_path / "c")
    again = pg.load(tmp_path / "c", device="cuda")
    s1, i1 = again.search(data[3], 10)
    s2, i2 = again.search(data[3], 10)
    assert i1.device.type == "cuda"
    # one device: the same bits run after run (XL's votes are summed without atomics);
    # CUDA against CPU: scores within rounding (cuBLAS / Triton sum in their own order), and
    # the same ids (the data has no near ties)
    assert torch.equal(s1, s2) and torch.equal(i1, i2)
    assert torch.equal(i1.cpu(), i_c) and torch.allclose(s1.cpu(), s_c, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
def test_cagra_model_saved_on_cuda_serves_exactly_on_cpu(tmp_path, data, cls):
    _backend_or_skip("cagra", "cuda")
    fit(cls, data, backend="cagra", device="cuda").save(tmp_path / "g")
    on_cpu = pg.load(tmp_path / "g", device="cpu")
    assert on_cpu.index.engine is None and on_cpu.device.type == "cpu"
    same_results(on_cpu, fit(cls, data, device="cpu"), data[3])


@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
def test_mmap_load(tmp_path, data, cls):
    model = fit(cls, data)
    model.save(tmp_path / "m")
    back = pg.load(tmp_path / "m", device="cpu", mmap=True)
    same_results(model, back, data[3])
    if sys.platform.startswith("linux"):
        maps = Path("/proc/self/maps").read_text()
        assert str((files_of(tmp_path / "m") / "doc_embeddings.npy").resolve()) in maps
        if cls is pg.PEFAXS:  # the index over the adapted rows has its own file
            assert str((files_of(tmp_path / "m") / "index" / "vectors.npy").resolve()) in maps
    back.index.add(torch.from_numpy(unit_rows(np.random.default_rng(0), 2, D)))  # still usable
    assert pg.load(tmp_path / "m", device="cpu").index.ntotal == N  # the file is untouched


# ---------------------------------------------------------------------------- params JSON

@pytest.mark.parametrize("params", [pg.ERMParams(), pg.XSParams(lam=0.25, augment_docs=False),
                                    pg.XLParams(lam=0.3, k=8, knn_norm="none", rescore=False),
                                    ExactParams(dtype="bfloat16", memory_budget=2**20)],
                         ids=lambda p: type(p).__name__)
def test_params_json_round_trip(params):
    text = params.to_json()
    assert type(params).from_json(text) == params
    assert type(params).from_dict(json.loads(text)) == params
    with pytest.raises(InputError, match="unknown keys \\['bogus'\\]"):
        type(params).from_dict({**params.to_dict(), "bogus": 1})


@pytest.mark.parametrize("backend", backend_names())
def test_backend_params_json_round_trip(backend):
    try:
        cls = backend_class(backend)
    except ImportError as exc:
        pytest.skip(f"backend {backend!r} cannot be imported here: {exc}")
    params = cls.Params()
    assert cls.Params.from_json(params.to_json()) == params
    with pytest.raises(InputError, match="unknown keys"):
        cls.Params.from_dict({**params.to_dict(), "bogus": 1})


def test_xl_save_whose_query_index_does_not_match_y_is_refused(tmp_path):
    """A save from before the query index held the training queries only (P indexed twice)."""
    rng = np.random.default_rng(3)
    P = rng.standard_normal((30, 8)).astype(np.float32)
    P /= np.linalg.norm(P, axis=1, keepdims=True)
    Q = P[:10] + 0.1
    Q /= np.linalg.norm(Q, axis=1, keepdims=True)
    xl = pg.PEFAXL(device="cpu").fit(P, Q, pg.Relevance.from_pairs(np.arange(10), np.arange(10),
                                                                  shape=(10, 30)))
    xl.query_index.add(P)  # the old layout: [Q; P]
    xl.save(tmp_path / "old")
    with pytest.raises(pg.FormatError, match="refit"):
        pg.load(tmp_path / "old")


def test_a_path_argument_that_is_not_a_path_is_named(data):
    """pg.load(None), save(None), export_hnsw(None) were pathlib's TypeError 'expected str,
    bytes or os.PathLike object, not NoneType', naming no argument."""
    P, Q, y, _ = data
    xl = pg.PEFAXL(device="cpu", k=2).fit(P, Q, y)
    erm = pg.ERM(device="cpu").fit(P)
    for call, name in ((lambda: pg.load(None), "directory"), (lambda: xl.save(3), "directory"),
                       (lambda: xl.export_hnsw(None), "export path"),
                       (lambda: erm.export_hnsw(None), "export path")):
        with pytest.raises(TypeError, match=f"^{name} must be a path"):
            call()
