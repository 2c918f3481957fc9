"""Qwen3-Next and Qwen3.5-MoE (text): the engine against transformers, and its own paths.

transformers' Qwen3NextForCausalLM and Qwen3_5MoeForCausalLM on random weights (its torch
fallbacks: the chunked gated delta rule for the whole prompt, F.conv1d, the eager attention) are
the oracle: their checkpoints are saved, converted to f32 vaults and compared at every position
within 1e-4 of max|logit|. Then the engine against itself: layer-major prefill = token-serial
decode bit for bit for several chunks and thread counts (the recurrence runs in token order in
both), a rewind to a mid-prompt position (the recurrent states recomputed or restored from the
snapshot) gives a fresh run's bits, and a batch of sessions decodes as each would alone.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from hf_models import write_tokenizer  # noqa: E402
from test_prefill import assert_identical, run_path  # noqa: E402

import pysmoe  # noqa: E402
from pysmoe.convert import convert_checkpoint  # noqa: E402

TOL = 1e-4  # of max|logit|
F32 = dict(experts="f32", dense="f32", progress=False)

BASE = dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=64,
            shared_expert_intermediate_size=96, num_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
            rms_norm_eps=1e-6, tie_word_embeddings=False)

# (family, config overrides): layer_types mixes, head sizes, expert counts, GQA of the linear heads
CASES = {
    "next_base": ("qwen3_next", dict(intermediate_size=96, norm_topk_prob=True)),
    "next_mixed": ("qwen3_next", dict(intermediate_size=96, norm_topk_prob=False, num_hidden_layers=5,
                                      layer_types=["full_attention", "linear_attention", "linear_attention",
                                                   "full_attention", "linear_attention"],
                                      linear_num_key_heads=1, linear_num_value_heads=4, linear_key_head_dim=32,
                                      linear_value_head_dim=8, num_experts=16, num_experts_per_tok=4,
                                      mlp_only_layers=[2], partial_rotary_factor=0.5)),
    "q35_base": ("qwen3_5_moe", dict()),
    "q35_wide": ("qwen3_5_moe", dict(num_hidden_layers=3, full_attention_interval=3, head_dim=16,
                                     linear_num_key_heads=4, linear_num_value_heads=4, linear_conv_kernel_dim=3,
                                     num_experts=4, num_experts_per_tok=1, tie_word_embeddings=True)),
}


def _config(family: str, overrides: dict):
    import transformers as T

    kw = {**BASE, **overrides}
    factor = kw.pop("partial_rotary_factor", 0.25)
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor}
    if family == "qwen3_next":
        cfg = T.Qwen3NextConfig(**kw)
    else:
        cfg = T.Qwen3_5MoeTextConfig(**kw)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


@torch.no_grad()
def _randomize(model, seed: int) -> None:
    """O(1) activations; random norm weights (the (1 + w) ones around 0, the gated norm's around
    1); decays that neither vanish nor stay at 1; a router with a wide spread."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("linear_attn.norm.weight"):
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        elif name.endswith("norm.weight"):  # (1 + w) norms
            p.copy_(torch.rand(p.shape, generator=g) - 0.5)
        elif name.endswith("A_log"):
            p.copy_(torch.log(torch.rand(p.shape, generator=g) * 2 + 0.1))
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        elif name.endswith("conv1d.weight"):
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        elif name.endswith("mlp.gate.weight"):
            p.copy_(torch.randn(p.shape, generator=g) * (3.0 / p.shape[-1] ** 0.5))
        else:
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def make_model(tmp, family: str, overrides: dict, seed: int = 0, multimodal: bool = False):
    """A random-weight model of the family, saved as transformers saves it; (dir, model)."""
    import transformers as T

    torch.manual_seed(seed)
    cfg = _config(family, overrides)
    cls = T.Qwen3NextForCausalLM if family == "qwen3_next" else T.Qwen3_5MoeForCausalLM
    model = cls(cfg).float().eval()
    if cfg.tie_word_embeddings:
        model.tie_weights()
    _randomize(model, seed)
    path = tmp / "hf"
    model.save_pretrained(path)
    if multimodal:  # what the released Qwen3.5 checkpoints look like: a language model inside
        _as_multimodal(path)
    write_tokenizer(path, cfg.vocab_size)
    return path, model


