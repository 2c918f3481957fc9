"""The names of staging directories: where a vault is written before it is renamed into place
(pysmoe.vaultdir.staged), and so what an interrupted write leaves behind, which open_vault
refuses by its name (completion *is* the rename; docs/vault.md, "Writing one").

    .NAME.incomplete-XXXXXXXX   the new vault being written beside NAME
    .NAME.replaced-XXXXXXXX     the old vault, renamed aside while the new one takes its name
"""
from __future__ import annotations

import pathlib
import re

from .errors import VaultError

INCOMPLETE = ".incomplete-"
REPLACED = ".replaced-"
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?:incomplete|replaced)-[A-Za-z0-9_]+$")


def leftover_of(path) -> str | None:
    """The vault name a leftover staging directory was meant to become, or None."""
    m = _LEFTOVER.match(pathlib.Path(path).name)
    return m.group("name") if m else None


def check_complete(path) -> None:
    """Raise VaultError if path is a staging directory an interrupted write left behind."""
    name = leftover_of(path)
    if name is not None:
        raise VaultError(f"{path}: incomplete vault (left by an interrupted write of {name!r}); "
                         f"delete it and write the vault again")
