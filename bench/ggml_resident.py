"""Resident prefill and decode of a vault with GGML experts against pysmoe's own q4 vault of the
same shape (every expert in the retention cache, warmed by a first pass: compute only).

    python -m pysmoe synth /tmp/mini_q4 --preset mini --experts q4 --layers 6
    python -m pysmoe synth /tmp/mini_Q4_K --preset mini --experts Q4_K --layers 6
    python bench/ggml_resident.py /tmp/mini_q4 /tmp/mini_Q4_K [--threads 2] [--prompt 256] [--decode 32]

Prints, per vault, the median of --repeats runs: prefill tokens/s (layer-major, one chunk) and
decode tokens/s, with 8-bit activations (the default) and with f32 activations.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import pysmoe


def measure(path: str, threads: int, prompt: int, decode: int, repeats: int, activations: str):
    v = pysmoe.open_vault(path)
    ids = [int(i) for i in np.random.default_rng(0).integers(0, v.config["vocab_size"], prompt)]
    pre, dec = [], []
    with v.session(cache_bytes=v.expert_bytes * 2, threads=threads, chunk=prompt, context=prompt + decode + 8,
                   activations=activations) as s:
        for r in range(repeats + 1):  # the first run fills the cache
            t0 = time.perf_counter()
            logits = s.prefill(ids)
            t1 = time.perf_counter()
            tok = int(np.argmax(logits))
            for _ in range(decode):
                tok = int(np.argmax(s.decode(tok)))
            t2 = time.perf_counter()
            if r:
                pre.append(prompt / (t1 - t0))
                dec.append(decode / (t2 - t1))
            s.reset()
    return statistics.median(pre), statistics.median(dec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("vaults", nargs="+")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    from pysmoe._ffi import ffi, lib
    print(f"kernels {ffi.string(lib.smoe_kernels()).decode()}; threads {a.threads}")
    for act in ("q8", "f32"):
        for path in a.vaults:
            p, d = measure(path, a.threads, a.prompt, a.decode, a.repeats, act)
            print(f"{act:4s} {path:40s} prefill {p:8.1f} tok/s   decode {d:6.2f} tok/s")


if __name__ == "__main__":
    main()
