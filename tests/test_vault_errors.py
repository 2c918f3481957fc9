"""A missing, truncated or corrupted vault gives pysmoe.VaultError with a message, never a crash.

Most corruptions of the header and tables are caught by header_crc alone; to reach the checks
behind it, many cases here re-seal the crc after editing (`seal`)."""
from __future__ import annotations

import os
import shutil
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import checksum_ref
import pysmoe
from pysmoe import vaultio as V
from pysmoe._ffi import check, ffi, lib

# Header field offsets (docs/vault.md section 1).
VERSION, HEADER_CRC, FILE_SIZE, TABLE_OFFSET, TABLE_BYTES = 8, 12, 16, 24, 32
DENSE_OFFSET, DENSE_BYTES, DENSE_CRC, N_TENSORS, BLOB_BYTES, N_BLOBS = 40, 48, 56, 60, 64, 72
PAGED_BYTES, PAGE_BYTES = 80, 88  # version 4
CONFIG = 256  # the config block opens the table region
DESC = 64


def u64(buf, off):
    return struct.unpack_from("<Q", buf, off)[0]


def u32(buf, off):
    return struct.unpack_from("<I", buf, off)[0]


def table_end(buf):
    return u64(buf, TABLE_OFFSET) + u64(buf, TABLE_BYTES)


def seal(buf):
    """Rewrite header_crc over [0, table_offset + table_bytes) with the field read as zero, as
    a writer would, so that an edit reaches the validation behind the checksum."""
    if len(buf) < TABLE_BYTES + 8:
        return buf
    end = table_end(buf)
    if end > len(buf) or end < 16:
        return buf
    b = bytearray(buf)
    b[HEADER_CRC:HEADER_CRC + 4] = bytes(4)
    struct.pack_into("<I", b, HEADER_CRC, checksum_ref.checksum(bytes(b[:end])))
    return b


def layout(buf):
    """Offsets of the table sections of a well-formed version-3 vault: expert is the first
    descriptor of the first sparse layer's blob layout, layouts the first layer's entry."""
    layers = u32(buf, CONFIG + 8)
    params = CONFIG + 96
    kinds = params + 8 + 40 * u32(buf, params)
    layouts = kinds + (layers + 7) // 8 * 8
    pos, expert = layouts, None
    for _ in range(layers):
        n = u32(buf, pos + 8)
        if n and expert is None:
            expert = pos + 16
        pos += 16 + DESC * n
    dense = pos
    blobs = dense + DESC * u32(buf, N_TENSORS)
    pages = blobs + 16 * u32(buf, N_BLOBS)
    return dict(params=params, kinds=kinds, layouts=layouts, expert=expert, dense=dense, blobs=blobs, pages=pages)


def dense_index(buf, name):
    d = layout(buf)["dense"]
    for i in range(u32(buf, N_TENSORS)):
        if buf[d + DESC * i:d + DESC * i + 40].rstrip(b"\0") == name.encode():
            return d + DESC * i
    raise KeyError(name)


def try_open(path):
    """Opens and closes; raises what check raises. A vault that opens is also verified."""
    p = ffi.new("smoe_vault **")
    rc = lib.smoe_open_vault(str(path).encode(), p)
    if rc:
        assert p[0] == ffi.NULL
        check(rc)
    try:
        c = ffi.new("smoe_config *")
        c.struct_size = ffi.sizeof("smoe_config")
        check(lib.smoe_vault_config(p[0], c))
        check(lib.smoe_verify_vault(p[0], ffi.NULL, ffi.NULL))
    finally:
        lib.smoe_close_vault(p[0])


@pytest.fixture(scope="module")
def good(tiny_vault):  # conftest.py's, shared: read-only
    return tiny_vault


@pytest.fixture(scope="module")
def good_bytes(good):
    return (good / "vault.bin").read_bytes()


@pytest.fixture
def put(tmp_path):
    """put(bytes) writes a vault dir holding those bytes as vault.bin and returns its path."""
    def write(buf):
        d = tmp_path / "v"
        d.mkdir(exist_ok=True)
        (d / "vault.bin").write_bytes(bytes(buf))
        return d
    return write


