"""What a decode step costs in Python beyond the C step (issue 17, item 4).

    python bench/decode_overhead.py VAULT [--threads 2] [--tokens 32] [--repeats 5]

Every expert resident (cache = the whole vault file, warmed by prefills), then per repeat:
`Session.generate` over --tokens tokens and `Session.decode` (logits copied out) over as many,
each timed by the wall clock against the seconds the C library itself counted inside
smoe_decode_step (stats()["decode_s"]). Prints medians in ms per token: wall, C step, and their
difference (cffi call, claim, numpy logits buffer, generator)."""
import argparse
import os
import statistics
import time

import numpy as np

import pysmoe


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("vault")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    v = pysmoe.open_vault(a.vault)
    cache = os.path.getsize(os.path.join(a.vault, "vault.bin"))
    s = v.session(cache_bytes=cache, threads=a.threads, context=1024)
    rng = np.random.default_rng(0)
    vocab = v.config["vocab_size"]
    for _ in range(2):  # warm: every expert read once
        s.reset()
        s.prefill(rng.integers(0, vocab, 256).tolist())
    prompt = rng.integers(0, vocab, 8).tolist()
    rows = {"generate": [], "decode": []}
    for _ in range(a.repeats):
        for how in rows:
            s.reset()
            s.prefill(prompt)
            c0 = s.stats()["decode_s"]
            t0 = time.perf_counter()
            if how == "generate":
                n = sum(1 for _ in s.generate([prompt[-1]], max_tokens=a.tokens))
            else:
                tok = prompt[-1]
                for _ in range(a.tokens):
                    tok = int(np.argmax(s.decode(tok)))
                n = a.tokens
            wall = time.perf_counter() - t0
            rows[how].append((wall / n, (s.stats()["decode_s"] - c0) / n))
    print(f"{a.vault}: threads {a.threads}, {a.tokens} tokens, medians of {a.repeats}; "
          f"load average {os.getloadavg()[0]:.2f}")
    print("| call | wall ms/token | C step ms/token | Python overhead ms/token |")
    print("|---|---|---|---|")
    for how, r in rows.items():
        w = statistics.median(x[0] for x in r)
        c = statistics.median(x[1] for x in r)
        print(f"| Session.{how} | {1e3 * w:.3f} | {1e3 * c:.3f} | {1e3 * (w - c):.3f} |")


if __name__ == "__main__":
    main()
