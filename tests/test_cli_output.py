"""The command line's outputs are always well-formed and its inputs bounded: ids that would
break a TSV or TREC line are refused where they are read (file:line), grades that are not
numbers too, and absurd counts at parse time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import pefa_gpu as pg
from pefa_gpu.cli import main
from textdata import write_beir


@pytest.fixture
def data(tmp_path):
    return write_beir(tmp_path / "toy", n_topics=3, docs_per_topic=4, train_per_doc=1, seed=2)


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def edit_line(path: Path, lineno: int, edit) -> None:
    lines = path.read_text().splitlines()
    lines[lineno - 1] = edit(lines[lineno - 1])
    path.write_text("\n".join(lines) + "\n")


def set_id(path: Path, lineno: int, value) -> None:
    edit_line(path, lineno, lambda line: json.dumps({**json.loads(line), "_id": value}))


@pytest.mark.parametrize("value,match", [
    ("d\tx", "holds '\\\\t'"), ("d\nx", "holds '\\\\n'"), ("d\u2028x", "holds '\\\\u2028'"),
    ("d\ud800x", "holds '\\\\ud800'"),  # a lone surrogate: the TSV output failed after the search
    ("", "empty document id"), ("  ", "empty document id"),
    (None, "must be a string, got None"), ([1], "must be a string")])
def test_corpus_ids_that_would_break_the_outputs_are_refused_with_file_and_line(
        data, value, match):
    set_id(data / "corpus.jsonl", 3, value)
    with pytest.raises(pg.InputError, match=rf"corpus\.jsonl:3: .*{match}"):
        pg.load_beir(data)


def test_integer_ids_are_taken_as_their_digits(data):
    set_id(data / "corpus.jsonl", 2, 17)
    assert pg.load_beir(data).corpus_ids[1] == "17"


@pytest.mark.parametrize("value", ["", None, "a\tb", "q\r"])
def test_query_files_with_bad_ids_are_refused_before_the_build_is_read(
        tmp_path, capsys, value):
    qfile = tmp_path / "q.jsonl"
    qfile.write_text(json.dumps({"_id": "ok", "text": "x"}) + "\n" +
                     json.dumps({"_id": value, "text": "y"}) + "\n")
    code, out, err = run(capsys, "search", tmp_path / "no-build", "--queries", qfile,
                         "--format", "trec", "-q")
    assert code == 2 and out == ""
    assert "q.jsonl:2:" in err and "id" in err


def test_tsv_query_files_with_an_empty_id_are_refused(tmp_path, capsys):
    qfile = tmp_path / "q.tsv"
    qfile.write_text("a\tfirst\n\tsecond\n")
    code, _, err = run(capsys, "search", tmp_path / "no-build", "--queries", qfile, "-q")
    assert code == 2 and "q.tsv:2: empty query id" in err


def test_a_build_whose_document_ids_would_break_the_outputs_is_refused(tmp_path, capsys, data):
    from pefa_gpu.builds import load_build, save_build

    model = pg.ERM(device="cpu").fit(__import__("numpy").eye(3, 4, dtype="float32"))
    with pytest.MonkeyPatch.context() as mp:  # save_build refuses them: a forged build
        mp.setattr("pefa_gpu.builds.check_doc_ids", lambda ids, n, where: list(ids))
        save_build(model, tmp_path / "b", ["a", "b\tc", "d"], {"encoder": {"kind": "default"}})
    with pytest.raises(pg.FormatError, match=r"doc_ids\.json: entry 1: .*'b\\tc'"):
        load_build(tmp_path / "b", device="cpu")


@pytest.mark.parametrize("grade", ["nan", "inf", "-inf", "NaN"])
def test_a_qrels_grade_that_is_not_a_finite_number_is_refused(data, grade):
    path = data / "qrels" / "test.tsv"
    lines = path.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line and not line.startswith("query"))
    fields = lines[at].split("\t")
    lines[at] = "\t".join([*fields[:-1], grade])
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(pg.InputError, match=rf"test\.tsv:{at + 1}: score '{grade}'"):
        pg.load_beir(data).qrels("test", keep_empty=True)


def test_a_deeply_nested_corpus_line_is_a_clear_error(data):
    edit_line(data / "corpus.jsonl", 2, lambda line: "[" * 100_000 + "]" * 100_000)
    with pytest.raises(pg.InputError, match=r"corpus\.jsonl:2: JSON nested too deeply"):
        pg.load_beir(data)


def test_a_deeply_nested_query_line_is_a_clear_error(tmp_path, capsys):
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    code, _, err = run(capsys, "search", tmp_path / "no-build", "--queries", qfile, "-q")
    assert code == 2 and "q.jsonl:1:" in err


@pytest.mark.parametrize("option", ["--topk", "--candidates", "--batch-size"])
def test_absurd_counts_are_refused_at_parse_time(tmp_path, capsys, option):
    with pytest.raises(SystemExit) as exit_:
        main(["search", str(tmp_path), "q", option, "10000000000", "-q"])
    assert exit_.value.code == 2
    assert "must be at most 2147483647" in capsys.readouterr().err


def test_search_topk_beyond_the_documents_prints_every_document_once(tmp_path, capsys, data):
    common = ["--model", "textdata:BowEncoder", "--cache-dir", tmp_path / "c", "--device",
              "cpu", "-q"]
    code, _, err = run(capsys, "build", data, "--method", "erm", *common, "--out",
                       tmp_path / "b")
    assert code == 0, err
    code, out, err = run(capsys, "search", tmp_path / "b", "a query", "--topk", "2000000000",
                         *common)
    assert code == 0, err
    docs = [line.split("\t")[2] for line in out.splitlines()[1:]]
    assert sorted(docs) == sorted(pg.load_beir(data).corpus_ids)
