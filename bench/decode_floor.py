"""Decode tokens/s under a cache budget against its own floor, alternated in one run.

    python bench/decode_floor.py VAULT --budgets 10,33 --prompt 64 --tokens 32 --repeats 3 --threads 2 \\
        [--coherent] [--json OUT.json]

The per-token floor under a budget: per sparse layer, the bytes of the experts the token needs
that the cache does not hold, read at the rate this disk gives for that read size and depth,
plus the compute of the token with every expert resident:

    floor_s = L × t(m) + resident_s,   m = the run's misses per token / L (experts read per layer)

t(m) is measured here, in the same repeats: groups of m random blobs of the vault (m rounded up
and down, then interpolated) read at once, m readers in flight (a layer's misses are read
together, and the layer cannot finish before its last one lands), one group after another; t(m)
is the median group time. resident_s is 1 / the tokens/s of a session whose cache holds every
expert, decoding the same tokens. So the floor is what a perfect engine with this cache's hit rate
would need: every miss read at the disk's own rate for that depth, nothing else waiting.

Per repeat, in an order that rotates: each budget (a fresh session, Direct I/O, prefill the
prompt layer-major, then time --tokens decode steps), the resident session (warmed once, then
the same), and the group reads. The decode is teacher-forced: with --coherent the ids are
pysmoe.routing.coherent_prompt (the model's own samples at temperature 0.8: the routing of text
it would write; use it with a `synth --routing realistic` vault), else a fixed random sequence;
the first --prompt ids are the prompt, the next --tokens are fed one decode step each. Reports
tok/s, hit rate, misses per token, the floor's parts and tok/s over the floor's tok/s.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MiB = 1 << 20


def decode_run(v, cache_bytes, ids, n_prompt, *, threads, io_threads, warm=False) -> dict:
    """Prefill ids[:n_prompt], then time one decode step per id of ids[n_prompt:]."""
    with v.session(cache_bytes=cache_bytes, threads=threads, io_threads=io_threads, context=len(ids) + 1,
                   direct_io=True) as s:
        s.prefill_path = "layer-major"
        if warm:  # every expert these tokens need comes in first
            s.prefill(ids[:n_prompt])
            for t in ids[n_prompt:]:
                s.decode(int(t))
            s.reset()
        s.prefill(ids[:n_prompt])
        s.reset_stats()
        t0 = time.perf_counter()
        for t in ids[n_prompt:]:
            s.decode(int(t))
        dt = time.perf_counter() - t0
        st = s.stats()
    n = len(ids) - n_prompt
    uses = st["cache_hits"] + st["cache_misses"]
    return {"seconds": dt, "tokens": n, "tps": n / dt, "blob_reads": st["blob_reads"], "bytes_read": st["bytes_read"],
            "hits": st["cache_hits"], "misses": st["cache_misses"], "hit_rate": st["cache_hits"] / uses if uses else None,
            "io_wait_s": st["io_wait_s"], "direct_io": st["direct_io"], "cache_bytes": st["cache_bytes"]}


def group_reads(reader, m: int, groups: int, seed: int) -> dict:
    """groups × (m random blobs read at once, m in flight): the median seconds per group. The
    readers (a thread pool) and their page-aligned buffers are made once, outside the timing;
    each read is one preadv of a whole blob with the probe's O_DIRECT descriptor (the same reads
    as DirectReader.read_requests, which disk_floor.py's sweep uses)."""
    import concurrent.futures as cf
    import mmap

    import numpy as np
    rng = np.random.default_rng(seed)
    size = int(reader.sizes.max())
    bufs = [mmap.mmap(-1, size) for _ in range(m)]
    views = [memoryview(b) for b in bufs]
    times = []

    def read(k, off, n):
        with views[k][:n] as part:
            got = os.preadv(reader.fd, [part], off)
        if got != n:
            raise OSError(f"short read at {off}: {got} of {n} bytes")

    try:
        with cf.ThreadPoolExecutor(m, thread_name_prefix="group-read") as pool:
            list(pool.map(lambda k: None, range(m)))  # the threads exist before the first group
            for _ in range(groups):
                pick = rng.choice(len(reader.offsets), m, replace=False)
                t0 = time.perf_counter()
                for f in [pool.submit(read, k, int(reader.offsets[i]), int(reader.sizes[i]))
                          for k, i in enumerate(pick)]:
                    f.result()
                times.append(time.perf_counter() - t0)
    finally:
        for v in views:
            v.release()
        for b in bufs:
            b.close()
    return {"m": m, "median_s": statistics.median(times), "min_s": min(times), "times": times}


