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
    """No --vault: the shipped demo (a trained model) answers in words, and nothing is made."""
    out = cli("run", "--prompt", "The function returns", "--max-tokens", "24", "--json",
              env=dict(ENV, PYSMOE_CACHE=str(tmp_path)))
    assert out.returncode == 0, out.stderr
    rec = json.loads(out.stdout)
    assert rec["generated_tokens"] == 24 and not any(tmp_path.iterdir())
    words = rec["text"].split()
    assert len(words) >= 8 and all(ch.isprintable() or ch == "\n" for ch in rec["text"]), rec["text"]


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
                                  ["run", "--chat-template-kwargs", "[1]"],
                                  ["run", "--max-tokens", "0"], ["run", "--max-tokens", "-1"], ["run", "--top-k", "-2"],
                                  ["run", "--seed", "-1"], ["run", "--seed", str(2 ** 64)], ["run", "--cache-mb", "nan"],
                                  ["run", "--cache-mb", "inf"], ["run", "--cache-mb", "-1"], ["run", "--threads", "0"],
                                  ["run", "--chunk", "0"], ["run", "--context", "0"], ["run", "--io-threads", "0"],
                                  ["run", "--temperature", "-1"], ["run", "--top-p", "1.5"], ["run", "--min-p", "nan"],
                                  ["run", "--repetition-penalty", "0"], ["run", "--ids", "1,x"], ["run", "--ids", "-3"],
                                  ["run", "--device", "gpu"], ["run", "--gpu-cache-mb", "-1"],
                                  ["serve", "--gpu-cache-mb", "8"],
                                  ["chat", "--top-k", "-2"], ["chat", "--max-tokens", "0"],
                                  ["synth", "OUT", "--layers", "0"], ["synth", "OUT", "--seed", "-1"],
                                  ["synth", "OUT", "--overlap", "2"], ["synth", "OUT", "--overlap", "0.5"],
                                  ["synth", "OUT", "--routing", "realistic", "--topics", "100000"],
                                  ["bench", "V", "--repeats", "0"], ["bench", "V", "--cache-mb", "inf"],
                                  ["bench", "V", "--threads", "0"], ["convert", "HF", "FILE"],
                                  ["info", "V", "--tokens", "1", "--routing-stats"]])
def test_bad_usage_exits_2_without_traceback(args, tmp_path):
    args = [str(tmp_path / "new") if a == "OUT" else str(tmp_path / "f") if a == "FILE" else a for a in args]
    (tmp_path / "f").write_text("a file")
    out = cli(*args, stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "error:" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()[-1]) < 300  # one line says what is wrong
    assert not (tmp_path / "new").exists()  # nothing written


