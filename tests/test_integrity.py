"""Issue 11, "silent wrong output": what is read is what was written, or an error says so.

- every blob is checked against its checksum each time it is read, by default; a mismatch is a
  ReadError naming layer, expert and offset, the position is kept and the session goes on;
- a Vault pins the file it opened: vault.bin replaced (renamed over, or rewritten in place) under
  it gives either the original data or a VaultError, never the old tables with the new blobs;
- a FIFO as vault.bin is refused without blocking (open_vault, read_vault, `info`, `verify`);
- verify reports non-finite scales and biases by tensor, and a vault whose logits come out all
  NaN makes decode fail instead of emitting id 0 forever.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import pysmoe
from pysmoe import quant
from pysmoe import vaultio as V
from pysmoe._ffi import lib


def ids_for(vault, n, seed=1):
    return [int(i) for i in np.random.default_rng(seed).integers(0, vault.config["vocab_size"], size=n)]


def flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def test_blobs_are_checked_by_default():
    assert lib.smoe_session_default_params().verify_blobs
    import inspect
    assert inspect.signature(pysmoe.Vault.session).parameters["verify_blobs"].default is True


@pytest.mark.parametrize("part_rows", [0, 1 << 20])  # the engine's parts (5 of 8 rows here), one part
@pytest.mark.parametrize("how", ["prefill", "decode"])
def test_flipped_blob_byte_after_open_is_a_read_error(tiny_vault, tmp_path, how, part_rows):
    copy = tmp_path / "v"
    shutil.copytree(tiny_vault, copy)
    r = V.read_vault(copy)
    layer = next(l for l in range(len(r.sparse)) if r.sparse[l])
    offsets = [r.blob_offset(layer, e) for e in range(r.binary_config["num_experts"])]
    r.close()
    with pysmoe.open_vault(copy) as vault, vault.session(direct_io=False, part_rows=part_rows) as s:
        ids = ids_for(vault, 40)  # 40 tokens route to every expert of a 16-expert layer

        def start():  # cold, at the position the call under test starts from
            s.reset()
            if how == "decode":
                s.prefill(ids[:20])
            s.clear_cache()

        def call():
            return s.decode(ids[20]) if how == "decode" else s.prefill(ids)

        start()
        want = call()
        start()
        before = s.position
        for off in offsets:  # one bit of each blob of one layer, after the vault was opened
            flip(copy / "vault.bin", off + 4321)
        for _ in range(2):  # each call reads a blob again and fails again
            with pytest.raises(pysmoe.ReadError) as err:
                call()
            msg = str(err.value)
            m = re.search(r"checksum mismatch \(layer (\d+), expert (\d+), offset (\d+)\)", msg)
            assert m and int(m[1]) == layer and int(m[3]) == offsets[int(m[2])], msg
            assert s.position == before  # the failed call left the position where it was
        for off in offsets:  # repaired: the same session reads them again, and agrees
            flip(copy / "vault.bin", off + 4321)
        assert np.array_equal(call(), want)


def test_unchecked_session_reads_the_flipped_bytes(tiny_vault, tmp_path):
    # What the check prevents: with verify_blobs=False the same flip changes the logits silently.
    copy = tmp_path / "v"
    shutil.copytree(tiny_vault, copy)
    with pysmoe.open_vault(copy) as vault:
        ids = ids_for(vault, 40)
        r = V.read_vault(copy)
        layer = next(l for l in range(len(r.sparse)) if r.sparse[l])
        t = r.expert_tensors[0]
        off = r.blob_offset(layer, 3) + t.offset + quant.parts(t.format, t.rows, t.cols)[1]  # a gate scale
        r.close()
        with vault.session(direct_io=False, verify_blobs=False) as s:
            good = s.prefill(ids)
            flip(copy / "vault.bin", off + 1)  # the high byte of an f16 scale
            s.reset()
            s.clear_cache()
            assert not np.array_equal(s.prefill(ids), good)


def _logits(vault, ids):
    with vault.session(direct_io=True) as s:
        return s.prefill(ids)


@pytest.mark.parametrize("how", ["rename", "rewrite"])
def test_vault_replaced_under_an_open_vault_is_never_mixed(make_vault, tmp_path, how):
    a, b = make_vault("tiny", preset="tiny", seed=0), make_vault("tiny_seed7", preset="tiny", seed=7)
    copy = tmp_path / "v"
    shutil.copytree(a, copy)
    with pysmoe.open_vault(copy) as vault:
        ids = ids_for(vault, 40)
        before = _logits(vault, ids)
        with pysmoe.open_vault(b) as other:
            theirs = _logits(other, ids)
        assert not np.array_equal(before, theirs)
        if how == "rename":  # what a re-synthesis into a temporary file and a rename does
            shutil.copyfile(b / "vault.bin", copy / "vault.tmp")
            os.replace(copy / "vault.tmp", copy / "vault.bin")
        else:  # what an in-place rewrite does: same inode, new bytes
            with open(copy / "vault.bin", "r+b") as f, open(b / "vault.bin", "rb") as src:
                f.truncate(0)
                shutil.copyfileobj(src, f)
        try:
            after = _logits(vault, ids)
        except pysmoe.VaultError as e:
            assert how == "rewrite" and "changed since it was opened" in str(e)
        else:
            assert how == "rename"  # the open file is still the old one: the old data, all of it
            assert np.array_equal(after, before)
    with pysmoe.open_vault(copy) as fresh:  # opened again: the new vault, whole
        assert np.array_equal(_logits(fresh, ids), theirs)


FIFO_SCRIPT = """
import sys, pysmoe
from pysmoe import vaultio
path = sys.argv[1]
for name, call in [("open_vault", lambda: pysmoe.open_vault(path)), ("read_vault", lambda: vaultio.read_vault(path)),
                   ("info", lambda: vaultio.info(path))]:
    try:
        call()
    except pysmoe.VaultError as e:
        assert "not a regular file" in str(e) and "vault.bin" in str(e), (name, str(e))
        print(name, "refused")
    else:
        raise SystemExit(name + " accepted a FIFO")
