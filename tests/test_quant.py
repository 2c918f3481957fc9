"""pysmoe.quant: layout, rounding, error bounds, and bit equality with libsmoe's smoe_dequantize."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pysmoe import quant as Q

FMTS = ["q4", "q8", "bf16", "f32"]
SCALES = ["f16", "bf16"]


def _align64(n):
    return (n + 63) // 64 * 64


@pytest.mark.parametrize("rows,cols", [(1, 64), (3, 128), (7, 192), (64, 2048), (768, 2048), (2048, 768)])
def test_sizes_match_the_spec(rows, cols):
    n = rows * cols
    assert Q.tensor_nbytes("f32", rows, cols) == 4 * n
    assert Q.tensor_nbytes("bf16", rows, cols) == 2 * n
    assert Q.tensor_nbytes("q8", rows, cols) == _align64(n) + 2 * _align64(2 * n // 64)
    assert Q.tensor_nbytes("q4", rows, cols) == _align64(n // 2) + 2 * _align64(2 * n // 64)
    w = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    for fmt in FMTS:
        for sd in SCALES:
            assert len(Q.quantize(w, fmt, sd)) == Q.tensor_nbytes(fmt, rows, cols)


def test_parts_are_64_byte_aligned():
    for fmt in ("q4", "q8"):
        for rows, cols in [(1, 64), (3, 64), (5, 320)]:
            ncodes, soff, boff, total = Q.parts(fmt, rows, cols)
            assert soff % 64 == 0 and boff % 64 == 0 and total % 64 == 0
            assert soff >= ncodes and boff - soff >= 2 * rows * cols // 64


def test_quantised_formats_need_whole_groups():
    with pytest.raises(ValueError, match="cols % 64"):
        Q.tensor_nbytes("q4", 4, 96)
    with pytest.raises(ValueError, match="unknown tensor format"):
        Q.tensor_nbytes("q3", 4, 64)
    assert Q.tensor_nbytes("f32", 1, 33) == 132


def test_q4_packing_order():
    # A group holding -15..0 four times quantises to scale 1, bias -15 (MLX's edge of larger
    # magnitude) and codes c % 16.
    w = np.tile(np.arange(16, dtype=np.float32) - 15, 4)[None, :]
    data = Q.quantize(w, "q4", "f16")
    words = np.frombuffer(data[:32], dtype="<u4")
    assert [hex(x) for x in words[:2]] == ["0x76543210", "0xfedcba98"]
    assert np.all(words == np.tile(np.array([0x76543210, 0xFEDCBA98], dtype=np.uint32), 4))
    scales = np.frombuffer(data[64:66], dtype="<f2")
    biases = np.frombuffer(data[128:130], dtype="<f2")
    assert scales[0] == 1 and biases[0] == -15
    assert np.array_equal(Q.dequantize(data, "q4", 1, 64, "f16"), w)


def test_q4_codes_direct_matches_element_rule():
    rng = np.random.default_rng(1)
    rows, cols = 3, 128
    codes = rng.integers(0, 16, (rows, cols), dtype=np.uint8)
    data = Q.quantize_codes_direct("q4", rows, cols, codes, np.ones(rows * 2), np.zeros(rows * 2), "bf16")
    words = np.frombuffer(data[:rows * cols // 2], dtype="<u4").reshape(rows, cols // 8)
    for r in range(rows):
        for c in range(cols):
            assert (words[r, c // 8] >> (4 * (c % 8))) & 15 == codes[r, c]
    assert np.array_equal(Q.dequantize(data, "q4", rows, cols, "bf16"), codes.astype(np.float32))
    # packed bytes (MLX's u32 words) give the same tensor
    again = Q.quantize_codes_direct("q4", rows, cols, words, np.ones(rows * 2), np.zeros(rows * 2), "bf16")
    assert again == data


def test_q8_layout():
    # rows 0..63 and 64..127: the larger edge is the maximum, so the scale is negative (-63/255)
    # and the codes count down from it
    w = np.arange(128, dtype=np.float32).reshape(2, 64)
    data = Q.quantize(w, "q8", "f16")
    codes = np.frombuffer(data[:128], dtype=np.uint8).reshape(2, 64)
    assert codes[0, 0] == 255 and codes[0, -1] == 0 and codes[1, 0] == 255 and codes[1, -1] == 0
    assert np.all(np.diff(codes.astype(int), axis=1) <= 0)
    assert np.frombuffer(data[128:130], dtype="<f2")[0] < 0


def test_bf16_round_to_nearest_even():
    one = 0x3F800000
    cases = {
        one: 0x3F80,
        one + 0x8000: 0x3F80,           # halfway, even below: down
        one + 0x18000: 0x3F82,          # halfway, odd below: up
        one + 0x8001: 0x3F81,           # just above halfway: up
        one + 0x7FFF: 0x3F80,
        0x7F7FFFFF: 0x7F80,             # largest f32 rounds to inf
        0xFF800000: 0xFF80,             # -inf
        0x00000001: 0x0000,             # smallest subnormal rounds to 0
    }
    x = np.array(list(cases), dtype=np.uint32).view(np.float32)
    assert [hex(v) for v in Q.f32_to_bf16_bits(x)] == [hex(v) for v in cases.values()]
    nan = Q.f32_to_bf16_bits(np.array([np.nan, -np.nan], dtype=np.float32))
    assert np.isnan(Q.bf16_bits_to_f32(nan)).all()


def _bf16_by_distance(x: np.ndarray) -> np.ndarray:
    """Slow, obvious bf16 rounding: the nearer of the two neighbours, ties to the even one."""
    u = x.view(np.uint32).astype(np.uint64)
    lo = u & 0xFFFF0000
    hi = lo + 0x10000
    as_f = lambda b: (b.astype(np.uint32)).view(np.float32).astype(np.float64)  # noqa: E731
    d_lo = np.abs(x.astype(np.float64) - as_f(lo))
    with np.errstate(invalid="ignore"):
        d_hi = np.abs(as_f(hi & 0xFFFFFFFF) - x.astype(np.float64))
    # the neighbour past the largest finite bf16 is inf, at distance "one more step"
    at_top = (hi & 0x7FFFFFFF) == 0x7F800000
    d_hi[at_top] = np.abs(np.ldexp(np.float64(1), 128) - np.abs(x[at_top].astype(np.float64)))
    even_lo = ((lo >> 16) & 1) == 0
    up = (d_hi < d_lo) | ((d_hi == d_lo) & ~even_lo)
    return (np.where(up, hi, lo) >> 16).astype(np.uint16)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 300))
def test_bf16_matches_nearest_even(seed, n):
    bits = np.random.default_rng(seed).integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
    bits[: n // 3] = (bits[: n // 3] & 0xFFFF0000) | 0x8000  # many exact ties
    x = bits.view(np.float32)
    x = x[np.isfinite(x)]
    assert np.array_equal(Q.f32_to_bf16_bits(x), _bf16_by_distance(x))


def _bound(w, fmt, sd):
    """Largest error allowed per element: a step (half a step of rounding; or, at the far end
    of the group, what MLX's moving the scale so that zero is a code can clip: at most
    levels·step/(2·|q0|) with |q0| >= levels/2), plus what rounding scale and bias to the
    stored dtype can cost at the group's ends — relatively (eps), or for an f16 scale below f16's
    smallest normal (6.1e-5: q8 groups of weights ~1e-3 wide) absolutely, half its subnormal
    spacing 2^-24 times the largest code."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // 64, 64).astype(np.float64)
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    levels = 15 if fmt == "q4" else 255
    step = (hi - lo) / levels
    eps = 2.0 ** -11 if sd == "f16" else 2.0 ** -8
    edge = np.maximum(np.abs(lo), np.abs(hi))
    sub = levels * 2.0 ** -25 if sd == "f16" else 0.0
    b = step * (1 + 2 * eps) + eps * (edge + levels * step) * 2 + sub + 1e-7 * (np.abs(hi) + np.abs(lo))
    return np.broadcast_to(b, g.shape).reshape(rows, cols)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 9), groups=st.integers(1, 4), seed=st.integers(0, 2 ** 32 - 1),
       scale=st.sampled_from([1e-3, 0.05, 1.0, 30.0]), offset=st.sampled_from([0.0, 0.5, -2.0]),
       fmt=st.sampled_from(["q4", "q8"]), sd=st.sampled_from(SCALES))
