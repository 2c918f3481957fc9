"""The package as users install it: pyproject.toml lists every package of pysmoe, so a wheel (not
only an editable install) has them; and `python -m build` gives an sdist and a platform wheel that
carries libsmoe (setup.py runs the Makefile) and runs in a fresh venv.

A subpackage missing from `[tool.setuptools] packages` is left out of a built wheel without an
error: pysmoe.textgen was, once. The demo vault's folder must be listed too (its files ride as
package data)."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_package_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "pysmoe").rglob("__init__.py")}
    assert found <= listed, f"not in pyproject.toml's packages: {sorted(found - listed)}"
    assert {"pysmoe.data", "pysmoe.data.demo"} <= listed


def test_demo_vault_is_package_data():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert data.get("pysmoe.data.demo") == ["*"]
    assert (ROOT / "pysmoe" / "data" / "demo" / "vault.bin").is_file()


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_is_an_spdx_expression_and_the_backend_takes_it():
    """setuptools ≥ 77 reads `license = "MIT"` (PEP 639); the table form is deprecated."""
    project = _pyproject()
    assert project["project"]["license"] == "MIT"
    assert "setuptools>=77" in project["build-system"]["requires"]


def _run(cmd, **kw):
    out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out


def _clean_env() -> dict:
    """An environment that finds neither this checkout nor another libsmoe."""
    drop = ("PYTHONPATH", "SMOE_LIB", "LD_PRELOAD", "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "VIRTUAL_ENV")
    return {k: v for k, v in os.environ.items() if k not in drop}


@pytest.mark.slow
def test_sdist_builds_a_wheel_that_runs_in_a_fresh_venv(tmp_path):
    """`python -m build`: the sdist, then the wheel built from the unpacked sdist (so the sdist
    carries everything libsmoe's build needs), installed into a fresh venv and run from outside the
    checkout: `import pysmoe` loads the wheel's own libsmoe and `python -m pysmoe run` on the
    shipped demo prints what this checkout's build prints. No build isolation (the backend is this
    environment's setuptools), and the venv reaches the installed dependencies through a .pth
    file instead of downloading them; libsmoe itself is compiled from the sdist's csrc/."""
    pytest.importorskip("build")
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} < 77 (pyproject's build requirement)")
    if not (shutil.which("make") and shutil.which(os.environ.get("CC", "cc"))):
        pytest.skip("make or a C compiler is missing")
    if not (ROOT / ".git").exists() or not shutil.which("git"):
        pytest.skip("not a git checkout: the sdist is built from the tracked files")
    dist = tmp_path / "dist"
    # From a copy of the tracked files: setuptools writes its egg-info and build/ beside them.
    src = tmp_path / "src"
    files = _run(["git", "ls-files", "-z"], cwd=ROOT).stdout.split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    built = _run([sys.executable, "-m", "build", "--no-isolation", "-o", str(dist), str(src)], env=_clean_env())
    assert "Deprecat" not in built.stdout + built.stderr, "the build warned of something deprecated"

    sdist = next(dist.glob("pysmoe-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"Makefile", "setup.py", "smoe.pc.in", "csrc/smoe.h", "csrc/engine/pass.c", "csrc/cpu/kernels_avx2.c",
            "pysmoe/data/demo/vault.bin", "pysmoe/server/app.py"} <= names
    assert not [n for n in names if n.endswith((".so", ".o", ".dylib"))], "a build output in the sdist"

    wheel = next(dist.glob("pysmoe-*.whl"))
    plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    assert wheel.name.endswith(f"-py3-none-{plat}.whl"), wheel.name
    libname = "libsmoe.dylib" if sys.platform == "darwin" else "libsmoe.so"
    with zipfile.ZipFile(wheel) as z:
        assert f"pysmoe/{libname}" in z.namelist()
        assert "pysmoe/_smoe_cffi.py" in z.namelist()  # the cdef parsed at build time (pysmoe/_ffi_build.py)
        info = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/WHEEL"))).decode()
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert "Root-Is-Purelib: false" in info
    assert "License-Expression: MIT" in meta

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index", str(wheel)],
         env=_clean_env())
    site = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    deps = sysconfig.get_paths()["purelib"]  # numpy, cffi, tokenizers... of this environment
    pathlib.Path(site, "pysmoe_test_deps.pth").write_text(deps + "\n")

    away = tmp_path / "elsewhere"
    away.mkdir()
    lib = _run([str(py), "-c", "import sys, pysmoe._ffi as f; print(f.LIB_PATH); print('pycparser' in sys.modules)"],
               cwd=away, env=_clean_env())
    assert lib.stdout.split()[1] == "False", "the wheel's binding parsed its cdef at import"
    assert pathlib.Path(lib.stdout.split()[0]).resolve() == (venv.resolve() / pathlib.Path(site).relative_to(venv)
                                                          / "pysmoe" / libname).resolve()
    cmd = ["-m", "pysmoe", "run", "--prompt", "The quick brown fox", "--max-tokens", "12"]
    got = _run([str(py), *cmd], cwd=away, env=_clean_env(), timeout=300)
    assert got.stdout.strip()
    if not os.environ.get("SMOE_LIB"):  # this checkout's build, the same flags: the same text
        want = _run([sys.executable, *cmd], cwd=ROOT, env=_clean_env(), timeout=300)
        assert got.stdout == want.stdout


def test_readme_and_docs_links_resolve():
    """Every relative link of README.md and docs/*.md names a file of the checkout (the README's
    details moved to docs/; a moved or renamed page must not leave a dead link)."""
    import re
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    dead = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                dead.append(f"{page.relative_to(ROOT)}: {target}")
    assert not dead, dead
