"""Random corruptions of vault.bin's header and tables give the pure-Python reader's VaultError,
never another exception (tests/fuzz_vaultio.py's mutations; `make fuzz` runs many more), and the
crash that fuzzer once found, replayed."""
import pathlib
import random
import shutil
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pysmoe
from fuzz_vaultio import check, mutate
from pysmoe.errors import VaultError
from pysmoe.vaultio import VaultFormatError, checksum, info, read_vault

# tests/fuzz_vaultio.py's iteration 4 with seed 0 (make fuzz) on the tiny preset's vault.bin when
# vaults were version 1: eight bytes changed, among them the '.' of layers.2.mlp.up_proj's name
# (now b"layers.2.mlp\xc5up_proj"), on which read_vault raised UnicodeDecodeError instead of a
# VaultError (fixed in 55b88f8, which committed the file at the repository root).
CRASH = pathlib.Path(__file__).parent / "data" / "vaultio-crash-v1-nonascii-tensor-name.bin"


@settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 2**64 - 1))
def test_mutated_vault_reads_or_is_a_vault_error(tiny_vault, tmp_path_factory, seed):
    work = tmp_path_factory.mktemp("vaultio_fuzz")
    for name in ("config.json", "tokenizer.json"):
        if (tiny_vault / name).exists():
            shutil.copy(tiny_vault / name, work / name)
    (work / "vault.bin").write_bytes(mutate((tiny_vault / "vault.bin").read_bytes(), random.Random(seed)))
    check(work)  # raises anything but VaultError


def as_version_2(data: bytes) -> bytes:
    """A version-1 vault.bin as version 2 reads it (docs/vault.md): the version field 2, each q8/q4
    tensor descriptor's group_size (a reserved 0 in version 1, whose groups were all 64) 64, and
    header_crc recomputed with version 2's checksum. The dense and blob checksums stay version 1's."""
    b = bytearray(data)
    struct.pack_into("<I", b, 8, 2)
    table_offset, table_bytes = struct.unpack_from("<QQ", b, 24)
    n_tensors = struct.unpack_from("<I", b, 60)[0]
    layers = struct.unpack_from("<I", b, table_offset + 8)[0]
    desc = table_offset + 96 + -(-layers // 8) * 8
    for k in range(3 + n_tensors):  # the expert blob's gate, up, down, then the dense tensors
        d = desc + 64 * k
        if b[d + 40] in (2, 3):  # q8, q4
            struct.pack_into("<H", b, d + 42, 64)
    b[12:16] = bytes(4)
    struct.pack_into("<I", b, 12, checksum(bytes(b[:table_offset + table_bytes])))
    return bytes(b)


def vault_dir(tmp_path, data: bytes) -> pathlib.Path:
    d = tmp_path / "v"
    d.mkdir()
    (d / "vault.bin").write_bytes(data)
    return d


def test_crash_file_replayed_is_a_vault_error(tmp_path):
    d = vault_dir(tmp_path, CRASH.read_bytes())
    for reader in (read_vault, info):
        with pytest.raises(VaultFormatError, match="version 1 is no longer supported"):
            reader(d)
    assert check(d) is False
    with pytest.raises(VaultError, match="version 1 is no longer supported"):
        pysmoe.open_vault(d)


def test_crash_file_in_version_2_reaches_the_bad_name_and_is_a_vault_error(tmp_path):
    """Past the version check, the replay gets to the descriptor that crashed the reader."""
    data = as_version_2(CRASH.read_bytes())
    assert b"layers.2.mlp\xc5up_proj\0" in data
    d = vault_dir(tmp_path, data)
    for reader in (read_vault, info):
        with pytest.raises(VaultFormatError, match=r"corrupt header or tables \(UnicodeDecodeError"):
            reader(d)
    assert check(d) is False
    with pytest.raises(VaultError):  # the C parser, stricter, stops at an earlier changed byte
        pysmoe.open_vault(d)
    # The name put right, the reader goes on to the next changed bytes (the high word of
    # layers.3.q_proj's offset): what stopped it above was the name.
    (d / "vault.bin").write_bytes(as_version_2(CRASH.read_bytes().replace(b"mlp\xc5up_proj", b"mlp.up_proj")))
    with pytest.raises(VaultFormatError, match="tensor layers.3.q_proj outside the dense region"):
        read_vault(d)


def test_a_linear_layer_without_its_sizes_is_a_vault_error(tiny_vault, tmp_path):
    """A layer kind turned to linear attention (a Gated DeltaNet) in a vault without the linear_*
    sizes: refused as vault.c refuses it, not a KeyError in info (the mutation hypothesis found,
    seed 1064407)."""
    shutil.copy(tiny_vault / "config.json", tmp_path / "config.json")
    (tmp_path / "vault.bin").write_bytes(mutate((tiny_vault / "vault.bin").read_bytes(), random.Random(1064407)))
    with pytest.raises(VaultFormatError, match="linear_"):
        read_vault(tmp_path)
