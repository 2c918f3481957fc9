"""Layer-major batched prefill: bit-identical to the token-serial path, reads each union expert
once per layer, and never touches the heap."""
from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pysmoe
from pysmoe._ffi import ffi, lib
from pysmoe.reference import ReferenceModel

ROOT = os.path.join(os.path.dirname(__file__), "..")
GREEDY_AFTER = 8


def run_path(vault, ids, prefill, **kw):
    """Logits after the prompt, the next greedy ids, and every KV row of every layer."""
    with vault.session(prefill=prefill, context=512, **kw) as s:
        logits = s.prefill(ids)
        nxt = [int(np.argmax(logits))]
        for _ in range(GREEDY_AFTER - 1):
            nxt.append(int(np.argmax(s.decode(nxt[-1]))))
        kv = [s.kv(layer) for layer in range(vault.config["num_hidden_layers"])]
        return logits, nxt, kv, s.stats()


def assert_identical(a, b):
    la, na, kva, _ = a
    lb, nb, kvb, _ = b
    assert np.array_equal(la.view(np.uint32), lb.view(np.uint32)), "logits differ"
    assert na == nb, "greedy continuations differ"
    for layer, ((ka, va), (kb, vb)) in enumerate(zip(kva, kvb)):
        assert np.array_equal(ka.view(np.uint32), kb.view(np.uint32)), f"K of layer {layer} differs"
        assert np.array_equal(va.view(np.uint32), vb.view(np.uint32)), f"V of layer {layer} differs"


def budgets(vault):
    return {"zero": 0, "small": vault.blob_bytes * (vault.config["num_experts_per_tok"] + 3),
            "all": vault.expert_bytes * 2}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_layer_major_is_bit_identical_to_token_serial(tiny_vault, data):
    vault = pysmoe.open_vault(tiny_vault)
    V = vault.config["vocab_size"]
    n = data.draw(st.integers(1, 300), label="prompt length")
    ids = data.draw(st.lists(st.integers(0, V - 1), min_size=n, max_size=n), label="ids")
    chunk = data.draw(st.integers(1, 128), label="chunk")
    threads = data.draw(st.integers(1, 3), label="threads")
    budget = data.draw(st.sampled_from(sorted(budgets(vault))), label="budget")
    kv_dtype = data.draw(st.sampled_from(pysmoe.KV_DTYPES), label="kv_dtype")
    serial = run_path(vault, ids, "token-serial", threads=threads, cache_bytes=budgets(vault)[budget],
                      kv_dtype=kv_dtype)
    part_rows = data.draw(st.integers(0, 16), label="part_rows")  # 0: the engine's choice
    batched = run_path(vault, ids, "layer-major", threads=threads, chunk=chunk, part_rows=part_rows,
                       cache_bytes=budgets(vault)[budget], kv_dtype=kv_dtype)
    assert_identical(serial, batched)
    assert_kv_of_dtype(serial[2], kv_dtype)


def assert_kv_of_dtype(kv, kv_dtype):
    """Every K and V value Session.kv() returns is a value of kv_dtype (widened exactly)."""
    for k, v in kv:
        for a in (k, v):
            if kv_dtype == "bf16":
                assert not np.any(a.view(np.uint32) & 0xFFFF), "a bf16 KV value with low bits set"
            elif kv_dtype == "f16":
                assert np.array_equal(a.astype(np.float16).astype(np.float32).view(np.uint32), a.view(np.uint32))


@pytest.mark.parametrize("kv_dtype", ["bf16", "f16"])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_prompt_lengths_around_the_chunk_with_16_bit_kv(tiny_vault, chunk, kv_dtype):
    vault = pysmoe.open_vault(tiny_vault)
    rng = np.random.default_rng(chunk)
    for n in sorted({1, 2, chunk, chunk + 1, chunk + 2, 2 * chunk + 1}):
        ids = [int(i) for i in rng.integers(0, vault.config["vocab_size"], size=n)]
        assert_identical(run_path(vault, ids, "token-serial", threads=2, kv_dtype=kv_dtype),
                         run_path(vault, ids, "layer-major", threads=2, chunk=chunk, kv_dtype=kv_dtype))


def to_bf16(a):
    """f32 → bf16 (nearest, ties to even) widened back, in numpy: independent of the C rounding."""
    u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    return r.view(np.float32)


