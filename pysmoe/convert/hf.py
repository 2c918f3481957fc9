"""A Hugging Face Qwen3-MoE checkpoint (safetensors, bf16/f16/f32) → the tensors of a vault.

The checkpoint is a directory with config.json and either model.safetensors or
model.safetensors.index.json plus its shards, read with safetensors_io (no torch). A real
Qwen3-235B-A22B is ~470 GB of bf16, so the converter never holds more than one tensor (or one
expert) in memory:

1. Plan, from the safetensors headers alone (no tensor data is read): every name is mapped to its
   place in the vault and its shape checked against config.json. An unknown tensor, a missing
   one, a duplicate or a wrong shape stops the conversion here, before anything is written, with
   the list of offending names: a weight is never dropped silently.
2. Write: the dense tensors in vault order, then the experts (layer, expert) by (layer, expert),
   each expert's gate, up and down read straight from wherever they lie (the shards stay mapped,
   not loaded) and handed to the writer together, so memory stays at about one expert.

Quantised formats use MLX's affine quantiser (pysmoe.quant), with scales in the source dtype by
default, so a q4 vault made here from the bf16 release holds the codes, scales and biases of
`mlx_lm convert -q` of the same checkpoint.

Expert weights come in two spellings, both accepted (also mixed across layers):

- per expert, as released Qwen checkpoints and transformers' save_pretrained write them:
  `model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`;
- fused, as transformers 5 holds them in memory: `model.layers.L.mlp.experts.gate_up_proj`
  [E, 2·I, H] (rows 0..I-1 are gate, I..2I-1 up: Qwen3MoeExperts does `.chunk(2)` on the output,
  gate first) and `model.layers.L.mlp.experts.down_proj` [E, H, I]. Read one expert at a time.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import SmoeError
from . import qwen_hybrid
from .safetensors_io import DTYPES, FLOATS, Checkpoint, SafetensorsError

# MXFP4: gpt-oss's released format, made from float weights by ggml_blocks.quantize_mxfp4
# (llama.cpp's rule); a released MXFP4 checkpoint's experts are imported as stored instead.
FORMATS = ("q4", "q8", "bf16", "f32", "MXFP4")
# Dense roles that can be given their own format (VaultWriter's roles), and those a single
# `dense` format covers: the router stays f32 (it decides routing and is small), norms f32.
DENSE_ROLES = ("embed", "lm_head", "attention", "mlp", "router", "norms")
DENSE_MATRIX_ROLES = ("embed", "lm_head", "attention", "mlp")
ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM", "Glm4MoeForCausalLM",
                 "GptOssForCausalLM")
MODEL_TYPES = ("qwen3_moe", "mixtral", "olmoe", "glm4_moe", "gpt_oss")

log = logging.getLogger("pysmoe.convert")


class ConvertError(SmoeError, ValueError):
    """The checkpoint cannot be converted: what is wrong is in the message."""


# ---- the source checkpoint ------------------------------------------------------------------


def load_config(hf_dir: Path) -> dict:
    """config.json, checked for what this engine runs, in the normalised spelling."""
    from ..vaultio import normalize_config

    path = hf_dir / "config.json"
    if not path.is_file():
        raise ConvertError(f"{hf_dir}: no config.json (is this a Hugging Face checkpoint directory?)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConvertError(f"{path}: {exc}") from None

    archs = raw.get("architectures") or []
    family = qwen_hybrid.family_of(raw)
    if family is not None:  # Qwen3-Next, Qwen3.5-MoE (its language model)
        try:
            return normalize_config(qwen_hybrid.normalize(raw, family))
        except (KeyError, ValueError, TypeError) as exc:
            raise ConvertError(f"{path}: {exc}") from None
    if not any(a in ARCHITECTURES for a in archs) and raw.get("model_type") not in MODEL_TYPES:
        raise ConvertError(f"{path}: architecture {archs or raw.get('model_type')!r} is not supported; "
                           f"pysmoe runs {', '.join(ARCHITECTURES)}")
    if raw.get("model_type") not in MODEL_TYPES:
        raise ConvertError(f"{path}: model_type {raw.get('model_type')!r} is not one of {', '.join(MODEL_TYPES)}")
    if raw.get("model_type") == "gpt_oss":
        try:  # its own checks (vaultio's normalize_config): layer types, RoPE (yarn or default)
            return normalize_config(raw)
        except (KeyError, ValueError, TypeError) as exc:
            raise ConvertError(f"{path}: {exc}") from None
    if raw.get("model_type") == "qwen3_moe" and raw.get("attention_bias"):
        raise ConvertError(f"{path}: attention_bias=true is not supported (Qwen3-MoE has no attention biases)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConvertError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported (only silu)")
    if raw.get("use_sliding_window"):
        raise ConvertError(f"{path}: use_sliding_window=true is not supported")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
    if rope_type not in ("default", None):
        raise ConvertError(f"{path}: RoPE type {rope_type!r} is not supported (only the default RoPE)")
    try:
        return normalize_config(raw)
    except (KeyError, ValueError, TypeError) as exc:
        raise ConvertError(f"{path}: {exc}") from None


# ---- the plan: every source tensor mapped to its place in the vault --------------------------


@dataclass(frozen=True)
class Source:
    """Where one vault matrix comes from: a tensor of a shard, or one expert's rows of a fused one."""

    file: Path
    name: str
    nbytes: int                # what it occupies in the checkpoint
    expert: int | None = None  # index into the first axis of a fused experts tensor
    rows: slice | None = None  # gate or up half of a fused gate_up_proj
    take: tuple | None = None  # rows taken from a dense tensor (qwen_hybrid: split or regrouped)
    one_plus: bool = False     # stored as 1 + w (qwen_hybrid's (1 + w) RMSNorms)
    shape: tuple | None = None # reshaped to (rows, cols) of the vault (a conv weight's (C, 1, K))

    def __str__(self):
        return self.name if self.expert is None else f"{self.name}[{self.expert}]"


