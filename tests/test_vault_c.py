"""libsmoe's vault reader on a good vault: open, config, layer kinds, verify, dequantize."""
from __future__ import annotations

import json
import shutil
import struct
import checksum_ref

import numpy as np
import pytest

import pysmoe
from pysmoe._ffi import check, ffi, lib
from pysmoe import quant



def written_config(path):
    return json.loads((path / "config.json").read_text())


def layer_kinds(cfg):
    """docs/vault.md 2.2, the way transformers decides it."""
    return [int(l not in cfg["mlp_only_layers"] and cfg["num_experts"] > 0
                and (l + 1) % cfg["decoder_sparse_step"] == 0) for l in range(cfg["num_hidden_layers"])]


def header(buf):
    """The header fields of vault.bin bytes, by docs/vault.md section 1."""
    names = ("magic", "version", "header_crc", "file_size", "table_offset", "table_bytes", "dense_offset",
             "dense_bytes", "dense_crc", "n_tensors", "blob_bytes", "n_blobs", "reserved", "paged_bytes",
             "page_bytes")
    return dict(zip(names, struct.unpack_from("<8sIIQQQQQIIQIIQI", buf, 0)))


def page_table_bytes(h):
    """Bytes of the page checksums (2.7) that close the tables of a version-4 vault."""
    n = -(-h["paged_bytes"] // h["page_bytes"]) if h["paged_bytes"] else 0
    return (4 * n + 7) // 8 * 8


def blob_entries(buf):
    """[(offset, crc)] of the blob table, index layer × experts + expert."""
    h = header(buf)
    end = h["table_offset"] + h["table_bytes"] - page_table_bytes(h)
    start = end - 16 * h["n_blobs"]
    return [struct.unpack_from("<QI", buf, start + 16 * i) for i in range(h["n_blobs"])]


class Opened:
    """A raw smoe_vault handle as a context manager."""

    def __init__(self, path):
        p = ffi.new("smoe_vault **")
        check(lib.smoe_open_vault(str(path).encode(), p))
        self.v = p[0]

    def __enter__(self):
        return self.v

    def __exit__(self, *exc):
        lib.smoe_close_vault(self.v)


def config(v):
    c = ffi.new("smoe_config *")
    c.struct_size = ffi.sizeof("smoe_config")
    check(lib.smoe_vault_config(v, c))
    return c


def verify(v):
    """(status, [(kind, layer, expert)]) of smoe_verify_vault."""
    bad = []

    @ffi.callback("smoe_verify_fn")
    def on_bad(kind, layer, expert, _what, _user):
        bad.append((ffi.string(kind).decode(), layer, expert))

    rc = lib.smoe_verify_vault(v, on_bad, ffi.NULL)
    return rc, bad


@pytest.fixture
def good(tiny_vault):  # conftest.py's, shared: read-only
    return tiny_vault


@pytest.fixture
def copy(good, tmp_path):
    dst = tmp_path / "vault"
    shutil.copytree(good, dst)
    return dst


def flip(path, offset):
    with open(path / "vault.bin", "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def test_open_and_config(good):
    want = written_config(good)
    with Opened(good) as v:
        c = config(v)
        for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok",
                  "max_position_embeddings", "norm_topk_prob", "tie_word_embeddings"):
            assert getattr(c, k) == want[k], k
        assert c.rms_norm_eps == np.float32(want["rms_norm_eps"])
        assert c.rope_theta == want["rope_theta"]
        buf = (good / "vault.bin").read_bytes()
        h = header(buf)
        assert c.file_bytes == len(buf) == h["file_size"]
        assert h["paged_bytes"] > 0 and h["page_bytes"] == 4096  # the untied embedding is left on disk
        assert c.dense_bytes == h["dense_bytes"] - h["paged_bytes"] and c.paged_bytes == h["paged_bytes"]
        assert c.blob_bytes == h["blob_bytes"] and c.blob_bytes % 16384 == 0
        assert c.struct_size == ffi.sizeof("smoe_config")


@pytest.mark.parametrize("kw", [dict(experts="q8", scale_dtype="bf16"), dict(experts="bf16"),
                                dict(experts="f32", formats={"attention": "bf16", "embed": "f32"}),
                                dict(overrides={"tie_word_embeddings": True}),
                                dict(layers=2, overrides={"mlp_only_layers": [0, 1]})],
                         ids=["q8-bf16scales", "bf16", "f32", "tied", "all-dense"])
def test_writer_variants_open_and_verify(make_vault, kw):
    path = make_vault("variant", preset="tiny", seed=0, **kw)
    want = written_config(path)
    with Opened(path) as v:
        c = config(v)
        assert c.tie_word_embeddings == want["tie_word_embeddings"]
        assert c.num_sparse_layers == sum(layer_kinds(want))
        assert (c.blob_bytes == 0) == (c.num_sparse_layers == 0)
        assert verify(v) == (0, [])


def test_layer_kinds(good):
    with Opened(good) as v:
        c = config(v)
        out = ffi.new("bool *")
        kinds = []
        for layer in range(c.num_hidden_layers):
            check(lib.smoe_vault_layer_is_sparse(v, layer, out))
            kinds.append(int(out[0]))
        assert kinds == layer_kinds(written_config(good))
        assert 0 < sum(kinds) < len(kinds)  # the test vault has both kinds
        assert c.num_sparse_layers == sum(kinds)
        with pytest.raises(pysmoe.InvalidArgument, match="out of range"):
            check(lib.smoe_vault_layer_is_sparse(v, c.num_hidden_layers, out))


def test_config_struct_size(good):
    with Opened(good) as v:
        c = ffi.new("smoe_config *")
        with pytest.raises(pysmoe.InvalidArgument, match="struct_size"):
            check(lib.smoe_vault_config(v, c))
        # An older caller's shorter struct gets only the prefix it knows.
        c.struct_size = 8
        check(lib.smoe_vault_config(v, c))
        assert c.struct_size == 8 and c.vocab_size == written_config(good)["vocab_size"] and c.hidden_size == 0


def test_verify_good_vault(good):
    # The writer's checksums come through the binding's smoe_checksum; a clean verify means the
    # C reader computes them the same way, over the header + tables, the dense region and every
    # blob (test_checksum_reference_is_the_spec checks one against a plain Python version).
    with Opened(good) as v:
        assert verify(v) == (0, [])


def test_verify_reports_flipped_blob_bytes(copy):
    buf = (copy / "vault.bin").read_bytes()
    entries = blob_entries(buf)
    n_exp = written_config(copy)["num_experts"]
    blob_bytes = header(buf)["blob_bytes"]
    sparse = [i for i, (off, _) in enumerate(entries) if off]
    hit = [sparse[0], sparse[len(sparse) // 2], sparse[-1]]
    with Opened(copy) as v:
        for k, i in enumerate(hit):
            flip(copy, entries[i][0] + (0, blob_bytes // 2, blob_bytes - 1)[k])
        rc, bad = verify(v)
        assert rc == lib.SMOE_ERR_VAULT
        assert bad == [("blob", i // n_exp, i % n_exp) for i in hit]  # each one, after a bad one too
        assert "3 problem" in pysmoe._ffi.last_error()


def test_verify_reports_dense_and_header(copy):
    buf = (copy / "vault.bin").read_bytes()
    h = header(buf)
    with Opened(copy) as v:
        flip(copy, h["dense_offset"] + h["dense_bytes"] - h["paged_bytes"] - 1)  # the last byte dense_crc covers
        assert verify(v) == (lib.SMOE_ERR_VAULT, [("dense", -1, -1)])
        flip(copy, h["table_offset"] + 5)
        assert verify(v) == (lib.SMOE_ERR_VAULT, [("header", -1, -1), ("dense", -1, -1)])


def test_verify_reports_blobs_cut_off(copy):
    buf = (copy / "vault.bin").read_bytes()
    h = header(buf)
    n_exp = written_config(copy)["num_experts"]
    with Opened(copy) as v:
        with open(copy / "vault.bin", "r+b") as f:
            f.truncate(len(buf) - h["blob_bytes"] - 10)  # the last blob gone, the one before cut
        last = len(blob_entries(buf)) - 1
        rc, bad = verify(v)
        assert rc == lib.SMOE_ERR_VAULT
        assert bad == [("blob", (last - 1) // n_exp, (last - 1) % n_exp), ("blob", last // n_exp, last % n_exp)]


def test_open_checks_dense_crc(copy):
    h = header((copy / "vault.bin").read_bytes())
    flip(copy, h["dense_offset"] + 3)
    with pytest.raises(pysmoe.VaultError, match="dense region checksum"):
        Opened(copy)


@pytest.fixture
def copy_in_memory(make_vault, tmp_path):
    """The tiny model with its embedding in memory: a dense region whose lanes start inside pages."""
    dst = tmp_path / "vault"
    shutil.copytree(make_vault("tiny_in_memory", preset="tiny", seed=0, paged_embedding=False), dst)
    return dst


@pytest.mark.parametrize("where", ["lane0-end", "lane1-head", "lane2", "lane3-head", "last"])
def test_open_checks_dense_crc_in_every_lane(copy_in_memory, where):
    """The dense region is read and checked by one thread per checksum lane (vault.c load_dense):
    a flipped byte anywhere, the start of a lane inside the previous lane's last page included,
    fails the open."""
    copy = copy_in_memory
    h = header((copy / "vault.bin").read_bytes())
    assert h["paged_bytes"] == 0
    n = h["dense_bytes"]
    m = n // 32 * 8  # smoe_checksum_lanes: lane i starts at i*m
    assert n >= 64 << 10 and m % 16384, "the tiny vault's lanes must start inside pages for this test"
    at = {"lane0-end": m - 1, "lane1-head": m, "lane2": 2 * m + 5, "lane3-head": 3 * m + 1, "last": n - 1}[where]
    flip(copy, h["dense_offset"] + at)
    with pytest.raises(pysmoe.VaultError, match="dense region checksum"):
        Opened(copy)


def test_open_logs_through_callback(good, caplog):
    with caplog.at_level("DEBUG", logger="pysmoe"):
        with Opened(good):
            pass
    assert any("opened" in r.getMessage() for r in caplog.records)


def test_errors_are_per_call_messages():
    assert ffi.string(lib.smoe_status_str(lib.SMOE_ERR_VAULT)) == b"bad vault"
    assert ffi.string(lib.smoe_version()).decode() == pysmoe.__version__
    p = ffi.new("smoe_vault **")
    assert lib.smoe_open_vault(ffi.NULL, p) == lib.SMOE_ERR_INVALID_ARG
    assert p[0] == ffi.NULL
    assert "dir is NULL" in pysmoe._ffi.last_error()
    lib.smoe_close_vault(ffi.NULL)  # accepted


@pytest.mark.parametrize("fmt,scale", [("f32", None), ("bf16", None), ("q8", "f16"), ("q8", "bf16"),
                                       ("q4", "f16"), ("q4", "bf16")])
def test_dequantize_matches_numpy(fmt, scale):
    rows, cols = 5, 192
    rng = np.random.default_rng(1)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    data = quant.quantize(w, fmt, scale) if scale else quant.quantize(w, fmt)
    want = quant.dequantize(data, fmt, rows, cols, scale)
    out = np.empty((rows, cols), np.float32)
    buf = ffi.from_buffer(data)
    group = 64 if fmt in ("q8", "q4") else 0
    check(lib.smoe_dequantize(quant.FORMAT_CODE[fmt], quant.SCALE_CODE[scale], group, rows, cols, buf, len(data),
                              ffi.cast("float *", out.ctypes.data)))
    assert out.tobytes() == want.tobytes()


def test_dequantize_rejects_bad_arguments():
    out = np.empty(64 * 4, np.float32)
    o = ffi.cast("float *", out.ctypes.data)
    data = bytes(quant.tensor_nbytes("q4", 4, 64))
    q4, f16 = quant.FORMAT_CODE["q4"], quant.SCALE_CODE["f16"]
    check(lib.smoe_dequantize(q4, f16, 64, 4, 64, data, len(data), o))
    with pytest.raises(pysmoe.InvalidArgument, match="bytes"):
        check(lib.smoe_dequantize(q4, f16, 64, 4, 64, data, len(data) - 1, o))
    with pytest.raises(pysmoe.InvalidArgument):
        check(lib.smoe_dequantize(q4, f16, 64, 4, 32, data, len(data), o))  # cols % group
    with pytest.raises(pysmoe.InvalidArgument):
        check(lib.smoe_dequantize(q4, f16, 48, 4, 96, data, len(data), o))  # no such group size
    with pytest.raises(pysmoe.InvalidArgument):
        check(lib.smoe_dequantize(q4, f16, 0, 4, 64, data, len(data), o))  # q4 needs a group size
    with pytest.raises(pysmoe.InvalidArgument):
        check(lib.smoe_dequantize(q4, 0, 64, 4, 64, data, len(data), o))  # q4 needs a scale format
    with pytest.raises(pysmoe.InvalidArgument):
        check(lib.smoe_dequantize(0, f16, 0, 4, 64, data, 4 * 4 * 64, o))  # f32 takes none
    with pytest.raises(pysmoe.InvalidArgument):
        check(lib.smoe_dequantize(0, 0, 64, 4, 64, data, 4 * 4 * 64, o))  # nor a group size
    with pytest.raises(pysmoe.InvalidArgument):
        check(lib.smoe_dequantize(7, 0, 0, 4, 64, data, len(data), o))
    with pytest.raises(pysmoe.InvalidArgument):
        check(lib.smoe_dequantize(q4, f16, 64, 0, 64, data, 0, o))


def test_checksum_reference_is_the_spec(good):
    # The writer's header_crc, recomputed the documented way (tests/checksum_ref.py: CRC-32C over
    # 4 lanes, in plain Python), is what the reader accepted.
    buf = bytearray((good / "vault.bin").read_bytes())
    h = header(buf)
    end = h["table_offset"] + h["table_bytes"]
    stored = h["header_crc"]
    buf[12:16] = bytes(4)
    assert checksum_ref.checksum(bytes(buf[:end])) == stored
    assert checksum_ref.crc32c(b"123456789") == 0xE3069283  # the iSCSI check value


@pytest.mark.parametrize("n", [0, 1, 7, 31, 32, 33, 63, 64, 100, 255, 256, 1000, 4099])
def test_smoe_checksum_matches_the_spec(n):
    data = np.random.default_rng(n).integers(0, 256, n + 3, dtype=np.uint8).tobytes()
    for start in (0, 1, 3):  # misaligned buffers too
        piece = data[start:start + n]
        assert lib.smoe_checksum(ffi.from_buffer(piece), n) == checksum_ref.checksum(piece)
