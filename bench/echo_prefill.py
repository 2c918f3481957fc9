"""The cost of an echo's log-probabilities (the server's echo + logprobs, lm-eval's log-likelihoods):
a prompt's plain prefill, its prefill handing back the logits after every position
(Session.prefill_logits), and a token-serial walk asking for each position's logits; checks that
the two sets of logits are bit-identical. bench/RESULTS.md, "Echo log-probabilities from the
prefill".

    python bench/echo_prefill.py [VAULT] [--tokens 256] [--threads 2] [--repeats 7]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import pysmoe
from pysmoe.demo import ensure_demo_vault


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("vault", nargs="?", help="vault directory (default: the demo vault)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    vault = pysmoe.open_vault(args.vault or ensure_demo_vault())
    text = (ensure_demo_vault() / "heldout.txt").read_text()
    ids = (vault.tokenizer.encode(text) if vault.tokenizer is not None else [])[:args.tokens]
    ids = ids or [i % vault.config["vocab_size"] for i in range(1, args.tokens + 1)]
    with vault.session(cache_bytes=vault.expert_bytes + vault.blob_bytes, threads=args.threads,
                       chunk=len(ids)) as s:
        def best(fn):
            times = []
            for _ in range(args.repeats):
                s.reset()
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return min(times)
        s.prefill(ids)  # the experts into the cache
        plain = best(lambda: s.prefill(ids))
        rows = best(lambda: s.prefill_logits(ids, range(len(ids))))
        serial = best(lambda: [s.decode(t) for t in ids])
        s.reset()
        echo = s.prefill_logits(ids, range(len(ids)))
        s.reset()
        walk = np.stack([s.decode(t) for t in ids])
    print(f"{len(ids)} tokens, vocab {vault.config['vocab_size']}, {args.threads} threads, best of {args.repeats}: "
          f"prefill {plain * 1e3:.1f} ms, prefill_logits every row {rows * 1e3:.1f} ms, "
          f"token-serial with logits {serial * 1e3:.1f} ms; bit-identical: {np.array_equal(echo, walk)}")


if __name__ == "__main__":
    main()