@dataclass
class Plan:
    config: dict
    dense: dict[str, Source]                            # vault name → source, in vault order
    experts: dict[tuple[int, int], dict[str, Source]]   # (layer, expert) → gate/up/down


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
# Mixtral's released spelling: w1 gate, w3 up, w2 down
_EXPERT_W = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight")
_W_PART = {"w1": "gate", "w2": "down", "w3": "up"}
_DENSE_IN_LAYER = {
    "input_layernorm.weight": "input_layernorm",
    "post_attention_layernorm.weight": "post_attention_layernorm",
    "self_attn.q_proj.weight": "q_proj", "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj", "self_attn.o_proj.weight": "o_proj",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "mlp.gate.weight": "router", "block_sparse_moe.gate.weight": "router",
    "self_attn.q_proj.bias": "q_proj.bias", "self_attn.k_proj.bias": "k_proj.bias",
    "self_attn.v_proj.bias": "v_proj.bias", "self_attn.o_proj.bias": "o_proj.bias",
    "mlp.gate.e_score_correction_bias": "router.bias",
    "mlp.shared_experts.gate_proj.weight": "shared.gate_proj", "mlp.shared_experts.up_proj.weight": "shared.up_proj",
    "mlp.shared_experts.down_proj.weight": "shared.down_proj",
    "mlp.gate_proj.weight": "mlp.gate_proj", "mlp.up_proj.weight": "mlp.up_proj",
    "mlp.down_proj.weight": "mlp.down_proj",
}
# Buffers some exporters save that are not weights (recomputed from rope_theta).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq")

# The model-level tensors, outside every layer: HF name -> vault name
_TOP_LEVEL = {"model.embed_tokens.weight": "embed_tokens", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}


def top_level_target(name: str, cfg: dict, hf_dir) -> str | None:
    """The vault name of a model-level tensor (the embedding, the final norm, lm_head); "" for an
    lm_head that tie_word_embeddings leaves unused (said in a warning); None for any other name."""
    target = _TOP_LEVEL.get(name)
    if target == "lm_head" and cfg["tie_word_embeddings"]:
        log.warning("%s: tie_word_embeddings is set, so lm_head.weight is not used "
                    "(transformers ties it to embed_tokens too)", hf_dir)
        return ""
    return target


