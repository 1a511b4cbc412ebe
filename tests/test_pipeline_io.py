"""What the pipeline holds and reads: the aggregation's partial sums wait on disk in the output
folder (removed after), PEFA-XL's build sends pairs only (no d-dimensional rows), whatever the
number of query shards; a build task holds one copy of its shard's rows; a search round reads
every shard once."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import textwrap
import tracemalloc

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import pefa_gpu as pg
from pefa_gpu import pipeline as pp
from pefa_gpu.errors import FormatError, InputError
from pefa_gpu.index.exact import ExactIndex
from conftest import run_forked


def array_bytes(x) -> int:
    """The bytes of every array in ``x`` (arrays, tensors, sparse matrices, dataclasses and
    sequences of them)."""
    if isinstance(x, np.ndarray):
        return x.nbytes
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if sp.issparse(x):
        return x.data.nbytes + x.indices.nbytes + x.indptr.nbytes
    if dataclasses.is_dataclass(x):
        return sum(array_bytes(getattr(x, f.name)) for f in dataclasses.fields(x))
    if isinstance(x, (list, tuple)):
        return sum(array_bytes(v) for v in x)
    return 0


class Holding(pp.LocalRunner):
    """A LocalRunner that records the bytes of the arrays in each map output it holds."""

    def __init__(self):
        self.held: list[int] = []

    def map_reduce(self, map_fn, map_calls, reduce_fn, reduce_calls, gpu=False):
        def counted(*args):
            out = map_fn(*args)
            self.held.append(array_bytes(out))
            return out
        return super().map_reduce(counted, map_calls, reduce_fn, reduce_calls, gpu)


def make_stages(tmp, seed: int, n: int = 300, m: int = 900, d: int = 64):
    """P (n, d), Q (m, d) unit rows; Y (m x n) with 2 pairs a query (repeats add up), empty
    queries and documents without pairs; row stages of 100 rows, relevance shards of 90."""
    rng = np.random.default_rng(seed)
    unit = lambda x: (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    P, Q = unit(rng.standard_normal((n, d))), unit(rng.standard_normal((m, d)))
    qi = np.repeat(np.arange(0, m, 1), 2)
    di = rng.integers(0, n - 20, qi.size)
    Y = sp.csr_matrix((np.ones(qi.size, np.float32), (qi, di)), shape=(m, n))
    Y = (sp.diags((np.arange(m) % 5 != 2).astype(np.float32)) @ Y).tocsr()
    Y.eliminate_zeros()
    return (P, Q, Y, pp.write_rows(P, tmp / "docs", rows=100),
            pp.write_rows(Q, tmp / "queries", rows=100),
            pp.write_relevance(Y, tmp / "pairs", rows=90))


def pair_bytes(Y: sp.csr_matrix, maps: int, ranges: int) -> int:
    """A bound on pairs-only map outputs: per pair a query row (int64), column (int32),
    weight (float32) and row pointer (int32 or int64), plus a row pointer per block."""
    return 32 * Y.nnz + 8 * maps * ranges


def test_aggregate_map_outputs_wait_on_disk(tmp_path):
    P, Q, Y, docs, queries, rel = make_stages(tmp_path, 0)
    run = Holding()
    out = pp.aggregate(queries, rel, docs, tmp_path / "xs", lam=0.4, doc_rows=60, runner=run)
    assert len(run.held) == 10 and sum(run.held) == 0  # no array waits in memory
    ref = Y.T.toarray().astype(np.float64) @ Q.astype(np.float64) + P
    np.testing.assert_allclose(pp.read_rows(out, tensor="sums"), ref, rtol=0, atol=2e-5)
    # the partial sums travelled (through the disk) and were removed after
    assert pp.read_stage(out).bytes_shuffled > 0
    assert sorted(p.name for p in out.iterdir()) == [f"doc-{s:05d}" for s in range(5)] + \
        ["stage.json"]


def test_xl_build_map_outputs_are_pairs_only(tmp_path):
    P, Q, Y, docs, queries, rel = make_stages(tmp_path, 1)
    run = Holding()
    b = pp.build("xl", tmp_path / "xl", docs, queries=queries, relevance=rel, doc_rows=60,
                 lam=0.3, k=4, candidates=20, runner=run)
    assert len(run.held) == 10
    assert 0 < sum(run.held) <= pair_bytes(Y, 10, 5) < Q.nbytes  # not the queries' rows
    # each shard's training queries are the rows of Q with a pair in its range
    for s, (lo, hi) in enumerate(e.rows for e in pp.read_stage(b).shards):
        shard = pp.read_shard(b / f"doc-{s:05d}")
        rows = shard.tensors["query_rows"].numpy()
        np.testing.assert_array_equal(rows, np.flatnonzero(Y[:, lo:hi].getnnz(axis=1)))
        np.testing.assert_array_equal(shard.model.query_index.vectors.numpy(), Q[rows])


@pytest.mark.parametrize("m", [2000, 8000])
def test_a_build_task_holds_its_rows_once(tmp_path, m):
    """numpy's allocations (the tasks' and the models' copies) at their peak during one XL
    reduce task (a range that every query has a pair in: its Q rows outweigh P's) and one ERM
    build task stay under 1.5x the rows the shard's model holds, whatever m; the scratch copy
    of the queries on disk is removed."""
    rng = np.random.default_rng(m)
    n, d = 1000, 256
    P = rng.standard_normal((n, d)).astype(np.float32)
    Q = rng.standard_normal((m, d)).astype(np.float32)
    P /= np.linalg.norm(P, axis=1, keepdims=True)
    Q /= np.linalg.norm(Q, axis=1, keepdims=True)
    Y = sp.csr_matrix((np.ones(m, np.float32), (np.arange(m), rng.integers(0, n, m))),
                      shape=(m, n))
    docs, queries = pp.write_rows(P, tmp_path / "docs"), pp.write_rows(Q, tmp_path / "queries")
    rel = pp.write_relevance(Y, tmp_path / "pairs", rows=m // 2)
    ranges = [(0, n)]
    parts = [pp.split_queries(queries, rel, r, ranges)[0] for r in range(2)]
    params = pp.read_stage(pp.build("xl", tmp_path / "ref", docs, queries=queries,
                                    relevance=rel, doc_rows=n)).params
    tracemalloc.start()
    try:
        entry, _ = pp.build_xl_shard(parts, queries, docs, (0, n), tmp_path / "xl", 0, params,
                                     50, "exact", None, "cpu", False)
        xl_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        pp.build_rows_shard(docs, (0, n), tmp_path / "erm", "doc-00000", "exact", None, "cpu",
                            False)
        erm_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert xl_peak < 1.5 * (P.nbytes + Q.nbytes)  # was 2 copies of each
    assert erm_peak < 1.5 * P.nbytes
    assert sorted(p.name for p in (tmp_path / "xl").iterdir()) == [entry.name]
    files = pp.read_shard(tmp_path / "xl" / entry.name).fields["files"]
    assert {f.split("/")[0] for f in files} == {"model", "query_rows.npy"}  # not the scratch
    model = pp.read_shard(tmp_path / "xl" / entry.name).model
    np.testing.assert_array_equal(model.query_index.vectors.numpy(), Q)
    np.testing.assert_array_equal(model.doc_embeddings.numpy(), P)


def test_a_foreign_folder_in_the_way_is_refused_and_kept(tmp_path):
    _, _, _, docs, queries, rel = make_stages(tmp_path, 2)
    out = tmp_path / "xs"
    (out / "part-00003").mkdir(parents=True)
    (out / "part-00003" / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="part-00003"):
        pp.aggregate(queries, rel, docs, out, lam=0.4, doc_rows=60)
    assert (out / "part-00003" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == ["part-00003"]  # ours removed


def test_a_rerun_with_fewer_shards_removes_the_old_ones_and_nothing_else(tmp_path):
    """The old run's shards beyond the new ones were left (never read: stage.json lists the
    shards, checksums included; but their disk space was kept); now removed at the commit,
    a folder of that name that is not a complete shard kept, as a link and other files."""
    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    out = pp.write_rows(x, tmp_path / "rows", rows=2)
    (out / "shard-00008").rename(tmp_path / "moved")
    (out / "shard-00008").symlink_to(tmp_path / "moved")
    (out / "shard-00009" / "pefa_shard.json").unlink()  # no longer a complete shard
    (out / "doc-00004").mkdir()
    (out / "notes.txt").write_text("mine")
    pp.write_rows(x[:5], out, rows=2)
    assert sorted(p.name for p in out.iterdir()) == [
        "doc-00004", "notes.txt", "shard-00000", "shard-00001", "shard-00002", "shard-00008",
        "shard-00009", "stage.json"]
    assert (tmp_path / "moved" / "pefa_shard.json").is_file()
    np.testing.assert_array_equal(pp.read_rows(out), x[:5])


@pytest.mark.parametrize("edit", [{"tensors": []}, {"tensors": {"embeddings": 5}},
                                  {"matrices": "abc"}, {"matrices": {"m": []}}])
def test_a_shard_manifest_whose_tables_are_not_tables_is_refused(tmp_path, edit):
    """A shard manifest re-signed (as a forger can) with its stage entry updated: tensors or
    matrices that are not tables of entries were a raw AttributeError / TypeError."""
    import json

    from pefa_gpu import storage
    from pefa_gpu.pipeline.shards import SHARD_MANIFEST

    out = pp.write_rows(np.ones((4, 2), np.float32), tmp_path / "r", rows=2)
    manifest = out / "shard-00000" / SHARD_MANIFEST
    m = {**json.loads(manifest.read_text()), **edit}
    m["manifest_sha256"] = storage.manifest_checksum(m)
    manifest.write_text(json.dumps(m))
    stage = json.loads((out / "stage.json").read_text())
    stage["shards"][0]["manifest_sha256"] = m["manifest_sha256"]
    (out / "stage.json").write_text(json.dumps(stage))
    with pytest.raises(FormatError, match="'tensors' and 'matrices' must be tables of file"):
        pp.read_rows(out)


@pytest.mark.parametrize("stage", [5, "", None, "relevance", "build"])
def test_write_rows_checks_its_stage_name_before_any_shard(tmp_path, stage):
    """stage=5 was Stage's TypeError ('stage fields [...] have the wrong type') once every shard
    was written, leaving them behind."""
    with pytest.raises(InputError, match="stage must be a non-empty name"):
        pp.write_rows(np.ones((4, 2), np.float32), tmp_path / "r", rows=2, stage=stage)
    assert not (tmp_path / "r").exists() or not os.listdir(tmp_path / "r")


def test_a_stage_shard_linked_outside_its_stage_is_refused(tmp_path):
    stage = pp.write_rows(np.zeros((4, 3), np.float32), tmp_path / "rows", rows=2)
    shard = stage / "shard-00001"
    shard.rename(tmp_path / "moved")
    os.symlink("../moved", shard)  # its own shard, outside the stage: was read
    with pytest.raises(FormatError, match="shard-00001 leads outside its stage folder"):
        pp.read_rows(stage, 2, 4)
    os.unlink(shard)
    pp.write_rows(np.ones((4, 3), np.float32), tmp_path / "other", rows=2)
    os.symlink(tmp_path / "other" / "shard-00001", shard)  # said "rewritten after its stage"
    with pytest.raises(FormatError, match="leads outside"):
        pp.read_rows(stage)
    assert pp.read_rows(stage, 0, 2).tolist() == [[0.0] * 3] * 2  # the other shard reads


def test_a_scratch_shard_linked_outside_is_refused_and_its_target_kept(tmp_path):
    _, _, _, docs, queries, rel = make_stages(tmp_path, 3)
    (tmp_path / "xs").mkdir()
    os.symlink(docs / "shard-00000", tmp_path / "xs" / "part-00000")
    before = pp.read_rows(docs)
    with pytest.raises(InputError, match="part-00000 leads outside its stage folder"):
        pp.aggregate(queries, rel, docs, tmp_path / "xs", lam=0.4, doc_rows=60)
    assert np.array_equal(pp.read_rows(docs), before)  # was written through, then removed


KILLED_BUILD = textwrap.dedent("""
    import os, signal, sys
    from pefa_gpu import PEFAXL, pipeline as pp

    PEFAXL.fit = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # mid-task, hard
    d = sys.argv[1]
    pp.build("xl", d + "/xl", d + "/docs", queries=d + "/queries", relevance=d + "/pairs",
             doc_rows=100)
