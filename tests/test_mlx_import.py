"""Importing MLX checkpoints: the same vault from the bf16 release and from its MLX 4-bit
conversion, mixed per-tensor bits, and the recipes a vault cannot hold refused before writing.
Skipped where mlx-lm is not installed."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'mlx[cpu]')")
mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm is not installed")

from hf_models import make_hf_model, sample_ids, write_released_spelling, write_tokenizer  # noqa: E402

import pysmoe  # noqa: E402
from pysmoe.convert import ConvertError, convert_checkpoint  # noqa: E402
from pysmoe.vaultio import TensorFormat, read_vault  # noqa: E402


@pytest.fixture(scope="module")
def bf16_release(tmp_path_factory):
    """A tiny Qwen3-MoE saved in bf16 with the released checkpoints' config spelling."""
    tmp = tmp_path_factory.mktemp("release")
    _, model = make_hf_model(tmp / "f32", seed=5, mlp_only_layers=[1], num_hidden_layers=3, intermediate_size=128)
    path = tmp / "hf-bf16"
    model.to(torch.bfloat16).save_pretrained(path)
    write_tokenizer(path, model.config.vocab_size)
    write_released_spelling(path)
    return path, model


def _mlx(src, out, **q):
    mlx_lm.convert(str(src), str(out), dtype="bfloat16", **q)
    return out


def test_bf16_release_and_its_mlx_4bit_give_the_same_vault(bf16_release, tmp_path):
    """`pysmoe convert` of the bf16 checkpoint with MLX's recipe (4-bit everywhere, 8-bit router,
    bf16 norms) writes the very vault.bin that importing `mlx_lm convert -q` of it writes."""
    src, _ = bf16_release
    mlx_dir = _mlx(src, tmp_path / "mlx", quantize=True, q_bits=4, q_group_size=64)
    imported = convert_checkpoint(mlx_dir, tmp_path / "from-mlx", progress=False)
    recipe = {"attention": "q4", "embed": "q4", "lm_head": "q4", "mlp": "q4",
              "router": TensorFormat("q8", 64, "bf16"), "norms": "bf16"}
    made = convert_checkpoint(src, tmp_path / "from-hf", dense=recipe, progress=False)
    a, b = read_vault(imported), read_vault(made)
    assert {n: (t.format, t.group, t.scale_format) for n, t in a.tensors.items()} == \
           {n: (t.format, t.group, t.scale_format) for n, t in b.tensors.items()}
    assert a.tensors["layers.0.router"].format == "q8" and a.expert_tensors[0].scale_format == "bf16"
    assert (imported / "vault.bin").read_bytes() == (made / "vault.bin").read_bytes()


def test_mixed_bits_per_expert_projection(bf16_release, tmp_path):
    """down_proj of the experts at 8 bits, the rest at 4: each projection keeps its format, and
    the engine (f32 activations) gives MLX's f32 logits."""
    src, model = bf16_release

    def predicate(path, module):
        if path.endswith("mlp.gate") or "switch_mlp.down_proj" in path:
            return {"group_size": 64, "bits": 8}
        return True

    mlx_dir = _mlx(src, tmp_path / "mlx", quantize=True, q_bits=4, q_group_size=64, quant_predicate=predicate)
    vault = convert_checkpoint(mlx_dir, tmp_path / "v", progress=False)
    v = read_vault(vault)
    assert [t.format for t in v.expert_tensors] == ["q4", "q4", "q8"]
    ids = sample_ids(model, 10)
    from mlx_lm.utils import load_model

    m, _ = load_model(mlx_dir)
    m.set_dtype(mx.float32)
    want = np.array(m(mx.array([ids]))[0, -1].astype(mx.float32))
    with pysmoe.open_vault(vault) as pv, pv.session(activations="f32") as s:
        got = s.prefill(ids)
    assert np.max(np.abs(got - want)) <= 1e-4


@pytest.mark.parametrize("q,named", [(dict(q_bits=3, q_group_size=64), "affine 3-bit"),
                                     (dict(q_bits=6, q_group_size=64), "affine 6-bit"),
                                     (dict(q_mode="mxfp4"), "mxfp4")])
def test_recipes_a_vault_cannot_hold_are_refused_before_writing(bf16_release, tmp_path, q, named):
    src, _ = bf16_release
    mlx_dir = _mlx(src, tmp_path / "mlx", quantize=True, **q)
    out = tmp_path / "v"
    with pytest.raises(ConvertError) as e:
        convert_checkpoint(mlx_dir, out, progress=False)
    msg = str(e.value)
    assert "cannot hold" in msg and named in msg and "model.layers.0.self_attn.q_proj" in msg
    assert not out.exists() or not any(out.iterdir())


def test_unquantised_mlx_experts_can_be_quantised_on_import(bf16_release, tmp_path):
    """An unquantised MLX checkpoint keeps its float formats by default; --experts q4 quantises
    them with MLX's quantiser, giving the codes of mlx's own 4-bit conversion."""
    src, _ = bf16_release
    plain = _mlx(src, tmp_path / "mlx", quantize=False)
    v = read_vault(convert_checkpoint(plain, tmp_path / "v", progress=False))
    assert v.expert_tensors[0].format == "bf16" and v.tensors["layers.0.q_proj"].format == "bf16"
    q4 = read_vault(convert_checkpoint(plain, tmp_path / "vq", experts="q4", progress=False))
    ref = read_vault(convert_checkpoint(_mlx(src, tmp_path / "mlxq", quantize=True, q_bits=4, q_group_size=64),
                             tmp_path / "vref", progress=False))
    assert q4.expert_tensors[0].scale_format == "bf16"
    assert q4.blob(0, 2).tobytes() == ref.blob(0, 2).tobytes()
