"""Synthetic vaults: random Qwen3-MoE models of any shape, for tests and benchmarks.

    pysmoe.synth("/tmp/v", preset="tiny", seed=0)
    python -m pysmoe synth /tmp/a3b --preset a3b

The weights are random but scaled so that a forward pass stays finite and every part of the
model matters: weights have std gain/sqrt(fan_in) (GPT-2's 1/sqrt(2·layers) on the projections
that feed the residual stream, so it grows slowly through the layers); norms are near 1; router
rows have a larger spread so that top-k is a clear choice rather than a near-tie.

Speed: an a3b vault holds ~16 GB of expert blobs and 1.5 G dense weights, so q4 and q8 tensors
are never generated as floats. Their codes are random bytes straight from the generator (codes
uniform on 0..15 have std sqrt(255/12)), the scales are one value per matrix with a little
jitter, and bias = −7.5·scale (−127.5·scale for q8) makes the weights zero-mean; an expert blob
is assembled in numpy and written whole. bf16 and f32 tensors (the f32 vaults of the tests) and
the norms and routers go through floats.

Every tensor and every expert draws from its own generator seeded by (seed, what, where), so the
result does not depend on the order they are written in, and one seed gives identical bytes.
"""
from __future__ import annotations

import concurrent.futures as cf
import math
import pathlib
import time
import zlib

import numpy as np

from . import quant
from .progress import Progress
from .tokenizer import build_synthetic_tokenizer, synthetic_tokenizer_config
from .vaultio import VaultWriter, role_of

_COMMON = dict(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False,
               rms_norm_eps=1e-6, rope_theta=1e6, model_type="qwen3_moe",
               architectures=["Qwen3MoeForCausalLM"])

PRESETS = {
    # Tests: every feature of the format at a size that builds in milliseconds. head_dim 32 is
    # not hidden/heads on purpose, layer 2 is a dense MLP layer.
    "tiny": dict(_COMMON, vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, intermediate_size=128, moe_intermediate_size=64,
                 num_experts=16, num_experts_per_tok=4, max_position_embeddings=4096, mlp_only_layers=[2]),
    # Benchmarks that fit CI: 18 × 64 blobs of 864 KiB, about 1 GB of experts.
    "mini": dict(_COMMON, vocab_size=32000, hidden_size=1024, num_hidden_layers=18, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=64, intermediate_size=2816, moe_intermediate_size=512,
                 num_experts=64, num_experts_per_tok=8, max_position_embeddings=4096),
    # Qwen3-30B-A3B.
    "a3b": dict(_COMMON, vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                num_experts=128, num_experts_per_tok=8, max_position_embeddings=40960),
    # Qwen3-235B-A22B.
    "a22b": dict(_COMMON, vocab_size=151936, hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                 num_key_value_heads=4, head_dim=128, intermediate_size=12288, moe_intermediate_size=1536,
                 num_experts=128, num_experts_per_tok=8, max_position_embeddings=40960),
}

EXPERT_FORMATS = ("q4", "q8", "bf16", "f32")
SCALE_JITTER = 0.1                           # scales vary ±5% around the matrix's own
ROUTER_GAIN = 2.0                            # router logits of std ~2 for a unit-rms input
LM_HEAD_GAIN = 2.0
NORM_SPREAD = 0.1                            # norm weights uniform in 1 ± 0.05·sqrt(3)·2


# ----------------------------------------------------------------------------------- seeding

_KIND_DENSE, _KIND_EXPERT = 0, 1


def _rng(seed: int, kind: int, *where: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, kind, *where])))


def _uniform(rng: np.random.Generator, shape, std: float, mean: float = 0.0) -> np.ndarray:
    """Uniform floats of this std: a fast stand-in for a Gaussian that quantises the same."""
    a = np.float32(std * math.sqrt(3.0))
    x = rng.random(shape, dtype=np.float32)
    x *= 2 * a
    x += np.float32(mean) - a
    return x


# ---------------------------------------------------------------------------------- routings
#
# A routing mode decides the router weights of a sparse layer. "uniform": every expert equally
# likely over random inputs. (A "realistic" mode, with popular experts and routing that
# correlates between neighbouring tokens, is another issue; it plugs in here.)

def _router_uniform(cfg: dict, layer: int, rng: np.random.Generator) -> np.ndarray:
    h = cfg["hidden_size"]
    return _uniform(rng, (cfg["num_experts"], h), ROUTER_GAIN / math.sqrt(h))


