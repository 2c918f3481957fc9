"""Writes pysmoe/_smoe_cffi.py: the binding's declarations (_cdef.CDEF) parsed once, when the
package is built, instead of at every import (cffi's out-of-line ABI mode: a pure-Python module,
no compiler). Parsing the cdef at import costs ~50 ms (pycparser's import and its parse; ~120 ms
with a cold page cache) of every `import pysmoe`'s engine and every `python -m pysmoe`; loading
the written module costs ~3 ms.

setup.py's build_ext runs write() next to the library it builds (the checkout's pysmoe/ in an
editable install, the wheel's otherwise). The module ends with the CDEF text it was written from,
so that _ffi.py uses it only while that is the cdef it would parse (a checkout whose _cdef.py
changed since falls back to parsing, as it does where the module was never written: `make lib`
alone, an unbuilt source tree). The text itself, not a hash of it: comparing 7 KB costs nothing,
and hashlib's OpenSSL would cost every import 4-8 ms after a page-cache drop.

    python -m pysmoe._ffi_build [DIR]     (default: this package's folder)
"""
from __future__ import annotations

import os
import pathlib
import sys

MODULE = "_smoe_cffi"


def write(directory: str | os.PathLike) -> pathlib.Path:
    """Parses CDEF and writes DIR/_smoe_cffi.py (atomically: a temporary file renamed over it)."""
    import cffi

    from ._cdef import CDEF

    target = pathlib.Path(directory) / f"{MODULE}.py"
    tmp = target.with_name(f".{MODULE}.{os.getpid()}.tmp")
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.set_source(f"pysmoe.{MODULE}", None)
    try:
        ffi.emit_python_code(str(tmp))
        with open(tmp, "a", encoding="utf-8") as f:
            f.write(f"\n# pysmoe._cdef.CDEF as this module was written from it (pysmoe/_ffi_build.py)\n"
                    f"CDEF = {CDEF!r}\n")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


if __name__ == "__main__":
    print(write(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent))
