"""The command line's hardening: a build folder is data, outputs go only to regular files and
are checked first, every argument mistake is caught before data is read, and the output says
what it counted (skipped queries, graded gains, MRR, TREC runs)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

import pefa_gpu as pg
from pefa_gpu import runs, storage
from pefa_gpu.builds import load_build
from pefa_gpu.cli import main
from conftest import run_python
from textdata import bow_unit, write_beir, write_embeddings


@pytest.fixture
def data(tmp_path):
    root = write_beir(tmp_path / "toy", n_topics=5, docs_per_topic=5, train_per_doc=2, seed=5,
                      mismatch=True)
    write_embeddings(root, "bow")
    return root


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def ok(capsys, *argv):
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    return out


@pytest.fixture
def built(data, tmp_path, capsys):
    """An XS build made with the callable test encoder (cached in tmp_path / 'c')."""
    out = tmp_path / "build"
    ok(capsys, "build", data, "--method", "xs", "--model", "textdata:BowEncoder",
       "--cache-dir", tmp_path / "c", "--device", "cpu", "--out", out, "-q")
    return out


def resign(path: Path, edit) -> None:
    manifest = json.loads(path.read_text())
    edit(manifest)
    if "manifest_sha256" in manifest:
        manifest["manifest_sha256"] = storage.manifest_checksum(manifest)
    path.write_text(json.dumps(manifest))


def forge_file(build: Path, field: str, content: str) -> None:
    """Replace the build's file named by ``field`` with ``content``, its size, sha256 and the
    manifest checksum made to match (a forged build that passes the integrity checks)."""
    path = build / "pefa_build.json"
    info = json.loads(path.read_text())
    file = build / info["data"] / info[field]
    file.write_text(content)
    info["files"][info[field]] = {"bytes": file.stat().st_size,
                                  "sha256": storage.sha256_file(file)}
    path.write_text(json.dumps(info))
    resign(path, lambda m: None)


# ---------------------------------------------------------------------------- item 1: no code

SIDE_EFFECT = """
from pathlib import Path
Path(__file__).with_name("IMPORTED").write_text("the build folder ran code")
def shell(texts):
    Path(__file__).with_name("CALLED").write_text(repr(texts))
    raise SystemExit(0)
