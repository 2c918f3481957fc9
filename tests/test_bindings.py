"""The Rust (bindings/rust) and Go (bindings/go) bindings against the Python one: Python writes
a prompt, the logits after it and after each following greedy step on the tiny vault; `cargo
test` and `go test` feed the same ids through their binding (with another prefill chunk size:
the layer-major path is bit-identical for any) and want the same f32 bits. Each is skipped, saying
so, where its toolchain is missing; .ci/run installs both."""
from __future__ import annotations

import hashlib
import os
import pathlib
import re
import shutil
import subprocess

import numpy as np
import pytest

import pysmoe

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROMPT = [3, 141, 59, 265, 358, 97, 93, 238, 462, 64, 33]
STEPS = 5
CHUNK = 4  # the other languages' prefill chunk; Python's session keeps its default (256)

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("SMOE_LIB")), reason="the bindings link build/'s libsmoe, not the SMOE_LIB one under test")


def hex_bits(logits) -> str:
    return " ".join(f"{b:08x}" for b in np.asarray(logits, dtype=np.float32).view(np.uint32))


@pytest.fixture(scope="module")
def expected(tiny_vault, tmp_path_factory):
    """The file both tests read: `prompt`, `chunk`, `logits` after the prompt, then one `decode ID
    NEXT` line per greedy step with the logits after feeding ID (docs in tests/logits.rs)."""
    lines = ["prompt " + " ".join(map(str, PROMPT)), f"chunk {CHUNK}"]
    with pysmoe.open_vault(tiny_vault) as vault, vault.session() as s:
        logits = s.prefill(PROMPT)
        lines.append("logits " + hex_bits(logits))
        for _ in range(STEPS):
            fed = int(np.argmax(logits))
            logits = s.decode(fed)
            lines.append(f"decode {fed} {int(np.argmax(logits))} {hex_bits(logits)}")
    path = tmp_path_factory.mktemp("bindings") / "expected.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def toolchain_env(tiny_vault, expected) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env.update(SMOE_TEST_VAULT=str(tiny_vault), SMOE_TEST_EXPECTED=str(expected))
    return env


def need_built_lib():
    if not (ROOT / "build" / "libsmoe.so").exists() and not (ROOT / "build" / "libsmoe.dylib").exists():
        pytest.skip("build/ has no libsmoe (make lib)")


def test_rust_crate_declares_the_headers_abi_version():
    header = re.search(r"^#define SMOE_ABI_VERSION (\d+)", (ROOT / "csrc" / "smoe.h").read_text(), re.M).group(1)
    crate = re.search(r"pub const ABI_VERSION: i32 = (\d+);", (ROOT / "bindings/rust/src/lib.rs").read_text()).group(1)
    assert crate == header, "smoe.h's ABI changed: update bindings/rust/src/sys.rs's structs and lib.rs's ABI_VERSION"


def test_rust_binding_logits_match_python(tiny_vault, expected):
    if not shutil.which("cargo"):
        pytest.skip("cargo not found: the Rust binding's test did not run (apt-get install cargo)")
    need_built_lib()
    env = toolchain_env(tiny_vault, expected)
    env.update(SMOE_LIB_DIR=str(ROOT / "build"), CARGO_TARGET_DIR=str(ROOT / "build" / "rust"))
    out = subprocess.run(["cargo", "test", "--offline", "--manifest-path", str(ROOT / "bindings/rust/Cargo.toml"),
                          "--", "--nocapture"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"rust: {1 + STEPS} logits vectors of 512 floats bit-identical to Python's" in out.stdout


def test_go_binding_logits_match_python(tiny_vault, expected):
    if not shutil.which("go"):
        pytest.skip("go not found: the Go binding's test did not run (apt-get install golang-go)")
    need_built_lib()
    env = toolchain_env(tiny_vault, expected)
    # offline, the build cache kept under build/, one per smoe.h: go does not hash a header cgo
    # includes from outside the package, so a cache from an older header would be reused
    header = hashlib.sha256((ROOT / "csrc" / "smoe.h").read_bytes()).hexdigest()[:12]
    env.update(GOPROXY="off", GOFLAGS="-mod=mod", GOCACHE=str(ROOT / "build" / f"go-cache-{header}"), CGO_ENABLED="1")
    out = subprocess.run(["go", "test", "-v", "-count=1", "./..."], cwd=ROOT / "bindings" / "go",
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "--- PASS: TestLogitsMatchPython" in out.stdout
    assert f"go: {1 + STEPS} logits vectors of 512 floats bit-identical to Python's" in out.stdout
