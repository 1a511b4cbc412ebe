"""A save that fails (disk full) leaves the target as it was, and the next save works; a load
racing a re-save gets a consistent model or one clear error."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pefa_gpu as pg
from pefa_gpu import storage
from pefa_gpu.builds import save_build

from conftest import small_problem

N, M, D = 40, 20, 8


@pytest.fixture(scope="module")
def data():
    return small_problem(5, N, M, D, 0)[:3]


def tree(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def full_disk_on_marker(monkeypatch):
    """Every write of a data folder's marker fails with ENOSPC (after creating the file)."""
    real = pathlib.Path.write_text

    def write_text(self, text, *args, **kwargs):
        if self.name == storage.DATA_MARKER:
            self.touch()
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        return real(self, text, *args, **kwargs)
    monkeypatch.setattr(pathlib.Path, "write_text", write_text)


@pytest.mark.parametrize("existing", [False, True])
def test_a_save_out_of_space_leaves_the_target_as_it_was_and_the_retry_works(
        tmp_path, data, monkeypatch, existing):
    P, Q, y = data
    model = pg.PEFAXS(device="cpu", lam=0.3).fit(P, Q, y)
    target = tmp_path / "m"
    if existing:
        pg.ERM(device="cpu").fit(P).save(target)
    before = tree(tmp_path)
    full_disk_on_marker(monkeypatch)
    for _ in range(3):  # no leak per failure
        with pytest.raises(OSError, match="No space left.*nothing was replaced"):
            model.save(target)
        assert tree(tmp_path) == before
    monkeypatch.undo()
    model.save(target)
    assert type(pg.load(target, device="cpu")) is pg.PEFAXS


