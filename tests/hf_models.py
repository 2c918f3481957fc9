"""Small random Qwen3MoeForCausalLM checkpoints for the oracle and converter tests.

transformers' own model is the oracle: nothing here computes a forward. What this module adds is
a checkpoint that tests the converter and the reference properly:

- every weight is drawn at a scale that keeps activations O(1) (transformers' default std 0.02
  makes logits ~0.1 and a 1e-4 tolerance nearly meaningless);
- norm weights are random, not ones, so a norm applied with the wrong weight (or none) shows;
- router rows get a wide spread, so the top-k choice is decided by a clear margin. With the default
  init, routing is nearly uniform and a 1e-7 rounding difference can flip a top-k tie between two
  correct implementations. `router_gap` measures that margin for a given sequence.

Everything runs on CPU in float32, with the eager attention and experts implementations (the
plainest code transformers has).
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

# Tiny enough that building, saving and converting one takes well under a second.
BASE_CONFIG = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=64,  # q4/q8 need the input width of down_proj to be a multiple of 64
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    norm_topk_prob=True,
    tie_word_embeddings=False,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)

ROUTER_LOGIT_STD = 3.0  # std of a router logit for an RMS-1 input; default init gives ~0.16


def make_config(**overrides):
    from transformers import Qwen3MoeConfig

    kw = {**BASE_CONFIG, **overrides}
    theta = kw.pop("rope_theta", 10000.0)
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": float(theta)}
    config = Qwen3MoeConfig(**kw)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


@torch.no_grad()
def randomize(model, seed: int = 0) -> None:
    """Redraw every weight: O(1) activations, random norm weights, a wide router spread."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)  # uniform in [0.5, 1.5)
        elif name.endswith("embed_tokens.weight"):
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)  # tied: also lm_head
        elif name.endswith("mlp.gate.weight"):  # the router
            p.copy_(torch.randn(p.shape, generator=g) * (ROUTER_LOGIT_STD / p.shape[-1] ** 0.5))
        else:  # a linear map (or a stack of them); the last axis is its input
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def build_model(seed: int = 0, **overrides):
    """A Qwen3MoeForCausalLM in eval mode with random weights (see `randomize`)."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(make_config(**overrides)).float().eval()
    if model.config.tie_word_embeddings:
        model.tie_weights()
    randomize(model, seed)
    return model


@functools.lru_cache(maxsize=None)
def _tokenizer_json(vocab_size: int) -> str:
    from pysmoe.tokenizer import build_synthetic_tokenizer

    return build_synthetic_tokenizer(vocab_size)  # trains a small BPE: once per vocab size


def write_tokenizer(out_dir, vocab_size: int) -> None:
    """tokenizer.json and tokenizer_config.json (with a chat template) sized to the model's vocab."""
    from pysmoe.tokenizer import synthetic_tokenizer_config

    out_dir = Path(out_dir)
    (out_dir / "tokenizer.json").write_text(_tokenizer_json(vocab_size), encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(synthetic_tokenizer_config(), indent=2))


def make_hf_model(tmp_dir, seed: int = 0, **config_overrides):
    """Build, randomise and save a small Qwen3MoeForCausalLM. Returns (checkpoint dir, model).

    The checkpoint is what `save_pretrained` writes (safetensors, per-expert tensor names,
    transformers-5 config spelling) plus a tokenizer."""
    path = Path(tmp_dir) / "hf"
    path.mkdir(parents=True, exist_ok=True)
    model = build_model(seed, **config_overrides)
    model.save_pretrained(path)
    write_tokenizer(path, model.config.vocab_size)
    return path, model


def sample_ids(model, n: int = 24, seed: int = 1) -> list[int]:
    """A fixed pseudo-random sequence of n token ids."""
    rng = np.random.default_rng(seed)
    return [int(i) for i in rng.integers(0, model.config.vocab_size, size=n)]


@torch.no_grad()
def hf_logits(model, ids) -> np.ndarray:
    """transformers' logits (len(ids), vocab) at every position, float32."""
    out = model(torch.tensor([list(ids)], dtype=torch.long), use_cache=False)
    return out.logits[0].float().numpy()


@torch.no_grad()
def router_gap(model, ids) -> float:
    """The smallest margin, over every sparse layer and token, between the k-th and the (k+1)-th
    largest router probability: how far the top-k choice is from a tie. inf if k = num_experts
    or no layer is sparse."""
    k = model.config.num_experts_per_tok
    out = model(torch.tensor([list(ids)], dtype=torch.long), use_cache=False, output_router_logits=True)
    gap = float("inf")
    for logits in out.router_logits or ():
        probs = torch.softmax(logits.float().reshape(-1, logits.shape[-1]), dim=-1)
        if probs.shape[-1] <= k:
            continue
        top = torch.sort(probs, dim=-1, descending=True).values
        gap = min(gap, float((top[:, k - 1] - top[:, k]).min()))
    return gap


@torch.no_grad()
def set_expert(model, layer: int, expert: int, gate, up, down) -> None:
    """Overwrite one expert of the in-memory model (fused layout: gate_up_proj = [gate; up])."""
    experts = model.model.layers[layer].mlp.experts
    gate, up, down = (torch.as_tensor(np.asarray(m, dtype=np.float32)) for m in (gate, up, down))
    experts.gate_up_proj[expert].copy_(torch.cat([gate, up], dim=0))
    experts.down_proj[expert].copy_(down)


def sparse_layers(model) -> list[int]:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    return [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock)]


def write_released_spelling(path) -> None:
    """Rewrite config.json the way released Qwen checkpoints spell it: num_experts and a
    top-level rope_theta (transformers 5 writes num_local_experts and rope_parameters)."""
    cfg_path = Path(path) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_experts"] = cfg.pop("num_local_experts")
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    cfg_path.write_text(json.dumps(cfg, indent=2))


def write_fused_checkpoint(model, out_dir, *, shards: int = 1) -> Path:
    """Save the model's in-memory state dict as is: experts as fused
    `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]. With shards > 1
    it writes model-0000i-of-0000n.safetensors files and a model.safetensors.index.json."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    names = sorted(state)
    if shards == 1:
        save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i in range(shards):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: state[n] for n in names[i::shards]}
            save_file(part, str(out_dir / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in part})
        (out_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    model.config.to_json_file(str(out_dir / "config.json"))
    write_tokenizer(out_dir, model.config.vocab_size)
    return out_dir
