"""The method registry (pefa_gpu.methods): its table agrees with the params classes, fit_config
fits what a hand-built model is, and no function of the package is above complexity 20."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import pefa_gpu as pg
from pefa_gpu.methods import REGISTRY, defaults, fit_config, model_class, settings

CLI_FIELDS = ("lam", "k", "candidates", "augment_docs")  # what --lam, --k, ... set


def _fields(cls: type) -> set[str]:
    return {f.name for c in (cls.Params, cls.SearchParams) for f in dataclasses.fields(c)}


@pytest.mark.parametrize("name", list(REGISTRY))
def test_what_a_method_takes_follows_from_its_params_classes(name):
    m, fields = REGISTRY[name], _fields(model_class(name))
    assert set(m.takes) <= fields and {k for k, _ in m.fixed} <= fields
    for field in CLI_FIELDS:  # the CLI refuses an option exactly where the field is missing
        assert (field in m.takes) == (field in fields), (name, field)
    cls = model_class(name)
    both = {**cls.Params().to_dict(), **cls.SearchParams().to_dict()}
    assert defaults(name) == {f: both[f] for f in m.takes}


def test_the_cli_settings_are_the_params_fields_with_help():
    fields = {f.name: f for cls in (pg.XSParams, pg.XLParams, pg.XLSearchParams, pg.NUDGEParams)
              for f in dataclasses.fields(cls)}
    assert set(settings()) == set(CLI_FIELDS)
    assert list(settings(search=True)) == ["candidates"]
    for name, f in settings().items():
        assert f.metadata == fields[name].metadata and f.type in ("float", "int", "bool")


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_setting_a_method_lacks_is_refused_by_the_cli(name, tmp_path, capsys):
    from pefa_gpu.cli import main

    fields = _fields(model_class(name))
    values = {"lam": "0.3", "k": "4", "candidates": "9"}
    for setting, f in settings().items():
        flag = [f.metadata.get("flag", f"--{setting}"), *([values[setting]]
                                                          if setting in values else [])]
        code = main(["eval", str(tmp_path / "no-data"), "--methods", name, *flag, "-q"])
        err = capsys.readouterr().err
        if setting in fields:  # taken: the next check (the missing data) speaks
            assert code == 2 and "is not a directory" in err, (name, setting, err)
        else:
            assert code == 2 and f"{flag[0]} has no effect with --methods {name}" in err


def test_cli_help_shows_the_params_defaults(capsys):
    from pefa_gpu import cli

    with pytest.raises(SystemExit):
        cli.main(["build", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    xs, xl = pg.XSParams(), pg.XLParams()
    assert f"(default: {xs.lam} for xs, {xl.lam} for xl)" in text
    assert f"XL neighbours (default: {xl.k})" in text
    assert f"(default: {pg.XLSearchParams().candidates})" in text


def test_the_registry_names_the_grid_and_the_pipeline():
    from pefa_gpu.sweep import METHODS

    assert METHODS == tuple(REGISTRY) == ("erm", "xs", "xl", "nudge-m", "nudge-n", "adapter",
                                          "prf", "adapter+xs")
    assert [m for m in REGISTRY if REGISTRY[m].model == "NUDGE"] == ["nudge-m", "nudge-n"]
    assert [m for m in REGISTRY if REGISTRY[m].query] == ["adapter", "prf", "adapter+xs"]
    assert [m for m in REGISTRY if REGISTRY[m].pipeline] == ["erm", "xs", "xl"]
    assert {m: REGISTRY[m].axes for m in ("erm", "xs", "xl", "nudge-n", "adapter+xs")} == {
        "erm": (), "xs": ("lam",), "xl": ("lam", "k"), "nudge-n": (), "adapter+xs": ("lam",)}
    with pytest.raises(pg.InputError, match="unknown method 'xm'"):
        fit_config(pg.Config("xm"), np.eye(2, dtype=np.float32))


@pytest.fixture(scope="module")
def data():
    g = np.random.default_rng(7)
    P = g.standard_normal((40, 8)).astype(np.float32)
    P /= np.linalg.norm(P, axis=1, keepdims=True)
    Q = g.standard_normal((30, 8)).astype(np.float32)
    Q /= np.linalg.norm(Q, axis=1, keepdims=True)
    Y = sp.csr_matrix((np.ones(45, np.float32), (g.integers(0, 30, 45), g.integers(0, 40, 45))),
                      shape=(30, 40))
    T = g.standard_normal((12, 8)).astype(np.float32)
    return P, Q, Y, T / np.linalg.norm(T, axis=1, keepdims=True)


@pytest.mark.parametrize("config, kw, build", [
    (pg.Config("erm"), {}, lambda P, Q, Y: pg.ERM(device="cpu").fit(P)),
    (pg.Config("xs"), {}, lambda P, Q, Y: pg.PEFAXS(lam=0.5, device="cpu").fit(P, Q, Y)),
    (pg.Config("xs", 0.2), {"augment_docs": False},
     lambda P, Q, Y: pg.PEFAXS(lam=0.2, augment_docs=False, device="cpu").fit(P, Q, Y)),
    (pg.Config("xl", 0.3, 4), {"candidates": 7, "knn_norm": "none"},
     lambda P, Q, Y: pg.PEFAXL(lam=0.3, k=4, knn_norm="none", device="cpu",
                               search_params=pg.XLSearchParams(candidates=7)).fit(P, Q, Y)),
    (pg.Config("xl"), {}, lambda P, Q, Y: pg.PEFAXL(lam=0.1, k=16, device="cpu").fit(P, Q, Y)),
    (pg.Config("nudge-m"), {}, lambda P, Q, Y: pg.NUDGE(variant="M", device="cpu").fit(P, Q, Y)),
    (pg.Config("prf"), {}, lambda P, Q, Y: pg.QueryModel(pg.ERM(device="cpu").fit(P), None,
                                                         pg.VectorPRF())),
])
def test_fit_config_fits_the_hand_built_model(data, config, kw, build):
    P, Q, Y, T = data
    got = fit_config(config, P, Q, Y, device="cpu", **kw)
    want = build(P, Q, Y)
    assert type(got) is type(want)
    s, i = got.search(T, 10)
    s0, i0 = want.search(T, 10)
    assert torch.equal(torch.as_tensor(i), torch.as_tensor(i0))
    assert torch.equal(torch.as_tensor(s), torch.as_tensor(s0))


def test_a_setting_no_method_takes_is_refused(data):
    P, Q, Y, _ = data
    with pytest.raises(pg.InputError, match="augment_doc"):
        fit_config(pg.Config("xs", 0.5), P, Q, Y, device="cpu", augment_doc=False)
    # a setting another method takes is left out (ERM has no λ, XS no k)
    fit_config(pg.Config("erm"), P, Q, Y, device="cpu", augment_docs=False, candidates=9)
    # a setting the method fixes: NUDGE's TypeError 'got multiple values for keyword argument'
    with pytest.raises(pg.InputError, match="method 'nudge-n' fixes variant='N'; drop variant"):
        fit_config(pg.Config("nudge-n"), P, Q, Y, device="cpu", variant="M")
    # lam=0.2 won silently over the config's λ = 0.5; search_params was PEFAXL's TypeError
    with pytest.raises(pg.InputError, match=r"lam is given twice, config.lam=0.5 and lam=0.2"):
        fit_config(pg.Config("xs", 0.5), P, Q, Y, device="cpu", lam=0.2)
    with pytest.raises(pg.InputError, match="give the search settings as keywords"):
        fit_config(pg.Config("xl", 0.5, 4), P, Q, Y, device="cpu",
                   search_params=pg.XLSearchParams(candidates=5))
    assert fit_config(pg.Config("xs"), P, Q, Y, device="cpu", lam=0.2).params.lam == 0.2


def test_no_function_is_above_complexity_20():
    cc = pytest.importorskip("radon.complexity")
    root = Path(pg.__file__).parent
    blocks = [(p, b) for p in sorted(root.rglob("*.py")) for top in cc.cc_visit(p.read_text())
              for b in (top, *getattr(top, "methods", ()))]
    over = [f"{p.relative_to(root)}:{b.name} ({b.complexity})" for p, b in blocks
            if b.complexity > 20]
    assert not over


@pytest.fixture
def beir(tmp_path):
    from textdata import write_beir, write_embeddings

    root = write_beir(tmp_path / "toy", n_topics=4, docs_per_topic=5, train_per_doc=2, seed=5)
    write_embeddings(root, "bow")
    return root


def test_cli_defaults_are_the_params_classes(beir, tmp_path, capsys):
    from pefa_gpu.builds import load_build
    from pefa_gpu.cli import main

    common = [str(beir), "--embeddings", "bow", "--device", "cpu", "-q"]
    assert main(["eval", *common, "--methods", "xs,xl,adapter+xs", "--json",
                 str(tmp_path / "e.json")]) == 0
    rows = json.loads((tmp_path / "e.json").read_text())["results"]
    xs, xl = pg.XSParams(), pg.XLParams()
    assert [(r["method"], r["lam"], r["k"]) for r in rows] == [
        ("xs", xs.lam, None), ("xl", xl.lam, xl.k), ("adapter+xs", xs.lam, None)]
    assert main(["build", *common, "--method", "xl", "--out", str(tmp_path / "m")]) == 0
    model, _, info = load_build(tmp_path / "m", device="cpu")
    assert (info["lam"], info["k"]) == (xl.lam, xl.k)
    assert model.params == xl and model.search_params == pg.XLSearchParams()
    capsys.readouterr()
