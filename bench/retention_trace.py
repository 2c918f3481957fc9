"""Record a routing trace from the engine: the experts every token uses at every layer.

    PYTHONPATH=. python bench/retention_trace.py VAULT OUT.npz [--tokens 512] [--seed 0] [--cache-gib 4]

(PYTHONPATH=.: a script's own directory comes first on sys.path, so without it `import pysmoe`
finds the venv's install, not this checkout.)

The engine decodes token by token (token-serial, the path decode takes) text it samples itself
at temperature 0.8 (the temperature `synth --routing realistic` calibrates its topic stay
for, as routing.coherent_prompt does), and after every step reads each layer's expert counts
(smoe_stats_expert_counts, reset before the step): one token's counts are its top-k set. The
trace holds, for token t and layer l, the sorted top-k expert ids (T, L, k), −1 rows for dense
layers, and the ids fed (T). Routing is exact and does not depend on the cache, so the trace is
what any session fed these ids routes: bench/retention_sim.py replays it through candidate
policies, and bench/retention_bench.py feeds the same ids to real sessions.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def record(vault_path: str, tokens: int, seed: int = 0, temperature: float = 0.8, cache_bytes: int = 4 << 30,
           threads: int | None = None, log=print):
    import pysmoe
    from pysmoe._ffi import check, ffi, lib

    v = pysmoe.open_vault(vault_path)
    cfg = v.config
    L, E, K = cfg["num_hidden_layers"], cfg["num_experts"], cfg["num_experts_per_tok"]
    rng = np.random.default_rng([seed, 0x7ace])
    ids = [int(rng.integers(cfg["vocab_size"]))]
    routes = np.full((tokens, L, K), -1, dtype=np.int16)
    buf = ffi.new("uint64_t[]", E)
    t0 = time.perf_counter()
    with v.session(cache_bytes=min(cache_bytes, v.expert_bytes), threads=threads, context=tokens + 1) as s:
        for t in range(tokens):
            check(lib.smoe_stats_reset(s.handle))
            logits = s.decode(ids[-1])
            for layer in range(L):
                check(lib.smoe_stats_expert_counts(s.handle, layer, buf, E))
                c = np.frombuffer(ffi.buffer(buf), dtype=np.uint64)
                used = np.flatnonzero(c)
                if len(used):
                    assert len(used) == K and (c[used] == 1).all(), (t, layer, c[used])
                    routes[t, layer] = used
            if t + 1 < tokens:
                z = logits.astype(np.float64) / temperature
                p = np.exp(z - z.max())
                ids.append(int(rng.choice(len(p), p=p / p.sum())))
            if log and (t + 1) % 64 == 0:
                log(f"  {t + 1}/{tokens} tokens, {time.perf_counter() - t0:.0f} s")
    v.close()
    return np.asarray(ids[:tokens], dtype=np.int32), routes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("vault")
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--cache-gib", type=float, default=4.0)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    ids, routes = record(a.vault, a.tokens, a.seed, a.temperature, int(a.cache_gib * (1 << 30)), a.threads)
    np.savez_compressed(a.out, ids=ids, routes=routes, vault=a.vault, seed=a.seed, temperature=a.temperature)
    print(f"{a.out}: {len(ids)} tokens, {routes.shape[1]} layers, k {routes.shape[2]}, "
          f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
