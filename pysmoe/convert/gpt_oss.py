"""gpt-oss's checkpoints, the parts no other family has: its experts as transformers stores them,
and the released MXFP4 experts rearranged losslessly into the vault's MXFP4 (format 71).

Float experts (transformers' save_pretrained, GptOssExperts): per layer one fused
`mlp.experts.gate_up_proj` [E, H, 2I] used as x @ W, its columns INTERLEAVED (gate is column
2i, up 2i + 1: GptOssExperts._apply_gate takes `[..., ::2]` and `[..., 1::2]`), with
`gate_up_proj_bias` [E, 2I] interleaved the same way; `mlp.experts.down_proj` [E, I, H] with
`down_proj_bias` [E, H]. A vault stores rows = outputs, so gate = W[e][:, 0::2]ᵀ (I, H), up =
W[e][:, 1::2]ᵀ, down = down_proj[e]ᵀ (H, I).

MXFP4 experts (the released openai/gpt-oss-20b and -120b): `gate_up_proj_blocks` [E, 2I, H/32,
16] and `gate_up_proj_scales` [E, 2I, H/32] (rows = outputs already, gate and up interleaved by
row), `down_proj_blocks` [E, H, I/32, 16] and `down_proj_scales` [E, H, I/32]; bf16 biases as
above. One block is 32 weights: a scale byte s (E8M0: the weight is FP4 · 2^(s − 127)) and 16
bytes of two FP4 codes each. transformers (integrations/mxfp4.py, convert_moe_packed_tensors)
puts byte j's LOW nibble at weight 2j and its HIGH nibble at 2j + 1. ggml's block_mxfp4 is the
scale byte e, then qs[16] with weight j in the low nibble of qs[j] and weight j + 16 in its high
nibble, dequantised as kvalue · 2^(e − 128) with kvalues = 2 · FP4. So e = s and the codes are
only re-paired: nothing is requantised, and every weight keeps its exact value
(tests/test_gpt_oss.py checks it against transformers' own dequantisation).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

MXFP4_BLOCK = 32         # weights per block
MXFP4_BLOCK_BYTES = 17   # ggml's block_mxfp4: the scale byte, 16 bytes of codes


def mxfp4_to_ggml(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """HF's MXFP4 rows → ggml's block_mxfp4 bytes. blocks: uint8 (rows, G, 16), scales: uint8
    (rows, G). Returns uint8 (rows, G · 17): per block the scale byte then the 16 code bytes."""
    blocks = np.asarray(blocks, dtype=np.uint8)
    scales = np.asarray(scales, dtype=np.uint8)
    if blocks.ndim != 3 or blocks.shape[2] != 16 or scales.shape != blocks.shape[:2]:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape}: want (rows, G, 16) and (rows, G)")
    rows, G = scales.shape
    codes = np.empty(blocks.shape[:2] + (MXFP4_BLOCK,), dtype=np.uint8)  # weight k's 4-bit code
    codes[..., 0::2] = blocks & 0x0F
    codes[..., 1::2] = blocks >> 4
    out = np.empty((rows, G, MXFP4_BLOCK_BYTES), dtype=np.uint8)
    out[..., 0] = scales
    out[..., 1:] = codes[..., :16] | (codes[..., 16:] << 4)
    return out.reshape(rows, G * MXFP4_BLOCK_BYTES)


def ggml_to_mxfp4(data: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of mxfp4_to_ggml: (blocks (rows, cols/32, 16), scales (rows, cols/32))."""
    b = np.asarray(data, dtype=np.uint8).reshape(rows, cols // MXFP4_BLOCK, MXFP4_BLOCK_BYTES)
    codes = np.concatenate([b[..., 1:] & 0x0F, b[..., 1:] >> 4], axis=-1)  # weight k's code, k < 32
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), b[..., 0].copy()


def split_gate_up(w: np.ndarray, interleaved_axis: int) -> tuple[np.ndarray, np.ndarray]:
    """(gate, up) of one expert's fused gate_up (interleaved along interleaved_axis: gate at even
    indices, up at odd ones)."""
    sl = [slice(None)] * w.ndim
    sl[interleaved_axis] = slice(0, None, 2)
    gate = w[tuple(sl)]
    sl[interleaved_axis] = slice(1, None, 2)
    return gate, w[tuple(sl)]


