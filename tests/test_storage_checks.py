"""storage.py's checks on a small save written directly (no model): unsafe paths a manifest
names, manifests that are not a pefa_gpu save's, and what a new save removes (its own leftovers,
nothing else)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from pefa_gpu import storage
from pefa_gpu.errors import FormatError


def small_save(path: Path) -> Path:
    with storage.writing_save(path) as w:
        storage.save_tensor(w.data / "t", torch.arange(6.0).reshape(2, 3))
        w.commit({"note": "x"})
    return path


def edit_manifest(path: Path, **fields) -> None:
    m = {**json.loads((path / "manifest.json").read_text()), **fields}
    m["manifest_sha256"] = storage.manifest_checksum(m)
    (path / "manifest.json").write_text(json.dumps(m))


UNSAFE = ["", "/etc/passwd", "a//t.npy", "./t.npy", "a/../t.npy", "..", "t.npy/", "a\\t.npy"]


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
