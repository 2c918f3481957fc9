"""The kernels, the worker pool and the sampler through their C tests.

tests/c/test_kernels.c, tests/c/test_ggml.c (the GGML block formats' products), tests/c/test_kernels_neon.c,
tests/c/test_pool_sample.c and
tests/c/test_checksum.c and tests/c/test_threads.c (with the whole engine, as test_paths.c) are compiled
here with gcc against the csrc files they need (csrc/cpu's kernels, cpu.c and pool.c, csrc/engine/sample.c,
csrc/util.c) with the engine's flags, and run. Builds:

    O2, O3        the engine's flags; the vector-extension lane loops; on x86-64 the AVX2 kernels,
                  on arm64 the NEON ones (test_kernels_neon has nothing to test elsewhere; `make
                  neon-check` runs it for arm64 under qemu)
    scalar        -DSMOE_KERNELS_SCALAR: the plain-C lane loops, which must give the same bits
    avx512emu     kernels_avx512.c on plain-C stand-ins for its intrinsics (tests/c/avx512_emu.h),
                  dispatched as on a CPU with AVX512-VNNI: its logic, bit for bit, on any x86-64
    portable      what `make PORTABLE=1` compiles: -DSMOE_PORTABLE, no -mavx2 (the reference
                  kernels are then the dispatched ones)
    nofutex       -DSMOE_NO_FUTEX: the pool's condition-variable path (what macOS runs)
    nohwcrc       -DSMOE_NO_HW_CRC: smoe_checksum without the CRC32C instructions (table only)
    asan          AddressSanitizer + UBSan
    tsan          ThreadSanitizer (pool and sampler only; slow)

test_kernels prints a checksum of the reference kernels' outputs, which every build must print
the same, and one of the dispatched kernels' outputs, the same in every build of one instruction
set (and equal to the reference checksum in the portable build).
"""

import os
import platform
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
LIB_SOURCES = [CSRC / name for name in ("cpu/kernels.c", "cpu/kernels_ref.c", "cpu/kernels_avx2.c",
                                        "cpu/kernels_avx512.c", "cpu/kernels_neon.c", "cpu/cpu.c", "cpu/pool.c",
                                        "engine/sample.c", "util.c")]
# the whole library as the Makefile builds it without CUDA: csrc/, csrc/engine/, csrc/cpu/
ALL_SOURCES = sorted(p for d in ("", "engine", "cpu") for p in (CSRC / d).glob("*.c"))
FLAGS = ["-std=c11", "-Wall", "-Wextra", "-Werror", "-pthread", "-ffp-contract=off", "-D_GNU_SOURCE", f"-I{CSRC}"]
X86 = platform.machine() in ("x86_64", "AMD64")
ARM64 = platform.machine() in ("aarch64", "arm64")
ISA = "avx2" if X86 else "neon" if ARM64 else "portable"  # what the non-portable builds dispatch to
ISA_FLAGS = ["-mavx2", "-mfma", "-mf16c"] if X86 else []
BUILDS = {
    "O2": ["-O2"],
    "O3": ["-O3"],
    "scalar": ["-O2", "-DSMOE_KERNELS_SCALAR"],
    "portable": ["-O2", "-DSMOE_PORTABLE=1"],
    "cpuhook": ["-O2", "-DSMOE_CPU_TEST_HOOKS"],
    "nofutex": ["-O2", "-DSMOE_NO_FUTEX"],
    "nohwcrc": ["-O2", "-DSMOE_NO_HW_CRC"],
    # kernels_avx512.c on tests/c/avx512_emu.h's plain-C intrinsics, dispatched as if the CPU had
    # AVX-512 + VNNI: its logic checked bit for bit where the CPU lacks AVX-512 (x86-64 only)
    "avx512emu": ["-O2", "-DSMOE_AVX512_EMULATE", "-Wno-psabi", f"-I{ROOT / 'tests' / 'c'}"],
    "asan": ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
    "tsan": ["-O1", "-g", "-fsanitize=thread"],
}
SANITIZER_RUNS = "1000"  # consecutive pool runs per thread count under a sanitizer (10,000 otherwise)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """make(program, variant) -> the test program built. Each engine source is compiled once per
    variant (objects shared by every program of that variant, the missing ones compiled side by
    side, a process a core), so a variant's programs pay for the engine once, not once each."""
    assert shutil.which("gcc"), "gcc is needed to build the C unit tests"
    out = tmp_path_factory.mktemp("c_units")
    built, objects = {}, {}

    def compile_cmd(variant: str, *args: str) -> list:
        isa = [] if variant == "portable" else ISA_FLAGS
        return ["gcc", *FLAGS, *isa, *BUILDS[variant], *args]

    def gcc(cmd: list) -> None:
        r = subprocess.run(cmd, capture_output=True, text=True, env=_no_preload())
        assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr}"

    def objs(variant: str, sources: list) -> list:
        todo = []
        for src in sources:
            if (src, variant) not in objects:
                o = out / variant / (str(src.relative_to(CSRC)).replace("/", "_")[:-2] + ".o")
                o.parent.mkdir(exist_ok=True)
                todo.append((src, o))
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as ex:
            list(ex.map(lambda so: gcc(compile_cmd(variant, "-c", str(so[0]), "-o", str(so[1]))), todo))
        for src, o in todo:
            objects[(src, variant)] = o
        return [objects[(src, variant)] for src in sources]

    def make(program: str, variant: str) -> Path:
        key = (program, variant)
        if key not in built:
            exe = out / f"{program}_{variant}"
            # the CPU-check build and test_paths link the whole engine (smoe_open_vault etc.)
            whole = variant == "cpuhook" or program in ("test_paths", "test_threads")
            linked = objs(variant, ALL_SOURCES if whole else LIB_SOURCES)
            gcc(compile_cmd(variant, str(ROOT / "tests" / "c" / f"{program}.c"), *map(str, linked), "-lm", "-o",
                            str(exe)))
            built[key] = exe
        return built[key]

    return make


