"""NUDGE-M / NUDGE-N against the float64 reference written from the paper, and against the
authors' nudge-ft where it is installed."""

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import pefa_gpu as pg
from pefa_gpu import nudge
from pefa_gpu.splits import split_queries
import reference as ref


def problem(seed, n=40, m=160, v=40, d=12, noise=0.9):
    """Queries scattered around their relevant document; documents 0..4 have no training query,
    validation queries 0..1 have no relevant document, a few queries have two answers."""
    rng = np.random.default_rng(seed)

    def unit(x):
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)

    P = unit(rng.standard_normal((n, d)))
    ans = rng.integers(5, n, m)
    ans_v = np.r_[ans[rng.integers(0, m, v - 3)], 0, 1, 2]  # 0, 1, 2: never trained on
    Q = unit(P[ans] + noise * rng.standard_normal((m, d)))
    Qv = unit(P[ans_v] + noise * rng.standard_normal((v, d)))
    rows, cols = list(range(m)), list(ans)
    rows += [0, 1, 2]
    cols += list(rng.integers(5, n, 3))                     # second answers
    Y = sp.csr_matrix((np.ones(len(rows), np.float32), (rows, cols)), shape=(m, n))
    keep = np.arange(v) >= 2                                 # rows 0, 1: no relevant document
    Yv = sp.csr_matrix((np.ones(keep.sum(), np.float32), (np.arange(v)[keep], ans_v[keep])),
                       shape=(v, n))
    return P, Q, Y, Qv, Yv, unit(rng.standard_normal((15, d)))


@pytest.mark.parametrize("variant", ["M", "N"])
@pytest.mark.parametrize("gamma", [0.0, 0.1, 0.3, 1.5])
def test_fixed_gamma_matches_reference(variant, gamma):
    P, Q, Y, _, _, T = problem(1)
    model = pg.NUDGE(variant=variant, gamma=gamma, device="cpu").fit(P, Q, Y)
    D, G = ref.nudge_sums(P, Q, Y)
    E = (ref.nudge_m if variant == "M" else ref.nudge_n)(D, G, gamma)
    np.testing.assert_allclose(model.nudge_embeddings().numpy(), E, atol=2e-6)
    s, i = model.search(T, 10)
    rs, ri = ref.exact_search(E, T, 10)
    np.testing.assert_allclose(s.numpy(), rs, atol=2e-6)
    np.testing.assert_array_equal(i.numpy(), ri)
    assert model.fitted_gamma == gamma
    # documents without a training query stay at Π(p_j)
    np.testing.assert_allclose(model.nudge_embeddings()[:5].numpy(), D[:5], atol=1e-7)


def test_nudge_n_cases_by_hand():
    """Within reach -> ĝ; out of reach -> the unit vector at <e, d> = 1 - γ/2 toward g; g = 0,
    g ∥ d or <d, g> < 0 -> d."""
    d = torch.tensor([[1.0, 0, 0], [1.0, 0, 0], [1.0, 0, 0], [1.0, 0, 0], [1.0, 0, 0]])
    g = torch.tensor([[0.9, 0.1, 0], [0, 2.0, 0], [0, 0, 0], [3.0, 0, 0], [-1.0, 0.5, 0]])
    e = nudge.nudge_n(d, g, 0.5)
    np.testing.assert_allclose(e[0].numpy(), (g[0] / g[0].norm()).numpy(), atol=1e-7)
    c = 1 - 0.25
    np.testing.assert_allclose(e[1].numpy(), [c, np.sqrt(1 - c * c), 0], atol=1e-7)
    np.testing.assert_array_equal(e[2:].numpy()[[0, 2]], d[[2, 4]].numpy())
    np.testing.assert_allclose(e[3].numpy(), [1.0, 0, 0], atol=1e-7)
    np.testing.assert_allclose(torch.linalg.vector_norm(e, dim=1).numpy(), 1.0, atol=1e-6)
    np.testing.assert_allclose(nudge.nudge_m(d, g, 0.5)[1].numpy(), [1.0, 0.5, 0], atol=1e-7)