def test_run_needs_a_prompt(tiny_vault):
    out = cli("run", "--vault", tiny_vault, "--max-tokens", "2", stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and "no prompt" in out.stderr and "--prompt" in out.stderr
    out = cli("run", "--vault", tiny_vault, "--max-tokens", "2", "--json", input="hello from stdin")
    assert out.returncode == 0, out.stderr
    with_flag = cli("run", "--vault", tiny_vault, "--max-tokens", "2", "--json", "--prompt", "hello from stdin")
    assert json.loads(out.stdout)["ids"] == json.loads(with_flag.stdout)["ids"]


def test_device_cuda_is_refused_clearly_by_a_cpu_build(tiny_vault):
    import pysmoe
    with pysmoe.open_vault(tiny_vault) as v:
        try:
            v.session(device="cuda").close()
            pytest.skip("this library has a usable CUDA backend")
        except pysmoe.Unsupported:
            pass
    out = cli("run", "--vault", tiny_vault, "--ids", "1,2,3", "--max-tokens", "2", "--device", "cuda")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "Unsupported" in out.stderr and "CUDA" in out.stderr, out.stderr
    out = cli("run", "--vault", tiny_vault, "--ids", "1,2,3", "--max-tokens", "2", "--json", "--gpu-cache-mb", "64")
    assert out.returncode == 0 and "does nothing without --device cuda" in out.stderr, out.stderr
    pytest.importorskip("uvicorn")
    out = cli("serve", "--vault", tiny_vault, "--device", "cuda", "--port", "0", timeout=60)
    assert out.returncode == 1 and "Unsupported" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_run_on_the_gpu_gives_the_python_apis_ids(tiny_vault):
    import pysmoe
    with pysmoe.open_vault(tiny_vault) as v:
        try:
            s = v.session(device="cuda", gpu_cache_bytes=v.expert_bytes + v.blob_bytes)
        except pysmoe.Unsupported:
            pytest.skip("no CUDA here")
        with s:
            want = list(s.generate([7, 8, 9], max_tokens=5))
            s.reset()
            seeded = list(s.generate([7, 8, 9], max_tokens=12, temperature=0.8, top_p=0.9, top_k=40,
                                     repetition_penalty=1.1, seed=11, stop=v.tokenizer.eos_ids))
    out = cli("run", "--vault", tiny_vault, "--ids", "7,8,9", "--max-tokens", "5", "--json", "--device", "cuda")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ids"] == want and "cuda: " in out.stderr
    out = cli("run", "--vault", tiny_vault, "--ids", "7,8,9", "--max-tokens", "12", "--json", "--device", "cuda",
              "--temperature", "0.8", "--top-p", "0.9", "--top-k", "40", "--repetition-penalty", "1.1", "--seed", "11")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ids"] == seeded


def test_default_cache_budget_is_printed_and_overridable(tiny_vault):
    out = cli("run", "--vault", tiny_vault, "--ids", "1,2,3", "--max-tokens", "2", "--json")
    assert out.returncode == 0 and "cache budget" in out.stderr and "--cache-mb" in out.stderr
    auto = json.loads(out.stdout)["resident_bytes"]
    out = cli("run", "--vault", tiny_vault, "--ids", "1,2,3", "--max-tokens", "2", "--json", "--cache-mb", "0")
    assert out.returncode == 0 and "cache budget" not in out.stderr
    assert json.loads(out.stdout)["resident_bytes"] < auto


def test_help_shows_defaults_and_every_option_has_help():
    import argparse

    from pysmoe.cli import build_parser
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in subs.choices.items():
        for action in p._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help text"
    out = cli("run", "--help")
    assert out.returncode == 0 and "(default: 64)" in out.stdout and "(default: layer-major)" in out.stdout


def test_version():
    import pysmoe
    out = cli("--version")
    assert out.returncode == 0 and f"pysmoe {pysmoe.__version__}" in out.stdout and "libsmoe " in out.stdout
    from pysmoe._ffi import ffi, lib
    kernels = ffi.string(lib.smoe_kernels()).decode()
    assert f"kernels {kernels})" in out.stdout  # ", cuda" at its end in a library built with CUDA


def test_engine_errors_exit_1_with_message(tmp_path, tiny_vault):
    out = cli("info", tmp_path)
    assert out.returncode == 1 and "VaultError" in out.stderr and "Traceback" not in out.stderr
    out = cli("run", "--vault", tiny_vault, "--ids", "1,99999", "--max-tokens", "2")
    assert out.returncode == 1 and "BadToken" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("args", [["-1", "5"], ["4", "-5"], ["x", "5"], ["4", "5x"], ["4", "1", "abc"], ["", "1"],
                                  ["4", "99999999999"]])
def test_c_example_validates_its_arguments(tiny_vault, args):
    exe = os.environ.get("SMOE_EXAMPLE") or os.path.join(os.path.dirname(__file__), "..", "build", "smoe_generate")
    out = subprocess.run([exe, str(tiny_vault), *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "usage:" in out.stderr and out.stdout == ""
    ok = subprocess.run([exe, str(tiny_vault), "0", "5"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.strip() == ""  # zero tokens asked, none printed


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
