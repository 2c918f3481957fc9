"""The C engine against the numpy reference and against transformers, its invariances, and its
behaviour on bad input."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess

import numpy as np
import pytest

import pysmoe
import pysmoe.memory
from pysmoe._ffi import ffi, lib
from pysmoe.reference import ReferenceModel

from conftest import ALL_F32

TOL = 1e-4

# Configs that exercise the model's quirks (tiny preset: head_dim 32 ≠ 64/4, mlp_only_layers [2]).
CONFIGS = {
    "tiny": {},
    "no_norm_topk": {"norm_topk_prob": False},
    "tied": {"tie_word_embeddings": True},
    "sparse_step_2": {"decoder_sparse_step": 2, "mlp_only_layers": []},
}


def serial_logits(session, ids):
    return np.stack([session.decode(t) for t in ids])


def ids_for(vault, n, seed=1):
    return [int(i) for i in np.random.default_rng(seed).integers(0, vault.config["vocab_size"], size=n)]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_engine_matches_reference_at_every_position(make_vault, name):
    path = make_vault(f"f32_{name}", preset="tiny", seed=3, experts="f32", formats=ALL_F32,
                      overrides=CONFIGS[name])
    with pysmoe.open_vault(path) as vault, vault.session(threads=2) as s:
        ids = ids_for(vault, 64)
        got = serial_logits(s, ids)
        want = ReferenceModel(path).logits(ids)
        assert np.isfinite(got).all()
        err = float(np.abs(got - want).max())
        assert err <= TOL, f"{name}: max |engine − reference| = {err}"
        assert np.abs(want).max() > 0.5  # the tolerance is small against the logits' size


def test_engine_matches_reference_on_quantized_vault(tiny_vault):
    # q4 experts and q8 matrices: the reference dequantises the same bytes and multiplies f32
    # activations, as the engine does with activations="f32"
    with pysmoe.open_vault(tiny_vault) as vault, vault.session(threads=2, activations="f32") as s:
        ids = ids_for(vault, 32)
        got = serial_logits(s, ids)
        want = ReferenceModel(tiny_vault).logits(ids)
        assert float(np.abs(got - want).max()) <= TOL


# 8-bit activations (the default) against f32 activations, on the same q4/q8 vault: the
# quantisation moves each product by at most Σ|s·q|·d/2 (tests/c/test_kernels.c checks that bound
# per kernel); through the layers it shows as a small relative change in the logits.
Q8_REL = 0.05  # max |Δlogit| / max |logit|


@pytest.mark.parametrize("preset", ["tiny", "mini"])
def test_q8_activations_close_to_f32(make_vault, tiny_vault, preset):
    path = tiny_vault if preset == "tiny" else make_vault("mini", preset="mini", seed=0, overrides={"num_hidden_layers": 6})
    with pysmoe.open_vault(path) as vault:
        ids = ids_for(vault, 24)
        with vault.session(threads=2, activations="f32") as s:
            exact = serial_logits(s, ids)
        with vault.session(threads=2) as s:
            assert s.activations == "q8"
            q8 = serial_logits(s, ids)
    assert np.isfinite(q8).all()
    assert not np.array_equal(q8, exact)  # the modes really differ
    rel = np.abs(q8 - exact).max(axis=1) / np.abs(exact).max(axis=1)
    assert rel.max() <= Q8_REL, rel
    agree = np.mean(q8.argmax(axis=1) == exact.argmax(axis=1))
    assert agree >= 0.9, agree


_LOGITS_SCRIPT = """
import sys, numpy as np, pysmoe
with pysmoe.open_vault(sys.argv[1]) as v, v.session(threads=2) as s:
    ids = np.random.default_rng(5).integers(0, v.config["vocab_size"], 20).astype(np.int32)
    sys.stdout.write(s.prefill(ids).astype(np.float32).tobytes().hex())