def _as_multimodal(path) -> None:
    """Rewrites a saved Qwen3_5MoeForCausalLM as the multimodal release spells it: config with a
    text_config, tensors under model.language_model., a (small) vision tower and an mtp head to
    be left out."""
    from safetensors.numpy import load_file, save_file

    raw = json.loads((path / "config.json").read_text())
    tied = raw.pop("tie_word_embeddings", False)
    cfg = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "tie_word_embeddings": tied, "text_config": {**raw, "model_type": "qwen3_5_moe_text"},
           "vision_config": {"depth": 1, "hidden_size": 8}}
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(path / "model.safetensors")
    out = {}
    for name, a in tensors.items():
        out[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = a
    out["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((24, 8), np.float32)
    out["mtp.fc.weight"] = np.zeros((4, 4), np.float32)
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()


def sample_ids(vocab: int, n: int, seed: int = 1) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, vocab, n)]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    family, over = CASES[request.param]
    path, model = make_model(tmp, family, over, multimodal=request.param == "q35_base")
    vault = convert_checkpoint(path, tmp / "f32", **F32)
    return request.param, vault, model


def test_f32_vault_matches_transformers_at_every_position(case):
    name, vault, model = case
    ids = sample_ids(model.config.vocab_size, 40)
    want = hf_logits(model, ids)
    with pysmoe.open_vault(vault) as v, v.session(threads=2, chunk=16) as s:
        got = s.prefill_logits(ids, rows=list(range(len(ids))))
    err = float(np.max(np.abs(got - want)))
    scale = float(np.max(np.abs(want)))
    print(f"\n{name}: f32 max|engine − transformers| = {err:.3g} (max|logit| {scale:.3g}, {err / scale:.2g})")
    assert err <= TOL * scale


def _serial(v, ids, **kw) -> np.ndarray:
    with v.session(prefill="token-serial", **kw) as s:
        return np.stack([s.decode(t) for t in ids])


def test_layer_major_is_token_serial_bit_for_bit(case):
    name, vault, model = case
    ids = sample_ids(model.config.vocab_size, 23, seed=2)
    with pysmoe.open_vault(vault) as v:
        want = _serial(v, ids, threads=1)
        for chunk, threads, cache in ((1, 2, 0), (5, 1, 1 << 20), (8, 2, 0), (64, 2, 1 << 30)):
            with v.session(chunk=chunk, threads=threads, cache_bytes=cache) as s:
                got = s.prefill_logits(ids, rows=list(range(len(ids))))
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (name, chunk, threads)
        # then decoding on from a layer-major prefill
        with v.session(chunk=7, threads=2) as s:
            s.prefill(ids[:15])
            tail = np.stack([s.decode(t) for t in ids[15:]])
        assert np.array_equal(tail.view(np.uint32), want[15:].view(np.uint32))


def _cpu(v, **kw):
    return v.session(threads=2, **kw)


def check_rewinds(case, open_session) -> None:
    """Rewinds before, past and onto a snapshot (and below one, which is then not used again)
    give a fresh run's bits: the states restored from the snapshot or recomputed from position 0."""
    name, vault, model = case
    ids = sample_ids(model.config.vocab_size, 30, seed=3)
    other = sample_ids(model.config.vocab_size, 12, seed=4)
    with pysmoe.open_vault(vault) as v:
        with open_session(v, chunk=8) as fresh:
            want = fresh.prefill_logits(ids[:13] + other, rows=list(range(13, 25)))
        with open_session(v, chunk=8) as s:
            s.prefill(ids)                      # snapshot at 30
            for t in other[:3]:
                s.decode(t)
            s.rewind(13)                        # before the snapshot: recomputed from position 0
            got = s.prefill_logits(other, rows=list(range(12)))
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), name
            s.rewind(20)                        # the snapshot (at 25) is past it: recomputed again
            s.rewind(17)
            again = np.stack([s.decode(t) for t in other[4:8]])
            assert np.array_equal(again.view(np.uint32), want[4:8].view(np.uint32)), name
        with open_session(v, chunk=8) as s:  # a snapshot a rewind went below is not used again
            s.prefill(ids[:20])                 # snapshot at 20
            s.rewind(13)
            for t in other[:9]:                 # decoded, no new snapshot: position 22
                s.decode(t)
            s.rewind(21)                        # past 20, but the snapshot's ids are gone
            got = np.stack([s.decode(t) for t in other[8:12]])
            assert np.array_equal(got.view(np.uint32), want[8:12].view(np.uint32)), name
        with open_session(v, chunk=8) as s:  # the chat case: back to the end of the prompt
            s.prefill(ids[:13])                 # snapshot at 13
            for t in ids[13:20]:
                s.decode(t)
            s.rewind(13)
            got = s.prefill_logits(other, rows=list(range(12)))
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), name