@pytest.mark.parametrize("seed", [2, 4, 7])
@pytest.mark.parametrize("variant", ["M", "N"])
def test_gamma_on_validation_matches_reference(variant, seed):
    P, Q, Y, Qv, Yv, _ = problem(seed)
    model = pg.NUDGE(variant=variant, device="cpu").fit(P, Q, Y, Qv, Yv)
    D, G = ref.nudge_sums(P, Q, Y)
    want = (ref.nudge_gamma_m if variant == "M" else ref.nudge_gamma_n)(D, G, Qv, Yv)
    assert model.fitted_gamma == pytest.approx(want, rel=1e-4, abs=1e-9)
    assert model.fitted_gamma > 0  # the data has signal: a test that 0 always passes is not one
    E = (ref.nudge_m if variant == "M" else ref.nudge_n)(D, G, model.fitted_gamma)
    np.testing.assert_allclose(model.nudge_embeddings().numpy(), E, atol=2e-6)


def test_gamma_m_counts_pairs_and_ties():
    """Two documents, one validation query equally close to both: the answer wins from γ = 0
    on only with the tie counted as a win; with no validation pair γ is 0."""
    d = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    g = torch.tensor([[0.0, 0.0], [0.0, 1.0]])  # document 1 moves up by γ along e2
    q = torch.tensor([[1.0, 1.0]]) / np.sqrt(2)
    y = sp.csr_matrix(np.array([[0, 1]], np.float32))
    assert nudge.choose_gamma("M", d, g, q, y) == 0.0  # tie at 0 counts: smallest best γ
    y0 = sp.csr_matrix(np.array([[1, 0]], np.float32))
    assert nudge.choose_gamma("M", d, g, q, y0) == 0.0  # wins only at γ = 0
    empty = sp.csr_matrix((1, 2), dtype=np.float32)
    assert nudge.choose_gamma("M", d, g, q, empty) == 0.0
    assert nudge.choose_gamma("N", d, g, q, empty) == 0.0
    none = torch.zeros(0, 2)  # no documents: 'M' was a ZeroDivisionError, 'N' gave 0 already
    for variant in "MN":
        assert nudge.choose_gamma(variant, none, none, q, sp.csr_matrix((1, 0))) == 0.0


def test_gamma_n_top_k_ties_go_to_the_lower_id():
    """Five equal documents tie for the validation query; the answer, document 0, is the lowest
    id, so it is the top-1 already at γ = 0 (the first of the grid); moving it (γ = 0.02 lifts
    it above the rest) is not needed. A top-1 that breaks the tie otherwise chooses 0.02."""
    d = torch.tensor([[1.0, 0.0]]).repeat(5, 1)
    g = torch.zeros(5, 2)
    g[0] = torch.tensor([1.0, 1.0])                # only document 0 has a training query
    q = torch.tensor([[1.0, 0.1]]) / np.hypot(1.0, 0.1)
    y = sp.csr_matrix(np.array([[1, 0, 0, 0, 0]], np.float32))
    assert nudge.choose_gamma("N", d, g, q, y) == 0.0
    y2 = sp.csr_matrix(np.array([[0, 0, 0, 0, 1]], np.float32))  # the highest id: never top-1
    assert nudge.choose_gamma("N", d, g, q, y2) == 0.0             # (no γ helps: the first)


@pytest.mark.parametrize("variant", ["M", "N"])
def test_without_validation_holds_out_a_seeded_part(variant):
    P, Q, Y, _, _, _ = problem(2)
    model = pg.NUDGE(variant=variant, device="cpu").fit(P, Q, Y)
    assert model.fitted_gamma > 0
    fit_rows, val_rows = split_queries(Q.shape[0], 0.2, 0)
    D, G_fit = ref.nudge_sums(P, Q[fit_rows], Y[fit_rows])
    want = (ref.nudge_gamma_m if variant == "M" else ref.nudge_gamma_n)(
        D, G_fit, Q[val_rows], Y[val_rows])
    assert model.fitted_gamma == pytest.approx(want, rel=1e-4, abs=1e-9)
    _, G = ref.nudge_sums(P, Q, Y)  # then every training query moves the documents
    E = (ref.nudge_m if variant == "M" else ref.nudge_n)(D, G, model.fitted_gamma)
    np.testing.assert_allclose(model.nudge_embeddings().numpy(), E, atol=2e-6)