@pytest.mark.parametrize("kv_dtype", ["bf16", "f16"])
def test_16_bit_kv_is_f32_kv_rounded(tiny_vault_f32, kv_dtype):
    """Layer 0's K and V do not depend on earlier attention, so a 16-bit session stores exactly
    the f32 session's values rounded to nearest-even; later layers differ (they see rounded KV),
    by little: the logits stay close to f32's. KV memory halves."""
    vault = pysmoe.open_vault(tiny_vault_f32)
    ids = [int(i) for i in np.random.default_rng(3).integers(0, vault.config["vocab_size"], size=40)]
    l32, _, kv32, st32 = run_path(vault, ids, "layer-major", chunk=16, kv_dtype="f32")
    l16, _, kv16, st16 = run_path(vault, ids, "layer-major", chunk=16, kv_dtype=kv_dtype)
    rnd = to_bf16 if kv_dtype == "bf16" else (lambda a: a.astype(np.float16).astype(np.float32))
    for a32, a16 in zip(kv32[0], kv16[0]):
        assert np.array_equal(rnd(a32).view(np.uint32), a16.view(np.uint32))
    assert not np.array_equal(kv32[1][0], kv16[1][0])  # the rounding is visible further up
    tol = 0.05 * float(np.max(np.abs(l32)))
    assert np.max(np.abs(l16 - l32)) < tol
    assert st16["kv_bytes"] * 2 == st32["kv_bytes"] and st16["kv_dtype"] == kv_dtype
    assert st16["resident_bytes"] == st16["dense_bytes"] + st16["cache_bytes"] + st16["kv_bytes"] + st16["plane_bytes"]


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_prompt_lengths_around_the_chunk(tiny_vault, chunk):
    vault = pysmoe.open_vault(tiny_vault)
    rng = np.random.default_rng(chunk)
    # the chunks cover ids[:-1]; so lengths that make n−1 a multiple, one more and one less
    for n in sorted({1, 2, chunk, chunk + 1, chunk + 2, 2 * chunk, 2 * chunk + 1, 2 * chunk + 2}):
        ids = [int(i) for i in rng.integers(0, vault.config["vocab_size"], size=n)]
        assert_identical(run_path(vault, ids, "token-serial", threads=2),
                         run_path(vault, ids, "layer-major", threads=2, chunk=chunk))


def test_quantized_and_f32_vaults_and_dense_layers(make_vault):
    # f32 everywhere, and a vault whose every other layer is a dense MLP
    for path in (make_vault("f32all", preset="tiny", seed=4, experts="f32",
                            formats={r: "f32" for r in ("attention", "embed", "lm_head", "mlp")}),
                 make_vault("step2", preset="tiny", seed=5, overrides={"decoder_sparse_step": 2,
                                                                       "mlp_only_layers": []})):
        vault = pysmoe.open_vault(path)
        ids = [int(i) for i in np.random.default_rng(0).integers(0, vault.config["vocab_size"], size=50)]
        assert_identical(run_path(vault, ids, "token-serial"), run_path(vault, ids, "layer-major", chunk=13))


def chunk_reads(vault, ids, chunk=None, budget=0):
    """Blob reads, union sizes and per-expert routing counts of one smoe_prefill_chunk of all
    ids, from a cold cache."""
    from pysmoe._ffi import check
    L, E = vault.config["num_hidden_layers"], vault.config["num_experts"]
    with vault.session(cache_bytes=budget, chunk=chunk or len(ids)) as s:
        arr = np.asarray(ids, dtype=np.int32)
        check(lib.smoe_prefill_chunk(s.handle, ffi.cast("int32_t *", ffi.from_buffer(arr)), len(arr), ffi.NULL, ffi.NULL))
        sizes = ffi.new("uint32_t[]", L)
        check(lib.smoe_stats_union_sizes(s.handle, sizes, L))
        counts = ffi.new("uint64_t[]", E)
        per_layer = []
        for layer in range(L):
            check(lib.smoe_stats_expert_counts(s.handle, layer, counts, E))
            per_layer.append([int(counts[e]) for e in range(E)])
        return s.stats(), list(sizes), per_layer


