"""glm4_moe_qknorm on the GPU vs the CPU: is the 1.02 a bug of flash attention or a router near-tie
that flash attention's f16 rounding decides the other way?

CPU part (any machine): the numpy reference with and without flash attention's f16 rounding of Q, K, V
and P emulated; the layer-0 routing margins. GPU part (when a CUDA session opens): the GPU's layer-0 K/V
rows against the CPU's, and the logits per position, flash on (default) — run it again with
SMOE_CUDA_FLASH=0 to compare.  Usage: python bench/cuda_glm_neartie.py [case]"""
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's pysmoe and the tests' builders
import pysmoe  # noqa: E402
from pysmoe import reference as R  # noqa: E402
from pysmoe.convert import convert_checkpoint  # noqa: E402
from test_families import _build  # noqa: E402

name = sys.argv[1] if len(sys.argv) > 1 else "glm4_moe_qknorm"
tmp = Path(tempfile.mkdtemp())
path, _ = _build(name, tmp)
vault = convert_checkpoint(path, tmp / "f32", experts="f32", dense="f32", group=32, progress=False)
rng = np.random.default_rng(1)
with pysmoe.open_vault(vault) as v:
    V = v.config["vocab_size"]
prompt, follow = rng.integers(0, V, 37).tolist(), rng.integers(0, V, 10).tolist()
ids = prompt + follow

f16 = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731
EMULATE = False


def attention(self, layer, h):  # reference.attention with flash's rounding when EMULATE
    p = f"layers.{layer}."
    T, d = h.shape[0], self.head_dim
    q, k, v = (h @ self.w(p + f"{x}_proj").T for x in "qkv")
    if self.has(p + "q_proj.bias"):
        q, k, v = q + self.w(p + "q_proj.bias"), k + self.w(p + "k_proj.bias"), v + self.w(p + "v_proj.bias")
    q = q.reshape(T, self.n_heads, d).transpose(1, 0, 2)
    k = k.reshape(T, self.n_kv_heads, d).transpose(1, 0, 2)
    v = v.reshape(T, self.n_kv_heads, d).transpose(1, 0, 2)
    if self.qk_norm == 1:
        q = R.rms_norm(q, self.w(p + "q_norm"), self.eps)
        k = R.rms_norm(k, self.w(p + "k_norm"), self.eps)
    cos, sin = R.rope_tables(T, self.rotary_dim, self.rope_theta)
    q, k = R.apply_rope(q, cos, sin), R.apply_rope(k, cos, sin)
    STATS.append((layer, float(np.abs(q).max()), float(np.abs(k).max()), float(np.abs(v).max())))
    if EMULATE:
        q, k, v = f16(q), f16(k), f16(v)
    group = self.n_heads // self.n_kv_heads
    future = np.triu(np.ones((T, T), dtype=bool), k=1)
    out = np.empty((self.n_heads, T, d), dtype=np.float32)
    for head in range(self.n_heads):
        kv = head // group
        s = (q[head] @ k[kv].T) * np.float32(1.0 / np.sqrt(d))
        s = np.where(future, np.float32(-np.inf), s)
        e = np.exp(s - s.max(-1, keepdims=True))
        pp = f16(e) if EMULATE else e
        out[head] = (pp @ v[kv]) / e.sum(-1, keepdims=True)
    attn = out.transpose(1, 0, 2).reshape(T, self.n_heads * d)
    return attn @ self.w(p + "o_proj").T


R.ReferenceModel.attention = attention
MARGIN = []
_route = R.ReferenceModel.route_grouped


def route_grouped(self, layer, h):
    scores = 1.0 / (1.0 + np.exp(-(h @ self.w(f"layers.{layer}.router").T)))
    choice = scores + self.w(f"layers.{layer}.router.bias")
    g = choice.reshape(len(h), self.n_group, -1)
    gs = np.sort(np.sort(g, -1)[..., -2:].sum(-1), -1)  # group scores, ascending
    gmargin = gs[:, -self.topk_group] - gs[:, -self.topk_group - 1]
    MARGIN.append((layer, gmargin))
    return _route(self, layer, h)


R.ReferenceModel.route_grouped = route_grouped
with R.ReferenceModel(vault) as m:
    STATS = []
    ref, rr = m.forward(ids)
    print("max |q|, |k|, |v| per layer:", STATS)
    margins = MARGIN[:]
    MARGIN.clear()
    EMULATE = True
    emu, er = m.forward(ids)
top = float(np.abs(ref).max())
print(f"reference vs reference with flash's f16 rounding: max|d|/max|logit| = {np.abs(emu - ref).max() / top:.3g}")
print(f"the same at positions 36..44, before the near-tie's token: {np.abs(emu[36:45] - ref[36:45]).max() / top:.3g}")
for layer, (a, b) in enumerate(zip(rr, er)):
    diff = [t for t in range(len(ids)) if sorted(a[t]) != sorted(b[t])]
    gm = margins[layer][1]
    print(f"layer {layer}: tokens routed differently {diff}; smallest group-choice margins "
          f"{np.sort(gm)[:4]} at tokens {np.argsort(gm)[:4]}")



def forced(s, L, E):
    """Logits per step (the prefill, then teacher-forced decode steps) and each step's expert counts."""
    from test_cuda import _expert_counts
    logits, routes = [], []
    for i in [None, *follow]:
        s.reset_stats()
        logits.append(s.prefill(prompt) if i is None else s.decode(i))
        routes.append(_expert_counts(s, L, E))
    return np.stack(logits), routes


with pysmoe.open_vault(vault) as v:
    L, E = v.config["num_hidden_layers"], v.config["num_experts"]
    with v.session(chunk=16, activations="f32") as c:
        cl, cr = forced(c, L, E)
        ckv = [c.kv(layer) for layer in range(L)]
    print(f"engine CPU vs reference: {np.abs(cl - ref[36:]).max() / top:.3g}")
    try:
        g = v.session(device="cuda", chunk=16, gpu_cache_bytes=1 << 30, activations="f32")
    except pysmoe.Unsupported as e:
        print("no GPU:", e)
        sys.exit(0)
    with g:
        print(g.backend)
        gl, gr = forced(g, L, E)
        gkv = [g.kv(layer) for layer in range(L)]
    for layer in range(L):  # positions before 45 (the near-tie's token): rounding only
        k, v_ = (np.abs(gkv[layer][i][:45] - ckv[layer][i][:45]).max() / np.abs(ckv[layer][i][:45]).max()
                 for i in (0, 1))
        print(f"layer {layer}, positions 0..44: max|K gpu - cpu| / max|K| {k:.3g}, the same of V {v_:.3g}")
    print("steps (0: the prefill) whose experts differ, GPU vs CPU:",
          [(i, [layer for layer in range(L) if gr[i][layer] != cr[i][layer]]) for i in range(len(gr))
           if gr[i] != cr[i]], "(the emulation: step 9 = position 45)")
    print("GPU vs CPU per step (max|d|/max|logit|):", np.round(np.abs(gl - cl).max(-1) / top, 5).tolist())
    print(f"GPU vs the f16-emulating reference, steps 0..8: {np.abs(gl[:9] - emu[36:45]).max() / top:.3g}; "
          f"CPU vs it: {np.abs(cl[:9] - emu[36:45]).max() / top:.3g}")
