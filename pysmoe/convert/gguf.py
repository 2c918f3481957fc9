"""`pysmoe convert FILE.gguf OUT`: a llama.cpp GGUF file → a vault, its tensors as stored.

    python -m pysmoe convert Qwen3-30B-A3B-Q4_K_M.gguf vault/
    python -m pysmoe convert Qwen3-235B-A22B-Q4_K_M-00001-of-00003.gguf vault/   # split files

What is read (with gguf-py's reader, numpy only; the `gguf` extra):

- the configuration from the `{arch}.*` metadata, through the family's table entry (FAMILIES:
  llama.cpp's architecture name -> the config.json keys, the tensor names, and the few facts
  llama.cpp fixes in code, e.g. that qwen3moe always renormalises its top-k weights);
- the tokenizer from `tokenizer.ggml.*`, as a tokenizer.json that encodes as llama.cpp does
  (gguf_tokenizer.py), and the chat template from `tokenizer.chat_template`;
- every tensor, kept in its GGML type byte for byte: dense tensors are copied, and each
  expert is cut out of the stacked `blk.N.ffn_{gate,up,down}_exps` tensors (one expert's rows
  are contiguous there) into its 16 KiB-aligned blob. Nothing is requantised.

A tensor type the engine has no kernel for, a tensor name the family does not know, a shape that
disagrees with the metadata: all are found while planning, before anything is written, and the
error names the tensors.
"""
from __future__ import annotations

import dataclasses
import json
import re
import struct
from pathlib import Path

import numpy as np

from .hf import ConvertError

SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ConvertError("converting a GGUF file needs the gguf package: pip install 'pysmoe[gguf]'") from None
    return gguf


# ------------------------------------------------------------------------------------ families

@dataclasses.dataclass(frozen=True)
class Family:
    """How one llama.cpp architecture maps onto a vault."""
    arch: str                   # general.architecture
    model_type: str             # config.json's model_type
    architectures: tuple        # config.json's architectures
    config: dict                # config.json key -> metadata key after "{arch}." (None: optional)
    optional: tuple = ()        # config keys whose metadata may be absent
    fixed: dict = dataclasses.field(default_factory=dict)  # config values llama.cpp fixes in code
    # GGUF name after "blk.N." -> vault name after "layers.N."; "experts.gate" etc. for the
    # stacked experts. Every tensor of the file must be named here (or in GLOBAL_TENSORS).
    layer_tensors: dict = dataclasses.field(default_factory=dict)
    # the family's own reading of the file, after the table's keys: (model, cfg) -> None, in place
    derive: object = None
    # vault tensor suffix -> the config key of its head count, for tensors whose rows llama.cpp's
    # converter permuted per head (undone by unpermuted_rows)
    permuted_rows: dict = dataclasses.field(default_factory=dict)
    rope_scaling: tuple = ()    # rope.scaling.type values the family's derive reads (others refused)
    # GGUF name after "blk.N." -> fn(cfg) -> {vault suffix: rows}: one file tensor cut into several
    # vault tensors by whole rows (Qwen3-Next's attn_q = query and gate rows per head)
    split_rows: dict = dataclasses.field(default_factory=dict)
    # GGUF name after "blk.N." -> (vault suffix, fn(f32 array) -> f32 array): a float vector the
    # converter transformed (Qwen3-Next's ssm_a = −exp(A_log)), transformed back
    f32_values: dict = dataclasses.field(default_factory=dict)


GLOBAL_TENSORS = {"token_embd.weight": "embed_tokens", "output_norm.weight": "norm", "output.weight": "lm_head"}

_QWEN3_LAYER = {
    "attn_norm.weight": "input_layernorm", "attn_q.weight": "q_proj", "attn_k.weight": "k_proj",
    "attn_v.weight": "v_proj", "attn_output.weight": "o_proj", "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm", "ffn_norm.weight": "post_attention_layernorm",
    "ffn_gate_inp.weight": "router", "ffn_gate_exps.weight": "experts.gate",
    "ffn_up_exps.weight": "experts.up", "ffn_down_exps.weight": "experts.down",
    "ffn_gate.weight": "mlp.gate_proj", "ffn_up.weight": "mlp.up_proj", "ffn_down.weight": "mlp.down_proj",
}

