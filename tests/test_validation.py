"""Bad input gets a clear error naming what is wrong."""

import re

import numpy as np
import scipy.sparse as sp
import pytest
import torch

import pefa_gpu as pg
from pefa_gpu.errors import InputError
from pefa_gpu.methods import method, takes
from pefa_gpu.params import check_at_most, check_nonnegative, check_positive
from pefa_gpu.splits import split_queries
from conftest import unit_rows


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    P, Q, T = unit_rows(rng, 20, 8), unit_rows(rng, 10, 8), unit_rows(rng, 3, 8)
    Y = pg.Relevance.from_pairs(np.arange(10), np.arange(10), shape=(10, 20))
    return P, Q, Y, T


@pytest.mark.parametrize("cls", [pg.PEFAXS, pg.PEFAXL])
def test_fit_errors(cls, data):
    P, Q, Y, T = data
    with pytest.raises(ValueError, match="dimension 7"):
        cls().fit(P, Q[:, :7], Y)
    bad = P.copy()
    bad[4, 2] = np.inf
    with pytest.raises(ValueError, match=r"NaN or inf \(rows \[4\]"):
        cls().fit(bad, Q, Y)
    with pytest.raises(ValueError, match="21 document"):
        cls().fit(P[:19], Q, Y) if False else cls().fit(np.vstack([P, P[:1]]), Q, Y)
    with pytest.raises(ValueError, match="9 query"):
        cls().fit(P, Q[:9], Y)
    with pytest.raises(ValueError, match="no nonzero"):
        cls().fit(P, Q, pg.Relevance.from_pairs([], [], shape=(10, 20)))
    with pytest.raises(ValueError, match="2-D"):
        cls().fit(P[0], Q, Y)


@pytest.mark.parametrize("make,msg", [
    (lambda: pg.PEFAXS(lam=1.5), "lam"), (lambda: pg.PEFAXS(lam=-0.1), "lam"),
    (lambda: pg.PEFAXL(lam=2), "lam"), (lambda: pg.PEFAXL(k=0), "k must"),
    (lambda: pg.PEFAXL(k=2.5), "k must"), (lambda: pg.XLSearchParams(candidates=-1), "candidates"),
    (lambda: pg.PEFAXL(knn_norm="sum"), "knn_norm"), (lambda: pg.PEFAXS(lamda=0.5), "lamda"),
    (lambda: pg.ERM(backend="nope"), "backend"), (lambda: pg.ERM(device="tpu"), "device"),
    (lambda: pg.ERM(device="meta"), "only cpu and cuda"),
    (lambda: pg.ERM(device="mps"), "only cpu and cuda"),
    # 1 == True in Python: a boolean choice took 1 / 0 / 1.0 (and stored them so)
    (lambda: pg.PEFAXL(augment_docs=1), r"augment_docs must be one of \[True, False\], got 1"),
    (lambda: pg.PEFAXL(rescore=0.0), r"rescore must be one of \[True, False\], got 0.0"),
])
def test_param_errors(make, msg):
    with pytest.raises(ValueError, match=msg):
        make()


@pytest.mark.parametrize("make,msg", [
    # an array compared elementwise: stored as the setting, or a bare 'truth value' ValueError
    (lambda: pg.XLParams(knn_norm=np.array(["k"])), "knn_norm must be one of"),
    (lambda: pg.PEFAXL(knn_norm=np.array(["k", "k"])), "knn_norm must be one of"),
    (lambda: pg.ERM(device=2**70), "device=1180591620717411303424 is not a valid"),  # overflow
    (lambda: pg.XSParams.from_json("{"), "XSParams.from_json: not valid JSON"),  # bare error
    (lambda: pg.XSParams.from_json("[1]"), "from_json: expected a JSON object"),
    (lambda: pg.XSParams.from_json("[" * 10**5), "XSParams.from_json: not valid JSON"),  # Recursion
    (lambda: pg.XSParams.from_dict({1: 0, "x": 0}), r"unknown keys \['x', 1\]"),  # '<' TypeError
    (lambda: split_queries(10.5), "n_queries must be an int >= 0, got 10.5"),  # AxisError
    (lambda: split_queries(2**40), "n_queries must be at most"),  # numpy's MemoryError, 8 TiB
    (lambda: split_queries("10"), "n_queries must be an int"),
    (lambda: method(["xs"]), r"unknown method \['xs'\]"),  # unhashable type: 'list'
    (lambda: takes(["zzz"], "lam"), "unknown method 'zzz'"),  # KeyError 'zzz'
])
def test_wrong_values_and_types_are_named(make, msg):
    with pytest.raises(InputError, match=msg):
        make()
    with pytest.raises(TypeError, match="from_dict takes a dict, got NoneType"):
        pg.XSParams.from_dict(None)  # 'NoneType' object is not iterable
    with pytest.raises(TypeError, match="got the str 'xs'"):
        takes("xs", "lam")  # its letters: KeyError 'x'
    assert split_queries(np.int64(5))[1].size == 1 and takes(["xs"], "lam")


