"""Vault writes are staged beside the target and renamed in when complete (pysmoe.vaultdir):
a killed or failed write never damages the vault that was there, and nothing is overwritten
without --force."""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time

import pytest

import pysmoe
from pysmoe.vaultdir import TargetError, TargetExists, staged

ENV = dict(os.environ, PYTHONUNBUFFERED="1")


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "pysmoe", *map(str, args)], capture_output=True, text=True,
                          timeout=600, env=ENV, **kw)


def digest(d) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def leftovers(parent) -> list:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.fixture
def old_vault(tmp_path):
    """A small vault at tmp_path/v that later writes must not damage."""
    v = pysmoe.synth(tmp_path / "v", preset="tiny", seed=1, layers=2, progress=False)
    return v, digest(v)


def test_refuses_a_non_empty_target(old_vault):
    v, before = old_vault
    with pytest.raises(TargetExists) as e:
        pysmoe.synth(v, preset="tiny", seed=2, layers=2, progress=False)
    assert isinstance(e.value, FileExistsError) and isinstance(e.value, pysmoe.SmoeError)
    assert str(v) in str(e.value) and "--force" in str(e.value)
    out = cli("synth", v, "--layers", "2", "--seed", "2", "--quiet")
    assert out.returncode == 2 and "not empty" in out.stderr and "Traceback" not in out.stderr
    assert digest(v) == before and leftovers(v.parent) == []


def test_force_replaces_with_the_new_vault(old_vault, tmp_path):
    v, before = old_vault
    out = cli("synth", v, "--layers", "2", "--seed", "2", "--quiet", "--force")
    assert out.returncode == 0, out.stderr
    want = digest(pysmoe.synth(tmp_path / "fresh", preset="tiny", seed=2, layers=2, progress=False))
    assert digest(v) == want != before
    assert leftovers(tmp_path) == []  # neither the staging nor the replaced directory is left


def test_an_empty_existing_directory_is_fine(tmp_path):
    (tmp_path / "e").mkdir()
    pysmoe.synth(tmp_path / "e", layers=1, progress=False)
    assert (tmp_path / "e" / "vault.bin").is_file()


def test_a_failed_write_leaves_nothing_and_the_old_vault_intact(old_vault):
    v, before = old_vault
    with pytest.raises(RuntimeError):
        with staged(v, force=True) as tmp:
            (tmp / "vault.bin").write_bytes(b"half")
            raise RuntimeError("writer failed")
    assert digest(v) == before and leftovers(v.parent) == []


def test_an_unverifiable_vault_is_not_installed(old_vault):
    v, before = old_vault
    with pytest.raises(pysmoe.VaultError):
        with staged(v, force=True) as tmp:
            (tmp / "vault.bin").write_bytes(b"not a vault at all")
    assert digest(v) == before and leftovers(v.parent) == []


@pytest.mark.parametrize("where", ["file", "under_file", "link"])
def test_refuses_a_file_a_link_or_an_uncreatable_path(tmp_path, where):
    f = tmp_path / "f"
    f.write_text("keep me")
    target = {"file": f, "under_file": f / "v", "link": tmp_path / "l"}[where]
    if where == "link":
        target.symlink_to(tmp_path)
    with pytest.raises(TargetError):
        with staged(target, force=True):
            pass
    out = cli("synth", target, "--quiet", "--force")
    assert out.returncode == 2 and "usage" in out.stderr and "Traceback" not in out.stderr
    assert f.read_text() == "keep me"


def _start_mini_over(v) -> subprocess.Popen:
    """A synth of the mini preset (seconds of work) replacing v, stopped once it has written."""
    proc = subprocess.Popen([sys.executable, "-m", "pysmoe", "synth", str(v), "--preset", "mini", "--layers", "2",
                             "--quiet", "--force"], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        staging = [p for p in v.parent.glob(f".{v.name}.incomplete-*/vault.bin")]
        if staging and staging[0].stat().st_blocks > 0:  # the file has data in it: writing started
            return proc
        time.sleep(0.01)
    proc.kill()
    pytest.fail(f"synth finished or stalled before it could be interrupted: {proc.communicate()}")


def test_kill_9_half_way_keeps_the_old_vault_bit_identical(old_vault):
    v, before = old_vault
    proc = _start_mini_over(v)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert digest(v) == before
    with pysmoe.open_vault(v) as vault:
        assert vault.verify() == []
    (left,) = v.parent.glob(f".{v.name}.incomplete-*")
    with pytest.raises(pysmoe.VaultError, match="incomplete vault"):
        pysmoe.open_vault(left)
    for args in (["info", left], ["run", "--vault", left, "--ids", "1,2", "--max-tokens", "1"]):
        out = cli(*args)
        assert out.returncode == 1 and "incomplete vault" in out.stderr and "Traceback" not in out.stderr


def test_ctrl_c_half_way_cleans_up(old_vault):
    v, before = old_vault
    proc = _start_mini_over(v)
    proc.send_signal(signal.SIGINT)
    proc.communicate()
    assert proc.returncode == 130
    assert digest(v) == before and leftovers(v.parent) == []
