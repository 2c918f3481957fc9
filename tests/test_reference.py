"""Properties of the numpy reference forward (pysmoe/reference.py) that hold whatever the weights.

The vaults here are written straight from numpy with VaultWriter (all f32), so these tests need
neither transformers nor the converter; test_oracle.py is where the reference meets transformers.
"""
from __future__ import annotations

import numpy as np
import pytest

from pysmoe.reference import ReferenceModel, apply_rope, rope_tables, top_k_experts
from pysmoe.vaultio import VaultWriter, dense_shapes, layer_kinds, normalize_config

CONFIG = dict(vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=12, intermediate_size=40, moe_intermediate_size=24,
              num_experts=6, num_experts_per_tok=2, max_position_embeddings=64,
              norm_topk_prob=True, tie_word_embeddings=False, rms_norm_eps=1e-6,
              rope_theta=10000.0, mlp_only_layers=[1], decoder_sparse_step=1)
F32 = {role: "f32" for role in ("experts", "attention", "embed", "lm_head", "mlp", "router", "norms")}


def random_weights(cfg: dict, seed: int = 0) -> tuple[dict, dict]:
    """({dense name: array}, {(layer, expert): (gate, up, down)}) at O(1) activation scale."""
    rng = np.random.default_rng(seed)
    dense = {}
    for name, rows, cols in dense_shapes(cfg):
        if rows == 1:  # a norm weight
            dense[name] = rng.uniform(0.5, 1.5, cols).astype(np.float32)
        else:
            dense[name] = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
    h, m = cfg["hidden_size"], cfg["moe_intermediate_size"]
    experts = {}
    for l, sparse in enumerate(layer_kinds(cfg)):
        if sparse:
            dense[f"layers.{l}.router"] *= 3.0
            for e in range(cfg["num_experts"]):
                experts[(l, e)] = tuple((rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32)
                                        for s in ((m, h), (m, h), (h, m)))
    return dense, experts


def write_vault(path, cfg: dict, dense: dict, experts: dict):
    with VaultWriter(path, cfg, formats=F32) as w:
        for name, a in dense.items():
            w.add_dense(name, a)
        for (l, e), (gate, up, down) in experts.items():
            w.add_expert(l, e, gate, up, down)
    return path


def make_vault(tmp_path, name="v", seed=0, **overrides):
    cfg = normalize_config({**CONFIG, **overrides})
    dense, experts = random_weights(cfg, seed)
    return write_vault(tmp_path / name, cfg, dense, experts), cfg, dense, experts


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path, *_ = make_vault(tmp_path_factory.mktemp("ref"))
    return ReferenceModel(path)


def ids_for(n, seed=3, vocab=CONFIG["vocab_size"]):
    return [int(i) for i in np.random.default_rng(seed).integers(0, vocab, n)]


def test_shapes_and_routing(model):
    ids = ids_for(9)
    logits, routes = model.forward(ids)
    assert logits.shape == (9, CONFIG["vocab_size"]) and logits.dtype == np.float32
    assert np.all(np.isfinite(logits))
    assert [r is None for r in routes] == [False, True, False]  # layer 1 is in mlp_only_layers
    for r in (routes[0], routes[2]):
        assert r.shape == (9, CONFIG["num_experts_per_tok"])
        assert np.all((0 <= r) & (r < CONFIG["num_experts"]))
        assert all(len(set(row)) == len(row) for row in r.tolist())
    assert np.array_equal(model.logits(ids), logits)


def test_causal(model):
    """Position i sees ids[:i+1] only: changing later ids, or dropping them, leaves it alone."""
    ids = ids_for(12)
    full = model.logits(ids)
    changed = model.logits(ids[:7] + ids_for(5, seed=9))
    np.testing.assert_allclose(changed[:7], full[:7], rtol=0, atol=1e-5)
    assert not np.allclose(changed[7:], full[7:], atol=1e-3)
    np.testing.assert_allclose(model.logits(ids[:5]), full[:5], rtol=0, atol=1e-5)


