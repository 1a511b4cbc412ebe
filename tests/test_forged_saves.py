"""Forged or hostile saves (checksums recomputed, so only the content checks stand) are refused
with a FormatError naming the file: no crash, no gigabytes read, no raw library error."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import textwrap
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

import pefa_gpu as pg
from pefa_gpu import storage
from pefa_gpu.errors import FormatError

from conftest import unit_rows

N, M, D = 60, 30, 8
MiB = 2**20


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(11)
    P, Q = unit_rows(rng, N, D), unit_rows(rng, M, D)
    y = sp.csr_matrix((np.ones(M, np.float32), (np.arange(M), rng.integers(0, N, M))),
                      shape=(M, N))
    return P, Q, y, unit_rows(rng, 4, D)


def manifest(save: Path) -> dict:
    return json.loads((save / "manifest.json").read_text())


def data_file(save: Path, rel: str) -> Path:
    return save / manifest(save)["data"] / rel


def resign(save: Path) -> None:
    """Recompute every size, sha256 and the manifest checksum after editing files (a forger
    can: they detect corruption, not forgery)."""
    m = manifest(save)
    files = storage.describe_files(save / m["data"])
    m["files"] = files
    m["manifest_sha256"] = storage.manifest_checksum(m)
    (save / "manifest.json").write_text(json.dumps(m))


# ---------------------------------------------------------------------------- sizes while streaming

def npy_of_zeros(n: int) -> bytes:
    """The .npy header of n float32 zeros (the body is streamed separately)."""
    fh = io.BytesIO()
    np.lib.format.write_array_header_1_0(fh, {"descr": "<f4", "fortran_order": False,
                                             "shape": (n,)})
    return fh.getvalue()


def bomb_npz(path: Path, csr: sp.csr_matrix, n: int, lie: bool) -> None:
    """A CSR .npz whose ``data`` member inflates to ``n`` float32 zeros (deflated: a few
    hundred KB). ``lie``: its zip directory declares the size of the honest member instead."""
    honest = io.BytesIO()
    np.save(honest, csr.data)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, arr in (("indptr", csr.indptr), ("indices", csr.indices)):
            buf = io.BytesIO()
            np.save(buf, arr)
            z.writestr(f"{name}.npy", buf.getvalue())
        with z.open("data.npy", "w") as fh:
            fh.write(npy_of_zeros(n))
            zeros = bytes(MiB)
            for _ in range(n * 4 // MiB):
                fh.write(zeros)
        buf = io.BytesIO()
        np.save(buf, np.asarray(csr.shape, np.int64))
        z.writestr("shape.npy", buf.getvalue())
    if lie:  # patch the uncompressed size in the local header and the central directory
        raw = bytearray(path.read_bytes())
        with zipfile.ZipFile(path) as z:
            info = z.getinfo("data.npy")
        small = struct.pack("<I", len(honest.getvalue()))
        raw[info.header_offset + 22: info.header_offset + 26] = small
        at = raw.find(b"PK\x01\x02")
        while at >= 0:
            name_len = struct.unpack_from("<H", raw, at + 28)[0]
            if raw[at + 46: at + 46 + name_len] == b"data.npy":
                raw[at + 24: at + 28] = small
            at = raw.find(b"PK\x01\x02", at + 4)
        path.write_bytes(bytes(raw))


@pytest.mark.parametrize("lie", [False, True])
def test_a_relevance_npz_inflating_past_its_declared_size_is_refused_early(tmp_path, data, lie):
    P, Q, y, _ = data
    save = tmp_path / "m"
    pg.PEFAXL(device="cpu", k=2).fit(P, Q, y).save(save)
    entry = manifest(save)["state"]["relevance"]
    path = data_file(save, entry["file"])
    csr = storage.load_csr(path)
    bomb_npz(path, csr, 48 * MiB // 4, lie)
    assert path.stat().st_size < 2 * MiB
    resign(save)
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match=r"relevance\.npz"):
            pg.load(save, device="cpu")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * MiB, peak / MiB  # d6866eb: the 48 MiB member inflated whole, then refused


# ---------------------------------------------------------------------------- malformed manifests

@pytest.fixture
def erm_save(tmp_path, data):
    save = tmp_path / "m"
    pg.ERM(device="cpu").fit(data[0]).save(save)
    return save


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_a_nan_literal_in_the_manifest_is_refused_naming_it(erm_save, literal):
    path = erm_save / "manifest.json"
    path.write_text(path.read_text().replace('"created": ', f'"created": {literal}, "x": ', 1))
    with pytest.raises(FormatError, match=rf"manifest\.json .*{literal.lstrip('-')}"):
        pg.load(erm_save, device="cpu")


def test_a_deeply_nested_manifest_is_refused(erm_save):
    (erm_save / "manifest.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(FormatError, match=r"manifest\.json .*nested too deeply"):
        pg.load(erm_save, device="cpu")


def test_a_big_endian_npy_is_refused_naming_the_file(erm_save):
    m = manifest(erm_save)
    path = data_file(erm_save, m["state"]["doc_embeddings"]["file"])
    arr = np.load(path)
    path.unlink()  # it may be hard-linked to the index's copy: write a new file
    np.save(path, arr.astype(">f4"))
    resign(erm_save)
    with pytest.raises(FormatError, match=r"doc_embeddings\.npy holds >f4 in non-native"):
        pg.load(erm_save, device="cpu")
