"""Tensors that exercise MLX's affine quantiser: shared by tests/test_quant_mlx.py and
scripts/make_quant_golden.py (which stores mlx's answers for them in tests/data)."""
from __future__ import annotations

import numpy as np

KINDS = ("normal", "offset", "constant", "zeros", "tiny", "large", "tie", "one_sign", "sparse")
DTYPES = ("f32", "f16", "bf16")


def case(seed: int, kind: str, group: int, dtype: str, rows: int = 3, groups: int = 2) -> np.ndarray:
    """A float32 (rows, groups·group) tensor of the given kind, every value exact in dtype."""
    from pysmoe.quant import bf16_bits_to_f32, f32_to_bf16_bits

    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, groups * group)).astype(np.float32)
    if kind == "offset":
        w = w * 0.1 + np.float32(rng.uniform(-4, 4))
    elif kind == "constant":                  # a whole group of one value
        w[:, :group] = np.float32(rng.uniform(-3, 3))
    elif kind == "zeros":
        w[:] = 0
        w[-1, -1] = 0.5
    elif kind == "tiny":                      # below MLX's 1e-7 floor on the scale
        w *= np.float32(1e-8)
    elif kind == "large":
        w *= np.float32(3e3 if dtype == "f16" else 1e6)
    elif kind == "tie":                       # |min| == |max|: the edge is the maximum
        w[:, 0] = 2.0
        w[:, 1] = -2.0
        w = np.clip(w, -2, 2)
    elif kind == "one_sign":
        w = np.abs(w) + 1
    elif kind == "sparse":
        w[rng.random(w.shape) < 0.8] = 0
    if dtype == "f16":
        w = w.astype(np.float16).astype(np.float32)
    elif dtype == "bf16":
        w = bf16_bits_to_f32(f32_to_bf16_bits(w))
    return w
