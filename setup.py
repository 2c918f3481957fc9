"""The build hook of pysmoe's package: libsmoe is built by the Makefile, here as for `make lib`.

setuptools drives the Makefile rather than a second description of the build (a CMakeLists, an
Extension list): csrc/'s file list, the compiler flags that bit identity depends on
(-ffp-contract=off), the instruction-set choice (AVX2 + FMA + F16C on x86-64, NEON on AArch64,
faster kernels picked at run time) and PORTABLE=1 / CUDA=1 stay in one place. What this file adds:

  - build_ext builds $(BUILD)/libsmoe.so in setuptools' build_temp (nothing is written into the
    checkout) and copies the library into the package in build_lib, so `pip install .`, the wheel
    and an install from the sdist carry it. In an editable install (`pip install -e .`, what
    `make run` and `make test` do) it runs `make lib`, which puts the library in pysmoe/.
  - Beside the library it writes pysmoe/_smoe_cffi.py, the binding's cdef parsed once
    (pysmoe/_ffi_build.py: cffi's out-of-line ABI mode, pure Python), which saves every import of
    the engine ~50 ms of parsing; without cffi in the build environment it says so and the
    binding parses at import, as before.
  - The distribution counts as having extension modules, so the wheel is platform-specific
    (py3-none-<platform>): libsmoe is loaded through cffi's ABI mode and does not depend on the
    Python version, only on the OS and the CPU.

The environment reaches make as usual: `PORTABLE=1 pip install .` builds the portable kernels,
`CUDA=1 pip install .` adds the CUDA backend (nvcc), CC picks the compiler. Metadata lives in
pyproject.toml."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

ROOT = pathlib.Path(__file__).resolve().parent
LIBNAME = "libsmoe.dylib" if sys.platform == "darwin" else "libsmoe.so"


def _make(*args: str) -> None:
    make = os.environ.get("MAKE") or shutil.which("make") or shutil.which("gmake")
    if make is None:
        sys.exit("pysmoe: building libsmoe needs make and a C compiler (cc); neither make nor gmake was found")
    jobs = str(min(os.cpu_count() or 1, 8))
    cmd = [make, "-C", str(ROOT), f"-j{jobs}", *args]
    print("pysmoe:", " ".join(cmd), flush=True)
    # not an outer make's jobserver (pip run from `make run`): its descriptors are not ours
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    subprocess.run(cmd, check=True, env=env)


def _write_cdef_module(directory: pathlib.Path) -> bool:
    """pysmoe/_ffi_build.py into directory (this checkout's pysmoe, imported from ROOT)."""
    r = subprocess.run([sys.executable, "-m", "pysmoe._ffi_build", str(directory)], cwd=ROOT,
                       capture_output=True, text=True)
    if r.returncode != 0:
        print("pysmoe: the binding's cdef was not precompiled (it will be parsed at import):",
              (r.stderr.strip().splitlines() or ["?"])[-1], flush=True)
    return r.returncode == 0


class BuildLibsmoe(build_ext):
    """Builds libsmoe with the Makefile (there are no Python extension modules) and writes the
    binding's precompiled cdef beside it."""

    def run(self):
        if self.editable_mode or self.inplace:
            _make("lib")
            _write_cdef_module(ROOT / "pysmoe")
            return
        build = pathlib.Path(self.build_temp).resolve() / "libsmoe"
        _make(f"BUILD={build}", str(build / LIBNAME))
        target = pathlib.Path(self.build_lib) / "pysmoe" / LIBNAME
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(build / LIBNAME, target)  # the real file, not the soname links
        os.chmod(target, 0o755)
        self._cdef = _write_cdef_module(target.parent)

    def get_outputs(self):
        if self.editable_mode or self.inplace:
            return []
        lib = pathlib.Path(self.build_lib) / "pysmoe"
        return [str(lib / LIBNAME)] + ([str(lib / "_smoe_cffi.py")] if getattr(self, "_cdef", False) else [])


class PlatformWheel(bdist_wheel):
    """py3-none-<platform>: any Python 3 on this OS and CPU family."""

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


class BinaryDistribution(Distribution):
    def has_ext_modules(self):
        return True


setup(distclass=BinaryDistribution, cmdclass={"build_ext": BuildLibsmoe, "bdist_wheel": PlatformWheel})
