"""Where the GPU's q4-expert error on tests/test_cuda.py's family models comes from: the numpy reference
over a q4 vault against itself with the tensor cores' f16 roundings emulated — the experts' input and
SwiGLU rows (a power-of-two row scaling does not change f16's relative rounding), each dequantised weight
(fma(scale, q, bias) rounded once), and, as tc_load_s did for f32 scales, each scale and bias to f16 first
— and, where a GPU answers, the GPU against the CPU and against that emulation (the GPU is the CPU plus
those roundings when |gpu - emulated| is well below |gpu - cpu|). Vaults with f32 scales (what an f32
checkpoint gives) and with f16 scales. Usage: python bench/cuda_q4_rounding.py [case ...]  (tests/test_families.py's)"""
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's pysmoe and the tests' builders
import pysmoe  # noqa: E402
from pysmoe import quant, reference as R  # noqa: E402
from pysmoe.convert import convert_checkpoint  # noqa: E402
from test_families import _build  # noqa: E402

f16 = lambda a: np.asarray(a, np.float32).astype(np.float16).astype(np.float32)  # noqa: E731
EMULATE, ROUND_SCALES = False, False
_widen = quant._widen


def widen(raw, scale_dtype):  # the scales and biases as dequantize reads them; to f16 first when emulating
    v = _widen(raw, scale_dtype)
    return f16(v) if EMULATE and ROUND_SCALES else v


quant._widen = widen


def moe(self, layer, h):  # ReferenceModel.moe with the tensor cores' roundings when EMULATE
    experts, weights = self.route(layer, h)
    out = np.zeros_like(h)
    for e in np.unique(experts):
        gate, up, down = (np.asarray(m, dtype=np.float32) for m in self.vault.expert(layer, int(e)))
        if EMULATE:
            gate, up, down = f16(gate), f16(up), f16(down)
        tokens, slot = np.nonzero(experts == e)
        x = f16(h[tokens]) if EMULATE else h[tokens]
        a = R.silu(x @ gate.T) * (x @ up.T)
        y = (f16(a) if EMULATE else a) @ down.T
        out[tokens] += y * weights[tokens, slot][:, None]
    if self.has(f"layers.{layer}.shared.gate_proj"):
        out = out + self.dense_mlp(layer, h, f"layers.{layer}.shared.")
    return out, experts


R.ReferenceModel.moe = moe
for name in sys.argv[1:] or ["mixtral_gqa4_tied", "olmoe", "olmoe_norm_topk"]:
    tmp = Path(tempfile.mkdtemp())
    path, _ = _build(name, tmp)
    for scales in ("f32", "f16"):
        vault = convert_checkpoint(path, tmp / f"q4{scales}", experts="q4", dense="f32", group=32,
                                   scale_dtype=None if scales == "f32" else scales, progress=False)
        rng = np.random.default_rng(1)
        gl = None
        with pysmoe.open_vault(vault) as v:
            V = v.config["vocab_size"]
            prompt, follow = rng.integers(0, V, 37).tolist(), rng.integers(0, V, 10).tolist()
            with v.session(chunk=16, activations="f32") as c:
                cl = np.stack([c.prefill(prompt)] + [c.decode(i) for i in follow])
            try:
                with v.session(device="cuda", chunk=16, gpu_cache_bytes=1 << 30, activations="f32") as g:
                    gl = np.stack([g.prefill(prompt)] + [g.decode(i) for i in follow])
            except pysmoe.Unsupported as e:
                print("  (no GPU:", e, ")")
        with R.ReferenceModel(vault) as m:
            stored = m.vault.layer_expert_tensors[m.n_layers - 1][0].scale_format
            EMULATE, ROUND_SCALES = False, False
            ref, _ = m.forward(prompt + follow)
            EMULATE = True
            emu, _ = m.forward(prompt + follow)
            ROUND_SCALES = True
            emu_s, _ = m.forward(prompt + follow)
            EMULATE, ROUND_SCALES = False, False
        top = float(np.abs(cl).max())
        rel = lambda a, b: f"{np.abs(a - b).max() / top:.3g}"  # noqa: E731
        print(f"{name}, {stored} scales: CPU vs reference {rel(cl, ref[36:])}; emulated tensor cores vs "
              f"reference {rel(emu[36:], ref[36:])}, with the scales and biases to f16 too "
              f"{rel(emu_s[36:], ref[36:])} (of max|logit| {top:.3g})")
        if gl is not None:
            print(f"  GPU vs CPU {rel(gl, cl)}; GPU vs the emulations {rel(gl, emu[36:])}, {rel(gl, emu_s[36:])}")
