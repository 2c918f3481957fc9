"""Time to first token: cold per prefill path, the compute floor and the honest I/O floor.

    .venv/bin/python -m pytest bench/test_ttft.py -p no:cacheprovider --benchmark-only

Each benchmark's time is the figure itself (extra_info holds the reads):
- test_ttft_cold[path-n]: Session.prefill of an n-token prompt after reset(), clear_cache(),
  reset_stats() (untimed setup), Direct I/O, the cache budget of --bench-cache-frac; extra_info
  also holds io_floor_s and ttft_over_io_floor (the median round over the honest I/O floor);
- test_compute_floor[path-n]: the same prefill with every expert resident (a warm run first);
- test_io_floor[n]: the reads the engine must make for that prompt — its exact union, each blob
  once, at its offset in vault.bin — with the fastest pattern of bench/disk_floor.py's sweep over
  that union (blob reads in offset order or runs of adjacent blobs, at the depth that was best);
  extra_info's io_floor_s is the union's bytes over the best rate of the sweep (span reads
  included) or of these rounds, whichever is faster: the CLI's honest floor (bench/disk_floor.py).
"""
from __future__ import annotations

import statistics
import time

import pytest

from pysmoe.bench import PATHS


@pytest.mark.parametrize("path", PATHS)
def test_ttft_cold(benchmark, bench, io_floor, rounds, record, path, prompt_len):
    s, ids = bench.cold, bench.prompt(prompt_len)
    floor = io_floor.get(prompt_len)  # before the timed rounds: it runs a prefill of its own
    s.prefill_path = path
    benchmark.group = f"ttft-{prompt_len}"
    times = []

    def cold():
        s.reset()
        s.clear_cache()
        s.reset_stats()

    def prefill():
        t0 = time.perf_counter()
        s.prefill(ids)
        times.append(time.perf_counter() - t0)

    benchmark.pedantic(prefill, setup=cold, rounds=rounds, iterations=1)
    st = s.stats()
    # The engine's own rate counts too (as in the CLI): a run reads at least the union, so the
    # floor is never above a run.
    fl = floor["floor_s"]
    if st["bytes_read"]:
        own = min(times) * floor["union_bytes"] / st["bytes_read"]
        fl = own if fl is None else min(fl, own)
    record(benchmark, s, prompt_tokens=prompt_len, path=path, kind="cold", cache_bytes=bench.cache_bytes,
           union_sizes=st["union_sizes"], io_floor_s=fl, ttft_over_io_floor=statistics.median(times) / fl if fl else None)


@pytest.mark.parametrize("path", PATHS)
def test_compute_floor(benchmark, bench, rounds, record, path, prompt_len):
    if bench.resident is None:
        pytest.skip("--bench-no-resident")
    s, ids = bench.resident, bench.prompt(prompt_len)
    s.prefill_path = path
    benchmark.group = f"ttft-{prompt_len}"
    s.reset()
    s.prefill(ids)  # warm-up: every expert this prompt needs comes in

    def again():
        s.reset()
        s.reset_stats()

    benchmark.pedantic(s.prefill, args=(ids,), setup=again, rounds=rounds, iterations=1)
    record(benchmark, s, prompt_tokens=prompt_len, path=path, kind="resident")


def test_io_floor(benchmark, bench, io_floor, rounds, prompt_len):
    floor = io_floor.get(prompt_len)
    if not floor["layers"]:
        pytest.skip("the prompt routes to no expert blob")
    benchmark.group = f"ttft-{prompt_len}"
    reqs, depth = io_floor.requests(prompt_len)
    probe, runs = bench.probe, []

    def read():
        runs.append(probe.read_requests(reqs, depth))

    benchmark.pedantic(read, rounds=rounds, iterations=1)
    own = min(r["seconds"] for r in runs)
    fl = own if floor["floor_s"] is None else min(floor["floor_s"], own)
    best = floor["best"]
    benchmark.extra_info.update(
        prompt_tokens=prompt_len, kind="io-floor", exact_union_blobs=sum(len(x) for x in floor["layers"]),
        exact_union_bytes=floor["union_bytes"], requests=len(reqs), depth=depth, gbps=[r["gbps"] for r in runs],
        io_floor_s=fl, sweep_best_gbps=best and best["gbps"],
        sweep_best_pattern=best and f"{best['pattern']['pattern']} ({best['when']})", direct_io=probe.direct_io)
