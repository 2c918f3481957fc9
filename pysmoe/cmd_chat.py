"""python -m pysmoe chat: a conversation through the vault's chat template.

Each turn re-renders the whole conversation and prefills it from position 0: simple and exact;
the retention cache keeps the experts of earlier turns warm, so the re-read is mostly hits."""
from __future__ import annotations

import argparse
import sys

from .cmd_run import add_sampling_args, add_session_args, add_template_args, open_session, sampling_kwargs


def add_parser(p: argparse.ArgumentParser, name: str) -> None:
    p.add_argument("--system", default=None, help="system message")
    add_template_args(p)
    add_session_args(p)
    add_sampling_args(p)


def run(args) -> int:
    from .generate import stream_generate
    vault, session = open_session(args)
    with vault, session:
        tok = vault.tokenizer
        if tok is None:
            print("pysmoe chat: this vault has no tokenizer.json", file=sys.stderr)
            return 2
        messages = [{"role": "system", "content": args.system}] if args.system else []
        interactive = sys.stdin.isatty()
        while True:
            if interactive:
                print(">> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line:
                return 0
            line = line.strip()
            if not line:
                continue
            messages.append({"role": "user", "content": line})
            ids = tok.apply_chat_template(messages, **(args.chat_template_kwargs or {}))
            if len(ids) + args.max_tokens > session.context:
                print("[the conversation no longer fits the context; starting over]", file=sys.stderr)
                messages = messages[-1:]
                ids = tok.apply_chat_template(messages, **(args.chat_template_kwargs or {}))
            session.reset()
            reply, last = [], None
            for r in stream_generate(session, ids, args.max_tokens, **sampling_kwargs(args)):
                print(r.text, end="", flush=True)
                reply.append(r.text)
                last = r
            if last is not None:
                print(f"\n[{last.generation_tokens} tokens, TTFT {last.ttft_s:.2f} s, "
                      f"{last.generation_tps:.1f} tok/s]", file=sys.stderr)
            messages.append({"role": "assistant", "content": "".join(reply)})
