"""GGUF import (pysmoe/convert/gguf.py) on files written by llama.cpp's own tools.

The fixtures in tests/data/gguf/ were made by scripts/make_gguf_fixtures.py: tiny random
Qwen3-MoE checkpoints (transformers) → llama.cpp's convert_hf_to_gguf.py → F32 → llama.cpp's
quantiser. The oracle for the logits is transformers run on the GGUF's weights dequantised by
gguf-py (`gguf.quants.dequantize`); the oracle for the tokenizer is llama.cpp's tokenizer, through
ids it produced (tokens.json, made by the same script) and, where llama-cpp-python is installed,
live.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from pysmoe import quant  # noqa: E402
from pysmoe.convert import ConvertError, convert_checkpoint  # noqa: E402
from pysmoe.convert.gguf import GGUFModel, plan, supported_types  # noqa: E402
from pysmoe.vaultio import read_vault  # noqa: E402

DATA = Path(__file__).parent / "data" / "gguf"
FIXTURES = sorted(p.stem for p in DATA.glob("*.gguf"))


def _runnable(path: Path) -> str | None:
    """Why this build cannot run the file (None if it can): a tensor type without a kernel."""
    types = supported_types()
    tensors = gguf.GGUFReader(path).tensors
    missing = sorted({t.tensor_type.name for t in tensors if int(t.tensor_type) not in types})
    return f"no kernel for {', '.join(missing)} in this build" if missing else None


@pytest.fixture(scope="module")
def vaults(tmp_path_factory):
    out = {}
    for name in FIXTURES:
        why = _runnable(DATA / f"{name}.gguf")
        out[name] = why or convert_checkpoint(DATA / f"{name}.gguf", tmp_path_factory.mktemp(name) / "v",
                                              progress=False)
    return out


def _vault(vaults, name):
    if isinstance(vaults[name], str):
        pytest.skip(f"{name}: {vaults[name]}")
    return vaults[name]


# ------------------------------------------------------------------------------ what is read

def test_the_fixtures_are_there():
    """Every fixture scripts/make_gguf_fixtures.py makes is checked in (and nothing else)."""
    assert FIXTURES == sorted(_scripts().FIXTURES)


@pytest.mark.parametrize("name", FIXTURES)
def test_config_is_the_checkpoints(name, vaults):
    """The configuration read from the metadata is the transformers config the fixture was made
    from (scripts/make_gguf_fixtures.py's shapes), in config.json's names."""
    import sys
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    from make_gguf_fixtures import FIXTURES as MADE
    from hf_models import BASE_CONFIG

    shape = dict(MADE[name][0])
    family = shape.pop("model", "qwen3_moe")
    want = {**BASE_CONFIG, **shape}
    if family == "olmoe":  # its expert width is intermediate_size; it never renormalises
        want.update(moe_intermediate_size=shape["intermediate_size"], norm_topk_prob=False,
                    head_dim=shape["hidden_size"] // shape["num_attention_heads"])
    if family == "glm4_moe":  # n_routed_experts; the MTP layer is counted apart
        want = {k: v for k, v in want.items() if k not in ("num_experts", "n_routed_experts", "mlp_only_layers", "mtp")}
        want.update(num_experts=shape["n_routed_experts"], num_nextn_predict_layers=shape.get("mtp", 1),
                    partial_rotary_factor=shape.get("partial_rotary_factor", 0.5),
                    mlp_only_layers=list(range(shape["first_k_dense_replace"])))
    if family == "mixtral":  # num_local_experts, each intermediate_size wide; always renormalised
        want = {k: v for k, v in want.items() if k not in ("num_experts", "num_local_experts")}
        want.update(num_experts=shape["num_local_experts"], moe_intermediate_size=shape["intermediate_size"],
                    norm_topk_prob=True)
    if family == "gpt_oss":  # each expert intermediate_size wide; window on alternate layers; YaRN
        want = {k: v for k, v in want.items() if k not in ("num_experts", "num_local_experts", "norm_topk_prob")}
        want.update(num_experts=shape["num_local_experts"], moe_intermediate_size=shape["intermediate_size"],
                    layer_types=["sliding_attention", "full_attention"] * (shape["num_hidden_layers"] // 2),
                    tie_word_embeddings=False)
    if family == "qwen3_next":  # three Gated DeltaNet layers, then gated full attention; a quarter rotated
        want.update(layer_types=["linear_attention"] * 3 + ["full_attention"], rotary_dim=shape["head_dim"] // 4)
    if family == "qwen3_5_moe":  # every layer sparse, the last of each interval full; llama.cpp's v-head order
        every = shape.get("full_attention_interval", 4)
        want = {k: v for k, v in want.items() if k not in ("full_attention_interval", "intermediate_size")}
        want.update(layer_types=["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                 for i in range(shape["num_hidden_layers"])],
                    rotary_dim=shape["head_dim"] // 4, norm_topk_prob=True, linear_value_head_order="tiled")
    p = plan(GGUFModel(DATA / f"{name}.gguf"), check_types=False)
    for k, v in want.items():
        assert p.config[k] == v, k
    assert p.config["rope_theta"] == {"mixtral": 1e6, "gpt_oss": 1.5e5}.get(family, 10000.0)
    assert p.config["model_type"] == family


@pytest.mark.parametrize("name", FIXTURES)
def test_tensors_byte_for_byte(name, vaults):
    """Every dense tensor and every expert's gate/up/down in the vault hold exactly the GGUF's
    bytes for it, in its GGML type."""
    v = read_vault(_vault(vaults, name))
    r = gguf.GGUFReader(DATA / f"{name}.gguf")
    names = {"token_embd.weight": "embed_tokens", "output_norm.weight": "norm", "output.weight": "lm_head"}
    E, L = v.config["num_experts"], v.config["num_hidden_layers"]
    seen = 0
    for t in r.tensors:
        raw = bytes(r.data[t.data_offset:t.data_offset + int(t.n_bytes)])
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= L:
            assert v.config["num_nextn_predict_layers"] > 0  # a multi-token-prediction layer: left out
        elif "_exps." in t.name:
            l, part = int(t.name.split(".")[1]), t.name.split(".")[2][4:-5]
            part += "_bias" if t.name.endswith(".bias") else ""  # gpt-oss: the blob's f32 bias rows
            desc = {x.name: x for x in v.layer_expert_tensors[l]}[part]
            n = len(raw) // E
            for e in range(E):
                blob = v.blob(l, e)
                assert bytes(blob[desc.offset:desc.offset + desc.nbytes]) == raw[e * n:(e + 1) * n], (t.name, e)
        elif t.name.split(".", 2)[-1] in ("attn_q.weight", "ssm_ba.weight", "ssm_a") and \
                r.fields["general.architecture"].contents() in ("qwen3next", "qwen35moe"):
            _check_qwen3next_split(t, raw, v)
        else:
            vname = names.get(t.name) or _layer_name(t.name, r)
            got = bytes(v.raw(vname))
            heads = _permuted_heads(t.name, v.config, r)
            if heads:  # llama.cpp's converter permuted the rows: the vault holds them un-permuted
                rows = np.frombuffer(raw, np.uint8).reshape(int(t.shape[-1]), -1)
                perm = _llama_cpp_permutation(rows.shape[0], heads)
                mine = np.frombuffer(got, np.uint8).reshape(rows.shape)
                assert all(bytes(mine[perm[g]]) == bytes(rows[g]) for g in range(len(perm))), t.name
            else:
                assert got == raw, t.name
        seen += 1
    assert seen == len(r.tensors)


def _llama_cpp_permutation(n_rows: int, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute applied to row numbers: the original row each
    row of llama.cpp's tensor holds (written from its definition, not from the importer's)."""
    hd = n_rows // n_head
    return np.arange(n_rows).reshape(n_head, 2, hd // 2).swapaxes(1, 2).reshape(-1)


def _permuted_heads(gname: str, cfg: dict, r) -> int:
    """The head count llama.cpp's converter permuted gname's rows with (0: not permuted)."""
    if r.fields["general.architecture"].contents() != "llama":
        return 0
    return {"attn_q.weight": cfg["num_attention_heads"], "attn_k.weight": cfg["num_key_value_heads"]}.get(
        gname.split(".", 2)[-1], 0)


def _check_qwen3next_split(t, raw: bytes, v) -> None:
    """Qwen3-Next's (and Qwen3.5-MoE's) tensors the import cuts or transforms: attn_q (per head the query's rows then
    the gate's) into q_proj and q_gate_proj, ssm_ba (per key head r rows of b then r of a) into
    linear.b and linear.a — whole rows, byte for byte — and ssm_a = −exp(A_log) back to A_log."""
    c, l, rest = v.config, t.name.split(".")[1], t.name.split(".", 2)[-1]
    p = f"layers.{l}."
    if rest == "ssm_a":
        a = np.frombuffer(raw, np.float32)
        a_log = np.frombuffer(bytes(v.raw(p + "linear.A_log")), np.float32)
        assert np.allclose(-np.exp(a_log.astype(np.float64)), a, rtol=3e-7, atol=0), t.name
        return
    rows = np.frombuffer(raw, np.uint8).reshape(int(t.shape[-1]), -1)
    if rest == "attn_q.weight":
        n, per = c["num_attention_heads"], c["head_dim"]
        parts = ("q_proj", "q_gate_proj")
    else:
        n, per = c["linear_num_key_heads"], c["linear_num_value_heads"] // c["linear_num_key_heads"]
        parts = ("linear.b", "linear.a")
    grouped = rows.reshape(n, 2, per, -1)
    for i, part in enumerate(parts):
        assert bytes(v.raw(p + part)) == grouped[:, i].tobytes(), (t.name, part)


def _layer_name(gname: str, r) -> str:
    from pysmoe.convert.gguf import FAMILIES
    _, l, rest = gname.split(".", 2)
    return f"layers.{l}.{FAMILIES[r.fields['general.architecture'].contents()].layer_tensors[rest]}"


def test_tokenizer_files_and_template(vaults):
    """tokenizer_config.json carries the file's chat template and its special tokens;
    generation_config.json its eos id."""
    m = GGUFModel(DATA / "tiny-f32.gguf")
    d = _vault(vaults, "tiny-f32")
    tc = json.loads((d / "tokenizer_config.json").read_text())
    assert tc["chat_template"] == m.meta["tokenizer.chat_template"]
    toks = m.meta["tokenizer.ggml.tokens"]
    assert tc["eos_token"] == toks[m.meta["tokenizer.ggml.eos_token_id"]]
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == m.meta["tokenizer.ggml.eos_token_id"]
    from pysmoe.tokenizer import load_tokenizer
    tok = load_tokenizer(d)
    assert tok.eos_id == m.meta["tokenizer.ggml.eos_token_id"]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# ------------------------------------------------------------------------------ the oracle

def _qwen3next_to_hf(w: dict, cfg: dict) -> tuple[dict, dict]:
    """llama.cpp's qwen3next tensors (dequantised) -> transformers' Qwen3-Next names, undoing what
    convert_hf_to_gguf.py did: norms stored as 1 + w, ssm_a = −exp(A_log), in_proj_qkvz split into
    attn_qkv (q, k, v of all heads) and attn_gate (z), conv1d squeezed. Returns (the tensors left
    for the shared mapping, the state made here)."""
    rest, state = {}, {}
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    r = nv // nk
    for name, a in w.items():
        if name == "output_norm.weight":
            state["model.norm.weight"] = a - 1
            continue
        if not name.startswith("blk."):
            rest[name] = a
            continue
        _, l, part = name.split(".", 2)
        p = f"model.layers.{l}."
        ln = {"attn_norm.weight": "input_layernorm.weight",
              "post_attention_norm.weight": "post_attention_layernorm.weight",
              "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
        lin = {"ssm_ba.weight": "in_proj_ba.weight", "ssm_dt.bias": "dt_bias", "ssm_norm.weight": "norm.weight",
               "ssm_out.weight": "out_proj.weight"}
        sh = {f"ffn_{x}_shexp.weight": f"mlp.shared_expert.{x}_proj.weight" for x in ("gate", "up", "down")}
        if part in ln:
            state[p + ln[part]] = a - 1
        elif part in lin:
            state[p + "linear_attn." + lin[part]] = a
        elif part in sh:
            state[p + sh[part]] = a
        elif part == "ffn_gate_inp_shexp.weight":
            state[p + "mlp.shared_expert_gate.weight"] = a.reshape(1, -1)
        elif part == "ssm_a":
            state[p + "linear_attn.A_log"] = np.log(-a)
        elif part == "ssm_conv1d.weight":
            state[p + "linear_attn.conv1d.weight"] = a[:, None, :]
        elif part == "attn_gate.weight":
            continue
        elif part == "attn_qkv.weight":
            q, k, v = a[:nk * dk], a[nk * dk:2 * nk * dk], a[2 * nk * dk:]
            z = w[f"blk.{l}.attn_gate.weight"]
            groups = [np.concatenate([q[g * dk:(g + 1) * dk], k[g * dk:(g + 1) * dk], v[g * r * dv:(g + 1) * r * dv],
                                      z[g * r * dv:(g + 1) * r * dv]]) for g in range(nk)]
            state[p + "linear_attn.in_proj_qkvz.weight"] = np.concatenate(groups)
        else:
            rest[name] = a
    return rest, state


def _grouped_from_tiled(nk: int, nv: int) -> np.ndarray:
    """For each value head in grouped order (head j reads key head j / r, r = nv/nk), the head of
    llama.cpp's tiled order holding it (tiled head i·nk + g reads key head g): written from the
    definitions, not from the importer's (which keeps the tiled order)."""
    r = nv // nk
    return np.array([(j % r) * nk + j // r for j in range(nv)])


def _qwen35moe_to_hf(w: dict, cfg: dict) -> tuple[dict, dict]:
    """llama.cpp's qwen35moe tensors (dequantised, f32) -> transformers' Qwen3.5-MoE text model,
    undoing what convert_hf_to_gguf.py did: norms as 1 + w, ssm_a = −exp(A_log), conv1d squeezed,
    and the value heads put back from tiled into grouped order (v rows of the qkv projection and of
    the convolution, z, b, a rows, A_log and dt_bias, ssm_out's columns)."""
    rest, state = {}, {}
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    order = _grouped_from_tiled(nk, nv)
    heads = lambda a, width, axis=0: np.take(  # noqa: E731
        a.reshape(a.shape[:axis] + (nv, width) + a.shape[axis + 1:]), order, axis=axis).reshape(a.shape)
    for name, a in w.items():
        if name == "output_norm.weight":
            state["model.norm.weight"] = a - 1
            continue
        if not name.startswith("blk."):
            rest[name] = a
            continue
        _, l, part = name.split(".", 2)
        p, lp = f"model.layers.{l}.", f"model.layers.{l}.linear_attn."
        ln = {"attn_norm.weight": "input_layernorm.weight",
              "post_attention_norm.weight": "post_attention_layernorm.weight",
              "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
        sh = {f"ffn_{x}_shexp.weight": f"mlp.shared_expert.{x}_proj.weight" for x in ("gate", "up", "down")}
        if part in ln:
            state[p + ln[part]] = a - 1
        elif part in sh:
            state[p + sh[part]] = a
        elif part == "ffn_gate_inp_shexp.weight":
            state[p + "mlp.shared_expert_gate.weight"] = a.reshape(1, -1)
        elif part == "ssm_a":
            state[lp + "A_log"] = heads(np.log(-a), 1)
        elif part == "ssm_dt.bias":
            state[lp + "dt_bias"] = heads(a, 1)
        elif part == "ssm_norm.weight":
            state[lp + "norm.weight"] = a
        elif part in ("ssm_beta.weight", "ssm_alpha.weight"):
            state[lp + {"ssm_beta.weight": "in_proj_b.weight", "ssm_alpha.weight": "in_proj_a.weight"}[part]] = \
                heads(a, 1)
        elif part == "attn_gate.weight":
            state[lp + "in_proj_z.weight"] = heads(a, dv)
        elif part in ("attn_qkv.weight", "ssm_conv1d.weight"):
            qk = 2 * nk * dk
            b = np.concatenate([a[:qk], heads(a[qk:], dv)])
            state[lp + ("in_proj_qkv.weight" if part == "attn_qkv.weight" else "conv1d.weight")] = \
                b if part == "attn_qkv.weight" else b[:, None, :]
        elif part == "ssm_out.weight":
            state[lp + "out_proj.weight"] = heads(a, dv, axis=1)
        else:
            rest[name] = a
    return rest, state


def _dequantised_hf_model(path: Path, cfg: dict):
    """transformers' model of the family (Qwen3-MoE, OLMoE, GLM-4.5) holding the GGUF's weights as gguf-py
    dequantises them (the multi-token-prediction layers left out, as transformers leaves them)."""
    import torch
    from hf_models import make_config

    keys = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
            "max_position_embeddings", "rms_norm_eps", "norm_topk_prob", "tie_word_embeddings", "rope_theta")
    if cfg["model_type"] == "olmoe":
        from transformers import OlmoeConfig, OlmoeForCausalLM
        kw = {k: cfg[k] for k in keys if k not in ("moe_intermediate_size", "head_dim", "rope_theta")}
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
        config = OlmoeConfig(**kw)
        config._attn_implementation = "eager"
        config._experts_implementation = "eager"
        model = OlmoeForCausalLM(config).float().eval()
    elif cfg["model_type"] == "glm4_moe":
        from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
        kw = {k: cfg[k] for k in keys if k not in ("num_experts", "rope_theta")}
        kw.update({k: cfg[k] for k in ("n_shared_experts", "first_k_dense_replace", "n_group", "topk_group",
                                       "routed_scaling_factor", "use_qk_norm", "attention_bias")})
        kw["n_routed_experts"] = cfg["num_experts"]
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_theta"],
                                 "partial_rotary_factor": cfg["partial_rotary_factor"]}
        config = Glm4MoeConfig(**kw)
        config._attn_implementation = "eager"
        config._experts_implementation = "eager"
        model = Glm4MoeForCausalLM(config).float().eval()
    elif cfg["model_type"] == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM
        kw = {k: cfg[k] for k in keys if k not in ("moe_intermediate_size", "num_experts", "norm_topk_prob",
                                                   "rope_theta")}
        kw.update(num_local_experts=cfg["num_experts"], intermediate_size=cfg["moe_intermediate_size"],
                  rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"]})
        config = MixtralConfig(**kw)
        config._attn_implementation = "eager"
        config._experts_implementation = "eager"
        model = MixtralForCausalLM(config).float().eval()
    elif cfg["model_type"] == "gpt_oss":
        from transformers import GptOssConfig, GptOssForCausalLM
        kw = {k: cfg[k] for k in keys if k not in ("moe_intermediate_size", "num_experts", "norm_topk_prob",
                                                   "rope_theta")}
        kw.update(num_local_experts=cfg["num_experts"], sliding_window=cfg["sliding_window"],
                  layer_types=cfg["layer_types"], rope_parameters=cfg["rope_parameters"])
        config = GptOssConfig(**kw)
        config._attn_implementation = "eager"
        config._experts_implementation = "eager"
        model = GptOssForCausalLM(config).float().eval()
    elif cfg["model_type"] == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
        kw = {k: cfg[k] for k in keys if k != "rope_theta"}
        kw.update({k: cfg[k] for k in cfg if k.startswith("linear_")},
                  layer_types=cfg["layer_types"],
                  shared_expert_intermediate_size=cfg["shared_expert_intermediate_size"],
                  rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"],
                                   "partial_rotary_factor": cfg["rotary_dim"] / cfg["head_dim"]})
        config = Qwen3NextConfig(**kw)
        config._attn_implementation = "eager"
        config._experts_implementation = "eager"
        model = Qwen3NextForCausalLM(config).float().eval()
    elif cfg["model_type"] == "qwen3_5_moe":
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
        kw = {k: cfg[k] for k in keys if k not in ("rope_theta", "intermediate_size", "norm_topk_prob")}
        kw.update({k: cfg[k] for k in cfg if k.startswith("linear_") and k != "linear_value_head_order"},
                  layer_types=cfg["layer_types"],
                  shared_expert_intermediate_size=cfg["shared_expert_intermediate_size"],
                  rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"],
                                   "partial_rotary_factor": cfg["rotary_dim"] / cfg["head_dim"]})
        config = Qwen3_5MoeTextConfig(**kw)
        config._attn_implementation = "eager"
        config._experts_implementation = "eager"
        model = Qwen3_5MoeForCausalLM(config).float().eval()
    else:
        from transformers import Qwen3MoeForCausalLM
        model = Qwen3MoeForCausalLM(make_config(**{k: cfg[k] for k in keys})).float().eval()
    L, gpt_oss = cfg["num_hidden_layers"], cfg["model_type"] == "gpt_oss"
    r = gguf.GGUFReader(path)
    w = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32) for t in r.tensors
         if not (t.name.startswith("blk.") and int(t.name.split(".")[1]) >= L)}  # no MTP layers
    hf = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}
    per_layer = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
                 "post_attention_norm.weight": "post_attention_layernorm.weight",
                 "ffn_gate_inp.weight": "mlp.gate.weight", "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
                 "attn_sinks.weight": "self_attn.sinks",
                 "ffn_down_exps.weight": "mlp.experts.down_proj",
                 **{f"ffn_{p}.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
                 **{f"ffn_{p}_shexp.weight": f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")}}
    for g, h in {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
                 "attn_q_norm": "q_norm", "attn_k_norm": "k_norm"}.items():
        per_layer[g + ".weight"] = f"self_attn.{h}.weight"
        per_layer[g + ".bias"] = f"self_attn.{h}.bias"
    state = {}
    if cfg["model_type"] == "qwen3_next":
        w, state = _qwen3next_to_hf(w, cfg)
    if cfg["model_type"] == "qwen3_5_moe":
        w, state = _qwen35moe_to_hf(w, cfg)
    for name, a in w.items():
        if name in hf:
            state[hf[name]] = a
            continue
        _, l, rest = name.split(".", 2)
        if rest.startswith(("ffn_gate_exps.", "ffn_up_exps.")) or (gpt_oss and rest.startswith("ffn_down_exps.")):
            continue
        if gpt_oss and rest.startswith("ffn_gate_inp."):
            rest = rest.replace("ffn_gate_inp", "router")
            state[f"model.layers.{l}.mlp.{rest}"] = a
            continue
        heads = _permuted_heads(name, cfg, r)
        if heads:  # llama.cpp's row order -> the checkpoint's
            b = np.empty_like(a)
            b[_llama_cpp_permutation(a.shape[0], heads)] = a
            a = b
        state[f"model.layers.{l}.{per_layer[rest]}"] = a
    for l in range(L):
        if f"blk.{l}.ffn_gate_exps.weight" not in w:
            continue
        g, u = w[f"blk.{l}.ffn_gate_exps.weight"], w[f"blk.{l}.ffn_up_exps.weight"]
        p = f"model.layers.{l}.mlp.experts."
        if gpt_oss:  # x @ W with gate and up interleaved by column; down_proj [E, I, H]; biases
            gu = np.empty((g.shape[0], g.shape[2], 2 * g.shape[1]), np.float32)
            gu[..., 0::2], gu[..., 1::2] = g.transpose(0, 2, 1), u.transpose(0, 2, 1)
            gb, ub = w[f"blk.{l}.ffn_gate_exps.bias"], w[f"blk.{l}.ffn_up_exps.bias"]
            gub = np.empty((gb.shape[0], 2 * gb.shape[1]), np.float32)
            gub[:, 0::2], gub[:, 1::2] = gb, ub
            state.update({p + "gate_up_proj": gu, p + "gate_up_proj_bias": gub,
                          p + "down_proj": w[f"blk.{l}.ffn_down_exps.weight"].transpose(0, 2, 1).copy(),
                          p + "down_proj_bias": w[f"blk.{l}.ffn_down_exps.bias"]})
        else:
            state[p + "gate_up_proj"] = np.concatenate([g, u], axis=1)
    params = dict(model.named_parameters())
    params.update((k, b) for k, b in model.named_buffers() if k.endswith("e_score_correction_bias"))
    with torch.no_grad():
        for k, a in state.items():
            assert params[k].shape == a.shape, (k, params[k].shape, a.shape)
            params[k].copy_(torch.from_numpy(a))
    assert set(state) == set(params), set(params) ^ set(state)
    return model


@pytest.mark.parametrize("name", FIXTURES)
def test_logits_against_transformers_on_the_dequantised_weights(name, vaults):
    """With f32 activations, the imported vault's logits at every position equal transformers'
    on the GGUF's dequantised weights within 1e-4 of max|logit|."""
    import pysmoe
    from hf_models import hf_logits

    d = _vault(vaults, name)
    cfg = json.loads((d / "config.json").read_text())
    model = _dequantised_hf_model(DATA / f"{name}.gguf", cfg)
    ids = [int(i) for i in np.random.default_rng(3).integers(0, cfg["vocab_size"], 20)]
    want = hf_logits(model, ids)
    with pysmoe.open_vault(d) as v, v.session(threads=1, activations="f32", prefill="token-serial") as s:
        got = np.stack([s.decode(i) for i in ids])
    err = float(np.max(np.abs(got - want)))
    assert err <= 1e-4 * float(np.max(np.abs(want))), err


LLAMA_LOGITS_TOL = 1e-5  # of max|logit|, per position; measured ≤ 4.2e-7 (bench/RESULTS.md)


@pytest.mark.parametrize("name", FIXTURES)
def test_logits_against_llama_cpps_own_on_the_same_file(name, vaults):
    """With the default 8-bit activations, the imported vault's logits at every position equal
    llama.cpp's own on the very same file (tests/data/gguf/logits.npz, recorded from llama.cpp by
    scripts/make_gguf_fixtures.py: f32 KV cache, one thread) within LLAMA_LOGITS_TOL of max|logit|:
    the GGML types' products quantise their activations as ggml's do for each weight type (Q8_0,
    Q8_1, Q8_K: csrc/cpu/kernels_ref.c, ref_ggml_prepare), so only the order of float sums differs.
    Before that, pysmoe's own per-32 rounding differed from llama.cpp's by 2e-2 to 7e-1 of
    max|logit| on these random-router models. gpt-oss is compared at its first position only: its
    YaRN follows the family's definition (`truncate: false`), which ggml's rope does not (docs/gguf.md),
    and position 0 is where the rotation is the identity. olmoe-q8_0 has no record: llama.cpp wants
    its k_norm as wide as q_norm and refuses the file."""
    import pysmoe

    path = DATA / "logits.npz"
    if not path.exists():
        pytest.skip("tests/data/gguf/logits.npz not made yet (scripts/make_gguf_fixtures.py --tokens-only)")
    g = np.load(path)
    if f"{name}.ids" not in g:
        pytest.skip(f"no llama.cpp logits recorded for {name}")
    d = _vault(vaults, name)
    ids, picks = g[f"{name}.ids"], g[f"{name}.picks"]
    with pysmoe.open_vault(d) as v, v.session(threads=1, prefill="token-serial") as s:
        got = np.stack([s.decode(int(i)) for i in ids])
    err = np.max(np.abs(np.take_along_axis(got, picks, axis=1) - g[f"{name}.logits"]), axis=1) / g[f"{name}.scale"]
    if name.startswith("gpt-oss"):
        err = err[:1]
    assert float(err.max()) <= LLAMA_LOGITS_TOL, (float(err.max()), int(err.argmax()))


# ------------------------------------------------------------------------------ refusals, splits

def _rewrite(src: Path, out: Path, *, retype: dict | None = None, split_max_tensors: int = 0, drop=(),
             meta: dict | None = None):
    """Copy a GGUF with gguf-py's writer, optionally storing some tensors in another type
    (zero blocks: only the planning reads them), splitting it into several files, or changing
    metadata (meta: key -> (value, GGUFValueType[, sub_type]), or None to leave the key out)."""
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(out, arch=arch, split_max_tensors=split_max_tensors)  # writes the arch itself
    meta = meta or {}
    for k, v in meta.items():
        if v is not None and k not in r.fields:
            w.add_key_value(k, *v)
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        if k in meta:
            if meta[k] is not None:
                w.add_key_value(k, *meta[k])
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(k, f.contents(), vt, sub_type=f.types[-1])
        else:
            w.add_key_value(k, f.contents(), vt)
    for t in r.tensors:
        if t.name in drop:
            continue
        data = np.asarray(t.data)
        if retype and t.name in retype:
            q = retype[t.name]
            bs, ts = gguf.GGML_QUANT_SIZES[q]
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            data = np.zeros(shape[:-1] + (shape[-1] // bs * ts,), dtype=np.uint8)
            w.add_tensor(t.name, data, raw_dtype=q)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _unsupported_type():
    """A GGML block type of 32 weights this build has no kernel for (Q8_1: ggml's activation type)."""
    types = supported_types()
    for q in gguf.GGMLQuantizationType:
        if int(q) not in types and gguf.GGML_QUANT_SIZES.get(q, (0,))[0] == 32:
            return q
    pytest.skip("this build runs every GGML type of 32-weight blocks")


def test_an_unsupported_type_is_refused_before_anything_is_written(tmp_path):
    bad = tmp_path / "bad.gguf"
    q = _unsupported_type()
    _rewrite(DATA / "tiny-f32.gguf", bad, retype={"blk.1.ffn_up_exps.weight": q, "blk.0.attn_q.weight": q})
    out = tmp_path / "v"
    with pytest.raises(ConvertError, match="tensor types this build cannot run") as e:
        convert_checkpoint(bad, out, progress=False)
    assert f"blk.1.ffn_up_exps.weight ({q.name})" in str(e.value)
    assert f"blk.0.attn_q.weight ({q.name})" in str(e.value)
    assert not out.exists() and list(tmp_path.iterdir()) == [bad]


def test_a_missing_or_unknown_tensor_is_named(tmp_path):
    bad = tmp_path / "bad.gguf"
    _rewrite(DATA / "tiny-f32.gguf", bad, drop=("blk.1.attn_k_norm.weight",))
    with pytest.raises(ConvertError, match=r"layers\.1\.k_norm missing"):
        convert_checkpoint(bad, tmp_path / "v", progress=False)
    assert not (tmp_path / "v").exists()


_U32, _F32, _STR = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.STRING


@pytest.mark.parametrize("fixture, meta, message", [
    ("mixtral-q4_k_m", {"llama.expert_count": None, "llama.expert_used_count": None}, "dense Llama"),
    ("mixtral-q4_k_m", {"llama.rope.dimension_count": (32, _U32)}, "RoPE over the whole head"),
    ("glm4moe-q8_0", {"glm4moe.expert_gating_func": (1, _U32)}, "router is sigmoid"),
    ("gpt-oss-mxfp4", {"gpt-oss.rope.scaling.yarn_ext_factor": (0.5, _F32)}, "yarn_ext_factor"),
    ("gpt-oss-mxfp4", {"gpt-oss.rope.freq_base_swa": (10000.0, _F32)}, "one RoPE base"),
    ("tiny-q8_0", {"qwen3moe.rope.scaling.type": ("yarn", _STR)}, "only plain RoPE"),
    ("qwen3next-q8_0", {"qwen3next.ssm.state_size": None}, "lacks qwen3next.ssm.state_size"),
    ("qwen35moe-q8_0", {"qwen35moe.ssm.group_count": None}, "lacks qwen35moe.ssm.group_count"),
])
def test_a_family_the_engine_would_run_wrong_is_refused(fixture, meta, message, tmp_path):
    """Metadata that asks for something the family's recipe does not compute is refused, before
    anything is written, with a message naming it."""
    bad = tmp_path / "bad.gguf"
    _rewrite(DATA / f"{fixture}.gguf", bad, meta=meta)
    with pytest.raises(ConvertError, match=message):
        convert_checkpoint(bad, tmp_path / "v", progress=False)
    assert not (tmp_path / "v").exists()


def test_an_old_mixtral_file_with_one_tensor_per_expert_is_refused(tmp_path):
    """llama.cpp's files before stacked experts (blk.N.ffn_gate.E.weight): named as such."""
    r = gguf.GGUFReader(DATA / "mixtral-q4_k_m.gguf")
    old = tmp_path / "old.gguf"
    w = gguf.GGUFWriter(old, arch="llama")
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(k, f.contents(), vt, sub_type=f.types[-1])
        else:
            w.add_key_value(k, f.contents(), vt)
    for t in r.tensors:
        data = np.asarray(t.data)
        if "_exps." not in t.name:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
            continue
        for e in range(data.shape[0]):  # one tensor per expert, as before 2024
            w.add_tensor(t.name.replace("_exps", f".{e}"), np.ascontiguousarray(data[e]), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConvertError, match=r"one tensor each \(blk\.0\.ffn_.*re-convert"):
        convert_checkpoint(old, tmp_path / "v", progress=False)
    assert not (tmp_path / "v").exists()


def test_qwen35moe_keeps_llama_cpps_value_head_order(vaults):
    """A qwen35moe vault says its value heads are tiled (vault parameter 1); a qwen3next one
    (grouped, as the checkpoints) leaves the key out, as vaults written before it."""
    assert read_vault(_vault(vaults, "qwen35moe-q8_0")).params["linear_value_head_order"] == 1
    assert "linear_value_head_order" not in read_vault(_vault(vaults, "qwen3next-q8_0")).params


def test_format_options_are_refused(tmp_path):
    with pytest.raises(ConvertError, match="as stored.*--experts"):
        convert_checkpoint(DATA / "tiny-f32.gguf", tmp_path / "v", experts="q4", progress=False)


def test_a_split_file_converts_to_the_same_vault(tmp_path, vaults):
    _rewrite(DATA / "tiny-f32.gguf", tmp_path / "m.gguf", split_max_tensors=10)
    parts = sorted(p.name for p in tmp_path.glob("*.gguf"))
    assert parts == ["m-00001-of-00003.gguf", "m-00002-of-00003.gguf", "m-00003-of-00003.gguf"]
    out = convert_checkpoint(tmp_path / parts[0], tmp_path / "v", progress=False)
    assert (out / "vault.bin").read_bytes() == (_vault(vaults, "tiny-f32") / "vault.bin").read_bytes()
    (tmp_path / parts[2]).unlink()
    with pytest.raises(ConvertError, match="split files missing: m-00003-of-00003.gguf"):
        convert_checkpoint(tmp_path / parts[0], tmp_path / "v2", progress=False)


def test_not_a_gguf_file(tmp_path):
    f = tmp_path / "x.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 10)
    with pytest.raises(ConvertError, match="not a readable GGUF"):
        convert_checkpoint(f, tmp_path / "v", progress=False)
    g = tmp_path / "y.bin"
    g.write_bytes(b"hello")
    with pytest.raises(ConvertError, match="not a GGUF file"):
        convert_checkpoint(g, tmp_path / "v", progress=False)


# ------------------------------------------------------------------------------ the tokenizer

def _scripts():
    import sys
    p = str(Path(__file__).parents[1] / "scripts")
    if p not in sys.path:
        sys.path.insert(0, p)
    import make_gguf_fixtures
    return make_gguf_fixtures


def _encoder(gguf_path: Path):
    from tokenizers import Tokenizer

    from pysmoe.convert.gguf_tokenizer import tokenizer_json
    tok = Tokenizer.from_str(tokenizer_json(GGUFModel(gguf_path).meta))
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def _golden():
    path = DATA / "tokens.json"
    if not path.exists():
        pytest.skip("tests/data/gguf/tokens.json not made yet (scripts/make_gguf_fixtures.py)")
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("pre", ["qwen2", "gpt-2", "llama-bpe", "qwen35", "glm4", "gpt-4o"])
def test_tokenizer_encodes_as_llama_cpp_did(pre, tmp_path):
    """The tokenizer.json made from a GGUF's vocabulary gives the ids llama.cpp gave for the same
    vocabulary and pre-tokenizer (tokens.json, made by llama.cpp), text by text."""
    g = _golden()
    mk = _scripts()
    demo = Path(__file__).parents[1] / "pysmoe" / "data" / "demo"
    path = mk.vocab_gguf(tmp_path / "v.gguf", demo, 4096, pre, DATA / "tiny-f32.gguf")
    enc = _encoder(path)
    for text, want in zip(g["texts"], g["demo"][pre]):
        assert enc(text) == want, text[:80]


def test_tokenizer_of_a_converted_file_encodes_as_llama_cpp_did():
    g = _golden()
    enc = _encoder(DATA / "tiny-f32.gguf")
    for text, want in zip(g["texts"], g["tiny-f32"]):
        assert enc(text) == want, text[:80]


def test_tokenizer_against_llama_cpp_live(tmp_path):
    """Where llama-cpp-python is installed: random strings drawn from a mix of scripts, digits,
    whitespace and specials, tokenised by both."""
    pytest.importorskip("llama_cpp")
    mk = _scripts()
    demo = Path(__file__).parents[1] / "pysmoe" / "data" / "demo"
    rng = np.random.default_rng(0)
    alphabet = list("abcXYZ  \t\n\r0123456789'.,!?-_") + ["é", "ß", "日", "本", "Ω", "й", "ع", "क", "🚀", "\u200d",
                                                        "\u00a0", "'s", "'LL", "<|im_start|>", "<|im_end|>", "  "]
    texts = ["".join(rng.choice(alphabet, size=int(rng.integers(0, 40)))) for _ in range(200)]
    for pre in mk.TOKENIZER_PRES:
        path = mk.vocab_gguf(tmp_path / f"{pre}.gguf", demo, 4096, pre, DATA / "tiny-f32.gguf")
        enc = _encoder(path)
        want = mk.llama_cpp_tokens(path, texts)
        bad = [t for t, w in zip(texts, want) if enc(t) != w]
        assert not bad, (pre, bad[:3])


@pytest.mark.parametrize("name", ["k256-q4_k_m", "k256-iq4_xs", "k256-iq", "tiny-q4_0", "glm4moe-q4_k_m", "mixtral-q4_k_m",
                                  "gpt-oss-mxfp4", "qwen3next-q8_0", "qwen35moe-q8_0", "qwen35moe-q4_k_m"])
@pytest.mark.parametrize("activations", ["f32", "q8"])
def test_layer_major_is_token_serial_on_an_imported_mix(name, activations, vaults):
    """A llama.cpp mix imported as stored keeps the engine's bit identity: a layer-major prefill
    in chunks of 5 gives the very logits of the token-serial walk, in both activation modes."""
    import pysmoe

    d = _vault(vaults, name)
    cfg = json.loads((d / "config.json").read_text())
    ids = [int(i) for i in np.random.default_rng(5).integers(0, cfg["vocab_size"], 17)]
    out = {}
    with pysmoe.open_vault(d) as v:
        for mode in ("layer-major", "token-serial"):
            with v.session(threads=2, chunk=5, activations=activations, prefill=mode) as s:
                first = s.prefill(ids)
                out[mode] = np.concatenate([first, s.decode(ids[0])])
    assert out["layer-major"].tobytes() == out["token-serial"].tobytes()


@pytest.mark.parametrize("name", ["k256-q4_k_m", "k256-iq4_xs", "k256-iq", "olmoe-q8_0", "glm4moe-q4_k_m", "mixtral-q4_k_m",
                                  "gpt-oss-mxfp4", "qwen3next-q8_0", "qwen35moe-q8_0", "qwen35moe-q4_k_m"])
def test_an_imported_mix_runs_on_the_gpu(name, vaults):
    """llama.cpp's files on device="cuda" (skipped without a GPU): within test_cuda's ATOL/RTOL of
    the CPU's f32-activation logits (flash attention's RTOL_F16 for head sizes 32/64/128), and
    layer-major in chunks of 5 = token-serial bit for bit on the GPU."""
    import pysmoe
    from pysmoe.errors import Unsupported
    from test_cuda import ATOL, RTOL, RTOL_F16

    d = _vault(vaults, name)
    cfg = json.loads((d / "config.json").read_text())
    ids = [int(i) for i in np.random.default_rng(5).integers(0, cfg["vocab_size"], 17)]
    out = {}
    with pysmoe.open_vault(d) as v:
        try:
            v.session(device="cuda").close()
        except Unsupported as e:
            pytest.skip(f"no CUDA here: {e}")
        for dev, mode in (("cpu", "layer-major"), ("cuda", "layer-major"), ("cuda", "token-serial")):
            with v.session(device=dev, chunk=5, activations="f32", prefill=mode) as s:
                first = s.prefill(ids)
                out[dev, mode] = np.stack([first, s.decode(ids[0])])
    gpu, cpu = out["cuda", "token-serial"], out["cpu", "layer-major"]
    assert out["cuda", "layer-major"].tobytes() == gpu.tobytes()
    rtol = RTOL_F16 if cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]) in (32, 64, 128) else RTOL
    err, top = float(np.max(np.abs(gpu - cpu))), float(np.max(np.abs(cpu)))
    print(f"{name}: max|gpu - cpu| / max|logit| = {err / top:.3g}")
    assert err <= ATOL + rtol * top, (name, err, top)


def test_a_truncated_file_is_refused(tmp_path):
    f = tmp_path / "cut.gguf"
    data = (DATA / "tiny-q8_0.gguf").read_bytes()
    for n in (len(data) - 1000, 5000, 40):
        f.write_bytes(data[:n])
        with pytest.raises(ConvertError, match="truncated|not a readable GGUF"):
            convert_checkpoint(f, tmp_path / "v", progress=False)
    assert not (tmp_path / "v").exists()


def test_info_names_every_layers_expert_types(vaults, capsys):
    """`pysmoe info` on an imported Q4_K_M lists ffn_down's type in every layer (Q5_0 in layers
    0-1, Q8_0 in 2-3 in the fixture: llama.cpp's fallbacks for rows of 128)."""
    from pysmoe.vaultio import info

    d = _vault(vaults, "k256-q4_k_m")
    downs = {t.tensor_type.name for t in gguf.GGUFReader(DATA / "k256-q4_k_m.gguf").tensors
             if "ffn_down_exps" in t.name}
    assert len(downs) > 1
    line = next(x for x in info(d).splitlines() if x.startswith("experts") and "down" in x)
    assert set(line.split("down ")[1].split(",")[0].split("+")) == downs


def test_corrupt_headers_give_a_convert_error_or_a_vault(tmp_path):
    """Bytes changed at random in the header, metadata and tensor table of a llama.cpp file:
    every attempt either converts or raises ConvertError (never another exception), and a failed
    one leaves nothing behind."""
    data = (DATA / "tiny-q8_0.gguf").read_bytes()
    rng = np.random.default_rng(7)
    f = tmp_path / "x.gguf"
    for i in range(60):
        b = bytearray(data)
        for _ in range(int(rng.integers(1, 4))):
            b[int(rng.integers(0, 12000))] = int(rng.integers(0, 256))
        f.write_bytes(bytes(b))
        out = tmp_path / f"v{i}"
        try:
            convert_checkpoint(f, out, progress=False)
        except ConvertError:
            assert not out.exists()


# ------------------------------------------------------------------------------ the families' own tokenizers

def _family_fixtures():
    path = DATA / "tokens.json"
    return sorted(json.loads(path.read_text(encoding="utf-8")).get("fixtures", {})) if path.exists() else []


@pytest.mark.parametrize("name", _family_fixtures())
def test_family_tokenizer_encodes_as_llama_cpp_did(name):
    """Each family fixture's vocabulary (its pre-tokenizer and special tokens, as llama.cpp's
    converter wrote them) encodes the shared texts and the family's own chat text as llama.cpp did."""
    g = _golden()["fixtures"][name]
    enc = _encoder(DATA / f"{name}.gguf")
    for text, want in zip(g["texts"], g["ids"]):
        assert enc(text) == want, text[:80]


@pytest.mark.parametrize("name", [n for n in FIXTURES if n.startswith(("glm4moe", "mixtral", "gpt-oss"))])
def test_family_chat_template_renders_as_transformers(name, vaults):
    """The chat template converted from tokenizer.chat_template renders, through pysmoe, the
    text transformers renders from the same template, with a system prompt, a tool and a tool call."""
    from transformers import PreTrainedTokenizerFast

    from pysmoe.tokenizer import load_tokenizer

    d = _vault(vaults, name)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    assert tc["chat_template"] == GGUFModel(DATA / f"{name}.gguf").meta["tokenizer.chat_template"]
    tools = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                               "parameters": {"type": "object", "properties": {
                                                   "a": {"type": "number"}, "b": {"type": "number"}}}}}]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
            {"role": "tool", "content": "4"}]
    kwargs = {}
    if name.startswith("gpt-oss"):  # harmony: reasoning effort as a template kwarg, a thinking field
        kwargs = {"reasoning_effort": "low"}
        msgs[2] = {**msgs[2], "thinking": "Add them."}
        msgs[3] = {"role": "tool", "content": "4", "name": "add"}
    if name.startswith("mixtral"):  # user/assistant alternating, no tools
        tools, msgs = None, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                             {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
    hf = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), chat_template=tc["chat_template"],
                                 bos_token=tc.get("bos_token"), eos_token=tc.get("eos_token"))
    want = hf.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
    got = load_tokenizer(d).apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True,
                                                **kwargs)
    start = {"mixtral": "<s>", "gpt-oss": "<|start|>system<|message|>", "glm4moe": "[gMASK]<sop>"}
    assert got == want and want.startswith(start[name.rsplit("-", 1)[0]])


