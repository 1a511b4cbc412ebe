"""Saves never lose what a user put next to them, never follow what a folder says outside
itself, and always leave a complete save (old or new), also when killed mid-save."""

from __future__ import annotations

import json
import os
import shutil
import signal
import textwrap
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

import pefa_gpu as pg
from pefa_gpu import storage
from pefa_gpu.errors import FormatError, InputError
from pefa_gpu.index import base as index_base

from conftest import make_model, run_forked, small_problem

N, M, D = 50, 30, 8


@pytest.fixture(scope="module")
def data():
    return small_problem(21, N, M, D, 5)


def fit(cls, data, **params):
    P, Q, y, _ = data
    if cls is pg.ERM:
        return pg.ERM(device="cpu").fit(P)
    return make_model(cls, device="cpu", **params).fit(P, Q, y)


def same(a, b, queries):
    sa, ia = a.search(queries, 10)
    sb, ib = b.search(queries, 10)
    assert np.array_equal(ia.numpy(), ib.numpy()) and np.array_equal(sa.numpy(), sb.numpy())


def data_folder(save: Path) -> Path:
    """Where a save's files are."""
    return save / json.loads((save / "manifest.json").read_text())["data"]


def edit_manifest(save: Path, sign: bool = True, edit=None, **changes) -> None:
    """Change manifest fields; ``sign`` recomputes the checksum (to reach the checks behind it)."""
    path = save / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.update(changes)
    if edit is not None:
        edit(manifest)
    if sign and "manifest_sha256" in manifest:
        manifest["manifest_sha256"] = storage.manifest_checksum(manifest)
    path.write_text(json.dumps(manifest))


