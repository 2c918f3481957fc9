#!/usr/bin/env python3
"""Batched decode on the GPU: aggregate tokens/s of 1, 4, 8 and 16 streams, alternated in one run.

    python bench/cuda_batch.py VAULT [--streams 1,4,8,16] [--steps 32] [--warmup 4] [--rounds 2]
                               [--prompt-len 32] [--json OUT.json]

Every expert in VRAM (a cache for all of them, warmed until a prefill uploads nothing). For each
round and stream count b, b sessions sharing that cache each prefill their own prompt, then decode
--warmup and --steps tokens each, greedy with the engine's sampler (its selection on the GPU), in
two ways, in alternating order from round to round:
  batched   one smoe_decode_batch per step for all b sessions;
  serial    the b sessions' smoe_decode_step one after another (for b = 1: the recorded step).
Both give the same ids (checked). Reported: aggregate tokens/s (b · steps / wall time) of each, and
batched at b against serial at 1; medians over rounds."""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, ".")
import pysmoe  # noqa: E402


def run(mode, sessions, prompts, warmup, steps):
    toks = []
    for s, p in zip(sessions, prompts):
        s.reset()
        s.set_sampler()  # greedy
        toks.append(s.prefill_next(p, want_logits=False)[1])
    fed = [[] for _ in sessions]

    def step():
        if mode == "batched":
            _, nxt = pysmoe.decode_batch(sessions, toks, sample=True, want_logits=False)
        else:
            nxt = [s.decode_next(t, want_logits=False)[1] for s, t in zip(sessions, toks)]
        for i, t in enumerate(nxt):
            fed[i].append(toks[i])
            toks[i] = t

    for _ in range(warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dt = time.perf_counter() - t0
    return {"tokens_per_s": len(sessions) * steps / dt, "step_ms": 1e3 * dt / steps}, fed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("vault")
    ap.add_argument("--streams", default="1,4,8,16")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--json")
    ap.add_argument("--profile", type=int, default=0, metavar="B",
                    help="after the runs, kernel times of 4 batched steps of B streams (torch.profiler)")
    args = ap.parse_args()
    streams = [int(b) for b in args.streams.split(",")]
    v = pysmoe.open_vault(args.vault)
    print(f"library {pysmoe._ffi.LIB_PATH}", flush=True)
    rng = np.random.default_rng(0)
    V = v.config["vocab_size"]
    nmax = max(streams)
    prompts = [rng.integers(0, V, args.prompt_len).tolist() for _ in range(nmax)]
    context = args.prompt_len + args.warmup + args.steps + 8
    lead = v.session(device="cuda", gpu_cache_bytes=v.expert_bytes + v.blob_bytes, chunk=max(64, nmax),
                     context=max(context, 1024))
    pool = [lead] + [v.session(share_cache=lead, chunk=16, context=context) for _ in range(nmax - 1)]
    print(lead.backend, flush=True)
    for _ in range(8):  # warm: every expert into VRAM
        before = lead.device_stats()["uploads"]
        lead.reset()
        lead.prefill(rng.integers(0, V, 512).tolist(), want_logits=False)
        if lead.device_stats()["uploads"] == before:
            break
    rows = {(b, m): [] for b in streams for m in ("batched", "serial")}
    for r in range(args.rounds):
        for b in streams:
            modes = ("batched", "serial") if (r + b) % 2 == 0 else ("serial", "batched")
            fed = {}
            for m in modes:
                res, fed[m] = run(m, pool[:b], prompts[:b], args.warmup, args.steps)
                rows[(b, m)].append(res)
                print(f"round {r} streams={b:2d} {m:8s} {res['tokens_per_s']:8.1f} tok/s  {res['step_ms']:6.2f} ms/step",
                      flush=True)
            assert fed["batched"] == fed["serial"], "the two modes decoded different ids"
    one = statistics.median(x["tokens_per_s"] for x in rows[(1, "serial")]) if 1 in streams else None
    print("\n| streams | batched tok/s | one after another tok/s | batched / one stream |")
    print("| --- | --- | --- | --- |")
    summary = []
    for b in streams:
        bt = statistics.median(x["tokens_per_s"] for x in rows[(b, "batched")])
        st = statistics.median(x["tokens_per_s"] for x in rows[(b, "serial")])
        summary.append({"streams": b, "batched": bt, "serial": st, "vs_one": bt / one if one else None})
        print(f"| {b} | {bt:.1f} | {st:.1f} | {bt / one:.2f}× |" if one else f"| {b} | {bt:.1f} | {st:.1f} | |")
    if args.profile:
        import torch
        from torch.profiler import ProfilerActivity, profile
        b = args.profile
        run("batched", pool[:b], prompts[:b], 2, 1)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as pr:
            run("batched", pool[:b], prompts[:b], 0, 4)
            torch.cuda.synchronize()
        print(f"4 steps of {b} streams (and their prefills)\n" +
              pr.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"args": vars(args), "backend": lead.backend,
                                                       "summary": summary,
                                                       "runs": {f"{b}/{m}": x for (b, m), x in rows.items()}},
                                                      indent=1))
    for s in reversed(pool):
        s.close()
    v.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
