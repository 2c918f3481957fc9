"""Load on `python -m pysmoe serve`: aggregate decode tokens/s, per-request TTFT and inter-token
latency (median, p95) at several numbers of concurrent streams, with batching on and off, in one
run (issue 13, item 6). Not a test: figures go to bench/RESULTS.md.

    .venv/bin/python bench/serve_load.py /work/bench-a3b-real --cache-frac 0.1 --streams 1,2,4,8,16 \
        --tokens 24 --json bench/results/serve-load-a3b.json --plot bench/results/serve-load-a3b.png

Modes, alternated at each number of streams (each run on a fresh server, so a fresh cache of the
same budget; the vault is opened once per run, the page cache is bypassed by Direct I/O):

  batched      continuous batching: the running streams advance together through one
               pysmoe.decode_batch pass per token (each layer's union of experts read once)
  interleaved  --no-batching: every running stream advances by its own Session.decode in turn
               (token by token, round robin), the same shared cache
  serial       --max-batch 1: one request after another (the others wait in the queue)

Every stream is a streamed /v1/completions request over loopback HTTP (http.client, one thread
per stream) for `--tokens` tokens (ignore_eos, so every stream is the same length), sampled at
temperature 0.7 with its own seed, from its own prompt: `--prompt-tokens` ids drawn at random
per stream. "logprobs": 0 makes the server send one chunk per token, so inter-token latency is
the gap between consecutive chunks as the client receives them.

Per run: aggregate decode tokens/s = Σ (tokens − 1) / (last chunk − first first-token) over the
run's streams; TTFT = request sent → first chunk with a token; ITL = gaps between a stream's
token chunks (pooled over the streams); blob reads per generated token = the shared cache's
blob reads over the run (prefill included) / tokens generated, and the decode steps' reads alone
per token they decoded (the first token of each stream comes from its prefill), from /metrics.

--turns also measures prefix reuse: two turns on a fresh batched server (first: a
--turn-prompt-tokens ids prompt and an 8-token answer; second: the first prompt plus 8 new ids —
a completions client does not see the answer's ids, so the second turn extends the prompt, which
is what the pool kept), TTFT of each and the tokens the second reused.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from pysmoe.cli.serve import Background  # noqa: E402

MODES = ("batched", "interleaved", "serial")


def server_args(vault, mode: str, streams: int, cache_mb: float, threads, context: int, device: str = "cpu"):
    return argparse.Namespace(vault=str(vault), host="127.0.0.1", port=0, api_key=None, model_name="bench",
                              max_batch=1 if mode == "serial" else streams, batching=mode == "batched",
                              cache_mb=cache_mb, kv_mb=None, threads=threads, chunk=256, context=context,
                              max_tokens_limit=4096, max_request_kb=1024, buffered=False, device=device,
                              gpu_cache_mb=None)


def stream_completion(port: int, body: dict) -> dict:
    """Send one streamed completion; the client-side times of its token chunks."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True, "logprobs": 0}),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    times, finish = [], None
    while True:
        line = r.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(chunk["error"])
        c = chunk["choices"][0]
        n = len((c.get("logprobs") or {}).get("tokens") or [])
        now = time.perf_counter()
        times.extend([now] * n)
        finish = c.get("finish_reason") or finish
    conn.close()
    return {"t0": t0, "times": times, "finish": finish}


def get_json(port: int, path: str) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", path)
    out = json.loads(conn.getresponse().read())
    conn.close()
    return out


def pct(values, q):
    if not values:
        return None
    v = sorted(values)
    return float(np.percentile(v, q))


