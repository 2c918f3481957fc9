"""Conversion throughput (MB/s of input) and peak RSS of `pysmoe convert` on a synthetic checkpoint.

    python bench/convert_throughput.py --kind hf  --layers 4 OUT_DIR    # bf16 safetensors
    python bench/convert_throughput.py --kind mlx --layers 4 OUT_DIR    # MLX 4-bit layout

Writes a checkpoint of Qwen3-30B-A3B's shape (hidden 2048, 128 experts of 768, 32 heads of 128,
4 kv heads; --layers of them) with numpy into OUT_DIR/src — random bf16 weights, or random MLX
q4 codes with bf16 scales and biases and an 8-bit router — in shards of about 2 GB, then runs
`python -m pysmoe convert` on it under /usr/bin/time -v, prints input MB/s and the peak RSS, and
deletes everything it wrote (--keep to keep it). The hf run converts to q4 experts (MLX's
quantiser), the mlx run copies.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
           num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
           num_experts_per_tok=8, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
           norm_topk_prob=True, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
           architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_act="silu")


class ShardWriter:
    """Writes safetensors shards of about `limit` bytes, tensor by tensor (little memory)."""

    def __init__(self, d: Path, limit: int = 2 << 30):
        self.d, self.limit, self.pending, self.size, self.n, self.map = d, limit, [], 0, 0, {}

    def add(self, name: str, dtype: str, shape, fill) -> None:
        """fill(): the tensor's bytes (called when the shard is written)."""
        nbytes = int(np.prod(shape)) * {"BF16": 2, "F32": 4, "U32": 4}[dtype]
        if self.pending and self.size + nbytes > self.limit:
            self.flush()
        self.pending.append((name, dtype, list(shape), nbytes, fill))
        self.size += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        self.n += 1
        fname = f"model-{self.n:05d}.safetensors"
        header, off = {}, 0
        for name, dtype, shape, nbytes, _ in self.pending:
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + nbytes]}
            off += nbytes
            self.map[name] = fname
        h = json.dumps(header).encode()
        h += b" " * (-len(h) % 8)
        with open(self.d / fname, "wb") as f:
            f.write(struct.pack("<Q", len(h)) + h)
            for _, _, _, _, fill in self.pending:
                f.write(fill())
        self.pending, self.size = [], 0

    def close(self) -> None:
        self.flush()
        (self.d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": self.map}))


def bf16(rng, shape, std):
    def fill():
        a = (rng.standard_normal(shape, dtype=np.float32) * std).view(np.uint32)
        return (a >> 16).astype("<u2").tobytes()
    return fill


def q_parts(rng, shape, bits, group):
    """(weight U32 fill, scales fill, biases fill) of a random MLX-quantised tensor."""
    *lead, rows, cols = shape
    n_groups = int(np.prod(lead, dtype=np.int64)) * rows * cols // group
    w = lambda: rng.integers(0, 2 ** 32, size=int(np.prod(lead, dtype=np.int64)) * rows * cols * bits // 32,  # noqa: E731
                             dtype=np.uint32).astype("<u4").tobytes()
    s = lambda: ((rng.random(n_groups, dtype=np.float32) * 0.01 + 0.001).view(np.uint32) >> 16).astype("<u2").tobytes()  # noqa: E731
    b = lambda: ((rng.random(n_groups, dtype=np.float32) * -0.05).view(np.uint32) >> 16).astype("<u2").tobytes()  # noqa: E731
    return w, s, b


def write_checkpoint(d: Path, kind: str, layers: int) -> None:
    cfg = dict(A3B, num_hidden_layers=layers)
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    H, V, E, M, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["num_experts"], cfg["moe_intermediate_size"], cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    sw = ShardWriter(d)
    mats = {"model.embed_tokens": (V, H), "lm_head": (V, H)}
    for l in range(layers):
        p = f"model.layers.{l}."
        mats.update({p + "self_attn.q_proj": (nq, H), p + "self_attn.k_proj": (nkv, H),
                     p + "self_attn.v_proj": (nkv, H), p + "self_attn.o_proj": (H, nq), p + "mlp.gate": (E, H)})
    norms = {"model.norm.weight": (H,)}
    for l in range(layers):
        p = f"model.layers.{l}."
        norms.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                      p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    for n, s in norms.items():
        sw.add(n, "BF16", s, bf16(rng, s, 0.1))
    if kind == "hf":
        for n, s in mats.items():
            sw.add(n + ".weight", "BF16", s, bf16(rng, s, s[-1] ** -0.5))
        for l in range(layers):
            for e in range(E):
                for part, s in (("gate", (M, H)), ("up", (M, H)), ("down", (H, M))):
                    sw.add(f"model.layers.{l}.mlp.experts.{e}.{part}_proj.weight", "BF16", s, bf16(rng, s, s[-1] ** -0.5))
    else:
        quant = {"group_size": 64, "bits": 4, "mode": "affine"}
        stacked = {}
        for l in range(layers):
            for part, s in (("gate", (E, M, H)), ("up", (E, M, H)), ("down", (E, H, M))):
                stacked[f"model.layers.{l}.mlp.switch_mlp.{part}_proj"] = s
        for n, s in {**mats, **stacked}.items():
            bits = 8 if n.endswith("mlp.gate") else 4
            if bits == 8:
                quant[n] = {"group_size": 64, "bits": 8}
            w, sc, b = q_parts(rng, s, bits, 64)
            sw.add(n + ".weight", "U32", (*s[:-1], s[-1] * bits // 32), w)
            sw.add(n + ".scales", "BF16", (*s[:-1], s[-1] // 64), sc)
            sw.add(n + ".biases", "BF16", (*s[:-1], s[-1] // 64), b)
        cfg["quantization"] = quant
    sw.close()
    (d / "config.json").write_text(json.dumps(cfg))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--kind", choices=("hf", "mlx"), default="hf")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    src, vault = args.out / "src", args.out / "vault"
    shutil.rmtree(args.out, ignore_errors=True)
    t = time.perf_counter()
    write_checkpoint(src, args.kind, args.layers)
    in_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    print(f"wrote {in_bytes / 1e9:.2f} GB of {args.kind} checkpoint in {time.perf_counter() - t:.1f} s")
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "pysmoe", "convert", str(src), str(vault), "--no-progress"]
    if args.kind == "hf":
        cmd += ["--experts", "q4"]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    dt = time.perf_counter() - t
    if r.returncode:
        print(r.stdout, r.stderr)
        return 1
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1))
    out_bytes = (vault / "vault.bin").stat().st_size
    print(json.dumps({"kind": args.kind, "layers": args.layers, "input_GB": round(in_bytes / 1e9, 3),
                      "vault_GB": round(out_bytes / 1e9, 3), "seconds": round(dt, 1),
                      "input_MB_per_s": round(in_bytes / 1e6 / dt, 1), "peak_rss_MB": round(rss / 1024, 1)}))
    if not args.keep:
        shutil.rmtree(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
