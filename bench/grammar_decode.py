"""Decode speed with and without a grammar: the demo vault, one session, the server's own loop
(Constraint.mask → Session.set_mask → decode_next → Constraint.consume) against a plain
decode_next loop.

    python bench/grammar_decode.py [--tokens N] [--rounds R]

Both loops draw at temperature 0.7 with the same seeds; the constrained one under json_object
(server.grammar), restarting from the prompt each time its reply ends, until N tokens are drawn.
Prints tokens per CPU second of each (one compute thread, timed with the thread's CPU clock so that
other work on a shared machine does not count) and the mean milliseconds a token's mask work
(llguidance's mask + Session.set_mask) took; the best of R rounds.

Then the sampler's side alone on a Qwen3-sized vocabulary: a synthetic "tiny" vault with
vocab_size 151,936 (made once under /tmp), decode_next with and without a mask that allows every
other id (set before each step), at temperature 0.7.
"""
from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    clock = time.thread_time
    import pysmoe
    from pysmoe.demo import ensure_demo_vault
    from pysmoe.server.grammar import Grammars

    with pysmoe.open_vault(ensure_demo_vault()) as v, v.session(threads=1) as s:
        tok = v.tokenizer
        prompt = tok.apply_chat_template([{"role": "user", "content": "Describe a cat as JSON."}])
        grammars = Grammars(tok, v.config["vocab_size"])
        grammars.constraint({"type": "json_object"}, None, None, starts_in_reasoning=False)  # tables built
        best = {}
        for constrained in (False, True) * args.rounds:
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
                    t0 = clock()
                    if c:
                        c.consume(t)
                        if c.done:
                            break
                        s.set_mask(c.mask())
                    t1 = clock()
                    _, t = s.decode_next(t, want_logits=False)
                    t2 = clock()
                    mask_s += t1 - t0
                    decode_s += t2 - t1
                    drawn += 1
            r = (drawn / (decode_s + mask_s), drawn / decode_s, mask_s / drawn * 1e3, seed)
            if constrained not in best or r[0] > best[constrained][0]:
                best[constrained] = r
        for constrained, (tps, dps, ms, replies) in best.items():
            print(f"demo {'json_object' if constrained else 'no grammar':>12}: {tps:7.1f} tok/s "
                  f"(decode alone {dps:7.1f} tok/s; mask {ms:.3f} ms/token), {args.tokens} tokens, {replies} replies",
                  flush=True)
    big_vocab(args, clock)
    return 0


def big_vocab(args, clock) -> None:
    import pathlib

    import numpy as np

    import pysmoe
    from pysmoe.synthesis import synth
    path = pathlib.Path("/tmp/pysmoe-bench-vocab151936")
    if not path.exists():
        synth(path, preset="tiny", seed=0, progress=False, overrides={"vocab_size": 151936})
    with pysmoe.open_vault(path) as v, v.session(threads=1) as s:
        V = v.config["vocab_size"]
        mask = np.full((V + 31) // 32, 0x55555555, dtype=np.uint32)  # every other id
        best = {}
        for masked in (False, True) * args.rounds:
            s.reset()
            s.set_sampler(temperature=0.7, seed=1)
            _, t = s.prefill_next([5, 6, 7], want_logits=False)
            dt = mt = 0.0
            for _ in range(args.tokens // 2):
                t0 = clock()
                if masked:
                    s.set_mask(mask)
                t1 = clock()
                _, t = s.decode_next(t, want_logits=False)
                t2 = clock()
                mt += t1 - t0
                dt += t2 - t1
            n = args.tokens // 2
            r = (dt / n * 1e3, mt / n * 1e3)
            if masked not in best or r[0] < best[masked][0]:
                best[masked] = r
        for masked, (ms, set_ms) in best.items():
            print(f"vocab {V:,} {'masked' if masked else 'plain':>6}: decode_next {ms:.3f} ms/token, "
                  f"set_mask {set_ms:.3f} ms", flush=True)


if __name__ == "__main__":
    sys.exit(main())
