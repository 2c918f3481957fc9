"""Write tests/data/ggml_golden.npz: for each GGML block format pysmoe reads, some blocks (random
bytes, so some f16 scales are inf or NaN, plus random_blocks' finite ones) and what gguf-py's
`gguf.quants.dequantize` makes of them, so tests/test_ggml_formats.py checks pysmoe's and libsmoe's
dequantisation where gguf is not installed. Run with gguf installed (pip install gguf):

    python scripts/make_ggml_golden.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from gguf.constants import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from pysmoe import ggml_blocks  # noqa: E402


# where each format's (first) f16 scale sits in its block; MXFP4's e8m0 scale is never inf or NaN,
# IQ1_M's d is spread over the top nibbles of four words (ggml_blocks.set_iq1m_d)
SCALE_AT = {"F16": 0, "Q4_0": 0, "Q4_1": 0, "Q5_0": 0, "Q5_1": 0, "Q8_0": 0, "Q2_K": 80, "Q3_K": 108, "Q4_K": 0, "Q5_K": 0, "Q6_K": 208,
            "IQ4_NL": 0, "IQ4_XS": 0, "IQ2_XXS": 0, "IQ2_XS": 0, "IQ2_S": 0, "IQ3_XXS": 0, "IQ3_S": 0, "IQ1_S": 0}


def main() -> None:
    out = {}
    rng = np.random.default_rng(20261203)
    for fmt, (_, bs, ts) in ggml_blocks.FORMATS.items():
        cols = 256 if bs > 1 else 64
        rows = 4
        raw = np.concatenate([rng.integers(0, 256, size=rows * cols // bs * ts, dtype=np.uint8),
                              ggml_blocks.random_blocks(fmt, rows, cols, 0.05, rng)]).reshape(2 * rows, -1)
        at = SCALE_AT.get(fmt)
        if at is not None:  # an inf and a NaN scale, whatever the random bytes hold
            blocks = raw.reshape(-1, ts)
            blocks[0, at:at + 2] = np.frombuffer(np.float16(-np.inf).tobytes(), np.uint8)
            blocks[1, at:at + 2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
        if fmt == "IQ1_M":
            blocks = raw.reshape(-1, ts)
            ggml_blocks.set_iq1m_d(blocks[:2], [-np.inf, np.nan])
        with np.errstate(invalid="ignore", over="ignore"):
            want = dequantize(raw, GGMLQuantizationType[fmt]).reshape(2 * rows, cols)
        out[f"{fmt}_bytes"] = raw
        out[f"{fmt}_values"] = want.view(np.uint32)
    np.savez_compressed(ROOT / "tests" / "data" / "ggml_golden.npz", **out)


if __name__ == "__main__":
    main()
