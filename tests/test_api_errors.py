"""Every error from the public Python API is a SmoeError (also the matching builtin), raised
before anything is fed; open_vault expands ~ (issue 11, items 5 and 6)."""
import os
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pysmoe
from pysmoe import InvalidArgument, SmoeError, VaultError
from pysmoe.generate import stream_generate

BAD_INTS = [-1, 2**64, 2**40 * 2**40, 1.5, "3", None, True]
SETTINGS = settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def vault(tiny_vault):
    return pysmoe.open_vault(tiny_vault)


@pytest.mark.parametrize("kw", [dict(cache_bytes=2**64), dict(cache_bytes=-1), dict(chunk=2**40), dict(chunk=0),
                                dict(threads=2**33), dict(context=2**32), dict(io_threads=-3), dict(cache_bytes="1"),
                                dict(chunk=1.0)])
def test_session_options_out_of_range_are_invalid_argument(vault, kw):
    with pytest.raises(InvalidArgument) as e:
        vault.session(**kw)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("kw", [dict(top_k=-1), dict(top_k=2**32), dict(seed=-1), dict(seed=2**64),
                                dict(temperature="hot"), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=None),
                                dict(min_p=2.0), dict(repetition_penalty=0), dict(max_tokens=-1),
                                dict(max_tokens=2.5), dict(stop=[None]), dict(stop=["a"]), dict(stop=5)])
def test_generate_checks_every_argument_before_feeding(vault, kw):
    with vault.session(chunk=4) as s:
        s.prefill([1, 2, 3])
        with pytest.raises(InvalidArgument):
            s.generate([4, 5, 6, 7, 8], **kw)  # raised by the call itself, not the first next()
        assert s.position == 3
        with pytest.raises(InvalidArgument):
            stream_generate(s, [4, 5, 6], **kw)
        assert s.position == 3
        if "max_tokens" not in kw and "stop" not in kw:
            with pytest.raises(InvalidArgument):
                s.set_sampler(**kw)


def test_other_arguments(vault):
    with vault.session() as s:
        s.prefill([1, 2])
        for call in (lambda: s.kv(-1), lambda: s.kv(0, start=-1), lambda: s.kv(0, 0, n=2**40),
                     lambda: s.rewind(-1), lambda: s.rewind(3), lambda: s.rewind(None), lambda: s.decode(None),
                     lambda: s.prefill([1, None]), lambda: s.prefill("abc"), lambda: stream_generate(s, [1, None])):
            with pytest.raises(InvalidArgument):
                call()
            assert s.position == 2
    with pytest.raises(InvalidArgument):
        pysmoe.open_vault(None)


@SETTINGS
@given(st.dictionaries(st.sampled_from(["cache_bytes", "chunk", "threads", "context", "io_threads"]),
                       st.one_of(st.integers(-2**70, 2**70), st.integers(0, 300), st.floats(), st.none(), st.text())))
def test_any_session_options_give_a_session_or_a_smoe_error(vault, kw):
    kw = {k: v for k, v in kw.items() if not (k in ("threads", "io_threads") and isinstance(v, int) and v > 8)}
    try:
        s = vault.session(**kw)
    except SmoeError:
        return
    s.close()


@SETTINGS
@given(st.dictionaries(st.sampled_from(["max_tokens", "temperature", "top_p", "seed", "top_k", "min_p",
                                        "repetition_penalty", "stop"]),
                       st.one_of(st.integers(-2**70, 2**70), st.floats(), st.none(), st.text(max_size=2),
                                 st.lists(st.one_of(st.integers(-2**40, 2**40), st.none()), max_size=3))))
def test_any_generate_arguments_give_tokens_or_a_smoe_error(vault, kw):
    with vault.session(chunk=4) as s:
        s.prefill([1, 2])
        if isinstance(kw.get("max_tokens"), int):
            kw["max_tokens"] = min(kw["max_tokens"], 2)
        try:
            it = s.generate([3, 4, 5], **kw)
        except SmoeError:
            assert s.position == 2
            return
        out = list(it)
        assert all(isinstance(t, int) for t in out)


@pytest.fixture
def vault_copy(tiny_vault, tmp_path):
    d = tmp_path / "v"
    shutil.copytree(tiny_vault, d)
    return d


def test_unreadable_config_is_a_vault_error_naming_the_file(vault_copy):
    cfg = vault_copy / "config.json"
    cfg.unlink()
    cfg.mkdir()  # reading it fails with an OSError, as an unreadable file does (also as root)
    with pytest.raises(VaultError, match="config.json") as e:
        pysmoe.open_vault(vault_copy)
    assert isinstance(e.value.__cause__, OSError)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_permission_denied_config_is_a_vault_error(vault_copy):
    os.chmod(vault_copy / "config.json", 0)
    with pytest.raises(VaultError, match="config.json"):
        pysmoe.open_vault(vault_copy)


def test_unreadable_or_bad_tokenizer_is_a_vault_error(vault_copy):
    tj = vault_copy / "tokenizer.json"
    assert tj.exists()
    tj.unlink()
    tj.mkdir()
    with pytest.raises(VaultError, match="tokenizer.json"):
        pysmoe.open_vault(vault_copy).tokenizer
    tj.rmdir()
    tj.write_text("{not json")
    v = pysmoe.open_vault(vault_copy)
    with pytest.raises(VaultError, match="tokenizer.json"):
        v.tokenizer
    with v.session() as s, pytest.raises(VaultError):
        stream_generate(s, "hello")


def test_config_that_is_not_an_object(vault_copy):
    (vault_copy / "config.json").write_text("[1, 2]")
    with pytest.raises(VaultError, match="config.json"):
        pysmoe.open_vault(vault_copy)


def test_open_vault_expands_the_home_directory(tiny_vault, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    os.symlink(tiny_vault, tmp_path / "tiny")
    v = pysmoe.open_vault("~/tiny")
    assert v.path == tmp_path / "tiny"
    with v.session() as s:
        assert np.isfinite(s.prefill([1, 2])).all()


def test_front_end_checks_refuse_what_the_session_refuses(vault):
    # The public checks a front end that drives a session itself uses (pysmoe.generate does).
    from pysmoe.engine import check_int, check_stop_ids
    with vault.session(chunk=4, context=8) as s:
        ids = s.check_ids([1, 2, 3])
        assert ids.dtype == np.int32 and ids.tolist() == [1, 2, 3] and s.position == 0
        with pytest.raises(pysmoe.BadToken):
            s.check_ids([1, vault.config["vocab_size"]])
        with pytest.raises(InvalidArgument):
            s.check_ids([])
        s.prefill([1, 2, 3])
        s.check_room(5)
        with pytest.raises(pysmoe.ContextFull):
            s.check_room(6)
        s.check_sampler(temperature=0.7, top_k=5, seed=1)
        with pytest.raises(InvalidArgument):
            s.check_sampler(top_p=0.0)
        assert s.position == 3 and not s.closed
    assert s.closed
    assert check_int("n", np.int64(4), 0, 10) == 4
    for bad in (-1, 11, 2.0, True, "4"):
        with pytest.raises(InvalidArgument):
            check_int("n", bad, 0, 10)
    assert check_stop_ids(None) == frozenset() and check_stop_ids([7, 7, 8]) == {7, 8}
    with pytest.raises(InvalidArgument):
        check_stop_ids(5)
