"""Dataset loaders: BEIR layout (malformed corpus / queries / qrels) and pairs files."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest

from pefa_gpu.datasets import load_beir, load_pairs
from pefa_gpu.errors import InputError
from conftest import run_forked
from textdata import write_beir


@pytest.fixture
def beir(tmp_path):
    return write_beir(tmp_path / "data")


def test_beir_round_trip(beir):
    ds = load_beir(beir)
    assert len(ds.corpus_ids) == 30 and ds.corpus_texts[0].startswith("title 0 ")
    rows, y = ds.qrels("train")
    assert y.shape == (rows.size, 30) and y.nnz == 60
    assert set(ds.query_ids[i] for i in rows) == {f"tr{d}_{r}" for d in range(30) for r in (0, 1)}
    trows, yt = ds.qrels("test", binary=False)
    assert not set(rows) & set(trows)
    assert set(np.unique(yt.csr.data)) <= {1.0, 2.0}
    _, y2 = ds.qrels("test", min_score=2)
    assert y2.nnz == int((yt.csr.data >= 2).sum())


@pytest.mark.parametrize("name,line,match", [
    ("corpus.jsonl", '{"_id": "x", "text": ', "not valid JSON"),
    ("corpus.jsonl", '{"text": "no id"}', "'_id'"),
    ("corpus.jsonl", '{"_id": "d0_0", "text": "dup"}', "duplicate document id"),
    ("corpus.jsonl", '{"_id": "z", "text": ["not", "a", "string"]}', "must be a string"),
    ("queries.jsonl", '{"_id": "", "text": "empty id"}', "empty query id"),
    # were read as "" (a query scoring 0 against every document)
    ("queries.jsonl", '{"_id": "q9", "title": "t"}', "query 'q9' has no 'text'$"),
    ("queries.jsonl", '{"_id": "q9", "text": null}', "query 'q9' has no 'text'$"),
    ("corpus.jsonl", '{"_id": "d9", "title": ""}', "document 'd9' has no 'text' and no 'title'"),
    # were read, then the UTF-8 error of search's output file, or encode's "text N is not
    # valid Unicode ... (text decoded with errors='surrogateescape'?)"
    ("corpus.jsonl", '{"_id": "d9", "title": "a\\ud800"}', r"field 'title' holds the lone "
     r"surrogate '\\ud800' \(a JSON escape without its pair\) at position 1"),
    ("queries.jsonl", '{"_id": "q9", "text": "\\udfff b"}', "field 'text' holds the lone "
     "surrogate"),
])
def test_beir_malformed_records_name_file_and_line(beir, name, line, match):
    path = beir / name
    n = sum(1 for _ in open(path))
    with open(path, "a") as f:
        f.write(line + "\n")
    with pytest.raises(InputError, match=match) as err:
        load_beir(beir)
    assert f"{path}:{n + 1}" in str(err.value)


@pytest.mark.parametrize("row,match", [
    ("tr0_0\tnope\t1", "document id 'nope'"),
    ("nobody\td0_0\t1", "query id 'nobody'"),
    ("tr0_0\td0_0\thigh", "not a number"),
    ("tr0_0", "expected"),
    ("tr0_0\td0_0\t1e308", "within float32's range"),  # it said 'Y contains NaN or inf'
    # a 4th field: TREC's layout (query, iteration, document, score), said so (was "document
    # id '1' is not in corpus.jsonl" for a line with one extra column)
    ("tr0_0\td0_0\t1\t5", r"\(4 fields: TREC's query-id, iteration, corpus-id, score\): "
     "document id '1' is not in corpus.jsonl"),
])
def test_beir_bad_qrels_line(beir, row, match):
    path = beir / "qrels" / "train.tsv"
    n = sum(1 for _ in open(path))
    with open(path, "a") as f:
        f.write(row + "\n")
    with pytest.raises(InputError, match=match) as err:
        load_beir(beir).qrels("train")
    assert f"{path}:{n + 1}" in str(err.value)


@pytest.mark.parametrize("name,line,match", [
    ("corpus.jsonl", '{"_id": ' + "9" * 5000 + ', "text": "x"}', "not valid JSON.*4300 digits"),
    ("queries.jsonl", '{"_id": "q", "text": ' + "9" * 5000 + "}", "not valid JSON"),
    ("qrels/train.tsv", "tr0_0\t" + "x" * 200_000 + "\t1", "field larger than field limit"),
    ("qrels/train.tsv", '"tr0_0\td0_0\t1\n' + "tr0_0\td0_0\t1\n" * 20_000, "unclosed quote")])
def test_a_line_python_cannot_parse_is_an_input_error_naming_the_file(beir, name, line, match):
    with open(beir / name, "a") as f:  # were a raw ValueError / csv.Error
        f.write(line + "\n")
    with pytest.raises(InputError, match=match) as err:
        load_beir(beir).qrels("train")
    assert f"{beir / name}:" in str(err.value)


def test_beir_empty_split_and_missing(beir, tmp_path):
    (beir / "qrels" / "dev.tsv").write_text("query-id\tcorpus-id\tscore\n")
    with pytest.raises(InputError, match="dev.tsv: no"):
        load_beir(beir).qrels("dev")
    with pytest.raises(InputError, match="splits here"):
        load_beir(beir).qrels("validation")
    (beir / "queries.jsonl").write_text("\n")
    with pytest.raises(InputError, match="no records"):
        load_beir(beir)
    with pytest.raises(InputError, match="not a directory"):
        load_beir(tmp_path / "nothing")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (POSIX)")
@pytest.mark.parametrize("name", ["corpus.jsonl", "qrels/train.tsv"])
def test_a_data_file_that_is_a_fifo_is_refused_not_waited_on(beir, name):
    """open() of a FIFO with no writer blocked forever (a /dev/zero link read without end)."""
    (beir / name).unlink()
    os.mkfifo(beir / name)
    res = run_forked("import sys\nfrom pefa_gpu.datasets import load_beir\n"
                     "try:\n    load_beir(sys.argv[1]).qrels('train')\n"
                     "except ValueError as e:\n    print(type(e).__name__, e)",
                     beir, timeout=60)
    assert res.stdout.startswith("InputError") and f"{name} is not a regular file" in res.stdout


@pytest.mark.parametrize("call,err,match", [  # were bare TypeErrors naming nothing, or taken
    (lambda ds: load_beir(None), TypeError, "data_dir must be a path"),
    (lambda ds: ds.embeddings(None), TypeError, "model must be a path"),
    (lambda ds: ds.qrels("train", min_score="1"), InputError, "min_score must be a finite"),
    (lambda ds: ds.qrels("train", min_score=None), InputError, "min_score must be a finite"),
    (lambda ds: ds.qrels("train", binary="no"), InputError, "binary must be True or False"),
    (lambda ds: ds.qrels("test", keep_empty="no"), InputError, "keep_empty must be True or"),
    (lambda ds: ds.qrels(None), TypeError, "split must be a str"),  # was 'qrels/None.tsv'
    (lambda ds: load_pairs(None, ds.corpus_ids), TypeError, "path must be a path"),
    (lambda ds: load_pairs(ds.root / "qrels" / "train.tsv", "d0_0"), TypeError,
     "doc_ids must be a list"),  # a str: its letters were the corpus
    (lambda ds: load_pairs(ds.root / "qrels" / "train.tsv", set(ds.corpus_ids)), TypeError,
     "doc_ids must be a list"),  # a set: columns in its iteration order
    (lambda ds: load_pairs(ds.root / "qrels" / "train.tsv", ds.corpus_ids,
                           queries=ds.query_ids), TypeError, "queries must be a dict"),
    (lambda ds: load_pairs(ds.root / "qrels" / "train.tsv", ds.corpus_ids, min_score="1"),
     InputError, "min_score must be a finite number or None, got '1'"),
    (lambda ds: load_pairs(ds.root / "qrels" / "train.tsv", ds.corpus_ids, binary="no"),
     InputError, "binary must be True or False"),
])
def test_wrong_argument_types_are_named(beir, call, err, match):
    ds = load_beir(beir)
    with pytest.raises(err, match=match):
        call(ds)
    assert ds.qrels("train", min_score=np.float32(1), binary=np.True_)[1].nnz > 0  # numpy: taken


DOCS = ["a", "b", "c", "d"]


def test_pairs_tsv_texts_weights_header(tmp_path):
    p = tmp_path / "pairs.tsv"
    p.write_text("query\tdoc_id\tweight\n"
                 "how to x\tb\t2\n"
                 "how to x\tc\t1\n"
                 "what is y\ta\n"
                 "\n"
                 "how to x\tb\t3\n"
                 "zero\td\t0\n")
    pairs = load_pairs(p, DOCS, binary=False)
    assert pairs.query_keys == ["how to x", "what is y"]
    assert pairs.query_texts == pairs.query_keys
    dense = pairs.relevance.csr.toarray()
    np.testing.assert_array_equal(dense, [[0, 5, 1, 0], [1, 0, 0, 0]])  # repeats add up
    binary = load_pairs(p, DOCS)
    np.testing.assert_array_equal(binary.relevance.csr.toarray(), [[0, 1, 1, 0], [1, 0, 0, 0]])
    high = load_pairs(p, DOCS, min_score=2)
    assert high.query_keys == ["how to x"]
    assert high.relevance.csr.toarray().tolist() == [[0, 1, 0, 0]]


def test_pairs_texts_are_not_the_keys_list_and_a_weight_sum_past_float32_names_the_file(
        tmp_path):
    """query_texts was query_keys itself (writing a text changed the key); two weights of
    3e38 on one pair added up to inf, said as 'Y contains NaN or inf weights'."""
    p = tmp_path / "pairs.tsv"
    p.write_text("q\ta\t3e38\nq\ta\t3e38\n")
    pairs = load_pairs(p, DOCS)
    pairs.query_texts[0] = "changed"
    assert pairs.query_keys == ["q"]
    with pytest.raises(InputError, match=f"{p}: the weights of a repeated pair add up beyond"):
        load_pairs(p, DOCS, binary=False)


def test_pairs_with_query_ids(tmp_path):
    p = tmp_path / "pairs.tsv"
    p.write_text("q2\tc\nq1\ta\n")
    pairs = load_pairs(p, DOCS, queries={"q1": "first", "q2": "second"})
    assert pairs.query_keys == ["q2", "q1"] and pairs.query_texts == ["second", "first"]
    p.write_text("q2\tc\nq9\ta\n")
    with pytest.raises(InputError, match=r"pairs.tsv:2: query id 'q9'"):
        load_pairs(p, DOCS, queries={"q1": "first", "q2": "second"})


@pytest.mark.parametrize("text,match,line", [
    ("q\ta\nq\tzz\t1\n", "document id 'zz'", 2),
    ("q\ta\t1\textra\n", "fields", 1),
    ("just one field\n", "fields", 1),
    ("q\ta\tlots\n", "not a number", 1),
    ("q\ta\t-1\n", ">= 0", 1),
    ("q\ta\tnan\n", ">= 0", 1),
    ("q\ta\t-1e39\n", "within float32's range", 1),
    ("q\ta\t1e39\n", "within float32's range", 1),
    ("\tb\n", "empty query", 1),
])
def test_pairs_malformed(tmp_path, text, match, line):
    p = tmp_path / "bad.tsv"
    p.write_text(text)
    with pytest.raises(InputError, match=match) as err:
        load_pairs(p, DOCS)
    assert f"{p}:{line}" in str(err.value)


def test_pairs_doc_ids_and_queries_are_checked(tmp_path):
    """A repeated id in doc_ids (or a dict column out of range) was from_pairs' "document ids out
    of range [0, 2): [2]", naming neither; a query text that is not a string was kept as the
    text (encode refused it later by position)."""
    path = tmp_path / "p.tsv"
    path.write_text("q1\td1\nq2\td2\n")
    with pytest.raises(InputError, match="doc_ids holds 'd1' twice"):
        load_pairs(path, ["d1", "d1", "d2"])
    for bad in (5, -1, "0", True):
        with pytest.raises(InputError, match=f"doc_ids maps 'd1' to {bad!r}; the columns of its "
                                             f"2 documents are the integers 0 .. 1"):
            load_pairs(path, {"d1": bad, "d2": 1})
    with pytest.raises(InputError, match=f"{path}:2: the text queries gives query 'q2' is of "
                                         f"type int"):
        load_pairs(path, ["d1", "d2"], queries={"q1": "one", "q2": 2})
    pairs = load_pairs(path, iter(["d2", "d1"]), queries={"q1": "one", "q2": "two"})
    assert pairs.query_texts == ["one", "two"] and pairs.relevance.csr.indices.tolist() == [1, 0]


def test_pairs_empty(tmp_path):
    p = tmp_path / "empty.tsv"
    p.write_text("query\tdoc_id\n")
    with pytest.raises(InputError, match="no \\(query, document\\) pair"):
        load_pairs(p, DOCS)
    with pytest.raises(InputError, match="not found"):
        load_pairs(tmp_path / "missing.tsv", DOCS)
    with pytest.raises(InputError, match="is not a file"):  # a folder: it said "not found"
        load_pairs(tmp_path, DOCS)


def test_pairs_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    p = tmp_path / "pairs.parquet"
    pq.write_table(pa.table({"score": [1.0, 2.0, 1.0], "doc_id": ["b", "c", "a"],
                             "query": ["x", "x", "y"]}), p)
    pairs = load_pairs(p, DOCS, binary=False)
    assert pairs.query_keys == ["x", "y"]
    np.testing.assert_array_equal(pairs.relevance.csr.toarray(), [[0, 1, 2, 0], [1, 0, 0, 0]])
    pq.write_table(pa.table({"query": ["x", "y"], "doc_id": ["b", "nope"]}), p)
    with pytest.raises(InputError, match="row 1: document id 'nope'"):
        load_pairs(p, DOCS)
    p.write_bytes(b"not parquet")
    with pytest.raises(InputError, match="not a readable parquet"):
        load_pairs(p, DOCS)


@pytest.mark.parametrize("columns,expected", [
    ({"a": ["x", "y"], "b": ["b", "a"]}, [[0, 1, 0, 0], [1, 0, 0, 0]]),  # by position
    ({"a": ["x", "y"], "b": ["b", "a"], "c": [2.0, 3.0]}, [[0, 2, 0, 0], [3, 0, 0, 0]]),
    ({"label": [2.0, 3.0], "pid": ["b", "a"], "qid": ["x", "y"]}, [[0, 2, 0, 0], [3, 0, 0, 0]]),
    ({"score": [2.0, 3.0], "query": ["x", "y"]}, None),  # doc_id by position is the query
    ({"doc_id": ["b", "a"]}, None),
    ({"query": ["x", "y"]}, None),
])
def test_pairs_parquet_columns_by_name_else_position(tmp_path, columns, expected):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    p = tmp_path / "pairs.pq"
    pq.write_table(pa.table(columns), p)
    if expected is None:
        with pytest.raises(InputError, match="needs columns"):
            load_pairs(p, DOCS, binary=False)
        return
    pairs = load_pairs(p, DOCS, binary=False)
    assert pairs.query_keys == ["x", "y"]
    np.testing.assert_array_equal(pairs.relevance.csr.toarray(), expected)
    query_column = "qid" if "qid" in columns else "a"
    pq.write_table(pa.table({**columns, query_column: ["x", None]}), p)
    with pytest.raises(InputError, match="row 1: missing query"):
        load_pairs(p, DOCS)


@pytest.mark.parametrize("cell", [["x", "y"], {"q": "x"}, 1.5, True, b"x"])
def test_a_parquet_query_cell_that_is_not_a_string_or_integer_is_refused(tmp_path, cell):
    """A list cell was read as the query text "['x', 'y']" (a struct, float, bool or bytes
    cell as their repr); integer ids still read as their digits."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    p = tmp_path / "pairs.parquet"
    pq.write_table(pa.table({"query": [cell, cell], "doc_id": ["a", "b"]}), p)
    with pytest.raises(InputError, match=r"row 0: .* not a string or integer"):
        load_pairs(p, DOCS)
    pq.write_table(pa.table({"query": [7, 8], "doc_id": ["a", "b"]}), p)
    assert load_pairs(p, DOCS).query_keys == ["7", "8"]