def test_from_json_names_a_text_of_another_type():
    with pytest.raises(TypeError, match="XSParams.from_json takes a str, got NoneType"):
        pg.XSParams.from_json(None)  # json's 'the JSON object must be str ...' named no argument


def test_numpy_numbers_are_numbers():
    # a numpy val_fraction / seed was refused as "not strictly between 0 and 1" / "not an int"
    fit, val = split_queries(10, np.float32(0.3), np.int64(2))
    want = np.random.default_rng(2).permutation(10)
    assert val.tolist() == sorted(want[:3]) and fit.tolist() == sorted(want[3:])
    assert pg.NUDGE(val_fraction=np.float64(0.25), seed=np.uint8(1)).params.seed == 1
    for bad in (np.bool_(True), np.float64("nan"), np.float32(1.0)):
        with pytest.raises(InputError, match="val_fraction must lie strictly between 0 and 1"):
            split_queries(10, bad)


def test_search_errors(data):
    P, Q, Y, T = data
    model = pg.PEFAXL().fit(P, Q, Y)
    with pytest.raises(ValueError, match="topk"):
        model.search(T, topk=0)
    with pytest.raises(ValueError, match="dimension 5"):
        model.search(T[:, :5], topk=3)
    with pytest.raises(ValueError, match="NaN"):
        model.search(np.full((1, 8), np.nan, dtype=np.float32), topk=3)
    with pytest.raises(ValueError, match="not fitted"):
        pg.ERM().search(T)
    with pytest.raises(ValueError, match="array"):
        model.search("not an array")


def test_unnormalised_embeddings_warn_not_fail(data):
    P, Q, Y, T = data
    with pytest.warns(UserWarning, match="not L2-normalised"):
        model = pg.PEFAXS().fit(P * 3, Q, Y)
    assert model.search(T, 3)[1].shape == (3, 3)


def test_the_norm_warning_reports_norms_float32_cannot_square():
    """Rows scaled by 1e30 / 1e-30 were reported as 'norms from 0 to inf' (float32 squares
    overflow and underflow); the extreme rows are measured in float64."""
    P = unit_rows(np.random.default_rng(4), 20, 8)
    P[3] *= np.float32(1e30)
    P[5] *= np.float32(1e-30)
    want = [np.linalg.norm(P[i].astype(np.float64)) for i in (5, 3)]
    with pytest.warns(UserWarning, match=re.escape(f"2 of 20 rows are not L2-normalised "
                                                   f"(norms from {want[0]:.3g} to {want[1]:.3g})")):
        pg.ERM(device="cpu").fit(P)


def test_single_query_vector_is_accepted(data):
    P, Q, Y, T = data
    model = pg.ERM().fit(P)
    assert torch.equal(model.search(T[0], 4)[1], model.search(T[:1], 4)[1])
    with pytest.raises(InputError, match=r"queries has dimension 5, expected 8"):
        model.search(T[0, :5], 4)  # was 'queries must be 2-D (rows, dim), got shape (5,)'


def test_params_round_trip_json():
    p = pg.XLParams(lam=0.2, k=32)
    assert pg.XLParams.from_json(p.to_json()) == p
    with pytest.raises(ValueError, match="unknown keys"):
        pg.XLParams.from_dict({"lam": 0.2, "bogus": 1})
    with pytest.raises(TypeError):
        pg.XLParams(0.2)  # keyword-only
    with pytest.raises(Exception):
        p.lam = 0.3  # frozen


def test_numpy_scalars_are_accepted_as_params():
    p = pg.XLParams(lam=np.float32(0.25), k=np.int64(8))
    assert p == pg.XLParams(lam=0.25, k=8)
    assert pg.XLParams.from_json(p.to_json()) == p
    s = pg.XLSearchParams(candidates=np.int32(50))
    assert s == pg.XLSearchParams(candidates=50) and type(s.candidates) is int
    assert pg.XLSearchParams.from_json(s.to_json()) == s


