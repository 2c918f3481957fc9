"""`pysmoe convert`: a Hugging Face Qwen3-MoE checkpoint (safetensors) → a vault.

    python -m pysmoe convert Qwen3-30B-A3B/ vault/ --experts q4 --dense bf16

The checkpoint is a directory with config.json and either model.safetensors or
model.safetensors.index.json plus its shards. A real Qwen3-235B-A22B is ~470 GB of bf16, so the
converter never holds more than one tensor (or one expert) in memory:

1. Plan, from the safetensors headers alone (no tensor data is read): every name is mapped to its
   place in the vault and its shape checked against config.json. An unknown tensor, a missing
   one, a duplicate or a wrong shape stops the conversion here, before anything is written, with
   the list of offending names: a weight is never dropped silently.
2. Write: the dense tensors in vault order, then the experts (layer, expert) by (layer, expert),
   each expert's gate, up and down read straight from wherever they lie (the shards stay mapped,
   not loaded) and handed to the writer together, so memory stays at about one expert.

Expert weights come in two spellings, both accepted (also mixed across layers):

- per expert, as released Qwen checkpoints and transformers' save_pretrained write them:
  `model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`;
- fused, as transformers 5 holds them in memory: `model.layers.L.mlp.experts.gate_up_proj`
  [E, 2·I, H] (rows 0..I-1 are gate, I..2I-1 up: Qwen3MoeExperts does `.chunk(2)` on the output,
  gate first) and `model.layers.L.mlp.experts.down_proj` [E, H, I]. Read one expert at a time
  through safetensors' slices.

torch is needed only here (safetensors hands bf16 out as torch tensors) and imported lazily.
"""
from __future__ import annotations

import json
import logging
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import SmoeError

FORMATS = ("q4", "q8", "bf16", "f32")
# Dense roles that can be given their own format (VaultWriter's roles), and those a single
# `dense` format covers: the router stays f32 (it decides routing and is small), norms f32.
DENSE_ROLES = ("embed", "lm_head", "attention", "mlp", "router", "norms")
DENSE_MATRIX_ROLES = ("embed", "lm_head", "attention", "mlp")
ARCHITECTURES = ("Qwen3MoeForCausalLM",)

log = logging.getLogger(__name__)


class ConvertError(SmoeError, ValueError):
    """The checkpoint cannot be converted: what is wrong is in the message."""


# ---- the source checkpoint ------------------------------------------------------------------


def _import_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        raise ConvertError("pysmoe convert needs PyTorch to read safetensors checkpoints "
                           "(bf16 tensors): pip install torch==2.13.0") from None
    return torch


