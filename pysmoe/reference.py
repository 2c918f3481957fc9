"""The numpy reference forward of the MoE families (Qwen3-MoE, Mixtral, OLMoE, GLM-4.5): slow,
obvious, and the thing everything is checked against.

    from pysmoe.reference import ReferenceModel
    ref = ReferenceModel("path/to/vault")
    logits = ref.logits(ids)          # (len(ids), vocab) float32, every position
    routes = ref.routing(ids)         # per layer: (len(ids), top_k) expert ids, or None if dense

It reads the vault through the pure-Python reader (`pysmoe.vaultio.read_vault`), so the weights it
uses are exactly what the engine will see after dequantisation: q4/q8/bf16 tensors come back as the
float32 values the format defines. Everything is float32, one whole causal forward over the ids
from position 0, the math written out the way transformers' `Qwen3MoeForCausalLM` does it:

    x = embed_tokens[ids]
    for each layer l:
        h = rmsnorm(x, input_layernorm)
        q, k, v = h @ q_proj.T, h @ k_proj.T, h @ v_proj.T          split into heads of head_dim
        q, k = rmsnorm(q, q_norm), rmsnorm(k, k_norm)                 per head, before RoPE
        q, k = rope(q), rope(k)                                       rotate-half, rope_theta
        a = softmax(q k^T / sqrt(head_dim) + causal mask) v           GQA: kv head = head // group
        x = x + a @ o_proj.T
        h = rmsnorm(x, post_attention_layernorm)
        x = x + moe(h) if the layer is sparse else mlp(h)
    logits = rmsnorm(x, norm) @ lm_head.T                            lm_head = embed_tokens if tied

moe(h) for one token: p = softmax(h @ router.T) over all experts; take the top_k (ties go to the
lower expert index); renormalise the k weights to sum 1 when norm_topk_prob; the output is
Σ_j w_j · down_j(silu(gate_j h) · up_j h).

The other families are the same forward with the vault's parameters (docs/vault.md 2.2): q/k/v
(and o) biases; QK-norm per head, over the whole projection (OLMoE) or none (Mixtral); RoPE over
the first rotary_dim dims of a head (GLM); GLM's router (sigmoid scores, router.bias for the
choice, group-limited top-k, renormalised, × routed_scaling_factor); a shared expert added beside
the routed ones.

No caching of the KV state and no batching tricks: the engine's two paths are the fast versions of
this, and this file must stay easy to check by eye.
"""
from __future__ import annotations

import numpy as np

from .vaultio import read_vault


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x · 1/sqrt(mean(x²) + eps) · weight over the last axis, in float32."""
    x = x.astype(np.float32)
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return (x * (np.float32(1.0) / np.sqrt(variance + np.float32(eps)))) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def rope_tables(n_positions: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin of shape (n_positions, head_dim) for positions 0..n-1, rotate-half layout."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    angles = np.arange(n_positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)  # (n, head_dim): both halves share a freq
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x: (heads, T, head_dim); cos, sin: (T, rot). x·cos + rotate_half(x)·sin on the first rot
    dims of each head; the rest pass through (partial RoPE)."""
    rot = cos.shape[-1]
    r, rest = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = np.concatenate([-r[..., half:], r[..., :half]], axis=-1)
    return np.concatenate([r * cos + rotated * sin, rest], axis=-1)


