"""The Triton top-k GEMM (pefa_gpu.triton_topk) against the float64 reference: its candidates
and unsettled rows, and exact search through it (ties, duplicates, the rows it leaves to score
blocks, a failing kernel); on the CPU under Triton's interpreter, on CUDA compiled."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
import pefa_gpu.index.exact as exact_module  # noqa: E402
from pefa_gpu import triton_topk as tt  # noqa: E402  (after the skip: imports triton)
from pefa_gpu.index import make_index  # noqa: E402
from pefa_gpu.triton_rowdots import available  # noqa: E402
import reference as ref  # noqa: E402
from test_triton_rowdots import DEVICES, kernel_device  # noqa: E402
from conftest import cuda_syncs  # noqa: E402

pytestmark = pytest.mark.triton
DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def any_size(monkeypatch):
    """The kernel serves the CPU (interpreter) and the tests' small indices."""
    monkeypatch.setattr(tt, "ON_CPU", True)
    monkeypatch.setattr(tt, "UNSETTLED_SHARE", 1e9)


def stored(x: np.ndarray, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.from_numpy(x.astype(np.float32)).to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [40, 37])  # rows of 16-byte multiples (TMA loads), or not
@pytest.mark.parametrize("keep", [2, 3])
def test_candidates_are_the_reference_top_w_where_settled(device, dtype, d, keep, monkeypatch):
    dev = kernel_device(device)
    monkeypatch.setattr(tt, "KEEP", keep)
    rng = np.random.default_rng(d)
    rows = stored(rng.standard_normal((1300, d)), dtype, dev)  # 6 tiles, the last partial
    q = stored(rng.standard_normal((130, d)), dtype, dev)  # two query blocks, one partial
    made, describe = [], tt.TensorDescriptor
    monkeypatch.setattr(tt, "TensorDescriptor", lambda *a: made.append(a) or describe(*a))
    vals, ids, unsettled = tt.tile_topw(q.float(), rows, 4)
    rv, ri = ref.exact_search(rows.cpu().double().numpy(), q.cpu().double().numpy(), 4)
    settled = ~unsettled.cpu().numpy()
    assert settled.any()
    np.testing.assert_array_equal(ids.cpu().numpy()[settled], ri[settled])
    np.testing.assert_allclose(vals.cpu().numpy()[settled], rv[settled], rtol=1e-5, atol=1e-5)
    assert ids.dtype == torch.int64 and vals.dtype == torch.float32
    hopper = not rows.is_cuda or torch.cuda.get_device_capability(rows.device)[0] >= 9
    assert len(made) == (2 if d == 40 and hopper else 0)  # d = 37: 74 / 148 (interpreter) bytes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [40, 37])
def test_rows_past_the_last_tile_never_rank_above_negative_scores(device, d):
    """Every score negative: the last tile's padding (zeros as loaded) must still rank last."""
    dev = kernel_device(device)
    rng = np.random.default_rng(7)
    rows = stored(-np.abs(rng.standard_normal((1300, d))), torch.bfloat16, dev)  # 6 tiles
    q = stored(np.abs(rng.standard_normal((20, d))), torch.bfloat16, dev)
    vals, ids, unsettled = tt.tile_topw(q.float(), rows, 4)
    rv, ri = ref.exact_search(rows.cpu().double().numpy(), q.cpu().double().numpy(), 4)
    settled = ~unsettled.cpu().numpy()
    assert settled.sum() >= 10 and (rv < 0).all()
    np.testing.assert_array_equal(ids.cpu().numpy()[settled], ri[settled])
    np.testing.assert_allclose(vals.cpu().numpy()[settled], rv[settled], rtol=1e-5, atol=1e-5)


class _CudaRows:
    """The attributes of a CUDA tensor that triton_topk._tma reads."""

    is_cuda, device = True, "cuda:0"

    def __init__(self, row_bytes: int):
        self.row_bytes = row_bytes

    def data_ptr(self) -> int:
        return 2**20

    def stride(self, dim: int) -> int:
        return self.row_bytes // 2

    def element_size(self) -> int:
        return 2


