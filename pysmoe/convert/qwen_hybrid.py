"""Qwen3-Next and Qwen3.5-MoE (the text model) → a vault's tensors: what differs from Qwen3-MoE.

Both families are hybrids (transformers' Qwen3NextForCausalLM, Qwen3_5MoeForCausalLM and the
language model of Qwen3_5MoeForConditionalGeneration): most layers are Gated DeltaNet linear
attention, every `full_attention_interval`-th (or as `layer_types` says) gated full attention;
every layer's FFN is the routed experts plus a shared expert with a sigmoid gate.

The vault stores them in one layout for both families, so the engine has one recipe:

  layers.L.q_proj / q_gate_proj   Qwen3NextAttention's q_proj holds, per head, the query's
                                  head_dim rows then the output gate's; split into two matrices
                                  (rows taken, nothing recomputed)
  layers.L.linear.{qkv,z,b,a}     Qwen3.5's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a as
                                  they are; Qwen3-Next's in_proj_qkvz and in_proj_ba interleave
                                  them per key head, and their rows are regrouped into this order
  layers.L.linear.conv            conv1d.weight (conv_dim, 1, K) as (conv_dim, K)
  layers.L.linear.{A_log,dt_bias} (1, value heads), f32
  layers.L.linear.norm            the gated RMSNorm's weight (plain w)
  layers.L.linear.out             out_proj
  layers.L.shared.{gate,up,down}_proj, layers.L.shared_gate   the shared expert and its gate

The RMSNorms of these families scale by (1 + w) (Qwen3NextRMSNorm: input and post-attention
norms, q_norm, k_norm, the final norm); the vault stores 1 + w in f32 (what transformers
multiplies by, computed in f32), so the engine's RMSNorm (· w) needs no variant.

Released Qwen3.5/3.6 checkpoints are multimodal: their language model's tensors are named
`model.language_model.*` and the vision tower's `model.visual.*`, which is left out (as are the
multi-token-prediction heads `mtp.*` of both families).
"""
from __future__ import annotations

import re

import numpy as np

FAMILY_ID = {"qwen3_next": 5, "qwen3_5_moe": 6}
ARCHITECTURES = {
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
}
MODEL_TYPES = {"qwen3_next": "qwen3_next", "qwen3_5_moe": "qwen3_5_moe", "qwen3_5_moe_text": "qwen3_5_moe"}

# Tensors of the source that are not the language model's: left out, with a log line.
IGNORED = re.compile(r"(mtp\..*|model\.visual\..*|.*rotary_emb\.inv_freq)")


def family_of(raw: dict) -> str | None:
    """'qwen3_next' or 'qwen3_5_moe' for a config.json of these families, else None."""
    for a in raw.get("architectures") or []:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    return MODEL_TYPES.get(raw.get("model_type"))


def text_config(raw: dict) -> dict:
    """The language model's config: a multimodal Qwen3.5 config.json's text_config (with the
    top-level tie_word_embeddings when the text part does not say), else raw itself."""
    tc = raw.get("text_config")
    if not isinstance(tc, dict):
        return dict(raw)
    out = dict(tc)
    if "tie_word_embeddings" not in out and "tie_word_embeddings" in raw:
        out["tie_word_embeddings"] = raw["tie_word_embeddings"]
    out.setdefault("architectures", raw.get("architectures"))
    return out


def layer_types(cfg: dict) -> list[str]:
    """Per layer 'linear_attention' or 'full_attention', as the transformers config decides."""
    L = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        every = int(cfg.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(L)]
    types = list(types)[:L]
    bad = sorted({t for t in types if t not in ("linear_attention", "full_attention")})
    if len(types) != L or bad:
        raise ValueError(f"layer_types must give {L} entries of linear_attention/full_attention (got {bad or len(types)})")
    return types


