"""Tensor formats of the vault (docs/vault.md section 3), in numpy.

A quantised tensor of rows × cols (cols % G == 0, G the group size: 32, 64 or 128) is three
parts, each starting on a 64-byte boundary relative to the tensor's first byte:

    codes    q4: rows × cols/8 little-endian u32 words, element c at bits 4·(c%8) of word c/8
             q8: rows × cols u8
    scales   rows × cols/G, f16, bf16 (2 bytes) or f32 (4 bytes)
    biases   rows × cols/G, same dtype as the scales

and dequantises as w = f32(scale)·f32(q) + f32(bias): one f32 multiply, then one f32 add, never
fused. libsmoe's `smoe_dequantize` does the same operations, so the two agree bit for bit
(tests/test_quant.py checks it). This is MLX's affine layout, so an MLX checkpoint's codes,
scales and biases are copied in unchanged.

`quantize` is MLX's affine quantiser (`mlx.core.quantize`, mode "affine"), reproduced exactly, so
a float checkpoint converted here holds the very codes, scales and biases MLX would have made.
It is not the textbook min/max rule. Per group, in f32 arithmetic:

    lo, hi = min, max of the group
    edge   = the one of lo, hi with the larger magnitude (hi on a tie)
    scale  = max((hi − lo) / (2^bits − 1), 1e-7), negative when edge is hi
    q0     = rint(edge / scale)            (edge's code counted from zero)
    if q0 ≠ 0: scale = edge / q0, bias = edge  (so that 0 lands exactly on a code: bias + k·scale
               is 0 for k = −q0 ... up to the rounding of that division)
    else:      bias = 0
    q      = clip(rint((w − bias) / scale), 0, 2^bits − 1)

The codes use the f32 scale; only then are scale and bias rounded to the stored dtype (the
source's dtype in MLX: bf16 for a bf16 checkpoint). The scale is signed: with the edge at hi,
codes count down from hi. tests/test_quant_mlx.py checks all of this bit for bit against mlx
where it is installed and against vectors made with it (tests/data/mlx_quant_golden.npz).
"""
from __future__ import annotations

import numpy as np

from . import ggml_blocks

GROUP = 64                  # the default group size, and the only one before format version 2
GROUPS = (32, 64, 128)
ALIGN = 64
# ggml_blocks.FORMATS: the GGML block formats (Q4_K, Q8_0, MXFP4, ...), copied from GGUF files
FORMATS = ("f32", "bf16", "q8", "q4") + tuple(ggml_blocks.FORMATS)
SCALE_DTYPES = ("f16", "bf16", "f32")
SCALE_BYTES = {"f16": 2, "bf16": 2, "f32": 4}
# The numbers docs/vault.md gives each format and scale dtype in the tensor descriptors.
FORMAT_CODE = {"f32": 0, "bf16": 1, "q8": 2, "q4": 3, **{k: v[0] for k, v in ggml_blocks.FORMATS.items()}}
SCALE_CODE = {None: 0, "f16": 1, "bf16": 2, "f32": 3}
FORMAT_NAME = {v: k for k, v in FORMAT_CODE.items()}
SCALE_NAME = {v: k for k, v in SCALE_CODE.items()}
_BITS = {"q4": 4, "q8": 8}
_EPS = np.float32(1e-7)     # MLX's floor on a group's scale magnitude

# Rows quantised per step: bounds the temporaries (a few × 16 MiB) whatever the matrix size.
_CHUNK_ELEMS = 1 << 22


def align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def is_quantized(fmt: str) -> bool:
    return fmt in _BITS


def _check_format(fmt: str, cols: int, group: int = GROUP) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown tensor format {fmt!r} (one of {', '.join(FORMATS)})")
    if ggml_blocks.is_ggml(fmt):
        ggml_blocks.check_cols(fmt, cols)
    if fmt in _BITS:
        if group not in GROUPS:
            raise ValueError(f"group size {group} is not one of {', '.join(map(str, GROUPS))}")
        if cols % group:
            raise ValueError(f"format {fmt} with groups of {group} needs cols % {group} == 0, got cols={cols}")


