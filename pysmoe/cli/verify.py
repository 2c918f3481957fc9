"""python -m pysmoe verify VAULT: check every checksum of a vault (exit 1 if any is bad)."""
from __future__ import annotations

import argparse
import time


def add_parser(p: argparse.ArgumentParser, name: str = "verify") -> None:
    p.add_argument("vault", help="vault directory")


def run(args) -> int:
    from ..engine import open_vault
    with open_vault(args.vault) as vault:  # the C parser validates header, tables and the dense CRC
        t0 = time.perf_counter()
        bad = vault.verify()
        dt = time.perf_counter() - t0
        for kind, layer, expert, what in bad:
            where = f"layer {layer} expert {expert}: " if layer >= 0 else ""
            print(f"BAD {kind}: {where}{what}")
        print(f"{args.vault}: {'OK' if not bad else f'{len(bad)} problem(s)'} "
              f"({vault.file_bytes / 1e9:.2f} GB checked in {dt:.1f} s)")
    return 0 if not bad else 1
