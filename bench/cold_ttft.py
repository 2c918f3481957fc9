"""Cold load + TTFT of engine settings (or library builds), alternated, each run a fresh process,
against the honest I/O floor read in the same repeats.

    python bench/cold_ttft.py VAULT --lengths 45,256 --cache-fracs 0.1,0 --repeats 3 --threads 2 \\
        --setting base: --setting io8:io_threads=8 --setting new:lib=/tmp/libsmoe-new.so --json OUT.json

A setting is NAME:KEY=VALUE,... where each KEY is a session parameter (threads, io_threads,
coalesce_bytes, part_rows, verify_blobs, chunk, prefill: layer-major or token-serial) or `lib` (a
libsmoe.so to run through SMOE_LIB) or `env` (NAME=VALUE pairs joined by '+', for the worker's
environment). Per prompt length, cache fraction and repeat, the contenders run in an order that
rotates from one repeat to the next: every setting cold, and the I/O floor's reads. As root the
page cache is dropped before each (`sync; echo 3 > /proc/sys/vm/drop_caches`), so each run's vault
open reads the dense weights from the disk too.

A cold run is a fresh worker process (this script with --worker): open the vault (timed: load),
make the session (timed), prefill the prompt layer-major (timed: TTFT), with Direct I/O; it reports
its counters and, once, the prompt's exact union (its routing counts: the blobs the prompt needs,
each once, at their offsets in vault.bin).

The I/O floor: the exact union read whole, by this process, in each of the patterns of
--floor-patterns (blob reads in offset order and runs of adjacent blobs up to 16 MiB, at several
queue depths), one contender per repeat (after a cache drop like the engine's runs: the same
host-side state); then bench/disk_floor.py's sweep (--floor-mb per pattern, 0 skips it). The
floor is the bytes the pass must read — the union, and the dense bytes the open leaves to it (an
lm_head read beside the first pass, vault.c) — over the best rate of all of these and of the
engine's own runs (bytes read / TTFT): no run can beat it. That best rate is the largest of many
samples, most of them 256 MiB of the sweep, on a disk whose rate moves by ±20 % within minutes;
so beside it the ratio to a like-for-like floor: the same bytes at the median rate of the fastest
whole-union pattern, read in the same repeats as the engine's runs (/rd med); and the ratio paired
repeat by repeat (/rep fl): each run's TTFT over its bytes at the best rate seen in its own repeat
(its own and the whole-union patterns' reads, minutes apart at most), the median of those — the
disk's swings between repeats then cancel instead of setting the floor. --compute-floor adds
a warm worker per length whose cache holds every expert (one prefill, then the timed one): TTFT /
max(I/O floor, compute floor) is then reported beside TTFT / I/O floor.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from disk_floor import drop_caches  # noqa: E402  (bench/, this script's folder)

MiB = 1 << 20
FLOOR_PATTERNS = "blobs:4,blobs:16,blobs:32,runs16:4,runs16:8"
SESSION_KEYS = {"threads": int, "io_threads": int, "coalesce_bytes": int, "part_rows": int,
                "verify_blobs": lambda x: x not in ("0", "off", "false"), "chunk": int, "prefill": str}


def parse_setting(text: str) -> tuple[str, dict, dict]:
    """NAME:KEY=VALUE,... -> (name, session kwargs, environment)."""
    name, _, rest = text.partition(":")
    kw, env = {}, {}
    for item in filter(None, rest.split(",")):
        k, _, val = item.partition("=")
        if k == "lib":
            env["SMOE_LIB"] = os.path.abspath(val)
        elif k == "env":
            for pair in val.split("+"):
                ek, _, ev = pair.partition("=")
                env[ek] = ev
        elif k in SESSION_KEYS:
            kw[k] = SESSION_KEYS[k](val)
        else:
            raise SystemExit(f"--setting {text}: unknown key {k!r} (session keys {sorted(SESSION_KEYS)}, lib, env)")
    return name or "default", kw, env


# ------------------------------------------------------------------------------------- worker

def worker(a) -> int:
    t0 = time.perf_counter()
    import pysmoe
    from pysmoe.bench import make_prompt
    t_import = time.perf_counter() - t0
    kw = json.loads(a.params)
    t0 = time.perf_counter()
    v = pysmoe.open_vault(a.vault)
    open_s = time.perf_counter() - t0
    ids = make_prompt(v.config["vocab_size"], a.n)
    cache = v.expert_bytes + v.blob_bytes * v.num_sparse_layers if a.resident else int(a.cache_frac * v.expert_bytes)
    threads = kw.pop("threads", a.threads)
    t0 = time.perf_counter()
    s = v.session(cache_bytes=cache, threads=threads, context=a.n + 1, direct_io=True,
                  **{"chunk": max(a.n, 1), **kw})
    session_s = time.perf_counter() - t0
    s.prefill_path = kw.get("prefill", "layer-major")
    if a.resident:
        s.prefill(ids)
        s.reset()
        s.reset_stats()
    t0 = time.perf_counter()
    s.prefill(ids)
    ttft = time.perf_counter() - t0
    st = s.stats()
    out = {"import_s": t_import, "open_s": open_s, "session_s": session_s, "ttft_s": ttft,
           "bytes_read": st["bytes_read"], "blob_reads": st["blob_reads"], "read_requests": st["read_requests"],
           "io_wait_s": st["io_wait_s"], "cache_hits": st["cache_hits"], "cache_slots": st["cache_slots"],
           "direct_io": st["direct_io"], "dense_bytes": v.dense_bytes, "threads": s.threads, "chunk": s.chunk}
    if a.union:
        from disk_floor import union_offsets
        out["union"] = union_offsets(v, s)
    s.close()
    v.close()
    print("RESULT " + json.dumps(out), flush=True)
    return 0


def run_worker(a, n, cache_frac, kw, env, union=False, resident=False, trace=None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", a.vault, "--n", str(n), "--cache-frac",
           str(cache_frac), "--threads", str(a.threads), "--params", json.dumps(kw)]
    if union:
        cmd.append("--union")
    if resident:
        cmd.append("--resident")
    e = dict(os.environ, **env)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=e, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if trace is not None:
        trace.write(p.stderr)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"worker failed ({p.returncode}): {p.stderr[-2000:]}")
    return {**json.loads(lines[-1][7:]), "wall_s": wall}


# --------------------------------------------------------------------------------------- floor

def floor_requests(pattern: str, union: list, blob_bytes: int) -> tuple[list, int]:
    from disk_floor import _floor_requests
    kind, _, depth = pattern.partition(":")
    if kind == "blobs":
        reqs, _ = _floor_requests("blobs", blob_bytes, union, blob_bytes, 1 << 62)
    elif kind.startswith("runs"):
        reqs, _ = _floor_requests("runs", int(kind[4:]) * MiB, union, blob_bytes, 1 << 62)
    else:
        raise SystemExit(f"floor pattern {pattern!r}: blobs:DEPTH or runsMIB:DEPTH")
    return reqs, int(depth)


def deferred_bytes(head_bytes: int, env: dict) -> int:
    """Bytes of the dense region that the open leaves for the first pass to wait on (vault.c: an
    untied lm_head of SMOE_DENSE_DEFER_MIN bytes or more, default 16 MiB, read beside the pass):
    the pass cannot end before they are read, so they are part of its I/O floor. head_bytes: the
    untied lm_head's size, 0 without one."""
    limit = int(env.get("SMOE_DENSE_DEFER_MIN", os.environ.get("SMOE_DENSE_DEFER_MIN", 16 * MiB)))
    return head_bytes if head_bytes >= limit else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("vault")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--cache-frac", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--params", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--union", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--resident", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--lengths", default="45,256")
    ap.add_argument("--cache-fracs", default="0.1", help="cache budgets as fractions of the expert bytes (0: the "
                                                          "least the engine allows)")
    ap.add_argument("--setting", action="append", default=[], help="NAME:KEY=VALUE,... (repeatable; default "
                                                                  "one setting, the library's defaults)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--floor-patterns", default=FLOOR_PATTERNS)
    ap.add_argument("--floor-mb", type=float, default=256, help="MiB per pattern of disk_floor.py's sweep (0: none)")
    ap.add_argument("--compute-floor", action="store_true")
    ap.add_argument("--trace", help="append the workers' stderr here")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.worker:
        return worker(a)

    import pysmoe
    from pysmoe.bench import DirectReader, loadavg, machine_info
    from disk_floor import floor_sweep
    settings = [parse_setting(x) for x in (a.setting or ["default:"])]
    lengths = [int(x) for x in a.lengths.split(",")]
    fracs = [float(x) for x in a.cache_fracs.split(",")]
    patterns = [p for p in a.floor_patterns.split(",") if p]
    from pysmoe import vaultio
    v = pysmoe.open_vault(a.vault)
    blob_bytes, vpath = v.blob_bytes, str(v.path)
    v.close()
    vf = vaultio.read_vault(vpath)
    head = vf.tensors.get("lm_head")  # none when tied
    head_bytes = head.nbytes if head is not None and not vf.config.get("tie_word_embeddings") else 0
    vf.close()
    deferred = {name: deferred_bytes(head_bytes, env) for name, _, env in settings}
    reader = DirectReader(vpath, 4)
    trace = open(a.trace, "a") if a.trace else None
    rec = {"machine": machine_info(), "loadavg_before": loadavg(), "vault": vpath, "threads": a.threads,
           "settings": [{"name": n, "session": kw, "env": env} for n, kw, env in settings], "rows": [],
           "argv": sys.argv[1:]}
    print(f"# {rec['machine'].get('cpu_model')}; load {rec['loadavg_before']}", flush=True)

    def save():
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rec, f, indent=1)

    for n in lengths:
        union = None
        comp = None
        if a.compute_floor:
            drop_caches()
            name0, kw0, env0 = settings[0]
            comp = run_worker(a, n, 1.0, kw0, env0, resident=True)
            print(f"# {n} tokens: compute floor {comp['ttft_s']:.3f} s (every expert resident)", flush=True)
        for frac in fracs:
            runs = {name: [] for name, _, _ in settings}
            fl_runs = {p: [] for p in patterns}
            contenders = [("run", s) for s in settings] + [("floor", p) for p in patterns]
            for r in range(a.repeats):
                k = r % len(contenders)
                for kind, what in contenders[k:] + contenders[:k]:
                    if kind == "floor" and union is None:
                        continue  # the first engine run gives the union
                    dropped = drop_caches()
                    if kind == "run":
                        name, kw, env = what
                        if trace:
                            trace.write(f"### n={n} frac={frac} rep={r} setting={name}\n")
                        x = run_worker(a, n, frac, kw, env, union=union is None, trace=trace)
                        if union is None:
                            union = x.pop("union")
                        x.update(dropped_caches=dropped, load=os.getloadavg()[0], rep=r)
                        runs[name].append(x)
                        print(json.dumps({"n": n, "cache_frac": frac, "setting": name, **x}), flush=True)
                    else:
                        reqs, depth = floor_requests(what, union, blob_bytes)
                        x = reader.read_requests(reqs, depth)
                        x.update(rep=r, load=os.getloadavg()[0])
                        fl_runs[what].append(x)
                        print(json.dumps({"n": n, "cache_frac": frac, "floor": what, **x}), flush=True)
            # patterns skipped in the first repeat (no union yet) have one run fewer
            ub = sum(len(u) for u in union) * blob_bytes
            rates = [(x["gbps"], f"union read, {p}") for p, xs in fl_runs.items() for x in xs]
            rates += [(x["bytes_read"] / x["ttft_s"] / 1e9, f"the engine's own run ({nm})")
                      for nm, xs in runs.items() for x in xs]
            row = {"n": n, "cache_frac": frac, "union_blobs": sum(len(u) for u in union), "union_bytes": ub,
                   "runs": runs, "floor_runs": fl_runs, "compute_floor": comp}
            if a.floor_mb > 0:
                sweep = floor_sweep(reader, union, blob_bytes, 4, 16 * MiB, int(a.floor_mb * MiB))
                row["sweep"] = sweep
                rates += [(p[w]["gbps"], f"sweep: {p['pattern']} ({w})") for p in sweep for w in ("first", "repeat")]
            best = max(rates)
            io_floor = ub / (best[0] * 1e9)
            io_floor = min([io_floor] + [x["ttft_s"] for xs in runs.values() for x in xs])
            row.update(io_floor_s=io_floor, floor_gbps=best[0], floor_set_by=best[1])
            cf = comp["ttft_s"] if comp else None
            fl = max(io_floor, min([cf] + [x["ttft_s"] for xs in runs.values() for x in xs])) if cf else io_floor
            row["floor_s"] = fl
            # like for like: the best pattern's median time over the whole union in the same repeats
            med = {p: statistics.median([x["seconds"] for x in xs]) for p, xs in fl_runs.items() if xs}
            med_p = min(med, key=med.get) if med else None
            row.update(union_read_s=med.get(med_p), union_read_by=med_p)
            for name, xs in runs.items():
                t = [x["ttft_s"] for x in xs]
                # the floor of what this setting's pass reads: the union and the dense bytes left to it
                db = deferred[name]
                io_fl = min([(ub + db) / (best[0] * 1e9)] + t)
                fl_s = max(io_fl, fl) if cf else io_fl
                rd = med[med_p] * (ub + db) / ub if med_p else None
                # paired: each run against the best rate of its own repeat (its own read included)
                paired = []
                for x in xs:
                    rate = max([x["bytes_read"] / x["ttft_s"] / 1e9]
                               + [f["gbps"] for fs in fl_runs.values() for f in fs if f["rep"] == x["rep"]])
                    paired.append(x["ttft_s"] / min((ub + db) / (rate * 1e9), x["ttft_s"]))
                row[name] = {"ttft_s": statistics.median(t), "min": min(t), "max": max(t), "deferred_bytes": db,
                             "io_floor_s": io_fl, "over_io_floor": statistics.median(t) / io_fl,
                             "over_floor": statistics.median(t) / fl_s,
                             "union_read_s": rd, "over_union_read": statistics.median(t) / rd if rd else None,
                             "over_rep_floor": statistics.median(paired),
                             "open_s": statistics.median([x["open_s"] for x in xs]),
                             "load_plus_ttft_s": statistics.median([x["open_s"] + x["session_s"] + x["ttft_s"]
                                                                    for x in xs]),
                             "io_wait_s": statistics.median([x["io_wait_s"] for x in xs]),
                             "bytes_read": statistics.median([x["bytes_read"] for x in xs]),
                             "read_requests": statistics.median([x["read_requests"] for x in xs])}
            rec["rows"].append(row)
            save()
    rec["loadavg_after"] = loadavg()
    save()
    print(f"\n{rec['machine'].get('cpu_model')}, {rec['machine']['cpus']} CPUs; load {rec['loadavg_before']} -> "
          f"{rec['loadavg_after']}; threads {a.threads}; median of {a.repeats} (min-max); a fresh process per run")
    hdr = (f"{'tokens':>6} {'cache':>5} {'MiB':>9} {'I/O fl s':>8} {'GB/s':>5} {'comp fl':>7} {'setting':<12} "
           f"{'TTFT s':>20} {'/I/O fl':>7} {'/floor':>6} {'/rd med':>7} {'/rep fl':>7} {'io_wait':>7} {'open s':>6} {'requests':>8}")
    print(hdr)
    print("-" * len(hdr))
    for row in rec["rows"]:
        cf = row["compute_floor"]["ttft_s"] if row["compute_floor"] else None
        for name, _, _ in settings:
            x = row[name]
            rd = x["over_union_read"]
            print(f"{row['n']:>6} {row['cache_frac']:>5.0%} {(row['union_bytes'] + x['deferred_bytes']) / MiB:>9,.0f} "
                  f"{x['io_floor_s']:>8.2f} {row['floor_gbps']:>5.2f} {(f'{cf:.2f}' if cf else '-'):>7} {name:<12} "
                  f"{x['ttft_s']:>6.2f} ({x['min']:.2f}-{x['max']:.2f}) {x['over_io_floor']:>7.2f} "
                  f"{x['over_floor']:>6.2f} {(f'{rd:.2f}' if rd else '-'):>7} {x['over_rep_floor']:>7.2f} {x['io_wait_s']:>7.2f} {x['open_s']:>6.2f} "
                  f"{x['read_requests']:>8.0f}")
    print("MiB: the prompt's union of expert blobs and the dense bytes the open left to the pass (a deferred "
          "lm_head); I/O fl: those at the best rate seen; /rd med: TTFT over their time at the median rate of "
          "the fastest whole-union read pattern, alternated with the runs; /rep fl: the median over the runs of "
          "TTFT over those bytes at the best rate seen in the run's own repeat")
    for row in rec["rows"]:
        print(f"{row['n']:>6} tokens, cache {row['cache_frac']:.0%}: I/O floor set by {row['floor_set_by']}; "
              f"whole-union read {row['union_read_by']}, median {row['union_read_s'] or 0:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