@pytest.mark.parametrize("variant", ["M", "N"])
def test_matches_nudge_ft(variant):
    """The authors' package on the same seeded data gives the same embeddings (float32)."""
    nft = pytest.importorskip("nudge")
    P, Q, Y, Qv, Yv, _ = problem(2)
    Qv, Yv = Qv[2:], Yv[2:]  # nudge-ft divides 0 by 0 for a query with no relevant document

    def answers(y):
        return [list(map(int, y[i].indices)) for i in range(y.shape[0])]

    cls = nft.NUDGEM if variant == "M" else nft.NUDGEN
    theirs = cls(device=torch.device("cpu")).finetune_embeddings(
        P, {"q_embs": Q, "q_ans_indx": answers(Y)}, {"q_embs": Qv, "q_ans_indx": answers(Yv)})
    model = pg.NUDGE(variant=variant, device="cpu").fit(P, Q, Y, Qv, Yv)
    np.testing.assert_allclose(model.nudge_embeddings().numpy(), theirs, atol=1e-6)
    assert np.abs(theirs - P).max() > 1e-2  # they moved


def test_bad_input_is_refused():
    P, Q, Y, Qv, Yv, _ = problem(7)
    with pytest.raises(pg.InputError, match="variant"):
        pg.NUDGE(variant="X")
    with pytest.raises(pg.InputError, match="gamma"):
        pg.NUDGE(variant="M", gamma=-0.1)
    with pytest.raises(pg.InputError, match="gamma"):
        pg.NUDGE(variant="N", gamma=4.5)
    with pytest.raises(pg.InputError, match="val_fraction"):
        pg.NUDGE(val_fraction=1.0)
    with pytest.raises(pg.InputError, match="val_k"):
        pg.NUDGE(val_k=0)
    with pytest.raises(pg.InputError, match="go together"):
        pg.NUDGE(device="cpu").fit(P, Q, Y, Qv)
    with pytest.raises(pg.InputError, match="fixed"):
        pg.NUDGE(gamma=0.1, device="cpu").fit(P, Q, Y, Qv, Yv)
    with pytest.raises(pg.InputError, match="Q_val has dimension"):
        pg.NUDGE(device="cpu").fit(P, Q, Y, Qv[:, :5], Yv)
    with pytest.raises(pg.InputError, match="Y_val"):
        pg.NUDGE(device="cpu").fit(P, Q, Y, Qv, Yv[:, :10])
    with pytest.raises(pg.InputError, match="Y"):
        pg.NUDGE(device="cpu").fit(P, Q, Y[:, :10])
    with pytest.raises(pg.InputError, match="at least 2"):
        pg.NUDGE(device="cpu").fit(P, Q[:1], Y[:1])
    with pytest.raises(pg.InputError, match="not fitted"):
        pg.NUDGE().search(Q, 5)


@pytest.mark.parametrize("variant", ["M", "N"])
def test_save_load_updates_and_score(tmp_path, variant):
    P, Q, Y, Qv, Yv, T = problem(8)
    model = pg.NUDGE(variant=variant, device="cpu").fit(P[:50], Q[:60], Y[:60, :50], Qv,
                                                        Yv[:, :50])
    model.save(tmp_path / "m")
    back = pg.load(tmp_path / "m", device="cpu")
    assert isinstance(back, pg.NUDGE) and back.fitted_gamma == model.fitted_gamma
    assert back.params == model.params
    for a, b in zip(model.search(T, 10), back.search(T, 10)):
        assert torch.equal(a, b)
    # updates equal a refit with the same gamma
    back.add_documents(P[50:]).add_pairs(Q[60:], Y[60:])
    refit = pg.NUDGE(variant=variant, gamma=model.fitted_gamma, device="cpu").fit(
        P, np.r_[Q[:60], Q[60:]], sp.vstack([sp.csr_matrix(Y[:60].toarray()), Y[60:]]))
    np.testing.assert_allclose(back.nudge_embeddings().numpy(),
                               refit.nudge_embeddings().numpy(), atol=1e-6)
    s, i = back.search(T, 10)
    rs, ri = refit.search(T, 10)
    np.testing.assert_array_equal(i.numpy(), ri.numpy())
    # score() of the returned ids is the search score, with a gradient to the queries
    q = torch.tensor(T, requires_grad=True)
    sc = back.score(q, i)
    np.testing.assert_allclose(sc.detach().numpy(), s.numpy(), atol=1e-6)
    sc.sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0


