"""Models' search settings apart from their build settings, each in one typed form: per-call
params equal a model built with those settings, defaults stay, other forms are refused, saves
record both."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import pefa_gpu as pg
from pefa_gpu.errors import InputError

from conftest import unit_rows

try:
    import faiss
except ImportError:  # the cases that need it skip (FAISS); the others run
    faiss = None
FAISS = pytest.mark.skipif(faiss is None, reason="faiss is not installed")
from pefa_gpu.index.hnsw import HNSWSearchParams  # noqa: E402


@pytest.fixture(scope="module")
def data():
    """Documents with training queries near them (neighbours vote), test queries near both."""
    rng = np.random.default_rng(21)
    n, m, d = 400, 300, 16
    P = unit_rows(rng, n, d)
    docs = rng.integers(0, n, m)
    Q = P[docs] + 0.4 * rng.standard_normal((m, d)).astype(np.float32)
    Q = (Q / np.linalg.norm(Q, axis=1, keepdims=True)).astype(np.float32)
    Y = sp.csr_matrix((np.ones(m, np.float32), (np.arange(m), docs)), shape=(m, n))
    T = unit_rows(rng, 40, d)
    return P, Q, Y, T


def xl(data, **kw):
    P, Q, Y, _ = data
    return pg.PEFAXL(lam=0.3, k=8, device="cpu", **kw).fit(P, Q, Y)


def equal(a, b):
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])


XL30 = pg.XLSearchParams(candidates=30)


@pytest.mark.parametrize("batch", [40, 5])  # the torch path and the small-batch host path
def test_xl_candidates_per_call_equal_a_model_built_with_them(data, batch):
    T = data[3][:batch]
    model = xl(data)
    default = model.search(T, 10)
    changed = 0
    for kp in (1, 3, 12):
        built = xl(data, search_params=pg.XLSearchParams(candidates=kp)).search(T, 10)
        equal(model.search(T, 10, params=pg.XLSearchParams(candidates=kp)), built)
        changed += not torch.equal(built[1], default[1])
    assert changed, "the candidates tried must change some result, else this test shows nothing"
    assert model.search_params == pg.XLSearchParams(candidates=500) and model.candidates == 500
    equal(model.search(T, 10), default)  # a call's settings never become the defaults


@FAISS
def test_xl_index_settings_apply_to_both_indices(data):
    P, Q, Y, T = data
    opts = dict(backend="hnsw", index_params={"M": 8, "ef_construction": 20, "threads": 1})
    model = xl(data, **opts)
    assert model.index_search_params == HNSWSearchParams()
    model.query_index.search_params = HNSWSearchParams(ef_search=400)  # the defaults differ
    per_call = model.search(T, 10, params=XL30, index_params=HNSWSearchParams(ef_search=8))
    # the same settings as a model's defaults: the same graph (one thread builds it
    # deterministically), both indices take them
    built = xl(data, search_params=XL30, index_search_params=HNSWSearchParams(ef_search=8),
               **opts)
    assert built.search_params.candidates == 30 and built.index_params == opts["index_params"]
    assert built.index.search_params.ef_search == built.query_index.search_params.ef_search == 8
    equal(built.search(T, 10), per_call)
    assert not torch.equal(model.search(T, 10, params=XL30)[1], per_call[1]), \
        "ef_search=8 must matter here, else this test shows nothing"
    # defaults changed after fit reach both indices
    model.index_search_params = HNSWSearchParams(ef_search=8)
    model.search_params = XL30
    assert model.query_index.search_params.ef_search == 8
    equal(model.search(T, 10), per_call)


@FAISS
def test_ann_ef_per_call_raises_recall(data):
    P, _, _, T = data
    model = pg.ERM(device="cpu", backend="hnsw",
                   index_params={"M": 4, "ef_construction": 8, "threads": 1}).fit(P)
    truth = pg.ERM(device="cpu").fit(P).search(T, 10)[1].numpy()

    def rec(ef):
        ids = model.search(T, 10, index_params=HNSWSearchParams(ef_search=ef))[1]
        return np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ids.numpy(), truth)])
    assert rec(400) >= 0.99 and rec(10) < rec(400)


@FAISS
def test_other_forms_of_search_settings_are_refused_by_name(data):
    T = data[3]
    model = xl(data, backend="hnsw", search_params=pg.XLSearchParams(candidates=20))
    expect = r"PEFAXL.search params must be XLSearchParams or None, got "
    for form, name in (({"candidates": 3}, "dict"), ([pg.XLSearchParams()], "list"),
                       ((pg.XLSearchParams(),), "tuple"), (HNSWSearchParams(), "HNSWSearch")):
        with pytest.raises(TypeError, match=expect + name):
            model.search(T, 10, params=form)
    for form in ({"ef_search": 3}, pg.XLSearchParams()):
        with pytest.raises(TypeError, match="index_params must be HNSWSearchParams or None"):
            model.search(T, 10, index_params=form)
    with pytest.raises(TypeError, match="neighbours params must be HNSWSearchParams"):
        model.neighbours(torch.from_numpy(T), 4, params={"ef_search": 3})
    with pytest.raises(InputError, match=r"'candidates' \(search settings: "
                                         r"search_params=XLSearchParams"):
        pg.PEFAXL(candidates=3)  # the loose keyword
    with pytest.raises(TypeError, match="PEFAXL.search_params must be XLSearchParams"):
        pg.PEFAXL(search_params={"candidates": 4})
    with pytest.raises(TypeError, match="index_search_params must be HNSWSearchParams"):
        pg.PEFAXL(backend="hnsw", index_search_params={"ef_search": 4})
    with pytest.raises(TypeError, match="must be XLSearchParams or None, got dict"):
        model.search_params = {"candidates": 3}
    with pytest.raises(InputError, match="candidates"):
        pg.XLSearchParams(candidates=0)
    with pytest.raises(InputError, match=r"\['ef_search'\] are search settings of backend "
                                         r"'hnsw', not build settings"):
        pg.ERM(backend="hnsw", index_params={"ef_search": 3})  # a search setting
    with pytest.raises(TypeError):
        pg.XLParams(candidates=3)  # a search setting, not among the build settings
    assert model.search_params.candidates == 20


@FAISS
def test_saves_record_both_and_load_them(data, tmp_path):
    T = data[3]
    model = xl(data, backend="hnsw", index_params={"M": 8, "threads": 1}, search_params=XL30,
               index_search_params=HNSWSearchParams(ef_search=12))
    model.query_index.search_params = HNSWSearchParams(ef_search=40)  # each index is saved
    model.save(tmp_path / "m")
    manifest = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert manifest["params"] == {"lam": 0.3, "k": 8, "knn_norm": "k", "rescore": True,
                                  "augment_docs": True}
    assert manifest["search_params"] == {"candidates": 30}
    assert manifest["index_params"] == {"M": 8, "ef_construction": 500, "threads": 1}
    assert manifest["index_search_params"]["ef_search"] == 12
    assert manifest["state"]["index"]["search_params"]["ef_search"] == 12
    assert manifest["state"]["query_index"]["search_params"]["ef_search"] == 40
    back = pg.load(tmp_path / "m", device="cpu")
    assert back.search_params == model.search_params
    assert back.index.search_params == model.index.search_params
    assert back.query_index.search_params.ef_search == 40
    equal(back.search(T, 10), model.search(T, 10))
