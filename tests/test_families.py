"""Mixtral, OLMoE and GLM-4.5 (glm4_moe) against transformers: random-weight models of several
configs, saved, converted to an f32 vault, run by the engine at every position (token-serial
decode steps), within 1e-4 of max|logit|; layer-major prefill = token-serial bit for bit; a q4
conversion runs."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import pysmoe  # noqa: E402
from hf_models import write_tokenizer  # noqa: E402
from test_prefill import assert_identical, run_path  # noqa: E402
from pysmoe.convert import convert_checkpoint  # noqa: E402
from pysmoe.reference import ReferenceModel  # noqa: E402
from pysmoe.vaultio import read_vault  # noqa: E402

TOL = 1e-4  # of max|logit|
BASE = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)

CASES = {
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                dict(intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, head_dim=16)),
    "mixtral_gqa4_tied": ("MixtralForCausalLM", "MixtralConfig",
                          dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, num_key_value_heads=1,
                               head_dim=24, tie_word_embeddings=True, num_hidden_layers=3)),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(intermediate_size=64, num_experts=8, num_experts_per_tok=2)),
    "olmoe_norm_topk": ("OlmoeForCausalLM", "OlmoeConfig",
                        dict(intermediate_size=64, num_experts=16, num_experts_per_tok=3, norm_topk_prob=True)),
    "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig",
                 dict(intermediate_size=96, moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2,
                      n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3, head_dim=16,
                      attention_bias=True, routed_scaling_factor=2.5, n_group=2, topk_group=1)),
    "glm4_moe_qknorm": ("Glm4MoeForCausalLM", "Glm4MoeConfig",
                        dict(intermediate_size=96, moe_intermediate_size=64, n_routed_experts=16, num_experts_per_tok=4,
                             n_shared_experts=2, first_k_dense_replace=0, head_dim=32, use_qk_norm=True,
                             attention_bias=False, norm_topk_prob=False, n_group=4, topk_group=2,
                             partial_rotary_factor=0.25)),
}
F32 = dict(experts="f32", dense="f32", progress=False)


@torch.no_grad()
def _build(name, tmp):
    import transformers

    arch, cfg_name, over = CASES[name]
    kw = {**BASE, **over}
    prf = kw.pop("partial_rotary_factor", None)
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    if prf is not None:
        kw["rope_parameters"]["partial_rotary_factor"] = prf
    cfg = getattr(transformers, cfg_name)(**kw)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, arch)(cfg).float().eval()
    g = torch.Generator().manual_seed(1)
    n_exp = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or cfg.n_routed_experts
    for pname, p in sorted(model.named_parameters()):
        if pname.endswith("norm.weight"):
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        elif pname.endswith("gate.weight") and p.shape[0] == n_exp:  # a router
            p.copy_(torch.randn(p.shape, generator=g) * (3.0 / p.shape[-1] ** 0.5))
        elif pname.endswith("bias"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        else:
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    for bname, b in model.named_buffers():
        if bname.endswith("e_score_correction_bias"):
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    path = tmp / "hf"
    model.save_pretrained(path)
    write_tokenizer(path, cfg.vocab_size)
    return path, model


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    path, model = _build(request.param, tmp)
    ids = [int(i) for i in np.random.default_rng(2).integers(0, model.config.vocab_size, size=20)]
    return request.param, tmp, path, model, ids


def _engine_logits(vault, ids, **kw):
    with pysmoe.open_vault(vault) as v, v.session(**kw) as s:
        rows = [s.prefill(ids[:1])]
        rows += [s.decode(i) for i in ids[1:]]
    return np.stack(rows)


def test_f32_vault_matches_transformers(case):
    name, tmp, path, model, ids = case
    vault = convert_checkpoint(path, tmp / "f32", **F32)
    assert read_vault(vault).family == name.split("_qk")[0].split("_gqa")[0].split("_norm")[0]
    with torch.no_grad():
        want = model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
    got = _engine_logits(vault, ids)
    rel = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    print(f"{name}: f32 max|engine - transformers| / max|logit| = {rel:.3g}")
    assert rel <= TOL
    ref = ReferenceModel(vault).logits(ids)  # the numpy reference forward follows the family too
    assert float(np.max(np.abs(ref - want)) / np.max(np.abs(want))) <= TOL


def test_layer_major_equals_token_serial(case):
    name, tmp, path, model, ids = case
    vault = tmp / "f32" if (tmp / "f32").exists() else convert_checkpoint(path, tmp / "f32", **F32)
    q4 = convert_checkpoint(path, tmp / "q4", experts="q4", dense="f32", progress=False)
    for v in (vault, q4):
        with pysmoe.open_vault(v) as vv:
            with vv.session(prefill="token-serial") as s:
                want = s.prefill(ids)
            for chunk, threads in ((3, 1), (8, 2), (32, 2)):
                with vv.session(prefill="layer-major", chunk=chunk, threads=threads) as s:
                    assert np.array_equal(s.prefill(ids), want), (name, v.name, chunk)


MLX_CASES = {
    "mixtral": dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, head_dim=16),
    "olmoe": dict(intermediate_size=64, num_experts=4, num_experts_per_tok=2),
    "glm4_moe": dict(intermediate_size=128, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
                     n_shared_experts=1, first_k_dense_replace=1, head_dim=16, attention_bias=True,
                     routed_scaling_factor=1.5),
}


@pytest.mark.parametrize("family", sorted(MLX_CASES))
def test_mlx_4bit_import_runs_as_mlx_lm_does(family, tmp_path):
    """mlx-lm's own 4-bit conversion of the family imports without requantising, and the engine
    (f32 activations) gives mlx-lm's f32 logits on the same codes."""
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed")
    mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm is not installed")
    from mlx_lm.utils import load_model

    arch, cfg_name, _ = CASES[family]
    saved = CASES[family]
    CASES[family] = (arch, cfg_name, MLX_CASES[family])
    try:
        path, model = _build(family, tmp_path)
    finally:
        CASES[family] = saved
    bf16 = tmp_path / "hf-bf16"
    model.to(torch.bfloat16).save_pretrained(bf16)
    write_tokenizer(bf16, model.config.vocab_size)
    cj = bf16 / "config.json"  # the released spelling: rope_theta (and GLM's partial_rotary_factor) at the top
    c = json.loads(cj.read_text())
    rp = c.get("rope_parameters") or {}
    c.setdefault("rope_theta", rp.get("rope_theta", 10000.0))
    c.setdefault("rope_scaling", None)
    if family == "glm4_moe":
        c.setdefault("partial_rotary_factor", rp.get("partial_rotary_factor", 0.5))
    cj.write_text(json.dumps(c))
    mlx_dir = tmp_path / "mlx"
    mlx_lm.convert(str(bf16), str(mlx_dir), dtype="bfloat16", quantize=True, q_bits=4, q_group_size=64)
    vault = convert_checkpoint(mlx_dir, tmp_path / "v", progress=False)
    v = read_vault(vault)
    assert v.family == family and [t.format for t in v.expert_tensors] == ["q4", "q4", "q4"]
    ids = [int(i) for i in np.random.default_rng(3).integers(0, model.config.vocab_size, size=10)]
    m, _ = load_model(mlx_dir)
    m.set_dtype(mx.float32)
    want = np.array(m(mx.array([ids]))[0, -1].astype(mx.float32))
    with pysmoe.open_vault(vault) as pv, pv.session(activations="f32") as s:
        got = s.prefill(ids)
    rel = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    print(f"{family}: mlx 4-bit max|engine - mlx-lm| / max|logit| = {rel:.3g}")
    assert rel <= TOL


