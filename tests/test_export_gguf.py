"""scripts/export_gguf.py: a tiny all-sparse vault as a qwen3moe GGUF, read back with gguf's reader.

Skipped when the optional `gguf` package is not installed (it belongs to the `peer` extra: the
llama.cpp comparison of bench/peer.py, never needed by pysmoe itself)."""
from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _exporter():
    spec = importlib.util.spec_from_file_location("export_gguf", ROOT / "scripts" / "export_gguf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def exported(make_vault, tmp_path_factory):
    vault = make_vault("tiny_sparse", preset="tiny", seed=0, overrides={"mlp_only_layers": []})
    out = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _exporter().export(vault, out, progress=False)
    return vault, gguf.GGUFReader(out)


def _field(reader, key):
    return reader.fields[key].contents()


def test_metadata(exported):
    from pysmoe.vaultio import read_vault
    vault, r = exported
    cfg = read_vault(vault).config
    want = {
        "general.architecture": "qwen3moe",
        "qwen3moe.context_length": cfg["max_position_embeddings"],
        "qwen3moe.embedding_length": cfg["hidden_size"],
        "qwen3moe.block_count": cfg["num_hidden_layers"],
        "qwen3moe.feed_forward_length": cfg["intermediate_size"],
        "qwen3moe.expert_feed_forward_length": cfg["moe_intermediate_size"],
        "qwen3moe.attention.head_count": cfg["num_attention_heads"],
        "qwen3moe.attention.head_count_kv": cfg["num_key_value_heads"],
        "qwen3moe.attention.key_length": cfg["head_dim"],
        "qwen3moe.attention.value_length": cfg["head_dim"],
        "qwen3moe.expert_count": cfg["num_experts"],
        "qwen3moe.expert_used_count": cfg["num_experts_per_tok"],
        "tokenizer.ggml.model": "gpt2",
    }
    for k, v in want.items():
        assert _field(r, k) == v, k
    assert cfg["head_dim"] != cfg["hidden_size"] // cfg["num_attention_heads"]  # tiny: key_length matters
    assert _field(r, "qwen3moe.rope.freq_base") == pytest.approx(cfg["rope_theta"])
    assert _field(r, "qwen3moe.attention.layer_norm_rms_epsilon") == pytest.approx(cfg["rms_norm_eps"])
    tokens = _field(r, "tokenizer.ggml.tokens")
    assert len(tokens) == cfg["vocab_size"]
    assert len(_field(r, "tokenizer.ggml.token_type")) == cfg["vocab_size"]
    assert len(_field(r, "tokenizer.ggml.merges")) > 0
    assert tokens[_field(r, "tokenizer.ggml.eos_token_id")] == "<|im_end|>"


def test_tensors(exported):
    from pysmoe.vaultio import read_vault
    vault, r = exported
    v = read_vault(vault)
    cfg = v.config
    T = gguf.GGMLQuantizationType
    h, m, E = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    tensors = {t.name: t for t in r.tensors}
    # ggml order: innermost (input) dimension first
    want = {"token_embd.weight": (T.Q8_0, [h, cfg["vocab_size"]]), "output.weight": (T.Q8_0, [h, cfg["vocab_size"]]),
            "output_norm.weight": (T.F32, [h])}
    for l in range(cfg["num_hidden_layers"]):
        b = f"blk.{l}."
        want.update({b + "attn_norm.weight": (T.F32, [h]), b + "ffn_norm.weight": (T.F32, [h]),
                     b + "attn_q.weight": (T.Q8_0, [h, q]), b + "attn_k.weight": (T.Q8_0, [h, kv]),
                     b + "attn_v.weight": (T.Q8_0, [h, kv]), b + "attn_output.weight": (T.Q8_0, [q, h]),
                     b + "attn_q_norm.weight": (T.F32, [cfg["head_dim"]]),
                     b + "attn_k_norm.weight": (T.F32, [cfg["head_dim"]]),
                     b + "ffn_gate_inp.weight": (T.F32, [h, E]),
                     b + "ffn_gate_exps.weight": (T.Q4_0, [h, m, E]), b + "ffn_up_exps.weight": (T.Q4_0, [h, m, E]),
                     b + "ffn_down_exps.weight": (T.Q4_0, [m, h, E])})
    assert set(tensors) == set(want)
    for name, (typ, shape) in want.items():
        assert tensors[name].tensor_type == typ, name
        assert [int(x) for x in tensors[name].shape] == shape, name
    # values: an expert's Q4_0 weights are within one Q4_0 step (amax/8) of the vault's q4
    # weights (half a step, but a full one where +8 steps clips to code 15; plus f16 rounding of d)
    from gguf.quants import dequantize
    gate = dequantize(tensors["blk.1.ffn_gate_exps.weight"].data, T.Q4_0)  # (E, m, h)
    ref = v.expert(1, 3)[0]
    step = np.abs(ref).reshape(-1, 32).max(1, keepdims=True) / 8
    assert np.all(np.abs(gate[3] - ref).reshape(-1, 32) <= step * 1.001 + 1e-6)
    np.testing.assert_array_equal(tensors["blk.2.ffn_gate_inp.weight"].data, v.tensor("layers.2.router"))
    np.testing.assert_array_equal(tensors["output_norm.weight"].data, v.tensor("norm"))


def test_refuses_dense_layers(tiny_vault, tmp_path):
    exp = _exporter()
    with pytest.raises(exp.ExportError, match="dense-MLP"):
        exp.export(tiny_vault, tmp_path / "x.gguf", progress=False)
    assert not (tmp_path / "x.gguf").exists()


def test_refuses_unnormalised_topk(make_vault, tmp_path):
    exp = _exporter()
    vault = make_vault("tiny_nonorm", preset="tiny", seed=0, overrides={"mlp_only_layers": [], "norm_topk_prob": False})
    with pytest.raises(exp.ExportError, match="norm_topk_prob"):
        exp.export(vault, tmp_path / "x.gguf", progress=False)
    exp.export(vault, tmp_path / "x.gguf", force=True, progress=False)
    assert (tmp_path / "x.gguf").exists()


def test_processes_write_the_same_bytes(make_vault, tmp_path):
    """The requantisation spread over forked processes writes the very file one process writes."""
    vault = make_vault("tiny_sparse", preset="tiny", seed=0, overrides={"mlp_only_layers": []})
    exp = _exporter()
    one = exp.export(vault, tmp_path / "one.gguf", threads=1, progress=False)
    three = exp.export(vault, tmp_path / "three.gguf", threads=3, progress=False)
    assert one.read_bytes() == three.read_bytes()


def test_a_failing_worker_fails_the_export(make_vault, tmp_path, monkeypatch):
    """An error in a worker process reaches the caller, and no GGUF (whole or partial) is left."""
    vault = make_vault("tiny_sparse", preset="tiny", seed=0, overrides={"mlp_only_layers": []})
    exp = _exporter()
    real, calls = exp.encode, {"n": 0}

    def encode(w, typ):  # the third expert tensor a worker encodes fails (each fork counts its own)
        if typ == "q4_0":
            calls["n"] += 1
            if calls["n"] == 3:
                raise ValueError("injected")
        return real(w, typ)

    monkeypatch.setattr(exp, "encode", encode)
    with pytest.raises(ValueError, match="injected"):
        exp.export(vault, tmp_path / "x.gguf", threads=2, progress=False)
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x.gguf.part").exists()