def expect_error(path, match):
    with pytest.raises(pysmoe.VaultError, match=match):
        try_open(path)


# ---------------------------------------------------------------------------- missing, short

def test_good_vault_opens(good):
    try_open(good)


def test_missing_dir(tmp_path):
    expect_error(tmp_path / "nope", "no vault at .*nope")


def test_dir_without_vault_bin(tmp_path):
    expect_error(tmp_path, "no vault at .*no vault.bin")


def test_path_is_a_file(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    expect_error(tmp_path / "f", "not a directory")


def test_empty_file(put):
    expect_error(put(b""), "empty")


@pytest.mark.parametrize("cut", [1, 7, 8, 100, 255, 256, 300, "tables-1", "tables", "dense", "dense+100",
                                 "blob", "end-1"])
def test_truncated(put, good_bytes, cut):
    h = good_bytes
    points = {"tables-1": table_end(h) - 1, "tables": table_end(h), "dense": u64(h, DENSE_OFFSET),
              "dense+100": u64(h, DENSE_OFFSET) + 100, "blob": len(h) - u64(h, BLOB_BYTES), "end-1": len(h) - 1}
    n = points.get(cut, cut)
    expect_error(put(h[:n]), "truncated")


def test_blob_cut_short_even_when_the_header_agrees(put, good_bytes):
    b = bytearray(good_bytes[:-100])
    struct.pack_into("<Q", b, FILE_SIZE, len(b))
    expect_error(put(seal(b)), "blob .*file's end")


def test_trailing_bytes(put, good_bytes):
    expect_error(put(good_bytes + b"\0"), "trailing")


# ------------------------------------------------------------------------------ header fields

def test_wrong_magic(put, good_bytes):
    expect_error(put(b"GGUF" + good_bytes[4:]), "not a pysmoe vault")
    expect_error(put(b"GGUF"), "not a pysmoe vault")  # a short file that is not ours either
    expect_error(put(b"SMOE"), "truncated")  # a short one that may be ours


def test_wrong_version(put, good_bytes):
    b = bytearray(good_bytes)
    struct.pack_into("<I", b, VERSION, 5)
    expect_error(put(seal(b)), "version 5 needs a newer pysmoe")
    expect_error(put(b), "version 5 needs a newer pysmoe")  # the version speaks before the checksum


def test_version_1_says_re_create(put, good_bytes):
    b = bytearray(good_bytes)
    struct.pack_into("<I", b, VERSION, 1)
    for buf in (b, seal(b)):
        path = put(buf)
        with pytest.raises(pysmoe.VaultError, match="version 1 is no longer supported; re-create it with "
                                                    "`pysmoe convert` or `pysmoe synth`") as e:
            try_open(path)
        assert str(path) in str(e.value)
        with pytest.raises(pysmoe.VaultError, match="version 1 is no longer supported"):
            V.read_vault(path)


def test_header_crc(put, good_bytes):
    b = bytearray(good_bytes)
    b[CONFIG + 200] ^= 1
    expect_error(put(b), "header checksum")


def test_dense_crc(put, good_bytes):
    b = bytearray(good_bytes)
    struct.pack_into("<I", b, DENSE_CRC, u32(b, DENSE_CRC) ^ 1)
    expect_error(put(seal(b)), "dense region checksum")


def edit(buf, off, fmt, value):
    b = bytearray(buf)
    struct.pack_into(fmt, b, off, value)
    return seal(b)


@pytest.mark.parametrize("field,fmt,value,match", [
    (TABLE_OFFSET, "<Q", 512, "table_offset"),
    (TABLE_BYTES, "<Q", 1 << 40, "table_bytes"),
    (TABLE_BYTES, "<Q", 8, "table_bytes"),
    (DENSE_OFFSET, "<Q", 1 << 62, "dense"),
    (DENSE_OFFSET, "<Q", 16384 + 64, "dense_offset"),
    (DENSE_OFFSET, "<Q", 0, "dense_offset"),
    (DENSE_BYTES, "<Q", (1 << 64) - 1, "dense region"),
    (N_TENSORS, "<I", 7, "n_tensors"),
    (N_TENSORS, "<I", 0xFFFFFFFF, "n_tensors"),
    (N_BLOBS, "<I", 0xFFFFFFFF, "n_blobs"),
    (BLOB_BYTES, "<Q", 100, "blob_bytes"),
    (BLOB_BYTES, "<Q", 0, "blob_bytes"),
    (BLOB_BYTES, "<Q", 1 << 60, "expert tensor|blob"),
    (76, "<I", 1, "reserved"),
    (200, "<B", 1, "reserved"),
])
def test_header_field_out_of_range(put, good_bytes, field, fmt, value, match):
    expect_error(put(edit(good_bytes, field, fmt, value)), match)


@pytest.mark.parametrize("field,value,match", [
    (0, 0, "vocab_size is 0"),
    (0, (1 << 24) + 1, "vocab_size"),
    (8, 1025, "num_hidden_layers"),
    (8, 2, "padding|n_blobs|n_tensors"),
    (16, 3, "multiple of num_key_value_heads"),
    (20, 15, "head_dim"),
    (32, 1025, "num_experts"),
    (36, 99, "num_experts_per_tok"),
    (44, 4, "flags"),
    (48, 0, "rms_norm_eps"),
    (52, 1, "reserved"),
])
def test_config_out_of_range(put, good_bytes, field, value, match):
    expect_error(put(edit(good_bytes, CONFIG + field, "<I", value)), match)


def test_layer_kind_bits(put, good_bytes):
    expect_error(put(edit(good_bytes, layout(good_bytes)["kinds"], "<B", 8)), "kind 8")  # an unknown bit
    expect_error(put(edit(good_bytes, layout(good_bytes)["kinds"], "<B", 7)), "kind 7")  # attention kind 3


def test_unknown_parameter(put, good_bytes):
    p = layout(good_bytes)["params"]
    assert u32(good_bytes, p) >= 1
    b = bytearray(good_bytes)
    b[p + 8:p + 8 + 32] = b"no_such_key".ljust(32, b"\0")
    with pytest.raises(pysmoe.SmoeError, match="needs a newer pysmoe: unknown parameter 'no_such_key'"):
        try_open(put(seal(b)))
    b[p + 8:p + 8 + 32] = b"family".ljust(32, b"\0")
    struct.pack_into("<d", b, p + 8 + 32, 99.0)
    with pytest.raises(pysmoe.SmoeError, match="unknown model family 99"):
        try_open(put(seal(b)))
    struct.pack_into("<d", b, p + 8 + 32, 0.5)
    expect_error(put(seal(b)), "'family' is 0.5, must be an integer")


def test_value_head_order_parameter(put, good_bytes):
    """linear_value_head_order (llama.cpp's qwen35moe files) is 0 or 1, and only with linear layers."""
    p = layout(good_bytes)["params"]
    b = bytearray(good_bytes)
    b[p + 8:p + 8 + 32] = b"linear_value_head_order".ljust(32, b"\0")
    struct.pack_into("<d", b, p + 8 + 32, 2.0)
    expect_error(put(seal(b)), "'linear_value_head_order' is 2, must be an integer in \\[0, 1\\]")
    struct.pack_into("<d", b, p + 8 + 32, 1.0)
    expect_error(put(seal(b)), "linear_value_head_order without a linear-attention layer")


# ------------------------------------------------------------------------------ tensor tables

def test_tensor_offset_past_dense_region(put, good_bytes):
    d = dense_index(good_bytes, "layers.1.router")
    expect_error(put(edit(good_bytes, d + 56, "<Q", u64(good_bytes, DENSE_BYTES))), "past the dense region")
    expect_error(put(edit(good_bytes, d + 56, "<Q", (1 << 64) - 64)), "past the dense region")
    expect_error(put(edit(good_bytes, d + 56, "<Q", 32)), "multiple of 64")


def test_tensor_wrong_shape(put, good_bytes):
    d = dense_index(good_bytes, "layers.2.q_proj")
    expect_error(put(edit(good_bytes, d + 44, "<I", 65)), "shape 65x64")
    expect_error(put(edit(good_bytes, d + 44, "<I", 0)), "empty shape")


def test_tensor_names(put, good_bytes):
    d = dense_index(good_bytes, "layers.1.router")
    for name, match in [(b"layers.1.mlp.gate_proj", "unexpected name"), (b"layers.01.router", "unexpected"),
                        (b"layers.9.router", "unexpected"), (b"layers.0.router", "appears twice"), (b"bogus", "unexpected"),
                        (b"layers.1.router\0x", "NUL-padded"), (b"x" * 40, "NUL-terminated")]:
        b = bytearray(good_bytes)
        b[d:d + 40] = name.ljust(40, b"\0")
        expect_error(put(seal(b)), match)


def test_tensor_formats(put, good_bytes):
    norm = dense_index(good_bytes, "layers.0.input_layernorm")
    b = bytearray(good_bytes)
    b[norm + 40:norm + 44] = bytes([3, 1, 64, 0])  # q4, f16 scales, groups of 64; hidden is a multiple of 64
    expect_error(put(seal(b)), "norm must be f32 or bf16")
    qn = dense_index(good_bytes, "layers.0.q_norm")
    b = bytearray(good_bytes)
    b[qn + 40:qn + 44] = bytes([2, 1, 64, 0])
    expect_error(put(seal(b)), "cols % group_size")
    expect_error(put(edit(good_bytes, qn + 40, "<B", 9)), "unknown format")
    expect_error(put(edit(good_bytes, qn + 41, "<B", 1)), "scale_format")
    expect_error(put(edit(good_bytes, qn + 42, "<H", 1)), "group_size 1 for f32")
    expect_error(put(edit(good_bytes, qn + 52, "<I", 1)), "reserved")
    q = dense_index(good_bytes, "layers.0.q_proj")
    assert good_bytes[q + 40] in (2, 3) and good_bytes[q + 42] == 64  # quantised in the tiny vault
    for group in (0, 16, 48, 256):
        expect_error(put(edit(good_bytes, q + 42, "<H", group)), f"group_size {group} \\(must be 32, 64 or 128\\)")
    expect_error(put(edit(good_bytes, q + 41, "<B", 4)), "scale_format 4")


@pytest.mark.parametrize("offset,value", [(42, 32), (41, 3)])
def test_other_group_sizes_and_f32_scales_open(put, good_bytes, offset, value):
    # A valid version-2 descriptor (the size it implies still fits the dense region) with a group
    # of 32 or f32 scales: the kernels run every group size and scale format, so the vault opens
    # (its reinterpreted bytes are nonsense values, which verify would report; the mlx oracle
    # tests run real vaults of these formats).
    q = dense_index(good_bytes, "layers.0.q_proj")
    path = put(edit(good_bytes, q + offset, "<B" if offset == 41 else "<H", value))
    with pysmoe.open_vault(path) as v, v.session(cache_bytes=0):
        pass


def test_expert_layout(put, good_bytes):
    e = layout(good_bytes)["expert"]
    expect_error(put(edit(good_bytes, e + DESC + 56, "<Q", 0)), "overlap")
    expect_error(put(edit(good_bytes, e + 2 * DESC + 56, "<Q", u64(good_bytes, BLOB_BYTES))), "past the blob")
    b = bytearray(good_bytes)
    b[e:e + 4] = b"gatf"
    expect_error(put(seal(b)), "unexpected name 'gatf'")
    b[e:e + 4] = b"down"
    expect_error(put(seal(b)), "'down' appears twice")
    lay = layout(good_bytes)["layouts"]
    expect_error(put(edit(good_bytes, lay, "<Q", u64(good_bytes, lay) + 16384)), "blob_bytes")
    expect_error(put(edit(good_bytes, lay, "<Q", 4096)), "multiple of 16384")
    expect_error(put(edit(good_bytes, e + 48, "<I", 128)), "shape")


def test_blob_table(put, good_bytes):
    t = layout(good_bytes)["blobs"]
    n_exp = u32(good_bytes, CONFIG + 32)
    kinds = good_bytes[layout(good_bytes)["kinds"]:][:u32(good_bytes, CONFIG + 8)]
    first_sparse = t + 16 * n_exp * kinds.index(1)
    dense = t + 16 * n_exp * kinds.index(0)
    off0 = u64(good_bytes, first_sparse)
    expect_error(put(edit(good_bytes, first_sparse + 16, "<Q", off0)), "overlap")
    expect_error(put(edit(good_bytes, first_sparse, "<Q", off0 + 4096)), "multiple of 16384")
    expect_error(put(edit(good_bytes, first_sparse, "<Q", len(good_bytes))), "file's end")
    expect_error(put(edit(good_bytes, first_sparse, "<Q", 0)), "dense region's end")
    expect_error(put(edit(good_bytes, first_sparse, "<Q", (1 << 64) - 16384)), "file's end")
    expect_error(put(edit(good_bytes, dense, "<Q", off0)), "dense layer")
    expect_error(put(edit(good_bytes, t + 12, "<I", 1)), "reserved")


# ------------------------------------------------------------------------------ fuzzing

@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def open_mutated(fuzz_dir, buf):
    (fuzz_dir / "vault.bin").write_bytes(bytes(buf))
    try:
        try_open(fuzz_dir)
    except pysmoe.VaultError as e:
        assert str(e)  # always a message


mutation = st.tuples(st.integers(min_value=0), st.integers(min_value=0, max_value=255))
FUZZ = settings(deadline=None, max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(muts=st.lists(mutation, min_size=1, max_size=8), reseal=st.booleans(), data=st.data())
def test_fuzz_header_and_tables(fuzz_dir, good_bytes, muts, reseal, data):
    end = table_end(good_bytes)
    b = bytearray(good_bytes)
    for pos, val in muts:
        b[pos % end] = val
    if data.draw(st.booleans(), label="cut"):
        b = b[:data.draw(st.integers(0, len(b)), label="length")]
    open_mutated(fuzz_dir, seal(b) if reseal else b)


# Words of the header and tables are where a single edit does the most: counts, offsets, sizes.
@FUZZ
@given(word=st.integers(min_value=0), value=st.one_of(
    st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 63, 64, 16384, 2**31, 2**32 - 1, 2**32, 2**63, 2**64 - 1])),
    width=st.sampled_from([4, 8]))