@pytest.fixture(scope="module")
def family_vaults(tmp_path_factory):
    """q4-expert vaults of the GLM (grouped router, shared expert, biases, partial RoPE) and OLMoE
    (QK-norm over the whole projection) configs, and a Mixtral one (no QK-norm)."""
    out = {}
    for name in ("glm4_moe", "glm4_moe_qknorm", "olmoe", "mixtral"):
        tmp = tmp_path_factory.mktemp(f"hyp-{name}")
        path, _ = _build(name, tmp)
        out[name] = convert_checkpoint(path, tmp / "q4", experts="q4", dense="f32", progress=False)
    return out


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_layer_major_is_bit_identical_to_token_serial(family_vaults, data):
    name = data.draw(st.sampled_from(sorted(family_vaults)), label="family")
    with pysmoe.open_vault(family_vaults[name]) as vault:
        V = vault.config["vocab_size"]
        n = data.draw(st.integers(1, 60), label="prompt length")
        ids = data.draw(st.lists(st.integers(0, V - 1), min_size=n, max_size=n), label="ids")
        chunk = data.draw(st.integers(1, 64), label="chunk")
        threads = data.draw(st.integers(1, 3), label="threads")
        budget = data.draw(st.sampled_from([0, vault.expert_bytes * 2]), label="budget")
        kv_dtype = data.draw(st.sampled_from(pysmoe.KV_DTYPES), label="kv_dtype")
        acts = data.draw(st.sampled_from(["f32", "q8"]), label="activations")
        kw = dict(threads=threads, cache_bytes=budget, kv_dtype=kv_dtype, activations=acts)
        assert_identical(run_path(vault, ids, "token-serial", **kw),
                         run_path(vault, ids, "layer-major", chunk=chunk,
                                  part_rows=data.draw(st.integers(0, 8), label="part_rows"), **kw))