FAMILIES = {
    "qwen3moe": Family(
        arch="qwen3moe", model_type="qwen3_moe", architectures=("Qwen3MoeForCausalLM",),
        config={"hidden_size": "embedding_length", "num_hidden_layers": "block_count",
                "max_position_embeddings": "context_length", "intermediate_size": "feed_forward_length",
                "moe_intermediate_size": "expert_feed_forward_length",
                "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
                "head_dim": "attention.key_length", "rms_norm_eps": "attention.layer_norm_rms_epsilon",
                "rope_theta": "rope.freq_base", "num_experts": "expert_count",
                "num_experts_per_tok": "expert_used_count"},
        optional=("intermediate_size", "head_dim", "rope_theta", "num_key_value_heads"),
        # llama.cpp's qwen3moe graph renormalises the top-k weights whatever the checkpoint said
        fixed={"norm_topk_prob": True, "decoder_sparse_step": 1},
        layer_tensors=_QWEN3_LAYER),
}
FAMILIES["olmoe"] = Family(
    arch="olmoe", model_type="olmoe", architectures=("OlmoeForCausalLM",),
    # llama.cpp's olmoe has no expert_feed_forward_length: feed_forward_length is the expert's width
    config={**{k: v for k, v in FAMILIES["qwen3moe"].config.items() if k != "moe_intermediate_size"},
            "moe_intermediate_size": "feed_forward_length"},
    optional=FAMILIES["qwen3moe"].optional,
    # its graph never renormalises the top-k weights; its QK-norm spans the whole projection
    # (the vault's olmoe recipe: the norms' shapes say so)
    fixed={"norm_topk_prob": False, "decoder_sparse_step": 1},
    layer_tensors=_QWEN3_LAYER)


