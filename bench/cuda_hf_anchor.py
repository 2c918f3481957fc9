"""transformers on the GPU, the anchor of issue 15: a Qwen3-MoE of the a3b shape in bf16 with random
weights, batch 1, prefill tokens/s at each length and decode tokens/s, on the same GPU and in the
same device run as bench/cuda_bench.py.

    python bench/cuda_hf_anchor.py --lengths 45,256,1024 --decode 16 --json OUT

Needs torch with CUDA and transformers (the device machine's own; not a pysmoe dependency). The
model is built on the GPU directly (about 61 GB in bf16); its weights are transformers' own random
initialisation, so only the speed means anything. Medians of --repeats after one warm-up each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
           num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
           num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
           max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="45,256,1024")
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        import torch
        import transformers
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    except ImportError as e:
        print(f"cuda_hf_anchor: {e}: nothing to measure", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("cuda_hf_anchor: no CUDA device", file=sys.stderr)
        return 2
    cfg = Qwen3MoeConfig(**dict(A3B, num_hidden_layers=args.layers))
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
        # Random weights set here, not left to the constructor (which may skip initialising, leaving
        # zeros: every router then picks the same 8 experts, and a prefill reads 8 of 128): normal
        # with std 0.02, norms at 1, so that routing spreads over the experts as a real model's does.
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    out = {"transformers": transformers.__version__, "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(0), "layers": args.layers, "build_s": build_s,
           "attn_implementation": getattr(model.config, "_attn_implementation", None), "prefill_tps": {},
           "prefill_runs_s": {}}
    print(json.dumps({k: out[k] for k in ("transformers", "torch", "gpu", "build_s", "attn_implementation")}),
          flush=True)
    gen = torch.Generator(device="cpu").manual_seed(1)
    with torch.inference_mode():
        for n in [int(x) for x in args.lengths.split(",") if x]:
            ids = torch.randint(0, cfg.vocab_size, (1, n), generator=gen).cuda()
            model(input_ids=ids, use_cache=False)  # warm-up
            torch.cuda.synchronize()
            runs = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                model(input_ids=ids, use_cache=False)
                torch.cuda.synchronize()
                runs.append(time.perf_counter() - t)
            out["prefill_runs_s"][str(n)] = runs
            # how many experts the routing spreads over (layer 0 and the last layer, this prompt)
            o = model(input_ids=ids, use_cache=False, output_router_logits=True)
            rl = getattr(o, "router_logits", None)
            if rl:
                k = cfg.num_experts_per_tok
                out.setdefault("experts_used", {})[str(n)] = [int(torch.unique(rl[i].topk(k, -1).indices).numel())
                                                              for i in (0, len(rl) - 1)]
            out["prefill_tps"][str(n)] = n / statistics.median(runs)
            print(f"transformers prefill {n}: {out['prefill_tps'][str(n)]:.1f} tok/s, experts used (first, last "
                  f"layer): {out.get('experts_used', {}).get(str(n))}", flush=True)
        ids = torch.randint(0, cfg.vocab_size, (1, 45), generator=gen).cuda()
        rates = []
        for _ in range(args.repeats):
            o = model(input_ids=ids, use_cache=True)
            past, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(args.decode):
                o = model(input_ids=nxt, past_key_values=past, use_cache=True)
                past, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            rates.append(args.decode / (time.perf_counter() - t))
        out["decode_tps_runs"] = rates
        out["decode_tps"] = statistics.median(rates)
        print(f"transformers decode: {out['decode_tps']:.2f} tok/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
