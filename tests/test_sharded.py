"""ShardedIndex: shards simulated on the CPU give exactly the single-index result, ties too."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import pefa_gpu as pg
from pefa_gpu.index import make_index
from pefa_gpu.index.sharded import ShardedIndex
from conftest import make_model, unit_rows


def ref_search(X: np.ndarray, T: np.ndarray, k: int):
    """float64 brute force: best k per row, ties to the lower id, (-inf, -1) padding."""
    s = T.astype(np.float64) @ X.astype(np.float64).T
    vals = np.full((len(T), k), -np.inf)
    ids = np.full((len(T), k), -1, dtype=np.int64)
    for r in range(len(T)):
        o = np.lexsort((np.arange(X.shape[0]), -s[r]))[:k]
        vals[r, :o.size], ids[r, :o.size] = s[r, o], o
    return vals, ids


def tied_data(seed: int, n: int = 97, b: int = 21, d: int = 6):
    """Vectors on a 1/4 grid (exact fp32 scores, many ties) with duplicated rows."""
    rng = np.random.default_rng(seed)
    X = rng.integers(-2, 3, (n, d)).astype(np.float32) / 4
    X[10:20] = X[0]
    T = rng.integers(-2, 3, (b, d)).astype(np.float32) / 4
    T[3] = 0.0  # every score ties
    return X, T


@pytest.mark.parametrize("shards", [1, 2, 3, 7, 120])
@pytest.mark.parametrize("k", [1, 5, 40, 150])
def test_cpu_shards_equal_single_index_and_reference(shards, k):
    X, T = tied_data(shards * 31 + k)
    idx = make_index("sharded", "cpu", {"devices": ["cpu"] * shards})
    idx.build(torch.from_numpy(X))
    assert idx.ntotal == X.shape[0] and idx.dim == X.shape[1] and len(idx.shards) == shards
    got_s, got_i = idx.search(torch.from_numpy(T), k)
    one_s, one_i = make_index("exact", "cpu").build(torch.from_numpy(X)).search(
        torch.from_numpy(T), k)
    ref_s, ref_i = ref_search(X, T, k)
    assert torch.equal(got_i, one_i) and torch.equal(got_s, one_s)
    np.testing.assert_array_equal(got_i.numpy(), ref_i)
    np.testing.assert_array_equal(got_s.numpy(), ref_s.astype(np.float32))
    assert got_s.dtype == torch.float32 and got_i.dtype == torch.int64


def test_add_update_reconstruct_and_small_budget_shards():
    X, T = tied_data(5)
    idx = make_index("sharded", "cpu", {"devices": ["cpu"] * 3,
                                        "backend_params": {"memory_budget": 65536}})
    idx.build(torch.from_numpy(X[:50]))
    idx.add(torch.from_numpy(X[50:]))
    ref_s, ref_i = ref_search(X, T, 9)
    s, i = idx.search(torch.from_numpy(T), 9)
    np.testing.assert_array_equal(i.numpy(), ref_i)
    ids = torch.tensor([0, 16, 33, 96, 60])
    assert torch.equal(idx.reconstruct(ids), torch.from_numpy(X[ids.numpy()]))
    for bad in ([-1], [len(X)]):  # not a zero row
        with pytest.raises(pg.InputError, match="out of range"):
            idx.reconstruct(torch.tensor(bad))
    two = make_index("sharded", "cpu", {"devices": ["cpu"] * 3}).build(torch.from_numpy(X[:2]))
    assert 0 in [shard.ntotal for shard in two.shards]  # an empty shard is passed over
    assert torch.equal(two.reconstruct(torch.tensor([1, 0])), torch.from_numpy(X[[1, 0]]))
    new = np.ones((5, X.shape[1]), np.float32)
    idx.update(ids, torch.from_numpy(new))
    X2 = X.copy()
    X2[ids.numpy()] = new
    s, i = idx.search(torch.from_numpy(T), 9)
    np.testing.assert_array_equal(i.numpy(), ref_search(X2, T, 9)[1])
    with pytest.raises(pg.InputError, match="out of range"):
        idx.update(torch.tensor([97]), torch.from_numpy(new[:1]))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_an_update_a_later_shard_refuses_leaves_every_shard_unchanged(dtype):
    """Rows 1 (shard 0) and 7 (shard 1): shard 1 refused its row after shard 0 had written
    row 1, so a failed update left the index half updated."""
    idx = ShardedIndex({"devices": ["cpu", "cpu"], "backend_params": {"dtype": dtype}}, "cpu")
    idx.build(torch.arange(30, dtype=torch.float32).reshape(10, 3))
    before = idx.reconstruct(torch.arange(10))
    for value in [float("nan")] + [1e6] * (dtype == "float16"):  # 1e6: float16's inf
        with pytest.raises(pg.InputError, match="NaN or inf"):
            idx.update(torch.tensor([1, 7]), torch.tensor([[9.0] * 3, [value] * 3]))
        assert torch.equal(idx.reconstruct(torch.arange(10)), before)


def test_empty_and_errors():
    idx = ShardedIndex({"devices": ["cpu", "cpu"]}, "cpu")
    s, i = idx.search(torch.zeros(2, 3), 4)
    assert (i == -1).all() and torch.isinf(s).all()
    with pytest.raises(pg.InputError, match="devices"):
        ShardedIndex({"devices": []}, "cpu")
    with pytest.raises(pg.InputError, match="itself"):
        ShardedIndex({"backend": "sharded"}, "cpu")
    with pytest.raises(pg.InputError, match="backend"):
        ShardedIndex({"backend": "nope"}, "cpu")
    idx.build(torch.ones(4, 3))
    with pytest.raises(pg.InputError, match="shape"):
        idx.search(torch.ones(2, 5), 1)
    # fewer rows than shards of a backend that builds no empty index: was named as (0, 8)
    pytest.importorskip("faiss")
    ivf = ShardedIndex({"devices": ["cpu"] * 3, "backend": "ivf"}, "cpu")
    with pytest.raises(pg.InputError, match="2 vectors cannot fill 3 shards: backend 'ivf'"):
        ivf.build(unit_rows(np.random.default_rng(1), 2, 8))


@pytest.mark.parametrize("shards", [2, 5])
def test_sharded_models_equal_unsharded(tmp_path, shards):
    rng = np.random.default_rng(shards)
    n, m, d = 80, 150, 8
    P = rng.integers(-2, 3, (n, d)).astype(np.float32)
    P /= np.maximum(np.linalg.norm(P, axis=1, keepdims=True), 1)
    Q = P[rng.integers(0, n, m)] + 0.25 * rng.integers(-1, 2, (m, d)).astype(np.float32)
    Q /= np.linalg.norm(Q, axis=1, keepdims=True)
    Y = sp.csr_matrix((np.ones(m, np.float32), (np.arange(m), rng.integers(0, n, m))),
                      shape=(m, n))
    T = Q[:30]
    params = {"devices": ["cpu"] * shards}
    for cls, kw in ((pg.PEFAXL, dict(k=4, candidates=20)), (pg.PEFAXS, {}), (pg.ERM, {})):
        args = (P,) if cls is pg.ERM else (P, Q, Y)
        with _nowarn():
            a = make_model(cls, backend="exact", device="cpu", **kw).fit(*args)
            b = make_model(cls, backend="sharded", device="cpu", index_params=params,
                           **kw).fit(*args)
        sa, ia = a.search(T, topk=12)
        sb, ib = b.search(T, topk=12)
        assert torch.equal(ia, ib), cls.__name__
        np.testing.assert_allclose(sa.numpy(), sb.numpy(), rtol=1e-6, atol=1e-6)
        if hasattr(pg, "load"):
            b.save(tmp_path / cls.__name__)
            back = pg.load(tmp_path / cls.__name__, device="cpu")
            assert torch.equal(back.search(T, topk=12)[1], ib)


class _nowarn:
    def __enter__(self):
        import warnings
        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        return self._w.__exit__(*exc)


@pytest.mark.gpu
def test_every_visible_gpu_gets_a_shard():
    X, T = tied_data(9, n=5000)
    idx = make_index("sharded", "cuda").build(torch.from_numpy(X))
    assert len(idx.shards) == torch.cuda.device_count()
    s, i = idx.search(torch.from_numpy(T), 17)
    assert i.device.type == "cuda"
    np.testing.assert_array_equal(i.cpu().numpy(), ref_search(X, T, 17)[1])


def test_sharded_passes_the_shard_backends_search_params(tmp_path):
    pytest.importorskip("faiss")
    from pefa_gpu.errors import InputError
    from pefa_gpu.index.ivf import IVFSearchParams

    rng = np.random.default_rng(20)
    X = rng.standard_normal((2400, 16)).astype(np.float32)
    T = rng.standard_normal((40, 16)).astype(np.float32)
    idx = make_index("sharded", "cpu", {"devices": ["cpu", "cpu"], "backend": "ivf",
                                        "backend_params": {"nlist": 20, "threads": 1}},
                     search_params={"nprobe": 1})
    assert idx.SearchParams is IVFSearchParams and idx.search_params == IVFSearchParams(nprobe=1)
    idx.build(torch.from_numpy(X))
    _, truth = ref_search(X, T, 10)
    _, one = idx.search(torch.from_numpy(T), 10)  # the defaults: one list per shard
    _, every = idx.search(torch.from_numpy(T), 10, params={"nprobe": 20})
    np.testing.assert_array_equal(every.numpy(), truth)  # every list of every shard: exact
    assert (one.numpy() != truth).any()
    assert idx.search_params.nprobe == 1
    with pytest.raises(InputError, match="ef_search"):
        idx.search(torch.from_numpy(T), 10, params={"ef_search": 5})


@pytest.mark.parametrize("offsets", [[0, 99], [0, -5], [0, 39], [3, 40], [0, "40"]])
def test_a_forged_offset_table_is_refused(tmp_path, offsets):
    X = np.random.default_rng(0).standard_normal((80, 6)).astype(np.float32)
    ShardedIndex({"devices": ["cpu"] * 2}, "cpu").build(torch.from_numpy(X)).save(tmp_path)
    meta = json.loads((tmp_path / "shards.json").read_text())
    assert meta["offsets"] == [0, 40]  # the running sum of the sizes, as written
    (tmp_path / "shards.json").write_text(json.dumps({**meta, "offsets": offsets}))
    with pytest.raises(pg.errors.FormatError, match="offsets"):
        ShardedIndex.load(tmp_path, {"devices": ["cpu"] * 2}, "cpu")


def test_shards_of_two_dimensions_are_refused_on_load(tmp_path):
    """Shard 1 of 4-wide rows beside shard 0 of 6-wide ones loaded; its first search said
    'queries must have shape (B, 4)' of 6-wide queries."""
    rng = np.random.default_rng(0)
    for folder, d in (("a", 6), ("b", 4)):
        (tmp_path / folder).mkdir()
        x = torch.from_numpy(rng.standard_normal((80, d)).astype(np.float32))
        ShardedIndex({"devices": ["cpu"] * 2}, "cpu").build(x).save(tmp_path / folder)
    (tmp_path / "b" / "shard_1" / "vectors.npy").replace(tmp_path / "a" / "shard_1" / "vectors.npy")
    with pytest.raises(pg.errors.FormatError, match=r"dimensions \[6, 4\]"):
        ShardedIndex.load(tmp_path / "a", {"devices": ["cpu"] * 2}, "cpu")


def test_a_shard_table_nested_too_deeply_is_a_format_error(tmp_path):
    X = np.random.default_rng(0).standard_normal((80, 6)).astype(np.float32)
    ShardedIndex({"devices": ["cpu"] * 2}, "cpu").build(torch.from_numpy(X)).save(tmp_path)
    (tmp_path / "shards.json").write_text("[" * 200_000 + "]" * 200_000)  # a RecursionError
    with pytest.raises(pg.errors.FormatError, match="shards.json is missing or unreadable"):
        ShardedIndex.load(tmp_path, {"devices": ["cpu"] * 2}, "cpu")
    # read through a link, a NaN size taken as a number: now refused as a save's JSON is
    (tmp_path / "elsewhere.json").write_text('{"offsets": [0, 40], "sizes": [40, 40]}')
    (tmp_path / "shards.json").unlink()
    (tmp_path / "shards.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(pg.errors.FormatError, match="is not a regular file"):
        ShardedIndex.load(tmp_path, {"devices": ["cpu"] * 2}, "cpu")
    (tmp_path / "shards.json").unlink()
    (tmp_path / "shards.json").write_text('{"offsets": [0, 40], "sizes": [40, NaN]}')
    with pytest.raises(pg.errors.FormatError, match="NaN is not a JSON number"):
        ShardedIndex.load(tmp_path, {"devices": ["cpu"] * 2}, "cpu")


def test_xl_scoring_over_sharded_indices_checks_no_ids(monkeypatch):
    """Its neighbours' rows are valid by construction: reading them makes no id check (on
    CUDA each one is a host synchronisation), and the scores equal the unsharded model's."""
    import pefa_gpu.index.base as base
    import pefa_gpu.index.sharded as sharded

    rng = np.random.default_rng(4)
    P, Q, T = (unit_rows(rng, r, 8) for r in (60, 40, 5))
    Y = sp.csr_matrix((np.ones(40, np.float32), (np.arange(40), rng.integers(0, 60, 40))),
                      shape=(40, 60))
    xl = pg.PEFAXL(backend="sharded", device="cpu", k=4,
                   index_params={"devices": ["cpu"] * 2}).fit(P, Q, Y)
    want = pg.PEFAXL(device="cpu", k=4).fit(P, Q, Y).score(T, torch.arange(10).repeat(5, 1))
    checks = []
    for module in (base, sharded):
        real = module.check_row_ids
        monkeypatch.setattr(module, "check_row_ids",
                            lambda *a, real=real, **k: checks.append(1) or real(*a, **k))
    got = xl.score(T, torch.arange(10).repeat(5, 1))
    assert checks == [] and torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("where", ["missing", "not empty", "empty name"])
def test_a_save_into_a_missing_or_used_folder_is_an_input_error(tmp_path, where):
    index = ShardedIndex({"devices": ["cpu"] * 2}, "cpu").build(
        torch.from_numpy(unit_rows(np.random.default_rng(3), 10, 4)))
    target = {"missing": tmp_path / "nowhere", "not empty": tmp_path, "empty name": ""}[where]
    (tmp_path / "theirs.txt").write_text("kept")
    with pytest.raises(pg.InputError, match="save directory"):  # was FileNotFoundError / ...
        index.save(target)
    assert (tmp_path / "theirs.txt").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["theirs.txt"]
