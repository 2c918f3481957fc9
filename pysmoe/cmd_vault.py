"""python -m pysmoe info VAULT | verify VAULT"""
from __future__ import annotations

import argparse
import json
import sys
import time


def add_parser(p: argparse.ArgumentParser, name: str) -> None:
    from .argtypes import int_range, seed
    p.add_argument("vault", help="vault directory")
    if name == "info":
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument("--routing-stats", action="store_true",
                       help="run the engine over a prompt sampled from the model and report adjacent-token "
                            "expert overlap, top-20%% expert share and 45-token union size per layer")
        p.add_argument("--tokens", type=int_range(2), default=256, help="prompt tokens for --routing-stats (default 256)")
        p.add_argument("--seed", type=seed, default=0, help="prompt seed for --routing-stats (default 0)")
        p.add_argument("--skew", default="auto", choices=("auto", "engine", "reference", "none"),
                       help="where --routing-stats gets per-expert counts (default auto)")
        p.set_defaults(_cmd="info")
    else:
        p.set_defaults(_cmd="verify")


def run(args) -> int:
    from .engine import open_vault
    from .errors import Unsupported
    try:
        vault = open_vault(args.vault)  # the C parser validates header, tables and the dense CRC
    except Unsupported as e:
        # a valid vault this build cannot run (a group size or scale dtype its kernels lack):
        # still describe it, from the pure-Python reader
        if args._cmd != "info" or args.json or getattr(args, "routing_stats", False):
            raise
        from .vaultio import info
        print(f"{info(args.vault)}\nengine     cannot run it: {e}")
        return 0
    with vault:
        if args._cmd == "verify":
            t0 = time.perf_counter()
            bad = vault.verify()
            dt = time.perf_counter() - t0
            for kind, layer, expert, what in bad:
                where = f"layer {layer} expert {expert}: " if layer >= 0 else ""
                print(f"BAD {kind}: {where}{what}")
            total = vault.file_bytes
            print(f"{args.vault}: {'OK' if not bad else f'{len(bad)} problem(s)'} "
                  f"({total / 1e9:.2f} GB checked in {dt:.1f} s)")
            return 0 if not bad else 1
        from .vaultio import info
        if getattr(args, "routing_stats", False):
            from .routing import format_stats, routing_stats
            st = routing_stats(vault, tokens=args.tokens, seed=args.seed, skew=args.skew)
            print(json.dumps(st, indent=1) if args.json else f"{info(args.vault)}\n\n{format_stats(st)}")
            return 0
        if args.json:
            print(json.dumps({"config": vault.config, "blob_bytes": vault.blob_bytes, "dense_bytes": vault.dense_bytes,
                              "expert_bytes": vault.expert_bytes, "file_bytes": vault.file_bytes}, indent=1))
        else:
            print(info(args.vault))
    return 0
