"""Held-out perplexity of the trained demo model through every numeric path (issue 14).

    .venv/bin/python bench/perplexity.py --hf build/demo-hf --json bench/results/perplexity.json
    .venv/bin/python bench/perplexity.py --gguf Q4_K_M Q8_0 F32     # GGUF import (issue 27), below

--hf is the float32 checkpoint scripts/train_demo.py wrote (the trained weights before any
quantisation). Without it the f32 model is regenerated from the shipped demo vault
(hf_from_vault): then the expert-format rows measure re-quantising weights that
are already on the q4 grid, which understates what q8/q4 cost; the table says which it used.

Every row scores the same windows of the held-out text (pysmoe/data/demo/heldout.txt), so rows
differ only by their numerics:

- transformers f32: Qwen3MoeForCausalLM, float32, eager attention and experts (the reference);
- numpy reference: pysmoe/reference.py over the f32 vault;
- pysmoe, each expert format (f32, bf16, q8, q4; dense f32), activations="f32" and the default
  8-bit activations; and the default conversion (q4 experts, q8 dense matrices: the shipped demo);
- mlx-lm on its own 4-bit conversion (mlx_lm.convert --quantize, groups of 64: every matrix q4,
  the router q8), and pysmoe on that conversion imported (`pysmoe convert`, codes copied);
- llama.cpp (llama-cpp-python) on scripts/export_gguf.py's output: of the f32 vault (F32) and
  of the default vault (experts requantised to Q4_0, dense Q8_0).

Rows whose package is missing are left out and named.

A gpt-oss checkpoint (`scripts/train_demo.py train --family gpt_oss`; issue 26) gets the same
windows and rows plus MXFP4 experts (`convert --experts MXFP4`, dense f32 and dense q8) and
transformers on the MXFP4 vault's dequantised weights (the exact oracle for the MXFP4 rows); the
float experts written as the release spells them (`*_blocks`/`*_scales`) and imported as stored
must give the same blobs (`released_spelling_is_the_same`). The numpy reference, mlx-lm and
llama.cpp rows are the Qwen3-MoE demo's only.

`--gguf FTYPE...` scores something else: the demo written as an F32 GGUF (export_gguf.py) and
quantised by llama.cpp's own quantiser to each llama_ftype named (Q4_K_M, Q8_0, ...), then run by
llama.cpp and by pysmoe on its import of the very same file (`pysmoe convert FILE.gguf`: GGML
types as stored), both activation modes; it also checks that the imported tokenizer gives
llama.cpp's ids on the held-out text, and compares greedy continuations (`gguf_table`).

The scoring is in the functions below, which tests/test_quality.py also uses:

    windows = heldout_windows(vault_path, n_windows=16, length=256)
    nll = engine_nll(vault_path, windows, activations="f32")    # mean nats per predicted token
    ppl = math.exp(nll)

The held-out text is the demo model's (`HELDOUT_TEXT`: documents of the corpus that training
never saw; scripts/train_demo.py says which). It is tokenised once with the vault's tokenizer and
cut into consecutive, non-overlapping windows of `length` tokens; each window is scored from an
empty context, every token after its first predicted from those before it. Every path scores the
very same windows, so their perplexities differ only by their numerics:

- `engine_nll`: pysmoe's engine, the first id by prefill, then one decode per id (token-serial;
  layer-major is bit-identical to it, which tests/test_quality.py checks on these weights);
- `reference_nll`: the numpy reference forward (pysmoe/reference.py) over the vault;
- `hf_nll`: transformers' Qwen3MoeForCausalLM in float32 (eager attention and experts);
- `mlx_nll`: mlx-lm's model of an `mlx_lm.convert` output, computing in float32;
- `llama_cpp_nll`: llama.cpp (llama-cpp-python) on a GGUF file (scripts/export_gguf.py).

`hf_from_vault` writes a float32 Hugging Face checkpoint holding a vault's dequantised weights,
so that the f32 oracles can run where only the shipped q4 demo vault exists.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pysmoe.convert import convert_checkpoint  # noqa: E402
from pysmoe.demo import DEMO_DIR, ensure_demo_vault  # noqa: E402

HELDOUT_TEXT = DEMO_DIR / "heldout.txt"


def heldout_windows(vault_path, n_windows: int | None = None, length: int = 256,
                    text_path=HELDOUT_TEXT) -> np.ndarray:
    """(n, length) int64 token windows of the held-out text, in order; all that fit if n is None."""
    from pysmoe.tokenizer import load_tokenizer

    ids = load_tokenizer(vault_path).encode(Path(text_path).read_text(encoding="utf-8"))
    n = len(ids) // length if n_windows is None else n_windows
    if n * length > len(ids):
        raise ValueError(f"the held-out text has {len(ids)} tokens: too few for {n} windows of {length}")
    return np.asarray(ids[:n * length], dtype=np.int64).reshape(n, length)


def nll_of_logits(logits: np.ndarray, window: np.ndarray) -> float:
    """Summed negative log-likelihood (nats) of window[1:] under logits[:-1] (rows: positions)."""
    z = np.asarray(logits[:len(window) - 1], dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return float(-logp[np.arange(len(window) - 1), window[1:]].sum())


def _mean(total: float, windows: np.ndarray) -> float:
    return total / (windows.shape[0] * (windows.shape[1] - 1))


def engine_nll(vault_path, windows: np.ndarray, activations: str = "q8", threads: int | None = None) -> float:
    """Mean NLL through the engine: per window, prefill its first id, then decode the rest."""
    from pysmoe.engine import open_vault

    total = 0.0
    with open_vault(vault_path) as v, v.session(cache_bytes=v.expert_bytes, threads=threads,
                                                 activations=activations) as s:
        for w in windows:
            s.reset()
            rows = [s.prefill([int(w[0])])]
            rows += [s.decode(int(t)) for t in w[1:-1]]
            total += nll_of_logits(np.stack(rows), w)
    return _mean(total, windows)


def reference_nll(vault_path, windows: np.ndarray) -> float:
    from pysmoe.reference import ReferenceModel

    with ReferenceModel(vault_path) as ref:
        total = sum(nll_of_logits(ref.logits(w), w) for w in windows)
    return _mean(total, windows)


def _hf_model(hf_dir):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(hf_dir, config=config, dtype=torch.float32).eval()


def hf_nll(hf_dir, windows: np.ndarray, batch: int = 8) -> float:
    """Mean NLL through transformers' model of the checkpoint (Qwen3MoeForCausalLM,
    GptOssForCausalLM), float32 on the CPU."""
    import torch

    model = _hf_model(hf_dir)
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            w = windows[i:i + batch]
            logits = model(input_ids=torch.from_numpy(w)).logits.float().numpy()
            total += sum(nll_of_logits(lg, x) for lg, x in zip(logits, w))
    return _mean(total, windows)


def mlx_nll(mlx_dir, windows: np.ndarray) -> float:
    """Mean NLL through mlx-lm's model of an mlx_lm.convert output, cast to float32."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(mlx_dir))
    model.set_dtype(mx.float32)
    total = 0.0
    for w in windows:
        logits = np.array(model(mx.array(w[None, :].astype(np.int32)))[0].astype(mx.float32))
        total += nll_of_logits(logits, w)
    return _mean(total, windows)


