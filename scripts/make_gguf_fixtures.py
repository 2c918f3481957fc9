#!/usr/bin/env python3
"""Remake tests/data/gguf/: small GGUF files written by llama.cpp's own tools, for the GGUF import
tests (tests/test_gguf_import.py), so that CI needs no llama.cpp build.

    python scripts/make_gguf_fixtures.py --llama-cpp DIR [--out tests/data/gguf]

DIR is llama.cpp's source tree (convert_hf_to_gguf.py and gguf-py/ in it): the one inside
llama-cpp-python's source package will do (`pip download --no-deps --no-binary :all:
llama-cpp-python`, then unpack; it is vendor/llama.cpp). Quantising needs llama-cpp-python
installed (its `llama_model_quantize`, the same code as the `llama-quantize` tool).

Each fixture is a tiny random Qwen3MoeForCausalLM (tests/hf_models.py, transformers) saved by
`save_pretrained`, turned into an F32 GGUF by convert_hf_to_gguf.py, then quantised by llama.cpp:

    tiny-f32.gguf        hidden 64: every tensor F32 (the oracle test's exact case)
    tiny-q8_0.gguf       hidden 64: Q8_0 matrices, F32 norms and router
    tiny-q4_0.gguf       hidden 64: Q4_0 (llama.cpp keeps a few tensors in other types)
    k256-q4_k_m.gguf     hidden 256: Q4_K_M, llama.cpp's mix (Q4_K, Q6_K, and where a row of 128
                         is too short for a 256-block, its fallbacks Q5_0/Q8_0, per layer)
    k256-iq4_xs.gguf     hidden 256: IQ4_XS (IQ4_NL where rows are 128)
    k256-q5_k_m.gguf     hidden 256: Q5_K_M (Q5_K, Q6_K and fallbacks)

The synthetic tokenizer (pysmoe.tokenizer) is not one convert_hf_to_gguf.py recognises by its
hash, so the conversion is told its pre-tokenizer (`--pre`, default qwen2, the family's): the
GGUF's tokenizer is then whatever llama.cpp makes of those tokens, merges and pre name, which is
what the import must reproduce. The weights depend only on the seeds; the files depend also on
the llama.cpp version (recorded in each file's general.* metadata by the tools).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

SMALL = dict(hidden_size=64, moe_intermediate_size=64, intermediate_size=96, num_experts=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16)
K256 = dict(hidden_size=256, moe_intermediate_size=128, intermediate_size=256, num_experts=4,
            num_attention_heads=2, num_key_value_heads=1, head_dim=64)

FIXTURES = {  # name -> (shape, llama_ftype name or None for the F32 file itself)
    "tiny-f32": (SMALL, None),
    "tiny-q8_0": (SMALL, "Q8_0"),
    "tiny-q4_0": (SMALL, "Q4_0"),
    "k256-q4_k_m": (K256, "Q4_K_M"),
    "k256-iq4_xs": (K256, "IQ4_XS"),
    "k256-q5_k_m": (K256, "Q5_K_M"),
}

_CONVERT = """
import sys
sys.path.insert(0, {dir!r})
import convert_hf_to_gguf as c
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
sys.argv = ["convert_hf_to_gguf.py", {src!r}, "--outtype", "f32", "--outfile", {out!r}]
c.main()
"""


def hf_checkpoint(work: Path, shape: dict, seed: int) -> Path:
    from hf_models import make_hf_model

    path, _ = make_hf_model(work, seed=seed, **shape)
    return path


def convert_f32(llama_cpp: Path, src: Path, out: Path, pre: str) -> None:
    """convert_hf_to_gguf.py, in a child process with llama.cpp's own gguf-py first on its path."""
    env = dict(os.environ, PYTHONPATH=str(llama_cpp / "gguf-py"))
    code = _CONVERT.format(dir=str(llama_cpp), pre=pre, src=str(src), out=str(out))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=llama_cpp)


def quantize(src: Path, out: Path, ftype: str) -> None:
    """llama.cpp's quantiser (llama_model_quantize) from F32 to ftype, as llama-quantize does."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 1
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize {ftype} failed ({rc})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "gguf")
    ap.add_argument("--pre", default="qwen2", help="tokenizer.ggml.pre to write (default qwen2)")
    ap.add_argument("--only", nargs="*", help="fixture names to make (default all)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        f32 = {}
        for name, (shape, ftype) in FIXTURES.items():
            if args.only and name not in args.only:
                continue
            key = tuple(sorted(shape.items()))
            if key not in f32:
                work = tmp / f"m{len(f32)}"
                src = hf_checkpoint(work, shape, seed=len(f32))
                f32[key] = work / "f32.gguf"
                convert_f32(args.llama_cpp.resolve(), src, f32[key], args.pre)
            out = args.out / f"{name}.gguf"
            if ftype is None:
                out.write_bytes(f32[key].read_bytes())
            else:
                quantize(f32[key], out, ftype)
            print(f"{out}: {out.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
