#!/usr/bin/env python3
"""Rewrite a GGUF file's stacked expert tensors (blk.N.ffn_{gate,up,down}_exps) as random blocks
of another GGML type, everything else copied: a speed benchmark's model of that type for both
engines (bench/peer.py --gguf OUT runs llama.cpp on the file and pysmoe on its import), without
quantising billions of weights (llama.cpp's IQ1/IQ2 quantisers take an importance matrix and
minutes per layer). The blocks are pysmoe.ggml_blocks.random_blocks': random codes, scales set so
the weights have the std of the tensor they replace (its dequantised values, measured on a sample
of rows), so the model's activations stay in a sane range; the weights mean nothing.

    .venv/bin/python bench/retype_gguf.py IN.gguf OUT.gguf --type IQ2_XXS [--seed 0]
"""
from __future__ import annotations

import argparse
import pathlib
import re
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

EXPERTS = re.compile(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight$")


def main(argv=None) -> int:
    import gguf

    from pysmoe import ggml_blocks

    sys.path.insert(0, str(ROOT / "scripts"))
    from export_gguf import copy_fields

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--type", required=True, choices=sorted(t for t in ggml_blocks.FORMATS if t != "F16"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    qt = gguf.GGMLQuantizationType[args.type]
    _, bs, ts = ggml_blocks.FORMATS[args.type]
    rng = np.random.default_rng(args.seed)
    r = gguf.GGUFReader(args.src)
    for t in r.tensors:  # before anything is written
        if EXPERTS.search(t.name) and int(t.shape[0]) % bs:
            raise SystemExit(f"{t.name}: {int(t.shape[0])} columns, not a whole number of {args.type} blocks ({bs})")
    w = gguf.GGUFWriter(args.out, r.fields["general.architecture"].contents())
    copy_fields(r, w)
    n = 0
    for t in r.tensors:
        if not EXPERTS.search(t.name):
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            continue
        cols = int(t.shape[0])
        rows = int(np.prod([int(s) for s in t.shape[1:]]))
        sample = gguf.quants.dequantize(np.asarray(t.data).reshape(rows, -1)[:64], t.tensor_type)
        std = float(np.std(sample)) or 0.02
        data = ggml_blocks.random_blocks(args.type, rows, cols, std, rng).reshape(*np.asarray(t.data).shape[:-1], -1)
        w.add_tensor(t.name, data, raw_dtype=qt)
        n += 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    print(f"{args.out}: {n} expert tensors as random {args.type} blocks, {pathlib.Path(args.out).stat().st_size / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
