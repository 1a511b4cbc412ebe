"""The offline pipeline over shards (pefa_gpu.pipeline) in one process and on a local Ray
cluster (pefa_gpu.distributed): every stage against an independent float64 reference and
against the single-machine library, the cluster run against the one-process run (bit for bit),
atomic and resumable shard writes, and workers killed mid-stage."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import pefa_gpu as pg
from pefa_gpu import pipeline as pp
from pefa_gpu.errors import FormatError, InputError
from pefa_gpu.fuse import neighbours
from pefa_gpu.pipeline.shards import _complete
from pefa_gpu.topk import merge_lists
from conftest import run_python
from reference import exact_search, normalize, xl_search
from textdata import BowEncoder

TESTS = Path(__file__).resolve().parent


# ------------------------------------------------------------------------------ data

def make_data(seed: int, n: int = 240, m: int = 400, d: int = 12, b: int = 50):
    """Unit rows with exact ties: documents 7 and 130 (different shards) duplicate document 3;
    queries 5 and 300 duplicate each other; documents 200.. have no pair; weighted pairs and
    repeated pairs (their weights add up)."""
    rng = np.random.default_rng(seed)
    unit = lambda x: (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    P = unit(rng.standard_normal((n, d)))
    P[[7, 130]] = P[3]
    Q = unit(P[rng.integers(0, 200, m)] + 0.5 * rng.standard_normal((m, d)))
    Q[300] = Q[5]
    qi = np.concatenate([np.arange(m), rng.integers(0, m, m)])
    di = rng.integers(0, 200, qi.size)
    w = rng.choice([1.0, 2.0, 0.5], qi.size).astype(np.float32)
    Y = sp.csr_matrix((w, (qi, di)), shape=(m, n))  # repeated pairs add up
    T = unit(P[rng.integers(0, n, b)] + 0.3 * rng.standard_normal((b, d)))
    T[0] = P[3]  # ties at the top: documents 3, 7, 130
    Yt = sp.csr_matrix((np.ones(b), (np.arange(b), rng.integers(0, n, b))), shape=(b, n))
    return P, Q, Y, T, Yt


def stages(tmp: Path, P, Q, Y, doc_rows: int = 70, query_rows: int = 130, rows: int = 90):
    docs = pp.write_rows(P, tmp / "docs", rows=rows)
    queries = pp.write_rows(Q, tmp / "queries", rows=rows)
    rel = pp.write_relevance(Y, tmp / "pairs", rows=query_rows)
    return docs, queries, rel


# ------------------------------------------------------------------------------ one process

@pytest.mark.parametrize("augment", [True, False])
def test_aggregate_equals_reference_and_pifa(tmp_path, augment):
    P, Q, Y, _, _ = make_data(1)
    docs, queries, rel = stages(tmp_path, P, Q, Y)
    out = pp.aggregate(queries, rel, docs, tmp_path / "xs", lam=0.3, augment_docs=augment,
                       doc_rows=70)
    sums, E = pp.read_rows(out, tensor="sums"), pp.read_rows(out)
    ref = Y.T.toarray().astype(np.float64) @ Q.astype(np.float64) + (P if augment else 0)
    np.testing.assert_allclose(sums, ref, rtol=0, atol=2e-5)
    ref_E = 0.3 * P.astype(np.float64) + 0.7 * normalize(ref)
    np.testing.assert_allclose(E, ref_E, rtol=0, atol=2e-6)
    if not augment:  # documents without a pair keep lam * p_j exactly (Π(0) = 0)
        assert np.array_equal(sums[200:], np.zeros_like(sums[200:]))
        assert np.array_equal(E[200:], np.float32(0.3) * P[200:])
    # the library's fit: the same sums to float32 rounding (summed in another order)
    xs = pg.PEFAXS(lam=0.3, augment_docs=augment, device="cpu").fit(P, Q, Y)
    np.testing.assert_allclose(sums, xs.doc_sums.numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(E, xs.xs_embeddings().numpy(), rtol=0, atol=1e-6)
    info = pp.read_stage(out, "aggregate")
    assert [s.rows for s in info.shards] == [(0, 70), (70, 140), (140, 210), (210, 240)]
    assert info.bytes_shuffled > 0


def test_erm_and_xs_search_equal_library_ids_with_ties(tmp_path):
    P, Q, Y, T, _ = make_data(2)
    docs, queries, rel = stages(tmp_path, P, Q, Y)
    b = pp.build("erm", tmp_path / "erm", docs, doc_rows=70)
    assert len(pp.read_stage(b).shards) == 4
    s, i = pp.search(b, T, topk=30, batch_size=17)
    ref_s, ref_i = exact_search(P, T, 30)
    np.testing.assert_array_equal(i.numpy(), ref_i)
    assert i[0, :3].tolist() == [3, 7, 130]  # tied across shards: lower id first
    np.testing.assert_allclose(s.numpy(), ref_s, atol=1e-6)
    lib_s, lib_i = pg.ERM(device="cpu").fit(P).search(T, 30)
    assert torch.equal(i, lib_i) and torch.allclose(s, lib_s, atol=1e-6)
    # a topk beyond the corpus pads with -1 / -inf
    s, i = pp.search(b, T[:3], topk=300)
    assert (i[:, 240:] == -1).all() and torch.isinf(s[:, 240:]).all()
    # XS: the search stage over the aggregated E equals one index over the same E
    agg = pp.aggregate(queries, rel, docs, tmp_path / "xs", lam=0.5, doc_rows=70)
    E = pp.read_rows(agg)
    s, i = pp.search(pp.build("xs", tmp_path / "xsi", docs, embeddings=agg), T, topk=30)
    ref_s, ref_i = exact_search(E, T, 30)
    np.testing.assert_array_equal(i.numpy(), ref_i)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # E is not unit-norm
        lib_s, lib_i = pg.ERM(device="cpu").fit(E).search(T, 30)
    assert torch.equal(i, lib_i) and torch.equal(s, lib_s)


def test_any_backend_and_search_settings_per_call(tmp_path):
    pytest.importorskip("faiss")
    P, Q, Y, T, _ = make_data(9)
    docs = pp.write_rows(P, tmp_path / "docs", rows=1000)
    b = pp.build("erm", tmp_path / "hnsw", docs, doc_rows=1000, backend="hnsw",
                 index_params={"M": 4, "ef_construction": 10})
    lib = pg.ERM(backend="hnsw", index_params={"M": 4, "ef_construction": 10},
                 device="cpu").fit(P)
    got = []
    for params in (None, {"ef_search": 10}):
        s, i = pp.search(b, T, topk=10, params=params)
        typed = lib.index_search_params.replace(**params) if params else None
        lib_s, lib_i = lib.search(T, 10, index_params=typed)
        assert torch.equal(i, lib_i) and torch.equal(s, lib_s)
        got.append(i)
    assert not torch.equal(*got)  # the setting reached the shards' indices
    assert pp.read_shard(tmp_path / "hnsw" / "doc-00000").model.backend == "hnsw"


def assert_same_ranking(s, i, ref_s, ref_i, atol=1e-5):
    """Scores equal to ``atol``; ids equal wherever the reference's scores at neighbouring
    ranks are more than ``atol`` apart (a near tie may swap under float32 rounding)."""
    s, i, ref_s, ref_i = (np.asarray(x) for x in (s, i, ref_s, ref_i))
    np.testing.assert_allclose(s, ref_s, atol=atol, rtol=0)
    gap_prev = np.abs(np.diff(ref_s, axis=1, prepend=np.inf))
    gap_next = np.abs(np.diff(ref_s, axis=1, append=-np.inf))
    clear = (gap_prev > atol) & (gap_next > atol)
    assert np.array_equal(i[clear], ref_i[clear])


@pytest.mark.parametrize("augment,rescore,knn_norm", [(True, True, "k"), (False, True, "k"),
                                                      (True, False, "none")])
def test_xl_search_equals_library_and_reference(tmp_path, augment, rescore, knn_norm):
    P, Q, Y, T, _ = make_data(3)
    docs, queries, rel = stages(tmp_path, P, Q, Y)
    b = pp.build("xl", tmp_path / "xl", docs, queries=queries, relevance=rel, doc_rows=70,
                 lam=0.3, k=8, candidates=20, knn_norm=knn_norm, rescore=rescore,
                 augment_docs=augment)
    info = pp.read_stage(b, "build")
    assert len(info.shards) == 4 and len(info.query_shards) == 4
    xl = pg.PEFAXL(lam=0.3, k=8, search_params=pg.XLSearchParams(candidates=20),
                   knn_norm=knn_norm, rescore=rescore, augment_docs=augment,
                   device="cpu").fit(P, Q, Y)
    for lam, k, bs in ((None, None, 13), (0.6, 4, 50)):
        s, i = pp.search(b, T, topk=15, lam=lam, k=k, batch_size=bs)
        if lam is None:
            lib_s, lib_i = xl.search(torch.from_numpy(T), 15)
        else:
            q = torch.from_numpy(T)
            erm = xl.index.search(q, 20)
            lib_s, lib_i = xl.fuse(q, erm, xl.neighbours(q, k, erm), 15, lam=lam, k=k)
        assert torch.equal(i, lib_i), (i != lib_i).nonzero()[:5]
        assert torch.allclose(s, lib_s, atol=1e-6)
    ref_s, ref_i = xl_search(P, Q, Y, T, lam=0.3, k=8, candidates=20, knn_norm=knn_norm,
                             rescore=rescore, augment_docs=augment, topk_out=15)
    s, i = pp.search(b, T, topk=15)
    assert_same_ranking(s, i, ref_s, ref_i)


@pytest.mark.gpu
def test_shard_servers_keep_results_on_the_device(tmp_path):
    """On CUDA each server's top-k stays on the GPU (merged there); search returns the CPU
    tensors of the library's ranking."""
    P, Q, Y, T, _ = make_data(11)
    docs, queries, rel = stages(tmp_path, P, Q, Y)
    b = pp.build("xl", tmp_path / "xl", docs, queries=queries, relevance=rel, doc_rows=70,
                 lam=0.3, k=8, candidates=20, device="cuda")
    server = pp.ShardServer(b, range(4), range(4), device="cuda")
    q = torch.from_numpy(T)
    assert server.erm(q, 20)[0].is_cuda and server.knn(q, 8)[1].is_cuda
    s, i = pp.search(b, T, topk=15, device="cuda")
    assert not s.is_cuda and not i.is_cuda
    xl = pg.PEFAXL(lam=0.3, k=8, search_params=pg.XLSearchParams(candidates=20),
                   device="cuda").fit(P, Q, Y)
    lib_s, lib_i = xl.search(q.cuda(), 15)
    assert_same_ranking(s, i, lib_s.cpu(), lib_i.cpu())