"""


def test_a_build_folder_never_makes_search_import_code(built, tmp_path, capsys, monkeypatch):
    (tmp_path / "evilmod.py").write_text(SIDE_EFFECT)
    monkeypatch.syspath_prepend(str(tmp_path))
    for record in ({"kind": "callable", "name": "evilmod:shell"},
                   {"kind": "unknown", "name": "evilmod:shell"}):
        resign(built / "pefa_build.json", lambda m: m.update(encoder=record))
        code, _, err = run(capsys, "search", built, "a query", "--device", "cpu", "-q")
        assert code == 2 and "pass --model" in err
    assert not (tmp_path / "IMPORTED").exists() and not (tmp_path / "CALLED").exists()


@pytest.mark.parametrize("spec, why", [
    (".relative:f", "invalid format"), (":f", "invalid format"), ("a b:f", "invalid format"),
    ("no_such_module_28:f", "No module named 'no_such_module_28'"),
    ("textdata:Nope", "has no attribute 'Nope'")])
def test_a_model_spec_that_cannot_be_imported_is_named(spec, why):
    from pefa_gpu.cli import resolve_model_arg

    with pytest.raises(pg.InputError) as info:
        resolve_model_arg(spec)
    assert str(info.value).startswith(f"--model {spec!r}: cannot import") and why in str(info.value)


@pytest.mark.parametrize("spec, kind", [("os:sep", "str"), ("math:pi", "float")])
def test_a_model_spec_naming_no_callable_is_refused(spec, kind, built, capsys):
    code, _, err = run(capsys, "search", built, "q", "--model", spec, "-q")  # os:sep: folder '/'
    assert code == 2 and f"--model {spec!r} names a {kind}, not a callable" in err, err


@pytest.mark.parametrize("source, why", [
    ("x = (\n", "SyntaxError: '(' was never closed"),
    ("raise RuntimeError('no GPU here')\n", "RuntimeError: no GPU here")])
def test_a_model_module_that_fails_as_it_is_imported_is_named(source, why, tmp_path,
                                                               monkeypatch):
    from pefa_gpu.cli import resolve_model_arg

    (tmp_path / "broken_enc_31.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(pg.InputError) as info:  # was the module's traceback
        resolve_model_arg("broken_enc_31:encode")
    assert str(info.value).startswith("--model 'broken_enc_31:encode': cannot import")
    assert why in str(info.value)


def test_query_texts_after_options_are_queries(built, tmp_path, capsys):
    common = ["--model", "textdata:BowEncoder", "--cache-dir", tmp_path / "c", "--device", "cpu",
              "-q", "--no-text"]
    want = ok(capsys, "search", built, "first query", "second query", "--topk", "3", *common)
    # were 'pefa-gpu: error: unrecognized arguments: first query'
    assert ok(capsys, "search", built, "--topk", "3", "first query", *common,
              "second query") == want
    assert ok(capsys, "search", built, "first query", "--topk", "3", "second query",
              *common) == want
    dashed = ok(capsys, "search", built, "first query", "--topk", "3", *common, "--",
                "-dash query")
    assert runs.query_id("-dash query") in dashed and runs.query_id("first query") in dashed
    with pytest.raises(SystemExit):
        main(["search", str(built), "--topk", "3", "a query", "--no-such-flag"])
    # was 'unrecognized arguments: a query --no-such-flag', the query named as unrecognized
    assert "unrecognized arguments: --no-such-flag\n" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["search", str(built), "a query", "--lam", "0.3", "another query"])
    assert "unrecognized arguments: --lam 0.3 another query\n" in capsys.readouterr().err


def test_a_callable_encoder_must_be_given_again(built, tmp_path, capsys):
    info = json.loads((built / "pefa_build.json").read_text())
    assert info["encoder"] == {"kind": "callable", "name": "textdata:BowEncoder"}
    code, _, err = run(capsys, "search", built, "a query", "--device", "cpu", "-q")
    assert code == 2 and "pass --model 'textdata:BowEncoder' again" in err
    ok(capsys, "search", built, "a query", "--model", "textdata:BowEncoder", "--device", "cpu",
       "--cache-dir", tmp_path / "c", "-q")


def test_an_edited_encoder_record_is_refused(built, capsys):
    path = built / "pefa_build.json"
    resign(path, lambda m: m.update(encoder={"kind": "hub", "name": "os:system"}))
    code, _, err = run(capsys, "search", built, "q", "--device", "cpu", "-q")
    assert code == 2 and "'os:system' is not a hub model name" in err
    info = json.loads(path.read_text())
    info["encoder"] = {"kind": "default", "name": "x"}  # not re-signed
    path.write_text(json.dumps(info))
    code, _, err = run(capsys, "search", built, "q", "--device", "cpu", "-q")
    assert code == 2 and "changed after it was written" in err


def test_quiet_prints_a_python_warning_as_one_line(built, tmp_path):
    shard = next((tmp_path / "c").rglob("*.keys.npy"))
    shard.write_bytes(b"garbage")
    # a process of its own: pytest keeps warnings
    res = run_python("-m", "pefa_gpu", "search", built, "q", "--model", "textdata:BowEncoder",
                     "--cache-dir", tmp_path / "c", "--device", "cpu", "-q", "--no-text")
    assert len(res.stderr.splitlines()) == 1, res.stderr  # + a source
    assert res.stderr.startswith(f"pefa-gpu search: UserWarning: encode cache: ignoring "
                                 f"unreadable shard {shard} (")


def test_a_warning_prints_once_as_one_line_also_without_quiet(data):
    """Embeddings off the unit sphere: eval of erm,xs,xl printed the same P warning three times,
    each with its source line ('p, q, rel = self._embeddings(...)'), among the progress bars."""
    folder = data / "embeddings" / "bow"
    for part in ("corpus", "queries"):
        np.save(folder / f"{part}.npy", 2 * np.load(folder / f"{part}.npy"))
    res = run_python("-m", "pefa_gpu", "eval", data, "--embeddings", "bow", "--methods",
                     "erm,xs,xl", "--device", "cpu")
    lines = [l for l in res.stderr.splitlines() if "not L2-normalised" in l]
    assert [l.split("UserWarning: ")[1][:3] for l in lines] == ["P: ", "Q: "], res.stderr
    assert all(l.startswith("pefa-gpu eval: UserWarning: ") for l in lines)
    assert "_embeddings(" not in res.stderr


def test_search_settings_the_build_does_not_take_are_refused_naming_the_flag(built, capsys):
    """It was 'XSSearchParams got unknown keys', naming no flag, after the queries were
    encoded."""
    code, _, err = run(capsys, "search", built, "a query", "--candidates", "5", "--device",
                       "cpu", "-q")
    assert code == 2 and "--candidates: no effect on this xs build; drop it" in err


# ---------------------------------------------------------------------------- item 13: encoder

def test_precomputed_embeddings_need_an_encoder_to_search_from_text(data, tmp_path, capsys,
                                                                    monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "b"
    ok(capsys, "build", data, "--method", "erm", "--embeddings", "bow", "--device", "cpu",
       "--out", out, "-q")
    info = json.loads((out / "pefa_build.json").read_text())
    assert info["encoder"] == {"kind": "precomputed", "name": "bow"}
    code, _, err = run(capsys, "search", out, "a query", "--device", "cpu", "-q")
    assert code == 2 and "precomputed embeddings 'bow'" in err and "pass --model" in err
    text = ok(capsys, "search", out, "a query", "--model", "textdata:BowEncoder", "--device",
              "cpu", "--no-cache", "-q")
    assert len(text.splitlines()) == 1 + 10


# ---------------------------------------------------------------------------- items 6 and 7

def test_a_failed_rebuild_keeps_the_previous_build(built, data, tmp_path, capsys, monkeypatch):
    before = load_build(built, device="cpu")
    real = pg.PEFAXS.save

    def failing(self, directory):
        real(self, directory)
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(pg.PEFAXS, "save", failing)
    code, _, err = run(capsys, "build", data, "--method", "xs", "--lam", "0.9", "--embeddings",
                       "bow", "--device", "cpu", "--out", built, "-q")
    assert code == 1 and "No space left" in err and "nothing was replaced" in err
    monkeypatch.undo()
    model, doc_ids, info = load_build(built, device="cpu")
    assert model.params.lam == before[0].params.lam == 0.5 and doc_ids == before[1]
    assert info["encoder"]["kind"] == "callable"


def test_build_never_touches_a_users_files(data, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "doc_ids.json").write_text("my own list")
    code, _, err = run(capsys, "build", data, "--method", "erm", "--embeddings", "bow",
                       "--device", "cpu", "--out", out, "-q")
    assert code == 2 and "not a pefa-gpu-build save" in err
    assert (out / "doc_ids.json").read_text() == "my own list"
    ok(capsys, "build", data, "--method", "erm", "--embeddings", "bow", "--device", "cpu",
       "--out", tmp_path / "b", "-q")
    (tmp_path / "b" / "README").write_text("notes")  # kept when the build is replaced
    ok(capsys, "build", data, "--method", "xs", "--embeddings", "bow", "--device", "cpu",
       "--out", tmp_path / "b", "-q")
    assert (tmp_path / "b" / "README").read_text() == "notes"
    assert type(load_build(tmp_path / "b", device="cpu")[0]) is pg.PEFAXS


@pytest.mark.parametrize("field,value", [("model", "../elsewhere"), ("model", "/abs/model"),
                                         ("doc_ids", "../ids.json")])
def test_build_paths_must_stay_inside(built, tmp_path, field, value, capsys):
    load_build(built, device="cpu")
    data = built / json.loads((built / "pefa_build.json").read_text())["data"]
    shutil.copytree(data / "model", tmp_path / "elsewhere")
    shutil.copy(data / "doc_ids.json", tmp_path / "ids.json")
    resign(built / "pefa_build.json", lambda m: m.update({field: value}))
    with pytest.raises(pg.FormatError, match="unsafe path"):
        load_build(built, device="cpu")


@pytest.mark.parametrize("content,match", [
    ("[1, 2", "is not a document id list"), ('{"ids": []}', "is not a document id list"),
    ('{"doc_ids": [1, 2]}', "must be a list of strings"),
    ('{"doc_ids": ["a", "a"]}', "not unique")])
def test_a_malformed_doc_ids_file_is_named(built, content, match):
    forge_file(built, "doc_ids", content)
    with pytest.raises(pg.FormatError, match=f"doc_ids.json.*{match}|{match}"):
        load_build(built, device="cpu")


@pytest.mark.parametrize("field", ["doc_ids", "doc_text"])
def test_a_build_table_nested_too_deeply_is_a_format_error(built, field):
    from pefa_gpu.builds import load_doc_text

    forge_file(built, field, "[" * 200_000 + "]" * 200_000)  # was a raw RecursionError
    with pytest.raises(pg.FormatError, match=f"{field}.json is not a"):
        load_build(built, device="cpu") if field == "doc_ids" else load_doc_text(built, 36)


def test_doc_text_of_a_build_replaced_since_its_model_loaded_is_refused(built):
    """search loads the build, encodes and searches, then reads the texts: a build replaced
    meanwhile (same document count) labelled the old ids with the new build's texts."""
    from pefa_gpu.builds import load_doc_text

    model, doc_ids, info = load_build(built, device="cpu")
    assert load_doc_text(built, len(doc_ids), info) is not None
    resign(built / "pefa_build.json", lambda m: m.update(method="another build"))
    with pytest.raises(pg.FormatError, match="changed since its model was loaded"):
        load_doc_text(built, len(doc_ids), info)