def test_rewind_to_mid_prompt_gives_a_fresh_runs_logits(case):
    check_rewinds(case, _cpu)


def check_batched_decode(case, open_session) -> None:
    """Sessions of one share decode together, each row with its own states, as each alone."""
    name, vault, model = case
    V = model.config.vocab_size
    prompts = [sample_ids(V, 9, seed=10), sample_ids(V, 4, seed=11), sample_ids(V, 13, seed=12)]
    steps = [sample_ids(V, 5, seed=20 + i) for i in range(3)]
    with pysmoe.open_vault(vault) as v:
        alone = []
        for p, st in zip(prompts, steps):
            with open_session(v, chunk=16) as s:
                s.prefill(p)
                alone.append(np.stack([s.decode(t) for t in st]))
        with open_session(v, chunk=16) as lead:
            others = [v.session(share_cache=lead, chunk=16) for _ in range(2)]
            ss = [lead] + others
            for s, p in zip(ss, prompts):
                s.prefill(p)
            for j in range(5):
                out = pysmoe.decode_batch(ss, [steps[i][j] for i in range(3)])
                for i in range(3):
                    assert np.array_equal(out[i].view(np.uint32), alone[i][j].view(np.uint32)), (name, i, j)
            for o in others:
                o.close()


def test_batched_decode_equals_each_alone(case):
    check_batched_decode(case, _cpu)


def test_the_vision_tower_and_mtp_are_left_out(tmp_path):
    path, model = make_model(tmp_path, "qwen3_5_moe", dict(num_hidden_layers=2, full_attention_interval=2),
                             multimodal=True)
    vault = convert_checkpoint(path, tmp_path / "v", **F32)
    with pysmoe.open_vault(vault) as v:
        assert v.config["num_hidden_layers"] == 2
        ids = sample_ids(model.config.vocab_size, 6)
        with v.session() as s:
            got = s.prefill_logits(ids, rows=list(range(6)))
    want = hf_logits(model, ids)
    assert np.max(np.abs(got - want)) <= TOL * np.max(np.abs(want))


@pytest.mark.parametrize("activations", ["q8", "f32"])
def test_quantized_vault_paths_agree_in_both_activation_modes(tmp_path_factory, activations):
    """q4 experts, q8 dense matrices (the in- and out-projections of the DeltaNet included): the
    layer-major prefill gives token-serial's bits with 8-bit and with f32 activations."""
    tmp = tmp_path_factory.mktemp(f"quant-{activations}")
    family, over = CASES["q35_wide"]
    path, model = make_model(tmp, family, {**over, "shared_expert_intermediate_size": 64}, seed=5)
    vault = convert_checkpoint(path, tmp / "q4", experts="q4", dense="q8", progress=False)
    ids = sample_ids(model.config.vocab_size, 17, seed=6)
    with pysmoe.open_vault(vault) as v:
        want = _serial(v, ids, threads=1, activations=activations)
        with v.session(chunk=6, threads=2, activations=activations) as s:
            got = s.prefill_logits(ids, rows=list(range(len(ids))))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.isfinite(got).all()


