"""The GGML block formats of the vault (docs/vault.md section 3), in numpy.

A tensor of one of these formats is `rows` rows, each cols / block_size blocks laid out exactly
as ggml lays them out (ggml-common.h), so a GGUF file's tensors are copied into a vault byte for
byte. The vault numbers each format 32 + ggml's enum ggml_type. `dequantize` gives the values
gguf-py's `gguf.quants.dequantize` gives, bit for bit (the same f32 operations in the same order;
tests/test_ggml_formats.py checks it against gguf-py where installed and against golden vectors),
and libsmoe's kernels dequantise the same way (csrc/cpu/ggml_blocks.h). A block whose f16 scale
is inf or NaN dequantises by IEEE arithmetic (inf·0 = NaN). The codebook formats (IQ1_S ... IQ3_S,
CODEBOOK_FORMATS) index tables that gguf-py defines: numpy leaves them to gguf-py itself (an
ImportError names the extra to install), libsmoe holds a copy written from gguf-py's.

Tensors arrive in these formats from a GGUF file (or from gpt-oss's MXFP4, rearranged
losslessly). The one quantiser here is `quantize_mxfp4`, for float experts converted to MXFP4
(the format gpt-oss is released in): llama.cpp's quantize_row_mxfp4_ref, as gguf-py's
`gguf.quants.MXFP4.quantize_blocks` writes it in numpy (tests/test_ggml_formats.py checks it
against gguf-py byte for byte where installed, and against golden vectors).
"""
from __future__ import annotations

import numpy as np

# name -> (vault format code, columns per block, bytes per block)
FORMATS = {
    "F16": (33, 1, 2),
    "Q4_0": (34, 32, 18),
    "Q4_1": (35, 32, 20),
    "Q5_0": (38, 32, 22),
    "Q5_1": (39, 32, 24),
    "Q8_0": (40, 32, 34),
    "Q2_K": (42, 256, 84),
    "Q3_K": (43, 256, 110),
    "Q4_K": (44, 256, 144),
    "Q5_K": (45, 256, 176),
    "Q6_K": (46, 256, 210),
    "IQ2_XXS": (48, 256, 66),
    "IQ2_XS": (49, 256, 74),
    "IQ3_XXS": (50, 256, 98),
    "IQ1_S": (51, 256, 50),
    "IQ4_NL": (52, 32, 18),
    "IQ3_S": (53, 256, 110),
    "IQ2_S": (54, 256, 82),
    "IQ4_XS": (55, 256, 136),
    "IQ1_M": (61, 256, 56),
    "MXFP4": (71, 32, 17),
}
# The codebook formats: their values come from grids that gguf-py defines (libsmoe holds the same,
# csrc/cpu/ggml_iq_grids.h, written from gguf-py by scripts/gen_iq_grids.py); in numpy they are
# dequantised by gguf-py itself.
CODEBOOK_FORMATS = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")
GGML_TYPE_BASE = 32  # vault format = 32 + ggml_type

KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)

_F = np.float32


def is_ggml(fmt: str) -> bool:
    return fmt in FORMATS


def block_size(fmt: str) -> int:
    return FORMATS[fmt][1]


def check_cols(fmt: str, cols: int) -> None:
    bs = FORMATS[fmt][1]
    if cols % bs:
        raise ValueError(f"format {fmt} needs cols % {bs} == 0 (whole blocks of {bs}), got cols={cols}")