def one_run(vault, mode, streams, args, cache_mb, vocab) -> dict:
    with Background(server_args(vault, mode, streams, cache_mb, args.threads, args.context, args.device)) as bg:
        rng = np.random.default_rng(1000 + streams)
        bodies = [{"prompt": [int(x) for x in rng.integers(0, vocab, args.prompt_tokens)], "max_tokens": args.tokens,
                   "temperature": 0.7, "seed": i, "ignore_eos": True} for i in range(streams)]
        t = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(streams) as ex:
            res = list(ex.map(lambda b: stream_completion(bg.port, b), bodies))
        wall = time.perf_counter() - t
        m = get_json(bg.port, "/metrics")
    tokens = sum(len(r["times"]) for r in res)
    firsts = [r["times"][0] for r in res if r["times"]]
    last = max(r["times"][-1] for r in res if r["times"])
    ttft = [r["times"][0] - r["t0"] for r in res if r["times"]]
    itl = [b - a for r in res for a, b in zip(r["times"], r["times"][1:])]
    window = last - min(firsts)
    eng = m["engine"]
    return {
        "mode": mode, "streams": streams, "tokens": tokens, "wall_s": wall,
        "decode_tps": (tokens - len(firsts)) / window if window > 0 else None,
        "overall_tps": tokens / wall,
        "ttft_median_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95),
        "itl_median_s": pct(itl, 50), "itl_p95_s": pct(itl, 95),
        "blob_reads": eng.get("blob_reads"), "blob_reads_per_token": eng["blob_reads"] / tokens if tokens else None,
        "decode_blob_reads_per_token": m.get("blob_reads_per_decode_token"),
        "cache_hit_rate": eng.get("cache_hit_rate"), "mean_batch_size": m.get("mean_batch_size"),
        "batch_blob_reads": eng.get("batch_blob_reads"), "batch_tokens": eng.get("batch_tokens"),
        "finish": sorted({r["finish"] for r in res}),
    }


def turns(vault, args, cache_mb, vocab) -> dict:
    """TTFT of a chat's first and second turn (prefix reuse), completions with ids."""
    with Background(server_args(vault, "batched", 2, cache_mb, args.threads, args.context, args.device)) as bg:
        rng = np.random.default_rng(7)
        first = [int(x) for x in rng.integers(0, vocab, args.turn_prompt_tokens)]
        body = {"max_tokens": 8, "temperature": 0.7, "seed": 1, "ignore_eos": True}
        r1 = stream_completion(bg.port, {**body, "prompt": first})
        m1 = get_json(bg.port, "/metrics")
        more = [int(x) for x in rng.integers(0, vocab, 8)]
        r2 = stream_completion(bg.port, {**body, "prompt": first + more})
        m2 = get_json(bg.port, "/metrics")
    t1, t2 = r1["times"][0] - r1["t0"], r2["times"][0] - r2["t0"]
    return {"first_prompt_tokens": len(first), "second_prompt_tokens": len(first) + len(more),
            "first_ttft_s": t1, "second_ttft_s": t2, "speedup": t1 / t2,
            "reused_tokens": m2["prompt_tokens_reused"] - m1["prompt_tokens_reused"]}