# ---------------------------------------------------------------------------- item 3: outputs

def test_outputs_are_checked_before_any_work_and_never_replace_links(tmp_path, capsys):
    target = tmp_path / "real.json"
    target.write_text("keep")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    cases = [(link, "is a symbolic link"), (tmp_path / "adir", "is a directory"),
             (tmp_path / "afile" / "out.json", "is a file, not a folder")]
    if os.path.exists("/dev/null"):
        cases.append((Path("/dev/null"), "not a regular file"))
    for path, match in cases:
        # the data folder does not exist: the output is checked first
        code, _, err = run(capsys, "eval", tmp_path / "no-data", "--json", path, "-q")
        assert code == 2 and match in err, err
    assert link.is_symlink() and target.read_text() == "keep"
    code, _, err = run(capsys, "sweep", tmp_path / "no-data", "--plot", link, "-q")
    assert code == 2 and "--plot" in err and "symbolic link" in err
    code, _, err = run(capsys, "search", tmp_path / "no-build", "q", "--out", tmp_path / "adir")
    assert code == 2 and "--out" in err and "is a directory" in err


def test_an_output_file_that_is_or_holds_the_cache_dir_is_refused_first(tmp_path, capsys):
    """--json X --cache-dir X (or X/c) encoded into the folder X, then failed at the end: '--json
    X is a directory'; now refused before the data is read (here: none)."""
    for cmd, flag, out, cache in (("eval", "--json", "x", "x"), ("eval", "--json", "x", "x/c"),
                                  ("sweep", "--plot", "p", "p/c"),
                                  ("search", "--out", "o", "o")):
        argv = [cmd, tmp_path / "no-data", *(["q"] if cmd == "search" else []), flag,
                tmp_path / out, "--cache-dir", tmp_path / cache, "-q"]
        code, _, err = run(capsys, *argv)
        assert code == 2 and f"{flag} {tmp_path / out} is (or is a folder above) --cache-dir" \
            in err, err
        assert not (tmp_path / out).exists()
    ok_json = tmp_path / "c" / "x.json"  # an output inside the cache folder is no clash
    code, _, err = run(capsys, "eval", tmp_path / "no-data", "--json", ok_json, "--cache-dir",
                       tmp_path / "c", "-q")
    assert code == 2 and "cache-dir" not in err


def test_json_output_replaces_a_regular_file_atomically_keeping_its_mode(data, tmp_path, capsys):
    out = tmp_path / "res.json"
    out.write_text("old")
    os.chmod(out, 0o640)
    ok(capsys, "eval", data, "--embeddings", "bow", "--methods", "erm", "--device", "cpu",
       "--json", out, "-q")
    assert json.loads(out.read_text())["results"][0]["method"] == "erm"
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["res.json", "toy"]


