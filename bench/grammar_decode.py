"""Decode speed with and without a grammar: the demo vault, one session, the server's own loop
(Constraint.mask → Session.set_mask → decode_next → Constraint.consume) against a plain
decode_next loop.

    python bench/grammar_decode.py [--tokens N] [--threads T]

Both loops draw at temperature 0.7 with the same seeds; the constrained one under json_object
(server.grammar), restarting from the prompt each time its reply ends, until N tokens are drawn.
Prints tokens/s of each and the mean milliseconds a token's mask work (compute + set) took.
"""
from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    import pysmoe
    from pysmoe.demo import ensure_demo_vault
    from pysmoe.server.grammar import Grammars

    with pysmoe.open_vault(ensure_demo_vault()) as v, v.session(threads=args.threads) as s:
        tok = v.tokenizer
        prompt = tok.apply_chat_template([{"role": "user", "content": "Describe a cat as JSON."}])
        grammars = Grammars(tok, v.config["vocab_size"])
        grammars.constraint({"type": "json_object"}, None, None, starts_in_reasoning=False)  # tables built
        for constrained in (False, True, False, True):
            drawn, decode_s, mask_s, seed = 0, 0.0, 0.0, 0
            while drawn < args.tokens:
                s.reset()
                s.set_sampler(temperature=0.7, seed=seed)
                seed += 1
                c = grammars.constraint({"type": "json_object"}, None, None, starts_in_reasoning=False) \
                    if constrained else None
                if c:
                    s.set_mask(c.mask())
                _, t = s.prefill_next(prompt, want_logits=False)
                while drawn < args.tokens and s.position + 1 < s.context:
                    t0 = time.perf_counter()
                    if c:
                        c.consume(t)
                        if c.done:
                            break
                        s.set_mask(c.mask())
                    t1 = time.perf_counter()
                    _, t = s.decode_next(t, want_logits=False)
                    t2 = time.perf_counter()
                    mask_s += t1 - t0
                    decode_s += t2 - t1
                    drawn += 1
            print(f"{'json_object' if constrained else 'no grammar':>12}: {drawn / (decode_s + mask_s):7.1f} tok/s "
                  f"(decode alone {drawn / decode_s:7.1f} tok/s; mask {mask_s / drawn * 1e3:.3f} ms/token) "
                  f"over {drawn} tokens, {seed} replies", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
