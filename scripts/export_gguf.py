#!/usr/bin/env python3
"""Write a pysmoe vault's weights as a GGUF file that llama.cpp runs (architecture `qwen3moe`).

    .venv/bin/python scripts/export_gguf.py VAULT OUT.gguf [--experts q4_0] [--dense q8_0]

Used by bench/peer.py to compare pysmoe with llama.cpp on the same weights (bench/peer.md).
Needs the `gguf` package (pip install gguf); reads the vault with pysmoe.vaultio.read_vault.

What is written:

- Expert FFNs as llama.cpp's stacked 3-D tensors blk.N.ffn_{gate,up,down}_exps, requantised
  from the vault's dequantised weights to Q4_0 by default (llama.cpp's 4-bit: blocks of 32
  weights, one f16 scale, w = d·(q − 8), symmetric). The vault's q4 is affine (groups of 64,
  w = scale·q + bias), so the GGUF's weights are close to, not equal to, the vault's: see
  bench/peer.md for the error this adds. `--experts q4_1` (blocks of 32, w = d·q + m, affine)
  or q8_0/f16/f32 are there for tighter checks.
- Attention, embedding and lm_head matrices as Q8_0 (blocks of 32, one f16 scale; F16 when a
  row is not a multiple of 32), the router (ffn_gate_inp) and every norm as F32.
- The hyperparameters llama.cpp reads for qwen3moe, all set explicitly (its defaults are wrong
  for Qwen3: key_length/value_length are head_dim, not hidden/heads).
- A `gpt2` (byte-level BPE) tokenizer from the vault's tokenizer.json, padded with [PADn]
  tokens up to vocab_size.

What llama.cpp cannot express, and so is refused: dense-MLP layers (`mlp_only_layers`,
`decoder_sparse_step`; llama.cpp's qwen3moe makes every layer MoE) and, unless --force,
`norm_topk_prob = false` (llama.cpp always renormalises the top-k weights for qwen3moe).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pysmoe.cli.args import positive_int  # noqa: E402
from pysmoe.vaultio import read_vault  # noqa: E402
from pysmoe.workers import default_procs, fork_map  # noqa: E402

ARCH = "qwen3moe"
EXPERT_TYPES = ("q4_0", "q4_1", "q8_0", "f16", "f32")
DENSE_TYPES = ("q8_0", "f16", "f32")
# llama_ftype numbers (llama.h) for general.file_type, by expert type.
_FTYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7}


class ExportError(ValueError):
    """The vault cannot be expressed as a llama.cpp qwen3moe GGUF."""


def _gguf():
    try:
        import gguf
    except ImportError:  # pragma: no cover - exercised only without the extra
        raise SystemExit("export_gguf needs the gguf package: .venv/bin/pip install gguf") from None
    return gguf


def copy_fields(r, w, skip: tuple = ()) -> None:
    """Every metadata key of GGUFReader r into GGUFWriter w, with its value type, except the
    reader's own GGUF.* fields, general.architecture (the writer's constructor writes it) and keys
    starting with one of skip."""
    gguf = _gguf()
    for k, f in r.fields.items():
        if k.startswith(("GGUF.", "general.architecture") + tuple(skip)):
            continue
        array = f.types[0] == gguf.GGUFValueType.ARRAY
        w.add_key_value(k, f.contents(), f.types[0], sub_type=f.types[-1] if array else None)


def _qtype(name: str):
    g = _gguf().GGMLQuantizationType
    return {"q4_0": g.Q4_0, "q4_1": g.Q4_1, "q8_0": g.Q8_0, "f16": g.F16, "f32": g.F32}[name]


def _block_size(name: str) -> int:
    return 1 if name in ("f16", "f32") else 32


def encode(w: np.ndarray, typ: str) -> np.ndarray:
    """A float matrix (rows, cols) in a GGML type: uint8 (rows, row_bytes) for the block types,
    float16/float32 (rows, cols) otherwise."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if typ == "f32":
        return w
    if typ == "f16":
        return w.astype(np.float16)
    return _gguf().quants.quantize(w, _qtype(typ))


