"""pysmoe.synth, the synthetic tokenizer, and the progress bar."""
from __future__ import annotations

import argparse
import io
import json

import numpy as np
import pytest

from pysmoe import synthesis as S
from pysmoe import vaultio as V
from pysmoe.progress import Progress
from pysmoe.tokenizer import (SPECIAL_TOKENS, build_synthetic_tokenizer, load_tokenizer, Tokenizer,
                              synthetic_tokenizer_config)


def test_tiny_opens_with_the_pure_reader(tiny_vault):
    with V.read_vault(tiny_vault) as v:
        assert v.verify() == []
        cfg = v.config
        for key, want in S.PRESETS["tiny"].items():
            assert cfg[key] == want, key
        assert cfg["head_dim"] * cfg["num_attention_heads"] != cfg["hidden_size"]
        assert [v.layer_is_sparse(l) for l in range(4)] == [True, True, False, True]
        assert v.tensors["layers.0.q_proj"].rows == 4 * 32
        assert v.expert_tensors[0].format == "q4"
        assert v.binary_config["head_dim"] == 32


def _files(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path, tiny_vault):
    a = _files(S.synth(tmp_path / "a", seed=0, progress=False))
    assert a == _files(tiny_vault)
    b = _files(S.synth(tmp_path / "b", seed=1, progress=False))
    assert set(a) == set(b) == {"vault.bin", "config.json", "tokenizer.json", "tokenizer_config.json"}
    assert a["vault.bin"] != b["vault.bin"] and len(a["vault.bin"]) == len(b["vault.bin"])
    with V.read_vault(tiny_vault) as va, V.read_vault(tmp_path / "b") as vb:
        assert not np.array_equal(va.tensor("embed_tokens"), vb.tensor("embed_tokens"))
        assert not np.array_equal(va.expert(0, 0)[0], vb.expert(0, 0)[0])
        assert (va.blob_crcs != vb.blob_crcs).sum() == 3 * 16


def test_layers_truncate_and_keep_the_first_layers(tmp_path, tiny_vault):
    two = S.synth(tmp_path / "two", layers=2, progress=False)
    three = S.synth(tmp_path / "three", layers=3, progress=False)
    with V.read_vault(two) as v2, V.read_vault(three) as v3, V.read_vault(tiny_vault) as v4:
        assert v2.config["num_hidden_layers"] == 2 and v2.config["mlp_only_layers"] == []
        assert v3.config["mlp_only_layers"] == [2] and v3.sparse == [True, True, False]
        # every tensor draws from its own seed: truncation keeps the layers it keeps (only the
        # gain of the projections into the residual stream, 1/sqrt(2·layers), changes)
        assert np.array_equal(v2.expert(1, 5)[0], v4.expert(1, 5)[0])
        assert np.array_equal(v3.tensor("layers.2.mlp.gate_proj"), v4.tensor("layers.2.mlp.gate_proj"))
    with pytest.raises(ValueError, match="layers"):
        S.synth(tmp_path / "zero", layers=0, progress=False)


def test_q4_experts_have_zero_mean_and_the_intended_std(tiny_vault):
    with V.read_vault(tiny_vault) as v:
        stds = S.expert_stds(v.config)
        for part in range(3):
            w = np.concatenate([v.expert(1, e)[part].ravel() for e in range(16)])
            assert abs(w.mean()) < 0.02 * stds[part]
            assert abs(w.std() / stds[part] - 1) < 0.03
        codes, _, _ = __import__("pysmoe.quant", fromlist=["split"]).split(
            np.asarray(v.blob(0, 0)), "q4", 64, 64, "f16")
        counts = np.bincount(codes.ravel(), minlength=16)
        assert counts.min() > 0.7 * counts.mean()  # codes uniform on 0..15


def test_dense_weights_are_scaled(tiny_vault):
    with V.read_vault(tiny_vault) as v:
        assert abs(v.tensor("embed_tokens").std() - 1) < 0.05
        norm = v.tensor("layers.0.input_layernorm")
        assert np.all(np.abs(norm - 1) < 0.2) and norm.std() > 0.01
        q = v.tensor("layers.0.q_proj")
        assert abs(q.std() * np.sqrt(64) - 1) < 0.05


