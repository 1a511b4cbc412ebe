"""The PEFA authors' XMC layout: pg.load_xmc and ``pefa-gpu eval --xmc``.

What each aug_type builds (from the authors' ``get_data_aug``, PECOS
examples/pefa-wsdm24/utils.py) is written out here independently of pefa_gpu.xmc.
"""

from __future__ import annotations

import json
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

import pefa_gpu as pg
from pefa_gpu.cli import main
from pefa_gpu.errors import FormatError, InputError

# the training sources each aug_type stacks, in order
EXPECTED = {"v0": ["trn"], "v1": ["doc"], "v2": ["d2q"], "v3": ["trn", "doc"],
            "v4": ["trn", "d2q"], "v5": ["trn", "doc", "d2q"]}
Y_NAME = {"trn": "Y.trn.npz", "tst": "Y.tst.npz", "abs": "Y.trn.abs.npz",
          "doc": "Y.trn.doc.npz", "d2q": "Y.trn.d2q.npz"}
X_NAME = {"trn": "X.trn.npy", "tst": "X.tst.npy", "abs": "X.trn.abs.npy",
          "doc": "X.trn.doc.npy", "d2q": "X.trn.d2q.npy"}


def write_xmc(root: Path, ys: dict, xs: dict) -> tuple[Path, Path]:
    xmc, emb = root / "xmc", root / "emb"
    xmc.mkdir(parents=True)
    emb.mkdir(parents=True)
    for src, y in ys.items():
        sp.save_npz(xmc / Y_NAME[src], sp.csr_matrix(y))
    for src, x in xs.items():
        np.save(emb / X_NAME[src], x)
    return xmc, emb


def synthetic_sources(seed: int = 0, n: int = 40, d: int = 12):
    """Unnormalised float32 embeddings (a zero row among them), binary Y; each source has its
    own row count so a wrong stack cannot pass; documents 0 and 1 have no abstract row,
    document 2 has two."""
    rng = np.random.default_rng(seed)
    rows = {"trn": 23, "tst": 11, "doc": 17, "d2q": 29}
    ys, xs = {}, {}
    for src, m in rows.items():
        y = (rng.random((m, n)) < 0.08).astype(np.float32)
        y[np.arange(m), rng.integers(0, n, m)] = 1.0
        ys[src] = y
        xs[src] = (3.0 * rng.standard_normal((m, d))).astype(np.float32)
    abs_docs = np.r_[np.arange(2, n), 2]
    ys["abs"] = np.zeros((abs_docs.size, n), np.float32)
    ys["abs"][np.arange(abs_docs.size), abs_docs] = 1.0
    xs["abs"] = (2.0 * rng.standard_normal((abs_docs.size, d))).astype(np.float32)
    xs["trn"][4] = 0.0
    return ys, xs


def unit64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return np.divide(x, norms, out=np.zeros_like(x), where=norms > 0)


@pytest.mark.parametrize("aug", sorted(EXPECTED))
def test_augmentations_against_an_independent_reference(tmp_path, aug):
    ys, xs = synthetic_sources()
    xmc, emb = write_xmc(tmp_path, ys, xs)
    data = pg.load_xmc(xmc, emb, aug=aug)

    P_ref = unit64(ys["abs"].T.astype(np.float64) @ unit64(xs["abs"]))
    Q_ref = np.vstack([unit64(xs[s]) for s in EXPECTED[aug]])
    Y_ref = np.vstack([ys[s] for s in EXPECTED[aug]])
    assert data.P.dtype == np.float32 and data.Q.dtype == np.float32
    np.testing.assert_allclose(data.P, P_ref, atol=1e-6)
    assert (data.P[:2] == 0).all()                     # no abstract row: a zero passage
    np.testing.assert_allclose(data.Q, Q_ref, atol=1e-6)
    if EXPECTED[aug][0] == "trn":
        assert (data.Q[4] == 0).all()                  # a zero embedding row stays zero
    np.testing.assert_array_equal(data.Y.csr.toarray(), Y_ref)
    np.testing.assert_allclose(data.Q_test, unit64(xs["tst"]), atol=1e-6)
    np.testing.assert_array_equal(data.Y_test.csr.toarray(), ys["tst"])
    assert data.sources == {s: ys[s].shape[0] for s in EXPECTED[aug]}
    assert data.aug == aug and data.name == "xmc" and data.n_docs == 40

    model = pg.PEFAXS(lam=0.5, augment_docs=False, device="cpu").fit(data.P, data.Q, data.Y)
    E_ref = 0.5 * P_ref + 0.5 * unit64(Y_ref.T @ Q_ref)
    _, ids = model.search(data.Q_test, 5)
    s_ref = unit64(xs["tst"]) @ E_ref.T
    top = np.take_along_axis(s_ref, ids.numpy(), 1)
    np.testing.assert_allclose(top, np.sort(s_ref, 1)[:, ::-1][:, :5], atol=1e-5)


