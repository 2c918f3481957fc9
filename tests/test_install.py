"""libsmoe as other programs use it: `make install` (versioned file, soname, links, smoe.h,
smoe.pc) into a temporary prefix, examples/generate.c built out of tree through pkg-config and run
on the tiny vault, the exported symbols exactly smoe.h's functions, and the header compiling
warning-free as C11, C99 and C++17."""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import pysmoe

ROOT = pathlib.Path(__file__).resolve().parent.parent
HEADER = ROOT / "csrc" / "smoe.h"
DARWIN = sys.platform == "darwin"

pytestmark = pytest.mark.skipif(sys.platform not in ("linux", "darwin"), reason="make install is for Linux and macOS")


def header_macro(name: str) -> str:
    return re.search(rf"^#define {name} \"?([^\"\s]+)", HEADER.read_text(), re.M).group(1)


ABI = header_macro("SMOE_ABI_VERSION")
RELEASE = header_macro("SMOE_VERSION_STRING")
SOVERSION = ".".join([ABI] + RELEASE.split(".")[1:])
if DARWIN:
    LIBNAME, LIBSONAME, LIBREAL = "libsmoe.dylib", f"libsmoe.{ABI}.dylib", f"libsmoe.{ABI}.dylib"
else:
    LIBNAME, LIBSONAME, LIBREAL = "libsmoe.so", f"libsmoe.so.{ABI}", f"libsmoe.so.{SOVERSION}"


