"""Decode tokens/s under a cache budget, retention policy against policy, on a recorded trace.

    PYTHONPATH=. python bench/retention_bench.py VAULT TRACE.npz [--budgets 5,10,25] [--policies lru,lrfu]
        [--prompt 64] [--decode 32] [--repeats 2] [--json OUT]

Each run is a fresh session (Direct I/O, the cache the budget gives: bench.budget_slots) made
with SMOE_RETENTION set to the policy; it prefills the trace's first `prompt` ids layer-major,
then decodes the next `decode` ids of the trace one by one (teacher-forced, so every run
routes exactly as the trace did and the simulator's replay is the same sequence), timed. Within
a repeat, every (budget, policy) pair runs once, policies alternating inside each budget and the
order rotating per repeat. Medians over repeats. The logits of every run are compared with the
first run's at the same step: the policy must not change a bit. PYTHONPATH=. so that this
checkout's pysmoe (and libsmoe) is the one imported, not the venv's install.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


def run_one(v, pct, policy, ids, prompt, decode, threads):
    from pysmoe.bench import budget_slots
    os.environ["SMOE_RETENTION"] = policy  # read when the session's streamer is made
    cache = budget_slots(v, pct) * v.blob_bytes
    with v.session(cache_bytes=cache, threads=threads, context=prompt + decode + 1, direct_io=True) as s:
        t0 = time.perf_counter()
        s.prefill(ids[:prompt])
        prefill_s = time.perf_counter() - t0
        s.reset_stats()
        sums = []
        t0 = time.perf_counter()
        for t in range(prompt, prompt + decode):
            sums.append(float(np.asarray(s.decode(int(ids[t])), dtype=np.float64).sum()))
        dt = time.perf_counter() - t0
        st = s.stats()
    uses = st["cache_hits"] + st["cache_misses"]
    return {"budget_pct": pct, "policy": policy, "tps": decode / dt, "seconds": dt, "prefill_s": prefill_s,
            "hits": st["cache_hits"], "misses": st["cache_misses"], "hit_rate": st["cache_hits"] / uses,
            "reads_per_token": st["blob_reads"] / decode, "io_wait_s": st["io_wait_s"],
            "cache_slots": st["cache_slots"], "logit_sums": sums, "load": os.getloadavg()[0]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("vault")
    ap.add_argument("trace")
    ap.add_argument("--budgets", default="5,10,25")
    ap.add_argument("--policies", default="lru,lrfu")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import pysmoe
    ids = np.load(a.trace)["ids"]
    budgets = [float(x) for x in a.budgets.split(",")]
    policies = a.policies.split(",")
    v = pysmoe.open_vault(a.vault)
    runs = []
    ref = None
    for r in range(a.repeats):
        for b in budgets:
            pols = policies[r % len(policies):] + policies[:r % len(policies)]
            for pol in pols:
                x = run_one(v, b, pol, ids, a.prompt, a.decode, a.threads)
                if ref is None:
                    ref = x["logit_sums"]
                x["identical"] = x["logit_sums"] == ref
                runs.append(x)
                print(f"rep {r + 1} budget {b:g}% {pol:5s} {x['tps']:.2f} tok/s  hit {x['hit_rate']:.3f}  "
                      f"reads/tok {x['reads_per_token']:.1f}  io_wait {x['io_wait_s']:.2f} s  "
                      f"load {x['load']:.1f}  same logits {x['identical']}", flush=True)
    print(f"\n{'budget':>7} {'policy':6} {'tok/s':>6} {'(runs)':>14} {'hit rate':>8} {'reads/tok':>9}")
    for b in budgets:
        for pol in policies:
            xs = [x for x in runs if x["budget_pct"] == b and x["policy"] == pol]
            print(f"{b:6g}% {pol:6} {statistics.median(x['tps'] for x in xs):6.2f} "
                  f"{'/'.join('%.2f' % x['tps'] for x in xs):>14} {statistics.median(x['hit_rate'] for x in xs):8.3f} "
                  f"{statistics.median(x['reads_per_token'] for x in xs):9.1f}")
    print("logits identical across policies and budgets:", all(x["identical"] for x in runs))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"vault": a.vault, "trace": a.trace, "prompt": a.prompt, "decode": a.decode,
                       "threads": a.threads, "runs": runs}, f, indent=1)
    v.close()


if __name__ == "__main__":
    sys.exit(main())
