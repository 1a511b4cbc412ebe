"""The relevance matrix: construction, duplicates, validation."""

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import pefa_gpu as pg
from pefa_gpu.errors import InputError


def test_from_pairs_binary_collapses_duplicates():
    Y = pg.Relevance.from_pairs([0, 0, 1, 0], [2, 2, 0, 1], shape=(3, 4))
    expect = np.zeros((3, 4))
    expect[0, 2] = expect[1, 0] = expect[0, 1] = 1
    np.testing.assert_array_equal(Y.csr.toarray(), expect)
    assert Y.nnz == 3 and Y.shape == (3, 4)


def test_from_pairs_weights_add_up():
    Y = pg.Relevance.from_pairs([0, 0], [1, 1], weights=[0.5, 2.0], shape=(1, 2))
    assert Y.csr.toarray()[0, 1] == pytest.approx(2.5)


def test_from_pairs_default_shape_and_float_ids():
    Y = pg.Relevance.from_pairs(np.array([0.0, 2.0]), np.array([3.0, 1.0]))
    assert Y.shape == (3, 4)


@pytest.mark.parametrize("q,d,msg", [([0, 5], [0, 1], "query ids out of range"),
                                     ([0, 1], [0, 9], "document ids out of range"),
                                     ([0, -1], [0, 1], "query ids out of range")])
def test_from_pairs_out_of_range(q, d, msg):
    with pytest.raises(ValueError, match=msg):
        pg.Relevance.from_pairs(q, d, shape=(3, 3))


def test_from_pairs_length_mismatch_and_non_integer():
    with pytest.raises(ValueError, match="entries"):
        pg.Relevance.from_pairs([0, 1], [0], shape=(2, 2))
    with pytest.raises(ValueError, match="integer"):
        pg.Relevance.from_pairs([0.5], [0], shape=(2, 2))


def test_as_relevance_checks_shape_and_emptiness():
    m = sp.csr_matrix(np.eye(3))
    assert pg.as_relevance(m, shape=(3, 3)).nnz == 3
    with pytest.raises(ValueError, match="3 rows"):
        pg.as_relevance(m, shape=(4, None))
    with pytest.raises(ValueError, match="3 columns"):
        pg.as_relevance(m, shape=(None, 5))
    with pytest.raises(ValueError, match="no nonzero"):
        pg.as_relevance(sp.csr_matrix((3, 3)))
    with pytest.raises(ValueError, match="scipy sparse"):
        pg.as_relevance([[1, 0]])
    for shape in ((3,), (3, 3, 3), "ab", {3: 3, 4: 4}, (3.0, None), (True, None)):  # (3,): none
        with pytest.raises(InputError, match=r"shape must be \(queries, documents\)"):
            pg.as_relevance(m, shape=shape)  # 'ab': 'there are a query embeddings'
    assert pg.as_relevance(m, shape=[np.int64(3), None]).nnz == 3


def test_explicit_zeros_dropped_and_nan_rejected():
    m = sp.csr_matrix((np.array([0.0, 1.0]), np.array([0, 1]), np.array([0, 2])), shape=(1, 2))
    assert pg.as_relevance(m).nnz == 1
    bad = sp.csr_matrix(np.array([[np.nan, 1.0]]))
    with pytest.raises(ValueError, match="NaN"):
        pg.as_relevance(bad)


def test_huge_ids_without_a_shape_are_a_clear_error():
    with pytest.raises(ValueError, match="query_ids holds 4611686018427387904, so without "
                                         "shape="):
        pg.Relevance.from_pairs([2**62], [0])
    with pytest.raises(ValueError, match="doc_ids holds 2147483647"):
        pg.Relevance.from_pairs([0], [2**31 - 1])
    with pytest.raises(ValueError, match=r"shape=\(4611686018427387904, 3\) is not a usable"):
        pg.Relevance.from_pairs([0], [1], shape=(2**62, 3))
    wide = pg.Relevance.from_pairs([0], [2**31 - 2])  # the largest inferred size still works
    assert wide.shape == (1, 2**31 - 1) and wide.nnz == 1