"""


def test_vnni_and_plain_avx2_give_the_same_bits(tiny_vault):
    # SMOE_NO_VNNI=1 forces the plain AVX2 instance of the 8-bit-activation products; where the
    # CPU has AVX-VNNI the default runs the VNNI one. Their integer sums are exact: same logits.
    import sys
    outs = []
    for flag in ("1", "0"):
        env = dict(os.environ, SMOE_NO_VNNI=flag)
        r = subprocess.run([sys.executable, "-c", _LOGITS_SCRIPT, str(tiny_vault)], capture_output=True, text=True,
                           timeout=120, env=env)
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout)
    assert outs[0] and outs[0] == outs[1]


_KERNELS_SCRIPT = """
import sys, pysmoe
from pysmoe._ffi import ffi, lib
sys.stdout.write(ffi.string(lib.smoe_kernels()).decode())
"""


def _cpu_has_avx512() -> bool:
    try:
        flags = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")).split(":", 1)[1].split()
    except (OSError, StopIteration):
        return False
    return {"avx512f", "avx512bw", "avx512vl"} <= set(flags)


def test_avx512_and_avx2_give_the_same_bits(tiny_vault):
    # SMOE_NO_AVX512=1 turns the AVX-512 instances of the 8-bit-activation products off; where the
    # CPU has AVX-512 the default runs them. Same integer sums, same float order: same logits.
    # smoe_kernels() says which ran.
    import sys
    outs, kernels = [], []
    for flag in ("1", "0"):
        env = dict(os.environ, SMOE_NO_AVX512=flag)
        for script, into in ((_LOGITS_SCRIPT, outs), (_KERNELS_SCRIPT, kernels)):
            r = subprocess.run([sys.executable, "-c", script, str(tiny_vault)], capture_output=True, text=True,
                               timeout=120, env=env)
            assert r.returncode == 0, r.stderr
            into.append(r.stdout)
    assert outs[0] and outs[0] == outs[1]
    assert "avx512" not in kernels[0]
    if platform.machine() in ("x86_64", "AMD64"):
        assert ("avx512" in kernels[1]) == _cpu_has_avx512(), kernels


_DECODE_SCRIPT = """
import sys, numpy as np, pysmoe
with pysmoe.open_vault(sys.argv[1]) as v, v.session(threads=2) as s:
    ids = np.random.default_rng(7).integers(0, v.config["vocab_size"], 12).astype(np.int32)
    rows = [s.prefill(ids)]
    for _ in range(6):
        rows.append(s.decode(int(rows[-1].argmax())))
    sys.stdout.write(np.stack(rows).astype(np.float32).tobytes().hex())