def _list(names, limit: int = 20) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _read_fp8(hf_dir: Path, ckpt: Checkpoint) -> None:
    """An FP8 release (quantization_config.quant_method "fp8", e4m3 weights with block scales,
    dynamic activation scales: Qwen3-*-FP8, GLM-4.5-FP8) is dequantised while converting: its
    weights read as f32 (safetensors_io), then take the formats asked for like any float weight.
    Any other quantisation method is refused by name."""
    try:
        q = json.loads((hf_dir / "config.json").read_text()).get("quantization_config")
    except (OSError, json.JSONDecodeError, AttributeError):
        return  # load_config reports an unreadable config.json
    if not isinstance(q, dict) or ckpt.fp8 or not q:
        return
    method = q.get("quant_method")
    if method != "fp8":
        if method == "mxfp4":
            return  # gpt-oss's released experts: its planner reads them as stored
        raise ConvertError(f"{hf_dir}: quantization_config.quant_method {method!r} is not supported "
                           "(FP8 releases with quant_method 'fp8' are dequantised; convert others from "
                           "their bf16 checkpoint)")
    if q.get("fmt", "e4m3") != "e4m3" or q.get("activation_scheme", "dynamic") != "dynamic":
        raise ConvertError(f"{hf_dir}: FP8 with fmt {q.get('fmt')!r} and activation_scheme "
                           f"{q.get('activation_scheme')!r} is not supported (only e4m3 with dynamic "
                           "activation scales, as Qwen's and GLM's FP8 releases are)")
    block = q.get("weight_block_size")
    if block is not None and not (isinstance(block, list) and len(block) == 2 and
                                  all(isinstance(b, int) and b > 0 for b in block)):
        raise ConvertError(f"{hf_dir}: quantization_config.weight_block_size {block!r} is not two positive integers")
    try:
        ckpt.dequantize_fp8(tuple(block) if block else None)
    except SafetensorsError as exc:
        raise ConvertError(f"{hf_dir}: {exc}") from None


def open_checkpoint(hf_dir, cfg: dict | None = None, ckpt: Checkpoint | None = None) -> tuple[Path, dict, Checkpoint]:
    """What every family's plan starts from: the folder, its config.json (unless given,
    normalised) and its safetensors headers, checked for tensors stored twice, FP8 weights' block
    scales paired. Reads no tensor data."""
    hf_dir = Path(hf_dir)
    cfg = load_config(hf_dir) if cfg is None else cfg
    if ckpt is None:
        try:
            ckpt = Checkpoint(hf_dir)
        except SafetensorsError as exc:
            raise ConvertError(str(exc)) from None
    if ckpt.duplicates:
        raise ConvertError(f"{hf_dir}: tensors stored more than once: {_list(ckpt.duplicates)}")
    _read_fp8(hf_dir, ckpt)
    return hf_dir, cfg, ckpt