def _no_preload() -> dict:
    """The environment without what `make asan` preloads: the C test programs carry their own
    sanitizer runtimes, and gcc under a preloaded ASan runtime runs many times slower."""
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def run(exe: Path, *args: str, timeout: float = 300) -> str:
    r = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout, env=_no_preload())
    assert r.returncode == 0, f"{exe.name} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r.stdout


def _cpu_flags() -> set:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@pytest.mark.parametrize("variant", ["O2", "O3", "scalar", "portable", "asan"])
def test_kernels(build, variant):
    out = run(build("test_kernels", variant))
    assert "test_kernels: ok" in out
    assert f"isa {ISA if variant != 'portable' else 'portable'}" in out
    if X86 and variant != "portable":
        # every qx instance the CPU runs was checked bit for bit; one it lacks says it was skipped
        # (Linux lists the AVX-512 flags only where the OS enables the ZMM state)
        flags = _cpu_flags()
        has512 = {"avx512f", "avx512bw", "avx512vl"} <= flags
        for name, present in (("avx2", True), ("avx-vnni", "avx_vnni" in flags), ("avx512", has512),
                              ("avx512vnni", has512 and "avx512_vnni" in flags), ("avx512-few", has512),
                              ("avx512vnni-few", has512 and "avx512_vnni" in flags),
                              ("amx", has512 and {"amx_tile", "amx_int8"} <= flags),
                              ("amx-packed", has512 and {"amx_tile", "amx_int8"} <= flags)):
            assert f"qx instance {name}: {'checked' if present else 'skipped'}" in out, out
        amx = has512 and {"amx_tile", "amx_int8"} <= flags
        assert f"amx tile configuration kept: {'checked' if amx else 'skipped'}" in out, out


@pytest.mark.parametrize("variant", ["O2", "asan"])
def test_ggml_kernels(build, variant):
    """The GGML block formats' products (f32 and 8-bit activations): reference against double,
    dispatched against the reference bit for bit (8-bit activations), batches and row cuts."""
    out = run(build("test_ggml", variant))
    assert "test_ggml: ok" in out and f"isa {ISA}" in out
    if X86:  # the AVX-VNNI instance too, where the CPU has it
        assert ("ggml qx instance avx-vnni: checked" in out) == ("avx_vnni" in _cpu_flags()), out
        flags = _cpu_flags()
        has512vnni = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags
        assert ("ggml qx instance avx512vnni: checked" in out) == has512vnni, out