@pytest.mark.parametrize("name", _family_fixtures())
def test_family_tokenizer_against_llama_cpp_live(name):
    """Where llama-cpp-python is installed: random strings of scripts, digits, whitespace runs,
    the family's special tokens and byte-fallback characters, tokenised by both."""
    pytest.importorskip("llama_cpp")
    mk = _scripts()
    path = DATA / f"{name}.gguf"
    meta = GGUFModel(path).meta
    specials = [t for t, ty in zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]) if ty in (3, 4)]
    rng = np.random.default_rng(1)
    alphabet = list("abcXYZ  \t\n\r0123456789'.,!?-_▁") + ["é", "ß", "日", "本", "Ω", "й", "ع", "क", "🚀",
                                                         "\u200d", "\u00a0", "'s", " the", "  ", "<0x41>"] + specials
    texts = ["".join(rng.choice(alphabet, size=int(rng.integers(0, 40)))) for _ in range(300)]
    enc = _encoder(path)
    want = mk.llama_cpp_tokens(path, texts)
    bad = [t for t, w in zip(texts, want) if enc(t) != w]
    assert not bad, bad[:3]


@pytest.mark.parametrize("model_type, size", [("bpe", 2000), ("unigram", 1500)])
def test_sentencepiece_vocabularies_against_llama_cpp_live(model_type, size, tmp_path):
    """Where llama-cpp-python and sentencepiece are installed: larger SentencePiece vocabularies
    (trained here on the held-out text: BPE and Unigram scores, byte fallback, user-defined
    tokens) as `llama` GGUF vocabularies, tokenised by llama.cpp and by the converted
    tokenizer.json: random strings and the whole held-out text in 500-character pieces."""
    pytest.importorskip("llama_cpp")
    spm = pytest.importorskip("sentencepiece")
    import io

    mk = _scripts()
    text = (Path(__file__).parents[1] / "pysmoe" / "data" / "demo" / "heldout.txt").read_text(encoding="utf-8")
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text.splitlines()), model_writer=out, model_type=model_type, vocab_size=size,
        byte_fallback=True, character_coverage=0.9995, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        split_digits=True, allow_whitespace_only_pieces=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, num_threads=1, minloglevel=2, user_defined_symbols=["<|im_start|>"])
    sp = spm.SentencePieceProcessor(model_proto=out.getvalue())
    n = sp.vocab_size()
    tokens = [sp.id_to_piece(i) for i in range(n)]
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i)
             else 4 if tokens[i] == "<|im_start|>" else 1 for i in range(n)]
    path = tmp_path / "spm.gguf"
    A = gguf.GGUFValueType
    _rewrite(DATA / "mixtral-q4_k_m.gguf", path, meta={
        "tokenizer.ggml.tokens": (tokens, A.ARRAY, A.STRING), "llama.vocab_size": (n, A.UINT32),
        "tokenizer.ggml.scores": ([sp.get_score(i) for i in range(n)], A.ARRAY, A.FLOAT32),
        "tokenizer.ggml.token_type": (types, A.ARRAY, A.INT32)})
    enc = _encoder(path)
    rng = np.random.default_rng(2)
    alphabet = list("abcXYZ  \t\n\r0123456789'.,!?-_▁") + ["é", "ß", "日", "Ω", "🚀", "\u00a0", " the", "  ",
                                                         "<|im_start|>", "<s>", "</s>"]
    texts = ["".join(rng.choice(alphabet, size=int(rng.integers(0, 40)))) for _ in range(300)]
    texts += [text[i:i + 500] for i in range(0, len(text), 500)]
    want = mk.llama_cpp_tokens(path, texts)
    bad = [t for t, w in zip(texts, want) if enc(t) != w]
    assert not bad, bad[:3]