def tensor_names() -> dict:
    """Our role -> llama.cpp's name template for qwen3moe, from gguf.constants (so a renamed
    tensor in a future llama.cpp shows up here as a KeyError rather than a silent mismatch)."""
    g = _gguf()
    t = g.MODEL_TENSOR
    wanted = {
        "token_embd": t.TOKEN_EMBD, "output_norm": t.OUTPUT_NORM, "output": t.OUTPUT,
        "attn_norm": t.ATTN_NORM, "attn_q": t.ATTN_Q, "attn_k": t.ATTN_K, "attn_v": t.ATTN_V,
        "attn_output": t.ATTN_OUT, "attn_q_norm": t.ATTN_Q_NORM, "attn_k_norm": t.ATTN_K_NORM,
        "ffn_norm": t.FFN_NORM, "ffn_gate_inp": t.FFN_GATE_INP, "ffn_gate_exps": t.FFN_GATE_EXP,
        "ffn_up_exps": t.FFN_UP_EXP, "ffn_down_exps": t.FFN_DOWN_EXP,
    }
    arch_tensors = set(g.MODEL_TENSORS[g.MODEL_ARCH.QWEN3MOE])
    out = {}
    for role, tid in wanted.items():
        if tid not in arch_tensors:
            raise KeyError(f"gguf {g.__name__}: {tid} is not a qwen3moe tensor")
        out[role] = g.TENSOR_NAMES[tid] + ".weight"
    return out


# vault dense tensor suffix (after "layers.l.") -> llama.cpp role
_LAYER_MAP = {
    "input_layernorm": "attn_norm", "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
    "o_proj": "attn_output", "q_norm": "attn_q_norm", "k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm", "router": "ffn_gate_inp",
}
_EXPERT_ROLES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def check_exportable(cfg: dict, sparse: list[bool], force: bool = False) -> list[str]:
    """Raise ExportError for what llama.cpp's qwen3moe cannot run; return warnings."""
    if cfg.get("model_type", "qwen3_moe") != "qwen3_moe":
        raise ExportError(f"a {cfg['model_type']} vault: this exporter writes Qwen3-MoE (qwen3moe) GGUFs only")
    dense = [l for l, s in enumerate(sparse) if not s]
    if dense:
        raise ExportError(f"layers {dense} are dense-MLP layers; llama.cpp's qwen3moe makes every layer "
                          "MoE, so this vault has no GGUF equivalent (use an all-sparse vault: "
                          "presets mini, a3b, a22b)")
    warnings = []
    if not cfg["norm_topk_prob"]:
        msg = ("norm_topk_prob is false, but llama.cpp renormalises the top-k weights for qwen3moe: "
               "its outputs will differ from pysmoe's")
        if not force:
            raise ExportError(msg + " (--force writes it anyway)")
        warnings.append(msg)
    for k in ("hidden_size", "moe_intermediate_size"):
        if cfg[k] % 32:
            raise ExportError(f"{k}={cfg[k]} is not a multiple of 32 (GGML block size)")
    return warnings


# ------------------------------------------------------------------------------ tokenizer