@pytest.mark.parametrize("n", [1, 3, 20, 45])
def test_a_cold_chunk_reads_exactly_its_unions(tiny_vault_f32, n):
    vault = pysmoe.open_vault(tiny_vault_f32)
    ids = [int(i) for i in np.random.default_rng(n).integers(0, vault.config["vocab_size"], size=n)]
    stats, sizes, counts = chunk_reads(vault, ids)
    # the unions, computed independently by the numpy reference's routing
    routes = ReferenceModel(tiny_vault_f32).routing(ids)
    want = [0 if r is None else len(np.unique(r)) for r in routes]
    assert sizes == want
    E = vault.config["num_experts"]
    assert counts == [[0] * E if r is None else np.bincount(np.ravel(r), minlength=E).tolist() for r in routes]
    assert stats["blob_reads"] == sum(want) == stats["cache_misses"]
    assert stats["bytes_read"] == sum(want) * vault.blob_bytes
    assert stats["cache_hits"] == 0


def _runs(experts, max_run):
    """Read requests for one layer's union when adjacent blobs (consecutive expert ids: the vault
    lays a layer's blobs out in expert order) are read together, at most max_run at a time."""
    runs, prev, length = 0, None, 0
    for e in sorted(experts):
        if prev is not None and e == prev + 1 and length < max_run:
            length += 1
        else:
            runs, length = runs + 1, 1
        prev = e
    return runs


@pytest.mark.parametrize("max_run", [2, 3, 64])
def test_coalesced_reads_read_the_same_blobs_in_fewer_requests(tiny_vault, max_run):
    vault = pysmoe.open_vault(tiny_vault)
    ids = [int(i) for i in np.random.default_rng(7).integers(0, vault.config["vocab_size"], size=24)]
    from pysmoe._ffi import check
    out = {}
    for coalesce in (0, max_run * vault.blob_bytes):
        with vault.session(cache_bytes=vault.expert_bytes, chunk=len(ids), coalesce_bytes=coalesce) as s:
            logits = s.prefill(ids)
            out[coalesce] = (logits, s.stats())
    (l0, s0), (l1, s1) = out[0], out[max_run * vault.blob_bytes]
    assert np.array_equal(l0, l1)
    assert s0["blob_reads"] == s1["blob_reads"] and s0["bytes_read"] == s1["bytes_read"]
    assert s0["read_requests"] == s0["blob_reads"]
    assert s1["read_requests"] < s1["blob_reads"]
    # A chunk alone (no decode step after it), in one part: one request per run of each layer's union.
    with vault.session(cache_bytes=vault.expert_bytes, chunk=len(ids), part_rows=len(ids),
                       coalesce_bytes=max_run * vault.blob_bytes) as s:
        arr = np.asarray(ids[:-1], dtype=np.int32)
        check(lib.smoe_prefill_chunk(s.handle, ffi.cast("int32_t *", ffi.from_buffer(arr)), len(arr), ffi.NULL, ffi.NULL))
        st = s.stats()
    want = [np.unique(r).tolist() for r in ReferenceModel(tiny_vault).routing(ids[:-1]) if r is not None]
    assert st["blob_reads"] == sum(len(u) for u in want)
    assert st["read_requests"] == sum(_runs(u, max_run) for u in want) < st["blob_reads"]


def test_union_sizes_in_stats_and_cli(tiny_vault):
    vault = pysmoe.open_vault(tiny_vault)
    ids = list(range(1, 41))
    with vault.session(chunk=16) as s:
        s.prefill(ids)
        u = s.stats()["union_sizes"]
    assert len(u) == vault.config["num_hidden_layers"]
    assert all((x > 0) == vault.layer_is_sparse(layer) for layer, x in enumerate(u))
    # three chunks (16 + 16 + 7 of the 39 prefilled ids): each layer's sum is at most 3·E
    assert max(u) <= 3 * vault.config["num_experts"]


def test_layer_major_matches_transformers(hf_vault):
    from hf_models import hf_logits, sample_ids
    path, model = hf_vault
    ids = sample_ids(model, 20)
    want = hf_logits(model, ids)
    with pysmoe.open_vault(path) as vault:
        for n in (1, 7, 20):
            with vault.session(chunk=6) as s:
                assert float(np.abs(s.prefill(ids[:n]) - want[n - 1]).max()) <= 1e-4