def _rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x) + eps) * w


def _silu(x):
    return x / (1 + np.exp(-x))


def _one_token(v, token: int):
    """One token at position 0 through every layer (attention over one position is its own v;
    RoPE at position 0 is the identity). Returns the residual after each layer, the logits and
    the router probabilities."""
    cfg = v.config
    hd, nh, nkv, eps = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
    x = v.tensor("embed_tokens")[token].astype(np.float64)
    trace, probs = [x.copy()], []
    for l in range(cfg["num_hidden_layers"]):
        p = f"layers.{l}."
        h = _rms_norm(x, v.tensor(p + "input_layernorm"), eps)
        vv = (v.tensor(p + "v_proj") @ h).reshape(nkv, hd)
        att = np.repeat(vv, nh // nkv, axis=0).reshape(-1)
        x = x + v.tensor(p + "o_proj") @ att
        h = _rms_norm(x, v.tensor(p + "post_attention_layernorm"), eps)
        if v.layer_is_sparse(l):
            logits = v.tensor(p + "router") @ h
            pr = np.exp(logits - logits.max())
            pr /= pr.sum()
            top = np.argsort(-pr)[:cfg["num_experts_per_tok"]]
            wts = pr[top] / pr[top].sum()
            out = np.zeros_like(x)
            for e, wt in zip(top, wts):
                g, u, d = v.expert(l, int(e))
                out += wt * (d @ (_silu(g @ h) * (u @ h)))
            probs.append(pr)
        else:
            out = v.tensor(p + "mlp.down_proj") @ (_silu(v.tensor(p + "mlp.gate_proj") @ h)
                                                   * (v.tensor(p + "mlp.up_proj") @ h))
        x = x + out
        trace.append(x.copy())
    logits = v.tensor("lm_head") @ _rms_norm(x, v.tensor("norm"), eps)
    return trace, logits, probs


@pytest.mark.parametrize("fixture", ["tiny_vault", "tiny_vault_f32"])
def test_a_forward_stays_finite_and_every_layer_counts(request, fixture):
    with V.read_vault(request.getfixturevalue(fixture)) as v:
        for token in (0, 7, 511):
            trace, logits, probs = _one_token(v, token)
            assert all(np.isfinite(t).all() for t in trace) and np.isfinite(logits).all()
            rms = [np.sqrt(np.mean(t * t)) for t in trace]
            assert 0.5 < rms[0] < 2 and rms[-1] < 4 * rms[0]
            steps = [np.sqrt(np.mean((b - a) ** 2)) for a, b in zip(trace, trace[1:])]
            assert min(steps) > 0.01  # no layer is a no-op
            assert 0.5 < logits.std() < 8
            k = v.config["num_experts_per_tok"]
            for pr in probs:  # the router picks: top-k holds clearly more than its share
                s = np.sort(pr)[::-1]
                assert s[:k].sum() > 1.3 * k / len(pr) and s[k - 1] - s[k] > 1e-6


def test_f32_and_other_expert_formats(tmp_path, tiny_vault_f32):
    with V.read_vault(tiny_vault_f32) as v:
        assert v.expert_tensors[0].format == "f32" and v.tensors["embed_tokens"].format == "f32"
        g, _, d = v.expert(0, 0)
        stds = S.expert_stds(v.config)
        assert abs(g.std() / stds[0] - 1) < 0.1 and abs(d.std() / stds[2] - 1) < 0.1
    for fmt in ("q8", "bf16"):
        p = S.synth(tmp_path / fmt, experts=fmt, layers=1, progress=False)
        with V.read_vault(p) as v:
            assert v.expert_tensors[0].format == fmt and v.verify() == []
            g = v.expert(0, 3)[0]
            assert abs(g.std() * 8 - 1) < 0.1 and abs(g.mean()) < 0.01


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="routing 'nonsense' is not implemented"):
        S.synth(tmp_path, routing="nonsense", progress=False)
    with pytest.raises(ValueError, match="expert format"):
        S.synth(tmp_path, experts="q3", progress=False)
    with pytest.raises(ValueError, match="unknown preset"):
        S.synth(tmp_path, preset="huge", progress=False)


