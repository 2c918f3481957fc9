"""KV cache in bf16 and f16 against f32: what it costs in logits, and what it changes in speed.

    python bench/kv_dtype.py accuracy [--tokens 384]
        transformers' Qwen3MoeForCausalLM on random weights (tests/hf_models.py: the oracle
        models of tests/test_oracle.py, with max_position_embeddings raised to fit), converted to
        an f32 vault. A sequence the f32 engine samples from the model itself (temperature 1), so
        its log-probabilities are those of text the model finds likely; then, per KV type, the
        logits at every position (token-serial, f32 activations so that only the KV type
        differs). Per model: max |Δ logit| against f32 KV, mean |Δ log p(next token)|, the
        perplexity of the sequence, and how many greedy choices (argmax) flip; and max |logit −
        transformers| for each, for scale.

    python bench/kv_dtype.py speed VAULT [--prompt 1024] [--decode 32] [--repeats 3]
        one resident session per KV type (cache = every expert, warmed by one prompt first),
        alternated in each repeat: prefill of --prompt tokens (layer-major) and --decode greedy
        decode steps after it; medians. Also the max |Δ logit| of the prompt's last logits
        against f32.

Prints a Markdown table; --json OUT writes the raw runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

DTYPES = ("f32", "bf16", "f16")
# tests/test_oracle.py's cases (its CASES), with room for the sequence
CASES = {
    "base": dict(),
    "head_dim": dict(head_dim=24, num_key_value_heads=1, rope_theta=1e6),
    "mlp_only_layers": dict(num_hidden_layers=3, mlp_only_layers=[0, 2]),
    "sparse_step_2": dict(num_hidden_layers=4, decoder_sparse_step=2, num_experts=16, num_experts_per_tok=4),
    "no_norm_topk": dict(norm_topk_prob=False, num_experts=16, num_experts_per_tok=3),
    "tied": dict(tie_word_embeddings=True),
}


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def all_logits(vault, ids, kv_dtype) -> np.ndarray:
    """(len(ids), vocab) logits after each prefix, token-serial, f32 activations."""
    with vault.session(context=len(ids), kv_dtype=kv_dtype, activations="f32", threads=1) as s:
        return np.stack([s.decode(i) for i in ids])


def accuracy(args) -> dict:
    import pysmoe
    from hf_models import hf_logits, make_hf_model
    from pysmoe.convert import convert_checkpoint

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, over in CASES.items():
            d = Path(tmp) / name
            path, model = make_hf_model(d, seed=0, max_position_embeddings=max(512, args.tokens), **over)
            vpath = convert_checkpoint(path, d / "f32", experts="f32", dense="f32", progress=False)
            with pysmoe.open_vault(vpath) as v:
                with v.session(context=args.tokens, kv_dtype="f32") as s:  # the model's own text
                    ids = [int(np.random.default_rng(0).integers(v.config["vocab_size"]))]
                    ids += list(s.generate(ids, max_tokens=args.tokens - 1, temperature=1.0, seed=1))
                ids = ids[:args.tokens]
                hf = hf_logits(model, ids)
                got = {dt: all_logits(v, ids, dt) for dt in DTYPES}
            nxt = np.array(ids[1:])
            lp = {dt: log_softmax(got[dt][:-1])[np.arange(len(nxt)), nxt] for dt in DTYPES}
            row = {"model": name, "tokens": len(ids), "hf_max_err": {}, "ppl": {}}
            for dt in DTYPES:
                row["hf_max_err"][dt] = float(np.max(np.abs(got[dt] - hf)))
                row["ppl"][dt] = float(np.exp(-lp[dt].mean()))
            for dt in DTYPES[1:]:
                row[dt] = {"max_dlogit": float(np.max(np.abs(got[dt] - got["f32"]))),
                           "mean_dlogp": float(np.mean(np.abs(lp[dt] - lp["f32"]))),
                           "max_dlogp": float(np.max(np.abs(lp[dt] - lp["f32"]))),
                           "argmax_flips": int(np.sum(got[dt].argmax(-1) != got["f32"].argmax(-1)))}
            row["logit_scale"] = float(np.max(np.abs(got["f32"])))
            rows.append(row)
            print(f"{name}: {json.dumps(row)}", file=sys.stderr, flush=True)
    print(f"\n| model | tokens | max \\|logit\\| | KV | max \\|Δ logit\\| vs f32 | mean \\|Δ log p\\| | max \\|Δ log p\\| "
          f"| argmax flips | perplexity (f32 {'/'.join(DTYPES[1:])}) | max \\|logit − transformers\\| |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for dt in DTYPES[1:]:
            x = r[dt]
            print(f"| {r['model']} | {r['tokens']} | {r['logit_scale']:.2f} | {dt} | {x['max_dlogit']:.2e} | "
                  f"{x['mean_dlogp']:.2e} | {x['max_dlogp']:.2e} | {x['argmax_flips']} | "
                  f"{r['ppl']['f32']:.4f} → {r['ppl'][dt]:.4f} | {r['hf_max_err']['f32']:.1e} → {r['hf_max_err'][dt]:.1e} |")
    return {"accuracy": rows}


def speed(args) -> dict:
    import pysmoe

    v = pysmoe.open_vault(args.vault)
    V = v.config["vocab_size"]
    ids = [int(i) for i in np.random.default_rng(args.seed).integers(0, V, size=args.prompt)]
    ctx = args.prompt + args.decode + 1
    sessions = {dt: v.session(cache_bytes=v.expert_bytes * 2, context=ctx, threads=args.threads, kv_dtype=dt)
                for dt in DTYPES}
    for s in sessions.values():  # every expert into the cache
        s.prefill(ids[:min(64, len(ids))])
    runs = {dt: [] for dt in DTYPES}
    last = {}
    for r in range(args.repeats):
        for dt in (DTYPES if r % 2 == 0 else DTYPES[::-1]):
            s = sessions[dt]
            s.reset()
            s.reset_stats()
            t0 = time.perf_counter()
            logits = s.prefill(ids)
            t_pre = time.perf_counter() - t0
            last[dt] = logits
            nxt = int(np.argmax(logits))
            t0 = time.perf_counter()
            for _ in range(args.decode):
                nxt = int(np.argmax(s.decode(nxt)))
            t_dec = time.perf_counter() - t0
            st = s.stats()
            assert st["blob_reads"] == 0, f"{dt}: the resident session read {st['blob_reads']} blobs"
            runs[dt].append({"prefill_s": t_pre, "decode_s": t_dec, "kv_bytes": st["kv_bytes"],
                             "resident_bytes": st["resident_bytes"]})
            print(f"rep {r + 1} {dt}: prefill {args.prompt / t_pre:.1f} tok/s, decode {args.decode / t_dec:.2f} tok/s",
                  file=sys.stderr, flush=True)
    for s in sessions.values():
        s.close()
    print(f"\n| KV | KV bytes (context {ctx}) | prefill {args.prompt} tok/s | decode tok/s (after {args.prompt}) "
          f"| max \\|Δ logit\\| vs f32 |")
    print("|---|---|---|---|---|")
    med = {}
    for dt in DTYPES:
        p = statistics.median(args.prompt / x["prefill_s"] for x in runs[dt])
        d = statistics.median(args.decode / x["decode_s"] for x in runs[dt])
        diff = float(np.max(np.abs(last[dt] - last["f32"])))
        med[dt] = {"prefill_tps": p, "decode_tps": d, "max_dlogit": diff}
        print(f"| {dt} | {runs[dt][0]['kv_bytes'] / 2**20:.1f} MiB | {p:.1f} | {d:.2f} | {diff:.2e} |")
    return {"speed": {"runs": runs, "medians": med, "prompt": args.prompt, "decode": args.decode}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("accuracy")
    a.add_argument("--tokens", type=int, default=384)
    s = sub.add_parser("speed")
    s.add_argument("vault")
    s.add_argument("--prompt", type=int, default=1024)
    s.add_argument("--decode", type=int, default=32)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--seed", type=int, default=0)
    for x in (a, s):
        x.add_argument("--json", default=None)
    args = p.parse_args()
    print(f"load average before {os.getloadavg()}", file=sys.stderr)
    res = accuracy(args) if args.what == "accuracy" else speed(args)
    res["loadavg_after"] = os.getloadavg()
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in res['loadavg_after'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