@pytest.mark.parametrize("check", [check_positive, check_nonnegative,
                                   lambda v, name: check_at_most(v, name, 16)])
def test_integer_checks_take_numpy_integers_and_return_python_ints(check):
    for value in (16, np.int64(16), np.int32(16), np.uint8(16)):
        out = check(value, "n")
        assert out == 16 and type(out) is int
    for bad in (True, np.bool_(True), 16.0, np.float64(16), "16", None, -1, np.int64(-1)):
        with pytest.raises(InputError, match=f"n must be .*, got {re.escape(repr(bad))}"):
            check(bad, "n")


def test_check_at_most_names_the_bound():
    assert check_at_most(np.int64(16), "M", 16) == 16
    with pytest.raises(InputError, match="M must be at most 16, got 17"):
        check_at_most(np.int64(17), "M", 16)


@pytest.mark.parametrize("bad", [np.array([["a", "b"]]), np.array([[b"x", b"y"]]),
                                 np.array([["2020-01-01"]], dtype="datetime64[D]")])
def test_non_numeric_arrays_are_named(bad):
    with pytest.raises(ValueError, match=re.escape(f"P has dtype {bad.dtype}; pass a numeric")):
        pg.ERM(device="cpu").fit(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 3, 40_000])
def test_host_clone_is_an_equal_copy_in_its_own_memory(dtype, rows):
    from pefa_gpu.arrays import host_clone

    src = torch.randn(rows, 33, generator=torch.Generator().manual_seed(rows)).to(dtype)
    src = src[:, 1:]  # not contiguous
    out = host_clone(src)
    assert out.dtype == dtype and out.shape == src.shape and out.is_contiguous()
    assert torch.equal(out, src)
    if rows:
        out[0, 0] += 1
        assert not torch.equal(out, src)


def test_a_fitted_model_keeps_its_own_copy_of_the_documents():
    P = unit_rows(np.random.default_rng(3), 50, 8)
    model = pg.ERM(device="cpu").fit(P)
    before = model.search(P[:2], 3)
    P[:] = 0.0
    after = model.search(unit_rows(np.random.default_rng(3), 50, 8)[:2], 3)
    assert torch.equal(before[1], after[1]) and torch.equal(before[0], after[0])


@pytest.mark.parametrize("dtype,q_dtype", [("float32", np.float32), ("float16", np.float32),
                                           ("float16", np.float16)])
def test_xl_copies_the_training_queries_only_for_an_index_that_would_share_them(
        dtype, q_dtype, monkeypatch):
    """A float16 query index casts Q straight (no float32 copy of Q first), and copies a Q
    already in float16; a float32 one shares its rows, so it gets a copy. Either way, editing Q
    after the fit changes nothing."""
    from pefa_gpu.index import ExactIndex

    rng = np.random.default_rng(4)
    P, Q = unit_rows(rng, 40, 8), unit_rows(rng, 30, 8).astype(q_dtype)
    Y = sp.csr_matrix((np.ones(30, np.float32), rng.integers(0, 40, 30), np.arange(31)), (30, 40))
    given, build = [], ExactIndex.build
    monkeypatch.setattr(ExactIndex, "build", lambda self, v: given.append(v) or build(self, v))
    model = pg.PEFAXL(device="cpu", index_params={"dtype": dtype}).fit(P, Q, Y)
    rows = given[1].numpy() if isinstance(given[1], torch.Tensor) else given[1]
    assert np.shares_memory(rows, Q) == (dtype == "float16")
    T = unit_rows(rng, 5, 8)
    before = model.search(T, 6)
    Q[:] = 0.0
    after = model.search(T, 6)
    assert torch.equal(before[1], after[1]) and torch.equal(before[0], after[0])


@pytest.mark.parametrize("make", [lambda: pg.PEFAXS(), lambda: pg.PEFAXL(),
                                  lambda: pg.PEFAXL(index_params={"dtype": "float16"})],
                         ids=["xs", "xl", "xl-float16"])
