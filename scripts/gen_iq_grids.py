"""Write csrc/cpu/ggml_iq_grids.h (included once, by kernels_ref.c): the codebooks of the GGML IQ1/IQ2/IQ3 formats (IQ2_XXS, IQ2_XS,
IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M), as gguf-py defines them (gguf.quants.<type>.grid: each
entry 8 or 4 small integers, a block's values before its scale and signs). They are part of the
format, like IQ4_NL's 16 kvalues, but too long to write by hand: this script reads them from the
installed gguf package and writes each entry as one little-endian integer whose byte j is value j
(int8 for IQ1's −1/0/1). It also checks that gguf-py's sign table is the one libsmoe computes
(gb_ksigns: 7 bits and an eighth that makes the count of minus signs even). Run with gguf installed:

    python scripts/gen_iq_grids.py

tests/test_ggml_formats.py checks every entry of every codebook against gguf-py's dequantisation
where gguf is installed.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import quants

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "csrc" / "cpu" / "ggml_iq_grids.h"

# C name, gguf-py class, bytes per entry
GRIDS = [
    ("gb_iq2xxs_grid", quants.IQ2_XXS, 8),
    ("gb_iq2xs_grid", quants.IQ2_XS, 8),
    ("gb_iq2s_grid", quants.IQ2_S, 8),
    ("gb_iq3xxs_grid", quants.IQ3_XXS, 4),
    ("gb_iq3s_grid", quants.IQ3_S, 4),
    ("gb_iq1s_grid", quants.IQ1_S, 8),
]


def check_signs() -> None:
    want = np.frombuffer(quants.IQ2_XXS.ksigns, np.uint8)
    got = np.array([i | (bin(i).count("1") & 1) << 7 for i in range(128)], np.uint8)
    assert np.array_equal(want, got), "gguf-py's ksigns are not 7 bits plus even parity"


def entries(cls, nbytes: int) -> list[int]:
    cls.init_grid()
    g = np.asarray(cls.grid, np.float32).reshape(cls.grid_shape)
    assert g.shape[1] == nbytes and np.array_equal(g, np.round(g)) and np.abs(g).max() < 128
    b = g.astype(np.int8).view(np.uint8).astype(np.uint64)
    return [int(sum(int(v) << (8 * j) for j, v in enumerate(row))) for row in b]


def main() -> None:
    check_signs()
    lines = [
        "/* ggml_iq_grids.h — the codebooks of the GGML IQ formats (declared in ggml_blocks.h), written",
        " * by scripts/gen_iq_grids.py from gguf-py's gguf.quants grids: entry i's byte j is value j of",
        " * grid entry i (int8: IQ1_S/IQ1_M's −1, 0, 1). Definitions, included once (kernels_ref.c), so",
        " * that every build of the kernels links them; csrc/cuda/ggml.cu includes it too, with GB_GRID",
        " * making device arrays of its own names. Generated: do not edit. */",
        "#ifndef GB_GRID",
        "#define GB_GRID(type, name) const type name",
        "#endif",
        "",
    ]
    for name, cls, nbytes in GRIDS:
        vals = entries(cls, nbytes)
        ctype, width = ("uint64_t", 16) if nbytes == 8 else ("uint32_t", 8)
        per = 4 if nbytes == 8 else 8
        lines.append(f"GB_GRID({ctype}, {name})[{len(vals)}] = {{")
        for i in range(0, len(vals), per):
            lines.append("    " + ", ".join(f"0x{v:0{width}x}" for v in vals[i:i + per]) + ",")
        lines.append("};")
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
