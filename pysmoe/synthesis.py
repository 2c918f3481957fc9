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

Routing (docs/synth.md): "uniform" random routers, or "realistic": popular experts and
neighbouring tokens sharing experts (≈45% and a top-20% share of ≈0.5 over long prompts by
default), built into the embedding, the routers, the lm_head and zero rows of the residual
writers, so that the engine's exact routing produces it.

Every tensor and every expert draws from its own generator seeded by (seed, what, where), so the
result does not depend on the order they are written in, and one seed gives identical bytes.
"""
from __future__ import annotations

import concurrent.futures as cf
import math
import pathlib
import zlib

import numpy as np

from . import ggml_blocks, quant
from .progress import Progress
from .tokenizer import build_synthetic_tokenizer, synthetic_tokenizer_config
from .vaultdir import staged
from .vaultio import VaultWriter, compute_layout, role_of

_COMMON = dict(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False,
               rms_norm_eps=1e-6, rope_theta=1e6, model_type="qwen3_moe",
               architectures=["Qwen3MoeForCausalLM"])

# The Qwen3.5-MoE line (model_type qwen3_5_moe, docs/hybrid.md): every layer sparse with a gated
# shared expert, full attention every 4th layer, partial RoPE over a quarter of each head.
_HYBRID = dict(_COMMON, model_type="qwen3_5_moe", architectures=["Qwen3_5MoeForCausalLM"], rope_theta=1e7,
               max_position_embeddings=262144, full_attention_interval=4, partial_rotary_factor=0.25,
               linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128)

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
    # Qwen3.6-35B-A3B (= Qwen3.5-35B-A3B's shapes): 40 layers, 3 Gated DeltaNet to 1 gated attention,
    # a shared expert beside 8 of 256 routed ones.
    "qwen3.6-35b-a3b": dict(_HYBRID, vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
                            num_attention_heads=16, num_key_value_heads=2, head_dim=256, moe_intermediate_size=512,
                            shared_expert_intermediate_size=512, intermediate_size=512, num_experts=256,
                            num_experts_per_tok=8, linear_num_key_heads=16, linear_num_value_heads=32),
    # Qwen3.5-397B-A17B: 60 layers, 10 of 512 experts; cut it with `--layers`.
    "qwen3.5-397b-a17b": dict(_HYBRID, vocab_size=248320, hidden_size=4096, num_hidden_layers=60,
                              num_attention_heads=32, num_key_value_heads=2, head_dim=256, moe_intermediate_size=1024,
                              shared_expert_intermediate_size=1024, intermediate_size=1024, num_experts=512,
                              num_experts_per_tok=10, linear_num_key_heads=16, linear_num_value_heads=64),
    # GLM-4.5 family (glm4_moe): sigmoid router with e_score_correction_bias, group-limited choice,
    # a shared expert, the first layer dense, partial RoPE, q/k/v biases. tiny-glm for tests.
    "tiny-glm": dict(_COMMON, model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], vocab_size=512,
                     hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     intermediate_size=128, moe_intermediate_size=64, num_experts=16, num_experts_per_tok=4,
                     max_position_embeddings=4096, mlp_only_layers=[0], first_k_dense_replace=1, n_shared_experts=1,
                     n_group=4, topk_group=2, routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=False,
                     partial_rotary_factor=0.5),
    # GLM-4.5-Air (106B total, 12B active): its config.json's shape.
    "glm-4.5-air": dict(_COMMON, model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], vocab_size=151552,
                        hidden_size=4096, num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8,
                        head_dim=128, intermediate_size=10944, moe_intermediate_size=1408, num_experts=128,
                        num_experts_per_tok=8, max_position_embeddings=131072, mlp_only_layers=[0],
                        first_k_dense_replace=1, n_shared_experts=1, n_group=1, topk_group=1,
                        routed_scaling_factor=1.0, attention_bias=True, use_qk_norm=False, partial_rotary_factor=0.5,
                        rms_norm_eps=1e-5),
}

# gpt-oss-20b and -120b (openai/gpt-oss-*'s config.json): every layer sparse, sliding-window
# (128) layers alternating with full ones, YaRN ×32 over 4,096 positions, biases, attention sinks.
# Their experts are released in MXFP4: `--experts MXFP4` is the released size.
_GPT_OSS = dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], vocab_size=201088, hidden_size=2880,
                intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
                rope_theta=150000.0, tie_word_embeddings=False, attention_bias=True, swiglu_limit=7.0,
                rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
                decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False)
PRESETS["gpt-oss-20b"] = dict(_GPT_OSS, num_hidden_layers=24, num_experts=32)
# Tests: gpt-oss's recipe at the tiny preset's size (windows of 8, YaRN ×4 over 64 positions).
PRESETS["gpt-oss-tiny"] = dict(_GPT_OSS, vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=16,
                               sliding_window=8, max_position_embeddings=4096,
                               rope_parameters=dict(_GPT_OSS["rope_parameters"], factor=4.0,
                                                    original_max_position_embeddings=64))
PRESETS["gpt-oss-120b"] = dict(_GPT_OSS, num_hidden_layers=36, num_experts=128)
BIAS_STD = 0.02                              # biases and attention sinks (gpt-oss): small, around 0

EXPERT_FORMATS = ("q4", "q8", "bf16", "f32") + tuple(ggml_blocks.FORMATS)  # GGML: random blocks
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
# A routing mode decides the router weights of a sparse layer and may shape the rest of the
# model so that the routing the engine computes has the statistics it wants. "uniform": every
# expert equally likely over random inputs, neighbouring tokens unrelated. "realistic": popular
# experts and locality between neighbouring tokens, as in a trained Qwen3 model (docs/synth.md).

def _router_uniform(cfg: dict, layer: int, rng: np.random.Generator) -> np.ndarray:
    h = cfg["hidden_size"]
    return _uniform(rng, (cfg["num_experts"], h), ROUTER_GAIN / math.sqrt(h))


class UniformRouting:
    """Random router rows; nothing else changes (the bytes of the original synth)."""

    def __init__(self, cfg: dict, seed: int, knobs: dict):
        self.cfg = cfg

    def router(self, layer: int, rng: np.random.Generator) -> np.ndarray:
        return _router_uniform(self.cfg, layer, rng)

    reserved = 0                   # leading residual channels no layer writes into

    def shape_columns(self, name: str) -> int:
        return 0                   # leading columns of a dense matrix this mode fills itself

    def fill_columns(self, name: str, block: np.ndarray, rng: np.random.Generator) -> None:
        pass

    def zero_rows(self, name: str) -> int:
        return 0                   # leading rows of a dense matrix that must be zero


# The realistic mode's knobs and their defaults (docs/synth.md says what each does).
REALISTIC_DEFAULTS = dict(
    overlap=0.45,        # target adjacent-token expert overlap, per layer
    top20_share=0.5,     # target share of routings taken by a layer's 20% most-used experts
    stay=0.9,            # P(the next sampled token keeps the current one's topic) at temperature
    temperature=0.8,     # ... this one (coherent_prompt's)
    topics=None,         # topic count: min(64, hidden/16, vocab/8), at least 2
    specific_dims=None,  # token-specific routing channels: max(16, topics)
)
_CAL_POPULATION = 8192   # calibration tokens, all topics equally often (the stationary mix)
_TOPIC_VALUE = 2.0       # embedding value of a token's topic channel
_BIAS_VALUE = 1.0        # embedding value of the shared channel (every token)
FINAL_RMS_GUESS = 1.05   # rms of the last residual state (measured 1.04 mini, 1.08 tiny)


def realistic_layout(cfg: dict, topics: int | None = None, specific_dims: int | None = None) -> dict:
    """Where the realistic mode's routing channels sit in the residual stream."""
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    t = topics if topics is not None else max(2, min(64, h // 16, vocab // 8))
    s = specific_dims if specific_dims is not None else max(16, t)
    if t < 1 or s < 1 or 1 + t + s > h // 2:
        raise ValueError(f"realistic routing: 1 + topics ({t}) + specific_dims ({s}) must be at most "
                         f"hidden_size/2 = {h // 2}")
    if t > vocab:
        raise ValueError(f"realistic routing: more topics ({t}) than tokens ({vocab})")
    return dict(topics=t, specific=s, bias_ch=0, topic_ch=1, spec_ch=1 + t, reserved=1 + t + s)


def topic_of(ids, vocab: int, topics: int) -> np.ndarray:
    """Topic of each token id: contiguous blocks of ids share one (docs/synth.md)."""
    return (np.asarray(ids, dtype=np.int64) * topics) // vocab


def _route_mask(z: np.ndarray, k: int) -> np.ndarray:
    """(..., E) logits -> (..., E) bool, True for each token's top k."""
    top = np.argpartition(-z, k - 1, axis=-1)[..., :k]
    m = np.zeros(z.shape, dtype=bool)
    np.put_along_axis(m, top, True, axis=-1)
    return m


def _logits(beta, topical, specific, lam: float, pop: float) -> np.ndarray:
    z = np.float32(lam) * topical + np.float32(math.sqrt(max(0.0, 1 - lam * lam))) * specific
    z += np.float32(pop) * beta
    return z


class _Population:
    """What the targets are defined on: the tokens of an endless coherent prompt, for one
    layer's draws (beta, alpha, nu). Its topic chain (keep the topic with probability stay,
    else jump to another) visits every topic equally often in the long run, so the sample is
    stratified: ceil(tokens/topics) token-specific draws xi for every topic.

    overlap: stay·(overlap of two tokens of one topic) + (1 − stay)·(two tokens of different
    topics), which is the adjacent-pair mean of such a prompt; top-20% share: of the sample's
    expert counts. With 8192 tokens the counts are large enough (≥ 512 per expert for 128
    experts, top-8) that finite counts add < 0.005 to the share; a finite prompt reads more
    (simulate_prompts, docs/synth.md)."""

    def __init__(self, beta, alpha, nu, k: int, stay: float, rng: np.random.Generator,
                 tokens: int = _CAL_POPULATION):
        T, E = alpha.shape
        S = nu.shape[1]
        M = max(2, -(-tokens // T))
        xi = rng.standard_normal((T, M, S), dtype=np.float32)
        self.beta, self.k, self.stay, self.T = beta, k, stay, T
        self.topical = alpha[:, None, :]                                       # (T, 1, E)
        self.specific = (xi @ nu.T) / np.float32(math.sqrt(S))                 # (T, M, E)
        # a partner of another topic for every token: row t, column j -> topic t + 1..T-1
        self.other = (np.arange(T)[:, None] + 1 + rng.integers(max(T - 1, 1), size=M)[None, :]) % T
        self.cols = np.arange(M)[None, :]

    def stats(self, lam: float, pop: float) -> tuple[float, float]:
        """(overlap, top-20% share) of the logit model with these (lam, pop)."""
        m = _route_mask(_logits(self.beta, self.topical, self.specific, lam, pop), self.k)
        same = (m[:, 1:] & m[:, :-1]).sum(-1).mean() / self.k
        if self.T > 1:
            diff = (m & m[self.other, self.cols]).sum(-1).mean() / self.k
            overlap = self.stay * same + (1 - self.stay) * diff
        else:
            overlap = same
        return float(overlap), float(top_share(m.sum((0, 1)).astype(np.float64)))


def topic_chain(T: int, tokens: int, seqs: int, stay: float, rng: np.random.Generator) -> np.ndarray:
    """(seqs, tokens) topics of coherent prompts: a random first topic, then each token keeps
    the topic with probability stay, else jumps to one of the other T − 1 (as the lm_head
    makes the model do)."""
    out = np.empty((seqs, tokens), dtype=np.int64)
    for s in range(seqs):
        t = int(rng.integers(T))
        for i in range(tokens):
            if i and T > 1 and rng.random() >= stay:
                t = (t + 1 + int(rng.integers(T - 1))) % T
            out[s, i] = t
    return out


def simulate_prompts(beta, alpha, nu, k: int, lam: float, pop: float, stay: float, tokens: int,
                     seqs: int, rng: np.random.Generator) -> dict:
    """What routing_stats would read on coherent prompts of this many tokens, for one layer's
    draws and (lam, pop): overlap and top-20% share per prompt (mean and std over seqs
    prompts). A short prompt's share is above the population's: it visits few topics, and its
    counts are small (docs/synth.md)."""
    S = nu.shape[1]
    ch = topic_chain(alpha.shape[0], tokens, seqs, stay, rng)
    xi = rng.standard_normal((seqs, tokens, S), dtype=np.float32)
    m = _route_mask(_logits(beta, alpha[ch], (xi @ nu.T) / np.float32(math.sqrt(S)), lam, pop), k)
    ov = (m[:, 1:] & m[:, :-1]).sum(-1).mean(-1) / k
    sh = top_share(m.sum(1).astype(np.float64), axis=-1)
    return {"tokens": tokens, "overlap": float(ov.mean()), "top20_share": float(sh.mean()),
            "top20_share_std": float(sh.std())}


def top_share(counts, frac: float = 0.2, axis: int = -1):
    """Share of the total taken by the largest frac of the entries (fractional at the edge:
    0.2 of 128 experts is the top 25 plus 0.6 of the 26th)."""
    c = -np.sort(-np.asarray(counts, dtype=np.float64), axis=axis)
    n = c.shape[axis]
    q = frac * n
    f = int(math.floor(q))
    c = np.moveaxis(c, axis, -1)
    top = c[..., :f].sum(-1) + ((q - f) * c[..., f] if f < n else 0.0)
    return top / np.maximum(c.sum(-1), 1e-30)


def calibrate(beta, alpha, nu, k: int, overlap: float, share: float, stay: float,
              rng: np.random.Generator, start: tuple[float, float] | None = None) -> tuple[float, float]:
    """(lam, pop) for which the logit model of one layer gives this overlap and top-20% share
    in the population of coherent tokens (_Population: the share of an endless prompt, not of
    a finite one). Common random numbers, alternating bisections: ~10 ms per step for a3b."""
    popn = _Population(beta, alpha, nu, k, stay, rng)

    def solve(f, target, lo, hi, steps=12):
        for _ in range(steps):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
        return 0.5 * (lo + hi)

    if start is None:      # from scratch: wide brackets (settled after two rounds on every preset)
        lam, pop = 0.7, 0.7
        for _ in range(3):
            pop = solve(lambda p: popn.stats(lam, p)[1], share, 0.0, 4.0)
            lam = solve(lambda l: popn.stats(l, pop)[0], overlap, 0.0, 1.0)
        return lam, pop
    lam, pop = start       # refining a nearby solution: narrow brackets, fewer steps
    for _ in range(2):
        pop = solve(lambda p: popn.stats(lam, p)[1], share, max(0.0, pop - 0.3), pop + 0.3, steps=7)
        lam = solve(lambda l: popn.stats(l, pop)[0], overlap, max(0.0, lam - 0.15), min(1.0, lam + 0.15),
                    steps=7)
    return lam, pop


class RealisticRouting:
    """Popular experts and locality between neighbours, reached through the weights.

    The residual stream reserves its first channels for routing: channel 0 carries a constant
    (every token), channels 1..topics a one-hot topic (tokens in contiguous id blocks share
    one), the next specific_dims channels a token-specific Gaussian. No layer writes into them
    (those rows of o_proj, the dense MLPs' and the experts' down_proj are zero), so every
    layer's router sees them exactly as the embedding put them, up to RMSNorm's scale, which
    top-k ignores. Router row e reads only them: pop·beta_e from the constant (popularity),
    lam·alpha_e[topic] from the topic channels (locality), sqrt(1-lam²)·nu_e·xi from the
    specific channels; (lam, pop) are solved on a sample of this logit model's population of
    coherent tokens (_Population) for the target overlap and share, the share of an endless
    prompt: once per vault, then refined on each layer's draws. A finite prompt reads a higher
    share (expected_stats). lm_head adds a logit to the tokens of the current token's topic,
    sized so that sampling at `temperature` keeps the topic with probability `stay`: the model
    writes topic-coherent text, which is what coherent_prompt samples.
    """

    def __init__(self, cfg: dict, seed: int, knobs: dict):
        unknown = set(knobs) - set(REALISTIC_DEFAULTS)
        if unknown:
            raise ValueError(f"unknown realistic-routing knob(s): {', '.join(sorted(unknown))}")
        kn = dict(REALISTIC_DEFAULTS, **{k: v for k, v in knobs.items() if v is not None})
        E, k = cfg["num_experts"], cfg["num_experts_per_tok"]
        if not (0 < kn["overlap"] < 1):
            raise ValueError(f"overlap must lie in (0, 1), got {kn['overlap']}")
        if not (0.2 <= kn["top20_share"] < 1):
            raise ValueError(f"top20_share must lie in [0.2, 1), got {kn['top20_share']}")
        if not (0 < kn["stay"] < 1) or kn["temperature"] <= 0:
            raise ValueError("stay must lie in (0, 1) and temperature be > 0")
        self.cfg, self.seed, self.knobs = cfg, seed, kn
        self.lay = realistic_layout(cfg, kn["topics"], kn["specific_dims"])
        self.reserved = self.lay["reserved"]
        self.calibration: tuple[float, float] | None = None
        self.layer_calibration: dict[int, tuple[float, float]] = {}
        T = self.lay["topics"]
        # logit advantage of the current topic's tokens: exp(d/temp)/(exp(d/temp) + T - 1) = stay
        self.topic_logit = kn["temperature"] * math.log(kn["stay"] / (1 - kn["stay"]) * max(T - 1, 1))

    def _norm(self, name: str) -> np.ndarray:
        """The norm weights synth writes for name (their own generator, drawn again here)."""
        rng = _rng(self.seed, _KIND_DENSE, zlib.crc32(name.encode()))
        return _uniform(rng, (self.cfg["hidden_size"],), NORM_SPREAD, mean=1.0)

    def _draws(self, rng: np.random.Generator):
        E, T, S = self.cfg["num_experts"], self.lay["topics"], self.lay["specific"]
        beta = rng.standard_normal(E)
        beta = ((beta - beta.mean()) / beta.std()).astype(np.float32)
        return beta, rng.standard_normal((T, E)).astype(np.float32), rng.standard_normal((E, S)).astype(np.float32)

    def solve(self) -> tuple[float, float]:
        """(lam, pop) for the targets, solved once per vault on draws of its own (every
        layer's draws have the same distribution; ~1 s for a3b)."""
        if self.calibration is None:
            kn = self.knobs
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, 7])))
            self.calibration = calibrate(*self._draws(rng), self.cfg["num_experts_per_tok"], kn["overlap"],
                                         kn["top20_share"], kn["stay"], rng)
        return self.calibration

    def expected_stats(self, tokens: int, seqs: int = 16) -> dict:
        """What routing_stats should read on this vault's coherent prompts of `tokens` tokens:
        the logit model with the vault's own draws and (lam, pop), on seqs simulated prompts
        (simulate_prompts; the mean over them, and the share's std from prompt to prompt).
        population_share is the target the calibration reached, the share of an endless prompt."""
        kn, k = self.knobs, self.cfg["num_experts_per_tok"]
        lam, pop = self.solve()
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, 7])))
        draws = self._draws(rng)
        out = simulate_prompts(*draws, k, lam, pop, kn["stay"], tokens, seqs,
                               np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, 8, tokens]))))
        out["population_share"] = _Population(*draws, k, kn["stay"], rng).stats(lam, pop)[1]
        return out

    def router(self, layer: int, rng: np.random.Generator) -> np.ndarray:
        cfg, lay, kn = self.cfg, self.lay, self.knobs
        E, k, h = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["hidden_size"]
        T, S = lay["topics"], lay["specific"]
        beta, alpha, nu = self._draws(rng)
        # Refine the vault's solution on this layer's own draws: with few experts or topics
        # (tiny: 16 and 4) one draw's popularity differs enough from another's to matter.
        kn = self.knobs
        lam, pop = calibrate(beta, alpha, nu, k, kn["overlap"], kn["top20_share"], kn["stay"],
                             np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, 7, layer]))),
                             start=self.solve())
        self.layer_calibration[layer] = (lam, pop)
        w = np.zeros((E, h), dtype=np.float32)
        w[:, lay["bias_ch"]] = pop * beta / _BIAS_VALUE
        w[:, lay["topic_ch"]:lay["topic_ch"] + T] = lam * alpha.T / _TOPIC_VALUE
        w[:, lay["spec_ch"]:lay["spec_ch"] + S] = math.sqrt(max(0.0, 1 - lam * lam)) * nu / math.sqrt(S)
        # The router reads rmsnorm(x)·post_attention_layernorm: undo the norm's weights.
        w[:, :self.reserved] /= self._norm(f"layers.{layer}.post_attention_layernorm")[None, :self.reserved]
        return w * np.float32(ROUTER_GAIN)

    def shape_columns(self, name: str) -> int:
        role = role_of(name)
        return self.reserved if role in ("embed", "lm_head") else 0

    def fill_columns(self, name: str, block: np.ndarray, rng: np.random.Generator) -> None:
        """block: the first shape_columns(name) columns of a (vocab, hidden) matrix, random."""
        lay, vocab = self.lay, self.cfg["vocab_size"]
        T, S = lay["topics"], lay["specific"]
        topic = topic_of(np.arange(vocab), vocab, T)
        rows = np.arange(vocab)
        if role_of(name) == "embed":
            block[:, :lay["spec_ch"]] = 0
            block[:, lay["bias_ch"]] = _BIAS_VALUE
            block[rows, lay["topic_ch"] + topic] = _TOPIC_VALUE
            block[:, lay["spec_ch"]:lay["spec_ch"] + S] = rng.standard_normal((vocab, S), dtype=np.float32)
        else:  # lm_head: the current topic's tokens gain topic_logit (final norm undone)
            block[:, lay["topic_ch"]:lay["topic_ch"] + T] *= np.float32(0.0)
            g = self._norm("norm")[lay["topic_ch"]:lay["topic_ch"] + T]
            block[rows, lay["topic_ch"] + topic] = (self.topic_logit * FINAL_RMS_GUESS / _TOPIC_VALUE / g[topic])

    def zero_rows(self, name: str) -> int:
        """Leading rows of a dense matrix that must be zero: the residual writers."""
        return self.reserved if name.endswith(("o_proj", "down_proj", "linear.out")) else 0