def test_evaluate_configs_gives_each_xs_lam_its_own_index(tmp_path):
    """lam 0.1 and 0.1000001 shared the folder xs-0.1 ({:g}): the third config (0.1 again)
    was searched with the index of 0.1000001."""
    from pefa_gpu.sweep import Config

    P, Q, Y, T, Yt = make_data(13)
    lams = (0.1, 0.1000001, 0.1)
    pp.evaluate_configs(P, Q, Y, T, Yt, [Config("xs", lam) for lam in lams], tmp_path,
                        show_progress=False)
    for lam in lams:
        assert pp.read_stage(tmp_path / f"xs-{lam!r}-index").lam == lam


def test_evaluate_configs_on_arrays_equals_the_library(tmp_path):
    """Arrays written as row stages, one index per method (XS: per lam), each config's lam / k
    at search: the metrics of the library's models."""
    from pefa_gpu.sweep import Config

    P, Q, Y, T, Yt = make_data(12)
    configs = [Config("erm"), Config("xs", 0.3), Config("xl", 0.2, 4), Config("xl", 0.6, 8)]
    got = pp.evaluate_configs(P, Q, Y, T, Yt, configs, tmp_path, candidates=30, doc_rows=70,
                              query_rows=130, show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs", "erm", "pairs", "queries",
                                                        "xl", "xs-0.3", "xs-0.3-index"]
    models = [pg.ERM(device="cpu").fit(P), pg.PEFAXS(lam=0.3, device="cpu").fit(P, Q, Y),
              *(pg.PEFAXL(lam=lam, k=k, search_params=pg.XLSearchParams(candidates=30),
                          device="cpu").fit(P, Q, Y) for lam, k in ((0.2, 4), (0.6, 8)))]
    for cfg, res, model in zip(configs, got, models):
        assert res == pg.evaluate(model.search(T, 100)[1], Yt, (10, 100)), cfg
    for bad in ({"doc_rows": 0}, {"query_rows": 0}):  # refused, not taken as the default
        with pytest.raises(InputError, match="rows must be a positive integer, got 0"):
            pp.evaluate_configs(P, Q, Y, T, Yt, configs[:1], tmp_path / "bad", **bad,
                                show_progress=False)
    # checked before any stage is written: lam None / '0.1' were raw format errors, a tuple
    # an AttributeError, all once P, Q and Y were written
    for bad, match in ((Config("xs"), "lam must be a number in"),
                       (Config("xs", "0.1"), "lam must be a number in"),
                       (Config("xl", 0.3), "k must be a positive integer"),
                       (("xs", 0.1), "configs must hold pefa_gpu.Config's")):
        with pytest.raises(InputError, match=match):
            pp.evaluate_configs(P, Q, Y, T, Yt, [configs[0], bad], tmp_path / "bad2",
                                show_progress=False)
        assert not (tmp_path / "bad2").exists()


