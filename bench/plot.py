"""Plots of `python -m pysmoe bench --json` records (matplotlib: pip install 'pysmoe[bench]').

    .venv/bin/python bench/plot.py bench/results/a3b.json bench/results/mini.json --out bench/results

For each record: <name>-ttft.png, TTFT against prompt length (log-log) for every prefill path
measured, the I/O floor and the compute floor; and, over all the records given, decode-tps.png,
decode tokens/s against the cache budget (as a fraction of the expert bytes; "every expert
resident" is plotted at 1.0). <name> is the JSON file's stem.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", nargs="+", help="JSON files written by python -m pysmoe bench --json")
    ap.add_argument("--out", default=".", help="directory for the PNGs (default .)")
    args = ap.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench/plot.py needs matplotlib: pip install 'pysmoe[bench]'", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    style = {"layer-major": ("o-", "C0"), "token-serial": ("s-", "C1")}
    decode_pts = []
    for path in map(pathlib.Path, args.records):
        res = json.loads(path.read_text())
        rows = res["ttft"]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for p, (marker, color) in style.items():
            pts = [(r["prompt_tokens"], r["paths"][p]["ttft_s"]) for r in rows if p in r["paths"]]
            if pts:
                ax.plot(*zip(*pts), marker, color=color, label=f"pysmoe {p} (cold)")
        for key, label, ls in (("io_floor_s", "I/O floor", "--"), ("compute_floor_s", "compute floor", ":")):
            pts = [(r["prompt_tokens"], r[key]) for r in rows if r.get(key)]
            if pts:
                ax.plot(*zip(*pts), ls, color="k" if key == "io_floor_s" else "0.5", label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("time to first token (s)")
        s, v = res["settings"], res["vault"]
        ax.set_title(f"{path.stem}: {v['layers']} layers x {v['experts']} experts, cache "
                     f"{100 * s['cache_frac']:.0f}%, chunk {s['chunk']}, {s['threads']} threads", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"{path.stem}-ttft.png", dpi=110)
        plt.close(fig)
        for kind, d in res.get("decode", {}).items():
            frac = s["cache_frac"] if kind == "budget" else 1.0
            decode_pts.append((path.stem, frac, d["tps"]))
        print(out / f"{path.stem}-ttft.png")
    if decode_pts:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name in dict.fromkeys(n for n, _, _ in decode_pts):
            pts = sorted((f, t) for n, f, t in decode_pts if n == name)
            ax.plot(*zip(*pts), "o-", label=name)
        ax.set_xlabel("cache budget / expert bytes (1.0: every expert resident)")
        ax.set_ylabel("decode tokens/s")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "decode-tps.png", dpi=110)
        plt.close(fig)
        print(out / "decode-tps.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