def test_states_are_counted_with_the_kv_cache(case):
    from pysmoe.memory import kv_bytes, recurrent_state_bytes

    name, vault, model = case
    with pysmoe.open_vault(vault) as v, v.session(context=64) as s:
        assert recurrent_state_bytes(v.config) > 0
        assert s.stats()["kv_bytes"] == kv_bytes(v.config, s.context), name
    from pysmoe.vaultio import info

    text = info(vault)
    assert f"model      {CASES[name][0]}:" in text and "Gated DeltaNet" in text, text


@pytest.mark.parametrize("preset", ["qwen3.6-35b-a3b", "qwen3.5-397b-a17b"])
def test_synth_presets_of_the_hybrids_run(tmp_path, preset):
    """The presets' recipe (shapes shrunk through overrides so that it builds in a moment): every
    tensor of a hybrid vault synthesised, realistic routing, prefill = token-serial."""
    small = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, head_dim=32, moe_intermediate_size=64,
                 shared_expert_intermediate_size=64, intermediate_size=64, num_experts=16,
                 linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2)
    small["linear_num_value_heads"] = 4 if preset.startswith("qwen3.6") else 8
    vault = pysmoe.synth(tmp_path / "v", preset=preset, layers=5, routing="realistic", progress=False,
                         overrides=small)
    ids = sample_ids(512, 11, seed=7)
    with pysmoe.open_vault(vault) as v:
        assert v.config["layer_types"] == ["linear_attention"] * 3 + ["full_attention", "linear_attention"]
        want = _serial(v, ids, threads=1)
        with v.session(chunk=4, threads=2) as s:
            got = s.prefill_logits(ids, rows=list(range(len(ids))))
    assert np.isfinite(got).all() and np.array_equal(got.view(np.uint32), want.view(np.uint32))


# ------------------------------------------------------------------------- on the GPU (CUDA)
# The hybrids on device="cuda" (csrc/cuda/deltanet.cu): skipped without a GPU. The GPU against the
# CPU (activations="f32") within test_cuda's tolerance (RTOL_F16 where flash attention's or the
# tensor cores' f16 roundings apply), and the GPU's own paths bit for bit: layer-major = token-serial
# for several chunks, a rewind (states restored from the snapshot or recomputed) and a batch.


def _gpu(v, **kw):
    from pysmoe.errors import Unsupported

    try:
        return v.session(device="cuda", gpu_cache_bytes=1 << 30, **kw)
    except Unsupported as e:
        pytest.skip(f"no CUDA here: {e}")


def test_without_a_gpu_the_cuda_device_is_refused_plainly(case):
    """Refused at session creation: a build without CUDA, or no GPU, says so (with a GPU, the
    tests below run the hybrids)."""
    from pysmoe.errors import Unsupported

    name, vault, model = case
    with pysmoe.open_vault(vault) as v:
        try:
            v.session(device="cuda").close()
        except Unsupported as e:
            assert "built without CUDA" in str(e) or "no usable GPU" in str(e), str(e)


def _gpu_tolerance(v) -> float:
    from test_cuda import ATOL, RTOL, RTOL_F16

    flash = v.config["head_dim"] in (32, 64, 128)
    return ATOL, RTOL_F16 if flash else RTOL


def _steps(s, ids, layers, experts):
    """Token-serial logits of each id, and each step's expert counts per layer."""
    from test_cuda import _expert_counts

    logits, routes = [], []
    for t in ids:
        s.reset_stats()
        logits.append(s.decode(t))
        routes.append(_expert_counts(s, layers, experts))
    return np.stack(logits), routes


def _first_near_tie(model, ids, margin: float = 1e-4) -> int:
    """The first position at which some layer's router (transformers, f32) separates its K-th and
    (K+1)-th experts' probabilities by less than margin; len(ids) if none does."""
    K = model.config.num_experts_per_tok
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=False, output_router_logits=True)
    first = len(ids)
    for rl in out.router_logits or ():
        if rl is None:
            continue
        p = torch.softmax(rl.float(), -1).numpy().reshape(len(ids), -1)
        top = -np.sort(-p, axis=1)
        close = np.nonzero(top[:, K - 1] - top[:, K] < margin)[0]
        if close.size:
            first = min(first, int(close[0]))
    return first