# ---- planning a gpt-oss checkpoint (convert.plan_checkpoint picks it for model_type gpt_oss) -

_ATTN = {f"self_attn.{p}_proj.{k}": f"{p}_proj" + ("" if k == "weight" else ".bias")
         for p in "qkvo" for k in ("weight", "bias")}
_LAYER_DENSE = {"input_layernorm.weight": "input_layernorm", "post_attention_layernorm.weight": "post_attention_layernorm",
                "self_attn.sinks": "sinks", "mlp.router.weight": "router", "mlp.router.bias": "router.bias", **_ATTN}
EXPERT_TENSORS = ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")


@dataclass(frozen=True)
class Part:
    """One tensor of one gpt-oss expert: `take` says how it comes out of the fused tensor `name`
    (expert `expert` of its first axis): 'gate_cols'/'up_cols' (the even/odd columns of
    gate_up_proj [H, 2I], transposed), 'down_T' (down_proj [I, H] transposed), 'even'/'odd' (of a
    bias), 'whole' (down_proj_bias), or the MXFP4 blocks 'mx_even'/'mx_odd'/'mx_all' (rows of
    `name`_blocks with `name`_scales, as stored)."""

    file: Path
    name: str
    nbytes: int
    expert: int
    take: str

    def __str__(self):
        return f"{self.name}[{self.expert}]"

    @property
    def mxfp4(self) -> bool:
        return self.take.startswith("mx_")

    def read(self, ckpt) -> np.ndarray:
        """f32 values (float parts), or uint8 block_mxfp4 rows (MXFP4 parts: as stored)."""
        if self.mxfp4:
            rows = {"mx_even": slice(0, None, 2), "mx_odd": slice(1, None, 2), "mx_all": slice(None)}[self.take]
            blocks = ckpt.raw(self.name + "_blocks", self.expert)[rows]
            scales = ckpt.raw(self.name + "_scales", self.expert)[rows]
            return mxfp4_to_ggml(blocks, scales)
        a = ckpt.floats(self.name, self.expert)
        if self.take in ("gate_cols", "up_cols"):
            a = split_gate_up(a, 1)[self.take == "up_cols"].T
        elif self.take == "down_T":
            a = a.T
        elif self.take in ("even", "odd"):
            a = split_gate_up(a, 0)[self.take == "odd"][None, :]
        else:
            a = a[None, :]
        return np.ascontiguousarray(a, dtype=np.float32)