def test_neighbours_merge_equals_pefaxl(tmp_path):
    P, Q, Y, T, _ = make_data(4)
    xl = pg.PEFAXL(k=10, search_params=pg.XLSearchParams(candidates=30), device="cpu").fit(P, Q, Y)
    q = torch.from_numpy(T)
    erm = xl.index.search(q, 30)
    want = xl.neighbours(q, 10, erm)
    parts = [xl.query_index.search(q, 10)]
    got = neighbours(merge_lists(parts, 10, as_is=True), erm, Q.shape[0], 10, augment_docs=True)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_shard_writes_are_atomic_and_stages_checked(tmp_path, monkeypatch):
    P = make_data(5)[0]
    out = pp.write_rows(P, tmp_path / "docs", rows=100)
    before = pp.read_rows(out)
    # a write that dies half way leaves the previous shard complete, and nothing partial
    from pefa_gpu.pipeline import shards as module

    calls = {"n": 0}
    real = module.save_tensor

    def failing(path, t):
        calls["n"] += 1
        real(path, t)
        raise OSError("disk full")
    monkeypatch.setattr(module, "save_tensor", failing)
    with pytest.raises(OSError, match="disk full"):
        pp.write_shard(tmp_path / "docs" / "shard-00000", {"rows": [0, 100]},
                       {"embeddings": torch.zeros(100, 12)})
    with pytest.raises(OSError):
        pp.write_shard(tmp_path / "new" / "shard-00000", {"rows": [0, 100]},
                       {"embeddings": torch.zeros(100, 12)})
    monkeypatch.undo()
    assert calls["n"] == 2
    assert np.array_equal(pp.read_rows(out), before)
    assert _complete(tmp_path / "new" / "shard-00000") is None
    assert not [p for p in (tmp_path / "new" / "shard-00000").rglob("*") if p.is_file()]
    # a shard rewritten after its stage was written is refused, not mixed in
    pp.write_shard(tmp_path / "docs" / "shard-00001", {"rows": [100, 200]},
                   {"embeddings": torch.zeros(100, 12)})
    with pytest.raises(FormatError, match="rewritten after"):
        pp.read_rows(out)
    with pytest.raises(FormatError, match="stage.json missing"):
        pp.read_stage(tmp_path / "new")
    # a stage.json that is not ours is never replaced
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "stage.json").write_text("my notes")
    with pytest.raises(InputError, match="not a pefa_gpu stage file"):
        pp.write_rows(P, tmp_path / "mine", rows=100)
    assert (tmp_path / "mine" / "stage.json").read_text() == "my notes"


def test_stage_files_are_typed_and_checked(tmp_path):
    """stage.json reads into a Stage (old files, which spell out every default, too); a damaged
    one is a FormatError naming the file, never a crash."""
    import json

    P, Q, Y, T, _ = make_data(10)
    docs, queries, rel = stages(tmp_path, P, Q, Y)
    b = pp.build("xl", tmp_path / "xl", docs, queries=queries, relevance=rel, doc_rows=100,
                 lam=0.3, k=8, candidates=20)
    path = b / "stage.json"
    info = pp.read_stage(b, "build")
    assert (info.n, info.m, info.dim, info.candidates) == (240, 400, 12, 20)
    assert info.params == pg.XLParams(lam=0.3, k=8) and info.shards[2].rows == (200, 240)
    assert [e.rows for e in info.query_shards] == [(0, 130), (130, 260), (260, 390), (390, 400)]
    body = json.loads(path.read_text())
    assert "backend" not in body and body["params"]["lam"] == 0.3  # defaults are not written
    want = pp.search(b, T, topk=10)
    path.write_text(json.dumps({**body, "backend": "exact", "index_params": None,
                                "lam": None, "augment_docs": True}))  # as 0.1 wrote it
    assert pp.read_stage(b) == info
    assert all(torch.equal(x, y) for x, y in zip(pp.search(b, T, topk=10), want))
    for edit in ({"n": "240"}, {"shards": [{"name": "doc-00000"}]}, {"params": {"lam": 2.0}},
                 {"colour": "red"}, {"query_shards": [{"name": "q", "rows": [0],
                                                       "manifest_sha256": "0"}]},
                 # were searched: a candidates of -5 / 0 / True, a lam out of [0, 1]
                 {"candidates": -5}, {"candidates": 0}, {"candidates": True}, {"lam": -3.0},
                 {"lam": 5}, {"bytes_shuffled": -1}):
        path.write_text(json.dumps({**body, **edit}))
        with pytest.raises(FormatError, match="stage.json is damaged"):
            pp.read_stage(b)
    path.write_text(json.dumps({**body, "format_version": 2}))  # a newer one was read as 1
    with pytest.raises(FormatError, match="stage.json has format_version 2"):
        pp.search(b, T, topk=10)
    path.write_text("[" * 200_000 + "]" * 200_000)  # was a raw RecursionError
    with pytest.raises(FormatError, match="stage.json is not valid JSON .*nested too deeply"):
        pp.read_stage(b)



