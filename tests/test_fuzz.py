"""Short, fixed-seed runs of `make fuzz`'s two fuzzers, so that the suite runs them as they are
(their harness, their checks) and not only their mutations: the Python reader's
(tests/fuzz_vaultio.py), and the C driver (tests/c/fuzz_vault.c) built by the Makefile's own
recipe without sanitizers, which make fuzz keeps. Each writes only in the directory it is given."""
from __future__ import annotations

import os
import pathlib
import random
import re
import shutil
import struct
import subprocess

import pytest

import fuzz_vaultio

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_vaultio_fuzzer_short_run(tiny_vault, tmp_path):
    out = tmp_path / "out"
    read = fuzz_vaultio.main(400, tiny_vault, out, seed=0)
    assert 0 < read < 400  # some mutations read, some were refused: both ways were taken
    assert list(out.iterdir()) == []  # its work vault removed, no crash file


def test_vaultio_fuzzer_keeps_a_crash_in_its_out_dir(tiny_vault, tmp_path, monkeypatch, capsys):
    """A reader raising anything but VaultError is a failure, and the input is kept in OUT_DIR."""
    def reader(path):
        data = (pathlib.Path(path) / "vault.bin").read_bytes()
        return struct.unpack_from("<Q", data, len(data) - 4)  # struct.error, not a VaultError
    monkeypatch.setattr(fuzz_vaultio, "read_vault", reader)
    out = tmp_path / "out"
    with pytest.raises(struct.error):
        fuzz_vaultio.main(10, tiny_vault, out, seed=3)
    assert [p.name for p in out.iterdir()] == ["vaultio-crash-3-0.bin"]
    first = fuzz_vaultio.mutate((tiny_vault / "vault.bin").read_bytes(), random.Random(3))
    assert (out / "vaultio-crash-3-0.bin").read_bytes() == first
    assert "iteration 0: not a VaultError" in capsys.readouterr().err


def tool_env() -> dict:
    """Without the sanitizer runtime `make asan` preloads and the outer make's jobserver."""
    return {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}


@pytest.fixture(scope="module")
def fuzz_driver(tmp_path_factory):
    """The C driver, built once by the Makefile's own recipe."""
    cc = os.environ.get("CC", "cc")
    if not shutil.which("make") or not shutil.which(cc):
        pytest.skip(f"make or {cc} not found")
    driver = tmp_path_factory.mktemp("fuzz_driver") / "fuzz_vault"
    r = subprocess.run(["make", "-s", "--no-print-directory", f"FUZZ_DRIVER={driver}", "FUZZ_CFLAGS=-O1 -Werror",
                        str(driver)], cwd=ROOT, capture_output=True, text=True, env=tool_env())
    assert r.returncode == 0, r.stdout + r.stderr
    return driver


def test_c_fuzz_driver_short_run(fuzz_driver, tiny_vault, tmp_path):
    driver, out = fuzz_driver, tmp_path / "out"
    out.mkdir()
    vault_bin = tiny_vault / "vault.bin"
    r = subprocess.run([str(driver), "3000", str(out), str(vault_bin)], capture_output=True, text=True,
                       env=tool_env(), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    parsed = re.search(rf"^{re.escape(str(vault_bin))}: 3000 mutations, (\d+) parsed$", r.stdout, re.M)
    assert parsed and 0 < int(parsed.group(1)) < 3000, r.stdout
    blobs = re.search(r": 50 blob mutations: (\d+) caught by the checksum, (\d+) in experts nobody used, "
                      r"(\d+) unchecked runs$", r.stdout, re.M)
    assert blobs, r.stdout
    caught, unused, unchecked = map(int, blobs.groups())
    assert caught + unused == 25 and unchecked == 25 and caught > 0
    assert list(out.iterdir()) == []  # its blob copy and kept input removed


def test_fuzzers_on_a_glm_vault(fuzz_driver, tiny_glm_vault, tmp_path):
    """Both fuzzers seeded with a vault of another family: the parameter table, per-layer blob
    layouts, biases, router.bias and shared experts under mutation (header and tables only)."""
    out = tmp_path / "py"
    read = fuzz_vaultio.main(200, tiny_glm_vault, out, seed=1)
    assert 0 < read < 200 and list(out.iterdir()) == []
    driver, out = fuzz_driver, tmp_path / "out"
    out.mkdir()
    vault_bin = tiny_glm_vault / "vault.bin"
    r = subprocess.run([str(driver), "2000", str(out), str(vault_bin)], capture_output=True, text=True,
                       env=tool_env(), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    parsed = re.search(rf"^{re.escape(str(vault_bin))}: 2000 mutations, (\d+) parsed$", r.stdout, re.M)
    assert parsed and 0 < int(parsed.group(1)) < 2000, r.stdout


@pytest.fixture(scope="module")
def other_family_vaults(tmp_path_factory):
    """gpt-oss (sinks, biases, YaRN parameters) from synth, and Qwen3.5-MoE (Gated DeltaNet layers:
    the linear_* parameters and tensors, tiled value heads) imported from its GGUF fixture."""
    from pysmoe.synthesis import synth
    out = {"gpt-oss": synth(tmp_path_factory.mktemp("oss") / "v", preset="gpt-oss-tiny")}
    try:
        import gguf  # noqa: F401  (the GGUF reader the import needs)
    except ImportError:
        out["qwen35moe"] = None
    else:
        from pysmoe.convert import convert_checkpoint
        out["qwen35moe"] = convert_checkpoint(ROOT / "tests" / "data" / "gguf" / "qwen35moe-q8_0.gguf",
                                              tmp_path_factory.mktemp("q35") / "v", progress=False)
    return out


@pytest.mark.parametrize("family", ["gpt-oss", "qwen35moe"])
def test_fuzzers_on_other_families(fuzz_driver, other_family_vaults, family, tmp_path):
    """Both fuzzers on a gpt-oss and a hybrid vault: a linear-attention layer has no q, k, v, o
    (the C driver touched them and crashed on the hybrid; the Python reader raised KeyError on a
    layer kind turned linear, test_vaultio_fuzz.py)."""
    if other_family_vaults[family] is None:
        pytest.skip("the gguf package is not installed: no GGUF import here")
    v = pathlib.Path(other_family_vaults[family])
    read = fuzz_vaultio.main(300, v, tmp_path / "py", seed=2)
    assert 0 < read < 300 and list((tmp_path / "py").iterdir()) == []
    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run([str(fuzz_driver), "3000", str(out), str(v / "vault.bin")], capture_output=True, text=True,
                       env=tool_env(), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    parsed = re.search(rf"^{re.escape(str(v / 'vault.bin'))}: 3000 mutations, (\d+) parsed$", r.stdout, re.M)
    assert parsed and 0 < int(parsed.group(1)) < 3000, r.stdout
    assert list(out.iterdir()) == []
