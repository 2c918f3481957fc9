"""Plots of `python -m pysmoe bench --json` records, with llama.cpp from `bench/peer.py --json`
(matplotlib: pip install '.[bench]' in the checkout).

    .venv/bin/python bench/plot.py bench/results/a3b.json [more records] [--peer bench/results/peer-a3b.json] \
        --out bench/results

For each record (<name> is the JSON file's stem):

- <name>-ttft.png: TTFT against prompt length (log-log): pysmoe layer-major and token-serial
  (cold, the record's cache budget), the I/O floor and the compute floor from the record; from a
  peer record of the same vault: llama.cpp cold (inside a memory cgroup of pysmoe's memory at
  the peer run's cache budget), llama.cpp with everything in memory when the peer ran its warm
  mode, and the peer run's own pysmoe cold TTFT (hollow markers: the same engine measured in the
  other run, to show how far the two runs' conditions differ).
- <name>-decode-budget.png, when the record has a --decode-budgets curve: decode tokens/s against
  the cache budget, as a percentage of the expert bytes (bottom axis) and in MiB (top axis), the
  median with the min-max of the repeats as error bars.

Over all the records given, decode-tps.png: decode tokens/s against the cache budget as a
fraction of the expert bytes, one line per record (its budget curve when it has one; otherwise
its two points, the budget and "every expert resident" at 1.0).

A peer record goes with the bench record of the same vault shape (layers, experts, top-k,
expert bytes); with one bench record and one peer record they are paired regardless, with a
warning when the shapes differ.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

MiB = 1 << 20
SHAPE = ("layers", "experts", "top_k", "expert_bytes")


def _shape(info: dict | None):
    return tuple(info.get(k) for k in SHAPE) if info else None


def _peer_series(peer: dict, mode: str, who: str) -> list[tuple[int, float]]:
    """(prompt tokens, TTFT) of one engine in one mode of a peer.py record."""
    m = peer.get(mode) or {}
    pts = []
    for n, r in m.items():
        if str(n).isdigit() and isinstance(r, dict) and (r.get(who) or {}).get("ttft_s"):
            pts.append((int(n), r[who]["ttft_s"]))
    return sorted(pts)


def pair_peers(records: list[dict], peers: list[dict], warn) -> dict[int, list[dict]]:
    """Bench record index -> the peer records of its vault."""
    out = {i: [] for i in range(len(records))}
    for p in peers:
        shape = _shape(p.get("vault_info"))
        match = [i for i, r in enumerate(records) if shape is not None and _shape(r["vault"]) == shape]
        if not match and len(records) == 1:
            warn(f"peer record {p.get('_path')}: vault shape {shape} is not the bench record's "
                 f"{_shape(records[0]['vault'])}; plotted with it anyway")
            match = [0]
        if not match:
            warn(f"peer record {p.get('_path')}: no bench record of the same vault shape {shape}; not plotted")
        for i in match:
            out[i].append(p)
    return out


def plot_ttft(ax, res: dict, peers: list[dict], warn) -> None:
    rows = res["ttft"]
    s, v = res["settings"], res["vault"]
    style = {"layer-major": ("o-", "C0"), "token-serial": ("s-", "C1")}
    for p, (marker, color) in style.items():
        pts = [(r["prompt_tokens"], r["paths"][p]["ttft_s"]) for r in rows if p in r["paths"]]
        if pts:
            ax.plot(*zip(*pts), marker, color=color, label=f"pysmoe {p}, cold, cache {100 * s['cache_frac']:.0f}%")
    for key, label, ls, color in (("io_floor_s", "I/O floor (union bytes / disk bandwidth)", "--", "k"),
                                  ("compute_floor_s", "compute floor (every expert resident)", ":", "0.5")):
        pts = [(r["prompt_tokens"], r[key]) for r in rows if r.get(key)]
        if pts:
            ax.plot(*zip(*pts), ls, color=color, label=label)
    for peer in peers:
        cold = peer.get("cold") or {}
        info = cold.get("info") or {}
        frac = (info["cache_bytes"] / peer["vault_info"]["expert_bytes"]
                if info.get("cache_bytes") is not None and peer.get("vault_info") else peer.get("cache_frac"))
        if frac is not None and abs(frac - s["cache_frac"]) > 0.01:
            warn(f"peer record {peer.get('_path')}: its cold budget used a {100 * frac:.0f}% cache, this record "
                 f"{100 * s['cache_frac']:.0f}%")
        pts = _peer_series(peer, "cold", "llama.cpp")
        if pts:
            budget = f"{info['budget_bytes'] / MiB:,.0f} MiB" if info.get("budget_bytes") else "pysmoe's memory"
            ax.plot(*zip(*pts), "D-", color="C3",
                    label=f"llama.cpp, cold, memory cgroup {budget} (= pysmoe at a "
                          f"{100 * (frac or 0):.0f}% cache)")
        pts = _peer_series(peer, "cold", "pysmoe")
        if pts:
            ax.plot(*zip(*pts), "o", mfc="none", color="C0", alpha=0.6,
                    label=f"pysmoe layer-major, cold, in the peer run (chunk: library default)")
        pts = _peer_series(peer, "warm", "llama.cpp")
        if pts:
            how = "in blocks, not alternated" if (peer.get("warm") or {}).get("alternated") is False else "alternated"
            ax.plot(*zip(*pts), "D:", color="C3", alpha=0.6, label=f"llama.cpp, everything in memory ({how})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    lengths = sorted({r["prompt_tokens"] for r in rows})
    ax.set_xticks(lengths)
    ax.set_xticklabels([str(n) for n in lengths])
    ax.minorticks_off()
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"{v['layers']} layers x {v['experts']} experts (top-{v['top_k']}), cache "
                 f"{100 * s['cache_frac']:.0f}%, chunk {s['chunk']}, {s['threads']} threads", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)


def plot_budget(ax, res: dict) -> None:
    c, v = res["decode_budgets"], res["vault"]
    pts = [b for b in c["budgets"] if b.get("tps")]
    x = [100 * b["cache_frac"] for b in pts]
    y = [b["tps"] for b in pts]
    err = [[b["tps"] - b["tps_spread"][0] for b in pts], [b["tps_spread"][1] - b["tps"] for b in pts]]
    ax.errorbar(x, y, yerr=err, fmt="o-", capsize=3, label="pysmoe decode (median, min-max of the repeats)")
    for b in pts:
        if b.get("hit_rate") is not None:
            ax.annotate(f"hit {b['hit_rate']:.0%}", (100 * b["cache_frac"], b["tps"]), textcoords="offset points",
                        xytext=(4, -12), fontsize=7, color="0.3")
    skipped = [f"{b['budget_pct']:g}%" for b in c["budgets"] if not b.get("tps")]
    ax.set_xlabel("cache budget (% of the expert bytes)")
    ax.set_ylabel("decode tokens/s")
    ax.set_xlim(0, 105)
    ax.set_ylim(bottom=0)
    mib = v["expert_bytes"] / MiB / 100
    top = ax.secondary_xaxis("top", functions=(lambda p: p * mib, lambda m: m / mib))
    top.set_xlabel("cache budget (MiB)")
    ax.set_title(f"{v['layers']} layers x {v['experts']} experts: {c['decode_tokens']} greedy tokens after a "
                 f"{c['prompt_tokens']}-token prompt, fresh session per run"
                 + (f"; skipped (memory): {', '.join(skipped)}" if skipped else ""), fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", nargs="+", help="JSON files written by python -m pysmoe bench --json")
    ap.add_argument("--peer", action="append", default=[], metavar="PEER_JSON",
                    help="a JSON file written by bench/peer.py --json (repeatable): llama.cpp on the TTFT plot")
    ap.add_argument("--out", default=".", help="directory for the PNGs (default .)")
    args = ap.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench/plot.py needs matplotlib: pip install '.[bench]' in the checkout", file=sys.stderr)
        return 2

    def warn(msg):
        print(f"plot.py: WARNING: {msg}", file=sys.stderr)

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = list(map(pathlib.Path, args.records))
    records = [json.loads(p.read_text()) for p in paths]
    peers = []
    for p in args.peer:
        peers.append(dict(json.loads(pathlib.Path(p).read_text()), _path=p))
    paired = pair_peers(records, peers, warn)
    decode_pts = []
    for i, (path, res) in enumerate(zip(paths, records)):
        if res.get("ttft"):
            fig, ax = plt.subplots(figsize=(12, 5.5))
            plot_ttft(ax, res, paired[i], warn)
            fig.suptitle(path.stem, fontsize=11)
            fig.tight_layout()
            fig.savefig(out / f"{path.stem}-ttft.png", dpi=110)
            plt.close(fig)
            print(out / f"{path.stem}-ttft.png")
        curve = res.get("decode_budgets")
        if curve and any(b.get("tps") for b in curve["budgets"]):
            fig, ax = plt.subplots(figsize=(8, 5))
            plot_budget(ax, res)
            fig.suptitle(path.stem, fontsize=11)
            fig.tight_layout()
            fig.savefig(out / f"{path.stem}-decode-budget.png", dpi=110)
            plt.close(fig)
            print(out / f"{path.stem}-decode-budget.png")
            decode_pts += [(path.stem, b["cache_frac"], b["tps"]) for b in curve["budgets"] if b.get("tps")]
        else:
            for kind, d in res.get("decode", {}).items():
                frac = res["settings"]["cache_frac"] if kind == "budget" else 1.0
                decode_pts.append((path.stem, frac, d["tps"]))
    if decode_pts:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name in dict.fromkeys(n for n, _, _ in decode_pts):
            pts = sorted((f, t) for n, f, t in decode_pts if n == name)
            ax.plot(*zip(*pts), "o-", label=name)
        ax.set_xlabel("cache budget / expert bytes (1.0: every expert)")
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