def tree(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


# ---------------------------------------------------------------------------- item 2: nothing lost

def test_saving_again_keeps_the_users_files(tmp_path, data):
    fit(pg.ERM, data).save(tmp_path / "m")
    (tmp_path / "m" / "notes.txt").write_text("mine")
    (tmp_path / "m" / "plots").mkdir()
    (tmp_path / "m" / "plots" / "a.png").write_bytes(b"png")
    new = fit(pg.PEFAXS, data, lam=0.3)
    new.save(tmp_path / "m")
    assert (tmp_path / "m" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "m" / "plots" / "a.png").read_bytes() == b"png"
    back = pg.load(tmp_path / "m", device="cpu")
    assert type(back) is pg.PEFAXS and back.params.lam == 0.3
    same(new, back, data[3])
    # one data folder: the old one was removed, nothing else was
    folders = [p.name for p in (tmp_path / "m").iterdir() if p.name.startswith("pefa-data-")]
    assert folders == [data_folder(tmp_path / "m").name]


def test_a_pefa_looking_manifest_does_not_make_a_folder_replaceable(tmp_path, data):
    target = tmp_path / "site"
    target.mkdir()
    (target / "manifest.json").write_text(json.dumps(
        {"format": "pefa_gpu", "format_version": 1, "files": {}}))
    (target / "index.html").write_text("precious")
    with pytest.raises(InputError, match="format_version 1"):
        fit(pg.ERM, data).save(target)
    assert tree(target) == ["index.html", "manifest.json"]
    # a format-2 manifest whose checksum does not match is not ours either
    (target / "manifest.json").write_text(json.dumps(
        {"format": "pefa_gpu", "format_version": 2, "files": {}, "data": "pefa-data-" + "0" * 16,
         "manifest_sha256": "0" * 64}))
    with pytest.raises(InputError, match="not an intact"):
        fit(pg.ERM, data).save(target)
    assert (target / "index.html").read_text() == "precious"


def test_non_empty_folders_and_files_are_refused(tmp_path, data):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("precious")
    with pytest.raises(InputError, match="not a pefa_gpu save"):
        fit(pg.ERM, data).save(tmp_path / "mine")
    assert tree(tmp_path / "mine") == ["thesis.tex"]
    (tmp_path / "afile").write_text("x")
    with pytest.raises(InputError, match="not a directory"):
        fit(pg.ERM, data).save(tmp_path / "afile")
    assert (tmp_path / "afile").read_text() == "x"


def test_a_save_under_a_file_empty_or_nul_path_is_an_input_error(tmp_path, data, monkeypatch):
    # under a file: mkdir's NotADirectoryError; '': written into the current folder (empty
    # here); a NUL: os' ValueError 'embedded null byte', naming nothing
    (tmp_path / "afile").write_text("x")
    (tmp_path / "e").mkdir()
    monkeypatch.chdir(tmp_path / "e")
    model = fit(pg.ERM, data)
    for target, match in ((tmp_path / "afile" / "sub", "afile is a file, not a folder"),
                          ("", "directory is ''"), ("a\0b", "directory holds a NUL character"),
                          ("a\ud800", "directory .* cannot be a file name here")):
        with pytest.raises(InputError, match=match):
            model.save(target)
    assert tree(tmp_path) == ["afile", "e"]
    with pytest.raises(InputError, match="directory holds a NUL character"):
        pg.load("a\0b")
    with pytest.raises(InputError, match="cannot be a file name here"):
        pg.load("a\ud800")


def test_a_users_backup_named_folder_is_never_deleted(tmp_path, data):
    backup = tmp_path / "m.pefa-backup"
    backup.mkdir()
    (backup / "diary.txt").write_text("precious")
    fit(pg.ERM, data).save(tmp_path / "m")
    fit(pg.PEFAXS, data).save(tmp_path / "m")
    assert (backup / "diary.txt").read_text() == "precious"


def test_new_save_gets_umask_permissions(tmp_path, data):
    old = os.umask(0o022)
    try:
        fit(pg.ERM, data).save(tmp_path / "m")
    finally:
        os.umask(old)
    if os.name == "posix":
        assert data_folder(tmp_path / "m").stat().st_mode & 0o777 == 0o755
        assert (tmp_path / "m" / "manifest.json").stat().st_mode & 0o777 == 0o644


# ---------------------------------------------------------------------------- item 4: links

def test_saving_to_a_symlinked_directory_writes_through_it(tmp_path, data):
    real = tmp_path / "disk" / "models"
    real.mkdir(parents=True)
    link = tmp_path / "models"
    link.symlink_to(real, target_is_directory=True)
    first = fit(pg.ERM, data)
    first.save(link)
    second = fit(pg.PEFAXS, data, lam=0.2)
    second.save(link)  # a later save to the same path keeps working
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert (real / "manifest.json").is_file()
    same(second, pg.load(link, device="cpu"), data[3])
    same(second, pg.load(real, device="cpu"), data[3])


def test_a_dangling_symlink_target_is_a_clear_error(tmp_path, data):
    link = tmp_path / "gone"
    link.symlink_to(tmp_path / "nowhere")
    with pytest.raises(InputError, match="symbolic link to .*nowhere.*does not exist"):
        fit(pg.ERM, data).save(link)
    assert link.is_symlink() and not (tmp_path / "nowhere").exists()


# ---------------------------------------------------------------------------- injected faults

def _fail_on_call(n):
    calls = {"n": 0}

    def hook(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise OSError(28, "No space left on device (simulated)")
    return hook


@pytest.mark.parametrize("where", ["save_tensor", "describe_files", "fsync_tree", "replace"])
def test_a_failure_anywhere_keeps_the_old_save_and_leaves_nothing(tmp_path, data, monkeypatch,
                                                                   where):
    old = fit(pg.PEFAXL, data, lam=0.2, k=4, candidates=20)
    old.save(tmp_path / "m")
    (tmp_path / "m" / "mine.txt").write_text("x")
    before = tree(tmp_path)
    hook = _fail_on_call(2 if where == "save_tensor" else 1)
    if where == "save_tensor":
        real = storage.save_tensor

        def failing(path, tensor):
            hook()
            return real(path, tensor)
        monkeypatch.setattr(storage, "save_tensor", failing)
        monkeypatch.setattr(index_base, "save_tensor", failing)
    elif where == "replace":
        real_replace = os.replace

        def replace(src, dst):
            if str(dst).endswith("manifest.json"):
                hook()
            return real_replace(src, dst)
        monkeypatch.setattr(storage.os, "replace", replace)
    else:
        real_fn = getattr(storage, where)

        def failing(*args):
            hook()
            return real_fn(*args)
        monkeypatch.setattr(storage, where, failing)
    with pytest.raises(OSError, match="No space left.*nothing was replaced"):
        fit(pg.PEFAXL, data, lam=0.9, k=4, candidates=20).save(tmp_path / "m")
    monkeypatch.undo()
    assert tree(tmp_path) == before  # no temporary folder or file left, the user's file kept
    back = pg.load(tmp_path / "m", device="cpu")
    assert back.params.lam == 0.2
    same(old, back, data[3])


def test_a_loaded_mapped_model_can_be_saved_over_its_own_files(tmp_path, data):
    model = fit(pg.PEFAXL, data, k=4, candidates=20)
    model.save(tmp_path / "a")
    pg.load(tmp_path / "a", device="cpu", mmap=True).save(tmp_path / "a")
    same(model, pg.load(tmp_path / "a", device="cpu"), data[3])


KILL_CHILD = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    import numpy as np, scipy.sparse as sp
    import pefa_gpu as pg
    from pefa_gpu import storage
    from pefa_gpu.index import base

    target, point, lam = sys.argv[1], sys.argv[2], float(sys.argv[3])
    rng = np.random.default_rng(5)
    P = rng.standard_normal((400, 16)).astype(np.float32)
    P /= np.linalg.norm(P, axis=1, keepdims=True)
    Q = P[:100] + 0.01
    Q /= np.linalg.norm(Q, axis=1, keepdims=True)
    y = sp.csr_matrix((np.ones(100, np.float32), (np.arange(100), np.arange(100))), (100, 400))
    model = pg.PEFAXL(lam=lam, k=4, search_params=pg.XLSearchParams(candidates=20),
                      device="cpu").fit(P, Q, y)

    def die(*a, **k):
        os.kill(os.getpid(), signal.SIGKILL)

    def wrap(obj, name, before=True, nth=1):
        real, calls = getattr(obj, name), [0]
        def hooked(*a, **k):
            calls[0] += 1
            if before and calls[0] == nth:
                die()
            out = real(*a, **k)
            if not before and calls[0] == nth:
                die()
            return out
        setattr(obj, name, hooked)

    if point == "tensor":
        wrap(storage, "save_tensor", nth=2); wrap(base, "save_tensor")  # the query index
    elif point == "fsync":
        wrap(storage, "fsync_tree")
    elif point == "manifest_tmp":
        wrap(storage.os, "replace")
    elif point == "after_commit":  # _remove_stale runs before the data (1) and after commit (2)
        wrap(storage, "_remove_stale", nth=2)
    elif point == "cleanup":  # half-way through deleting the previous data folder
        real_stale, real_rmtree, calls = storage._remove_stale, storage.shutil.rmtree, [0]

        def stale(*a, **k):
            calls[0] += 1
            return real_stale(*a, **k)

        def rmtree(path, *a, **k):
            if calls[0] == 2:
                next(iter(sorted(Path(path).rglob("*.npy")))).unlink()
                die()
            return real_rmtree(path, *a, **k)
        storage._remove_stale, storage.shutil.rmtree = stale, rmtree
    model.save(target)
    print("saved")
""")


@pytest.mark.slow
@pytest.mark.skipif(os.name != "posix", reason="SIGKILL")
def test_killed_mid_save_leaves_a_complete_save_and_the_next_save_cleans_up(tmp_path):
    """SIGKILL at each step of a replacing save: the folder always loads (old or new), and the
    next save leaves nothing of the killed one behind."""
    target = tmp_path / "m"

    def child(point, lam, returncode=0):
        return run_forked(KILL_CHILD, target, point, lam, returncode=returncode)

    child("none", 0.2)
    expect_new = {"tensor": False, "fsync": False, "manifest_tmp": False,
                  "after_commit": True, "cleanup": True}
    lam = 0.2
    for i, (point, new) in enumerate(expect_new.items()):
        new_lam = round(0.3 + 0.1 * i, 1)
        child(point, new_lam, -signal.SIGKILL)
        back = pg.load(target, device="cpu")  # verified: every file, the manifest checksum
        lam = new_lam if new else lam
        assert back.params.lam == lam, point
    child("none", 0.9)
    assert pg.load(target, device="cpu").params.lam == 0.9
    # only the save's own entries remain, next to it nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    assert sorted(p.name for p in target.iterdir()) == ["manifest.json",
                                                        data_folder(target).name]


def test_leftovers_are_removed_only_when_name_and_marker_prove_them_ours(tmp_path, data):
    fit(pg.ERM, data).save(tmp_path / "m")
    current = data_folder(tmp_path / "m")
    crashed = tmp_path / "m" / ("pefa-data-" + "a" * 16)  # what a killed save leaves
    shutil.copytree(current, crashed)
    (crashed / ".pefa-data").write_text(crashed.name + "\n")
    lookalike = tmp_path / "m" / ("pefa-data-" + "b" * 16)  # the user's, no marker
    lookalike.mkdir()
    (lookalike / "keep.txt").write_text("x")
    forged = tmp_path / "m" / ("pefa-data-" + "c" * 16)  # marker names another folder
    forged.mkdir()
    (forged / ".pefa-data").write_text("pefa-data-" + "d" * 16)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / ".pefa-data").write_text("pefa-data-" + "e" * 16)
    (tmp_path / "m" / ("pefa-data-" + "e" * 16)).symlink_to(outside)  # a link is never ours
    fit(pg.PEFAXS, data).save(tmp_path / "m")
    assert not crashed.exists() and not current.exists()
    assert (lookalike / "keep.txt").exists() and forged.exists() and outside.exists()


# ---------------------------------------------------------------------------- item 5: integrity

@pytest.fixture
def xl_save(tmp_path, data):
    model = fit(pg.PEFAXL, data, lam=0.4, k=4, candidates=20)
    model.save(tmp_path / "xl")
    return model, tmp_path / "xl"


def test_an_edited_manifest_is_refused(xl_save):
    _, path = xl_save
    edit_manifest(path, sign=False, edit=lambda m: m["params"].update(lam=0.9))
    with pytest.raises(FormatError, match="changed after it was written"):
        pg.load(path, device="cpu")


def test_an_xl_save_relabelled_as_erm_is_refused(xl_save):
    _, path = xl_save
    edit_manifest(path, **{"class": "ERM"},
                  edit=lambda m: m.__setitem__("params", {}))
    with pytest.raises(FormatError, match="query_index.*relevance.*does not save"):
        pg.load(path, device="cpu")


def test_a_file_missing_from_the_files_table_is_refused(xl_save):
    _, path = xl_save
    edit_manifest(path, edit=lambda m: m["files"].pop("doc_embeddings.npy"))
    with pytest.raises(FormatError, match="doc_embeddings.npy.*does not list"):
        pg.load(path, device="cpu")
    edit_manifest(path, edit=lambda m: m["files"].pop("query_index/vectors.npy"))
    with pytest.raises(FormatError, match="does not list"):
        pg.load(path, device="cpu", mmap=True)


def test_an_attribute_naming_an_unlisted_file_is_refused(xl_save):
    _, path = xl_save
    for name in ("absent.npy", "query_index"):  # not a file of the table (absent, a folder)
        edit_manifest(path, edit=lambda m: m["state"]["doc_embeddings"].update(file=name))
        with pytest.raises(FormatError, match=f"{name}"):
            pg.load(path, device="cpu")


def test_an_unlisted_file_in_the_data_folder_is_refused(xl_save):
    _, path = xl_save
    (data_folder(path) / "query_index" / "extra.npy").write_bytes(b"x")
    with pytest.raises(FormatError, match="extra.npy.*does not list"):
        pg.load(path, device="cpu")


@pytest.mark.parametrize("field,value", [("n_docs", N + 1), ("n_docs", N - 1), ("dim", D + 1)])
def test_shapes_are_cross_checked_at_load(xl_save, field, value):
    _, path = xl_save
    edit_manifest(path, edit=lambda m: m["state"][field].update(value=value))
    with pytest.raises(FormatError, match="has shape"):
        pg.load(path, device="cpu")


def test_relevance_columns_must_match_the_documents(tmp_path, data):
    model = fit(pg.PEFAXL, data, k=4, candidates=20)
    model.relevance = pg.Relevance(sp.hstack([model.relevance.csr,
                                              sp.csr_matrix((model.relevance.shape[0], 1))]))
    model.save(tmp_path / "bad")
    with pytest.raises(FormatError, match="relevance has shape"):
        pg.load(tmp_path / "bad", device="cpu")


@pytest.mark.parametrize("version", [1, 2])
def test_saves_of_older_format_versions_are_refused_and_never_replaced(xl_save, version):
    model, path = xl_save
    edit_manifest(path, format_version=version)  # re-signed: intact, but of an older version
    with pytest.raises(FormatError, match=f"format_version {version}, older than this pefa_gpu "
                                          f"reads \\(3\\)"):
        pg.load(path, device="cpu")
    before = tree(path)
    with pytest.raises(InputError, match=f"not an intact.*format_version {version}"):
        model.save(path)
    assert tree(path) == before


# ---------------------------------------------------------------------------- item 6: paths

def test_an_index_dir_outside_the_save_is_refused(xl_save, tmp_path):
    model, path = xl_save
    # a complete index one level up, as an attacker would place it
    shutil.copytree(data_folder(path) / "query_index", tmp_path / "query_index")
    edit_manifest(path, edit=lambda m: m["state"]["query_index"].update(dir=".."))
    with pytest.raises(FormatError, match="unsafe path '..'"):
        pg.load(path, device="cpu")
    edit_manifest(path, edit=lambda m: m["state"]["query_index"].update(
        dir=str(tmp_path / "query_index")))
    with pytest.raises(FormatError, match="unsafe path"):
        pg.load(path, device="cpu")


def test_symlinks_inside_a_save_are_not_followed(xl_save, tmp_path):
    _, path = xl_save
    f = data_folder(path) / "doc_embeddings.npy"
    outside = tmp_path / "copy.npy"
    shutil.copy(f, outside)  # identical bytes: the sha256 would match
    f.unlink()
    f.symlink_to(outside)
    with pytest.raises(FormatError, match="symbolic link"):
        pg.load(path, device="cpu")


def test_a_symlinked_data_folder_is_refused(xl_save, tmp_path):
    _, path = xl_save
    folder = data_folder(path)
    moved = tmp_path / "elsewhere"
    folder.rename(moved)
    folder.symlink_to(moved)
    with pytest.raises(FormatError, match="symbolic link"):
        pg.load(path, device="cpu")


def test_a_symlinked_folder_inside_the_data_folder_is_refused(xl_save, tmp_path):
    _, path = xl_save
    folder = data_folder(path) / "query_index"
    moved = tmp_path / "elsewhere"
    folder.rename(moved)  # same files, same sha256, reached through a link
    folder.symlink_to(moved)
    with pytest.raises(FormatError, match="query_index.*symbolic link"):
        pg.load(path, device="cpu")


def test_a_file_name_with_dots_is_refused(xl_save):
    _, path = xl_save
    edit_manifest(path, edit=lambda m: m["state"]["doc_embeddings"].update(
        file="../doc_embeddings.npy"))
    with pytest.raises(FormatError, match="unsafe path"):
        pg.load(path, device="cpu")