def tokenizer_fields(vault_dir: pathlib.Path, vocab_size: int) -> dict:
    """tokens, token types, merges and special ids of a gpt2-style GGUF vocabulary, from the
    vault's tokenizer.json (Hugging Face byte-level BPE), padded to vocab_size."""
    gguf = _gguf()
    tj = vault_dir / "tokenizer.json"
    if tj.exists():
        tok = json.loads(tj.read_text(encoding="utf-8"))
    else:  # a vault without a tokenizer still needs one for llama.cpp: the synthetic one
        from pysmoe.tokenizer import build_synthetic_tokenizer
        tok = json.loads(build_synthetic_tokenizer(vocab_size))
    model = tok.get("model", {})
    if model.get("type") != "BPE":
        raise ExportError(f"tokenizer.json model type {model.get('type')!r}: only BPE is exported")
    by_id: dict[int, tuple[str, int]] = {}
    for text, i in model["vocab"].items():
        by_id[int(i)] = (text, int(gguf.TokenType.NORMAL))
    for a in tok.get("added_tokens", []):
        typ = gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED
        by_id[int(a["id"])] = (a["content"], int(typ))
    if by_id and max(by_id) >= vocab_size:
        raise ExportError(f"tokenizer has id {max(by_id)} >= vocab_size {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        text, typ = by_id.get(i, (f"[PAD{i}]", int(gguf.TokenType.UNUSED)))
        tokens.append(text)
        types.append(typ)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    cfg_path = vault_dir / "tokenizer_config.json"
    tcfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.exists() else {}

    def tid(name):
        if isinstance(name, dict):
            name = name.get("content")
        if not name:
            return None
        for i, (text, _) in by_id.items():
            if text == name:
                return i
        return None

    eos = tid(tcfg.get("eos_token")) or tid("<|im_end|>") or tid("<|endoftext|>")
    pad = tid(tcfg.get("pad_token")) or tid("<|endoftext|>")
    bos = tid(tcfg.get("bos_token")) or tid("<|endoftext|>")  # as convert_hf_to_gguf.py does for Qwen
    # llama.cpp's name for the pre-tokenizer: a plain ByteLevel one (its own GPT-2 regex, as the
    # demo's and the synthetic tokenizers have) is "gpt-2"; otherwise Qwen's regex is assumed
    pre = tok.get("pre_tokenizer") or {}
    pre_name = "gpt-2" if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) else "qwen2"
    return {"tokens": tokens, "types": types, "merges": merges, "eos": eos, "pad": pad, "bos": bos,
            "pre": pre_name}


# ------------------------------------------------------------------------------ export

def plan(vault, expert_type: str = "q4_0", dense_type: str = "q8_0") -> list[tuple]:
    """Every GGUF tensor in file order: (gguf name, source, ggml type name, numpy shape).
    source is ("dense", vault name) or ("experts", layer, part index)."""
    cfg = vault.config
    names = tensor_names()
    L, E = cfg["num_hidden_layers"], cfg["num_experts"]
    h, m = cfg["hidden_size"], cfg["moe_intermediate_size"]

    def dense_type_for(vname: str, cols: int) -> str:
        t = vault.tensors[vname]
        if t.rows == 1 or vname.endswith("router"):
            return "f32"  # norms and the router
        if dense_type == "q8_0" and cols % 32:
            return "f16"
        return dense_type

    out = []

    def add_dense(gname, vname):
        t = vault.tensors[vname]
        shape = (t.cols,) if t.rows == 1 else (t.rows, t.cols)
        out.append((gname, ("dense", vname), dense_type_for(vname, t.cols), shape))

    add_dense(names["token_embd"], "embed_tokens")
    for l in range(L):
        for suffix in ("input_layernorm", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "o_proj",
                       "post_attention_layernorm", "router"):
            add_dense(names[_LAYER_MAP[suffix]].format(bid=l), f"layers.{l}.{suffix}")
        for part, role in enumerate(_EXPERT_ROLES):
            shape = (E, h, m) if role == "ffn_down_exps" else (E, m, h)
            out.append((names[role].format(bid=l), ("experts", l, part), expert_type, shape))
    add_dense(names["output_norm"], "norm")
    if not cfg["tie_word_embeddings"]:
        add_dense(names["output"], "lm_head")
    return out


