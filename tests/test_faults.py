"""Failed blob reads, injected: tests/c/fault_shim.c preloaded under tests/faults_driver.py.

The shim wraps pread for a child Python (LD_PRELOAD, after whatever is preloaded already: `make
asan`'s sanitizer runtimes), which drives the engine through the binding:

    rewind   a read fails part way through a multi-chunk prefill and through generate: the
             position goes back to where it was, and the session then gives a fault-free
             session's results bit for bit;
    soak     random operations with random EIO, short reads and bit flips, each checked
             against a fault-free session: equal bits, or a SmoeError with the position kept.
             SMOE_SOAK_OPS sets its length (default 600, a few seconds) and SMOE_SOAK_SEED
             its seed.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "a C compiler is needed to build the fault shim"
    out = tmp_path_factory.mktemp("shim") / "fault_shim.so"
    cmd = [cc, "-std=c11", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-O2",
           str(ROOT / "tests" / "c" / "fault_shim.c"), "-ldl", "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return out


def drive(shim: Path, *args: str) -> str:
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(filter(None, [env.get("LD_PRELOAD", ""), str(shim)]))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "faults_driver.py"), *args], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=1800)
    assert r.returncode == 0, f"faults_driver {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r.stdout


def test_failed_read_rewinds_prefill_and_generate(shim, tiny_vault):
    assert "rewind: ok" in drive(shim, "rewind", str(tiny_vault), str(shim))


def test_soak_with_random_read_faults(shim, tiny_vault):
    ops = os.environ.get("SMOE_SOAK_OPS", "600")
    seed = os.environ.get("SMOE_SOAK_SEED", "0")
    out = drive(shim, "soak", str(tiny_vault), str(shim), ops, seed)
    assert "soak: ok" in out
    print(out.strip().splitlines()[-1])