def test_a_long_output_name_is_written_and_a_failed_write_names_the_output(data, tmp_path,
                                                                          capsys):
    """A 240-character name (the limit is 255) failed after the work: its temporary name was
    over 255 ('File name too long: .../.aaa...json.pefa-tmp-...json'), naming that file."""
    out = tmp_path / ("r" * 235 + ".json")
    ok(capsys, "eval", data, "--embeddings", "bow", "--methods", "erm", "--device", "cpu",
       "--json", out, "-q")
    assert json.loads(out.read_text())["results"][0]["method"] == "erm"

    def full(path):
        path.write_text("part")
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OSError, match=f"cannot write --json {tmp_path / 'r.png'}: No space"):
        storage.write_output_file(tmp_path / "r.png", full, "--json")
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name, "toy"]


# ---------------------------------------------------------------------------- item 18: arguments

@pytest.mark.parametrize("cmd", ["eval", "sweep", "tune", "build"])
def test_lam_has_one_rule_and_message_checked_before_data(cmd, tmp_path, capsys):
    extra = ["--out", tmp_path / "o"] if cmd == "build" else []
    with pytest.raises(SystemExit) as e:
        main([cmd, str(tmp_path / "no-data"), "--lam", "1.5", *map(str, extra)])
    assert e.value.code == 2
    assert "argument --lam: λ must lie in [0, 1], got '1.5'" in capsys.readouterr().err


def test_a_negative_zero_lam_is_zero():
    """--lam -0 was kept as -0.0: tables and build's label showed 'λ=-0', its manifest -0.0."""
    from pefa_gpu.cli import build_parser

    for argv in (["eval", "d", "--lam=-0.0,0.5"], ["build", "d", "--lam=-0", "--out", "o"]):
        lam = build_parser().parse_args(argv).lam
        assert str(lam).startswith(("(0.0", "0.0")), lam


@pytest.mark.parametrize("argv,match", [
    (["--threads", "-1"], "argument --threads: must be a positive integer"),
    (["--threads", "0"], "argument --threads: must be a positive integer"),
    (["--batch-size", "0"], "argument --batch-size: must be a positive integer"),
    (["--candidates", "0"], "argument --candidates: must be a positive integer"),
])
def test_counts_must_be_positive(argv, match, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["eval", str(tmp_path), *argv])
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("argv,match", [
    (["eval", "--methods", "erm", "--lam", "0.3"], "--lam has no effect with --methods erm"),
    (["eval", "--methods", "erm,xs", "--k", "8"], "--k has no effect with --methods erm,xs"),
    (["sweep", "--methods", "xs", "--candidates", "50"], "--candidates has no effect"),
    (["tune", "--methods", "erm", "--no-augment"], "--no-augment has no effect"),
    (["tune", "--val-fraction", "1"], "--val-fraction must lie strictly between 0 and 1"),
    (["build", "--method", "erm", "--lam", "0.5", "--out", "X"], "--lam has no effect with "
                                                                 "--method erm"),
    (["build", "--method", "xs", "--k", "4", "--out", "X"], "--k has no effect"),
    (["build", "--method", "xl", "--seed", "3", "--out", "X"], "--seed has no effect"),
    (["eval", "--model", "m", "--embeddings", "e"], "either --embeddings"),
    (["eval", "-q", "-v"], "either --quiet (no log lines) or --verbose (more), not both"),
    # were ignored: the pairs file is the training split; --xmc's folders hold their splits
    # and weights
    (["eval", "--train-pairs", "p.tsv", "--train-split", "dev"], "--train-split has no effect "
                                                               "with --train-pairs"),
    (["build", "--train-pairs", "p.tsv", "--train-split", "dev", "--out", "X"],
     "--train-split has no effect"),
    (["eval", "--split", "dev"], "drop --split"),
    (["tune", "--train-split", "dev", "--min-score", "2"], "drop --train-split, --min-score"),
])
def test_options_that_do_nothing_are_refused_before_data(argv, match, tmp_path, capsys):
    data = ["--xmc", tmp_path / "x", "--emb", tmp_path / "e"] if "drop" in match else \
        [tmp_path / "no-data"]
    code, _, err = run(capsys, argv[0], *data, *argv[1:])
    assert code == 2 and match in err and "is not a directory" not in err


def test_search_argument_errors(tmp_path, capsys):
    code, _, err = run(capsys, "search", tmp_path)
    assert code == 2 and "no queries" in err
    code, _, err = run(capsys, "search", tmp_path, "q", "--tag", "run1")
    assert code == 2 and "--tag names a TREC run" in err
    code, _, err = run(capsys, "search", tmp_path, "q", "--format", "trec", "--tag", "a b")
    assert code == 2 and "one word" in err
    code, _, err = run(capsys, "search", tmp_path, "q", "--out", tmp_path / "r.run", "--no-text")
    assert code == 2 and "--no-text has no effect on a TREC run" in err


def test_build_help_describes_build(capsys):
    with pytest.raises(SystemExit):
        main(["build", "--help"])
    text = capsys.readouterr().out
    assert "Nothing is evaluated" in text and "--split" not in text
    assert "--count-empty" not in text and "λ in [0, 1]" in text


# ---------------------------------------------------------------------------- items 14-16: output