def test_retype_gguf_rewrites_only_the_experts(tmp_path):
    """bench/retype_gguf.py (a benchmark's model of one GGML type): the stacked experts become
    random blocks of the type with about the std of the tensors they replace, every other tensor
    and every metadata key is copied as it was, and the file imports and runs."""
    import sys

    import pysmoe

    gguf = pytest.importorskip("gguf")
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_scripts import load

    src, out = DATA / "k256-iq.gguf", tmp_path / "iq1s.gguf"
    assert load("retype_gguf").main([str(src), str(out), "--type", "IQ1_S", "--seed", "3"]) == 0
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(out)
    assert {k: f.contents() for k, f in a.fields.items() if not k.startswith("GGUF.")} == \
           {k: f.contents() for k, f in b.fields.items() if not k.startswith("GGUF.")}
    tb = {t.name: t for t in b.tensors}
    assert set(tb) == {t.name for t in a.tensors}
    for t in a.tensors:
        u = tb[t.name]
        assert [int(x) for x in u.shape] == [int(x) for x in t.shape], t.name
        if "_exps." in t.name:
            assert u.tensor_type.name == "IQ1_S", t.name
            want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).std()
            got = gguf.quants.dequantize(np.asarray(u.data), u.tensor_type).std()
            assert 0.5 * want < got < 2 * want, (t.name, want, got)
        else:
            assert u.tensor_type == t.tensor_type and np.asarray(u.data).tobytes() == np.asarray(t.data).tobytes(), t.name
    vault = convert_checkpoint(out, tmp_path / "v", progress=False)
    with pysmoe.open_vault(vault) as v, v.session() as s:
        assert np.isfinite(s.prefill([1, 2, 3])).all()
    with pytest.raises(SystemExit, match="columns"):  # Q4_K_M's 128-wide down_proj holds no 256-block
        load("retype_gguf").main([str(DATA / "k256-q4_k_m.gguf"), str(tmp_path / "x.gguf"), "--type", "IQ2_XXS"])
    assert not (tmp_path / "x.gguf").exists()  # refused before anything was written