def test_normalize_false_keeps_rows_and_only_needed_files_are_read(tmp_path):
    ys, xs = synthetic_sources(1)
    for src in ("doc", "d2q"):  # v0 does not need them
        del ys[src], xs[src]
    xmc, emb = write_xmc(tmp_path, ys, xs)
    data = pg.load_xmc(xmc, emb, aug="v0", normalize=False)
    np.testing.assert_array_equal(data.Q, xs["trn"])
    P_ref = unit64(ys["abs"].T.astype(np.float64) @ xs["abs"])  # PIFA is normalised anyway
    np.testing.assert_allclose(data.P, P_ref, atol=1e-6)
    with pytest.raises(InputError, match=r"Y\.trn\.doc\.npz not found"):
        pg.load_xmc(xmc, emb, aug="v5")


@pytest.mark.slow
def test_scifact_in_the_authors_layout_gives_the_beir_numbers(scifact_dir, tmp_path, capsys):
    ds = pg.load_beir(scifact_dir)
    P, Qall = ds.embeddings("all-MiniLM-L6-v2")
    train_rows, y_train = ds.qrels("train")
    test_rows, y_test = ds.qrels("test", binary=False)
    n = P.shape[0]
    root = tmp_path / "scifact"  # same folder name: the header names the data set
    xmc, emb = root, tmp_path / "emb"
    xmc.mkdir()
    emb.mkdir()
    sp.save_npz(xmc / "Y.trn.npz", y_train.csr)
    sp.save_npz(xmc / "Y.tst.npz", y_test.csr)
    sp.save_npz(xmc / "Y.trn.abs.npz", sp.identity(n, format="csr", dtype=np.float32))
    np.save(emb / "X.trn.npy", Qall[train_rows])
    np.save(emb / "X.tst.npy", Qall[test_rows])
    np.save(emb / "X.trn.abs.npy", P)

    common = ["--device", "cpu", "--quiet", "--lam", "0.3"]
    assert main(["eval", str(scifact_dir), "--embeddings", "all-MiniLM-L6-v2", *common,
                 "--json", str(tmp_path / "beir.json")]) == 0
    beir = capsys.readouterr().out
    assert main(["eval", "--xmc", str(xmc), "--emb", str(emb), "--aug", "v0", *common,
                 "--json", str(tmp_path / "xmc.json")]) == 0
    ours = capsys.readouterr().out
    # the header says what counts: BEIR's grade rule, XMC's stored weights (it said 'binary'
    # and 'qrels grade >= 1' of --xmc too, whose weights are used as stored)
    head = "pairs, weights as stored), 300 test queries\nrelevant: the pairs of Y.tst.npz " \
        "weighted > 0; nDCG gains: their stored weights\n"
    assert head in ours and "pairs, binary)" in beir
    assert ours.split("\n", 2)[2] == beir.split("\n", 2)[2]  # the tables
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("beir.json", "xmc.json"))
    assert a.pop("min_score") == 1.0 and b.pop("min_score") is None and a == b
    assert [r["method"] for r in a["results"]] == ["erm", "xs", "xl"]
    assert a["results"][0]["recall@10"] == pytest.approx(0.7833, abs=5e-4)  # published ERM