def _byte_shape(shape, typ: str):
    """numpy shape of the encoded array (uint8 rows for block types)."""
    if typ in ("f16", "f32"):
        return shape, (np.float16 if typ == "f16" else np.float32)
    g = _gguf()
    bs, ts = g.GGML_QUANT_SIZES[_qtype(typ)]
    return (*shape[:-1], shape[-1] // bs * ts), np.uint8


def add_metadata(w, cfg: dict, tok: dict, expert_type: str, name: str) -> None:
    w.add_name(name)
    w.add_file_type(_FTYPE[expert_type])
    w.add_quantization_version(_gguf().GGML_QUANT_VERSION)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok["pre"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    if tok["merges"]:
        w.add_token_merges(tok["merges"])
    for key, fn in (("eos", w.add_eos_token_id), ("pad", w.add_pad_token_id), ("bos", w.add_bos_token_id)):
        if tok[key] is not None:
            fn(tok[key])
    w.add_add_bos_token(False)


def encode_layer(v, layer: int, typ: str, procs: int) -> list[np.ndarray]:
    """A layer's expert tensors (gate, up, down), each stacked over the experts and encoded, the
    requantisation spread over `procs` forked processes (pysmoe.workers: gguf's numpy code holds
    the GIL, so threads ran at one core's rate)."""
    E = v.config["num_experts"]
    enc: list = [None] * E
    for e, parts in fork_map(lambda e: [encode(x, typ) for x in v.expert(layer, e)], range(E), procs):
        enc[e] = parts
    return [np.stack([enc[e][p] for e in range(E)]) for p in range(3)]


def export(vault_path, out_path, expert_type: str = "q4_0", dense_type: str = "q8_0",
           force: bool = False, threads: int | None = None, progress: bool = True) -> pathlib.Path:
    """Write vault_path's weights to out_path as a qwen3moe GGUF; returns out_path."""
    gguf = _gguf()
    if expert_type not in EXPERT_TYPES:
        raise ValueError(f"expert type {expert_type!r} is not one of {EXPERT_TYPES}")
    if dense_type not in DENSE_TYPES:
        raise ValueError(f"dense type {dense_type!r} is not one of {DENSE_TYPES}")
    vault_path, out_path = pathlib.Path(vault_path), pathlib.Path(out_path)
    v = read_vault(vault_path)
    cfg = v.config
    for w_ in check_exportable(cfg, v.sparse, force):
        print("warning:", w_, file=sys.stderr)
    tok = tokenizer_fields(v.dir, cfg["vocab_size"])
    items = plan(v, expert_type, dense_type)
    threads = threads or default_procs()

    tmp = out_path.with_name(out_path.name + ".part")
    w = gguf.GGUFWriter(tmp, ARCH)
    add_metadata(w, cfg, tok, expert_type, name=f"pysmoe export of {vault_path.name}")
    for gname, _, typ, shape in items:
        bshape, dt = _byte_shape(shape, typ)
        nbytes = int(np.prod(bshape)) * np.dtype(dt).itemsize
        w.add_tensor_info(gname, bshape, np.dtype(dt), nbytes, raw_dtype=None if typ in ("f16", "f32") else _qtype(typ))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    t0, done, total = time.monotonic(), 0, len(items)
    try:
        layer_cache: dict = {}
        for gname, src, typ, shape in items:
            if src[0] == "dense":
                arr = v.tensor(src[1])
                data = encode(arr.reshape(1, -1) if arr.ndim == 1 else arr, typ)
                if arr.ndim == 1:
                    data = data.reshape(-1)
            else:
                _, l, part = src
                if l not in layer_cache:  # all three parts of a layer's experts at once
                    layer_cache.clear()
                    layer_cache[l] = encode_layer(v, l, typ, threads)
                data = layer_cache[l][part]
            w.write_tensor_data(np.ascontiguousarray(data))
            done += 1
            if progress and (src[0] == "experts" and src[2] == 2 or done == total):
                el = time.monotonic() - t0
                print(f"\r{out_path.name}: {done}/{total} tensors, {el:.0f} s", end="", file=sys.stderr, flush=True)
        if progress:
            print(file=sys.stderr)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    w.close()
    os.replace(tmp, out_path)
    v.close()
    return out_path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("vault", help="pysmoe vault directory")
    ap.add_argument("out", help="GGUF file to write")
    ap.add_argument("--experts", default="q4_0", choices=EXPERT_TYPES, help="expert weight type (default q4_0)")
    ap.add_argument("--dense", default="q8_0", choices=DENSE_TYPES,
                    help="attention/embedding/lm_head type (default q8_0); norms and router are always f32")
    ap.add_argument("--jobs", "--threads", dest="threads", type=positive_int, default=None,
                    help="requantisation processes (default: one per core this process may use; 1 = this "
                         "process alone; --threads is the older name)")
    ap.add_argument("--force", action="store_true", help="write even if llama.cpp will renormalise top-k differently")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        out = export(a.vault, a.out, a.experts, a.dense, a.force, a.threads, progress=not a.quiet)
    except ExportError as e:
        print(f"export_gguf: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({out.stat().st_size / 2**20:,.1f} MiB) in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
