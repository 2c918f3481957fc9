"""python -m pysmoe bench VAULT: time to first token and decode speed, against the machine's limits.

The options and the exit status; what is measured, and how, is pysmoe/bench.py's (and
bench/README.md's)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from ..bench import DEFAULT_LENGTHS, PATHS, MiB
from .args import mebibytes, nonneg_int, positive_float, positive_int, probability, seed


def _int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, not {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError("prompt lengths must be integers ≥ 1")
    return out


def _pct_list(text: str) -> list[float]:
    try:
        out = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated percentages, not {text!r}") from None
    if not out or out[0] < 0 or out[-1] > 100:
        raise argparse.ArgumentTypeError("budgets are percentages of the expert bytes, 0 to 100")
    return out


def _path_list(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in PATHS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"paths are a comma-separated subset of {','.join(PATHS)}")
    return out


def add_parser(p: argparse.ArgumentParser, name: str = "bench") -> None:
    p.add_argument("vault", help="vault directory (make one with: python -m pysmoe synth DIR --preset mini)")
    p.add_argument("--prompt-lengths", type=_int_list, default=list(DEFAULT_LENGTHS),
                   help="prompt lengths in tokens, comma-separated (default 1,8,45,64,256,1024)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--cache-mb", type=mebibytes, default=None, help="retention cache budget in MiB")
    budget.add_argument("--cache-frac", type=probability, default=None,
                        help="retention cache budget as a fraction of the expert bytes (default 0.1)")
    p.add_argument("--paths", type=_path_list, default=list(PATHS),
                   help="prefill paths to time, comma-separated (default layer-major,token-serial)")
    p.add_argument("--repeats", type=positive_int, default=3, help="runs per figure; each figure is their median (default 3)")
    p.add_argument("--chunk", type=positive_int, default=None,
                   help="layer-major chunk in tokens (default: each session's, pysmoe.memory.default_chunk: 256 "
                        "for the resident runs, 1,024 under the cache budget)")
    p.add_argument("--threads", type=positive_int, default=None, help="compute threads (default: all cores)")
    p.add_argument("--io-threads", type=positive_int, default=4, help="blob reads in flight, engine and probe (default 4)")
    p.add_argument("--decode-tokens", type=nonneg_int, default=16, help="tokens decoded per decode run (0: no decode runs)")
    p.add_argument("--decode-prompt", type=positive_int, default=8, help="prompt length before the decode runs (default 8)")
    p.add_argument("--decode-budgets", type=_pct_list, default=None, metavar="PCTS",
                   help="decode tokens/s against the cache budget: comma-separated percentages of the expert bytes "
                        "(100: every expert), e.g. 0,5,10,25,50,100; a fresh session per run prefills "
                        "--budget-prompt tokens, then decodes --decode-tokens; budgets that do not fit in available "
                        "memory are skipped")
    p.add_argument("--budget-prompt", type=positive_int, default=64,
                   help="prompt length before each --decode-budgets run (default 64: long enough that the cache is "
                        "as full as its budget allows when decode starts)")
    p.add_argument("--no-ttft", action="store_true",
                   help="skip the TTFT table and the two-point decode (with --decode-budgets: only the budget curve)")
    p.add_argument("--serial-max-len", type=positive_int, default=None,
                   help="time token-serial only for prompts up to this length (it reads top-k blobs per token "
                        "per layer: slow on large vaults)")
    p.add_argument("--no-resident", action="store_true",
                   help="skip the compute floor and resident decode (they need memory for every expert)")
    p.add_argument("--resident-mb", type=mebibytes, default=None,
                   help="cache of the resident session in MiB (default: every expert's bytes)")
    p.add_argument("--probe-mb", type=positive_float, default=1024,
                   help="at most this many MiB per bandwidth probe (default 1024)")
    p.add_argument("--coalesce-mb", type=mebibytes, default=None,
                   help="largest read request of the engine's cold sessions in MiB (default: the library's, 16; "
                        "0: one read per blob)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the prompt ids and the probe's blob choice")
    p.add_argument("--verify-blobs", choices=("on", "off", "both"), default="on",
                   help="check each blob's checksum as it is read (the engine's default, on); both: every cold "
                        "run also runs on a second, unchecked session in the same repeat, and the table gives "
                        "the cost of checking (default on)")
    p.add_argument("--prompt-ids", metavar="FILE", default=None,
                   help="prompt ids (.npy, or text of integers) instead of random ones; each prompt length takes a "
                        "prefix. For realistic-routing vaults use coherent ids sampled from the model: "
                        "python -c \"import numpy, pysmoe.routing as r; numpy.save('ids.npy', "
                        "r.coherent_prompt('VAULT', 1024))\"")
    p.add_argument("--context", type=positive_int, default=None, help="KV length (default: the longest prompt, decode prompt + decode tokens, or budget prompt + "
                        "decode tokens, whichever is most, + 1)")
    p.add_argument("--kv-dtype", choices=("f32", "bf16", "f16"), default=None,
                   help="KV cache element type of every session (default: the library's)")
    p.add_argument("--strict", action="store_true", help="exit 3 if any cold run or probe lacked Direct I/O")
    p.add_argument("--json", metavar="OUT", help="write every run and the medians to this JSON file")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _write_json(path, res: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, path)


def run(args, sweep=None) -> int:
    """The benchmark of the parsed options; sweep: pysmoe.bench.run_bench's (bench/disk_floor.py
    passes its floor sweep)."""
    from ..bench import format_table, load_prompt_ids, run_bench
    if args.repeats < 1:
        print("pysmoe bench: --repeats must be ≥ 1", file=sys.stderr)
        return 2
    if args.no_ttft and not args.decode_budgets:
        print("pysmoe bench: --no-ttft leaves nothing to run without --decode-budgets", file=sys.stderr)
        return 2
    if args.decode_budgets and (args.decode_tokens < 1 or args.budget_prompt < 1):
        print("pysmoe bench: --decode-budgets needs --decode-tokens ≥ 1 and --budget-prompt ≥ 1", file=sys.stderr)
        return 2
    prompt_ids = None
    if args.prompt_ids:
        from ..engine import open_vault
        with open_vault(args.vault) as v:
            vocab = v.config["vocab_size"]
        try:
            prompt_ids = load_prompt_ids(args.prompt_ids, vocab)
        except (OSError, ValueError) as e:
            print(f"pysmoe bench: --prompt-ids: {e}", file=sys.stderr)
            return 2
        need = max(list(args.prompt_lengths) + [args.decode_prompt, args.budget_prompt if args.decode_budgets else 0])
        if len(prompt_ids) < need:
            print(f"pysmoe bench: --prompt-ids holds {len(prompt_ids)} ids, the longest prompt needs {need}",
                  file=sys.stderr)
            return 2
    cache_bytes = int(args.cache_mb * MiB) if args.cache_mb is not None else None
    cache_frac = args.cache_frac if args.cache_frac is not None else 0.1
    log = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    if (not args.no_resident and not args.no_ttft) or args.decode_budgets:
        # The resident session (and a large budget of the curve) holds every expert: on a shared
        # machine short of memory, let the kernel's OOM killer take this benchmark rather than
        # someone else's work.
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
        except OSError:
            pass
    res = run_bench(args.vault, args.prompt_lengths, paths=args.paths, repeats=args.repeats, cache_bytes=cache_bytes,
                    cache_frac=cache_frac, chunk=args.chunk, threads=args.threads, io_threads=args.io_threads,
                    decode_tokens=args.decode_tokens, decode_prompt=args.decode_prompt,
                    serial_max_len=args.serial_max_len, resident=not args.no_resident,
                    resident_bytes=int(args.resident_mb * MiB) if args.resident_mb is not None else None,
                    probe_bytes=int(args.probe_mb * MiB), seed=args.seed, context=args.context, log=log,
                    ttft=not args.no_ttft, decode_budgets=args.decode_budgets, budget_prompt=args.budget_prompt,
                    prompt_ids=prompt_ids, verify_blobs=args.verify_blobs, kv_dtype=args.kv_dtype,
                    coalesce_bytes=int(args.coalesce_mb * MiB) if args.coalesce_mb is not None else None,
                    sweep=sweep, checkpoint=(lambda partial: _write_json(args.json, partial)) if args.json else None)
    print(format_table(res))
    if not res["direct_io_everywhere"]:
        print("pysmoe bench: WARNING: O_DIRECT was not in force for every cold run; see the table", file=sys.stderr)
    if args.json:
        _write_json(args.json, res)
    if args.strict and not res["direct_io_everywhere"]:
        return 3
    return 0