def nbytes(fmt: str, rows: int, cols: int) -> int:
    check_cols(fmt, cols)
    _, bs, ts = FORMATS[fmt]
    return rows * (cols // bs) * ts


def _f16(b: np.ndarray) -> np.ndarray:
    """(n, 2) u8 -> (n, 1) f32"""
    return np.ascontiguousarray(b).view("<f2").astype(_F)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16·k) u8 -> (n, 32·k): per 16 bytes, the 16 low nibbles then the 16 high ones"""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, 16)
    return np.concatenate([q & 15, q >> 4], axis=2).reshape(n, -1)


def _scale_min_k4(s: np.ndarray):
    """(n, 12) packed 6-bit scales and mins of Q4_K/Q5_K -> two (n, 8) arrays"""
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=1)
    m = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, m


def _dequant_blocks(fmt: str, b: np.ndarray) -> np.ndarray:
    """(n, type_size) u8 blocks -> (n, block_size) f32"""
    n = b.shape[0]
    if fmt == "F16":
        return _f16(b)
    if fmt in ("Q4_0", "Q5_0"):
        d = _f16(b[:, 0:2])
        if fmt == "Q4_0":
            q = _nibbles(b[:, 2:18]).astype(np.int16) - 8
        else:
            qh = np.ascontiguousarray(b[:, 2:6]).view("<u4")
            hi = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)
            q = (_nibbles(b[:, 6:22]).astype(np.int16) | (hi << 4)) - 16
        return d * q.astype(_F)
    if fmt == "Q8_0":
        return b[:, 2:34].view(np.int8).astype(_F) * _f16(b[:, 0:2])
    if fmt in ("Q4_1", "Q5_1"):
        d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        if fmt == "Q4_1":
            q = _nibbles(b[:, 4:20])
        else:
            qh = np.ascontiguousarray(b[:, 4:8]).view("<u4")
            q = _nibbles(b[:, 8:24]) | (((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4)
        return d * q.astype(_F) + m
    if fmt in ("IQ4_NL", "MXFP4"):
        if fmt == "MXFP4":
            e = b[:, 0:1].astype(np.uint32)
            d = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32).view(_F)
            q = KVALUES_MXFP4[_nibbles(b[:, 1:17])]
        else:
            d = _f16(b[:, 0:2])
            q = KVALUES_IQ4NL[_nibbles(b[:, 2:18])]
        return d * q
    if fmt == "IQ4_XS":
        d = _f16(b[:, 0:2])
        sh = np.ascontiguousarray(b[:, 2:4]).view("<u2").astype(np.int32)           # (n, 1)
        i = np.arange(8)
        lo = (b[:, 4 + i // 2] >> (4 * (i % 2))) & 15                                 # (n, 8)
        ls = (lo.astype(np.int32) | (((sh >> (2 * i)) & 3) << 4)) - 32
        dl = (d * ls.astype(_F))[:, :, None]
        q = KVALUES_IQ4NL[_nibbles(b[:, 8:136])].reshape(n, 8, 32)
        return (dl * q).reshape(n, 256)
    if fmt in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, m = _scale_min_k4(b[:, 4:16])
        d1 = (d * sc.astype(_F))[:, :, None]
        dm = (dmin * m.astype(_F))[:, :, None]
        qs = b[:, 48:176] if fmt == "Q5_K" else b[:, 16:144]
        q = qs.reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        q = (q & 15).reshape(n, 8, 32)
        if fmt == "Q5_K":
            qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            q = q | ((qh & 1) << 4)
        return (d1 * q.astype(_F) - dm).reshape(n, 256)
    if fmt == "Q6_K":
        ql, qh = b[:, 0:128], b[:, 128:192]
        sc = b[:, 192:208].view(np.int8).astype(_F)
        d = _f16(b[:, 208:210])
        lo = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15   # (n, 2, 2, 64)
        hi = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3  # (n, 2, 4, 32)
        q = (lo.reshape(n, 256) | (hi.reshape(n, 256) << 4)).astype(np.int16) - 32
        return ((d * sc)[:, :, None] * q.reshape(n, 16, 16).astype(_F)).reshape(n, 256)
    if fmt == "Q2_K":
        sc, qs = b[:, 0:16], b[:, 16:80]
        d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
        dl = (d * (sc & 15).astype(_F))[:, :, None]
        ml = (dmin * (sc >> 4).astype(_F))[:, :, None]
        q = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        return (dl * q.reshape(n, 16, 16).astype(_F) - ml).reshape(n, 256)
    if fmt == "Q3_K":
        hm, qs, s = b[:, 0:32], b[:, 32:96], b[:, 96:108]
        d = _f16(b[:, 108:110])
        j = np.arange(16)
        lo = np.where(j < 8, s[:, j % 8] & 15, s[:, j % 8] >> 4).astype(np.int32)
        hi = ((s[:, 8 + j % 4] >> (2 * (j // 4))) & 3).astype(np.int32)
        dl = (d * ((lo | (hi << 4)) - 32).astype(_F))[:, :, None]
        ql = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        h = (hm.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        q = ql.reshape(n, 256).astype(np.int16) - 4 * (1 - h.reshape(n, 256).astype(np.int16))
        return (dl * q.reshape(n, 16, 16).astype(_F)).reshape(n, 256)
    if fmt in CODEBOOK_FORMATS:
        try:
            from gguf.constants import GGMLQuantizationType
            from gguf.quants import dequantize as gguf_dequantize
        except ImportError as e:
            raise ImportError(f"dequantising {fmt} in numpy takes gguf-py's codebooks: pip install 'pysmoe[gguf]'") from e
        return gguf_dequantize(np.ascontiguousarray(b).reshape(-1), GGMLQuantizationType[fmt]).reshape(n, -1)
    raise ValueError(f"unknown GGML format {fmt!r}")


# Rows per step: bounds the temporaries whatever the matrix size.
_CHUNK_ELEMS = 1 << 20


def dequantize(data, fmt: str, rows: int, cols: int) -> np.ndarray:
    """Stored bytes (bytes, memoryview or u8 array, at least nbytes long) -> f32 (rows, cols)."""
    n = nbytes(fmt, rows, cols)
    u8 = data.reshape(-1).view(np.uint8) if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    if u8.size < n:
        raise ValueError(f"{fmt} {rows}x{cols} needs {n} bytes, got {u8.size}")
    _, bs, ts = FORMATS[fmt]
    row_bytes = cols // bs * ts
    out = np.empty((rows, cols), dtype=_F)
    step = max(1, _CHUNK_ELEMS // cols)
    with np.errstate(invalid="ignore", over="ignore"):  # inf or NaN scales: IEEE's answer, as gguf-py's
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            blocks = u8[r0 * row_bytes:r1 * row_bytes].reshape(-1, ts)
            out[r0:r1] = _dequant_blocks(fmt, blocks).reshape(r1 - r0, cols)
    return out


# ------------------------------------------------------------------------- random tensors

_MXFP4_STEP = 1 << 14  # blocks per step of quantize_mxfp4: bounds its (n, 32, 16) f32 temporary (32 MiB)


def quantize_mxfp4(w: np.ndarray) -> np.ndarray:
    """A (rows, cols) float matrix (cols % 32 == 0) -> its block_mxfp4 bytes, u8 (rows, cols/32 · 17).

    The OCP Microscaling (MX v1.0) rule as llama.cpp implements it (quantize_row_mxfp4_ref, and
    gguf-py's MXFP4.quantize_blocks, which this reproduces bit for bit), per block of 32 in f32:

        amax = max |w|
        e    = floor(log2(amax)) − 2 + 127     (E8M0: the shared scale 2^(e − 127) puts amax in
                                               [4, 8) units, the top of E2M1's range; 0 when amax is 0)
        d    = 2^(e − 128)                     (ggml stores E2M1 doubled: kvalues 0, ±1, ±2, ±3, ±4, ±6, ±8, ±12)
        code = argmin over the 16 codes of |kvalue · d − w| (f32), the first on a tie: a tie goes
               to the smaller magnitude (not OCP's round-half-to-even), and |w| past 6 · 2^(e−127)
               saturates to ±6 · 2^(e−127).

    Weights must be finite (an inf or NaN has no E8M0 scale)."""
    w = np.asarray(w, dtype=_F)
    if w.ndim != 2:
        raise ValueError(f"expected a matrix, got shape {w.shape}")
    rows, cols = w.shape
    check_cols("MXFP4", cols)
    if not np.isfinite(w).all():
        raise ValueError("MXFP4 needs finite weights: this matrix holds inf or NaN")
    x = w.reshape(-1, 32)
    out = np.empty((x.shape[0], 17), dtype=np.uint8)
    k = KVALUES_MXFP4.reshape(1, 1, 16)
    for b0 in range(0, x.shape[0], _MXFP4_STEP):
        xb = x[b0:b0 + _MXFP4_STEP]
        amax = np.abs(xb).max(axis=1)
        with np.errstate(divide="ignore"):
            e = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0).astype(np.uint8)
        eu = e.astype(np.uint32)
        d = np.where(eu < 2, np.uint32(0x00200000) << eu, (eu - 1) << np.uint32(23)).astype(np.uint32).view(_F)
        code = np.argmin(np.abs(d.reshape(-1, 1, 1) * k - xb[:, :, None]), axis=-1).astype(np.uint8)
        out[b0:b0 + _MXFP4_STEP, 0] = e
        out[b0:b0 + _MXFP4_STEP, 1:] = code[:, :16] | (code[:, 16:] << 4)
    return out.reshape(rows, cols // 32 * 17)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(v.astype("<f2")).view(np.uint8).reshape(len(v), 2)


def _pack_k4(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """(n, 8) 6-bit scales and mins -> the (n, 12) bytes _scale_min_k4 unpacks"""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def set_iq1m_d(blocks: np.ndarray, d) -> None:
    """Write f16 d (one value, or one per block) into IQ1_M blocks (n, 56) u8, in place: its four
    nibbles are the top ones of the scale words at bytes 48..56 (their low 12 bits kept)."""
    h = np.ascontiguousarray(np.asarray(d, "<f2").reshape(-1, 1)).view("<u2").astype(np.uint16)
    sc = np.ascontiguousarray(blocks[:, 48:56]).view("<u2") & np.uint16(0x0FFF)
    sc |= ((h >> (4 * np.arange(4, dtype=np.uint16))) & 15) << 12
    blocks[:, 48:56] = sc.view(np.uint8)


def random_blocks(fmt: str, rows: int, cols: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """A random rows × cols tensor of format fmt (u8 bytes, nbytes long) whose weights have about
    this std and a mean near 0: random codes, scales set per block (synthetic vaults, tests and
    benchmarks; no float weights are made)."""
    _, bs, ts = FORMATS[fmt]
    n = rows * (cols // bs)
    if fmt == "F16":
        return _f16_bytes(rng.standard_normal(n).astype(_F) * _F(std)).reshape(-1)
    b = rng.integers(0, 256, size=(n, ts), dtype=np.uint8)
    jit = (1 + 0.1 * (rng.random(n) - 0.5)).astype(_F)  # ±5% per block
    if fmt in ("Q4_0", "Q5_0", "Q8_0", "IQ4_NL"):
        code_std = {"Q4_0": 4.61, "Q5_0": 9.23, "Q8_0": 73.9, "IQ4_NL": 67.0}[fmt]
        b[:, 0:2] = _f16_bytes(_F(std / code_std) * jit)
    elif fmt in ("Q4_1", "Q5_1"):  # m = −d·mean(q): zero mean
        qmean, qstd = (7.5, 4.61) if fmt == "Q4_1" else (15.5, 9.23)
        d = _F(std / qstd) * jit
        b[:, 0:2] = _f16_bytes(d)
        b[:, 2:4] = _f16_bytes(-d * _F(qmean))
    elif fmt == "MXFP4":  # a power of two per block: 2^(e − 128), kvalues std ≈ 5.6
        b[:, 0] = np.clip(128 + np.round(np.log2(std / 5.6) + (rng.random(n) - 0.5)), 2, 254).astype(np.uint8)
    elif fmt == "IQ4_XS":  # ls − 32 in 1..31 (mean 16)
        ls = rng.integers(33, 64, size=(n, 8), dtype=np.uint8)
        b[:, 0:2] = _f16_bytes(_F(std / (67.0 * 17.9)) * jit)
        b[:, 2:4] = np.ascontiguousarray(
            (((ls >> 4) & 3).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1).astype("<u2")
        ).view(np.uint8).reshape(n, 2)
        b[:, 4:8] = (ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)
    elif fmt in ("Q4_K", "Q5_K"):  # m = sc and dmin = mean(q)·d: zero mean
        sc = rng.integers(1, 64, size=(n, 8), dtype=np.uint8)
        qmean, qstd = (7.5, 4.61) if fmt == "Q4_K" else (15.5, 9.23)
        d = _F(std / (qstd * 36.4)) * jit
        b[:, 0:2] = _f16_bytes(d)
        b[:, 2:4] = _f16_bytes(d * _F(qmean))
        b[:, 4:16] = _pack_k4(sc, sc)
    elif fmt == "Q6_K":
        b[:, 192:208] = rng.integers(1, 128, size=(n, 16), dtype=np.uint8) * rng.choice(
            np.array([1, 255], np.uint8), size=(n, 16))  # ±(1..127) as int8
        b[:, 208:210] = _f16_bytes(_F(std / (18.5 * 73.3)) * jit)
    elif fmt == "Q2_K":  # m = sc & 15 and dmin = 1.5·d: zero mean
        lo = rng.integers(1, 16, size=(n, 16), dtype=np.uint8)
        b[:, 0:16] = lo | (lo << 4)
        d = _F(std / (1.118 * 9.0)) * jit
        b[:, 80:82] = _f16_bytes(d)
        b[:, 82:84] = _f16_bytes(d * _F(1.5))
    elif fmt == "Q3_K":
        b[:, 108:110] = _f16_bytes(_F(std / (2.29 * 18.5)) * jit)
    elif fmt == "IQ1_M":  # d in the top nibbles of the four scale words
        set_iq1m_d(b, _F(std / 7.2) * jit)
    elif fmt in CODEBOOK_FORMATS:  # random grid entries, signs and scales: values' std at d = 1
        code_std = {"IQ2_XXS": 53.2, "IQ2_XS": 55.9, "IQ2_S": 56.4, "IQ3_XXS": 142.5, "IQ3_S": 140.3, "IQ1_S": 7.19}[fmt]
        b[:, 0:2] = _f16_bytes(_F(std / code_std) * jit)
    return b.reshape(-1)