def _shard_files(hf_dir: Path) -> list[Path]:
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConvertError(f"{index}: no weight_map")
        files = [hf_dir / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ConvertError(f"{index} names shards that are not there: {', '.join(missing)}")
        return files
    single = hf_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ConvertError(f"{hf_dir}: neither model.safetensors nor model.safetensors.index.json")


def load_config(hf_dir: Path) -> dict:
    """config.json, checked for what this engine runs, in the normalised spelling."""
    from .vaultio import normalize_config

    path = hf_dir / "config.json"
    if not path.is_file():
        raise ConvertError(f"{hf_dir}: no config.json (is this a Hugging Face checkpoint directory?)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConvertError(f"{path}: {exc}") from None

    archs = raw.get("architectures") or []
    if not any(a in ARCHITECTURES for a in archs) and raw.get("model_type") != "qwen3_moe":
        raise ConvertError(f"{path}: architecture {archs or raw.get('model_type')!r} is not supported; "
                           f"pysmoe runs {', '.join(ARCHITECTURES)} (model_type qwen3_moe)")
    if raw.get("attention_bias"):
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

    def __str__(self):
        return self.name if self.expert is None else f"{self.name}[{self.expert}]"


@dataclass
class Plan:
    config: dict
    dense: dict[str, Source]                            # vault name → source, in vault order
    experts: dict[tuple[int, int], dict[str, Source]]   # (layer, expert) → gate/up/down


_FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}  # safetensors dtypes read as weights
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_DENSE_IN_LAYER = {
    "input_layernorm.weight": "input_layernorm",
    "post_attention_layernorm.weight": "post_attention_layernorm",
    "self_attn.q_proj.weight": "q_proj", "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj", "self_attn.o_proj.weight": "o_proj",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "mlp.gate.weight": "router",
    "mlp.gate_proj.weight": "mlp.gate_proj", "mlp.up_proj.weight": "mlp.up_proj",
    "mlp.down_proj.weight": "mlp.down_proj",
}
# Buffers some exporters save that are not weights (recomputed from rope_theta).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq")


def _list(names, limit: int = 20) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def plan(hf_dir, cfg: dict | None = None) -> Plan:
    """Read config.json (unless given, normalised) and the safetensors headers; map and check
    every tensor. Reads no tensor data."""
    from safetensors import safe_open

    hf_dir = Path(hf_dir)
    cfg = load_config(hf_dir) if cfg is None else cfg
    files = _shard_files(hf_dir)
    _import_torch()

    headers: dict[str, tuple[Path, tuple[int, ...], int]] = {}  # name → file, shape, bytes/element
    duplicates, not_float = [], []
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if name in headers:
                    duplicates.append(name)
                sl = st.get_slice(name)
                dtype = sl.get_dtype()
                if dtype not in _FLOAT_BYTES:
                    not_float.append(f"{name} ({dtype})")
                headers[name] = (f, tuple(sl.get_shape()), _FLOAT_BYTES.get(dtype, 4))
    if duplicates:
        raise ConvertError(f"{hf_dir}: tensors stored more than once: {_list(duplicates)}")
    if not_float:
        raise ConvertError(f"{hf_dir}: tensors that are not floats (an already quantised "
                           f"checkpoint?): {_list(not_float)}")

    from .vaultio import dense_shapes, layer_kinds

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

    for name, (f, shape, itemsize) in headers.items():
        size = itemsize * int(np.prod(shape))
        m = _LAYER.fullmatch(name)
        if name == "model.embed_tokens.weight":
            target = "embed_tokens"
        elif name == "model.norm.weight":
            target = "norm"
        elif name == "lm_head.weight":
            if cfg["tie_word_embeddings"]:
                log.warning("%s: tie_word_embeddings is set, so lm_head.weight is not used "
                            "(transformers ties it to embed_tokens too)", hf_dir)
                continue
            target = "lm_head"
        elif _IGNORED.fullmatch(name):
            continue
        elif m and int(m.group(1)) < L:
            l, rest = int(m.group(1)), m.group(2)
            me = _EXPERT.fullmatch(rest)
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
    return Plan(cfg, {k: dense[k] for k in want_dense}, experts)


# ---- formats --------------------------------------------------------------------------------


def resolve_formats(experts: str = "q4", dense=None) -> dict[str, str]:
    """{role: format} for VaultWriter. `dense` is None (the writer's defaults: q8 matrices, f32
    router and norms), one format for every dense matrix role in DENSE_MATRIX_ROLES (the router
    and the norms keep f32 unless named), or a {role: format} dict over DENSE_ROLES."""
    def check(role, fmt):
        if fmt not in FORMATS:
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


def _read(handles: dict, src: Source) -> np.ndarray:
    import torch

    st = handles[src.file]
    if src.expert is None:
        t = st.get_tensor(src.name)
    else:
        t = st.get_slice(src.name)[src.expert]
        if src.rows is not None:
            t = t[src.rows]
    if not t.is_floating_point():
        raise ConvertError(f"{src}: dtype {t.dtype} is not a float (an already quantised checkpoint?)")
    return np.ascontiguousarray(t.to(torch.float32).numpy())


def _tokenizer_files(hf_dir: Path) -> tuple[str | None, dict | None]:
    tok_json, tok_cfg = hf_dir / "tokenizer.json", hf_dir / "tokenizer_config.json"
    text = tok_json.read_text(encoding="utf-8") if tok_json.is_file() else None
    cfg = None
    if tok_cfg.is_file():
        try:
            cfg = json.loads(tok_cfg.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ConvertError(f"{tok_cfg}: {exc}") from None
    if text is None:
        log.warning("%s has no tokenizer.json: the vault will have none", hf_dir)
    return text, cfg


def convert(hf_dir, out_dir, experts: str = "q4", dense=None, scale_dtype: str = "f16",
            progress: bool = True, force: bool = False) -> Path:
    """Convert the checkpoint in hf_dir into a vault at out_dir; returns out_dir as a Path.

    experts: the expert format (q4, q8, bf16, f32). dense: None for the writer's defaults, one
    format for every dense matrix (embed, lm_head, attention, dense mlp), or {role: format} with
    roles embed, lm_head, attention, router, mlp, norms. scale_dtype: f16 or bf16, the scales
    and biases of q4/q8 tensors. Raises ConvertError before writing anything when the checkpoint
    cannot be converted. The vault is written beside out_dir and renamed into place when complete
    and verified (pysmoe.vaultdir.staged): a non-empty out_dir is refused unless force."""
    from safetensors import safe_open

    from .progress import Progress
    from .vaultdir import staged
    from .vaultio import VaultWriter, compute_layout

    hf_dir, out_dir = Path(hf_dir), Path(out_dir).expanduser()
    formats = resolve_formats(experts, dense)
    cfg = load_config(hf_dir)
    try:  # limits, and formats that do not fit a shape (q4 needs cols % 64 == 0), fail here
        compute_layout(cfg, formats, scale_dtype)
    except ValueError as exc:
        raise ConvertError(f"cannot convert {hf_dir} with formats {formats}: {exc}") from None
    p = plan(hf_dir, cfg)
    tokenizer_json, tokenizer_config = _tokenizer_files(hf_dir)

    with ExitStack() as stack:
        tmp = stack.enter_context(staged(out_dir, force))  # entered first: left last, after the writer closed
        writer = stack.enter_context(VaultWriter(
            tmp, p.config, formats=formats, scale_dtype=scale_dtype,
            tokenizer_json=tokenizer_json, tokenizer_config=tokenizer_config))
        files = {s.file for s in p.dense.values()}
        files |= {s.file for parts in p.experts.values() for s in parts.values()}
        handles = {f: stack.enter_context(safe_open(str(f), framework="pt")) for f in sorted(files)}
        total = sum(s.nbytes for s in p.dense.values())
        total += sum(s.nbytes for parts in p.experts.values() for s in parts.values())
        bar = stack.enter_context(Progress(total, "convert", unit="B", enabled=progress))
        for name, src in p.dense.items():
            writer.add_dense(name, _read(handles, src))
            bar.update(src.nbytes)
        for (layer, e), parts in p.experts.items():
            gate, up, down = (_read(handles, parts[k]) for k in ("gate", "up", "down"))
            writer.add_expert(layer, e, gate, up, down)
            del gate, up, down
            bar.update(sum(s.nbytes for s in parts.values()))
    return out_dir


# ---- CLI ------------------------------------------------------------------------------------


def add_parser(p, name: str = "convert") -> None:
    """The arguments of `python -m pysmoe convert` on its (sub)parser p (cli.py makes p)."""
    p.description = ("Convert a Hugging Face Qwen3-MoE checkpoint (config.json + safetensors) into "
                     "a vault, reading one tensor (or one expert) at a time.")
    p.add_argument("hf_dir", metavar="HF_DIR", help="checkpoint directory (config.json, *.safetensors)")
    from .argtypes import vault_out
    p.add_argument("out", metavar="OUT", type=vault_out, help="vault directory to write (empty or new, unless --force)")
    p.add_argument("--force", action="store_true", help="replace a non-empty OUT (only once the new vault is complete)")
    p.add_argument("--experts", choices=FORMATS, default="q4", help="expert weight format (default q4)")
    p.add_argument("--dense", choices=FORMATS, help="format of every dense matrix (default: the writer's)")
    p.add_argument("--attention", choices=FORMATS, help="format of q/k/v/o_proj (overrides --dense)")
    p.add_argument("--embed", choices=FORMATS, help="format of embed_tokens (overrides --dense)")
    p.add_argument("--lm-head", dest="lm_head", choices=FORMATS, help="format of lm_head (overrides --dense)")
    p.add_argument("--scale-dtype", choices=("f16", "bf16"), default="f16",
                   help="dtype of q4/q8 scales and biases (default f16)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def run(args) -> int:
    dense = {role: args.dense for role in DENSE_MATRIX_ROLES} if args.dense else {}
    for role in ("attention", "embed", "lm_head"):
        if getattr(args, role):
            dense[role] = getattr(args, role)
    convert(args.hf_dir, args.out, experts=args.experts, dense=dense or None,
            scale_dtype=args.scale_dtype, progress=args.progress, force=args.force)
    return 0
