"""The built-in demo vault: made on first use under the user's cache folder."""
from __future__ import annotations

import os
import pathlib
import sys

DEMO_PRESET = "tiny"
DEMO_SEED = 0
DEMO_VERSION = 2  # bump when the synth output or the vault format changes (2: vault format 2)


def demo_vault_path() -> pathlib.Path:
    base = os.environ.get("PYSMOE_CACHE") or os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return pathlib.Path(base) / "pysmoe" / f"demo-{DEMO_PRESET}-s{DEMO_SEED}-v{DEMO_VERSION}"


def ensure_demo_vault() -> pathlib.Path:
    """The demo vault's path, making it first if it is not there (written aside, then renamed,
    so an interrupted run never leaves half a vault behind)."""
    path = demo_vault_path()
    if (path / "vault.bin").exists():
        return path
    from .synthesis import synth
    print(f"making the demo vault ({DEMO_PRESET} preset) in {path} ...", file=sys.stderr)
    # force: whatever is there without a vault.bin is not a vault worth keeping
    return synth(path, preset=DEMO_PRESET, seed=DEMO_SEED, force=True)