def test_nan_in_a_memory_mapped_q_is_named(make, tmp_path):
    """Q read where it lies (a memory map, never copied first) is still checked: the error
    names Q and the row, whichever index reads it."""
    rng = np.random.default_rng(8)
    P, Q = unit_rows(rng, 40, 8), unit_rows(rng, 30, 8)
    Q[7, 5] = np.inf
    np.save(tmp_path / "Q.npy", Q)
    Y = sp.csr_matrix((np.ones(30, np.float32), rng.integers(0, 40, 30), np.arange(31)), (30, 40))
    with pytest.raises(pg.InputError, match=r"Q contains NaN or inf \(rows \[7\]"):
        make().fit(P, np.load(tmp_path / "Q.npy", mmap_mode="r"), Y)


@pytest.mark.parametrize("bad", [dict(val_fraction=v) for v in (0, 1.0, -0.1, True, "0.2",
                                                                  float("nan"), float("inf"))]
                         + [dict(seed=s) for s in (1.5, True, "0", None, -1)])
@pytest.mark.parametrize("make", [lambda **kw: pg.NUDGE(**kw),
                                  lambda **kw: pg.QueryAdapter(**kw)],
                         ids=["nudge", "query-adapter"])
def test_held_out_split_settings_are_checked(make, bad):
    with pytest.raises(pg.InputError, match=next(iter(bad))):
        make(**bad)
    make(val_fraction=0.5, seed=3)  # the limits are strict, a valid pair is kept


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("size", [1, 384, 70_000, 1 << 20])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
def test_all_finite_against_numpy(dtype, size, bad):
    from pefa_gpu.arrays import all_finite

    rng = np.random.default_rng(size)
    x = rng.uniform(-60000, 60000, size)
    if bad is not None:
        x[rng.integers(size)] = bad
    t = torch.from_numpy(x).to(dtype)
    assert all_finite(t.reshape(-1, 1)) is bool(np.isfinite(t.double().numpy()).all())
    assert all_finite(t) is (bad is None)


@pytest.mark.parametrize("make", [lambda: pg.ERM(device="cpu"), lambda: pg.PEFAXS(device="cpu"),
                                  lambda: pg.PEFAXL(device="cpu", k=4),
                                  lambda: pg.NUDGE(device="cpu", gamma=0.5)])
def test_big_endian_arrays_are_read_as_their_values(make):
    """A '>f4' array (np.load of a file written so) was torch.from_numpy's bare ValueError
    ('byte order different from the native'); it is now read as the numbers it holds."""
    rng = np.random.default_rng(9)
    P, Q, T = (unit_rows(rng, n, 8) for n in (30, 20, 5))
    Y = sp.csr_matrix((np.ones(20, np.float32), (np.arange(20), np.arange(20))), shape=(20, 30))
    fit = (lambda m, p, q: m.fit(p)) if isinstance(make(), pg.ERM) else \
        (lambda m, p, q: m.fit(p, q, Y))
    want = fit(make(), P, Q).search(T, 5)
    big = [a.astype(">f4") for a in (P, Q, T)]
    model = fit(make(), big[0], big[1])
    got = model.search(big[2], 5)
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    assert torch.equal(model.score(big[2], got[1]), model.score(T, got[1]))
    assert np.array_equal(big[0], P)  # the caller's arrays as they were


def small_xl(seed):
    """A PEFA-XL (k=4) over 30 documents and 20 training queries of dimension 8, 5 test queries
    T (numpy) / q (torch), and their passage search (top 10) and neighbours (top 4)."""
    rng = np.random.default_rng(seed)
    P, Q, T = unit_rows(rng, 30, 8), unit_rows(rng, 20, 8), unit_rows(rng, 5, 8)
    Y = sp.csr_matrix((np.ones(20, np.float32), (np.arange(20), np.arange(20))), shape=(20, 30))
    xl = pg.PEFAXL(device="cpu", k=4).fit(P, Q, Y)
    q = torch.from_numpy(T)
    erm, knn = xl.index.search(q, 10), xl.neighbours(q, 4)
    return xl, T, q, erm, knn


