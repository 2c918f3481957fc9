"""Replay a routing trace (bench/retention_trace.py) through candidate retention policies.

    python bench/retention_sim.py TRACE.npz [--budgets 5,10,25] [--prompt 64] [--decode 64]
        [--policies quota-lru,...] [--json OUT]

The replay is the streamer's bookkeeping, slot for slot: n_slots = the session's slot count for
the budget (bench.budget_slots: whole blobs of the sparse layers' expert bytes); the prompt's
first `prompt` ids are one layer-major chunk, so each layer visit acquires the chunk's union
once; every decode token then visits each sparse layer and acquires its k experts. The blobs
of the visit in progress are pinned (the engine pins a layer's blobs from acquire until it has
computed them; never a victim), everything else unpinned and READY (reads are waited for within
the visit). A miss takes an empty slot while one is left, else the policy's victim. The hit
rate is that of the decode steps alone, as `bench --decode-budgets` reports it.

Policies (victim choice among unpinned retained blobs):
  quota-lru     today's streamer.c: largest excess over the per-layer quota n_slots/n_sparse,
                then another layer than the requester, then the most recently used layer, then
                the least recently used slot.
  global-lru    plain LRU (thrashes on the layer cycle: for reference).
  lfu-quota     the quota's layer choice, then within the layer the fewest uses so far (ties:
                least recent). Uses are counted per acquire over the session (LFU, no decay).
  lrfu-quota:H  the same with uses decayed per visit of the layer by 2^(-1/H): frequency with a
                half-life of H tokens (H large ~ LFU, H small ~ LRU); one use per acquire, and
                a layer's clock is its visit count (a prefill chunk is one visit), as the
                streamer sees them (csrc/retention.c).
  lfu-global:H  no quota: the globally smallest decayed score, each on its layer's clock.
  hot-quota:P   a pinned hot set: per layer the P % of the quota with the most uses in the
                trace's prompt (its routing statistics: token counts of the chunk) never leave;
                the rest of the quota is quota-lru.
  belady        the optimal offline choice (furthest next use): an upper bound, not a policy.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np


def visits(routes, prompt: int, decode: int):
    """(token, layer, experts, counts, is_decode) in engine order: the prompt as one chunk per
    layer (union in order of first appearance, token counts), then one visit per decode token
    per sparse layer."""
    T, L, K = routes.shape
    sparse = [l for l in range(L) if routes[0, l, 0] >= 0]
    out = []
    if prompt:
        for l in sparse:
            r = routes[:prompt, l].reshape(-1)
            uniq, first, counts = np.unique(r, return_index=True, return_counts=True)
            order = np.argsort(first)
            out.append((prompt - 1, l, uniq[order].tolist(), counts[order].tolist(), False))
    for t in range(prompt, min(T, prompt + decode)):
        for l in sparse:
            out.append((t, l, routes[t, l].tolist(), [1] * K, True))
    return out, sparse


def simulate(routes, n_slots: int, policy: str, prompt: int = 64, decode: int = 64, E: int | None = None):
    T, L, K = routes.shape
    E = E or int(routes.max()) + 1
    vs, sparse = visits(routes, prompt, decode)
    quota = n_slots // len(sparse)
    name, _, arg = policy.partition(":")
    half = float(arg) if arg and name in ("lrfu-quota", "lfu-global") else None
    decay = 2.0 ** (-1.0 / half) if half else 1.0
    key = np.full(n_slots, -1, dtype=np.int64)
    stamp = np.zeros(n_slots, dtype=np.int64)
    pinned = np.zeros(n_slots, dtype=bool)
    count = np.zeros(L, dtype=np.int64)
    layer_use = np.zeros(L, dtype=np.int64)
    index = {}
    score = np.zeros(L * E)      # uses, decayed to score_t
    score_t = np.zeros(L * E)    # the layer's token clock at the last update
    hot = np.zeros(L * E, dtype=bool)
    if name == "hot-quota":
        n_hot = int(round(quota * float(arg) / 100))
        for l in sparse:
            c = np.bincount(routes[:prompt, l].reshape(-1), minlength=E)
            for e in np.argsort(-c, kind="stable")[:n_hot]:
                if c[e] > 0:
                    hot[l * E + e] = True
    nxt = None
    if name == "belady":  # position of each visit's next use per key
        nxt = []
        last = {}
        for i in range(len(vs) - 1, -1, -1):
            _, l, es, _, _ = vs[i]
            nxt.append({e: last.get(l * E + e, math.inf) for e in es})
            for e in es:
                last[l * E + e] = i
        nxt.reverse()
        next_use = np.full(n_slots, math.inf)
    clock = 0
    hits = misses = 0

    visit = np.zeros(L, dtype=np.int64)  # per layer: its visits so far (the decay clock)

    def eff(k, t):
        return score[k] * decay ** (visit[np.asarray(k) // E] - score_t[k])

    for vi, (t, l, es, cs, is_dec) in enumerate(vs):
        held = []
        visit[l] += 1
        for e, c in zip(es, cs):
            k = l * E + e
            clock += 1
            if name in ("lfu-quota", "lrfu-quota", "lfu-global", "hot-quota"):
                # one use per acquire, as the streamer sees it (a prefill chunk acquires once)
                score[k] = eff(k, t) + 1 if name != "hot-quota" else score[k] + c
                score_t[k] = visit[l]
            i = index.get(k)
            if i is not None:
                hits += is_dec
            else:
                misses += is_dec
                free = np.flatnonzero(key < 0)
                if len(free):
                    i = int(free[0])
                else:
                    cand = np.flatnonzero(~pinned)
                    if not len(cand):
                        raise RuntimeError("every slot pinned")
                    i = victim(name, cand, key, stamp, count, layer_use, quota, l, E, eff, t, hot,
                               next_use if nxt is not None else None)
                    old = int(key[i])
                    del index[old]
                    count[old // E] -= 1
                key[i] = k
                index[k] = i
                count[l] += 1
            pinned[i] = True
            stamp[i] = clock
            layer_use[l] = clock
            if nxt is not None:
                next_use[i] = nxt[vi][e]
            held.append(i)
        pinned[held] = False
    return {"hits": hits, "misses": misses, "hit_rate": hits / max(hits + misses, 1)}


def victim(name, cand, key, stamp, count, layer_use, quota, l, E, eff, t, hot, next_use):
    lay = key[cand] // E
    if name == "belady":
        nu = next_use[cand]
        return int(cand[np.lexsort((stamp[cand], -nu))[0]])
    if name == "global-lru":
        return int(cand[np.argmin(stamp[cand])])
    if name == "lfu-global":
        sc = eff(key[cand], t)
        return int(cand[np.lexsort((stamp[cand], sc))[0]])
    excess = count[lay] - quota
    other = lay != l
    if name == "hot-quota":
        # hot blobs are kept: they leave only when nothing else is left
        cold = ~hot[key[cand]]
        if cold.any():
            cand, lay, excess, other = cand[cold], lay[cold], excess[cold], other[cold]
    # sort keys, last is primary: excess desc, other first, layer_use desc, then within layer
    if name in ("lfu-quota", "lrfu-quota"):
        sc = eff(key[cand], t)
        order = np.lexsort((stamp[cand], sc, -layer_use[lay], ~other, -excess))
    else:
        order = np.lexsort((stamp[cand], -layer_use[lay], ~other, -excess))
    return int(cand[order[0]])


def slots_for(routes, pct: float, E: int) -> int:
    T, L, K = routes.shape
    n_sparse = int((routes[0, :, 0] >= 0).sum())
    total = n_sparse * E
    return max(K, min(total, int(pct / 100 * total)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--budgets", default="5,10,25")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--experts", type=int, default=None, help="num_experts (default: max id + 1)")
    ap.add_argument("--policies", default="quota-lru,global-lru,lfu-quota,lrfu-quota:4,lrfu-quota:16,"
                                          "lrfu-quota:64,lfu-global:16,hot-quota:50,belady")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    tr = np.load(a.trace)
    routes = tr["routes"].astype(np.int64)
    E = a.experts or int(routes.max()) + 1
    budgets = [float(x) for x in a.budgets.split(",")]
    res = {}
    print(f"{a.trace}: {routes.shape[0]} tokens; prompt {a.prompt}, decode {a.decode}; hit rate of decode steps")
    print(f"{'policy':16s}" + "".join(f"{b:>9g}%" for b in budgets))
    for pol in a.policies.split(","):
        row = []
        for b in budgets:
            r = simulate(routes, slots_for(routes, b, E), pol, a.prompt, a.decode, E)
            res.setdefault(pol, {})[b] = r
            row.append(r["hit_rate"])
        print(f"{pol:16s}" + "".join(f"{x:10.3f}" for x in row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"trace": a.trace, "prompt": a.prompt, "decode": a.decode, "results": res}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