@pytest.fixture(scope="module")
def noalloc_exe(tmp_path_factory):
    lib_dir = os.path.dirname(os.environ.get("SMOE_LIB") or os.path.join(ROOT, "build", "libsmoe.so"))
    exe = tmp_path_factory.mktemp("noalloc") / "test_noalloc"
    cc = os.environ.get("CC", "cc")
    cmd = [cc, "-std=c11", "-O1", "-Wall", "-Wextra", "-Werror", "-I", os.path.join(ROOT, "csrc"),
           os.path.join(ROOT, "tests", "c", "test_noalloc.c"), "-L", lib_dir, "-lsmoe",
           f"-Wl,-rpath,{lib_dir}", "-o", str(exe)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return exe


@pytest.mark.skipif(not os.path.exists("/lib/x86_64-linux-gnu/libc.so.6") and
                    not os.path.exists("/lib/aarch64-linux-gnu/libc.so.6"), reason="the shim needs glibc")
@pytest.mark.skipif("LD_PRELOAD" in os.environ, reason="a preloaded allocator (ASan) replaces the shim")
@pytest.mark.parametrize("budget,chunk,kv_dtype", [(0, 7, 0), (1 << 30, 64, 0), (0, 1, 0), (0, 7, 1), (1 << 30, 64, 2)])
def test_no_heap_allocation_in_prefill_or_decode(noalloc_exe, tiny_vault, budget, chunk, kv_dtype):
    out = subprocess.run([str(noalloc_exe), str(tiny_vault), str(budget), str(chunk), "100", "8", str(kv_dtype)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "heap calls during prefill + decode: 0" in out.stdout


# ------------------------------------------------------------------ the prefill contract

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_prefill_hands_back_the_logits_of_chosen_positions(tiny_vault, data):
    """smoe_prefill_rows: the logits after chosen tokens of a layer-major prompt are bit for bit those
    the token-serial step gives after each of them (an echo's log-probabilities, no serial pass)."""
    vault = pysmoe.open_vault(tiny_vault)
    V = vault.config["vocab_size"]
    n = data.draw(st.integers(1, 60), label="prompt length")
    ids = data.draw(st.lists(st.integers(0, V - 1), min_size=n, max_size=n), label="ids")
    rows = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n), label="rows"))
    chunk = data.draw(st.integers(1, 24), label="chunk")
    with vault.session(prefill="token-serial") as s:
        want = [s.decode(t) for t in ids]
    with vault.session(chunk=chunk) as s:
        got = s.prefill_logits(ids, rows)
        assert s.position == n
    assert got.shape == (len(rows), V)
    for r, row in zip(rows, got):
        assert row.tobytes() == want[r].tobytes(), f"position {r}"


def test_prefill_rows_refuses_bad_rows(tiny_vault):
    with pysmoe.open_vault(tiny_vault) as v, v.session(chunk=8) as s:
        for rows in ([3, 3], [5, 2], [-1], [9]):
            with pytest.raises(pysmoe.InvalidArgument, match="rows"):
                s.prefill_logits(list(range(1, 10)), rows)
        assert s.position == 0
        arr = np.arange(1, 6, dtype=np.int32)
        bad = np.array([2, 1], dtype=np.uint32)
        out = np.empty((2, v.config["vocab_size"]), dtype=np.float32)
        rc = lib.smoe_prefill_rows(s.handle, ffi.cast("int32_t *", ffi.from_buffer(arr)), 5,
                                   ffi.cast("uint32_t *", ffi.from_buffer(bad)), 2,
                                   ffi.cast("float *", ffi.from_buffer(out)), ffi.NULL)
        assert rc == pysmoe.InvalidArgument.code and s.position == 0


@pytest.mark.parametrize("piece,chunk", [(16, 16), (16, 64), (7, 7)])
def test_a_prompt_fed_in_pieces_reads_no_more_than_one_call(tiny_vault_f32, piece, chunk):
    """A prompt fed piece by piece, logits asked on the last piece only (what the server does), reads
    no more blobs than one prefill of it with the same chunks (no cache: every union is read), and
    gives the same logits bit for bit: no piece pays a token-serial pass of its own."""
    vault = pysmoe.open_vault(tiny_vault_f32)
    ids = [int(i) for i in np.random.default_rng(piece).integers(0, vault.config["vocab_size"], 96)]
    with vault.session(chunk=min(piece, chunk), cache_bytes=0) as s:
        one = s.prefill(ids)
        one_reads = s.stats()["blob_reads"]
    with vault.session(chunk=chunk, cache_bytes=0) as s:
        for start in range(0, len(ids) - piece, piece):
            assert s.prefill(ids[start:start + piece], want_logits=False) is None
        last = s.prefill(ids[len(ids) - (len(ids) - 1) % piece - 1:])
        reads = s.stats()["blob_reads"]
    assert last.tobytes() == one.tobytes()
    assert reads <= one_reads, (reads, one_reads)
