"""python -m pysmoe run: generate from a prompt, streaming the text, then the figures."""
from __future__ import annotations

import argparse
import json
import sys

from .argtypes import (float_range, mebibytes, nonneg_float, nonneg_int, positive_float, positive_int,
                       probability, seed)


def add_session_args(p: argparse.ArgumentParser) -> None:
    """Options shared by run and chat."""
    p.add_argument("--vault", help="vault directory (default: the built-in demo vault, a small trained model)")
    p.add_argument("--cache-mb", type=mebibytes, default=None,
                   help="retention cache budget in MiB; 0: only the slots one step needs (default: chosen "
                        "from available memory and the vault, printed at start; see pysmoe/memory.py)")
    p.add_argument("--threads", type=positive_int, default=None, help="compute threads (default: all cores)")
    p.add_argument("--io-threads", type=positive_int, default=4, help="blob reads in flight")
    p.add_argument("--chunk", type=positive_int, default=None,
                   help="layer-major prefill chunk in tokens (default: 256 when the cache holds every expert, "
                        "else 1024)")
    p.add_argument("--context", type=positive_int, default=4096,
                   help="KV cache length in tokens (capped by the model's max_position_embeddings)")
    p.add_argument("--prefill", choices=("layer-major", "token-serial"), default="layer-major",
                   help="how prompts are fed: layer-major chunks or one token at a time (same result)")
    p.add_argument("--kv-dtype", choices=("f32", "bf16", "f16"), default=None,
                   help="KV cache element type (default: the library's, f32); bf16/f16 halve its memory "
                        "(bench/RESULTS.md, \"KV cache in bf16 and f16\")")
    p.add_argument("--buffered", action="store_true", help="buffered reads instead of Direct I/O")
    add_device_args(p)


def add_device_args(p: argparse.ArgumentParser, note: str = "") -> None:
    """--device and --gpu-cache-mb (run, chat, serve)."""
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the layers run: the CPU, or the first NVIDIA GPU (a library built with "
                        f"`make CUDA=1`; README, \"GPU (CUDA)\"){note}")
    p.add_argument("--gpu-cache-mb", type=mebibytes, default=None,
                   help="with --device cuda: VRAM for experts in MiB (default: room for every expert, so that "
                        "nothing streams once they are up; give less when the GPU is smaller than the experts)")


def device_kwargs(vault, args) -> dict:
    """Vault.session's device and gpu_cache_bytes for --device and --gpu-cache-mb ({} on the CPU)."""
    if args.device != "cuda":
        return {}
    every = vault.expert_bytes + vault.blob_bytes
    return dict(device="cuda", gpu_cache_bytes=every if args.gpu_cache_mb is None
                else int(args.gpu_cache_mb * (1 << 20)))


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=positive_int, default=64, help="most tokens to generate")
    p.add_argument("--temperature", type=nonneg_float, default=0.0, help="sampling temperature; 0: greedy")
    p.add_argument("--top-p", type=probability, default=1.0, help="nucleus sampling mass; 1: off")
    p.add_argument("--top-k", type=nonneg_int, default=0, help="sample among the k likeliest; 0: off")
    p.add_argument("--min-p", type=probability, default=0.0,
                   help="drop tokens below min-p times the likeliest's probability; 0: off")
    p.add_argument("--repetition-penalty", type=positive_float, default=1.0,
                   help="divide the logits of recent tokens by this; 1: off")
    p.add_argument("--presence-penalty", type=float_range(-2.0, 2.0), default=0.0,
                   help="subtract this from the logit of every token already generated (OpenAI's); 0: off")
    p.add_argument("--frequency-penalty", type=float_range(-2.0, 2.0), default=0.0,
                   help="subtract this times its count from the logit of each generated token (OpenAI's); 0: off")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop when the text contains TEXT (not shown; matched across tokens); repeatable")
    p.add_argument("--seed", type=seed, default=0, help="sampler seed (same seed, same ids)")


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


def open_session(args):
    from .demo import ensure_demo_vault
    from .engine import open_vault
    from .memory import BUDGET_CHUNK, choose_cache
    if args.gpu_cache_mb is not None and args.device != "cuda":
        print("pysmoe: --gpu-cache-mb does nothing without --device cuda", file=sys.stderr)
    vault = open_vault(args.vault or ensure_demo_vault())
    try:
        gpu = device_kwargs(vault, args)
        if args.cache_mb is None:
            choice = choose_cache(vault, args.context, args.chunk or BUDGET_CHUNK, kv_dtype=args.kv_dtype)
            cache_bytes = choice.bytes
            print(f"pysmoe: {choice.describe()}", file=sys.stderr)
        else:
            cache_bytes = int(args.cache_mb * (1 << 20))
        session = vault.session(cache_bytes=cache_bytes, threads=args.threads, chunk=args.chunk,
                                prefill=args.prefill, context=args.context, io_threads=args.io_threads,
                                direct_io=not args.buffered, kv_dtype=args.kv_dtype, **gpu)
        if gpu:
            print(f"pysmoe: {session.backend}", file=sys.stderr)
    except BaseException:
        vault.close()
        raise
    return vault, session


def sampling_kwargs(args) -> dict:
    return dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, stop_strings=args.stop, seed=args.seed)


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


def print_summary(rec: dict, out=sys.stderr) -> None:
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
    from .generate import interruptible, stream_generate
    prompt = read_prompt(args)
    if prompt is None:
        print("pysmoe run: error: no prompt: give --prompt TEXT, --ids 1,2,3, or pipe text on stdin",
              file=sys.stderr)
        return 2
    vault, session = open_session(args)
    with vault, session:
        last, n_prompt, ids, text = None, None, [], []
        for r in interruptible(session, stream_generate(session, prompt, args.max_tokens, chat=args.chat,
                                                        chat_template_kwargs=args.chat_template_kwargs,
                                                        **sampling_kwargs(args))):
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
