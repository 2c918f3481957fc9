"""Cold TTFT with coalesced reads off and on, alternated in one run, against the honest I/O floor.

    python bench/coalesce_ttft.py /work/bench-a3b --lengths 1,8,45,256 --repeats 3 --threads 2 --cache-frac 0.1

Per prompt length and repeat, a fresh session of each setting (coalesce_bytes 0: one read per blob,
as before; and the library's default) prefills the prompt cold, in an order that alternates from
one repeat to the next; as root, the page cache is dropped before every run (the blobs bypass it
with O_DIRECT anyway; this also drops what the dense weights left). After the repeats the floor
sweep of bench/disk_floor.py reads the prompt's union in every pattern, and the I/O floor is the union's bytes over the best rate seen, the engine's own runs
included (bytes read / TTFT), so no run can beat it. Prints one JSON record per run and a table;
--json writes everything.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import pysmoe  # noqa: E402
from pysmoe._ffi import lib  # noqa: E402
from pysmoe.bench import DirectReader, floor_rates, loadavg, machine_info, make_prompt  # noqa: E402

from disk_floor import FLOOR_BYTES, drop_caches, floor_sweep, union_offsets  # noqa: E402  (bench/, this script's folder)

MiB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("vault")
    ap.add_argument("--lengths", default="1,8,45,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--cache-frac", type=float, default=0.1)
    ap.add_argument("--coalesce-mb", type=float, default=None, help="the 'on' setting (default: the library's)")
    ap.add_argument("--floor-mb", type=float, default=FLOOR_BYTES / MiB)
    ap.add_argument("--json")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    on = int(a.coalesce_mb * MiB) if a.coalesce_mb is not None else int(lib.smoe_session_default_params().coalesce_bytes)
    settings = [("off", 0), ("on", on)]
    v = pysmoe.open_vault(a.vault)
    cache = int(a.cache_frac * v.expert_bytes)
    reader = DirectReader(v.path, a.io_threads)
    rec = {"machine": machine_info(), "loadavg_before": loadavg(), "vault": str(v.path), "cache_bytes": cache,
           "threads": a.threads, "io_threads": a.io_threads, "coalesce_on_bytes": on, "rows": []}
    print(f"# {rec['machine']}", flush=True)
    for n in lengths:
        ids = make_prompt(v.config["vocab_size"], n)
        runs = {k: [] for k, _ in settings}
        union = None
        for r in range(a.repeats):
            for name, co in (settings if r % 2 == 0 else settings[::-1]):
                dropped = drop_caches()
                with v.session(cache_bytes=cache, threads=a.threads, io_threads=a.io_threads, chunk=max(n, 1),
                               context=n + 1, coalesce_bytes=co) as s:
                    t0 = time.perf_counter()
                    s.prefill(ids)
                    dt = time.perf_counter() - t0
                    st = s.stats()
                    if union is None:
                        union = union_offsets(v, s)
                x = {"ttft_s": dt, "bytes_read": st["bytes_read"], "blob_reads": st["blob_reads"],
                     "read_requests": st["read_requests"], "io_wait_s": st["io_wait_s"],
                     "direct_io": st["direct_io"], "dropped_caches": dropped, "load": os.getloadavg()[0]}
                runs[name].append(x)
                print(json.dumps({"n": n, "rep": r, "coalesce": name, **x}), flush=True)
        sweep = floor_sweep(reader, union, v.blob_bytes, a.io_threads, on, int(a.floor_mb * MiB),
                            log=lambda m: print("#" + m, flush=True))
        union_bytes = sum(len(u) for u in union) * v.blob_bytes
        rates = floor_rates([], sweep, runs, a.io_threads)
        best = max(rates)
        floor = union_bytes / (best[0] * 1e9)
        firsts = max(r for r in rates if r[1].endswith("(first touch)"))
        repeats = max(r for r in rates if r[1].endswith("(repeat)"))
        row = {"n": n, "union_blobs": sum(len(u) for u in union), "union_bytes": union_bytes, "floor_s": floor,
               "floor_gbps": best[0], "floor_set_by": best[1], "best_first_touch": firsts, "best_repeat": repeats,
               "sweep": sweep, "runs": runs}
        for name, _ in settings:
            t = [x["ttft_s"] for x in runs[name]]
            row[name] = {"ttft_s": statistics.median(t), "min": min(t), "max": max(t),
                         "over_floor": statistics.median([x / floor for x in t]),
                         "read_requests": statistics.median([x["read_requests"] for x in runs[name]]),
                         "blob_reads": statistics.median([x["blob_reads"] for x in runs[name]]),
                         "io_wait_s": statistics.median([x["io_wait_s"] for x in runs[name]])}
        row["on_over_off"] = statistics.median([b["ttft_s"] / c["ttft_s"] for b, c in zip(runs["on"], runs["off"])])
        rec["rows"].append(row)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rec, f, indent=1)
    rec["loadavg_after"] = loadavg()
    print(f"\nload {rec['loadavg_before']} -> {rec['loadavg_after']}; cache {cache / MiB:,.0f} MiB, threads {a.threads}, "
          f"io_threads {a.io_threads}, coalesce on = {on / MiB:.0f} MiB; median of {a.repeats} (min-max)")
    print(f"{'tokens':>6} {'union MiB':>9} {'floor s':>8} {'GB/s':>5}  {'off TTFT s':>18} {'req':>6} "
          f"{'on TTFT s':>18} {'req':>6} {'on/off':>6} {'off/fl':>6} {'on/fl':>6}")
    for row in rec["rows"]:
        f, o = row["off"], row["on"]
        print(f"{row['n']:>6} {row['union_bytes'] / MiB:>9,.0f} {row['floor_s']:>8.2f} {row['floor_gbps']:>5.2f}  "
              f"{f['ttft_s']:>6.2f} ({f['min']:.2f}-{f['max']:.2f}) {f['read_requests']:>6.0f} "
              f"{o['ttft_s']:>6.2f} ({o['min']:.2f}-{o['max']:.2f}) {o['read_requests']:>6.0f} "
              f"{row['on_over_off']:>6.2f} {f['over_floor']:>6.2f} {o['over_floor']:>6.2f}")
    for row in rec["rows"]:
        ft, rp = row["best_first_touch"], row["best_repeat"]
        print(f"{row['n']:>6} tokens: floor set by {row['floor_set_by']}; best first touch {ft[0]:.2f} GB/s "
              f"({ft[1].replace(' (first touch)', '')}); best repeat {rp[0]:.2f} GB/s "
              f"({rp[1].replace(' (repeat)', '')})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
