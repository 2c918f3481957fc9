#!/usr/bin/env python3
"""One run of the engine's CPU figures, for an A/B of two libraries alternated run by run.

    PYTHONPATH=CHECKOUT python bench/engine_ab.py VAULT [--prompt 45] [--resident 256] [--decode 32]
                                                  [--cache-frac 0.1] [--threads 2]

Prints one JSON line: cold TTFT of a --prompt-token prompt (empty caches, page cache bypassed with
Direct I/O, a cache of --cache-frac of the experts), resident prefill tokens/s of --resident tokens
and resident decode tokens/s over --decode greedy steps (a cache holding every expert, warmed by
the same prompt), plus the library it loaded. It uses only the API both sides of an A/B share
(Session.prefill, decode, reset, clear_cache), so an older checkout runs it too; alternate the two
(A B A B ...) in one shell and compare medians (bench/RESULTS.md, "One engine").
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

import pysmoe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("vault")
    ap.add_argument("--prompt", type=int, default=45)
    ap.add_argument("--resident", type=int, default=256)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--cache-frac", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    v = pysmoe.open_vault(a.vault)
    V = v.config["vocab_size"]
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, V, a.prompt).tolist()
    long = rng.integers(0, V, a.resident).tolist()
    out = {"library": str(pysmoe._ffi.LIB_PATH)}
    with v.session(cache_bytes=int(v.expert_bytes * a.cache_frac), threads=a.threads) as s:
        s.clear_cache()
        t0 = time.perf_counter()
        s.prefill(prompt)
        out["cold_ttft_s"] = time.perf_counter() - t0
    with v.session(cache_bytes=v.expert_bytes + v.blob_bytes, threads=a.threads, chunk=256) as s:
        s.prefill(long)
        s.reset()
        t0 = time.perf_counter()
        logits = s.prefill(long)
        out["resident_prefill_tps"] = a.resident / (time.perf_counter() - t0)
        t = int(np.argmax(logits))
        t0 = time.perf_counter()
        for _ in range(a.decode):
            t = int(np.argmax(s.decode(t)))
        out["decode_tps"] = a.decode / (time.perf_counter() - t0)
        out["last_id"] = t
    print(json.dumps(out))


if __name__ == "__main__":
    main()
