"""pysmoe's quantiser gives exactly mlx.core.quantize's codes, scales and biases (mode affine).

Against mlx itself where it is installed (random tensors of every kind in mlx_quant_cases.py,
group sizes 32/64/128, 4 and 8 bits, f32/f16/bf16 sources), and against the answers mlx gave
once (tests/data/mlx_quant_golden.npz, from scripts/make_quant_golden.py) everywhere.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_quant_cases import DTYPES, KINDS, case
from pysmoe import quant as Q

GOLDEN = Path(__file__).parent / "data" / "mlx_quant_golden.npz"


def _ours(w: np.ndarray, group: int, bits: int, dtype: str):
    """(codes bytes, scales bytes, biases bytes) of pysmoe's quantisation."""
    fmt = "q4" if bits == 4 else "q8"
    rows, cols = w.shape
    data = Q.quantize(w, fmt, dtype, group)
    ncodes, soff, boff, _ = Q.parts(fmt, rows, cols, group, dtype)
    nb = Q.SCALE_BYTES[dtype] * rows * cols // group
    return data[:ncodes], data[soff:soff + nb], data[boff:boff + nb]


def _golden_cases():
    if not GOLDEN.exists():
        return []
    with np.load(GOLDEN) as z:
        return sorted(k[:-2] for k in z.files if k.endswith("/q"))


@pytest.mark.parametrize("key", _golden_cases())
def test_matches_stored_mlx_answers(key):
    kind, group, bits, dtype = key.split("-")
    with np.load(GOLDEN) as z:
        w = z[f"{kind}-{group}-{dtype}/w"]
        want = (z[key + "/q"].tobytes(), z[key + "/s"].tobytes(), z[key + "/b"].tobytes())
    got = _ours(w, int(group), int(bits), dtype)
    for part, g, m in zip(("codes", "scales", "biases"), got, want):
        assert g == m, f"{key}: {part} differ"


def test_golden_file_is_there():
    assert len(_golden_cases()) == len(KINDS) * 3 * 2 * 3


# ------------------------------------------------------------------------- against mlx itself

def _mlx():
    return pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'mlx[cpu]')")


def _theirs(mx, w: np.ndarray, group: int, bits: int, dtype: str):
    dt = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}[dtype]
    q, s, b = mx.quantize(mx.array(w).astype(dt), group, bits)
    raw = (lambda a: np.array(a.view(mx.uint16)).tobytes()) if dtype != "f32" else (lambda a: np.array(a).tobytes())
    return np.array(q).tobytes(), raw(s), raw(b)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), kind=st.sampled_from(KINDS), group=st.sampled_from(Q.GROUPS),
       bits=st.sampled_from([4, 8]), dtype=st.sampled_from(DTYPES), rows=st.integers(1, 6),
       groups=st.integers(1, 4))
def test_bit_equal_to_mlx(seed, kind, group, bits, dtype, rows, groups):
    mx = _mlx()
    w = case(seed, kind, group, dtype, rows, groups)
    assert _ours(w, group, bits, dtype) == _theirs(mx, w, group, bits, dtype)


def test_bit_equal_to_mlx_on_a_big_matrix():
    """More rows than one chunk of the quantiser, bf16 as a checkpoint holds it."""
    mx = _mlx()
    w = case(7, "normal", 64, "bf16", rows=2100, groups=32)
    assert _ours(w, 64, 4, "bf16") == _theirs(mx, w, 64, 4, "bf16")


def test_huge_constant_group_is_refused():
    # edge/1e-7 overflows f32: MLX's result there is a float->int cast of NaN (undefined)
    w = np.full((1, 64), 1e32, dtype=np.float32)
    with pytest.raises(ValueError, match="too large"):
        Q.quantize(w, "q4", "f32")