def llama_cpp_nll(gguf_path, windows: np.ndarray, threads: int = 2) -> float:
    """Mean NLL through llama.cpp (llama-cpp-python) on a GGUF file, every position's logits."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=windows.shape[1], n_batch=windows.shape[1],
                          n_threads=threads, n_threads_batch=threads, logits_all=True, verbose=False)
    total = 0.0
    try:
        for w in windows:
            llm.reset()
            llm.eval([int(t) for t in w])
            total += nll_of_logits(np.array(llm.scores[:len(w)], dtype=np.float32), w)
    finally:
        llm.close()
    return _mean(total, windows)


def llama_cpp_tokens(gguf_path, text: str) -> list[int]:
    """llama.cpp's tokenization of text (no BOS, special tokens parsed)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)
    try:
        return llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
    finally:
        llm.close()


def llama_cpp_greedy(gguf_path, prompt: list[int], n: int, threads: int = 2, kv: str = "f32") -> list[int]:
    """n greedy ids after prompt, through llama.cpp (argmax of its logits, no sampler). kv "f32":
    its KV cache in f32 and flash attention off, as pysmoe's default KV cache (llama.cpp's own
    default, "f16", rounds K and V to f16 and, in attention, the queries too)."""
    import llama_cpp

    kw = {}
    if kv == "f32":
        kw = dict(type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, flash_attn=False)
    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=len(prompt) + n, n_batch=len(prompt) + n,
                          n_threads=threads, n_threads_batch=threads, logits_all=True, verbose=False, **kw)
    out = []
    try:
        llm.eval(list(prompt))
        for _ in range(n):
            out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([out[-1]])
    finally:
        llm.close()
    return out