def top_k_experts(probs: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest probabilities, largest first; equal values go to the lower index."""
    return np.argsort(-probs, kind="stable")[:k]


class ReferenceModel:
    """A Qwen3-MoE forward in numpy over a vault. `logits(ids)` and `routing(ids)`."""

    def __init__(self, vault_path):
        self.vault = read_vault(vault_path)
        c = self.vault.config
        self.config = c
        self.n_layers = int(c["num_hidden_layers"])
        self.n_heads = int(c["num_attention_heads"])
        self.n_kv_heads = int(c["num_key_value_heads"])
        self.head_dim = int(c["head_dim"])
        self.vocab_size = int(c["vocab_size"])
        self.n_experts = int(c["num_experts"])
        self.top_k = int(c["num_experts_per_tok"])
        self.norm_topk_prob = bool(c["norm_topk_prob"])
        self.tied = bool(c["tie_word_embeddings"])
        self.eps = float(c["rms_norm_eps"])
        self.rope_theta = float(c["rope_theta"])
        pm = self.vault.params
        self.qk_norm = int(pm.get("qk_norm", 1))
        self.rotary_dim = int(pm.get("rotary_dim", self.head_dim))
        self.router_kind = int(pm.get("router_kind", 0))
        self.n_group, self.topk_group = int(pm.get("n_group", 1)), int(pm.get("topk_group", 1))
        self.routed_scaling_factor = float(pm.get("routed_scaling_factor", 1.0))
        if self.vault.family not in ("qwen3_moe", "mixtral", "olmoe", "glm4_moe") or self.router_kind > 1 \
                or any(self.vault.attention_kinds):
            raise ValueError(f"the numpy reference has no recipe for this {self.vault.family} vault")
        self._dense: dict[str, np.ndarray] = {}

    # ---- weights ---------------------------------------------------------------------------

    def w(self, name: str) -> np.ndarray:
        """A dense tensor, dequantised to float32; vectors come back 1-D. Kept once read."""
        if name not in self._dense:
            t = np.asarray(self.vault.tensor(name), dtype=np.float32)
            if t.ndim == 2 and t.shape[0] == 1:
                t = t[0]
            self._dense[name] = t
        return self._dense[name]

    def has(self, name: str) -> bool:
        return name in self.vault.tensors

    def is_sparse(self, layer: int) -> bool:
        return bool(self.vault.layer_is_sparse(layer))

    # ---- blocks ----------------------------------------------------------------------------

    def attention(self, layer: int, h: np.ndarray) -> np.ndarray:
        """Causal GQA self-attention of h (T, hidden) at positions 0..T-1; returns (T, hidden)."""
        p = f"layers.{layer}."
        T, d = h.shape[0], self.head_dim
        q, k, v = (h @ self.w(p + f"{x}_proj").T for x in "qkv")
        if self.has(p + "q_proj.bias"):
            q, k, v = q + self.w(p + "q_proj.bias"), k + self.w(p + "k_proj.bias"), v + self.w(p + "v_proj.bias")
        if self.qk_norm == 2:  # OLMoE: over the whole projection
            q, k = rms_norm(q, self.w(p + "q_norm"), self.eps), rms_norm(k, self.w(p + "k_norm"), self.eps)
        q = q.reshape(T, self.n_heads, d).transpose(1, 0, 2)
        k = k.reshape(T, self.n_kv_heads, d).transpose(1, 0, 2)
        v = v.reshape(T, self.n_kv_heads, d).transpose(1, 0, 2)
        if self.qk_norm == 1:  # per head, before RoPE
            q = rms_norm(q, self.w(p + "q_norm"), self.eps)
            k = rms_norm(k, self.w(p + "k_norm"), self.eps)
        cos, sin = rope_tables(T, self.rotary_dim, self.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        group = self.n_heads // self.n_kv_heads
        future = np.triu(np.ones((T, T), dtype=bool), k=1)  # future[i, j]: j > i, not visible
        out = np.empty((self.n_heads, T, d), dtype=np.float32)
        for head in range(self.n_heads):
            kv = head // group
            scores = (q[head] @ k[kv].T) * np.float32(1.0 / np.sqrt(d))
            scores = np.where(future, np.float32(-np.inf), scores)
            out[head] = softmax(scores) @ v[kv]
        attn = out.transpose(1, 0, 2).reshape(T, self.n_heads * d)
        o = attn @ self.w(p + "o_proj").T
        return o + self.w(p + "o_proj.bias") if self.has(p + "o_proj.bias") else o

    def dense_mlp(self, layer: int, h: np.ndarray, p: str | None = None) -> np.ndarray:
        p = p or f"layers.{layer}.mlp."
        gate, up, down = self.w(p + "gate_proj"), self.w(p + "up_proj"), self.w(p + "down_proj")
        return (silu(h @ gate.T) * (h @ up.T)) @ down.T

    def route(self, layer: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each token of h (T, hidden): its top-k expert ids (T, k) and their weights (T, k)."""
        if self.router_kind == 1:
            return self.route_grouped(layer, h)
        probs = softmax(h @ self.w(f"layers.{layer}.router").T)  # (T, n_experts), float32
        experts = np.stack([top_k_experts(row, self.top_k) for row in probs])
        weights = np.take_along_axis(probs, experts, axis=-1)
        if self.norm_topk_prob:
            weights = weights / np.sum(weights, axis=-1, keepdims=True)
        return experts, weights

    def route_grouped(self, layer: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """GLM-4.5's router: sigmoid scores; the choice on score + router.bias within the
        topk_group best of n_group groups (a group scores its two best); weights the scores."""
        scores = np.float32(1.0) / (np.float32(1.0) + np.exp(-(h @ self.w(f"layers.{layer}.router").T)))
        choice = scores + self.w(f"layers.{layer}.router.bias")
        if self.n_group > 1:
            g = choice.reshape(len(h), self.n_group, -1)
            group_scores = np.sort(g, axis=-1)[..., -2:].sum(axis=-1)  # (T, n_group)
            for t in range(len(h)):
                keep = top_k_experts(group_scores[t], self.topk_group)
                mask = np.ones(self.n_group, dtype=bool)
                mask[keep] = False
                g[t, mask] = -np.inf
            choice = g.reshape(len(h), -1)
        experts = np.stack([top_k_experts(row, self.top_k) for row in choice])
        weights = np.take_along_axis(scores, experts, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (np.sum(weights, axis=-1, keepdims=True) + np.float32(1e-20))
        return experts, weights * np.float32(self.routed_scaling_factor)

    def moe(self, layer: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The sparse block; returns its output (T, hidden) and the routing (T, k)."""
        experts, weights = self.route(layer, h)
        out = np.zeros_like(h)
        for e in np.unique(experts):  # each expert read once, applied to every token routed to it
            gate, up, down = (np.asarray(m, dtype=np.float32) for m in self.vault.expert(layer, int(e)))
            tokens, slot = np.nonzero(experts == e)
            x = h[tokens]
            y = (silu(x @ gate.T) * (x @ up.T)) @ down.T
            out[tokens] += y * weights[tokens, slot][:, None]
        if self.has(f"layers.{layer}.shared.gate_proj"):  # GLM's shared expert, beside the routed ones
            out = out + self.dense_mlp(layer, h, f"layers.{layer}.shared.")
        return out, experts

    # ---- the model -------------------------------------------------------------------------

    def forward(self, ids) -> tuple[np.ndarray, list[np.ndarray | None]]:
        """Logits (T, vocab) at every position and, per layer, the routing (T, k) or None (dense)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("ids is empty")
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}); got {ids.min()}..{ids.max()}")

        x = self.w("embed_tokens")[ids]
        routing: list[np.ndarray | None] = []
        for layer in range(self.n_layers):
            p = f"layers.{layer}."
            x = x + self.attention(layer, rms_norm(x, self.w(p + "input_layernorm"), self.eps))
            h = rms_norm(x, self.w(p + "post_attention_layernorm"), self.eps)
            if self.is_sparse(layer):
                y, experts = self.moe(layer, h)
                routing.append(experts)
            else:
                y = self.dense_mlp(layer, h)
                routing.append(None)
            x = x + y
        x = rms_norm(x, self.w("norm"), self.eps)
        lm_head = self.w("embed_tokens") if self.tied else self.w("lm_head")
        return (x @ lm_head.T).astype(np.float32), routing

    def close(self) -> None:
        self.vault.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def logits(self, ids) -> np.ndarray:
        """(len(ids), vocab_size) float32: the logits after each prefix ids[:i+1]."""
        return self.forward(ids)[0]

    def routing(self, ids) -> list[np.ndarray | None]:
        """Per layer, the (len(ids), top_k) expert ids each token was routed to (best first),
        or None for a dense layer. The union of a layer's array is what a layer-major chunk reads."""
        return self.forward(ids)[1]
