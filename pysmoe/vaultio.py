"""Write and read vaults (docs/vault.md) in pure Python.

`VaultWriter` is the one writer: `pysmoe synth` and `pysmoe convert` both use it. The layout is
fully determined by the config and the formats, so the writer computes every offset up front,
creates vault.bin at its final size, and then takes tensors and expert blobs in any order, each
written with pwrite at its place (a converter can stream experts straight from safetensors
shards without holding them). `close()` checks that everything arrived, checksums the dense
region, and writes the tables and the header last: a vault whose writer died has no valid
header.

    header (256) | tables | pad to 16 KiB | dense region | blob (0,0) | blob (0,1) | ...

`read_vault` is a small reader over np.memmap for `pysmoe info` and the numpy reference forward.
It parses what it needs and checks the obvious; the C parser is the one that validates untrusted
input exhaustively.
"""
from __future__ import annotations

import dataclasses
import json
import mmap
import os
import pathlib
import stat
import struct
import threading

import numpy as np

from . import quant
from .errors import VaultError
from .quant import FORMAT_CODE, FORMAT_NAME, SCALE_CODE, SCALE_NAME, align

MAGIC = b"SMOEVLT\0"
VERSION = 4
READ_VERSIONS = (2, 3, 4)
HEADER_BYTES = 256
BLOB_ALIGN = 16384
CONFIG_BYTES = 96
DESC_BYTES = 64
BLOB_ENTRY_BYTES = 16
NAME_BYTES = 40
MAX_TABLE_BYTES = 64 << 20
PAGE_BYTES = 4096  # a paged embedding's checksummed page (docs/vault.md 4.1)

DEFAULT_CONTEXT = 4096  # the CLI's --context, capped by the model's max_position_embeddings

_HEADER = struct.Struct("<8sIIQQQQQIIQIIQI")  # through page_bytes at 88 (v4); zeros to 256
_CONFIG = struct.Struct("<12IfId")           # 64 bytes; zeros to 96
_DESC = struct.Struct("<40sBBHIIIQ")          # 64 bytes
_BLOB = struct.Struct("<QII")                 # 16 bytes
_PARAMS_HEAD = struct.Struct("<II")           # count, 0
_PARAM = struct.Struct("<32sd")               # key NUL-padded, f64 value: 40 bytes
_LAYOUT = struct.Struct("<QII")               # a layer's blob bytes, descriptors, 0: 16 bytes

ROLES = ("experts", "attention", "embed", "lm_head", "router", "norms", "mlp")
DEFAULT_FORMATS = {"experts": "q4", "attention": "q8", "embed": "q8", "lm_head": "q8",
                   "mlp": "q8", "router": "f32", "norms": "f32"}
EXPERT_PARTS = ("gate", "up", "down")

# Model families (docs/vault.md 2.2): model_type -> the vault's `family` number.
FAMILIES = {"qwen3_moe": 0, "mixtral": 1, "olmoe": 2, "glm4_moe": 3, "gpt_oss": 4, "qwen3_next": 5,
            "qwen3_5_moe": 6}
FAMILY_NAME = {v: k for k, v in FAMILIES.items()}
# What the engine of this build runs (a vault of another family opens, and is refused by a session).
RUNNABLE_FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "glm4_moe", "gpt_oss", "qwen3_next", "qwen3_5_moe")
LINEAR_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
               "linear_conv_kernel_dim")
PARAM_KEYS = ("family", "rotary_dim", "sliding_window", "router_kind", "n_group", "topk_group",
              "routed_scaling_factor", "shared_intermediate_size", "attention_bias", "qk_norm",
              "swiglu_alpha", "swiglu_limit", "yarn_factor", "yarn_original_max_position", "yarn_beta_fast",
              "yarn_beta_slow", "yarn_attention_factor", "yarn_truncate") + LINEAR_KEYS + ("linear_value_head_order",)
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5_moe")  # Gated DeltaNet + gated attention (convert/qwen_hybrid.py)
ATTN_FULL, ATTN_SLIDING, ATTN_LINEAR = 0, 1, 2
# gpt-oss's blobs hold each expert's biases after its matrices (f32 rows)
EXPERT_BIAS_PARTS = ("gate_bias", "up_bias", "down_bias")
ROUTER_SOFTMAX_TOPK, ROUTER_SIGMOID_GROUP, ROUTER_TOPK_SOFTMAX = 0, 1, 2
QK_NORM_NONE, QK_NORM_HEAD, QK_NORM_WHOLE = 0, 1, 2

# ------------------------------------------------------------------------------------ config

CONFIG_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size",
               "num_experts", "num_experts_per_tok", "max_position_embeddings", "norm_topk_prob",
               "tie_word_embeddings", "rms_norm_eps", "rope_theta", "mlp_only_layers",
               "decoder_sparse_step")
_INT_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size",
             "num_experts", "num_experts_per_tok", "max_position_embeddings", "decoder_sparse_step")


