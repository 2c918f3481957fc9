"""Resident prefill and decode of a vault with GGML experts against pysmoe's own q4 vault of the
same shape (every expert in the retention cache, warmed by a first pass: compute only).

    python -m pysmoe synth /tmp/mini_q4 --preset mini --experts q4 --layers 6
    python -m pysmoe synth /tmp/mini_Q4_K --preset mini --experts Q4_K --layers 6
    python bench/ggml_resident.py /tmp/mini_q4 /tmp/mini_Q4_K [--threads 2] [--prompt 256] [--decode 32]

Prints, per vault, the median of --repeats alternated rounds (each vault once per round):
prefill tokens/s (layer-major, one chunk) and decode tokens/s, by wall time and by the process's
CPU time, and the median per-round ratio to the first vault, with 8-bit activations (the default)
and with f32 activations. On a shared machine, quote the ratios (the CPU-time ones with --threads 1).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import pysmoe


def run_once(s, ids, decode: int):
    """One prefill of ids and `decode` greedy tokens: (prefill wall s, prefill CPU s, decode wall s,
    decode CPU s); CPU: the process's (every thread's) CPU time, which a loaded machine moves less."""
    w0, c0 = time.perf_counter(), time.process_time()
    logits = s.prefill(ids)
    w1, c1 = time.perf_counter(), time.process_time()
    tok = int(np.argmax(logits))
    for _ in range(decode):
        tok = int(np.argmax(s.decode(tok)))
    w2, c2 = time.perf_counter(), time.process_time()
    s.reset()
    return w1 - w0, c1 - c0, w2 - w1, c2 - c1


def measure(paths, threads: int, prompt: int, decode: int, repeats: int, activations: str):
    """The vaults' sessions open together and run in turn, round after round (alternated: a change
    in the machine's load falls on all of them); per vault the medians of tokens/s by wall time and
    by CPU time, and per round the ratio to the first vault (its median)."""
    vaults = [pysmoe.open_vault(p) for p in paths]
    ids = [int(i) for i in np.random.default_rng(0).integers(0, vaults[0].config["vocab_size"], prompt)]
    sessions = [v.session(cache_bytes=v.expert_bytes * 2, threads=threads, chunk=prompt, context=prompt + decode + 8,
                          activations=activations) for v in vaults]
    try:
        for s in sessions:  # the first run fills the cache
            run_once(s, ids, decode)
        rows = [[] for _ in paths]
        for _ in range(repeats):
            for i, s in enumerate(sessions):
                rows[i].append(run_once(s, ids, decode))
    finally:
        for s in sessions:
            s.close()
    out = []
    for i in range(len(paths)):
        r = rows[i]
        med = lambda j, n: statistics.median(n / x[j] for x in r)  # noqa: E731
        ratio = lambda j, n: statistics.median((n / a[j]) / (n / b[j]) for a, b in zip(r, rows[0]))  # noqa: E731
        out.append({"prefill": med(0, prompt), "prefill_cpu": med(1, prompt), "decode": med(2, decode),
                    "decode_cpu": med(3, decode), "prefill_ratio": ratio(0, prompt), "prefill_cpu_ratio": ratio(1, prompt),
                    "decode_ratio": ratio(2, decode), "decode_cpu_ratio": ratio(3, decode)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("vaults", nargs="+")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--activations", default="q8,f32", help="comma-separated: q8, f32")
    a = ap.parse_args()
    from pysmoe._ffi import ffi, lib
    print(f"kernels {ffi.string(lib.smoe_kernels()).decode()}; threads {a.threads}; load {os.getloadavg()[0]:.1f}")
    for act in a.activations.split(","):
        for path, m in zip(a.vaults, measure(a.vaults, a.threads, a.prompt, a.decode, a.repeats, act)):
            print(f"{act:4s} {path:32s} prefill {m['prefill']:7.1f} tok/s (CPU {m['prefill_cpu']:7.1f}; x{m['prefill_ratio']:.2f}"
                  f" / CPU x{m['prefill_cpu_ratio']:.2f})   decode {m['decode']:6.2f} tok/s (CPU {m['decode_cpu']:6.2f};"
                  f" x{m['decode_ratio']:.2f} / CPU x{m['decode_cpu_ratio']:.2f})")
    print(f"load {os.getloadavg()[0]:.1f}; x: the per-round ratio to the first vault (median)")


if __name__ == "__main__":
    main()