def test_glm_synth_presets_and_info(tiny_glm_vault):
    """`pysmoe synth --preset tiny-glm` writes a GLM vault the engine runs (layer-major = token
    serial) and `info` names its family and recipe; glm-4.5-air's layout is GLM-4.5-Air's shape."""
    from pysmoe import synthesis as S
    from pysmoe import vaultio as V

    text = V.info(tiny_glm_vault)
    assert "model      glm4_moe" in text
    assert "q/k/v biases, RoPE on 16 of 32 dims, sigmoid router with score bias, best 2 of 4 groups, x2.5, " \
           "shared expert 64" in text
    with pysmoe.open_vault(tiny_glm_vault) as v:
        ids = list(range(3, 40))
        assert_identical(run_path(v, ids, "token-serial"), run_path(v, ids, "layer-major", chunk=7, threads=2))
    air = V.compute_layout(S.preset_config("glm-4.5-air", layers=3))
    assert air.params == {"family": 3, "qk_norm": 0, "attention_bias": 1, "router_kind": 1, "n_group": 1,
                          "topk_group": 1, "routed_scaling_factor": 1.0, "shared_intermediate_size": 1408,
                          "rotary_dim": 64}
    assert air.sparse == (False, True, True)
    assert air.tensors["layers.1.shared.gate_proj"].rows == 1408 and air.tensors["layers.0.mlp.gate_proj"].rows == 10944
    assert air.tensors["layers.1.q_proj"].rows == 96 * 128 and air.tensors["layers.2.router.bias"].cols == 128


def test_layers_with_blobs_of_their_own_layout(make_vault, tmp_path):
    """Vault v3's per-layer blob layout: layer 1's down in f32 (a 32 KiB blob), the others q4
    (16 KiB). The streamer reads each layer's own length, verify checks it, both prefill paths
    agree bit for bit, and the engine (f32 activations) matches the numpy reference."""
    from pysmoe import vaultio as V

    path = make_vault("mixed_layers", preset="tiny", seed=2, formats={"layers.1.experts.down": "f32"})
    v = V.read_vault(path)
    assert v.layer_blob_bytes == [16384, 32768, 0, 16384] and v.header.blob_bytes == 32768
    assert [t.format for t in v.layer_expert_tensors[1]] == ["q4", "q4", "f32"]
    assert v.verify() == []
    ids = list(range(5, 60, 3))
    with pysmoe.open_vault(path) as pv:
        pv.verify()
        for budget in (0, pv.expert_bytes * 2):
            assert_identical(run_path(pv, ids, "token-serial", cache_bytes=budget),
                             run_path(pv, ids, "layer-major", chunk=5, threads=2, cache_bytes=budget))
        with pv.session(activations="f32") as s:
            got = s.prefill(ids)
    want = ReferenceModel(path).logits(ids)[-1]
    assert float(np.max(np.abs(got - want)) / np.max(np.abs(want))) <= TOL


def test_decode_batch_on_a_glm_vault_is_bit_identical_to_one_at_a_time(tiny_glm_vault):
    """smoe_decode_batch runs the GLM recipe (biases, grouped router, shared expert, partial RoPE)
    on every session's row in one pass: each row gets the bits it gets decoding alone."""
    prompts = [[5, 9, 200], [7], [11, 12, 13, 14, 15, 16]]
    with pysmoe.open_vault(tiny_glm_vault) as v:
        first = v.session(threads=2, context=48, chunk=8)
        batch = [first] + [v.session(share_cache=first, context=48, chunk=8) for _ in prompts[1:]]
        alone = [v.session(threads=1, context=48, chunk=8) for _ in prompts]
        try:
            for b, a, p in zip(batch, alone, prompts):
                assert np.array_equal(b.prefill(p).view(np.uint32), a.prefill(p).view(np.uint32))
            for step in range(4):
                toks = [(31 * step + 7 * i) % 500 for i in range(len(prompts))]
                got = pysmoe.decode_batch(batch, toks)
                for a, t, g in zip(alone, toks, got):
                    assert np.array_equal(np.asarray(g).view(np.uint32), a.decode(t).view(np.uint32))
        finally:
            for s in batch + alone:
                s.close()
