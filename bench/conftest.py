"""pytest-benchmark suites of pysmoe: TTFT (test_ttft.py) and decode (test_decode.py).

Not part of `make test` (pytest's testpaths is tests/). Run from the repository root:

    .venv/bin/python -m pytest bench -p no:cacheprovider --benchmark-only
    PYSMOE_BENCH_VAULT=/work/vault .venv/bin/python -m pytest bench -p no:cacheprovider --benchmark-only
    .venv/bin/python -m pytest bench -p no:cacheprovider --benchmark-only --bench-vault /work/vault \\
        --bench-lengths 1,8,45 --bench-threads 2 --bench-cache-frac 0.1

The vault: --bench-vault, else $PYSMOE_BENCH_VAULT, else a `mini` vault made under pytest's
temporary directory (about 1 GB, a few seconds). The suites drive the same code as
`python -m pysmoe bench` (pysmoe.bench.Bench); the CLI is the one that alternates the contenders
inside each repeat and takes the ratios, so quote its table for comparisons.
"""
from __future__ import annotations

import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pytest_addoption(parser):
    g = parser.getgroup("pysmoe bench")
    g.addoption("--bench-vault", default=None, help="vault directory (default: $PYSMOE_BENCH_VAULT, else a fresh mini)")
    g.addoption("--bench-lengths", default="1,8,45,64", help="prompt lengths for the TTFT suite (default 1,8,45,64)")
    g.addoption("--bench-cache-frac", type=float, default=0.1, help="cache budget / expert bytes (default 0.1)")
    g.addoption("--bench-threads", type=int, default=None, help="compute threads (default: all cores)")
    g.addoption("--bench-rounds", type=int, default=3, help="timed rounds per benchmark (default 3)")
    g.addoption("--bench-no-resident", action="store_true", help="skip the compute-floor and resident benchmarks")
    g.addoption("--bench-floor-mb", type=float, default=256,
                help="MiB per pattern of the I/O floor sweep over each prompt's union (bench/disk_floor.py; "
                     "default 256)")


def pytest_generate_tests(metafunc):
    if "prompt_len" in metafunc.fixturenames:
        lengths = [int(x) for x in metafunc.config.getoption("--bench-lengths").split(",") if x.strip()]
        metafunc.parametrize("prompt_len", lengths)


@pytest.fixture(scope="session")
def bench_vault(request, tmp_path_factory) -> str:
    path = request.config.getoption("--bench-vault") or os.environ.get("PYSMOE_BENCH_VAULT")
    if path:
        return path
    from pysmoe.synthesis import synth
    return str(synth(tmp_path_factory.mktemp("bench-mini"), preset="mini", seed=0, progress=False))


@pytest.fixture(scope="session")
def bench(request, bench_vault):
    """pysmoe.bench.Bench over the vault: a cold session at the budget, a resident one, the probe."""
    from pysmoe.bench import Bench
    opt = request.config.getoption
    b = Bench(bench_vault, cache_frac=opt("--bench-cache-frac"), threads=opt("--bench-threads"),
              resident=not opt("--bench-no-resident"), context=4096)
    yield b
    b.close()


@pytest.fixture(scope="session")
def io_floor(request, bench):
    """The honest I/O floor of each prompt length, as bench/disk_floor.py takes it: HonestFloor."""
    return HonestFloor(bench, int(request.config.getoption("--bench-floor-mb") * (1 << 20)))


class HonestFloor:
    """Per prompt length, the reads the engine must make for that prompt (its exact union: the
    blobs its routing asks for, each once, at their offsets in vault.bin) and the best rate this
    disk gives for them: bench/disk_floor.py's sweep of read patterns (blob reads in offset order,
    runs of adjacent blobs, span reads; depths 1 to 32; each read twice) over the union.

    get(n) -> {"layers": per sparse layer the union's sorted blob offsets, "union_bytes",
    "best": the sweep's best (GB/s, pattern record, "first"/"repeat"), "floor_s": union bytes /
    that rate, "sweep": every pattern's record}. The union comes from the cold session's routing
    counts after one prefill of the prompt (routing does not depend on the cache)."""

    def __init__(self, bench, floor_bytes: int):
        self.bench, self.floor_bytes, self._rows = bench, floor_bytes, {}

    def get(self, n: int) -> dict:
        if n not in self._rows:
            from bench import disk_floor
            b = self.bench
            s = b.cold
            s.prefill_path = "layer-major"
            s.reset()
            s.clear_cache()
            s.reset_stats()
            s.prefill(b.prompt(n))
            layers = disk_floor.union_offsets(b.vault, s)
            s.reset_stats()
            union_bytes = sum(len(offs) for offs in layers) * b.blob_bytes
            sweep = disk_floor.floor_sweep(b.probe, layers, b.blob_bytes, b.io_threads, b.coalesce_bytes,
                                           max(self.floor_bytes, b.blob_bytes))
            best = max(((p[when]["gbps"], i, when) for i, p in enumerate(sweep) for when in ("first", "repeat")),
                       default=None)
            row = {"layers": layers, "union_bytes": union_bytes, "sweep": sweep, "best": None, "floor_s": None}
            if best is not None:
                gbps, i, when = best
                row["best"] = {"gbps": gbps, "pattern": sweep[i], "when": when}
                row["floor_s"] = union_bytes / (gbps * 1e9)
            self._rows[n] = row
        return self._rows[n]

    def requests(self, n: int) -> tuple[list, int]:
        """The whole union as the best of the patterns that read nothing else (blob reads and runs
        of adjacent blobs, not span reads) reads it: (requests, depth)."""
        from bench import disk_floor
        row, b = self.get(n), self.bench
        pat = max((p for p in row["sweep"] if p["kind"] != "span"),
                  key=lambda p: max(p["first"]["gbps"], p["repeat"]["gbps"]))
        reqs, _ = disk_floor._floor_requests(pat["kind"], pat["request_bytes"], row["layers"], b.blob_bytes,
                                             budget=1 << 62)
        return reqs, pat["depth"]


@pytest.fixture(scope="session")
def rounds(request) -> int:
    return request.config.getoption("--bench-rounds")


@pytest.fixture
def record():
    return _record


def _record(benchmark, session, **extra) -> dict:
    """Put the session's I/O counters of the last round into the benchmark's extra_info."""
    import warnings
    st = session.stats()
    info = {k: st[k] for k in ("blob_reads", "bytes_read", "cache_hits", "cache_misses", "io_wait_s", "direct_io")}
    info.update(extra)
    benchmark.extra_info.update(info)
    if not st["direct_io"]:
        warnings.warn("O_DIRECT was NOT in force: the page cache may have served these reads")
    return info
