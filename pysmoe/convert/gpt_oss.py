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