def test_eval_reports_skipped_queries_and_count_empty_counts_them(tmp_path, capsys):
    root = write_beir(tmp_path / "d", n_topics=4, docs_per_topic=4, seed=9)
    with open(root / "queries.jsonl", "a") as f:
        f.write(json.dumps({"_id": "lonely", "text": "nothing relevant"}) + "\n")
    write_embeddings(root, "bow")
    with open(root / "qrels" / "test.tsv", "a") as f:
        f.write("lonely\td0_0\t0\n")
    argv = ["eval", root, "--embeddings", "bow", "--methods", "erm", "--device", "cpu", "-q"]
    out = ok(capsys, *argv, "--json", tmp_path / "a.json")
    assert "1 without a relevant document skipped; --count-empty counts them as 0" in out
    assert "nDCG gains: the qrels grades" in out and "| mrr@10 |" in out
    skip = json.loads((tmp_path / "a.json").read_text())
    out = ok(capsys, *argv, "--count-empty", "--json", tmp_path / "b.json")
    assert "1 without a relevant document counted as 0" in out
    zero = json.loads((tmp_path / "b.json").read_text())
    assert (skip["n_test_queries"], skip["n_skipped"], skip["n_empty"]) == (12, 1, 1)
    assert (zero["n_test_queries"], zero["n_skipped"], zero["count_empty"]) == (13, 0, True)
    # independent: ERM top-100 of the bag-of-words vectors, recall averaged both ways
    ds = pg.load_beir(root)
    P, Qa = bow_unit(ds.corpus_texts), bow_unit(ds.query_texts)
    lines = (root / "qrels" / "test.tsv").read_text().splitlines()[1:]
    rel: dict[str, set] = {}
    for line in lines:
        q, d, g = line.split("\t")
        rel.setdefault(q, set())
        if float(g) >= 1:
            rel[q].add(d)
    recalls = []
    for q, docs in rel.items():
        scores = Qa[ds.query_index[q]] @ P.T
        top = np.lexsort((np.arange(len(scores)), -scores))[:10]
        recalls.append(len({ds.corpus_ids[i] for i in top} & docs) / len(docs) if docs else 0)
    assert skip["results"][0]["recall@10"] == pytest.approx(sum(recalls) / 12, abs=1e-9)
    assert zero["results"][0]["recall@10"] == pytest.approx(sum(recalls) / 13, abs=1e-9)


def test_search_writes_trec_runs_with_stable_query_ids(built, tmp_path, capsys):
    common = ["--model", "textdata:BowEncoder", "--cache-dir", tmp_path / "c", "--device",
              "cpu", "--topk", "3", "-q"]
    qfile = tmp_path / "q.txt"
    qfile.write_text("second query\nfirst query\n")
    ok(capsys, "search", built, "first query", "--queries", qfile, *common,
       "--out", tmp_path / "run.trec", "--tag", "myrun")
    lines = (tmp_path / "run.trec").read_text().splitlines()
    qid = {t: "q-" + hashlib.sha256(t.encode()).hexdigest()[:10]
           for t in ("first query", "second query")}
    assert len(lines) == 2 * 3  # "first query" given twice is searched once
    fields = [line.split(" ") for line in lines]
    assert all(len(f) == 6 and f[1] == "Q0" and f[5] == "myrun" for f in fields)
    assert [f[0] for f in fields] == [qid["first query"]] * 3 + [qid["second query"]] * 3
    assert [int(f[3]) for f in fields] == [1, 2, 3, 1, 2, 3]
    scores = [float(f[4]) for f in fields]
    assert scores[:3] == sorted(scores[:3], reverse=True)
    # the same ids in another run, whatever the order and the other queries
    text = ok(capsys, "search", built, "unrelated", "second query", *common, "--format", "trec")
    assert [line.split(" ")[0] for line in text.splitlines()][3:] == [qid["second query"]] * 3
    # equal to the TSV output's documents
    tsv = ok(capsys, "search", built, "first query", *common)
    assert [line.split("\t")[2] for line in tsv.splitlines()[1:]] == [f[2] for f in fields[:3]]


def test_search_output_format_follows_the_out_suffix_unless_given(built, tmp_path, capsys):
    common = ["first query", "--model", "textdata:BowEncoder", "--cache-dir", tmp_path / "c",
              "--device", "cpu", "--topk", "2", "-q"]
    for name, fmt in [("r.json", None), ("r.RUN", None), ("r.txt", None), ("r.json", "tsv")]:
        out = tmp_path / name
        ok(capsys, "search", built, *common, "--out", out, *(["--format", fmt] if fmt else []))
        text = out.read_text()
        if name == "r.json" and fmt is None:
            assert [r["rank"] for r in json.loads(text)[0]["results"]] == [1, 2]
        elif name == "r.RUN":
            assert [line.split(" ")[1:4:2] for line in text.splitlines()] == [["Q0", "1"],
                                                                              ["Q0", "2"]]
        else:
            assert text.splitlines()[0].startswith("query_id\trank\tdoc_id\tscore")


# ---------------------------------------------------------------------------- probe-cli

