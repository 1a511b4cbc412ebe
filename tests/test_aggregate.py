"""PIFA aggregation against the float64 reference."""

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import pefa_gpu as pg
from conftest import DEVICES, unit_rows
import reference as ref


def random_relevance(rng, m, n, nnz, weighted=False):
    rows, cols = rng.integers(0, m, nnz), rng.integers(0, n, nnz)
    w = rng.uniform(0.5, 2.0, nnz) if weighted else None
    return pg.Relevance.from_pairs(rows, cols, w, shape=(m, n))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighted", [False, True])
def test_pifa_matches_reference(device, weighted):
    rng = np.random.default_rng(11)
    m, n, d = 60, 40, 12
    Q = unit_rows(rng, m, d)
    Y = random_relevance(rng, m, n, 90, weighted)
    for normalize in (True, False):
        got = pg.pifa(Y, Q, normalize=normalize, device=device)
        assert got.dtype == torch.float32 and got.shape == (n, d)
        assert got.device.type == device
        np.testing.assert_allclose(got.cpu().numpy(), ref.pifa(Y, Q, normalize), atol=1e-5)


def test_pifa_documents_without_queries_stay_zero():
    rng = np.random.default_rng(2)
    Q = unit_rows(rng, 5, 4)
    Y = pg.Relevance.from_pairs([0, 1, 1], [0, 0, 2], shape=(5, 4))  # docs 1 and 3: no queries
    A = pg.pifa(Y, Q).numpy()
    assert np.all(A[[1, 3]] == 0)
    np.testing.assert_allclose(np.linalg.norm(A[[0, 2]], axis=1), 1.0, atol=1e-6)


def test_pifa_opposite_queries_cancel_to_zero():
    q = np.array([[1.0, 0.0], [-1.0, 0.0]], dtype=np.float32)
    Y = pg.Relevance.from_pairs([0, 1], [0, 0], shape=(2, 1))
    A = pg.pifa(Y, q)
    assert torch.equal(A, torch.zeros(1, 2)) and torch.isfinite(A).all()


@pytest.mark.parametrize("kind", ["numpy", "torch", "scipy_csc", "dense"])
def test_pifa_input_kinds(kind):
    rng = np.random.default_rng(4)
    Q = unit_rows(rng, 10, 3)
    Yr = random_relevance(rng, 10, 7, 15)
    Yin = {"numpy": Yr, "torch": Yr, "scipy_csc": sp.csc_matrix(Yr.csr),
           "dense": Yr.csr.toarray()}[kind]
    Qin = torch.from_numpy(Q) if kind == "torch" else Q
    np.testing.assert_allclose(pg.pifa(Yin, Qin).numpy(), ref.pifa(Yr, Q), atol=1e-6)


def test_pifa_shape_mismatch():
    Q = np.ones((3, 2), dtype=np.float32)
    Y = pg.Relevance.from_pairs([0], [0], shape=(4, 2))
    with pytest.raises(ValueError, match="4 rows"):
        pg.pifa(Y, Q)


