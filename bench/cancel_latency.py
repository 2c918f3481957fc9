#!/usr/bin/env python3
"""How long Session.cancel() takes to stop a long prefill (issue 11: within a layer, not a chunk).

    python bench/cancel_latency.py VAULT [--tokens 1024] [--chunk 1024] [--after 2,4,6] [--cache-frac 0.1]

For each delay in --after: a fresh cold session starts prefilling --tokens random ids in chunks of
--chunk on a worker thread; the main thread calls cancel() after that many seconds and times how
long the prefill takes to raise Cancelled. Prints each latency and the layer time it compares to
(an uncancelled run's prefill time / layers / chunks)."""
from __future__ import annotations

import argparse
import pathlib
import sys
import threading
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import pysmoe  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("vault")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--after", default="2,4,6")
    ap.add_argument("--cache-frac", type=float, default=0.1)
    args = ap.parse_args()
    v = pysmoe.open_vault(args.vault)
    ids = np.random.default_rng(0).integers(0, v.config["vocab_size"], args.tokens)
    cache = int(v.expert_bytes * args.cache_frac)
    with v.session(cache_bytes=cache, chunk=args.chunk, context=args.tokens + 8) as s:
        t0 = time.perf_counter()
        s.prefill(ids)
        full = time.perf_counter() - t0
    layer = full / v.config["num_hidden_layers"] / -(-args.tokens // args.chunk)
    print(f"uncancelled prefill of {args.tokens} tokens (chunk {args.chunk}): {full:.2f} s; "
          f"one layer of one chunk: {layer:.3f} s")
    for after in (float(a) for a in args.after.split(",")):
        with v.session(cache_bytes=cache, chunk=args.chunk, context=args.tokens + 8) as s:
            out = {}

            def work():
                try:
                    s.prefill(ids)
                    out["done"] = time.perf_counter()
                except pysmoe.Cancelled:
                    out["cancelled"] = time.perf_counter()

            t = threading.Thread(target=work)
            t.start()
            time.sleep(after)
            tc = time.perf_counter()
            s.cancel()
            t.join()
            if "cancelled" in out:
                print(f"cancel after {after:.1f} s: stopped {1000 * (out['cancelled'] - tc):.0f} ms later, "
                      f"position {s.position}")
            else:
                print(f"cancel after {after:.1f} s: the prefill had finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
