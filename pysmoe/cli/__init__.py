"""python -m pysmoe run|chat|serve|synth|convert|info|verify|bench

One module of this package per subcommand (info and verify too), each with add_parser(p, name),
which puts the command's arguments on its own parser p, and run(args) -> exit status; args.py
holds what several of them share (argument types, option groups, the session they describe).
Building the parser imports each module and what its choices come from (synth's presets,
convert's formats), nothing more: the engine, the server and the work itself are imported when
the command runs. Bad usage prints the usage and exits 2, an engine error one line and exits 1."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS = {
    "run": ("pysmoe.cli.run", "generate from a prompt (no --vault: the built-in demo vault)"),
    "chat": ("pysmoe.cli.chat", "interactive chat with the vault's chat template"),
    "serve": ("pysmoe.cli.serve", "an OpenAI-compatible HTTP server (chat, completions, streaming)"),
    "synth": ("pysmoe.cli.synth", "make a random vault of a preset shape"),
    "convert": ("pysmoe.cli.convert", "import an MLX or Hugging Face Qwen3-MoE checkpoint into a vault"),
    "info": ("pysmoe.cli.info", "show a vault's config, sizes and formats"),
    "verify": ("pysmoe.cli.verify", "check every checksum of a vault"),
    "bench": ("pysmoe.cli.bench", "time to first token and decode speed, against the machine's limits"),
}
WRITERS = ("synth", "convert")  # commands that write a vault (pysmoe.vaultdir.staged)


class _Version(argparse.Action):
    """--version: pysmoe's and libsmoe's, the library loaded only when asked."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from .. import __version__
        try:
            from .._ffi import ffi, lib
            native = (f"libsmoe {ffi.string(lib.smoe_version()).decode()} (ABI {lib.smoe_abi_version()}; kernels "
                      f"{ffi.string(lib.smoe_kernels()).decode()})")
        except (ImportError, OSError) as e:
            native = f"libsmoe unavailable ({e})"
        print(f"pysmoe {__version__}, {native}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    from .args import HelpFormatter
    parser = argparse.ArgumentParser(prog="python -m pysmoe", description=__doc__.splitlines()[0],
                                     epilog="exit status: 0 ok, 1 engine error, 2 bad usage, 130 interrupted")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the engine's messages")
    parser.add_argument("--version", action=_Version, help="print pysmoe's and libsmoe's versions and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ImportError as e:  # a command whose module is missing still shows, and says why
            p = sub.add_parser(name, help=f"{help_text} (unavailable: {e})")
            p.set_defaults(_unavailable=str(e))
            continue
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        mod.add_parser(p, name)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="pysmoe: %(message)s")
    if getattr(args, "_unavailable", None):
        print(f"pysmoe {args.command}: unavailable: {args._unavailable}", file=sys.stderr)
        return 2
    from ..errors import SmoeError
    from ..vaultdir import TargetError
    try:
        return args._run(args) or 0
    except TargetError as e:  # where to write: a usage error, said before anything was written
        print(f"pysmoe {args.command}: error: {e}", file=sys.stderr)
        return 2
    except SmoeError as e:
        print(f"pysmoe {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except OSError as e:  # a full disk, a failed read or write: one line, not a traceback
        where = f": {e.filename}" if e.filename else ""
        kept = " (nothing was replaced: a vault already there is as it was)" if args.command in WRITERS else ""
        print(f"pysmoe {args.command}: error: {e.strerror or e}{where}{kept}", file=sys.stderr)
        return 1
