"""HNSW export: faiss' own builder on the CPU (no exact O(n^2) graph), a model's HNSW graph
written as it is, paths checked before the build, and nothing left behind by a failure."""

from __future__ import annotations

import functools
import json
import os

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import pefa_gpu as pg
from pefa_gpu import export, storage
from pefa_gpu.errors import InputError
from pefa_gpu.params import MAX_HNSW_EF, MAX_HNSW_M
from conftest import unit_rows

faiss = pytest.importorskip("faiss")


def clustered(seed, n=3000, d=32, m=300):
    rng = np.random.default_rng(seed)
    centres = unit_rows(rng, 40, d)
    x = centres[rng.integers(0, 40, n)] + 0.35 * rng.standard_normal((n, d))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    q = x[rng.integers(0, n, m)] + 0.2 * rng.standard_normal((m, d)).astype(np.float32)
    return x, (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)


def recall(found, truth):
    return np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(found, truth)])


def exact_top(x, q, k):
    s = q.astype(np.float64) @ x.astype(np.float64).T
    return np.argsort(-s, axis=1, kind="stable")[:, :k]


def test_cpu_export_uses_faiss_hnsw_builder_not_an_exact_graph(tmp_path, monkeypatch):
    x, q = clustered(1, n=1500)

    def no_exact_graph(*a, **k):
        raise AssertionError("the CPU export built an exact k-NN graph")

    monkeypatch.setattr(export, "knn_graph", no_exact_graph)
    path = export.export_hnsw(x, tmp_path / "x.faiss", M=16, ef_search=64, device="cpu")
    index = faiss.read_index(str(path))
    assert isinstance(index, faiss.IndexHNSWFlat) and index.ntotal == len(x)
    assert index.hnsw.efSearch == 64 and index.metric_type == faiss.METRIC_INNER_PRODUCT
    # faiss' own index with the same settings, as a user would build it
    ref = faiss.IndexHNSWFlat(x.shape[1], 16, faiss.METRIC_INNER_PRODUCT)
    ref.hnsw.efConstruction = 500
    ref.hnsw.efSearch = 64
    ref.add(x)
    truth = exact_top(x, q, 10)
    r_export = recall(index.search(q, 10)[1], truth)
    r_faiss = recall(ref.search(q, 10)[1], truth)
    assert r_export >= r_faiss - 1e-9 and r_export >= 0.95


def test_a_models_hnsw_graph_is_written_as_it_is(tmp_path, monkeypatch):
    x, q = clustered(2, n=1500)
    model = pg.ERM(device="cpu", backend="hnsw").fit(x)

    @functools.wraps(export.build_hnsw)  # its signature: export_hnsw reads the defaults
    def no_build(*a, **k):
        raise AssertionError("rebuilt a graph the model already has")

    monkeypatch.setattr(export, "build_hnsw", no_build)
    path = model.export_hnsw(tmp_path / "erm.faiss", ef_search=128)
    index = faiss.read_index(str(path))
    assert index.hnsw.efSearch == 128 and model.index.faiss_index.hnsw.efSearch == 300
    mine = model.index.faiss_index
    params = faiss.SearchParametersHNSW()
    params.efSearch = 128
    assert np.array_equal(index.search(q, 10)[1], mine.search(q, 10, params=params)[1])
    monkeypatch.undo()
    # another M: a new graph
    other = faiss.read_index(str(model.export_hnsw(tmp_path / "m16.faiss", M=16)))
    assert other.hnsw.nb_neighbors(1) == 16


def test_export_paths_are_checked_before_the_build(tmp_path, monkeypatch):
    x, _ = clustered(3, n=200)
    calls = []
    monkeypatch.setattr(export, "build_hnsw", lambda *a, **k: calls.append(1))
    (tmp_path / "dir").mkdir()
    (tmp_path / "real").write_text("keep")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    for path, match in [(tmp_path / "dir", "is a directory"),
                        (tmp_path / "link", "symbolic link"),
                        (tmp_path / "real" / "x.faiss", "is a file, not a folder")]:
        with pytest.raises(InputError, match=match):
            export.export_hnsw(x, path, device="cpu")
    assert calls == [] and (tmp_path / "real").read_text() == "keep"


@pytest.mark.parametrize("setting", ["M", "ef_search", "ef_construction", "entrypoints"])
def test_export_settings_are_positive_integers(tmp_path, setting):
    x, _ = clustered(4, n=50)
    for bad in (0, -1, 2.5):  # ef_search=-1 was written into the file as it was
        with pytest.raises(InputError, match=f"{setting} must be a positive integer"):
            export.export_hnsw(x, tmp_path / "x.faiss", device="cpu", **{setting: bad})
    assert not (tmp_path / "x.faiss").exists()
    model = pg.ERM(backend="hnsw", device="cpu", index_params={"M": 8}).fit(x)
    with pytest.raises(InputError, match="ef_search must be a positive integer"):
        model.export_hnsw(tmp_path / "x.faiss", M=8, ef_search=-1)  # its own graph, kept