def test_sweep_and_tune_take_nudge():
    P, Q, Y, _, _, T = problem(9)
    Yt = sp.csr_matrix((np.ones(15, np.float32), (np.arange(15), np.arange(15))),
                       shape=(15, len(P)))  # (15, 60) over 40 documents: sweep refuses it
    res = pg.sweep(P, Q, Y, T, Yt, methods="erm,nudge-m,nudge-n", show_progress=False)
    assert [r["method"] for r in res.rows] == ["erm", "nudge-m", "nudge-n"]
    for row in res.rows[1:]:
        model = pg.fit_config(pg.Config(row["method"]), P, Q, Y, device="cpu")
        want = pg.evaluate(model.search(T, 100)[1], Yt, (10, 100))
        assert row["recall@10"] == want["recall@10"]
    tuned = pg.tune(P, Q, Y, methods=("nudge-n",), show_progress=False, device="cpu")
    assert [r["method"] for r in tuned.validation.rows] == ["erm", "nudge-n"]
    with pytest.raises(pg.InputError, match="methods"):
        pg.sweep(P, Q, Y, T, Yt, methods="erm,nudge-x")


def test_cli_methods_accept_nudge():
    import argparse

    from pefa_gpu.cli import _methods

    assert _methods("erm,nudge-m,NUDGE-N") == ("erm", "nudge-m", "nudge-n")
    with pytest.raises(argparse.ArgumentTypeError, match="nudge-n"):
        _methods("nudge")


def test_a_val_k_beyond_the_documents_chooses_as_every_document():
    """val_k >= 2**31 raised OverflowError (np.minimum with int32 counts)."""
    P, Q, Y, Qv, Yv, _ = problem(7)
    fits = [pg.NUDGE(val_k=v, device="cpu").fit(P, Q, Y, Qv, Yv) for v in (len(P), 2**40)]
    assert fits[0].fitted_gamma == fits[1].fitted_gamma


def test_a_step_beyond_float32_is_refused_not_nan_results():
    """NUDGE-M's gamma and VectorPRF's beta scale float32 rows: gamma=1e39 (or inf) was taken
    and every search score came back NaN; a QueryModel with beta=1e300 searched inf queries
    unchecked (NaN scores). Now InputErrors naming them; float32's max itself is taken."""
    for gamma in (1e39, float("inf"), 10**400):
        with pytest.raises(pg.InputError, match="gamma must be None or a number in"):
            pg.NUDGE(variant="M", gamma=gamma)
    with pytest.raises(pg.InputError, match="beta must be a finite number >= 0, got 1e\\+300"):
        pg.VectorPRF(beta=1e300)
    big = float(np.finfo(np.float32).max)
    assert pg.NUDGE(variant="M", gamma=big).params.gamma == pg.VectorPRF(beta=big).params.beta


def test_nudge_embeddings_checks_gamma_as_the_params_do():
    """nudge_embeddings(gamma) took any value: NUDGE-N's 5 or -1 was a bare 'math domain
    error', NaN gave NaN rows, NUDGE-M's -1 moved documents backwards, 'x' a TypeError that
    named nothing; now the params' InputError (a valid gamma as before)."""
    rng = np.random.default_rng(0)
    P, Q = (rng.standard_normal((n, 6)).astype(np.float32) for n in (20, 15))
    Y = sp.csr_matrix((np.ones(15, np.float32), (np.arange(15), np.arange(15))), shape=(15, 20))
    for variant, bad in (("N", (5, -1, float("nan"), "x")), ("M", (-1, float("inf"), "x"))):
        model = pg.NUDGE(variant=variant, gamma=0.5, device="cpu").fit(P, Q, Y)
        for gamma in bad:
            with pytest.raises(pg.InputError, match="gamma must be None or a number in"):
                model.nudge_embeddings(gamma)
        assert torch.equal(model.nudge_embeddings(0.5), model.nudge_embeddings())