ROUTINGS = {"uniform": _router_uniform}


# ------------------------------------------------------------------------------------- dense

def _dense_std(cfg: dict, name: str, cols: int) -> float:
    """Std of a dense matrix's weights (not norms, not routers)."""
    role = role_of(name)
    if role == "embed":
        return 1.0
    if name.endswith(("o_proj", "down_proj")):
        return 1.0 / math.sqrt(2 * cfg["num_hidden_layers"]) / math.sqrt(cols)
    return (LM_HEAD_GAIN if role == "lm_head" else 1.0) / math.sqrt(cols)


def _write_dense(writer: VaultWriter, name: str, rng: np.random.Generator, routing: str) -> None:
    cfg, t = writer.config, writer.layout.tensors[name]
    role = role_of(name)
    if role == "norms":
        writer.add_dense(name, _uniform(rng, (t.cols,), NORM_SPREAD, mean=1.0))
    elif role == "router":
        writer.add_dense(name, ROUTINGS[routing](cfg, int(name.split(".")[1]), rng))
    elif quant.is_quantized(t.format):
        # As for experts, q4/q8 matrices are drawn as codes: an a3b has 1.5 G dense weights.
        buf = np.zeros(t.nbytes, dtype=np.uint8)
        _random_codes(buf, t, _dense_std(cfg, name, t.cols), rng, writer.scale_dtype)
        writer.add_dense_raw(name, buf)
    else:
        writer.add_dense(name, _uniform(rng, (t.rows, t.cols), _dense_std(cfg, name, t.cols)))


# ------------------------------------------------------------------------------------ experts

def expert_stds(cfg: dict) -> tuple[float, float, float]:
    """Intended std of an expert's gate, up and down weights."""
    h, m = cfg["hidden_size"], cfg["moe_intermediate_size"]
    down = 1.0 / math.sqrt(2 * cfg["num_hidden_layers"]) / math.sqrt(m)
    return 1.0 / math.sqrt(h), 1.0 / math.sqrt(h), down


