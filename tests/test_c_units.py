"""The reference kernels, the worker pool and the sampler through their C tests.

tests/c/test_kernels.c and tests/c/test_pool_sample.c are compiled here with gcc against the
csrc files they need (kernels.c, pool.c, sample.c, util.c) with the engine's flags, and run.
Builds:

    O2, O3        the engine's flags; the vector-extension lane loops
    scalar        -DSMOE_KERNELS_SCALAR: the plain-C lane loops, which must give the same bits
    nofutex       -DSMOE_NO_FUTEX: the pool's condition-variable path (what macOS runs)
    asan          AddressSanitizer + UBSan
    tsan          ThreadSanitizer (pool and sampler only; slow)

test_kernels prints a checksum of every kernel output; all its builds must print the same one.
"""

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
LIB_SOURCES = [CSRC / name for name in ("kernels.c", "pool.c", "sample.c", "util.c")]
FLAGS = ["-std=c11", "-Wall", "-Wextra", "-Werror", "-pthread", "-ffp-contract=off", "-D_GNU_SOURCE", f"-I{CSRC}"]
if platform.machine() in ("x86_64", "AMD64"):
    FLAGS += ["-mavx2", "-mfma", "-mf16c"]
BUILDS = {
    "O2": ["-O2"],
    "O3": ["-O3"],
    "scalar": ["-O2", "-DSMOE_KERNELS_SCALAR"],
    "nofutex": ["-O2", "-DSMOE_NO_FUTEX"],
    "asan": ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
    "tsan": ["-O1", "-g", "-fsanitize=thread"],
}
SANITIZER_RUNS = "1000"  # consecutive pool runs per thread count under a sanitizer (10,000 otherwise)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    assert shutil.which("gcc"), "gcc is needed to build the C unit tests"
    out = tmp_path_factory.mktemp("c_units")
    built = {}

    def make(program: str, variant: str) -> Path:
        key = (program, variant)
        if key not in built:
            exe = out / f"{program}_{variant}"
            cmd = ["gcc", *FLAGS, *BUILDS[variant], str(ROOT / "tests" / "c" / f"{program}.c"),
                   *map(str, LIB_SOURCES), "-lm", "-o", str(exe)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr}"
            built[key] = exe
        return built[key]

    return make


def run(exe: Path, *args: str, timeout: float = 300) -> str:
    # The C test programs carry their own sanitizer runtimes: drop what `make asan` preloads.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    r = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, f"{exe.name} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r.stdout


@pytest.mark.parametrize("variant", ["O2", "O3", "scalar", "asan"])
def test_kernels(build, variant):
    assert "test_kernels: ok" in run(build("test_kernels", variant))


def test_kernels_same_bits_in_every_build(build):
    sums = {}
    for variant in ("O2", "O3", "scalar"):
        lines = [ln for ln in run(build("test_kernels", variant)).splitlines() if ln.startswith("checksum ")]
        assert len(lines) == 1
        sums[variant] = lines[0]
    assert len(set(sums.values())) == 1, sums


@pytest.mark.parametrize("variant", ["O2", "nofutex", "asan"])
def test_pool_and_sampler(build, variant):
    args = [SANITIZER_RUNS] if variant == "asan" else []
    assert "test_pool_sample: ok" in run(build("test_pool_sample", variant), *args)


@pytest.mark.slow
def test_pool_and_sampler_tsan(build):
    assert "test_pool_sample: ok" in run(build("test_pool_sample", "tsan"), SANITIZER_RUNS, timeout=600)
