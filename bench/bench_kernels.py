"""Prefill and decode tokens/s of two (or more) builds of libsmoe, alternated in one run.

    make lib && make PORTABLE=1 BUILD=build-portable lib
    python -m pysmoe synth /tmp/mini --preset mini
    .venv/bin/python bench/bench_kernels.py /tmp/mini build/libsmoe.so build-portable/libsmoe.so

Each library runs in its own child process (SMOE_LIB selects the library the binding loads);
the children alternate, REPS rounds, so a noisy shared machine slows both alike; the figures are
medians over rounds and the ratio is taken per round. Every expert stays resident (a cache as
large as the vault, warmed by a first prefill), so this measures compute, not the disk. With
--cpu the rates are per CPU-second of the child (use it with --threads 1 when the machine is
shared: time spent descheduled then does not count).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
import numpy as np
import pysmoe
vault, prompt, decode, threads, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
cpu = sys.argv[6] == "1"
v = pysmoe.open_vault(vault)
ids = np.random.default_rng(0).integers(0, v.config["vocab_size"], prompt).tolist()
with v.session(cache_bytes=1 << 40, threads=threads, chunk=chunk, context=prompt + decode + 8) as s:
    s.prefill(ids)  # warms the retention cache: every expert the prompt needs is resident now
    s.reset()
    clock = time.process_time if cpu else time.perf_counter
    t = clock(); logits = s.prefill(ids); t_prefill = clock() - t
    tok = int(np.argmax(logits))
    t = clock()
    for _ in range(decode):
        tok = int(np.argmax(s.decode(tok)))
    t_decode = clock() - t
    st = s.stats()
print(json.dumps(dict(prefill_tps=prompt / t_prefill, decode_tps=decode / t_decode, misses=st["cache_misses"])))
"""


def run_child(lib: str, args) -> dict:
    env = dict(os.environ, SMOE_LIB=os.path.abspath(lib))
    cmd = [sys.executable, "-c", CHILD, args.vault, str(args.prompt), str(args.decode), str(args.threads),
           str(args.chunk), "1" if args.cpu else "0"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("vault")
    ap.add_argument("libs", nargs="+", help="libsmoe.so paths; the first is the baseline of the ratios")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--cpu", action="store_true",
                    help="tokens per CPU-second of the process instead of per wall second (meaningful with "
                         "--threads 1 on a shared machine)")
    args = ap.parse_args()

    rounds = []
    for r in range(args.reps):
        res = {lib: run_child(lib, args) for lib in (args.libs if r % 2 == 0 else args.libs[::-1])}
        rounds.append(res)
        print(f"round {r}: " + "  ".join(f"{os.path.basename(os.path.dirname(lib)) or lib}: "
                                        f"prefill {res[lib]['prefill_tps']:.1f} tok/s, decode {res[lib]['decode_tps']:.2f} tok/s"
                                        for lib in args.libs), flush=True)
    base = args.libs[0]
    print(f"\n{args.vault}: prompt {args.prompt}, decode {args.decode}, threads {args.threads}, chunk {args.chunk}, "
          f"{args.reps} rounds (medians){', per CPU-second' if args.cpu else ''}")
    for lib in args.libs:
        pre = statistics.median(rd[lib]["prefill_tps"] for rd in rounds)
        dec = statistics.median(rd[lib]["decode_tps"] for rd in rounds)
        rp = statistics.median(rd[lib]["prefill_tps"] / rd[base]["prefill_tps"] for rd in rounds)
        rd_ = statistics.median(rd[lib]["decode_tps"] / rd[base]["decode_tps"] for rd in rounds)
        print(f"  {lib:32s} prefill {pre:8.1f} tok/s (×{rp:.2f})   decode {dec:7.2f} tok/s (×{rd_:.2f})")


if __name__ == "__main__":
    main()