@pytest.mark.parametrize("capability, hip, row_bytes, tma", [
    ((9, 0), None, 80, True), ((8, 6), None, 80, False), ((9, 0), None, 74, False),
    ((9, 4), "6.2", 80, False)])  # Hopper, Ampere, unaligned rows, ROCm (its gfx numbers)
def test_tma_loads_only_on_hopper_or_later_nvidia_gpus_with_aligned_rows(
        capability, hip, row_bytes, tma, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    rows = _CudaRows(row_bytes)
    assert tt._tma(rows, rows) is tma
    monkeypatch.setattr(tt, "TensorDescriptor", None)  # a Triton before 3.4
    assert tt._tma(rows, rows) is False


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("keep", [2, 3])
@pytest.mark.parametrize("redo", [0.0, 1.0])
def test_more_top_rows_in_one_tile_than_kept_leave_the_row_unsettled(device, keep, redo,
                                                                     monkeypatch):
    """Three of query 0's top rows in one tile: with 2 kept a tile the row is unsettled,
    unless that tile is scored in full (redo); query 2 has three rows in each of REDO_TILES + 1
    tiles: the redo scores REDO_TILES of them; query 3 in REDO_TILES tiles: all scored."""
    dev = kernel_device(device)
    monkeypatch.setattr(tt, "KEEP", keep)
    monkeypatch.setattr(tt, "REDO_SHARE", redo)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2048, 24)) * 0.1  # 8 tiles
    x[[5, 9, 200], :8] = 3.0  # three copies of query 0's best row, one tile (of 256)
    x[[300, 600]] = -2.0  # the best two for query 1 (-1, ..., -1): two tiles
    for dims, tiles in ((slice(8, 16), tt.REDO_TILES + 1), (slice(16, 24), tt.REDO_TILES)):
        x[256 * (np.arange(tiles) + 2)[:, None] + [10, 20, 30], dims] = 3.0
    q = np.zeros((4, 24))
    q[0, :8], q[1], q[2, 8:16], q[3, 16:] = 1.0, -1.0, 1.0, 1.0
    vals, ids, unsettled = tt.tile_topw(stored(q, torch.bfloat16, dev),
                                        stored(x, torch.bfloat16, dev), 2)
    assert unsettled.tolist() == [keep == 2 and not redo, False, keep == 2,
                                  keep == 2 and not redo]
    if keep == 2 and not redo:  # of equal scores in a tile: the lower ids
        assert sorted(ids[0].tolist()) == [5, 9]
    else:  # all three seen: the tie rule is the caller's
        assert set(ids[0].tolist()) < {5, 9, 200}
    assert sorted(ids[1].tolist()) == [300, 600]
    np.testing.assert_allclose(vals[:2].cpu().numpy(), [[24.0, 24.0], [48.0, 48.0]], rtol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 6])
def test_exact_search_through_tiles_equals_the_reference_with_ties(device, dtype, k,
                                                                    monkeypatch):
    dev = kernel_device(device)
    rng = np.random.default_rng(k)
    x = rng.integers(-2, 3, (2600, 12)).astype(np.float32)  # integer scores: real ties
    x[700:705] = x[3]  # duplicates across tiles and within one
    q = rng.integers(-2, 3, (9, 12)).astype(np.float32)
    q[0] = x[3]
    calls = {"tiles": 0, "blocks": 0}
    tiles, blocks = tt.tile_topw, exact_module._scores

    def counted(key, fn):
        return lambda *a: (calls.__setitem__(key, calls[key] + 1), fn(*a))[1]

    monkeypatch.setattr(tt, "tile_topw", counted("tiles", tiles))
    monkeypatch.setattr(exact_module, "_scores", counted("blocks", blocks))
    index = make_index("exact", dev, {"dtype": str(dtype).replace("torch.", "")}).build(x)
    vals, ids = index.search(torch.from_numpy(q).to(dev), k)
    rv, ri = ref.exact_search(x, q, k)
    np.testing.assert_array_equal(ids.cpu().numpy(), ri)
    np.testing.assert_array_equal(vals.cpu().numpy(), rv.astype(np.float32))
    assert calls["tiles"] >= 1 and calls["blocks"] >= 1  # heavy ties: some rows re-scored


