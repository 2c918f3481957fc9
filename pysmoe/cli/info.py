"""python -m pysmoe info VAULT: a vault's config, sizes and formats (--routing-stats: how it routes)."""
from __future__ import annotations

import argparse
import json

from .args import int_range, seed


def add_parser(p: argparse.ArgumentParser, name: str = "info") -> None:
    p.add_argument("vault", help="vault directory")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--routing-stats", action="store_true",
                   help="run the engine over a prompt sampled from the model and report adjacent-token "
                        "expert overlap, top-20%% expert share and 45-token union size per layer")
    p.add_argument("--tokens", type=int_range(2), default=256, help="prompt tokens for --routing-stats (default 256)")
    p.add_argument("--seed", type=seed, default=0, help="prompt seed for --routing-stats (default 0)")
    p.add_argument("--skew", default="auto", choices=("auto", "engine", "reference", "none"),
                   help="where --routing-stats gets per-expert counts (default auto)")


def run(args) -> int:
    from ..engine import open_vault
    from ..errors import Unsupported
    from ..vaultio import info
    try:
        vault = open_vault(args.vault)  # the C parser validates header, tables and the dense CRC
    except Unsupported as e:
        # a valid vault this build cannot run (a group size or scale dtype its kernels lack):
        # still describe it, from the pure-Python reader
        if args.json or args.routing_stats:
            raise
        print(f"{info(args.vault)}\nengine     cannot run it: {e}")
        return 0
    with vault:
        if args.routing_stats:
            from ..routing import format_stats, routing_stats
            st = routing_stats(vault, tokens=args.tokens, seed=args.seed, skew=args.skew)
            print(json.dumps(st, indent=1) if args.json else f"{info(args.vault)}\n\n{format_stats(st)}")
            return 0
        if args.json:
            print(json.dumps({"config": vault.config, "blob_bytes": vault.blob_bytes, "dense_bytes": vault.dense_bytes,
                              "paged_bytes": vault.paged_bytes, "expert_bytes": vault.expert_bytes,
                              "file_bytes": vault.file_bytes}, indent=1))
        else:
            print(info(args.vault))
    return 0
