"""python -m pysmoe synth OUT: write a random vault of a preset shape (pysmoe.synthesis)."""
from __future__ import annotations

import sys
import time

from .args import HelpFormatter, int_range, positive_float, positive_int, probability, seed, vault_out


def add_parser(parser, name: str = "synth"):
    """Add synth's arguments to parser (pysmoe.cli passes the subcommand's own parser); given
    the subparsers object of an ArgumentParser instead, make the subcommand first."""
    from ..synthesis import EXPERT_FORMATS, PRESETS, REALISTIC_DEFAULTS, ROUTINGS
    if hasattr(parser, "add_parser"):
        parser = parser.add_parser(name, help="write a random vault of a preset shape", formatter_class=HelpFormatter,
                                   description="Write a random vault of a preset shape, Qwen3-MoE or GLM-4.5 "
                                               "(tiny-glm, glm-4.5-air), for tests and benchmarks.")
    p = parser
    p.add_argument("out", type=vault_out, help="vault directory to write (must be empty or new, unless --force)")
    p.add_argument("--force", action="store_true", help="replace a non-empty OUT (only once the new vault is complete)")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model shape")
    p.add_argument("--seed", type=seed, default=0, help="seed of every random weight (same seed, same bytes)")
    p.add_argument("--layers", type=positive_int, default=None, help="keep only the first N layers")
    p.add_argument("--experts", default="q4", choices=EXPERT_FORMATS, help="expert format")
    p.add_argument("--routing", default="uniform", choices=sorted(ROUTINGS),
                   help="uniform: random routers; realistic: popular experts and locality (docs/synth.md)")
    g = p.add_argument_group("realistic routing knobs (docs/synth.md)")
    d = REALISTIC_DEFAULTS
    g.add_argument("--overlap", type=probability, default=None,
                   help=f"target adjacent-token expert overlap per layer, in (0, 1) (default {d['overlap']})")
    g.add_argument("--top20-share", type=probability, default=None,
                   help=f"target share of routings of a layer's top 20%% experts, in [0.2, 1) "
                        f"(default {d['top20_share']})")
    g.add_argument("--stay", type=probability, default=None,
                   help=f"P(next sampled token keeps the topic), in (0, 1) (default {d['stay']})")
    g.add_argument("--temperature", type=positive_float, default=None,
                   help=f"sampling temperature stay refers to (default {d['temperature']})")
    g.add_argument("--topics", type=int_range(1), default=None, help="topic count (default min(64, hidden/16, vocab/8))")
    g.add_argument("--specific-dims", type=int_range(1), default=None,
                   help="token-specific routing channels (default max(16, topics))")
    p.add_argument("--embedding-in-memory", dest="paged_embedding", action="store_false",
                   help="keep the embedding table in memory (default: left on disk, each token's row read when needed; docs/vault.md 4.1)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from ..synthesis import REALISTIC_DEFAULTS, prepare, synth
    t0 = time.monotonic()
    knobs = {k: getattr(args, k, None) for k in REALISTIC_DEFAULTS}
    knobs = {k: v for k, v in knobs.items() if v is not None}
    try:  # a knob out of range for the preset is bad usage, said before anything is written
        prepare(args.preset, args.seed, args.layers, args.experts, args.routing, knobs=knobs)
    except ValueError as e:
        print(f"pysmoe synth: error: {e}", file=sys.stderr)
        return 2
    out = synth(args.out, preset=args.preset, seed=args.seed, layers=args.layers, experts=args.experts,
                routing=args.routing, progress=not args.quiet, force=args.force,
                paged_embedding=args.paged_embedding, **knobs)
    size = (out / "vault.bin").stat().st_size
    print(f"wrote {out} ({size / 2 ** 20:,.1f} MiB) in {time.monotonic() - t0:.1f} s")
    return 0
