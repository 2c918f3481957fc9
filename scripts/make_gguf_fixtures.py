#!/usr/bin/env python3
"""Remake tests/data/gguf/: small GGUF files written by llama.cpp's own tools, for the GGUF import
tests (tests/test_gguf_import.py), so that CI needs no llama.cpp build.

    python scripts/make_gguf_fixtures.py --llama-cpp DIR [--out tests/data/gguf]

DIR is llama.cpp's source tree (convert_hf_to_gguf.py and gguf-py/ in it): the one inside
llama-cpp-python's source package will do (`pip download --no-deps --no-binary :all:
llama-cpp-python`, then unpack; it is vendor/llama.cpp). Quantising needs llama-cpp-python
installed (its `llama_model_quantize`, the same code as the `llama-quantize` tool). logits.npz
needs a build whose CPU path quantises activations as x86's AVX2 code does: `CMAKE_ARGS="-DGGML_NATIVE=OFF
-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" pip install llama-cpp-python` (a native build on a
CPU with AMX takes ggml's AMX kernels, which fault where the hypervisor does not enable AMX).

Each fixture is a tiny random model of its family (transformers) saved by `save_pretrained`,
turned into an F32 GGUF by convert_hf_to_gguf.py, then quantised by llama.cpp:

    tiny-f32.gguf        hidden 64: every tensor F32 (the oracle test's exact case)
    tiny-q8_0.gguf       hidden 64: Q8_0 matrices, F32 norms and router
    tiny-q4_0.gguf       hidden 64: Q4_0 (llama.cpp keeps a few tensors in other types)
    olmoe-q8_0.gguf      an OLMoE (llama.cpp's `olmoe`), hidden 64: Q8_0
    k256-q4_k_m.gguf     hidden 256: Q4_K_M, llama.cpp's mix (Q4_K, Q6_K, and where a row of 128
                         is too short for a 256-block, its fallbacks Q5_0/Q8_0, per layer)
    k256-iq4_xs.gguf     hidden 256: IQ4_XS (IQ4_NL where rows are 128)
    k256-q5_k_m.gguf     hidden 256: Q5_K_M (Q5_K, Q6_K and fallbacks)
    k256-iq.gguf         hidden 256, every matrix 256 columns wide: the seven codebook types of the
                         low-bit mixes (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) spread
                         over experts, attention, embedding and lm_head (IQ_MIX), each tensor
                         quantised by llama.cpp's own ggml_quantize_chunk with a flat importance
                         matrix (llama_model_quantize refuses the IQ1/IQ2 types without one)
    glm4moe-q8_0.gguf    GLM-4.5 (`glm4moe`): QK-norm, 4 expert groups, a shared expert, a dense
                         first layer, biases, and one multi-token-prediction layer: Q8_0
    glm4moe-q4_k_m.gguf  GLM-4.5-Air-like, hidden 256: Q4_K_M
    mixtral-q4_k_m.gguf  Mixtral (`llama` with experts; q/k rows permuted by the converter) with a
                         SentencePiece vocabulary trained here: Q4_K_M
    gpt-oss-mxfp4.gguf   gpt-oss (`gpt-oss`): llama.cpp's MXFP4_MOE mix (MXFP4 experts), YaRN
    qwen3next-q8_0.gguf  Qwen3-Next (`qwen3next`): Gated DeltaNet and gated attention layers: Q8_0
    qwen35moe-q8_0.gguf  Qwen3.5-MoE (`qwen35moe`): value heads in llama.cpp's tiled order: Q8_0
    qwen35moe-q4_k_m.gguf  the same family, hidden 256: Q4_K_M (ssm_out's 64-wide v heads inside
                         Q4_K's 256-blocks)
    logits.npz           llama.cpp's own logits on each fixture (LOGIT_IDS after a BOS-free start,
                         every position, f32 KV cache, one thread): at LOGIT_PICKS vocabulary ids
                         (a fixed random 64 and llama.cpp's top 8) and max|logit| per position, for
                         the check that pysmoe's 8-bit activations compute as ggml does
    tokens.json          llama.cpp's token ids for TOKENIZER_TEXTS: on tiny-f32.gguf's vocabulary,
                         on the demo's vocabulary under each pre-tokenizer of TOKENIZER_PRES
                         (vocabulary-only GGUFs made here, tokenised by llama.cpp), and on each
                         family fixture's vocabulary with its family's chat text (FAMILY_TEXTS)

A shape's random weights depend only on its seed, its place among the distinct shapes of FIXTURES
(so `--only` remakes the same files); the files depend also on the llama.cpp version.

The synthetic tokenizer (pysmoe.tokenizer) is not one convert_hf_to_gguf.py recognises by its
hash, so the conversion is told its pre-tokenizer (`--pre`, default qwen2; FAMILY_PRE per family:
glm4, gpt-4o): the GGUF's tokenizer is then whatever llama.cpp makes of those tokens, merges and
pre name, which is what the import must reproduce.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

SMALL = dict(hidden_size=64, moe_intermediate_size=64, intermediate_size=96, num_experts=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16)
K256 = dict(hidden_size=256, moe_intermediate_size=128, intermediate_size=256, num_experts=4,
            num_attention_heads=2, num_key_value_heads=1, head_dim=64)

# OLMoE (llama.cpp's `olmoe`): QK-norm over the whole projection, top-k weights not renormalised.
# convert_hf_to_gguf.py writes rms_norm_eps 1e-5 for it whatever the config says: so does this.
OLMOE = dict(model="olmoe", hidden_size=64, intermediate_size=64, num_experts=4, num_experts_per_tok=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)

# GLM-4.5 (llama.cpp's `glm4moe`): sigmoid router with e_score_correction_bias (exp_probs_b),
# grouped selection, routed scaling, a shared expert, a leading dense layer, partial RoPE, q/k/v
# biases; the first one with QK-norm (GLM-4.5) and 4 groups, the second without (GLM-4.5-Air).
# The first carries one multi-token-prediction layer (blk.L.nextn.*), as the released checkpoints
# and llama.cpp's files do (the import leaves it out); the second has none (the size limit).
GLM = dict(model="glm4_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
           num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=2, head_dim=32, attention_bias=True, use_qk_norm=True,
           routed_scaling_factor=2.5, n_group=4, topk_group=2, norm_topk_prob=True, rms_norm_eps=1e-5)
GLM_AIR = dict(model="glm4_moe", hidden_size=256, intermediate_size=128, moe_intermediate_size=128,
               n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
               attention_bias=True, use_qk_norm=False, routed_scaling_factor=1.0, n_group=1, topk_group=1,
               norm_topk_prob=True, rms_norm_eps=1e-5, partial_rotary_factor=0.5, mtp=0)

# Mixtral (llama.cpp's `llama` architecture with experts): its converter permutes the q/k rows for
# llama.cpp's interleaved RoPE (the import undoes it row by row) and writes the SentencePiece
# vocabulary (`tokenizer.ggml.model = llama`: scores, byte tokens, <s>/</s>/<unk>). Grouped-query
# attention (2 heads, 1 kv head) so that q and k are permuted with different head counts.
MIXTRAL = dict(model="mixtral", vocab_size=384, hidden_size=256, intermediate_size=64, num_local_experts=4,
               num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
               rms_norm_eps=1e-5)

# gpt-oss (llama.cpp's `gpt-oss`): quantised by llama.cpp's MXFP4_MOE mix (experts MXFP4, as the
# released files are); attention sinks, biases everywhere, a window of 4 on alternate layers, and
# YaRN as the released config has it (no truncation of the correction range).
GPT_OSS = dict(model="gpt_oss", hidden_size=64, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
               max_position_embeddings=128, rms_norm_eps=1e-5,
               rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 32, "rope_theta": 150000.0})

# Qwen3-Next (llama.cpp's `qwen3next`): three Gated DeltaNet layers and one gated full-attention
# layer, 2 key heads to 4 value heads, a shared expert with its sigmoid gate, partial RoPE. The
# converter is run with --no-mtp (it insists on MTP tensors otherwise, which transformers' model has
# none of).
QWEN3_NEXT = dict(model="qwen3_next", hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                  num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, shared_expert_intermediate_size=64,
                  norm_topk_prob=True, rms_norm_eps=1e-6)

# Qwen3.5-MoE (llama.cpp's `qwen35moe`, whose converter puts the value heads in tiled order): the
# same layer mix, 2 key heads to 4 value heads (so grouped and tiled orders differ), every layer
# sparse with a shared expert; and a hidden-256 one for Q4_K_M, its ssm_out 4 v heads of 64 wide.
QWEN35 = dict(QWEN3_NEXT, model="qwen3_5_moe")
del QWEN35["intermediate_size"], QWEN35["norm_topk_prob"]
QWEN35_K256 = dict(QWEN35, hidden_size=256, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                   num_hidden_layers=2, full_attention_interval=2, head_dim=64, num_attention_heads=2,
                   num_key_value_heads=1, num_experts=4, linear_key_head_dim=64, linear_value_head_dim=64)

# every matrix a whole number of 256-blocks wide (o_proj: 4 heads of 64; down: 256)
K256_IQ = dict(K256, moe_intermediate_size=256, num_attention_heads=4)
# GGUF tensor name (its layer as {l}) -> ggml type per layer, for IQ_MIX; the rest stays F32
IQ_MIX = {
    "token_embd.weight": "IQ3_S",
    "output.weight": "IQ3_XXS",
    "blk.{l}.ffn_gate_exps.weight": ("IQ2_XXS", "IQ1_S"),
    "blk.{l}.ffn_up_exps.weight": ("IQ2_XS", "IQ1_M"),
    "blk.{l}.ffn_down_exps.weight": ("IQ3_XXS", "IQ2_S"),
    "blk.{l}.attn_q.weight": ("IQ3_S", "IQ2_S"),
    "blk.{l}.attn_k.weight": ("IQ3_S", "IQ2_XS"),
    "blk.{l}.attn_v.weight": ("IQ3_XXS", "IQ2_XXS"),
    "blk.{l}.attn_output.weight": ("IQ2_S", "IQ3_S"),
}

FIXTURES = {  # name -> (shape, llama_ftype name, "IQ_MIX", or None for the F32 file itself)
    "tiny-f32": (SMALL, None),
    "tiny-q8_0": (SMALL, "Q8_0"),
    "tiny-q4_0": (SMALL, "Q4_0"),
    "k256-q4_k_m": (K256, "Q4_K_M"),
    "k256-iq4_xs": (K256, "IQ4_XS"),
    "k256-q5_k_m": (K256, "Q5_K_M"),
    "k256-iq": (K256_IQ, "IQ_MIX"),
    "olmoe-q8_0": (OLMOE, "Q8_0"),
    "glm4moe-q8_0": (GLM, "Q8_0"),
    "glm4moe-q4_k_m": (GLM_AIR, "Q4_K_M"),
    "mixtral-q4_k_m": (MIXTRAL, "Q4_K_M"),
    "gpt-oss-mxfp4": (GPT_OSS, "MXFP4_MOE"),
    "qwen3next-q8_0": (QWEN3_NEXT, "Q8_0"),
    "qwen35moe-q8_0": (QWEN35, "Q8_0"),
    "qwen35moe-q4_k_m": (QWEN35_K256, "Q4_K_M"),
}
CONVERT_ARGS = {"qwen3_next": ["--no-mtp"], "qwen3_5_moe": ["--no-mtp"]}  # extra convert_hf_to_gguf.py options per family
# what convert_hf_to_gguf.py is told the pre-tokenizer is, per family (default: --pre)
FAMILY_PRE = {"glm4_moe": "glm4", "gpt_oss": "gpt-4o"}

# Text for the tokenizer check: prose, code, digits, whitespace runs, CRLF, contractions in
# both cases, several scripts and emoji (a ZWJ sequence among them), and the special tokens.
TOKENIZER_TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 3.14159, not 22/7!",
    "def f(x):\n    return x ** 2  # square\n\n\n\tif   x  >  1000000:\n        pass\n",
    "12345 678 9 0.5 1,000,000 2025-12-03 3rd 4th 100% $42 v1.2.3",
    "a   b\t\tc\n\n\n  d   \r\n e \u00a0 f\u3000g   ",
    "I'VE don't WE'LL they'Re SHE'S it'd O'Neil 'quoted' ''double''",
    "h\u00e9llo w\u00f6rld \u00f1and\u00fa \u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 "
    "\u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac \u0440\u0443\u0441\u0441\u043a\u0438\u0439 "
    "\u0639\u0631\u0628\u064a \u0915\u093f\u0924\u093e\u092c \U0001f680\U0001f636\u200d\U0001f32b\ufe0f \u2705",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|><|endoftext|>",
    "   leading spaces and trailing   ",
    "",
    "!!!??? ... ---=== ((( ))) [[x]] {y} <z> @#$%^&* ~`|\\ /path/to/file.py:12",
]
# Each family's own chat text, tokenised on its fixtures' vocabularies with TOKENIZER_TEXTS.
FAMILY_TEXTS = {
    "gpt_oss": "<|start|>system<|message|>You are ChatGPT.\nReasoning: low<|end|><|start|>user<|message|>What's 2+2?"
               "<|end|><|start|>assistant<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant"
               "<|channel|>final<|message|>4<|return|>",
    "qwen3_next": "<|im_start|>system\nYou are Qwen.<|im_end|>\n<|im_start|>user\nWhat's 2+2?<|im_end|>\n"
                  "<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|><|endoftext|>",
    "qwen3_5_moe": "<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n4"
                   "<|im_end|>\n",
    "mixtral": "<s>[INST] What is 2+2? Answer briefly. [/INST] 4</s><s>[INST] And 3+3?[/INST]",
    "glm4_moe": "[gMASK]<sop><|system|>\nYou are a helpful assistant.<|user|>\nWhat's 2+2? Answer briefly."
                "<|assistant|>\n<think>Simple.</think>\n4<|endoftext|><|observation|>",
}
# Pre-tokenizers checked on the demo's vocabulary (4,096 tokens, 3,837 merges).
TOKENIZER_PRES = ("qwen2", "gpt-2", "llama-bpe", "qwen35", "glm4", "gpt-4o")


def vocab_gguf(out: Path, tokenizer_dir: Path, vocab_size: int, pre: str, hparams_from: Path) -> Path:
    """A vocabulary-only GGUF (no tensors) of tokenizer_dir's tokenizer.json under the given
    llama.cpp pre-tokenizer name: what llama.cpp needs to tokenize (`vocab_only`). Written with
    gguf-py; the hyperparameters are copied from hparams_from so that llama.cpp accepts it."""
    import gguf

    sys.path.insert(0, str(ROOT / "scripts"))
    from export_gguf import copy_fields, tokenizer_fields

    tok = tokenizer_fields(Path(tokenizer_dir), vocab_size)
    r = gguf.GGUFReader(hparams_from)
    w = gguf.GGUFWriter(out, arch=r.fields["general.architecture"].contents())
    copy_fields(r, w, skip=("tokenizer.",))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    if tok["eos"] is not None:
        w.add_eos_token_id(tok["eos"])
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def llama_cpp_tokens(gguf_path: Path, texts) -> list[list[int]]:
    """llama.cpp's ids for each text: no BOS, special tokens parsed (as a chat prompt is)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)
    try:
        return [llm.tokenize(t.encode("utf-8"), add_bos=False, special=True) for t in texts]
    finally:
        llm.close()