""")


@pytest.mark.slow
def test_a_killed_xl_build_leaves_scratch_that_the_next_build_removes(tmp_path):
    """The queries' copy that a killed build task leaves in its shard's unfinished save is
    removed when the next build writes that shard; what the library did not write is kept."""
    P, Q, Y, docs, queries, rel = make_stages(tmp_path, 4)
    run_forked(KILLED_BUILD, tmp_path, returncode=-9)
    out = tmp_path / "xl"
    (left,) = (out / "doc-00000").iterdir()  # what the kill left: marker and the queries' copy
    assert sorted(f.name for f in left.iterdir()) == [".pefa-data", "q.npy"]
    kept = {out / "notes.txt": "mine", out / ".scratch-user" / "q.npy": "mine",
            out / "doc-00000.old" / "q.npy": "mine"}
    for path, text in kept.items():
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    pp.build("xl", out, docs, queries=queries, relevance=rel, doc_rows=100)
    assert not left.exists()
    assert {path: path.read_text() for path in kept} == kept
    for s in range(3):  # the committed shards hold no copy of the queries
        shard = pp.read_shard(out / f"doc-{s:05d}")
        assert "q.npy" not in shard.fields["files"] and shard.tensors["query_rows"].numel()
    assert pp.read_stage(out, "build").n == P.shape[0]


@pytest.mark.parametrize("name", ["../evil", "a/b", "a\\b", "", ".", "..", "/tmp/evil", 3])
def test_a_shard_tensor_name_that_is_not_a_plain_file_name_is_refused(tmp_path, name):
    """write_rows' name becomes a file in each shard's data folder: a path is refused before
    anything is written (it wrote ../evil.npy beside the data folder)."""
    x = np.ones((5, 2), np.float32)
    with pytest.raises(InputError, match="must be a plain file name"):
        pp.write_rows(x, tmp_path / "x", name=name)
    assert sorted(p.name for p in tmp_path.rglob("*")) in ([], ["x"], ["shard-00000", "x"])
    assert not list(tmp_path.rglob("*.npy"))


def test_row_bounds_that_are_not_ints_are_named(tmp_path):
    """read_rows(folder, 0, 2.5) was a raw TypeError from a slice, lo='a' one from a comparison;
    Rows.take of float rows a raw casting TypeError."""
    rows = pp.Rows(pp.write_rows(np.ones((5, 2), np.float32), tmp_path / "x", rows=2))
    for lo, hi, match in ((0, 2.5, "hi must be an int >= 0, got 2.5"),
                          ("a", 3, "lo must be an int >= 0, got 'a'"),
                          (None, 3, "lo must be an int >= 0, got None"),
                          (0, -1, "hi must be an int >= 0, got -1")):
        with pytest.raises(InputError, match=match):
            pp.read_rows(rows.folder, lo, hi)
    assert pp.read_rows(rows.folder, np.int64(1), np.int64(3)).shape == (2, 2)
    for bad, match in ((np.array([0.0, 2.5]), "float64"), ([1, 2], "list"),
                       (np.array(["a"]), "<U1"), (np.array([[1, 2]]), "int64")):
        with pytest.raises(InputError, match=f"rows must be a 1-D numpy array of integers, "
                                             f"got {match}"):
            rows.take(bad)
    for bad in ([0, 3, 1], [0, 50, 3]):  # were wrong rows or a raw IndexError
        for dt in (np.int64, np.uint64):  # np.diff of uint64 wraps: the order was not checked
            with pytest.raises(InputError, match="rows must be in ascending order"):
                rows.take(np.array(bad, dt))
    for out in (np.empty((2, 3), np.float32), np.empty((2, 2)), [[0, 0], [0, 0]]):
        with pytest.raises(InputError, match="out must be a \\(2, 2\\) float32"):
            rows.take(np.array([0, 3]), out)  # was numpy's raw ValueError / TypeError


@pytest.mark.parametrize("fields", [{}, {"rows": "ab"}, {"rows": [0.5, 1]}, {"rows": [2, 1]},
                                    {"rows": [0, 1, 2]}, {"rows": [True, 1]}, None])
def test_a_shard_without_its_rows_is_refused_before_it_is_written(tmp_path, fields):
    # were a raw KeyError / TypeError from its stage entry, the shard left written
    with pytest.raises(InputError, match="a shard's fields need 'rows': \\[lo, hi\\]"):
        pp.write_shard(tmp_path / "s", fields, {"e": torch.ones(1, 2)})
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("name", [".", "", "sub/.."])
def test_a_shard_named_as_its_folder_is_refused_before_it_is_written(tmp_path, monkeypatch,
                                                                      name):
    # '.' was saved into the working folder, then Entry.of's raw ValueError
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    with pytest.raises(InputError, match="a shard is named .*, not a folder in the stage"):
        pp.write_shard(name, {"rows": [0, 1]}, {"e": torch.ones(1, 2)})
    assert sorted(os.listdir(tmp_path)) == ["sub"] and not os.listdir(tmp_path / "sub")


def test_rows_take_reads_rows_across_shards(tmp_path):
    x = np.random.default_rng(3).standard_normal((250, 8)).astype(np.float32)
    rows = pp.Rows(pp.write_rows(x, tmp_path / "x", rows=100))
    for want in ([], [0], [99, 100], [5, 5, 120, 249], list(range(250))):
        got = rows.take(np.array(want, dtype=np.int64))
        assert got.dtype == np.float32 and got.shape == (len(want), 8)
        np.testing.assert_array_equal(got, x[want])
    with pytest.raises(InputError, match="outside"):
        rows.take(np.array([3, 250]))


def test_aggregate_sums_past_float32_are_refused_by_name(tmp_path):
    """Yᵀ Q past float32's range was written (inf sums, NaN E after a warning), and
    build('xs') then said 'P contains NaN or inf'."""
    big = np.full((2, 4), np.finfo(np.float32).max, np.float32)
    queries = pp.write_rows(big, tmp_path / "q")
    docs = pp.write_rows(np.ones((3, 4), np.float32), tmp_path / "p")
    rel = pp.write_relevance(sp.csr_matrix(np.ones((2, 3), np.float32)), tmp_path / "y", rows=1)
    for lam in (None, 0.5):
        with pytest.raises(InputError, match=r"sums Yᵀ Q of documents \[0, 1, 2\]\.\.\. "
                                             r"overflow float32"):
            pp.aggregate(queries, rel, docs, tmp_path / "a", lam=lam)
        assert not (tmp_path / "a" / "stage.json").exists()


def test_rows_take_checks_a_stage_files_dim_before_allocating(tmp_path):
    # a forged stage.json dim (2^40) was a MemoryError for 8 TiB before any shard was read
    folder = pp.write_rows(np.ones((10, 4), np.float32), tmp_path / "x", rows=3)
    body = json.loads((folder / "stage.json").read_text())
    (folder / "stage.json").write_text(json.dumps({**body, "dim": 2**40}))
    with pytest.raises(FormatError, match="holds no 'embeddings' of its stage's shape"):
        pp.Rows(folder).take(np.array([0, 1]))


@pytest.mark.parametrize("method", ["erm", "xl"])
def test_a_forged_build_dim_is_the_builds_error_not_the_queries(tmp_path, method):
    """A stage.json whose dim is not its shards' said 'queries have dimension 64, ...' of the
    right queries."""
    P, Q, Y, docs, queries, rel = make_stages(tmp_path, 6, n=120, m=90, d=16)
    b = pp.build(method, tmp_path / "b", docs, **({"queries": queries, "relevance": rel}
                                                  if method == "xl" else {}))
    body = json.loads((b / "stage.json").read_text())
    (b / "stage.json").write_text(json.dumps({**body, "dim": 8}))
    for q in (Q[:5], queries, Q[:5, :8].copy()):  # an array, a row stage, the forged dim
        with pytest.raises(FormatError, match="doc-00000 does not hold the .* dimension 8"):
            pp.search(b, q, topk=3)


def test_a_search_reads_every_shard_once_per_round(tmp_path, monkeypatch):
    P, Q, Y, docs, queries, rel = make_stages(tmp_path, 4)
    b = pp.build("xl", tmp_path / "xl", docs, queries=queries, relevance=rel, doc_rows=60,
                 lam=0.3, k=4, candidates=20)
    T = np.random.default_rng(5).standard_normal((1200, P.shape[1])).astype(np.float32)
    T[1] = P[7]
    want = pp.search(b, T, topk=10, batch_size=300)  # 4 rounds
    calls = collections.Counter()
    search = ExactIndex.search

    def counted(self, q, k, params=None):
        calls[self] += 1
        return search(self, q, k, params)
    monkeypatch.setattr(ExactIndex, "search", counted)
    got = pp.search(b, T, topk=10)
    # 5 passage shards and 10 query shards, each searched once for the 1,200 queries
    assert len(calls) == 15 and set(calls.values()) == {1}
    assert torch.equal(got[1], want[1])  # scores: faiss' BLAS path sums in another order
    np.testing.assert_allclose(got[0].numpy(), want[0].numpy(), rtol=0, atol=2e-6)
    assert got[1][1, 0] == 7


def test_a_file_given_for_a_stage_folder_is_named(tmp_path):
    """A file for a stage folder (a .npy, the stage.json itself) was a raw NotADirectoryError
    from every reader (read_stage, read_rows, build, search's queries)."""
    docs = pp.write_rows(np.eye(3, dtype=np.float32), tmp_path / "p")
    np.save(tmp_path / "q.npy", np.eye(3, dtype=np.float32))
    b = pp.build("erm", tmp_path / "b", docs)
    for file in (tmp_path / "q.npy", docs / "stage.json"):
        for run in (lambda: pp.read_stage(file), lambda: pp.read_rows(file),
                    lambda: pp.build("erm", tmp_path / "b2", file), lambda: pp.search(b, file)):
            with pytest.raises(FormatError, match=f"{file} is not a folder: a stage is a folder "
                                                  f"holding its stage.json"):
                run()


def test_search_takes_any_path_like_for_a_query_stage(tmp_path):
    # a PurePosixPath or another os.PathLike was refused as 'queries must be an array'
    import pathlib

    class Where:
        def __fspath__(self):
            return str(queries)
    x = np.eye(3, dtype=np.float32)
    docs, queries = pp.write_rows(x, tmp_path / "p"), pp.write_rows(x, tmp_path / "q")
    b = pp.build("erm", tmp_path / "b", docs)
    want = pp.search(b, x, topk=2)
    for q in (pathlib.PurePosixPath(queries), Where()):
        got = pp.search(b, q, topk=2)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    y = sp.eye(3, dtype=np.float32, format="csr")
    got = pp.evaluate_configs(pathlib.PurePosixPath(docs), Where(), y, x, y,
                              [pg.Config("erm")], tmp_path / "w", ks=(1,), topk=2,
                              show_progress=False)
    assert got[0]["recall@1"] == 1.0 and not (tmp_path / "w" / "docs").exists()


def test_a_listed_shard_that_is_gone_is_named(tmp_path):
    # a shard folder deleted (or not copied with its stage) was open_save's raw
    # FileNotFoundError for every reader
    import shutil

    x = np.eye(4, dtype=np.float32)
    docs = pp.write_rows(x, tmp_path / "p", rows=2)
    b = pp.build("erm", tmp_path / "b", docs, doc_rows=2)
    for folder, shard, run in ((docs, "shard-00001", lambda: pp.read_rows(docs)),
                               (b, "doc-00000", lambda: pp.search(b, x, topk=2))):
        shutil.rmtree(folder / shard)
        with pytest.raises(FormatError, match=f"{folder / shard} is missing: "
                                              f"{folder / 'stage.json'} lists it"):
            run()


def test_a_tensor_a_stage_lacks_is_named_with_what_it_holds(tmp_path):
    # read_rows(..., tensor='sums') of a row stage, or the default 'embeddings' of a sums-only
    # aggregate, read as a damaged shard ('holds no ... of its stage's shape'), and nothing more
    P, Q, Y, docs, queries, rel = make_stages(tmp_path, 5, n=40, m=60, d=8)
    sums = pp.aggregate(queries, rel, docs, tmp_path / "sums")
    for folder, tensor, held in ((docs, "sums", "['embeddings']"), (sums, "embeddings",
                                                                     "['sums']")):
        with pytest.raises(FormatError, match=f"holds no '{tensor}' of its stage's shape "
                                              f".*; it holds \\{held[:-1]}\\]"):
            pp.read_rows(folder, tensor=tensor)


def test_a_folder_that_is_no_path_is_named(tmp_path):
    # each was a raw "expected str, bytes or os.PathLike object, not int", naming nothing
    x = np.eye(3, dtype=np.float32)
    y = sp.eye(3, dtype=np.float32, format="csr")
    docs, queries = pp.write_rows(x, tmp_path / "p"), pp.write_rows(x, tmp_path / "q")
    rel = pp.write_relevance(y, tmp_path / "y")
    calls = {"out": [lambda: pp.write_rows(x, 5), lambda: pp.write_relevance(y, 5),
                     lambda: pp.aggregate(queries, rel, docs, 5), lambda: pp.build("erm", 5, docs),
                     lambda: pp.encode(["a"], 5, model=lambda t: np.ones((len(t), 2)))],
             "folder": [lambda: pp.read_rows(5), lambda: pp.read_stage(None)],
             "queries": [lambda: pp.aggregate(5, rel, docs, tmp_path / "a")],
             "relevance": [lambda: pp.build("xl", tmp_path / "b", docs, queries=queries,
                                            relevance=5)],
             "docs": [lambda: pp.build("erm", tmp_path / "b", 5)],
             "embeddings": [lambda: pp.build("xs", tmp_path / "b", docs, embeddings=5)],
             "build": [lambda: pp.search(5, x)],
             "path": [lambda: pp.write_shard(5, {"rows": [0, 1]})],
             "work": [lambda: pp.evaluate_configs(x, x, y, x, y, [pg.Config("erm")], 5)]}
    for name, runs in calls.items():
        for run in runs:
            with pytest.raises(TypeError, match=f"{name} must be a path \\(str or os.PathLike\\), "
                                                f"got (int|NoneType)"):
                run()
    assert sorted(os.listdir(tmp_path)) == ["p", "q", "y"]


def test_aggregate_takes_a_numpy_lam(tmp_path):
    # np.float32 / np.int64 lam stopped at the first reduce: 'the manifest cannot be written
    # as JSON: Object of type float32 is not JSON serializable', the map's work lost
    P, Q, Y, docs, queries, rel = make_stages(tmp_path, 6, n=40, m=60, d=8)
    want = pp.read_rows(pp.aggregate(queries, rel, docs, tmp_path / "want", lam=0.25))
    for i, lam in enumerate((np.float32(0.25), np.float16(0.25))):
        got = pp.aggregate(queries, rel, docs, tmp_path / f"a{i}", lam=lam)
        assert pp.read_stage(got).lam == 0.25
        np.testing.assert_array_equal(pp.read_rows(got), want)
    assert pp.read_stage(pp.aggregate(queries, rel, docs, tmp_path / "one",
                                      lam=np.int64(1))).lam == 1.0


def test_flags_that_are_not_bools_are_refused_before_the_work(tmp_path):
    # encode(normalize=np.bool_(False) / 1 / 'no') encoded every shard, then Stage's raw
    # TypeError 'stage fields ['normalize'] have the wrong type'; aggregate took
    # augment_docs='no' as True
    calls = []

    def enc(texts):
        calls.append(len(texts))
        return np.ones((len(texts), 2), np.float32)
    enc.cache_key = "ones"
    for bad in (1, "no", None):
        with pytest.raises(InputError, match=f"normalize must be True or False, got {bad!r}"):
            pp.encode(["a", "b"], tmp_path / "e", model=enc, normalize=bad, show_progress=False)
    assert calls == []
    out = pp.encode(["a", "b"], tmp_path / "e", model=enc, normalize=np.bool_(False),
                    show_progress=False)
    assert pp.read_stage(out).normalize is False and (pp.read_rows(out) == 1).all()
    P, Q, Y, docs, queries, rel = make_stages(tmp_path, 7, n=40, m=60, d=8)
    with pytest.raises(InputError, match="augment_docs must be True or False, got 'no'"):
        pp.aggregate(queries, rel, docs, tmp_path / "a", augment_docs="no")
    out = pp.aggregate(queries, rel, docs, tmp_path / "a", augment_docs=np.bool_(False))
    assert pp.read_stage(out).augment_docs is False


def test_a_stage_without_rows_is_not_read_as_rows(tmp_path):
    # a relevance (or build) stage given for rows was read as 0-wide rows: 'queries have
    # dimension 0, documents 8' / 'queries have dimension 8, documents 0'
    P, Q, Y, docs, queries, rel = make_stages(tmp_path, 8, n=40, m=60, d=8)
    b = pp.build("erm", tmp_path / "b", docs)
    for run, bad in ((lambda: pp.build("xl", tmp_path / "x", docs, queries=rel, relevance=rel),
                      rel), (lambda: pp.aggregate(queries, rel, rel, tmp_path / "a"), rel),
                     (lambda: pp.read_rows(b), b), (lambda: pp.search(b, b), b)):
        with pytest.raises(FormatError, match=f"{bad} holds a '(relevance|build)' stage, not "
                                              f"rows"):
            run()


def test_build_refuses_an_export_hnsw_that_is_not_a_bool(tmp_path):
    # export_hnsw='no' (truthy) exported an HNSW file next to every shard's model
    docs = pp.write_rows(np.eye(4, dtype=np.float32), tmp_path / "p", rows=2)
    for bad in ("no", 1):
        with pytest.raises(InputError, match=f"export_hnsw must be True or False, got {bad!r}"):
            pp.build("erm", tmp_path / "b", docs, export_hnsw=bad)
        assert not (tmp_path / "b").exists()


def test_split_checks_its_row_count():
    # n=-5 was [(0, 0)], True one row, 2.5 a raw TypeError naming nothing
    assert pp.split(5, 2) == [(0, 2), (2, 4), (4, 5)] and pp.split(0, 3) == [(0, 0)]
    assert pp.split(np.int64(3), 2) == [(0, 2), (2, 3)]
    for bad in (-5, True, 2.5, "3"):
        with pytest.raises(InputError, match=f"n must be an int >= 0, got {bad!r}"):
            pp.split(bad, 2)


def test_a_shard_server_takes_distinct_shards_of_its_build(tmp_path):
    # [0, 0] gave every result twice, [-1] and [True] served other shards, [5] was a raw
    # IndexError
    x = np.eye(4, dtype=np.float32)
    b = pp.build("erm", tmp_path / "b", pp.write_rows(x, tmp_path / "p", rows=2), doc_rows=2)
    for bad in ([0, 0], [-1], [True], [5], [1.0]):
        with pytest.raises(InputError, match=r"doc_shards must be distinct shard numbers in "
                                             r"\[0, 2\)"):
            pp.ShardServer(b, bad)
    with pytest.raises(InputError, match=r"query_shards must be distinct shard numbers in "
                                         r"\[0, 0\), got \[0\]"):
        pp.ShardServer(b, [0], [0])
    _, ids = pp.ShardServer(b, [np.int64(1), 0]).erm(torch.from_numpy(x), 4)
    assert sorted(ids[0].tolist()) == [0, 1, 2, 3]


def test_encode_refuses_an_empty_cache_dir(tmp_path, monkeypatch):
    # '' was expanded to '.', and the encode cache written into the current folder
    monkeypatch.chdir(tmp_path)

    def enc(texts):
        return np.ones((len(texts), 2), np.float32)
    enc.cache_key = "ones"
    with pytest.raises(InputError, match="cache_dir is '': give a folder, or None"):
        pp.encode(["a"], tmp_path / "e", model=enc, cache_dir="", show_progress=False)
    with pytest.raises(TypeError, match="cache_dir must be a path"):
        pp.encode(["a"], tmp_path / "e", model=enc, cache_dir=5, show_progress=False)
    assert os.listdir(tmp_path) == []


def test_encode_fingerprint_of_a_text_with_a_lone_surrogate():
    """A Python str may hold a lone surrogate; its fingerprint was a raw UnicodeEncodeError."""
    a = pp.encode_fingerprint(["x\ud800y"], "model", True)
    assert len(a) == 64 and a != pp.encode_fingerprint(["x\ud801y"], "model", True)
    assert a != pp.encode_fingerprint(["xy"], "model", True)
