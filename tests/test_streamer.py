"""The streamer (csrc/streamer.c) through its C test, tests/c/test_streamer.c.

The C test is compiled here with gcc, against csrc/streamer.c, csrc/retention.c and csrc/util.c only, and run
once per test name so that a failure names what broke. Its files go under build-tests/ in the
repository: /work's disk takes O_DIRECT, which is part of what is tested. Besides the -O2
build: the condition-variable build other OSes get, ThreadSanitizer, and AddressSanitizer +
UBSan (skipped where the compiler has no sanitizer runtime; SMOE_SANITIZE=0 skips them).
"""

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "csrc" / "streamer.c", ROOT / "csrc" / "retention.c", ROOT / "csrc" / "util.c",
           ROOT / "tests" / "c" / "test_streamer.c"]
FLAGS = ["-std=c11", "-Wall", "-Wextra", "-Werror", "-pthread", "-ffp-contract=off", "-D_GNU_SOURCE",
         "-DSMOE_STREAMER_TEST_HOOKS", f"-I{ROOT / 'csrc'}"]
BUILDS = {
    "O2": ["-O2"],
    "nofutex": ["-O2", "-DSMOE_NO_FUTEX"],  # the condition-variable path other OSes take
    "tsan": ["-O1", "-g", "-fsanitize=thread"],
    "asan": ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
}
SANITIZED = {"tsan", "asan"}
TESTS = ["basic", "script", "topk_pool", "quota", "retain", "truncate", "verify", "pinned", "direct", "stress", "settle", "coalesce"]


@pytest.fixture(scope="module")
def binaries(tmp_path_factory):
    if shutil.which("gcc") is None:
        pytest.skip("gcc not found")
    out = tmp_path_factory.mktemp("streamer")
    built = {}

    def build(name):
        if name not in built:
            exe = out / f"test_streamer_{name}"
            cmd = ["gcc", *FLAGS, *BUILDS[name], *map(str, SOURCES), "-o", str(exe), "-lm"]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0 and name in SANITIZED and ("cannot find" in r.stderr or "unsupported" in r.stderr):
                built[name] = None  # a link failure: no sanitizer runtime here
            else:
                assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr}"
                built[name] = exe
        return built[name]

    return build


@pytest.fixture
def workdir():
    base = ROOT / "build-tests"
    base.mkdir(exist_ok=True)
    d = tempfile.mkdtemp(prefix="streamer-", dir=base)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("test", TESTS)
def test_streamer(binaries, workdir, build, test):
    if build in SANITIZED and os.environ.get("SMOE_SANITIZE") == "0":
        pytest.skip("SMOE_SANITIZE=0")
    exe = binaries(build)
    if exe is None:
        pytest.skip(f"no {build} runtime for gcc here")
    args = [str(exe), test, workdir]
    if os.path.isdir("/dev/shm"):
        args.append("/dev/shm")
    # The C test programs carry their own sanitizer runtimes: drop what `make asan` preloads.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.update(TSAN_OPTIONS="halt_on_error=1", ASAN_OPTIONS="detect_leaks=1")
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, f"{' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert f"ok {test}" in r.stdout