def golden_tokens(out_dir: Path, tmp: Path) -> Path:
    """tokens.json: llama.cpp's ids for TOKENIZER_TEXTS and the held-out text's first 4 KiB,
    for the demo vocabulary under each of TOKENIZER_PRES and for tiny-f32.gguf's own."""
    demo = ROOT / "pysmoe" / "data" / "demo"
    texts = TOKENIZER_TEXTS + [(demo / "heldout.txt").read_text(encoding="utf-8")[:4096]]
    golden = {"texts": texts, "demo": {}}
    for pre in TOKENIZER_PRES:
        g = vocab_gguf(tmp / f"vocab-{pre}.gguf", demo, 4096, pre, out_dir / "tiny-f32.gguf")
        golden["demo"][pre] = llama_cpp_tokens(g, texts)
    golden["tiny-f32"] = llama_cpp_tokens(out_dir / "tiny-f32.gguf", texts)
    golden["fixtures"] = {}
    for name, (shape, _) in FIXTURES.items():  # each family's fixtures on their own vocabulary
        family = shape.get("model", "qwen3_moe")
        if family in FAMILY_TEXTS and (out_dir / f"{name}.gguf").exists():
            ftexts = texts + [FAMILY_TEXTS[family]]
            golden["fixtures"][name] = {"texts": ftexts, "ids": llama_cpp_tokens(out_dir / f"{name}.gguf", ftexts)}
    path = out_dir / "tokens.json"
    path.write_text(json.dumps(golden, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


LOGIT_POSITIONS = 20  # ids: np.random.default_rng(3).integers(0, vocab, 20), as the transformers test takes


def llama_cpp_logits(gguf_path: Path, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits at every position of ids: f32 K and V (no f16 rounding of the cache),
    flash attention off, one thread, one batch."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=64, n_batch=64, n_ubatch=64, n_threads=1,
                          n_threads_batch=1, logits_all=True, type_k=llama_cpp.GGML_TYPE_F32,
                          type_v=llama_cpp.GGML_TYPE_F32, flash_attn=False, verbose=False)
    try:
        llm.eval(ids)
        return np.array(llm.scores[:len(ids)], dtype=np.float32)
    finally:
        llm.close()


def golden_logits(out_dir: Path) -> Path:
    """logits.npz: per fixture, `NAME.ids` (the prompt), `NAME.picks` (per position the vocabulary
    ids kept: 64 drawn once per fixture, then llama.cpp's top 8), `NAME.logits` (its logits there)
    and `NAME.scale` (max|logit| per position)."""
    import gguf

    arrays = {}
    for name in FIXTURES:
        path = out_dir / f"{name}.gguf"
        if not path.exists():
            continue
        r = gguf.GGUFReader(path)
        vocab = len(r.fields["tokenizer.ggml.tokens"].data)
        ids = [int(i) for i in np.random.default_rng(3).integers(0, vocab, LOGIT_POSITIONS)]
        try:
            full = llama_cpp_logits(path, ids)
        except ValueError as e:  # olmoe-q8_0: llama.cpp wants k_norm as wide as q_norm (no GQA)
            print(f"{name}: llama.cpp cannot run it ({e}); no logits recorded")
            continue
        drawn = np.random.default_rng(11).choice(vocab, 64, replace=False)
        picks = np.stack([np.concatenate([drawn, np.argsort(-row, kind="stable")[:8]]) for row in full])
        arrays[f"{name}.ids"] = np.array(ids, np.int32)
        arrays[f"{name}.picks"] = picks.astype(np.int32)
        arrays[f"{name}.logits"] = np.take_along_axis(full, picks, axis=1)
        arrays[f"{name}.scale"] = np.max(np.abs(full), axis=1)
    path = out_dir / "logits.npz"
    np.savez_compressed(path, **arrays)
    return path


_CONVERT = """
import sys
sys.path.insert(0, {dir!r})
import convert_hf_to_gguf as c
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
sys.argv = ["convert_hf_to_gguf.py", {src!r}, "--outtype", "f32", "--outfile", {out!r}] + {extra!r}
c.main()
"""


def hf_checkpoint(work: Path, shape: dict, seed: int) -> Path:
    from hf_models import make_hf_model

    shape = dict(shape)
    family = shape.pop("model", "qwen3_moe")
    if family == "olmoe":
        return olmoe_checkpoint(work, shape, seed)
    if family == "glm4_moe":
        return glm_checkpoint(work, shape, seed)
    if family == "mixtral":
        return mixtral_checkpoint(work, shape, seed)
    if family == "gpt_oss":
        return gpt_oss_checkpoint(work, shape, seed)
    if family in ("qwen3_next", "qwen3_5_moe"):
        return qwen3_next_checkpoint(work, shape, seed, family)
    path, _ = make_hf_model(work, seed=seed, **shape)
    return path


def olmoe_checkpoint(work: Path, shape: dict, seed: int) -> Path:
    """A random OlmoeForCausalLM saved by save_pretrained (hf_models' weight draw), with a tokenizer."""
    import torch
    from hf_models import BASE_CONFIG, randomize, write_tokenizer
    from transformers import OlmoeConfig, OlmoeForCausalLM

    keys = ("vocab_size", "num_hidden_layers", "max_position_embeddings", "tie_word_embeddings")
    kw = {**{k: BASE_CONFIG[k] for k in keys}, **shape}
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    torch.manual_seed(seed)
    model = OlmoeForCausalLM(OlmoeConfig(**kw)).float().eval()
    randomize(model, seed)
    path = Path(work) / "hf"
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path, model.config.vocab_size)
    return path


GLM_SPECIALS = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")


def glm_checkpoint(work: Path, shape: dict, seed: int) -> Path:
    """A random Glm4MoeForCausalLM saved by save_pretrained, with one multi-token-prediction layer
    appended as zai-org's releases have it (model.layers.L: a full decoder layer plus eh_proj,
    enorm, hnorm and shared_head.norm), GLM's chat template and special tokens."""
    import torch
    from hf_models import BASE_CONFIG
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    from pysmoe.tokenizer import build_synthetic_tokenizer

    keys = ("vocab_size", "max_position_embeddings", "tie_word_embeddings")
    kw = {**{k: BASE_CONFIG[k] for k in keys}, **shape}
    rope = {"rope_type": "default", "rope_theta": 10000.0,
            "partial_rotary_factor": kw.pop("partial_rotary_factor", 0.5)}
    L, mtp = kw["num_hidden_layers"], kw.pop("mtp", 1)
    kw.update(num_hidden_layers=L + mtp, rope_parameters=rope)  # the last one becomes the MTP layer
    torch.manual_seed(seed)
    model = Glm4MoeForCausalLM(Glm4MoeConfig(**kw)).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * (3.0 / p.shape[-1] ** 0.5))
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    path = Path(work) / "hf"
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    H = kw["hidden_size"]
    if mtp:
        st = path / "model.safetensors"
        w = load_file(st)
        p = f"model.layers.{L}."
        w[p + "eh_proj.weight"] = torch.randn(H, 2 * H, generator=g) / (2 * H) ** 0.5
        for n in ("enorm", "hnorm", "shared_head.norm"):
            w[p + n + ".weight"] = torch.rand(H, generator=g) + 0.5
        save_file(w, st, metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(num_hidden_layers=L, num_nextn_predict_layers=mtp)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    V = kw["vocab_size"]
    tok = Tokenizer.from_str(build_synthetic_tokenizer(V - len(GLM_SPECIALS)))
    tok.add_special_tokens(list(GLM_SPECIALS))
    assert tok.get_vocab_size(with_added_tokens=True) <= V
    tok.save(str(path / "tokenizer.json"))
    template = (ROOT / "tests" / "data" / "glm4_moe_chat_template.jinja").read_text(encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
         "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 131072}, indent=2))
    return path


def qwen3_next_checkpoint(work: Path, shape: dict, seed: int, family: str = "qwen3_next") -> Path:
    """A random Qwen3NextForCausalLM (or Qwen3_5MoeForCausalLM, the text model) saved by
    save_pretrained (weights drawn as
    tests/test_qwen_hybrid.py draws them: decays that neither vanish nor stay at 1, (1 + w) norms
    around 0), with the synthetic tokenizer."""
    import torch
    from hf_models import BASE_CONFIG, write_tokenizer
    import transformers

    kw = {k: BASE_CONFIG[k] for k in ("vocab_size", "max_position_embeddings", "tie_word_embeddings")}
    kw.update(shape)
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    torch.manual_seed(seed)
    if family == "qwen3_5_moe":
        config, cls = transformers.Qwen3_5MoeTextConfig(**kw), transformers.Qwen3_5MoeForCausalLM
    else:
        config, cls = transformers.Qwen3NextConfig(**kw), transformers.Qwen3NextForCausalLM
    model = cls(config).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) - 0.5)
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 2 + 0.1))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * (3.0 / p.shape[-1] ** 0.5))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    path = Path(work) / "hf"
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path, kw["vocab_size"])
    return path


