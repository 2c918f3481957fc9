"""Routing statistics of a vault, measured through the engine, and coherent benchmark prompts.

    from pysmoe.routing import coherent_prompt, routing_stats
    ids = coherent_prompt("path/to/vault", 256, seed=0)      # the model's own text, fixed seed
    st = routing_stats("path/to/vault", tokens=256)           # per layer and overall
    st["overall"]  -> {"overlap": 0.45, "top20_share": 0.5, "union45": 60.1}

    python -m pysmoe info VAULT --routing-stats [--tokens N] [--json]

What is measured, per sparse layer, over a prompt of N tokens:

- overlap: |topk(t) ∩ topk(t+1)| / k averaged over adjacent tokens. A layer-major chunk of
  two tokens reads the union of their experts, 2k − |overlap|, and the engine reports each
  layer's union (smoe_stats_union_sizes), so the prompt is fed as chunks (0,1), (2,3), ...: the
  overlap of every other adjacent pair, exactly, from the engine's own routing.
- top20_share: the share of the N·k routings taken by the layer's 20% most-used experts
  (fractional at the edge: for 128 experts the top 25 plus 0.6 of the 26th). A uniform router
  gives 0.2 in the limit, more over a finite prompt (uniform_share: 0.27 for 128 experts, top-8
  over 256 tokens), and the output reports that baseline at the same N. Needs per-expert
  counts: the engine's (smoe_stats_expert_counts), or the numpy reference's routing (exact,
  slow: fine for tiny and mini, minutes for a3b; `skew="reference"`), or none (`skew="none"`).
- union45: the union size of a 45-token layer-major chunk (the seed's benchmark prompt
  length), averaged over the prompt's full 45-token chunks (engine, exact).

Prompts: by default coherent_prompt(vault, N, seed): a first id drawn from the seed, then N−1
ids sampled from the model itself (engine decode, temperature 0.8, top-p 1). Sampling from the
model works for any vault, real or synthetic: a prompt is coherent when the model would write
it. Random ids wash out the locality a trained (or a realistic synthetic) model has, the way
shuffled words would. Text through the vault's tokenizer works too (`ids=`).
"""
from __future__ import annotations

import math

import numpy as np

UNION_CHUNK = 45
TOP_FRACTION = 0.2
DEFAULT_TOKENS = 256
DEFAULT_TEMPERATURE = 0.8

def _open(vault):
    from .engine import Vault, open_vault
    if isinstance(vault, Vault):
        return vault, False
    return open_vault(vault), True


def top_share(counts, frac: float = TOP_FRACTION) -> float:
    """Share of the total taken by the largest frac of the entries, fractional at the edge."""
    c = -np.sort(-np.asarray(counts, dtype=np.float64))
    total = c.sum()
    if total <= 0:
        return float("nan")
    q = frac * c.size
    f = int(math.floor(q))
    top = c[:f].sum() + ((q - f) * c[f] if f < c.size else 0.0)
    return float(top / total)


