"""A save's files are hashed as save_tensor writes them (not read back at the commit); the
manifest's sizes and sha256 are those of the bytes on disk, whatever the tensor's layout."""

import hashlib

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from pefa_gpu import storage
from pefa_gpu.arrays import as_tensor
from pefa_gpu.storage import open_save, save_csr, save_tensor, writing_save


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tensors(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(37, 5, generator=g)
    return {"c": x, "f": x.t(), "strided": x[::3, 1:4], "half": x.half(), "bf16": x.bfloat16(),
            "bool": x > 0, "long": torch.arange(11), "empty": torch.zeros(0, 4),
            "scalar": torch.tensor(2.5), "row": x[:1], "f_half": x.half().t()}


@pytest.mark.parametrize("seed", [0, 1])
def test_the_manifest_holds_the_files_own_sizes_and_sha256(tmp_path, monkeypatch, seed):
    read = []
    real = storage.sha256_file
    monkeypatch.setattr(storage, "sha256_file", lambda p: read.append(p.name) or real(p))
    with writing_save(tmp_path / "s") as w:
        for name, t in tensors(seed).items():
            save_tensor(w.data / name, t)
        save_csr(w.data / "y", sp.random(9, 7, density=0.3, format="csr", random_state=seed))
        (w.data / "note.txt").write_text("not written by save_tensor")
        manifest = w.commit({})
    monkeypatch.undo()
    assert sorted(read) == ["note.txt", "strided.npy", "y.npz"]  # not from memory as it is
    save = open_save(tmp_path / "s")  # every sha256 checked against the files
    for rel, info in manifest["files"].items():
        path = save.data / rel
        assert info == {"bytes": path.stat().st_size, "sha256": sha(path)}
    for name, t in tensors(seed).items():
        back = storage.load_tensor(save.data / name)
        assert back.dtype == t.dtype and torch.equal(back.reshape(t.shape), t)


def test_a_file_changed_after_its_write_is_hashed_again(tmp_path):
    with writing_save(tmp_path / "s") as w:
        save_tensor(w.data / "a", torch.ones(1000))
        save_tensor(w.data / "b", torch.ones(1000))
        (w.data / "a.npy").write_bytes(b"x" * 10)           # another size
        with open(w.data / "b.npy", "r+b") as fh:           # same size, same inode
            fh.seek(200)
            fh.write(b"\0\0\0\0")
        manifest = w.commit({})
    for rel in ("a.npy", "b.npy"):
        assert manifest["files"][rel]["sha256"] == sha(w.data / rel)


def test_a_nested_save_is_known_to_the_outer_one_and_nothing_outside_a_save_is_kept(
        tmp_path, monkeypatch):
    save_tensor(tmp_path / "loose", torch.ones(3))
    assert storage._PENDING == {}
    read = []
    real = storage.sha256_file
    monkeypatch.setattr(storage, "sha256_file", lambda p: read.append(p.name) or real(p))
    with writing_save(tmp_path / "outer") as w:
        with writing_save(w.data / "inner") as inner:
            save_tensor(inner.data / "x", torch.arange(6.0).reshape(2, 3))
            inner.commit({})
        manifest = w.commit({})
    monkeypatch.undo()
    assert read == ["manifest.json"]  # the inner manifest, written as text
    assert storage._PENDING == {}
    for rel, info in manifest["files"].items():
        assert info["sha256"] == sha(w.data / rel)


def test_a_failed_save_forgets_its_files(tmp_path):
    with pytest.raises(RuntimeError):
        with writing_save(tmp_path / "s") as w:
            save_tensor(w.data / "a", torch.ones(3))
            raise RuntimeError("stop")
    assert storage._PENDING == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.bfloat16])
def test_a_zero_dimensional_tensor_keeps_its_shape(tmp_path, dtype):
    t = torch.tensor(1, dtype=dtype)
    meta = storage.save_tensor(tmp_path / "x", t)
    back = storage.load_tensor(tmp_path / "x", meta=meta)
    assert back.shape == () and back.dtype == dtype and back.item() == t.item()
    assert as_tensor(np.float32(2.5) * np.ones(())).shape == ()