def _random_codes(out: np.ndarray, t, std: float, rng: np.random.Generator, scale_dtype: str) -> None:
    """Fill out (t.nbytes bytes) with a random q4/q8 tensor of zero mean and this std, drawn
    as codes: no float weight is ever made."""
    bits = 4 if t.format == "q4" else 8
    levels = (1 << bits) - 1
    ncodes, soff, boff, _ = quant.parts(t.format, t.rows, t.cols)
    # Full-range u64 draws are the generator's raw output: the fastest random bytes numpy has.
    out[:ncodes] = rng.integers(0, 2 ** 64 - 1, ncodes // 8, dtype=np.uint64, endpoint=True).view(np.uint8)
    groups = t.rows * (t.cols // quant.GROUP)
    code_std = math.sqrt(((levels + 1) ** 2 - 1) / 12)  # of a code uniform on 0..levels
    s = np.float32(std / code_std) * (1 + SCALE_JITTER * (rng.random(groups, dtype=np.float32) - 0.5))
    s_bits, s_val = quant._round_to(s.astype(np.float32), scale_dtype)
    b_bits, _ = quant._round_to(np.float32(-levels / 2) * s_val, scale_dtype)
    out[soff:soff + 2 * groups] = s_bits.astype("<u2").view(np.uint8)
    out[boff:boff + 2 * groups] = b_bits.astype("<u2").view(np.uint8)


def _coded_blob(writer: VaultWriter, rng: np.random.Generator, stds) -> np.ndarray:
    """One q4 or q8 expert blob of random codes."""
    last = writer.layout.expert[-1]
    blob = np.zeros(last.offset + last.nbytes, dtype=np.uint8)
    for t, std in zip(writer.layout.expert, stds):
        _random_codes(blob[t.offset:t.offset + t.nbytes], t, std, rng, writer.scale_dtype)
    return blob


def _float_expert(cfg: dict, rng: np.random.Generator, stds):
    h, m = cfg["hidden_size"], cfg["moe_intermediate_size"]
    return (_uniform(rng, (m, h), stds[0]), _uniform(rng, (m, h), stds[1]), _uniform(rng, (h, m), stds[2]))


# -------------------------------------------------------------------------------------- synth

def preset_config(preset: str, layers: int | None = None, overrides: dict | None = None) -> dict:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (one of {', '.join(PRESETS)})")
    cfg = dict(PRESETS[preset])
    cfg["mlp_only_layers"] = list(cfg["mlp_only_layers"])
    cfg.update(overrides or {})
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        layers = min(layers, cfg["num_hidden_layers"])
        cfg["num_hidden_layers"] = layers
        cfg["mlp_only_layers"] = [l for l in cfg["mlp_only_layers"] if l < layers]
    return cfg


def synth(path, preset: str = "tiny", seed: int = 0, layers: int | None = None, experts: str = "q4",
          routing: str = "uniform", progress: bool = True, *, formats: dict | None = None,
          overrides: dict | None = None, scale_dtype: str = "f16") -> pathlib.Path:
    """Write a random vault to directory path and return it.

    preset: a key of PRESETS; layers truncates it; experts: the expert format; routing: only
    "uniform" so far. formats sets other roles' formats (docs: vaultio.DEFAULT_FORMATS);
    overrides replaces config fields (e.g. {"tie_word_embeddings": True}).
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing {routing!r} is not implemented (available: {', '.join(ROUTINGS)})")
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"expert format {experts!r} is not one of {', '.join(EXPERT_FORMATS)}")
    cfg = preset_config(preset, layers, overrides)
    path = pathlib.Path(path)
    fmts = dict(formats or {}, experts=experts)
    tok_json = build_synthetic_tokenizer(cfg["vocab_size"])
    writer = VaultWriter(path, cfg, formats=fmts, scale_dtype=scale_dtype, tokenizer_json=tok_json,
                         tokenizer_config=synthetic_tokenizer_config())
    with writer:
        cfg = writer.config
        lay = writer.layout
        dense_total = sum(t.rows * t.cols for t in lay.tensors.values())
        with Progress(dense_total, f"{path.name}: dense", unit="weights", enabled=progress) as bar:
            for name, t in lay.tensors.items():
                rng = _rng(seed, _KIND_DENSE, zlib.crc32(name.encode()))
                _write_dense(writer, name, rng, routing)
                bar.update(t.rows * t.cols)
        _write_experts(writer, seed, progress, path.name)
    return path


def _write_experts(writer: VaultWriter, seed: int, progress: bool, label: str) -> None:
    cfg, lay = writer.config, writer.layout
    todo = [(l, e) for l in writer.sparse_layers() for e in range(cfg["num_experts"])]
    if not todo:
        return
    stds = expert_stds(cfg)
    coded = quant.is_quantized(writer.expert_format())
    # Generation holds the GIL; crc32 and pwrite release it, so one writer thread overlaps them.
    with Progress(len(todo) * lay.blob_bytes, f"{label}: experts", unit="B", enabled=progress) as bar, \
            cf.ThreadPoolExecutor(max_workers=1) as pool:
        pending: list[cf.Future] = []
        for l, e in todo:
            rng = _rng(seed, _KIND_EXPERT, l, e)
            if coded:
                blob = _coded_blob(writer, rng, stds)
            else:
                blob = writer.pack_expert(*_float_expert(cfg, rng, stds))
            pending.append(pool.submit(writer.add_expert_raw, l, e, blob))
            if len(pending) >= 4:
                pending.pop(0).result()
                bar.update(lay.blob_bytes)
        for f in pending:
            f.result()
            bar.update(lay.blob_bytes)


# ---------------------------------------------------------------------------------------- CLI

def add_parser(parser, name: str = "synth"):
    """Add synth's arguments to parser (pysmoe.cli passes the subcommand's own parser); given
    the subparsers object of an ArgumentParser instead, make the subcommand first."""
    if hasattr(parser, "add_parser"):
        parser = parser.add_parser(name, help="write a random vault of a preset shape",
                                   description="Write a random Qwen3-MoE vault (for tests and benchmarks).")
    p = parser
    p.add_argument("out", help="vault directory to write")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model shape (default tiny)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    p.add_argument("--experts", default="q4", choices=EXPERT_FORMATS, help="expert format (default q4)")
    p.add_argument("--routing", default="uniform", choices=sorted(ROUTINGS))
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    t0 = time.monotonic()
    out = synth(args.out, preset=args.preset, seed=args.seed, layers=args.layers, experts=args.experts,
                routing=args.routing, progress=not args.quiet)
    size = (out / "vault.bin").stat().st_size
    print(f"wrote {out} ({size / 2 ** 20:,.1f} MiB) in {time.monotonic() - t0:.1f} s")
    return 0