def test_stage_rows_that_do_not_tile_the_stage_are_refused(tmp_path):
    """Forged shard rows (gaps, overlaps, floats, beyond n), counts or a PEFA-XL build without
    its params or query shards: were wrong rows or ids beyond n, or a raw error."""
    import json

    P, Q, Y, T, _ = make_data(10)
    docs, queries, rel = stages(tmp_path, P, Q, Y)
    b = pp.build("xl", tmp_path / "xl", docs, queries=queries, relevance=rel, doc_rows=100,
                 lam=0.3, k=8, candidates=20)
    for folder in (docs, b):
        path = folder / "stage.json"
        body = json.loads(path.read_text())
        first = body["shards"][0]
        for edit in ({"shards": body["shards"][1:]}, {"shards": []}, {"dim": -1}, {"n": 10**30},
                     {"shards": [{**first, "rows": [1, first["rows"][1]]}, *body["shards"][1:]]},
                     {"shards": [{**first, "rows": [0, 1.5]}, *body["shards"][1:]]},
                     {"shards": [{**first, "rows": [0, 2**63]}, *body["shards"][1:]]}):
            path.write_text(json.dumps({**body, **edit}))
            with pytest.raises(FormatError, match="stage.json is damaged"):
                pp.search(b, T, topk=10) if folder == b else pp.read_rows(docs)
        path.write_text(json.dumps(body))
    body = json.loads((b / "stage.json").read_text())
    for name in ("..", ".", ""):  # were read as shards: the stage folder or its parent
        edit = {"shards": [{**body["shards"][0], "name": name}, *body["shards"][1:]]}
        (b / "stage.json").write_text(json.dumps({**body, **edit}))
        with pytest.raises(FormatError, match="stage.json is damaged.*not a folder in the"):
            pp.search(b, T, topk=10)
    for edit in ({"params": None}, {"query_shards": []}):
        (b / "stage.json").write_text(json.dumps({**body, **edit}))
        with pytest.raises(FormatError, match="stage.json is damaged"):
            pp.search(b, T, topk=10)


def test_an_output_folder_holding_another_stage_or_a_file_is_refused_before_any_shard(
        tmp_path):
    """An input given as a stage's output: its stage.json was replaced (build(out=docs) made the
    documents a build, write_rows into a build unmade it); a file as the folder was an OSError
    after the work. Now InputErrors before any shard is written, the inputs intact."""
    P, Q, Y, T, _ = make_data(11)
    docs, queries, rel = stages(tmp_path, P, Q, Y)
    erm = pp.build("erm", tmp_path / "erm", docs, doc_rows=100)
    want = pp.search(erm, T, topk=5)
    runs = {docs: lambda: pp.build("erm", docs, docs, doc_rows=100),
            queries: lambda: pp.aggregate(queries, rel, docs, queries, lam=0.4),
            rel: lambda: pp.write_rows(P, rel, rows=100),
            erm: lambda: pp.write_rows(P, erm, rows=100)}
    for folder, run in runs.items():
        before = sorted(p.name for p in folder.iterdir())
        with pytest.raises(InputError, match=f"{folder / 'stage.json'}: it holds a '"):
            run()
        assert sorted(p.name for p in folder.iterdir()) == before
    assert np.array_equal(pp.read_rows(docs), P) and np.array_equal(pp.read_rows(queries), Q)
    assert all(torch.equal(x, y) for x, y in zip(pp.search(erm, T, topk=5), want))
    (tmp_path / "file").write_text("mine")
    for out in (tmp_path / "file", tmp_path / "file" / "sub"):
        with pytest.raises(InputError, match="file is a file, not a folder"):
            pp.write_rows(P, out, rows=100)
    assert pp.write_rows(P[:5], docs, rows=100) == docs  # a stage of its own kind: rewritten
    assert np.array_equal(pp.read_rows(docs), P[:5])


def test_build_index_params_are_checked_before_any_shard(tmp_path):
    """A list was a raw AttributeError, a numpy int a raw TypeError from stage.json's JSON once
    every shard was built (the build was left without its stage), backend=5 a TypeError."""
    P = make_data(12)[0]
    docs = pp.write_rows(P, tmp_path / "docs", rows=100)
    for kw, error, match in ((dict(index_params=[4]), TypeError,
                              "index_params must be a HNSWParams or a dict, got list"),
                             (dict(index_params={"zz": 1}), InputError, "unknown keys"),
                             (dict(backend=5), InputError, "backend=5 is unknown")):
        with pytest.raises(error, match=match):
            pp.build("erm", tmp_path / "b", docs, **{"backend": "hnsw", **kw})
        assert not (tmp_path / "b").exists()
    b = pp.build("erm", tmp_path / "b", docs, backend="hnsw", index_params={"M": np.int64(8)},
                 doc_rows=100)
    assert pp.read_stage(b).index_params["M"] == 8
    assert pp.search(b, P[:3], topk=1)[1].ravel().tolist() == [0, 1, 2]


def test_a_stage_file_that_is_a_fifo_or_holds_nan_is_refused(tmp_path):
    """stage.json as a FIFO was read until a writer came (forever), NaN read as a number."""
    import json
    import threading
    import time

    docs = pp.write_rows(np.ones((4, 3), np.float32), tmp_path / "docs", rows=2)
    body = json.loads((docs / "stage.json").read_text())
    (docs / "stage.json").write_text(json.dumps(body).replace('"dim": 3', '"dim": NaN'))
    with pytest.raises(FormatError, match="stage.json is not valid JSON .*NaN"):
        pp.read_stage(docs)
    os.unlink(docs / "stage.json")
    os.mkfifo(docs / "stage.json")

    def writer():  # ends the old code's wait (empty JSON) rather than hanging the test
        for _ in range(50):
            try:
                os.close(os.open(docs / "stage.json", os.O_WRONLY | os.O_NONBLOCK))
                return
            except OSError:
                time.sleep(0.1)
    thread = threading.Thread(target=writer)
    thread.start()
    with pytest.raises(FormatError, match="stage.json is not a regular file"):
        pp.read_rows(docs)
    thread.join()