@pytest.mark.parametrize("dense", [np.array([[1, None]], dtype=object), np.array([["a", "b"]])])
def test_dense_y_of_objects_or_strings_is_a_clear_error(dense):
    with pytest.raises(ValueError, match=f"Y has dtype {dense.dtype}; relevance weights must"):
        pg.as_relevance(dense)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_dense_torch_y_of_any_float_dtype_is_read(dtype):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    dense = rng.integers(0, 4, size=(5, 7)) * (rng.random((5, 7)) < 0.4)  # small ints: exact
    got = pg.as_relevance(torch.tensor(dense, dtype=getattr(torch, dtype)), allow_empty=True)
    assert got.csr.dtype == np.float32
    np.testing.assert_array_equal(got.csr.toarray().astype(np.float64), dense.astype(np.float64))


@pytest.mark.parametrize("bad", [[[1, 0]], np.ones(3), "Y",
                                 torch.empty(2, 2, device="meta")])  # 'Cannot copy out of meta'
def test_a_y_that_is_no_matrix_is_named_by_as_relevance_and_relevance(bad):
    for make in (pg.as_relevance, pg.Relevance):
        with pytest.raises(ValueError, match="must be a scipy sparse matrix, a pefa_gpu"):
            make(bad)


def test_a_sparse_y_of_more_than_2_31_rows_or_columns_is_refused_before_allocation():
    """A one-entry COO / CSC of shape (2^40, 1) or (1, 2^40) raised MemoryError (8 TiB of row
    pointers) in as_relevance, Relevance.transpose or pifa; from_pairs bounded rows only."""
    def coo(shape):
        return sp.coo_matrix((np.ones(1, np.float32), (np.zeros(1, np.int64),
                                                       np.zeros(1, np.int64))), shape=shape)
    csc = sp.csc_matrix((np.ones(1, np.float32), np.zeros(1, np.int64), np.array([0, 1])),
                        shape=(2**40, 1))
    for y in (coo((2**40, 1)), coo((1, 2**40)), csc):
        with pytest.raises(InputError, match=r"at most 2147483647 rows \(queries\) and columns"):
            pg.as_relevance(y)
    with pytest.raises(InputError, match=r"at most 2147483647 rows"):
        pg.pifa(coo((1, 2**40)), np.ones((1, 4), np.float32), device="cpu")
    with pytest.raises(InputError, match=r"shape=\(1, 4611686018427387904\) is not a usable"):
        pg.Relevance.from_pairs([0], [0], shape=(1, 2**62))
    assert pg.as_relevance(coo((1, 2**31 - 1))).shape == (1, 2**31 - 1)
    # dense arrays without data: Y or Yᵀ of 8 TiB of row pointers (MemoryError), and evaluate's
    for y in (np.zeros((2**40, 0), np.float32), torch.zeros(0, 2**40)):  # scipy ValueError
        with pytest.raises(InputError, match=r"at most 2147483647 rows"):
            pg.Relevance(y)
    with pytest.raises(InputError, match=r"at most 2147483647 rows"):  # 'could not convert
        pg.evaluate(np.zeros((0, 1), int), np.zeros((0, 2**40)), ks=1)  # integer scalar'


def test_a_y_of_2_31_rows_or_columns_is_refused_before_its_row_pointers():
    """Shape (2^31, 1) passed the old bound (at most 2^31) and asked for 16 GiB of int64 row
    pointers (MemoryError), as did Yᵀ of a (1, 2^31) Y: now at most 2^31 - 1 (int32)."""
    for shape in ((2**31, 1), (1, 2**31)):
        y = sp.coo_matrix((np.ones(1, np.float32), (np.zeros(1, np.int64),
                                                    np.zeros(1, np.int64))), shape=shape)
        for make in (pg.Relevance, pg.as_relevance):
            with pytest.raises(InputError, match=rf"Y has shape \({shape[0]}, {shape[1]}\): at "
                                                 r"most 2147483647 rows \(queries\)"):
                make(y)
        with pytest.raises(InputError, match=r"at most 2147483647 queries and documents"):
            pg.Relevance.from_pairs([0], [0], shape=shape)


def test_malformed_shapes_rows_and_index_arrays_are_input_errors():
    """Each was a bare TypeError / IndexError / ValueError from Python or scipy."""
    with pytest.raises(InputError, match="shape must be two integers"):
        pg.Relevance.from_pairs([0], [0], shape=5)  # len() of an int
    for shape in ({1: 1, 2: 2}, np.array(5)):  # KeyError: 0; len() of a 0-d array
        with pytest.raises(InputError, match="shape must be two integers"):
            pg.Relevance.from_pairs([0], [0], shape=shape)
    assert pg.Relevance.from_pairs([0], [0], shape=[np.int64(1), 2]).shape == (1, 2)
    y = pg.Relevance.from_pairs([0, 1], [0, 1])
    with pytest.raises(InputError, match=r"1-D array of row positions, got shape \(1, 2\)"):
        y.rows([[0, 1]])  # scipy: 'Indexing that leads to >2D'
    for attr in ("indices", "data"):
        bad = sp.csr_matrix(np.eye(3, dtype=np.float32))
        setattr(bad, attr, getattr(bad, attr).reshape(-1, 1))
        with pytest.raises(InputError, match="indices and data must be 1-D"):
            pg.as_relevance(bad)