HARMONY_SPECIALS = ("<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>")


def gpt_oss_checkpoint(work: Path, shape: dict, seed: int) -> Path:
    """A random GptOssForCausalLM saved by save_pretrained (float experts; llama.cpp's quantiser
    makes them MXFP4), biases, sinks and norms random, with harmony's special tokens and chat
    template."""
    import torch
    from hf_models import BASE_CONFIG
    from tokenizers import Tokenizer
    from transformers import GptOssConfig, GptOssForCausalLM

    from pysmoe.tokenizer import build_synthetic_tokenizer

    kw = {"vocab_size": BASE_CONFIG["vocab_size"], "tie_word_embeddings": False, **shape}
    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**kw)).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith(("bias", "sinks")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "experts" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.6)
            elif "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    path = Path(work) / "hf"
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    V = kw["vocab_size"]
    tok = Tokenizer.from_str(build_synthetic_tokenizer(V - len(HARMONY_SPECIALS)))
    tok.add_special_tokens(list(HARMONY_SPECIALS))
    assert tok.get_vocab_size(with_added_tokens=True) <= V
    tok.save(str(path / "tokenizer.json"))
    template = (ROOT / "tests" / "data" / "gpt_oss_chat_template.jinja").read_text(encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
         "bos_token": "<|start|>", "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 131072}, indent=2))
    return path


def sentencepiece_model(vocab_size: int) -> bytes:
    """A SentencePiece BPE model (byte fallback, <unk> <s> </s> first, digits split, whitespace
    kept: Mistral's options) trained on pysmoe's small corpus."""
    import io

    import sentencepiece as spm

    corpus = (ROOT / "pysmoe" / "data" / "corpus.txt").read_text(encoding="utf-8").splitlines()
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=out, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, character_coverage=0.9995, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        add_dummy_prefix=True, split_digits=True, allow_whitespace_only_pieces=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, num_threads=1, minloglevel=2)
    return out.getvalue()


