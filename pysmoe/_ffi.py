"""Layer 1 of the binding: load libsmoe (cffi ABI mode) and check every status.

ABI mode over the library that `make lib` builds keeps Python installs free of a compiler step
and lets `SMOE_LIB` point the same Python at another build (the sanitizer build, say); the price,
a cdef that must match the header, is paid by tests/test_binding.py (docs/binding.md).
"""
from __future__ import annotations

import logging
import os
import pathlib
import sys

from ._cdef import CDEF
from .errors import BY_CODE, SmoeError

ABI_VERSION = 6


def _make_ffi():
    """The declarations as the build parsed them (_smoe_cffi, written by _ffi_build.py: ~3 ms to
    load) while they match CDEF; else CDEF parsed here (~50 ms)."""
    try:
        from . import _smoe_cffi
        if getattr(_smoe_cffi, "CDEF", None) == CDEF:
            return _smoe_cffi.ffi
    except Exception:  # not written (make lib alone), or by a cffi this one cannot load: parse
        pass
    import cffi
    f = cffi.FFI()
    f.cdef(CDEF)
    return f


ffi = _make_ffi()

_log = logging.getLogger("pysmoe")


def _candidates():
    env = os.environ.get("SMOE_LIB")
    if env:
        yield pathlib.Path(env)
        return
    name = "libsmoe.dylib" if sys.platform == "darwin" else "libsmoe.so"
    here = pathlib.Path(__file__).resolve().parent
    yield here / name
    yield here.parent / "build" / name


def _load():
    tried = []
    for path in _candidates():
        if path.exists():
            lib = ffi.dlopen(str(path))
            got = lib.smoe_abi_version()
            if got != ABI_VERSION or lib.SMOE_ABI_VERSION != ABI_VERSION:
                raise ImportError(f"{path}: libsmoe ABI version {got}, this pysmoe needs {ABI_VERSION}; rebuild with `make lib`")
            return lib, path
        tried.append(str(path))
    raise ImportError("libsmoe not found (tried " + ", ".join(tried) + "); build it with `make lib` or set SMOE_LIB")


lib, LIB_PATH = _load()

_LEVELS = {0: logging.DEBUG, 1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR}


@ffi.callback("smoe_log_fn")
def _on_log(level, message, _user):
    try:
        _log.log(_LEVELS.get(level, logging.INFO), ffi.string(message).decode("utf-8", "replace"))
    except Exception:  # a callback must never raise into C
        pass


lib.smoe_set_log_callback(_on_log, ffi.NULL)


def last_error() -> str:
    return ffi.string(lib.smoe_last_error()).decode("utf-8", "replace")


def check(rc: int) -> int:
    """Raise the exception class of status rc, carrying the library's own message."""
    if rc >= 0:
        return rc
    message = last_error() or ffi.string(lib.smoe_status_str(rc)).decode()
    raise BY_CODE.get(rc, SmoeError)(message, rc)
