"""Search runs as files (pefa_gpu.runs): query files in, TSV / JSON / TREC runs out, checked
against lines written out by hand."""

from __future__ import annotations

import hashlib
import json
import re

import numpy as np
import pytest

import pefa_gpu as pg
from pefa_gpu.runs import format_results, queries, query_id, read_queries

DOCS = ["d0", "d1", "d2"]
SCORES = np.array([[0.5, 0.25, -np.inf], [0.75, -np.inf, -np.inf]], np.float32)
IDS = np.array([[2, 0, -1], [1, -1, -1]], np.int64)  # -1: no result (padding)
QUERIES = [("q1", "first"), ("q2", "second")]


def test_query_ids_are_the_texts_sha256_prefix():
    assert query_id("a query") == "q-" + hashlib.sha256(b"a query").hexdigest()[:10]


def test_the_three_formats_skip_padding_and_rank_from_one():
    assert format_results("tsv", QUERIES, SCORES, IDS, DOCS, "t").splitlines() == [
        "query_id\trank\tdoc_id\tscore", "q1\t1\td2\t0.500000", "q1\t2\td0\t0.250000",
        "q2\t1\td1\t0.750000"]
    assert format_results("trec", QUERIES, SCORES, IDS, DOCS, "run1").splitlines() == [
        "q1 Q0 d2 1 0.500000 run1", "q1 Q0 d0 2 0.250000 run1", "q2 Q0 d1 1 0.750000 run1"]
    text = (["T0", "T1", "T2"], ["x0", "x1", "x2"])
    got = json.loads(format_results("json", QUERIES, SCORES, IDS, DOCS, "t", text))
    assert got == [
        {"query_id": "q1", "query": "first", "results": [
            {"rank": 1, "doc_id": "d2", "score": 0.5, "title": "T2", "text": "x2"},
            {"rank": 2, "doc_id": "d0", "score": 0.25, "title": "T0", "text": "x0"}]},
        {"query_id": "q2", "query": "second", "results": [
            {"rank": 1, "doc_id": "d1", "score": 0.75, "title": "T1", "text": "x1"}]}]
    tsv = format_results("tsv", QUERIES, SCORES, IDS, DOCS, "t", text).splitlines()
    assert tsv[0].endswith("\ttitle\ttext") and tsv[1] == "q1\t1\td2\t0.500000\tT2\tx2"


def test_trec_refuses_ids_with_spaces():
    with pytest.raises(pg.InputError, match="cannot hold ids with spaces: query id 'a b'"):
        format_results("trec", [("a b", "t")], SCORES[:1], IDS[:1], DOCS, "t")
    with pytest.raises(pg.InputError, match="spaces: document id 'd 2'"):  # not the query's
        format_results("trec", QUERIES[:1], SCORES[:1], IDS[:1], ["d0", "d1", "d 2"], "t")


def test_query_files_are_read_by_their_suffix_in_any_case(tmp_path):
    (tmp_path / "Q.JSONL").write_text('{"_id": "a1", "text": "first"}\n')
    (tmp_path / "Q.Tsv").write_text("b1\tsecond\n")
    assert read_queries(tmp_path / "Q.JSONL") == [("a1", "first")]  # were the lines as texts
    assert read_queries(tmp_path / "Q.Tsv") == [("b1", "second")]


def test_queries_keep_a_repeat_once_and_refuse_one_id_with_two_texts(tmp_path):
    f = tmp_path / "q.tsv"
    f.write_text("x1\tsecond\n\nx2\tfirst\n")
    assert read_queries(f) == [("x1", "second"), ("x2", "first")]
    assert queries(["first", "first"], f) == [(query_id("first"), "first"), ("x1", "second"),
                                              ("x2", "first")]
    f.write_text("x1\tone\nx1\ttwo\n")
    with pytest.raises(pg.InputError, match="'x1' is given twice with different texts"):
        queries([], f)
    with pytest.raises(pg.InputError, match="not found"):
        read_queries(tmp_path / "none.txt")
    with pytest.raises(pg.InputError, match="is not a file"):  # it said "not found"
        read_queries(tmp_path)
    f.write_text("\n  \n")
    with pytest.raises(pg.InputError, match=f"the queries file {f} holds none"):
        queries([], f)  # it gave 'queries has dimension 0' after loading the build