def normalize(raw: dict, family: str) -> dict:
    """The family's text config with the keys the vault's config block and parameters need:
    the Qwen3-MoE keys (pysmoe.vaultio.normalize_config), plus `family`, `rotary_dim`,
    `layer_types`, `shared_expert_intermediate_size` and the `linear_*` sizes."""
    cfg = text_config(raw)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    if cfg.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported (neither family has attention biases)")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        rope = {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise ValueError(f"RoPE type {rope_type!r} is not supported (only the default RoPE)")
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    cfg["head_dim"] = head_dim
    if "rotary_dim" not in cfg:  # (a vault's config.json, normalised before, has it)
        cfg["rotary_dim"] = int(head_dim * float(factor))
    if cfg["rotary_dim"] < 2 or cfg["rotary_dim"] % 2:
        raise ValueError(f"partial_rotary_factor {factor} gives a rotary dimension of {cfg['rotary_dim']}")
    # keys the Qwen3-MoE config block needs that these configs leave out
    cfg.pop("rope_parameters", None)
    cfg.pop("rope_scaling", None)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    if family == "qwen3_5_moe":  # every layer sparse, top-k weights always renormalised
        cfg["decoder_sparse_step"] = 1
        cfg["mlp_only_layers"] = []
        cfg["norm_topk_prob"] = True
        cfg.setdefault("intermediate_size", shared or cfg["moe_intermediate_size"])
    else:
        if cfg.get("norm_topk_prob") is None:
            cfg["norm_topk_prob"] = True  # Qwen3NextConfig's default
    cfg["shared_expert_intermediate_size"] = shared
    cfg["layer_types"] = layer_types(cfg)
    cfg["model_type"] = family
    for k, default in (("linear_conv_kernel_dim", 4), ("linear_key_head_dim", 128), ("linear_value_head_dim", 128),
                       ("linear_num_key_heads", 16), ("linear_num_value_heads", 32)):
        cfg[k] = int(cfg.get(k, default))
    if cfg["linear_num_value_heads"] % cfg["linear_num_key_heads"]:
        raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    if cfg["linear_conv_kernel_dim"] < 1 or cfg["linear_conv_kernel_dim"] > 64:
        raise ValueError("linear_conv_kernel_dim must be 1 to 64")
    return cfg


def linear_dims(cfg: dict) -> dict:
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    return {"nk": nk, "nv": nv, "dk": dk, "dv": dv, "key_dim": nk * dk, "value_dim": nv * dv,
            "conv_dim": 2 * nk * dk + nv * dv, "kernel": cfg["linear_conv_kernel_dim"]}


def dense_shapes(cfg: dict) -> list[tuple[str, int, int]]:
    """(vault name, rows, cols) of the per-layer attention and shared-expert tensors these
    families have in place of, or beside, Qwen3-MoE's; in vault order."""
    H, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    S = cfg["shared_expert_intermediate_size"]
    d = linear_dims(cfg)
    out = []
    for l, kind in enumerate(cfg["layer_types"]):
        p = f"layers.{l}."
        out += [(p + "input_layernorm", 1, H), (p + "post_attention_layernorm", 1, H)]
        if kind == "full_attention":
            out += [(p + "q_proj", q, H), (p + "q_gate_proj", q, H), (p + "k_proj", kv, H), (p + "v_proj", kv, H),
                    (p + "o_proj", H, q), (p + "q_norm", 1, hd), (p + "k_norm", 1, hd)]
        else:
            out += [(p + "linear.qkv", d["conv_dim"], H), (p + "linear.z", d["value_dim"], H),
                    (p + "linear.b", d["nv"], H), (p + "linear.a", d["nv"], H),
                    (p + "linear.conv", d["conv_dim"], d["kernel"]), (p + "linear.A_log", 1, d["nv"]),
                    (p + "linear.dt_bias", 1, d["nv"]), (p + "linear.norm", 1, d["dv"]),
                    (p + "linear.out", H, d["value_dim"])]
        out += [(p + "shared.gate_proj", S, H), (p + "shared.up_proj", S, H), (p + "shared.down_proj", H, S),
                (p + "shared_gate", 1, H)]
    return out


# ---- the source's names and what becomes of them ---------------------------------------------

_PREFIX = re.compile(r"^model\.(?:language_model\.)?")
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def strip_prefix(name: str) -> str | None:
    """The name below the language model ('layers.3.…', 'embed_tokens.weight', 'lm_head.weight'),
    or None for a name outside it."""
    if name == "lm_head.weight":
        return name
    m = _PREFIX.match(name)
    return name[m.end():] if m else None


def _qkvz_rows(d: dict) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-Next's in_proj_qkvz rows → (rows of q,k,v in the vault's order, rows of z): per key
    head g the source holds [q (dk) | k (dk) | v (r·dv) | z (r·dv)], r = nv/nk."""
    nk, dk, dv, r = d["nk"], d["dk"], d["dv"], d["nv"] // d["nk"]
    width = 2 * dk + 2 * r * dv
    base = np.arange(nk)[:, None] * width
    q = (base + np.arange(dk)).ravel()
    k = (base + dk + np.arange(dk)).ravel()
    v = (base + 2 * dk + np.arange(r * dv)).ravel()
    z = (base + 2 * dk + r * dv + np.arange(r * dv)).ravel()
    return np.concatenate([q, k, v]), z


def _ba_rows(d: dict) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-Next's in_proj_ba rows → (b rows, a rows): per key head [b (r) | a (r)]."""
    nk, r = d["nk"], d["nv"] // d["nk"]
    base = np.arange(nk)[:, None] * 2 * r
    return (base + np.arange(r)).ravel(), (base + r + np.arange(r)).ravel()


