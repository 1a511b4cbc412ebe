"""Forged or hostile saves (checksums recomputed, so only the content checks stand) are refused
with a FormatError naming the file: no crash, no gigabytes read, no raw library error."""

from __future__ import annotations

import io
import json
import re
import struct
import subprocess
import sys
import tracemalloc
import types
import zipfile
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import pefa_gpu as pg
from pefa_gpu import storage
from pefa_gpu.errors import FormatError

from conftest import run_forked, small_problem, unit_rows

N, M, D = 60, 30, 8
MiB = 2**20


@pytest.fixture(scope="module")
def data():
    return small_problem(11, N, M, D, 4)


def manifest(save: Path) -> dict:
    return json.loads((save / "manifest.json").read_text())


def data_file(save: Path, rel: str) -> Path:
    return save / manifest(save)["data"] / rel


def resign(save: Path) -> None:
    """Recompute every size, sha256 and the manifest checksum after editing files (a forger
    can: they detect corruption, not forgery)."""
    m = manifest(save)
    files = storage.describe_files(save / m["data"])
    m["files"] = files
    m["manifest_sha256"] = storage.manifest_checksum(m)
    (save / "manifest.json").write_text(json.dumps(m))


# ---------------------------------------------------------------------------- sizes while streaming

def npy_of_zeros(n: int) -> bytes:
    """The .npy header of n float32 zeros (the body is streamed separately)."""
    fh = io.BytesIO()
    np.lib.format.write_array_header_1_0(fh, {"descr": "<f4", "fortran_order": False,
                                             "shape": (n,)})
    return fh.getvalue()


