#!/bin/sh
# neon_check.sh — the C tests cross-built for AArch64 (so with the NEON kernels) and run under
# qemu-aarch64 user emulation. `make neon-check` runs it; so can a person, from the repository root.
#
#   1. every library C file (csrc/, csrc/engine/, csrc/cpu/) compiles for aarch64 with -Werror (the library as the Makefile builds it);
#   2. tests/c/test_kernels.c, built -O2, -O3, -DSMOE_KERNELS_SCALAR and -DSMOE_PORTABLE: every
#      build passes; the reference kernels print one checksum in all four, the dispatched (NEON)
#      kernels one checksum in the three NEON builds;
#   3. tests/c/test_kernels_neon.c (the NEON kernels against the reference, n- and split-
#      independence), -O2 and -O3 with one checksum, under ASan + UBSan where the cross
#      toolchain has their runtimes, and built by clang where there is one (the same checksum);
#   4. tests/c/test_ggml.c (the GGML block formats' products), tests/c/test_pool_sample.c and
#      tests/c/test_streamer.c (every test name);
#   5. tests/c/test_paths.c: the whole engine, layer-major against token-serial bit for bit, on
#      tiny vaults written by the host's Python (skipped, with a message, without $PY).
#
# Static linking (-static) keeps qemu from needing an aarch64 sysroot, except for the sanitizer
# build, which is dynamic and runs with QEMU_LD_PREFIX. qemu gives no speed figures worth
# reading: this checks arithmetic and behaviour, not performance.
#
# Without the tools it says so and exits 0, so it is safe to call anywhere (CI does not: it
# would need apt-get install gcc-aarch64-linux-gnu qemu-user).
#
# Environment: CROSS (default aarch64-linux-gnu-gcc), QEMU (qemu-aarch64 or qemu-aarch64-static),
# OUT (default build/neon-check), PY (default .venv/bin/python).
set -eu

CROSS=${CROSS:-aarch64-linux-gnu-gcc}
QEMU=${QEMU:-}
if [ -z "$QEMU" ]; then
    for q in qemu-aarch64 qemu-aarch64-static; do
        if command -v "$q" >/dev/null 2>&1; then QEMU=$q; break; fi
    done
fi
if ! command -v "$CROSS" >/dev/null 2>&1 || [ -z "$QEMU" ] || ! command -v "$QEMU" >/dev/null 2>&1; then
    echo "neon-check skipped: no aarch64-linux-gnu-gcc / qemu-aarch64"
    echo "  (Debian/Ubuntu: apt-get install gcc-aarch64-linux-gnu qemu-user)"
    exit 0
fi

OUT=${OUT:-build/neon-check}
PY=${PY:-.venv/bin/python}
SYSROOT=${SYSROOT:-/usr/aarch64-linux-gnu}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

FLAGS="-std=c11 -Wall -Wextra -Werror -pthread -ffp-contract=off -D_GNU_SOURCE -DSMOE_BUILD -Icsrc"
NSRC="csrc/cpu/kernels.c csrc/cpu/kernels_ref.c csrc/cpu/kernels_neon.c csrc/cpu/cpu.c csrc/util.c" # test_kernels_neon's
KSRC="csrc/cpu/kernels.c csrc/cpu/kernels_ref.c csrc/cpu/kernels_neon.c csrc/cpu/kernels_avx2.c csrc/cpu/kernels_avx512.c csrc/cpu/cpu.c csrc/cpu/pool.c csrc/engine/sample.c csrc/util.c"
LIBSRC="$(ls csrc/*.c csrc/engine/*.c csrc/cpu/*.c)"

step() { printf '\n== %s\n' "$*"; }
fail() { echo "neon-check FAILED: $*" >&2; exit 1; }
build() { # build EXE FLAGS... SOURCES...
    exe=$1; shift
    # shellcheck disable=SC2086
    $CROSS $FLAGS "$@" -lm -o "$OUT/$exe" || fail "building $exe"
}
run() { # run EXE ARGS... : its output in $OUT/EXE.log, printed; fails on a non-zero exit
    exe=$1; shift
    if ! "$QEMU" "$OUT/$exe" "$@" >"$OUT/$exe.log" 2>&1; then
        cat "$OUT/$exe.log"
        fail "$exe $*"
    fi
    grep -v '^info:' "$OUT/$exe.log" || true
}
field() { sed -n "s/^$1 //p" "$OUT/$2.log"; } # field NAME EXE

