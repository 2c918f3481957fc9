"""VaultWriter -> read_vault round trips, the byte layout of docs/vault.md, checksums, config."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from pysmoe import quant as Q
from pysmoe import vaultio as V
from pysmoe.vaultio import checksum

import checksum_ref

CFG = dict(vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
           head_dim=32, intermediate_size=128, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
           max_position_embeddings=512, norm_topk_prob=True, tie_word_embeddings=False, rms_norm_eps=1e-6,
           rope_theta=1e6, mlp_only_layers=[1], decoder_sparse_step=1)


def _write_model(path, cfg=CFG, formats=None, scale_dtype="f16", seed=0, order=1):
    """Random float weights through the writer (in a shuffled order); returns what the reader
    must give back: every tensor quantised then dequantised."""
    rng = np.random.default_rng(seed)
    want, experts = {}, {}
    with V.VaultWriter(path, cfg, formats=formats, scale_dtype=scale_dtype, tokenizer_json='{"x": 1}',
                       tokenizer_config={"eos_token": "<|im_end|>"}) as w:
        items = list(w.layout.tensors.items())
        jobs = [("dense", n, t) for n, t in items]
        jobs += [("expert", l, e) for l in w.sparse_layers() for e in range(w.config["num_experts"])]
        for i in rng.permutation(len(jobs))[::order]:
            kind, a, b = jobs[i]
            if kind == "dense":
                x = rng.standard_normal((b.rows, b.cols)).astype(np.float32) * 0.3 + 0.1
                w.add_dense(a, x)
                want[a] = Q.dequantize(Q.quantize(x, b.format, scale_dtype), b.format, b.rows, b.cols, b.scale_format)
            else:
                mats = [rng.standard_normal((t.rows, t.cols)).astype(np.float32) for t in w.layout.expert]
                w.add_expert(a, b, *mats)
                experts[(a, b)] = [Q.dequantize(Q.quantize(m, t.format, scale_dtype), t.format, t.rows, t.cols,
                                                t.scale_format) for m, t in zip(mats, w.layout.expert)]
        layout = w.layout
    return layout, want, experts


@pytest.mark.parametrize("formats,scale_dtype", [
    (None, "f16"),
    (None, "bf16"),
    ({"experts": "f32", "attention": "bf16", "embed": "f32", "lm_head": "q4", "mlp": "q4", "norms": "bf16"}, "f16"),
    ({"experts": "q8", "router": "q8", "layers.0.q_proj": "f32"}, "bf16"),
])
def test_round_trip(tmp_path, formats, scale_dtype):
    layout, want, experts = _write_model(tmp_path, formats=formats, scale_dtype=scale_dtype)
    with V.read_vault(tmp_path) as v:
        assert set(v.tensors) == set(want)
        for name, w in want.items():
            got = v.tensor(name)
            assert np.array_equal(got.reshape(w.shape), w), name
            assert v.tensors[name].format == layout.tensors[name].format
        for (l, e), mats in experts.items():
            for got, w in zip(v.expert(l, e), mats):
                assert np.array_equal(got, w), (l, e)
        assert [v.layer_is_sparse(l) for l in range(3)] == [True, False, True]
        assert v.verify() == []
        assert v.config == V.normalize_config(CFG)
    if formats and "layers.0.q_proj" in formats:
        assert layout.tensors["layers.0.q_proj"].format == "f32"
        assert layout.tensors["layers.2.q_proj"].format == "q8"


def _header(raw: bytes) -> dict:
    names = ("magic", "version", "header_crc", "file_size", "table_offset", "table_bytes", "dense_offset",
             "dense_bytes", "dense_crc", "n_tensors", "blob_bytes", "n_blobs", "reserved", "paged_bytes",
             "page_bytes")
    return dict(zip(names, struct.unpack_from("<8sIIQQQQQIIQIIQI", raw, 0)))


def test_bytes_follow_the_spec(tmp_path):
    layout, want, _ = _write_model(tmp_path)
    raw = (tmp_path / "vault.bin").read_bytes()
    h = _header(raw)
    assert h["magic"] == b"SMOEVLT\0" and h["version"] == 4 and h["reserved"] == 0
    assert raw[92:256] == bytes(164)
    assert h["file_size"] == len(raw) == layout.file_size
    assert h["table_offset"] == 256
    assert h["dense_offset"] % 16384 == 0 and h["dense_offset"] >= 256 + h["table_bytes"]
    assert h["blob_bytes"] % 16384 == 0 and h["blob_bytes"] == layout.blob_bytes
    assert h["n_blobs"] == 3 * 4 and h["n_tensors"] == len(want)

    # checksums
    head = bytearray(raw[:256 + h["table_bytes"]])
    head[12:16] = bytes(4)
    assert checksum_ref.checksum(head) == h["header_crc"]
    # the untied embedding is the dense region's tail, on disk, checked page by page (4.1, 2.7)
    emb = layout.tensors["embed_tokens"]
    start = h["dense_offset"] + h["dense_bytes"] - h["paged_bytes"]
    assert h["page_bytes"] == 4096 and emb.offset == start and start % 16384 == 0
    assert h["paged_bytes"] == (emb.nbytes + 63) // 64 * 64
    assert all(t.offset + t.nbytes <= start for n, t in layout.tensors.items() if n != "embed_tokens")
    assert checksum(raw[h["dense_offset"]:start]) == h["dense_crc"]
    n_pages = -(-h["paged_bytes"] // 4096)
    table_end = 256 + h["table_bytes"]
    page_crcs = struct.unpack_from(f"<{n_pages}I", raw, table_end - (4 * n_pages + 7) // 8 * 8)
    assert list(page_crcs) == [checksum(raw[a:min(a + 4096, start + h["paged_bytes"])])
                               for a in range(start, start + h["paged_bytes"], 4096)]

    # config block
    t = 256
    cfg = struct.unpack_from("<12IfId", raw, t)
    assert cfg[:11] == (320, 64, 3, 4, 2, 32, 128, 64, 4, 2, 512)
    assert cfg[11] == 1  # norm_topk_prob, not tied
    assert cfg[12] == np.float32(1e-6) and cfg[14] == 1e6
    assert raw[t + 64:t + 96] == bytes(32)
    t += 96
    # parameters: count, 0, then (key[32], f64) entries; a Qwen3-MoE vault names its family and QK-norm
    n_params, zero = struct.unpack_from("<II", raw, t)
    assert zero == 0
    params = {}
    for i in range(n_params):
        key, value = struct.unpack_from("<32sd", raw, t + 8 + 40 * i)
        params[key.rstrip(b"\0").decode()] = value
    assert params == {"family": 0, "qk_norm": 1}
    t += 8 + 40 * n_params
    assert raw[t:t + 8] == bytes([1, 0, 1, 0, 0, 0, 0, 0])  # layer kinds, padded to 8
    t += 8
    # per layer: (blob bytes, descriptors, 0), then gate, up, down, 64-byte aligned, within the blob
    for layer in range(3):
        nbytes, n, zero = struct.unpack_from("<QII", raw, t)
        t += 16
        if layer == 1:
            assert (nbytes, n, zero) == (0, 0, 0)
            continue
        assert n == 3 and zero == 0 and nbytes == h["blob_bytes"]
        end = 0
        for i, part in enumerate(("gate", "up", "down")):
            name, fmt, sfmt, r0, rows, cols, r1, off = struct.unpack_from("<40sBBHIIIQ", raw, t + 64 * i)
            assert name.rstrip(b"\0") == part.encode() and fmt == 3 and sfmt == 1 and r0 == 64 and r1 == 0
            assert (rows, cols) == ((64, 64) if part != "down" else (64, 64))
            assert off % 64 == 0 and off >= end
            end = off + Q.tensor_nbytes("q4", rows, cols)
        assert end <= nbytes
        t += 192
    # dense table: offsets relative to dense_offset, 64-aligned, inside the dense region, no overlap
    spans = []
    for i in range(h["n_tensors"]):
        name, fmt, sfmt, group, rows, cols, _, off = struct.unpack_from("<40sBBHIIIQ", raw, t + 64 * i)
        name = name.rstrip(b"\0").decode()
        assert group == (0 if Q.FORMAT_NAME[fmt] in ("f32", "bf16") else 64)
        n = Q.tensor_nbytes(Q.FORMAT_NAME[fmt], rows, cols)
        assert off % 64 == 0 and off + n <= h["dense_bytes"]
        assert sfmt == (0 if Q.FORMAT_NAME[fmt] in ("f32", "bf16") else 1)
        spans.append((off, off + n))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    t += 64 * h["n_tensors"]
    # blob table
    seen = []
    for i in range(h["n_blobs"]):
        off, crc, res = struct.unpack_from("<QII", raw, t + 16 * i)
        layer = i // 4
        assert res == 0
        if layer == 1:
            assert off == 0 and crc == 0
            continue
        assert off % 16384 == 0 and off + h["blob_bytes"] <= len(raw)
        assert off >= h["dense_offset"] + h["dense_bytes"]
        assert crc == checksum(raw[off:off + h["blob_bytes"]])
        seen.append(off)
    assert len(set(seen)) == len(seen) and sorted(seen) == seen  # (layer, expert) order, distinct
    assert t + 16 * h["n_blobs"] + (4 * n_pages + 7) // 8 * 8 == 256 + h["table_bytes"]  # then the page crcs


def test_side_files(tmp_path):
    _write_model(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key in V.CONFIG_KEYS:
        assert key in cfg
    assert (tmp_path / "tokenizer.json").read_text() == '{"x": 1}'
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"


def test_missing_tensors_raise_and_leave_no_header(tmp_path):
    w = V.VaultWriter(tmp_path, CFG)
    w.add_dense("norm", np.ones(64, dtype=np.float32))
    w.add_expert_raw(0, 0, b"\1" * 100)
    with pytest.raises(ValueError, match="incomplete") as e:
        w.close()
    msg = str(e.value)
    names = msg.split(": ", 1)[1].split(" and ")[0].split(", ")
    assert names[0] == "layers.0.input_layernorm" and "more tensors" in msg and "norm" not in names
    assert "3 experts of layer 0 (1, 2, 3)" in msg and "4 experts of layer 2" in msg
    assert "expert (0, 1)" in w.missing() and "norm" not in w.missing()
    with pytest.raises(V.VaultFormatError, match="bad magic"):
        V.read_vault(tmp_path)
    w.abort()
    assert not (tmp_path / "vault.bin").exists()


def test_writer_rejects_bad_input(tmp_path):
    with V.VaultWriter(tmp_path, CFG) as w:
        t = w.layout.tensors
        with pytest.raises(ValueError, match="shape"):
            w.add_dense("layers.0.q_proj", np.zeros((64, 128)))
        with pytest.raises(KeyError):
            w.add_dense("layers.1.router", np.zeros((4, 64)))  # layer 1 is dense
        with pytest.raises(ValueError, match="bytes"):
            w.add_dense_raw("norm", b"\0" * 8)
        w.add_dense("norm", np.ones(64))
        with pytest.raises(ValueError, match="twice"):
            w.add_dense("norm", np.ones(64))
        with pytest.raises(ValueError, match="dense layer"):
            w.add_expert_raw(1, 0, b"")
        with pytest.raises(IndexError):
            w.add_expert_raw(3, 0, b"")
        with pytest.raises(ValueError, match="blob_bytes"):
            w.add_expert_raw(0, 0, bytes(w.blob_bytes + 1))
        for name, d in t.items():
            if name != "norm":
                w.add_dense_raw(name, bytes(d.nbytes))
        for l in w.sparse_layers():
            for e in range(4):
                w.add_expert_raw(l, e, b"")
    with V.read_vault(tmp_path) as v:
        assert v.verify() == []
        assert np.array_equal(v.tensor("norm"), np.ones(64, dtype=np.float32))
    with pytest.raises(ValueError, match="cols % 64"):
        V.VaultWriter(tmp_path / "x", dict(CFG, hidden_size=96))
    with pytest.raises(ValueError, match="norm vectors"):
        V.VaultWriter(tmp_path / "y", CFG, formats={"norms": "q8"})
    with pytest.raises(ValueError, match="neither a role nor a tensor"):
        V.VaultWriter(tmp_path / "z", CFG, formats={"expert": "q8"})


def test_raw_blob_is_zero_padded_and_crc_covers_padding(tmp_path):
    cfg = dict(CFG, mlp_only_layers=[0, 1])
    with V.VaultWriter(tmp_path, cfg) as w:
        for name, t in w.layout.tensors.items():
            w.add_dense_raw(name, bytes(t.nbytes))
        for e in range(4):
            w.add_expert_raw(2, e, bytes([e + 1]) * 1000)
    with V.read_vault(tmp_path) as v:
        b = np.asarray(v.blob(2, 3))
        assert b.size == v.header.blob_bytes
        assert np.all(b[:1000] == 4) and not b[1000:].any()
        assert v.blob_crcs[2 * 4 + 3] == checksum_ref.checksum(bytes([4]) * 1000 + bytes(v.header.blob_bytes - 1000))
        assert v.verify() == []


def test_tied_and_all_dense(tmp_path):
    cfg = dict(CFG, tie_word_embeddings=True, mlp_only_layers=[0, 1, 2])
    lay = V.compute_layout(cfg)
    assert "lm_head" not in lay.tensors and "layers.0.router" not in lay.tensors
    assert lay.blob_bytes == 0 and lay.file_size == lay.dense_offset + lay.dense_bytes
    assert lay.blob_offsets == (0,) * 12
    _write_model(tmp_path, cfg)
    with V.read_vault(tmp_path) as v:
        assert v.header.blob_bytes == 0 and not any(v.sparse)
        assert v.verify() == []
        assert v.binary_config["tie_word_embeddings"]


def test_corruption_is_seen_by_verify(tmp_path):
    layout, _, _ = _write_model(tmp_path)
    p = tmp_path / "vault.bin"
    raw = bytearray(p.read_bytes())
    off = layout.blob_offset(2, 1)
    raw[off + 5] ^= 1
    raw[layout.dense_offset + 7] ^= 1
    p.write_bytes(bytes(raw))
    with V.read_vault(tmp_path) as v:
        assert v.verify() == ["dense", "blob (2, 1)"]
    p.write_bytes(bytes(raw[:-1]))
    with pytest.raises(V.VaultFormatError, match="truncated"):
        V.read_vault(tmp_path)


def test_sizes_of_the_real_models():
    from pysmoe.synthesis import preset_config

    a3b = V.compute_layout(preset_config("a3b"))
    assert a3b.blob_bytes == 2654208  # 3 × (768·2048/2 + 2·2·768·2048/64) bytes, = 162 × 16 KiB
    assert a3b.n_blobs == 48 * 128
    assert a3b.file_size - a3b.dense_offset - a3b.dense_bytes < 48 * 128 * a3b.blob_bytes + 16384
    a22b = V.compute_layout(preset_config("a22b"))
    assert a22b.blob_bytes % 16384 == 0 and a22b.n_blobs == 94 * 128


# ------------------------------------------------------------------------------------ config

def test_normalize_config_released_spelling():
    released = dict(CFG, num_experts=128, rope_theta=1000000.0, head_dim=128, model_type="qwen3_moe",
                    rope_scaling=None, hidden_size=2048, num_attention_heads=32)
    out = V.normalize_config(released)
    assert out["num_experts"] == 128 and out["rope_theta"] == 1e6 and out["head_dim"] == 128
    assert out["model_type"] == "qwen3_moe"


def test_normalize_config_transformers5_spelling():
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen3MoeConfig(vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=128, moe_intermediate_size=64,
                                     num_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
                                     norm_topk_prob=True, mlp_only_layers=[1],
                                     rope_parameters={"rope_type": "default", "rope_theta": 5e5}).to_dict()
    out = V.normalize_config(hf)
    for key in V.CONFIG_KEYS:
        assert key in out, key
    assert out["num_experts"] == 4 and "num_local_experts" not in out
    assert out["rope_theta"] == 5e5
    assert out["head_dim"] == hf.get("head_dim") or out["head_dim"] == 16
    assert out["mlp_only_layers"] == [1] and out["norm_topk_prob"] is True


def test_normalize_config_by_hand():
    v5 = {k: v for k, v in CFG.items() if k not in ("num_experts", "rope_theta", "head_dim")}
    v5.update(num_local_experts=8, rope_parameters={"rope_theta": 2e6, "rope_type": "default"})
    out = V.normalize_config(v5)
    assert out["num_experts"] == 8 and out["rope_theta"] == 2e6 and out["head_dim"] == 16
    assert V.normalize_config(out) == out  # idempotent
    with pytest.raises(ValueError, match="rope_type"):
        V.normalize_config(dict(CFG, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match="lacks"):
        V.normalize_config({"hidden_size": 64})


def test_layer_kinds_follow_transformers():
    cfg = V.normalize_config(dict(CFG, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert V.layer_kinds(cfg) == [False, True, False, False, False, True]


def test_info(tiny_vault):
    text = V.info(tiny_vault)
    assert "4 layers (3 sparse)" in text and "experts q4/g64/f16" in text and "chat template" in text


def test_libsmoe_opens_what_the_writer_wrote(tiny_vault):
    try:
        from pysmoe._ffi import check, ffi, lib
    except (ImportError, OSError) as e:
        pytest.skip(f"libsmoe not available: {e}")
    vp = ffi.new("smoe_vault **")
    check(lib.smoe_open_vault(str(tiny_vault).encode(), vp))
    try:
        c = ffi.new("smoe_config *")
        c.struct_size = ffi.sizeof("smoe_config")
        check(lib.smoe_vault_config(vp[0], c))
        with V.read_vault(tiny_vault) as v:
            assert c.blob_bytes == v.header.blob_bytes and c.file_bytes == v.header.file_size
            assert c.num_sparse_layers == sum(v.sparse) and c.head_dim == 32
        check(lib.smoe_verify_vault(vp[0], ffi.NULL, ffi.NULL))
    finally:
        lib.smoe_close_vault(vp[0])