def mixtral_checkpoint(work: Path, shape: dict, seed: int) -> Path:
    """A random MixtralForCausalLM saved by save_pretrained (the released spelling:
    block_sparse_moe.experts.E.w1/w2/w3), with a SentencePiece tokenizer.model and Mixtral's chat
    template."""
    import torch
    from hf_models import BASE_CONFIG, randomize
    from transformers import MixtralConfig, MixtralForCausalLM

    keys = ("num_hidden_layers", "max_position_embeddings", "tie_word_embeddings")
    kw = {**{k: BASE_CONFIG[k] for k in keys}, **shape}
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**kw)).float().eval()
    randomize(model, seed)
    path = Path(work) / "hf"
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    (path / "tokenizer.model").write_bytes(sentencepiece_model(kw["vocab_size"]))
    template = (ROOT / "tests" / "data" / "mixtral_chat_template.jinja").read_text(encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "add_bos_token": True, "add_eos_token": False, "tokenizer_class": "LlamaTokenizer"}, indent=2))
    return path


def convert_f32(llama_cpp: Path, src: Path, out: Path, pre: str, extra: list | None = None) -> None:
    """convert_hf_to_gguf.py, in a child process with llama.cpp's own gguf-py first on its path."""
    env = dict(os.environ, PYTHONPATH=str(llama_cpp / "gguf-py"))
    code = _CONVERT.format(dir=str(llama_cpp), pre=pre, src=str(src), out=str(out), extra=list(extra or []))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=llama_cpp)