def test_a_build_folder_out_of_space_leaves_nothing(tmp_path, data, monkeypatch):
    P, _, _ = data
    model = pg.ERM(device="cpu").fit(P)
    full_disk_on_marker(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        save_build(model, tmp_path / "b", [str(i) for i in range(N)], {"encoder": "x"})
    assert tree(tmp_path) == []
    monkeypatch.undo()
    save_build(model, tmp_path / "b", [str(i) for i in range(N)], {"encoder": "x"})


@pytest.mark.parametrize("ids, texts, message", [
    (["a", "b", "a"], None, "the document ids are not unique"),
    (["a", "b"], None, "2 document ids for a model of 3 documents"),
    ([1, 2, 3], None, "doc_ids must be a list of strings"),
    (["a", "b\tc", "d"], None, r"entry 1: .*'b\\tc'"),
    (["a", "b", "c"], ["t", "u"], "texts must be a list of 3 strings"),
    ({"a", "b", "c"}, None, "doc_ids must be a list of strings"),  # written in the set's order
])
def test_a_build_load_build_would_refuse_is_refused_before_anything_is_written(
        tmp_path, ids, texts, message):
    """save_build wrote any ids (repeated, too few, ints) and texts of any length: the build
    was written, and load_build / search refused it; now InputError and nothing written."""
    model = pg.ERM(device="cpu").fit(np.eye(3, 4, dtype=np.float32))
    kw = {} if texts is None else {"titles": ["", "", ""], "texts": texts}
    with pytest.raises(pg.InputError, match=message):
        save_build(model, tmp_path / "b", ids, {"encoder": "x"}, **kw)
    assert tree(tmp_path) == []


@pytest.mark.parametrize("marker", [None, "", "pefa-data-01"])
def test_a_data_folder_killed_before_its_marker_is_removed_by_the_next_save(
        tmp_path, data, marker):
    P, _, _ = data
    left = tmp_path / "m" / ("pefa-data-" + "0123456789abcdef")
    left.mkdir(parents=True)
    if marker is not None:
        (left / storage.DATA_MARKER).write_text(marker)
    pg.ERM(device="cpu").fit(P).save(tmp_path / "m")
    assert not left.exists()


@pytest.mark.parametrize("content", ["pefa-data-ff", "x"])
def test_a_folder_that_is_not_a_cut_short_data_folder_is_kept(tmp_path, data, content):
    P, _, _ = data
    other = tmp_path / "m" / ("pefa-data-" + "0123456789abcdef")
    other.mkdir(parents=True)
    (other / storage.DATA_MARKER).write_text(content)
    with pytest.raises(pg.InputError, match="not a pefa_gpu save"):
        pg.ERM(device="cpu").fit(P).save(tmp_path / "m")
    assert (other / storage.DATA_MARKER).read_text() == content


# ---------------------------------------------------------------------------- loads racing saves

SETUP = r"""
import json, sys, time
import numpy as np
import pefa_gpu as pg
from conftest import small_problem
n, m, d = map(int, sys.argv[3:6])
P, Q, y, _ = small_problem(5, n, m, d, 0)
end = time.monotonic() + float(sys.argv[1])
target = sys.argv[2]
"""
WRITER = SETUP + r"""
models = [pg.PEFAXS(device="cpu", lam=lam).fit(P, Q, y) for lam in (0.2, 0.8)]
i = 0
while time.monotonic() < end:
    models[i % 2].save(target)
    i += 1
print(i)
"""
READER = SETUP + r"""
want = {}
for lam in (0.2, 0.8):
    s, i = pg.PEFAXS(device="cpu", lam=lam).fit(P, Q, y).search(Q[:5], 10)
    want[lam] = (s.numpy(), i.numpy())
out = {"loaded": 0, "changed": 0, "wrong": []}
while time.monotonic() < end:
    try:
        model = pg.load(target, device="cpu")
    except pg.FormatError as exc:
        if "changed while it was read" in str(exc):
            out["changed"] += 1
        else:
            out["wrong"].append(repr(exc))
        continue
    except Exception as exc:  # a raw FileNotFoundError & co
        out["wrong"].append(repr(exc))
        continue
    s, i = model.search(Q[:5], 10)
    ref = want[model.params.lam]
    if np.array_equal(i.numpy(), ref[1]) and np.array_equal(s.numpy(), ref[0]):
        out["loaded"] += 1
    else:
        out["wrong"].append(f"lam={model.params.lam}: results differ")
print(json.dumps(out))
"""


@pytest.mark.slow
def test_loads_while_another_process_saves_get_a_model_or_one_clear_error(tmp_path, data):
    """One writer re-saving and two readers loading, each its own process, for 4 seconds."""
    P, Q, y = data
    target = tmp_path / "m"
    pg.PEFAXS(device="cpu", lam=0.2).fit(P, Q, y).save(target)
    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests),
                                                         os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", code, "4", str(target), str(N),
                               str(M), str(D)], cwd=tests, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for code in (WRITER, READER, READER)]
    results = [p.communicate(timeout=180) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err
    saves = int(results[0][0].strip())
    reads = [json.loads(out.strip().splitlines()[-1]) for out, _ in results[1:]]
    assert saves > 5 and all(r["loaded"] > 5 for r in reads), (saves, reads)
    assert not any(r["wrong"] for r in reads), [(len(r["wrong"]), r["wrong"][:3]) for r in reads]


@pytest.mark.skipif(storage.fcntl is None, reason="no flock: saves are not serialised")
def test_two_saves_into_one_folder_at_once_leave_the_last_save_intact(tmp_path, monkeypatch):
    """Save b ran between save a's manifest commit and a's cleanup: a's cleanup removed b's
    data folder, which the manifest (b's) named: both saves returned, the folder was broken.
    Now a save holds the folder's lock to its end: b waits (here: past the 1 s given), then
    saves over a."""
    import threading

    a, b = (pg.ERM(device="cpu").fit(np.eye(n, 3, dtype=np.float32)) for n in (4, 5))
    target, real, threads = tmp_path / "m", storage.write_output_file, []

    def commit_then_b_saves(path, content, what="output"):
        out = real(path, content, what)
        if what == "manifest" and not threads:
            threads.append(threading.Thread(target=b.save, args=(target,)))
            threads[0].start()
            threads[0].join(timeout=1)  # the old code: b saved meanwhile
        return out
    monkeypatch.setattr(storage, "write_output_file", commit_then_b_saves)
    a.save(target)
    threads[0].join()
    assert pg.load(target, device="cpu").n_docs == 5
    assert len([p for p in target.iterdir() if p.name.startswith("pefa-data-")]) == 1
