/* cpu.c — the runtime half of the instruction-set choice (kernels_isa.h is the build-time half).
 *
 * An x86-64 build is compiled with -mavx2 -mfma -mf16c for every file, so the compiler may use
 * those instructions anywhere, not only in kernels_avx2.c; on a CPU without them the library
 * would die of SIGILL at some unpredictable point. So the first entry points a program calls
 * (smoe_open_vault, smoe_session_new) call smoe_cpu_check before anything else, and this file is
 * compiled for the baseline x86-64 instruction set whatever the flags say (the pragma below), so
 * the check itself cannot be the instruction that faults. smoe_fail is safe to call from here: it
 * takes no floating-point arguments, so its variadic prologue saves no vector registers, and the
 * formatting is libc's.
 *
 * The check is a few loads of the compiler runtime's CPU model: cheap, and not on any hot path.
 *
 * An AArch64 build needs no check: its NEON kernels use only what ARMv8.0-A makes mandatory
 * (Advanced SIMD with float FMA and half-precision conversion), so smoe_cpu_check is SMOE_OK. */
#include "cpu.h"

#include "internal.h"
#include "kernels_isa.h"

#if SMOE_HAVE_AVX2 && defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC target("no-avx,no-avx2,no-fma,no-f16c")
#endif

#ifdef SMOE_CPU_TEST_HOOKS
int smoe_cpu_test_lacks_isa;
#endif

#if SMOE_HAVE_AVX2
static int cpu_has_isa(void) {
#ifdef SMOE_CPU_TEST_HOOKS
    if (smoe_cpu_test_lacks_isa) return 0;
#endif
    __builtin_cpu_init();
    /* GCC and Clang report AVX only when the OS saves the YMM state too (XGETBV) */
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#endif

smoe_status smoe_cpu_check(void) {
#if SMOE_HAVE_AVX2
    if (!cpu_has_isa())
        return smoe_fail(SMOE_ERR_UNSUPPORTED, "this libsmoe was built for AVX2+FMA (x86-64-v3); this CPU lacks it; "
                                               "rebuild with make PORTABLE=1");
#endif
    return SMOE_OK;
}

#if SMOE_HAVE_AVX2 && defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