def test_a_jsonl_query_with_a_lone_surrogate_is_refused_naming_the_line(tmp_path):
    """Was encode's "text 0 is not valid Unicode ... (text decoded with
    errors='surrogateescape'?)", naming neither the file nor its line."""
    f = tmp_path / "q.jsonl"
    f.write_text('{"_id": "x", "text": "a"}\n{"_id": "y", "text": "b\\udc80"}\n')
    want = re.escape(f"{f}:2: field 'text' holds the lone surrogate '\\udc80' (a JSON escape")
    with pytest.raises(pg.InputError, match=f"^{want}"):
        read_queries(f)


@pytest.mark.parametrize("texts,lines,match", [
    (["a", ""], "", r"QUERY text 2 is empty \(''\)"), (["  "], "", r"QUERY text 1 is empty"),
    ([], '{"_id": "x", "text": "a"}\n{"_id": "y", "text": ""}\n', r"q.jsonl:2: empty query"),
    ([], "x\ta\ny\t \n", r"q.tsv:2: empty query text ' '")])
def test_empty_query_texts_are_refused_naming_their_position(tmp_path, texts, lines, match):
    f = tmp_path / ("q.tsv" if "\t" in lines else "q.jsonl")
    f.write_text(lines or '{"_id": "x", "text": "a"}\n')
    with pytest.raises(pg.InputError, match=match):  # were searched: every score 0
        queries(texts, f)


@pytest.mark.parametrize("call,match", [
    (lambda: queries("abc"), "texts must be a list of query texts, got str"),  # 3 queries
    (lambda: queries([3]), "QUERY text 1 must be a str, got int"),  # AttributeError 'strip'
    (lambda: read_queries(None), "path must be a path"),  # pathlib's, naming nothing
    (lambda: queries(["a"], 3), "path must be a path"),
])
def test_wrong_argument_types_are_named(call, match):
    with pytest.raises(TypeError, match=match):
        call()


@pytest.mark.parametrize("args,match", [
    (("xml", QUERIES, SCORES, IDS, DOCS), "fmt must be 'tsv', 'json' or 'trec', got 'xml'"),
    (("tsv", QUERIES, SCORES, IDS + 5, DOCS), r"ids below the 3 documents"),  # IndexError
    (("tsv", QUERIES[:1] * 3, SCORES, IDS, DOCS), r"must be \(3, k\) arrays"),  # IndexError
    (("json", QUERIES, SCORES[:, :2], IDS, DOCS), r"got shapes \(2, 2\) and \(2, 3\)"),
    # an id below -1 was skipped as padding; a TREC tag with a space broke the run's lines; a
    # NaN / inf score was written as JSON's NaN / Infinity, which JSON readers refuse; doc_text
    # shorter than the documents was an IndexError
    (("tsv", QUERIES, SCORES, IDS - 2, DOCS), r"-1 for no result"),
    (("trec", QUERIES, SCORES, IDS, DOCS, "my run"), "tag must be one word"),
    (("json", QUERIES, SCORES + np.float32(np.nan), IDS, DOCS), "query 'q1' has a result scored "
                                                               "NaN or inf"),
    (("tsv", QUERIES, SCORES, IDS, DOCS, "t", (DOCS, DOCS[:2])), "doc_text must be .titles, "
                                                                 "texts. of the 3 documents"),
    # ids of another dtype: NaN / inf were bare ValueError / OverflowError, 1.7 was read as
    # document 1, True as document 1; a str score a bare ValueError
    (("tsv", QUERIES, SCORES, IDS + 0.7, DOCS), "ids must be an array of integers, got dtype f"),
    (("json", QUERIES, SCORES, np.where(IDS > 0, IDS, np.nan), DOCS), "ids must be an array"),
    (("trec", QUERIES, SCORES, IDS > 0, DOCS), "ids must be an array of integers, got dtype bool"),
    (("tsv", QUERIES, SCORES.astype(str), IDS, DOCS), "scores must be an array of real numbers"),
])
def test_format_results_refuses_what_it_cannot_write(args, match):
    with pytest.raises(pg.InputError, match=match):  # xml was written as TSV
        format_results(*args, *(() if len(args) > 5 else ("t",)))
