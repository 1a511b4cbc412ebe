"""Recall / nDCG / MRR against the reference, with padding, duplicates and empty queries."""

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import pefa_gpu as pg
import reference as ref


def random_case(seed, b=30, n=50, K=20, graded=False):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(n)[:K] for _ in range(b)])
    ids[rng.random(ids.shape) < 0.1] = -1              # padding
    ids[:, 5] = ids[:, 2]                              # a repeated id counts once
    dense = (rng.random((b, n)) < 0.08).astype(float)
    if graded:
        dense *= rng.integers(1, 4, dense.shape)
    dense[:3] = 0                                      # queries without relevant documents
    return ids, sp.csr_matrix(dense)


@pytest.mark.parametrize("graded", [False, True])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_metrics_match_reference(graded, as_tensor):
    ids, Y = random_case(1, graded=graded)
    res = pg.evaluate(torch.from_numpy(ids) if as_tensor else ids, Y, ks=(1, 5, 20))
    assert res["n_skipped"] == 3 and res["n_queries"] == 27
    for k in (1, 5, 20):
        assert res[f"recall@{k}"] == pytest.approx(ref.recall(ids, Y, k))
        assert res[f"ndcg@{k}"] == pytest.approx(ref.ndcg(ids, Y, k))
        assert res[f"mrr@{k}"] == pytest.approx(ref.mrr(ids, Y, k))
    assert pg.recall_at_k(ids, Y, ks=(5,)) == {5: pytest.approx(ref.recall(ids, Y, 5))}
    assert pg.ndcg_at_k(ids, Y, ks=5)[5] == pytest.approx(ref.ndcg(ids, Y, 5))
    assert pg.mrr_at_k(ids, Y, ks=5)[5] == pytest.approx(ref.mrr(ids, Y, 5))


def test_hand_checked_recall():
    # query 0: relevant {1, 2}, found 2 at rank 1 -> recall@1 = 0.5; query 1: relevant {0}
    Y = pg.Relevance.from_pairs([0, 0, 1], [1, 2, 0], shape=(2, 4))
    ids = np.array([[2, 3, 1], [3, -1, -1]])
    assert pg.recall_at_k(ids, Y, ks=(1, 3)) == {1: 0.25, 3: 0.5}
    assert pg.mrr_at_k(ids, Y, ks=3)[3] == 0.5


def test_metric_errors():
    Y = pg.Relevance.from_pairs([0], [1], shape=(2, 3))
    with pytest.raises(ValueError, match="rows"):
        pg.recall_at_k(np.zeros((3, 2), int), Y)
    with pytest.raises(ValueError, match="document 7"):
        pg.recall_at_k(np.array([[7], [0]]), Y)
    with pytest.raises(ValueError, match="ks"):
        pg.recall_at_k(np.zeros((2, 2), int), Y, ks=(0,))
    with pytest.raises(ValueError, match="2-D"):
        pg.recall_at_k(np.zeros(2, int), Y)


def test_metric_ids_must_be_integers_and_padding_is_minus_one():
    Y = pg.Relevance.from_pairs([0], [1], shape=(1, 3))
    with pytest.raises(ValueError, match="integer"):
        pg.recall_at_k(np.array([[1.5, 0.0]]), Y, ks=(1,))
    with pytest.raises(ValueError, match="-1 marks padding"):
        pg.recall_at_k(np.array([[-2, 1]]), Y, ks=(2,))
    assert pg.recall_at_k(np.array([[1.0, -1.0]]), Y, ks=(1,)) == {1: 1.0}


def test_k_beyond_the_ranks_is_an_error_not_a_smaller_k():
    ids, Y = random_case(2, K=10)
    with pytest.raises(ValueError, match="10 ranks per query, fewer than k = 100"):
        pg.recall_at_k(ids, Y, ks=(100,))
    with pytest.raises(ValueError, match="topk >= 20"):
        pg.evaluate(ids, Y, ks=(10, 20))
    assert pg.recall_at_k(ids, Y, ks=(10,))[10] == pytest.approx(ref.recall(ids, Y, 10))


@pytest.mark.parametrize("graded", [False, True])
def test_count_empty_counts_queries_without_relevant_documents_as_zero(graded):
    ids, Y = random_case(3, graded=graded)              # 3 of 30 queries have no relevant doc
    skip = pg.evaluate(ids, Y, ks=(1, 5, 20))
    zero = pg.evaluate(ids, Y, ks=(1, 5, 20), count_empty=True)
    assert (skip["n_queries"], skip["n_skipped"], skip["n_empty"]) == (27, 3, 3)
    assert (zero["n_queries"], zero["n_skipped"], zero["n_empty"]) == (30, 0, 3)
    for k in (1, 5, 20):  # the same per-query values summed, divided by all 30 queries
        for name, fn in (("recall", ref.recall), ("ndcg", ref.ndcg), ("mrr", ref.mrr)):
            assert zero[f"{name}@{k}"] == pytest.approx(fn(ids, Y, k) * 27 / 30)
            assert skip[f"{name}@{k}"] == pytest.approx(fn(ids, Y, k))
    empty = sp.csr_matrix((2, 50))
    res = pg.evaluate(np.zeros((2, 1), int), empty, ks=(1,), count_empty=True)
    assert res["recall@1"] == 0.0 and res["n_queries"] == 2 and res["n_empty"] == 2