def test_cli_runs_every_augmentation(tmp_path, capsys):
    ys, xs = synthetic_sources(2)
    xmc, emb = write_xmc(tmp_path, ys, xs)
    out_json = tmp_path / "v5.json"
    assert main(["eval", "--xmc", str(xmc), "--emb", str(emb), "--aug", "v5", "--device",
                 "cpu", "--quiet", "--k", "4", "--candidates", "20", "--json",
                 str(out_json)]) == 0
    out = capsys.readouterr().out
    m = 23 + 17 + 29
    assert out.startswith(f"xmc: 40 documents, {m} training queries (")
    res = json.loads(out_json.read_text())
    assert res["dataset"] == "xmc" and len(res["results"]) == 3
    assert main(["sweep", "--xmc", str(xmc), "--emb", str(emb), "--aug", "v3", "--device",
                 "cpu", "--quiet", "--methods", "xs,xl", "--lam", "0.2,0.6", "--k", "2,4",
                 "--candidates", "20"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"xmc: 40 documents, {23 + 17} training queries (")
    assert out.count("| XS |") == 2 and out.count("| XL |") == 4


@pytest.mark.parametrize("argv,match", [
    (["--xmc", "X"], "go together"),
    (["--emb", "E"], "go together"),
    (["DATA", "--xmc", "X", "--emb", "E"], "drop DATA_DIR"),
    ([], "no data"),
])
def test_cli_data_arguments(tmp_path, capsys, argv, match):
    argv = [str(tmp_path / a) if a in ("X", "E", "DATA") else a for a in argv]
    assert main(["eval", *argv, "--quiet"]) == 2
    assert match in capsys.readouterr().err
    assert main(["build", "--out", str(tmp_path / "out"), "--quiet"]) == 2  # no --xmc there
    assert "no data: give DATA_DIR (a BEIR folder)\n" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ bad folders

@pytest.fixture
def folders(tmp_path):
    ys, xs = synthetic_sources(3)
    return write_xmc(tmp_path, ys, xs)


def test_missing_folders_and_files(folders, tmp_path):
    xmc, emb = folders
    with pytest.raises(InputError, match="XMC folder"):
        pg.load_xmc(tmp_path / "nowhere", emb)
    with pytest.raises(InputError, match="embedding folder"):
        pg.load_xmc(xmc, tmp_path / "nowhere")
    (emb / "X.tst.npy").unlink()
    with pytest.raises(InputError, match=r"X\.tst\.npy not found"):
        pg.load_xmc(xmc, emb)
    (emb / "X.tst.npy").mkdir()
    with pytest.raises(InputError, match=r"X\.tst\.npy is not a file"):  # it said "not found"
        pg.load_xmc(xmc, emb)
    with pytest.raises(InputError, match="aug='v6'"):
        pg.load_xmc(xmc, emb, aug="v6")
    with pytest.raises(InputError, match=r"aug=\['v0'\] is not one of"):  # unhashable type
        pg.load_xmc(xmc, emb, aug=["v0"])
    # Path(None) was a TypeError naming no argument ('expected str, bytes or os.PathLike')
    with pytest.raises(TypeError, match="xmc_dir must be a path .* got NoneType"):
        pg.load_xmc(None, emb)
    with pytest.raises(TypeError, match="emb_dir must be a path .* got int"):
        pg.load_xmc(xmc, 3)
    with pytest.raises(InputError, match="normalize must be True or False, got 'no'"):
        pg.load_xmc(xmc, emb, normalize="no")  # it normalised


@pytest.mark.parametrize("src,change,match", [
    ("trn", lambda x: x[:-1], r"Y\.trn\.npz has 23 rows but .*X\.trn\.npy has 22"),
    ("doc", lambda x: x[:, :-1], r"X\.trn\.doc\.npy has dimension 11 but .*X\.trn\.abs\.npy"),
])
def test_embedding_shapes_must_agree(folders, src, change, match):
    xmc, emb = folders
    np.save(emb / X_NAME[src], change(np.load(emb / X_NAME[src])))
    with pytest.raises(InputError, match=match):
        pg.load_xmc(xmc, emb, aug="v5")


def test_relevance_columns_must_agree(folders):
    xmc, emb = folders
    y = sp.load_npz(xmc / "Y.trn.d2q.npz")
    sp.save_npz(xmc / "Y.trn.d2q.npz", sp.csr_matrix(y.toarray()[:, :-1]))
    with pytest.raises(InputError, match=r"Y\.trn\.d2q\.npz has 39 document columns but .*"
                                         r"Y\.trn\.abs\.npz has 40"):
        pg.load_xmc(xmc, emb, aug="v4")
    pg.load_xmc(xmc, emb, aug="v3")  # v3 does not read d2q


class _Sentinel:
    """Unpickling this creates a file: proof that a loader ran pickled code."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_pickled_files_are_refused_and_never_run(folders, tmp_path):
    xmc, emb = folders
    ran = tmp_path / "pickle-ran"
    np.save(emb / "X.trn.npy", np.array([_Sentinel(ran)], dtype=object), allow_pickle=True)
    with pytest.raises(FormatError, match=r"X\.trn\.npy is not a readable \.npy"):
        pg.load_xmc(xmc, emb)
    assert not ran.exists()
    np.save(emb / "X.trn.npy", np.zeros((23, 12), np.float32))
    y = sp.load_npz(xmc / "Y.trn.npz")
    np.savez(xmc / "Y.trn.npz", format="csr", shape=np.array(y.shape), indptr=y.indptr,
             indices=y.indices, data=np.array([_Sentinel(ran)] * y.nnz, dtype=object))
    with pytest.raises(FormatError, match=r"Y\.trn\.npz is not a readable scipy sparse"):
        pg.load_xmc(xmc, emb)
    assert not ran.exists()


def write_npz(path: Path, members: dict) -> None:
    """A deflated .npz of ``members``: name -> array, or an int n: n int32 zeros, streamed."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, arr in members.items():
            with z.open(f"{name}.npy", "w") as fh:
                if not isinstance(arr, int):
                    np.lib.format.write_array(fh, np.asarray(arr), allow_pickle=False)
                    continue
                np.lib.format.write_array_header_1_0(fh, {"descr": "<i4", "fortran_order": False,
                                                         "shape": (arr,)})
                for _ in range(arr * 4 // 2**20):
                    fh.write(bytes(2**20))


@pytest.mark.parametrize("consistent", [False, True])
def test_a_relevance_file_inflating_past_its_shape_is_refused_early(folders, consistent):
    """Y.trn.npz (23 x 40) whose data inflates to 48 MiB of zeros (``consistent``: indices too,
    and indptr counts them all in the last row) from under 1 MB: refused before inflating."""
    xmc, emb = folders
    y, n = sp.load_npz(xmc / "Y.trn.npz"), 12 * 2**20
    indptr = np.r_[np.zeros(23, np.int32), n] if consistent else y.indptr
    write_npz(xmc / "Y.trn.npz", {"format": np.array(b"csr"), "shape": np.array(y.shape),
                                  "indptr": indptr, "indices": n if consistent else y.indices,
                                  "data": n})
    assert (xmc / "Y.trn.npz").stat().st_size < 2**20
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match=r"Y\.trn\.npz .*member (data|indices) inflates past"):
            pg.load_xmc(xmc, emb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, peak / 2**20  # unbounded, all 48 MiB inflated (then kept or refused)


@pytest.mark.parametrize("write,match", [
    (lambda p: p.write_bytes(b"PK\x03\x04 truncated"), "not a readable"),
    (lambda p: sp.save_npz(p, sp.coo_matrix(np.eye(23, 40, dtype=np.float32))), "'coo'"),
    (lambda p: np.savez(p, format="csr", shape=np.array([23, 40]), data=np.ones(1),
                        indices=np.array([99]), indptr=np.r_[0, np.ones(23, int)]),
     "not a readable"),                                 # column index out of range
    (lambda p: np.savez(p, format="csr", shape=np.array(5), data=np.ones(1), indices=[0],
                        indptr=np.zeros((2, 2), int)), "not a readable"),  # 0-d shape
    (lambda p: np.savez(p, format="csr", shape=np.array([23, 40]), data=np.ones(1),
                        indices=[0], indptr=np.zeros((12, 2), int)), "not a readable"),
    (lambda p: sp.save_npz(p, sp.csr_matrix(np.full((23, 40), np.nan, np.float32))),
     "NaN or inf"),
])
def test_malformed_relevance_files(folders, write, match):
    xmc, emb = folders
    target = xmc / "Y.trn.npz"
    target.unlink()
    write(target)
    with pytest.raises(FormatError, match=rf"Y\.trn\.npz.*{match}|{match}.*Y\.trn\.npz"):
        pg.load_xmc(xmc, emb)


def test_malformed_embedding_files(folders):
    xmc, emb = folders
    x = np.load(emb / "X.tst.npy")
    x[3, 2] = np.nan
    np.save(emb / "X.tst.npy", x)
    with pytest.raises(FormatError, match=r"X\.tst\.npy holds NaN or inf \(rows \[3\]"):
        pg.load_xmc(xmc, emb)
    np.save(emb / "X.tst.npy", np.zeros(12, np.float32))
    with pytest.raises(FormatError, match=r"X\.tst\.npy must hold a 2-D real matrix"):
        pg.load_xmc(xmc, emb)
    (emb / "X.tst.npy").write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(FormatError, match=r"X\.tst\.npy is not a readable"):
        pg.load_xmc(xmc, emb)


def test_files_must_lie_inside_their_folder(folders, tmp_path):
    xmc, emb = folders
    outside = tmp_path / "elsewhere.npy"
    np.save(outside, np.load(emb / "X.trn.npy"))
    (emb / "X.trn.npy").unlink()
    (emb / "X.trn.npy").symlink_to(outside)
    with pytest.raises(InputError, match=r"X\.trn\.npy points outside"):
        pg.load_xmc(xmc, emb)
    (emb / "X.trn.npy").unlink()
    (emb / "X.trn.npy").symlink_to("X.tst.npy")  # a link inside the folder is fine
    with pytest.raises(InputError, match="rows"):   # (and then the shapes disagree)
        pg.load_xmc(xmc, emb)


def test_training_source_without_pairs(folders):
    xmc, emb = folders
    sp.save_npz(xmc / "Y.trn.npz", sp.csr_matrix((23, 40), dtype=np.float32))
    with pytest.raises(InputError, match=r"Y\.trn\.npz has no \(query, document\) pair"):
        pg.load_xmc(xmc, emb)
    # stored zeros only: nnz 3 passed the check, the fit said 'Y has no nonzero entries'
    zeros = sp.csr_matrix((np.zeros(3, np.float32), ([0, 1, 2], [0, 1, 2])), shape=(23, 40))
    assert zeros.nnz == 3
    sp.save_npz(xmc / "Y.trn.npz", zeros)
    with pytest.raises(InputError, match=r"Y\.trn\.npz has no \(query, document\) pair"):
        pg.load_xmc(xmc, emb)


def test_a_folder_of_a_user_not_here_is_named():
    """'~nouser/x': pathlib's bare RuntimeError 'Could not determine home directory'."""
    with pytest.raises(InputError, match="XMC folder ~no-such-user-here/x does not exist"):
        pg.load_xmc("~no-such-user-here/x", "~no-such-user-here/e")
