"""gpt-oss: its MXFP4 experts imported as stored, and (with transformers as the oracle) the f32 and
MXFP4 vaults of random-weight GptOssForCausalLM models; layer-major = token-serial bit for bit."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pysmoe import ggml_blocks
from pysmoe.convert.gpt_oss import ggml_to_mxfp4, mxfp4_to_ggml, split_gate_up


# ------------------------------------------------------------------------------ MXFP4 as stored
def test_mxfp4_rearrangement_is_transformers_dequantisation():
    """Every weight of the rearranged blocks dequantises (pysmoe's MXFP4, the kernels' rule) to
    exactly what transformers' convert_moe_packed_tensors gives, for every scale byte."""
    torch = pytest.importorskip("torch")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    E, R, G = 2, 6, 3
    blocks = rng.integers(0, 256, (E, R, G, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, (E, R, G), dtype=np.uint8)
    scales[0, 0, :] = (118, 127, 140)
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    for e in range(E):
        g = mxfp4_to_ggml(blocks[e], scales[e])
        assert g.shape == (R, G * 17)
        ours = ggml_blocks.dequantize(g.reshape(-1), "MXFP4", R, G * 32)
        np.testing.assert_array_equal(ours, theirs[e].T.numpy())
        b2, s2 = ggml_to_mxfp4(g, R, G * 32)  # and back: nothing lost
        np.testing.assert_array_equal(b2, blocks[e])
        np.testing.assert_array_equal(s2, scales[e])


def test_mxfp4_bad_shapes():
    with pytest.raises(ValueError, match="MXFP4 blocks"):
        mxfp4_to_ggml(np.zeros((2, 3, 15), np.uint8), np.zeros((2, 3), np.uint8))
    with pytest.raises(ValueError, match="MXFP4 blocks"):
        mxfp4_to_ggml(np.zeros((2, 3, 16), np.uint8), np.zeros((2, 4), np.uint8))


@pytest.mark.parametrize("change, message", [
    ({"sliding_window": None}, "sliding_window is None"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, "layer_types"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}}, "RoPE type"),
])
def test_bad_gpt_oss_configs_are_refused(tmp_path, change, message):
    import json as _json

    from pysmoe.convert import ConvertError, load_config

    cfg = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "vocab_size": 64, "hidden_size": 32,
           "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
           "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4,
           "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
           "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, **change}
    (tmp_path / "config.json").write_text(_json.dumps(cfg))
    with pytest.raises(ConvertError, match=message):
        load_config(tmp_path)


def test_split_gate_up_is_transformers_interleave():
    w = np.arange(2 * 5 * 8).reshape(2, 5, 8)  # (E, H, 2I): gate columns 0, 2, ..; up 1, 3, ..
    gate, up = split_gate_up(w[1], 1)
    np.testing.assert_array_equal(gate, w[1][:, ::2])
    np.testing.assert_array_equal(up, w[1][:, 1::2])


# ------------------------------------------------------------------------------ against transformers
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import pysmoe  # noqa: E402
from pysmoe.convert import convert_checkpoint  # noqa: E402

TOL = 1e-4  # of max|logit|, at every position
YARN = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 32, "rope_theta": 150000.0}
CASES = {
    # YaRN without truncation (gpt-oss's own), window 5 < the prompt, GQA 2:1
    "yarn": dict(hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=5,
                 rope_parameters=YARN, max_position_embeddings=256),
    # plain RoPE, head_dim 32 ≠ hidden/heads, MHA, 4 experts top 3, a window of 3, layer types not alternating
    "plain_rope": dict(hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=4, head_dim=32, num_local_experts=4, num_experts_per_tok=3,
                       sliding_window=3, layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=512),
    # YaRN with truncation and its own attention factor, head_dim 24, 4 query heads per kv head, 16 experts
    # top 4, tied embeddings, a tighter clamp
    "yarn_truncate": dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=1, head_dim=24, num_local_experts=16, num_experts_per_tok=4,
                          sliding_window=7, tie_word_embeddings=True, swiglu_limit=3.0,
                          rope_parameters={**YARN, "truncate": True, "factor": 4.0, "attention_factor": 1.3},
                          max_position_embeddings=128),
}
PROMPT = 24


