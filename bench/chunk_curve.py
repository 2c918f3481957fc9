"""TTFT against the layer-major chunk, every expert resident, alternated in one run.

    python -m pysmoe synth /work/tmp-chunk-mini --preset mini --layers 9
    python bench/chunk_curve.py /work/tmp-chunk-mini --chunks 256,512,1024,2048 --prompts 256,1024,4096 \
        --repeats 2 --threads 2

One session per chunk, each with a cache that holds every expert, warmed by one 512-token prefill
(so the timed runs compute and never read: the table shows their misses). Per prompt length and
repeat, every chunk runs once, in an order that rotates from one repeat to the next. TTFT is the
wall time of Session.prefill (all ids but the last in chunks, the last through the decode step).
Memory per chunk: the session's activation planes (stats()["plane_bytes"]), which grow with the
chunk; KV is sized by the context, the same for all.
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
from pysmoe.bench import loadavg, machine_info, make_prompt  # noqa: E402

MiB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("vault")
    ap.add_argument("--chunks", default="256,512,1024,2048")
    ap.add_argument("--prompts", default="256,1024,4096")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    chunks = [int(x) for x in a.chunks.split(",")]
    prompts = [int(x) for x in a.prompts.split(",")]
    v = pysmoe.open_vault(a.vault)
    context = min(max(prompts), v.config["max_position_embeddings"])
    rec = {"machine": machine_info(), "loadavg_before": loadavg(), "vault": str(v.path), "threads": a.threads,
           "context": context, "chunks": chunks, "rows": []}
    print(f"# {rec['machine']}", flush=True)
    sessions = {}
    for c in chunks:
        s = v.session(cache_bytes=v.expert_bytes + v.blob_bytes * v.num_sparse_layers, threads=a.threads, chunk=c,
                      context=context)
        s.prefill(make_prompt(v.config["vocab_size"], 512, seed=99))
        sessions[c] = s
    planes = {c: sessions[c].stats()["plane_bytes"] for c in chunks}
    for n in prompts:
        ids = make_prompt(v.config["vocab_size"], n)
        runs = {c: [] for c in chunks}
        for r in range(a.repeats):
            order = chunks[r % len(chunks):] + chunks[:r % len(chunks)]
            for c in order:
                s = sessions[c]
                s.reset()
                s.reset_stats()
                t0 = time.perf_counter()
                s.prefill(ids)
                dt = time.perf_counter() - t0
                st = s.stats()
                x = {"ttft_s": dt, "misses": st["cache_misses"], "load": os.getloadavg()[0]}
                runs[c].append(x)
                print(json.dumps({"prompt": n, "chunk": c, "rep": r, **x}), flush=True)
        row = {"prompt": n, "runs": runs}
        for c in chunks:
            t = [x["ttft_s"] for x in runs[c]]
            row[c] = {"ttft_s": statistics.median(t), "min": min(t), "max": max(t)}
        rec["rows"].append(row)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rec, f, indent=1, default=str)
    rec["loadavg_after"] = loadavg()
    base = chunks[0]
    print(f"\nload {rec['loadavg_before']} -> {rec['loadavg_after']}; threads {a.threads}, context {context}; "
          f"median of {a.repeats} (min-max); x = against chunk {base}")
    print(f"{'chunk':>6} {'planes MiB':>10} " + " ".join(f"{f'{n} tokens s':>24}" for n in prompts))
    for c in chunks:
        cells = []
        for row in rec["rows"]:
            m = row[c]
            cells.append(f"{m['ttft_s']:7.2f} ({m['min']:.2f}-{m['max']:.2f}) x{m['ttft_s'] / row[base]['ttft_s']:.2f}")
        print(f"{c:>6} {planes[c] / MiB:>10.1f} " + " ".join(f"{x:>24}" for x in cells))
    rec["plane_bytes"] = planes
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rec, f, indent=1, default=str)
    for s in sessions.values():
        s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