def test_a_build_shard_holding_another_shards_model_or_forged_rows_is_refused(tmp_path):
    """A shard's files are re-signed (as a forger can) and its stage entry updated: its model
    must cover its rows (were ids beyond n) and PEFA-XL's query rows be sorted global rows."""
    import json
    import shutil

    from pefa_gpu import storage
    from pefa_gpu.pipeline.shards import SHARD_MANIFEST

    P, Q, Y, T, _ = make_data(10)
    docs, queries, rel = stages(tmp_path, P, Q, Y)
    b = pp.build("xl", tmp_path / "xl", docs, queries=queries, relevance=rel, doc_rows=100,
                 lam=0.3, k=8, candidates=20)
    body = json.loads((b / "stage.json").read_text())

    def forged(shard, edit):
        """``edit(data folder, manifest)`` on a copy of the build; its path."""
        out = tmp_path / "forged"
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(b, out)
        m = json.loads((out / shard / SHARD_MANIFEST).read_text())
        edit(out / shard / m["data"], m)
        m["files"] = storage.describe_files(out / shard / m["data"])
        m["manifest_sha256"] = storage.manifest_checksum(m)
        (out / shard / SHARD_MANIFEST).write_text(json.dumps(m))
        for e in body["shards"] + body["query_shards"]:
            if e["name"] == shard:
                e["manifest_sha256"] = m["manifest_sha256"]
        (out / "stage.json").write_text(json.dumps(body))
        return out

    def model_of(other):
        def edit(data, m):
            shutil.rmtree(data / "model")
            src = b / other / json.loads((b / other / SHARD_MANIFEST).read_text())["data"]
            shutil.copytree(src / "model", data / "model")
        return edit

    def query_rows(rows):
        def edit(data, m):
            m["tensors"]["query_rows"] = storage.save_tensor(data / "query_rows", rows)
        return edit

    rows = pp.read_shard(b / "doc-00000").tensors["query_rows"]
    for shard, edit in (("doc-00000", model_of("doc-00002")),  # 40 documents, not 100
                        ("query-00000", model_of("query-00003")),
                        ("doc-00000", model_of("query-00000")),  # an ERM, not a PEFAXL
                        ("doc-00000", query_rows(rows.flip(0))),
                        ("doc-00000", query_rows(rows + 10**6)),
                        ("doc-00000", query_rows(rows[:, None])),
                        ("doc-00000", query_rows(torch.arange(1000)))):
        with pytest.raises(FormatError, match=f"{shard} does not hold the"):
            pp.search(forged(shard, edit), T, topk=10)
        body = json.loads((b / "stage.json").read_text())


def test_a_relevance_shard_of_the_wrong_shape_or_without_its_matrix_is_refused(tmp_path):
    """A relevance shard re-written (as write_shard writes one) with its stage entry updated:
    no 'relevance' matrix was a raw KeyError, fewer rows or columns wrong sums silently, more
    rows a raw IndexError."""
    import json

    P, Q, Y, _, _ = make_data(10)
    docs, queries, rel = stages(tmp_path, P, Q, Y)
    body = json.loads((rel / "stage.json").read_text())
    lo, hi = body["shards"][0]["rows"]
    for kw in ({"tensors": {"x": torch.zeros(1, 1)}}, {"matrices": {"relevance": Y[lo:hi - 5]}},
               {"matrices": {"relevance": Y[lo:hi + 5]}},
               {"matrices": {"relevance": Y[lo:hi, :100]}}):
        e = pp.write_shard(rel / "shard-00000", {"stage": "relevance", "rows": [lo, hi]}, **kw)
        body["shards"][0]["manifest_sha256"] = e.manifest_sha256
        (rel / "stage.json").write_text(json.dumps(body))
        for run in (lambda: pp.aggregate(queries, rel, docs, tmp_path / "agg", lam=0.3),
                    lambda: pp.build("xl", tmp_path / "xl", docs, queries=queries,
                                     relevance=rel, doc_rows=100)):
            with pytest.raises(FormatError, match=f"shard-00000 holds no relevance matrix of "
                                                  f"its rows and the stage's documents "
                                                  f"\\({hi - lo} x 240\\)"):
                run()


def test_encode_reuses_a_shard_only_at_its_rows_and_with_its_embeddings(tmp_path):
    """A shard was kept by its fingerprint alone (the model, each text): the same texts at
    other rows (rows=40 then 30 over repeated texts: shard 2 is 20 texts both times) wrote a
    stage.json whose rows did not tile, and a shard without embeddings was a raw KeyError; now
    they are encoded again."""
    out = pp.encode(["same text"] * 100, tmp_path / "enc", model=BowEncoder(), rows=40,
                    show_progress=False)
    out = pp.encode(["same text"] * 80, out, model=BowEncoder(), rows=30, show_progress=False)
    assert [e.rows for e in pp.read_stage(out).shards] == [(0, 30), (30, 60), (60, 80)]
    fp = pp.read_shard(out / "shard-00000").fields["fingerprint"]
    pp.write_shard(out / "shard-00000", {"stage": "encode", "rows": [0, 30],
                                         "fingerprint": fp}, {"x": torch.zeros(30, 48)})
    enc = BowEncoder()
    out = pp.encode(["same text"] * 80, out, model=enc, rows=30, show_progress=False)
    assert enc.calls == 1 and pp.read_rows(out).shape == (80, 48)  # shard 0 only


def test_encode_encodes_again_a_shard_resigned_with_float_rows(tmp_path):
    """A shard manifest re-signed (as a forger can) with rows [0.0, 30.0] passed encode's reuse
    test ([0.0, 30.0] == [0, 30]) and the stage stopped with Entry.of's raw TypeError; that
    shard is encoded again."""
    import json

    from pefa_gpu import storage
    from pefa_gpu.pipeline.shards import SHARD_MANIFEST

    texts = [f"claim {i} about cell {i % 7}" for i in range(60)]
    out = pp.encode(texts, tmp_path / "enc", model=BowEncoder(), rows=30, show_progress=False)
    want = pp.read_rows(out)
    manifest = out / "shard-00000" / SHARD_MANIFEST
    m = {**json.loads(manifest.read_text()), "rows": [0.0, 30.0]}
    m["manifest_sha256"] = storage.manifest_checksum(m)
    manifest.write_text(json.dumps(m))
    enc = BowEncoder()
    out = pp.encode(texts, out, model=enc, rows=30, show_progress=False)
    assert enc.calls == 1 and [e.rows for e in pp.read_stage(out).shards] == [(0, 30), (30, 60)]
    assert torch.equal(torch.as_tensor(pp.read_rows(out)), torch.as_tensor(want))


def test_encode_refuses_shards_of_different_dimensions(tmp_path):
    """A model changed under the same cache_key (its shards kept, a new one of another width)
    wrote a stage whose every read said a shard is 'not of its stage's shape'."""
    def enc(texts):
        return np.ones((len(texts), width), np.float32)
    enc.cache_key = "same-key"
    width = 3
    out = pp.encode(["a", "b"], tmp_path / "enc", model=enc, rows=2, show_progress=False)
    width = 4
    with pytest.raises(InputError, match=r"embeddings of dimensions \[3, 4\] \(one changed "
                                         r"under the same cache_key\?\)"):
        pp.encode(["a", "b", "c"], out, model=enc, rows=2, show_progress=False)
    assert pp.read_rows(out).shape == (2, 3)  # the earlier stage is left as it was


_KILLER = """
import sys
sys.path[:0] = {paths!r}
import numpy as np
from pefa_gpu import pipeline as pp
from textdata import BowEncoder
texts = [line.rstrip("\\n") for line in open({texts!r})]
class DiesOnThirdCall(BowEncoder):
    cache_key = BowEncoder.cache_key
    n = 0
    def __call__(self, batch):
        self.n += 1
        if self.n == 3:
            import os
            os._exit(9)        # killed mid-stage: no cleanup, no exception handlers
        return super().__call__(batch)
pp.encode(texts, {out!r}, model=DiesOnThirdCall(), rows=40, show_progress=False)
"""


