"""Held-out perplexity of the trained demo model through every numeric path (issue 14).

    .venv/bin/python bench/perplexity.py --hf build/demo-hf --json bench/results/perplexity.json

--hf is the float32 checkpoint scripts/train_demo.py wrote (the trained weights before any
quantisation). Without it the f32 model is regenerated from the shipped demo vault
(pysmoe.perplexity.hf_from_vault): then the expert-format rows measure re-quantising weights that
are already on the q4 grid, which understates what q8/q4 cost; the table says which it used.

Every row scores the same windows of the held-out text (pysmoe/data/demo/heldout.txt), so rows
differ only by their numerics:

- transformers f32: Qwen3MoeForCausalLM, float32, eager attention and experts (the reference);
- numpy reference: pysmoe/reference.py over the f32 vault;
- pysmoe, each expert format (f32, bf16, q8, q4; dense f32), activations="f32" and the default
  8-bit activations; and the default conversion (q4 experts, q8 dense matrices: the shipped demo);
- mlx-lm on its own 4-bit conversion (mlx_lm.convert --quantize, groups of 64: every matrix q4,
  the router q8), and pysmoe on that conversion imported (`pysmoe convert`, codes copied);
- llama.cpp (llama-cpp-python) on scripts/export_gguf.py's output: of the f32 vault (F32) and
  of the default vault (experts requantised to Q4_0, dense Q8_0).

Rows whose package is missing are left out and named.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pysmoe.convert import convert_checkpoint  # noqa: E402
from pysmoe.demo import ensure_demo_vault  # noqa: E402
from pysmoe.perplexity import (engine_nll, heldout_windows, hf_from_vault, hf_nll,  # noqa: E402
                               llama_cpp_nll, mlx_nll, reference_nll)


def released_spelling(hf: Path, out: Path) -> Path:
    """A copy of the checkpoint with config.json as released Qwen checkpoints spell it (mlx-lm
    reads num_experts and a top-level rope_theta; transformers 5 writes num_local_experts and
    rope_parameters)."""
    shutil.copytree(hf, out)
    cfg = json.loads((out / "config.json").read_text())
    if "num_local_experts" in cfg:
        cfg["num_experts"] = cfg.pop("num_local_experts")
    if "rope_parameters" in cfg:
        cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", help="the trained float32 checkpoint (default: regenerated from the demo vault)")
    ap.add_argument("--windows", type=int, default=None, help="windows scored (default: all the held-out text)")
    ap.add_argument("--length", type=int, default=256, help="tokens per window (default 256)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)

    demo = ensure_demo_vault()
    windows = heldout_windows(demo, args.windows, args.length)
    tmp = Path(tempfile.mkdtemp(prefix="smoe-ppl-"))
    rows, skipped = [], []

    def row(name, fn, **extra):
        t0 = time.perf_counter()
        nll = fn()
        r = {"path": name, "nll": nll, "ppl": math.exp(nll), "seconds": round(time.perf_counter() - t0, 1), **extra}
        rows.append(r)
        print(f"{name:58s} ppl {r['ppl']:.4f}  ({r['seconds']} s)", flush=True)

    try:
        if args.hf:
            hf, source = Path(args.hf), "trained f32 checkpoint"
        else:
            hf, source = hf_from_vault(demo, tmp / "hf"), "regenerated from the demo vault"
        print(f"{windows.shape[0]} windows x {windows.shape[1]} tokens; f32 model: {source}", flush=True)
        vaults = {}
        for fmt in ("f32", "bf16", "q8", "q4"):
            vaults[fmt] = convert_checkpoint(hf, tmp / f"v-{fmt}", experts=fmt, dense="f32", progress=False)
        vaults["default"] = convert_checkpoint(hf, tmp / "v-default", progress=False)

        row("transformers f32", lambda: hf_nll(hf, windows))
        row("numpy reference, f32 vault", lambda: reference_nll(vaults["f32"], windows))
        for fmt in ("f32", "bf16", "q8", "q4", "default"):
            label = f"experts {fmt}, dense f32" if fmt != "default" else "default conversion (experts q4, dense q8)"
            for act in ("f32", "q8"):
                row(f"pysmoe {label}, activations {act}",
                    lambda: engine_nll(vaults[fmt], windows, activations=act, threads=args.threads))

        try:
            import mlx_lm
        except ImportError:
            skipped.append("mlx-lm (not installed)")
        else:
            mlx_dir = tmp / "mlx"
            mlx_lm.convert(str(released_spelling(hf, tmp / "hf-released")), str(mlx_dir), quantize=True,
                           q_bits=4, q_group_size=64, dtype="float32")
            for f in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copyfile(hf / f, mlx_dir / f)
            row("mlx-lm, its 4-bit conversion (f32 compute)", lambda: mlx_nll(mlx_dir, windows))
            mv = convert_checkpoint(mlx_dir, tmp / "v-mlx", progress=False)
            for act in ("f32", "q8"):
                row(f"pysmoe on that MLX conversion, activations {act}",
                    lambda: engine_nll(mv, windows, activations=act, threads=args.threads))

        try:
            import llama_cpp  # noqa: F401
            import gguf  # noqa: F401
        except ImportError:
            skipped.append("llama.cpp (llama-cpp-python or gguf not installed)")
        else:
            for vault, experts, dense, label in ((vaults["f32"], "f32", "f32", "f32 vault as F32"),
                                                 (vaults["default"], "q4_0", "q8_0",
                                                  "default vault, experts Q4_0, dense Q8_0")):
                gg = tmp / f"{label.split()[0]}-{experts}.gguf"
                subprocess.run([sys.executable, str(ROOT / "scripts" / "export_gguf.py"), str(vault), str(gg),
                                "--experts", experts, "--dense", dense, "--quiet"], check=True)
                row(f"llama.cpp, export_gguf of the {label}", lambda: llama_cpp_nll(gg, windows))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    base = rows[0]["ppl"]
    print(f"\n| path | perplexity | vs transformers f32 |\n|---|---:|---:|")
    for r in rows:
        print(f"| {r['path']} | {r['ppl']:.4f} | {100 * (r['ppl'] / base - 1):+.3f} % |")
    for s in skipped:
        print(f"skipped: {s}")
    if args.json:
        meta = {"windows": int(windows.shape[0]), "length": int(windows.shape[1]), "f32_model": source,
                "cpu": platform.processor() or platform.machine(), "load_average": os.getloadavg(),
                "skipped": skipped}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
