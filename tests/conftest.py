"""Shared fixtures: small synthetic vaults, made once per test session.

    tiny_vault       preset "tiny", seed 0, default formats (q4 experts, q8 matrices, f32 norms)
    tiny_vault_f32   preset "tiny", seed 0, every tensor f32 (tight comparisons)
    tiny_qwen3_vault tiny_vault under Qwen3's chat template (reasoning, tools)
    hf_vault         (f32 vault, transformers model) converted from a small random checkpoint
    make_vault       make_vault(name, **synth_kwargs) -> path, cached per argument set

Treat the vaults as read-only: they are shared by every test of the session.
"""
from __future__ import annotations

import pathlib

import pytest

ALL_F32 = {"attention": "f32", "embed": "f32", "lm_head": "f32", "mlp": "f32", "router": "f32", "norms": "f32"}


@pytest.fixture(scope="session")
def make_vault(tmp_path_factory):
    from pysmoe.synthesis import synth

    made = {}

    def make(name: str = "vault", **kwargs):
        key = (name, repr(sorted(kwargs.items())))
        if key not in made:
            kwargs.setdefault("progress", False)
            made[key] = synth(tmp_path_factory.mktemp(name), **kwargs)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_vault(make_vault):
    return make_vault("tiny", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_vault(tiny_vault, tmp_path_factory):
    """The tiny vault under Qwen3's chat template (reasoning, tools): its files linked, the template
    (tests/data/qwen3_chat_template.jinja) beside them."""
    import shutil
    d = tmp_path_factory.mktemp("tiny_qwen3")
    for f in pathlib.Path(tiny_vault).iterdir():
        (d / f.name).symlink_to(f)
    shutil.copy(pathlib.Path(__file__).parent / "data" / "qwen3_chat_template.jinja", d / "chat_template.jinja")
    return d


@pytest.fixture(scope="session")
def tiny_glm_vault(make_vault):
    """A GLM-4.5-family vault (vault v3's parameters, biases, router.bias, shared experts)."""
    return make_vault("tiny_glm", preset="tiny-glm", seed=0)


@pytest.fixture(scope="session")
def tiny_vault_f32(make_vault):
    return make_vault("tiny_f32", preset="tiny", seed=0, experts="f32", formats=ALL_F32)


@pytest.fixture(scope="session")
def hf_vault(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_models import make_hf_model
    from pysmoe.convert import convert_checkpoint
    tmp = tmp_path_factory.mktemp("hf_e2e")
    path, model = make_hf_model(tmp, num_hidden_layers=3, mlp_only_layers=[1])
    return convert_checkpoint(path, tmp / "vault", experts="f32", dense="f32", progress=False), model