@pytest.mark.parametrize("device", DEVICES)
def test_a_failing_kernel_warns_once_and_score_blocks_serve(device, monkeypatch):
    dev = kernel_device(device)
    monkeypatch.setattr(tt, "_FAILED", {})

    class Broken:
        def __getitem__(self, grid):
            raise RuntimeError("no kernel here")

    monkeypatch.setattr(tt, "_tile_best_kernel", Broken())
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3000, 8)).astype(np.float32)
    q = rng.standard_normal((4, 8)).astype(np.float32)
    index = make_index("exact", dev, {"dtype": "float16"}).build(x)
    with pytest.warns(RuntimeWarning, match="Triton top-k kernel failed"):
        _, ids = index.search(torch.from_numpy(q).to(dev), 3)
    _, ids2 = index.search(torch.from_numpy(q).to(dev), 3)  # no second warning: not tried
    x16 = torch.from_numpy(x).half().double().numpy()
    np.testing.assert_array_equal(ids.cpu().numpy(), ref.exact_search(x16, q, 3)[1])
    assert torch.equal(ids, ids2)


def test_usable_only_for_16_bit_rows_many_tiles_and_a_kernel_device(monkeypatch):
    rows = torch.zeros(100_000, 4, dtype=torch.bfloat16)
    monkeypatch.setattr(tt, "UNSETTLED_SHARE", 0.02)
    assert tt.usable(rows, 10)  # 10^3 256^2 <= 0.12 * 10^10
    assert not tt.usable(rows, 200)  # too few tiles: many rows would be unsettled
    assert not tt.usable(rows.float(), 10)
    monkeypatch.setattr(tt, "ON_CPU", False)
    assert not tt.usable(rows, 10)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_with_nan_or_inf_scores_go_to_score_blocks(device, monkeypatch):
    dev = kernel_device(device)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3000, 8)).astype(np.float32)
    x[17] = 0.0  # inf * 0: a NaN score in the inf query's row
    q = rng.standard_normal((4, 8)).astype(np.float32)
    q[1, 2], q[2, 5] = np.nan, np.inf
    rows = stored(x, torch.bfloat16, dev)
    assert tt.tile_topw(torch.from_numpy(q).to(dev), rows, 5)[2].tolist() == \
        [False, True, True, False]
    index = make_index("exact", dev, {"dtype": "bfloat16"}).build(x)
    got = index.search(torch.from_numpy(q).to(dev), 5)
    monkeypatch.setattr(tt, "ON_CPU", False)
    monkeypatch.setattr(tt, "usable", lambda rows, w: False)
    blocks = index.search(torch.from_numpy(q).to(dev), 5)  # NaN first: test_exact pins it
    assert torch.equal(got[1], blocks[1])
    assert torch.equal(got[0].isnan(), blocks[0].isnan())


@pytest.mark.parametrize("device", DEVICES)
def test_scores_beyond_float32_of_finite_queries_go_to_score_blocks(device, monkeypatch):
    dev = kernel_device(device)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3000, 8)).astype(np.float32)
    x[40, :2] = 1e30  # with q[1]: 2e60, inf in float32 (products exact or not)
    q = rng.standard_normal((3, 8)).astype(np.float32)
    q[1, :2] = 1e30
    rows = stored(x, torch.bfloat16, dev)
    assert tt.tile_topw(torch.from_numpy(q).to(dev), rows, 5)[2].tolist() == \
        [False, True, False]
    index = make_index("exact", dev, {"dtype": "bfloat16"}).build(x)
    got = index.search(torch.from_numpy(q).to(dev), 5)
    monkeypatch.setattr(tt, "usable", lambda rows, w: False)
    blocks = index.search(torch.from_numpy(q).to(dev), 5)
    assert not blocks[0][1].isfinite().all()  # the reference holds the score ...
    assert torch.equal(got[1], blocks[1])  # ... and the tiles' search the same ids
    assert torch.equal(got[0].isnan(), blocks[0].isnan())


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402


@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(2600, 4000), d=st.integers(1, 70), b=st.integers(1, 12),
       k=st.integers(1, 12), levels=st.sampled_from([2, 5, 1000]),
       dtype=st.sampled_from(["float16", "bfloat16"]), transposed=st.booleans())