def _q_rows(cfg: dict) -> tuple[np.ndarray, np.ndarray]:
    """q_proj rows → (query rows, output gate rows): per head [query (hd) | gate (hd)]."""
    n, hd = cfg["num_attention_heads"], cfg["head_dim"]
    base = np.arange(n)[:, None] * 2 * hd
    return (base + np.arange(hd)).ravel(), (base + hd + np.arange(hd)).ravel()


# What one source tensor becomes: (vault name, rows to take or None, add one?)
Target = tuple[str, "np.ndarray | None", bool]

_ONE_PLUS = {"input_layernorm.weight": "input_layernorm", "post_attention_layernorm.weight": "post_attention_layernorm",
             "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"}
_AS_IS = {"self_attn.k_proj.weight": "k_proj", "self_attn.v_proj.weight": "v_proj",
          "self_attn.o_proj.weight": "o_proj", "mlp.gate.weight": "router",
          "linear_attn.in_proj_qkv.weight": "linear.qkv", "linear_attn.in_proj_z.weight": "linear.z",
          "linear_attn.in_proj_b.weight": "linear.b", "linear_attn.in_proj_a.weight": "linear.a",
          "linear_attn.conv1d.weight": "linear.conv", "linear_attn.A_log": "linear.A_log",
          "linear_attn.dt_bias": "linear.dt_bias", "linear_attn.norm.weight": "linear.norm",
          "linear_attn.out_proj.weight": "linear.out",
          "mlp.shared_expert.gate_proj.weight": "shared.gate_proj",
          "mlp.shared_expert.up_proj.weight": "shared.up_proj",
          "mlp.shared_expert.down_proj.weight": "shared.down_proj",
          "mlp.shared_expert_gate.weight": "shared_gate",
          "mlp.gate_proj.weight": "mlp.gate_proj", "mlp.up_proj.weight": "mlp.up_proj",
          "mlp.down_proj.weight": "mlp.down_proj"}


def targets(cfg: dict, inner: str) -> list[Target] | None:
    """The vault tensors a non-expert source tensor (its name below the language model, from
    strip_prefix) becomes, or None if it is not one of this family's."""
    if inner == "embed_tokens.weight":
        return [("embed_tokens", None, False)]
    if inner == "norm.weight":
        return [("norm", None, True)]
    if inner == "lm_head.weight":
        return [("lm_head", None, False)]
    m = _LAYER.fullmatch(inner)
    if not m or int(m.group(1)) >= cfg["num_hidden_layers"]:
        return None
    p, rest = f"layers.{m.group(1)}.", m.group(2)
    if rest in _ONE_PLUS:
        return [(p + _ONE_PLUS[rest], None, True)]
    if rest in _AS_IS:
        return [(p + _AS_IS[rest], None, False)]
    if rest == "self_attn.q_proj.weight":
        q, g = _q_rows(cfg)
        return [(p + "q_proj", q, False), (p + "q_gate_proj", g, False)]
    d = linear_dims(cfg)
    if rest == "linear_attn.in_proj_qkvz.weight":
        qkv, z = _qkvz_rows(d)
        return [(p + "linear.qkv", qkv, False), (p + "linear.z", z, False)]
    if rest == "linear_attn.in_proj_ba.weight":
        b, a = _ba_rows(d)
        return [(p + "linear.b", b, False), (p + "linear.a", a, False)]
    return None


def source_rows(cfg: dict, inner: str) -> int | None:
    """The first-axis length the source tensor must have for its targets (None: as the target)."""
    m = _LAYER.fullmatch(inner)
    rest = m.group(2) if m else ""
    d = linear_dims(cfg)
    if rest == "self_attn.q_proj.weight":
        return 2 * cfg["num_attention_heads"] * cfg["head_dim"]
    if rest == "linear_attn.in_proj_qkvz.weight":
        return 2 * d["key_dim"] + 2 * d["value_dim"]
    if rest == "linear_attn.in_proj_ba.weight":
        return 2 * d["nv"]
    return None


def transform(a: np.ndarray, rows: np.ndarray | None, one_plus: bool, shape: tuple[int, int]) -> np.ndarray:
    """A source tensor (f32) as the vault stores it: rows taken, 1 + w for the (1 + w) norms
    (in f32, as transformers computes it), reshaped to (rows, cols)."""
    if rows is not None:
        a = a[rows]
    if one_plus:
        a = (np.float32(1.0) + a.astype(np.float32)).astype(np.float32)
    return np.ascontiguousarray(a.reshape(shape), dtype=np.float32)
