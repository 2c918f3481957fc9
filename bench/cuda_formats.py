#!/usr/bin/env python3
"""Resident prefill and decode on the GPU for the formats and families ggml.cu and deltanet.cu run:
one synth vault per case, every expert in VRAM, against the same shape's q4 vault where one exists.

    python bench/cuda_formats.py OUTDIR [--layers 4] [--prompt 256] [--steps 64] [--repeats 3]
                                 [--cases a3b:q4,a3b:Q4_K,...] [--json OUT.json]

A case is PRESET:EXPERTS (pysmoe synth's preset and expert format; the dense tensors as synth makes
them). Per case: a session on device="cuda" with a VRAM cache for every expert, warmed by one
prefill; then --repeats times: a prefill of --prompt random ids (layer-major, from position 0) and
--steps greedy decode steps after it. Reported: the medians of prefill tok/s and decode tok/s."""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, ".")
import pysmoe  # noqa: E402


def bench(vault, prompt, steps, repeats, device):
    with pysmoe.open_vault(vault) as v:
        ids = np.random.default_rng(0).integers(0, v.config["vocab_size"], prompt).tolist()
        kw = dict(gpu_cache_bytes=1 << 40) if device == "cuda" else {}
        with v.session(device=device, context=prompt + steps + 8, **kw) as s:
            s.set_sampler()  # greedy
            s.prefill(ids)
            pre, dec = [], []
            for _ in range(repeats):
                s.reset()
                t0 = time.perf_counter()
                _, tok = s.prefill_next(ids, want_logits=False)
                t1 = time.perf_counter()
                for _ in range(steps):
                    _, tok = s.decode_next(tok, want_logits=False)
                t2 = time.perf_counter()
                pre.append(prompt / (t1 - t0))
                dec.append(steps / (t2 - t1))
            return statistics.median(pre), statistics.median(dec), s.backend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", type=pathlib.Path)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cases", default="a3b:q4,a3b:Q4_K,a3b:Q8_0,gpt-oss-20b:MXFP4,qwen3.6-35b-a3b:q4")
    ap.add_argument("--json", type=pathlib.Path)
    a = ap.parse_args()
    rows = []
    for case in a.cases.split(","):
        preset, experts = case.split(":")
        path = a.outdir / f"{preset}-{experts}-{a.layers}"
        if not (path / "vault.bin").exists():
            pysmoe.synth(path, preset=preset, layers=a.layers, experts=experts, progress=False)
        p, d, line = bench(path, a.prompt, a.steps, a.repeats, a.device)
        rows.append(dict(case=case, layers=a.layers, prefill_tok_s=round(p, 1), decode_tok_s=round(d, 1)))
        print(f"{case:28s} {a.layers} layers: prefill {p:9.1f} tok/s ({a.prompt} tokens), decode {d:7.1f} tok/s  [{line}]",
              flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