"""


@pytest.mark.parametrize("env", [{"SMOE_MATVEC": "avx512"}, {"SMOE_MATVEC": "avx512", "SMOE_NO_VNNI": "1"},
                                 {"SMOE_MATVEC": "avx2", "SMOE_NO_VNNI": "1"}, {"SMOE_NO_AVX512": "1"}],
                         ids=["avx512-matvec", "avx512bw-matvec", "plain-avx2-matvec", "no-avx512"])
def test_one_token_instances_give_the_same_bits(tiny_vault, env):
    # One token's products (decode, and a prefill's one-token experts) go to the AVX2 or the
    # AVX-512 instance's matrix-vector path by a CPU rule (kernels.c); SMOE_MATVEC=avx2|avx512
    # forces one, SMOE_NO_VNNI / SMOE_NO_AVX512 take instances away. A 12-token layer-major prefill
    # (n > 1 and n = 1 products) and 6 decode steps (n = 1) give the same logits under each forcing
    # as with SMOE_MATVEC=avx2 (tests/c/test_kernels.c checks every instance against the
    # reference bit for bit at every n, odd shapes included; on a CPU without AVX-512 the forcings
    # all run AVX2 and this only checks that they are harmless).
    import sys

    def logits(extra):
        r = subprocess.run([sys.executable, "-c", _DECODE_SCRIPT, str(tiny_vault)], capture_output=True, text=True,
                           timeout=120, env=dict(os.environ, **extra))
        assert r.returncode == 0, r.stderr
        return r.stdout

    base = logits({"SMOE_MATVEC": "avx2"})
    assert base and logits(env) == base


def test_bad_activations_refused(tiny_vault):
    with pysmoe.open_vault(tiny_vault) as vault:
        with pytest.raises(pysmoe.InvalidArgument):
            vault.session(activations="int4")


def test_end_to_end_against_transformers(hf_vault):
    import torch
    from hf_models import hf_logits, sample_ids
    path, model = hf_vault
    ids = sample_ids(model, 16)
    with pysmoe.open_vault(path) as vault, vault.session(threads=2) as s:
        got = serial_logits(s, ids)
        assert float(np.abs(got - hf_logits(model, ids)).max()) <= TOL

        s.reset()
        engine_ids = list(s.generate(ids, max_tokens=32))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                             eos_token_id=None, pad_token_id=0)
    assert engine_ids == out[0, len(ids):].tolist()


def test_results_do_not_depend_on_threads_or_cache(tiny_vault):
    vault = pysmoe.open_vault(tiny_vault)
    ids = ids_for(vault, 24)
    expert_total = vault.expert_bytes
    runs = {}
    for threads in (1, 2, 3):
        for budget in (0, vault.blob_bytes * 10, expert_total * 2):
            with vault.session(threads=threads, cache_bytes=budget) as s:
                runs[threads, budget] = serial_logits(s, ids)
                st = s.stats()
                if budget == 0:
                    assert st["cache_misses"] > 0 and st["blob_reads"] == st["cache_misses"]
                    assert st["bytes_read"] == st["blob_reads"] * vault.blob_bytes
    first = next(iter(runs.values()))
    for key, got in runs.items():
        assert np.array_equal(got, first), key


def test_cache_budget_is_respected_and_hits_counted(tiny_vault):
    vault = pysmoe.open_vault(tiny_vault)
    ids = ids_for(vault, 16)
    with vault.session(cache_bytes=vault.expert_bytes * 2) as s:
        serial_logits(s, ids)
        st = s.stats()
        total_blobs = vault.num_sparse_layers * vault.config["num_experts"]
        assert st["blob_reads"] <= total_blobs  # everything fits: each blob read at most once
        assert st["cache_hits"] + st["cache_misses"] == 16 * vault.num_sparse_layers * vault.config["num_experts_per_tok"]
        assert st["cache_bytes"] <= vault.expert_bytes
        s.clear_cache()
        s.reset_stats()
        s.reset()
        serial_logits(s, ids[:1])
        assert s.stats()["cache_hits"] == 0
    small = vault.blob_bytes * 6
    with vault.session(cache_bytes=small) as s:
        st = s.stats()
        assert st["cache_bytes"] <= small
        assert st["resident_bytes"] == st["dense_bytes"] + st["cache_bytes"] + st["kv_bytes"] + st["plane_bytes"]
        assert st["kv_bytes"] == pysmoe.memory.kv_bytes(vault.config, s.context)  # the library's default type


def test_kv_dtype_parameter(tiny_vault):
    vault = pysmoe.open_vault(tiny_vault)
    for name in pysmoe.KV_DTYPES:
        with vault.session(context=64, kv_dtype=name) as s:
            assert s.kv_dtype == name and s.stats()["kv_dtype"] == name
            assert s.stats()["kv_bytes"] == pysmoe.memory.kv_bytes(vault.config, 64, name)
    with pytest.raises(pysmoe.InvalidArgument):
        vault.session(kv_dtype="f8")
    p = lib.smoe_session_default_params()
    p.kv_dtype = 3
    out = ffi.new("smoe_session **")
    assert lib.smoe_session_new(vault.handle, ffi.new("smoe_session_params *", p), out) == pysmoe.InvalidArgument.code


def test_bad_input_is_an_error_and_the_session_survives(tiny_vault):
    vault = pysmoe.open_vault(tiny_vault)
    V = vault.config["vocab_size"]
    with vault.session(context=8) as s:
        with pytest.raises(pysmoe.BadToken):
            s.decode(V)
        with pytest.raises(pysmoe.BadToken):
            s.prefill([1, 2, -1])
        with pytest.raises(ValueError):  # BadToken is also a ValueError
            s.prefill([V + 5])
        assert s.position == 0
        s.prefill([1, 2, 3, 4, 5, 6])
        with pytest.raises(pysmoe.ContextFull):
            s.prefill([1, 2, 3])
        assert s.position == 6
        s.decode(7)
        s.decode(8)
        with pytest.raises(pysmoe.ContextFull):
            s.decode(9)
        s.reset()
        assert np.isfinite(s.prefill([1, 2, 3])).all()


def test_null_handles_and_bad_params_from_c():
    from pysmoe._ffi import ffi, lib
    assert lib.smoe_decode_step(ffi.NULL, 1, ffi.NULL, ffi.NULL) == pysmoe.InvalidArgument.code
    assert lib.smoe_prefill_chunk(ffi.NULL, ffi.NULL, 0, ffi.NULL, ffi.NULL) == pysmoe.InvalidArgument.code
    assert lib.smoe_session_new(ffi.NULL, ffi.NULL, ffi.NULL) == pysmoe.InvalidArgument.code
    lib.smoe_session_free(ffi.NULL)
    lib.smoe_close_vault(ffi.NULL)
    out = ffi.new("smoe_vault **")
    assert lib.smoe_open_vault(b"/nonexistent/vault", out) == pysmoe.VaultError.code
    assert out[0] == ffi.NULL


def test_bad_session_params(tiny_vault):
    vault = pysmoe.open_vault(tiny_vault)
    for kwargs in ({"chunk": 0}, {"threads": 0}, {"context": 0}, {"io_threads": 0}, {"cache_bytes": -1},
                   {"prefill": "sideways"}):
        with pytest.raises(pysmoe.InvalidArgument):
            vault.session(**kwargs)
    with vault.session() as s:
        with pytest.raises(pysmoe.InvalidArgument):
            s.set_sampler(top_p=0.0)
        with pytest.raises(pysmoe.InvalidArgument):
            s.set_sampler(temperature=-1.0)


def test_truncated_blob_file_after_open_is_a_read_error(tiny_vault, tmp_path):
    copy = tmp_path / "v"
    shutil.copytree(tiny_vault, copy)
    vault = pysmoe.open_vault(copy)
    ids = ids_for(vault, 40)  # a 40-token chunk routes to every expert of a 16-expert layer
    with vault.session(direct_io=False) as s:
        good = s.prefill(ids)
        s.reset()
        s.clear_cache()
        # the last blobs (the last layer's last experts) disappear under the open vault
        os.truncate(copy / "vault.bin", (copy / "vault.bin").stat().st_size - 3 * vault.blob_bytes)
        with pytest.raises(pysmoe.ReadError) as err:
            s.prefill(ids)
        assert "layer" in str(err.value) and "expert" in str(err.value)
        assert s.position == 0  # a failed call leaves the position where it was
        shutil.copyfile(tiny_vault / "vault.bin", copy / "vault.bin")  # same inode, whole again
        s.reset()
        assert np.array_equal(s.prefill(ids), good)  # and the session still works


def test_session_keeps_its_vault_alive_and_close_is_idempotent(tiny_vault):
    vault = pysmoe.open_vault(tiny_vault)
    s = vault.session()
    vault.close()
    vault.close()
    assert np.isfinite(s.prefill([1, 2, 3])).all()  # the vault is still open under the session
    s.close()
    s.close()
    with pytest.raises(pysmoe.InvalidArgument):
        s.decode(1)
    with pytest.raises(pysmoe.InvalidArgument):
        vault.session()


def test_sampling_is_deterministic_per_seed(tiny_vault):
    vault = pysmoe.open_vault(tiny_vault)
    ids = ids_for(vault, 8)
    runs = []
    for seed in (5, 5, 6):
        with vault.session() as s:
            runs.append(list(s.generate(ids, max_tokens=24, temperature=1.0, top_p=0.9, seed=seed)))
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    with vault.session() as s:
        greedy = list(s.generate(ids, max_tokens=8))
        s.reset()
        logits = s.prefill(ids)
        assert greedy[0] == int(np.argmax(logits))


def test_stream_generate_records(tiny_vault):
    with pysmoe.open_vault(tiny_vault) as vault, vault.session() as s:
        recs = list(pysmoe.stream_generate(s, "hello there", max_tokens=5, stop=()))
        assert [r.generation_tokens for r in recs] == [1, 2, 3, 4, 5]
        assert recs[-1].finish_reason == "length" and all(r.finish_reason is None for r in recs[:-1])
        assert recs[0].prompt_tokens == len(vault.tokenizer.encode("hello there"))
        assert all(r.ttft_s > 0 for r in recs)


def test_c_example_matches_python(tiny_vault):
    exe = os.environ.get("SMOE_EXAMPLE") or os.path.join(os.path.dirname(__file__), "..", "build", "smoe_generate")
    if not os.path.exists(exe):
        pytest.fail(f"{exe} is missing: `make examples` builds it")
    vault = pysmoe.open_vault(tiny_vault)
    ids = ids_for(vault, 300)  # two chunks in C (its default 256), one in Python (1024 under a small cache)
    with vault.session() as s:
        want = list(s.generate(ids, max_tokens=12))
    out = subprocess.run([exe, str(tiny_vault), "12", *map(str, ids)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert [int(x) for x in out.stdout.split()] == want


def test_c_example_reports_errors(tmp_path):
    exe = os.environ.get("SMOE_EXAMPLE") or os.path.join(os.path.dirname(__file__), "..", "build", "smoe_generate")
    out = subprocess.run([exe, str(tmp_path), "4", "1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "smoe_open_vault" in out.stderr


@pytest.mark.parametrize("experts", ["q4", "Q4_K"])
def test_steps_shared_between_threads_keep_the_bits(make_vault, experts):
    """A prompt long enough that quantising a product's input and the experts' activation go to the
    worker pool (products.c, SPLIT_VALUES: 256 tokens of hidden 1,024; experts of 32+ rows of 512):
    the same logits at 1, 2 and 3 threads, and the same as feeding the ids one at a time. Q4_K: a
    GGML format, whose inputs are quantised as ggml does (Q8_K, blocks of 256)."""
    vault = pysmoe.open_vault(make_vault(f"mini2_{experts}", preset="mini", seed=0, layers=2, experts=experts))
    ids = ids_for(vault, 256)
    got = {}
    for threads in (1, 2, 3):
        with vault.session(threads=threads, cache_bytes=vault.expert_bytes) as s:
            got[threads] = s.prefill(ids)
    with vault.session(threads=2, cache_bytes=vault.expert_bytes) as s:
        serial = serial_logits(s, ids)[-1]
    assert got[1].tobytes() == got[2].tobytes() == got[3].tobytes() == serial.tobytes()
