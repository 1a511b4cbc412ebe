"""The Triton re-scoring kernel (pefa_gpu.triton_rowdots) against a float64 reference: on the
CPU under Triton's interpreter (conftest sets TRITON_INTERPRET=1 where there is no CUDA), on
CUDA compiled; and its fallback to torch."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from conftest import run_python

pytest.importorskip("triton")
from pefa_gpu import triton_rowdots as tr  # noqa: E402  (after the skip: imports triton)
from pefa_gpu.errors import InputError  # noqa: E402

pytestmark = pytest.mark.triton

DEVICES = [pytest.param("cpu", id="cpu-interpreter"),
           pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def kernel_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cpu" and not tr.available(dev):
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=1 is set only where torch "
                    "sees no CUDA device; there the compiled kernel is tested)")
    assert tr.available(dev)
    return torch.empty(0, device=dev).device  # "cuda" resolved to "cuda:<current>"


def case(seed: int, b: int, n: int, d: int, pairs: int, dtype: torch.dtype, device):
    """Queries (float32), documents stored in ``dtype``, pairs with repeated ids."""
    rng = np.random.default_rng(seed)
    q = torch.from_numpy(rng.standard_normal((b, d)).astype(np.float32)).to(device)
    p = torch.from_numpy(rng.standard_normal((n, d)).astype(np.float32)).to(dtype).to(device)
    batch = rng.integers(0, b, pairs)
    doc = rng.integers(0, n, pairs)
    batch[: pairs // 4] = batch[0]  # repeated query rows
    doc[pairs // 4: pairs // 2] = doc[0]  # repeated document rows
    return q, p, torch.from_numpy(batch).to(device), torch.from_numpy(doc).to(device)


def reference(q, p, batch, doc) -> np.ndarray:
    """float64 dot products of the stored values."""
    qn = q.cpu().double().numpy()
    pn = p.cpu().double().numpy()
    return np.einsum("id,id->i", qn[batch.cpu().numpy()], pn[doc.cpu().numpy()])


def no_torch_path(monkeypatch):
    """Make the torch path fail, so a result can only come from the kernel."""
    def refuse(*args):
        raise AssertionError("the torch path ran instead of the Triton kernel")
    monkeypatch.setattr(tr, "torch_rowdots", refuse)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 37, 64, 130])  # below, at and across the 64-wide block
def test_kernel_matches_float64_reference(device, dtype, d, monkeypatch):
    dev = kernel_device(device)
    q, p, batch, doc = case(d, 5, 50, d, 150, dtype, dev)
    no_torch_path(monkeypatch)
    out = tr.rowdots(q, p, batch, doc)
    assert out.dtype == torch.float32 and out.shape == (150,) and out.device == dev
    np.testing.assert_allclose(out.cpu().numpy(), reference(q, p, batch, doc),
                               rtol=1e-5, atol=1e-5 * np.sqrt(d))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qdtype", [torch.float16, torch.bfloat16, torch.float64])
def test_query_dtypes_and_strided_inputs(device, qdtype, monkeypatch):
    dev = kernel_device(device)
    q, p, batch, doc = case(3, 7, 40, 24, 90, torch.float32, dev)
    q = q.to(qdtype)
    wide = torch.zeros(40, 50, dtype=torch.bfloat16, device=dev)
    wide[:, ::2][:, :24] = p.to(torch.bfloat16)
    strided = wide[:, ::2][:, :24]  # column stride 2: read in place, never copied
    assert not strided.is_contiguous()
    no_torch_path(monkeypatch)
    out = tr.rowdots(q, strided, batch, doc)
    np.testing.assert_allclose(out.cpu().numpy(), reference(q, strided, batch, doc),
                               rtol=1e-5, atol=1e-4)
    qt = q.t().contiguous().t()  # column-major queries
    out2 = tr.rowdots(qt, strided, batch, doc)
    np.testing.assert_array_equal(out2.cpu().numpy(), out.cpu().numpy())


@pytest.mark.parametrize("device", DEVICES)
def test_no_pairs_and_one_pair(device):
    dev = kernel_device(device)
    q, p, _, _ = case(4, 3, 10, 8, 4, torch.float32, dev)
    empty = torch.zeros(0, dtype=torch.int64, device=dev)
    out = tr.rowdots(q, p, empty, empty)
    assert out.shape == (0,) and out.dtype == torch.float32 and out.device == dev
    one = torch.tensor([2], device=dev)
    np.testing.assert_allclose(tr.rowdots(q, p, one, one).cpu().numpy(),
                               reference(q, p, one, one), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_equals_torch_path(device):
    dev = kernel_device(device)
    q, p, batch, doc = case(5, 9, 300, 96, 700, torch.bfloat16, dev)
    got = tr.rowdots(q, p, batch, doc)
    want = tr.torch_rowdots(q, p, batch, doc)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compile_failure_falls_back_to_torch_with_one_warning(monkeypatch):
    dev = torch.device("cpu")
    if not tr.available(dev):
        pytest.skip("the kernel cannot run on the CPU here (interpreter off)")
    q, p, batch, doc = case(6, 4, 20, 16, 30, torch.float16, dev)

    class Broken:
        def __getitem__(self, grid):
            raise RuntimeError("simulated compilation error")

    monkeypatch.setattr(tr, "_rowdots_kernel", Broken())
    monkeypatch.setattr(tr, "_FAILED", {})
    with pytest.warns(RuntimeWarning, match="simulated compilation error.*using torch"):
        out = tr.rowdots(q, p, batch, doc)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call is quiet
        out2 = tr.rowdots(q, p, batch, doc)
    ref = reference(q, p, batch, doc)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out2.numpy(), out.numpy())
    # another dtype pair is tried on its own
    assert (str(dev), torch.float32, torch.float16) in tr._FAILED
    with pytest.warns(RuntimeWarning):
        tr.rowdots(q, p.float(), batch, doc)


def test_without_the_interpreter_the_cpu_uses_torch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not tr.available(torch.device("cpu"))
    q, p, batch, doc = case(7, 4, 20, 16, 30, torch.float32, "cpu")
    no_torch_path(monkeypatch)
    with pytest.raises(AssertionError, match="torch path ran"):
        tr.rowdots(q, p, batch, doc)


def test_bad_input_is_named():
    q, p, batch, doc = case(8, 4, 20, 16, 30, torch.float32, "cpu")
    with pytest.raises(InputError, match="queries .* and docs"):
        tr.rowdots(q[:, :5], p, batch, doc)
    with pytest.raises(InputError, match="int64"):
        tr.rowdots(q, p, batch.int(), doc)
    with pytest.raises(InputError, match="one shape"):
        tr.rowdots(q, p, batch[:3], doc)
    with pytest.raises(InputError, match="float"):
        tr.rowdots(q.long(), p, batch, doc)


@pytest.mark.gpu
def test_cuda_launch_guards_the_device_and_uses_the_current_stream():
    """Tensors on the last GPU while device 0 is current (needs two GPUs for the guard), and a
    launch on a side stream: the kernel reads the tensors' GPU and is ordered on the stream."""
    last = torch.device("cuda", torch.cuda.device_count() - 1)
    q, p, batch, doc = case(9, 64, 5000, 384, 20000, torch.bfloat16, last)
    ref = reference(q, p, batch, doc)
    side = torch.cuda.Stream(last)
    with torch.cuda.stream(side), torch.cuda.device(0):  # (entering a stream sets its device)
        assert torch.cuda.current_device() == 0
        p2 = p * 2  # written on the side stream just before the kernel reads it
        out = tr.rowdots(q, p2, batch, doc) * 0.5
    side.synchronize()
    np.testing.assert_allclose(out.cpu().numpy(), ref, rtol=1e-5, atol=1e-4)
    assert not tr._FAILED, tr._FAILED


def test_import_does_not_load_triton():
    code = "import sys, pefa_gpu, pefa_gpu.fuse; print('triton' in sys.modules)"
    assert run_python("-c", code).stdout.strip() == "False"
