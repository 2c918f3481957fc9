"""python -m pysmoe: each subcommand on the tiny vault, and bad usage."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ENV = dict(os.environ, PYTHONUNBUFFERED="1")


def cli(*args, timeout=300, **kw):
    return subprocess.run([sys.executable, "-m", "pysmoe", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=kw.pop("env", ENV), **kw)


def test_run_json(tiny_vault):
    out = cli("run", "--vault", tiny_vault, "--ids", "1,2,3,4,5", "--max-tokens", "6", "--json")
    assert out.returncode == 0, out.stderr
    rec = json.loads(out.stdout)
    assert rec["prompt_tokens"] == 5 and rec["generated_tokens"] == 6 and len(rec["ids"]) == 6
    assert rec["direct_io"] is True and rec["blob_reads"] > 0
    assert len(rec["union_sizes"]) == 4 and rec["ttft_s"] > 0


def test_run_text_prints_figures(tiny_vault):
    out = cli("run", "--vault", tiny_vault, "--prompt", "hello world", "--max-tokens", "4", "--cache-mb", "1")
    assert out.returncode == 0, out.stderr
    assert "TTFT" in out.stderr and "blob reads" in out.stderr and "union per layer" in out.stderr


def test_run_matches_python_api(tiny_vault):
    import pysmoe
    with pysmoe.open_vault(tiny_vault) as v, v.session() as s:
        want = list(s.generate([7, 8, 9], max_tokens=5))
    out = cli("run", "--vault", tiny_vault, "--ids", "7,8,9", "--max-tokens", "5", "--json")
    assert json.loads(out.stdout)["ids"] == want


def test_run_demo_vault(tmp_path):
    out = cli("run", "--max-tokens", "3", "--json", env=dict(ENV, PYSMOE_CACHE=str(tmp_path)))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "pysmoe").is_dir() and json.loads(out.stdout)["generated_tokens"] == 3


def test_info_and_verify(tiny_vault, tmp_path):
    out = cli("info", tiny_vault)
    assert out.returncode == 0 and "experts" in out.stdout
    out = cli("verify", tiny_vault)
    assert out.returncode == 0 and "OK" in out.stdout
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(tiny_vault, bad)
    size = (bad / "vault.bin").stat().st_size
    with open(bad / "vault.bin", "r+b") as f:
        f.seek(size - 100)
        b = f.read(1)
        f.seek(size - 100)
        f.write(bytes([b[0] ^ 0xFF]))
    out = cli("verify", bad)
    assert out.returncode == 1 and "BAD blob" in out.stdout


def test_synth(tmp_path):
    out = cli("synth", tmp_path / "v", "--preset", "tiny", "--seed", "3", "--layers", "2")
    assert out.returncode == 0, out.stderr
    out = cli("info", tmp_path / "v", "--json")
    assert json.loads(out.stdout)["config"]["num_hidden_layers"] == 2


@pytest.mark.parametrize("args", [[], ["frobnicate"], ["run", "--max-tokens", "many"], ["synth"],
                                  ["run", "--prefill", "sideways"], ["run", "--chat-template-kwargs", "{nope"],
                                  ["run", "--chat-template-kwargs", "[1]"]])
def test_bad_usage_exits_2_without_traceback(args):
    out = cli(*args)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "usage" in out.stderr


def test_engine_errors_exit_1_with_message(tmp_path, tiny_vault):
    out = cli("info", tmp_path)
    assert out.returncode == 1 and "VaultError" in out.stderr and "Traceback" not in out.stderr
    out = cli("run", "--vault", tiny_vault, "--ids", "1,99999", "--max-tokens", "2")
    assert out.returncode == 1 and "BadToken" in out.stderr and "Traceback" not in out.stderr


def test_chat_template_kwargs_reach_the_template(tiny_vault, tmp_path):
    """--chat-template-kwargs sets template variables: a template that prints one shows it in
    the prompt's token count (the vault's template replaced by one reading `mode`)."""
    import shutil

    v = tmp_path / "v"
    shutil.copytree(tiny_vault, v)
    (v / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}"
                                           "{% if mode is defined %}{{ mode * 20 }}{% endif %}")
    args = ["run", "--vault", v, "--prompt", "hi", "--chat", "--max-tokens", "1", "--json"]
    plain = json.loads(cli(*args).stdout)["prompt_tokens"]
    out = cli(*args, "--chat-template-kwargs", '{"mode": "long "}')
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["prompt_tokens"] > plain + 10
