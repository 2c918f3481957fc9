"""Writing a vault directory so that a good vault is never lost (docs/vault.md, "Writing one").

    with staged("models/a3b", force=args.force) as tmp:
        write_the_vault_into(tmp)

`staged` checks the target first: a file, a symbolic link, a parent that cannot be made, or a
non-empty directory without `force` is refused before anything is written. The vault is written
into a fresh directory beside the target, `.NAME.incomplete-XXXXXXXX` (same filesystem, so the
final rename is atomic); when the body returns, the new vault is synced, opened and checked
against its checksums, and renamed into place. With `force` an existing target is first renamed
aside (`.NAME.replaced-XXXXXXXX`), the new one renamed in, and only then the old one removed.
An exception (Ctrl-C included) removes the temporary directory; a kill -9 leaves it behind, and
`open_vault` refuses it as an "incomplete vault" by its name: completion *is* the rename.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import tempfile
from typing import Iterator

from .errors import SmoeError, VaultError
from .staging import INCOMPLETE, REPLACED, leftover_of


class TargetError(SmoeError, OSError):
    """A vault cannot be written at this path (a file, a link, a parent that cannot be made)."""


class TargetExists(TargetError, FileExistsError):
    """The target directory is not empty and `force` was not given."""


def check_target(target, force: bool = False) -> pathlib.Path:
    """The target as an absolute Path if a vault may be written there; TargetError if not."""
    target = pathlib.Path(target).expanduser().absolute()
    if target.is_symlink():
        raise TargetError(f"{target} is a symbolic link: give the directory it points to")
    if target.exists() and not target.is_dir():
        raise TargetError(f"{target} exists and is not a directory")
    if leftover_of(target) is not None:
        raise TargetError(f"{target}: that name is reserved for an interrupted write's leftovers")
    if target.is_dir() and not force and any(target.iterdir()):
        raise TargetExists(f"{target} is not empty: pass --force (force=True) to replace it")
    for parent in target.parents:  # the nearest existing ancestor must be a writable directory
        if parent.exists():
            if not parent.is_dir():
                raise TargetError(f"cannot make {target}: {parent} is not a directory")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise TargetError(f"cannot make {target}: {parent} is not writable")
            break
    return target


def _fsync_tree(root: pathlib.Path) -> None:
    # A rename is atomic, but without this a power cut right after it could expose files whose
    # data never reached the disk.
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(pathlib.Path(dirpath))


def _fsync_dir(path: pathlib.Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory; the data is synced anyway
        pass
    finally:
        os.close(fd)


def verify_new(path: pathlib.Path) -> None:
    """Open the vault at path with the C library and check every checksum (VaultError if bad).
    Without the library, at least parse it with the Python reader."""
    try:
        from .engine import Vault  # not open_vault: that refuses staging directories by name
    except ImportError:
        from .vaultio import read_vault
        read_vault(path).close()
        return
    with Vault(path) as v:
        bad = v.verify()
    if bad:
        where = ", ".join(f"{k} {l}/{e}" if k == "blob" else k for k, l, e in bad[:5])
        raise VaultError(f"the vault just written failed its checksums ({where}); nothing was replaced")


def _install(tmp: pathlib.Path, target: pathlib.Path, force: bool) -> None:
    try:
        os.rename(tmp, target)  # onto nothing or an empty directory: atomic
        return
    except OSError as e:
        if not (target.is_dir() and any(target.iterdir())):
            raise TargetError(f"cannot rename the new vault into {target}: {e.strerror}") from None
        if not force:  # it filled up while we wrote
            raise TargetExists(f"{target} is not empty: pass --force (force=True) to replace it") from None
    old = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}{REPLACED}", dir=target.parent))
    os.rename(target, old)  # onto the empty directory mkdtemp made
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(old, target)
        raise
    _fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged(target, force: bool = False) -> Iterator[pathlib.Path]:
    """Yield a fresh directory to write a vault into; on normal exit, verify it and rename it
    onto target (replacing a non-empty target only when force). On an exception, remove it."""
    target = check_target(target, force)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TargetError(f"cannot make {target.parent}: {e.strerror}") from None
    try:
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}{INCOMPLETE}", dir=target.parent))
    except OSError as e:
        raise TargetError(f"cannot write in {target.parent}: {e.strerror}") from None
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; a vault is an ordinary directory
        _fsync_tree(tmp)
        verify_new(tmp)
        _install(tmp, target, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