def quantize(src: Path, out: Path, ftype: str) -> None:
    """llama.cpp's quantiser (llama_model_quantize) from F32 to ftype, as llama-quantize does."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 1
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize {ftype} failed ({rc})")


def quantize_mix(src: Path, out: Path, mix: dict) -> None:
    """src's metadata and tensors into out, the tensors mix names quantised to their types by
    llama.cpp's ggml_quantize_chunk (from llama-cpp-python's libggml-base), with an importance
    matrix of ones where the type asks for one."""
    import ctypes

    import gguf
    import llama_cpp

    sys.path.insert(0, str(ROOT / "scripts"))
    from export_gguf import copy_fields

    ggml = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    ggml.ggml_quantize_chunk.restype = ctypes.c_size_t
    ggml.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    want = {}
    for pattern, types in mix.items():
        for l, t in enumerate(types if isinstance(types, tuple) else (types,)):
            want[pattern.format(l=l)] = gguf.GGMLQuantizationType[t]
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(out, r.fields["general.architecture"].contents())
    copy_fields(r, w)
    for t in r.tensors:
        data = np.ascontiguousarray(t.data, np.float32)
        qt = want.pop(t.name, None)
        if qt is None:
            w.add_tensor(t.name, data)
            continue
        cols = int(t.shape[0])
        rows = data.size // cols
        bs, ts = gguf.GGML_QUANT_SIZES[qt]
        q = np.zeros(rows * (cols // bs) * ts, np.uint8)
        imatrix = np.ones(cols, np.float32)
        n = ggml.ggml_quantize_chunk(int(qt), data.ctypes.data, q.ctypes.data, 0, rows, cols, imatrix.ctypes.data)
        assert n == q.size, (t.name, n, q.size)
        w.add_tensor(t.name, q.reshape(*data.shape[:-1], -1), raw_dtype=qt)  # the shape in bytes
    assert not want, f"tensors not in the file: {sorted(want)}"
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "gguf")
    ap.add_argument("--pre", default="qwen2", help="tokenizer.ggml.pre to write (default qwen2)")
    ap.add_argument("--only", nargs="*", help="fixture names to make (default all)")
    ap.add_argument("--tokens-only", action="store_true", help="remake tokens.json and logits.npz alone")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        f32 = {}
        if args.tokens_only:
            print(golden_tokens(args.out, tmp))
            print(golden_logits(args.out))
            return 0
        # a shape's seed is its place among the distinct shapes of FIXTURES, whatever --only picks
        seeds = {}
        for shape, _ in FIXTURES.values():
            seeds.setdefault(json.dumps(shape, sort_keys=True), len(seeds))
        for name, (shape, ftype) in FIXTURES.items():
            if args.only and name not in args.only:
                continue
            key = json.dumps(shape, sort_keys=True)
            if key not in f32:
                work = tmp / f"m{len(f32)}"
                src = hf_checkpoint(work, shape, seed=seeds[key])
                f32[key] = work / "f32.gguf"
                pre = FAMILY_PRE.get(shape.get("model"), args.pre)
                convert_f32(args.llama_cpp.resolve(), src, f32[key], pre, CONVERT_ARGS.get(shape.get("model")))
            out = args.out / f"{name}.gguf"
            if ftype is None:
                out.write_bytes(f32[key].read_bytes())
            elif ftype == "IQ_MIX":
                quantize_mix(f32[key], out, IQ_MIX)
            else:
                quantize(f32[key], out, ftype)
            print(f"{out}: {out.stat().st_size} bytes")
        print(golden_tokens(args.out, tmp))
        print(golden_logits(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