def load_average() -> str:
    try:
        return " ".join(pathlib.Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def plot(record: dict, out: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = record["runs"]
    done = sorted({r["streams"] for r in runs})
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    style = {"batched": ("C0", "o"), "interleaved": ("C1", "s"), "serial": ("C2", "^")}
    for mode in record["modes"]:
        rs = sorted((r for r in runs if r["mode"] == mode), key=lambda r: r["streams"])
        if not rs:
            continue
        x = [r["streams"] for r in rs]
        c, mk = style.get(mode, ("k", "x"))
        axes[0].plot(x, [r["decode_tps"] for r in rs], marker=mk, color=c, label=mode)
        axes[1].plot(x, [r["ttft_median_s"] for r in rs], marker=mk, color=c, label=f"{mode} median")
        axes[1].plot(x, [r["ttft_p95_s"] for r in rs], marker=mk, color=c, ls="--", mfc="none", label=f"{mode} p95")
        axes[2].plot(x, [r["itl_median_s"] for r in rs], marker=mk, color=c, label=f"{mode} median")
        axes[2].plot(x, [r["itl_p95_s"] for r in rs], marker=mk, color=c, ls="--", mfc="none", label=f"{mode} p95")
        key = "decode_blob_reads_per_token" if all(r.get("decode_blob_reads_per_token") for r in rs) \
            else "blob_reads_per_token"
        axes[3].plot(x, [r[key] for r in rs], marker=mk, color=c, label=mode)
    decode_only = all(r.get("decode_blob_reads_per_token") for r in runs)
    titles = ["aggregate decode tokens/s", "TTFT (s)", "inter-token latency (s)",
              "blob reads per decoded token" if decode_only else "blob reads per generated token (prefill incl.)"]
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xticks(done)
        ax.set_xticklabels([str(s) for s in done])
        ax.set_xlabel("concurrent streams")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    for ax in axes[1:3]:
        ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=7)
    fig.suptitle(f"pysmoe serve under load: {record['vault_name']}, cache {record['cache_frac']:.0%} of experts, "
                 f"{record['tokens']} tokens per stream, {record['cpu']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("vault")
    ap.add_argument("--cache-frac", type=float, default=0.1, help="cache budget as a fraction of the expert bytes")
    ap.add_argument("--streams", default="1,2,4,8,16")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--tokens", type=int, default=24, help="tokens per stream")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="the server's device (cuda: every expert may stay in VRAM, the host cache behind it)")
    ap.add_argument("--turns", action="store_true", help="also the two-turn prefix-reuse TTFT")
    ap.add_argument("--turn-prompt-tokens", type=int, default=256)
    ap.add_argument("--json", type=pathlib.Path)
    ap.add_argument("--plot", type=pathlib.Path)
    ap.add_argument("--replot", action="store_true", help="only plot the --json record (an interrupted run's too)")
    args = ap.parse_args(argv)
    if args.replot:
        plot(json.loads(args.json.read_text()), args.plot)
        return 0
    streams = [int(s) for s in args.streams.split(",") if s]  # --streams "": only --turns
    modes = args.modes.split(",")
    from pysmoe import open_vault
    with open_vault(args.vault) as v:
        expert_bytes, vocab = v.expert_bytes, v.config["vocab_size"]
    cache_mb = args.cache_frac * expert_bytes / (1 << 20)
    cpu = subprocess.run(["sh", "-c", "lscpu | sed -n 's/^Model name: *//p'"], capture_output=True,
                         text=True).stdout.strip() + f", {os.cpu_count()} CPUs"
    record = {"vault": str(args.vault), "vault_name": pathlib.Path(args.vault).name, "cache_frac": args.cache_frac,
              "cache_mb": cache_mb, "streams": streams, "modes": modes, "tokens": args.tokens,
              "prompt_tokens": args.prompt_tokens, "threads": args.threads, "cpu": cpu,
              "load_before": load_average(), "runs": []}
    print(f"{record['vault_name']}: cache {cache_mb:.0f} MiB ({args.cache_frac:.0%}), {cpu}, load {record['load_before']}",
          file=sys.stderr)
    print(f"{'streams':>7} {'mode':<12} {'dec tok/s':>9} {'TTFT med':>9} {'TTFT p95':>9} {'ITL med':>8} {'ITL p95':>8} "
          f"{'reads/tok':>9} {'dec r/tok':>9} {'hit':>5} {'batch':>5} {'wall s':>7}")
    for n in streams:
        for mode in modes:
            r = one_run(args.vault, mode, n, args, cache_mb, vocab)
            r["load"] = load_average()
            record["runs"].append(r)
            print(f"{n:>7} {mode:<12} {r['decode_tps']:>9.2f} {r['ttft_median_s']:>9.3f} {r['ttft_p95_s']:>9.3f} "
                  f"{r['itl_median_s']:>8.3f} {r['itl_p95_s']:>8.3f} {r['blob_reads_per_token']:>9.1f} "
                  f"{r['decode_blob_reads_per_token'] or 0:>9.1f} "
                  f"{r['cache_hit_rate'] or 0:>5.0%} {r['mean_batch_size'] or 0:>5.1f} {r['wall_s']:>7.1f}",
                  flush=True)
            if args.json:
                args.json.write_text(json.dumps(record, indent=1))
    if args.turns:
        record["turns"] = turns(args.vault, args, cache_mb, vocab)
        t = record["turns"]
        print(f"two turns: TTFT {t['first_ttft_s']:.3f} s ({t['first_prompt_tokens']} tokens), then "
              f"{t['second_ttft_s']:.3f} s ({t['second_prompt_tokens']} tokens, {t['reused_tokens']} reused): "
              f"{t['speedup']:.1f}x")
    record["load_after"] = load_average()
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    if args.plot:
        plot(record, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