def build_gpt_oss(tmp, seed=0, **over):
    """A random GptOssForCausalLM saved with save_pretrained: biases, sinks and norms random too,
    experts large enough that the SwiGLU's clamp bites."""
    cfg = transformers.GptOssConfig(vocab_size=320, **over)
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0, 0.5)
            elif "experts" in name:
                p.normal_(0, 0.6)
            elif "norm" in name:
                p.normal_(1, 0.2)
    path = tmp / "hf"
    model.save_pretrained(path)
    return path, model


@torch.no_grad()
def hf_logits(model, ids):
    return model(torch.tensor([list(ids)]), use_cache=False).logits[0].float().numpy()


@torch.no_grad()
def clamp_and_router_margins(model, ids):
    """(the largest gate pre-activation the chosen experts saw, over the clamp's limit; the
    smallest margin between the k-th and (k+1)-th router logit): the clamp must bite, and no
    top-k choice may be near a tie that float rounding could flip."""
    seen, margin = [0.0], [float("inf")]
    k = model.config.num_experts_per_tok

    def watch(experts):
        apply = experts._apply_gate

        def gate(gate_up):
            seen[0] = max(seen[0], float(gate_up[..., ::2].max()) / experts.limit)
            return apply(gate_up)
        return gate

    def router_hook(mod, args, out):
        top = torch.sort(out[0].float(), dim=-1, descending=True).values
        if top.shape[-1] > k:
            margin[0] = min(margin[0], float((top[:, k - 1] - top[:, k]).min()))

    hooks = []
    for layer in model.model.layers:
        layer.mlp.experts._apply_gate = watch(layer.mlp.experts)
        hooks.append(layer.mlp.router.register_forward_hook(router_hook))
    try:
        model(torch.tensor([list(ids)]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
        for layer in model.model.layers:
            del layer.mlp.experts._apply_gate
    return seen[0], margin[0]


def _rel(a, b):
    return float(np.max(np.abs(a - b), axis=-1).max() / np.abs(b).max())


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    path, model = build_gpt_oss(tmp, **CASES[request.param])
    ids = [int(i) for i in np.random.default_rng(1).integers(0, 320, PROMPT)]
    vault = convert_checkpoint(path, tmp / "vault", experts="f32", dense="f32", progress=False, jobs=1)
    return request.param, model, ids, vault


def test_f32_vault_matches_transformers_at_every_position(case):
    name, model, ids, vault = case
    clamp, margin = clamp_and_router_margins(model, ids)
    assert clamp > 1.0, f"{name}: the clamp never bites (largest gate {clamp:.2f}·limit)"
    assert margin > 1e-4, f"{name}: router top-k margin {margin:.3g}: a tie could flip between implementations"
    ref = hf_logits(model, ids)
    with pysmoe.open_vault(vault) as v:
        assert v.config["model_type"] == "gpt_oss"
        with v.session(threads=2, chunk=7, activations="f32") as s:
            lm = s.prefill_logits(ids, list(range(PROMPT)))  # layer-major, every position
        with v.session(threads=1, prefill="token-serial", activations="f32") as s:
            ts = np.stack([s.decode(i) for i in ids])       # token-serial, every position
    err = _rel(lm, ref)
    print(f"\n{name}: layer-major {err:.2e}, token-serial {_rel(ts, ref):.2e} of max|logit| "
          f"(largest gate {clamp:.1f}x the limit, router margin {margin:.2g})")
    assert err < TOL and _rel(ts, ref) < TOL
    assert np.array_equal(lm.view(np.uint32), ts.view(np.uint32))


def test_sinks_window_yarn_and_biases_matter(case):
    """The comparison above could not pass with any of gpt-oss's pieces left out: transformers'
    logits move by far more than TOL when one is removed."""
    name, model, ids, _ = case
    ref = hf_logits(model, ids)
    cfg = model.config
    variants = {"sinks": lambda m: [l.self_attn.sinks.fill_(-1e4) for l in m.model.layers],
                "biases": lambda m: [l.self_attn.q_proj.bias.zero_() for l in m.model.layers],
                "clamp": lambda m: [setattr(l.mlp.experts, "limit", 1e9) for l in m.model.layers]}
    if any(t == "sliding_attention" for t in cfg.layer_types):
        variants["window"] = lambda m: [setattr(l.self_attn, "sliding_window", None) for l in m.model.layers]
    import copy
    for what, change in variants.items():
        m = copy.deepcopy(model)
        with torch.no_grad():
            change(m)
        if what == "window":
            m.config.layer_types = ["full_attention"] * cfg.num_hidden_layers
        assert _rel(hf_logits(m, ids), ref) > 10 * TOL, f"{name}: leaving out the {what} changes nothing"


def test_q4_experts_from_a_float_checkpoint(tmp_path):
    """A float checkpoint's experts quantised to q4 (MLX's quantiser), biases kept f32: the vault
    matches transformers run on the experts read back from the vault, in both activation modes'
    bit identity."""
    path, model = build_gpt_oss(tmp_path, **CASES["yarn"])
    vault = convert_checkpoint(path, tmp_path / "vault", experts="q4", dense="f32", group=32, progress=False, jobs=1)
    vf = pysmoe.vaultio.read_vault(vault)
    assert [t.format for t in vf.layer_expert_tensors[0]] == ["q4", "q4", "q4", "f32", "f32", "f32"]
    with torch.no_grad():
        for l, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            for e in range(model.config.num_local_experts):
                gate, up, down = (torch.from_numpy(np.asarray(m)) for m in vf.expert(l, e))
                ex.gate_up_proj[e][:, 0::2] = gate.T
                ex.gate_up_proj[e][:, 1::2] = up.T
                ex.down_proj[e] = down.T
    ids = [int(i) for i in np.random.default_rng(3).integers(0, 320, PROMPT)]
    ref = hf_logits(model, ids)
    with pysmoe.open_vault(vault) as v:
        with v.session(chunk=6, activations="f32") as s:
            lm = s.prefill_logits(ids, list(range(PROMPT)))
        for act in ("f32", "q8"):
            with v.session(chunk=6, activations=act) as s, v.session(prefill="token-serial", activations=act) as t:
                a, b = s.prefill(ids), t.prefill(ids)
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), act
    assert _rel(lm, ref) < TOL


def test_tied_checkpoint_with_a_stray_lm_head_converts_with_a_warning(tmp_path, caplog):
    """config.json says the embedding is tied but the files hold an lm_head: it is left out, as
    transformers leaves it, and the converter says so (the rule the Qwen converter follows)."""
    import logging

    path, _ = build_gpt_oss(tmp_path, **CASES["yarn"])
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    with caplog.at_level(logging.WARNING, logger="pysmoe.convert"):
        vault = convert_checkpoint(path, tmp_path / "vault", experts="f32", dense="f32", progress=False, jobs=1)
    assert "lm_head.weight is not used" in caplog.text
    vf = pysmoe.vaultio.read_vault(vault)
    assert "lm_head" not in vf.tensors and "embed_tokens" in vf.tensors


# ------------------------------------------------------------------------------ MXFP4 experts, as released
def write_mxfp4_checkpoint(path, model, seed=0):
    """model's weights with its experts replaced by random MXFP4 blocks and scales, written as the
    released checkpoints store them (`*_blocks` u8 [E, rows, cols/32, 16], `*_scales` u8 [E, rows,
    cols/32], rows = outputs, gate/up interleaved by row); returns {name: (blocks, scales)}."""
    import json

    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    cfg = model.config
    E, H, I = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    tensors, packed = {}, {}
    for name, p in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rows, cols = (2 * I, H) if name.endswith("gate_up_proj") else (H, I)
            blocks = rng.integers(0, 256, (E, rows, cols // 32, 16), dtype=np.uint8)
            scales = rng.integers(124, 128, (E, rows, cols // 32), dtype=np.uint8)  # weights up to 6·2^0
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            packed[name] = (blocks, scales)
        elif name != "lm_head.weight" or not cfg.tie_word_embeddings:
            tensors[name] = p.detach().to(torch.bfloat16).float().numpy()  # a bf16 release, widened
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path / "model.safetensors"))
    raw = json.loads(cfg.to_json_string())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                       "model.layers.*.mlp.router",
                                                                                       "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(raw))
    return packed


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """A released-style MXFP4 checkpoint, its vault, and transformers on the dequantised weights."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tmp = tmp_path_factory.mktemp("mxfp4")
    _, model = build_gpt_oss(tmp, **CASES["yarn"])
    packed = write_mxfp4_checkpoint(tmp / "released", model)
    vault = convert_checkpoint(tmp / "released", tmp / "vault", dense="f32", progress=False, jobs=1)
    with torch.no_grad():
        for name, p in model.named_parameters():  # the bf16 release's dense weights, then its experts
            p.copy_(p.to(torch.bfloat16).float())
        for name, (blocks, scales) in packed.items():
            w = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
            model.get_parameter(name).copy_(w)  # (E, cols, rows): transformers' own layout
    return model, vault


def test_mxfp4_vault_matches_transformers_on_the_dequantised_weights(mxfp4):
    model, vault = mxfp4
    ids = [int(i) for i in np.random.default_rng(2).integers(0, 320, PROMPT)]
    ref = hf_logits(model, ids)
    with pysmoe.open_vault(vault) as v:
        blob = pysmoe.vaultio.read_vault(vault)
        assert [t.format for t in blob.expert_tensors][:3] == ["MXFP4"] * 3
        with v.session(threads=2, chunk=5, activations="f32") as s:
            lm = s.prefill_logits(ids, list(range(PROMPT)))
    err = _rel(lm, ref)
    print(f"\nMXFP4 vault (f32 activations): {err:.2e} of max|logit|")
    assert err < TOL
    source = json.loads((vault / "source.json").read_text())
    assert "MXFP4" in source["quantization"]["experts"]


# ------------------------------------------------------------------------------ bit identity
def _run(vault, ids, prefill, **kw):
    with pysmoe.open_vault(vault) as v, v.session(prefill=prefill, context=256, **kw) as s:
        logits = s.prefill(ids)
        nxt = [int(np.argmax(logits))]
        for _ in range(3):
            nxt.append(int(np.argmax(s.decode(nxt[-1]))))
        return logits, nxt, [s.kv(layer) for layer in range(v.config["num_hidden_layers"])]


@pytest.fixture(scope="module")
def f32_vault(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("f32")
    path, _ = build_gpt_oss(tmp, **CASES["yarn"])
    return convert_checkpoint(path, tmp / "vault", experts="f32", dense="f32", progress=False, jobs=1)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_layer_major_is_token_serial_bit_for_bit(f32_vault, mxfp4, data):
    """For any prompt, chunk, parts, thread count, cache budget, KV type and activation mode, on an f32 and
    an MXFP4 gpt-oss vault: the same logits, continuations and KV cache, bit for bit."""
    vault = data.draw(st.sampled_from([f32_vault, mxfp4[1]]), label="vault")
    n = data.draw(st.integers(1, 40), label="prompt length")
    ids = data.draw(st.lists(st.integers(0, 319), min_size=n, max_size=n), label="ids")
    kw = dict(threads=data.draw(st.integers(1, 3), label="threads"),
              cache_bytes=data.draw(st.sampled_from([0, 1 << 16, 1 << 26]), label="cache"),
              kv_dtype=data.draw(st.sampled_from(pysmoe.KV_DTYPES), label="kv_dtype"),
              activations=data.draw(st.sampled_from(["f32", "q8"]), label="activations"))
    a = _run(vault, ids, "token-serial", **kw)
    b = _run(vault, ids, "layer-major", chunk=data.draw(st.integers(1, 24), label="chunk"),
             part_rows=data.draw(st.integers(0, 8), label="part_rows"), **kw)
    assert np.array_equal(a[0].view(np.uint32), b[0].view(np.uint32)) and a[1] == b[1]
    for (ka, va), (kb, vb) in zip(a[2], b[2]):
        assert np.array_equal(ka.view(np.uint32), kb.view(np.uint32))
        assert np.array_equal(va.view(np.uint32), vb.view(np.uint32))


# ------------------------------------------------------------------------------ synth presets
def test_synth_presets(tmp_path):
    """gpt-oss-20b and -120b at their real shapes (the layout only: 10 and 60 GB of MXFP4 experts),
    and the tiny one written and run (layer-major = token-serial)."""
    from pysmoe.synthesis import preset_config, synth
    from pysmoe.vaultio import compute_layout

    for preset, layers, experts in (("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)):
        lay = compute_layout(preset_config(preset), {"experts": "MXFP4"})
        names = [t.name for t in lay.expert]
        assert names == ["gate", "up", "down", "gate_bias", "up_bias", "down_bias"]
        matrices = 3 * 2880 * 2880 * 17 // 32
        assert lay.expert[2].offset + lay.expert[2].nbytes >= matrices
        assert lay.blob_bytes % 16384 == 0 and 0 <= lay.blob_bytes - (matrices + 3 * 2880 * 4) < 2 * 16384
        assert lay.n_blobs == layers * experts and lay.params["sliding_window"] == 128
        assert lay.params["yarn_factor"] == 32.0 and lay.params["router_kind"] == 2
    d = synth(tmp_path / "v", preset="gpt-oss-tiny", experts="MXFP4", progress=False)
    from pysmoe.vaultio import info
    recipe = next(line for line in info(d).splitlines() if line.startswith("recipe"))
    assert "gpt_oss" in recipe and "sliding window 8 on 2 of 4 layers" in recipe and "YaRN x4" in recipe
    ids = [int(i) for i in np.random.default_rng(0).integers(0, 512, 30)]
    with pysmoe.open_vault(d) as v:
        assert v.config["model_type"] == "gpt_oss"
        with v.session(chunk=8) as s, v.session(prefill="token-serial") as t:
            a, b = s.prefill(ids), t.prefill(ids)
    assert np.isfinite(a).all() and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_decode_batch_is_each_session_alone(f32_vault):
    """Sessions at different positions (some past the window, some not) decoded in one batch: each
    gets the bits it gets alone (its own KV cache, window and sinks)."""
    from pysmoe.engine import decode_batch

    rng = np.random.default_rng(5)
    prompts = [[int(i) for i in rng.integers(0, 320, n)] for n in (2, 9, 17)]
    toks = [11, 22, 33]
    with pysmoe.open_vault(f32_vault) as v:
        alone = []
        for p, t in zip(prompts, toks):
            with v.session(chunk=4) as s:
                s.prefill(p)
                alone.append(s.decode(t))
        lead = v.session(chunk=4)
        batch = [lead] + [v.session(chunk=4, share_cache=lead) for _ in prompts[1:]]
        for s, p in zip(batch, prompts):
            s.prefill(p)
        got = decode_batch(batch, toks)
        for s in batch:
            s.close()
    for a, b in zip(alone, got):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


# ------------------------------------------------------------------------------ mlx-lm's conversions
# mlx-lm 0.32's gpt-oss always truncates YaRN's correction range (it has no `truncate` key), where
# transformers truncates only when asked (the released gpt-oss asks not to): the oracle's model
# here truncates, so that mlx-lm's forward and transformers' are the same model.
MLX_CASE = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
                rope_parameters={**YARN, "truncate": True}, max_position_embeddings=256)
MLX_WAYS = {
    # the release as mlx-lm imports it: experts in MLX's mxfp4 mode, the rest bf16
    "mxfp4": [dict()],
    # as mlx-community's MXFP4-Q8 conversions: experts mxfp4, every other matrix affine 8-bit
    "mxfp4_q8": [dict(quantize=True, q_bits=8, q_group_size=64)],
    # mlx-lm's affine 4-bit conversion: the release dequantised by mlx-lm, then quantised (its
    # float gpt-oss reader takes only the released layout: transformers' fused float experts
    # are not one it loads)
    "affine_q4": [dict(dequantize=True), dict(quantize=True, q_bits=4, q_group_size=64)],
}


@pytest.mark.parametrize("way", sorted(MLX_WAYS))
def test_mlx_lm_conversion_imports_as_stored_and_runs_as_mlx_lm(way, tmp_path):
    """mlx-lm's own conversion of a released-style MXFP4 gpt-oss imports without requantising
    (every expert weight dequantises to exactly what mlx's own dequantize gives), and the engine
    (f32 activations) gives mlx-lm's f32 logits at every position."""
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed")
    mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm is not installed")
    from mlx_lm.utils import load_model

    from hf_models import write_tokenizer
    from pysmoe.vaultio import read_vault

    _, model = build_gpt_oss(tmp_path, **MLX_CASE)
    src = tmp_path / "released"
    write_mxfp4_checkpoint(src, model)
    write_tokenizer(src, 320)
    cj = src / "config.json"  # mlx-lm reads RoPE from rope_theta and rope_scaling
    c = json.loads(cj.read_text())
    c.update(rope_theta=c["rope_parameters"]["rope_theta"], rope_scaling=dict(c["rope_parameters"]))
    cj.write_text(json.dumps(c))
    for i, kw in enumerate(MLX_WAYS[way]):
        mlx_lm.convert(str(src), str(tmp_path / f"mlx{i}"), dtype="bfloat16", **kw)
        src = tmp_path / f"mlx{i}"
    vault = convert_checkpoint(src, tmp_path / "v", progress=False)
    v = read_vault(vault)
    want_fmt = "q4" if way == "affine_q4" else "MXFP4"
    assert v.family == "gpt_oss" and [t.format for t in v.expert_tensors][:3] == [want_fmt] * 3
    if way == "mxfp4_q8":
        assert v.tensors["layers.0.q_proj"].format == "q8" and v.tensors["lm_head"].format == "q8"
    stored = mx.load(str(src / "model.safetensors"))
    for layer, e in ((0, 0), (1, 5)):
        for part, got in zip(("gate", "up", "down"), v.expert(layer, e)):
            p = f"model.layers.{layer}.mlp.experts.{part}_proj."
            if want_fmt == "MXFP4":
                w = mx.dequantize(stored[p + "weight"][e], stored[p + "scales"][e], group_size=32, bits=4,
                                  mode="mxfp4")
            else:
                w = mx.dequantize(stored[p + "weight"][e], stored[p + "scales"][e].astype(mx.float32),
                                  stored[p + "biases"][e].astype(mx.float32), group_size=64, bits=4)
            assert np.array_equal(got, np.array(w.astype(mx.float32))), (way, layer, e, part)
    if way == "affine_q4":  # the float step between: mlx-lm's dequantised experts, imported as floats
        f = read_vault(convert_checkpoint(tmp_path / "mlx0", tmp_path / "vf", progress=False))
        floats = mx.load(str(tmp_path / "mlx0" / "model.safetensors"))
        assert [t.format for t in f.expert_tensors][:3] == ["bf16"] * 3
        got = f.expert(1, 2)[2]
        assert np.array_equal(got, np.array(floats["model.layers.1.mlp.experts.down_proj.weight"][2].astype(mx.float32)))
    ids = [int(i) for i in np.random.default_rng(3).integers(0, 320, size=12)]
    m, _ = load_model(src)
    m.set_dtype(mx.float32)
    want = np.array(m(mx.array([ids]))[0].astype(mx.float32))
    with pysmoe.open_vault(vault) as pv, pv.session(activations="f32") as s:
        got = np.stack([s.prefill(ids[:1])] + [s.decode(i) for i in ids[1:]])
    err = _rel(got, want)
    print(f"gpt-oss {way}: max|engine - mlx-lm| / max|logit| = {err:.2e}")
    assert err <= TOL
