"""python -m pysmoe info VAULT | verify VAULT"""
from __future__ import annotations

import argparse
import json
import sys
import time


def add_parser(p: argparse.ArgumentParser, name: str) -> None:
    p.add_argument("vault", help="vault directory")
    if name == "info":
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(_cmd="info")
    else:
        p.set_defaults(_cmd="verify")


def run(args) -> int:
    from .engine import open_vault
    vault = open_vault(args.vault)  # the C parser validates header, tables and the dense CRC
    with vault:
        if args._cmd == "verify":
            t0 = time.perf_counter()
            bad = vault.verify()
            dt = time.perf_counter() - t0
            for kind, layer, expert in bad:
                where = f"layer {layer} expert {expert}" if kind == "blob" else kind
                print(f"BAD {kind}: {where}")
            total = vault.file_bytes
            print(f"{args.vault}: {'OK' if not bad else f'{len(bad)} bad region(s)'} "
                  f"({total / 1e9:.2f} GB checked in {dt:.1f} s)")
            return 0 if not bad else 1
        from .vaultio import info
        if args.json:
            print(json.dumps({"config": vault.config, "blob_bytes": vault.blob_bytes, "dense_bytes": vault.dense_bytes,
                              "expert_bytes": vault.expert_bytes, "file_bytes": vault.file_bytes}, indent=1))
        else:
            print(info(args.vault))
    return 0
