"""Medians over separate `pysmoe bench --repeats 1 --json` runs of one vault (runs alternated with
other vaults' on a shared machine, so each vault's repeats meet different load).

    python bench/median_table.py run1.json run2.json run3.json

Prints, per prompt length, the median (and range) of the layer-major and token-serial TTFT, the
union, the I/O floor and compute floor, TTFT over the larger floor; then decode tok/s with the
bench's cache budget and with every expert resident. Medians of each figure on its own (the I/O
floor of a run is that run's best disk rate)."""
from __future__ import annotations

import json
import statistics
import sys


def _med(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "—"
    return f"{statistics.median(xs):.3g} ({min(xs):.3g}–{max(xs):.3g})" if len(xs) > 1 else f"{xs[0]:.3g}"


def main(paths: list[str]) -> None:
    runs = [json.load(open(p)) for p in paths]
    v = runs[0]["vault"]
    print(f"{v['path']}: {v['layers']} layers, {v['experts']} experts top-{v['top_k']}, "
          f"blob {v['blob_bytes'] / 2**20:.2f} MiB, experts {v['expert_bytes'] / 2**30:.2f} GiB; "
          f"{len(runs)} runs, load {[r['loadavg_before'][0] for r in runs]}")
    print("| prompt | layer-major TTFT s | token-serial TTFT s | union blobs (MiB) | disk GB/s | I/O floor s "
          "| compute floor s | LM / floor |")
    print("|---|---|---|---|---|---|---|---|")
    for i, t in enumerate(runs[0]["ttft"]):
        rows = [r["ttft"][i] for r in runs]
        lm = [x["paths"].get("layer-major", {}).get("ttft_s") for x in rows]
        ts = [x["paths"].get("token-serial", {}).get("ttft_s") for x in rows]
        ratio = [x["paths"].get("layer-major", {}).get("ttft_over_floor") for x in rows]
        print(f"| {t['prompt_tokens']} | {_med(lm)} | {_med(ts)} | {t['exact_union_blobs']} "
              f"({t['exact_union_bytes'] / 2**20:.0f}) | {_med([x['disk_gbps'] for x in rows])} "
              f"| {_med([x['io_floor_s'] for x in rows])} | {_med([x['compute_floor_s'] for x in rows])} "
              f"| {_med(ratio)} |")
    d = [r["decode"] for r in runs]
    print(f"decode tok/s: cache {runs[0]['settings']['cache_frac']:.0%} {_med([x['budget']['tps'] for x in d])} "
          f"({d[0]['budget']['blob_reads_per_token']:.1f} blob reads a token), "
          f"resident {_med([x['resident']['tps'] for x in d])}")


if __name__ == "__main__":
    main(sys.argv[1:])
