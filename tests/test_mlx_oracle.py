"""mlx-lm as a second oracle: tiny Qwen3-MoE models made with transformers, converted by
`mlx_lm.convert` (quantised and not), imported with `pysmoe convert`, and run by both.

MLX computes in f32 on the very same weights (its model's parameters cast to f32: scales and
biases widen exactly, the codes are untouched), so with activations="f32" the engine must give
the same logits up to f32 summation order (≤ 1e-4) and the same greedy ids. With the default
8-bit activations the difference is the activation quantisation's (tolerance in docs/convert.md).
Skipped where mlx-lm is not installed.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")
mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'mlx[cpu]')")
mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm is not installed")

from hf_models import make_hf_model, sample_ids, write_released_spelling  # noqa: E402

import pysmoe  # noqa: E402
from pysmoe.convert import convert_checkpoint, detect  # noqa: E402
from pysmoe.errors import Unsupported  # noqa: E402
from pysmoe.vaultio import read_vault  # noqa: E402

F32_TOL = 1e-4
# ‖Δlogits‖/‖logits‖ with 8-bit activations: measured 0.49 (q4 case) and 0.04 (q8) for these
# prompts; the random tiny models amplify activation rounding chaotically (0.03-0.12 on other
# prompts, with either quantiser), so this bound is loose: the f32 comparison is the tight one.
Q8_REL = 0.6

# (id, transformers config overrides, mlx_lm.convert quantisation or None)
CASES = [
    ("q4g64-bf16", dict(head_dim=32), dict(q_bits=4, q_group_size=64, dtype="bfloat16")),
    ("q8g64-f16-dense-tied", dict(mlp_only_layers=[0], tie_word_embeddings=True, norm_topk_prob=False),
     dict(q_bits=8, q_group_size=64, dtype="float16")),
    ("q4g64-f32", dict(), dict(q_bits=4, q_group_size=64, dtype="float32")),
    ("q4g32-bf16", dict(), dict(q_bits=4, q_group_size=32, dtype="bfloat16")),
    ("q4g128-bf16", dict(hidden_size=128, moe_intermediate_size=128, intermediate_size=128),
     dict(q_bits=4, q_group_size=128, dtype="bfloat16")),
    ("float-f32", dict(head_dim=24), None),
]


def _mlx_convert(hf, out, q):
    if q is None:
        mlx_lm.convert(str(hf), str(out), dtype="float32")
    else:
        mlx_lm.convert(str(hf), str(out), quantize=True, **q)  # q_bits, q_group_size, dtype
    return out


def _mlx_logits(path, ids) -> np.ndarray:
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    model.set_dtype(mx.float32)
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def _open(vault):
    try:
        return pysmoe.open_vault(vault)
    except Unsupported as e:
        pytest.skip(f"needs the kernels of the group-size/f32-scale branch: {e}")


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def case(request, tmp_path_factory):
    name, overrides, q = request.param
    tmp = tmp_path_factory.mktemp(name)
    hf, model = make_hf_model(tmp, seed=3, **overrides)
    write_released_spelling(hf)  # mlx-lm reads num_experts and rope_theta
    mlx_dir = _mlx_convert(hf, tmp / "mlx", q)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # mlx_lm saves its own; keep ours
        shutil.copyfile(hf / f, mlx_dir / f)
    ids = sample_ids(model, 12)
    vault = convert_checkpoint(mlx_dir, tmp / "vault", progress=False)
    return dict(mlx=mlx_dir, vault=vault, ids=ids, q=q, want=_mlx_logits(mlx_dir, ids))


def test_detected_as_mlx(case):
    assert detect(case["mlx"]) == "mlx"


def test_stored_bytes_are_copied(case):
    """Every quantised tensor of the vault is MLX's codes, scales and biases, byte for byte."""
    from pysmoe.convert.safetensors_io import Checkpoint

    if case["q"] is None:
        pytest.skip("unquantised")
    ck = Checkpoint(case["mlx"])
    v = read_vault(case["vault"])
    t = v.tensors["layers.0.q_proj"]
    assert t.format == f"q{case['q']['q_bits']}" and t.group == case["q"]["q_group_size"]
    assert t.scale_format == {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}[case["q"]["dtype"]]
    raw = v.raw("layers.0.q_proj").tobytes()
    w = ck.raw("model.layers.0.self_attn.q_proj.weight").tobytes()
    s = ck.raw("model.layers.0.self_attn.q_proj.scales").tobytes()
    assert raw[:len(w)] == w and s in raw
    router = [n for n in v.tensors if n.endswith("router")][0]
    assert v.tensors[router].format == "q8"  # mlx-lm quantises the router to 8 bits
    g = v.expert_tensors[0]
    blob = v.blob(v.sparse.index(True), 1).tobytes()
    l = v.sparse.index(True)
    ew = ck.raw(f"model.layers.{l}.mlp.switch_mlp.gate_proj.weight")[1].tobytes()
    assert blob[g.offset:g.offset + len(ew)] == ew
    assert json.loads((case["vault"] / "source.json").read_text())["kind"] == "mlx"


def test_logits_match_mlx_in_f32(case):
    with _open(case["vault"]) as v, v.session(activations="f32", chunk=4) as s:
        got = s.prefill(case["ids"])
    want = case["want"][-1]
    print(f"f32 activations: max |dlogit| {np.max(np.abs(got - want)):.3g}")
    assert np.max(np.abs(got - want)) <= F32_TOL
    assert int(np.argmax(got)) == int(np.argmax(want))


def test_greedy_ids_match_mlx(case):
    ids = list(case["ids"])
    with _open(case["vault"]) as v, v.session(activations="f32") as s:
        ours = list(s.generate(ids, max_tokens=6, temperature=0.0))
    theirs, seq = [], list(ids)
    for _ in range(6):
        nxt = int(np.argmax(_mlx_logits(case["mlx"], seq)[-1]))
        theirs.append(nxt)
        seq.append(nxt)
    assert ours == theirs


def test_logits_with_8bit_activations(case):
    with _open(case["vault"]) as v, v.session() as s:
        got = s.prefill(case["ids"])
    want = case["want"][-1]
    rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    print(f"8-bit activations: max |dlogit| {np.max(np.abs(got - want)):.3g}, relative RMS {rel:.3g}")
    assert rel <= Q8_REL