@pytest.mark.parametrize("setting,top", [("M", MAX_HNSW_M), ("ef_search", MAX_HNSW_EF),
                                         ("ef_construction", MAX_HNSW_EF),
                                         ("entrypoints", MAX_HNSW_EF)])
def test_export_sizes_are_bounded_before_faiss_is_reached(tmp_path, monkeypatch, setting, top):
    x, _ = clustered(4, n=50)

    def no_faiss():
        raise AssertionError(f"faiss was reached with {setting} beyond {top}")

    monkeypatch.setattr(export, "import_faiss", no_faiss)  # M=10**9 would allocate ~n * 8 GB
    for bad in (top + 1, 10**9, np.int64(10**9)):
        with pytest.raises(InputError, match=f"{setting} must be at most {top}, got {int(bad)}"):
            export.build_hnsw(x, device="cpu", **{setting: bad})
    monkeypatch.undo()
    model = pg.ERM(backend="hnsw", device="cpu", index_params={"M": 8}).fit(x)
    with pytest.raises(InputError, match=f"ef_search must be at most {MAX_HNSW_EF}"):
        model.export_hnsw(tmp_path / "x.faiss", M=8, ef_search=10**9)  # its own graph, kept
    assert not (tmp_path / "x.faiss").exists()


def test_an_hnsw_degree_of_one_is_refused_before_faiss_is_reached(monkeypatch):
    # M=1: faiss' level multiplier 1 / log M is infinite, a segfault building the graph
    def no_faiss():
        raise AssertionError("faiss was reached with M=1")

    monkeypatch.setattr(export, "import_faiss", no_faiss)
    for method in ("hnsw", "knn"):
        with pytest.raises(InputError, match="M must be at least 2"):
            export.build_hnsw(clustered(4, n=50)[0], M=1, method=method, device="cpu")


def test_knn_graph_degree_is_bounded_by_an_hnsw_level_0():
    x, _ = clustered(4, n=50)
    top = 2 * MAX_HNSW_M
    assert export.knn_graph(x, top, "cpu").shape == (50, top)  # the bound itself is taken
    with pytest.raises(InputError, match=f"degree must be at most {top}, got {top + 1}"):
        export.knn_graph(x, top + 1, "cpu")


@pytest.mark.parametrize("shape", [(0, 4), (5, 0)])
def test_vectors_without_rows_or_width_are_refused_naming_their_shape(tmp_path, shape):
    """(5, 0) vectors were exported by faiss' builder as an index of 0-wide vectors (knn
    refused them); knn_graph of no rows said 'k must be a positive integer, got 0'."""
    for method in ("hnsw", "knn"):
        with pytest.raises(InputError, match=rf"vectors have shape \({shape[0]}, {shape[1]}\)"):
            export.export_hnsw(np.zeros(shape, np.float32), tmp_path / "x.faiss", M=4,
                               method=method, device="cpu")
    assert not (tmp_path / "x.faiss").exists()
    if shape[0] == 0:
        with pytest.raises(InputError, match=r"vectors have shape \(0, 4\): no rows"):
            export.knn_graph(np.zeros(shape, np.float32), 4, "cpu")


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_knn_graph_alone_refuses_nan_or_inf_vectors(value):
    """knn_graph called alone built its graph over NaN / inf rows (only build_hnsw checked
    them first); its exact index refuses them now."""
    x, _ = clustered(5, n=50)
    x[7, 3] = value
    with pytest.raises(InputError, match="vectors hold NaN or inf"):
        export.knn_graph(x, 8, "cpu")


