#!/usr/bin/env python3
"""Batched decode (pysmoe.decode_batch) against one-at-a-time decode, alternated in one run.

    python bench/batch_decode.py VAULT [--batches 1,2,4,8] [--steps 16] [--warmup 4] [--rounds 3]
                                 [--cache-frac 0.1] [--prompt-len 24] [--threads 2] [--json OUT]

For each round and batch size b, b sessions sharing one cache (cache-frac of the vault's expert
bytes) each prefill their own coherent prompt (pysmoe.routing.coherent_prompt, a different seed
per session), then decode --warmup and --steps tokens per session, sampled (temperature 0.7,
numpy, seeded per session) from their logits, in two ways, in alternating order from round to
round:
  batched   one decode_batch call per step for all b sessions;
  serial    the b sessions' decode() one after another, token by token (interleaved streams,
            no batching).
Both modes see bit-identical logits, so they sample the same tokens and route alike (checked).
The cache is cleared before the warmup steps. Reported over the --steps steps: aggregate
tokens/s (b·steps / wall time) and blob reads per generated token; medians over rounds."""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import pysmoe  # noqa: E402
from pysmoe.bench import loadavg, machine_info  # noqa: E402
from pysmoe.routing import coherent_prompt  # noqa: E402

TEMPERATURE = 0.7


def sample(logits: np.ndarray, rng: np.random.Generator) -> int:
    z = logits.astype(np.float64) / TEMPERATURE
    p = np.exp(z - z.max())
    return int(rng.choice(len(p), p=p / p.sum()))


def run_mode(mode: str, sessions, prompts, warmup: int, steps: int, round_: int) -> dict:
    rngs = [np.random.default_rng([round_, i]) for i in range(len(sessions))]
    toks = []
    for s, p in zip(sessions, prompts):
        s.reset()
        toks.append(sample(s.prefill(p), rngs[len(toks)]))
    sessions[0].clear_cache()
    fed = [[] for _ in sessions]

    def step():
        if mode == "batched":
            out = pysmoe.decode_batch(sessions, toks)
        else:
            out = [s.decode(t) for s, t in zip(sessions, toks)]
        for i, lg in enumerate(out):
            fed[i].append(toks[i])
            toks[i] = sample(lg, rngs[i])

    for _ in range(warmup):
        step()
    r0 = sessions[0].stats()["blob_reads"]
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dt = time.perf_counter() - t0
    reads = sessions[0].stats()["blob_reads"] - r0
    n = len(sessions) * steps
    return {"tokens_per_s": n / dt, "reads_per_token": reads / n, "seconds": dt, "fed": fed}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("vault")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cache-frac", type=float, default=0.1)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    v = pysmoe.open_vault(args.vault)
    cache = int(v.expert_bytes * args.cache_frac)
    nmax = max(batches)
    prompts = [coherent_prompt(v, args.prompt_len, seed=i, threads=args.threads) for i in range(nmax)]
    context = args.prompt_len + args.warmup + args.steps + 8
    first = v.session(cache_bytes=cache, threads=args.threads, context=context)
    pool = [first] + [v.session(share_cache=first, context=context) for _ in range(nmax - 1)]
    load0 = loadavg()
    rows = {(b, m): [] for b in batches for m in ("batched", "serial")}
    for r in range(args.rounds):
        for b in batches:
            modes = ("batched", "serial") if (r + b) % 2 == 0 else ("serial", "batched")
            fed = {}
            for m in modes:
                res = run_mode(m, pool[:b], prompts[:b], args.warmup, args.steps, r)
                fed[m] = res.pop("fed")
                rows[(b, m)].append(res)
                print(f"round {r} b={b} {m:8s} {res['tokens_per_s']:7.2f} tok/s  "
                      f"{res['reads_per_token']:6.2f} reads/token", flush=True)
            assert fed["batched"] == fed["serial"], "the two modes sampled different tokens"
    load1 = loadavg()
    summary = []
    for b in batches:
        row = {"batch": b}
        for m in ("batched", "serial"):
            row[m] = {k: statistics.median(x[k] for x in rows[(b, m)]) for k in ("tokens_per_s", "reads_per_token")}
        summary.append(row)
    print("\n| sessions | batched tok/s | one-at-a-time tok/s | speed-up | batched reads/token | "
          "one-at-a-time reads/token |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in summary:
        bt, st = row["batched"], row["serial"]
        print(f"| {row['batch']} | {bt['tokens_per_s']:.2f} | {st['tokens_per_s']:.2f} | "
              f"{bt['tokens_per_s'] / st['tokens_per_s']:.2f}× | {bt['reads_per_token']:.2f} | "
              f"{st['reads_per_token']:.2f} |")
    print(f"load average before {load0}, after {load1}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({
            "args": vars(args), "machine": machine_info(), "load_before": load0, "load_after": load1,
            "summary": summary, "runs": {f"{b}/{m}": x for (b, m), x in rows.items()}}, indent=1))
    for s in reversed(pool):
        s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