def test_gpu_agrees_with_the_cpu_and_its_own_paths(case):
    """Logits within tolerance of the CPU's, with the same experts, at every position before the
    first router near-tie; on the GPU layer-major prefill in chunks of 1, 5 and 64 gives
    token-serial's logits bit for bit, and decoding on from a prefill continues them; the states
    are counted with the KV cache.

    A near-tie (the oracle's K-th and (K+1)-th router probabilities within 1e-4, the GPU's own
    error in max|logit| on these configs) may go the other way on the GPU (its f16 roundings) and
    change that token's experts, and every later position through the recurrent states and K/V rows
    (as test_cuda's family test explains). next_mixed (16 experts, 4 chosen) has them from step 5 of
    its 23 (margins 7.7e-5 at step 5, 1.2e-5 at step 8, in transformers' f32): its first run on the
    H200 differed by 8.6e-3 of max|logit| over all 23 steps. So the comparison covers the steps
    before the first near-tie (next_base 14, next_mixed 5, q35_base 18, q35_wide all 23), and there
    the experts must agree."""
    from pysmoe.memory import kv_bytes

    name, vault, model = case
    ids = sample_ids(model.config.vocab_size, 23, seed=2)
    tie = _first_near_tie(model, ids)
    assert tie >= 1, name
    with pysmoe.open_vault(vault) as v:
        L, E = v.config["num_hidden_layers"], v.config["num_experts"]
        with v.session(chunk=8, activations="f32", prefill="token-serial") as c:
            cpu, cr = _steps(c, ids, L, E)
        with _gpu(v, prefill="token-serial", context=64) as g:
            assert g.stats()["kv_bytes"] == kv_bytes(v.config, 64), name
            want, gr = _steps(g, ids, L, E)
        atol, rtol = _gpu_tolerance(v)
        err, top = float(np.max(np.abs(want[:tie] - cpu[:tie]))), float(np.max(np.abs(cpu[:tie])))
        print(f"{name}: max|gpu - cpu| / max|logit| = {err / top:.3g} over the first {tie} of {len(ids)} steps")
        assert gr[:tie] == cr[:tie], (name, "the experts differ before the first near-tie")
        assert err <= atol + rtol * top, (name, err, top)
        for chunk in (1, 5, 64):
            with _gpu(v, chunk=chunk) as s:
                got = s.prefill_logits(ids, rows=list(range(len(ids))))
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (name, chunk)
        with _gpu(v, chunk=7) as s:
            s.prefill(ids[:15])
            tail = np.stack([s.decode(t) for t in ids[15:]])
        assert np.array_equal(tail.view(np.uint32), want[15:].view(np.uint32)), name


def test_gpu_rewinds_to_a_fresh_runs_bits(case):
    """The states on the GPU follow rewinds as the CPU's do."""
    check_rewinds(case, _gpu)


def test_gpu_batched_decode_equals_each_alone(case):
    """Sessions of one share decoding together on the GPU, each row with its own states."""
    check_batched_decode(case, _gpu)


def test_gpu_quantized_hybrids(q4_hybrids):
    """q4 experts and q8 dense matrices (the tensor cores' products, the DeltaNet's projections
    included): within RTOL_F16 of the CPU, and layer-major = token-serial on the GPU with the
    experts in VRAM or streamed through two slots."""
    from test_cuda import ATOL, RTOL_F16

    for name, vault in sorted(q4_hybrids.items()):
        with pysmoe.open_vault(vault) as v:
            ids = sample_ids(v.config["vocab_size"], 21, seed=8)
            with v.session(chunk=8, activations="f32") as c:
                cpu = c.prefill_logits(ids, rows=list(range(len(ids))))
            with _gpu(v, prefill="token-serial") as g:
                want = np.stack([g.decode(t) for t in ids])
            err, top = float(np.max(np.abs(want - cpu))), float(np.max(np.abs(cpu)))
            print(f"{name} q4/q8: max|gpu - cpu| / max|logit| = {err / top:.3g}")
            assert err <= ATOL + RTOL_F16 * top, (name, err, top)
            for chunk, gpu in ((4, 1 << 30), (16, 2 * v.blob_bytes)):
                from pysmoe.errors import Unsupported
                try:
                    s = v.session(device="cuda", chunk=chunk, gpu_cache_bytes=gpu)
                except Unsupported as e:
                    pytest.skip(f"no CUDA here: {e}")
                with s:
                    got = s.prefill_logits(ids, rows=list(range(len(ids))))
                assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (name, chunk, gpu)