def uniform_share(num_experts: int, top_k: int, tokens: int, reps: int | None = None, seed: int = 0) -> float:
    """Mean top-20% share that a uniform router (k distinct experts per token, all equally
    likely) gives over `tokens` tokens. Not 0.2: finite counts scatter around tokens·k/E and
    the largest fifth of them is picked after the fact, so it reads high when tokens·k/E is
    small (128 experts, top-8: 0.27 over 256 tokens, 0.23 over 1024). Monte Carlo with a
    fixed seed, reps prompts of up to ~4 M draws together; deterministic."""
    if tokens < 1:
        raise ValueError("tokens must be >= 1")
    rng = np.random.default_rng([seed, num_experts, top_k, tokens])
    reps = reps or int(min(64, max(8, 4_000_000 // (tokens * num_experts))))
    shares = []
    for _ in range(reps):
        counts = np.zeros(num_experts, dtype=np.int64)
        for n in range(0, tokens, 65536):
            z = rng.random((min(65536, tokens - n), num_experts), dtype=np.float32)
            counts += np.bincount(np.argpartition(z, top_k - 1, axis=1)[:, :top_k].ravel(), minlength=num_experts)
        shares.append(top_share(counts))
    return float(np.mean(shares))


def uniform_expectations(num_experts: int, top_k: int, chunk: int = UNION_CHUNK, tokens: int | None = None) -> dict:
    """What routing that ignores its input and favours no expert gives. top20_share is the
    population value, 0.2; with tokens, top20_share_at_tokens is what such a router reads over
    a prompt of that many tokens (uniform_share)."""
    p = top_k / num_experts
    out = {"overlap": p, "top20_share": TOP_FRACTION, "union45": num_experts * (1 - (1 - p) ** chunk)}
    if tokens is not None:
        out["tokens"] = int(tokens)
        out["top20_share_at_tokens"] = uniform_share(num_experts, top_k, tokens)
    return out


# ------------------------------------------------------------------------------------ prompts

def coherent_prompt(vault, n: int, seed: int = 0, temperature: float = DEFAULT_TEMPERATURE,
                    top_p: float = 1.0, threads: int | None = None, cache_bytes: int | None = None) -> np.ndarray:
    """n prompt ids the model treats as coherent: a first id drawn from seed, then n−1 ids
    sampled from the model itself (engine, token-serial decode) at temperature, seeded by
    seed. Deterministic for a vault, n, seed and temperature (the engine's results do not
    depend on threads or cache). Returns int32 ids."""
    if n < 1:
        raise ValueError("n must be >= 1")
    v, owned = _open(vault)
    try:
        vocab = v.config["vocab_size"]
        first = int(np.random.default_rng([seed, 0x5eed]).integers(vocab))
        ids = [first]
        if n > 1:
            with v.session(cache_bytes=_cache_bytes(v, cache_bytes), threads=threads,
                           context=max(n + 1, 64)) as s:
                ids.extend(s.generate([first], max_tokens=n - 1, temperature=temperature, top_p=top_p,
                                      seed=seed))
        return np.asarray(ids, dtype=np.int32)
    finally:
        if owned:
            v.close()


def _cache_bytes(v, cache_bytes):
    if cache_bytes is not None:
        return int(cache_bytes)
    return int(min(v.expert_bytes, 2 << 30))


# ------------------------------------------------------------------------------ statistics

def stats_from_routes(routes, num_experts: int, top_k: int, chunk: int = UNION_CHUNK) -> list[dict | None]:
    """Per layer, the statistics of explicit routing ((T, k) expert ids, None for dense layers),
    e.g. ReferenceModel.routing(ids): overlap over every adjacent pair."""
    out = []
    for r in routes:
        if r is None:
            out.append(None)
            continue
        r = np.asarray(r)
        T = r.shape[0]
        m = np.zeros((T, num_experts), dtype=bool)
        np.put_along_axis(m, r, True, axis=1)
        d = {"overlap": float((m[1:] & m[:-1]).sum(1).mean() / top_k) if T > 1 else float("nan"),
             "top20_share": top_share(m.sum(0)),
             "union45": (float(np.mean([m[s:s + chunk].any(0).sum() for s in range(0, T - chunk + 1, chunk)]))
                         if T >= chunk else float("nan"))}
        out.append(d)
    return out


def _engine_pass(s, ids, chunk: int, n_layers: int, want_counts: bool):
    """Feed ids as layer-major chunks of `chunk` tokens from position 0; per full chunk the
    per-layer union sizes (and, when want_counts, the per-expert counts)."""
    from ._ffi import check, ffi, lib
    s.reset()
    sizes = ffi.new("uint32_t[]", n_layers)
    unions, counts = [], None
    if want_counts:
        E = s.vault.config["num_experts"]
        buf = ffi.new("uint64_t[]", E)
        counts = np.zeros((n_layers, E), dtype=np.uint64)
    arr = np.ascontiguousarray(ids, dtype=np.int32)
    for start in range(0, len(arr) - chunk + 1, chunk):
        part = arr[start:start + chunk]
        if want_counts:
            check(lib.smoe_stats_reset(s.handle))
        check(lib.smoe_prefill_chunk(s.handle, ffi.cast("int32_t *", ffi.from_buffer(part)), len(part), ffi.NULL, ffi.NULL))
        check(lib.smoe_stats_union_sizes(s.handle, sizes, n_layers))
        unions.append([int(sizes[i]) for i in range(n_layers)])
        if want_counts:
            for layer in range(n_layers):
                check(lib.smoe_stats_expert_counts(s.handle, layer, buf, E))
                counts[layer] += np.frombuffer(ffi.buffer(buf), dtype=np.uint64)
    return (np.asarray(unions, dtype=np.int64).reshape(-1, n_layers),
            None if counts is None else counts.astype(np.int64))


def routing_stats(vault, tokens: int = DEFAULT_TOKENS, seed: int = 0, ids=None, skew: str = "auto",
                  threads: int | None = None, cache_bytes: int | None = None,
                  temperature: float = DEFAULT_TEMPERATURE, chunk: int = UNION_CHUNK) -> dict:
    """Measure a vault's routing through the engine (module docstring says how).

    ids: the prompt (default coherent_prompt(vault, tokens, seed, temperature)). skew: where the
    per-expert counts come from: "engine" (or "auto", the same), "reference" (the numpy
    reference's routing) or "none".
    Returns {"tokens", "num_experts", "top_k", "skew_source", "uniform": {...},
    "layers": [per layer {"layer", "overlap", "top20_share", "union45"} or None if dense],
    "overall": the means over sparse layers}."""
    if skew not in ("auto", "engine", "reference", "none"):
        raise ValueError(f"skew must be auto, engine, reference or none, not {skew!r}")
    v, owned = _open(vault)
    try:
        cfg = v.config
        E, k, L = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["num_hidden_layers"]
        if ids is None:
            ids = coherent_prompt(v, tokens, seed=seed, temperature=temperature, threads=threads,
                                  cache_bytes=cache_bytes)
        ids = np.asarray(ids, dtype=np.int32).reshape(-1)
        if ids.size < 2:
            raise ValueError("need at least 2 tokens")
        if skew == "auto":
            skew = "engine"
        sparse = [v.layer_is_sparse(l) for l in range(L)]
        with v.session(cache_bytes=_cache_bytes(v, cache_bytes), threads=threads,
                       chunk=max(chunk, 2), context=max(len(ids) + 1, 64)) as s:
            pairs, counts = _engine_pass(s, ids, 2, L, skew == "engine")
            big, _ = (_engine_pass(s, ids, chunk, L, False) if len(ids) >= chunk else (None, None))
        ref = None
        if skew == "reference":
            from .reference import ReferenceModel
            with ReferenceModel(v.path) as model:
                ref = stats_from_routes(model.routing(ids), E, k, chunk)
        layers = []
        for l in range(L):
            if not sparse[l]:
                layers.append(None)
                continue
            d = {"layer": l, "overlap": float(np.mean((2 * k - pairs[:, l]) / k))}
            if skew == "engine":
                d["top20_share"] = top_share(counts[l])
            elif ref is not None:
                d["top20_share"] = ref[l]["top20_share"]
            else:
                d["top20_share"] = None
            d["union45"] = float(big[:, l].mean()) if big is not None and len(big) else None
            layers.append(d)
        live = [d for d in layers if d is not None]

        def mean(key):
            vals = [d[key] for d in live if d[key] is not None]
            return float(np.mean(vals)) if vals else None

        overall = {key: mean(key) for key in ("overlap", "top20_share", "union45")}
        for key in ("overlap", "top20_share", "union45"):
            vals = [d[key] for d in live if d[key] is not None]
            overall[key + "_min"] = float(min(vals)) if vals else None
            overall[key + "_max"] = float(max(vals)) if vals else None
        return {"vault": str(v.path), "tokens": int(ids.size), "num_experts": E, "top_k": k,
                "pairs": int(pairs.shape[0]), "chunks45": 0 if big is None else int(len(big)),
                "skew_source": None if skew == "none" else skew,
                "uniform": uniform_expectations(E, k, chunk, tokens=int(ids.size)),
                "layers": layers, "overall": overall}
    finally:
        if owned:
            v.close()


def format_stats(st: dict) -> str:
    """A table of routing_stats' result."""
    def f(x, spec):
        return "-" if x is None else format(x, spec)
    u = st["uniform"]
    lines = [f"routing over {st['tokens']} prompt tokens ({st['pairs']} adjacent pairs, "
             f"{st['chunks45']} chunks of {UNION_CHUNK}; skew from {st['skew_source'] or 'nowhere: no counts'})",
             f"uniform routing would give overlap {u['overlap']:.3f}, top-20% share {u['top20_share']:.3f}"
             + (f" ({u['top20_share_at_tokens']:.3f} over {u['tokens']} tokens: finite counts)"
                if "top20_share_at_tokens" in u else "")
             + f", 45-token union {u['union45']:.1f}",
             f"{'layer':>5}  {'overlap':>7}  {'top20%':>6}  {'union45':>7}"]
    for d in st["layers"]:
        if d is not None:
            lines.append(f"{d['layer']:>5}  {f(d['overlap'], '7.3f')}  {f(d['top20_share'], '6.3f')}  "
                         f"{f(d['union45'], '7.1f')}")
    o = st["overall"]
    lines.append(f"{'all':>5}  {f(o['overlap'], '7.3f')}  {f(o['top20_share'], '6.3f')}  {f(o['union45'], '7.1f')}"
                 f"   (per-layer range: overlap {f(o['overlap_min'], '.3f')}..{f(o['overlap_max'], '.3f')}, "
                 f"share {f(o['top20_share_min'], '.3f')}..{f(o['top20_share_max'], '.3f')})")
    return "\n".join(lines)


__all__ = ["coherent_prompt", "routing_stats", "stats_from_routes", "top_share", "format_stats",
           "uniform_expectations", "uniform_share"]