def test_no_queries_or_no_ranks():
    """Zero queries give zeros; zero ranks per query are refused by name (not a scipy error)."""
    res = pg.evaluate(np.zeros((0, 3), np.int64), sp.csr_matrix((0, 5)), ks=(1, 3))
    assert res["n_queries"] == 0 and res["recall@3"] == 0.0 and res["ndcg@1"] == 0.0
    Y = pg.Relevance.from_pairs([0], [1], shape=(2, 5))
    with pytest.raises(pg.InputError, match="0 ranks per query"):
        pg.evaluate(np.zeros((2, 0), np.int64), Y, ks=(1,))


def test_the_metric_functions_read_ks_once():
    """ks may be any iterable, an iterator too (it was consumed twice: InputError)."""
    ids = np.array([[0, 1, 2], [2, 1, 0]])
    y = pg.Relevance.from_pairs([0, 1], [1, 1], shape=(2, 3))
    for fn in (pg.recall_at_k, pg.ndcg_at_k, pg.mrr_at_k):
        assert fn(ids, y, iter([1, 2])) == fn(ids, y, (1, 2))


def test_ids_of_a_non_number_dtype_and_ks_that_are_not_integers_are_input_errors():
    """Object / string ids raised numpy's isfinite TypeError, bool and complex ones were read
    as 0 / 1 and as their real part; ks=None was tuple()'s bare TypeError."""
    y = sp.csr_matrix(np.eye(2, 5, dtype=np.float32))
    ids = np.array([[0, 1], [1, 0]])
    for bad in (ids.astype(object), ids.astype(str), ids > 0, ids + 1j,
                torch.from_numpy(ids > 0)):
        with pytest.raises(pg.InputError, match="ids must be integer document ids, got dtype"):
            pg.evaluate(bad, y, ks=(2,))
    for fn in (pg.evaluate, pg.recall_at_k, pg.ndcg_at_k, pg.mrr_at_k):
        with pytest.raises(pg.InputError, match="ks must be positive integers, got None"):
            fn(ids, y, ks=None)
    assert pg.recall_at_k(ids.astype(np.float32), y, ks=2) == {2: 1.0}


def test_ids_beyond_int64_and_a_relevance_without_documents():
    """ids of 1e20 (float) or 2**63 + 5 (uint64) were cast first and reported as
    '-9223372036854775808: only -1 marks padding'; Y_test of 0 columns with padding-only ids was
    scipy's IndexError."""
    y = sp.csr_matrix(np.eye(2, 4, dtype=np.float32))
    # a list past 2**63 is numpy's ulonglong, which torch read as 'can't convert ... uint64'
    for big in (np.full((2, 1), 1e20), np.full((2, 1), 2**63 + 5, np.uint64), [[2**63]] * 2):
        with pytest.raises(pg.InputError, match=r"ids contain document \d+ but Y_test has 4"):
            pg.evaluate(big, y, ks=(1,))
    res = pg.evaluate(np.full((3, 2), -1), sp.csr_matrix((3, 0)), ks=(1,), count_empty=True)
    assert res["n_queries"] == 3 and res["n_empty"] == 3 and res["recall@1"] == 0.0


def test_a_query_relevant_to_every_document_costs_no_dense_ideal_table():
    """The sorted ideal gains were a dense (queries, most relevant of one query) table: one
    query relevant to all of 200k documents made 40 queries' @10 metrics allocate 64 MB (1.7
    GB for 1000 queries x 100k documents); now (queries, ranks) at most."""
    import tracemalloc
    b, n = 40, 200_000
    rows = np.r_[np.zeros(n, np.int64), np.arange(1, b)]
    cols = np.r_[np.arange(n), np.zeros(b - 1, np.int64)]
    Y = sp.csr_matrix((np.r_[np.linspace(1, 2, n), np.ones(b - 1)], (rows, cols)), shape=(b, n))
    ids = np.tile(np.arange(n - 1, n - 11, -1), (b, 1))  # row 0: its 10 best grades
    pg.evaluate(ids, Y, ks=(10,))  # warm: imports
    tracemalloc.start()
    res = pg.evaluate(ids, Y, ks=(10,))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert res["ndcg@10"] == pytest.approx(1.0 / b)
    assert peak < 32 * 2**20, peak


def test_count_empty_must_be_a_bool():
    """count_empty='no' was truthy: the empty queries were counted as 0."""
    Y = sp.csr_matrix(np.array([[1, 0], [0, 0]], np.float32))
    with pytest.raises(pg.InputError, match="count_empty must be True or False, got 'no'"):
        pg.evaluate(np.array([[0], [1]]), Y, ks=(1,), count_empty="no")
    assert pg.evaluate(np.array([[0], [1]]), Y, ks=(1,), count_empty=np.True_)["n_queries"] == 2


def test_ids_that_are_no_array_are_named():
    """ids=None or a ragged list were 'array must be an array ...' / 'array could not be turned
    into a numeric array': the message named no argument."""
    y = sp.csr_matrix(np.eye(2, 5, dtype=np.float32))
    for bad in (None, {}, [[0, 1], [1]]):
        with pytest.raises(pg.InputError, match=r"^ids "):
            pg.evaluate(bad, y, ks=(1,))


def test_ids_of_no_queries_and_2_40_ranks_cost_nothing():
    """ids of shape (0, 2**40) hold no data, but evaluate made its discounts for every rank:
    8 TiB (MemoryError); they are made up to the largest k."""
    ids = np.zeros((0, 2**40), np.int64)
    res = pg.evaluate(ids, sp.csr_matrix((0, 5)), ks=(1, 3))
    assert res["n_queries"] == 0 and res["ndcg@3"] == 0.0