def t_of(curve: dict, m: float) -> float:
    """t(m) by linear interpolation between the measured whole depths (t(0) = 0)."""
    if m <= 0:
        return 0.0
    lo, hi = int(m), int(m) + 1
    tl = 0.0 if lo == 0 else curve[lo]
    if m == lo:
        return tl
    return tl + (m - lo) * (curve[hi] - tl)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("vault")
    ap.add_argument("--budgets", default="10,33", help="cache budgets, percent of the expert bytes")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--groups", type=int, default=24, help="groups of m blobs per depth and repeat")
    ap.add_argument("--coherent", action="store_true", help="ids from pysmoe.routing.coherent_prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args()

    import pysmoe
    from pysmoe.bench import DirectReader, loadavg, machine_info, make_prompt
    v = pysmoe.open_vault(a.vault)
    L = v.num_sparse_layers
    K = v.config["num_experts_per_tok"]
    n_all = a.prompt + a.tokens
    if a.coherent:
        from pysmoe.routing import coherent_prompt
        ids = coherent_prompt(v, n_all, seed=a.seed, threads=a.threads)
    else:
        ids = make_prompt(v.config["vocab_size"], n_all, a.seed)
    budgets = [float(x) for x in a.budgets.split(",")]
    reader = DirectReader(v.path, a.io_threads)
    rec = {"machine": machine_info(), "loadavg_before": loadavg(), "vault": str(v.path), "argv": sys.argv[1:],
           "sparse_layers": L, "top_k": K, "blob_bytes": v.blob_bytes, "ids": "coherent" if a.coherent else "random",
           "runs": {f"{b:g}": [] for b in budgets}, "resident": [], "groups": {m: [] for m in range(1, K + 1)}}
    print(f"# {rec['machine'].get('cpu_model')}; load {rec['loadavg_before']}", flush=True)
    contenders = [("budget", b) for b in budgets] + [("resident", None), ("groups", None)]
    resident_bytes = v.expert_bytes + v.blob_bytes * L
    for r in range(a.repeats):
        k = r % len(contenders)
        for kind, b in contenders[k:] + contenders[:k]:
            if kind == "budget":
                x = decode_run(v, int(b / 100 * v.expert_bytes), ids, a.prompt, threads=a.threads,
                               io_threads=a.io_threads)
                rec["runs"][f"{b:g}"].append(x)
                print(f"  rep {r + 1} budget {b:g}%: {x['tps']:.2f} tok/s, hit rate {x['hit_rate']:.1%}, "
                      f"{x['misses'] / x['tokens']:.1f} misses/token", flush=True)
            elif kind == "resident":
                x = decode_run(v, resident_bytes, ids, a.prompt, threads=a.threads, io_threads=a.io_threads,
                               warm=True)
                rec["resident"].append(x)
                print(f"  rep {r + 1} resident: {x['tps']:.2f} tok/s ({x['misses']} misses)", flush=True)
            else:
                for m in range(1, K + 1):
                    rec["groups"][m].append(group_reads(reader, m, a.groups, seed=a.seed * 1000 + r * 10 + m))
                print(f"  rep {r + 1} group reads: " + ", ".join(
                    f"t({m})={rec['groups'][m][-1]['median_s'] * 1e3:.1f} ms" for m in range(1, K + 1)), flush=True)
    # per repeat: the floor from that repeat's group reads and resident run
    rows = []
    for b in budgets:
        ratios, floors, parts = [], [], []
        for r, x in enumerate(rec["runs"][f"{b:g}"]):
            curve = {m: rec["groups"][m][r]["median_s"] for m in range(1, K + 1)}
            m = x["misses"] / x["tokens"] / L
            io_s = L * t_of(curve, min(m, K))
            comp_s = 1 / rec["resident"][r]["tps"]
            floor = io_s + comp_s
            floors.append(floor)
            parts.append((io_s, comp_s))
            ratios.append(x["tps"] * floor)  # tok/s over the floor's tok/s
        xs = rec["runs"][f"{b:g}"]
        rows.append({"budget_pct": b, "tps": statistics.median([x["tps"] for x in xs]),
                     "tps_spread": [min(x["tps"] for x in xs), max(x["tps"] for x in xs)],
                     "hit_rate": statistics.median([x["hit_rate"] for x in xs]),
                     "misses_per_token": statistics.median([x["misses"] / x["tokens"] for x in xs]),
                     "io_wait_per_token_s": statistics.median([x["io_wait_s"] / x["tokens"] for x in xs]),
                     "floor_s": statistics.median(floors), "floor_tps": 1 / statistics.median(floors),
                     "floor_io_s": statistics.median([p[0] for p in parts]),
                     "floor_compute_s": statistics.median([p[1] for p in parts]),
                     "over_floor": statistics.median(ratios)})
    rec["rows"] = rows
    rec["resident_tps"] = statistics.median([x["tps"] for x in rec["resident"]])
    rec["t_of_m_ms"] = {m: 1e3 * statistics.median([g["median_s"] for g in rec["groups"][m]]) for m in range(1, K + 1)}
    rec["loadavg_after"] = loadavg()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rec, f, indent=1)
    print(f"\n{rec['machine'].get('cpu_model')}, {rec['machine']['cpus']} CPUs; load {rec['loadavg_before']} -> "
          f"{rec['loadavg_after']}; {L} sparse layers, top-{K}, blob {v.blob_bytes / MiB:.2f} MiB; ids {rec['ids']}; "
          f"prompt {a.prompt}, {a.tokens} decode steps; threads {a.threads}, io_threads {a.io_threads}; "
          f"median of {a.repeats}")
    print("t(m), m blobs read at once: " + ", ".join(f"{m}: {t:.1f} ms" for m, t in rec["t_of_m_ms"].items()))
    print(f"resident (every expert cached): {rec['resident_tps']:.2f} tok/s")
    hdr = (f"{'budget':>6} {'tok/s':>16} {'hit rate':>8} {'miss/tok':>8} {'wait/tok':>8} {'floor I/O':>9} "
           f"{'floor comp':>10} {'floor tok/s':>11} {'/floor':>6}")
    print(hdr)
    print("-" * len(hdr))
    for row in rows:
        sp = row["tps_spread"]
        print(f"{row['budget_pct']:>5g}% {row['tps']:>6.2f} ({sp[0]:.2f}-{sp[1]:.2f}) {row['hit_rate']:>8.1%} "
              f"{row['misses_per_token']:>8.1f} {row['io_wait_per_token_s'] * 1e3:>6.1f}ms "
              f"{row['floor_io_s'] * 1e3:>7.1f}ms {row['floor_compute_s'] * 1e3:>8.1f}ms {row['floor_tps']:>11.2f} "
              f"{row['over_floor']:>6.2f}")
    v.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