def test_encode_resumes_after_a_kill_and_shares_the_cache(tmp_path):
    texts = [f"claim {i} about protein {i % 13} and cell {i % 7}" for i in range(200)]
    (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n")
    out = tmp_path / "enc"
    script = _KILLER.format(paths=[str(TESTS)], texts=str(tmp_path / "texts.txt"),
                            out=str(out))
    run_python("-c", script, returncode=9)
    # shards 0 and 1 are complete, shard 2 was being encoded: nothing of it is visible
    assert _complete(out / "shard-00000") and _complete(out / "shard-00001")
    assert _complete(out / "shard-00002") is None
    enc = BowEncoder()
    pp.encode(texts, out, model=enc, rows=40, show_progress=False)
    assert enc.seen == 120  # shards 2, 3, 4 only
    want = pg.encode(texts, model=BowEncoder(), show_progress=False).numpy()
    np.testing.assert_array_equal(pp.read_rows(out), want)
    # the same texts again: nothing is encoded
    enc = BowEncoder()
    pp.encode(texts, out, model=enc, rows=40, show_progress=False)
    assert enc.seen == 0
    # a retried shard call (a Ray actor that died after the commit) encodes nothing either
    fp = _complete(out / "shard-00001").manifest["fingerprint"]
    enc = BowEncoder()
    entry = pp.encode_shard(texts[40:80], out, 1, 40, fp, model=enc)
    assert enc.seen == 0 and (entry.name, entry.rows) == ("shard-00001", (40, 80))
    # pg.encode's cache and the pipeline's encode share their work both ways
    cache = tmp_path / "cache"
    pg.encode(texts[:100], model=BowEncoder(), cache_dir=cache, show_progress=False)
    enc = BowEncoder()
    pp.encode(texts, tmp_path / "enc2", model=enc, rows=40, cache_dir=cache,
              show_progress=False)
    assert enc.seen == 100
    np.testing.assert_array_equal(pp.read_rows(tmp_path / "enc2"), want)
    enc = BowEncoder()
    np.testing.assert_array_equal(
        pg.encode(texts, model=enc, cache_dir=cache, show_progress=False).numpy(), want)
    assert enc.seen == 0
    # a ~user not here: pathlib's bare RuntimeError 'Could not determine home directory'
    with pytest.raises(InputError, match="cache_dir '~no-such-user-here/c'"):
        pp.encode(texts, tmp_path / "enc3", model=enc, cache_dir="~no-such-user-here/c",
                  show_progress=False)


def test_bad_input_is_named(tmp_path):
    P, Q, Y, T, _ = make_data(6)
    docs, queries, rel = stages(tmp_path, P, Q, Y)
    with pytest.raises(InputError, match="method must be one of"):
        pp.build("xxl", tmp_path / "b", docs)
    with pytest.raises(InputError, match="needs embeddings="):
        pp.build("xs", tmp_path / "b", docs)
    with pytest.raises(InputError, match="needs queries= and relevance="):
        pp.build("xl", tmp_path / "b", docs)
    other = pp.write_rows(Q[:10], tmp_path / "few", rows=100)
    with pytest.raises(InputError, match="400 x 240 but there are 10 query"):
        pp.aggregate(other, rel, docs, tmp_path / "a")
    with pytest.raises(InputError, match="400 x 240 but there are 10 query"):
        pp.build("xl", tmp_path / "b", docs, queries=other, relevance=rel)
    narrow = pp.write_rows(Q[:, :5], tmp_path / "narrow", rows=100)
    for run in (lambda: pp.aggregate(narrow, rel, docs, tmp_path / "a"),
                lambda: pp.build("xl", tmp_path / "b", docs, queries=narrow, relevance=rel)):
        with pytest.raises(InputError, match="queries have dimension 5, documents"):
            run()
    with pytest.raises(InputError, match="lam"):
        pp.aggregate(queries, rel, docs, tmp_path / "a", lam=1.5)
    b = pp.build("erm", tmp_path / "erm", docs)
    with pytest.raises(InputError, match="dimension"):
        pp.search(b, T[:, :5])
    with pytest.raises(InputError, match="NaN"):
        pp.search(b, np.full((2, 12), np.nan, np.float32))
    with pytest.raises(InputError, match="topk"):
        pp.search(b, T, topk=0)
    bad = T.copy()
    bad[7, 2] = np.inf  # a row stage that write_rows and encode would refuse: read per round
    entry = pp.write_shard(tmp_path / "bad" / "shard-00000", {"rows": [0, len(T)]},
                           {"embeddings": torch.from_numpy(bad)})
    bad = pp.write_stage(tmp_path / "bad", pp.Stage(stage="rows", shards=(entry,), n=len(T),
                                                    dim=12))
    xl = pp.build("xl", tmp_path / "xl", docs, queries=queries, relevance=rel, candidates=20)
    for build in (b, xl):
        with pytest.raises(InputError, match=r"queries\[4:8\] contains NaN or inf"):
            pp.search(build, bad, batch_size=4)
    with pytest.raises(FormatError, match="not 'aggregate'"):
        pp.build("xs", tmp_path / "b", docs, embeddings=docs)
    with pytest.raises(InputError, match="strings"):
        pp.encode(["a", 3], tmp_path / "e", model=BowEncoder())


# ------------------------------------------------------------------------------ Ray

@pytest.fixture(scope="session")
def ray_runner():
    ray = pytest.importorskip("ray")
    from pefa_gpu.distributed import RayRunner

    # the workers import this folder's helpers (textdata, this module) by name
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])
    ray.init(num_cpus=2, include_dashboard=False)
    runner = RayRunner(workers=2)
    yield runner
    runner.close()
    ray.shutdown()


def _results(tmp: Path, P, Q, Y, T, runner) -> dict:
    """Every stage's output from one run (aggregate sums and E, and each method's search)."""
    docs, queries, rel = stages(tmp, P, Q, Y)
    agg = pp.aggregate(queries, rel, docs, tmp / "xs", lam=0.4, doc_rows=70, runner=runner)
    out = {"sums": pp.read_rows(agg, tensor="sums"), "E": pp.read_rows(agg)}
    builds = {"erm": pp.build("erm", tmp / "erm", docs, doc_rows=70, runner=runner),
              "xs": pp.build("xs", tmp / "xsi", docs, embeddings=agg, runner=runner),
              "xl": pp.build("xl", tmp / "xl", docs, queries=queries, relevance=rel,
                             doc_rows=70, lam=0.2, k=8, candidates=25, runner=runner)}
    for name, b in builds.items():
        out[name] = pp.search(b, T, topk=20, batch_size=32, runner=runner)
    return out