def test_fuzz_sealed_fields(fuzz_dir, good_bytes, word, value, width):
    end = table_end(good_bytes)
    off = (word * 4) % (end - width)
    b = bytearray(good_bytes)
    b[off:off + width] = (value % (1 << (8 * width))).to_bytes(width, "little")
    open_mutated(fuzz_dir, seal(b))


@FUZZ
@given(length=st.integers(min_value=0))
def test_fuzz_truncation(fuzz_dir, good_bytes, length):
    open_mutated(fuzz_dir, good_bytes[:length % len(good_bytes)])


# ------------------------------------------------------------------------------ version 2


def as_version_2(buf):
    """A version-3 or 4 Qwen3-MoE vault's bytes rewritten as the version-2 file of the same model:
    no parameter table, one expert layout (3 descriptors) for every sparse layer, no page checksums
    (a paged embedding joins the dense region's checksum); dense region and blobs where they were."""
    lay = layout(buf)
    layers = u32(buf, CONFIG + 8)
    kinds = bytes(buf[lay["kinds"]:lay["layouts"]])
    tables = bytes(buf[CONFIG:CONFIG + 96]) + kinds + bytes(buf[lay["expert"]:lay["expert"] + 3 * DESC])
    tables += bytes(buf[lay["dense"]:lay["pages"]])
    assert all(k in (0, 1) for k in kinds[:layers])
    b = bytearray(buf)
    b[CONFIG:table_end(buf)] = tables + bytes(table_end(buf) - CONFIG - len(tables))
    struct.pack_into("<I", b, VERSION, 2)
    struct.pack_into("<Q", b, TABLE_BYTES, len(tables))
    d0, n = u64(buf, DENSE_OFFSET), u64(buf, DENSE_BYTES)
    struct.pack_into("<I", b, DENSE_CRC, checksum_ref.checksum(bytes(buf[d0:d0 + n])))
    b[PAGED_BYTES:PAGE_BYTES + 4] = bytes(12)
    return seal(b)


