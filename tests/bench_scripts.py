"""bench/'s scripts as modules, for the tests of the code they hold (bench/ is a folder of
scripts, not a package: the research code it keeps out of pysmoe is tested from here)."""
from __future__ import annotations

import importlib.util
import pathlib

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


def load(name: str):
    """bench/NAME.py imported as the module bench_NAME (a fresh module each call)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