def test_xl_fuse_checks_its_searches_lams_and_ks():
    """fuse / fuse_grid took malformed searches to numpy's broadcasting / IndexError / max()
    errors, or fused them silently (knn of other rows, ks=(0,), lam=2 or NaN);
    neighbours(k=None) was a bare TypeError."""
    xl, T, q, erm, knn = small_xl(3)
    want = xl.search(T, 5)
    got = xl.fuse(q, erm, knn, 5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for bad_erm, bad_knn in [((erm[0][:3], erm[1][:3]), knn), (erm, (knn[0][:3], knn[1][:3])),
                             ((erm[0], erm[1][:, :5]), knn), (erm, (knn[0], knn[1].float())),
                             ((erm[0][0], erm[1][0]), knn), ((erm[0],), knn), (erm, None)]:
        with pytest.raises(InputError, match=r"must be \(scores, ids\): float and integer"):
            xl.fuse(q, bad_erm, bad_knn, 5)
    for bad_q in (q[:, :4], q[None], T.tolist(), q.long()):
        with pytest.raises(InputError, match=r"q must be a \(B, 8\) float array"):
            xl.fuse(bad_q, erm, knn, 5)
    for lams, ks, match in [((0.5,), (), "ks is empty"), ((2.0,), (4,), "lam must be"),
                            ((float("nan"),), (4,), "lam must be"), ((0.5,), (0,), "k must be"),
                            ((0.5,), (1.5,), "k must be"), (0.5, 4, "must be sequences")]:
        with pytest.raises(InputError, match=match):
            xl.fuse_grid(q, erm, knn, lams, ks, 5)
    for k in (None, "3", 0):
        with pytest.raises(InputError, match="k must be a positive integer"):
            xl.neighbours(q, k)
    # ids outside [-1, n) / [-1, rows of Y): a document id n + 5 came back as a result, a
    # neighbour row past Y was numpy's IndexError (on CUDA: reads past the arrays)
    for value, name in ((30 + 5, "erm"), (-7, "erm"), (10**6, "knn")):
        pair = erm if name == "erm" else knn
        forged = (pair[0], torch.full_like(pair[1], value))
        with pytest.raises(InputError, match=rf"{name} ids must be in \[-1, "):
            xl.fuse(q, *((forged, knn) if name == "erm" else (erm, forged)), 5)
    # a repeated λ or k fused every query twice: 2B rows under one key
    twice = xl.fuse_grid(q, erm, knn, (0.5, 0.5, 0.5), (4, 4), 5)
    once = xl.fuse_grid(q, erm, knn, (0.5,), (4,), 5)
    assert list(twice) == [(0.5, 4)] and all(map(torch.equal, twice[(0.5, 4)], once[(0.5, 4)]))


def test_xl_fuse_refuses_unsigned_ids_and_neighbours_checks_q_and_erm():
    """Unsigned ids: numpy uint32 / uint64 were numpy's OverflowError / TypeError in fuse, a
    torch uint8 pair an 'ids must be in [-1, 30)' error for ids in range (-1 compared as 255),
    torch uint64 a RuntimeError; now one InputError (-1 is the padding: ids are signed).
    neighbours took an erm of other rows to torch's RuntimeError, one with ids past the
    documents to neighbour rows past Y, a list to an AttributeError, and NaN numpy queries
    unchecked."""
    xl, T, q, erm, knn = small_xl(5)
    as_np = (erm[0].numpy(), erm[1].numpy())
    for ids in (as_np[1].astype(np.uint32), as_np[1].astype(np.uint64), erm[1].to(torch.uint8),
                erm[1].to(torch.uint64)):
        scores = erm[0] if isinstance(ids, torch.Tensor) else as_np[0]
        with pytest.raises(InputError, match=r"erm ids must be signed integers .*, got .*uint"):
            xl.fuse(T if isinstance(ids, np.ndarray) else q, (scores, ids), knn, 5)
    for bad in ((erm[0][:2], erm[1][:2]), [1, 2], (erm[0], erm[1].float())):
        with pytest.raises(InputError, match=r"erm must be \(scores, ids\)"):
            xl.neighbours(q, 4, erm=bad)
    with pytest.raises(InputError, match=r"erm ids must be in \[-1, 30\)"):
        xl.neighbours(q, 4, erm=(erm[0], erm[1] + 30))
    with pytest.raises(InputError, match="q contains NaN or inf"):
        xl.neighbours(T * np.nan, 4)
    got = xl.neighbours(q, 4, erm=as_np)  # numpy erm, torch q: results as q's
    assert all(torch.equal(g, w) for g, w in zip(got, knn))


def test_xs_embeddings_takes_a_numpy_lam_as_the_params_do(data):
    """xs_embeddings(np.float32(0.3)) was 'lam must be a number in [0, 1]', though PEFAXS(lam=)
    and fuse_grid's lams take numpy scalars."""
    P, Q, Y, _ = data
    xs = pg.PEFAXS(device="cpu").fit(P, Q, Y)
    want = xs.xs_embeddings(float(np.float32(0.3)))
    assert torch.equal(xs.xs_embeddings(np.float32(0.3)), want)
    assert torch.equal(xs.xs_embeddings(1), xs.xs_embeddings(1.0))
    for bad in (np.float64(2.0), True, float("nan"), "0.5"):
        with pytest.raises(InputError, match="lam must be a number in"):
            xs.xs_embeddings(bad)


def test_sparse_and_meta_tensors_are_named_not_torch_errors():
    """A torch sparse tensor was a TypeError / RuntimeError from torch ('Cannot access data
    pointer'), a meta tensor a NotImplementedError ('Cannot copy out of meta tensor')."""
    rng = np.random.default_rng(4)
    P, T = unit_rows(rng, 20, 8), torch.from_numpy(unit_rows(rng, 3, 8))
    erm = pg.ERM(device="cpu").fit(P)
    for bad, what in [(T.to_sparse(), "torch.sparse_coo"), (T.to_sparse_csr(), "torch.sparse_csr"),
                      (torch.empty(3, 8, device="meta"), "torch.strided tensor on meta")]:
        for call in (lambda: erm.search(bad, 2), lambda: erm.add_documents(bad),
                     lambda: pg.ERM(device="cpu").fit(bad)):
            with pytest.raises(InputError, match=re.escape(what)):
                call()


def test_nested_quantized_and_long_double_arrays_are_named_not_torch_errors():
    """A nested tensor was torch's RuntimeError ('Internal error: NestedTensorImpl doesn't
    support sizes'), a quantized one 'Creation of quantized tensor requires quantized dtype', a
    numpy long double torch.from_numpy's TypeError naming no array."""
    rng = np.random.default_rng(4)
    P, T = unit_rows(rng, 20, 8), torch.from_numpy(unit_rows(rng, 3, 8))
    erm = pg.ERM(device="cpu").fit(P)
    for bad, what in [(torch.nested.nested_tensor(list(T)), "is a nested (ragged) tensor"),
                      (torch.quantize_per_tensor(T, 0.1, 0, torch.qint8), "dtype torch.qint8"),
                      (T.numpy().astype(np.longdouble), "which torch does not read")]:
        for call in (lambda: pg.ERM(device="cpu").fit(bad), lambda: erm.search(bad, 2)):
            with pytest.raises(InputError, match=re.escape(what)):
                call()


def test_a_reversed_single_row_view_is_read_as_its_values():
    """x[::-1] of a (1, d) array has a negative row stride yet numpy calls it C-contiguous:
    torch.from_numpy's bare ValueError ('negative strides are not supported') in search,
    score, fit and add_documents."""
    rng = np.random.default_rng(12)
    P, T = unit_rows(rng, 20, 8), unit_rows(rng, 1, 8)
    rev = T[::-1]
    assert rev.flags.c_contiguous and rev.strides[0] < 0
    erm = pg.ERM(device="cpu").fit(P)
    want = erm.search(T, 3)
    got = erm.search(rev, 3)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(erm.score(rev, got[1]), erm.score(T, got[1]))
    assert erm.add_documents(rev).n_docs == 21
    assert pg.ERM(device="cpu").fit(P[:1][::-1]).n_docs == 1


def test_float64_values_past_float32_range_are_named_not_called_inf():
    """float64 rows holding 1e39 (finite) became inf in the float32 cast and were reported as
    'contains NaN or inf'; a real NaN in float64 rows still is."""
    rng = np.random.default_rng(12)
    P = unit_rows(rng, 20, 8).astype(np.float64)
    P[3, 1] = 1e39
    with pytest.raises(pg.InputError, match=r"P holds values past float32's range \(largest "
                                            r"magnitude 1e\+39\)"):
        pg.ERM(device="cpu").fit(P)
    erm = pg.ERM(device="cpu").fit(unit_rows(rng, 20, 8))
    q = unit_rows(rng, 2, 8).astype(np.float64)
    q[1, 0] = -4e38
    with pytest.raises(pg.InputError, match="queries holds values past float32's range"):
        erm.search(q, 3)
    q[1, 0] = np.nan
    with pytest.raises(pg.InputError, match=r"queries contains NaN or inf \(rows \[1\]"):
        erm.search(q, 3)
