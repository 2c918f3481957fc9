"""An MLX checkpoint (what `mlx_lm convert` writes, and mlx-community uploads) → a vault.

MLX keeps Hugging Face's tensor names for everything but the experts, which it stacks per layer:

    model.layers.L.mlp.switch_mlp.{gate,up,down}_proj.weight   [E, out, in]      (floats) or
    model.layers.L.mlp.switch_mlp.{gate,up,down}_proj.{weight,scales,biases}    (quantised)

gpt-oss keeps them as `model.layers.L.mlp.experts.{gate,up,down}_proj.{weight,scales,bias}` (the
released MXFP4 experts in MLX's mxfp4 mode, or affine), and Qwen3.5-MoE's language model is under
`language_model.model.` (its head `language_model.lm_head`).

A quantised module (any of them: embeddings, attention, lm_head, the router `mlp.gate`, the
experts) has `weight` as u32 words [.., out, in·bits/32] (q4: element c at bits 4·(c%8) of word
c/8; q8: byte c%4 of word c/4 — both exactly the vault's byte order), and `scales`, `biases`
[.., out, in/G] in the source dtype. config.json's `quantization` gives the default
{group_size, bits, mode} and per-module overrides (`"model.layers.0.mlp.gate": {"bits": 8,
...}`, or `false` for a module left in floats). Bits are also read off the shapes, and the two
must agree. A module's own entry in `quantization` that names no mode is affine (what mlx's
nn.quantize does with it), whatever the default mode.

MLX's mxfp4 mode (gpt-oss's experts as mlx-lm imports the release) keeps the released blocks as
u32 words — the same bytes as the Hugging Face `*_blocks` — and their E8M0 scale bytes: they are
re-paired into the vault's MXFP4 (format 71) as pysmoe/convert/gpt_oss.py does for the release,
nothing requantised.

The hybrids (Qwen3-Next, Qwen3.5-MoE) are imported with the same row moves as their Hugging Face
checkpoints (pysmoe/convert/qwen_hybrid.py): a quantised matrix's rows are independent (its groups
run along a row), so taking rows of its codes, scales and biases is exact. mlx-lm stores their
(1 + w) norms already as 1 + w, which is what the vault holds, so they are copied as stored.

Every quantised tensor is copied as stored: codes, scales and biases byte for byte, in the
vault format that matches (q4/q8, its group size, its scale dtype). Unquantised tensors keep
their float format (f16, which the vault lacks, widens exactly to f32) unless the caller asks
for another. What the vault cannot hold — 2/3/5/6-bit, the nvfp4/mxfp8 modes, mxfp4 outside the
experts, experts of one projection stored differently in different layers — is refused while
planning, before anything is written, with the tensors and the recipe named.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import quant
from ..vaultio import TensorFormat, dense_shapes, layer_kinds
from .hf import ConvertError, _list, load_config
from .safetensors_io import FLOATS, Checkpoint

SWITCH = re.compile(r"(?:language_model\.)?model\.layers\.(\d+)\.(?:(?:mlp|block_sparse_moe)\.switch_mlp|mlp\.experts)"
                    r"\.(gate|up|down)_proj\.(weight|scales|biases)")
HYBRIDS = ("qwen3_next", "qwen3_5_moe")


def switch_module(cfg: dict, layer: int, part: str, prefix: str = "model.") -> str:
    """The stacked experts' module of a layer in mlx-lm's checkpoints of this family."""
    if cfg.get("model_type") == "gpt_oss":
        return f"{prefix}layers.{layer}.mlp.experts.{part}_proj"
    block = "block_sparse_moe" if cfg.get("model_type") == "mixtral" else "mlp"
    return f"{prefix}layers.{layer}.{block}.switch_mlp.{part}_proj"


def model_prefix(ckpt: Checkpoint) -> str:
    """Where the language model's tensors are: `model.`, or `language_model.model.` (mlx-lm's
    Qwen3.5-MoE, whose model wraps a language model)."""
    return "language_model.model." if any(n.startswith("language_model.model.") for n in ckpt.tensors) \
        else "model."


_SCALE = {"BF16": "bf16", "F16": "f16", "F32": "f32"}
_VAULT_FLOAT = {"BF16": "bf16", "F32": "f32", "F16": "f32", "F64": "f32"}


def is_mlx(ckpt_dir: Path, ckpt: Checkpoint) -> bool:
    """An MLX checkpoint: config.json declares a quantisation, or the experts are stacked."""
    try:
        raw = json.loads((Path(ckpt_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        raw = {}
    return "quantization" in raw or any(SWITCH.fullmatch(n) for n in ckpt.tensors)


def _hf_name(vault_name: str, cfg: dict) -> tuple[str, str]:
    """The checkpoint module of a vault dense tensor and the leaf that holds it ("weight" for a
    matrix, quantised or not; "bias" or "e_score_correction_bias" for a float vector)."""
    oss = cfg.get("model_type") == "gpt_oss"
    if oss and vault_name.endswith((".sinks", ".router", ".router.bias")):
        _, l, rest = vault_name.split(".", 2)
        return ((f"model.layers.{l}.self_attn", "sinks") if rest == "sinks" else
                (f"model.layers.{l}.mlp.router", "weight" if rest == "router" else "bias"))
    if vault_name == "embed_tokens":
        return "model.embed_tokens", "weight"
    if vault_name == "norm":
        return "model.norm", "weight"
    if vault_name == "lm_head":
        return "lm_head", "weight"
    _, l, rest = vault_name.split(".", 2)
    attn = {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}
    if rest.endswith(".bias") and rest[:-5] in attn:
        return f"model.layers.{l}.self_attn.{rest[:-5]}", "bias"
    if rest in attn:
        return f"model.layers.{l}.self_attn.{rest}", "weight"
    block = "block_sparse_moe" if cfg.get("model_type") == "mixtral" else "mlp"
    if rest == "router":
        return f"model.layers.{l}.{block}.gate", "weight"
    if rest == "router.bias":
        return f"model.layers.{l}.mlp.gate", "e_score_correction_bias"
    if rest.startswith("shared."):
        return f"model.layers.{l}.mlp.shared_experts.{rest[7:]}", "weight"
    return f"model.layers.{l}.{rest}", "weight"  # input_layernorm, post_attention_layernorm, mlp.*_proj


# A hybrid's source tensors below its prefix: every name its layers may hold (both families'
# spellings; those the checkpoint lacks are simply not sources).
_HYBRID_LAYER = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                 "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                 "self_attn.q_norm.weight", "self_attn.k_norm.weight", "linear_attn.in_proj_qkvz.weight",
                 "linear_attn.in_proj_ba.weight", "linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
                 "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight", "linear_attn.conv1d.weight",
                 "linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.norm.weight",
                 "linear_attn.out_proj.weight", "mlp.gate.weight", "mlp.shared_expert.gate_proj.weight",
                 "mlp.shared_expert.up_proj.weight", "mlp.shared_expert.down_proj.weight",
                 "mlp.shared_expert_gate.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                 "mlp.down_proj.weight")


def _hybrid_sources(cfg: dict, ckpt: Checkpoint, prefix: str) -> dict:
    """{vault name: (module, leaf, rows to take or None, the source's row count)} of a hybrid's
    dense tensors, as qwen_hybrid.targets maps the Hugging Face names (mlx-lm keeps them, and
    already stores the (1 + w) norms as 1 + w)."""
    from . import qwen_hybrid

    head = "language_model.lm_head" if prefix.startswith("language_model.") else "lm_head"
    inner = {"embed_tokens.weight": prefix + "embed_tokens.weight", "norm.weight": prefix + "norm.weight",
             "lm_head.weight": head + ".weight"}
    for l in range(cfg["num_hidden_layers"]):
        inner.update({f"layers.{l}.{r}": f"{prefix}layers.{l}.{r}" for r in _HYBRID_LAYER})
    out = {}
    for name, full in inner.items():
        if full not in ckpt:
            continue
        module, leaf = full.rsplit(".", 1)
        for vault_name, rows, _one_plus in qwen_hybrid.targets(cfg, name) or ():
            out[vault_name] = (module, leaf, None if rows is None else tuple(int(r) for r in rows),
                               qwen_hybrid.source_rows(cfg, name))
    return out


@dataclass(frozen=True)
class Entry:
    """One vault matrix: a module of the checkpoint (index = expert for stacked experts)."""
    module: str
    rows: int
    cols: int
    fmt: TensorFormat
    quantised: bool            # copied as stored (codes, scales, biases)
    index: int | None = None
    nbytes: int = 0            # what it occupies in the checkpoint
    leaf: str = "weight"       # the tensor under module: weight, or a float vector's name
    take: tuple | None = None  # rows of the source that are this matrix (a hybrid's split projections)


@dataclass
class Plan:
    config: dict
    recipe: dict                       # config.json's quantization, or {}
    dense: dict[str, Entry]            # vault name → entry, in vault order
    experts: dict[str, TensorFormat]   # gate/up/down → the one format of all layers
    sparse: list[int]
    prefix: str = "model."             # where the language model's tensors are
    expert_bias: bool = False          # gpt-oss: each expert projection has a float bias

    def formats(self) -> dict:
        """The VaultWriter formats: every dense tensor by name, experts per part."""
        out = {name: e.fmt for name, e in self.dense.items()}
        out.update({f"experts.{p}": tf for p, tf in self.experts.items()})
        out["experts"] = self.experts.get("gate", TensorFormat("f32", 0, None))
        return out


def _recipe(raw: dict) -> dict:
    q = raw.get("quantization")
    if q is None:
        q = raw.get("quantization_config") if isinstance(raw.get("quantization_config"), dict) and \
            "group_size" in raw.get("quantization_config", {}) else None
    return q or {}


def plan(ckpt_dir, ckpt: Checkpoint, float_format: dict | None = None) -> Plan:
    """Map and check every tensor of an MLX checkpoint; reads no tensor data. float_format:
    {vault name or role or "experts": format} for tensors stored unquantised (default: keep)."""
    from ..vaultio import role_of

    ckpt_dir = Path(ckpt_dir)
    cfg = load_config(ckpt_dir)
    raw = json.loads((ckpt_dir / "config.json").read_text())
    recipe = _recipe(raw)
    mode = recipe.get("mode", "affine")
    default_bits, default_group = recipe.get("bits"), recipe.get("group_size")
    float_format = float_format or {}
    problems, refused, used = [], [], set()
    if ckpt.duplicates:
        problems.append(f"tensors stored more than once: {_list(ckpt.duplicates)}")

    def module_mode(o) -> str:  # a module's own entry without a mode is affine (nn.quantize's default)
        return o.get("mode", "affine") if isinstance(o, dict) else mode

    def describe(module: str) -> str:
        o = recipe.get(module)
        if isinstance(o, dict):
            return f"{module_mode(o)} {o.get('bits', default_bits)}-bit, groups of {o.get('group_size', default_group)}"
        return f"{mode} {default_bits}-bit, groups of {default_group}"

    def entry(module: str, rows: int, cols: int, index: int | None, name_for_float: str,
              leaf: str = "weight", take: tuple | None = None, src_rows: int | None = None) -> Entry | None:
        w, s, b = (f"{module}.{k}" for k in (leaf, "scales", "biases"))
        if w not in ckpt:
            problems.append(f"missing {w}")
            return None
        used.add(w)
        tw = ckpt.tensors[w]
        lead = () if index is None else (tw.shape[0],)
        per = tw.nbytes // (tw.shape[0] if index is not None else 1)
        srows = rows if take is None else src_rows
        if take is not None:  # this matrix is some of the source's rows: count its share
            per = per * rows // srows
        if s not in ckpt or leaf != "weight":  # unquantised
            if tw.dtype not in FLOATS:
                problems.append(f"{w}: {tw.dtype} without scales")
                return None
            shape = tuple(tw.shape)
            fits = shape[:len(lead) + 2] == lead + (srows, cols) and all(d == 1 for d in shape[len(lead) + 2:])
            if not fits and not (rows == 1 and index is None and shape == (cols,)):
                problems.append(f"{w} {list(tw.shape)} (want {list(lead + (srows, cols))})")
                return None
            fmt = float_format.get(name_for_float) or _VAULT_FLOAT[tw.dtype]
            return Entry(module, rows, cols, TensorFormat(fmt, quant.GROUP, None), False, index, per, leaf, take)
        used.add(s)
        o = recipe.get(module)
        m = module_mode(o)
        o = o if isinstance(o, dict) else {}
        ts = ckpt.tensors[s]
        if m == "mxfp4" and b not in ckpt and name_for_float == "experts":  # (the engine's MXFP4 is for experts)
            if tw.dtype != "U32" or tuple(tw.shape) != lead + (srows, cols // 8) or cols % 32 or \
                    ts.dtype != "U8" or tuple(ts.shape) != lead + (srows, cols // 32):
                problems.append(f"{w}/{s}: {tw.dtype} {list(tw.shape)} / {ts.dtype} {list(ts.shape)} are not "
                                f"mxfp4 codes of {srows}x{cols}")
                return None
            if (o.get("bits", default_bits), o.get("group_size", default_group)) != (4, 32):
                problems.append(f"{module}: mxfp4 with {describe(module)} (mxfp4 is 4-bit, groups of 32)")
                return None
            per += ts.nbytes // (ts.shape[0] if index is not None else 1)
            return Entry(module, rows, cols, TensorFormat("MXFP4", 0, None), True, index, per, leaf, take)
        used.add(b)
        if m != "affine" or b not in ckpt:
            refused.append(f"{module} ({m}{'' if b in ckpt else ', no biases'})")
            return None
        tb = ckpt.tensors[b]
        if tw.dtype != "U32" or not tw.shape or tw.shape[:-1] != lead + (srows,) or (tw.shape[-1] * 32) % cols:
            problems.append(f"{w} {tw.dtype} {list(tw.shape)} is not a quantised {srows}x{cols}")
            return None
        bits = tw.shape[-1] * 32 // cols
        group = cols // ts.shape[-1] if ts.shape and ts.shape[-1] and cols % ts.shape[-1] == 0 else 0
        want_bits, want_group = o.get("bits", default_bits), o.get("group_size", default_group)
        if (want_bits is not None and want_bits != bits) or (want_group is not None and want_group != group):
            problems.append(f"{module}: stored as {bits}-bit groups of {group}, config.json says "
                            f"{want_bits}-bit groups of {want_group}")
            return None
        if bits not in (4, 8) or group not in quant.GROUPS:
            refused.append(f"{module} ({describe(module)})")
            return None
        if ts.shape != lead + (srows, cols // group) or tb.shape != ts.shape or ts.dtype != tb.dtype \
                or ts.dtype not in _SCALE:
            problems.append(f"{s}/{b}: {ts.dtype} {list(ts.shape)} / {tb.dtype} {list(tb.shape)} do not fit "
                            f"{srows}x{cols} in groups of {group}")
            return None
        fmt = TensorFormat("q4" if bits == 4 else "q8", group, _SCALE[ts.dtype])
        extra = (ts.nbytes + tb.nbytes) // (ts.shape[0] if index is not None else 1)
        per += extra if take is None else extra * rows // srows
        return Entry(module, rows, cols, fmt, True, index, per, leaf, take)

    prefix = model_prefix(ckpt)
    hybrid = _hybrid_sources(cfg, ckpt, prefix) if cfg.get("model_type") in HYBRIDS else None
    dense = {}
    for name, rows, cols in dense_shapes(cfg):
        if hybrid is not None:
            if name not in hybrid:
                problems.append(f"missing the source of {name}")
                continue
            module, leaf, take, src_rows = hybrid[name]
        else:
            (module, leaf), take, src_rows = _hf_name(name, cfg), None, None
        e = entry(module, rows, cols, None, name, leaf, take, src_rows)
        if e is not None:
            if e.quantised and role_of(name) == "norms":
                refused.append(f"{e.module} (a quantised norm)")
            dense[name] = e
    H, I, E = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    sparse = [l for l, s in enumerate(layer_kinds(cfg)) if s]
    oss = cfg.get("model_type") == "gpt_oss"
    experts: dict[str, TensorFormat] = {}
    for part, rows, cols in (("gate", I, H), ("up", I, H), ("down", H, I)):
        seen = {}
        for l in sparse:
            module = switch_module(cfg, l, part, prefix)
            e = entry(module, rows, cols, 0, "experts")
            if oss:  # each expert projection's bias, (E, rows) floats
                t = ckpt.tensors.get(module + ".bias")
                used.add(module + ".bias")
                if t is None or t.dtype not in FLOATS or tuple(t.shape) != (E, rows):
                    problems.append(f"{module}.bias: " + ("missing" if t is None else
                                                          f"{t.dtype} {list(t.shape)} (want floats {[E, rows]})"))
            if e is None:
                continue
            if ckpt.tensors[e.module + ".weight"].shape[0] != E:
                problems.append(f"{e.module}.weight holds {ckpt.tensors[e.module + '.weight'].shape[0]} experts, "
                                f"config.json says {E}")
            seen.setdefault(e.fmt, []).append(l)
        if len(seen) > 1:
            refused.append(f"{part} experts stored differently across layers "
                           f"({'; '.join(f'{tf.format}/g{tf.group}: layers {ls}' for tf, ls in seen.items())}); "
                           f"a vault holds one format per expert projection")
        elif seen:
            experts[part] = next(iter(seen))
    ignored = {n for n in ckpt.tensors if n.endswith("rotary_emb.inv_freq")}
    if cfg["tie_word_embeddings"]:
        ignored |= {n for n in ckpt.tensors if n.startswith(("lm_head.", "language_model.lm_head."))}
    unknown = set(ckpt.tensors) - used - ignored
    if unknown:
        problems.append(f"tensors this converter does not know what to do with: {_list(unknown)}")
    if refused:
        problems.insert(0, f"quantisations a vault cannot hold (it holds affine 4- and 8-bit in groups of "
                           f"32, 64 or 128, and mxfp4 experts; recipe "
                           f"{json.dumps({k: v for k, v in recipe.items() if not isinstance(v, dict)})}): "
                           f"{_list(refused)}")
    if problems:
        raise ConvertError(f"cannot import {ckpt_dir}:\n  " + "\n  ".join(problems))
    return Plan(cfg, recipe, dense, experts, sparse, prefix, oss)


def read_float(ckpt: Checkpoint, e: Entry) -> np.ndarray:
    a = ckpt.floats(f"{e.module}.{e.leaf}", e.index)
    if e.take is not None:
        a = a.reshape(a.shape[0], -1)[list(e.take)]
    return a.reshape(e.rows, e.cols)


def read_quantised(ckpt: Checkpoint, e: Entry, index: int | None = None) -> bytes:
    """The stored bytes of a quantised module (one expert of a stacked one) in vault layout."""
    i = e.index if index is None else index
    if e.fmt.format == "MXFP4":  # the released blocks' bytes, re-paired into ggml's block_mxfp4
        from .gpt_oss import mxfp4_to_ggml

        w, s = (ckpt.raw(f"{e.module}.{k}", i) for k in ("weight", "scales"))
        if e.take is not None:
            w, s = w[list(e.take)], s[list(e.take)]
        blocks = np.ascontiguousarray(w).view(np.uint8).reshape(e.rows, e.cols // 32, 16)
        return mxfp4_to_ggml(blocks, np.ascontiguousarray(s).view(np.uint8)).tobytes()
    w, s, b = (ckpt.raw(f"{e.module}.{k}", i) for k in ("weight", "scales", "biases"))
    if e.take is not None:
        w, s, b = (a[list(e.take)] for a in (w, s, b))
    sd = e.fmt.scale_dtype
    s = np.ascontiguousarray(s)
    b = np.ascontiguousarray(b)
    if sd == "f32":
        s, b = s.view(np.float32), b.view(np.float32)
    return quant.quantize_codes_direct(e.fmt.format, e.rows, e.cols, np.ascontiguousarray(w), s, b, sd,
                                       e.fmt.group)
