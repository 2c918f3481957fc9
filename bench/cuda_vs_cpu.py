"""How far the CUDA backend's logits are from the CPU's (activations="f32"), on synthetic vaults:
max |Δ| over max |logit| of a 37-token prefill, and whether 12 greedy ids agree.

    python bench/cuda_vs_cpu.py [--presets tiny,mini] [--layers 4] [--dir /tmp/cuda_vs_cpu]

The figure tests/test_cuda.py's tolerance is set from (bench/RESULTS.md, "Tensor cores")."""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, ".")
import pysmoe  # noqa: E402


def greedy(s, prompt, n):
    logits = s.prefill(prompt)
    first, ids = logits.copy(), [int(np.argmax(logits))]
    for _ in range(n - 1):
        ids.append(int(np.argmax(s.decode(ids[-1]))))
    return first, ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="tiny,mini")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/cuda_vs_cpu")
    a = ap.parse_args()
    rows = []
    for preset in a.presets.split(","):
        for experts in ("q4", "q8"):
            path = os.path.join(a.dir, f"{preset}-{experts}")
            if not os.path.exists(path):
                pysmoe.synth(path, preset=preset, seed=0, layers=a.layers, experts=experts, progress=False)
            with pysmoe.open_vault(path) as v:
                for seed in range(a.seeds):
                    prompt = np.random.default_rng(seed).integers(0, v.config["vocab_size"], 37).tolist()
                    with v.session(device="cuda", chunk=16, gpu_cache_bytes=1 << 30) as g:
                        gl, gids = greedy(g, prompt, 12)
                    with v.session(chunk=16, activations="f32") as c:
                        cl, cids = greedy(c, prompt, 12)
                    rel = float(np.max(np.abs(gl - cl)) / np.max(np.abs(cl)))
                    same = sum(x == y for x, y in zip(gids, cids))
                    rows.append({"vault": f"{preset}-{experts}", "seed": seed, "max_rel": rel, "greedy_same": same})
                    print(json.dumps(rows[-1]), flush=True)
    print("worst max |Δ| / max |logit|:", max(r["max_rel"] for r in rows))


if __name__ == "__main__":
    main()