def normalize_config(cfg: dict) -> dict:
    """A Qwen3-MoE config.json dict in either spelling -> one with every key of CONFIG_KEYS.

    Released Qwen checkpoints write `num_experts` and `rope_theta`; transformers 5 writes
    `num_local_experts` and `rope_parameters: {"rope_theta": ...}`. Keys not listed are kept
    as they were (model_type, architectures, ...).
    """
    out = dict(cfg)
    mt = out.setdefault("model_type", "qwen3_moe")
    if mt in ("qwen3_5_moe_text",) or mt in HYBRID_FAMILIES:
        from .convert import qwen_hybrid
        fam = qwen_hybrid.family_of(out) or mt
        out = qwen_hybrid.normalize(out, fam)
        mt = out["model_type"] = fam
    if mt not in FAMILIES:
        raise ValueError(f"model_type {mt!r} is not a family pysmoe knows ({', '.join(FAMILIES)})")
    if mt == "glm4_moe" and "n_routed_experts" in out and "num_experts" not in out:
        out["num_experts"] = out["n_routed_experts"]
    if "num_experts" not in out and "num_local_experts" in out:
        out["num_experts"] = out["num_local_experts"]
    out.pop("num_local_experts", None)
    _normalize_family(out)
    if "rope_theta" not in out:
        rp = out.get("rope_parameters")
        if isinstance(rp, dict) and "rope_theta" in rp:
            out["rope_theta"] = rp["rope_theta"]
    for key in ("rope_parameters", "rope_scaling"):
        rp = out.get(key)
        rope_type = rp.get("rope_type", rp.get("type", "default")) if isinstance(rp, dict) else "default"
        if rope_type != "default" and not (rope_type == "yarn" and out.get("model_type") == "gpt_oss"):
            raise ValueError(f"{key} rope_type {rope_type!r} is not supported (only default RoPE)")
    if out.get("head_dim") is None and out.get("hidden_size") and out.get("num_attention_heads"):
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    if out.get("num_key_value_heads") is None and "num_attention_heads" in out:
        out["num_key_value_heads"] = out["num_attention_heads"]
    defaults = {"mlp_only_layers": [], "decoder_sparse_step": 1, "norm_topk_prob": False,
                "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    for k, v in defaults.items():
        if out.get(k) is None:
            out[k] = v
    missing = [k for k in CONFIG_KEYS if k not in out]
    if missing:
        raise ValueError("config lacks " + ", ".join(missing))
    for k in _INT_KEYS:
        out[k] = int(out[k])
    out["mlp_only_layers"] = [int(x) for x in out["mlp_only_layers"]]
    out["norm_topk_prob"] = bool(out["norm_topk_prob"])
    out["tie_word_embeddings"] = bool(out["tie_word_embeddings"])
    out["rms_norm_eps"] = float(out["rms_norm_eps"])
    out["rope_theta"] = float(out["rope_theta"])
    return out


def _normalize_family(out: dict) -> None:
    """The family's own spellings -> the keys every vault config has (in place)."""
    mt = out["model_type"]
    if mt in ("mixtral", "olmoe"):
        # every layer sparse; intermediate_size is the expert's width
        if out.get("moe_intermediate_size") is None and out.get("intermediate_size") is not None:
            out["moe_intermediate_size"] = out["intermediate_size"]
        if mt == "mixtral":
            out["norm_topk_prob"] = True  # MixtralTopKRouter always renormalises
            sw = out.get("sliding_window")
            if sw is not None and int(sw) < int(out.get("max_position_embeddings") or 0):
                raise ValueError(f"Mixtral with sliding_window {sw} below max_position_embeddings is not supported")
        if mt == "olmoe" and out.get("clip_qkv") is not None:
            raise ValueError(f"OLMoE with clip_qkv {out['clip_qkv']} is not supported")
    if mt == "gpt_oss":
        # every layer sparse; intermediate_size is the expert's width; layer_types as GptOssConfig
        # defaults them (sliding first, alternating)
        out["moe_intermediate_size"] = out.get("intermediate_size")
        out.setdefault("mlp_only_layers", [])
        out.setdefault("decoder_sparse_step", 1)
        out["norm_topk_prob"] = False  # unused: the softmax runs over the chosen k
        n = int(out.get("num_hidden_layers") or 0)
        if out.get("layer_types") is None:
            out["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        bad = sorted(set(out["layer_types"]) - {"sliding_attention", "full_attention"})
        if bad or len(out["layer_types"]) != n:
            raise ValueError(f"gpt_oss layer_types must be {n} of sliding_attention/full_attention, got {bad or 'a wrong count'}")
        sw = out.get("sliding_window")
        if "sliding_attention" in out["layer_types"] and (not isinstance(sw, int) or isinstance(sw, bool) or sw < 1):
            raise ValueError(f"gpt_oss has sliding_attention layers but sliding_window is {sw!r}")
        rp = out.get("rope_parameters") or out.get("rope_scaling") or {}
        if rp.get("rope_type", rp.get("type", "default")) not in ("yarn", "default"):
            raise ValueError(f"gpt_oss with RoPE type {rp.get('rope_type')!r} is not supported (yarn or default)")
    if mt == "glm4_moe":
        k = int(out.get("first_k_dense_replace", 1) or 0)
        out.setdefault("mlp_only_layers", list(range(min(k, int(out.get("num_hidden_layers") or 0)))))
        out.setdefault("norm_topk_prob", True)
        rp = out.get("rope_parameters") if isinstance(out.get("rope_parameters"), dict) else {}
        prf = rp.get("partial_rotary_factor", out.get("partial_rotary_factor", 0.5))
        out["partial_rotary_factor"] = float(prf)


def family_params(cfg: dict) -> dict:
    """The vault's parameter table (docs/vault.md 2.2) for a normalised config: key -> number."""
    mt = cfg.get("model_type", "qwen3_moe")
    p = {"family": FAMILIES[mt]}
    hd = cfg["head_dim"]
    if mt == "qwen3_moe":
        p["qk_norm"] = QK_NORM_HEAD
    elif mt == "mixtral":
        p["qk_norm"] = QK_NORM_NONE
    elif mt == "olmoe":
        p["qk_norm"] = QK_NORM_WHOLE
        p["attention_bias"] = 2 if cfg.get("attention_bias") else 0
    elif mt == "glm4_moe":
        p["qk_norm"] = QK_NORM_HEAD if cfg.get("use_qk_norm") else QK_NORM_NONE
        p["attention_bias"] = 1 if cfg.get("attention_bias") else 0
        p["router_kind"] = ROUTER_SIGMOID_GROUP
        p["n_group"] = int(cfg.get("n_group") or 1)
        p["topk_group"] = int(cfg.get("topk_group") or 1)
        p["routed_scaling_factor"] = float(cfg.get("routed_scaling_factor") or 1.0)
        p["shared_intermediate_size"] = int(cfg["moe_intermediate_size"]) * int(cfg.get("n_shared_experts") or 0)
        rot = int(hd * float(cfg.get("partial_rotary_factor", 0.5)))
        p["rotary_dim"] = rot - rot % 2
    elif mt == "gpt_oss":
        p["qk_norm"] = QK_NORM_NONE
        p["attention_bias"] = 2 if cfg.get("attention_bias", True) else 0
        p["router_kind"] = ROUTER_TOPK_SOFTMAX
        if ATTN_SLIDING in layer_attention(cfg):
            p["sliding_window"] = int(cfg["sliding_window"])
        p["swiglu_alpha"] = float(cfg.get("swiglu_alpha", 1.702))
        p["swiglu_limit"] = float(cfg.get("swiglu_limit", 7.0))
        p.update(yarn_params(cfg))
    elif mt in HYBRID_FAMILIES:
        p["qk_norm"] = QK_NORM_HEAD
        p["rotary_dim"] = int(cfg["rotary_dim"])
        p["shared_intermediate_size"] = int(cfg.get("shared_expert_intermediate_size") or 0)
        if ATTN_LINEAR in layer_attention(cfg):
            p.update({k: int(cfg[k]) for k in LINEAR_KEYS})
            # llama.cpp's qwen35moe files: value head h reads key head h mod k_heads (docs/gguf.md)
            order = cfg.get("linear_value_head_order", "grouped")
            if order not in ("grouped", "tiled"):
                raise ValueError(f"linear_value_head_order {order!r}: grouped or tiled")
            if order == "tiled":
                p["linear_value_head_order"] = 1
    else:
        raise ValueError(f"model_type {mt!r}: this pysmoe cannot write its vault yet")
    return p


def yarn_params(cfg: dict) -> dict:
    """YaRN's entries of the parameter table (none for the default RoPE), with the attention factor
    transformers derives (_compute_yarn_parameters: 0.1·ln(factor) + 1 unless given)."""
    import math

    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rp.get("rope_type", rp.get("type")) != "yarn":
        return {}
    factor = float(rp.get("factor") or cfg["max_position_embeddings"] / rp["original_max_position_embeddings"])
    af = rp.get("attention_factor")
    if af is None:
        ms, msa = rp.get("mscale"), rp.get("mscale_all_dim")

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        af = mscale(factor, ms) / mscale(factor, msa) if ms and msa else mscale(factor)
    return {"yarn_factor": factor, "yarn_original_max_position": float(rp["original_max_position_embeddings"]),
            "yarn_beta_fast": float(rp.get("beta_fast") or 32), "yarn_beta_slow": float(rp.get("beta_slow") or 1),
            "yarn_attention_factor": float(af), "yarn_truncate": 1.0 if rp.get("truncate", True) else 0.0}


def layer_attention(cfg: dict) -> list[int]:
    """Per layer its attention kind (bits 1-2 of the kind byte): gpt-oss's sliding_attention layers
    ATTN_SLIDING, the hybrids' linear_attention layers ATTN_LINEAR, else ATTN_FULL."""
    mt = cfg.get("model_type")
    types = cfg.get("layer_types") if mt == "gpt_oss" or mt in HYBRID_FAMILIES else None
    if not types:
        return [ATTN_FULL] * cfg["num_hidden_layers"]
    kind = {"sliding_attention": ATTN_SLIDING if mt == "gpt_oss" else ATTN_FULL,
            "linear_attention": ATTN_LINEAR if mt in HYBRID_FAMILIES else ATTN_FULL}
    return [kind.get(t, ATTN_FULL) for t in types]


def layer_kinds(cfg: dict) -> list[bool]:
    """Per layer: True if sparse (router + experts), as transformers decides it."""
    step = cfg["decoder_sparse_step"]
    only = set(cfg["mlp_only_layers"])
    return [l not in only and cfg["num_experts"] > 0 and step > 0 and (l + 1) % step == 0
            for l in range(cfg["num_hidden_layers"])]


def _check_limits(cfg: dict) -> None:
    for k in _INT_KEYS:
        if cfg[k] < 1:
            raise ValueError(f"config {k} must be >= 1, got {cfg[k]}")
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if not cfg["num_experts_per_tok"] <= cfg["num_experts"] <= 1024:
        raise ValueError("need num_experts_per_tok <= num_experts <= 1024")
    if cfg["num_hidden_layers"] > 1024:
        raise ValueError("at most 1024 layers")
    for k in ("hidden_size", "head_dim", "intermediate_size", "moe_intermediate_size"):
        if cfg[k] > 65536:
            raise ValueError(f"{k} must be <= 65536")
    if cfg["vocab_size"] > 1 << 24:
        raise ValueError("vocab_size must be <= 2^24")
    if cfg["head_dim"] % 2:
        raise ValueError("head_dim must be even")


def role_of(name: str) -> str:
    """The role (a key of DEFAULT_FORMATS) of a dense tensor name."""
    if name == "embed_tokens":
        return "embed"
    if name == "lm_head":
        return "lm_head"
    if name == "norm" or name.endswith(("layernorm", "q_norm", "k_norm", ".bias", ".sinks", "linear.conv",
                                         "linear.A_log", "linear.dt_bias", "linear.norm")):
        return "norms"  # float vectors: norms and biases (and a Gated DeltaNet's small f32 weights)
    if name.endswith("shared_gate"):
        return "router"  # a shared expert's sigmoid gate: one row, kept f32 like the router
    if name.endswith("router"):
        return "router"
    if ".mlp." in name or ".shared." in name:
        return "mlp"
    return "attention"


def dense_shapes(cfg: dict) -> list[tuple[str, int, int]]:
    """Every dense tensor (name, rows, cols) in the order the writer lays them out."""
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    q_out = cfg["num_attention_heads"] * hd
    kv_out = cfg["num_key_value_heads"] * hd
    fp = family_params(cfg)
    qk, bias = fp.get("qk_norm", QK_NORM_HEAD), fp.get("attention_bias", 0)
    shared = fp.get("shared_intermediate_size", 0)
    out = [("embed_tokens", cfg["vocab_size"], h)]
    hybrid = None
    if cfg.get("model_type") in HYBRID_FAMILIES:
        from .convert import qwen_hybrid
        hybrid = qwen_hybrid.dense_shapes(cfg)  # each layer's mixer (and shared-gate) tensors
    for l, sparse in enumerate(layer_kinds(cfg)):
        p = f"layers.{l}."
        if hybrid is not None:
            mine = [t for t in hybrid if t[0].startswith(p)]
            out += [t for t in mine if ".shared" not in t[0]]
            shared_part = [t for t in mine if ".shared" in t[0]] if shared else []
        else:
            out += [(p + "input_layernorm", 1, h), (p + "q_proj", q_out, h), (p + "k_proj", kv_out, h),
                    (p + "v_proj", kv_out, h)]
            if bias:
                out += [(p + "q_proj.bias", 1, q_out), (p + "k_proj.bias", 1, kv_out), (p + "v_proj.bias", 1, kv_out)]
            if qk == QK_NORM_HEAD:
                out += [(p + "q_norm", 1, hd), (p + "k_norm", 1, hd)]
            elif qk == QK_NORM_WHOLE:
                out += [(p + "q_norm", 1, q_out), (p + "k_norm", 1, kv_out)]
            out += [(p + "o_proj", h, q_out)]
            if bias == 2:
                out.append((p + "o_proj.bias", 1, h))
            if fp["family"] == FAMILIES["gpt_oss"]:
                out.append((p + "sinks", 1, cfg["num_attention_heads"]))
            out.append((p + "post_attention_layernorm", 1, h))
            shared_part = [(p + "shared.gate_proj", shared, h), (p + "shared.up_proj", shared, h),
                           (p + "shared.down_proj", h, shared)] if shared else []
        if sparse:
            out.append((p + "router", cfg["num_experts"], h))
            if fp.get("router_kind", ROUTER_SOFTMAX_TOPK) != ROUTER_SOFTMAX_TOPK:
                out.append((p + "router.bias", 1, cfg["num_experts"]))
            out += shared_part
        else:
            i = cfg["intermediate_size"]
            out += [(p + "mlp.gate_proj", i, h), (p + "mlp.up_proj", i, h), (p + "mlp.down_proj", h, i)]
    out.append(("norm", 1, h))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head", cfg["vocab_size"], h))
    return out


# ------------------------------------------------------------------------------------ layout

@dataclasses.dataclass(frozen=True)
class Tensor:
    """A tensor descriptor. offset is absolute in vault.bin for dense tensors and relative to
    the blob's start for the expert tensors gate/up/down."""
    name: str
    format: str
    scale_format: str | None
    rows: int
    cols: int
    offset: int
    nbytes: int
    group: int = quant.GROUP  # q4/q8 group size along cols; 0 for f32/bf16


@dataclasses.dataclass(frozen=True)
class TensorFormat:
    """How one tensor is stored: format, and for q4/q8 the group size and the scales' dtype.
    A `formats` entry may be one of these or just the format's name (the writer's defaults
    fill in the rest)."""
    format: str
    group: int = quant.GROUP
    scale_dtype: str | None = None


@dataclasses.dataclass(frozen=True)
class Layout:
    config: dict
    sparse: tuple            # (layers) bool
    table_bytes: int
    dense_offset: int
    dense_bytes: int
    tensors: dict            # name -> Tensor (offset absolute)
    expert: tuple            # (gate, up, down) Tensor of the first sparse layer, offsets relative to the blob
    blob_bytes: int          # the largest layer's blob
    blob_offsets: tuple      # (layers × experts) absolute, 0 for dense layers
    file_size: int
    params: dict = dataclasses.field(default_factory=dict)  # the parameter table (family_params)
    layer_expert: tuple = ()      # (layers) each layer's (gate, up, down) Tensors; () for dense layers
    layer_blob_bytes: tuple = ()  # (layers) each layer's blob length; 0 for dense layers
    paged_bytes: int = 0          # the embedding left on disk: the dense region's tail (docs/vault.md 4.1)
    page_bytes: int = 0

    @property
    def n_blobs(self) -> int:
        return len(self.blob_offsets)

    def blob_offset(self, layer: int, expert: int) -> int:
        return self.blob_offsets[layer * self.config["num_experts"] + expert]


def resolve_formats(formats: dict | None, scale_dtype: str = "f16", group: int = quant.GROUP) -> dict:
    """Role (or exact tensor name, or `experts.gate|up|down`) -> TensorFormat, with the defaults
    filled in. Float formats get group 0 and no scale dtype."""
    raw = dict(DEFAULT_FORMATS)
    raw.update(formats or {})
    out = {}
    for k, v in raw.items():
        tf = v if isinstance(v, TensorFormat) else TensorFormat(v, group, scale_dtype)
        if tf.format not in quant.FORMATS:
            raise ValueError(f"format for {k!r}: {tf.format!r} is not one of {', '.join(quant.FORMATS)}")
        if quant.is_quantized(tf.format):
            sd = tf.scale_dtype or scale_dtype
            if sd not in quant.SCALE_DTYPES:
                raise ValueError(f"scale dtype for {k!r}: {sd!r} is not one of {', '.join(quant.SCALE_DTYPES)}")
            if tf.group not in quant.GROUPS:
                raise ValueError(f"group size for {k!r}: {tf.group} is not one of {', '.join(map(str, quant.GROUPS))}")
            tf = TensorFormat(tf.format, tf.group, sd)
        else:
            tf = TensorFormat(tf.format, 0, None)
        out[k] = tf
    return out


def _sized(name: str, tf: TensorFormat, rows: int, cols: int, offset: int) -> Tensor:
    try:
        n = quant.tensor_nbytes(tf.format, rows, cols, tf.group or quant.GROUP, tf.scale_dtype)
    except ValueError as e:
        raise ValueError(f"{name} ({rows}x{cols}): {e}") from None
    return Tensor(name, tf.format, tf.scale_dtype, rows, cols, offset, n, tf.group)


def compute_layout(cfg: dict, formats: dict | None = None, scale_dtype: str = "f16",
                   group: int = quant.GROUP, paged_embedding: bool = True) -> Layout:
    """Where every byte of a vault of this config goes (docs/vault.md section 5). formats maps
    a role, a dense tensor's name or `experts.gate|up|down` to a format name or a
    TensorFormat; scale_dtype and group are the defaults for q4/q8 entries given by name.
    paged_embedding: an untied embedding goes last in the dense region, read from disk a row at a
    time (4.1); False keeps it in memory like the rest."""
    cfg = normalize_config(cfg)
    _check_limits(cfg)
    if scale_dtype not in quant.SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {quant.SCALE_DTYPES}, got {scale_dtype!r}")
    fmts = resolve_formats(formats, scale_dtype, group)
    sparse = tuple(layer_kinds(cfg))
    shapes = dense_shapes(cfg)
    params = family_params(cfg)
    L, E = cfg["num_hidden_layers"], cfg["num_experts"]
    expert_keys = {f"experts.{p}" for p in EXPERT_PARTS}
    expert_keys |= {f"layers.{l}.experts.{p}" for l in range(L) if sparse[l] for p in EXPERT_PARTS}
    unknown = set(fmts) - set(ROLES) - expert_keys - {n for n, _, _ in shapes}
    if unknown:
        raise ValueError("formats names neither a role nor a tensor: " + ", ".join(sorted(unknown)))
    n_parts = len(EXPERT_PARTS) + (len(EXPERT_BIAS_PARTS) if params["family"] == FAMILIES["gpt_oss"] else 0)

    def fmt_of(name: str) -> TensorFormat:
        return fmts.get(name, fmts[role_of(name)])

    paged = paged_embedding and not cfg["tie_word_embeddings"]
    if paged:  # the embedding last, at a 16 KiB boundary: its pages are the region's tail
        shapes = [s for s in shapes if s[0] != "embed_tokens"] + [s for s in shapes if s[0] == "embed_tokens"]
        name, rows, cols = shapes[-1]
        paged_bytes = align(_sized(name, fmt_of(name), rows, cols, 0).nbytes, quant.ALIGN)
    else:
        paged_bytes = 0
    n_pages = -(-paged_bytes // PAGE_BYTES)
    table_bytes = (CONFIG_BYTES + _PARAMS_HEAD.size + _PARAM.size * len(params) + align(L, 8)
                   + _LAYOUT.size * L + n_parts * DESC_BYTES * sum(sparse) + DESC_BYTES * len(shapes)
                   + BLOB_ENTRY_BYTES * L * E + align(4 * n_pages, 8))
    if table_bytes > MAX_TABLE_BYTES:
        raise ValueError(f"table region of {table_bytes} bytes exceeds 64 MiB")
    dense_offset = align(HEADER_BYTES + table_bytes, BLOB_ALIGN)

    tensors, rel = {}, 0
    for name, rows, cols in shapes:
        tf = fmt_of(name)
        if role_of(name) == "norms" and tf.format not in ("f32", "bf16"):
            raise ValueError(f"{name}: norm vectors must be f32 or bf16, not {tf.format}")
        rel = align(rel, BLOB_ALIGN if paged and name == "embed_tokens" else quant.ALIGN)
        tensors[name] = _sized(name, tf, rows, cols, dense_offset + rel)
        rel += tensors[name].nbytes
    dense_bytes = align(rel, quant.ALIGN)
    assert not paged or dense_bytes - paged_bytes == tensors["embed_tokens"].offset - dense_offset

    h, m = cfg["hidden_size"], cfg["moe_intermediate_size"]

    def blob_layout(l: int) -> tuple:
        expert, off = [], 0
        parts = [("gate", m, h), ("up", m, h), ("down", h, m)]
        if n_parts > 3:
            parts += [("gate_bias", 1, m), ("up_bias", 1, m), ("down_bias", 1, h)]
        for part, rows, cols in parts:
            if part.endswith("_bias"):
                tf = TensorFormat("f32", 0, None)
            else:
                tf = fmts.get(f"layers.{l}.experts.{part}", fmts.get(f"experts.{part}", fmts["experts"]))
            off = align(off, quant.ALIGN)
            expert.append(dataclasses.replace(_sized(f"expert {part}", tf, rows, cols, off), name=part))
            off += expert[-1].nbytes
        return tuple(expert)

    layer_expert = tuple(blob_layout(l) if sparse[l] else () for l in range(L))
    layer_blob_bytes = tuple(align(x[-1].offset + x[-1].nbytes, BLOB_ALIGN) if x else 0 for x in layer_expert)
    first = next((x for x in layer_expert if x), None)
    expert = first if first is not None else blob_layout(0)
    any_sparse = any(sparse)
    blob_bytes = max(layer_blob_bytes) if any_sparse else 0

    pos = align(dense_offset + dense_bytes, BLOB_ALIGN)
    blob_offsets = []
    for l in range(L):
        for _ in range(E):
            if sparse[l]:
                blob_offsets.append(pos)
                pos += layer_blob_bytes[l]
            else:
                blob_offsets.append(0)
    file_size = pos if any_sparse else dense_offset + dense_bytes
    return Layout(cfg, sparse, table_bytes, dense_offset, dense_bytes, tensors, expert,
                  blob_bytes, tuple(blob_offsets), file_size, params, layer_expert, layer_blob_bytes,
                  paged_bytes, PAGE_BYTES if paged_bytes else 0)


def _name_bytes(name: str) -> bytes:
    b = name.encode("ascii")
    if len(b) >= NAME_BYTES:
        raise ValueError(f"tensor name {name!r} longer than {NAME_BYTES - 1} bytes")
    return b.ljust(NAME_BYTES, b"\0")


def checksum(data) -> int:
    """The vault format's checksum (docs/vault.md, "Checksums"): libsmoe's smoe_checksum, a
    4-lane CRC-32C, over any buffer (bytes, bytearray, memoryview, numpy array, mmap)."""
    from ._ffi import ffi, lib  # the binding loads libsmoe; only checksumming needs it here
    with memoryview(data) as view:
        if view.nbytes == 0:
            return int(lib.smoe_checksum(ffi.NULL, 0))
        if not view.c_contiguous:
            return checksum(view.tobytes())
        with view.cast("B") as flat:
            return int(lib.smoe_checksum(ffi.from_buffer(flat), flat.nbytes))


def _desc(t: Tensor, offset: int) -> bytes:
    return _DESC.pack(_name_bytes(t.name), FORMAT_CODE[t.format], SCALE_CODE[t.scale_format],
                      t.group if quant.is_quantized(t.format) else 0, t.rows, t.cols, 0, offset)


def _config_block(cfg: dict) -> bytes:
    flags = (1 if cfg["norm_topk_prob"] else 0) | (2 if cfg["tie_word_embeddings"] else 0)
    b = _CONFIG.pack(cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"],
                     cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
                     cfg["intermediate_size"], cfg["moe_intermediate_size"], cfg["num_experts"],
                     cfg["num_experts_per_tok"], cfg["max_position_embeddings"], flags,
                     cfg["rms_norm_eps"], 0, cfg["rope_theta"])
    return b.ljust(CONFIG_BYTES, b"\0")


# ------------------------------------------------------------------------------------ writer

class VaultWriter:
    """Writes one vault directory. Tensors and blobs may arrive in any order and from several
    threads (each is one pwrite at its own offset); close() finishes the file.

        with VaultWriter(out, config, formats={"experts": "q4"}) as w:
            w.add_dense("embed_tokens", emb)          # quantised per its role
            w.add_expert(0, 3, gate, up, down)        # float arrays
            w.add_expert_raw(0, 4, blob_bytes)        # already laid out
    """

    def __init__(self, out_dir, config: dict, *, formats: dict | None = None, scale_dtype: str = "f16",
                 group: int = quant.GROUP, tokenizer_json: str | None = None,
                 tokenizer_config: dict | None = None, paged_embedding: bool = True):
        self.layout = compute_layout(config, formats, scale_dtype, group, paged_embedding)
        self.config = self.layout.config
        self.scale_dtype = scale_dtype
        self.tokenizer_json = tokenizer_json
        self.tokenizer_config = tokenizer_config
        self.dir = pathlib.Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "vault.bin"
        self._lock = threading.Lock()
        self._dense_done: set[str] = set()
        self._blob_crc: dict[tuple[int, int], int] = {}
        self._closed = False
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(self._fd, self.layout.file_size)  # sparse: untouched padding reads as 0
        except BaseException:
            os.close(self._fd)
            raise

    # -- properties for `pysmoe info` and progress reporting
    @property
    def blob_bytes(self) -> int:
        return self.layout.blob_bytes

    @property
    def file_size(self) -> int:
        return self.layout.file_size

    def format_of(self, name: str) -> str:
        return self.layout.tensors[name].format

    def sparse_layers(self) -> list[int]:
        return [l for l, s in enumerate(self.layout.sparse) if s]

    def missing(self) -> list[str]:
        """What close() would complain about."""
        out = [n for n in self.layout.tensors if n not in self._dense_done]
        E = self.config["num_experts"]
        for l in self.sparse_layers():
            out += [f"expert ({l}, {e})" for e in range(E) if (l, e) not in self._blob_crc]
        return out

    def _describe_missing(self) -> str:
        dense = [n for n in self.layout.tensors if n not in self._dense_done]
        parts = []
        if dense:
            parts.append(", ".join(dense[:12]) + (f" and {len(dense) - 12} more tensors" if len(dense) > 12 else ""))
        E = self.config["num_experts"]
        for l in self.sparse_layers():
            gone = [e for e in range(E) if (l, e) not in self._blob_crc]
            if len(gone) == 1:
                parts.append(f"expert ({l}, {gone[0]})")
            elif gone:
                shown = ", ".join(map(str, gone[:8])) + (", ..." if len(gone) > 8 else "")
                parts.append(f"{len(gone)} experts of layer {l} ({shown})")
        return "; ".join(parts)

    def _pwrite(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            try:
                n = os.pwrite(self._fd, view, offset)
            except OSError as e:  # a full disk says which file it could not write
                raise OSError(e.errno, e.strerror, str(self.path)) from None
            view, offset = view[n:], offset + n

    def _check_open(self):
        if self._closed:
            raise ValueError("VaultWriter is closed")

    # -- dense tensors
    def add_dense(self, name: str, array) -> None:
        """Quantise a float array to the format of name's role and write it."""
        t = self._tensor(name)
        a = np.asarray(array)
        if a.shape != (t.rows, t.cols) and not (t.rows == 1 and a.shape == (t.cols,)):
            raise ValueError(f"{name}: shape {a.shape}, expected ({t.rows}, {t.cols})")
        self.add_dense_raw(name, quant.quantize(a.reshape(t.rows, t.cols), t.format, t.scale_format or "f16",
                                                t.group or quant.GROUP))

    def add_dense_raw(self, name: str, data) -> None:
        """Write a dense tensor's bytes, already in its stored format."""
        self._check_open()
        t = self._tensor(name)
        if memoryview(data).nbytes != t.nbytes:
            raise ValueError(f"{name}: {memoryview(data).nbytes} bytes, {t.format} {t.rows}x{t.cols} is {t.nbytes}")
        with self._lock:
            if name in self._dense_done:
                raise ValueError(f"{name} written twice")
            self._dense_done.add(name)
        self._pwrite(data, t.offset)

    def _tensor(self, name: str) -> Tensor:
        try:
            return self.layout.tensors[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a tensor of this vault") from None

    # -- experts
    def expert_format(self) -> str:
        return self.layout.expert[0].format

    def pack_expert(self, gate, up, down, layer: int | None = None, biases=None, raw=None) -> bytes:
        """Quantise one expert's float matrices into a blob's bytes (unpadded), laid out as
        layer's blobs are (the first sparse layer's when layer is None). biases: (gate_bias, up_bias,
        down_bias) for layouts that hold them (gpt-oss). raw: {part: stored bytes} for matrices given
        as stored in the blob's format (gpt-oss's MXFP4), their float argument None."""
        x = self.layout.expert if layer is None else self.layout.layer_expert[layer]
        buf = bytearray(x[-1].offset + x[-1].nbytes)
        mats = (gate, up, down) + tuple(biases or ())
        if len(mats) != len(x):
            raise ValueError(f"expert: {len(mats)} tensors given, its blobs hold {', '.join(t.name for t in x)}")
        for t, w in zip(x, mats):
            if raw and t.name in raw:
                data = np.asarray(raw[t.name], dtype=np.uint8).reshape(-1)
                if data.nbytes != t.nbytes:
                    raise ValueError(f"expert {t.name}: {data.nbytes} bytes, its {t.format} takes {t.nbytes}")
                buf[t.offset:t.offset + t.nbytes] = data.tobytes()
                continue
            w = np.asarray(w)
            if w.ndim == 1:
                w = w[None, :]
            if w.shape != (t.rows, t.cols):
                raise ValueError(f"expert {t.name}: shape {w.shape}, expected ({t.rows}, {t.cols})")
            buf[t.offset:t.offset + t.nbytes] = quant.quantize(w, t.format, t.scale_format or "f16",
                                                               t.group or quant.GROUP)
        return bytes(buf)

    def add_expert(self, layer: int, expert: int, gate, up, down, biases=None) -> None:
        """Quantise and write one expert: gate, up (moe_inter, hidden), down (hidden, moe_inter);
        biases (gate_bias, up_bias, down_bias) where the layout holds them (gpt-oss)."""
        if not (0 <= layer < len(self.layout.sparse)) or not self.layout.sparse[layer]:
            return self.add_expert_raw(layer, expert, b"")  # its error
        self.add_expert_raw(layer, expert, self.pack_expert(gate, up, down, layer, biases))

    def add_expert_raw(self, layer: int, expert: int, blob) -> None:
        """Write one whole blob laid out as layout.expert says (at most blob_bytes; the rest is
        zero padding)."""
        self._check_open()
        L, E = self.config["num_hidden_layers"], self.config["num_experts"]
        if not (0 <= layer < L and 0 <= expert < E):
            raise IndexError(f"expert ({layer}, {expert}) outside {L} layers x {E} experts")
        if not self.layout.sparse[layer]:
            raise ValueError(f"layer {layer} is a dense layer; it has no experts")
        n, bb = memoryview(blob).nbytes, self.layout.layer_blob_bytes[layer]
        if n > bb:
            raise ValueError(f"blob of {n} bytes, layer {layer}'s blob_bytes is {bb}")
        pad = bb - n
        crc = checksum(bytes(blob) + bytes(pad) if pad else blob)  # over the whole blob, padding included
        with self._lock:
            if (layer, expert) in self._blob_crc:
                raise ValueError(f"expert ({layer}, {expert}) written twice")
            self._blob_crc[(layer, expert)] = crc
        off = self.layout.blob_offset(layer, expert)
        self._pwrite(blob, off)
        if pad:  # the file is sparse, but say it in bytes: a rewritten vault must not leak
            self._pwrite(bytes(pad), off + n)

    # -- finishing
    def _dense_crc(self) -> int:
        n = self.layout.dense_bytes - self.layout.paged_bytes  # a paged embedding has its own (4.1)
        if n == 0:
            return checksum(b"")
        # dense_offset is a 16 KiB multiple, so a valid mmap offset on every platform
        with mmap.mmap(self._fd, n, prot=mmap.PROT_READ, offset=self.layout.dense_offset) as m:
            return checksum(m)

    def _page_crcs(self) -> list[int]:
        lay = self.layout
        if not lay.paged_bytes:
            return []
        start = lay.dense_offset + lay.dense_bytes - lay.paged_bytes  # a 16 KiB multiple
        with mmap.mmap(self._fd, lay.paged_bytes, prot=mmap.PROT_READ, offset=start) as m:
            mv = memoryview(m)
            try:
                return [checksum(mv[k:k + lay.page_bytes]) for k in range(0, lay.paged_bytes, lay.page_bytes)]
            finally:
                mv.release()

    def _tables(self) -> bytes:
        lay, cfg = self.layout, self.config
        L, E = cfg["num_hidden_layers"], cfg["num_experts"]
        parts = [_config_block(cfg), _PARAMS_HEAD.pack(len(lay.params), 0)]
        parts += [_PARAM.pack(k.encode("ascii"), float(v)) for k, v in lay.params.items()]
        attn = layer_attention(cfg)
        parts.append(bytes(int(s) | attn[l] << 1 for l, s in enumerate(lay.sparse)).ljust(align(L, 8), b"\0"))
        for l in range(L):
            x = lay.layer_expert[l]
            parts.append(_LAYOUT.pack(lay.layer_blob_bytes[l], len(x), 0))
            parts += [_desc(t, t.offset) for t in x]
        parts += [_desc(t, t.offset - lay.dense_offset) for t in lay.tensors.values()]
        for l in range(L):
            for e in range(E):
                parts.append(_BLOB.pack(lay.blob_offset(l, e), self._blob_crc.get((l, e), 0), 0))
        pages = self._page_crcs()
        parts.append(struct.pack(f"<{len(pages)}I", *pages).ljust(align(4 * len(pages), 8), b"\0"))
        tables = b"".join(parts)
        assert len(tables) == lay.table_bytes
        return tables

    def _header(self, dense_crc: int, header_crc: int) -> bytes:
        lay, cfg = self.layout, self.config
        h = _HEADER.pack(MAGIC, VERSION, header_crc, lay.file_size, HEADER_BYTES, lay.table_bytes,
                         lay.dense_offset, lay.dense_bytes, dense_crc, len(lay.tensors),
                         lay.blob_bytes, cfg["num_hidden_layers"] * cfg["num_experts"], 0,
                         lay.paged_bytes, lay.page_bytes)
        return h.ljust(HEADER_BYTES, b"\0")

    def close(self) -> None:
        """Check that every tensor and blob was written, then write tables, header and the
        side files. Raises ValueError naming what is missing (the file stays headerless)."""
        if self._closed:
            return
        missing = self.missing()
        if missing:
            raise ValueError("vault incomplete, not written: " + self._describe_missing())
        tables = self._tables()
        dense_crc = self._dense_crc()
        header_crc = checksum(self._header(dense_crc, 0) + tables)
        self._pwrite(tables, HEADER_BYTES)
        self._pwrite(self._header(dense_crc, header_crc), 0)
        os.fsync(self._fd)
        os.close(self._fd)
        self._closed = True
        (self.dir / "config.json").write_text(json.dumps(self.config, indent=2) + "\n")
        if self.tokenizer_json is not None:
            (self.dir / "tokenizer.json").write_text(self.tokenizer_json)
        if self.tokenizer_config is not None:
            (self.dir / "tokenizer_config.json").write_text(json.dumps(self.tokenizer_config, indent=2) + "\n")

    def abort(self) -> None:
        """Give up: close and delete vault.bin."""
        if self._closed:
            return
        self._closed = True
        os.close(self._fd)
        self.path.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __del__(self):
        if not getattr(self, "_closed", True):
            try:
                os.close(self._fd)
            except OSError:
                pass


# ------------------------------------------------------------------------------------ reader

class VaultFormatError(VaultError, ValueError):
    """The pure reader could not make sense of a vault."""


@dataclasses.dataclass(frozen=True)
class Header:
    version: int
    header_crc: int
    file_size: int
    table_offset: int
    table_bytes: int
    dense_offset: int
    dense_bytes: int
    dense_crc: int
    n_tensors: int
    blob_bytes: int
    n_blobs: int
    reserved: int = 0
    paged_bytes: int = 0  # version 4 (docs/vault.md 4.1); 0 before
    page_bytes: int = 0

    @property
    def n_pages(self) -> int:
        return -(-self.paged_bytes // self.page_bytes) if self.paged_bytes else 0


def _parse_desc(raw: bytes, base: int = 0) -> Tensor:
    """A descriptor -> Tensor (offset + base)."""
    name, fmt, sfmt, group, rows, cols, _, off = _DESC.unpack(raw)
    if b"\0" not in name:
        raise VaultFormatError("tensor name not NUL-terminated")
    if fmt not in FORMAT_NAME or sfmt not in SCALE_NAME:
        raise VaultFormatError(f"bad format {fmt}/{sfmt}")
    name = name.split(b"\0", 1)[0].decode("ascii")
    fmt, sfmt = FORMAT_NAME[fmt], SCALE_NAME[sfmt]
    if quant.is_quantized(fmt) and group not in quant.GROUPS:
        raise VaultFormatError(f"tensor {name}: group size {group} (32, 64 or 128)")
    if not quant.is_quantized(fmt) and group:
        raise VaultFormatError(f"tensor {name}: group size {group} on a {fmt} tensor (must be 0)")
    try:
        n = quant.tensor_nbytes(fmt, rows, cols, group or quant.GROUP, sfmt)
    except ValueError as e:
        raise VaultFormatError(f"tensor {name}: {e}") from None
    return Tensor(name, fmt, sfmt, rows, cols, base + off, n, group)


def _config_from_block(b: bytes, sparse: list[bool]) -> dict:
    v = _CONFIG.unpack(b[:_CONFIG.size])
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size",
            "num_experts", "num_experts_per_tok", "max_position_embeddings")
    cfg = dict(zip(keys, v[:11]))
    cfg["norm_topk_prob"] = bool(v[11] & 1)
    cfg["tie_word_embeddings"] = bool(v[11] & 2)
    cfg["rms_norm_eps"] = float(v[12])
    cfg["rope_theta"] = float(v[14])
    cfg["mlp_only_layers"] = [l for l, s in enumerate(sparse) if not s]
    cfg["decoder_sparse_step"] = 1
    return cfg


class VaultFile:
    """A vault opened read-only over np.memmap (pure Python, no libsmoe)."""

    def __init__(self, path):
        p = pathlib.Path(path)
        self.dir = p if p.is_dir() else p.parent
        self.path = self.dir / "vault.bin" if p.is_dir() else p
        st = self.path.stat()
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block the open below
            raise VaultFormatError(f"{self.path} is not a regular file (a FIFO, device or socket); "
                                   "not a pysmoe vault")
        size = st.st_size
        if size < HEADER_BYTES:
            raise VaultFormatError(f"{self.path}: {size} bytes, shorter than a header")
        self.mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        try:
            self._parse(size)
        except VaultError:
            raise
        except (struct.error, ValueError, KeyError, IndexError, OverflowError, TypeError) as e:
            # a field _parse has no explicit check for (a name, a format code, a count) is nonsense
            raise VaultFormatError(f"{self.path}: corrupt header or tables ({type(e).__name__}: {e})") from None

    def _parse(self, size: int) -> None:
        head = bytes(self.mm[:HEADER_BYTES])
        f = _HEADER.unpack(head[:_HEADER.size])
        if f[0] != MAGIC:
            raise VaultFormatError(f"{self.path}: not a pysmoe vault (bad magic)")
        if f[1] == 1:
            raise VaultFormatError(f"{self.path}: vault format version 1 is no longer supported; re-create it "
                                   "with `pysmoe convert` or `pysmoe synth`")
        if f[1] not in READ_VERSIONS:
            raise VaultFormatError(f"{self.path}: vault version {f[1]}, this reader knows "
                                   f"{', '.join(map(str, READ_VERSIONS))}")
        self.header = Header(*f[1:15])
        h = self.header
        if h.file_size != size:
            raise VaultFormatError(f"{self.path}: {size} bytes, header says {h.file_size} (truncated?)")
        if h.table_offset + h.table_bytes > size or h.table_bytes > MAX_TABLE_BYTES:
            raise VaultFormatError("table region outside the file")
        tab = bytes(self.mm[h.table_offset:h.table_offset + h.table_bytes])
        pos = CONFIG_BYTES
        L = _CONFIG.unpack(tab[:_CONFIG.size])[2]
        self.params = {}
        if h.version >= 3:
            n_params, _ = _PARAMS_HEAD.unpack_from(tab, pos)
            pos += _PARAMS_HEAD.size
            for _ in range(n_params):
                key, value = _PARAM.unpack_from(tab, pos)
                key = key.split(b"\0", 1)[0].decode("ascii")
                if key not in PARAM_KEYS:
                    raise VaultFormatError(f"{self.path}: this vault needs a newer pysmoe: unknown parameter {key!r}")
                self.params[key] = value
                pos += _PARAM.size
        kinds = tab[pos:pos + L]
        self.sparse = [bool(b & 1) for b in kinds]
        self.attention_kinds = [b >> 1 for b in kinds]
        linear = ATTN_LINEAR in self.attention_kinds
        if any(bool(self.params.get(k)) != linear for k in LINEAR_KEYS):  # as vault.c's parse_params refuses it
            raise VaultFormatError(f"{self.path}: parameters: the linear_* sizes must be given, all of them, exactly "
                                   f"when a layer is linear attention ({'there is one' if linear else 'there is none'})")
        pos += align(L, 8)
        self.layer_expert_tensors: list[tuple] = []
        self.layer_blob_bytes: list[int] = []
        if h.version >= 3:
            for l in range(L):
                nbytes, n, _ = _LAYOUT.unpack_from(tab, pos)
                pos += _LAYOUT.size
                x = []
                for _ in range(n):
                    x.append(_parse_desc(tab[pos:pos + DESC_BYTES]))
                    pos += DESC_BYTES
                self.layer_expert_tensors.append(tuple(x))
                self.layer_blob_bytes.append(nbytes)
        else:
            x = []
            for _ in range(3):
                x.append(_parse_desc(tab[pos:pos + DESC_BYTES]))
                pos += DESC_BYTES
            self.layer_expert_tensors = [tuple(x) if s else () for s in self.sparse]
            self.layer_blob_bytes = [h.blob_bytes if s else 0 for s in self.sparse]
        first = next((x for x in self.layer_expert_tensors if x), ())
        self.expert_tensors = list(first)
        self.tensors: dict[str, Tensor] = {}
        for _ in range(h.n_tensors):
            t = _parse_desc(tab[pos:pos + DESC_BYTES], h.dense_offset)
            if t.offset + t.nbytes > h.dense_offset + h.dense_bytes:
                raise VaultFormatError(f"tensor {t.name} outside the dense region")
            self.tensors[t.name] = t
            pos += DESC_BYTES
        blobs = np.frombuffer(tab, dtype=np.dtype([("offset", "<u8"), ("crc", "<u4"), ("r", "<u4")]),
                              count=h.n_blobs, offset=pos)
        self.blob_offsets = blobs["offset"].astype(np.int64)
        self.blob_crcs = blobs["crc"].astype(np.int64)
        pos += BLOB_ENTRY_BYTES * h.n_blobs
        self.page_crcs = np.frombuffer(tab, dtype="<u4", count=h.n_pages, offset=pos).astype(np.int64)
        bin_cfg = _config_from_block(tab, self.sparse)
        bin_cfg["model_type"] = self.family
        cj = self.dir / "config.json"
        self.config = normalize_config(json.loads(cj.read_text())) if cj.exists() else bin_cfg
        self.binary_config = bin_cfg

    # -- access
    def raw(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        return self.mm[t.offset:t.offset + t.nbytes]

    def tensor(self, name: str) -> np.ndarray:
        """The dense tensor, dequantised to f32 (rows, cols); vectors come back (cols,)."""
        t = self.tensors[name]
        w = quant.dequantize(self.raw(name), t.format, t.rows, t.cols, t.scale_format, t.group or quant.GROUP)
        return w.reshape(-1) if t.rows == 1 else w

    def layer_is_sparse(self, layer: int) -> bool:
        return self.sparse[layer]

    def blob_offset(self, layer: int, expert: int) -> int:
        return int(self.blob_offsets[layer * self.binary_config["num_experts"] + expert])

    @property
    def family(self) -> str:
        """The model family's name (docs/vault.md 2.2); a version-2 vault is qwen3_moe."""
        return FAMILY_NAME.get(int(self.params.get("family", 0)), "?")

    def blob(self, layer: int, expert: int) -> np.ndarray:
        if not self.sparse[layer]:
            raise ValueError(f"layer {layer} is dense; it has no experts")
        off = self.blob_offset(layer, expert)
        return self.mm[off:off + self.layer_blob_bytes[layer]]

    def expert(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate, up, down) of one expert, dequantised to f32."""
        b = self.blob(layer, expert)
        return tuple(quant.dequantize(b[t.offset:t.offset + t.nbytes], t.format, t.rows, t.cols,
                                      t.scale_format, t.group or quant.GROUP)
                     for t in self.layer_expert_tensors[layer][:3])

    # -- checks
    def verify(self) -> list[str]:
        """Every checksum: the names of the bad regions ([] if all good)."""
        h, bad = self.header, []
        head = bytearray(self.mm[:h.table_offset + h.table_bytes])
        head[12:16] = b"\0\0\0\0"
        if checksum(head) != h.header_crc:
            bad.append("header")
        if _crc(self.mm, h.dense_offset, h.dense_bytes - h.paged_bytes) != h.dense_crc:
            bad.append("dense")
        start = h.dense_offset + h.dense_bytes - h.paged_bytes
        for k, crc in enumerate(self.page_crcs):
            at = start + k * h.page_bytes
            if _crc(self.mm, at, min(h.page_bytes, start + h.paged_bytes - at)) != crc:
                bad.append(f"embedding page {k}")
        E = self.binary_config["num_experts"]
        for i, off in enumerate(self.blob_offsets):
            if self.sparse[i // E] and _crc(self.mm, int(off), self.layer_blob_bytes[i // E]) != self.blob_crcs[i]:
                bad.append(f"blob ({i // E}, {i % E})")
        return bad

    def close(self) -> None:
        """Drop the mapping. It is unmapped when the last array viewing it goes (raw() and
        blob() hand out views); closing the mmap under them would crash numpy."""
        self.mm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _crc(mm: np.ndarray, off: int, n: int) -> int:
    return checksum(mm[off:off + n])


def read_vault(path) -> VaultFile:
    """Open a vault directory (or its vault.bin) with the pure-Python reader."""
    return VaultFile(path)


# -------------------------------------------------------------------------------------- info

def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def info(path) -> str:
    """A human summary of a vault: config, sizes, formats per role."""
    v = read_vault(path)
    try:
        cfg, h = v.config, v.header
        n_sparse = sum(v.sparse)
        E = v.binary_config["num_experts"]
        kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"]  # elements
        context = min(DEFAULT_CONTEXT, cfg["max_position_embeddings"])  # run's, chat's and serve's default
        lines = [f"vault      {v.dir}",
                 f"model      {v.family}: {cfg['num_hidden_layers']} layers "
                 f"({n_sparse} sparse), hidden {cfg['hidden_size']}, vocab {cfg['vocab_size']}",
                 f"attention  {cfg['num_attention_heads']} heads x {cfg['head_dim']}, "
                 f"{cfg['num_key_value_heads']} kv heads, rope_theta {cfg['rope_theta']:g}, "
                 f"max positions {cfg['max_position_embeddings']}",
                 f"experts    {cfg['num_experts']} x {cfg['moe_intermediate_size']}, top-{cfg['num_experts_per_tok']}"
                 f"{' (renormalised)' if cfg['norm_topk_prob'] else ''}; dense MLP {cfg['intermediate_size']}",
                 f"recipe     {_recipe_line(v)}",
                 f"file       {_size(h.file_size)} ({h.file_size} bytes)",
                 f"dense      {_size(h.dense_bytes - h.paged_bytes)} in {h.n_tensors - bool(h.paged_bytes)} "
                 f"tensors (resident)",
                 f"blobs      {n_sparse * E} x {_size(h.blob_bytes)} = {_size(E * sum(v.layer_blob_bytes))}",
                 f"kv cache   {_size(kv_per_token * 4)} per token in f32, {_size(kv_per_token * 2)} in bf16/f16 "
                 f"(a session reserves its whole context: by default {context:,} tokens = "
                 f"{_size(kv_per_token * 4 * context)} in f32)"]
        if h.paged_bytes:
            lines.insert(lines.index(next(x for x in lines if x.startswith("dense"))) + 1,
                         f"embedding  {_size(h.paged_bytes)} on disk, read a row at a time "
                         f"({_size(h.page_bytes)} pages, each checked)")
        lin = [k == ATTN_LINEAR for k in v.attention_kinds]
        if any(lin):
            from .memory import recurrent_state_bytes
            p = v.params
            lines.insert(3, f"linear     {sum(lin)} of {len(lin)} layers Gated DeltaNet: "
                            f"{int(p['linear_num_key_heads'])} q/k heads x {int(p['linear_key_head_dim'])}, "
                            f"{int(p['linear_num_value_heads'])} v heads x {int(p['linear_value_head_dim'])}, "
                            f"conv {int(p['linear_conv_kernel_dim'])}"
                            f"{', v heads tiled' if p.get('linear_value_head_order') else ''}; states + snapshot "
                            f"{_size(recurrent_state_bytes(cfg))} a session")
        def fmt(t: Tensor) -> str:  # q4/g64/bf16, f32
            return t.format + (f"/g{t.group}/{t.scale_format}" if quant.is_quantized(t.format) else "")

        roles: dict[str, set] = {}
        for t in v.tensors.values():
            roles.setdefault(role_of(t.name), set()).add(fmt(t))
        if n_sparse:
            roles["experts"] = {fmt(t) for x in v.layer_expert_tensors for t in x}
        lines.append("formats    " + ", ".join(f"{r} {'+'.join(sorted(roles[r]))}" for r in ROLES if r in roles))
        if n_sparse and len(roles["experts"]) > 1:
            # per part, the formats of every layer (a GGUF mix changes them from layer to layer)
            by_part: dict[str, list] = {}
            for x in v.layer_expert_tensors:
                for t in x:
                    if fmt(t) not in by_part.setdefault(t.name, []):
                        by_part[t.name].append(fmt(t))
            lines.append("experts    " + ", ".join(f"{n} {'+'.join(f)}" for n, f in by_part.items()))
        src = v.dir / "source.json"
        if src.exists():
            try:
                s = json.loads(src.read_text())
                q = s.get("quantization")
                recipe = (", ".join(f"{k} {val}" for k, val in q.items() if not isinstance(val, dict))
                          if isinstance(q, dict) else "none (floats)")
                overrides = sum(isinstance(val, dict) for val in (q or {}).values()) if isinstance(q, dict) else 0
                lines.append(f"source     {s.get('kind')} checkpoint {s.get('path', '')}"
                             f"{' (' + s['dtype'] + ')' if s.get('dtype') else ''}")
                lines.append(f"recipe     {recipe}{f' (+{overrides} per-tensor overrides)' if overrides else ''}")
            except (ValueError, AttributeError, TypeError):
                lines.append("source     source.json unreadable")
        tok = v.dir / "tokenizer.json"
        lines.append(f"tokenizer  {'tokenizer.json' if tok.exists() else 'none'}"
                     f"{', chat template' if _has_chat_template(v.dir) else ''}")
        return "\n".join(lines)
    finally:
        v.close()


def _recipe_line(v: VaultFile) -> str:
    """The family and what of its recipe differs from Qwen3-MoE's, from the parameter table."""
    p, hd = v.params, v.binary_config["head_dim"]
    parts = [v.family]
    qk = int(p.get("qk_norm", QK_NORM_HEAD))
    parts.append({QK_NORM_NONE: "no QK-norm", QK_NORM_HEAD: "QK-norm per head",
                  QK_NORM_WHOLE: "QK-norm over the whole projection"}.get(qk, f"qk_norm {qk}"))
    bias = int(p.get("attention_bias", 0))
    if bias:
        parts.append("q/k/v/o biases" if bias == 2 else "q/k/v biases")
    rot = int(p.get("rotary_dim", hd))
    if rot != hd:
        parts.append(f"RoPE on {rot} of {hd} dims")
    kind = int(p.get("router_kind", ROUTER_SOFTMAX_TOPK))
    if kind == ROUTER_SIGMOID_GROUP:
        g, tg = int(p.get("n_group", 1)), int(p.get("topk_group", 1))
        groups = f", best {tg} of {g} groups" if g > 1 else ""
        parts.append(f"sigmoid router with score bias{groups}, x{p.get('routed_scaling_factor', 1.0):g}")
    elif kind == ROUTER_TOPK_SOFTMAX:
        parts.append("top-k then softmax router")
    else:
        parts.append("softmax router")
    shared = int(p.get("shared_intermediate_size", 0))
    if shared:
        parts.append(f"shared expert {shared}")
    n_sliding = sum(k == ATTN_SLIDING for k in v.attention_kinds)
    if n_sliding:
        parts.append(f"sliding window {int(p.get('sliding_window', 0))} on {n_sliding} of {len(v.attention_kinds)} layers")
    kinds = {k for k in v.attention_kinds if k not in (ATTN_FULL, ATTN_SLIDING)}
    if kinds:
        parts.append("attention kinds " + "+".join(str(k) for k in sorted(kinds)))
    if v.family == "gpt_oss":
        parts.append(f"attention sinks, clamped SwiGLU (limit {p.get('swiglu_limit', 0):g}), expert biases")
    if float(p.get("yarn_factor", 1)) > 1:
        parts.append(f"YaRN x{p['yarn_factor']:g} over {int(p.get('yarn_original_max_position', 0))} positions")
    if v.family not in RUNNABLE_FAMILIES:
        parts.append("(this pysmoe cannot run it)")
    return ", ".join(parts)


def _has_chat_template(d: pathlib.Path) -> bool:
    if (d / "chat_template.jinja").exists():
        return True
    p = d / "tokenizer_config.json"
    if not p.exists():
        return False
    try:
        return bool(json.loads(p.read_text()).get("chat_template"))
    except (ValueError, AttributeError):
        return False
