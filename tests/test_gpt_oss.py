"""gpt-oss: its MXFP4 experts imported as stored, and (with transformers as the oracle) the f32 and
MXFP4 vaults of random-weight GptOssForCausalLM models; layer-major = token-serial bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from pysmoe import ggml_blocks
from pysmoe.convert.gpt_oss import ggml_to_mxfp4, mxfp4_to_ggml, split_gate_up


# ------------------------------------------------------------------------------ MXFP4 as stored
def test_mxfp4_rearrangement_is_transformers_dequantisation():
    """Every weight of the rearranged blocks dequantises (pysmoe's MXFP4, the kernels' rule) to
    exactly what transformers' convert_moe_packed_tensors gives, for every scale byte."""
    torch = pytest.importorskip("torch")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    E, R, G = 2, 6, 3
    blocks = rng.integers(0, 256, (E, R, G, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, (E, R, G), dtype=np.uint8)
    scales[0, 0, :] = (118, 127, 140)
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    for e in range(E):
        g = mxfp4_to_ggml(blocks[e], scales[e])
        assert g.shape == (R, G * 17)
        ours = ggml_blocks.dequantize(g.reshape(-1), "MXFP4", R, G * 32)
        np.testing.assert_array_equal(ours, theirs[e].T.numpy())
        b2, s2 = ggml_to_mxfp4(g, R, G * 32)  # and back: nothing lost
        np.testing.assert_array_equal(b2, blocks[e])
        np.testing.assert_array_equal(s2, scales[e])


def test_mxfp4_bad_shapes():
    with pytest.raises(ValueError, match="MXFP4 blocks"):
        mxfp4_to_ggml(np.zeros((2, 3, 15), np.uint8), np.zeros((2, 3), np.uint8))
    with pytest.raises(ValueError, match="MXFP4 blocks"):
        mxfp4_to_ggml(np.zeros((2, 3, 16), np.uint8), np.zeros((2, 4), np.uint8))


def test_split_gate_up_is_transformers_interleave():
    w = np.arange(2 * 5 * 8).reshape(2, 5, 8)  # (E, H, 2I): gate columns 0, 2, ..; up 1, 3, ..
    gate, up = split_gate_up(w[1], 1)
    np.testing.assert_array_equal(gate, w[1][:, ::2])
    np.testing.assert_array_equal(up, w[1][:, 1::2])