@pytest.mark.ray
def test_ray_stages_equal_one_process_bit_for_bit(tmp_path, ray_runner):
    P, Q, Y, T, _ = make_data(7)
    local = _results(tmp_path / "local", P, Q, Y, T, None)
    cluster = _results(tmp_path / "ray", P, Q, Y, T, ray_runner)
    for key in ("sums", "E"):
        assert np.array_equal(local[key], cluster[key]), key
    for key in ("erm", "xs", "xl"):
        assert torch.equal(local[key][1], cluster[key][1]), key
        assert torch.equal(local[key][0], cluster[key][0]), key
    xl = pg.PEFAXL(lam=0.2, k=8, search_params=pg.XLSearchParams(candidates=25),
                   device="cpu").fit(P, Q, Y)
    assert torch.equal(cluster["xl"][1], xl.search(T, 20)[1])


def _double(x):
    return 2 * x


@pytest.mark.ray
def test_ray_map_exports_one_remote_function(ray_runner, monkeypatch):
    """RayRunner.map makes one Ray remote function for all its calls (not one per call, each
    pickled and exported to the cluster again)."""
    made = []
    real = type(ray_runner)._task
    monkeypatch.setattr(type(ray_runner), "_task",
                        lambda self, fn, gpu, **kw: made.append(fn) or real(self, fn, gpu, **kw))
    assert ray_runner.map(_double, [(1,), (2,), (3,)]) == [2, 4, 6]
    assert made == [_double]


@pytest.mark.ray
def test_ray_runner_refuses_bad_workers(ray_runner):
    for bad in (0, -1, 1.5):  # refused, not taken as the default (0) or used (-1: no actors)
        with pytest.raises(InputError, match="workers must be a positive integer"):
            type(ray_runner)(workers=bad)
    for bad in (-2, "3", 2.5, None, True):  # were Ray's ValueError / TypeError at the first task
        with pytest.raises(InputError, match="max_retries must be"):
            type(ray_runner)(max_retries=bad)
    for ok in (-1, 0, np.int64(-1), np.int64(2)):  # -1: Ray's "no limit"; numpy ints as ints
        assert type(type(ray_runner)(max_retries=ok).max_retries) is int


class KillOnce:
    """Wraps a stage function: its first call, in whichever worker, kills that worker's
    process (a marker file makes the retry run normally)."""

    def __init__(self, fn, marker: str):
        self.fn, self.marker = fn, marker
        self.__name__ = fn.__name__

    def __call__(self, *args):
        if not os.path.exists(self.marker):
            Path(self.marker).touch()
            os._exit(1)
        return self.fn(*args)


@pytest.mark.slow
@pytest.mark.ray
def test_ray_worker_killed_mid_stage_is_retried(tmp_path, ray_runner):
    P, Q, Y, T, _ = make_data(8)
    docs, queries, rel = stages(tmp_path, P, Q, Y)
    want = pp.aggregate(queries, rel, docs, tmp_path / "want", lam=0.4, doc_rows=70)

    class Killing(type(ray_runner)):
        def map_reduce(self, map_fn, map_calls, reduce_fn, reduce_calls, gpu=False):
            return super().map_reduce(KillOnce(map_fn, str(tmp_path / "map-killed")),
                                      map_calls, reduce_fn, reduce_calls, gpu)
    got = pp.aggregate(queries, rel, docs, tmp_path / "got", lam=0.4, doc_rows=70,
                       runner=Killing(workers=2))
    assert (tmp_path / "map-killed").exists()
    assert np.array_equal(pp.read_rows(got), pp.read_rows(want))
    # a search actor killed between two batches is restarted; the results do not change
    import ray

    b = pp.build("xl", tmp_path / "xl", docs, queries=queries, relevance=rel, doc_rows=70,
                 lam=0.2, k=8, candidates=25, runner=ray_runner)
    info = pp.read_stage(b)
    want_s, want_i = pp.search(b, T, topk=10)
    got = []
    with ray_runner.servers(pp.ShardServer, b, pp.server_groups(info, 2)) as fan:
        for lo in (0, 25):
            got.append(pp.search_batch(fan, info, torch.from_numpy(T[lo:lo + 25]), 10))
            ray.kill(fan.actors[0], no_restart=False)
    assert torch.equal(torch.cat([g[1] for g in got]), want_i)
    assert torch.equal(torch.cat([g[0] for g in got]), want_s)


class DiesOnFirstBatch(BowEncoder):
    """An encoder whose first call kills its encoder actor's process."""

    cache_key = BowEncoder.cache_key

    def __init__(self, marker: str):
        super().__init__()
        self.marker = marker

    def __call__(self, batch):
        if not os.path.exists(self.marker):
            Path(self.marker).touch()
            os._exit(1)
        return super().__call__(batch)


@pytest.mark.slow
@pytest.mark.ray
def test_ray_encode_killed_actor_and_cache(tmp_path, ray_runner):
    texts = [f"claim {i} about gene {i % 11} in tissue {i % 5}" for i in range(300)]
    want = pg.encode(texts, model=BowEncoder(), show_progress=False).numpy()
    marker = tmp_path / "killed"
    run = type(ray_runner)(workers=1)  # one encoder actor: one restart on these 2 cores
    out = pp.encode(texts, tmp_path / "enc", model=DiesOnFirstBatch(str(marker)), rows=110,
                    runner=run, cache_dir=tmp_path / "cache", show_progress=False)
    assert marker.exists()
    np.testing.assert_array_equal(pp.read_rows(out), want)
    assert len(pp.read_stage(out).shards) == 3
    # the workers filled pg.encode's cache: a local call encodes nothing
    enc = BowEncoder()
    got = pg.encode(texts, model=enc, cache_dir=tmp_path / "cache", show_progress=False)
    assert enc.seen == 0 and np.array_equal(got.numpy(), want)