def _glm4moe(model: "GGUFModel", cfg: dict) -> None:
    """GLM-4.5/4.6/Air: what llama.cpp's glm4moe reads beyond the table, and what it decides from
    the tensors present (q/k/v biases, QK-norm). The multi-token-prediction layers llama.cpp's
    converter appends (the last `nextn_predict_layers` blocks, blk.L.nextn.*) are left out, as
    transformers leaves them out."""
    meta, a = model.meta, "glm4moe"
    gating = meta.get(f"{a}.expert_gating_func", 2)
    if gating != 2:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
        raise ConvertError(f"{a}.expert_gating_func {gating}: GLM-4.5's router is sigmoid (2)")
    nextn = int(meta.get(f"{a}.nextn_predict_layers") or 0)
    cfg["num_hidden_layers"] = int(cfg["num_hidden_layers"]) - nextn
    if cfg["num_hidden_layers"] < 1:
        raise ConvertError(f"{a}.block_count {cfg['num_hidden_layers'] + nextn} leaves no layer "
                           f"beside {nextn} multi-token-prediction layers")
    cfg["num_nextn_predict_layers"] = nextn
    cfg["first_k_dense_replace"] = int(meta.get(f"{a}.leading_dense_block_count") or 0)
    cfg["n_shared_experts"] = int(meta.get(f"{a}.expert_shared_count") or 0)
    cfg["n_group"] = int(meta.get(f"{a}.expert_group_count") or 1)
    cfg["topk_group"] = int(meta.get(f"{a}.expert_group_used_count") or 1)
    # llama.cpp: no expert_weights_norm means no renormalising, a scale of 0 means none
    cfg["norm_topk_prob"] = bool(meta.get(f"{a}.expert_weights_norm", False))
    cfg["routed_scaling_factor"] = float(meta.get(f"{a}.expert_weights_scale") or 1.0)
    hd = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    rot = int(meta.get(f"{a}.rope.dimension_count") or hd // 2)
    if not 0 < rot <= hd or rot % 2:
        raise ConvertError(f"{a}.rope.dimension_count {rot} does not fit head_dim {hd}")
    cfg["partial_rotary_factor"] = rot / hd
    cfg["use_qk_norm"] = "blk.0.attn_q_norm.weight" in model.tensors
    cfg["attention_bias"] = "blk.0.attn_q.bias" in model.tensors
    cfg["mlp_only_layers"] = list(range(min(cfg["first_k_dense_replace"], cfg["num_hidden_layers"])))


FAMILIES["glm4moe"] = Family(
    arch="glm4moe", model_type="glm4_moe", architectures=("Glm4MoeForCausalLM",),
    config=FAMILIES["qwen3moe"].config, optional=FAMILIES["qwen3moe"].optional,
    fixed={"decoder_sparse_step": 1},
    layer_tensors={**_QWEN3_LAYER, "attn_q.bias": "q_proj.bias", "attn_k.bias": "k_proj.bias",
                   "attn_v.bias": "v_proj.bias", "post_attention_norm.weight": "post_attention_layernorm",
                   "exp_probs_b.bias": "router.bias", "ffn_gate_shexp.weight": "shared.gate_proj",
                   "ffn_up_shexp.weight": "shared.up_proj", "ffn_down_shexp.weight": "shared.down_proj"},
    derive=_glm4moe)


def _llama(model: "GGUFModel", cfg: dict) -> None:
    """Mixtral as llama.cpp stores it: the `llama` architecture with experts (a dense Llama is not
    a model pysmoe runs). llama.cpp's graph always renormalises the top-k softmax weights."""
    a = "llama"
    if not cfg.get("num_experts"):
        raise ConvertError("a llama-architecture file without experts (llama.expert_count) is a dense Llama/"
                           "Mistral: pysmoe runs Mixture-of-Experts models only")
    scale = model.meta.get(f"{a}.expert_weights_scale")
    if scale not in (None, 0.0, 1.0):
        raise ConvertError(f"{a}.expert_weights_scale {scale}: Mixtral's experts are not scaled")
    hd = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    rot = model.meta.get(f"{a}.rope.dimension_count")
    if rot is not None and int(rot) != hd:
        raise ConvertError(f"{a}.rope.dimension_count {rot}: only RoPE over the whole head ({hd}) is supported")


FAMILIES["llama"] = Family(
    arch="llama", model_type="mixtral", architectures=("MixtralForCausalLM",),
    config=FAMILIES["olmoe"].config, optional=FAMILIES["qwen3moe"].optional + ("num_experts", "num_experts_per_tok"),
    fixed={"norm_topk_prob": True, "decoder_sparse_step": 1},
    layer_tensors={k: v for k, v in _QWEN3_LAYER.items() if k not in ("attn_q_norm.weight", "attn_k_norm.weight")},
    derive=_llama,
    # llama.cpp's converter permutes q and k rows for its interleaved RoPE (LlamaModel.permute):
    # within each head, row 2i+j holds the original row j*hd/2+i. Undone row by row on import.
    permuted_rows={"q_proj": "num_attention_heads", "k_proj": "num_key_value_heads"})


def _gpt_oss(model: "GGUFModel", cfg: dict) -> None:
    """gpt-oss as llama.cpp's `gpt-oss` (openai-moe) reads it: the sliding window on the layers
    its swa pattern names (2 by default: window, full, window, ... as GptOssConfig's layer_types),
    YaRN from rope.scaling.*, and what its graph fixes (the clamped SwiGLU 1.702/7.0, top-k then
    softmax). YaRN's correction range is not truncated: gpt-oss's own definition (its config's
    truncate: false), which transformers follows; ggml's rope always truncates it (floor/ceil)."""
    meta, a = model.meta, "gpt-oss"
    L = int(cfg["num_hidden_layers"])
    cfg["sliding_window"] = int(meta.get(f"{a}.attention.sliding_window") or 0) or None
    pattern = meta.get(f"{a}.attention.sliding_window_pattern", 2)
    if isinstance(pattern, list):
        if len(pattern) < L:
            raise ConvertError(f"{a}.attention.sliding_window_pattern has {len(pattern)} entries for {L} layers")
        swa = [bool(x) for x in pattern[:L]]
    else:  # llama_hparams::set_swa_pattern(n, dense_first=false)
        n = int(pattern)
        swa = [n == 0 or l % n < n - 1 for l in range(L)]
    cfg["layer_types"] = ["sliding_attention" if x else "full_attention" for x in swa]
    base_swa = meta.get(f"{a}.rope.freq_base_swa")
    if base_swa is not None and float(base_swa) != float(cfg.get("rope_theta", 10000.0)):
        raise ConvertError(f"{a}.rope.freq_base_swa {base_swa} differs from rope.freq_base: pysmoe has one RoPE base")
    rope = {"rope_type": "default", "rope_theta": float(cfg.get("rope_theta", 10000.0))}
    kind = meta.get(f"{a}.rope.scaling.type")
    if kind == "yarn":
        for k in ("rope.scaling.yarn_log_multiplier", "rope.scaling.attn_factor"):
            if meta.get(f"{a}.{k}") not in (None, 0.0, 1.0):
                raise ConvertError(f"{a}.{k} {meta[f'{a}.{k}']}: not gpt-oss's YaRN")
        ext = meta.get(f"{a}.rope.scaling.yarn_ext_factor")
        if ext not in (None, 1.0):
            raise ConvertError(f"{a}.rope.scaling.yarn_ext_factor {ext}: only 1 (gpt-oss's) is supported")
        factor = meta.get(f"{a}.rope.scaling.factor")
        orig = meta.get(f"{a}.rope.scaling.original_context_length")
        if not factor or not orig:
            raise ConvertError(f"{a}.rope.scaling.type yarn without its factor and original_context_length")
        rope.update(rope_type="yarn", factor=float(factor), original_max_position_embeddings=int(orig),
                    beta_fast=float(meta.get(f"{a}.rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(meta.get(f"{a}.rope.scaling.yarn_beta_slow", 1.0)), truncate=False)
        af = meta.get(f"{a}.rope.scaling.yarn_attn_factor")
        if af is not None:
            rope["attention_factor"] = float(af)
    elif kind not in (None, "none"):
        raise ConvertError(f"{a}.rope.scaling.type {kind!r}: gpt-oss's RoPE is YaRN or plain")
    cfg["rope_parameters"] = rope
    cfg.pop("rope_theta", None)
    cfg.update(swiglu_alpha=1.702, swiglu_limit=7.0, attention_bias=True)  # fixed in llama.cpp's graph
    cfg["moe_intermediate_size"] = cfg["intermediate_size"]


FAMILIES["gpt-oss"] = Family(
    arch="gpt-oss", model_type="gpt_oss", architectures=("GptOssForCausalLM",),
    config={**{k: v for k, v in FAMILIES["qwen3moe"].config.items()
               if k not in ("moe_intermediate_size", "intermediate_size")},
            "intermediate_size": "expert_feed_forward_length"},
    optional=FAMILIES["qwen3moe"].optional,
    fixed={"decoder_sparse_step": 1},
    layer_tensors={**{k: v for k, v in _QWEN3_LAYER.items()
                      if k not in ("attn_q_norm.weight", "attn_k_norm.weight", "ffn_norm.weight")},
                   "attn_q.bias": "q_proj.bias", "attn_k.bias": "k_proj.bias", "attn_v.bias": "v_proj.bias",
                   "attn_output.bias": "o_proj.bias", "attn_sinks.weight": "sinks",
                   "post_attention_norm.weight": "post_attention_layernorm", "ffn_gate_inp.bias": "router.bias",
                   "ffn_gate_exps.bias": "experts.gate_bias", "ffn_up_exps.bias": "experts.up_bias",
                   "ffn_down_exps.bias": "experts.down_bias"},
    derive=_gpt_oss, rope_scaling=("yarn",))


def _qwen3next(model: "GGUFModel", cfg: dict) -> None:
    """Qwen3-Next as llama.cpp's `qwen3next` reads it: the Gated DeltaNet sizes from ssm.*, the
    layer kinds from attention.recurrent_layers (or full_attention_interval), the shared expert's
    width, partial RoPE; its graph always renormalises the top-k weights. Multi-token-prediction
    layers (nextn_predict_layers) are left out. Qwen3.5-MoE (`qwen35moe`) reads the same keys."""
    meta, a = model.meta, model.arch
    nextn = int(meta.get(f"{a}.nextn_predict_layers") or 0)
    L = int(cfg["num_hidden_layers"]) - nextn
    if L < 1:
        raise ConvertError(f"{a}.block_count leaves no layer beside {nextn} multi-token-prediction layers")
    cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"] = L, nextn
    need = {k: meta.get(f"{a}.ssm.{k}") for k in ("conv_kernel", "state_size", "group_count", "time_step_rank",
                                                   "inner_size")}
    missing = [f"{a}.ssm.{k}" for k, v in need.items() if v is None]
    if missing:
        raise ConvertError("the file's metadata lacks " + ", ".join(missing))
    nv = int(need["time_step_rank"])
    if int(need["inner_size"]) % nv:
        raise ConvertError(f"{a}.ssm.inner_size {need['inner_size']} is not a multiple of time_step_rank {nv}")
    cfg.update(linear_conv_kernel_dim=int(need["conv_kernel"]), linear_key_head_dim=int(need["state_size"]),
               linear_num_key_heads=int(need["group_count"]), linear_num_value_heads=nv,
               linear_value_head_dim=int(need["inner_size"]) // nv)
    rec = meta.get(f"{a}.attention.recurrent_layers")
    if isinstance(rec, list):
        if len(rec) < L:
            raise ConvertError(f"{a}.attention.recurrent_layers has {len(rec)} entries for {L} layers")
        cfg["layer_types"] = ["linear_attention" if x else "full_attention" for x in rec[:L]]
    else:
        cfg["full_attention_interval"] = int(meta.get(f"{a}.full_attention_interval") or 4)
    cfg["shared_expert_intermediate_size"] = int(meta.get(f"{a}.expert_shared_feed_forward_length") or 0)
    hd = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg["partial_rotary_factor"] = int(meta.get(f"{a}.rope.dimension_count") or hd // 4) / hd
    cfg["norm_topk_prob"] = True


def _q_and_gate(cfg: dict) -> dict:
    """attn_q holds per head the query's head_dim rows then the output gate's (as the checkpoint)."""
    n, hd = cfg["num_attention_heads"], cfg["head_dim"]
    base = np.arange(n)[:, None] * 2 * hd
    return {"q_proj": (base + np.arange(hd)).ravel(), "q_gate_proj": (base + hd + np.arange(hd)).ravel()}


def _b_and_a(cfg: dict) -> dict:
    """ssm_ba is the checkpoint's in_proj_ba: per key head [b (r rows) | a (r rows)], r = nv/nk."""
    nk = cfg["linear_num_key_heads"]
    r = cfg["linear_num_value_heads"] // nk
    base = np.arange(nk)[:, None] * 2 * r
    return {"linear.b": (base + np.arange(r)).ravel(), "linear.a": (base + r + np.arange(r)).ravel()}


def _a_log(a: np.ndarray) -> np.ndarray:
    """llama.cpp's converter stores ssm_a = −exp(A_log); the vault keeps A_log: log(−a), in f64
    then rounded to f32 (exp of it gives a back to within an ulp or two, not bit for bit)."""
    return np.log(-a.astype(np.float64)).astype(np.float32)


FAMILIES["qwen3next"] = Family(
    arch="qwen3next", model_type="qwen3_next", architectures=("Qwen3NextForCausalLM",),
    config=FAMILIES["qwen3moe"].config, optional=FAMILIES["qwen3moe"].optional,
    fixed={"decoder_sparse_step": 1},
    layer_tensors={**{k: v for k, v in _QWEN3_LAYER.items() if k != "ffn_norm.weight"},
                   "post_attention_norm.weight": "post_attention_layernorm",
                   "ffn_gate_shexp.weight": "shared.gate_proj", "ffn_up_shexp.weight": "shared.up_proj",
                   "ffn_down_shexp.weight": "shared.down_proj", "ffn_gate_inp_shexp.weight": "shared_gate",
                   "attn_qkv.weight": "linear.qkv", "attn_gate.weight": "linear.z",
                   "ssm_conv1d.weight": "linear.conv", "ssm_dt.bias": "linear.dt_bias",
                   "ssm_norm.weight": "linear.norm", "ssm_out.weight": "linear.out"},
    derive=_qwen3next,
    split_rows={"attn_q.weight": _q_and_gate, "ssm_ba.weight": _b_and_a},
    f32_values={"ssm_a": ("linear.A_log", _a_log)})


def _qwen35moe(model: "GGUFModel", cfg: dict) -> None:
    """Qwen3.5/3.6-MoE as llama.cpp's `qwen35moe` reads it: Qwen3-Next's keys (every layer sparse),
    and its converter's value-head order. That converter (conversion/qwen.py,
    _LinearAttentionVReorderBase) moves the value heads from grouped order (v head j reads key head
    j / r, r = v/k heads) to tiled order (j reads key head j mod k) in everything per value head:
    the v rows of attn_qkv and conv1d, attn_gate's rows, ssm_beta/ssm_alpha's rows, ssm_a, ssm_dt,
    and ssm_out's *columns*. A column permutation of block-quantised rows cannot be undone byte for
    byte, so the vault keeps the file's order and says so (`linear_value_head_order` tiled, vault
    parameter 1): the recipe's DeltaNet then pairs v head j with key head j mod k. Its
    rope.dimension_sections (interleaved MRoPE) rotate text positions as plain partial RoPE."""
    _qwen3next(model, cfg)
    if cfg["linear_num_value_heads"] != cfg["linear_num_key_heads"]:  # (equal: the orders are one)
        cfg["linear_value_head_order"] = "tiled"


FAMILIES["qwen35moe"] = dataclasses.replace(
    FAMILIES["qwen3next"], arch="qwen35moe", model_type="qwen3_5_moe", architectures=("Qwen3_5MoeForCausalLM",),
    layer_tensors={**FAMILIES["qwen3next"].layer_tensors, "ssm_beta.weight": "linear.b", "ssm_alpha.weight": "linear.a"},
    derive=_qwen35moe, split_rows={"attn_q.weight": _q_and_gate})
NOT_YET: dict = {}  # architectures pysmoe runs from safetensors but not yet from llama.cpp's files, and why


# ------------------------------------------------------------------------------------ reading

@dataclasses.dataclass(frozen=True)
class GTensor:
    """One tensor of the file(s): its GGML type, its shape as (rows, cols) or (experts, rows,
    cols), and where its bytes lie."""
    name: str
    type: int          # ggml_type
    shape: tuple       # outermost first (numpy order)
    data: np.ndarray   # uint8 view of its bytes (a memmap)

    @property
    def type_name(self) -> str:
        return _gguf().GGMLQuantizationType(self.type).name


def split_paths(path: Path) -> list[Path]:
    """The files of a (possibly split) GGUF model, first to last; all must exist."""
    m = SPLIT_RE.match(path.name)
    if not m:
        return [path]
    n = int(m["n"])
    if n < 1:
        raise ConvertError(f"{path}: split count {n}")
    paths = [path.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise ConvertError(f"{path}: split files missing: {', '.join(missing)}")
    return paths


def _text(field, i) -> str:
    try:
        return bytes(field.parts[i]).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConvertError(f"metadata {field.name}: a string that is not UTF-8 ({exc.reason})") from None


def _field_value(field):
    """A metadata field as a Python value (str, int, float, bool, list)."""
    gguf = _gguf()
    t = field.types[0] if field.types else None
    if t == gguf.GGUFValueType.ARRAY:
        sub = field.types[1] if len(field.types) > 1 else None
        if sub == gguf.GGUFValueType.STRING:
            return [_text(field, i) for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if t == gguf.GGUFValueType.STRING:
        return _text(field, field.data[0])
    v = field.parts[field.data[0]].tolist()[0]
    return bool(v) if t == gguf.GGUFValueType.BOOL else v


class GGUFModel:
    """The metadata and tensors of one GGUF model (one file or a split set), memory-mapped."""

    def __init__(self, path):
        gguf = _gguf()
        path = Path(path).expanduser()
        if not path.is_file():
            raise ConvertError(f"{path}: no such file")
        self.paths = split_paths(path)
        self.meta: dict = {}
        self.tensors: dict[str, GTensor] = {}
        for i, p in enumerate(self.paths):
            try:
                r = gguf.GGUFReader(p, "r")
            except (ValueError, OSError, struct.error, IndexError, KeyError) as exc:
                raise ConvertError(f"{p}: not a readable GGUF file ({exc})") from None
            meta = {k: _field_value(f) for k, f in r.fields.items() if not k.startswith("GGUF.")}
            if i == 0:
                self.meta = meta
            for t in r.tensors:
                if t.name in self.tensors:
                    raise ConvertError(f"{p}: tensor {t.name} appears twice")
                shape = tuple(int(x) for x in reversed(t.shape.tolist()))
                raw = r.data[t.data_offset:t.data_offset + int(t.n_bytes)]
                if raw.nbytes != int(t.n_bytes):
                    raise ConvertError(f"{p}: tensor {t.name} runs past the end of the file (truncated?)")
                self.tensors[t.name] = GTensor(t.name, int(t.tensor_type), shape, raw)
        n = self.meta.get("split.count")
        if n is not None and int(n) != len(self.paths):
            raise ConvertError(f"{path}: split.count says {n} files; give the first, "
                               f"named like NAME-00001-of-{int(n):05d}.gguf")
        self.arch = self.meta.get("general.architecture")


# ------------------------------------------------------------------------------------ planning

def supported_types() -> dict[int, str]:
    """ggml_type -> vault format name, for every GGML type this build's vault writer knows."""
    from .. import quant
    gguf = _gguf()
    out = {}
    for t in gguf.GGMLQuantizationType:
        # F32 and BF16 are the vault's own f32/bf16 (same bytes); the block types keep ggml's names
        name = {"F32": "f32", "BF16": "bf16"}.get(t.name, t.name)
        if name in quant.FORMATS:
            out[int(t)] = name
    return out


@dataclasses.dataclass
class Plan:
    family: Family
    config: dict
    dense: dict            # vault name -> GTensor
    experts: dict          # layer -> {"gate"|"up"|"down": GTensor (E, rows, cols)}
    formats: dict          # vault name / "experts.part" -> format name
    row_order: dict = dataclasses.field(default_factory=dict)  # vault name -> rows to take, in order
    values: dict = dataclasses.field(default_factory=dict)     # vault name -> f32 array written instead


def _config(model: GGUFModel, fam: Family) -> dict:
    meta, arch = model.meta, fam.arch
    cfg = {"architectures": list(fam.architectures), "model_type": fam.model_type}
    missing = []
    for key, mkey in fam.config.items():
        v = meta.get(f"{arch}.{mkey}")
        if v is None:
            if key not in fam.optional:
                missing.append(f"{arch}.{mkey}")
            continue
        if isinstance(v, list):  # per-layer values (some files write head_count_kv so)
            if len(set(v)) != 1:
                raise ConvertError(f"{arch}.{mkey} differs between layers ({sorted(set(v))}); "
                                   "pysmoe needs one value")
            v = v[0]
        if isinstance(v, float) and float(np.float32(v)) == v:
            v = float(str(np.float32(v)))  # an f32 field: 1e-06, not 9.999999974752427e-07
        cfg[key] = v
    if missing:
        raise ConvertError("the file's metadata lacks " + ", ".join(missing))
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none") + fam.rope_scaling:
        raise ConvertError(f"{arch}.rope.scaling.type {scaling!r}: only plain RoPE is supported")
    vlen = meta.get(f"{arch}.attention.value_length")
    if vlen is not None and "head_dim" in cfg and vlen != cfg["head_dim"]:
        raise ConvertError(f"attention.key_length {cfg['head_dim']} != value_length {vlen}")
    if "head_dim" not in cfg:
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    if "num_key_value_heads" not in cfg:
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    cfg.setdefault("rope_theta", 10000.0)
    cfg.update(fam.fixed)
    if fam.derive is not None:
        fam.derive(model, cfg)
    emb = model.tensors.get("token_embd.weight")
    if emb is None:
        raise ConvertError("the file has no token_embd.weight")
    cfg["vocab_size"] = emb.shape[0]
    cfg["tie_word_embeddings"] = "output.weight" not in model.tensors
    L = int(cfg["num_hidden_layers"])
    if "mlp_only_layers" not in cfg:
        sparse = [f"blk.{l}.ffn_gate_inp.weight" in model.tensors for l in range(L)]
        cfg["mlp_only_layers"] = [l for l in range(L) if not sparse[l]]
    cfg.setdefault("intermediate_size", cfg["moe_intermediate_size"])
    for k in ("bos", "eos", "padding"):
        i = meta.get(f"tokenizer.ggml.{k}_token_id")
        if i is not None:
            cfg[{"padding": "pad"}.get(k, k) + "_token_id"] = int(i)
    return cfg


def plan(model: GGUFModel, check_types: bool = True) -> Plan:
    """Everything the conversion will do, checked: ConvertError before any byte is written.
    check_types=False plans a file whose tensor types this build cannot run (for inspection;
    its formats then name the GGML types)."""
    from ..vaultio import dense_shapes, normalize_config

    fam = FAMILIES.get(model.arch)
    if fam is None and model.arch in NOT_YET:
        raise ConvertError(f"GGUF architecture {model.arch!r}: {NOT_YET[model.arch]}")
    if fam is None:
        raise ConvertError(f"GGUF architecture {model.arch!r} is not supported "
                           f"(supported: {', '.join(sorted(FAMILIES))})")
    try:
        cfg = normalize_config(_config(model, fam))
    except ValueError as exc:
        raise ConvertError(f"GGUF metadata: {exc}") from None
    L, E = cfg["num_hidden_layers"], cfg["num_experts"]
    H, I = cfg["hidden_size"], cfg["moe_intermediate_size"]
    dense, experts, unknown, row_order, values = {}, {}, [], {}, {}
    extra = L + int(cfg.get("num_nextn_predict_layers") or 0)  # layers llama.cpp keeps, pysmoe not
    for name, t in model.tensors.items():
        if name in GLOBAL_TENSORS:
            dense[GLOBAL_TENSORS[name]] = t
            continue
        m = re.match(r"^blk\.(\d+)\.(.+)$", name)
        if m and L <= int(m[1]) < extra:
            continue  # a multi-token-prediction layer: not part of the model's forward
        if m and int(m[1]) < L and m[2] in fam.split_rows:
            for part, rows in fam.split_rows[m[2]](cfg).items():
                dense[f"layers.{m[1]}.{part}"] = t
                row_order[f"layers.{m[1]}.{part}"] = rows
            continue
        if m and int(m[1]) < L and m[2] in fam.f32_values:
            part, fn = fam.f32_values[m[2]]
            if t.type != 0:
                unknown.append(f"{name} ({t.type_name}; pysmoe reads it as F32 only)")
                continue
            dense[f"layers.{m[1]}.{part}"] = t
            values[f"layers.{m[1]}.{part}"] = fn(np.frombuffer(t.data.tobytes(), np.float32))
            continue
        role = fam.layer_tensors.get(m[2]) if m and int(m[1]) < L else None
        if role is None:
            unknown.append(name)
        elif role.startswith("experts."):
            experts.setdefault(int(m[1]), {})[role.split(".")[1]] = t
        else:
            dense[f"layers.{m[1]}.{role}"] = t
    per_expert = [n for n in unknown if re.match(r"^blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight$", n)]
    if per_expert:
        raise ConvertError("experts stored one tensor each (" + _names(per_expert, 3) + "): llama.cpp's format "
                           "before its stacked ffn_*_exps (2024); re-convert with a current llama.cpp, or convert "
                           "the Hugging Face checkpoint")
    if unknown:
        raise ConvertError(f"tensors pysmoe does not know for {fam.arch}: " + _names(unknown))
    problems = []
    want = {n: (r, c) for n, r, c in dense_shapes(cfg)}
    for n in want:
        if n not in dense:
            problems.append(f"{n} missing")
    for n, t in dense.items():
        if n not in want:
            problems.append(f"{t.name}: not expected in this model")
        elif (_matrix(t.shape) if n not in row_order else (len(row_order[n]), t.shape[-1])) != want[n]:
            problems.append(f"{t.name}: shape {t.shape}, expected {want[n]}")
    sparse = [l for l in range(L) if l not in cfg["mlp_only_layers"]]
    shapes = {"gate": (E, I, H), "up": (E, I, H), "down": (E, H, I)}
    if cfg["model_type"] == "gpt_oss":  # each expert's biases ride in its blob, as f32 rows
        shapes.update(gate_bias=(E, I), up_bias=(E, I), down_bias=(E, H))
    for l in sparse:
        parts = experts.get(l, {})
        for p, shape in shapes.items():
            gname = f"blk.{l}.ffn_{p.split('_')[0]}_exps." + ("bias" if p.endswith("_bias") else "weight")
            if p not in parts:
                problems.append(f"{gname} missing")
            elif parts[p].shape != shape:
                problems.append(f"{parts[p].name}: shape {parts[p].shape}, expected {shape}")
            elif p.endswith("_bias") and parts[p].type != 0:
                problems.append(f"{parts[p].name}: {parts[p].type_name}, expected F32")
    for l in experts:
        if l not in sparse:
            problems.append(f"blk.{l}: stacked experts in a layer without a router")
    if problems:
        raise ConvertError("the GGUF file does not fit its metadata: " + _names(problems))

    types = supported_types()
    refused = [f"{t.name} ({t.type_name})" for t in _all(dense, experts) if t.type not in types]
    if not check_types:
        types = {t.type: types.get(t.type, t.type_name) for t in _all(dense, experts)}
    elif refused:
        raise ConvertError("tensor types this build cannot run: " + _names(refused)
                           + f" (supported: {', '.join(sorted(_gguf().GGMLQuantizationType(t).name for t in types))})")
    formats = {n: types[t.type] for n, t in dense.items()}
    for l, parts in experts.items():
        for p, t in parts.items():
            if not p.endswith("_bias"):  # the biases are the blob's f32 rows, not a format choice
                formats[f"experts.{l}.{p}"] = types[t.type]
    for n in dense:
        key = fam.permuted_rows.get(n.rsplit(".", 1)[-1]) if n.startswith("layers.") else None
        if key is not None:
            row_order[n] = unpermuted_rows(dense[n].shape[0], int(cfg[key]))
    return Plan(fam, cfg, dense, experts, formats, row_order, values)


def _matrix(shape: tuple) -> tuple:
    return (1, shape[0]) if len(shape) == 1 else tuple(shape)


def unpermuted_rows(n_rows: int, n_head: int) -> np.ndarray:
    """For each original row, the row of llama.cpp's permuted tensor that holds it: in each head of
    hd rows, llama.cpp's row 2i+j is the original row j*hd/2+i (convert_hf_to_gguf's
    LlamaModel.permute). A permutation of whole rows: block-quantised rows move intact."""
    hd = n_rows // n_head
    return np.arange(n_rows).reshape(n_head, hd // 2, 2).transpose(0, 2, 1).reshape(-1)


def dense_bytes(p: "Plan", name: str) -> np.ndarray:
    """The bytes the vault stores for dense tensor name: the file's, rows reordered where the
    family's converter permuted them."""
    if name in p.values:
        return p.values[name].view(np.uint8)
    t = p.dense[name]
    order = p.row_order.get(name)
    if order is None:
        return t.data
    return t.data.reshape(t.shape[0], -1)[order].reshape(-1)


def _all(dense, experts):
    yield from dense.values()
    for parts in experts.values():
        yield from parts.values()


def _names(items: list[str], k: int = 12) -> str:
    return ", ".join(items[:k]) + (f" and {len(items) - k} more" if len(items) > k else "")


def expert_bytes(t: GTensor, e: int) -> np.ndarray:
    """Expert e's rows of a stacked (E, rows, cols) tensor: a contiguous slice of its bytes."""
    n = t.data.nbytes // t.shape[0]
    return t.data[e * n:(e + 1) * n]


# ------------------------------------------------------------------------------------ writing

def _vault_formats(p: Plan) -> dict:
    """The VaultWriter's formats: every dense tensor by name, the experts by layer and part
    (`layers.L.experts.gate`: a vault v3 blob layout per layer, as llama.cpp's mixes need)."""
    formats = {n: fmt for n, fmt in p.formats.items() if not n.startswith("experts.")}
    for l, parts in p.experts.items():
        for part in parts:
            if not part.endswith("_bias"):
                formats[f"layers.{l}.experts.{part}"] = p.formats[f"experts.{l}.{part}"]
    return formats


def _type_counts(p: Plan) -> dict:
    counts: dict[str, int] = {}
    for t in _all(p.dense, p.experts):
        counts[t.type_name] = counts.get(t.type_name, 0) + 1
    return dict(sorted(counts.items()))


def convert_gguf(src, out_dir, progress: bool = True, force: bool = False, paged_embedding: bool = True) -> Path:
    """Convert the GGUF model at src (one file, or the first of a split set) into a vault at
    out_dir (paged_embedding: as convert_checkpoint's). Raises ConvertError before writing anything
    when it cannot be converted."""
    from ..progress import Progress
    from ..vaultdir import staged
    from ..vaultio import VaultWriter
    from . import gguf_tokenizer as tok

    src, out_dir = Path(src).expanduser(), Path(out_dir).expanduser()
    model = GGUFModel(src)
    p = plan(model)
    try:
        tokenizer = tok.tokenizer_json(model.meta)
    except tok.TokenizerError as exc:
        raise ConvertError(f"{src}: {exc}") from None
    formats = _vault_formats(p)
    from ..vaultio import compute_layout
    try:
        compute_layout(p.config, formats, paged_embedding=paged_embedding)
    except ValueError as exc:
        raise ConvertError(f"{src}: {exc}") from None
    total = sum(t.data.nbytes for t in _all(p.dense, p.experts))
    with staged(out_dir, force) as target:
        with VaultWriter(target, p.config, formats=formats, tokenizer_json=tokenizer,
                         tokenizer_config=tok.tokenizer_config(model.meta), paged_embedding=paged_embedding) as w:
            with Progress(total, "convert", unit="B", enabled=progress) as bar:
                for name, t in p.dense.items():
                    w.add_dense_raw(name, dense_bytes(p, name))
                    bar.update(t.data.nbytes)
                for l in sorted(p.experts):
                    lay = w.layout.layer_expert[l]
                    end = lay[-1].offset + lay[-1].nbytes
                    parts = p.experts[l]
                    for e in range(p.config["num_experts"]):
                        blob = bytearray(end)
                        for t in lay:
                            blob[t.offset:t.offset + t.nbytes] = expert_bytes(parts[t.name], e).tobytes()
                        w.add_expert_raw(l, e, blob)
                    bar.update(sum(t.data.nbytes for t in parts.values()))
        gen = tok.generation_config(model.meta)
        if gen:
            (target / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        source = {"kind": "gguf", "path": str(model.paths[0].resolve()), "files": len(model.paths),
                  "architecture": model.arch,
                  "quantization": {"ggml types": ", ".join(f"{k} x{v}" for k, v in _type_counts(p).items())}}
        if model.meta.get("general.name"):
            source["name"] = model.meta["general.name"]
        (target / "source.json").write_text(json.dumps(source, indent=2) + "\n")
    return out_dir