def bomb_npz(path: Path, csr: sp.csr_matrix, n: int, lie: bool) -> None:
    """A CSR .npz whose ``data`` member inflates to ``n`` float32 zeros (deflated: a few
    hundred KB). ``lie``: its zip directory declares the size of the honest member instead."""
    honest = io.BytesIO()
    np.save(honest, csr.data)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, arr in (("indptr", csr.indptr), ("indices", csr.indices)):
            buf = io.BytesIO()
            np.save(buf, arr)
            z.writestr(f"{name}.npy", buf.getvalue())
        with z.open("data.npy", "w") as fh:
            fh.write(npy_of_zeros(n))
            zeros = bytes(MiB)
            for _ in range(n * 4 // MiB):
                fh.write(zeros)
        buf = io.BytesIO()
        np.save(buf, np.asarray(csr.shape, np.int64))
        z.writestr("shape.npy", buf.getvalue())
    if lie:  # patch the uncompressed size in the local header and the central directory
        raw = bytearray(path.read_bytes())
        with zipfile.ZipFile(path) as z:
            info = z.getinfo("data.npy")
        small = struct.pack("<I", len(honest.getvalue()))
        raw[info.header_offset + 22: info.header_offset + 26] = small
        at = raw.find(b"PK\x01\x02")
        while at >= 0:
            name_len = struct.unpack_from("<H", raw, at + 28)[0]
            if raw[at + 46: at + 46 + name_len] == b"data.npy":
                raw[at + 24: at + 28] = small
            at = raw.find(b"PK\x01\x02", at + 4)
        path.write_bytes(bytes(raw))


@pytest.mark.parametrize("lie", [False, True])
def test_a_relevance_npz_inflating_past_its_declared_size_is_refused_early(tmp_path, data, lie):
    P, Q, y, _ = data
    save = tmp_path / "m"
    pg.PEFAXL(device="cpu", k=2).fit(P, Q, y).save(save)
    entry = manifest(save)["state"]["relevance"]
    path = data_file(save, entry["file"])
    csr = storage.load_csr(path)
    bomb_npz(path, csr, 48 * MiB // 4, lie)
    assert path.stat().st_size < 2 * MiB
    resign(save)
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match=r"relevance\.npz"):
            pg.load(save, device="cpu")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * MiB, peak / MiB  # d6866eb: the 48 MiB member inflated whole, then refused


# ---------------------------------------------------------------------------- malformed manifests

@pytest.fixture
def erm_save(tmp_path, data):
    save = tmp_path / "m"
    pg.ERM(device="cpu").fit(data[0]).save(save)
    return save


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_a_nan_literal_in_the_manifest_is_refused_naming_it(erm_save, literal):
    path = erm_save / "manifest.json"
    path.write_text(path.read_text().replace('"created": ', f'"created": {literal}, "x": ', 1))
    with pytest.raises(FormatError, match=rf"manifest\.json .*{literal.lstrip('-')}"):
        pg.load(erm_save, device="cpu")


def test_a_deeply_nested_manifest_is_refused(erm_save):
    (erm_save / "manifest.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(FormatError, match=r"manifest\.json .*nested too deeply"):
        pg.load(erm_save, device="cpu")


def test_a_big_endian_npy_is_refused_naming_the_file(erm_save):
    m = manifest(erm_save)
    path = data_file(erm_save, m["state"]["doc_embeddings"]["file"])
    arr = np.load(path)
    path.unlink()  # write a new file
    np.save(path, arr.astype(">f4"))
    resign(erm_save)
    with pytest.raises(FormatError, match=r"doc_embeddings\.npy holds >f4 in non-native"):
        pg.load(erm_save, device="cpu")


FORGED_DTYPES = {"bool": lambda a: a > 0, "complex64": lambda a: a.astype(np.complex64),
                 "unicode": lambda a: a.astype(str),
                 "long double": lambda a: a.astype(np.longdouble),
                 "datetime": lambda a: a.astype("datetime64[s]")}


@pytest.mark.parametrize("kind", FORGED_DTYPES)
@pytest.mark.parametrize("mmap", [False, True])
def test_a_npy_of_a_dtype_pefa_gpu_never_writes_is_a_format_error(tmp_path, kind, mmap):
    arr = FORGED_DTYPES[kind](np.arange(-3, 9).reshape(3, 4))
    if arr.dtype == np.float64:
        pytest.skip("long double is float64 on this platform")
    np.save(tmp_path / "t.npy", arr)  # was an InputError (or a TypeError for long double)
    with pytest.raises(FormatError, match=rf"t\.npy holds dtype {re.escape(str(arr.dtype))}, "
                                          r"which pefa_gpu never writes"):
        storage.load_tensor(tmp_path / "t", "cpu", mmap=mmap)


@pytest.mark.parametrize("kind", ["bool", "complex64", "unicode"])
def test_a_save_whose_tensor_has_a_dtype_pefa_gpu_never_writes_is_refused(erm_save, kind):
    entry = manifest(erm_save)["state"]["doc_embeddings"]
    path = data_file(erm_save, entry["file"])
    arr = FORGED_DTYPES[kind](np.load(path))
    path.unlink()
    np.save(path, arr)
    entry.update(dtype=str(arr.dtype))  # the manifest agrees with the forged file
    forge_index_entry(erm_save, lambda state: state.update(doc_embeddings=entry))
    dtype = re.escape(str(arr.dtype))
    with pytest.raises(FormatError, match=rf"doc_embeddings\.npy holds dtype {dtype}"):
        pg.load(erm_save, device="cpu")


@pytest.mark.parametrize("shape", [None, 5, "60x8"])
def test_a_tensor_entry_whose_shape_is_not_a_list_is_refused(erm_save, shape):
    m = manifest(erm_save)
    m["state"]["doc_embeddings"]["shape"] = shape
    (erm_save / "manifest.json").write_text(json.dumps(m))
    resign(erm_save)  # was a TypeError: 'int' object is not iterable
    with pytest.raises(FormatError, match=r"doc_embeddings\.npy holds .* manifest says .*shape"):
        pg.load(erm_save, device="cpu")


def forge_index_entry(save: Path, edit) -> None:
    m = manifest(save)
    edit(m["state"])
    (save / "manifest.json").write_text(json.dumps(m))
    resign(save)


@pytest.mark.parametrize("name", ["doc_embeddings", "index"])
@pytest.mark.parametrize("value", [None, [[0.5] * D] * N, "x"], ids=["null", "list", "str"])
def test_an_array_or_index_forged_as_a_json_value_is_refused(erm_save, name, value):
    forge_index_entry(erm_save, lambda state: state.update({name: {"kind": "json",
                                                                   "value": value}}))
    with pytest.raises(FormatError, match=name):  # was an AttributeError, or null loaded
        pg.load(erm_save, device="cpu")


@pytest.mark.parametrize("cls,name,kind", [
    (pg.PEFAXS, "doc_sums", "csr"), (pg.PEFAXS, "doc_sums", "relevance"),
    (pg.ERM, "index", "tensor"), (pg.PEFAXL, "query_index", "tensor"),
    (pg.PEFAXL, "relevance", "tensor"), (pg.PEFAXL, "relevance", "csr")],
    ids=lambda v: getattr(v, "__name__", v))
def test_a_saved_value_of_the_wrong_kind_but_the_right_shape_is_refused(tmp_path, data, cls,
                                                                         name, kind):
    """These passed the shape check and failed at search time (or, Y as a tensor, at load)."""
    save = tmp_path / "m"
    (cls(device="cpu").fit(data[0]) if cls is pg.ERM else cls(device="cpu").fit(*data[:3])
     ).save(save)
    rows, cols = (M, N) if name == "relevance" else (N, D)
    folder = save / manifest(save)["data"]
    if kind == "tensor":
        entry = {"kind": kind, **storage.save_tensor(folder / "forged", torch.zeros(rows, cols))}
    else:
        entry = {"kind": kind, **storage.save_csr(folder / "forged", sp.random(
            rows, cols, 0.5, "csr", dtype=np.float32, random_state=0))}
    forge_index_entry(save, lambda state: state.update({name: entry}))
    with pytest.raises(FormatError, match=rf"{name} is a \w+, not a"):
        pg.load(save, device="cpu")


@pytest.mark.parametrize("cls,target", [(pg.ERM, "nope"), (pg.ERM, "dim"), (pg.ERM, ["x"]),
                                        (pg.PEFAXL, "relevance"), (pg.PEFAXL, "query_index")],
                         ids=str)
def test_an_index_over_a_missing_or_non_tensor_attribute_is_refused(tmp_path, data, cls,
                                                                    target):
    save = tmp_path / "s"
    (pg.ERM(device="cpu").fit(data[0]) if cls is pg.ERM else
     pg.PEFAXL(device="cpu").fit(*data[:3])).save(save)
    assert manifest(save)["state"]["index"]["vectors"] == "doc_embeddings"
    forge_index_entry(save, lambda state: state["index"].update(vectors=target))
    with pytest.raises(FormatError, match=rf"index 'index' .*{target!r}".replace("[", r"\[")):
        pg.load(save, device="cpu")


@pytest.mark.parametrize("how", ["rows", "float16", "hnsw", "bfloat16 index"])
def test_an_index_over_a_wrong_shaped_or_typed_tensor_is_refused(erm_save, how):
    entry = manifest(erm_save)["state"]["doc_embeddings"]
    path = data_file(erm_save, entry["file"])
    arr = np.load(path)
    if how in ("rows", "float16"):
        arr = arr[:-1] if how == "rows" else arr.astype(np.float16)
        np.save(path, arr)
        entry.update(shape=list(arr.shape), dtype=str(arr.dtype))

    def edit(state):
        state["doc_embeddings"] = entry
        if how == "hnsw":
            state["index"].update(backend="hnsw", params={})
        elif how == "bfloat16 index":
            state["index"]["params"]["dtype"] = "bfloat16"
    forge_index_entry(erm_save, edit)
    with pytest.raises(FormatError, match="index 'index' "):
        pg.load(erm_save, device="cpu")


# ---------------------------------------------------------------------------- forged graphs, lists

LOAD_AND_SEARCH = r"""
import sys
import numpy as np
from pefa_gpu.index import backend_class
from pefa_gpu.errors import FormatError
name, folder, params = sys.argv[1], sys.argv[2], eval(sys.argv[3])
q = np.random.default_rng(0).standard_normal((20, int(sys.argv[4])), dtype=np.float32)
try:
    index = backend_class(name).load(folder, params)
except FormatError as exc:
    print("refused:", exc)
    sys.exit(0)
s, i = index.search(q, 10)
print("searched", int(i.max()), int(i.min()))
"""


def load_and_search(backend: str, folder: Path, params: dict) -> subprocess.CompletedProcess:
    """Load and search in a child process: a forged file may crash a native library."""
    return run_forked(LOAD_AND_SEARCH, backend, folder, repr(params), D)


HNSW_HEADER = struct.Struct("<6QiI3QdQ")  # hnswlib's saveIndex header (hnswalg.h)


def hnswlib_nodes(raw: bytes) -> tuple[tuple, list[tuple[int, int, int]]]:
    """The header and (node, offset of its upper lists, levels) of nodes above level 0."""
    head = HNSW_HEADER.unpack_from(raw)
    count, per_element, max_m = head[2], head[3], head[8]
    pos, upper = HNSW_HEADER.size + count * per_element, []
    for node in range(count):
        nbytes = struct.unpack_from("<I", raw, pos)[0]
        if nbytes:
            upper.append((node, pos + 4, nbytes // (4 + 4 * max_m)))
        pos += 4 + nbytes
    return head, upper


def forge_hnswlib(folder: Path, how: str) -> None:
    path = folder / "index.bin"
    raw = bytearray(path.read_bytes())
    head, upper = hnswlib_nodes(bytes(raw))
    count, per_element, label_offset = head[2], head[3], head[4]
    level0 = HNSW_HEADER.size + 3 * per_element  # node 3's level-0 list
    if how == "level0 id beyond the nodes":
        struct.pack_into("<H", raw, level0, 2)
        struct.pack_into("<I", raw, level0 + 8, 10**6)
    elif how == "level0 count beyond maxM0":
        struct.pack_into("<H", raw, level0, 60000)
    elif how == "upper link to a level-0 node":
        zero = next(n for n in range(count) if n not in {u[0] for u in upper})
        node, at, _ = upper[0]
        struct.pack_into("<HxxI", raw, at, 1, zero)
    elif how == "label beyond the nodes":
        struct.pack_into("<Q", raw, level0 + label_offset, 10**6)
    elif how == "entry point beyond the nodes":
        struct.pack_into("<I", raw, 6 * 8 + 4, count + 5)
    path.write_bytes(bytes(raw))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["level0 id beyond the nodes", "level0 count beyond maxM0",
                                 "upper link to a level-0 node", "label beyond the nodes",
                                 "entry point beyond the nodes"])
def test_a_forged_hnswlib_graph_is_refused_at_load(tmp_path, data, how):
    pytest.importorskip("hnswlib")
    from pefa_gpu.index import make_index

    params = {"M": 4, "ef_construction": 20}
    index = make_index("hnswlib", "cpu", params).build(np.tile(data[0], (10, 1)))
    (tmp_path / "ix").mkdir()
    index.save(tmp_path / "ix")
    assert hnswlib_nodes((tmp_path / "ix" / "index.bin").read_bytes())[1], "no upper levels"
    forge_hnswlib(tmp_path / "ix", how)
    res = load_and_search("hnswlib", tmp_path / "ix", params)
    assert res.stdout.startswith("refused:"), (res.stdout, res.stderr[-500:])
    assert "index.bin" in res.stdout


def test_an_hnswlib_row_forged_as_deleted_is_refused_at_load(tmp_path, data):
    """hnswlib's deleted mark (byte 2 of a level-0 list): searches skipped the row and
    reconstruct raised hnswlib's raw RuntimeError 'Label not found'."""
    def mark_deleted(raw):
        raw[HNSW_HEADER.size + 7 * HNSW_HEADER.unpack_from(raw)[3] + 2] = 1  # node 7

    with pytest.raises(FormatError, match="index.bin: rows are marked deleted"):
        load_forged_hnswlib(tmp_path, data, mark_deleted)


def test_an_hnswlib_save_of_nan_vectors_is_refused_at_load(tmp_path, data):
    """Loaded; a search past the rows (the exact fallback over them) then blamed the caller:
    InputError 'vectors hold NaN or inf'."""
    def nan_row(raw):
        head = HNSW_HEADER.unpack_from(raw)
        struct.pack_into("<f", raw, HNSW_HEADER.size + 7 * head[3] + head[5] + 4, float("nan"))

    with pytest.raises(FormatError, match="index.bin: the stored vectors hold NaN or inf"):
        load_forged_hnswlib(tmp_path, data, nan_row)


def load_forged_hnswlib(tmp_path, data, forge):
    """Load an hnswlib save of 50 rows whose index.bin ``forge`` (bytearray -> None) edited."""
    pytest.importorskip("hnswlib")
    from pefa_gpu.index import backend_class, make_index

    params = {"M": 4, "ef_construction": 20}
    (tmp_path / "ix").mkdir()
    make_index("hnswlib", "cpu", params).build(data[0][:50]).save(tmp_path / "ix")
    path = tmp_path / "ix" / "index.bin"
    raw = bytearray(path.read_bytes())
    forge(raw)
    path.write_bytes(bytes(raw))
    return backend_class("hnswlib").load(tmp_path / "ix", params)


@pytest.mark.parametrize("mult", [float("nan"), 1e300, -1.0])
def test_a_forged_hnswlib_level_multiplier_is_refused_at_load(tmp_path, data, mult):
    """hnswlib draws an added node's level as -log(u) * mult: NaN, huge or negative made the next
    add() a raw RuntimeError ('Not enough memory: addPoint failed to allocate linklist')."""
    pytest.importorskip("hnswlib")
    from pefa_gpu.index import backend_class, make_index

    params = {"M": 4, "ef_construction": 20}
    (tmp_path / "ix").mkdir()
    make_index("hnswlib", "cpu", params).build(data[0][:50]).save(tmp_path / "ix")
    path = tmp_path / "ix" / "index.bin"
    raw = bytearray(path.read_bytes())
    struct.pack_into("<d", raw, HNSW_HEADER.size - 16, mult)  # mult, before ef_construction
    path.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="index.bin: hnswlib's header is inconsistent"):
        backend_class("hnswlib").load(tmp_path / "ix", params)


@pytest.mark.slow
@pytest.mark.parametrize("asset,value", [("datapoint_to_token.npy", 10**6),
                                         ("datapoint_to_token.npy", -1),
                                         ("datapoint_to_token.npy", None),
                                         ("hashed_dataset.npy", 200)])
def test_a_forged_scann_token_or_code_file_is_refused_at_load(tmp_path, asset, value):
    pytest.importorskip("scann")
    from pefa_gpu.index import make_index

    rng = np.random.default_rng(3)
    params = {"brute_force_below": 0, "num_leaves": 6}
    index = make_index("scann", "cpu", params).build(unit_rows(rng, 400, D))
    (tmp_path / "ix").mkdir()
    index.save(tmp_path / "ix")
    path = tmp_path / "ix" / asset
    arr = np.load(path)
    if value is None:
        arr = arr[:-3]  # rows without a leaf: unreachable, silently
    else:
        arr.flat[7] = value
    np.save(path, arr)
    res = load_and_search("scann", tmp_path / "ix", params)
    assert res.stdout.startswith("refused:"), (res.stdout, res.stderr[-500:])
    assert asset in res.stdout


@pytest.mark.parametrize("how", ["nan centre", "short centre", "leaf id", "missing"])
def test_a_forged_scann_tree_is_refused_at_load(tmp_path, how):
    """ScaNN trusts its saved tree: a NaN centre segfaulted the next add()."""
    pytest.importorskip("scann")
    from scann.partitioning import partitioner_pb2

    from pefa_gpu.index import make_index

    params = {"brute_force_below": 0, "num_leaves": 6}
    make_index("scann", "cpu", params).build(unit_rows(np.random.default_rng(8), 400, D)).save(
        tmp_path)
    path = tmp_path / "serialized_partitioner.pb"
    tree = partitioner_pb2.SerializedPartitioner.FromString(path.read_bytes())
    root = tree.kmeans.kmeans_tree.root
    if how == "nan centre":
        root.centers[0].dimension[0] = float("nan")
    elif how == "short centre":
        del root.centers[2].dimension[-1]
    elif how == "leaf id":
        root.children[1].leaf_id = 6
    path.write_bytes(b"" if how == "missing" else tree.SerializeToString())
    add = LOAD_AND_SEARCH.replace("s, i = index.search", "index.add(q)\ns, i = index.search")
    res = run_forked(add, "scann", tmp_path, repr(params), D)
    assert res.stdout.startswith("refused:"), (res.stdout, res.stderr[-500:])
    assert "serialized_partitioner.pb: ScaNN's tree is not 6 finite centres" in res.stdout


@pytest.mark.parametrize("params,value", [({"brute_force_below": 0, "num_leaves": 6}, np.nan),
                                          ({"brute_force_below": 0, "num_leaves": 6}, 3e38),
                                          ({}, np.inf)], ids=["tree-nan", "tree-big", "bf-inf"])
def test_a_scann_save_of_rows_a_build_refuses_is_refused_at_load(tmp_path, params, value):
    """Loaded: a tree then answered only -1 ids to some queries (NaN scores padded away)."""
    pytest.importorskip("scann")
    from pefa_gpu.index import backend_class, make_index

    x = unit_rows(np.random.default_rng(9), 400, D)
    make_index("scann", "cpu", params).build(x).save(tmp_path)
    rows = np.load(tmp_path / "dataset.npy")
    rows[5:40] = value
    np.save(tmp_path / "dataset.npy", rows)
    with pytest.raises(FormatError, match=r"dataset\.npy holds NaN or inf"):
        backend_class("scann").load(tmp_path, params, "cpu")


@pytest.mark.parametrize("leaves", [401, 2**31])
def test_a_scann_save_with_more_leaves_than_rows_is_refused_at_load(tmp_path, leaves):
    """2^31 leaves loaded, then every search was pybind's TypeError (a C int); a tree has at
    most a leaf a row."""
    pytest.importorskip("scann")
    from pefa_gpu.index import backend_class, make_index

    params = {"brute_force_below": 0, "num_leaves": 6}
    x = unit_rows(np.random.default_rng(4), 400, D)
    make_index("scann", "cpu", params).build(x).save(tmp_path)
    meta = json.loads((tmp_path / "scann.json").read_text())
    (tmp_path / "scann.json").write_text(json.dumps({**meta, "num_leaves": leaves}))
    with pytest.raises(FormatError, match=r"scann\.json: num_leaves must be an int in \[0, "
                                          r"ntotal=400\]"):
        backend_class("scann").load(tmp_path, params, "cpu")


@pytest.mark.parametrize("params", [{"brute_force_below": 0, "num_leaves": 6}, {}],
                         ids=["tree", "brute-force"])
def test_a_scann_save_listing_no_vectors_is_refused_at_load(tmp_path, params):
    """A tree's asset list without DATASET_NPY aborted the process in ScaNN ('Cannot enable
    exact reordering when the original dataset is empty'): run in a child process."""
    pytest.importorskip("scann")
    from pefa_gpu.index import make_index

    make_index("scann", "cpu", params).build(unit_rows(np.random.default_rng(5), 400, D)).save(
        tmp_path)
    listing = tmp_path / "scann_assets.pbtxt"
    blocks = re.split(r"(?=assets \{)", listing.read_text())
    listing.write_text("".join(b for b in blocks if "asset_type: DATASET_NPY\n" not in b))
    res = load_and_search("scann", tmp_path, params)
    assert res.stdout.startswith("refused:") and "lists no DATASET_NPY" in res.stdout, (
        res.stdout, res.stderr[-500:])


def test_a_scann_config_that_loads_but_cannot_search_is_refused_at_load(tmp_path):
    """AH blocks short of the dimension: ScaNN loaded it, then every search was a raw
    RuntimeError ('Error during search: SCANN_RET_CHECK_EQ failure')."""
    pytest.importorskip("scann")
    from scann.proto import scann_pb2

    from pefa_gpu.index import make_index

    params = {"brute_force_below": 0, "num_leaves": 6}
    make_index("scann", "cpu", params).build(unit_rows(np.random.default_rng(6), 400, D)).save(
        tmp_path)
    config = scann_pb2.ScannConfig()
    config.ParseFromString((tmp_path / "scann_config.pb").read_bytes())
    config.hash.asymmetric_hash.projection.num_blocks //= 2
    (tmp_path / "scann_config.pb").write_bytes(config.SerializeToString())
    res = load_and_search("scann", tmp_path, params)
    assert res.stdout.startswith("refused:") and "could not be searched by ScaNN" in res.stdout, (
        res.stdout, res.stderr[-500:])


def test_a_forged_ivf_save_returning_ids_beyond_the_documents_is_refused(tmp_path, data):
    faiss = pytest.importorskip("faiss")
    P, Q, y, queries = data
    save = tmp_path / "m"
    pg.PEFAXL(device="cpu", k=2, backend="ivf", index_params={"nlist": 2}).fit(P, Q, y).save(save)
    path = data_file(save, "index/index.faiss")
    index = faiss.read_index(str(path))
    lists = index.invlists
    first = next(i for i in range(index.nlist) if lists.list_size(i))
    faiss.rev_swig_ptr(lists.get_ids(first), lists.list_size(first))[0] = N + 7
    path.unlink()
    faiss.write_index(index, str(path))
    resign(save)
    with pytest.raises(FormatError, match=r"index.*0\.\.59 once"):
        pg.load(save, device="cpu")


def test_a_forged_ivf_save_with_more_centroids_than_lists_is_refused_at_load(tmp_path):
    """faiss reads it; its search then aborted the process (faiss 1.13) or raised a raw
    RuntimeError (1.15)."""
    faiss = pytest.importorskip("faiss")
    rng = np.random.default_rng(5)
    quantizer = faiss.IndexFlatIP(D)
    quantizer.add(unit_rows(rng, 4, D))
    index = faiss.IndexIVFFlat(quantizer, D, 4, faiss.METRIC_INNER_PRODUCT)
    index.is_trained = True
    index.add(unit_rows(rng, 300, D))
    index.quantizer.add(10 * unit_rows(rng, 60, D))  # centroids 4..63 name no list
    (tmp_path / "ix").mkdir()
    faiss.write_index(index, str(tmp_path / "ix" / "index.faiss"))
    res = load_and_search("ivf", tmp_path / "ix", {"nlist": 4})
    assert res.stdout.startswith("refused:"), (res.stdout, res.stderr[-500:])
    assert "has 64 centroids of dimension 8, 4 lists and codes of 32 bytes for nlist=4" \
        in res.stdout


def test_a_forged_ivf_pq_save_with_codes_wider_than_its_lists_is_refused_at_load(tmp_path):
    """faiss reads a product quantizer of 16-byte codes over lists of 4-byte codes (its search
    and reconstruct then decode past each code)."""
    faiss = pytest.importorskip("faiss")
    from pefa_gpu.index import make_index

    params = {"kind": "pq", "nlist": 4, "pq_m": 4}
    (tmp_path / "ix").mkdir()
    make_index("ivf", "cpu", params).build(unit_rows(np.random.default_rng(7), 400, D)).save(
        tmp_path / "ix")
    path = tmp_path / "ix" / "index.faiss"
    index = faiss.read_index(str(path))
    pq = index.pq
    pq.M, pq.nbits, pq.dsub, pq.ksub, pq.code_size = 8, 16, 1, 65536, 16
    faiss.copy_array_to_vector(np.zeros(D * 65536, np.float32), pq.centroids)
    faiss.write_index(index, str(path))
    res = load_and_search("ivf", tmp_path / "ix", params)
    assert res.stdout.startswith("refused:"), (res.stdout, res.stderr[-500:])
    assert "codes of 16 bytes for nlist=4, d=8, code size 4" in res.stdout


FORGED_LIST_LOAD = r"""
import resource, sys
from pefa_gpu.index import backend_class
from pefa_gpu.errors import FormatError
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    backend_class("ivf").load(sys.argv[1], {"nlist": 2})
except FormatError as exc:
    print("refused:", exc)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_a_forged_ivf_list_size_is_refused_before_faiss_allocates_it(tmp_path):
    """faiss allocates every list's claimed size before reading it: 2^26 entries took 2.5 GiB
    and 12 s before its read error (the list sizes it refuses outright start at 2^40 bytes)."""
    faiss = pytest.importorskip("faiss")
    index = faiss.index_factory(D, "IVF2,Flat", faiss.METRIC_INNER_PRODUCT)
    x = unit_rows(np.random.default_rng(6), 300, D)
    index.train(x)
    index.add(x)
    raw = bytearray(faiss.serialize_index(index))
    at = raw.index(b"ilar") + 4  # then nlist, code size, 'full', the sizes' count, the sizes
    assert raw[at + 16:at + 20] == b"full"
    struct.pack_into("<Q", raw, at + 28, 2**26)
    (tmp_path / "index.faiss").write_bytes(bytes(raw))
    res = run_forked(FORGED_LIST_LOAD, tmp_path)
    assert "index.faiss could not be read by faiss" in res.stdout, (res.stdout, res.stderr[-500:])
    assert int(res.stdout.split()[-1]) < 200, res.stdout  # MiB


def test_an_ivf_save_of_faiss_on_disk_lists_naming_another_file_is_refused(tmp_path):
    """faiss opens the file the on-disk lists name (read-write, mapped shared): the load was
    accepted and the next add() wrote the new rows into that file."""
    faiss = pytest.importorskip("faiss")
    from pefa_gpu.index import backend_class

    x = unit_rows(np.random.default_rng(6), 300, D)
    index = faiss.index_factory(D, "IVF2,Flat", faiss.METRIC_INNER_PRODUCT)
    index.train(x)
    lists = faiss.OnDiskInvertedLists(2, 4 * D, str(tmp_path / "other"))
    index.replace_invlists(lists, False)
    index.add(x)
    (tmp_path / "ix").mkdir()
    raw = faiss.serialize_index(index).tobytes() + bytes(20000)  # room for the lists' size
    del index, lists
    (tmp_path / "ix" / "index.faiss").write_bytes(raw)
    before = (tmp_path / "other").read_bytes()
    with pytest.raises(FormatError, match="the saved IVF lists are not held in the index file"):
        backend_class("ivf").load(tmp_path / "ix", {"nlist": 2}).add(x[:5])
    assert (tmp_path / "other").read_bytes() == before


def test_an_ivf_save_without_its_lists_is_refused(tmp_path):
    """faiss reads lists marked 'il00' (not stored) as none: the load raised AttributeError."""
    faiss = pytest.importorskip("faiss")
    from pefa_gpu.index import backend_class

    index = faiss.index_factory(D, "IVF2,Flat", faiss.METRIC_INNER_PRODUCT)
    index.train(unit_rows(np.random.default_rng(6), 300, D))
    raw = faiss.serialize_index(index).tobytes()
    (tmp_path / "index.faiss").write_bytes(raw[:raw.index(b"ilar")] + b"il00")
    with pytest.raises(FormatError, match="the saved IVF lists are not held in the index file"):
        backend_class("ivf").load(tmp_path, {"nlist": 2})


def test_an_ivf_pq_save_with_an_l2_quantizer_is_refused_without_its_distance_table(tmp_path):
    """faiss' read of an IVF-PQ whose quantizer is L2 precomputes nlist * M * 2^nbits floats:
    this 2 MiB file took 2 GiB (faiss' cap) and 2.5 s before the load."""
    faiss = pytest.importorskip("faiss")
    rng = np.random.default_rng(0)
    quantizer = faiss.IndexFlatL2(D)
    quantizer.add(rng.standard_normal((1000, D), dtype=np.float32))
    index = faiss.IndexIVFPQ(quantizer, D, 1000, 8, 16, faiss.METRIC_INNER_PRODUCT)
    faiss.copy_array_to_vector(rng.standard_normal(D << 16, dtype=np.float32), index.pq.centroids)
    index.is_trained = True
    (tmp_path / "ix").mkdir()
    faiss.write_index(index, str(tmp_path / "ix" / "index.faiss"))
    res = run_forked(FORGED_LIST_LOAD.replace('{"nlist": 2}', '{"kind": "pq"}'), tmp_path / "ix")
    assert "(quantizer metric 1, index 0)" in res.stdout, (res.stdout, res.stderr[-500:])
    assert int(res.stdout.split()[-1]) < 200, res.stdout  # MiB


@pytest.mark.parametrize("how", ["a neighbour beyond the rows", "the entry point beyond the rows",
                                 "a list beyond the neighbours"])
def test_a_forged_faiss_hnsw_graph_is_refused_at_load(tmp_path, how):
    """faiss' own check as it reads the graph, which the faiss >= 1.14 floor relies on (1.13
    searched such a graph out of bounds: a segfault); the load names the file."""
    faiss = pytest.importorskip("faiss", minversion="1.14")
    index = faiss.IndexHNSWFlat(D, 4, faiss.METRIC_INNER_PRODUCT)
    index.add(unit_rows(np.random.default_rng(6), 300, D))
    h = index.hnsw
    links = faiss.rev_swig_ptr(h.neighbors.data(), h.neighbors.size())  # a view: edits stick
    if how == "a neighbour beyond the rows":
        links[5] = 10**6
    elif how == "the entry point beyond the rows":
        h.entry_point = 10**6
    else:
        faiss.rev_swig_ptr(h.offsets.data(), h.offsets.size())[-1] = 10**9
    (tmp_path / "ix").mkdir()
    faiss.write_index(index, str(tmp_path / "ix" / "index.faiss"))
    res = load_and_search("hnsw", tmp_path / "ix", {"M": 4})
    assert res.stdout.startswith("refused:"), (res.stdout, res.stderr[-500:])
    assert "index.faiss could not be read by faiss" in res.stdout


@pytest.mark.parametrize("probas", [[], [1e-12] * 60])
def test_a_forged_faiss_hnsw_level_draw_is_refused_at_load(tmp_path, probas):
    """add() draws a node's level from the saved assign_probas, which faiss does not check:
    none segfaulted, 60 levels of 1e-12 were std::bad_alloc (a MemoryError)."""
    faiss = pytest.importorskip("faiss", minversion="1.14")
    index = faiss.IndexHNSWFlat(D, 4, faiss.METRIC_INNER_PRODUCT)
    index.add(unit_rows(np.random.default_rng(6), 300, D))
    faiss.copy_array_to_vector(np.array(probas, np.float64), index.hnsw.assign_probas)
    (tmp_path / "ix").mkdir()
    faiss.write_index(index, str(tmp_path / "ix" / "index.faiss"))
    res = load_and_search("hnsw", tmp_path / "ix", {"M": 4})
    assert res.stdout.startswith("refused:"), (res.stdout, res.stderr[-500:])
    assert "level probabilities or links per level are not faiss' for M=4" in res.stdout


def test_a_faiss_hnsw_save_of_nan_vectors_is_refused_at_load(tmp_path):
    """Loaded; searches then dropped the NaN rows without a word."""
    faiss = pytest.importorskip("faiss", minversion="1.14")
    from pefa_gpu.index import backend_class

    index = faiss.IndexHNSWFlat(D, 4, faiss.METRIC_INNER_PRODUCT)
    index.add(unit_rows(np.random.default_rng(6), 300, D))
    flat = faiss.downcast_index(index.storage)
    faiss.rev_swig_ptr(flat.codes.data(), flat.codes.size()).view(np.float32)[7] = np.nan
    faiss.write_index(index, str(tmp_path / "index.faiss"))
    with pytest.raises(FormatError, match="the saved vectors hold NaN or inf"):
        backend_class("hnsw").load(tmp_path, {"M": 4})


@pytest.mark.parametrize("where", ["centroid", "row", "pq codebook"])
def test_an_ivf_save_of_nan_centroids_or_rows_is_refused_at_load(tmp_path, where):
    """Loaded; searches then dropped the NaN rows (or a NaN centroid's list) without a word;
    NaN PQ codebooks: rows dropped, or no results at all (ids -1), reconstruct gave NaN."""
    faiss = pytest.importorskip("faiss", minversion="1.14")
    from pefa_gpu.index import backend_class

    spec = "IVF2,PQ4x4" if where == "pq codebook" else "IVF2,Flat"
    index = faiss.index_factory(D, spec, faiss.METRIC_INNER_PRODUCT)
    x = unit_rows(np.random.default_rng(6), 300, D)
    index.train(x)
    index.add(x)
    if where == "centroid":
        flat = faiss.downcast_index(index.quantizer)
        codes, size = flat.codes.data(), flat.codes.size()
    elif where == "row":
        codes, size = index.invlists.get_codes(1), index.invlists.list_size(1) * 4 * D
    else:
        codes, size = index.pq.centroids.data(), index.pq.centroids.size()
    faiss.rev_swig_ptr(codes, size).view(np.float32)[3] = np.nan
    faiss.write_index(index, str(tmp_path / "index.faiss"))
    params = {"nlist": 2, "kind": "pq" if where == "pq codebook" else "flat"}
    with pytest.raises(FormatError, match="the saved centroids or vectors hold NaN or inf"):
        backend_class("ivf").load(tmp_path, params)


def test_a_faiss_older_than_1_14_is_refused_naming_its_version(monkeypatch, caplog):
    """It would search a forged saved graph out of bounds (tests above); exact search on the
    CPU then runs without it, saying so."""
    from pefa_gpu.errors import MissingDependencyError
    from pefa_gpu.index._faiss import import_faiss, optional_faiss

    monkeypatch.setitem(sys.modules, "faiss", types.SimpleNamespace(__version__="1.13.2"))
    with pytest.raises(MissingDependencyError, match=r"faiss 1\.13\.2 is too old: .*>= 1\.14"):
        import_faiss()
    optional_faiss.cache_clear()
    try:
        assert optional_faiss() is None
        assert "faiss 1.13.2 is too old" in caplog.text and "carrying on without it" in caplog.text
    finally:
        optional_faiss.cache_clear()
    monkeypatch.setitem(sys.modules, "faiss", types.SimpleNamespace(__version__="1.14.3"))
    assert import_faiss().__version__ == "1.14.3"


def test_ids_beyond_the_index_from_any_backend_search_are_a_clear_error(data, monkeypatch):
    P, Q, y, queries = data
    xl = pg.PEFAXL(device="cpu", k=2).fit(P, Q, y)
    real = xl.index.search

    def forged(q, k, params=None):
        s, i = real(q, k, params)
        i = i.clone()
        i[0, 0] = xl.index.ntotal + 3
        return s, i
    monkeypatch.setattr(xl.index, "search", forged)
    with pytest.raises(FormatError, match=r"returned ids outside \[0, "):
        xl.search(queries, 5)
    xl = pg.PEFAXL(device="cpu", k=2, rescore=False, augment_docs=False).fit(P, Q, y)
    real = xl.index.search  # score searches the passages only for C (without rescore)
    monkeypatch.setattr(xl.index, "search", forged)
    with pytest.raises(FormatError, match=r"returned ids outside \[0, "):
        xl.score(queries, np.zeros((len(queries), 2), np.int64))


@pytest.mark.parametrize("variant,gamma", [("N", 5.0), ("M", 1e39), ("N", None), ("M", -1.0)])
def test_a_nudge_fitted_gamma_outside_its_variants_range_is_refused(tmp_path, variant, gamma):
    """A forged fitted_gamma of 5 for NUDGE-N loaded and add_documents then raised a bare 'math
    domain error'; 1e39 for NUDGE-M loaded and gave NaN scores for the added documents."""
    P = np.eye(4, dtype=np.float32)
    model = pg.NUDGE(variant=variant, device="cpu").fit(P, P, sp.csr_matrix(np.eye(4)))
    model.save(tmp_path / "s")
    m = manifest(tmp_path / "s")
    m["state"]["fitted_gamma"]["value"] = gamma
    m["manifest_sha256"] = storage.manifest_checksum(m)
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match="fitted_gamma must be a finite number in NUDGE-"):
        pg.load(tmp_path / "s")


@pytest.mark.parametrize("rel", ["query_index/vectors.npy", "doc_embeddings.npy"])
def test_a_save_whose_vectors_hold_nan_is_refused_at_load(tmp_path, data, rel):
    """An exact index's rows are checked finite at build; a forged save's vectors.npy was loaded
    as is and every search of a NaN row's scores was NaN."""
    save = tmp_path / "xl"
    pg.PEFAXL(device="cpu", k=2).fit(*data[:3]).save(save)
    path = data_file(save, rel)
    arr = np.load(path)
    arr[3, 1] = np.nan
    np.save(path, arr)
    resign(save)
    with pytest.raises(FormatError, match=rel.split("/")[-1].split(".")[0]):
        pg.load(save, device="cpu")


def test_an_index_count_forged_as_a_string_is_named_as_the_manifest_holds_it(erm_save):
    """'holds 60 vectors of dimension 8; the manifest says 60 of dimension 8' for ntotal "60":
    the two read the same; now the manifest's value is quoted."""
    forge_index_entry(erm_save, lambda state: state["index"].update(ntotal=str(N)))
    with pytest.raises(FormatError, match=f"the manifest says '{N}' of dimension {D}"):
        pg.load(erm_save, device="cpu")


FORGED_VECTOR_LOAD = FORGED_LIST_LOAD.replace(
    'backend_class("ivf").load(sys.argv[1], {"nlist": 2})',
    'backend_class("hnsw").load(sys.argv[1])')


def test_a_forged_faiss_vector_size_is_refused_before_faiss_allocates_it(tmp_path):
    """faiss allocates the size a file claims for a vector before reading it: an HNSW save whose
    stored rows claim 2 GiB took 2 GiB and 5 s before faiss' read error."""
    faiss = pytest.importorskip("faiss")
    index = faiss.IndexHNSWFlat(D, 16, faiss.METRIC_INNER_PRODUCT)
    index.add(unit_rows(np.random.default_rng(7), 300, D))
    raw, rows = bytearray(faiss.serialize_index(index)), 300 * D * 4
    at = len(raw) - rows - 8  # the rows come last, after their size in floats
    assert struct.unpack_from("<Q", raw, at) == (300 * D,)
    struct.pack_into("<Q", raw, at, 2**29)
    (tmp_path / "index.faiss").write_bytes(bytes(raw))
    res = run_forked(FORGED_VECTOR_LOAD, tmp_path)
    assert "index.faiss could not be read by faiss" in res.stdout, (res.stdout, res.stderr[-500:])
    assert int(res.stdout.split()[-1]) < 200, res.stdout  # MiB