def test_bad_ids(model):
    with pytest.raises(ValueError):
        model.logits([0, CONFIG["vocab_size"]])
    with pytest.raises(ValueError):
        model.logits([-1])
    with pytest.raises(ValueError):
        model.logits([])


def test_tied_embeddings_use_embed_tokens_as_lm_head(tmp_path):
    untied, cfg, dense, experts = make_vault(tmp_path, "untied")
    dense["lm_head"] = dense["embed_tokens"].copy()
    write_vault(untied, cfg, dense, experts)  # overwrite with lm_head = embed_tokens
    tied_cfg = normalize_config({**cfg, "tie_word_embeddings": True})
    tied = write_vault(tmp_path / "tied", tied_cfg, {k: v for k, v in dense.items() if k != "lm_head"},
                       experts)
    ref = ReferenceModel(tied)
    assert "lm_head" not in ref.vault.tensors
    ids = ids_for(6)
    np.testing.assert_array_equal(ref.logits(ids), ReferenceModel(untied).logits(ids))


def test_sparse_layer_of_identical_experts_is_the_dense_mlp(tmp_path):
    """With norm_topk_prob, k copies of one MLP weighted to sum 1 are that MLP: the sparse path
    (routing, weights, gathering) must equal the dense path given the same matrices."""
    cfg = normalize_config({**CONFIG, "mlp_only_layers": [], "intermediate_size": 24})
    dense, experts = random_weights(cfg)
    for l in range(cfg["num_hidden_layers"]):
        experts.update({(l, e): experts[(l, 0)] for e in range(cfg["num_experts"])})
    sparse = write_vault(tmp_path / "sparse", cfg, dense, experts)

    dense_cfg = normalize_config({**cfg, "mlp_only_layers": [0, 1, 2]})
    as_dense = {k: v for k, v in dense.items() if not k.endswith("router")}
    for l in range(cfg["num_hidden_layers"]):
        gate, up, down = experts[(l, 0)]
        as_dense.update({f"layers.{l}.mlp.gate_proj": gate, f"layers.{l}.mlp.up_proj": up,
                         f"layers.{l}.mlp.down_proj": down})
    dense_vault = write_vault(tmp_path / "dense", dense_cfg, as_dense, {})

    ids = ids_for(8)
    np.testing.assert_allclose(ReferenceModel(sparse).logits(ids), ReferenceModel(dense_vault).logits(ids),
                               rtol=0, atol=1e-5)
    assert all(r is None for r in ReferenceModel(dense_vault).routing(ids))


def test_decoder_sparse_step(tmp_path):
    path, *_ = make_vault(tmp_path, num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[])
    routes = ReferenceModel(path).routing(ids_for(4))
    assert [r is not None for r in routes] == [False, True, False, True]


def test_top_k_ties_go_to_the_lower_index():
    probs = np.array([0.1, 0.3, 0.2, 0.3, 0.1], dtype=np.float32)
    assert top_k_experts(probs, 2).tolist() == [1, 3]
    assert top_k_experts(probs, 3).tolist() == [1, 3, 2]
    assert top_k_experts(np.full(4, 0.25, np.float32), 2).tolist() == [0, 1]


def test_rope_is_a_relative_rotation():
    """Position 0 is the identity, norms are kept, and q·k depends only on the distance."""
    d = 16
    cos, sin = rope_tables(40, d, 10000.0)
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 1, 1, d)).astype(np.float32)
    at = lambda x, p: apply_rope(np.repeat(x, 40, axis=1), cos, sin)[0, p]  # noqa: E731
    np.testing.assert_allclose(at(q, 0), q[0, 0], atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(at(q, 17)), np.linalg.norm(q), rtol=1e-5)
    np.testing.assert_allclose(at(q, 10) @ at(k, 3), at(q, 30) @ at(k, 23), rtol=1e-4, atol=1e-5)
