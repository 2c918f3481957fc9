"""The CUDA backend's figures on one GPU, each against a limit measured in the same run.

    python bench/cuda_bench.py VAULT [--lengths 45,256,1024] [--decode 32] [--repeats 3] [--budget 0.1]
                                     [--json OUT.json]

1. limits: device-to-device copy bandwidth (HBM) and pinned host-to-device bandwidth at 2.5 MiB and
   256 MiB (torch, on the same GPU);
2. resident: every expert in VRAM (warmed until a prefill uploads nothing): prefill tokens/s at each
   length (a fresh prompt per repeat, median) and decode tokens/s, against the HBM floor (bytes of
   weights one token touches / measured HBM bandwidth);
3. budget: a VRAM expert cache of `budget` × the experts, the rest in the host cache (pinned, warm):
   TTFT at each length and decode tokens/s, against the host-to-device floor (bytes uploaded in
   the run / pinned bandwidth), the session's host cache warmed by two prefills first. With --vram-gb G[,G...] the budget is a
   whole GPU of G GiB instead (issue 30, item 2): the expert cache is G GiB less what the session
   holds besides (dense weights, KV cache, planes: vram_other_bytes), less the CUDA context and
   --vram-reserve-gb of slack; each budget is reported with the VRAM the process really held
   (torch.cuda.mem_get_info at its peak);
4. cold: TTFT at 45 tokens from the disk (page cache dropped, empty caches), against the disk floor
   (bytes read / O_DIRECT bandwidth of vault.bin measured just before).
Medians of --repeats runs; the contenders of 3. alternate within each repeat."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, ".")
import pysmoe  # noqa: E402
from pysmoe.vaultio import VaultFile  # noqa: E402


def limits():
    import torch
    dev = torch.device("cuda")
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(10):
            b.copy_(a)
        torch.cuda.synchronize()
        runs.append(2 * 10 * a.numel() / (time.perf_counter() - t0))  # read + write
    hbm = statistics.median(runs)
    del a, b
    h2d = {}
    for size in (int(2.5 * (1 << 20)), 256 << 20):
        host = torch.empty(size, dtype=torch.uint8).pin_memory()
        d = torch.empty(size, dtype=torch.uint8, device=dev)
        reps = max(4, (2 << 30) // size)
        d.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                d.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            runs.append(reps * size / (time.perf_counter() - t0))
        h2d[size] = statistics.median(runs)
    return {"hbm_Bps": hbm, "h2d_Bps": h2d, "gpu": torch.cuda.get_device_name()}


def disk_bandwidth(path, total=4 << 30, req=16 << 20, threads=8) -> float:
    """O_DIRECT reads of vault.bin's last `total` bytes, `threads` requests in flight."""
    import mmap
    import os
    from concurrent.futures import ThreadPoolExecutor
    f = os.path.join(path, "vault.bin")
    size = os.path.getsize(f)
    total = min(total, size // req * req)
    first = (size - total) // req * req
    fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
    bufs = [mmap.mmap(-1, req) for _ in range(threads)]

    def read(i):
        done = 0
        for off in range(first + i * req, first + total, threads * req):
            done += os.preadv(fd, [bufs[i]], off)
        return done

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        got = sum(ex.map(read, range(threads)))
    dt = time.perf_counter() - t0
    os.close(fd)
    return got / dt


def drop_page_cache() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def touched_bytes(path, v) -> int:
    """Bytes of weights one token reads: every dense tensor but the embedding (one row of it), and
    top-k blobs per sparse layer."""
    vf = VaultFile(path)
    dense = sum(t.nbytes for n, t in vf.tensors.items() if n != "embed_tokens")
    emb = vf.tensors["embed_tokens"]
    return dense + emb.nbytes // emb.rows + v.config["num_experts_per_tok"] * v.blob_bytes * v.num_sparse_layers


def prompts(v, n, count, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, v.config["vocab_size"], n).tolist() for _ in range(count)]


def timed_prefill(s, ids):
    s.reset()
    t0 = time.perf_counter()
    logits = s.prefill(ids)
    return time.perf_counter() - t0, logits


def timed_decode(s, first, n):
    nxt = int(np.argmax(first))
    t0 = time.perf_counter()
    for _ in range(n):
        nxt = int(np.argmax(s.decode(nxt)))
    return n / (time.perf_counter() - t0)


