"""Train the demo model: a small Qwen3MoeForCausalLM on the Python 3.11 documentation.

Corpus: the reStructuredText sources of the Python 3.11 documentation as Debian ships them in the
package `python3.11-doc`, version 3.11.2-6+deb12u9 (files under
/usr/share/doc/python3.11/html/_sources/), licensed under the Python Software Foundation License
Version 2 (a free, GPL-compatible licence; the package's copyright file carries the full text).
About 11 MB of reST; 6.7 MB of English prose (1.7 M tokens) once markup and code are taken out.

Three steps, each deterministic from --seed (two `train` runs on fresh H200 machines wrote
byte-identical weights):

    python scripts/train_demo.py prepare --out build/demo-data      # CPU, ~40 s
    python scripts/train_demo.py train --data build/demo-data --out build/demo-hf   # one H200: 65 s (CPU: hours)
    python scripts/train_demo.py ship --data build/demo-data --hf build/demo-hf --out pysmoe/data/demo

`prepare` fetches the .deb with `apt-get download` (or takes --deb), cleans the reST into prose
(`clean_rst`), holds out every HELDOUT_EVERY-th document (sorted by path) for evaluation, trains a
byte-level BPE of VOCAB_SIZE tokens on the training documents with the ChatML special tokens, and
writes the token streams (uint16) and the tokenizer. `train` needs torch and transformers only,
so the data directory can be carried to a machine with a GPU that has no network.

`ship` converts the checkpoint with pysmoe's converter in its default formats (q4 experts, q8
dense matrices, f32 router and norms) and adds the first HELDOUT_SHIP_BYTES of the held-out text
(bench/perplexity.py and tests/test_quality.py score it) and the training record.

gpt-oss (issue 26: quality of MXFP4 experts on trained weights) is the same recipe with
`train --family gpt_oss` (GPT_OSS_CONFIG: the demo's widths; one H200, 121 s); `--tiny` is the
test fixture's size (58 s), shipped as tests/data/gpt_oss_trained with

    python scripts/train_demo.py train --data build/demo-data --out build/oss-tiny-hf --family gpt_oss --tiny
    python scripts/train_demo.py ship --data build/demo-data --hf build/oss-tiny-hf --hf-name build/oss-tiny-hf \
        --out tests/data/gpt_oss_trained --experts q8 --dense q4 --fixture

The demo shipped in pysmoe/data/demo/ was trained on one NVIDIA H200; see docs/demo.md for the cost and the
losses.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DEB_PACKAGE = "python3.11-doc"
DEB_VERSION = "3.11.2-6+deb12u9"
DEB_LICENSE = "PSF-2.0 (Python Software Foundation License Version 2)"
SOURCES_DIR = "usr/share/doc/python3.11/html/_sources"

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB_SIZE = 4096
HELDOUT_SHIP_BYTES = 64 * 1024
HELDOUT_EVERY = 20  # every 20th document (sorted by path) is held out: ~5 % of the text

MODEL_CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=256,
    intermediate_size=512,          # unused: every layer is sparse
    moe_intermediate_size=128,      # a multiple of 64, as q4/q8 need for down_proj's input
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=16,
    num_experts_per_tok=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    norm_topk_prob=True,
    tie_word_embeddings=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    router_aux_loss_coef=0.01,
    output_router_logits=True,      # the load-balancing loss joins the training loss
    bos_token_id=None,
    eos_token_id=2,                 # <|im_end|>
    pad_token_id=0,                 # <|endoftext|>
)
ROPE_THETA = 10000.0

# gpt-oss at the demo's size (issue 26, item 4: quality of MXFP4 experts on trained weights): the
# family's pieces at small scale — sliding-window (128) layers alternating with full ones,
# attention sinks, biases on attention and experts, the clamped SwiGLU, the router's top-k then
# softmax, YaRN RoPE (factor 4 over 256 original positions) — with the demo's vocabulary and
# widths. expert intermediate_size 128: a multiple of 32 (MXFP4) and of 64 (q4/q8).
GPT_OSS_CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=256,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_local_experts=16,
    num_experts_per_tok=2,
    sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    attention_bias=True,
    router_aux_loss_coef=0.01,
    output_router_logits=True,
    bos_token_id=None,
    eos_token_id=2,
    pad_token_id=0,
)
GPT_OSS_ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 256}

# --tiny: the same family at a test fixture's size (tests/test_quality.py's gpt-oss fixture):
# two layers (one sliding, one full), 8 experts of 64, hidden 128.
TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
TINY_EXPERTS = {"qwen3_moe": dict(num_experts=8, moe_intermediate_size=64),
                "gpt_oss": dict(num_local_experts=8, intermediate_size=64,
                                layer_types=["sliding_attention", "full_attention"])}

FAMILIES = {"qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", MODEL_CONFIG,
                          {"rope_type": "default", "rope_theta": ROPE_THETA}),
            "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", GPT_OSS_CONFIG, GPT_OSS_ROPE)}

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# ---- corpus ------------------------------------------------------------------------------------

_ROLE = re.compile(r":[a-zA-Z:+-]+:`!?~?([^`<]*?)(?:\s*<[^>]*>)?`")
_LINK = re.compile(r"`([^`<]+?)\s*<[^>]*>`_{1,2}")
_REF = re.compile(r"`([^`]+)`_{1,2}")
_LITERAL = re.compile(r"``([^`]+)``")
_EMPH = re.compile(r"\*\*?([^*\n]+)\*\*?")
_FOOTNOTE = re.compile(r"\s*\[(#[\w-]*|\d+|\*)\]_")
_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+.:_])\1{2,}\s*$")


_SKIP_DIRECTIVES = ("code-block", "sourcecode", "code", "doctest", "testcode", "testoutput", "testsetup",
                    "testcleanup", "productionlist", "index", "toctree", "literalinclude", "highlight",
                    "csv-table", "table", "list-table", "image", "figure", "raw", "include", "only",
                    "audit-event", "impl-detail", "moduleauthor", "sectionauthor", "seealso", "opcode",
                    "cmdoption", "option", "envvar", "describe", "productionlist", "availability")


def clean_rst(text: str) -> str:
    """Prose paragraphs of one reST document. Literal blocks (after a `::`), code, table, index
    and similar directives with their indented bodies, comments, interactive sessions and section
    underlines are dropped; the bodies of the other directives (function and class descriptions,
    notes) are kept as prose; roles, links and inline markup are reduced to their text; each
    paragraph is joined onto one line, and paragraphs of fewer than six words (headings, list
    stubs, signatures) are dropped."""
    paragraphs, cur = [], []

    def flush():
        if cur:
            p = " ".join(cur)
            if len(p.split()) >= 6:
                paragraphs.append(p)
            cur.clear()

    skip_deeper = None  # while set, lines indented deeper than this are skipped
    for line in text.splitlines():
        s = line.rstrip().expandtabs(8)
        if not s.strip():
            flush()
            continue
        indent = len(s) - len(s.lstrip())
        if skip_deeper is not None:
            if indent > skip_deeper:
                continue
            skip_deeper = None
        body = s.strip()
        if body.startswith(".. "):
            flush()
            m = re.match(r"\.\. ([\w:-]+)::", body)
            if m is None or m.group(1).split(":")[-1] in _SKIP_DIRECTIVES or m.group(1).startswith("_"):
                skip_deeper = indent  # a comment, a target, or a directive whose body is not prose
            continue
        if body.startswith(("|", "+-", "+=", ">>>", "...", "$ ")) or _UNDERLINE.match(body):
            flush()
            continue
        body = re.sub(r"^([*-]|#\.|\d+\.)\s+", "", body)  # list bullets
        cur.append(body)
        if body.endswith("::"):  # a literal block follows, indented deeper
            flush()
            skip_deeper = indent
    flush()

    out = []
    for p in paragraphs:
        p = _ROLE.sub(r"\1", p)
        p = _LINK.sub(r"\1", p)
        p = _REF.sub(r"\1", p)
        p = _LITERAL.sub(r"\1", p)
        p = _EMPH.sub(r"\1", p)
        p = _FOOTNOTE.sub("", p)
        p = p.replace("\\", "")
        if p.endswith("::"):
            p = p[:-1]
        p = re.sub(r"\s+", " ", p).strip()
        if p:
            out.append(p)
    return "\n".join(out)


def fetch_deb(dest: Path) -> Path:
    """apt-get download of the pinned package version into dest."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["apt-get", "download", f"{DEB_PACKAGE}={DEB_VERSION}"], cwd=dest, check=True)
    debs = sorted(dest.glob(f"{DEB_PACKAGE}_*.deb"))
    if not debs:
        raise SystemExit(f"apt-get download left no {DEB_PACKAGE} .deb in {dest}")
    return debs[-1]


