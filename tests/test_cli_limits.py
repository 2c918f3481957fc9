"""The CLI where issue 29 found it wanting: a full disk is one line and keeps the old vault; what
a newcomer reads in --help, info and chat says what the commands do."""
from __future__ import annotations

import errno
import io
import os
import pathlib
import subprocess
import sys

import pytest

import pysmoe
from pysmoe import cli


def _main(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines: compare words


def _digest(vault) -> dict:
    return {p.name: p.read_bytes() for p in pathlib.Path(vault).iterdir()}


def _leftovers(parent) -> list[str]:
    return [p.name for p in pathlib.Path(parent).iterdir() if p.name.startswith(".")]


# ------------------------------------------------------------------ item 6: a full disk
class _FullDisk:
    """os.pwrite, as the vault writer calls it, failing with ENOSPC after `allow` calls."""

    def __init__(self, allow: int):
        self.allow, self.real = allow, os.pwrite

    def __call__(self, fd, data, offset):
        if self.allow <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.allow -= 1
        return self.real(fd, data, offset)


def test_synth_on_a_full_disk_is_one_line_and_keeps_the_old_vault(tmp_path, capsys, monkeypatch):
    out = tmp_path / "v"
    pysmoe.synth(out, preset="tiny", layers=1)
    before = _digest(out)
    monkeypatch.setattr("pysmoe.vaultio.os.pwrite", _FullDisk(allow=3))
    rc, _, err = _main(capsys, "synth", out, "--seed", "1", "--force", "--quiet")
    assert rc == 1
    assert err.count("\n") == 1 and "No space left on device" in err and "Traceback" not in err, err
    assert _digest(out) == before and _leftovers(tmp_path) == []


def test_convert_on_a_full_disk_is_one_line_and_keeps_the_old_vault(tmp_path, capsys, monkeypatch):
    pytest.importorskip("torch")
    from test_convert import write_checkpoint
    src = write_checkpoint(tmp_path / "hf")
    out = tmp_path / "v"
    assert _main(capsys, "convert", src, out, "--quiet", "--jobs", "1")[0] == 0
    before = _digest(out)
    monkeypatch.setattr("pysmoe.vaultio.os.pwrite", _FullDisk(allow=2))
    rc, _, err = _main(capsys, "convert", src, out, "--force", "--quiet", "--jobs", "1", "--experts", "q8")
    assert rc == 1
    assert err.count("\n") == 1 and "No space left on device" in err and "Traceback" not in err, err
    assert _digest(out) == before and _leftovers(tmp_path) == []


def test_synth_onto_a_real_full_filesystem(tmp_path):
    """The same on a 1.6 MiB tmpfs that holds one tiny vault but not a second (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1600k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode(errors='replace').strip()}")
    try:
        def synth(*extra):
            return subprocess.run([sys.executable, "-m", "pysmoe", "synth", str(mnt / "v"), "--quiet", *extra],
                                  capture_output=True, text=True, timeout=300)
        assert synth().returncode == 0
        before = _digest(mnt / "v")
        r = synth("--force", "--seed", "1")
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and "No space left on device" in r.stderr, r.stderr
        assert _digest(mnt / "v") == before and _leftovers(mnt) == []
        with pysmoe.open_vault(mnt / "v") as v:
            assert v.config["num_experts"] > 0
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


# ------------------------------------------------------------------ item 8: the newcomer's trial
def test_an_empty_prompt_is_bad_usage(capsys):
    rc, _, err = _main(capsys, "run", "--prompt", "")
    assert rc == 2 and "--prompt is empty" in err


def test_info_reserves_the_context_the_vault_allows(tmp_path, capsys):
    v = pysmoe.synth(tmp_path / "v", preset="tiny", layers=1, overrides={"max_position_embeddings": 1024})
    rc, out, _ = _main(capsys, "info", v)
    assert rc == 0
    assert "by default 1,024 tokens" in out and "4,096" not in out


def test_chat_caps_a_large_max_tokens_at_the_context(tiny_vault):
    from pysmoe.cli.chat import Conversation
    with pysmoe.open_vault(tiny_vault) as v, v.session(context=64, cache_bytes=1 << 22, threads=1) as s:
        conv = Conversation(s, v.tokenizer, max_tokens=4000, temperature=0.0)
        got = list(conv.reply("hello"))
        assert got and got[-1].finish_reason in ("stop", "context")
        assert s.position <= 64


def test_help_says_what_is_true(capsys):
    serve = _help(capsys, "serve")
    assert "made on first use" not in serve and "demo vault" in serve
    convert = _help(capsys, "convert")
    assert "(default: True)" not in convert and "--quiet" in convert
    run = _help(capsys, "run")
    run = run[run.index("options:"):]  # past the usage line
    for option, default in [("--temperature", "0.0"), ("--top-k", "0"), ("--min-p", "0.0"),
                            ("--presence-penalty", "0.0"), ("--frequency-penalty", "0.0"), ("--seed", "0"),
                            ("--repetition-penalty", "1.0")]:
        text = run[run.index(option + " "):]
        end = text.find(" --", 1)
        text = text if end < 0 else text[:end]
        assert f"(default: {default})" in text, text
    assert "greedy" in run and "server" in run


def test_progress_bars_are_short_in_a_log_and_off_in_the_api(tmp_path, capfd):
    from pysmoe.progress import Progress
    log = io.StringIO()
    with Progress(1000, "load", unit="B", stream=log) as bar:
        for _ in range(100):
            bar.update(10)
    lines = log.getvalue().splitlines()
    assert len(lines) == 1 and "100%" in lines[0]
    capfd.readouterr()
    pysmoe.synth(tmp_path / "v", preset="tiny", layers=1)
    assert capfd.readouterr().err == ""