"""


def test_fifo_as_vault_bin_is_refused_without_blocking(tiny_vault, tmp_path):
    d = tmp_path / "v"
    d.mkdir()
    shutil.copyfile(tiny_vault / "config.json", d / "config.json")
    os.mkfifo(d / "vault.bin")
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    # in a child with a timeout: a regression blocks on open() and must fail, not hang the suite
    r = subprocess.run([sys.executable, "-c", FIFO_SCRIPT, str(d)], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["open_vault", "refused", "read_vault", "refused", "info", "refused"]
    for cmd in ("info", "verify"):
        r = subprocess.run([sys.executable, "-m", "pysmoe", cmd, str(d)], capture_output=True, text=True,
                           timeout=120, env=env)
        assert r.returncode != 0 and "not a regular file" in r.stderr + r.stdout, (cmd, r.stdout, r.stderr)


NAN_F16 = np.array([np.nan], np.float16).view(np.uint16)[0]


def _nan_vault(src, dst, dense_name="layers.1.q_proj", blob=(3, 5), part="down", field="biases"):
    """src rewritten through VaultWriter (so every checksum is right) with a NaN in the scales of
    dense_name and in the `field` of one blob's `part`."""
    r = V.read_vault(src)
    try:
        with V.VaultWriter(dst, r.config) as w:
            for name, t in r.tensors.items():
                raw = bytearray(r.raw(name))
                if name == dense_name:
                    s_off = quant.parts(t.format, t.rows, t.cols)[1]
                    raw[s_off + 6:s_off + 8] = int(NAN_F16).to_bytes(2, "little")
                w.add_dense_raw(name, raw)
            E = r.binary_config["num_experts"]
            for l in range(len(r.sparse)):
                if not r.sparse[l]:
                    continue
                for e in range(E):
                    raw = bytearray(r.blob(l, e))
                    if (l, e) == blob:
                        t = next(t for t in r.expert_tensors if t.name == part)
                        _, s_off, b_off, _ = quant.parts(t.format, t.rows, t.cols)
                        at = t.offset + (s_off if field == "scales" else b_off)
                        raw[at:at + 2] = int(NAN_F16).to_bytes(2, "little")
                    w.add_expert_raw(l, e, raw)
    finally:
        r.close()
    return dst


def test_verify_names_non_finite_scales_and_biases(tiny_vault, tmp_path):
    bad = _nan_vault(tiny_vault, tmp_path / "nan")
    with pysmoe.open_vault(bad) as vault:  # every checksum is right: it opens
        problems = vault.verify()
    kinds = [(k, l, e) for k, l, e, _ in problems]
    assert kinds == [("values", -1, -1), ("values", 3, 5)], problems
    assert problems[0][3].startswith("layers.1.q_proj scales: 1 non-finite")
    assert problems[1][3].startswith("down biases: 1 non-finite")
    with pysmoe.open_vault(tiny_vault) as good:
        assert good.verify() == []
    r = subprocess.run([sys.executable, "-m", "pysmoe", "verify", str(bad)], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert r.returncode == 1
    assert "BAD values: layers.1.q_proj scales" in r.stdout
    assert "BAD values: layer 3 expert 5: down biases" in r.stdout


def test_all_nan_logits_are_an_error_not_token_0(tiny_vault, tmp_path):
    bad = _nan_vault(tiny_vault, tmp_path / "nan")
    with pysmoe.open_vault(bad) as vault, vault.session() as s:
        with pytest.raises(pysmoe.VaultError, match="every logit is NaN or infinite"):
            list(s.generate([1, 2, 3], max_tokens=4))
        s.reset()
        with pytest.raises(pysmoe.VaultError, match="every logit"):
            s.decode(1)
        assert s.position == 0