@pytest.mark.slow
@pytest.mark.ray
def test_ray_encode_with_a_plain_function_encoder(tmp_path, ray_runner):
    """A module-level function without a cache_key (no fingerprint): encoded every run, and
    the run completes (its shard manifests record no fingerprint, as the driver expects)."""
    from textdata import bow_unit

    texts = [f"claim {i} about gene {i % 7}" for i in range(150)]
    want = pg.encode(texts, model=bow_unit, show_progress=False).numpy()
    for _ in range(2):  # the second run encodes again (nothing identifies the model)
        out = pp.encode(texts, tmp_path / "enc", model=bow_unit, rows=100, runner=ray_runner,
                        show_progress=False)
        np.testing.assert_array_equal(pp.read_rows(out), want)
        assert len(pp.read_stage(out).shards) == 2


# ------------------------------------------------------------------------------ CLI, SciFact

def _cli(capsys, *argv):
    from pefa_gpu.cli import main

    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


@pytest.mark.slow
@pytest.mark.ray
def test_cli_with_ray_prints_what_it_prints_without(tmp_path, capsys, ray_runner):
    from textdata import write_beir, write_embeddings

    data = write_beir(tmp_path / "toy", n_topics=6, docs_per_topic=6, train_per_doc=2,
                      seed=3, mismatch=True)
    common = ["--model", "textdata:BowEncoder", "--no-cache", "--device", "cpu", "-q"]
    argv = ["eval", data, "--lam", "0.4,0.7", "--k", "4", "--candidates", "30", *common]
    want = _cli(capsys, *argv, "--json", tmp_path / "a.json")
    work = tmp_path / "work"
    got = _cli(capsys, *argv, "--json", tmp_path / "b.json", "--ray", "local", "--workers",
               "2", "--work-dir", work)
    assert got == want and "| XL | 0.7 | 4 |" in got
    assert (tmp_path / "a.json").read_text() == (tmp_path / "b.json").read_text()
    # the encoded shards in --work-dir are reused by the next run, not written again
    manifests = sorted(work.glob("encode-*/shard-*/pefa_shard.json"))
    assert len(manifests) == 1  # corpus, training and test queries: one stage, one shard
    stamps = [p.stat().st_mtime_ns for p in manifests]
    assert _cli(capsys, *argv, "--ray", "local", "--work-dir", work) == want
    assert [p.stat().st_mtime_ns for p in manifests] == stamps
    # tune: the same validation table, choice and test table
    write_embeddings(data, "bow")
    argv = ["tune", data, "--embeddings", "bow", "--lam", "0.3,0.6", "--k", "4", "-q"]
    assert _cli(capsys, *argv, "--ray", "local") == _cli(capsys, *argv)


def test_cli_ray_options_are_checked(tmp_path, capsys):
    from pefa_gpu.cli import main

    for argv, msg in ((["--workers", "2"], "--workers has no effect without --ray"),
                      (["--work-dir", str(tmp_path)], "--work-dir has no effect without"),
                      (["--ray", "auto"], "--ray auto needs --work-dir")):
        assert main(["eval", str(tmp_path), *argv]) == 2
        assert msg in capsys.readouterr().err


def test_a_local_cluster_has_at_most_the_cpus_here(tmp_path, capsys):
    pytest.importorskip("ray")
    from pefa_gpu.cli import main

    argv = ["eval", str(tmp_path), "--ray", "local", "--workers", str(2**31 - 1)]
    assert main(argv) == 2  # it hung in ray.init(num_cpus=2**31 - 1)
    err = capsys.readouterr().err
    assert f"workers must be at most the {os.cpu_count()} CPUs here for a local cluster" in err


@pytest.mark.ray
@pytest.mark.slow
def test_scifact_from_text_to_metrics(scifact_dir, tmp_path, ray_runner):
    """A SciFact subset, encoded by the offline model on the cluster, through every stage to
    the metrics: embeddings equal to the dataset's precomputed ones to float32 rounding,
    metrics and (exact backend) ids equal to the library's in one process on them."""
    from pefa_gpu.distributed import RayRunner
    from pefa_gpu.sweep import Config

    ds = pg.load_beir(scifact_dir)
    tr, Y = ds.qrels("train", binary=True)
    te, Yt = ds.qrels("test")
    tr, Y, te, Yt = tr[:30], Y.csr[:30], te[:20], Yt.csr[:20]
    docs = np.union1d(np.union1d(Y.indices, Yt.indices), np.arange(20))
    Y, Yt = Y[:, docs], Yt[:, docs]
    texts = [ds.corpus_texts[j] for j in docs]
    q_texts = [ds.query_texts[i] for i in tr]
    t_texts = [ds.query_texts[i] for i in te]
    run = RayRunner(workers=1)  # one encoder actor: a single model load on these 2 cores
    enc = pp.encode(texts + q_texts + t_texts, tmp_path / "enc", rows=80, runner=run,
                    show_progress=False)
    # the dataset's precomputed all-MiniLM-L6-v2 embeddings, made elsewhere
    P_ref, Q_ref = ds.embeddings("all-MiniLM-L6-v2")
    want = np.concatenate([P_ref[docs], Q_ref[tr], Q_ref[te]])
    np.testing.assert_allclose(pp.read_rows(enc), want, rtol=0, atol=2e-6)
    bounds = np.cumsum([0, len(texts), len(q_texts), len(t_texts)])
    P, Q, T = (pp.read_rows(enc, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]))
    stages_ = [pp.write_rows(x, tmp_path / name) for name, x in
               (("docs", P), ("train", Q), ("test", T))]
    configs = [Config("erm"), Config("xs", 0.5), Config("xl", 0.1, 16)]
    got = pp.evaluate_configs(*stages_[:2], Y, stages_[2], Yt, configs, tmp_path / "work",
                              candidates=100, runner=ray_runner, show_progress=False)
    models = [pg.ERM(device="cpu").fit(P), pg.PEFAXS(lam=0.5, device="cpu").fit(P, Q, Y),
              pg.PEFAXL(lam=0.1, k=16, search_params=pg.XLSearchParams(candidates=100),
                        device="cpu").fit(P, Q, Y)]
    for cfg, res, model in zip(configs, got, models):
        ids = model.search(T, 100)[1]
        want = pg.evaluate(ids, Yt, (10, 100))
        assert res == pytest.approx(want, abs=1e-12), cfg
    build = pp.build("xl", tmp_path / "xl", stages_[0], queries=stages_[1],
                     relevance=pp.write_relevance(Y, tmp_path / "pairs", rows=20),
                     doc_rows=50, lam=0.1, k=16, candidates=100, runner=ray_runner)
    assert torch.equal(pp.search(build, stages_[2], runner=ray_runner)[1],
                       models[2].search(T, 100)[1])