def test_version_2_still_opens(good, good_bytes, tmp_path):
    old = tmp_path / "v2"
    shutil.copytree(good, old)
    (old / "vault.bin").write_bytes(bytes(as_version_2(good_bytes)))
    assert V.read_vault(old).header.version == 2 and V.read_vault(old).family == "qwen3_moe"
    for e in (0, 3):
        for a, b in zip(V.read_vault(old).expert(0, e), V.read_vault(good).expert(0, e)):
            assert np.array_equal(a, b)
    ids = [3, 17, 5, 250, 9]
    with pysmoe.open_vault(old) as v2, pysmoe.open_vault(good) as v3:
        with v2.session() as s2, v3.session() as s3:
            assert np.array_equal(s2.prefill(ids), s3.prefill(ids))
    try_open(old)  # and verifies


def test_a_family_this_build_does_not_know_is_refused_at_open(good, good_bytes, tmp_path):
    # every family the vault format names runs on the CPU; one past them is a newer pysmoe's
    p = layout(good_bytes)["params"]
    b = bytearray(good_bytes)
    for i in range(u32(good_bytes, p)):
        if b[p + 8 + 40 * i:p + 8 + 40 * i + 32].rstrip(b"\0") == b"family":
            struct.pack_into("<d", b, p + 8 + 40 * i + 32, float(len(V.FAMILIES)))
    d = tmp_path / "v"
    shutil.copytree(good, d)
    (d / "vault.bin").write_bytes(bytes(seal(b)))
    with pytest.raises(pysmoe.VaultError, match="family"):
        pysmoe.open_vault(d)


