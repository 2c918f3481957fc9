"""Write tests/data/mlx_quant_golden.npz: mlx.core.quantize's codes, scales and biases for the
tensors of tests/mlx_quant_cases.py, so tests/test_quant_mlx.py can check pysmoe's quantiser
where mlx is not installed. Run once with mlx installed (pip install "mlx[cpu]"):

    python scripts/make_quant_golden.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import mlx.core as mx  # noqa: E402

from mlx_quant_cases import DTYPES, KINDS, case  # noqa: E402

MX = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}


def stored(a) -> np.ndarray:
    """An mlx array's bytes as numpy (u16 bits for the 16-bit floats)."""
    return np.array(a.view(mx.uint16) if a.dtype in (mx.float16, mx.bfloat16) else a)


def main() -> None:
    out = {}
    for i, kind in enumerate(KINDS):
        for group in (32, 64, 128):
            for bits in (4, 8):
                for dtype in DTYPES:
                    w = case(i, kind, group, dtype, rows=2)
                    out[f"{kind}-{group}-{dtype}/w"] = w
                    q, s, b = mx.quantize(mx.array(w).astype(MX[dtype]), group, bits)
                    key = f"{kind}-{group}-{bits}-{dtype}"
                    out[key + "/q"] = np.array(q)
                    out[key + "/s"] = stored(s)
                    out[key + "/b"] = stored(b)
    path = ROOT / "tests" / "data" / "mlx_quant_golden.npz"
    np.savez_compressed(path, mlx_version=np.array(mx.__version__), **out)
    print(f"{path}: {sum(k.endswith('/q') for k in out)} cases, mlx {mx.__version__}")


if __name__ == "__main__":
    main()