@pytest.mark.parametrize("variant", ["M", "N"])
def test_validation_queries_without_a_relevant_document_warn_that_gamma_is_0(variant, caplog):
    """Q_val / Y_val with no relevant pair chose gamma 0 in silence: NUDGE then equals the ERM
    and nothing said why. A validation set with pairs chooses as before, without the warning."""
    P, Q, Y, Qv, Yv, _ = problem(3)
    for none in (sp.csr_matrix(Yv.shape, dtype=np.float32), -Yv):  # no pair, or graded <= 0
        caplog.clear()
        with caplog.at_level("WARNING", logger="pefa_gpu"):
            model = pg.NUDGE(variant=variant, device="cpu").fit(P, Q, Y, Qv, none)
        assert model.fitted_gamma == 0.0
        assert "the 40 validation queries have no relevant document, so gamma is 0" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="pefa_gpu"):
        assert pg.NUDGE(variant=variant, device="cpu").fit(P, Q, Y, Qv, Yv).fitted_gamma > 0
    assert "gamma is 0" not in caplog.text


NUDGE_M_MEMORY = r"""
import resource, numpy as np, scipy.sparse as sp, pefa_gpu as pg
from pefa_gpu import nudge
from conftest import unit_rows
nudge.BLOCK_CELLS = 2**16  # 256 KiB of float32 cells per table
rng = np.random.default_rng(0)
N, M = 5000, 200
P, Q, Qv = unit_rows(rng, N, 16), unit_rows(rng, M, 16), unit_rows(rng, 3, 16)
Y = sp.csr_matrix((np.ones(M, np.float32), (np.arange(M), rng.integers(0, N, M))), shape=(M, N))
Yv = sp.csr_matrix(np.r_[np.ones((1, N)), np.eye(2, N)].astype(np.float32))
pg.NUDGE(variant="M", device="cpu").fit(P[:50], Q[:20], sp.identity(50, format="csr")[:20],
                                        Qv, Yv[:, :50])  # warm-up
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
pg.NUDGE(variant="M", device="cpu").fit(P, Q, Y, Qv, Yv)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_nudge_m_validation_pairs_are_taken_in_blocks():
    """NUDGE-M's step search made (pairs, documents) tables for every pair of a block of
    BLOCK_CELLS / n queries at once: one validation query relevant to all of 5000 documents
    took 670 MB (n² cells); now BLOCK_CELLS / n pairs at a time (the same γ)."""
    from conftest import run_forked
    grew_mb = int(run_forked(NUDGE_M_MEMORY).stdout.split()[-1])
    assert grew_mb < 150, grew_mb


def test_the_formulas_refuse_what_the_model_would_refuse():
    """nudge.choose_gamma took variant 'X' as 'N', val_k=0 was numpy's reshape error, a y_val
    of fewer rows than q_val (or other columns than d) was taken silently or was torch's
    error; nudge_n's gamma 5 was 'math domain error' and NaN gave NaN rows."""
    rng = np.random.default_rng(0)
    d, g, q = (torch.from_numpy(rng.standard_normal((n, 8)).astype(np.float32))
               for n in (30, 30, 10))
    y = sp.csr_matrix((np.ones(10, np.float32), (np.arange(10), np.arange(10))), shape=(10, 30))
    with pytest.raises(pg.InputError, match="variant must be 'M' or 'N', got 'X'"):
        nudge.choose_gamma("X", d, g, q, y)
    with pytest.raises(pg.InputError, match="val_k must be a positive integer, got 0"):
        nudge.choose_gamma("N", d, g, q, y, val_k=0)
    for args in ((d, g, q, y[:5]), (d, g, q, y[:, :20]), (d, g[:29], q, y), (d, g, q[:, :5], y)):
        with pytest.raises(pg.InputError, match=r"must be \(n, D\), \(n, D\), \(v, D\), \(v, n\)"):
            nudge.choose_gamma("M", *args)
    for fn, bad in ((nudge.nudge_n, (5.0, -1.0, float("nan"))), (nudge.nudge_m, (-1.0, 1e39))):
        for gamma in bad:
            with pytest.raises(pg.InputError, match="gamma must be a finite number in"):
                fn(d, g, gamma)
    assert isinstance(nudge.choose_gamma("N", d, g, q, y, val_k=3), float)
    with pytest.raises(TypeError, match="choose_gamma: g, q_val must be torch.Tensor, got "
                                        "ndarray, list"):  # was 'no attribute float'
        nudge.choose_gamma("M", d, g.numpy(), q.tolist(), y)
    for fn in (nudge.nudge_m, nudge.nudge_n):
        with pytest.raises(TypeError, match=f"{fn.__name__}: d must be torch.Tensor, got ndarray"):
            fn(d.numpy(), g, 0.5)