def _check_scale_dtype(scale_dtype: str) -> None:
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"unknown scale dtype {scale_dtype!r} (one of {', '.join(SCALE_DTYPES)})")


def parts(fmt: str, rows: int, cols: int, group: int = GROUP,
          scale_dtype: str | None = "f16") -> tuple[int, int, int, int]:
    """(codes_bytes, scales_offset, biases_offset, total_bytes) of a quantised tensor."""
    _check_format(fmt, cols, group)
    if fmt not in _BITS:
        n = tensor_nbytes(fmt, rows, cols)
        return n, n, n, n
    _check_scale_dtype(scale_dtype)
    codes = rows * cols * _BITS[fmt] // 8
    sb = SCALE_BYTES[scale_dtype] * rows * (cols // group)
    scales_off = align(codes, ALIGN)
    biases_off = scales_off + align(sb, ALIGN)
    return codes, scales_off, biases_off, biases_off + align(sb, ALIGN)


def tensor_nbytes(fmt: str, rows: int, cols: int, group: int = GROUP,
                  scale_dtype: str | None = "f16") -> int:
    """Stored size in bytes of a rows × cols tensor (the same for f16 and bf16 scales)."""
    _check_format(fmt, cols, group)
    if fmt == "f32":
        return 4 * rows * cols
    if fmt == "bf16":
        return 2 * rows * cols
    if ggml_blocks.is_ggml(fmt):
        return ggml_blocks.nbytes(fmt, rows, cols)
    return parts(fmt, rows, cols, group, scale_dtype)[3]


# ------------------------------------------------------------------------------ 16-bit floats

def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even of f32 to bf16, as u16 bits (NaN stays a quiet NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return rounded


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


_STORED = {"f16": "<u2", "bf16": "<u2", "f32": "<f4"}


def _round_to(x: np.ndarray, scale_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(stored values — u16 bits, or f32 for f32 —, their exact f32 value) of x rounded to
    scale_dtype."""
    x = np.asarray(x, dtype=np.float32)
    if scale_dtype == "f32":
        return x, x
    if scale_dtype == "f16":
        with np.errstate(over="ignore"):
            h = x.astype(np.float16)
        return h.view(np.uint16), h.astype(np.float32)
    bits = f32_to_bf16_bits(x)
    return bits, bf16_bits_to_f32(bits)


def _stored(values, scale_dtype: str) -> np.ndarray:
    """Scales or biases, given as stored bits (u16 for f16/bf16), float16 (f16 only) or floats
    (rounded to scale_dtype) -> the stored values."""
    values = np.asarray(values)
    if scale_dtype == "f32":
        if values.dtype != np.float32:
            raise ValueError(f"f32 scales must be given as float32, got {values.dtype}")
        return values
    if values.dtype == np.uint16:
        return values
    if values.dtype == np.float16:
        if scale_dtype != "f16":
            raise ValueError("float16 scales given for a bf16 scale dtype; pass floats or u16 bits")
        return values.view(np.uint16)
    return _round_to(values.astype(np.float32), scale_dtype)[0]


# --------------------------------------------------------------------------------- quantise

def pack_q4_codes(codes: np.ndarray) -> np.ndarray:
    """u8 codes 0..15 (…, cols) -> the packed bytes (…, cols/2): low nibble = even element.

    Eight nibbles per little-endian u32 with element c at bits 4·(c%8) is exactly this byte
    stream, so no u32 arithmetic is needed.
    """
    codes = np.asarray(codes, dtype=np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << np.uint8(4))).astype(np.uint8)


def unpack_q4_codes(packed: np.ndarray) -> np.ndarray:
    """Inverse of pack_q4_codes: bytes (…, n) -> codes (…, 2n)."""
    packed = np.asarray(packed, dtype=np.uint8)
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = packed & np.uint8(15)
    out[..., 1::2] = packed >> np.uint8(4)
    return out


def quantize_codes_direct(fmt: str, rows: int, cols: int, codes, scales, biases,
                          scale_dtype: str = "f16", group: int = GROUP) -> bytearray:
    """Lay out codes that already exist, with their scales and biases, as the vault stores them.

    For writers that never had float weights: `pysmoe synth` (random codes) and the MLX import
    (MLX's q4 u32 words and q8 u32 words are this layout, byte for byte). codes: q4 either
    packed (rows·cols/2 bytes, any dtype whose bytes are the words, e.g. MLX's u32 (rows,
    cols/8)) or unpacked u8 (rows, cols); q8 u8 (rows, cols) or MLX's u32 (rows, cols/4).
    scales, biases: rows × cols/group as stored bits (u16 for f16/bf16, float32 for f32),
    float16 (f16 only) or floats (rounded to scale_dtype).
    """
    if not is_quantized(fmt):
        raise ValueError(f"quantize_codes_direct is for q4/q8, not {fmt}")
    _check_scale_dtype(scale_dtype)
    ncodes, soff, boff, total = parts(fmt, rows, cols, group, scale_dtype)
    codes = np.ascontiguousarray(codes)
    if fmt == "q4" and codes.nbytes == rows * cols and codes.dtype == np.uint8:
        codes = pack_q4_codes(codes.reshape(rows, cols))
    if codes.nbytes != ncodes:
        raise ValueError(f"{fmt} codes of {rows}x{cols} must be {ncodes} bytes, got {codes.nbytes}")
    groups = rows * (cols // group)
    s = _stored(scales, scale_dtype).reshape(-1)
    b = _stored(biases, scale_dtype).reshape(-1)
    if s.size != groups or b.size != groups:
        raise ValueError(f"{rows}x{cols} needs {groups} scales and biases, got {s.size} and {b.size}")
    out = bytearray(total)
    nb = SCALE_BYTES[scale_dtype] * groups
    out[:ncodes] = codes.view(np.uint8).reshape(-1).data
    out[soff:soff + nb] = s.astype(_STORED[scale_dtype]).tobytes()
    out[boff:boff + nb] = b.astype(_STORED[scale_dtype]).tobytes()
    return out  # a bytearray: a tensor can be large, and bytes(out) would copy it


def mlx_affine(g: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MLX's affine quantisation of groups g (…, G) in f32 -> (codes u8 (…, G), scale f32 (…),
    bias f32 (…)), scale and bias not yet rounded to a stored dtype. See the module docstring."""
    g = np.asarray(g, dtype=np.float32)
    levels = np.float32((1 << bits) - 1)
    lo = g.min(axis=-1)
    hi = g.max(axis=-1)
    if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
        raise ValueError("cannot quantise a tensor holding inf or NaN")
    lo_wins = np.abs(lo) > np.abs(hi)
    with np.errstate(over="ignore"):
        span = (hi - lo) / levels
    if not np.isfinite(span).all():
        raise ValueError("values too large to quantise (a group spans more than f32 can hold)")
    scale = np.maximum(span, _EPS)
    scale = np.where(lo_wins, scale, -scale)
    edge = np.where(lo_wins, lo, hi)
    with np.errstate(over="ignore"):
        q0 = np.rint(edge / scale)
    if not np.isfinite(q0).all():
        # edge/1e-7 overflows only for a near-constant group beyond ~3e31; MLX's own result
        # there rests on a float->int cast of NaN, which no port can promise to match.
        raise ValueError("values too large to quantise exactly as MLX does (|w| > 3e31 in a near-constant group)")
    moved = q0 != 0
    safe_q0 = np.where(moved, q0, np.float32(1))
    scale = np.where(moved, edge / safe_q0, scale).astype(np.float32)
    bias = np.where(moved, edge, np.float32(0)).astype(np.float32)
    q = g - bias[..., None]
    q /= scale[..., None]
    np.rint(q, out=q)
    np.clip(q, 0, levels, out=q)
    return q.astype(np.uint8), scale, bias


def _quantize_rows(w: np.ndarray, bits: int, group: int, scale_dtype: str, out_codes: np.ndarray,
                   out_s: np.ndarray, out_b: np.ndarray) -> None:
    r, cols = w.shape
    q, s, b = mlx_affine(w.reshape(r, cols // group, group), bits)
    s_st, s_val = _round_to(s, scale_dtype)
    b_st, b_val = _round_to(b, scale_dtype)
    if not (np.isfinite(s_val).all() and np.isfinite(b_val).all()):
        raise ValueError(f"values too large for {scale_dtype} scales")
    q = q.reshape(r, cols)
    out_codes[...] = pack_q4_codes(q) if bits == 4 else q
    out_s[...] = s_st
    out_b[...] = b_st


def quantize(w: np.ndarray, fmt: str, scale_dtype: str = "f16", group: int = GROUP) -> bytes:
    """A (rows, cols) or (cols,) float array -> its bytes in format fmt (docs/vault.md §3).

    q4/q8 are MLX's affine quantisation with groups of `group` along cols, scales and biases
    rounded to scale_dtype: `mlx.core.quantize(w, group, bits)` of a tensor of dtype D gives the
    same codes, scales and biases as quantize(w as f32, fmt, D) here (D = f16, bf16 or f32)."""
    w = np.asarray(w)
    if w.ndim == 1:
        w = w.reshape(1, -1)
    if w.ndim != 2:
        raise ValueError(f"expected a matrix or a vector, got shape {w.shape}")
    rows, cols = w.shape
    return bytes(quantize_rows(lambda r0, r1: w[r0:r1].astype(np.float32, copy=False), rows, cols, fmt,
                               scale_dtype, group))


def quantize_rows(read_rows, rows: int, cols: int, fmt: str, scale_dtype: str = "f16",
                  group: int = GROUP) -> np.ndarray:
    """quantize() of a matrix given as read_rows(r0, r1) -> f32 (r1 - r0, cols), called for a
    few MiB of rows at a time, so a large tensor (an embedding) never exists in f32 whole.
    Returns the stored bytes as a u8 array."""
    _check_format(fmt, cols, group)
    step = max(1, _CHUNK_ELEMS // max(cols, 1))
    if fmt == "MXFP4":  # float experts to gpt-oss's released format (ggml_blocks.quantize_mxfp4)
        out = np.empty((rows, ggml_blocks.nbytes(fmt, 1, cols)), dtype=np.uint8)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            out[r0:r1] = ggml_blocks.quantize_mxfp4(read_rows(r0, r1))
        return out.reshape(-1)
    if ggml_blocks.is_ggml(fmt):
        raise ValueError(f"pysmoe does not quantise to {fmt}: GGML formats come as they are from a GGUF file "
                         "(write their bytes with add_dense_raw / add_expert_raw); of them it makes MXFP4 only")
    if fmt in ("f32", "bf16"):
        out = np.empty((rows, cols), dtype="<f4" if fmt == "f32" else "<u2")
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            block = read_rows(r0, r1)
            out[r0:r1] = block if fmt == "f32" else f32_to_bf16_bits(block)
        return out.reshape(-1).view(np.uint8)
    _check_scale_dtype(scale_dtype)
    bits = _BITS[fmt]
    ncodes, soff, boff, total = parts(fmt, rows, cols, group, scale_dtype)
    gpr = cols // group
    nb = SCALE_BYTES[scale_dtype] * rows * gpr
    buf = np.zeros(total, dtype=np.uint8)
    codes = buf[:ncodes].reshape(rows, cols * bits // 8)
    scales = buf[soff:soff + nb].view(_STORED[scale_dtype]).reshape(rows, gpr)
    biases = buf[boff:boff + nb].view(_STORED[scale_dtype]).reshape(rows, gpr)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        _quantize_rows(read_rows(r0, r1), bits, group, scale_dtype, codes[r0:r1], scales[r0:r1], biases[r0:r1])
    return buf


# ------------------------------------------------------------------------------- dequantise

def _as_u8(data) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return data.reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


def _widen(raw: np.ndarray, scale_dtype: str) -> np.ndarray:
    """Stored scale bytes (u8) -> f32 values."""
    if scale_dtype == "f32":
        return raw.view("<f4").astype(np.float32)
    if scale_dtype == "f16":
        return raw.view("<f2").astype(np.float32)
    return bf16_bits_to_f32(raw.view("<u2"))


def split(data, fmt: str, rows: int, cols: int, scale_dtype: str | None = "f16", group: int = GROUP):
    """The parts of a stored q4/q8 tensor as arrays: (codes u8 (rows, cols) unpacked,
    scales f32 (rows, cols/group), biases f32 (rows, cols/group))."""
    ncodes, soff, boff, total = parts(fmt, rows, cols, group, scale_dtype)
    u8 = _as_u8(data)
    if u8.size < total:
        raise ValueError(f"{fmt} {rows}x{cols} needs {total} bytes, got {u8.size}")
    gpr = cols // group
    nb = SCALE_BYTES[scale_dtype] * rows * gpr
    codes = u8[:ncodes].reshape(rows, -1)
    if fmt == "q4":
        codes = unpack_q4_codes(codes)
    s = _widen(u8[soff:soff + nb], scale_dtype).reshape(rows, gpr)
    b = _widen(u8[boff:boff + nb], scale_dtype).reshape(rows, gpr)
    return codes, s, b


def dequantize(data, fmt: str, rows: int, cols: int, scale_dtype: str | None = "f16",
               group: int = GROUP) -> np.ndarray:
    """Stored bytes (bytes, memoryview or u8 array, at least tensor_nbytes long) -> f32 (rows, cols)."""
    _check_format(fmt, cols, group)
    if fmt in _BITS:
        _check_scale_dtype(scale_dtype)
    n = tensor_nbytes(fmt, rows, cols, group, scale_dtype)
    u8 = _as_u8(data)
    if u8.size < n:
        raise ValueError(f"{fmt} {rows}x{cols} needs {n} bytes, got {u8.size}")
    if fmt == "f32":
        return u8[:n].view("<f4").astype(np.float32).reshape(rows, cols)
    if fmt == "bf16":
        return bf16_bits_to_f32(u8[:n].view("<u2")).reshape(rows, cols)
    if ggml_blocks.is_ggml(fmt):
        return ggml_blocks.dequantize(u8, fmt, rows, cols)
    gpr = cols // group
    sb = SCALE_BYTES[scale_dtype]
    out = np.empty((rows, cols), dtype=np.float32)
    step = max(1, _CHUNK_ELEMS // cols)
    ncodes, soff, boff, _ = parts(fmt, rows, cols, group, scale_dtype)
    code_row = ncodes // rows
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        c = u8[r0 * code_row:r1 * code_row].reshape(r1 - r0, code_row)
        q = unpack_q4_codes(c) if fmt == "q4" else c
        s = _widen(u8[soff + sb * r0 * gpr:soff + sb * r1 * gpr], scale_dtype)
        b = _widen(u8[boff + sb * r0 * gpr:boff + sb * r1 * gpr], scale_dtype)
        o = out[r0:r1].reshape(r1 - r0, gpr, group)
        np.multiply(q.reshape(r1 - r0, gpr, group).astype(np.float32),
                    s.reshape(r1 - r0, gpr, 1), out=o)
        np.add(o, b.reshape(r1 - r0, gpr, 1), out=o)
    return out