def test_outputs_never_replace_the_inputs(data, built, tmp_path, capsys):
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("q\td\n")
    cases = [("eval", data, "--json", data / "corpus.jsonl"),
             ("eval", data, "--json", data / "qrels" / "test.tsv"),
             ("tune", data, "--json", data / "embeddings" / "bow" / "corpus.npy"),
             ("sweep", data, "--plot", data / "qrels" / "new.png"),
             ("eval", data, "--json", pairs, "--train-pairs", pairs)]
    before = {p: p.read_bytes() for p in [*data.rglob("*"), pairs] if p.is_file()}
    for cmd, root, flag, out, *more in cases:
        code, _, err = run(capsys, cmd, root, "--embeddings", "bow", flag, out, *more, "-q")
        assert code == 2 and f"{flag} {out} is (or is inside) one of the command's inputs" in err
    manifest = built / "pefa_build.json"
    code, _, err = run(capsys, "search", built, "q", "--out", manifest)
    assert code == 2 and "one of the command's inputs" in err
    assert {p: p.read_bytes() for p in before} == before and manifest.is_file()
    ok(capsys, "eval", data, "--embeddings", "bow", "--json", data / "results.json", "-q")


def test_outputs_never_replace_the_model_module_or_folder(built, tmp_path, capsys, monkeypatch):
    module = tmp_path / "enc_module_b4.py"
    module.write_text("from textdata import BowEncoder\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "st").mkdir()
    for model, out in (("enc_module_b4:BowEncoder", module), (tmp_path / "st", tmp_path / "st/r")):
        code, _, err = run(capsys, "search", built, "q", "--model", model, "--out", out, "-q")
        assert code == 2 and "one of the command's inputs" in err, err  # was written over
    assert module.read_text() == "from textdata import BowEncoder\n"
    assert not (tmp_path / "st" / "r").exists()


def test_outputs_never_replace_embeddings_or_splits_named_outside_the_data_folder(
        data, tmp_path, capsys):
    outside = tmp_path / "elsewhere"
    shutil.copytree(data / "embeddings" / "bow", outside)
    before = {p: p.read_bytes() for p in outside.iterdir()}
    for name in (outside, os.path.relpath(outside, data / "embeddings")):
        code, _, err = run(capsys, "eval", data, "--embeddings", name, "--json",
                           outside / "corpus.npy", "-q")  # was replaced by the JSON
        assert code == 2 and "one of the command's inputs" in err, err
    assert {p: p.read_bytes() for p in outside.iterdir()} == before
    split = tmp_path / "split.tsv"
    split.write_bytes((data / "qrels" / "test.tsv").read_bytes())
    for flag in ("--split", "--train-split"):
        code, _, err = run(capsys, "eval", data, "--embeddings", "bow", flag,
                           os.path.relpath(tmp_path / "split", data / "qrels"), "--json", split,
                           "-q")  # was replaced by the JSON
        assert code == 2 and "one of the command's inputs" in err, err
    assert split.read_bytes() == (data / "qrels" / "test.tsv").read_bytes()


def test_outputs_never_replace_a_builds_files(data, built, tmp_path, capsys):
    manifest = built / "pefa_build.json"
    data_folder = next(built.glob("pefa-data-*"))
    before = {p: p.read_bytes() for p in built.rglob("*") if p.is_file()}
    for out in (manifest, data_folder / "doc_ids.json", data_folder / "new.json"):
        code, _, err = run(capsys, "eval", data, "--embeddings", "bow", "--json", out, "-q")
        assert code == 2 and "a saved build or model's files" in err, err  # eval wrote there
    other = tmp_path / "other"
    shutil.copytree(built, other)
    code, _, err = run(capsys, "search", other, "a query", "--out", manifest, "-q")
    assert code == 2 and "a saved build or model's files" in err, err
    assert {p: p.read_bytes() for p in built.rglob("*") if p.is_file()} == before
    ok(capsys, "eval", data, "--embeddings", "bow", "--json", built / "r.json", "-q")  # beside it


def test_the_encode_cache_is_never_written_into_a_builds_files(built, tmp_path, capsys):
    """--cache-dir in a build's data folder added files its manifest does not list: every later
    search failed ('... holds [...model.json], which pefa_build.json does not list')."""
    data_folder = next(built.glob("pefa-data-*"))
    search = ["search", built, "a query", "--model", "textdata:BowEncoder", "--device", "cpu",
              "-q"]
    for cache in (data_folder, data_folder / "cache"):
        code, out, err = run(capsys, *search, "--cache-dir", cache)
        assert code == 2 and out == "" and "--cache-dir" in err and "build or model's" in err
    assert sorted(p.name for p in data_folder.iterdir()) == sorted(
        [".pefa-data", "doc_ids.json", "doc_text.json", "model"])
    ok(capsys, *search, "--cache-dir", built / "cache")  # beside the data folder: not its files
    ok(capsys, *search, "--no-cache", "--cache-dir", data_folder)  # no cache: nothing written


def test_the_ray_work_dir_is_never_a_builds_files(built, tmp_path, capsys):
    """--work-dir in a build's data folder would have written the stages' shards among its
    files (every later search: '... which pefa_build.json does not list'); refused before Ray
    starts."""
    data_folder = next(built.glob("pefa-data-*"))
    before = sorted(p.name for p in data_folder.iterdir())
    code, out, err = run(capsys, "eval", tmp_path / "nodata", "--ray", "local", "--work-dir",
                         data_folder / "work", "-q")
    assert code == 2 and out == "" and "--work-dir" in err and "build or model's" in err, err
    assert sorted(p.name for p in data_folder.iterdir()) == before


def test_search_given_the_build_manifest_asks_for_its_folder(built, capsys, tmp_path):
    code, _, err = run(capsys, "search", built / "pefa_build.json", "a query", "-q")
    assert code == 2 and "is a file; give the folder" in err, err  # was 'pefa_build.json missing'
    os.mkfifo(tmp_path / "fifo")  # was called 'a file'
    code, _, err = run(capsys, "search", tmp_path / "fifo", "a query", "-q")
    assert code == 2 and "fifo is not a folder; give the folder" in err, err


@pytest.mark.parametrize("argv,flag", [
    (["eval", "", "--embeddings", "bow"], "DATA_DIR"), (["search", "", "q"], "MODEL_DIR"),
    (["eval", "D", "--embeddings", ""], "--embeddings"), (["eval", "D", "--json", ""], "--json"),
    (["sweep", "D", "--plot", ""], "--plot"), (["eval", "D", "--model", ""], "--model"),
    (["eval", "D", "--train-pairs", ""], "--train-pairs"), (["build", "D", "--out", ""], "--out"),
    (["eval", "D", "--cache-dir", ""], "--cache-dir"),
])
def test_empty_values_are_refused_not_taken_as_absent(argv, flag, capsys):
    code, _, err = run(capsys, *argv)
    assert code == 2 and f"{flag} is empty" in err, err


def test_sweep_without_matplotlib_plots_only_when_asked_and_says_so_first(data, tmp_path,
                                                                           capsys, monkeypatch):
    """Without matplotlib (an optional extra) sweep --json ran, wrote the JSON, then failed on
    the plot nobody asked for ('plots need matplotlib'); an explicit --plot failed only at the
    end too."""
    for name in ("matplotlib", "matplotlib.backend_bases", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)  # import matplotlib: ImportError
    out = tmp_path / "r.json"
    ok(capsys, "sweep", data, "--embeddings", "bow", "--methods", "erm", "--device", "cpu",
       "--json", out, "-q")
    assert out.is_file() and not out.with_suffix(".png").exists()
    code, _, err = run(capsys, "sweep", tmp_path / "no-data", "--plot", tmp_path / "p.png", "-q")
    assert code == 2 and f"--plot {tmp_path / 'p.png'} needs matplotlib" in err, err



def test_sweep_json_keeps_an_existing_png_and_says_how_to_replace_it(data, tmp_path, capsys,
                                                                      caplog):
    """sweep --json r.json replaced an existing r.png (the user's own image) by its default
    plot; now it is kept with a warning, --plot r.png replaces it, and a plot the sweep wrote
    is refreshed."""
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    png.write_bytes(b"my own image")
    argv = ("sweep", data, "--embeddings", "bow", "--methods", "erm", "--device", "cpu", "-q")
    ok(capsys, *argv, "--json", out)
    assert out.is_file() and png.read_bytes() == b"my own image"
    assert f"no plot written: {png} exists and is kept; give --plot {png}" in caplog.text
    ok(capsys, *argv, "--json", out, "--plot", png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    caplog.clear()  # the sweep's own plot is refreshed by the next run
    before = png.stat().st_ino
    ok(capsys, *argv, "--json", out)
    assert png.stat().st_ino != before and "no plot written" not in caplog.text


@pytest.mark.parametrize("argv,match", [
    (["sweep", "--json", "r.json", "--plot", "r.json"], "--plot r.json is (or is inside) --j"),
    (["sweep", "--json", "r.json", "--plot", "r.json/p.png"], "is (or is inside) --json's file"),
    (["sweep", "--plot", "r.tsv"], "matplotlib cannot write .tsv files"),
    (["sweep", "--plot", "plot"], "matplotlib cannot write a name without a suffix"),  # was
    (["sweep", "--json", "r.png"], "the same file; give --json a .json name"),  # after data
    (["eval", "--device", "meta"], "only cpu and cuda devices"),
    (["eval", "--threads", str(2**31 - 1)], "--threads must be at most the"),
    (["tune", "--metric", "ndcg@10"], "metric must be recall@K terms"),
    (["eval", "--min-score", "0"], "--min-score must be > 0 here, got 0"),  # were scored as
    (["sweep", "--min-score", "-1"], "--min-score must be > 0 here, got -1"),  # not relevant
    (["tune", "--min-score", "-0.5"], "a pair graded 0 or below counts as not relevant"),
])
def test_outputs_device_and_threads_are_checked_before_data(argv, match, tmp_path, capsys):
    if "--plot" in argv:
        pytest.importorskip("matplotlib")
    code, _, err = run(capsys, argv[0], tmp_path / "no-data", *argv[1:], "-q")
    assert code == 2 and match in err and "no-data" not in err, err


@pytest.mark.parametrize("argv,match", [
    (["eval", "--min-score", "nan"], "argument --min-score: must be a finite number"),
    (["tune", "--min-z", "inf"], "argument --min-z: must be a finite number"),
    (["tune", "--val-fraction", "nan"], "argument --val-fraction: must be a finite number"),
    (["tune", "--seed", "-1"], "argument --seed: must be an integer >= 0"),
    (["build", "--method", "auto", "--seed", "x", "--out", "o"], "argument --seed: expected"),
])
def test_numbers_must_be_finite_and_seeds_not_negative(argv, match, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([argv[0], str(tmp_path / "no-data"), *argv[1:]])
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_a_folder_where_a_data_file_belongs_is_bad_data(data, capsys):
    (data / "qrels" / "test.tsv").unlink()
    (data / "qrels" / "test.tsv").mkdir()
    code, _, err = run(capsys, "eval", data, "--embeddings", "bow", "-q")
    assert code == 2 and "Is a directory" in err and "test.tsv" in err


@pytest.mark.parametrize("exc,code,line", [
    (KeyboardInterrupt(), 130, "pefa-gpu eval: interrupted"),  # was 'pefa-gpu eval: '
    (KeyboardInterrupt("kept 3 texts"), 130, "pefa-gpu eval: kept 3 texts"),
    (MemoryError(), 1, "pefa-gpu eval: error: out of memory (MemoryError); try a smaller"),
])
def test_ctrl_c_and_out_of_memory_say_what_happened(exc, code, line, data, capsys, monkeypatch):
    def fail(*args, **kwargs):
        raise exc
    monkeypatch.setattr("pefa_gpu.datasets.load_beir", fail)
    got, out, err = run(capsys, "eval", data, "--embeddings", "bow", "--device", "cpu", "-q")
    assert got == code and out == "" and err.startswith(line) and err.count("\n") == 1, err


def test_a_query_text_with_a_lone_surrogate_is_named(built, capsys):
    """A byte that is not UTF-8 in the shell's argument (sys.argv's surrogateescape) was the
    query id's raw "'utf-8' codec can't encode character" error."""
    assert len(runs.query_id("caf\udce9")) == 12  # an id, not an error
    code, out, err = run(capsys, "search", built, "caf\udce9", "--model", "textdata:BowEncoder",
                         "--no-cache", "--device", "cpu", "-q")
    assert code == 2 and out == "" and "is not valid Unicode" in err and "udce9" in err, err


@pytest.mark.parametrize("n_train, argv, want", [
    (2, ["tune"], "nudge-m, nudge-n, adapter, adapter+xs: the step (NUDGE's gamma, the "
     "adapter's alpha) is chosen on held-out training queries, so at least 2 training queries "
     "are needed, got 1 of 2 (the others are tune's validation queries): give more training "
     "pairs, or leave them out of --methods"),
    (2, ["build", "--method", "auto"], "got 1 of 2 (the others are tune's validation queries): "
     "give more training pairs, or choose another --method"),
    (1, ["eval", "--methods", "erm,nudge-n"], "nudge-n: the step (NUDGE's gamma, the adapter's "
     "alpha) is chosen on held-out training queries, so at least 2 training queries are "
     "needed, got 1: give more training pairs, or leave them out of --methods"),
    (1, ["build", "--method", "adapter"], "got 1: give more training pairs, or choose another "
     "--method")])
def test_too_few_training_queries_to_hold_out_says_what_the_command_can_do(
        n_train, argv, want, tmp_path, capsys):
    """Was NUDGE's "give Q_val / Y_val or set gamma" (the adapter's "set alpha"): arguments of
    the library the command does not have."""
    root = write_beir(tmp_path / "few", n_topics=1, docs_per_topic=n_train, train_per_doc=1)
    write_embeddings(root, "bow")
    out = ["--out", tmp_path / "b"] if argv[0] == "build" else []
    code, _, err = run(capsys, *argv, root, "--embeddings", "bow", "--device", "cpu", "-q", *out)
    assert code == 2 and want in err and err.count("\n") == 1, err
    assert not (tmp_path / "b").exists()
    ok(capsys, *argv[:1], root, "--embeddings", "bow", "--device", "cpu", "-q", *out,
       *(["--method", "xs"] if argv[0] == "build" else ["--methods", "erm,xs,xl"]))


@pytest.mark.parametrize("module, source, spec, want", [
    ("enc_fails_41", "def encode(texts, extra):\n    return None\n", "encode",
     "encoder enc_fails_41.encode failed on a batch of 2 texts: TypeError: encode() missing 1 "
     "required positional argument: 'extra'"),
    ("enc_fails_42", "def encode(texts):\n    raise KeyError('k')\n", "encode",
     "encoder enc_fails_42.encode failed on a batch of 2 texts: KeyError: 'k'"),
    ("enc_fails_43", "class Enc:\n    def __init__(self, dim):\n        pass\n", "Enc",
     "--model 'enc_fails_43:Enc': the class Enc could not be made with no arguments "
     "(TypeError: Enc.__init__() missing 1 required positional argument: 'dim')")])
def test_a_model_callable_that_fails_is_one_line_naming_it(module, source, spec, want, data,
                                                           tmp_path, capsys, monkeypatch):
    """Was the exception's traceback (exit status 1)."""
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = run(capsys, "eval", data, "--model", f"{module}:{spec}", "--no-cache",
                       "--batch-size", "2", "--device", "cpu", "-q")
    assert code == 2 and err == f"pefa-gpu eval: error: {want}\n", err


@pytest.mark.parametrize("kind", ["file", "FIFO (named pipe)"])
def test_a_model_path_that_is_a_file_or_fifo_says_so(kind, data, tmp_path, capsys):
    """Was "the folder exists but is not a sentence-transformers model" (a FIFO was handed to
    sentence-transformers, which may read it)."""
    path = tmp_path / "model"
    path.write_text("{}") if kind == "file" else os.mkfifo(path)
    code, _, err = run(capsys, "eval", data, "--model", path, "--no-cache", "--device", "cpu",
                       "-q")
    assert code == 2 and f"model '{path}' is a {kind}, not a model folder" in err, err


def test_build_refuses_a_cache_folder_inside_its_out_before_any_work(data, tmp_path, capsys):
    """The cache was written into --out as the texts were encoded, and the save then refused
    --out as 'a non-empty directory that is not a pefa-gpu-build save', the cache left there."""
    out = tmp_path / "b"
    code, _, err = run(capsys, "build", data, "--method", "xs", "--model", "textdata:BowEncoder",
                       "--device", "cpu", "-q", "--out", out, "--cache-dir", out / "cache")
    assert code == 2 and f"--cache-dir {out / 'cache'} is (or is inside) --out {out}" in err, err
    assert not out.exists()
