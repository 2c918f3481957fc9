"""pysmoe convert on hand-made checkpoints: what it accepts, and the clear errors for what it does not.

The checkpoints are written here tensor by tensor (safetensors + config.json), so a test can
drop, add or reshape one tensor. That conversion bounds its memory to about one tensor is
not tested (it would need a checkpoint larger than the test machine); the code keeps it by
reading one expert at a time from mapped shards.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402

from pysmoe.cli.convert import add_parser, run  # noqa: E402
from pysmoe.convert import ConvertError, convert_checkpoint  # noqa: E402
from pysmoe.vaultio import read_vault  # noqa: E402

CONFIG = {  # the released-checkpoint spelling; layer 1 is dense
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "vocab_size": 50, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 64,
    "moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "norm_topk_prob": True, "tie_word_embeddings": False, "mlp_only_layers": [1],
    "decoder_sparse_step": 1, "attention_bias": False, "hidden_act": "silu",
}


def checkpoint_tensors(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    H, V, d = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    I, M, E = cfg["intermediate_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, H)
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (nq, H), p + "self_attn.k_proj.weight": (nkv, H),
                       p + "self_attn.v_proj.weight": (nkv, H), p + "self_attn.o_proj.weight": (H, nq),
                       p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        if l in cfg["mlp_only_layers"]:
            shapes.update({p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                           p + "mlp.down_proj.weight": (H, I)})
        else:
            shapes[p + "mlp.gate.weight"] = (E, H)
            for e in range(E):
                shapes.update({f"{p}mlp.experts.{e}.gate_proj.weight": (M, H),
                               f"{p}mlp.experts.{e}.up_proj.weight": (M, H),
                               f"{p}mlp.experts.{e}.down_proj.weight": (H, M)})
    return {n: torch.randn(s, generator=g) * 0.1 for n, s in shapes.items()}


def write_checkpoint(path, cfg=None, tensors=None, *, dtype=torch.float32, tokenizer=True):
    cfg = dict(CONFIG if cfg is None else cfg)
    tensors = checkpoint_tensors(cfg) if tensors is None else tensors
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({n: t.to(dtype) if t.is_floating_point() else t for n, t in tensors.items()},
              str(path / "model.safetensors"))
    if tokenizer:
        (path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "WordLevel"}}')
        (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    return path


def torch_bf16_round(a):
    return torch.from_numpy(a).to(torch.bfloat16).to(torch.float32).numpy()


def convert_quiet(src, dst, **kw):
    return convert_checkpoint(src, dst, progress=False, **kw)


# ---- what converts ---------------------------------------------------------------------------


def test_converts_with_default_formats(tmp_path):
    tensors = checkpoint_tensors(CONFIG)
    src = write_checkpoint(tmp_path / "hf", tensors=tensors, dtype=torch.bfloat16)
    out = convert_quiet(src, tmp_path / "v")
    vf = read_vault(out)
    assert vf.config["num_experts"] == 4 and vf.sparse == [True, False]
    assert vf.expert_tensors[0].format == "q4"
    assert vf.tensors["layers.0.q_proj"].format == "q8"
    assert vf.tensors["layers.0.router"].format == "f32"
    assert vf.verify() == []
    # bf16 in, f32 out: exact
    want = tensors["model.layers.0.mlp.gate.weight"].to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(vf.tensor("layers.0.router"), want)
    assert (out / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == "{{ messages }}"


def test_f32_round_trip_is_exact(tmp_path):
    tensors = checkpoint_tensors(CONFIG)
    src = write_checkpoint(tmp_path / "hf", tensors=tensors)
    vf = read_vault(convert_quiet(src, tmp_path / "v", experts="f32", dense="f32"))
    gate, up, down = vf.expert(0, 2)
    np.testing.assert_array_equal(gate, tensors["model.layers.0.mlp.experts.2.gate_proj.weight"].numpy())
    np.testing.assert_array_equal(down, tensors["model.layers.0.mlp.experts.2.down_proj.weight"].numpy())
    np.testing.assert_array_equal(vf.tensor("layers.1.mlp.up_proj"),
                                  tensors["model.layers.1.mlp.up_proj.weight"].numpy())
    np.testing.assert_array_equal(vf.tensor("layers.1.k_norm"),
                                  tensors["model.layers.1.self_attn.k_norm.weight"].numpy())


def test_tied_checkpoint_with_a_stray_lm_head_converts_with_a_warning(tmp_path, caplog):
    cfg = {**CONFIG, "tie_word_embeddings": True}
    tensors = checkpoint_tensors(cfg)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    src = write_checkpoint(tmp_path / "hf", cfg, tensors)
    with caplog.at_level(logging.WARNING, logger="pysmoe.convert"):
        vf = read_vault(convert_quiet(src, tmp_path / "v"))
    assert "lm_head" not in vf.tensors
    assert "lm_head.weight is not used" in caplog.text


def test_cli_formats(tmp_path):
    src = write_checkpoint(tmp_path / "hf", tokenizer=False)
    parser = argparse.ArgumentParser()
    add_parser(parser, "convert")
    args = parser.parse_args([str(src), str(tmp_path / "v"), "--experts", "q8",
                              "--dense", "bf16", "--embed", "f32", "--no-progress"])
    assert run(args) == 0
    vf = read_vault(tmp_path / "v")
    assert vf.expert_tensors[2].format == "q8"
    assert vf.tensors["embed_tokens"].format == "f32"
    assert vf.tensors["lm_head"].format == "bf16"
    assert vf.tensors["layers.0.o_proj"].format == "bf16"
    assert vf.tensors["layers.1.mlp.down_proj"].format == "bf16"
    assert vf.tensors["layers.0.router"].format == "f32"  # --dense leaves the router alone
    assert vf.tensors["norm"].format == "f32"
    assert not (tmp_path / "v" / "tokenizer.json").exists()


@pytest.mark.parametrize("on", [False, True])
def test_progress_on_and_off(tmp_path, capsys, on):
    src = write_checkpoint(tmp_path / "hf")
    convert_checkpoint(src, tmp_path / "v", progress=on)
    err = capsys.readouterr().err
    assert (err != "") == on


# ---- what does not, and says why --------------------------------------------------------------


def errors_for(tmp_path, cfg=None, tensors=None, **kw) -> str:
    src = write_checkpoint(tmp_path / "hf", cfg, tensors)
    with pytest.raises(ConvertError) as exc:
        convert_quiet(src, tmp_path / "v", **kw)
    assert not (tmp_path / "v" / "vault.bin").exists()  # nothing half-written is left
    return str(exc.value)


def test_a_source_that_does_not_exist_is_named_so(tmp_path):
    for src in (tmp_path / "nowhere", tmp_path / "model-Q4_K_M.gguf"):
        with pytest.raises(ConvertError, match="no such file or directory"):
            convert_quiet(src, tmp_path / "v")
    assert not (tmp_path / "v").exists()


def test_missing_config(tmp_path):
    src = write_checkpoint(tmp_path / "hf")
    (src / "config.json").unlink()
    with pytest.raises(ConvertError, match="config.json"):
        convert_quiet(src, tmp_path / "v")


def test_missing_safetensors(tmp_path):
    src = write_checkpoint(tmp_path / "hf")
    (src / "model.safetensors").unlink()
    with pytest.raises(ConvertError, match="model.safetensors"):
        convert_quiet(src, tmp_path / "v")
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ConvertError, match="model-00001-of-00002.safetensors"):
        convert_quiet(src, tmp_path / "v")


@pytest.mark.parametrize("patch, message", [
    ({"attention_bias": True}, "attention_bias"),
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "LlamaForCausalLM"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
])
def test_unsupported_config(tmp_path, patch, message):
    src = write_checkpoint(tmp_path / "hf")
    (src / "config.json").write_text(json.dumps({**CONFIG, **patch}))
    with pytest.raises(ConvertError, match=message):
        convert_quiet(src, tmp_path / "v")


def test_missing_tensors_are_listed(tmp_path):
    tensors = checkpoint_tensors(CONFIG)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    del tensors["model.layers.0.mlp.experts.3.down_proj.weight"]
    msg = errors_for(tmp_path, tensors=tensors)
    assert "missing" in msg and "layers.1.k_norm" in msg and "layers.0.experts.3.down" in msg


def test_unknown_tensors_are_listed(tmp_path):
    tensors = checkpoint_tensors(CONFIG)
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    tensors["model.mtp.proj.weight"] = torch.zeros(4, 4)
    tensors["model.layers.1.mlp.gate.weight"] = torch.zeros(4, 64)  # a router in a dense layer
    tensors["model.layers.0.mlp.experts.4.up_proj.weight"] = torch.zeros(64, 64)  # expert 4 of 4
    msg = errors_for(tmp_path, tensors=tensors)
    for name in ("model.layers.0.self_attn.q_proj.bias", "model.mtp.proj.weight",
                 "model.layers.1.mlp.gate.weight", "model.layers.0.mlp.experts.4.up_proj.weight"):
        assert name in msg


def test_wrong_shapes_are_listed(tmp_path):
    tensors = checkpoint_tensors(CONFIG)
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(32, 64)
    tensors["model.layers.0.mlp.experts.1.gate_proj.weight"] = torch.zeros(64, 32)
    msg = errors_for(tmp_path, tensors=tensors)
    assert "shape" in msg and "q_proj.weight (32, 64) (want (64, 64))" in msg
    assert "experts.1.gate_proj.weight" in msg


def test_an_expert_given_twice(tmp_path):
    tensors = checkpoint_tensors(CONFIG)
    tensors["model.layers.0.mlp.experts.down_proj"] = torch.zeros(4, 64, 64)  # fused, as well
    msg = errors_for(tmp_path, tensors=tensors)
    assert "twice" in msg and "experts.down_proj[0]" in msg


def test_integer_tensor(tmp_path):
    tensors = checkpoint_tensors(CONFIG)
    tensors["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(32, 64, dtype=torch.int32)
    msg = errors_for(tmp_path, tensors=tensors)
    assert "not floats" in msg and "model.layers.0.self_attn.v_proj.weight (I32)" in msg


def test_format_that_does_not_fit(tmp_path):
    cfg = {**CONFIG, "moe_intermediate_size": 48}  # down_proj's 48 inputs: not groups of 64
    assert "cols" in errors_for(tmp_path, cfg, experts="q4")


def test_bad_format_names(tmp_path):
    src = write_checkpoint(tmp_path / "hf")
    with pytest.raises(ConvertError, match="q3"):
        convert_quiet(src, tmp_path / "v", experts="q3")
    with pytest.raises(ConvertError, match="ffn"):
        convert_quiet(src, tmp_path / "v", dense={"ffn": "q8"})


def test_converts_without_torch_or_safetensors(tmp_path, monkeypatch):
    """The checkpoint is read by pysmoe's own safetensors parser: neither torch nor the
    safetensors package is imported (bf16 source, so bf16 bits are widened by hand)."""
    src = write_checkpoint(tmp_path / "hf", dtype=torch.bfloat16)
    want = {n: t.to(torch.float32).numpy() for n, t in checkpoint_tensors(CONFIG).items()}
    for mod in ("torch", "safetensors", "safetensors.torch", "safetensors.numpy"):
        monkeypatch.setitem(sys.modules, mod, None)
    v = read_vault(convert_quiet(src, tmp_path / "v", experts="f32", dense="f32"))
    q = want["model.layers.0.self_attn.q_proj.weight"]
    assert np.array_equal(v.tensor("layers.0.q_proj"), torch_bf16_round(q))


def test_processes_write_the_same_vault(tmp_path):
    """Experts quantised by several forked processes give the vault one process gives, byte for byte."""
    src = write_checkpoint(tmp_path / "hf", dtype=torch.bfloat16)
    one = convert_quiet(src, tmp_path / "one", jobs=1)
    three = convert_quiet(src, tmp_path / "three", jobs=3)
    names = sorted(p.name for p in one.iterdir())
    assert names == sorted(p.name for p in three.iterdir())
    for name in names:
        if name != "source.json":
            assert (one / name).read_bytes() == (three / name).read_bytes(), name


def test_a_failing_read_in_a_worker_fails_the_conversion(tmp_path, monkeypatch):
    """An error in a worker process reaches the caller as itself, and no vault is left behind."""
    from pysmoe.convert import hf

    src = write_checkpoint(tmp_path / "hf", dtype=torch.bfloat16)
    real, calls = hf.read, {"n": 0}

    def read(ckpt, s):  # the fifth expert matrix a worker reads fails (each fork counts its own)
        if ".experts." in s.name:
            calls["n"] += 1
            if calls["n"] == 5:
                raise OSError("injected read error")
        return real(ckpt, s)

    monkeypatch.setattr(hf, "read", read)
    with pytest.raises(OSError, match="injected read error"):
        convert_quiet(src, tmp_path / "v", jobs=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing staged is left


@pytest.mark.parametrize("jobs", [0, -1, 1.5, True])
def test_jobs_must_be_a_positive_count(tmp_path, jobs):
    src = write_checkpoint(tmp_path / "hf")
    with pytest.raises(ConvertError, match="jobs"):
        convert_quiet(src, tmp_path / "v", jobs=jobs)
