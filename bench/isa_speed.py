"""Prefill and decode tokens/s with every expert resident, the AVX2 kernels against the AVX-512
ones (issue 17, item 4), on one vault and thread count, alternated run by run.

    python -m pysmoe synth /tmp/mini --preset mini --seed 0
    python bench/isa_speed.py /tmp/mini --prompt 256 --decode 32 --threads 2 --repeats 3

Each run is a fresh process (the kernel choice is read once per process from the environment):
SMOE_NO_AVX512=1 for "avx2" (which still uses AVX-VNNI where the CPU has it), unset for the
default; smoe_kernels() of each is printed. In each process: a session whose cache holds every
expert, warmed by the same greedy run once untimed (no blob is read afterwards: checked), then one
timed layer-major prefill of --prompt tokens and --decode greedy decode steps. The two kinds' last
logits are compared bit for bit (the kernels give the same bits). Medians over --repeats, the
order of the two reversed every other repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import numpy as np
import pysmoe
from pysmoe._ffi import ffi, lib
vault, prompt, decode, threads, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
with pysmoe.open_vault(vault) as v:
    ids = [int(i) for i in np.random.default_rng(seed).integers(0, v.config["vocab_size"], size=prompt)]
    with v.session(cache_bytes=v.expert_bytes * 2, context=prompt + decode + 1, threads=threads) as s:
        def timed():
            s.reset()
            t0 = time.perf_counter()
            logits = s.prefill(ids)
            t_pre = time.perf_counter() - t0
            nxt = int(np.argmax(logits))
            t0 = time.perf_counter()
            for _ in range(decode):
                logits = s.decode(nxt)
                nxt = int(np.argmax(logits))
            return t_pre, time.perf_counter() - t0, logits
        timed()   # the same greedy run, untimed: every expert it uses is then in the cache
        s.reset_stats()
        t_pre, t_dec, last = timed()
        st = s.stats()
        print(json.dumps({"kernels": ffi.string(lib.smoe_kernels()).decode(), "prefill_s": t_pre, "decode_s": t_dec,
                          "blob_reads": st["blob_reads"], "logits": np.asarray(last, np.float32).tobytes().hex()}))
"""

KINDS = {"avx2": "1", "avx512": "0"}  # SMOE_NO_AVX512


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("vault")
    a.add_argument("--prompt", type=int, default=256)
    a.add_argument("--decode", type=int, default=32)
    a.add_argument("--threads", type=int, default=2)
    a.add_argument("--repeats", type=int, default=3)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--json", default=None)
    args = a.parse_args()
    runs = {k: [] for k in KINDS}
    for r in range(args.repeats):
        for kind in (list(KINDS) if r % 2 == 0 else list(KINDS)[::-1]):
            env = dict(os.environ, SMOE_NO_AVX512=KINDS[kind])
            out = subprocess.run([sys.executable, "-c", CHILD, args.vault, str(args.prompt), str(args.decode),
                                  str(args.threads), str(args.seed)], capture_output=True, text=True, env=env,
                                 check=True).stdout
            res = json.loads(out.strip().splitlines()[-1])
            assert res["blob_reads"] == 0, f"{kind}: the resident session read {res['blob_reads']} blobs"
            runs[kind].append(res)
            print(f"rep {r + 1} {kind} ({res['kernels']}): prefill {args.prompt / res['prefill_s']:.1f} tok/s, "
                  f"decode {args.decode / res['decode_s']:.2f} tok/s", file=sys.stderr, flush=True)
    same = len({x["logits"] for k in KINDS for x in runs[k]}) == 1
    print(f"\n| kernels | prefill {args.prompt} tok/s (runs) | decode tok/s (runs) |")
    print("|---|---|---|")
    med = {}
    for k in KINDS:
        p = [args.prompt / x["prefill_s"] for x in runs[k]]
        d = [args.decode / x["decode_s"] for x in runs[k]]
        med[k] = {"kernels": runs[k][0]["kernels"], "prefill_tps": statistics.median(p),
                  "decode_tps": statistics.median(d)}
        print(f"| {runs[k][0]['kernels']} | {med[k]['prefill_tps']:.1f} ({', '.join(f'{v:.1f}' for v in p)}) | "
              f"{med[k]['decode_tps']:.2f} ({', '.join(f'{v:.2f}' for v in d)}) |")
    print(f"\nlast logits bit-identical across every run: {same}")
    if args.json:
        for k in KINDS:
            for x in runs[k]:
                x.pop("logits")
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "medians": med, "same_logits": same}, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