def engine_greedy(vault_path, prompt: list[int], n: int, activations: str = "q8") -> list[int]:
    from pysmoe.engine import open_vault

    out = []
    with open_vault(vault_path) as v, v.session(activations=activations) as s:
        logits = s.prefill(list(prompt))
        for _ in range(n):
            out.append(int(np.argmax(logits)))
            logits = s.decode(out[-1])
    return out


def quantize_gguf(src, out, ftype: str) -> Path:
    """llama.cpp's quantiser (llama_model_quantize, what llama-quantize runs) from src to ftype."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize to {ftype} failed ({rc})")
    return Path(out)


def gguf_table(ftypes, n_windows, length: int, threads: int | None, tmp: Path, continuations: int = 32) -> list[dict]:
    """The demo quantised by llama.cpp to each of ftypes, scored through pysmoe (the file imported
    by `pysmoe convert`) and through llama.cpp on the very same file and windows."""
    import gguf

    demo = ensure_demo_vault()
    f32 = tmp / "demo-F32.gguf"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "export_gguf.py"), str(demo), str(f32),
                    "--experts", "f32", "--dense", "f32", "--quiet"], check=True)
    text = HELDOUT_TEXT.read_text(encoding="utf-8")
    rows = []
    for ftype in ftypes:
        gg = f32 if ftype == "F32" else quantize_gguf(f32, tmp / f"demo-{ftype}.gguf", ftype)
        types = {}
        for t in gguf.GGUFReader(gg).tensors:
            types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        vault = convert_checkpoint(gg, tmp / f"v-{ftype}", progress=False)
        windows = heldout_windows(vault, n_windows, length)
        from pysmoe.tokenizer import load_tokenizer
        same_tokens = load_tokenizer(vault).encode(text) == llama_cpp_tokens(gg, text)
        r = {"file": ftype, "types": types, "tokens_equal": same_tokens}
        for label, fn in (("llama.cpp", lambda: llama_cpp_nll(gg, windows, threads or 2)),
                          ("pysmoe f32", lambda: engine_nll(vault, windows, "f32", threads)),
                          ("pysmoe q8", lambda: engine_nll(vault, windows, "q8", threads))):
            t0 = time.perf_counter()
            r[label] = math.exp(fn())
            print(f"{ftype:8s} {label:12s} ppl {r[label]:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
        # per window: how many of the greedy ids agree before the first difference
        r["greedy_same"] = {"f32": [], "q8": []}
        for w in windows[:3]:
            prompt = [int(t) for t in w[:32]]
            a = llama_cpp_greedy(gg, prompt, continuations, threads or 2)
            for act in ("f32", "q8"):
                b = engine_greedy(vault, prompt, continuations, act)
                r["greedy_same"][act].append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)))
        rows.append(r)
    return rows


def _gpt_oss_layer(v, layer: int, E: int, dense) -> dict:
    """A gpt-oss layer's tensors under transformers' names from a vault (GptOssExperts' layout:
    gate_up_proj [E, H, 2I] and its bias with gate and up interleaved, down_proj [E, I, H])."""
    import torch

    p, q = f"model.layers.{layer}.", f"layers.{layer}."
    new = {f"{p}self_attn.sinks": dense(q + "sinks"), f"{p}mlp.router.weight": dense(q + "router"),
           f"{p}mlp.router.bias": dense(q + "router.bias")}
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        new[f"{p}self_attn.{n}.weight"] = dense(q + n)
        new[f"{p}self_attn.{n}.bias"] = dense(q + n + ".bias")
    for n in ("input_layernorm", "post_attention_layernorm"):
        new[f"{p}{n}.weight"] = dense(q + n)
    tensors = v.layer_expert_tensors[layer]
    gate_up, gate_up_bias, down, down_bias = [], [], [], []
    for e in range(E):
        g, u, d = v.expert(layer, e)
        b = v.blob(layer, e)
        gb, ub, db = (np.frombuffer(b[t.offset:t.offset + t.nbytes], "<f4") for t in tensors[3:6])
        gu = np.empty((g.shape[1], 2 * g.shape[0]), np.float32)
        gu[:, 0::2], gu[:, 1::2] = g.T, u.T
        gub = np.empty(2 * g.shape[0], np.float32)
        gub[0::2], gub[1::2] = gb, ub
        gate_up.append(gu), gate_up_bias.append(gub), down.append(d.T), down_bias.append(db)
    for name, parts in (("gate_up_proj", gate_up), ("gate_up_proj_bias", gate_up_bias), ("down_proj", down),
                        ("down_proj_bias", down_bias)):
        new[f"{p}mlp.experts.{name}"] = torch.from_numpy(np.ascontiguousarray(np.stack(parts)))
    return new


def hf_from_vault(vault_path, out_dir) -> Path:
    """Write a float32 Hugging Face checkpoint (Qwen3-MoE or gpt-oss, as the vault's config.json
    says) holding the vault's weights as the engine sees them (every tensor dequantised:
    q4/q8/bf16/MXFP4 values widen exactly to float32), with the vault's tokenizer files. Needs
    torch and transformers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pysmoe.vaultio import read_vault

    vault_path, out = Path(vault_path), Path(out_dir)
    v = read_vault(vault_path)
    try:
        config = AutoConfig.from_pretrained(vault_path)  # the source's config.json, kept in the vault
        if config.model_type not in ("qwen3_moe", "gpt_oss"):
            raise ValueError(f"hf_from_vault: {config.model_type} vaults are not written back (qwen3_moe, gpt_oss)")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).float()
        state = model.state_dict()

        def dense(name):
            t = np.asarray(v.tensor(name), dtype=np.float32)
            return torch.from_numpy(t.reshape(-1) if t.ndim == 2 and t.shape[0] == 1 else t)

        new = {"model.embed_tokens.weight": dense("embed_tokens"), "model.norm.weight": dense("norm")}
        if not config.tie_word_embeddings:
            new["lm_head.weight"] = dense("lm_head")
        for layer in range(config.num_hidden_layers):
            if config.model_type == "gpt_oss":
                new.update(_gpt_oss_layer(v, layer, config.num_local_experts, dense))
                continue
            p, q = f"model.layers.{layer}.", f"layers.{layer}."
            for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                new[f"{p}self_attn.{n}.weight"] = dense(q + n)
            for n in ("input_layernorm", "post_attention_layernorm"):
                new[f"{p}{n}.weight"] = dense(q + n)
            if not v.layer_is_sparse(layer):
                for n in ("gate_proj", "up_proj", "down_proj"):
                    new[f"{p}mlp.{n}.weight"] = dense(q + n)
                continue
            new[f"{p}mlp.gate.weight"] = dense(q + "router")
            experts = [[np.asarray(m, dtype=np.float32) for m in v.expert(layer, e)]
                       for e in range(config.num_experts)]
            new[f"{p}mlp.experts.gate_up_proj"] = torch.from_numpy(
                np.stack([np.concatenate([g, u], axis=0) for g, u, _ in experts]))
            new[f"{p}mlp.experts.down_proj"] = torch.from_numpy(np.stack([d for _, _, d in experts]))
        missing = set(state) - set(new) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
        if missing:
            raise ValueError(f"hf_from_vault: no vault tensor for {sorted(missing)[:5]}")
        model.load_state_dict(new, strict=False)
        if config.tie_word_embeddings:
            model.tie_weights()
    finally:
        v.close()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (vault_path / name).exists():
            (out / name).write_bytes((vault_path / name).read_bytes())
    return out


