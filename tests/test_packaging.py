"""pyproject.toml lists every package of pysmoe, so a wheel (not only an editable install) has them.

A subpackage missing from `[tool.setuptools] packages` is left out of a built wheel without an
error: pysmoe.textgen was, once. The demo vault's folder must be listed too (its files ride as
package data)."""
from __future__ import annotations

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_package_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "pysmoe").rglob("__init__.py")}
    assert found <= listed, f"not in pyproject.toml's packages: {sorted(found - listed)}"
    assert {"pysmoe.data", "pysmoe.data.demo"} <= listed


def test_demo_vault_is_package_data():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert data.get("pysmoe.data.demo") == ["*"]
    assert (ROOT / "pysmoe" / "data" / "demo" / "vault.bin").is_file()