@pytest.fixture(scope="module")
def q4_hybrids(tmp_path_factory):
    """q4-expert, q8-dense vaults of a Qwen3-Next and a Qwen3.5 config."""
    out = {}
    for name in ("next_base", "q35_wide"):
        tmp = tmp_path_factory.mktemp(f"hyp-{name}")
        family, over = CASES[name]
        path, _ = make_model(tmp, family, {**over, "shared_expert_intermediate_size": 64}, seed=9)
        out[name] = convert_checkpoint(path, tmp / "q4", experts="q4", dense="q8", progress=False)
    return out


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_layer_major_is_bit_identical_to_token_serial_hypothesis(q4_hybrids, data):
    """Logits, greedy continuation and every KV row, over prompt, chunk, threads, cache budget, KV
    type and activation mode (test_prefill's run_path)."""
    name = data.draw(st.sampled_from(sorted(q4_hybrids)), label="config")
    with pysmoe.open_vault(q4_hybrids[name]) as vault:
        V = vault.config["vocab_size"]
        n = data.draw(st.integers(1, 40), label="prompt length")
        ids = data.draw(st.lists(st.integers(0, V - 1), min_size=n, max_size=n), label="ids")
        chunk = data.draw(st.integers(1, 48), label="chunk")
        kw = dict(threads=data.draw(st.integers(1, 3), label="threads"),
                  cache_bytes=data.draw(st.sampled_from([0, vault.expert_bytes * 2]), label="budget"),
                  kv_dtype=data.draw(st.sampled_from(pysmoe.KV_DTYPES), label="kv_dtype"),
                  activations=data.draw(st.sampled_from(["f32", "q8"]), label="activations"))
        assert_identical(run_path(vault, ids, "token-serial", **kw),
                         run_path(vault, ids, "layer-major", chunk=chunk, **kw))


def test_a_checkpoint_missing_or_misshaping_a_deltanet_tensor_is_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    from pysmoe.convert.hf import ConvertError

    path, _ = make_model(tmp_path, "qwen3_next", dict(num_hidden_layers=2, full_attention_interval=2))
    tensors = load_file(path / "model.safetensors")
    good = dict(tensors)
    del tensors["model.layers.0.linear_attn.A_log"]
    tensors["model.layers.0.linear_attn.in_proj_ba.weight"] = good["model.layers.0.linear_attn.in_proj_ba.weight"][:6]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConvertError) as e:
        convert_checkpoint(path, tmp_path / "v", **F32)
    msg = str(e.value)
    assert "layers.0.linear.A_log" in msg and "in_proj_ba" in msg, msg


# ------------------------------------------------------------------------------ mlx-lm's conversions
MLX_CASES = {  # (case of CASES, mlx-lm's quantisation): mlx-lm follows full_attention_interval, not layer_types
    "next_q4": ("next_base", 4),
    "q35_q8": ("q35_base", 8),
}