def test_pifa_rejects_nan():
    Q = np.ones((2, 2), dtype=np.float32)
    Q[1, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        pg.pifa(pg.Relevance.from_pairs([0], [0], shape=(2, 1)), Q)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_kind", ["numpy", "torch", "float64"])
def test_pifa_from_initial_sums(device, q_kind):
    """``initial`` (PEFA-XS: P) plus Yᵀ Q, accumulated into it in place; Q never written."""
    rng = np.random.default_rng(23)
    m, n, d = 70, 30, 8
    Q = unit_rows(rng, m, d)
    Y = random_relevance(rng, m, n, 120, weighted=True)
    start = rng.standard_normal((n, d)).astype(np.float32)
    q = {"numpy": Q, "torch": torch.from_numpy(Q), "float64": Q.astype(np.float64)}[q_kind]
    copy = lambda x: x.numpy().copy() if isinstance(x, torch.Tensor) else x.copy()  # noqa: E731
    q_before = copy(q)
    initial = torch.from_numpy(start.copy()).to(device)
    got = pg.pifa(Y, q, normalize=False, device=device, initial=initial)
    assert got.data_ptr() == initial.data_ptr()
    want = start.astype(np.float64) + ref.pifa(Y, Q, False)
    np.testing.assert_allclose(got.cpu().numpy(), want, atol=1e-5)
    np.testing.assert_array_equal(copy(q), q_before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", ["shape", "dim", "dtype", "grad", "numpy", "list"])
def test_pifa_initial_of_the_wrong_shape_is_refused(bad, device):
    """On CUDA a device tensor Q takes the in-memory product (not the streamed path). An
    initial that requires grad was torch's RuntimeError ("Can't call numpy() on Tensor that
    requires grad"; on CUDA: a leaf used in an in-place operation)."""
    rng = np.random.default_rng(5)
    Q = torch.from_numpy(unit_rows(rng, 10, 6)).to(device)
    Y = random_relevance(rng, 10, 4, 12)
    initial = {"shape": torch.zeros(5, 6), "dim": torch.zeros(4, 7),
               "dtype": torch.zeros(4, 6, dtype=torch.float64),
               "grad": torch.zeros(4, 6)}.get(bad, torch.zeros(0))
    initial = initial.to(device).requires_grad_(bad == "grad")
    if bad in ("numpy", "list"):  # a list was AttributeError 'list' object has no 'shape'
        initial = np.zeros((4, 6), np.float32) if bad == "numpy" else [[0.0] * 6] * 4
    with pytest.raises(pg.InputError, match="initial"):
        pg.pifa(Y, Q, normalize=False, initial=initial, device=device)


def test_normalize_rows_takes_any_array_and_refuses_what_is_not_a_real_matrix():
    """pg.normalize_rows(numpy) was an AttributeError ('no attribute float'), a 0-d tensor an
    IndexError; bool / complex tensors were normalised as 0 / 1 and their real part."""
    x = np.array([[3.0, 4.0], [0.0, 0.0]])
    want = torch.tensor([[0.6, 0.8], [0.0, 0.0]])
    for given in (x, x.tolist(), x.astype(np.float16), x.astype(">f8"), torch.from_numpy(x)):
        assert torch.allclose(pg.normalize_rows(given), want)
    for bad, match in [(x[0], r"got shape \(2,\)"), (torch.tensor(1.0), r"got shape \(\)"),
                       (x > 0, "dtype"), (torch.from_numpy(x).to(torch.complex64), "dtype"),
                       (x.astype(object), "dtype")]:
        with pytest.raises(pg.InputError, match=match):
            pg.normalize_rows(bad)


def test_float64_rows_beyond_float32_and_a_sparse_q():
    """normalize_rows of finite float64 rows past float32's range gave NaN rows (1e300) or,
    silently, zero rows (1e-300); pifa of such a Q said 'Q contains NaN or inf' of finite
    values; a torch sparse Q was torch's bare TypeError ("can't convert Sparse layout tensor
    to numpy")."""
    x = np.array([[1e300, -1e300], [3e-300, 4e-300], [0.0, 0.0]])
    want = torch.tensor([[2 ** -0.5, -(2 ** -0.5)], [0.6, 0.8], [0.0, 0.0]])
    assert torch.allclose(pg.normalize_rows(x), want)
    Y = pg.Relevance.from_pairs([0, 1], [0, 0], shape=(2, 1))
    with pytest.raises(pg.InputError, match="Q contains NaN or inf .* beyond float32's range"):
        pg.pifa(Y, np.full((2, 2), 1e300), device="cpu")
    with pytest.raises(pg.InputError, match="Q is a torch.sparse_coo tensor"):
        pg.pifa(Y, torch.eye(2).to_sparse(), device="cpu")
    with pytest.raises(pg.InputError, match="normalize must be True or False, got 'no'"):
        pg.pifa(Y, np.ones((2, 2), np.float32), normalize="no", device="cpu")  # normalised


def test_pifa_sums_past_the_machines_memory_are_refused_before_allocating():
    """A one-row Y declaring 2^31 - 1 documents made pifa ask torch for (n, d) float32 sums
    past any memory: torch's bare RuntimeError ("DefaultCPUAllocator: can't allocate
    memory")."""
    Y = sp.csr_matrix((1, 2**31 - 1), dtype=np.float32)
    with pytest.raises(pg.InputError, match=r"pifa: the \(2147483647, 4096\) float32 sums .* "
                                             r"GiB of memory, more than this machine's"):
        pg.pifa(Y, np.ones((1, 4096), np.float32), device="cpu")


def test_pifa_refusals_before_q_is_read_leave_initial_unchanged():
    """Q's row count (an array's) and the budget are checked before ``initial`` is written;
    errors found while Q streams may leave it partly summed (pifa's docstring says so)."""
    Y = pg.Relevance.from_pairs([0, 1], [0, 0], shape=(2, 1))
    initial = torch.ones(1, 2)
    for q, budget in ((np.ones((3, 2), np.float32), None), (np.ones((2, 2), np.float32), 9)):
        with pytest.raises(pg.InputError, match="3 rows|too small"):
            pg.pifa(Y, q, normalize=False, device="cpu", memory_budget=budget, initial=initial)
        assert torch.equal(initial, torch.ones(1, 2))