def test_from_pairs_and_rows_read_ragged_big_and_bfloat16_arrays_by_name():
    """A ragged list (query_ids, weights, rows) was numpy's bare ValueError; a float id of inf /
    1e30 or a uint64 past int64 wrapped in the int64 cast, named as -9223372036854775808 / -1;
    bfloat16 torch weights were numpy's TypeError 'Got unsupported ScalarType BFloat16'."""
    with pytest.raises(InputError, match="query_ids could not be read as an array"):
        pg.Relevance.from_pairs([[0, 1], [2]], [0, 1, 2])
    with pytest.raises(InputError, match="weights could not be read as an array"):
        pg.Relevance.from_pairs([0, 1], [0, 1], weights=[[1], [1, 2]])
    with pytest.raises(InputError, match="rows could not be read as an array"):
        pg.Relevance.from_pairs([0, 1], [0, 1]).rows([[0], [1, 0]])
    for bad, shown in ((np.array([0.0, np.inf]), r"\[inf\]"), (np.array([0, 1e30]), r"\[1e\+30\]"),
                       (np.array([0, 2**64 - 1], np.uint64), r"\[18446744073709551615\]")):
        with pytest.raises(InputError, match=f"doc_ids holds ids beyond int64: {shown}"):
            pg.Relevance.from_pairs([0, 1], bad, shape=(2, 2))
    w = torch.tensor([1.0, 2.5], dtype=torch.bfloat16)
    y = pg.Relevance.from_pairs([0, 1], [1, 0], weights=w)
    assert y.csr.toarray().tolist() == [[0.0, 1.0], [2.5, 0.0]]


@pytest.mark.parametrize("fmt", ["dense", "torch", "csr", "csc", "coo", "lil", "pairs"])
def test_weights_that_float32_rounds_to_zero_are_refused(fmt):
    """A float64 weight below float32's smallest (1e-300) became an explicit 0 and was dropped:
    a relevant pair gone without a word (evaluate skipped its query); inf is refused too."""
    dense = np.array([[1.0, 1e-300], [0.0, 2.0]])
    with pytest.raises(InputError, match=r"too small for float32 .*1e-300"):
        if fmt == "pairs":
            pg.Relevance.from_pairs([0, 0, 1], [0, 1, 1], weights=[1.0, 1e-300, 2.0])
        elif fmt in ("dense", "torch"):
            pg.as_relevance(dense if fmt == "dense" else torch.from_numpy(dense))
        else:
            pg.as_relevance(sp.csr_matrix(dense).asformat(fmt))
    assert pg.as_relevance(sp.csr_matrix([[1.0, 1e-40]])).nnz == 2  # a float32 subnormal
    assert pg.as_relevance(np.array([[1.0, 0.0]], np.float16)).nnz == 1  # no scipy float16


def test_rows_names_a_boolean_mask_of_another_length():
    """A mask of 2 entries for 3 rows was 'rows takes integer row positions, got dtype bool'."""
    y = pg.Relevance(sp.eye(3, format="csr"))
    for mask in ([True, False], np.ones(4, bool), np.ones((3, 1), bool)):
        with pytest.raises(InputError, match=r"a boolean mask needs 3 entries .Y's rows., got sh"):
            y.rows(mask)
    assert y.rows([False, True, True]).csr.toarray().tolist() == [[0, 1, 0], [0, 0, 1]]


def test_relevance_of_a_relevance_is_a_copy():
    """Relevance(a Relevance) was refused as 'Y must be a scipy sparse matrix, a
    pefa_gpu.Relevance or ...', naming the type it was given as one it takes."""
    y = pg.Relevance(sp.csr_matrix(np.array([[0, 2.0], [1, 0]], np.float32)))
    z = pg.Relevance(y)
    assert z.csr is not y.csr and (z.csr != y.csr).nnz == 0
    z.csr.data[:] = 5
    np.testing.assert_array_equal(y.csr.data, [2, 1])