def test_exact_search_through_tiles_over_shapes_dtypes_and_layouts(n, d, b, k, levels, dtype,
                                                                   transposed):
    """Any shape, few or many score levels (ties), queries as a transposed view: the index's
    ids and scores through the tiles equal the float64 reference (integers: exact scores)."""
    if not available(torch.device("cpu")):
        return  # compiled Triton runs the other tests
    rng = np.random.default_rng([n, d, b, k, levels])
    x = rng.integers(0, levels, (n, d)).astype(np.float32) - levels // 2
    q = rng.integers(-2, 3, (d, b) if transposed else (b, d)).astype(np.float32)
    qt = torch.from_numpy(q).T if transposed else torch.from_numpy(q)
    called = []
    tile_topw = tt.tile_topw
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tt, "tile_topw", lambda *a: called.append(1) or tile_topw(*a))
        vals, ids = make_index("exact", "cpu", {"dtype": dtype}).build(x).search(qt, k)
    x16 = torch.from_numpy(x).to(getattr(torch, dtype)).double().numpy()
    rv, ri = ref.exact_search(x16, qt.numpy(), k)
    assert called
    np.testing.assert_array_equal(ids.numpy(), ri)
    np.testing.assert_array_equal(vals.numpy(), rv.astype(np.float32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("share", [1e-9, 1.0])
@pytest.mark.parametrize("k", [1, 3])
def test_unsettled_rows_beyond_the_redo_share_are_searched_again(device, share, k, monkeypatch):
    """Each query has three copies of its best row in one tile (unsettled with 2 kept a tile)
    and eight more of its top rows in eight other tiles. Up to REDO_SHARE of a pass's rows get that
    tile scored in full without a host sync; the rows beyond (here all but one, or none) go
    through a second, wider pass. Either way the ids and scores equal the float64 reference."""
    dev = kernel_device(device)
    x = np.zeros((11 * 256 - 100, 16), np.float32)  # 11 tiles, the last one partial
    for i in range(16):  # query i: column i
        tile = i % 11
        x[tile * 256 + 3 * i + np.arange(3), i] = 10.0
        others = (tile + 1 + np.arange(8)) % 11
        x[others * 256 + 100 + i, i] = 9.0 - 0.5 * np.arange(8)
    x[0, 10] = 10.0  # a fourth copy for query 10, whose three lie in the last tile
    q = np.eye(16, dtype=np.float32)
    monkeypatch.setattr(tt, "REDO_SHARE", share)
    index = make_index("exact", dev, {"dtype": "bfloat16"}).build(x)
    passes = []
    one_pass = index._pass
    monkeypatch.setattr(index, "_pass", lambda q, kk, w: passes.append(len(q)) or
                        one_pass(q, kk, w))
    vals, ids = index.search(torch.from_numpy(q).to(dev), k)
    rv, ri = ref.exact_search(x, q, k)
    np.testing.assert_array_equal(ids.cpu().numpy(), ri)
    np.testing.assert_array_equal(vals.cpu().numpy(), rv.astype(np.float32))
    assert passes == ([16] if share == 1.0 else [16, 15])


@pytest.mark.gpu
def test_a_search_through_the_tiles_synchronises_once():
    """The unsettled rows are re-scored without a host synchronisation: the one left is the
    rescan check at the end (the queue holds the merge and tie rule while the kernel runs)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    rng = np.random.default_rng(6)
    x = rng.standard_normal((200000, 32)).astype(np.float32)  # ~0.2% of rows unsettled
    q = torch.from_numpy(rng.standard_normal((300, 32)).astype(np.float32)).cuda()
    index = make_index("exact", "cuda", {"dtype": "bfloat16"}).build(x)
    assert tt.usable(index.vectors, 18)
    index.search(q, 10)  # compiles the kernel
    (vals, ids), syncs = cuda_syncs(lambda: index.search(q, 10))
    rv, ri = ref.exact_search(index.vectors.double().cpu().numpy(),
                              q.to(torch.bfloat16).double().cpu().numpy(), 10)
    assert syncs == 1
    assert (ids.cpu().numpy() == ri).mean() > 0.99  # 16-bit products: rare near-tie swaps
