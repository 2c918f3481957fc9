"""Per-token cost of a grammar's token mask: llguidance, XGrammar and outlines-core, on the demo
vault's vocabulary (4,096 ids) and on a Qwen3-sized one (151,643 ids).

    python bench/grammar_mask.py [--big PATH] [--repeat N]

The Qwen3-sized tokenizer is a byte-level BPE trained with the `tokenizers` library on the Python
standard library's sources (about two minutes, once; kept at --big, default
/tmp/pysmoe-bench-151k-tokenizer.json): real Qwen3 weights cannot be downloaded here, and what the
mask costs depends on the vocabulary's size and shape (a trie of byte strings), which a code-and-
English BPE of the same size has too.

For each library and grammar it builds the tokenizer's tables once (`setup`), compiles the grammar
(`compile`, per request in a server), then walks a fixed valid reply token by token: compute the
mask of allowed ids for the next step, then consume the reply's token. It prints the mean and the
median microseconds of one mask, and the compile time. Libraries that are not installed are
skipped. The figures go to bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEMO = ROOT / "pysmoe" / "data" / "demo" / "tokenizer.json"

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
REPLY = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["mathematics", "poetry", "engines"],
                    "address": {"city": "London", "zip": "W1"}}, separators=(",", ":"))


def build_big(path: pathlib.Path) -> None:
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    files = sorted(p for p in pathlib.Path(sysconfig.get_paths()["stdlib"]).rglob("*.py") if "test" not in p.parts)

    def lines():
        for f in files:
            yield from f.read_text(encoding="utf-8", errors="replace").splitlines()

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=151_643, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines(), trainer)
    tok.save(str(path))


def _bytes_of(tok) -> list[bytes]:
    """Each id's bytes (byte-level BPE: its symbols mapped back through GPT-2's byte alphabet)."""
    from tokenizers import pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    # GPT-2's table: printable bytes map to themselves, the others to U+0100 onwards, in byte order
    printable = [b for b in range(256) if chr(b) in alphabet]
    table, k = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + k)] = b
            k += 1
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    out = []
    for i in range(tok.get_vocab_size()):
        s = tok.id_to_token(i)
        out.append(s.encode() if s in special else bytes(table[c] for c in s))
    return out


def _walk(mask, consume, ids) -> list[float]:
    times = []
    for t in ids:
        t0 = time.perf_counter()
        mask()
        times.append(time.perf_counter() - t0)
        consume(t)
    t0 = time.perf_counter()
    mask()  # the last step: end of sequence allowed
    times.append(time.perf_counter() - t0)
    return times


def bench_llguidance(path, tok, ids, eos, grammar):
    import llguidance
    import numpy as np
    t0 = time.perf_counter()
    lt = llguidance.LLTokenizer(path.read_text(), eos_token=eos)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    g = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA if grammar == "schema" else {"type": "object"})
    m = llguidance.LLMatcher(lt, g)
    compile_s = time.perf_counter() - t0
    assert not m.is_error(), m.get_error()
    buf = np.zeros((tok.get_vocab_size() + 31) // 32, dtype=np.int32)
    times = _walk(lambda: m.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes), lambda t: m.consume_token(t), ids)
    assert not m.is_error(), m.get_error()
    assert buf[eos // 32] >> (eos % 32) & 1, "the end of sequence is allowed at the end"
    return setup, compile_s, times


def bench_xgrammar(path, tok, ids, eos, grammar):
    import xgrammar as xgr
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(_bytes_of(tok), vocab_type=xgr.VocabType.RAW, vocab_size=tok.get_vocab_size(),
                             stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    cg = (compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
          if grammar == "schema" else compiler.compile_builtin_json_grammar())
    m = xgr.GrammarMatcher(cg)
    compile_s = time.perf_counter() - t0
    bm = xgr.allocate_token_bitmask(1, tok.get_vocab_size())
    times = _walk(lambda: m.fill_next_token_bitmask(bm), lambda t: m.accept_token(t) or sys.exit(f"rejected {t}"),
                  ids)
    return setup, compile_s, times


def bench_outlines(path, tok, ids, eos, grammar):
    if grammar != "schema":
        return None  # outlines-core compiles regular expressions: JSON of any depth is not one
    import numpy as np
    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema
    t0 = time.perf_counter()
    vocab = {}
    for i, b in enumerate(_bytes_of(tok)):
        if i != eos:
            vocab.setdefault(b, []).append(i)
    v = oc.Vocabulary(eos, vocab)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = oc.Index(build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern=""), v)
    guide = oc.Guide(index)
    compile_s = time.perf_counter() - t0
    buf = np.zeros((tok.get_vocab_size() + 31) // 32, dtype=np.int32)
    times = _walk(lambda: guide.write_mask_into(buf.ctypes.data, buf.size, 4), lambda t: guide.advance(t), ids)
    return setup, compile_s, times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big", type=pathlib.Path, default=pathlib.Path("/tmp/pysmoe-bench-151k-tokenizer.json"))
    ap.add_argument("--repeat", type=int, default=5, help="walks of the reply per case (default 5)")
    args = ap.parse_args(argv)
    from tokenizers import Tokenizer
    if not args.big.exists():
        print(f"training the 151,643-token BPE into {args.big} (about two minutes) ...", file=sys.stderr)
        build_big(args.big)
    libs = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar, "outlines-core": bench_outlines}
    print(f"{'vocabulary':>12} {'library':>14} {'grammar':>12} {'setup s':>8} {'compile ms':>10} "
          f"{'mask µs mean':>12} {'median':>8} {'tokens':>6}")
    for path in (DEMO, args.big):
        tok = Tokenizer.from_file(str(path))
        eos = tok.token_to_id("<|im_end|>")
        ids = tok.encode(REPLY).ids
        for name, fn in libs.items():
            for grammar in ("schema", "json_object"):
                try:
                    runs = [fn(path, tok, ids, eos, grammar) for _ in range(args.repeat)]
                except ImportError as e:
                    print(f"{name}: not installed ({e})", file=sys.stderr)
                    break
                if runs[0] is None:
                    continue
                times = [t for r in runs for t in r[2]]
                print(f"{tok.get_vocab_size():>12,} {name:>14} {grammar:>12} {runs[0][0]:>8.2f} "
                      f"{statistics.median(r[1] for r in runs) * 1e3:>10.1f} {statistics.mean(times) * 1e6:>12.1f} "
                      f"{statistics.median(times) * 1e6:>8.1f} {len(ids):>6}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
