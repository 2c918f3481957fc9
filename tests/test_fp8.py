"""FP8 releases (quant_method "fp8": e4m3 weights, a float scale per block) dequantised while
converting: the vault equals the one converted from the same weights dequantised by torch, and
what does not fit is refused before anything is written."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402

from pysmoe.convert import ConvertError, convert_checkpoint  # noqa: E402
from pysmoe.convert.safetensors_io import E4M3, Checkpoint, SafetensorsError  # noqa: E402

BLOCK = (24, 40)  # not a divisor of 64 or 32: ragged blocks at the bottom and the right


def fp8_quantize(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale per block, torch's dequantisation) as an FP8 release stores them."""
    *lead, R, C = w.shape
    br, bc = block
    nr, nc = -(-R // br), -(-C // bc)
    pad = torch.zeros(*lead, nr * br, nc * bc)
    pad[..., :R, :C] = w
    blocks = pad.reshape(*lead, nr, br, nc, bc)
    scale = blocks.abs().amax(dim=(-3, -1)) / 448.0  # (…, nr, nc)
    full = scale.repeat_interleave(br, -2).repeat_interleave(bc, -1)[..., :R, :C]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, scale.float(), q.float() * full


def test_e4m3_table_is_torch_s():
    ref = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(np.isnan(E4M3), np.isnan(ref))
    ok = ~np.isnan(ref)
    assert np.array_equal(E4M3[ok].view(np.uint32), ref[ok].view(np.uint32))


def test_stacked_and_row_reads(tmp_path):
    g = torch.Generator().manual_seed(3)
    w3 = torch.randn(3, 50, 70, generator=g)
    w2 = torch.randn(61, 45, generator=g) * 7
    q3, s3, d3 = fp8_quantize(w3, BLOCK)
    q2, s2, d2 = fp8_quantize(w2, BLOCK)
    save_file({"a.weight": q3, "a.weight_scale_inv": s3, "b.weight": q2, "b.weight_scale_inv": s2,
               "c.bias": torch.ones(4)}, tmp_path / "model.safetensors")
    with Checkpoint(tmp_path) as ck:
        ck.dequantize_fp8(BLOCK)
        assert "a.weight_scale_inv" not in ck.tensors and ck.is_float("a.weight")
        for e in range(3):
            assert np.array_equal(ck.floats("a.weight", e), d3[e].numpy())
        assert np.array_equal(ck.floats("a.weight", (1, slice(5, 9))), d3[1, 5:9].numpy())
        assert np.array_equal(ck.floats("b.weight"), d2.numpy())
        for r0, r1 in ((0, 61), (7, 30), (24, 48), (47, 61), (60, 61)):
            assert np.array_equal(ck.rows("b.weight", r0, r1), d2[r0:r1].numpy()), (r0, r1)


def _fp8_checkpoint(src, dst, block, *, drop_scale=None, bad_scale=None, qcfg=None):
    """A copy of the float checkpoint src with every projection in FP8 (as Qwen's FP8 releases:
    router, norms, embeddings and lm_head stay as they were); returns the dequantised copy's
    tensors (what the FP8 checkpoint means)."""
    from safetensors.torch import load_file
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    fp8, plain = {}, {}
    for name, w in tensors.items():
        if name.endswith("_proj.weight"):
            q, s, d = fp8_quantize(w, block)
            fp8[name], plain[name] = q, d
            if name != drop_scale:
                fp8[name.replace(".weight", ".weight_scale_inv")] = s[:-1] if name == bad_scale else s
        else:
            fp8[name] = plain[name] = w
    save_file(fp8, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = qcfg or {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(cfg))
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    return plain


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory):
    from hf_models import make_hf_model
    path, _ = make_hf_model(tmp_path_factory.mktemp("fp8src"), num_hidden_layers=2)
    return path


def _vault_files(v):
    return {p.relative_to(v): p.read_bytes() for p in sorted(v.rglob("*"))
            if p.is_file() and p.name != "source.json"}


def test_fp8_release_converts_as_its_dequantised_weights(hf_ckpt, tmp_path):
    plain = _fp8_checkpoint(hf_ckpt, tmp_path / "fp8", BLOCK)
    ref = tmp_path / "deq"
    ref.mkdir()
    save_file(plain, ref / "model.safetensors")
    shutil.copy(hf_ckpt / "config.json", ref / "config.json")
    shutil.copy(hf_ckpt / "tokenizer.json", ref / "tokenizer.json")
    kw = dict(experts="f32", dense="f32", progress=False, jobs=1)
    a = convert_checkpoint(tmp_path / "fp8", tmp_path / "va", **kw)
    b = convert_checkpoint(ref, tmp_path / "vb", **kw)
    fa, fb = _vault_files(a), _vault_files(b)
    assert fa.keys() == fb.keys()
    assert [k for k in fa if fa[k] != fb[k]] == []
    # and in the default formats (q4 experts, q8 dense): the same bytes too
    a4 = convert_checkpoint(tmp_path / "fp8", tmp_path / "va4", progress=False, jobs=1)
    b4 = convert_checkpoint(ref, tmp_path / "vb4", progress=False, jobs=1, scale_dtype="bf16")
    fa, fb = _vault_files(a4), _vault_files(b4)
    assert [k for k in fa if fa[k] != fb[k]] == []


@pytest.mark.parametrize("case, words", [
    ("drop_scale", "without a float weight_scale_inv"),
    ("bad_scale", "want"),
    ("method", "quant_method 'awq'"),
    ("static", "activation_scheme 'static'"),
    ("block", "weight_block_size"),
])
def test_fp8_refusals_write_nothing(hf_ckpt, tmp_path, case, words):
    name = "model.layers.1.self_attn.k_proj.weight"
    kw = {"drop_scale": dict(drop_scale=name), "bad_scale": dict(bad_scale=name),
          "method": dict(qcfg={"quant_method": "awq", "bits": 4}),
          "static": dict(qcfg={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static",
                               "weight_block_size": [24, 40]}),
          "block": dict(qcfg={"quant_method": "fp8", "weight_block_size": [24]})}[case]
    _fp8_checkpoint(hf_ckpt, tmp_path / "fp8", BLOCK, **kw)
    with pytest.raises(ConvertError, match=words) as exc:
        convert_checkpoint(tmp_path / "fp8", tmp_path / "out", progress=False, jobs=1)
    if case in ("drop_scale", "bad_scale"):
        assert name in str(exc.value)
    assert not (tmp_path / "out").exists()


def test_fp8_nan_is_refused(tmp_path):
    q = torch.full((4, 4), 448.0).to(torch.float8_e4m3fn)
    q.view(torch.uint8)[1, 2] = 0x7F
    save_file({"x.weight": q, "x.weight_scale_inv": torch.ones(1, 1)}, tmp_path / "model.safetensors")
    with Checkpoint(tmp_path) as ck:
        ck.dequantize_fp8((128, 128))
        with pytest.raises(SafetensorsError, match="NaN"):
            ck.floats("x.weight")
