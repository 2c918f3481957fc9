"""GGUF import (pysmoe/convert/gguf.py) on files written by llama.cpp's own tools.

The fixtures in tests/data/gguf/ were made by scripts/make_gguf_fixtures.py: tiny random
Qwen3-MoE checkpoints (transformers) → llama.cpp's convert_hf_to_gguf.py → F32 → llama.cpp's
quantiser. The oracle for the logits is transformers run on the GGUF's weights dequantised by
gguf-py (`gguf.quants.dequantize`); the oracle for the tokenizer is llama.cpp's tokenizer, through
ids it produced (tokens.json, made by the same script) and, where llama-cpp-python is installed,
live.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from pysmoe import quant  # noqa: E402
from pysmoe.convert import ConvertError, convert_checkpoint  # noqa: E402
from pysmoe.convert.gguf import GGUFModel, plan, supported_types  # noqa: E402
from pysmoe.vaultio import read_vault  # noqa: E402

DATA = Path(__file__).parent / "data" / "gguf"
FIXTURES = sorted(p.stem for p in DATA.glob("*.gguf"))


def _runnable(path: Path) -> str | None:
    """Why this build cannot run the file (None if it can): a tensor type without a kernel."""
    types = supported_types()
    tensors = gguf.GGUFReader(path).tensors
    missing = sorted({t.tensor_type.name for t in tensors if int(t.tensor_type) not in types})
    return f"no kernel for {', '.join(missing)} in this build" if missing else None


@pytest.fixture(scope="module")
def vaults(tmp_path_factory):
    out = {}
    for name in FIXTURES:
        why = _runnable(DATA / f"{name}.gguf")
        out[name] = why or convert_checkpoint(DATA / f"{name}.gguf", tmp_path_factory.mktemp(name) / "v",
                                              progress=False)
    return out


def _vault(vaults, name):
    if isinstance(vaults[name], str):
        pytest.skip(f"{name}: {vaults[name]}")
    return vaults[name]


# ------------------------------------------------------------------------------ what is read

def test_the_fixtures_are_there():
    """Every fixture scripts/make_gguf_fixtures.py makes is checked in (and nothing else)."""
    assert FIXTURES == sorted(_scripts().FIXTURES)


@pytest.mark.parametrize("name", FIXTURES)
def test_config_is_the_checkpoints(name, vaults):
    """The configuration read from the metadata is the transformers config the fixture was made
    from (scripts/make_gguf_fixtures.py's shapes), in config.json's names."""
    import sys
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    from make_gguf_fixtures import FIXTURES as MADE
    from hf_models import BASE_CONFIG

    shape = dict(MADE[name][0])
    family = shape.pop("model", "qwen3_moe")
    want = {**BASE_CONFIG, **shape}
    if family == "olmoe":  # its expert width is intermediate_size; it never renormalises
        want.update(moe_intermediate_size=shape["intermediate_size"], norm_topk_prob=False,
                    head_dim=shape["hidden_size"] // shape["num_attention_heads"])
    p = plan(GGUFModel(DATA / f"{name}.gguf"), check_types=False)
    for k, v in want.items():
        assert p.config[k] == v, k
    assert p.config["rope_theta"] == 10000.0
    assert p.config["model_type"] == family


@pytest.mark.parametrize("name", FIXTURES)
def test_tensors_byte_for_byte(name, vaults):
    """Every dense tensor and every expert's gate/up/down in the vault hold exactly the GGUF's
    bytes for it, in its GGML type."""
    v = read_vault(_vault(vaults, name))
    r = gguf.GGUFReader(DATA / f"{name}.gguf")
    names = {"token_embd.weight": "embed_tokens", "output_norm.weight": "norm", "output.weight": "lm_head"}
    E = v.config["num_experts"]
    seen = 0
    for t in r.tensors:
        raw = bytes(r.data[t.data_offset:t.data_offset + int(t.n_bytes)])
        if "_exps." in t.name:
            l, part = int(t.name.split(".")[1]), t.name.split(".")[2][4:-5]
            desc = {x.name: x for x in v.layer_expert_tensors[l]}[part]
            n = len(raw) // E
            for e in range(E):
                blob = v.blob(l, e)
                assert bytes(blob[desc.offset:desc.offset + desc.nbytes]) == raw[e * n:(e + 1) * n], (t.name, e)
        else:
            vname = names.get(t.name) or _layer_name(t.name)
            assert bytes(v.raw(vname)) == raw, t.name
        seen += 1
    assert seen == len(r.tensors)


def _layer_name(gname: str) -> str:
    from pysmoe.convert.gguf import FAMILIES
    _, l, rest = gname.split(".", 2)
    return f"layers.{l}.{FAMILIES['qwen3moe'].layer_tensors[rest]}"


def test_tokenizer_files_and_template(vaults):
    """tokenizer_config.json carries the file's chat template and its special tokens;
    generation_config.json its eos id."""
    m = GGUFModel(DATA / "tiny-f32.gguf")
    d = _vault(vaults, "tiny-f32")
    tc = json.loads((d / "tokenizer_config.json").read_text())
    assert tc["chat_template"] == m.meta["tokenizer.chat_template"]
    toks = m.meta["tokenizer.ggml.tokens"]
    assert tc["eos_token"] == toks[m.meta["tokenizer.ggml.eos_token_id"]]
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == m.meta["tokenizer.ggml.eos_token_id"]
    from pysmoe.tokenizer import load_tokenizer
    tok = load_tokenizer(d)
    assert tok.eos_id == m.meta["tokenizer.ggml.eos_token_id"]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# ------------------------------------------------------------------------------ the oracle

def _dequantised_hf_model(path: Path, cfg: dict):
    """transformers' Qwen3MoeForCausalLM holding the GGUF's weights as gguf-py dequantises them."""
    import torch
    from hf_models import make_config

    keys = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
            "max_position_embeddings", "rms_norm_eps", "norm_topk_prob", "tie_word_embeddings", "rope_theta")
    if cfg["model_type"] == "olmoe":
        from transformers import OlmoeConfig, OlmoeForCausalLM
        kw = {k: cfg[k] for k in keys if k not in ("moe_intermediate_size", "head_dim", "rope_theta")}
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
        config = OlmoeConfig(**kw)
        config._attn_implementation = "eager"
        config._experts_implementation = "eager"
        model = OlmoeForCausalLM(config).float().eval()
    else:
        from transformers import Qwen3MoeForCausalLM
        model = Qwen3MoeForCausalLM(make_config(**{k: cfg[k] for k in keys})).float().eval()
    r = gguf.GGUFReader(path)
    w = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32) for t in r.tensors}
    hf = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}
    attn = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
            "attn_q_norm": "q_norm", "attn_k_norm": "k_norm"}
    state = {}
    for name, a in w.items():
        if name in hf:
            state[hf[name]] = a
            continue
        _, l, part, _ = name.split(".")
        p = f"model.layers.{l}."
        if part in attn:
            state[p + "self_attn." + attn[part] + ".weight"] = a
        elif part == "attn_norm":
            state[p + "input_layernorm.weight"] = a
        elif part == "ffn_norm":
            state[p + "post_attention_layernorm.weight"] = a
        elif part == "ffn_gate_inp":
            state[p + "mlp.gate.weight"] = a
        elif part == "ffn_down_exps":
            state[p + "mlp.experts.down_proj"] = a
    for l in range(cfg["num_hidden_layers"]):
        g, u = w[f"blk.{l}.ffn_gate_exps.weight"], w[f"blk.{l}.ffn_up_exps.weight"]
        state[f"model.layers.{l}.mlp.experts.gate_up_proj"] = np.concatenate([g, u], axis=1)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for k, a in state.items():
            assert params[k].shape == a.shape, (k, params[k].shape, a.shape)
            params[k].copy_(torch.from_numpy(a))
    assert set(state) == set(params), set(params) ^ set(state)
    return model


@pytest.mark.parametrize("name", FIXTURES)
def test_logits_against_transformers_on_the_dequantised_weights(name, vaults):
    """With f32 activations, the imported vault's logits at every position equal transformers'
    on the GGUF's dequantised weights within 1e-4 of max|logit|."""
    import pysmoe
    from hf_models import hf_logits

    d = _vault(vaults, name)
    cfg = json.loads((d / "config.json").read_text())
    model = _dequantised_hf_model(DATA / f"{name}.gguf", cfg)
    ids = [int(i) for i in np.random.default_rng(3).integers(0, cfg["vocab_size"], 20)]
    want = hf_logits(model, ids)
    with pysmoe.open_vault(d) as v, v.session(threads=1, activations="f32", prefill="token-serial") as s:
        got = np.stack([s.decode(i) for i in ids])
    err = float(np.max(np.abs(got - want)))
    assert err <= 1e-4 * float(np.max(np.abs(want))), err


# ------------------------------------------------------------------------------ refusals, splits

def _rewrite(src: Path, out: Path, *, retype: dict | None = None, split_max_tensors: int = 0, drop=()):
    """Copy a GGUF with gguf-py's writer, optionally storing some tensors in another type
    (zero blocks: only the planning reads them) or splitting it into several files."""
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(out, arch=arch, split_max_tensors=split_max_tensors)  # writes the arch itself
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(k, f.contents(), vt, sub_type=f.types[-1])
        else:
            w.add_key_value(k, f.contents(), vt)
    for t in r.tensors:
        if t.name in drop:
            continue
        data = np.asarray(t.data)
        if retype and t.name in retype:
            q = retype[t.name]
            bs, ts = gguf.GGML_QUANT_SIZES[q]
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            data = np.zeros(shape[:-1] + (shape[-1] // bs * ts,), dtype=np.uint8)
            w.add_tensor(t.name, data, raw_dtype=q)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _unsupported_type():
    """A GGML block type of 32 weights this build has no kernel for (Q8_1: ggml's activation type)."""
    types = supported_types()
    for q in gguf.GGMLQuantizationType:
        if int(q) not in types and gguf.GGML_QUANT_SIZES.get(q, (0,))[0] == 32:
            return q
    pytest.skip("this build runs every GGML type of 32-weight blocks")


def test_an_unsupported_type_is_refused_before_anything_is_written(tmp_path):
    bad = tmp_path / "bad.gguf"
    q = _unsupported_type()
    _rewrite(DATA / "tiny-f32.gguf", bad, retype={"blk.1.ffn_up_exps.weight": q, "blk.0.attn_q.weight": q})
    out = tmp_path / "v"
    with pytest.raises(ConvertError, match="tensor types this build cannot run") as e:
        convert_checkpoint(bad, out, progress=False)
    assert f"blk.1.ffn_up_exps.weight ({q.name})" in str(e.value)
    assert f"blk.0.attn_q.weight ({q.name})" in str(e.value)
    assert not out.exists() and list(tmp_path.iterdir()) == [bad]


def test_a_missing_or_unknown_tensor_is_named(tmp_path):
    bad = tmp_path / "bad.gguf"
    _rewrite(DATA / "tiny-f32.gguf", bad, drop=("blk.1.attn_k_norm.weight",))
    with pytest.raises(ConvertError, match=r"layers\.1\.k_norm missing"):
        convert_checkpoint(bad, tmp_path / "v", progress=False)
    assert not (tmp_path / "v").exists()


def test_format_options_are_refused(tmp_path):
    with pytest.raises(ConvertError, match="as stored.*--experts"):
        convert_checkpoint(DATA / "tiny-f32.gguf", tmp_path / "v", experts="q4", progress=False)


def test_a_split_file_converts_to_the_same_vault(tmp_path, vaults):
    _rewrite(DATA / "tiny-f32.gguf", tmp_path / "m.gguf", split_max_tensors=10)
    parts = sorted(p.name for p in tmp_path.glob("*.gguf"))
    assert parts == ["m-00001-of-00003.gguf", "m-00002-of-00003.gguf", "m-00003-of-00003.gguf"]
    out = convert_checkpoint(tmp_path / parts[0], tmp_path / "v", progress=False)
    assert (out / "vault.bin").read_bytes() == (_vault(vaults, "tiny-f32") / "vault.bin").read_bytes()
    (tmp_path / parts[2]).unlink()
    with pytest.raises(ConvertError, match="split files missing: m-00003-of-00003.gguf"):
        convert_checkpoint(tmp_path / parts[0], tmp_path / "v2", progress=False)


def test_not_a_gguf_file(tmp_path):
    f = tmp_path / "x.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 10)
    with pytest.raises(ConvertError, match="not a readable GGUF"):
        convert_checkpoint(f, tmp_path / "v", progress=False)
    g = tmp_path / "y.bin"
    g.write_bytes(b"hello")
    with pytest.raises(ConvertError, match="not a GGUF file"):
        convert_checkpoint(g, tmp_path / "v", progress=False)


# ------------------------------------------------------------------------------ the tokenizer

def _scripts():
    import sys
    p = str(Path(__file__).parents[1] / "scripts")
    if p not in sys.path:
        sys.path.insert(0, p)
    import make_gguf_fixtures
    return make_gguf_fixtures


def _encoder(gguf_path: Path):
    from tokenizers import Tokenizer

    from pysmoe.convert.gguf_tokenizer import tokenizer_json
    tok = Tokenizer.from_str(tokenizer_json(GGUFModel(gguf_path).meta))
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def _golden():
    path = DATA / "tokens.json"
    if not path.exists():
        pytest.skip("tests/data/gguf/tokens.json not made yet (scripts/make_gguf_fixtures.py)")
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("pre", ["qwen2", "gpt-2", "llama-bpe", "qwen35", "glm4", "gpt-4o"])
def test_tokenizer_encodes_as_llama_cpp_did(pre, tmp_path):
    """The tokenizer.json made from a GGUF's vocabulary gives the ids llama.cpp gave for the same
    vocabulary and pre-tokenizer (tokens.json, made by llama.cpp), text by text."""
    g = _golden()
    mk = _scripts()
    demo = Path(__file__).parents[1] / "pysmoe" / "data" / "demo"
    path = mk.vocab_gguf(tmp_path / "v.gguf", demo, 4096, pre, DATA / "tiny-f32.gguf")
    enc = _encoder(path)
    for text, want in zip(g["texts"], g["demo"][pre]):
        assert enc(text) == want, text[:80]


def test_tokenizer_of_a_converted_file_encodes_as_llama_cpp_did():
    g = _golden()
    enc = _encoder(DATA / "tiny-f32.gguf")
    for text, want in zip(g["texts"], g["tiny-f32"]):
        assert enc(text) == want, text[:80]


def test_tokenizer_against_llama_cpp_live(tmp_path):
    """Where llama-cpp-python is installed: random strings drawn from a mix of scripts, digits,
    whitespace and specials, tokenised by both."""
    pytest.importorskip("llama_cpp")
    mk = _scripts()
    demo = Path(__file__).parents[1] / "pysmoe" / "data" / "demo"
    rng = np.random.default_rng(0)
    alphabet = list("abcXYZ  \t\n\r0123456789'.,!?-_") + ["é", "ß", "日", "本", "Ω", "й", "ع", "क", "🚀", "\u200d",
                                                        "\u00a0", "'s", "'LL", "<|im_start|>", "<|im_end|>", "  "]
    texts = ["".join(rng.choice(alphabet, size=int(rng.integers(0, 40)))) for _ in range(200)]
    for pre in mk.TOKENIZER_PRES:
        path = mk.vocab_gguf(tmp_path / f"{pre}.gguf", demo, 4096, pre, DATA / "tiny-f32.gguf")
        enc = _encoder(path)
        want = mk.llama_cpp_tokens(path, texts)
        bad = [t for t, w in zip(texts, want) if enc(t) != w]
        assert not bad, (pre, bad[:3])


@pytest.mark.parametrize("name", ["k256-q4_k_m", "k256-iq4_xs", "tiny-q4_0"])
@pytest.mark.parametrize("activations", ["f32", "q8"])
def test_layer_major_is_token_serial_on_an_imported_mix(name, activations, vaults):
    """A llama.cpp mix imported as stored keeps the engine's bit identity: a layer-major prefill
    in chunks of 5 gives the very logits of the token-serial walk, in both activation modes."""
    import pysmoe

    d = _vault(vaults, name)
    cfg = json.loads((d / "config.json").read_text())
    ids = [int(i) for i in np.random.default_rng(5).integers(0, cfg["vocab_size"], 17)]
    out = {}
    with pysmoe.open_vault(d) as v:
        for mode in ("layer-major", "token-serial"):
            with v.session(threads=2, chunk=5, activations=activations, prefill=mode) as s:
                first = s.prefill(ids)
                out[mode] = np.concatenate([first, s.decode(ids[0])])
    assert out["layer-major"].tobytes() == out["token-serial"].tobytes()


@pytest.mark.parametrize("name", ["k256-q4_k_m", "k256-iq4_xs", "olmoe-q8_0"])
def test_an_imported_mix_runs_on_the_gpu(name, vaults):
    """llama.cpp's files on device="cuda" (skipped without a GPU): within test_cuda's ATOL/RTOL of
    the CPU's f32-activation logits (flash attention's RTOL_F16 for head sizes 32/64/128), and
    layer-major in chunks of 5 = token-serial bit for bit on the GPU."""
    import pysmoe
    from pysmoe.errors import Unsupported
    from test_cuda import ATOL, RTOL, RTOL_F16

    d = _vault(vaults, name)
    cfg = json.loads((d / "config.json").read_text())
    ids = [int(i) for i in np.random.default_rng(5).integers(0, cfg["vocab_size"], 17)]
    out = {}
    with pysmoe.open_vault(d) as v:
        try:
            v.session(device="cuda").close()
        except Unsupported as e:
            pytest.skip(f"no CUDA here: {e}")
        for dev, mode in (("cpu", "layer-major"), ("cuda", "layer-major"), ("cuda", "token-serial")):
            with v.session(device=dev, chunk=5, activations="f32", prefill=mode) as s:
                first = s.prefill(ids)
                out[dev, mode] = np.stack([first, s.decode(ids[0])])
    gpu, cpu = out["cuda", "token-serial"], out["cpu", "layer-major"]
    assert out["cuda", "layer-major"].tobytes() == gpu.tobytes()
    rtol = RTOL_F16 if cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]) in (32, 64, 128) else RTOL
    err, top = float(np.max(np.abs(gpu - cpu))), float(np.max(np.abs(cpu)))
    print(f"{name}: max|gpu - cpu| / max|logit| = {err / top:.3g}")
    assert err <= ATOL + rtol * top, (name, err, top)


def test_a_truncated_file_is_refused(tmp_path):
    f = tmp_path / "cut.gguf"
    data = (DATA / "tiny-q8_0.gguf").read_bytes()
    for n in (len(data) - 1000, 5000, 40):
        f.write_bytes(data[:n])
        with pytest.raises(ConvertError, match="truncated|not a readable GGUF"):
            convert_checkpoint(f, tmp_path / "v", progress=False)
    assert not (tmp_path / "v").exists()


def test_info_names_every_layers_expert_types(vaults, capsys):
    """`pysmoe info` on an imported Q4_K_M lists ffn_down's type in every layer (Q5_0 in layers
    0-1, Q8_0 in 2-3 in the fixture: llama.cpp's fallbacks for rows of 128)."""
    from pysmoe.vaultio import info

    d = _vault(vaults, "k256-q4_k_m")
    downs = {t.tensor_type.name for t in gguf.GGUFReader(DATA / "k256-q4_k_m.gguf").tensors
             if "ffn_down_exps" in t.name}
    assert len(downs) > 1
    line = next(x for x in info(d).splitlines() if x.startswith("experts") and "down" in x)
    assert set(line.split("down ")[1].split(",")[0].split("+")) == downs


def test_corrupt_headers_give_a_convert_error_or_a_vault(tmp_path):
    """Bytes changed at random in the header, metadata and tensor table of a llama.cpp file:
    every attempt either converts or raises ConvertError (never another exception), and a failed
    one leaves nothing behind."""
    data = (DATA / "tiny-q8_0.gguf").read_bytes()
    rng = np.random.default_rng(7)
    f = tmp_path / "x.gguf"
    for i in range(60):
        b = bytearray(data)
        for _ in range(int(rng.integers(1, 4))):
            b[int(rng.integers(0, 12000))] = int(rng.integers(0, 256))
        f.write_bytes(bytes(b))
        out = tmp_path / f"v{i}"
        try:
            convert_checkpoint(f, out, progress=False)
        except ConvertError:
            assert not out.exists()
