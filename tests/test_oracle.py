"""The oracle: transformers' Qwen3MoeForCausalLM on random weights, saved, converted, and compared
with pysmoe.reference at every position.

- f32 vault (experts and dense f32): the reference must match transformers to 1e-4 absolute.
- q4 / q8 experts (dense f32): the transformers model gets the dequantised experts read back from
  the vault, and the two must again agree to 1e-4; quantisation error is not what is tested.
- the checkpoint spellings (transformers-5 config + per-expert names, the released-checkpoint
  config, fused gate_up_proj/down_proj, sharded with an index) all give the same vault.

Each model's router spread is measured (`router_gap`: the smallest margin between the k-th and
(k+1)-th router probability over the test sequence) and must be far above float32 rounding, or a
top-k choice could flip between two correct implementations and the comparison mean nothing.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from hf_models import (hf_logits, make_hf_model, router_gap, sample_ids, set_expert,  # noqa: E402
                       sparse_layers, write_fused_checkpoint, write_released_spelling)

from pysmoe.convert import convert_checkpoint  # noqa: E402
from pysmoe.reference import ReferenceModel  # noqa: E402
from pysmoe.vaultio import CONFIG_KEYS, read_vault  # noqa: E402

TOL = 1e-4
MIN_ROUTER_GAP = 1e-5  # float32 rounding moves a probability by ~1e-7

CASES = {
    "base": dict(),
    # head_dim 24 ≠ 64/4; four query heads per kv head; a large rope_theta
    "head_dim": dict(head_dim=24, num_key_value_heads=1, rope_theta=1e6),
    "mlp_only_layers": dict(num_hidden_layers=3, mlp_only_layers=[0, 2]),
    "sparse_step_2": dict(num_hidden_layers=4, decoder_sparse_step=2, num_experts=16,
                          num_experts_per_tok=4),
    "no_norm_topk": dict(norm_topk_prob=False, num_experts=16, num_experts_per_tok=3),
    "tied": dict(tie_word_embeddings=True),
}

F32 = dict(experts="f32", dense="f32", progress=False)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    path, model = make_hf_model(tmp, **CASES[request.param])
    ids = sample_ids(model, 24)
    gap = router_gap(model, ids)
    print(f"\n{request.param}: smallest router top-k gap {gap:.3g}")
    return request.param, tmp, path, model, ids, gap


def test_router_gap_is_not_tiny(case):
    name, _, _, _, _, gap = case
    assert gap > MIN_ROUTER_GAP, f"{name}: router top-k gap {gap} too small to compare routing"


def test_f32_vault_matches_transformers(case):
    name, tmp, path, model, ids, _ = case
    vault = convert_checkpoint(path, tmp / "f32", **F32)
    ref = ReferenceModel(vault)

    want = hf_logits(model, ids)
    got = ref.logits(ids)
    assert got.shape == want.shape == (len(ids), model.config.vocab_size)
    err = float(np.max(np.abs(got - want)))
    print(f"{name}: f32 max |reference − transformers| = {err:.3g}")
    assert err <= TOL

    # Same experts chosen, layer by layer, as transformers' router.
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=False, output_router_logits=True)
    routes = ref.routing(ids)
    sparse = sparse_layers(model)
    assert [l for l, r in enumerate(routes) if r is not None] == sparse
    k = model.config.num_experts_per_tok
    for l, logits in zip(sparse, out.router_logits):
        want_sets = torch.topk(logits.float(), k, dim=-1).indices.sort(dim=-1).values.numpy()
        assert np.array_equal(np.sort(routes[l], axis=-1), want_sets), f"layer {l}"


# q8 goes through the same path as q4; once is enough.
QUANTIZED = {name: ("q4", "q8") if name == "base" else ("q4",) for name in CASES}


def test_quantized_experts_match_transformers_with_dequantized_weights(case):
    import copy

    name, tmp, path, model, ids, _ = case
    for fmt in QUANTIZED[name]:
        vault = convert_checkpoint(path, tmp / fmt, experts=fmt, dense="f32", progress=False)
        vf = read_vault(vault)

        # A copy of the transformers model carrying the dequantised experts.
        deq = copy.deepcopy(model)
        changed = 0.0
        for l in sparse_layers(model):
            for e in range(model.config.num_experts):
                gate, up, down = vf.expert(l, e)
                old = model.model.layers[l].mlp.experts.down_proj[e].detach().numpy()
                changed = max(changed, float(np.max(np.abs(old - down))))
                set_expert(deq, l, e, gate, up, down)
        assert changed > 0, "quantisation changed nothing: the test would not test it"
        gap = router_gap(deq, ids)
        assert gap > MIN_ROUTER_GAP, f"{name} {fmt}: router top-k gap {gap}"

        want = hf_logits(deq, ids)
        got = ReferenceModel(vault).logits(ids)
        err = float(np.max(np.abs(got - want)))
        print(f"{name}: {fmt} max |reference − transformers(dequantised)| = {err:.3g}, gap {gap:.3g}")
        assert err <= TOL


def _same_vault(a, b):
    assert (a / "vault.bin").read_bytes() == (b / "vault.bin").read_bytes()
    ca, cb = read_vault(a).config, read_vault(b).config
    assert {k: ca[k] for k in CONFIG_KEYS} == {k: cb[k] for k in CONFIG_KEYS}
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes()


def test_checkpoint_spellings_give_identical_vaults(tmp_path):
    # default dense formats (q8) need every input width a multiple of 64
    path, model = make_hf_model(tmp_path, num_hidden_layers=3, mlp_only_layers=[1], intermediate_size=128)
    saved = convert_checkpoint(path, tmp_path / "v_saved", experts="q4", progress=False)

    released = tmp_path / "released"
    shutil.copytree(path, released)
    write_released_spelling(released)
    cfg = json.loads((released / "config.json").read_text())
    assert "num_experts" in cfg and "rope_theta" in cfg
    assert "num_local_experts" not in cfg and "rope_parameters" not in cfg
    _same_vault(saved, convert_checkpoint(released, tmp_path / "v_released", experts="q4", progress=False))

    fused = write_fused_checkpoint(model, tmp_path / "fused")
    with open(fused / "model.safetensors", "rb") as f:
        header = f.read(8 + int.from_bytes(f.read(8), "little"))
    assert b"mlp.experts.gate_up_proj" in header and b"experts.0.gate_proj" not in header
    _same_vault(saved, convert_checkpoint(fused, tmp_path / "v_fused", experts="q4", progress=False))

    sharded = write_fused_checkpoint(model, tmp_path / "sharded", shards=3)
    assert (sharded / "model.safetensors.index.json").is_file()
    _same_vault(saved, convert_checkpoint(sharded, tmp_path / "v_sharded", experts="q4", progress=False))


def test_fused_layout_gate_rows_come_first(tmp_path):
    """The fused tensor's first I rows are gate: checked on values, not just on the vault bytes."""
    path, model = make_hf_model(tmp_path)
    fused = write_fused_checkpoint(model, tmp_path / "fused")
    vf = read_vault(convert_checkpoint(fused, tmp_path / "v", **F32))
    I = model.config.moe_intermediate_size
    gate_up = model.model.layers[0].mlp.experts.gate_up_proj[3].detach().numpy()
    gate, up, down = vf.expert(0, 3)
    np.testing.assert_array_equal(gate, gate_up[:I])
    np.testing.assert_array_equal(up, gate_up[I:])
    np.testing.assert_array_equal(down, model.model.layers[0].mlp.experts.down_proj[3].detach().numpy())