def expert_parts(ckpt_tensors: dict, prefix: str, E: int, H: int, I: int, problems: list) -> list[dict] | None:
    """Per expert {tensor: Part} of one layer's `prefix`mlp.experts.*, float or MXFP4 (None: the
    layer has none of them; problems gets what is wrong)."""
    base = prefix + "mlp.experts."
    mx = base + "gate_up_proj_blocks" in ckpt_tensors
    want = {"gate_up_proj_bias": (E, 2 * I), "down_proj_bias": (E, H)}
    if mx:
        want.update({"gate_up_proj_blocks": (E, 2 * I, H // 32, 16), "gate_up_proj_scales": (E, 2 * I, H // 32),
                     "down_proj_blocks": (E, H, I // 32, 16), "down_proj_scales": (E, H, I // 32)})
    else:
        want.update({"gate_up_proj": (E, H, 2 * I), "down_proj": (E, I, H)})
    if not any(base + k in ckpt_tensors for k in want):
        return None
    for k, shape in want.items():
        t = ckpt_tensors.get(base + k)
        if t is None:
            problems.append(f"missing {base + k}")
        elif tuple(t.shape) != shape:
            problems.append(f"{base + k} {tuple(t.shape)} (want {shape})")
        elif k.endswith(("_blocks", "_scales")) and t.dtype != "U8":
            problems.append(f"{base + k} is {t.dtype}, MXFP4 blocks and scales are U8")
    if problems:
        return None

    def part(k, e, take):
        t = ckpt_tensors[base + k + ("_blocks" if take.startswith("mx_") else "")]
        n = t.nbytes // E // (2 if take in ("gate_cols", "up_cols", "even", "odd", "mx_even", "mx_odd") else 1)
        return Part(t.file, base + k, n, e, take)

    out = []
    for e in range(E):
        if mx:
            p = {"gate": part("gate_up_proj", e, "mx_even"), "up": part("gate_up_proj", e, "mx_odd"),
                 "down": part("down_proj", e, "mx_all")}
        else:
            p = {"gate": part("gate_up_proj", e, "gate_cols"), "up": part("gate_up_proj", e, "up_cols"),
                 "down": part("down_proj", e, "down_T")}
        p.update({"gate_bias": part("gate_up_proj_bias", e, "even"), "up_bias": part("gate_up_proj_bias", e, "odd"),
                  "down_bias": part("down_proj_bias", e, "whole")})
        out.append(p)
    return out


def layer_dense_name(rest: str) -> str | None:
    """The vault name (after `layers.L.`) of a gpt-oss layer tensor's HF name (after
    `model.layers.L.`), or None."""
    return _LAYER_DENSE.get(rest)


def plan(hf_dir: Path, cfg: dict | None = None, ckpt=None) -> "hf.Plan":
    """hf.plan for a gpt-oss checkpoint: every tensor mapped (dense ones to hf.Source, experts to
    Part), shapes checked against config.json and the vault's dense list; ConvertError listing
    every problem, before anything is read."""
    from ..vaultio import dense_shapes, layer_kinds
    from . import hf

    hf_dir, cfg, ckpt = hf.open_checkpoint(hf_dir, cfg, ckpt)
    want_dense = {n: (cols,) if rows == 1 else (rows, cols) for n, rows, cols in dense_shapes(cfg)}
    L, E, H, I = cfg["num_hidden_layers"], cfg["num_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    sparse = [l for l, s in enumerate(layer_kinds(cfg)) if s]
    dense, experts, unknown, bad, problems = {}, {}, [], [], []
    expert_names = set()
    for l in sparse:
        parts = expert_parts(ckpt.tensors, f"model.layers.{l}.", E, H, I, problems)
        if parts is None:
            continue
        for e, p in enumerate(parts):
            experts[(l, e)] = p
        expert_names |= {n for n in ckpt.tensors if n.startswith(f"model.layers.{l}.mlp.experts.")}
    for name, t in ckpt.tensors.items():
        if name in expert_names or hf._IGNORED.fullmatch(name):
            continue
        m = hf._LAYER.fullmatch(name)
        if (top := hf.top_level_target(name, cfg, hf_dir)) is not None:
            if not top:
                continue
            target = top
        elif m and int(m.group(1)) < L and layer_dense_name(m.group(2)):
            target = f"layers.{m.group(1)}.{layer_dense_name(m.group(2))}"
        else:
            unknown.append(name)
            continue
        if target not in want_dense:
            unknown.append(name)
            continue
        if t.dtype not in hf.FLOATS:
            bad.append(f"{name} is {t.dtype}, not a float")
        elif tuple(t.shape) != want_dense[target]:
            bad.append(f"{name} {tuple(t.shape)} (want {want_dense[target]})")
        dense[target] = hf.Source(t.file, name, t.nbytes)
    if unknown:
        problems.append(f"tensors this converter does not know what to do with: {hf._list(unknown)}")
    if bad:
        problems.append(f"tensors whose shape or type does not fit config.json: {hf._list(bad)}")
    missing = [k for k in want_dense if k not in dense]
    missing += [f"model.layers.{l}.mlp.experts" for l in sparse if (l, 0) not in experts]
    if missing:
        problems.append(f"weights missing from the checkpoint: {hf._list(missing)}")
    if problems:
        raise hf.ConvertError(f"cannot convert {hf_dir}:\n  " + "\n  ".join(problems))
    return hf.Plan(cfg, {k: dense[k] for k in want_dense}, experts)


def is_mxfp4(p: "hf.Plan") -> bool:
    """Whether the plan's experts are MXFP4 as stored (imported as format 71, nothing requantised)."""
    return any(x.mxfp4 for parts in p.experts.values() for x in parts.values() if isinstance(x, Part))