def profile(s, v, n, after=45):
    import torch
    from torch.profiler import ProfilerActivity, profile as prof
    p = prompts(v, after, 1, 3)[0]
    _, first = timed_prefill(s, p)
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as pr:
        timed_decode(s, first, 8)
    print(f"decode x8 after {after}\n" + pr.key_averages().table(sort_by="cuda_time_total", row_limit=30), flush=True)
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as pr:
        timed_prefill(s, prompts(v, n, 1, 4)[0])
        torch.cuda.synchronize()
    print(f"prefill {n}\n" + pr.key_averages().table(sort_by="cuda_time_total", row_limit=30), flush=True)


def run_budget(a, v, common, lengths, name, value, gpu, lim):
    """TTFT at each length and decode tok/s with a VRAM expert cache of gpu bytes, the host cache warm."""
    bw = lim["h2d_Bps"][int(2.5 * (1 << 20))]
    peak = [0]

    def note_vram():
        try:
            import torch
            free, total = torch.cuda.mem_get_info()
            peak[0] = max(peak[0], total - free)
        except Exception:  # no torch: the figure is left out
            pass
    s = v.session(device="cuda", gpu_cache_bytes=gpu, **common)
    for p in prompts(v, max(lengths), 2, 5):  # the host cache warm: every expert those prompts touch is in RAM
        timed_prefill(s, p)
    note_vram()
    bud = {"budget": name, "value": value, "gpu_cache_bytes": gpu, "ttft": {}, "floor_s": {}, "uploaded_bytes": {}}
    for n in sorted(set(lengths) | {45}):
        ts, fl, ub = [], [], []
        for p in prompts(v, n, a.repeats, 1000 + n):
            d0 = s.device_stats()["upload_bytes"]
            t, _ = timed_prefill(s, p)
            d = s.device_stats()["upload_bytes"] - d0
            ts.append(t)
            fl.append(d / bw)
            ub.append(d)
        note_vram()
        key = f"layer-major@{n}"
        bud["ttft"][key] = statistics.median(ts)
        bud["floor_s"][key] = statistics.median(fl)
        bud["uploaded_bytes"][key] = statistics.median(ub)
        print("budget", name, key, bud["ttft"][key], bud["floor_s"][key], flush=True)
    dec, fl, hits = [], [], []
    for p in prompts(v, 45, a.repeats, 11):
        _, first = timed_prefill(s, p)
        st0 = s.device_stats()
        tps = timed_decode(s, first, a.decode)
        st = s.device_stats()
        d = st["upload_bytes"] - st0["upload_bytes"]
        dec.append(tps)
        fl.append(a.decode / (d / bw) if d else float("inf"))
        uses = (st["vram_hits"] - st0["vram_hits"]) + (st["vram_misses"] - st0["vram_misses"])
        hits.append((st["vram_hits"] - st0["vram_hits"]) / uses if uses else 1.0)
    note_vram()
    bud["decode_tps"] = statistics.median(dec)
    bud["decode_floor_tps"] = statistics.median(fl)
    bud["decode_vram_hit_rate"] = statistics.median(hits)
    bud["h2d_Bps"] = bw
    bud["backend"] = s.backend
    bud["vram_peak_bytes"] = peak[0]
    s.close()
    print("budget", json.dumps(bud), flush=True)
    return bud


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("vault")
    ap.add_argument("--lengths", default="45,256,1024")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--vram-gb", default="",
                    help="comma list of whole-GPU VRAM budgets in GiB for the budget part (replaces --budget there)")
    ap.add_argument("--vram-reserve-gb", type=float, default=0.5,
                    help="slack kept free under each --vram-gb budget besides the CUDA context")
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: resident,budget")
    ap.add_argument("--cold-repeats", type=int, default=1)
    ap.add_argument("--decode-after", default="45",
                    help="decode measured after prompts of these lengths (comma list; the first is decode_tps): "
                         "how decode holds up as the KV cache grows")
    ap.add_argument("--kv-dtype", default="f32", choices=["f32", "bf16", "f16"],
                    help="the sessions' KV cache (f16: the same logits as f32 where attention is flash)")
    ap.add_argument("--profile-after", type=int, default=45,
                    help="the prompt length before --profile's decode steps (at most the sessions' context)")
    ap.add_argument("--profile", type=int, nargs="?", const=256, default=0, metavar="N",
                    help="kernel times of 8 decode steps and an N-token prefill (torch.profiler)")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    longest = max(lengths)
    skip = set(a.skip.split(",")) - {""}
    out = {"limits": limits()}
    lim = out["limits"]
    print(json.dumps(lim), flush=True)
    v = pysmoe.open_vault(a.vault)
    experts = v.expert_bytes
    touched = touched_bytes(a.vault, v)
    out["config"] = {"layers": v.config["num_hidden_layers"], "experts_bytes": experts, "blob_bytes": v.blob_bytes,
                     "touched_bytes_per_token": touched, "dense_bytes": v.dense_bytes if hasattr(v, "dense_bytes") else None}
    after = [int(x) for x in a.decode_after.split(",")]
    ctx = max(longest, *after) + a.decode + 8
    common = dict(chunk=longest, context=ctx, cache_bytes=experts + v.blob_bytes, io_threads=8, kv_dtype=a.kv_dtype)
    out["config"]["kv_dtype"] = a.kv_dtype
    from pysmoe._ffi import LIB_PATH
    out["config"]["library"] = str(LIB_PATH)
    print("library", out["config"]["library"], flush=True)

    if "resident" not in skip:
        with v.session(device="cuda", gpu_cache_bytes=experts + v.blob_bytes, **common) as s:
            out["backend"] = s.backend
            warm = prompts(v, longest, 6, 99)
            for i, p in enumerate(warm):  # until a prefill of the longest prompt uploads nothing new
                before = s.device_stats()["uploads"]
                timed_prefill(s, p)
                if i > 0 and s.device_stats()["uploads"] == before:
                    break
            res = {"prefill_tps": {}, "uploads_during": 0}
            u0 = s.device_stats()["uploads"]
            for n in lengths:
                ts = [timed_prefill(s, p)[0] for p in prompts(v, n, a.repeats, n)]
                res["prefill_tps"][n] = n / statistics.median(ts)
                print("resident prefill", n, res["prefill_tps"][n], flush=True)
            res["decode_tps_after"] = {}
            for m in after:
                dec = []
                for p in prompts(v, m, a.repeats, 7):
                    _, first = timed_prefill(s, p)
                    dec.append(timed_decode(s, first, a.decode))
                res["decode_tps_after"][m] = statistics.median(dec)
                print("resident decode after", m, res["decode_tps_after"][m], flush=True)
            res["decode_tps"] = res["decode_tps_after"][after[0]]
            res["uploads_during"] = s.device_stats()["uploads"] - u0
            res["hbm_floor_tps"] = lim["hbm_Bps"] / touched
            out["resident"] = res
            print("resident", json.dumps(res), flush=True)
            if a.profile:
                profile(s, v, a.profile, a.profile_after)

    if "budget" not in skip:
        budgets = [("fraction", a.budget, int(a.budget * experts))]
        if a.vram_gb:
            import torch
            torch.cuda.empty_cache()  # limits()' buffers back to the driver
            free0, total = torch.cuda.mem_get_info()
            context = total - free0  # the CUDA context (torch's and libsmoe's share the primary one)
            with v.session(device="cuda", gpu_cache_bytes=v.blob_bytes, **common) as probe:
                other = probe.device_stats()["vram_other_bytes"]
            budgets = []
            for g in (float(x) for x in a.vram_gb.split(",")):
                cache = int(g * (1 << 30) - context - other - a.vram_reserve_gb * (1 << 30))
                budgets.append((f"{g:g} GiB", g, min(max(cache, v.blob_bytes), experts + v.blob_bytes)))
            out["vram"] = {"context_bytes": context, "other_bytes": other, "total_bytes": total}
            print("vram", json.dumps(out["vram"]), flush=True)
        out["budgets"] = [run_budget(a, v, common, lengths, name, value, gpu, lim)
                          for name, value, gpu in budgets]
        out["budget"] = out["budgets"][0]
    if "cold" not in skip:
        gpu = int(a.budget * experts)
        cold = {"disk_Bps": disk_bandwidth(a.vault), "dropped_page_cache": drop_page_cache(), "runs": []}
        for i, p in enumerate(prompts(v, 45, a.cold_repeats, 77)):
            drop_page_cache()
            with v.session(device="cuda", gpu_cache_bytes=gpu, chunk=longest, context=ctx,
                           cache_bytes=int(a.budget * experts), io_threads=8, kv_dtype=a.kv_dtype) as s:
                t, _ = timed_prefill(s, p)
                st = s.stats()
                cold["runs"].append({"ttft_s": t, "bytes_read": st["bytes_read"],
                                     "floor_s": st["bytes_read"] / cold["disk_Bps"], "direct_io": st["direct_io"]})
            print("cold", json.dumps(cold["runs"][-1]), flush=True)
        out["cold45"] = cold
        print("cold", json.dumps(cold), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
