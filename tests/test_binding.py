"""The cffi binding: its cdef is the header's, the ABI version is checked, every status maps to
a typed exception that carries the library's message, and logs reach Python's logging."""
from __future__ import annotations

import importlib.util
import logging
import os
import pathlib

import pytest

import pysmoe
from pysmoe import errors
from pysmoe._cdef import CDEF
from pysmoe._ffi import ABI_VERSION, check, ffi, lib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_cdef_is_generated_from_the_header():
    spec = importlib.util.spec_from_file_location("gen_cdef", ROOT / "scripts" / "gen_cdef.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    header = gen.header_text()
    assert gen.render(header) == (ROOT / "pysmoe" / "_cdef.py").read_text(), \
        "pysmoe/_cdef.py is stale: python scripts/gen_cdef.py > pysmoe/_cdef.py"
    assert "smoe_prefill_chunk" in CDEF and "smoe_decode_step" in CDEF


def test_precompiled_cdef_matches_and_a_stale_one_is_not_used(tmp_path, monkeypatch):
    """pysmoe/_ffi_build.py's module (the cdef parsed at build time) declares what parsing CDEF
    declares; _ffi uses it only while the CDEF it carries is the current one, else it parses."""
    import sys
    import types

    import cffi

    from pysmoe import _ffi, _ffi_build
    path = _ffi_build.write(tmp_path)
    spec = importlib.util.spec_from_file_location("pysmoe._smoe_cffi_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.CDEF == CDEF
    parsed = cffi.FFI()
    parsed.cdef(CDEF)
    for name in ("smoe_session_params", "smoe_config", "smoe_counters", "smoe_sampler_params", "smoe_proj"):
        if name in CDEF:
            assert mod.ffi.sizeof(name) == parsed.sizeof(name), name
            assert [f[0] for f in mod.ffi.typeof(name).fields] == [f[0] for f in parsed.typeof(name).fields], name
    for name in ("smoe_log_fn", "smoe_verify_fn"):  # the callbacks' types, as the binding names them
        assert mod.ffi.typeof(name).cname == parsed.typeof(name).cname, name
    # the module that _ffi picks: the written one while it matches, a parse when it is stale
    monkeypatch.setitem(sys.modules, "pysmoe._smoe_cffi", mod)
    monkeypatch.setattr(pysmoe, "_smoe_cffi", mod, raising=False)
    assert _ffi._make_ffi() is mod.ffi
    stale = types.SimpleNamespace(ffi=mod.ffi, CDEF=CDEF.replace("smoe_decode_step", "smoe_decode_steps"))
    monkeypatch.setitem(sys.modules, "pysmoe._smoe_cffi", stale)
    monkeypatch.setattr(pysmoe, "_smoe_cffi", stale, raising=False)
    got = _ffi._make_ffi()
    assert got is not mod.ffi and got.sizeof("smoe_session_params") == parsed.sizeof("smoe_session_params")


def test_every_public_function_is_exported():
    import re
    headers = "".join((ROOT / "csrc" / h).read_text() for h in ("smoe.h", "smoe_testing.h"))
    names = re.findall(r"SMOE_API [^;(]*?\b(smoe_\w+)\s*\(", headers)
    assert len(names) > 20
    for name in names:
        assert getattr(lib, name) is not None, name
    for fixed in ("smoe_open_vault", "smoe_close_vault", "smoe_session_new", "smoe_session_free",
                  "smoe_prefill_chunk", "smoe_decode_step", "smoe_stats", "smoe_last_error", "smoe_version"):
        assert fixed in names


def test_versions():
    assert lib.smoe_abi_version() == ABI_VERSION == lib.SMOE_ABI_VERSION
    assert ffi.string(lib.smoe_version()).decode() == pysmoe.__version__


def test_every_status_maps_to_a_typed_exception():
    codes = [v for k, v in vars(lib).items() if k.startswith("SMOE_ERR_")] if hasattr(lib, "__dict__") else []
    codes = [getattr(lib, n) for n in dir(lib) if n.startswith("SMOE_ERR_")] or codes
    assert sorted(codes) == sorted(errors.BY_CODE)  # every status has its class, and no class is stale
    for code in codes:
        text = ffi.string(lib.smoe_status_str(code)).decode()
        assert text and text != ffi.string(lib.smoe_status_str(0)).decode()
        cls = errors.BY_CODE[code]
        assert issubclass(cls, pysmoe.SmoeError) and cls.code == code
    assert issubclass(pysmoe.VaultError, pysmoe.SmoeError)
    assert issubclass(pysmoe.BadToken, ValueError) and issubclass(pysmoe.ReadError, OSError)
    assert issubclass(pysmoe.Busy, RuntimeError) and errors.BY_CODE[lib.SMOE_ERR_BUSY] is pysmoe.Busy
    assert errors.BY_CODE[lib.SMOE_ERR_CANCELLED] is pysmoe.Cancelled


def test_check_carries_the_library_message(tmp_path):
    out = ffi.new("smoe_vault **")
    with pytest.raises(pysmoe.VaultError) as err:
        check(lib.smoe_open_vault(os.fsencode(tmp_path / "nowhere"), out))
    assert "nowhere" in str(err.value) and err.value.code == pysmoe.VaultError.code
    assert check(0) == 0


def test_engine_messages_reach_logging(tiny_vault, caplog):
    with caplog.at_level(logging.DEBUG, logger="pysmoe"):
        pysmoe.open_vault(tiny_vault).close()
    opened = [r for r in caplog.records if r.name == "pysmoe" and "opened" in r.getMessage()]
    assert opened and opened[0].levelno == logging.INFO and str(tiny_vault) in opened[0].getMessage()


def test_open_vault_on_garbage(tmp_path):
    (tmp_path / "vault.bin").write_bytes(b"not a vault at all" * 100)
    with pytest.raises(pysmoe.VaultError, match="not a pysmoe vault"):
        pysmoe.open_vault(tmp_path)
