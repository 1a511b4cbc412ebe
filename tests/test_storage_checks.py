"""storage.py's checks on a small save written directly (no model): unsafe paths a manifest
names, manifests that are not a pefa_gpu save's, what a new save removes (its own leftovers,
nothing else); persist.py's: an index saved by reference, n_docs and dim of a forged save."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import pefa_gpu as pg
from pefa_gpu import storage
from pefa_gpu.errors import FormatError
from pefa_gpu.index import ExactIndex
from pefa_gpu.persist import _vectors_of

from conftest import unit_rows


def small_save(path: Path) -> Path:
    with storage.writing_save(path) as w:
        storage.save_tensor(w.data / "t", torch.arange(6.0).reshape(2, 3))
        w.commit({"note": "x"})
    return path


def edit_manifest(path: Path, **fields) -> None:
    m = {**json.loads((path / "manifest.json").read_text()), **fields}
    m["manifest_sha256"] = storage.manifest_checksum(m)
    (path / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("dtype", [torch.bool, torch.bfloat16, torch.float16, torch.float32,
                                   torch.float64, torch.int8, torch.uint8, torch.int64])
@pytest.mark.parametrize("mmap", [False, True])
def test_every_real_dtype_loads_back_bit_exact(tmp_path, dtype, mmap):
    t = (torch.arange(-6, 6) * 1.37).reshape(3, 4).to(dtype)
    meta = storage.save_tensor(tmp_path / "t", t.T)  # a transposed view too
    back = storage.load_tensor(tmp_path / "t", "cpu", mmap=mmap, meta=meta)
    assert back.dtype == dtype and torch.equal(back, t.T)


@pytest.mark.parametrize("dtype", [[("x", "<u2")], [("bool", "u1"), ("b", "u1")],
                                   [("bfloat16", "<i2")]], ids=str)
def test_a_structured_dtype_pefa_gpu_does_not_write_is_refused(tmp_path, dtype):
    np.save(tmp_path / "t.npy", np.zeros(3, dtype=dtype))
    with pytest.raises(FormatError, match=r"t\.npy holds an unknown structured dtype"):
        storage.load_tensor(tmp_path / "t", "cpu")


UNSAFE = ["", "/etc/passwd", "a//t.npy", "./t.npy", "a/../t.npy", "..", "t.npy/", "a\\t.npy",
          "a\0t.npy", "a\ud800t.npy"]  # NUL, lone surrogate: os' ValueError / UnicodeError


@pytest.mark.parametrize("rel", [*UNSAFE, 3, None, ["t.npy"]], ids=repr)
def test_a_path_outside_or_unclear_is_an_unsafe_path(tmp_path, rel):
    save = storage.open_save(small_save(tmp_path / "s"))
    for get in (save.file, save.folder):
        with pytest.raises(FormatError, match="unsafe path"):
            get(rel)


@pytest.mark.parametrize("rel", UNSAFE, ids=repr)
def test_a_files_table_naming_an_unsafe_path_is_refused(tmp_path, rel):
    path = small_save(tmp_path / "s")
    files = json.loads((path / "manifest.json").read_text())["files"]
    edit_manifest(path, files={**files, rel: {"bytes": 1, "sha256": "0" * 64}})
    with pytest.raises(FormatError, match=f"unsafe path {rel!r}".replace("\\", "\\\\")):
        storage.open_save(path)


@pytest.mark.skipif(os.name != "posix", reason="symbolic links, FIFOs")
@pytest.mark.parametrize("what", ["file", "link", "fifo", "folder"])
def test_a_listed_file_not_regular_or_an_unlisted_entry_is_refused(tmp_path, what):
    def make(p: Path) -> None:
        if what == "file":
            p.write_bytes(b"x")
        elif what == "link":
            p.symlink_to(tmp_path / "outside.npy")
        elif what == "fifo":
            os.mkfifo(p)
        else:
            p.mkdir()
            (p / "t.npy").write_bytes(b"x")
    (tmp_path / "outside.npy").write_bytes(b"x")
    path = small_save(tmp_path / "s")
    data = storage.open_save(path).data
    make(data / "extra.npy")
    with pytest.raises(FormatError, match=r"extra\.npy.*does not list"):
        storage.open_save(path)
    if what != "file":
        (data / "t.npy").unlink()
        make(data / "t.npy")
        with pytest.raises(FormatError,
                           match=r"t\.npy (is not a regular file|leads through a sym)"):
            storage.open_save(path)


@pytest.mark.parametrize("body,match", [
    ([], r"not a pefa_gpu manifest \(format=None\)"),
    ("pefa_gpu", r"not a pefa_gpu manifest \(format=None\)"),
    ({"format": "other"}, r"not a pefa_gpu manifest \(format='other'\)"),
    ({"format": 1}, r"not a pefa_gpu manifest \(format=1\)"),
    ({"format": "pefa_gpu"}, r"no integer format_version \(got None\)"),
    ({"format": "pefa_gpu", "format_version": True}, r"no integer format_version \(got True\)"),
    ({"format": "pefa_gpu", "format_version": 3.0}, r"no integer format_version \(got 3\.0\)"),
    ({"format": "pefa_gpu", "format_version": "3"}, r"no integer format_version \(got '3'\)"),
])
def test_a_manifest_of_another_format_is_refused_naming_what_it_holds(tmp_path, body, match):
    (tmp_path / "manifest.json").write_text(json.dumps(body))
    with pytest.raises(FormatError, match=match):
        storage.open_save(tmp_path)


def test_a_manifest_larger_than_any_pefa_gpu_writes_is_refused_unread(tmp_path, monkeypatch):
    """A forged multi-GB manifest.json is refused from its size, before it is read (here: the
    limit lowered to just under a real one's size, so the file is small)."""
    path = small_save(tmp_path / "s")
    size = (path / "manifest.json").stat().st_size
    monkeypatch.setattr(storage, "MAX_MANIFEST_BYTES", size - 1)
    read = []
    monkeypatch.setattr(Path, "read_text", lambda *a, **k: read.append(a) or "{}")
    with pytest.raises(FormatError, match=rf"is {size} bytes, more than a manifest's {size - 1}"):
        storage.open_save(path)
    assert not read
    monkeypatch.undo()  # the real limit: the same save opens
    assert storage.open_save(path).manifest["note"] == "x"


@pytest.mark.skipif(os.name != "posix", reason="symbolic links")
def test_a_manifest_replaced_after_its_check_is_read_no_further(tmp_path, monkeypatch):
    """read_json checked the size and kind with lstat, then read the whole file: one grown or
    swapped for a link (to /dev/zero: without end) since was read all the same."""
    path = small_save(tmp_path / "s")
    real = (path / "manifest.json").read_text()
    lstat = os.lstat
    as_checked = lstat(path / "manifest.json")  # what lstat saw: a small regular file
    monkeypatch.setattr(storage.os, "lstat", lambda p, *a: as_checked if str(p).endswith(
        "manifest.json") else lstat(p, *a))
    (path / "manifest.json").write_text(real + " " * 20)
    with pytest.raises(FormatError, match=f"grew past the {len(real)} bytes checked"):
        storage.open_save(path)
    (path / "manifest.json").unlink()
    (path / "manifest.json").symlink_to(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_text(real)
    with pytest.raises(FormatError, match="manifest.json is unreadable"):
        storage.open_save(path)


@pytest.mark.skipif(os.name != "posix", reason="symbolic links")
def test_a_new_save_removes_only_the_leftovers_of_earlier_saves(tmp_path):
    path = small_save(tmp_path / "s")
    old = storage.open_save(path).data.name
    stale = path / ("pefa-data-" + "ab" * 8)  # a save cut short: its marker written
    stale.mkdir()
    (stale / ".pefa-data").write_text(stale.name + "\n")
    (stale / "t.npy").write_bytes(b"x")
    (path / ".manifest.json.pefa-tmp-0123").write_text("{")  # a manifest being written
    mine = {"notes.txt": "mine", "pefa-data-notours": None, ".manifest.json.pefa-tmp-link": None}
    (path / "notes.txt").write_text("mine")
    (path / "pefa-data-notours").mkdir()  # not a data folder's name
    (tmp_path / "target.txt").write_text("keep")
    (path / ".manifest.json.pefa-tmp-link").symlink_to(tmp_path / "target.txt")
    small_save(path)
    new = storage.open_save(path).data.name
    assert new != old
    assert sorted(os.listdir(path)) == sorted([*mine, "manifest.json", new])
    assert (path / "notes.txt").read_text() == "mine"
    assert (tmp_path / "target.txt").read_text() == "keep"


# ---------------------------------------------------------------------------- persist.py

def test_check_save_target_refuses_what_writing_save_would(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(pg.InputError, match="afile is a file, not a folder"):
        storage.check_save_target(tmp_path / "afile" / "out")
    with pytest.raises(pg.InputError, match="exists and is not a directory"):
        storage.check_save_target(tmp_path / "afile")
    assert storage.check_save_target(tmp_path / "new" / "s") == tmp_path.resolve() / "new" / "s"
    assert storage.check_save_target(small_save(tmp_path / "s")) == tmp_path.resolve() / "s"


def test_an_index_is_saved_as_a_reference_only_over_its_own_float32_memory():
    m = torch.randn(6, 4)
    index = ExactIndex({"dtype": "float32"}, "cpu").build(m)
    v = index.vectors
    assert _vectors_of(index, v) and _vectors_of(index, v.view(6, 4))
    for other in (v.clone(), v[:5], v.T.contiguous().T, v.reshape(4, 6), v.numpy(), None):
        assert not _vectors_of(index, other)
    half = ExactIndex({"dtype": "float16"}, "cpu").build(m)
    assert not _vectors_of(half, half.vectors)


@pytest.mark.parametrize("value", [True, 60.0, "60", 0, -1, None])
def test_n_docs_or_dim_not_a_positive_integer_is_refused(tmp_path, value):
    pg.ERM(device="cpu").fit(unit_rows(np.random.default_rng(3), 60, 8)).save(tmp_path / "m")
    state = json.loads((tmp_path / "m" / "manifest.json").read_text())["state"]
    for name in ("n_docs", "dim"):
        edit_manifest(tmp_path / "m", state={**state, name: {"kind": "json", "value": value}})
        with pytest.raises(FormatError, match="n_docs and dim must be positive integers"):
            pg.load(tmp_path / "m", device="cpu")


@pytest.mark.parametrize("member, value", [
    ("shape", np.array([5.5, 7.0])), ("shape", np.array(["5", "7"])),
    ("shape", np.array([2**63, 7], dtype=np.uint64)), ("indptr", "float"), ("indices", "float"),
    ("data", "complex"), ("data", "U5"), ("data", "M8[s]")])
def test_a_csr_npz_member_of_a_non_numeric_dtype_is_refused(tmp_path, member, value):
    """Were read converted (floats truncated to indices, strings parsed, complex losing its
    imaginary part) or a raw OverflowError."""
    import io
    import zipfile

    good = sp.random(5, 7, density=0.4, format="csr", random_state=0, dtype=np.float32)
    members = {"indptr": good.indptr, "indices": good.indices, "data": good.data,
               "shape": np.array(good.shape), "format": np.array("csr")}
    members[member] = value if isinstance(value, np.ndarray) else members[member].astype(value)
    path = tmp_path / "y.npz"
    with zipfile.ZipFile(path, "w") as z:
        for name, arr in members.items():
            buf = io.BytesIO()
            np.save(buf, arr)
            z.writestr(f"{name}.npy", buf.getvalue())
    with pytest.raises(FormatError, match="y.npz"):
        storage.load_csr(path)


def test_a_npy_header_of_unbalanced_brackets_is_refused_naming_the_file(tmp_path):
    """numpy retries a header it cannot parse through its tokenizer filter, whose
    tokenize.TokenError ('EOF in multi-line statement') came through read_npy and load_csr."""
    import io
    import zipfile

    buf = io.BytesIO()
    np.save(buf, np.arange(3, dtype=np.int32))
    raw = buf.getvalue().replace(b"(3,)", b"(3,(", 1)
    (tmp_path / "x.npy").write_bytes(raw)
    for mmap in (None, "r"):
        with pytest.raises(FormatError, match="x.npy cannot be read or has a malformed .npy"):
            storage.read_npy(tmp_path / "x.npy", mmap_mode=mmap)
    good = sp.random(3, 3, density=0.5, format="csr", random_state=0)
    storage.save_csr(tmp_path / "y", good)
    with zipfile.ZipFile(tmp_path / "y.npz") as z:
        members = {n: z.read(n) for n in z.namelist()}
    members["indices.npy"] = members["indices.npy"].replace(b"shape': (", b"shape': ((", 1)
    with zipfile.ZipFile(tmp_path / "y.npz", "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    with pytest.raises(FormatError, match="y.npz is truncated or not a valid CSR"):
        storage.load_csr(tmp_path / "y.npz")


def test_save_tensor_writes_no_link_target_and_opens_no_fifo(tmp_path):
    """save_tensor opened its path to write: through a link named as its file (the target
    overwritten), and a FIFO waited for a reader forever."""
    (tmp_path / "target.txt").write_text("precious")
    (tmp_path / "v.npy").symlink_to(tmp_path / "target.txt")
    with pytest.raises(pg.InputError, match="tensor file .*v.npy is a symbolic link"):
        storage.save_tensor(tmp_path / "v", torch.ones(3))
    assert (tmp_path / "target.txt").read_text() == "precious"
    os.mkfifo(tmp_path / "f.npy")
    with pytest.raises(pg.InputError, match="tensor file .*f.npy is not a regular file"):
        storage.save_tensor(tmp_path / "f", torch.ones(3))
    (tmp_path / "y.npz").symlink_to(tmp_path / "target.txt")  # save_csr's np.savez: the same
    with pytest.raises(pg.InputError, match="matrix file .*y.npz is a symbolic link"):
        storage.save_csr(tmp_path / "y", sp.eye(3, format="csr"))
    assert (tmp_path / "target.txt").read_text() == "precious"
