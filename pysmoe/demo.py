"""The built-in demo vault: a small Qwen3-MoE trained on the Python documentation, shipped in
pysmoe/data/demo/ (scripts/train_demo.py made it; docs/demo.md says how)."""
from __future__ import annotations

import pathlib

from .errors import VaultError

DEMO_DIR = pathlib.Path(__file__).resolve().parent / "data" / "demo"


def ensure_demo_vault() -> pathlib.Path:
    """The shipped demo vault's path; a VaultError if the installation lacks it."""
    if not (DEMO_DIR / "vault.bin").is_file():
        raise VaultError(f"the demo vault is missing from this installation ({DEMO_DIR}); "
                         "pass --vault, or rebuild it with scripts/train_demo.py")
    return DEMO_DIR