def plan(hf_dir, cfg: dict | None = None, ckpt: Checkpoint | None = None) -> Plan:
    """Read config.json (unless given, normalised) and the safetensors headers; map and check
    every tensor. Reads no tensor data. For every model type but gpt_oss, whose tensors
    gpt_oss.plan maps (convert.plan_checkpoint chooses)."""
    hf_dir, cfg, ckpt = open_checkpoint(hf_dir, cfg, ckpt)
    if cfg.get("model_type") == "gpt_oss":
        raise ConvertError(f"{hf_dir}: a gpt-oss checkpoint: its plan is gpt_oss.plan (convert.plan_checkpoint)")
    not_float = [f"{n} ({t.dtype})" for n, t in ckpt.tensors.items() if not ckpt.is_float(n)]
    if not_float:
        raise ConvertError(f"{hf_dir}: tensors that are not floats (an already quantised "
                           f"checkpoint that is not MLX's?): {_list(not_float)}")
    headers = {n: (t.file, t.shape, np.dtype(DTYPES[t.dtype]).itemsize) for n, t in ckpt.tensors.items()}

    from ..vaultio import dense_shapes, layer_kinds

    # vault name → shape in the checkpoint (norm vectors are 1-D there), in vault order
    want_dense = {n: (cols,) if rows == 1 else (rows, cols) for n, rows, cols in dense_shapes(cfg)}
    L, E, H = cfg["num_hidden_layers"], cfg["num_experts"], cfg["hidden_size"]
    I = cfg["moe_intermediate_size"]
    want_expert = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    sparse = {l for l, is_sparse in enumerate(layer_kinds(cfg)) if is_sparse}

    dense: dict[str, Source] = {}
    experts: dict[tuple[int, int], dict[str, Source]] = {(l, e): {} for l in sorted(sparse) for e in range(E)}
    unknown, bad_shape, twice = [], [], []

    def place(slot: dict, key: str, src: Source) -> None:
        if key in slot:
            twice.append(f"{slot[key]} and {src}")
        slot[key] = src

    hybrid = cfg.get("model_type") in qwen_hybrid.FAMILY_ID
    left_out = []
    for name, (f, shape, itemsize) in headers.items():
        size = itemsize * int(np.prod(shape))
        if hybrid:
            if qwen_hybrid.IGNORED.fullmatch(name):
                left_out.append(name)
                continue
            inner = qwen_hybrid.strip_prefix(name)
            if inner is None:
                unknown.append(name)
                continue
            if ".mlp.experts." not in inner and not inner.endswith(".mlp.gate.weight"):
                if inner == "lm_head.weight" and cfg["tie_word_embeddings"]:
                    log.warning("%s: tie_word_embeddings is set, so lm_head.weight is not used", hf_dir)
                    continue
                _place_hybrid(cfg, name, inner, f, shape, size, want_dense, dense, unknown, bad_shape, place)
                continue
            m = _LAYER.fullmatch("model." + inner)  # experts and routers: as Qwen3-MoE's
        else:
            m = _LAYER.fullmatch(name)
        if (top := top_level_target(name, cfg, hf_dir)) is not None:
            if not top:
                continue
            target = top
        elif _IGNORED.fullmatch(name):
            continue
        elif m and cfg["model_type"] == "glm4_moe" and int(m.group(1)) >= L:
            continue  # GLM's multi-token-prediction layers (num_nextn_predict_layers): transformers drops them too
        elif m and int(m.group(1)) < L:
            l, rest = int(m.group(1)), m.group(2)
            me = _EXPERT.fullmatch(rest)
            mw = _EXPERT_W.fullmatch(rest)
            if mw and l in sparse and int(mw.group(1)) < E:
                part = _W_PART[mw.group(2)]
                if shape != want_expert[part]:
                    bad_shape.append(f"{name} {shape} (want {want_expert[part]})")
                place(experts[(l, int(mw.group(1)))], part, Source(f, name, size))
                continue
            if rest.startswith("block_sparse_moe.experts.") and rest.endswith((".gate_up_proj", ".down_proj")):
                rest = "mlp." + rest[len("block_sparse_moe."):]
            if rest in _DENSE_IN_LAYER:
                target = f"layers.{l}.{_DENSE_IN_LAYER[rest]}"
            elif me and l in sparse and int(me.group(1)) < E:
                if shape != want_expert[me.group(2)]:
                    bad_shape.append(f"{name} {shape} (want {want_expert[me.group(2)]})")
                place(experts[(l, int(me.group(1)))], me.group(2), Source(f, name, size))
                continue
            elif rest == "mlp.experts.gate_up_proj" and l in sparse:
                if shape != (E, 2 * I, H):
                    bad_shape.append(f"{name} {shape} (want {(E, 2 * I, H)})")
                    continue
                for e in range(E):
                    place(experts[(l, e)], "gate", Source(f, name, size // (2 * E), e, slice(0, I)))
                    place(experts[(l, e)], "up", Source(f, name, size // (2 * E), e, slice(I, 2 * I)))
                continue
            elif rest == "mlp.experts.down_proj" and l in sparse:
                if shape != (E, H, I):
                    bad_shape.append(f"{name} {shape} (want {(E, H, I)})")
                    continue
                for e in range(E):
                    place(experts[(l, e)], "down", Source(f, name, size // E, e))
                continue
            else:
                unknown.append(name)
                continue
        else:
            unknown.append(name)
            continue
        if target not in want_dense:  # e.g. a router in a layer config.json says is dense
            unknown.append(name)
            continue
        if shape != want_dense[target]:
            bad_shape.append(f"{name} {shape} (want {want_dense[target]})")
        place(dense, target, Source(f, name, size))

    if left_out:
        log.info("%s: left out (not the language model): %d tensors such as %s", hf_dir, len(left_out),
                 _list(left_out, 3))
    problems = []
    if unknown:
        problems.append(f"tensors this converter does not know what to do with (config.json says "
                        f"{len(sparse)} of {L} layers are sparse, {E} experts): {_list(unknown)}")
    if bad_shape:
        problems.append(f"tensors whose shape does not match config.json: {_list(bad_shape)}")
    if twice:
        problems.append(f"weights given twice: {_list(twice)}")
    missing = [f"{k}" for k in want_dense if k not in dense]
    missing += [f"layers.{l}.experts.{e}.{p}" for (l, e), got in experts.items()
                for p in ("gate", "up", "down") if p not in got]
    if missing:
        problems.append(f"weights missing from the checkpoint: {_list(missing)}")
    if problems:
        raise ConvertError(f"cannot convert {hf_dir}:\n  " + "\n  ".join(problems))
    if ckpt.fp8:  # the vault holds no FP8: its config says nothing of the release's quantisation
        cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    return Plan(cfg, {k: dense[k] for k in want_dense}, experts)


def _place_hybrid(cfg, name, inner, f, shape, size, want_dense, dense, unknown, bad_shape, place) -> None:
    """A Qwen3-Next / Qwen3.5-MoE dense tensor into the vault tensors it becomes (qwen_hybrid)."""
    tg = qwen_hybrid.targets(cfg, inner)
    if tg is None or any(vn not in want_dense for vn, _, _ in tg):
        unknown.append(name)
        return
    src_rows = qwen_hybrid.source_rows(cfg, inner)
    for vn, rows, one_plus in tg:
        want = want_dense[vn]
        r, c = (1, want[0]) if len(want) == 1 else want
        first = src_rows or r
        if int(np.prod(shape)) != first * c or (first > 1 and shape[0] != first):
            bad_shape.append(f"{name} {shape} (want {first} rows of {c} for {vn})")
            return
        take = None if rows is None else tuple(int(i) for i in rows)
        place(dense, vn, Source(f, name, size, take=take, one_plus=one_plus, shape=(r, c)))


# ---- formats --------------------------------------------------------------------------------


def resolve_formats(experts: str = "q4", dense=None) -> dict[str, str]:
    """{role: format} for VaultWriter. `dense` is None (the writer's defaults: q8 matrices, f32
    router and norms), one format for every dense matrix role in DENSE_MATRIX_ROLES (the router
    and the norms keep f32 unless named), or a {role: format} dict over DENSE_ROLES."""
    def check(role, fmt):
        if (fmt if isinstance(fmt, str) else getattr(fmt, "format", None)) not in FORMATS:  # or a TensorFormat
            raise ConvertError(f"unknown format {fmt!r} for {role} (one of {', '.join(FORMATS)})")
        return fmt

    formats = {"experts": check("experts", experts)}
    if dense is None:
        return formats
    if isinstance(dense, str):
        dense = {role: dense for role in DENSE_MATRIX_ROLES}
    for role, fmt in dense.items():
        if role not in DENSE_ROLES:
            raise ConvertError(f"unknown dense role {role!r} (one of {', '.join(DENSE_ROLES)})")
        if fmt is not None:
            formats[role] = check(role, fmt)
    return formats


# ---- conversion -----------------------------------------------------------------------------


def read(ckpt: Checkpoint, src: Source) -> np.ndarray:
    """One vault matrix from the checkpoint, as f32 (bf16/f16 widen exactly); a gpt-oss expert
    part as its Part.read gives it (MXFP4 blocks as stored)."""
    if hasattr(src, "read"):
        return src.read(ckpt)
    if src.expert is None:
        a = ckpt.floats(src.name)
        if src.take is None and not src.one_plus and src.shape is None:
            return a
        rows = None if src.take is None else np.asarray(src.take)
        return qwen_hybrid.transform(a, rows, src.one_plus, src.shape or a.shape)
    a = ckpt.floats(src.name, src.expert if src.rows is None else (src.expert, src.rows))
    return np.ascontiguousarray(a)


def source_dtype(ckpt: Checkpoint, p: Plan) -> str:
    """The float dtype of the checkpoint's expert weights (or its first matrix): what the
    scales of quantised tensors default to, as MLX keeps them."""
    srcs = [s for parts in p.experts.values() for s in parts.values() if not getattr(s, "mxfp4", False)]
    srcs = srcs or list(p.dense.values())
    dt = ckpt.tensors[srcs[0].name].dtype if srcs else "F32"
    return {"BF16": "bf16", "F16": "f16", "F8_E4M3": "bf16"}.get(dt, "f32")
