"""python -m pysmoe run: generate from a prompt, streaming the text, then the figures."""
from __future__ import annotations

import argparse
import json
import sys

from .args import add_sampling_args, add_session_args, add_template_args, open_session, sampling_kwargs


def add_parser(p: argparse.ArgumentParser, name: str) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text, through the vault's tokenizer (or pipe it on stdin)")
    src.add_argument("--ids", type=_id_list, help="prompt token ids, comma-separated")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    add_template_args(p)
    p.add_argument("--json", action="store_true", help="print one machine-readable record instead of text")
    add_session_args(p)
    add_sampling_args(p)


def _id_list(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("takes comma-separated integers") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError("takes one or more comma-separated non-negative integers")
    return ids


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
                              "kv_bytes", "kv_dtype", "direct_io", "union_sizes")},
    }


def print_summary(rec: dict, out=None) -> None:
    out = out or sys.stderr  # the stream of the moment (a default bound at import goes stale under capture)
    mb = 1 << 20
    print(f"\n--\nprompt {rec['prompt_tokens']} tokens, TTFT {rec['ttft_s']:.3f} s ({rec['prompt_tps']:.1f} tok/s, "
          f"{rec['prefill']}); generated {rec['generated_tokens']} tokens at {rec['generation_tps']:.2f} tok/s "
          f"({rec['finish_reason']})", file=out)
    print(f"I/O: {rec['blob_reads']} blob reads, {rec['bytes_read'] / mb:.1f} MiB, hits {rec['cache_hits']}, misses "
          f"{rec['cache_misses']}, waited {rec['io_wait_s']:.3f} s, direct I/O {'on' if rec['direct_io'] else 'OFF'}; "
          f"resident {rec['resident_bytes'] / mb:.1f} MiB (KV {rec['kv_bytes'] / mb:.1f} MiB {rec['kv_dtype']})", file=out)
    u = rec["union_sizes"]
    if any(u):
        print(f"prefill union per layer: {' '.join(map(str, u))} (Σ {sum(u)})", file=out)


def read_prompt(args) -> str | list[int] | None:
    """The prompt: --ids, --prompt, or the text piped on stdin; None when there is none."""
    if args.ids is not None:
        return args.ids
    if args.prompt is not None:
        return args.prompt
    if sys.stdin is not None and not sys.stdin.isatty():
        text = sys.stdin.read()
        return text if text.strip() else None
    return None


def run(args) -> int:
    from ..generate import interruptible, stream_generate
    if args.prompt == "":
        print("pysmoe run: error: --prompt is empty: give it some text, or --ids 1,2,3, or pipe text on stdin",
              file=sys.stderr)
        return 2
    prompt = read_prompt(args)
    if prompt is None:
        print("pysmoe run: error: no prompt: give --prompt TEXT, --ids 1,2,3, or pipe text on stdin",
              file=sys.stderr)
        return 2
    vault, session = open_session(args)
    with vault, session:
        tok, view, starts_in_reasoning = vault.tokenizer, None, False
        if args.chat and isinstance(prompt, str) and tok is not None:
            from ..textgen import render_chat
            rendered = render_chat(tok, [{"role": "user", "content": prompt}],
                                   chat_template_kwargs=args.chat_template_kwargs)
            prompt, starts_in_reasoning = rendered.ids, rendered.starts_in_reasoning
        if args.chat and tok is not None:
            # the reply read as the server reads it: reasoning apart, no format tags in the answer
            from .chat import ReplyView, reply_format
            view = ReplyView(reply_format(vault, tok), starts_in_reasoning, show=not args.json)
        last, n_prompt, ids, text = None, None, [], []
        for r in interruptible(session, stream_generate(session, prompt, args.max_tokens,
                                                        **sampling_kwargs(args))):
            last, n_prompt = r, r.prompt_tokens
            ids.append(r.token)
            text.append(r.text)
            if view is not None:
                view.feed(r.text)
            elif not args.json:
                print(r.text if tok is not None else f"{r.token} ", end="", flush=True)
        message = view.finish() if view is not None else None
        rec = summary(session, last, n_prompt or 0)
        if args.json:
            rec["ids"], rec["text"] = ids, "".join(text)
            if message is not None:
                rec["content"], rec["reasoning"] = message["content"], message.get("reasoning_content", "")
                rec["tool_calls"] = message.get("tool_calls", [])
            print(json.dumps(rec))
        else:
            print_summary(rec)
    return 0
