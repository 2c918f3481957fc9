"""An MLX checkpoint (what `mlx_lm convert` writes, and mlx-community uploads) → a vault.

MLX keeps Hugging Face's tensor names for everything but the experts, which it stacks per layer:

    model.layers.L.mlp.switch_mlp.{gate,up,down}_proj.weight   [E, out, in]      (floats) or
    model.layers.L.mlp.switch_mlp.{gate,up,down}_proj.{weight,scales,biases}    (quantised)

A quantised module (any of them: embeddings, attention, lm_head, the router `mlp.gate`, the
experts) has `weight` as u32 words [.., out, in·bits/32] (q4: element c at bits 4·(c%8) of word
c/8; q8: byte c%4 of word c/4 — both exactly the vault's byte order), and `scales`, `biases`
[.., out, in/G] in the source dtype. config.json's `quantization` gives the default
{group_size, bits, mode} and per-module overrides (`"model.layers.0.mlp.gate": {"bits": 8,
...}`, or `false` for a module left in floats). Bits are also read off the shapes, and the two
must agree.

Every quantised tensor is copied as stored: codes, scales and biases byte for byte, in the
vault format that matches (q4/q8, its group size, its scale dtype). Unquantised tensors keep
their float format (f16, which the vault lacks, widens exactly to f32) unless the caller asks
for another. What the vault cannot hold — 2/3/5/6-bit, the mxfp4/nvfp4/mxfp8 modes, experts
of one projection stored differently in different layers — is refused while planning, before
anything is written, with the tensors and the recipe named.
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

SWITCH = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.switch_mlp\.(gate|up|down)_proj\.(weight|scales|biases)")


def switch_module(cfg: dict, layer: int, part: str) -> str:
    """The stacked experts' module of a layer in mlx-lm's checkpoints of this family."""
    block = "block_sparse_moe" if cfg.get("model_type") == "mixtral" else "mlp"
    return f"model.layers.{layer}.{block}.switch_mlp.{part}_proj"
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


@dataclass
class Plan:
    config: dict
    recipe: dict                       # config.json's quantization, or {}
    dense: dict[str, Entry]            # vault name → entry, in vault order
    experts: dict[str, TensorFormat]   # gate/up/down → the one format of all layers
    sparse: list[int]

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

    def describe(module: str) -> str:
        o = recipe.get(module)
        if isinstance(o, dict):
            return f"{o.get('mode', mode)} {o.get('bits', default_bits)}-bit, groups of {o.get('group_size', default_group)}"
        return f"{mode} {default_bits}-bit, groups of {default_group}"

    def entry(module: str, rows: int, cols: int, index: int | None, name_for_float: str,
              leaf: str = "weight") -> Entry | None:
        w, s, b = (f"{module}.{k}" for k in (leaf, "scales", "biases"))
        if w not in ckpt:
            problems.append(f"missing {w}")
            return None
        used.add(w)
        tw = ckpt.tensors[w]
        lead = () if index is None else (tw.shape[0],)
        per = tw.nbytes // (tw.shape[0] if index is not None else 1)
        if s not in ckpt or leaf != "weight":  # unquantised
            if tw.dtype not in FLOATS:
                problems.append(f"{w}: {tw.dtype} without scales")
                return None
            if tw.shape != lead + (rows, cols) and not (rows == 1 and index is None and tw.shape == (cols,)):
                problems.append(f"{w} {list(tw.shape)} (want {list(lead + (rows, cols))})")
                return None
            fmt = float_format.get(name_for_float) or _VAULT_FLOAT[tw.dtype]
            return Entry(module, rows, cols, TensorFormat(fmt, quant.GROUP, None), False, index, per, leaf)
        used.update({s, b})
        o = recipe.get(module)
        o = o if isinstance(o, dict) else {}
        m = o.get("mode", mode)
        if m != "affine" or b not in ckpt:
            refused.append(f"{module} ({m}{'' if b in ckpt else ', no biases'})")
            return None
        ts, tb = ckpt.tensors[s], ckpt.tensors[b]
        if tw.dtype != "U32" or not tw.shape or tw.shape[:-1] != lead + (rows,) or (tw.shape[-1] * 32) % cols:
            problems.append(f"{w} {tw.dtype} {list(tw.shape)} is not a quantised {rows}x{cols}")
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
        if ts.shape != lead + (rows, cols // group) or tb.shape != ts.shape or ts.dtype != tb.dtype \
                or ts.dtype not in _SCALE:
            problems.append(f"{s}/{b}: {ts.dtype} {list(ts.shape)} / {tb.dtype} {list(tb.shape)} do not fit "
                            f"{rows}x{cols} in groups of {group}")
            return None
        fmt = TensorFormat("q4" if bits == 4 else "q8", group, _SCALE[ts.dtype])
        per += (ts.nbytes + tb.nbytes) // (ts.shape[0] if index is not None else 1)
        return Entry(module, rows, cols, fmt, True, index, per)

    dense = {}
    for name, rows, cols in dense_shapes(cfg):
        module, leaf = _hf_name(name, cfg)
        e = entry(module, rows, cols, None, name, leaf)
        if e is not None:
            if e.quantised and role_of(name) == "norms":
                refused.append(f"{e.module} (a quantised norm)")
            dense[name] = e
    H, I, E = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    sparse = [l for l, s in enumerate(layer_kinds(cfg)) if s]
    experts: dict[str, TensorFormat] = {}
    for part, rows, cols in (("gate", I, H), ("up", I, H), ("down", H, I)):
        seen = {}
        for l in sparse:
            e = entry(switch_module(cfg, l, part), rows, cols, 0, "experts")
            if e is None:
                continue
            if ckpt.tensors[e.module + ".weight"].shape[0] != E:
                problems.append(f"{e.module}.weight holds {ckpt.tensors[e.module + '.weight'].shape[0]} experts, "
                                f"config.json says {E}")
            seen.setdefault(e.fmt, []).append(l)
        if len(seen) > 1:
            refused.append(f"switch_mlp.{part}_proj stored differently across layers "
                           f"({'; '.join(f'{tf.format}/g{tf.group}: layers {ls}' for tf, ls in seen.items())}); "
                           f"a vault holds one format per expert projection")
        elif seen:
            experts[part] = next(iter(seen))
    ignored = {n for n in ckpt.tensors if n.endswith("rotary_emb.inv_freq")}
    if cfg["tie_word_embeddings"]:
        ignored |= {n for n in ckpt.tensors if n.startswith("lm_head.")}
    unknown = set(ckpt.tensors) - used - ignored
    if unknown:
        problems.append(f"tensors this converter does not know what to do with: {_list(unknown)}")
    if refused:
        problems.insert(0, f"quantisations a vault cannot hold (it holds affine 4- and 8-bit in groups of "
                           f"32, 64 or 128; recipe {json.dumps({k: v for k, v in recipe.items() if not isinstance(v, dict)})}): "
                           f"{_list(refused)}")
    if problems:
        raise ConvertError(f"cannot import {ckpt_dir}:\n  " + "\n  ".join(problems))
    return Plan(cfg, recipe, dense, experts, sparse)


def read_float(ckpt: Checkpoint, e: Entry) -> np.ndarray:
    a = ckpt.floats(f"{e.module}.{e.leaf}", e.index)
    return a.reshape(e.rows, e.cols)


def read_quantised(ckpt: Checkpoint, e: Entry, index: int | None = None) -> bytes:
    """The stored bytes of a quantised module (one expert of a stacked one) in vault layout."""
    i = e.index if index is None else index
    w, s, b = (ckpt.raw(f"{e.module}.{k}", i) for k in ("weight", "scales", "biases"))
    sd = e.fmt.scale_dtype
    s = np.ascontiguousarray(s)
    b = np.ascontiguousarray(b)
    if sd == "f32":
        s, b = s.view(np.float32), b.view(np.float32)
    return quant.quantize_codes_direct(e.fmt.format, e.rows, e.cols, np.ascontiguousarray(w), s, b, sd,
                                       e.fmt.group)