ROUTINGS = {"uniform": UniformRouting, "realistic": RealisticRouting}


def expected_stats(preset: str, tokens: int, seed: int = 0, seqs: int = 16, overrides: dict | None = None,
                   **knobs) -> dict:
    """What `info --routing-stats --tokens N` should read on `synth(preset=..., routing=
    "realistic", seed=..., **knobs)` (RealisticRouting.expected_stats; no vault is written)."""
    knobs = {k: v for k, v in knobs.items() if v is not None}
    return RealisticRouting(preset_config(preset, None, overrides), seed, knobs).expected_stats(tokens, seqs)


# ------------------------------------------------------------------------------------- dense

def _dense_std(cfg: dict, name: str, cols: int) -> float:
    """Std of a dense matrix's weights (not norms, not routers)."""
    role = role_of(name)
    if role == "embed":
        return 1.0
    if name.endswith(("o_proj", "down_proj")):
        return 1.0 / math.sqrt(2 * cfg["num_hidden_layers"]) / math.sqrt(cols)
    return (LM_HEAD_GAIN if role == "lm_head" else 1.0) / math.sqrt(cols)


def _zero_leading_rows(buf: np.ndarray, t, rows: int) -> None:
    """Make the first rows of a q4/q8 tensor exactly zero: scale and bias 0 (GGML: all-zero
    blocks, whose scales are 0)."""
    if ggml_blocks.is_ggml(t.format):
        buf[:rows * (t.nbytes // t.rows)] = 0
        return
    _, soff, boff, _ = quant.parts(t.format, t.rows, t.cols)
    n = 2 * rows * (t.cols // quant.GROUP)
    buf[soff:soff + n] = 0
    buf[boff:boff + n] = 0


def _splice_columns(buf: np.ndarray, t, block_bytes: bytes, ncols: int) -> None:
    """Put a quantised (rows, ncols) block over the first ncols columns of a q4/q8 tensor."""
    bits = 4 if t.format == "q4" else 8
    blk = np.frombuffer(block_bytes, dtype=np.uint8)
    ncodes, soff, boff, _ = quant.parts(t.format, t.rows, t.cols)
    bc, bsoff, bboff, _ = quant.parts(t.format, t.rows, ncols)
    full = buf[:ncodes].reshape(t.rows, t.cols * bits // 8)
    full[:, :ncols * bits // 8] = blk[:bc].reshape(t.rows, ncols * bits // 8)
    g, bg = t.cols // quant.GROUP, ncols // quant.GROUP
    for off, boff_ in ((soff, bsoff), (boff, bboff)):
        dst = buf[off:off + 2 * t.rows * g].reshape(t.rows, 2 * g)
        dst[:, :2 * bg] = blk[boff_:boff_ + 2 * t.rows * bg].reshape(t.rows, 2 * bg)


def _write_dense(writer: VaultWriter, name: str, rng: np.random.Generator, routing) -> None:
    cfg, t = writer.config, writer.layout.tensors[name]
    role = role_of(name)
    if role == "norms" and name.endswith((".bias", ".sinks")):
        writer.add_dense(name, _uniform(rng, (t.cols,), BIAS_STD))
        return
    if name.endswith(("linear.conv", "linear.A_log")):  # a Gated DeltaNet's: taps of std 1/√K; A = −exp(A_log) ≈ −1
        std = 1 / math.sqrt(t.cols) if name.endswith("conv") else NORM_SPREAD
        writer.add_dense(name, _uniform(rng, (t.rows, t.cols), std))
        return
    if role == "norms":
        writer.add_dense(name, _uniform(rng, (t.cols,), NORM_SPREAD, mean=1.0))
        return
    if name.endswith("shared_gate"):  # a shared expert's gate: sigmoid of a logit of std ~1
        writer.add_dense(name, _uniform(rng, (t.rows, t.cols), 1 / math.sqrt(t.cols)))
        return
    if role == "router":
        writer.add_dense(name, routing.router(int(name.split(".")[1]), rng))
        return
    std = _dense_std(cfg, name, t.cols)
    shaped = routing.shape_columns(name)
    zero = routing.zero_rows(name)
    if ggml_blocks.is_ggml(t.format) and shaped:
        raise ValueError(f"{name}: routing 'realistic' shapes its columns, which synth cannot do in {t.format}")
    if quant.is_quantized(t.format) or ggml_blocks.is_ggml(t.format):
        # As for experts, q4/q8 matrices are drawn as codes: an a3b has 1.5 G dense weights.
        buf = np.zeros(t.nbytes, dtype=np.uint8)
        _random_codes(buf, t, std, rng, writer.scale_dtype)
        if shaped:
            ncols = quant.align(shaped, quant.GROUP)
            block = _uniform(rng, (t.rows, ncols), std)
            routing.fill_columns(name, block, rng)
            _splice_columns(buf, t, quant.quantize(block, t.format, writer.scale_dtype), ncols)
        if zero:
            _zero_leading_rows(buf, t, zero)
        writer.add_dense_raw(name, buf)
    else:
        w = _uniform(rng, (t.rows, t.cols), std)
        if shaped:
            block = w[:, :shaped].copy()
            routing.fill_columns(name, block, rng)
            w[:, :shaped] = block
        if zero:
            w[:zero] = 0
        writer.add_dense(name, w)


# ------------------------------------------------------------------------------------ experts

def expert_stds(cfg: dict) -> tuple[float, float, float]:
    """Intended std of an expert's gate, up and down weights."""
    h, m = cfg["hidden_size"], cfg["moe_intermediate_size"]
    down = 1.0 / math.sqrt(2 * cfg["num_hidden_layers"]) / math.sqrt(m)
    return 1.0 / math.sqrt(h), 1.0 / math.sqrt(h), down


def _random_codes(out: np.ndarray, t, std: float, rng: np.random.Generator, scale_dtype: str) -> None:
    """Fill out (t.nbytes bytes) with a random q4/q8 tensor of zero mean and this std, drawn
    as codes: no float weight is ever made (GGML formats: ggml_blocks.random_blocks)."""
    if ggml_blocks.is_ggml(t.format):
        out[:t.nbytes] = ggml_blocks.random_blocks(t.format, t.rows, t.cols, std, rng)
        return
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


def _coded_blob(writer: VaultWriter, rng: np.random.Generator, stds, zero_down_rows: int = 0,
                layer: int | None = None) -> np.ndarray:
    """One expert blob laid out as layer's (the first sparse layer's when None): random codes for
    its q4/q8/GGML tensors, random floats for the others (the first zero_down_rows rows of down
    zero); gpt-oss's expert biases, after the matrices, zero."""
    x = writer.layout.expert if layer is None else writer.layout.layer_expert[layer]
    last = x[-1]
    blob = np.zeros(last.offset + last.nbytes, dtype=np.uint8)
    for i, (t, std) in enumerate(zip(x, stds)):
        part = blob[t.offset:t.offset + t.nbytes]
        if quant.is_quantized(t.format) or ggml_blocks.is_ggml(t.format):
            _random_codes(part, t, std, rng, writer.scale_dtype)
            if i == 2 and zero_down_rows:
                _zero_leading_rows(part, t, zero_down_rows)
        else:
            w = _uniform(rng, (t.rows, t.cols), std)
            if i == 2:
                w[:zero_down_rows] = 0
            part[:] = np.frombuffer(quant.quantize(w, t.format, writer.scale_dtype), dtype=np.uint8)
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
          routing: str = "uniform", progress: bool = False, *, formats: dict | None = None,
          overrides: dict | None = None, scale_dtype: str = "f16", overlap: float | None = None,
          top20_share: float | None = None, stay: float | None = None, temperature: float | None = None,
          topics: int | None = None, specific_dims: int | None = None, force: bool = False,
          paged_embedding: bool = True) -> pathlib.Path:
    """Write a random vault to directory path and return it.

    preset: a key of PRESETS; layers truncates it; experts: the expert format; routing:
    "uniform" (random routers) or "realistic" (popular experts, neighbouring tokens sharing
    experts; its knobs overlap, top20_share, stay, temperature, topics, specific_dims default
    to REALISTIC_DEFAULTS, docs/synth.md). formats sets other roles' formats (docs:
    vaultio.DEFAULT_FORMATS); overrides replaces config fields (e.g. {"tie_word_embeddings": True}).

    The vault is written beside path and renamed into place when complete and verified
    (pysmoe.vaultdir.staged): a non-empty path is refused (TargetExists) unless force.
    Bad arguments raise ValueError before anything is written. progress: bars on stderr (off by
    default: `pysmoe synth` turns them on). paged_embedding: an untied embedding stays on disk,
    read a row at a time (docs/vault.md 4.1); False keeps it in memory.
    """
    knobs = dict(overlap=overlap, top20_share=top20_share, stay=stay, temperature=temperature,
                 topics=topics, specific_dims=specific_dims)
    cfg, fmts, mode = prepare(preset, seed, layers, experts, routing, formats, overrides, scale_dtype, knobs)
    path = pathlib.Path(path).expanduser()
    tok_json = build_synthetic_tokenizer(cfg["vocab_size"])
    with staged(path, force) as tmp:
        with VaultWriter(tmp, cfg, formats=fmts, scale_dtype=scale_dtype, tokenizer_json=tok_json,
                         tokenizer_config=synthetic_tokenizer_config(), paged_embedding=paged_embedding) as writer:
            lay = writer.layout
            dense_total = sum(t.rows * t.cols for t in lay.tensors.values())
            with Progress(dense_total, f"{path.name}: dense", unit="weights", enabled=progress) as bar:
                for name, t in lay.tensors.items():
                    rng = _rng(seed, _KIND_DENSE, zlib.crc32(name.encode()))
                    _write_dense(writer, name, rng, mode)
                    bar.update(t.rows * t.cols)
            _write_experts(writer, seed, progress, path.name, mode.reserved)
    return path


def prepare(preset: str = "tiny", seed: int = 0, layers: int | None = None, experts: str = "q4",
            routing: str = "uniform", formats: dict | None = None, overrides: dict | None = None,
            scale_dtype: str = "f16", knobs: dict | None = None):
    """Check synth's arguments without writing anything: (config, formats, routing mode), or
    ValueError saying what is wrong (compute_layout's limits included)."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing {routing!r} is not implemented (available: {', '.join(ROUTINGS)})")
    knobs = {k: v for k, v in (knobs or {}).items() if v is not None}
    if knobs and routing != "realistic":
        raise ValueError(f"{', '.join(sorted(knobs))}: only for routing='realistic'")
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"expert format {experts!r} is not one of {', '.join(EXPERT_FORMATS)}")
    fmts = dict(formats or {}, experts=experts)
    cfg = preset_config(preset, layers, overrides)
    return cfg, fmts, ROUTINGS[routing](compute_layout(cfg, fmts, scale_dtype).config, seed, knobs)


def _write_experts(writer: VaultWriter, seed: int, progress: bool, label: str, zero_down_rows: int = 0) -> None:
    cfg, lay = writer.config, writer.layout
    todo = [(l, e) for l in writer.sparse_layers() for e in range(cfg["num_experts"])]
    if not todo:
        return
    stds = expert_stds(cfg)
    coded = {l: any(quant.is_quantized(t.format) or ggml_blocks.is_ggml(t.format) for t in lay.layer_expert[l])
             for l in writer.sparse_layers()}
    # Generation holds the GIL; crc32 and pwrite release it, so one writer thread overlaps them.
    with Progress(len(todo) * lay.blob_bytes, f"{label}: experts", unit="B", enabled=progress) as bar, \
            cf.ThreadPoolExecutor(max_workers=1) as pool:
        pending: list[cf.Future] = []
        for l, e in todo:
            rng = _rng(seed, _KIND_EXPERT, l, e)
            if coded[l]:
                blob = _coded_blob(writer, rng, stds, zero_down_rows, l)
            else:
                gate, up, down = _float_expert(cfg, rng, stds)
                down[:zero_down_rows] = 0
                biases = [np.zeros(t.cols, np.float32) for t in lay.layer_expert[l][3:]] or None  # gpt-oss's
                blob = writer.pack_expert(gate, up, down, l, biases=biases)
            pending.append(pool.submit(writer.add_expert_raw, l, e, blob))
            if len(pending) >= 4:
                pending.pop(0).result()
                bar.update(lay.blob_bytes)
        for f in pending:
            f.result()
            bar.update(lay.blob_bytes)