def test_a_null_parquet_weight_is_refused_not_taken_as_1(tmp_path):
    """A null weight cell was read as weight 1 (the pair relevant), as a pair without a weight
    column is."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    p = tmp_path / "pairs.parquet"
    pq.write_table(pa.table({"query": ["x", "y"], "doc_id": ["a", "b"], "weight": [2.0, None]}), p)
    with pytest.raises(InputError, match=r"row 1: the weight is missing \(null\)"):
        load_pairs(p, DOCS, binary=False)
    pq.write_table(pa.table({"query": ["x", "y"], "doc_id": ["a", "b"]}), p)
    assert load_pairs(p, DOCS).relevance.nnz == 2


def test_beir_title_only_and_empty_documents_load(tmp_path):
    root = write_beir(tmp_path / "d")  # BEIR has title-only documents; "" texts load as ""
    with open(root / "corpus.jsonl", "a") as f:
        f.write(json.dumps({"_id": "nulls", "title": "T", "text": None}) + "\n")
        f.write(json.dumps({"_id": "untexted", "title": "T"}) + "\n")
        f.write(json.dumps({"_id": "empty", "title": "", "text": ""}) + "\n")
    ds = load_beir(root)
    assert [ds.corpus_texts[ds.doc_index[d]] for d in ("nulls", "untexted", "empty")] == [
        "T ", "T ", ""]
    with open(root / "corpus.jsonl", "a") as f:
        f.write(json.dumps({"_id": "nulls2", "title": None, "text": None}) + "\n")
    with pytest.raises(InputError, match="'nulls2' has no 'text' and no 'title'"):
        load_beir(root)


# -- clear errors and the qrels defaults ----------------------------------------------------

@pytest.mark.parametrize("name", ["corpus.jsonl", "queries.jsonl", "qrels/train.tsv"])
def test_a_non_utf8_byte_names_file_and_line(beir, name):
    path = beir / name
    n = sum(1 for _ in open(path, "rb"))
    with open(path, "ab") as f:  # Latin-1 "café"
        f.write(b'{"_id": "zz", "text": "caf\xe9"}\n' if name.endswith("jsonl")
                else b"tr0_0\td0_0\t1 caf\xe9\n")
    with pytest.raises(InputError, match=r"not valid UTF-8 \(byte 0xe9") as err:
        load_beir(beir).qrels("train")
    assert f"{path}:{n + 1}" in str(err.value)


def test_a_utf8_bom_is_accepted(beir):
    path = beir / "queries.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert load_beir(beir).query_ids[0] == json.loads(path.read_text("utf-8-sig")
                                                      .splitlines()[0])["_id"]


def test_qrels_are_graded_by_default_and_binary_on_request(beir):
    ds = load_beir(beir)
    rows, graded = ds.qrels("test")
    rows_b, binary = ds.qrels("test", binary=True)
    assert np.array_equal(rows, rows_b)
    assert set(np.unique(graded.csr.data)) == {1.0, 2.0}  # write_beir grades the test split
    assert set(np.unique(binary.csr.data)) == {1.0}
    assert (graded.csr != 0).toarray().tolist() == (binary.csr != 0).toarray().tolist()


def test_keep_empty_keeps_judged_queries_without_a_relevant_document(beir):
    ds = load_beir(beir)
    test_ids = sorted({line.split("\t")[0] for line in
                       (beir / "qrels" / "test.tsv").read_text().splitlines()[1:]})
    with open(beir / "qrels" / "test.tsv", "a") as f:  # a judged query, all grades below 1
        f.write("tr0_0\td0_0\t0\n")
    rows, y = ds.qrels("test")
    assert [ds.query_ids[r] for r in rows] == sorted(test_ids, key=ds.query_ids.index)
    rows_e, y_e = ds.qrels("test", keep_empty=True)
    assert ds.query_index["tr0_0"] in rows_e and rows_e.size == rows.size + 1
    empty = int(np.searchsorted(rows_e, ds.query_index["tr0_0"]))
    assert y_e.csr[empty].nnz == 0
    keep = np.delete(np.arange(rows_e.size), empty)
    assert (y_e.csr[keep] != y.csr).nnz == 0


@pytest.mark.parametrize("content,match", [
    (b"0.1 0.2\n0.3 0.4\n", "corpus.npy is not a .npy file .*looks like text"),
    ("truncate", "corpus.npy is truncated"),
    ("objects", "corpus.npy holds Python objects"),
    ("nan", r"corpus.npy holds NaN or inf \(rows \[2\]"),
    ("1e300", r"corpus.npy holds NaN or inf \(rows \[2\]\.\.\.; or values beyond float32's"),
    ("1-d", "corpus.npy must hold a 2-D real matrix"),
])
def test_bad_embeddings_files_are_named(beir, content, match):
    from textdata import write_embeddings

    write_embeddings(beir, "e")
    path = beir / "embeddings" / "e" / "corpus.npy"
    if content == "truncate":
        path.write_bytes(path.read_bytes()[:-100])
    elif content == "objects":
        np.save(path, np.array([None] * 30, dtype=object), allow_pickle=True)
    elif content in ("nan", "1-d", "1e300"):
        x = np.load(path).astype(np.float64)
        x[2, 5] = 1e300 if content == "1e300" else np.nan
        np.save(path, x[:, 0] if content == "1-d" else x)
    else:
        path.write_bytes(content)
    with warnings.catch_warnings():  # float64 1e300 cast to float32: numpy's overflow warning
        warnings.simplefilter("error")  # (a second line on the command's stderr)
        with pytest.raises(ValueError, match=match):
            load_beir(beir).embeddings("e")


def test_corpus_embeddings_of_no_dimension_are_named(beir):
    """A (n, 0) corpus.npy was read, then queries.npy was blamed: 'has shape (m, 48), expected
    (m, 0)'."""
    from textdata import write_embeddings

    write_embeddings(beir, "e")
    path = beir / "embeddings" / "e" / "corpus.npy"
    n = len(np.load(path))
    np.save(path, np.zeros((n, 0), np.float32))
    with pytest.raises(InputError, match=rf"corpus.npy has shape \({n}, 0\), expected "
                                         rf"\({n}, d >= 1\) to match corpus.jsonl$"):
        load_beir(beir).embeddings("e")


def test_query_embeddings_of_another_dimension_are_named(beir):
    """It loaded and failed later with 'queries has dimension 5, expected 48 (the dimension
    the model was fitted with)', naming no file."""
    from textdata import write_embeddings

    write_embeddings(beir, "e")
    path = beir / "embeddings" / "e" / "queries.npy"
    x = np.load(path)
    np.save(path, x[:, :5])
    d = np.load(beir / "embeddings" / "e" / "corpus.npy").shape[1]
    with pytest.raises(InputError, match=rf"queries.npy has shape \({len(x)}, 5\), expected "
                                         rf"\({len(x)}, {d}\) to match queries.jsonl and corpus"):
        load_beir(beir).embeddings("e")