@pytest.mark.skipif(not X86, reason="the AVX-512 kernels are x86-64's")
def test_kernels_avx512_logic_emulated(build):
    out = run(build("test_kernels", "avx512emu"))
    assert "test_kernels: ok" in out
    assert "qx instance avx512: checked" in out and "qx instance avx512vnni: checked" in out, out
    assert "qx instance avx512-few: checked" in out and "qx instance avx512vnni-few: checked" in out, out
    assert "qx instance amx: checked" in out and "qx instance amx-packed: checked" in out, out
    assert "amx tile configuration kept: checked" in out, out  # the caller's tile state given back


@pytest.mark.parametrize("variant", ["O2", "O3", "asan"])
def test_kernels_neon(build, variant):
    out = run(build("test_kernels_neon", variant))
    assert ("test_kernels_neon: ok" if ARM64 else "test_kernels_neon: skipped") in out


def checksums(out: str) -> dict:
    return dict(ln.split() for ln in out.splitlines() if ln.startswith("checksum"))


def test_kernels_same_bits_in_every_build(build):
    variants = ("O2", "O3", "scalar", "portable") + (("avx512emu",) if X86 else ())
    sums = {v: checksums(run(build("test_kernels", v))) for v in variants}
    # the reference kernels: one set of bits whatever the flags and the instruction set
    # (twice: group 64 with f16/bf16 scales, and the other groups and f32 scales)
    for key in ("checksum", "checksum_groups"):
        assert len({s[key] for s in sums.values()}) == 1, sums
        # the dispatched kernels: one set of bits per instruction set
        assert len({sums[v][key + "_fast"] for v in set(variants) - {"portable"}}) == 1, sums
        assert sums["portable"][key + "_fast"] == sums["portable"][key]


def test_cpu_check_refuses_before_any_avx2(build):
    """A CPU without AVX2 gets SMOE_ERR_UNSUPPORTED and a message from the first entry points."""
    assert "test_kernels cpu: ok" in run(build("test_kernels", "cpuhook"), "cpu")


@pytest.mark.parametrize("vault", ["tiny_vault", "tiny_vault_f32"])
def test_paths_program(build, vault, request):
    """tests/c/test_paths.c (layer-major against token-serial from C, what `make neon-check` runs
    for arm64 under qemu) on this host, so that the program keeps building and passing."""
    assert "test_paths: ok" in run(build("test_paths", "O2"), str(request.getfixturevalue(vault)), "40")


@pytest.mark.parametrize("variant", ["O2", "asan"])
def test_threads_program(build, variant, tiny_vault):
    """tests/c/test_threads.c: concurrent calls on one session are refused (SMOE_ERR_BUSY), a
    cancel from another thread stops a prefill with the position kept (smoe.h, Threading)."""
    assert "test_threads: ok" in run(build("test_threads", variant), str(tiny_vault))


@pytest.mark.slow
def test_threads_program_tsan(build, tiny_vault):
    assert "test_threads: ok" in run(build("test_threads", "tsan"), str(tiny_vault), timeout=600)


@pytest.mark.parametrize("variant", ["O2", "nofutex", "asan"])
def test_pool_and_sampler(build, variant):
    args = [SANITIZER_RUNS] if variant == "asan" else []
    assert "test_pool_sample: ok" in run(build("test_pool_sample", variant), *args)


@pytest.mark.slow
def test_pool_and_sampler_tsan(build):
    assert "test_pool_sample: ok" in run(build("test_pool_sample", "tsan"), SANITIZER_RUNS, timeout=600)


@pytest.mark.parametrize("variant", ["O2", "portable", "nohwcrc", "asan"])
def test_checksum(build, variant):
    """tests/c/test_checksum.c: the hardware CRC32C (SSE4.2 / ARMv8, when the CPU has it) and the
    table agree with a bitwise CRC-32C and the 4-lane definition, on every length 0..300 and
    random lengths up to 100k at misaligned addresses."""
    out = run(build("test_checksum", variant))
    assert "test_checksum: ok" in out
    if variant == "nohwcrc":
        assert "impl table" in out
    elif X86 and variant != "asan":
        assert "impl sse4.2" in out  # every x86-64 CPU that runs the AVX2 build has SSE4.2
