#!/usr/bin/env python3
"""Greedy continuations of the demo quantised by llama.cpp, through llama.cpp and through pysmoe's
import of the very same file (issue 27 item 3: "their greedy continuations the same").

    python bench/gguf_greedy.py --ftypes Q4_K_M Q8_0 --prompts 20 --threads 2

The demo vault is written as an F32 GGUF (scripts/export_gguf.py), quantised by llama.cpp's own
quantiser, and imported by `pysmoe convert`. For each of --prompts windows of the held-out text
(the first --prompt-len ids of each), --tokens greedy ids are taken from llama.cpp (argmax of its
logits) and from pysmoe with f32 and with 8-bit activations; the table gives how many
continuations agree in full, and the mean number of ids equal before the first difference.

ggml quantises the activations of a product to the weight type's vec_dot_type (Q8_0 blocks of 32
with an f16 scale for Q8_0/Q4_0/Q5_0/IQ4_NL/MXFP4 weights; Q8_K blocks of 256 with an f32 scale
from the signed maximum for the K-quants and IQ4_XS), and so does pysmoe's default 8-bit mode for
the GGML types (csrc/cpu/kernels_ref.c, ref_ggml_prepare): the two differ only in the order of
float sums. With f32 activations pysmoe does not round them at all, so those continuations differ
from llama.cpp's wherever the rounding decides a near-tie. llama.cpp runs with its KV cache in f32
(--llama-kv f32, the default here, as pysmoe's); with its own default f16 cache it also rounds K,
V and the queries to f16.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from perplexity import (engine_greedy, heldout_windows, llama_cpp_greedy,  # noqa: E402
                        quantize_gguf)

from pysmoe.convert import convert_checkpoint  # noqa: E402
from pysmoe.demo import ensure_demo_vault  # noqa: E402


def first_difference(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ftypes", nargs="+", default=["Q4_K_M", "Q8_0"])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-kv", choices=("f32", "f16"), default="f32",
                    help="llama.cpp's KV cache: f32 (default, as pysmoe's) or f16 (llama.cpp's own default)")
    ap.add_argument("--json", type=Path, help="write the rows here too")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="smoe-gguf-greedy-"))
    f32 = tmp / "demo-F32.gguf"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "export_gguf.py"), str(ensure_demo_vault()), str(f32),
                    "--experts", "f32", "--dense", "f32", "--quiet"], check=True)
    rows = []
    for ftype in args.ftypes:
        gg = f32 if ftype == "F32" else quantize_gguf(f32, tmp / f"demo-{ftype}.gguf", ftype)
        vault = convert_checkpoint(gg, tmp / f"v-{ftype}", progress=False)
        windows = heldout_windows(vault, args.prompts, args.prompt_len + args.tokens)
        same = {"f32": [], "q8": [], "q8 vs f32": []}
        for w in windows[:args.prompts]:
            prompt = [int(t) for t in w[:args.prompt_len]]
            ref = llama_cpp_greedy(gg, prompt, args.tokens, args.threads, args.llama_kv)
            mine = {act: engine_greedy(vault, prompt, args.tokens, act) for act in ("f32", "q8")}
            same["f32"].append(first_difference(ref, mine["f32"]))
            same["q8"].append(first_difference(ref, mine["q8"]))
            same["q8 vs f32"].append(first_difference(mine["f32"], mine["q8"]))
        row = {"file": ftype, "prompts": len(same["f32"]), "tokens": args.tokens, "llama_kv": args.llama_kv,
               "first_difference": same}
        for k, v in same.items():
            row[f"{k}: all equal"] = sum(x == args.tokens for x in v)
            row[f"{k}: mean equal prefix"] = sum(v) / len(v)
        rows.append(row)
        print(f"{ftype:7s} " + "  ".join(f"{k}: {row[f'{k}: all equal']}/{row['prompts']} equal, mean prefix "
                                          f"{row[f'{k}: mean equal prefix']:.1f}" for k in same), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"machine": platform.processor(), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
