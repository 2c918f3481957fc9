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