def documents(deb: Path) -> list[tuple[str, str]]:
    """(path, cleaned prose) for every .rst.txt source in the package, sorted by path."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["dpkg-deb", "-x", str(deb), tmp], check=True)
        root = Path(tmp) / SOURCES_DIR
        docs = []
        for f in sorted(root.rglob("*.rst.txt")):
            rel = f.relative_to(root).as_posix()
            if rel.startswith("whatsnew/changelog"):  # a list of commit titles, not prose
                continue
            prose = clean_rst(f.read_text(encoding="utf-8", errors="replace"))
            if prose:
                docs.append((rel, prose))
    return docs


def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    return tok


def encode(tok, docs: list[str]) -> np.ndarray:
    """One stream: each document's ids followed by <|endoftext|>."""
    eot = tok.token_to_id("<|endoftext|>")
    out = []
    for enc in tok.encode_batch(docs):
        out.extend(enc.ids)
        out.append(eot)
    return np.asarray(out, dtype=np.uint16)


def tokenizer_config() -> dict:
    return {"chat_template": CHATML_TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
            "bos_token": None, "model_max_length": MODEL_CONFIG["max_position_embeddings"]}


def prepare(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deb = Path(args.deb) if args.deb else fetch_deb(out / "deb")
    docs = documents(deb)
    held = [t for i, (_, t) in enumerate(docs) if i % HELDOUT_EVERY == HELDOUT_EVERY // 2]
    train = [t for i, (_, t) in enumerate(docs) if i % HELDOUT_EVERY != HELDOUT_EVERY // 2]
    tok = train_tokenizer(train)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2))
    tr, ho = encode(tok, train), encode(tok, held)
    tr.tofile(out / "train.u16")
    ho.tofile(out / "heldout.u16")
    (out / "heldout.txt").write_text("\n\n".join(held), encoding="utf-8")
    meta = {"package": DEB_PACKAGE, "version": DEB_VERSION, "license": DEB_LICENSE,
            "documents": len(docs), "heldout_documents": len(held),
            "train_bytes": sum(len(t.encode()) for t in train), "heldout_bytes": sum(len(t.encode()) for t in held),
            "train_tokens": int(tr.size), "heldout_tokens": int(ho.size)}
    (out / "corpus.json").write_text(json.dumps(meta, indent=2))
    print(json.dumps(meta, indent=2))


# ---- training ----------------------------------------------------------------------------------

def make_config(family: str = "qwen3_moe", tiny: bool = False):
    """The transformers config of one family's model (--tiny: the fixture's size)."""
    import transformers

    _, config_cls, cfg, rope = FAMILIES[family]
    cfg = {**cfg, **(TINY | TINY_EXPERTS[family] if tiny else {})}
    return getattr(transformers, config_cls)(**cfg, rope_parameters=dict(rope))


def make_model(family: str = "qwen3_moe", tiny: bool = False):
    import transformers

    return getattr(transformers, FAMILIES[family][0])(make_config(family, tiny))


def batches(stream: np.ndarray, seq: int, batch: int, rng: np.random.Generator):
    """Endless random windows of seq + 1 tokens (inputs and shifted targets)."""
    starts_max = stream.size - seq - 1
    while True:
        starts = rng.integers(0, starts_max, size=batch)
        yield np.stack([stream[s:s + seq + 1] for s in starts]).astype(np.int64)


def evaluate(model, stream: np.ndarray, seq: int, device, max_windows: int | None = None) -> float:
    """Mean next-token loss over consecutive non-overlapping windows of the stream."""
    import torch

    n = (stream.size - 1) // seq
    if max_windows:
        n = min(n, max_windows)
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, n, 64):
            w = np.stack([stream[j * seq:j * seq + seq + 1] for j in range(i, min(n, i + 64))]).astype(np.int64)
            x = torch.from_numpy(w).to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logits = model(input_ids=x[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                     reduction="sum")
            total += float(loss)
            count += x[:, 1:].numel()
    model.train()
    return total / count


def train(args) -> None:
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = Path(args.data)
    train_ids = np.fromfile(data / "train.u16", dtype=np.uint16)
    held_ids = np.fromfile(data / "heldout.u16", dtype=np.uint16)

    model = make_model(args.family, args.tiny).to(device)
    aux_coef = model.config.router_aux_loss_coef
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.2f} M parameters on {device}; {train_ids.size} training tokens, "
          f"{held_ids.size} held out", flush=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    warmup = max(1, args.steps // 20)

    def lr_at(step):
        if step < warmup:
            return args.lr * (step + 1) / warmup
        t = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    rng = np.random.default_rng(args.seed)
    it = batches(train_ids, args.seq, args.batch, rng)
    t0 = time.time()
    log = []
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x = torch.from_numpy(next(it)).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(input_ids=x[:, :-1])  # targets are the window shifted by one (below)
        logits = out.logits.float()
        lm = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss = lm + aux_coef * out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == args.steps - 1:
            row = {"step": step, "loss": round(float(lm.detach()), 4), "aux": round(float(out.aux_loss.detach()), 4),
                   "s": round(time.time() - t0, 1)}
            if step % 500 == 0 or step == args.steps - 1:
                row["heldout"] = round(evaluate(model, held_ids, args.seq, device, 256), 4)
            log.append(row)
            print(json.dumps(row), flush=True)
    train_s = time.time() - t0
    final = {"family": args.family, "tiny": args.tiny, "params": n_params, "steps": args.steps, "batch": args.batch, "seq": args.seq, "lr": args.lr,
             "seed": args.seed, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
             "train_seconds": round(train_s, 1),
             "train_loss": round(evaluate(model, train_ids[:held_ids.size * 2], args.seq, device), 4),
             "heldout_loss": round(evaluate(model, held_ids, args.seq, device), 4), "log": log}
    print(json.dumps({k: v for k, v in final.items() if k != "log"}), flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = model.float().cpu()
    model.config.output_router_logits = False
    model.save_pretrained(out, max_shard_size="12MB")
    for name in ("tokenizer.json", "tokenizer_config.json", "corpus.json"):
        (out / name).write_bytes((data / name).read_bytes())
    (out / "training.json").write_text(json.dumps(final, indent=2))


def ship(args) -> None:
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    from pysmoe.convert import convert_checkpoint

    data, hf, out = Path(args.data), Path(args.hf), Path(args.out)
    convert_checkpoint(hf, out, experts=args.experts, dense=args.dense, force=True, progress=False)
    source = json.loads((out / "source.json").read_text())
    source["path"] = f"scripts/train_demo.py train ({args.hf_name})"  # not this machine's folder
    (out / "source.json").write_text(json.dumps(source, indent=2) + "\n")
    training = json.loads((hf / "training.json").read_text())
    corpus = json.loads((hf / "corpus.json").read_text())
    (out / "training.json").write_text(json.dumps({"corpus": corpus, **training}, indent=2) + "\n")
    if args.fixture:  # the tokenizer and the held-out text are the demo's (prepare is deterministic)
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            (out / name).unlink(missing_ok=True)
        print(f"{out}: {sum(f.stat().st_size for f in out.iterdir()) / 1e6:.2f} MB")
        return
    held, size = [], 0
    for para in (data / "heldout.txt").read_text(encoding="utf-8").split("\n"):
        size += len(para.encode()) + 1
        if size > HELDOUT_SHIP_BYTES:
            break
        held.append(para)
    (out / "heldout.txt").write_text("\n".join(held) + "\n", encoding="utf-8")
    print(f"{out}: {sum(f.stat().st_size for f in out.iterdir()) / 1e6:.2f} MB")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="fetch and clean the corpus, train the tokenizer, write token streams")
    p.add_argument("--out", required=True)
    p.add_argument("--deb", help=f"a {DEB_PACKAGE}_{DEB_VERSION}_all.deb already at hand")
    t = sub.add_parser("train", help="train the model on a prepared data directory")
    t.add_argument("--data", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--seq", type=int, default=256)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_moe",
                   help="the model's family: qwen3_moe (the demo) or gpt_oss (issue 26's MXFP4 quality table)")
    t.add_argument("--tiny", action="store_true", help="a test fixture's size (two layers, 8 experts, hidden 128)")
    s = sub.add_parser("ship", help="convert the trained checkpoint into the demo vault, with held-out text")
    s.add_argument("--data", required=True)
    s.add_argument("--hf", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--experts", help="expert format (default: the converter's, q4)")
    s.add_argument("--dense", help="dense matrices' format (default: the converter's, q8)")
    s.add_argument("--hf-name", default="build/demo-hf", help="how source.json names the checkpoint")
    s.add_argument("--fixture", action="store_true",
                   help="a test fixture: the vault, config and records only (tokenizer and held-out text: the demo's)")
    args = ap.parse_args(argv)
    {"prepare": prepare, "train": train, "ship": ship}[args.cmd](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