def _fuse_experts(path) -> None:
    """The released Qwen3.5 checkpoints' experts, stacked per layer: `experts.gate_up_proj`
    [E, 2I, H] (gate rows then up rows) and `experts.down_proj` [E, H, I], which is what mlx-lm
    reads (transformers saves one tensor per expert)."""
    import re

    from safetensors.numpy import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    out, per = {}, {}
    for name, a in tensors.items():
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
        if m:
            per.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = a
        else:
            out[name] = a
    for base, parts in per.items():
        E = len(parts["gate"])
        out[base + ".gate_up_proj"] = np.stack([np.concatenate([parts["gate"][e], parts["up"][e]]) for e in range(E)])
        out[base + ".down_proj"] = np.stack([parts["down"][e] for e in range(E)])
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("name", sorted(MLX_CASES))
def test_mlx_lm_conversion_imports_as_stored_and_runs_as_mlx_lm(name, tmp_path):
    """mlx-lm's own quantised conversion of the family (Qwen3-Next as transformers saves it,
    Qwen3.5 as the multimodal release spells it) imports without requantising: the experts, and
    the rows a split projection takes, dequantise to exactly mlx's own dequantisation; and the
    engine (f32 activations) gives mlx-lm's f32 logits at every position."""
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed")
    mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm is not installed")
    from mlx_lm.utils import load_model

    from pysmoe.convert import qwen_hybrid
    from pysmoe.vaultio import read_vault

    case, bits = MLX_CASES[name]
    family, over = CASES[case]
    path, model = make_model(tmp_path, family, over, multimodal=family == "qwen3_5_moe")
    if family == "qwen3_5_moe":
        _fuse_experts(path)
    if family == "qwen3_next":  # mlx-lm reads these at the top of config.json, as the release has them
        cj = path / "config.json"
        c = json.loads(cj.read_text())
        c.update(rope_theta=c["rope_parameters"]["rope_theta"],
                 partial_rotary_factor=c["rope_parameters"]["partial_rotary_factor"])
        cj.write_text(json.dumps(c))
    mlx_dir = tmp_path / "mlx"
    mlx_lm.convert(str(path), str(mlx_dir), dtype="bfloat16", quantize=True, q_bits=bits, q_group_size=64)
    vault = convert_checkpoint(mlx_dir, tmp_path / "v", progress=False)
    v = read_vault(vault)
    fmt = f"q{bits}"
    assert v.family == family and [t.format for t in v.expert_tensors] == [fmt] * 3

    stored = {}
    for f in mlx_dir.glob("*.safetensors"):
        stored.update(mx.load(str(f)))
    pre = "language_model.model." if family == "qwen3_5_moe" else "model."

    def deq(module, rows=None, e=None):
        w, s, b = (stored[f"{pre}{module}.{k}"] for k in ("weight", "scales", "biases"))
        if e is not None:
            w, s, b = w[e], s[e], b[e]
        a = np.array(mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=64, bits=bits))
        return a if rows is None else a[rows]

    for part, got in zip(("gate", "up", "down"), v.expert(1, 3)):
        assert np.array_equal(got, deq(f"layers.1.mlp.switch_mlp.{part}_proj", e=3)), part
    cfg = v.config
    q, g = qwen_hybrid._q_rows(cfg)
    assert np.array_equal(v.tensor("layers.3.q_proj"), deq("layers.3.self_attn.q_proj", q))
    assert np.array_equal(v.tensor("layers.3.q_gate_proj"), deq("layers.3.self_attn.q_proj", g))
    if family == "qwen3_next":
        qkv, z = qwen_hybrid._qkvz_rows(qwen_hybrid.linear_dims(cfg))
        assert np.array_equal(v.tensor("layers.0.linear.qkv"), deq("layers.0.linear_attn.in_proj_qkvz", qkv))
        assert np.array_equal(v.tensor("layers.0.linear.z"), deq("layers.0.linear_attn.in_proj_qkvz", z))
    else:
        assert np.array_equal(v.tensor("layers.0.linear.z"), deq("layers.0.linear_attn.in_proj_z"))

    ids = sample_ids(model.config.vocab_size, 16, seed=5)
    m, _ = load_model(mlx_dir)
    m.set_dtype(mx.float32)
    want = np.array(m(mx.array([ids]))[0].astype(mx.float32))
    with pysmoe.open_vault(vault) as pv, pv.session(activations="f32", threads=2) as s:
        got = s.prefill_logits(ids, rows=list(range(len(ids))))
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    print(f"\n{name}: max|engine - mlx-lm| / max|logit| = {err:.3g}")
    assert err <= TOL