# ------------------------------------------------------------- the paged embedding (4.1, 2.7)

def test_paged_region_rules(put, good_bytes):
    """What the header says of a paged embedding is checked before a byte of it is used."""
    paged, page = u64(good_bytes, PAGED_BYTES), u32(good_bytes, PAGE_BYTES)
    assert paged and page == 4096

    def with_fields(paged_bytes, page_bytes):
        b = bytearray(good_bytes)
        struct.pack_into("<QI", b, PAGED_BYTES, paged_bytes, page_bytes)
        return seal(b)

    expect_error(put(with_fields(paged, 3000)), "page_bytes 3000 must be a power of two")
    expect_error(put(with_fields(paged, 2048)), "page_bytes 2048 must be a power of two in")
    expect_error(put(with_fields(paged, 0)), "both 0, or neither")
    expect_error(put(with_fields(paged + 64, page)), "must be the dense region's .* last bytes")
    # a whole page more: the table of page checksums no longer matches what it describes
    expect_error(put(with_fields(paged + 16384, page)), "table_bytes")
    # not a page in the header's reserved bytes either
    b = bytearray(good_bytes)
    b[92] = 1
    expect_error(put(seal(b)), "reserved bytes not zero")


def test_page_table_padding_and_checksums(put, good_bytes, tmp_path):
    n_pages = -(-u64(good_bytes, PAGED_BYTES) // u32(good_bytes, PAGE_BYTES))
    assert n_pages % 2 == 1, "the tiny vault's page table must end in padding for this test"
    pages = layout(good_bytes)["pages"]
    b = bytearray(good_bytes)
    b[pages + 4 * n_pages] = 1
    expect_error(put(seal(b)), "page checksums: padding not zero")
    # a wrong page checksum opens (the embedding is not read at open) and is named by verify
    b = bytearray(good_bytes)
    b[pages + 4] ^= 1
    path = put(seal(b))
    with pysmoe.open_vault(path) as v:
        assert v.verify() == [("embedding", -1, -1, "page 1: checksum mismatch")]


def test_a_paged_region_holds_the_embedding_alone(put, good_bytes):
    """A tensor moved into the paged region, or the embedding moved out of it, is refused."""
    d0 = u64(good_bytes, DENSE_OFFSET)
    start = u64(good_bytes, DENSE_BYTES) - u64(good_bytes, PAGED_BYTES)
    b = bytearray(good_bytes)
    struct.pack_into("<Q", b, dense_index(b, "norm") + 56, start)  # the final norm's offset into the tail
    expect_error(put(seal(b)), "'norm' reaches into the paged embedding")
    b = bytearray(good_bytes)
    struct.pack_into("<Q", b, dense_index(b, "embed_tokens") + 56, start - 16384)
    expect_error(put(seal(b)), "must hold embed_tokens exactly")
    assert d0 % 16384 == 0