def test_quantised_round_trip_error(rows, groups, seed, scale, offset, fmt, sd):
    cols = 64 * groups
    w = (np.random.default_rng(seed).standard_normal((rows, cols)) * scale + offset).astype(np.float32)
    r = Q.dequantize(Q.quantize(w, fmt, sd), fmt, rows, cols, sd)
    assert r.dtype == np.float32 and r.shape == (rows, cols)
    assert np.all(np.abs(r.astype(np.float64) - w) <= _bound(w, fmt, sd))


def test_round_trip_error_with_a_subnormal_f16_scale():
    """q8 over a group 4e-3 wide: the f16 scale (1.7e-5) is subnormal, so it rounds by up to 2^-25
    absolutely, which the far codes multiply (hypothesis found it: seed 189713285, scale 1e-3)."""
    w = (np.random.default_rng(189713285).standard_normal((1, 64)) * 1e-3).astype(np.float32)
    r = Q.dequantize(Q.quantize(w, "q8", "f16"), "q8", 1, 64, "f16")
    err = np.abs(r.astype(np.float64) - w)
    assert (w.max() - w.min()) / 255 < 2.0 ** -14 and err.max() > (w.max() - w.min()) / 255  # the case
    assert np.all(err <= _bound(w, "q8", "f16"))


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 5), cols=st.integers(1, 70), seed=st.integers(0, 2 ** 32 - 1))
def test_float_formats_round_trip(rows, cols, seed):
    w = (np.random.default_rng(seed).standard_normal((rows, cols)) * 10).astype(np.float32)
    assert np.array_equal(Q.dequantize(Q.quantize(w, "f32"), "f32", rows, cols), w)
    r = Q.dequantize(Q.quantize(w, "bf16"), "bf16", rows, cols)
    assert np.all(np.abs(r - w) <= np.abs(w) * 2.0 ** -8)


