"""Quality on real weights: the shipped demo model (a trained Qwen3-MoE, pysmoe/data/demo/) scored
on held-out text through each numeric path (bench/perplexity.py's functions; its command gives
the whole table, over more text and every expert format).

The f32 model here is regenerated from the shipped vault (`hf_from_vault`: its q4 experts and q8
dense matrices dequantised to float32, which is exact), so transformers, the numpy reference and
the engine all score the very same weights, and what must hold can be asserted tightly:

- f32 vault through the engine (activations="f32") = transformers' perplexity to 1e-4 relative,
  and so does the numpy reference;
- the shipped q4 vault with activations="f32" = the f32 vault of its own dequantised weights
  (the q4/q8 kernels dequantise exactly) to 1e-4;
- the default 8-bit activations within ACT_BOUND of activations="f32" on the same weights;
- layer-major prefill = token-serial, bit for bit (logits and KV) on these weights;
- and the model is trained: its held-out perplexity is far below a random model's (~vocab).

The second half does the same for gpt-oss on a trained tiny model (tests/data/gpt_oss_trained),
with MXFP4 experts made by the converter: MXFP4 = transformers on its dequantised weights, and
within MXFP4_BOUND of f32 (issue 26, item 4).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

from bench_scripts import load  # noqa: E402

import pysmoe  # noqa: E402
from pysmoe.convert import convert_checkpoint  # noqa: E402
from pysmoe.demo import ensure_demo_vault  # noqa: E402

_ppl = load("perplexity")  # the scoring lives with the research code, in bench/
engine_nll, heldout_windows, hf_from_vault, hf_nll, reference_nll = (
    _ppl.engine_nll, _ppl.heldout_windows, _ppl.hf_from_vault, _ppl.hf_nll, _ppl.reference_nll)

EXACT_REL = 1e-4
# |ppl(8-bit activations) / ppl(f32 activations) - 1| on the demo's vault: measured -0.37 % on these
# 4 windows and +0.15 % over bench/perplexity.py's 63 windows of 256 (bench/RESULTS.md).
ACT_BOUND = 0.01
SANE_PPL = 60.0  # held-out perplexity at the end of training was 36; a random model gives ~4000


def rel(a: float, b: float) -> float:
    return abs(a / b - 1.0)


@pytest.fixture(scope="module")
def demo():
    return ensure_demo_vault()


@pytest.fixture(scope="module")
def windows(demo):
    return heldout_windows(demo, n_windows=4, length=128)


@pytest.fixture(scope="module")
def f32(demo, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quality")
    hf = hf_from_vault(demo, tmp / "hf")
    vault = convert_checkpoint(hf, tmp / "f32", experts="f32", dense="f32", progress=False)
    return hf, vault


@pytest.fixture(scope="module")
def ppl(demo, windows, f32):
    hf, vault = f32
    return {
        "transformers": math.exp(hf_nll(hf, windows)),
        "reference": math.exp(reference_nll(vault, windows)),
        "f32 vault": math.exp(engine_nll(vault, windows, activations="f32")),
        "demo, f32 activations": math.exp(engine_nll(demo, windows, activations="f32")),
        "demo, default": math.exp(engine_nll(demo, windows)),
    }


def test_model_is_trained(ppl):
    print(ppl)
    assert ppl["transformers"] < SANE_PPL


def test_f32_vault_is_transformers(ppl):
    assert rel(ppl["f32 vault"], ppl["transformers"]) <= EXACT_REL
    assert rel(ppl["reference"], ppl["transformers"]) <= EXACT_REL


def test_q4_vault_with_f32_activations_is_its_dequantised_weights(ppl):
    assert rel(ppl["demo, f32 activations"], ppl["f32 vault"]) <= EXACT_REL


def test_default_activations_within_bound(ppl):
    assert rel(ppl["demo, default"], ppl["demo, f32 activations"]) <= ACT_BOUND


def assert_paths_agree(vault, ids, cache_part: int | None = None, **session) -> None:
    """Layer-major and token-serial prefill: the same logits, KV cache and greedy ids, bit for bit
    (cache_part: an expert cache of 1/cache_part of the experts' bytes; None: the default)."""
    with pysmoe.open_vault(vault) as v:
        if cache_part is not None:
            session["cache_bytes"] = v.expert_bytes // cache_part
        out = []
        for path in ("layer-major", "token-serial"):
            with v.session(prefill=path, **session) as s:
                logits = s.prefill(ids)
                kv = [s.kv(layer) for layer in range(v.config["num_hidden_layers"])]
                s.reset()
                gen = list(s.generate(ids, max_tokens=8))
                out.append((logits, kv, gen))
    (la, kva, ga), (lb, kvb, gb) = out
    assert np.array_equal(la.view(np.uint32), lb.view(np.uint32))
    for (ka, va), (kb, vb) in zip(kva, kvb):
        assert np.array_equal(ka.view(np.uint32), kb.view(np.uint32))
        assert np.array_equal(va.view(np.uint32), vb.view(np.uint32))
    assert ga == gb


@pytest.mark.parametrize("n,chunk", [(1, 64), (37, 16), (256, 64)])
def test_layer_major_is_token_serial(demo, n, chunk):
    ids = heldout_windows(demo, n_windows=1, length=256)[0][:n].tolist()
    assert_paths_agree(demo, ids, cache_part=3, chunk=chunk)


# ---- gpt-oss: MXFP4 experts on trained weights (issue 26, item 4) -------------------------------
# tests/data/gpt_oss_trained: a GptOssForCausalLM trained like the demo (scripts/train_demo.py train
# --family gpt_oss --tiny: 2 layers, one sliding-window (128) and one full, sinks, YaRN, biases,
# 8 experts top-2, hidden 128; 1.0 M parameters, 58 s on one H200, held-out loss 3.80), shipped
# with experts q8 and dense q4 so that it stays under 1 MB. Its tokenizer and held-out text are the
# demo's. Its dequantised weights are the f32 model here; the MXFP4 vault is made from them by
# `convert --experts MXFP4` (ggml_blocks.quantize_mxfp4, llama.cpp's rule), as a float gpt-oss
# checkpoint would be. bench/RESULTS.md has the full table (the demo-sized gpt-oss: MXFP4 +0.79 %).

OSS_FIXTURE = Path(__file__).parent / "data" / "gpt_oss_trained"
OSS_SANE_PPL = 60.0  # measured 41.8 on these windows; a random model gives ~4000
# ppl(MXFP4 experts) / ppl(f32) - 1 on these 4 windows: measured +0.86 % (the demo-sized gpt-oss
# over 63 windows: +0.79 %, bench/RESULTS.md). The bound catches a broken quantiser: its shared
# exponent one too high (a grid twice as coarse) gives +2.5 %, one too low (saturating) +57 %,
# nibbles out of order ×240; the figures are deterministic (fixed weights, windows and rule).
MXFP4_BOUND = 0.015


@pytest.fixture(scope="module")
def oss(demo, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quality-oss")
    windows = heldout_windows(demo, n_windows=4, length=256)  # longer than the sliding window
    hf = hf_from_vault(OSS_FIXTURE, tmp / "hf")
    f32 = convert_checkpoint(hf, tmp / "f32", experts="f32", dense="f32", progress=False)
    mx = convert_checkpoint(hf, tmp / "mxfp4", experts="MXFP4", dense="f32", progress=False)
    mx_hf = hf_from_vault(mx, tmp / "mxfp4-hf")
    ppl = {
        "transformers": math.exp(hf_nll(hf, windows)),
        "f32 vault": math.exp(engine_nll(f32, windows, activations="f32")),
        "fixture, f32 activations": math.exp(engine_nll(OSS_FIXTURE, windows, activations="f32")),
        "transformers, MXFP4 weights": math.exp(hf_nll(mx_hf, windows)),
        "MXFP4, f32 activations": math.exp(engine_nll(mx, windows, activations="f32")),
        "MXFP4, default": math.exp(engine_nll(mx, windows)),
    }
    print(ppl)
    return mx, ppl


def test_gpt_oss_model_is_trained(oss):
    _, ppl = oss
    assert ppl["transformers"] < OSS_SANE_PPL


def test_gpt_oss_f32_vault_is_transformers(oss):
    _, ppl = oss
    assert rel(ppl["f32 vault"], ppl["transformers"]) <= EXACT_REL
    assert rel(ppl["fixture, f32 activations"], ppl["transformers"]) <= EXACT_REL


def test_gpt_oss_mxfp4_vault_is_transformers_on_its_weights(oss):
    mx, ppl = oss
    from pysmoe.vaultio import read_vault

    v = read_vault(mx)
    try:
        assert [t.format for t in v.expert_tensors][:3] == ["MXFP4"] * 3
    finally:
        v.close()
    assert rel(ppl["MXFP4, f32 activations"], ppl["transformers, MXFP4 weights"]) <= EXACT_REL


def test_gpt_oss_mxfp4_within_bound_of_f32(oss):
    _, ppl = oss
    assert ppl["MXFP4, f32 activations"] != ppl["transformers"]  # the experts were requantised
    assert rel(ppl["MXFP4, f32 activations"], ppl["transformers"]) <= MXFP4_BOUND


def test_gpt_oss_mxfp4_default_activations_within_bound(oss):
    _, ppl = oss
    assert rel(ppl["MXFP4, default"], ppl["MXFP4, f32 activations"]) <= ACT_BOUND


@pytest.mark.parametrize("n,chunk", [(200, 64), (256, 37)])
def test_gpt_oss_mxfp4_layer_major_is_token_serial(oss, demo, n, chunk):
    """On trained MXFP4 weights, past the sliding window: logits, KV and greedy ids alike."""
    mx, _ = oss
    ids = heldout_windows(demo, n_windows=2, length=256)[1][:n].tolist()
    assert_paths_agree(mx, ids, chunk=chunk)
