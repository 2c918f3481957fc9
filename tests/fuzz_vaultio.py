"""Mutation fuzzing of the pure-Python vault reader (pysmoe/vaultio.py: read_vault, info).

    python tests/fuzz_vaultio.py ITERS VAULT_DIR [OUT_DIR [SEED]]   (`make fuzz` runs it after the C fuzzer)

Each iteration copies VAULT_DIR's vault.bin with a few bytes of its header and tables changed
(or a whole 4-byte word, or the file cut short), then read_vault and info must either succeed or
raise VaultError: any other exception is a bug, and the input that raised it is kept as
OUT_DIR/vaultio-crash-SEED-ITERATION.bin (a vault.bin: replay it with check()). The mutations come
from random.Random(SEED) (default 0): a run is reproducible. Everything it writes is under OUT_DIR
(default build/fuzz in the repository): the work vault in a temporary directory there, removed at
the end, and a crash file. tests/test_vaultio_fuzz.py runs the same check under hypothesis, and
tests/test_fuzz.py a short run of main, in the test suite.
"""
from __future__ import annotations

import pathlib
import random
import shutil
import sys
import tempfile

from pysmoe.errors import VaultError
from pysmoe.vaultio import info, read_vault


def head_bytes(data: bytes) -> int:
    """End of the header and tables (table_offset + table_bytes, u64s at bytes 24 and 32 of the
    header: docs/vault.md), what mutations aim at; the first 4 KiB if that is nonsense."""
    import struct
    off, n = struct.unpack_from("<QQ", data, 24)
    return off + n if 0 < off + n <= len(data) else min(len(data), 4096)


def mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    end = head_bytes(data)
    for _ in range(rng.randint(1, 4)):
        pos = rng.randrange(end)
        if rng.random() < 0.5 or pos - pos % 4 + 4 > len(b):
            b[pos] = rng.randrange(256)
        else:
            w = pos - pos % 4
            v = rng.getrandbits(32) if rng.random() < 0.3 else rng.randrange(70000)
            b[w:w + 4] = v.to_bytes(4, "little")
    if rng.random() < 0.1:
        del b[rng.randrange(len(b) + 1):]
    return bytes(b)


def check(vault_dir: pathlib.Path) -> bool:
    """read_vault and info on vault_dir: True if it read, False on VaultError; raises otherwise."""
    try:
        v = read_vault(vault_dir)
        v.close()
        info(vault_dir)
        return True
    except VaultError:
        return False


OUT_DIR = pathlib.Path(__file__).resolve().parent.parent / "build" / "fuzz"


def main(iters: int, src, out_dir=OUT_DIR, seed: int = 0) -> int:
    """iters mutations of src's vault.bin through check(); the number that read. Raises what
    check() raised, with the input kept in out_dir."""
    rng = random.Random(seed)
    src = pathlib.Path(src)
    src_dir = src.parent if src.name == "vault.bin" else src
    data = (src_dir / "vault.bin").read_bytes()
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vaultio-", dir=out_dir) as tmp:
        work = pathlib.Path(tmp) / "v"
        shutil.copytree(src_dir, work)
        read = 0
        for i in range(iters):
            bad = mutate(data, rng)
            (work / "vault.bin").write_bytes(bad)
            try:
                read += check(work)
            except Exception:
                keep = out_dir / f"vaultio-crash-{seed}-{i}.bin"
                keep.write_bytes(bad)
                print(f"iteration {i}: not a VaultError; input kept in {keep}", file=sys.stderr)
                raise
    print(f"{src_dir}: {iters} mutations through read_vault and info, {read} read")
    return read


if __name__ == "__main__":
    if not 3 <= len(sys.argv) <= 5:
        sys.exit(f"usage: {sys.argv[0]} ITERS VAULT_DIR [OUT_DIR [SEED]]")
    a = sys.argv[1:]
    main(int(a[0]), a[1], a[2] if len(a) > 2 else OUT_DIR, int(a[3]) if len(a) > 3 else 0)
