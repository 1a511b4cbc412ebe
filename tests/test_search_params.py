"""Models' search settings apart from their build settings: per-call params equal a model built
with those settings, defaults stay, bad keys are named, saves record both."""

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


@pytest.mark.parametrize("batch", [40, 5])  # the torch path and the small-batch host path
def test_xl_candidates_per_call_equal_a_model_built_with_them(data, batch):
    T = data[3][:batch]
    model = xl(data)
    default = model.search(T, 10)
    changed = 0
    for kp in (1, 3, 12):
        built = xl(data, candidates=kp).search(T, 10)
        equal(model.search(T, 10, params={"candidates": kp}), built)
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
    per_call = model.search(T, 10, params={"candidates": 30, "ef_search": 8})
    typed = model.search(T, 10, params=[pg.XLSearchParams(candidates=30),
                                        HNSWSearchParams(ef_search=8)])
    equal(per_call, typed)
    # the same settings as a model's defaults, given as a keyword and in search_params: the
    # same graph (one thread builds it deterministically)
    old = xl(data, candidates=30, search_params={"ef_search": 8}, **opts)
    new = xl(data, search_params={"candidates": 30, "ef_search": 8}, **opts)
    for m in (old, new):
        assert m.search_params.candidates == 30 and m.index_params == opts["index_params"]
        assert m.index.search_params.ef_search == m.query_index.search_params.ef_search == 8
        equal(m.search(T, 10), per_call)
    assert not torch.equal(model.search(T, 10, params={"candidates": 30})[1], per_call[1]), \
        "ef_search=8 must matter here, else this test shows nothing"
    # defaults changed after fit reach both indices
    model.index_search_params = {"ef_search": 8}
    model.search_params = {"candidates": 30}
    assert model.query_index.search_params.ef_search == 8
    equal(model.search(T, 10), per_call)


@FAISS
def test_a_calls_dict_changes_only_its_keys_of_each_indexs_defaults(data):
    T = data[3]
    model = xl(data, backend="hnsw", index_params={"M": 4, "ef_construction": 8, "threads": 1},
               search_params={"ef_search": 8})
    model.query_index.search_params = {"ef_search": 400}  # the indices' defaults differ
    model.search_params = {"candidates": 30}
    expected = model.search(T, 10)
    model.search_params = {"candidates": 500}
    equal(model.search(T, 10, params={"candidates": 30}), expected)
    # a backend key applies to both indices, other backend keys stay each index's own
    model.index.search_params = {"ef_search": 8, "full_scan_factor": 1000.0}  # exact scans
    scan = model.search(T, 10, params={"candidates": 30, "ef_search": 400})
    assert not torch.equal(scan[1], expected[1]), "the settings must matter here"
    model.index.search_params = {"ef_search": 400, "full_scan_factor": 1000.0}
    model.search_params = {"candidates": 30}
    equal(model.search(T, 10), scan)


@FAISS
def test_ann_ef_per_call_raises_recall(data):
    P, _, _, T = data
    model = pg.ERM(device="cpu", backend="hnsw",
                   index_params={"M": 4, "ef_construction": 8, "threads": 1}).fit(P)
    truth = pg.ERM(device="cpu").fit(P).search(T, 10)[1].numpy()

    def rec(ids):
        return np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ids.numpy(), truth)])
    low = rec(model.search(T, 10, params={"ef_search": 10})[1])
    high = rec(model.search(T, 10, params={"ef_search": 400})[1])
    assert high >= 0.99 and low < high


@FAISS
def test_bad_search_settings_are_named(data):
    T = data[3]
    model = xl(data, candidates=20)
    with pytest.raises(InputError, match=r"unknown settings \['candidatez'\]; valid: "
                                         r"\['candidates'\] \(XLSearchParams\) and \[\]"):
        model.search(T, 10, params={"candidatez": 3})
    with pytest.raises(InputError, match="candidates"):
        model.search(T, 10, params={"candidates": 0})
    with pytest.raises(TypeError, match="XLSearchParams"):
        model.search(T, 10, params=HNSWSearchParams())  # another backend's settings
    erm = pg.ERM(device="cpu", backend="hnsw").fit(data[0])
    with pytest.raises(InputError, match=r"valid: \[\] \(ERMSearchParams\) and \['ef_search', "
                                         r"'full_scan_factor'\] \(HNSWSearchParams"):
        erm.search(T, 10, params={"candidates": 3})
    with pytest.raises(InputError, match="given twice"):
        pg.PEFAXL(candidates=3, search_params={"candidates": 4})
    with pytest.raises(InputError, match=r"\['ef_search'\] are search settings of backend "
                                         r"'hnsw', not build settings"):
        pg.ERM(backend="hnsw", index_params={"ef_search": 3})  # a search setting
    with pytest.raises(TypeError):
        pg.XLParams(candidates=3)  # a search setting, no longer among the build settings
    with pytest.raises(InputError, match="unknown keys"):
        model.search_params = {"ef_search": 3}
    assert model.search_params.candidates == 20


@FAISS
def test_saves_record_both_and_load_them(data, tmp_path):
    T = data[3]
    model = xl(data, backend="hnsw", index_params={"M": 8, "threads": 1},
               search_params={"candidates": 30, "ef_search": 12})
    model.query_index.search_params = {"ef_search": 40}  # indices may differ: each is saved
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
