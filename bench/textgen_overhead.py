"""What stream_generate (run and chat's path: the engine's sampler, as Session.generate's, plus
pysmoe.textgen's detokenizer and stop-string matcher) costs per token over Session.generate.

    python bench/textgen_overhead.py VAULT [VAULT ...] [--tokens 32] [--reps 5]

Per vault, the four contenders run alternated, reps times, each on a warm cache from the same
prompt; the figure is decode tokens/s from the first generated token to the last (prefill
excluded), median over the reps. The ids of the two paths are checked equal, greedy and seeded
(one sampler draws both).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import pysmoe
from pysmoe.generate import stream_generate

CONTENDERS = {
    "C greedy (Session.generate)": ("c", dict()),
    "textgen greedy (stream_generate)": ("py", dict()),
    "C T=0.7 top-p 0.9": ("c", dict(temperature=0.7, top_p=0.9, seed=1)),
    "textgen T=0.7 top-p 0.9": ("py", dict(temperature=0.7, top_p=0.9, seed=1)),
}


def run(s, kind, kw, ids, n):
    s.reset()
    stamps, out = [], []
    it = s.generate(ids, max_tokens=n, stop=(), **kw) if kind == "c" else stream_generate(s, ids, n, stop=(), **kw)
    for r in it:
        stamps.append(time.perf_counter())
        out.append(r if kind == "c" else r.token)
    return (len(out) - 1) / (stamps[-1] - stamps[0]), out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("vaults", nargs="+")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    for path in a.vaults:
        with pysmoe.open_vault(path) as v, v.session(cache_bytes=4 << 30) as s:
            ids = v.tokenizer.encode("The history of the printing press begins")
            run(s, "c", {}, ids, 4)  # warm the cache
            tps = {k: [] for k in CONTENDERS}
            drawn = {}
            for _ in range(a.reps):
                for name, (kind, kw) in CONTENDERS.items():
                    t, out = run(s, kind, kw, ids, a.tokens)
                    tps[name].append(t)
                    drawn.setdefault(repr(kw), {})[kind] = out
            assert all(d["c"] == d["py"] for d in drawn.values()), "the two paths drew different ids"
            print(f"\n{path} (vocab {v.config['vocab_size']}, {v.config['num_hidden_layers']} layers): "
                  f"decode tok/s, median of {a.reps} (min-max); ids equal")
            for name, xs in tps.items():
                print(f"  {name:36s} {statistics.median(xs):8.1f}  ({min(xs):.1f}-{max(xs):.1f})")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
