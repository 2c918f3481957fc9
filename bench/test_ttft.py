"""Time to first token: cold per prefill path, the compute floor and the I/O floor.

    .venv/bin/python -m pytest bench/test_ttft.py -p no:cacheprovider --benchmark-only

Each benchmark's time is the figure itself (extra_info holds the reads):
- test_ttft_cold[path-n]: Session.prefill of an n-token prompt after reset(), clear_cache(),
  reset_stats() (untimed setup), Direct I/O, the cache budget of --bench-cache-frac;
- test_compute_floor[path-n]: the same prefill with every expert resident (a warm run first);
- test_io_floor[n]: a plain parallel O_DIRECT pread of as many random blobs as the prompt's exact
  union holds, io_threads readers: the union's bytes at this disk's bandwidth.
"""
from __future__ import annotations

import pytest

from pysmoe.bench import PATHS


@pytest.mark.parametrize("path", PATHS)
def test_ttft_cold(benchmark, bench, rounds, record, path, prompt_len):
    s, ids = bench.cold, bench.prompt(prompt_len)
    s.prefill_path = path
    benchmark.group = f"ttft-{prompt_len}"

    def cold():
        s.reset()
        s.clear_cache()
        s.reset_stats()

    benchmark.pedantic(s.prefill, args=(ids,), setup=cold, rounds=rounds, iterations=1)
    record(benchmark, s, prompt_tokens=prompt_len, path=path, kind="cold", cache_bytes=bench.cache_bytes,
           union_sizes=s.stats()["union_sizes"])


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


def test_io_floor(benchmark, bench, rounds, prompt_len):
    exact = bench.exact_union(prompt_len)
    if exact is None:
        pytest.skip("the exact union needs the resident session")
    benchmark.group = f"ttft-{prompt_len}"
    probe = bench.probe
    res = benchmark.pedantic(probe.read, args=(exact,), rounds=rounds, iterations=1)
    benchmark.extra_info.update(prompt_tokens=prompt_len, kind="io-floor", exact_union_blobs=exact,
                                exact_union_bytes=exact * bench.blob_bytes, gbps=res["gbps"],
                                io_threads=probe.io_threads, direct_io=res["direct_io"])