@pytest.mark.parametrize("method", ["hnsw", "knn"])
def test_numpy_integer_settings_export_the_same_file_as_python_ints(tmp_path, method):
    x, q = clustered(6, n=400)
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)  # one thread: faiss' HNSW build is then deterministic
    try:
        plain = export.export_hnsw(x, tmp_path / "a.faiss", M=8, ef_search=40,
                                   ef_construction=64, entrypoints=4, method=method,
                                   device="cpu")
        numpy = export.export_hnsw(x, tmp_path / "b.faiss", M=np.int64(8),
                                   ef_search=np.int32(40), ef_construction=np.uint16(64),
                                   entrypoints=np.int64(4), method=method, device="cpu")
    finally:
        faiss.omp_set_num_threads(threads)
    assert plain.read_bytes() == numpy.read_bytes()
    index = faiss.read_index(str(numpy))
    assert (index.hnsw.nb_neighbors(0), index.hnsw.efSearch) == (16, 40)
    assert np.array_equal(export.knn_graph(x, np.int64(6), "cpu"), export.knn_graph(x, 6, "cpu"))
    # a model's own graph is kept for a numpy M, and its file says the numpy ef_search
    model = pg.ERM(backend="hnsw", device="cpu", index_params={"M": np.int64(8)}).fit(x)
    kept = faiss.read_index(str(model.export_hnsw(tmp_path / "m.faiss", M=np.int64(8),
                                                  ef_search=np.int64(128))))
    assert kept.hnsw.efSearch == 128 and kept.hnsw.nb_neighbors(1) == 8
    params = faiss.SearchParametersHNSW()
    params.efSearch = 128
    truth = exact_top(x, q, 10)
    mine = model.index.faiss_index.search(q, 10, params=params)[1]
    assert np.array_equal(kept.search(q, 10)[1], mine)
    assert recall(kept.search(q, 10)[1], truth) >= 0.9


def test_a_failed_export_leaves_nothing_and_keeps_the_old_file(tmp_path, monkeypatch):
    x, _ = clustered(4, n=300)
    target = tmp_path / "x.faiss"
    export.export_hnsw(x, target, M=8, device="cpu")
    before = target.read_bytes()
    real = faiss.write_index

    def half_written(index, name):
        real(index, name)
        with open(name, "r+b") as f:
            f.truncate(100)
        raise RuntimeError("disk full (simulated)")

    monkeypatch.setattr(faiss, "write_index", half_written)
    with pytest.raises(RuntimeError, match="simulated"):
        export.export_hnsw(x[:100], target, M=8, device="cpu")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.faiss"]
    assert target.read_bytes() == before


def _xl(seed=5):
    x, q = clustered(seed, n=400, m=60)
    y = sp.csr_matrix((np.ones(60, np.float32), (np.arange(60), np.arange(60))), (60, 400))
    return pg.PEFAXL(device="cpu", k=4, search_params=pg.XLSearchParams(candidates=20)).fit(x, q, y)


def test_xl_export_directory_is_new_atomic_and_cleans_killed_exports(tmp_path, monkeypatch):
    model = _xl()
    killed = tmp_path / ".xl.pefa-tmp-0123456789ab"  # what a killed export leaves
    killed.mkdir()
    (killed / ".pefa-export-tmp").write_text("")
    (killed / "passages.faiss").write_bytes(b"partial")
    users = tmp_path / ".xl.pefa-tmp-mine"  # the same pattern without the marker: kept
    users.mkdir()
    monkeypatch.setattr(sp, "save_npz", lambda *a, **k: (_ for _ in ()).throw(
        OSError(28, "No space left on device (simulated)")))
    with pytest.raises(OSError, match="simulated"):
        model.export_hnsw(tmp_path / "xl", M=8)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".xl.pefa-tmp-mine"]
    out = model.export_hnsw(tmp_path / "xl", M=8)
    assert sorted(p.name for p in out.iterdir()) == ["export.json", "passages.faiss",
                                                     "queries.faiss", "relevance.npz"]
    assert json.loads((out / "export.json").read_text())["n_docs"] == 400
    with pytest.raises(InputError, match="exists"):
        model.export_hnsw(tmp_path / "xl", M=8)
    assert users.is_dir() and not killed.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".xl.pefa-tmp-mine", "xl"]


def test_a_killed_export_of_another_name_is_kept_when_the_name_holds_glob_characters(tmp_path):
    other = tmp_path / ".xa.pefa-tmp-0123456789ab"  # "x[ab]" as a pattern matches ".xa..."
    other.mkdir()
    (other / ".pefa-export-tmp").write_text("")
    out = _xl().export_hnsw(tmp_path / "x[ab]", M=8)
    assert out.name == "x[ab]" and other.is_dir()


def test_an_export_folder_with_a_long_name_gets_a_temporary_name_within_the_limit(tmp_path):
    """The temporary folder was '.<name>.pefa-tmp-<12 hex>': past 255 characters (ENAMETOOLONG)
    for a name of 233 or more; now cut as write_output_file's temporary file names are."""
    out = export.export_parts({"export.json": {"n": 1}}, tmp_path / ("x" * 250))
    assert [p.name for p in tmp_path.iterdir()] == ["x" * 250]
    assert json.loads((out / "export.json").read_text()) == {"n": 1}


