"""What the subcommands share: argparse `type=` functions, the help formatter, the option groups
of more than one command (session, device, sampling, chat template) and what those options mean
(the session they open, the sampling keyword arguments they give).

The types make a bad option value a usage error (exit 2, one line) that never reaches the engine
as a traceback. Upper bounds are the C ABI's field widths (uint32 counts, uint64 seed and byte
budgets): larger values would not fit the struct, so they are usage errors too. What the engine
refuses within those widths (a chunk larger than it supports, say) is its own one-line error
(exit 1)."""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

U32_MAX = 2 ** 32 - 1
U64_MAX = 2 ** 64 - 1
MAX_MIB = float(2 ** 63 >> 20)  # byte budgets in MiB: bytes must fit a signed 64-bit size


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def int_range(low: int, high: int = U32_MAX):
    """An integer in [low, high]."""
    def parse(text: str) -> int:
        v = _int(text)
        if not low <= v <= high:
            raise argparse.ArgumentTypeError(f"{v} is out of range: must be {_describe(low, high)}")
        return v
    parse.__name__ = "integer"  # argparse names the type in its message
    return parse


def _describe(low, high) -> str:
    if high in (U32_MAX, U64_MAX, MAX_MIB):
        return f"≥ {low}"
    return f"between {low} and {high}"


positive_int = int_range(1)
nonneg_int = int_range(0)
seed = int_range(0, U64_MAX)


def float_range(low: float = -math.inf, high: float = math.inf, *, low_open: bool = False,
                high_open: bool = False):
    """A finite float in the interval [low, high] (ends open when asked)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if v < low or v > high or (low_open and v == low) or (high_open and v == high):
            lo = f"{'(' if low_open else '['}{low:g}" if low > -math.inf else "(-inf"
            hi = f"{high:g}{')' if high_open else ']'}" if high < math.inf else "inf)"
            raise argparse.ArgumentTypeError(f"{v:g} is out of range: must lie in {lo}, {hi}")
        return v
    parse.__name__ = "number"
    return parse


finite = float_range()
nonneg_float = float_range(0.0)
positive_float = float_range(0.0, low_open=True)
probability = float_range(0.0, 1.0)
mebibytes = float_range(0.0, MAX_MIB)


def vault_out(text: str) -> pathlib.Path:
    """A directory a vault may be written to: not a file, and under a writable directory
    (whether it may be replaced is --force's business, checked when writing starts)."""
    from ..vaultdir import TargetError, check_target
    try:
        check_target(text, force=True)
    except TargetError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return pathlib.Path(text).expanduser()


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" after an option's help, except where there is nothing to show (no
    default, a flag) or the help already says it. A default of 0 is shown (`in (None, False)`
    would take it for False)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is argparse.SUPPRESS or action.nargs == 0 or "default" in text:
            return text
        return super()._get_help_string(action)


def json_object(text: str) -> dict:
    """A JSON object (--chat-template-kwargs)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


# ------------------------------------------------------------------------------ option groups

def add_session_args(p: argparse.ArgumentParser) -> None:
    """Options of the session run and chat open (open_session)."""
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
                        f"`make CUDA=1`; docs/gpu.md){note}")
    p.add_argument("--gpu-cache-mb", type=mebibytes, default=None,
                   help="with --device cuda: VRAM for experts in MiB (default: room for every expert, so that "
                        "nothing streams once they are up; give less when the GPU is smaller than the experts)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """Options of the sampler and the stop conditions (run, chat; sampling_kwargs)."""
    p.add_argument("--max-tokens", type=positive_int, default=64, help="most tokens to generate")
    p.add_argument("--temperature", type=nonneg_float, default=0.0, help="sampling temperature; 0: greedy (the server's requests sample at 1 "
                        "unless they set it, as OpenAI's do)")
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
    p.add_argument("--chat-template-kwargs", dest="chat_template_kwargs", type=json_object, default=None,
                   metavar="JSON", help="variables of the chat template, e.g. '{\"enable_thinking\": false}'")


# ----------------------------------------------------------------------- what the options mean

def device_kwargs(vault, args) -> dict:
    """Vault.session's device and gpu_cache_bytes for --device and --gpu-cache-mb ({} on the CPU)."""
    if args.device != "cuda":
        return {}
    every = vault.expert_bytes + vault.blob_bytes
    return dict(device="cuda", gpu_cache_bytes=every if args.gpu_cache_mb is None
                else int(args.gpu_cache_mb * (1 << 20)))


def open_session(args):
    """The vault and session of add_session_args' options: (vault, session), both to close."""
    from ..demo import ensure_demo_vault
    from ..engine import open_vault
    from ..memory import BUDGET_CHUNK, choose_cache
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
    """stream_generate's sampling keyword arguments of add_sampling_args' options."""
    return dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, stop_strings=args.stop, seed=args.seed)