def test_presets_have_the_intended_sizes():
    mini = V.compute_layout(S.preset_config("mini"))
    experts = mini.blob_bytes * sum(mini.sparse) * mini.config["num_experts"]
    assert 0.9e9 < experts < 1.2e9
    a3b = S.preset_config("a3b")
    assert (a3b["hidden_size"], a3b["num_hidden_layers"], a3b["num_experts"], a3b["moe_intermediate_size"],
            a3b["head_dim"], a3b["max_position_embeddings"]) == (2048, 48, 128, 768, 128, 40960)
    a22b = S.preset_config("a22b", layers=3)
    assert a22b["num_hidden_layers"] == 3 and a22b["hidden_size"] == 4096


def test_cli(tmp_path, capsys):
    from pysmoe.cli import synth as synth_cli
    parser = argparse.ArgumentParser()
    synth_cli.add_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["synth", str(tmp_path / "v"), "--preset", "tiny", "--seed", "3", "--layers", "2",
                              "--experts", "q8", "--quiet"])
    assert args.func(args) == 0
    assert "wrote" in capsys.readouterr().out
    from pysmoe import cli
    assert cli.main(["synth", str(tmp_path / "w"), "--layers", "1", "--quiet"]) == 0
    assert V.read_vault(tmp_path / "w").config["num_hidden_layers"] == 1
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2
    with V.read_vault(tmp_path / "v") as v:
        assert v.expert_tensors[0].format == "q8"


# -------------------------------------------------------------------------------- tokenizer

def test_synthetic_tokenizer_is_deterministic_and_fits():
    for vocab in (260, 512, 32000):
        text = build_synthetic_tokenizer(vocab)
        assert text == build_synthetic_tokenizer(vocab)
        tok = Tokenizer(text)
        assert tok.vocab_size == min(vocab, 1003)
        for s in SPECIAL_TOKENS:
            assert tok.token_to_id(s) < vocab
    with pytest.raises(ValueError, match="vocab_size"):
        build_synthetic_tokenizer(200)


def test_tokenizer_of_a_vault(tiny_vault):
    tok = load_tokenizer(tiny_vault)
    assert tok.eos_ids[0] == tok.token_to_id("<|im_end|>") and tok.token_to_id("<|endoftext|>") in tok.eos_ids
    text = "Hello, world! The river is cold. Ünïcode ✓"
    ids = tok.encode(text)
    assert all(0 <= i < 512 for i in ids) and tok.decode(ids) == text
    assert tok.decode(ids + [tok.vocab_size, 10 ** 6]) == text  # past the tokenizer's vocab: ""
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = tok.apply_chat_template(msgs, tokenize=False)
    assert chat == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(msgs)
    assert ids.count(tok.token_to_id("<|im_start|>")) == 3 and ids.count(tok.eos_id) == 2
    assert tok.decode(ids, skip_special_tokens=False) == chat
    assert tok.chat_template == synthetic_tokenizer_config()["chat_template"]


def test_chat_template_agrees_with_jinja():
    jinja2 = pytest.importorskip("jinja2")
    from pysmoe.tokenizer import CHATML_TEMPLATE, apply_chat_template

    msgs = [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "c"}, {"role": "user", "content": ""}]
    for gen in (True, False):
        want = jinja2.Template(CHATML_TEMPLATE).render(messages=msgs, add_generation_prompt=gen)
        assert apply_chat_template(msgs, gen) == want


# --------------------------------------------------------------------------------- progress

def test_progress_to_a_log():
    out = io.StringIO()
    with Progress(1000, "load", unit="B", stream=out) as bar:
        for _ in range(100):
            bar.update(10)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and "100%" in lines[-1] and "1000 B" in lines[-1]  # a quick job: its last line
    quiet = io.StringIO()
    with Progress(10, stream=quiet, enabled=False) as bar:
        bar.update(10)
    assert quiet.getvalue() == ""