def released_spelling(hf: Path, out: Path) -> Path:
    """A copy of the checkpoint with config.json as released Qwen checkpoints spell it (mlx-lm
    reads num_experts and a top-level rope_theta; transformers 5 writes num_local_experts and
    rope_parameters)."""
    shutil.copytree(hf, out)
    cfg = json.loads((out / "config.json").read_text())
    if "num_local_experts" in cfg:
        cfg["num_experts"] = cfg.pop("num_local_experts")
    if "rope_parameters" in cfg:
        cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def foreign_rows(hf: Path, vaults: dict, windows: np.ndarray, tmp: Path, row, skipped: list, threads) -> None:
    """The demo table's rows through other runtimes: mlx-lm on its own 4-bit conversion (and
    pysmoe on that conversion), llama.cpp on export_gguf's files."""
    try:
        import mlx_lm
    except ImportError:
        skipped.append("mlx-lm (not installed)")
    else:
        mlx_dir = tmp / "mlx"
        mlx_lm.convert(str(released_spelling(hf, tmp / "hf-released")), str(mlx_dir), quantize=True,
                       q_bits=4, q_group_size=64, dtype="float32")
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(hf / f, mlx_dir / f)
        row("mlx-lm, its 4-bit conversion (f32 compute)", lambda: mlx_nll(mlx_dir, windows))
        mv = convert_checkpoint(mlx_dir, tmp / "v-mlx", progress=False)
        for act in ("f32", "q8"):
            row(f"pysmoe on that MLX conversion, activations {act}",
                lambda: engine_nll(mv, windows, activations=act, threads=threads))

    try:
        import llama_cpp  # noqa: F401
        import gguf  # noqa: F401
    except ImportError:
        skipped.append("llama.cpp (llama-cpp-python or gguf not installed)")
    else:
        for vault, experts, dense, label in ((vaults["f32"], "f32", "f32", "f32 vault as F32"),
                                             (vaults["default"], "q4_0", "q8_0",
                                              "default vault, experts Q4_0, dense Q8_0")):
            gg = tmp / f"{label.split()[0]}-{experts}.gguf"
            subprocess.run([sys.executable, str(ROOT / "scripts" / "export_gguf.py"), str(vault), str(gg),
                            "--experts", experts, "--dense", dense, "--quiet"], check=True)
            row(f"llama.cpp, export_gguf of the {label}", lambda: llama_cpp_nll(gg, windows))


