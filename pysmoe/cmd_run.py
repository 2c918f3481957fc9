"""python -m pysmoe run: generate from a prompt, streaming the text, then the figures."""
from __future__ import annotations

import argparse
import json
import sys


def add_session_args(p: argparse.ArgumentParser) -> None:
    """Options shared by run, chat and bench."""
    p.add_argument("--vault", help="vault directory (default: the built-in demo vault, made on first use)")
    p.add_argument("--cache-mb", type=float, default=0, help="retention cache budget in MiB (0: one layer's slots)")
    p.add_argument("--threads", type=int, default=None, help="compute threads (default: all cores)")
    p.add_argument("--io-threads", type=int, default=4, help="blob reads in flight")
    p.add_argument("--chunk", type=int, default=None, help="layer-major prefill chunk in tokens (default: the library's, 256)")
    p.add_argument("--context", type=int, default=4096, help="KV cache length (tokens)")
    p.add_argument("--prefill", choices=("layer-major", "token-serial"), default="layer-major")
    p.add_argument("--buffered", action="store_true", help="buffered reads instead of Direct I/O")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)


def add_template_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template-kwargs", dest="chat_template_kwargs", type=_json_object, default=None,
                   metavar="JSON", help="variables of the chat template, e.g. '{\"enable_thinking\": false}'")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_parser(p: argparse.ArgumentParser, name: str) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (through the vault's tokenizer)")
    src.add_argument("--ids", help="prompt token ids, comma-separated")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    add_template_args(p)
    p.add_argument("--json", action="store_true", help="print one machine-readable record instead of text")
    add_session_args(p)
    add_sampling_args(p)


def open_session(args):
    from .demo import ensure_demo_vault
    from .engine import open_vault
    vault = open_vault(args.vault or ensure_demo_vault())
    session = vault.session(cache_bytes=int(args.cache_mb * (1 << 20)), threads=args.threads, chunk=args.chunk,
                            prefill=args.prefill, context=args.context, io_threads=args.io_threads,
                            direct_io=not args.buffered)
    return vault, session


def sampling_kwargs(args) -> dict:
    return dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                repetition_penalty=args.repetition_penalty, seed=args.seed)


def summary(session, last, prompt_tokens: int) -> dict:
    st = session.stats()
    return {
        "prompt_tokens": prompt_tokens,
        "generated_tokens": last.generation_tokens if last else 0,
        "ttft_s": last.ttft_s if last else None,
        "prompt_tps": last.prompt_tps if last else None,
        "generation_tps": last.generation_tps if last else None,
        "finish_reason": last.finish_reason if last else None,
        "prefill": session.prefill_path,
        **{k: st[k] for k in ("blob_reads", "bytes_read", "cache_hits", "cache_misses", "io_wait_s", "resident_bytes",
                              "direct_io", "union_sizes")},
    }


def print_summary(rec: dict, out=sys.stderr) -> None:
    mb = 1 << 20
    print(f"\n--\nprompt {rec['prompt_tokens']} tokens, TTFT {rec['ttft_s']:.3f} s ({rec['prompt_tps']:.1f} tok/s, "
          f"{rec['prefill']}); generated {rec['generated_tokens']} tokens at {rec['generation_tps']:.2f} tok/s "
          f"({rec['finish_reason']})", file=out)
    print(f"I/O: {rec['blob_reads']} blob reads, {rec['bytes_read'] / mb:.1f} MiB, hits {rec['cache_hits']}, misses "
          f"{rec['cache_misses']}, waited {rec['io_wait_s']:.3f} s, direct I/O {'on' if rec['direct_io'] else 'OFF'}; "
          f"resident {rec['resident_bytes'] / mb:.1f} MiB", file=out)
    u = rec["union_sizes"]
    if any(u):
        print(f"prefill union per layer: {' '.join(map(str, u))} (Σ {sum(u)})", file=out)


def run(args) -> int:
    from .generate import stream_generate
    if args.ids:
        try:
            prompt = [int(x) for x in args.ids.split(",") if x.strip()]
        except ValueError:
            print("pysmoe run: --ids takes comma-separated integers", file=sys.stderr)
            return 2
    else:
        prompt = args.prompt if args.prompt is not None else "The quick brown fox"
    vault, session = open_session(args)
    with vault, session:
        last, n_prompt, ids, text = None, None, [], []
        for r in stream_generate(session, prompt, args.max_tokens, chat=args.chat,
                                 chat_template_kwargs=args.chat_template_kwargs, **sampling_kwargs(args)):
            last, n_prompt = r, r.prompt_tokens
            ids.append(r.token)
            text.append(r.text)
            if not args.json:
                print(r.text if vault.tokenizer is not None else f"{r.token} ", end="", flush=True)
        rec = summary(session, last, n_prompt or 0)
        if args.json:
            rec["ids"], rec["text"] = ids, "".join(text)
            print(json.dumps(rec))
        else:
            print_summary(rec)
    return 0
