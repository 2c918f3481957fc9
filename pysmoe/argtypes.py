"""argparse `type=` functions, so that a bad option value is a usage error (exit 2, one line)
and never reaches the engine as a traceback; and the help formatter every subcommand uses.

Upper bounds are the C ABI's field widths (uint32 counts, uint64 seed and byte budgets): larger
values would not fit the struct, so they are usage errors too. What the engine refuses within
those widths (a chunk larger than it supports, say) is its own one-line error (exit 1)."""
from __future__ import annotations

import argparse
import math
import pathlib

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
    from .vaultdir import TargetError, check_target
    try:
        check_target(text, force=True)
    except TargetError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return pathlib.Path(text).expanduser()


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" after an option's help, except where there is nothing to show (no
    default, a flag) or the help already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action)