echo "neon-check: $($CROSS --version | head -n 1); $($QEMU --version | head -n 1)"

step "library: every C file of csrc/, csrc/engine/, csrc/cpu/ for aarch64, -O3 -Werror"
rm -rf "$OUT/lib" && mkdir -p "$OUT/lib"
for f in $LIBSRC; do
    # shellcheck disable=SC2086
    $CROSS $FLAGS -fPIC -fvisibility=hidden -O3 -c "$f" -o "$OUT/lib/$(basename "$f" .c).o" || fail "compiling $f"
done
# shellcheck disable=SC2046
$CROSS -shared -o "$OUT/lib/libsmoe.so" $(ls "$OUT"/lib/*.o) -lm -pthread || fail "linking libsmoe.so"
echo "ok: $OUT/lib/libsmoe.so"

step "test_kernels: O2, O3, scalar lane loops, portable"
build tk_O2 -static -O2 tests/c/test_kernels.c $KSRC
build tk_O3 -static -O3 tests/c/test_kernels.c $KSRC
build tk_scalar -static -O2 -DSMOE_KERNELS_SCALAR tests/c/test_kernels.c $KSRC
build tk_portable -static -O2 -DSMOE_PORTABLE=1 tests/c/test_kernels.c $KSRC
for v in O2 O3 scalar portable; do
    run tk_$v
    want=neon; [ $v = portable ] && want=portable
    [ "$(field isa tk_$v)" = $want ] || fail "tk_$v: isa $(field isa tk_$v), expected $want"
done
ref=$(field checksum tk_O2)
for v in O3 scalar portable; do
    [ "$(field checksum tk_$v)" = "$ref" ] || fail "reference kernels: checksum of $v differs from O2"
done
fast=$(field checksum_fast tk_O2)
for v in O3 scalar; do
    [ "$(field checksum_fast tk_$v)" = "$fast" ] || fail "NEON kernels: checksum of $v differs from O2"
done
[ "$(field checksum_fast tk_portable)" = "$ref" ] || fail "portable build: dispatched kernels are not the reference"
echo "ok: reference checksum $ref in all four builds, NEON checksum $fast in O2, O3 and scalar"
# For information only (nothing promises it): an x86-64 host's AVX2 build of the same test. Where
# both instruction sets use the same stated order, the two print the same bits.
if [ "$(uname -m)" = x86_64 ] && command -v gcc >/dev/null 2>&1 &&
    gcc $FLAGS -O2 -mavx2 -mfma -mf16c tests/c/test_kernels.c $KSRC -lm -o "$OUT/tk_host" 2>/dev/null &&
    "$OUT/tk_host" >"$OUT/tk_host.log" 2>&1; then
    [ "$(field checksum tk_host)" = "$ref" ] && same_ref=same || same_ref=differs
    [ "$(field checksum_fast tk_host)" = "$fast" ] && same_fast=same || same_fast=differs
    echo "info: this host's $(field isa tk_host) build: reference checksum $same_ref, dispatched kernels' checksum $same_fast"
fi

step "test_kernels_neon: O2, O3, ASan + UBSan, clang"
build tkn_O2 -static -O2 tests/c/test_kernels_neon.c $NSRC
build tkn_O3 -static -O3 tests/c/test_kernels_neon.c $NSRC
run tkn_O2
run tkn_O3
[ "$(field checksum_neon tkn_O2)" = "$(field checksum_neon tkn_O3)" ] || fail "test_kernels_neon: O2 and O3 differ"
# shellcheck disable=SC2086
if $CROSS $FLAGS -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all tests/c/test_kernels_neon.c \
        $NSRC -lm -o "$OUT/tkn_asan" 2>"$OUT/tkn_asan.build.log" && [ -d "$SYSROOT" ]; then
    # LeakSanitizer needs ptrace, which qemu-user does not give
    (export QEMU_LD_PREFIX="$SYSROOT" ASAN_OPTIONS=detect_leaks=0 && run tkn_asan)
else
    echo "skipped: no aarch64 sanitizer runtime or sysroot ($OUT/tkn_asan.build.log)"
fi

# clang (what macOS builds with) must print the same bits: the order is the source's, not the compiler's
if command -v clang >/dev/null 2>&1 && [ -d "$SYSROOT/include" ]; then
    ok=1
    rm -rf "$OUT/clang" "$OUT/clang.build.log" && mkdir -p "$OUT/clang"
    for f in tests/c/test_kernels_neon.c $NSRC; do
        # shellcheck disable=SC2086
        clang --target=aarch64-linux-gnu --sysroot="$SYSROOT" -isystem "$SYSROOT/include" $FLAGS -O3 -c "$f" \
            -o "$OUT/clang/$(basename "$f" .c).o" 2>>"$OUT/clang.build.log" || ok=0
    done
    if [ $ok = 1 ] && $CROSS -static "$OUT"/clang/*.o -lm -o "$OUT/tkn_clang" 2>>"$OUT/clang.build.log"; then
        run tkn_clang
        [ "$(field checksum_neon tkn_clang)" = "$(field checksum_neon tkn_O2)" ] || fail "clang and gcc builds differ"
    else
        echo "skipped: clang cannot build for aarch64 here ($OUT/clang.build.log)"
    fi
else
    echo "skipped: no clang (the same test built by clang, compared bit for bit)"
fi

step "test_ggml: the GGML block formats' products (NEON against the reference, bit for bit), O2 (with and without SDOT) and portable"
build tg_O2 -static -O2 tests/c/test_ggml.c $KSRC
build tg_portable -static -O2 -DSMOE_PORTABLE=1 tests/c/test_ggml.c $KSRC
run tg_O2
SMOE_NO_DOTPROD=1 run tg_O2 # the widening instance where the emulated CPU has SDOT
run tg_portable
[ "$(field isa tg_O2)" = neon ] || fail "tg_O2: isa $(field isa tg_O2), expected neon"

step "test_pool_sample, test_streamer"
build tps -static -O2 tests/c/test_pool_sample.c $KSRC
run tps
build tst -static -O2 -DSMOE_STREAMER_TEST_HOOKS csrc/streamer.c csrc/retention.c csrc/util.c tests/c/test_streamer.c
mkdir -p build-tests
for t in basic script topk_pool quota truncate verify direct stress; do
    d=$(mktemp -d build-tests/neon-streamer-XXXXXX) # on the repository's disk: O_DIRECT is tested
    if [ -d /dev/shm ]; then run tst "$t" "$d" /dev/shm; else run tst "$t" "$d"; fi
    rm -rf "$d"
done

step "test_paths: the engine, layer-major against token-serial"
# shellcheck disable=SC2046
build tpaths -static -O2 tests/c/test_paths.c $LIBSRC
if [ -x "$PY" ]; then
    rm -rf "$OUT/vaults"
    "$PY" - "$OUT/vaults" <<'EOF' || fail "writing the tiny vaults"
import sys
import pysmoe
from pysmoe import vaultio
out = sys.argv[1]
f32 = {role: "f32" for role in vaultio.ROLES}
mixed = {"attention": "bf16", "embed": "q4", "lm_head": "bf16", "mlp": "q4"}
pysmoe.synth(f"{out}/tiny", preset="tiny", seed=0, progress=False)
pysmoe.synth(f"{out}/tiny_f32", preset="tiny", seed=1, experts="f32", formats=f32, progress=False)
pysmoe.synth(f"{out}/tiny_mixed", preset="tiny", seed=2, experts="q8", formats=mixed, scale_dtype="bf16",
             progress=False)
EOF
    for v in tiny tiny_f32 tiny_mixed; do run tpaths "$OUT/vaults/$v" 40; done
    # the same with the NEON product's widening instance where the emulated CPU has SDOT
    for v in tiny tiny_mixed; do SMOE_NO_DOTPROD=1 run tpaths "$OUT/vaults/$v" 40; done
else
    echo "skipped: no $PY to write the vaults (make venv)"
fi

printf '\nneon-check: ok\n'