def tool_env() -> dict:
    """The environment for make, compilers and linkers: without the sanitizer runtime that
    `make asan` preloads, and without the outer make's jobserver (its descriptors are not ours)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    return env


def run(cmd, **kw):
    out = subprocess.run(cmd, capture_output=True, text=True, env=kw.pop("env", tool_env()), **kw)
    assert out.returncode == 0, f"{cmd}\n{out.stdout}\n{out.stderr}"
    return out


def make(*args):
    if not shutil.which("make"):
        pytest.skip("make not found")
    return run(["make", "-s", "--no-print-directory", *args], cwd=ROOT)


def header_functions() -> set[str]:
    """Every function smoe.h (and smoe_testing.h, the calls for tests and tools) declares with
    SMOE_API, read from the headers themselves, so functions added there are expected without this
    test changing."""
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text() + (HEADER.parent / "smoe_testing.h").read_text(), flags=re.S)
    return set(re.findall(r"SMOE_API\s[^;(]*?\b(smoe_\w+)\s*\(", text))


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("prefix")
    make("install", f"PREFIX={prefix}")
    return prefix


def test_install_lays_out_the_versioned_library_header_and_pc(prefix):
    lib = prefix / "lib"
    assert (lib / LIBREAL).is_file() and not (lib / LIBREAL).is_symlink()
    if not DARWIN:
        assert os.readlink(lib / LIBSONAME) == LIBREAL
    assert os.readlink(lib / LIBNAME) == LIBSONAME
    assert (prefix / "include" / "smoe.h").read_bytes() == HEADER.read_bytes()
    pc = (lib / "pkgconfig" / "smoe.pc").read_text()
    assert f"prefix={prefix}\n" in pc and f"Version: {RELEASE}\n" in pc
    if DARWIN:
        ident = run(["otool", "-D", str(lib / LIBREAL)]).stdout.split()[-1]
        assert ident == str(lib / LIBSONAME)
    else:
        dyn = run(["readelf", "-d", str(lib / LIBREAL)]).stdout
        assert f"Library soname: [{LIBSONAME}]" in dyn
        assert "RPATH" not in dyn and "RUNPATH" not in dyn


def test_destdir_stages_under_it_and_uninstall_removes_everything(tmp_path):
    stage = tmp_path / "stage"
    make("install", "PREFIX=/opt/smoe-test", f"DESTDIR={stage}")
    root = stage / "opt" / "smoe-test"
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())
    assert files == sorted({f"lib/{LIBREAL}", f"lib/{LIBSONAME}", f"lib/{LIBNAME}", "include/smoe.h",
                            "lib/pkgconfig/smoe.pc"})
    # what is written into the files is the final prefix, never the staging directory
    assert "prefix=/opt/smoe-test\n" in (root / "lib" / "pkgconfig" / "smoe.pc").read_text()
    assert str(stage).encode() not in (root / "lib" / LIBREAL).read_bytes()
    make("uninstall", "PREFIX=/opt/smoe-test", f"DESTDIR={stage}")
    assert [p for p in root.rglob("*") if not p.is_dir()] == []


def greedy_ids(vault_dir, prompt, n):
    with pysmoe.open_vault(vault_dir) as vault, vault.session() as s:
        out = [int(np.argmax(s.prefill(prompt)))]
        while len(out) < n:
            out.append(int(np.argmax(s.decode(out[-1]))))
    return out


def test_generate_builds_out_of_tree_with_pkg_config_and_runs(prefix, tmp_path, tiny_vault):
    if not shutil.which("pkg-config"):
        pytest.skip("pkg-config not found")
    env = tool_env()
    env["PKG_CONFIG_PATH"] = str(prefix / "lib" / "pkgconfig")
    flags = run(["pkg-config", "--cflags", "--libs", "smoe"], env=env).stdout.split()
    assert flags == [f"-I{prefix}/include", f"-L{prefix}/lib", "-lsmoe"]
    src = tmp_path / "generate.c"
    shutil.copy(ROOT / "examples" / "generate.c", src)
    exe = tmp_path / "generate"
    run([os.environ.get("CC", "cc"), "-std=c11", "-Wall", "-Wextra", "-Werror", str(src), *flags, "-o", str(exe)],
        cwd=tmp_path, env=env)
    if not DARWIN:
        assert f"Shared library: [{LIBSONAME}]" in run(["readelf", "-d", str(exe)]).stdout
    env["LD_LIBRARY_PATH" if not DARWIN else "DYLD_LIBRARY_PATH"] = str(prefix / "lib")
    prompt = [5, 17, 300, 42, 7, 99, 1]
    out = run([str(exe), str(tiny_vault), "6", *map(str, prompt)], cwd=tmp_path, env=env, timeout=120)
    got = [int(t) for t in out.stdout.split()]
    if os.environ.get("SMOE_LIB"):  # Python runs another build (make asan's): only the count is sure
        assert len(got) == 6
    else:
        assert got == greedy_ids(tiny_vault, prompt, 6)


def test_exported_symbols_are_exactly_the_header_functions():
    lib = ROOT / "build" / LIBNAME
    if not lib.exists():
        pytest.skip(f"{lib} not built (make lib)")
    if not shutil.which("nm"):
        pytest.skip("nm not found")
    cmd = ["nm", "-gU", str(lib)] if DARWIN else ["nm", "-D", "--defined-only", str(lib)]
    exported = {line.split()[-1].lstrip("_" if DARWIN else "") for line in run(cmd).stdout.splitlines() if line.strip()}
    declared = header_functions()
    assert len(declared) > 20 and "smoe_decode_step" in declared
    assert exported - declared == set(), "exported but not in smoe.h"
    assert declared - exported == set(), "declared in smoe.h but not exported"


PROGRAM = """#include "smoe.h"
#include <stdio.h>
int main(void) {
    smoe_session_params p = smoe_session_default_params();
    printf("%s %d %u\\n", smoe_version(), smoe_abi_version(), (unsigned)p.struct_size);
    return smoe_abi_version() == SMOE_ABI_VERSION ? 0 : 1;
}
"""


@pytest.mark.parametrize("compiler,std,suffix", [("cc", "c11", ".c"), ("cc", "c99", ".c"), ("c++", "c++17", ".cpp")])
def test_header_compiles_warning_free_and_links(compiler, std, suffix, tmp_path):
    """Built, linked and run, so the C++ build also proves the extern "C" guard (mangled names
    would not link)."""
    lib_dir = ROOT / "build"
    if not (lib_dir / LIBNAME).exists():
        pytest.skip("build/ has no libsmoe (make lib)")
    cc = os.environ.get("CXX", "c++") if compiler == "c++" else os.environ.get("CC", "cc")
    if not shutil.which(cc):
        pytest.skip(f"{cc} not found")
    src = tmp_path / f"use{suffix}"
    src.write_text(PROGRAM)
    exe = tmp_path / "use"
    run([cc, f"-std={std}", "-Wall", "-Wextra", "-Wpedantic", "-Werror", f"-I{ROOT / 'csrc'}", str(src),
         f"-L{lib_dir}", "-lsmoe", f"-Wl,-rpath,{lib_dir}", "-o", str(exe)])
    version, abi, _ = run([str(exe)]).stdout.split()
    assert (version, abi) == (RELEASE, ABI)
