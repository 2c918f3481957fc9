"""Random corruptions of vault.bin's header and tables give the pure-Python reader's VaultError,
never another exception (tests/fuzz_vaultio.py's mutations; `make fuzz` runs many more)."""
import random
import shutil

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz_vaultio import check, mutate


@settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 2**64 - 1))
def test_mutated_vault_reads_or_is_a_vault_error(tiny_vault, tmp_path_factory, seed):
    work = tmp_path_factory.mktemp("vaultio_fuzz")
    for name in ("config.json", "tokenizer.json"):
        if (tiny_vault / name).exists():
            shutil.copy(tiny_vault / name, work / name)
    (work / "vault.bin").write_bytes(mutate((tiny_vault / "vault.bin").read_bytes(), random.Random(seed)))
    check(work)  # raises anything but VaultError
