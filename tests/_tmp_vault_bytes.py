"""TEMPORARY: a bare struct-packing vault writer for the vault tests, until pysmoe.synth lands
(then the tests use it and this file is deleted). Random bytes stand in for weights."""
from __future__ import annotations

import os
import struct
import zlib

import numpy as np

from pysmoe.quant import FORMAT_CODE, tensor_nbytes, align

CFG = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=64,
           num_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
           norm_topk_prob=True, tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0)
KINDS = [0, 1, 1]


def _desc(name, fmt, rows, cols, off):
    scale = 0 if fmt in ("f32", "bf16") else 1
    return struct.pack("<40sBBHIIIQ", name.encode(), FORMAT_CODE[fmt], scale, 0, rows, cols, 0, off)


def write(path, seed=0):
    c, rng = CFG, np.random.default_rng(seed)
    h, hd, I, mi = c["hidden_size"], c["head_dim"], c["intermediate_size"], c["moe_intermediate_size"]
    L, E = c["num_hidden_layers"], c["num_experts"]
    dense = [("embed_tokens", "bf16", c["vocab_size"], h), ("norm", "f32", 1, h),
             ("lm_head", "q8", c["vocab_size"], h)]
    for l in range(L):
        p = f"layers.{l}."
        dense += [(p + "input_layernorm", "f32", 1, h), (p + "post_attention_layernorm", "bf16", 1, h),
                  (p + "q_proj", "q4", 4 * hd, h), (p + "k_proj", "f32", 2 * hd, h),
                  (p + "v_proj", "bf16", 2 * hd, h), (p + "o_proj", "q8", h, 4 * hd),
                  (p + "q_norm", "f32", 1, hd), (p + "k_norm", "f32", 1, hd)]
        if KINDS[l]:
            dense.append((p + "router", "f32", E, h))
        else:
            dense += [(p + "mlp.gate_proj", "q4", I, h), (p + "mlp.up_proj", "q4", I, h),
                      (p + "mlp.down_proj", "q4", h, I)]
    descs, off = [], 0
    for name, fmt, r, col in dense:
        descs.append(_desc(name, fmt, r, col, off))
        off = align(off + tensor_nbytes(fmt, r, col), 64)
    dense_bytes = off
    eoff = 0
    edescs = []
    for name, r, col in (("gate", mi, h), ("up", mi, h), ("down", h, mi)):
        edescs.append(_desc(name, "q4", r, col, eoff))
        eoff = align(eoff + tensor_nbytes("q4", r, col), 64)
    blob_bytes = align(eoff, 16384)
    flags = int(c["norm_topk_prob"]) | int(c["tie_word_embeddings"]) << 1
    config = struct.pack("<12IfId", *(c[k] for k in list(CFG)[:11]), flags, c["rms_norm_eps"], 0,
                         c["rope_theta"]).ljust(96, b"\0")
    kinds = bytes(KINDS).ljust(align(L, 8), b"\0")
    table_bytes = 96 + len(kinds) + 192 + 64 * len(dense) + 16 * L * E
    dense_offset = align(256 + table_bytes, 16384)
    dense_data = rng.integers(0, 256, dense_bytes, dtype=np.uint8).tobytes()
    blobs, entries, pos = [], [], dense_offset + dense_bytes
    pos = align(pos, 16384)
    for l in range(L):
        for e in range(E):
            if KINDS[l]:
                b = rng.integers(0, 256, blob_bytes, dtype=np.uint8).tobytes()
                entries.append(struct.pack("<QII", pos, zlib.crc32(b), 0))
                blobs.append((pos, b))
                pos += blob_bytes
            else:
                entries.append(struct.pack("<QII", 0, 0, 0))
    tables = config + kinds + b"".join(edescs) + b"".join(descs) + b"".join(entries)
    assert len(tables) == table_bytes
    header = struct.pack("<8sIIQQQQQIIQII", b"SMOEVLT\0", 1, 0, pos, 256, table_bytes, dense_offset,
                         dense_bytes, zlib.crc32(dense_data), len(dense), blob_bytes, L * E, 0).ljust(256, b"\0")
    crc = zlib.crc32(header + tables)
    header = header[:12] + struct.pack("<I", crc) + header[16:]
    out = bytearray(pos)
    out[:256 + table_bytes] = header + tables
    out[dense_offset:dense_offset + dense_bytes] = dense_data
    for p, b in blobs:
        out[p:p + blob_bytes] = b
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "vault.bin"), "wb") as f:
        f.write(out)
    return path
