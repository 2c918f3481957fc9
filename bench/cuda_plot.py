"""The CUDA backend's figures against their limits, from bench/cuda_bench.py records (issue 15).

    python bench/cuda_plot.py bench/cuda_h200_a3b.json bench/results/cuda-h200-merged.json \
        --out bench/results/cuda-h200.png [--hf bench/results/cuda-h200-s4-hf.json]

Three panels, one bar group per record: resident prefill tokens/s at each length beside
transformers' bf16 (the --hf record of bench/cuda_hf_anchor.py, measured in the same machine
session, or else issue 15's anchors); resident decode tokens/s after each prompt length the
records hold (bench/cuda_bench.py --decode-after) beside the 100 tok/s target (the HBM floor is
printed, it is off the scale); and, for the records that have them, with 10 % of the experts in
VRAM, TTFT over its host-to-device floor (and the cold TTFT over its disk floor), with the 1.3
target line. Needs matplotlib (not a dependency of pysmoe).
"""

from __future__ import annotations

import argparse
import json
import pathlib

# transformers, Qwen3-MoE a3b shape in bf16 on an H200, batch 1 (issue 15's anchors)
TRANSFORMERS_PREFILL = {"45": 389, "256": 2235, "1024": 11026}
DECODE_TARGET = 100.0
TTFT_TARGET = 1.3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", nargs="+", help="JSON records written by bench/cuda_bench.py --json")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--hf", help="bench/cuda_hf_anchor.py's JSON from the same machine session")
    args = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [(pathlib.Path(p).stem, json.loads(pathlib.Path(p).read_text())) for p in args.records]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4.6))
    width = 0.8 / (len(recs) + 1)

    lengths = sorted({n for _, r in recs for n in r["resident"]["prefill_tps"]}, key=int)
    xs = range(len(lengths))
    for k, (name, r) in enumerate(recs):
        tps = r["resident"]["prefill_tps"]
        a1.bar([x + k * width for x in xs], [tps.get(n, 0) for n in lengths], width, label=f"pysmoe CUDA ({name})")
    hf, hf_label = TRANSFORMERS_PREFILL, "transformers bf16 (issue 15's anchor)"
    if args.hf:
        hf = json.loads(pathlib.Path(args.hf).read_text())["prefill_tps"]
        hf_label = "transformers bf16 (same machine session)"
    a1.bar([x + len(recs) * width for x in xs], [hf.get(n, 0) for n in lengths], width, label=hf_label, color="grey")
    a1.set_xticks([x + width * len(recs) / 2 for x in xs], [f"{n} tokens" for n in lengths])
    a1.set_yscale("log")
    a1.set_ylabel("prefill tokens/s (log)")
    a1.set_title("everything in VRAM: prefill")
    a1.legend(fontsize=7)

    def after(r):
        res = r["resident"]
        return res.get("decode_tps_after") or {"45": res["decode_tps"]}

    ctxs = sorted({m for _, r in recs for m in after(r)}, key=int)
    xs = range(len(ctxs))
    for k, (name, r) in enumerate(recs):
        a2.bar([x + k * width for x in xs], [after(r).get(m, 0) for m in ctxs], width, label=name)
    a2.axhline(DECODE_TARGET, color="red", linestyle="--", label=f"target {DECODE_TARGET:.0f} tok/s")
    floors = ", ".join(f"{r['resident']['hbm_floor_tps']:,.0f}" for _, r in recs)
    a2.set_xticks([x + width * (len(recs) - 1) / 2 for x in xs], [f"after {m} tokens" for m in ctxs], fontsize=7)
    a2.set_ylabel("decode tokens/s")
    a2.set_title(f"everything in VRAM: decode (HBM floor {floors} tok/s)", fontsize=9)
    a2.legend(fontsize=7)

    brecs = [(name, r) for name, r in recs if r.get("budget")]
    keys = [k for k in ("layer-major@45", "token-serial@45", "layer-major@1024")
            if any(k in r["budget"]["ttft"] for _, r in brecs)]
    labels = keys + ["cold@45 (disk)"]
    xs = range(len(labels))
    for k, (name, r) in enumerate(brecs):
        b = r["budget"]
        vals = [b["ttft"][key] / b["floor_s"][key] if key in b["ttft"] else 0 for key in keys]
        cold = r.get("cold45") or r.get("cold") or {}
        runs = cold.get("runs") or []
        vals.append(runs[0]["ttft_s"] / runs[0]["floor_s"] if runs else 0)
        a3.bar([x + k * width for x in xs], vals, width, label=name)
    a3.axhline(TTFT_TARGET, color="red", linestyle="--", label=f"target {TTFT_TARGET}× (45 tokens)")
    a3.axhline(1.0, color="black", linewidth=0.8)
    a3.set_xticks([x + width * (len(brecs) - 1) / 2 for x in xs], labels, fontsize=7)
    a3.set_ylabel("TTFT / floor")
    a3.set_title("10 % of the experts in VRAM: TTFT over its floor", fontsize=9)
    a3.legend(fontsize=7)

    fig.suptitle("pysmoe CUDA backend, NVIDIA H200, Qwen3-30B-A3B shape (bench/cuda_bench.py)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