@pytest.mark.skipif(storage.fcntl is None, reason="no flock: temporaries are always kept")
def test_a_running_exports_temporary_folder_is_kept_a_killed_ones_removed(tmp_path):
    """Any marked temporary folder of the same name was removed, a running export's too (two
    exports to one path: the first failed mid-write); now only one whose marker is unlocked."""
    live, killed = (tmp_path / f".xl.pefa-tmp-{h}" for h in ("0123456789ab", "ba9876543210"))
    for folder in (live, killed):
        folder.mkdir()
        (folder / ".pefa-export-tmp").write_text("")
        (folder / "relevance.npz").write_bytes(b"partial")
    held = storage.lock_folder(live)  # as the running export holds it
    try:
        export.export_parts({"export.json": {"n": 1}}, tmp_path / "xl")
        assert (live / "relevance.npz").is_file() and not killed.exists()
    finally:
        os.close(held)
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "xl"]
    (tmp_path / "xl").rename(tmp_path / "done")  # its exporter gone: removed by the next
    export.export_parts({"export.json": {"n": 1}}, tmp_path / "xl")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done", "xl"]


def test_a_kept_graph_checks_the_settings_it_does_not_use(tmp_path):
    """An hnsw model's own graph skipped build_hnsw, so a misspelt keyword (ef_constrution=)
    or ef_construction=-1 / entrypoints=0 was ignored silently there, while the other
    backends' export raised; now the same TypeError / InputError on both."""
    x, _ = clustered(4, n=50)
    for backend in ("hnsw", "exact"):
        model = pg.ERM(backend=backend, device="cpu", index_params={"M": 8} if backend ==
                       "hnsw" else None).fit(x)
        with pytest.raises(TypeError, match="unexpected keyword argument.*ef_constrution"):
            model.export_hnsw(tmp_path / "x.faiss", M=8, ef_constrution=64)
        for setting in ("ef_construction", "entrypoints"):
            with pytest.raises(InputError, match=f"{setting} must be a positive integer"):
                model.export_hnsw(tmp_path / "x.faiss", M=8, **{setting: -1})
        # compared with the kept graph's before any check: numpy's 'truth value' ValueError
        with pytest.raises(InputError, match="method must be one of"):
            model.export_hnsw(tmp_path / "x.faiss", M=8, method=np.array(["hnsw"]))
        with pytest.raises(InputError, match="M must be"):
            model.export_hnsw(tmp_path / "x.faiss", M=np.array([8, 8]))
        assert not (tmp_path / "x.faiss").exists()


def test_a_scann_model_exports_its_documents_or_says_what_it_lacks(tmp_path):
    """ScaNN keeps no rows to return: ERM's export was a bare NotImplementedError though its
    index rows are P; PEFAXL's (no training-query vectors anywhere) one too."""
    pytest.importorskip("scann")
    rng = np.random.default_rng(7)
    P, Q = unit_rows(rng, 50, 8), unit_rows(rng, 20, 8)
    erm = pg.ERM(device="cpu", backend="scann").fit(P)
    out = erm.export_hnsw(tmp_path / "erm.faiss")
    graph = faiss.read_index(str(out))
    np.testing.assert_array_equal(graph.reconstruct_n(0, 50), P)
    Y = sp.csr_matrix(np.eye(20, 50, dtype=np.float32))
    xl = pg.PEFAXL(device="cpu", backend="scann").fit(P, Q, Y)
    with pytest.raises(InputError, match="PEFAXL.export_hnsw needs the indexed vectors: "
                                         "backend 'scann'"):
        xl.export_hnsw(tmp_path / "xl")
    assert not (tmp_path / "xl").exists()


def test_models_over_a_sharded_index_export_its_rows(tmp_path):
    """index_vectors knew no sharded index: ERM and PEFAXL (its query index) over the sharded
    backend said 'cannot read the vectors back from ShardedIndex', which returns every row."""
    rng = np.random.default_rng(8)
    P, Q = unit_rows(rng, 50, 8), unit_rows(rng, 20, 8)
    shards = {"devices": ["cpu"] * 3}
    erm = pg.ERM(device="cpu", backend="sharded", index_params=shards).fit(P)
    graph = faiss.read_index(str(erm.export_hnsw(tmp_path / "erm.faiss", M=4)))
    np.testing.assert_array_equal(graph.reconstruct_n(0, 50), P)
    Y = sp.csr_matrix(np.eye(20, 50, dtype=np.float32))
    xl = pg.PEFAXL(device="cpu", backend="sharded", index_params=shards).fit(P, Q, Y)
    out = xl.export_hnsw(tmp_path / "xl", M=4)
    queries = faiss.read_index(str(out / "queries.faiss"))
    assert queries.ntotal == xl.query_index.ntotal > 0
    np.testing.assert_array_equal(queries.reconstruct_n(0, queries.ntotal),
                                  xl.query_index.reconstruct(torch.arange(queries.ntotal)))