def released_spelling_is_the_same(hf: Path, mxfp4_vault: Path, tmp: Path) -> None:
    """Write the float checkpoint's experts as gpt-oss is released (`*_blocks`/`*_scales`, made by
    quantize_mxfp4 and re-paired into HF's nibble order), convert that as stored, and check that
    every expert blob is byte for byte the `--experts MXFP4` vault's: the MXFP4 rows measure the
    released format."""
    from safetensors.numpy import load_file, save_file

    from pysmoe.convert.gpt_oss import ggml_to_mxfp4
    from pysmoe.ggml_blocks import quantize_mxfp4
    from pysmoe.vaultio import read_vault

    out = tmp / "hf-released-mxfp4"
    out.mkdir()
    tensors = {}
    for f in sorted(hf.glob("*.safetensors")):
        tensors.update(load_file(f))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name)  # (E, in, out): x @ W
        E, cols, rows = w.shape
        q = quantize_mxfp4(np.ascontiguousarray(w.transpose(0, 2, 1)).reshape(E * rows, cols))
        blocks, scales = ggml_to_mxfp4(q, E * rows, cols)
        tensors[name + "_blocks"] = blocks.reshape(E, rows, cols // 32, 16)
        tensors[name + "_scales"] = scales.reshape(E, rows, cols // 32)
    save_file(tensors, str(out / "model.safetensors"))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(hf / f, out / f)
    v = convert_checkpoint(out, tmp / "v-released-spelling", dense="f32", progress=False)
    a, b = read_vault(v), read_vault(mxfp4_vault)
    try:
        L, E = a.config["num_hidden_layers"], a.config["num_experts"]
        same = all(bytes(a.blob(l, e)) == bytes(b.blob(l, e)) for l in range(L) for e in range(E))
    finally:
        a.close(), b.close()
    if not same:
        raise AssertionError("the released spelling's MXFP4 experts differ from convert --experts MXFP4's")
    print("released spelling (*_blocks/*_scales) imported as stored = convert --experts MXFP4, blob for blob",
          flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", help="the trained float32 checkpoint (default: regenerated from the demo vault)")
    ap.add_argument("--windows", type=int, default=None, help="windows scored (default: all the held-out text)")
    ap.add_argument("--length", type=int, default=256, help="tokens per window (default 256)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--gguf", nargs="+", metavar="FTYPE",
                    help="instead: the demo quantised by llama.cpp to these llama_ftype names (Q4_K_M Q8_0 "
                         "...; F32 for the export itself), through pysmoe and llama.cpp on the same file")
    args = ap.parse_args(argv)
    if args.gguf:
        tmp = Path(tempfile.mkdtemp(prefix="smoe-ppl-gguf-"))
        try:
            rows = gguf_table(args.gguf, args.windows, args.length, args.threads, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print("\n| GGUF (llama.cpp's quantiser) | tensor types | llama.cpp | pysmoe, f32 act. | difference "
              "| pysmoe, q8 act. | difference | greedy ids before the first difference (3 prompts, of 32): "
              "f32 act. / q8 act. |\n|---|---|---:|---:|---:|---:|---:|---|")
        for r in rows:
            d = [100 * (r[f"pysmoe {a}"] / r["llama.cpp"] - 1) for a in ("f32", "q8")]
            g = r["greedy_same"]
            print(f"| {r['file']} | {', '.join(f'{k} {v}' for k, v in r['types'].items())} | {r['llama.cpp']:.4f} "
                  f"| {r['pysmoe f32']:.4f} | {d[0]:+.3f} % | {r['pysmoe q8']:.4f} | {d[1]:+.3f} % "
                  f"| {g['f32']} / {g['q8']} |")
        if not all(r["tokens_equal"] for r in rows):
            print("tokenization differs from llama.cpp's on the held-out text")
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows}, indent=2) + "\n")
        return 0

    demo = ensure_demo_vault()
    windows = heldout_windows(demo, args.windows, args.length)
    tmp = Path(tempfile.mkdtemp(prefix="smoe-ppl-"))
    rows, skipped = [], []

    def row(name, fn, **extra):
        t0 = time.perf_counter()
        nll = fn()
        r = {"path": name, "nll": nll, "ppl": math.exp(nll), "seconds": round(time.perf_counter() - t0, 1), **extra}
        rows.append(r)
        print(f"{name:58s} ppl {r['ppl']:.4f}  ({r['seconds']} s)", flush=True)

    try:
        if args.hf:
            hf, source = Path(args.hf), "trained f32 checkpoint"
        else:
            hf, source = hf_from_vault(demo, tmp / "hf"), "regenerated from the demo vault"
        family = json.loads((hf / "config.json").read_text())["model_type"]
        print(f"{windows.shape[0]} windows x {windows.shape[1]} tokens; f32 model ({family}): {source}", flush=True)
        oss = family == "gpt_oss"
        formats = ("f32", "bf16", "q8", "q4") + (("MXFP4",) if oss else ())
        vaults = {}
        for fmt in formats:
            vaults[fmt] = convert_checkpoint(hf, tmp / f"v-{fmt}", experts=fmt, dense="f32", progress=False)
        vaults["default"] = convert_checkpoint(hf, tmp / "v-default", progress=False)
        labels = {"default": "default conversion (experts q4, dense q8)"}
        if oss:  # the released checkpoints' formats: MXFP4 experts (the converter keeps dense q8)
            vaults["released"] = convert_checkpoint(hf, tmp / "v-released", experts="MXFP4", progress=False)
            labels["released"] = "experts MXFP4, dense q8 (as released, dense q8)"
            released_spelling_is_the_same(hf, vaults["MXFP4"], tmp)

        row("transformers f32", lambda: hf_nll(hf, windows))
        if oss:
            skipped.append("numpy reference (pysmoe/reference.py has no gpt-oss recipe)")
            mx_hf = hf_from_vault(vaults["MXFP4"], tmp / "hf-mxfp4")
            row("transformers f32 on the MXFP4 vault's dequantised weights", lambda: hf_nll(mx_hf, windows))
        else:
            row("numpy reference, f32 vault", lambda: reference_nll(vaults["f32"], windows))
        for fmt in formats + tuple(labels):
            label = labels.get(fmt, f"experts {fmt}, dense f32")
            for act in ("f32", "q8"):
                row(f"pysmoe {label}, activations {act}",
                    lambda: engine_nll(vaults[fmt], windows, activations=act, threads=args.threads))
        if oss:
            skipped.append("mlx-lm and llama.cpp rows (run for the Qwen3-MoE demo only)")

        if not oss:
            foreign_rows(hf, vaults, windows, tmp, row, skipped, args.threads)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    base = rows[0]["ppl"]
    print(f"\n| path | perplexity | vs transformers f32 |\n|---|---:|---:|")
    for r in rows:
        print(f"| {r['path']} | {r['ppl']:.4f} | {100 * (r['ppl'] / base - 1):+.3f} % |")
    for s in skipped:
        print(f"skipped: {s}")
    if args.json:
        meta = {"windows": int(windows.shape[0]), "length": int(windows.shape[1]), "f32_model": source,
                "cpu": platform.processor() or platform.machine(), "load_average": os.getloadavg(),
                "skipped": skipped}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