def test_constant_group_and_vector():
    w = np.full(64, 0.75, dtype=np.float32)            # scale 0: every code 0, w = bias
    for fmt in ("q4", "q8"):
        data = Q.quantize(w, fmt, "f16")
        assert np.array_equal(Q.dequantize(data, fmt, 1, 64, "f16")[0], w)
    z = np.zeros((2, 128), dtype=np.float32)
    assert np.array_equal(Q.dequantize(Q.quantize(z, "q4"), "q4", 2, 128), z)


def test_non_finite_is_refused():
    w = np.zeros((1, 64), dtype=np.float32)
    w[0, 3] = np.nan
    with pytest.raises(ValueError, match="inf or NaN"):
        Q.quantize(w, "q4")
    with pytest.raises(ValueError, match="too large"):
        Q.quantize(np.array([[0.0] * 63 + [1e7]], dtype=np.float32), "q4", "f16")


def test_dequantize_is_separate_multiply_and_add():
    rng = np.random.default_rng(5)
    rows, cols = 4, 128
    data = Q.quantize(rng.standard_normal((rows, cols)).astype(np.float32), "q8", "bf16")
    codes, s, b = Q.split(data, "q8", rows, cols, "bf16")
    want = (np.repeat(s, 64, axis=1) * codes.astype(np.float32)) + np.repeat(b, 64, axis=1)
    assert np.array_equal(Q.dequantize(data, "q8", rows, cols, "bf16"), want)


def test_big_matrix_is_chunked_consistently():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((3000, 2048)).astype(np.float32)  # more than one chunk of rows
    data = Q.quantize(w, "q4")
    r = Q.dequantize(data, "q4", 3000, 2048)
    one = Q.dequantize(Q.quantize(w[2999:], "q4"), "q4", 1, 2048)
    assert np.array_equal(r[2999:], one)


# ----------------------------------------------------------------- bit equality with libsmoe

def _lib():
    try:
        from pysmoe._ffi import check, ffi, lib
    except (ImportError, OSError) as e:
        pytest.skip(f"libsmoe not available: {e}")
    return ffi, lib, check


def _c_dequantize(data: bytes, fmt: str, sd: str | None, rows: int, cols: int) -> np.ndarray:
    ffi, lib, check = _lib()
    out = np.empty((rows, cols), dtype=np.float32)
    buf = ffi.from_buffer(data)
    group = 64 if fmt in ("q8", "q4") else 0  # quant.py's only group size until it takes others
    check(lib.smoe_dequantize(Q.FORMAT_CODE[fmt], Q.SCALE_CODE[sd], group, rows, cols, buf, len(data),
                              ffi.cast("float *", ffi.from_buffer(out, require_writable=True))))
    return out


def _random_stored(rng, fmt, sd, rows, cols) -> bytes:
    """Random codes and random finite scales/biases, subnormals included."""
    if fmt in ("q4", "q8"):
        levels = 15 if fmt == "q4" else 255
        codes = rng.integers(0, levels + 1, (rows, cols), dtype=np.uint8)
        g = rows * cols // 64
        mag = 10.0 ** rng.uniform(-9 if sd == "f16" else -30, 3, 2 * g)
        sb = (mag * rng.choice([-1, 1], 2 * g)).astype(np.float32)
        return Q.quantize_codes_direct(fmt, rows, cols, codes, sb[:g], sb[g:], sd)
    w = (rng.standard_normal((rows, cols)) * 10.0 ** rng.uniform(-3, 3, (rows, 1))).astype(np.float32)
    return Q.quantize(w, fmt)


@pytest.mark.parametrize("fmt,sd", [("q4", "f16"), ("q4", "bf16"), ("q8", "f16"), ("q8", "bf16"),
                                    ("bf16", None), ("f32", None)])
def test_bit_equal_to_libsmoe(fmt, sd):
    rng = np.random.default_rng(zlib.crc32(f"{fmt}{sd}".encode()))
    for rows, cols in [(1, 64), (5, 128), (33, 256), (64, 2048)]:
        data = _random_stored(rng, fmt, sd, rows, cols)
        py = Q.dequantize(data, fmt, rows, cols, sd)
        c = _c_dequantize(data, fmt, sd, rows, cols)
        assert np.array_equal(py.view(np.uint32), c.view(np.uint32)), (fmt, sd, rows, cols)


def test_bit_equal_to_libsmoe_on_quantised_weights():
    rng = np.random.default_rng(11)
    w = rng.standard_normal((96, 512)).astype(np.float32)
    for fmt in ("q4", "q8"):
        for sd in SCALES:
            data = Q.quantize(w, fmt, sd)
            assert np.array_equal(Q.dequantize(data, fmt, 96, 512, sd).view(np.uint32),
                                  _c_dequantize(data, fmt, sd, 96, 512).view(np.uint32))
