"""Held-out perplexity of a Qwen3-MoE through each numeric path, on the same token windows.

    from pysmoe.perplexity import heldout_windows, engine_nll
    windows = heldout_windows(vault_path, n_windows=16, length=256)
    nll = engine_nll(vault_path, windows, activations="f32")    # mean nats per predicted token
    ppl = math.exp(nll)

The held-out text is the demo model's (`HELDOUT_TEXT`: documents of the corpus that training
never saw; scripts/train_demo.py says which). It is tokenised once with the vault's tokenizer and
cut into consecutive, non-overlapping windows of `length` tokens; each window is scored from an
empty context, every token after its first predicted from those before it. Every path below
scores the very same windows, so their perplexities differ only by their numerics:

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

import math
import pathlib

import numpy as np

HELDOUT_TEXT = pathlib.Path(__file__).resolve().parent / "data" / "demo" / "heldout.txt"


def heldout_windows(vault_path, n_windows: int | None = None, length: int = 256,
                    text_path=HELDOUT_TEXT) -> np.ndarray:
    """(n, length) int64 token windows of the held-out text, in order; all that fit if n is None."""
    from .tokenizer import load_tokenizer

    ids = load_tokenizer(vault_path).encode(pathlib.Path(text_path).read_text(encoding="utf-8"))
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


def perplexity(nll: float) -> float:
    return math.exp(nll)


def engine_nll(vault_path, windows: np.ndarray, activations: str = "q8", threads: int | None = None) -> float:
    """Mean NLL through the engine: per window, prefill its first id, then decode the rest."""
    from .engine import open_vault

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
    from .reference import ReferenceModel

    with ReferenceModel(vault_path) as ref:
        total = sum(nll_of_logits(ref.logits(w), w) for w in windows)
    return _mean(total, windows)


def _hf_model(hf_dir):
    import torch
    from transformers import AutoConfig, Qwen3MoeForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM.from_pretrained(hf_dir, config=config, dtype=torch.float32).eval()


def hf_nll(hf_dir, windows: np.ndarray, batch: int = 8) -> float:
    """Mean NLL through transformers' Qwen3MoeForCausalLM, float32 on the CPU."""
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

    model, _ = load_model(pathlib.Path(mlx_dir))
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


def hf_from_vault(vault_path, out_dir) -> pathlib.Path:
    """Write a float32 Hugging Face Qwen3-MoE checkpoint holding the vault's weights as the engine
    sees them (every tensor dequantised: q4/q8/bf16 values widen exactly to float32), with the
    vault's tokenizer files. Needs torch and transformers."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from .vaultio import read_vault

    vault_path, out = pathlib.Path(vault_path), pathlib.Path(out_dir)
    v = read_vault(vault_path)
    try:
        config = Qwen3MoeConfig.from_pretrained(vault_path)  # the source's config.json, kept in the vault
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(config).float()
        state = model.state_dict()

        def dense(name):
            t = np.asarray(v.tensor(name), dtype=np.float32)
            return torch.from_numpy(t.reshape(-1) if t.ndim == 2 and t.shape[0] == 1 else t)

        new = {"model.embed_tokens.weight": dense("embed_tokens"), "model.norm.weight": dense("norm")}
        if not config.tie_word_embeddings:
            new["lm_head.weight"] = dense("lm_head")
        for layer in range(config.num_hidden_layers):
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
