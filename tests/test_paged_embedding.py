"""The embedding left on disk (docs/vault.md 4.1): the same bits as in memory, its rows read page
by page and checked, a damaged page an error that names it and loses nothing."""
from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

import checksum_ref
import pysmoe
from pysmoe import vaultio as V

# embedding formats: the vault's own and two GGML block formats (rows of whole blocks)
FORMATS = ["q8", "q4", "bf16", "f32", "Q8_0", "Q4_0"]


def header(path):
    raw = (path / "vault.bin").read_bytes()
    f = struct.unpack_from("<8sIIQQQQQIIQIIQI", raw, 0)
    return dict(table_bytes=f[5], dense_offset=f[6], dense_bytes=f[7], n_blobs=f[11], paged_bytes=f[13],
                page_bytes=f[14])


@pytest.fixture
def paged_copy(make_vault, tmp_path):
    """A copy of the tiny model with its q8 embedding on disk, to damage."""
    copy = tmp_path / "v"
    shutil.copytree(make_vault("paged_q8", preset="tiny", seed=3, formats={"embed": "q8"}), copy)
    return copy


def paged_start(h):
    return h["dense_offset"] + h["dense_bytes"] - h["paged_bytes"]


def flip(path, offset, mask=0x5A):
    with open(path / "vault.bin", "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_same_bits_as_in_memory(make_vault, fmt):
    """Every row of the vocabulary through a paged embedding and through one in memory: the same
    logits, prefill and decode; the paged vault holds the table's bytes less in memory."""
    kw = dict(preset="tiny", seed=3, formats={"embed": fmt})
    paged = pysmoe.open_vault(make_vault(f"paged_{fmt}", **kw))
    held = pysmoe.open_vault(make_vault(f"held_{fmt}", paged_embedding=False, **kw))
    assert held.paged_bytes == 0 and paged.paged_bytes > 0
    table = V.read_vault(paged.path).tensors["embed_tokens"]
    assert table.format == fmt and paged.paged_bytes == -(-table.nbytes // 64) * 64
    vocab = paged.config["vocab_size"]
    ids = [int(i) for i in np.random.default_rng(7).permutation(vocab)]  # every row, pages in any order
    with paged.session(context=vocab + 8) as a, held.session(context=vocab + 8) as b:
        assert np.array_equal(a.prefill(ids), b.prefill(ids))
        for t in (0, vocab - 1, 5, 5):
            assert np.array_equal(a.decode(t), b.decode(t))
        assert a.stats()["dense_bytes"] == paged.dense_bytes
        assert paged.dense_bytes <= held.dense_bytes - table.nbytes + 16384  # less the table (and its alignment)


def test_a_damaged_page_fails_the_call_that_reads_it_and_loses_nothing(paged_copy):
    copy = paged_copy
    h = header(copy)
    hidden = pysmoe.open_vault(copy).config["hidden_size"]
    row = 300  # q8: the codes of row r are bytes [r·hidden, (r+1)·hidden) of the tensor
    at = row * hidden + 5
    page = at // h["page_bytes"]
    vault = pysmoe.open_vault(copy)
    with vault.session(context=64) as s:
        good = s.prefill([5, row, 7])
        s.reset()
        flip(copy, paged_start(h) + at)  # under the open vault: the open read none of it
        assert s.prefill([1, 2, 3]) is not None  # rows in other pages
        with pytest.raises(pysmoe.ReadError, match=f"embedding's page {page} .* fails its checksum"):
            s.prefill([5, row, 7])
        assert s.position == 3
        with pytest.raises(pysmoe.ReadError, match=f"page {page}"):
            s.decode(row)
        assert s.position == 3
        s.decode(9)
        assert [k for k, *_ in vault.verify()] == ["embedding"]
        assert vault.verify()[0][3] == f"page {page}: checksum mismatch"
        assert V.read_vault(copy).verify() == [f"embedding page {page}"]
        flip(copy, paged_start(h) + at)  # whole again: nothing about the page was kept
        s.reset()
        assert np.array_equal(s.prefill([5, row, 7]), good)
        assert vault.verify() == []


def test_verify_reads_the_paged_rows_values(paged_copy):
    """A NaN scale in a paged row, its page checksum made to match: verify names the row."""
    copy = paged_copy
    h = header(copy)
    t = V.read_vault(copy).tensors["embed_tokens"]
    groups = t.cols // t.group
    row, group = 401, groups - 1
    scales_off = -(-t.rows * t.cols // 64) * 64  # q8 codes, then the scales part at a 64-byte boundary
    at = scales_off + 2 * (row * groups + group)  # f16 scales
    raw = bytearray((copy / "vault.bin").read_bytes())
    start = paged_start(h)
    struct.pack_into("<H", raw, start + at, 0x7E00)  # f16 NaN
    k, pb = at // h["page_bytes"], h["page_bytes"]
    end = min(start + (k + 1) * pb, start + h["paged_bytes"])
    n_pages = -(-h["paged_bytes"] // pb)
    table_end = 256 + h["table_bytes"]
    crc_at = table_end - (4 * n_pages + 7) // 8 * 8 + 4 * k
    struct.pack_into("<I", raw, crc_at, V.checksum(bytes(raw[start + k * pb:end])))
    raw[12:16] = bytes(4)
    struct.pack_into("<I", raw, 12, checksum_ref.checksum(bytes(raw[:table_end])))
    (copy / "vault.bin").write_bytes(bytes(raw))
    bad = pysmoe.open_vault(copy).verify()
    assert [(kind, what) for kind, _, _, what in bad] == [
        ("values", f"embed_tokens scales: 1 non-finite value(s) (NaN or inf), the first at row {row}, group {group}")]
    assert V.read_vault(copy).verify() == []  # its checksums are sound


def test_a_tied_embedding_stays_in_memory(make_vault):
    v = pysmoe.open_vault(make_vault("tied", preset="tiny", seed=0, overrides={"tie_word_embeddings": True}))
    assert v.paged_bytes == 0 and header(v.path)["paged_bytes"] == 0


# ------------------------------------------------------------------ a deferred lm_head (vault.c)

def test_a_deferred_lm_head_gives_the_same_bits(make_vault, monkeypatch):
    """lm_head read beside the first pass (forced here for the tiny model: SMOE_DENSE_DEFER_MIN)
    and read at open: the same logits."""
    path = make_vault("paged_q8", preset="tiny", seed=3, formats={"embed": "q8"})
    ids = [int(i) for i in np.random.default_rng(2).integers(0, 512, 40)]
    out = []
    for defer in ("", "1"):
        monkeypatch.setenv("SMOE_DENSE_DEFER_MIN", defer or str(1 << 40))
        with pysmoe.open_vault(path) as v, v.session(context=64) as s:
            out.append((s.prefill(ids), s.decode(7)))
    assert np.array_equal(out[0][0], out[1][0]) and np.array_equal(out[0][1], out[1][1])


def test_a_damaged_deferred_lm_head_fails_every_pass_not_the_open(paged_copy, monkeypatch):
    copy = paged_copy
    flip(copy, V.read_vault(copy).tensors["lm_head"].offset + 100)
    monkeypatch.setenv("SMOE_DENSE_DEFER_MIN", str(1 << 40))
    with pytest.raises(pysmoe.VaultError, match="dense region checksum mismatch"):
        pysmoe.open_vault(copy)  # read at open: the open fails, as before
    monkeypatch.setenv("SMOE_DENSE_DEFER_MIN", "1")
    with pysmoe.open_vault(copy) as v, v.session(context=64) as s:  # opens: lm_head still arriving
        for _ in range(2):
            with pytest.raises(pysmoe.VaultError, match="dense region checksum mismatch"):
                s.prefill([1, 2, 3])
            assert s.position == 0
        with pytest.raises(pysmoe.VaultError, match="dense region checksum mismatch"):
            s.decode(5)
        assert s.position == 0
        assert ("dense", -1, -1, "checksum mismatch") in v.verify()


_UNLOAD = r"""
import ctypes, _ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
vault = ctypes.c_void_p()
st = lib.smoe_open_vault(sys.argv[2].encode(), ctypes.byref(vault))  # lm_head still arriving
assert st == 0, st
_ctypes.dlclose(lib._handle)  # what cffi and ctypes do to a library at the interpreter's exit
mapped = any(sys.argv[1].rsplit("/", 1)[-1] in line for line in open("/proc/self/maps"))
print("mapped" if mapped else "unmapped", flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="-z nodelete and /proc/self/maps are Linux's")
def test_a_host_that_unloads_the_library_keeps_its_threads_alive(make_vault):
    """A vault left open (its lm_head reader running) in a host that dlcloses the library and
    exits: the library stays mapped (-z nodelete) instead of unmapping the code its threads run
    (a segfault at exit before)."""
    path = make_vault("paged_q8", preset="tiny", seed=3, formats={"embed": "q8"})
    from pysmoe._ffi import LIB_PATH as lib  # the build under test (SMOE_LIB under `make asan`)
    env = {**os.environ, "SMOE_DENSE_DEFER_MIN": "1"}
    r = subprocess.run([sys.executable, "-c", _UNLOAD, str(lib), str(path)], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["mapped"]
