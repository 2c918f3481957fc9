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
 * The AVX-512 kernels (kernels_avx512.c) are optional: smoe_cpu_avx512 below says whether this
 * CPU and OS run them, and kernels.c asks it before each 8-bit-activation product.
 *
 * An AArch64 build needs no check: its NEON kernels use only what ARMv8.0-A makes mandatory
 * (Advanced SIMD with float FMA and half-precision conversion), so smoe_cpu_check is SMOE_OK; the
 * one optional instance (SDOT, ARMv8.2) is asked for by smoe_cpu_neon_dot below. */
#include "cpu.h"

#include "internal.h"
#include "kernels_isa.h"

#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if SMOE_HAVE_AVX512
#include <cpuid.h>
#endif
#if SMOE_HAVE_AMX
#include <sys/syscall.h>
#endif
#if SMOE_HAVE_NEON_DOT && !defined(__ARM_FEATURE_DOTPROD) && defined(__linux__)
#include <sys/auxv.h>
#endif

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

/* The AVX-512 half: cpuid leaf 7 for the features, and XCR0 for the OS's part — without bits 5–7
 * (opmask, the upper halves of ZMM0–15, ZMM16–31) set, a kernel's first AVX-512 instruction
 * would fault, whatever cpuid says. */
unsigned smoe_cpu_avx512_hw(void) {
#if defined(SMOE_AVX512_EMULATE) /* tests/c/avx512_emu.h: every instance runs, emulated */
    return SMOE_CPU_AVX512 | SMOE_CPU_AVX512VNNI;
#elif SMOE_HAVE_AVX512
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0; /* OSXSAVE: xgetbv works */
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    const unsigned f = b >> 16 & 1, bw = b >> 30 & 1, vl = b >> 31 & 1, vnni = c >> 11 & 1;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    (void)hi;
    if (!(f && bw && vl) || (lo & 0xe6u) != 0xe6u) return 0; /* + SSE (1) and AVX (2) state */
    return SMOE_CPU_AVX512 | (vnni ? SMOE_CPU_AVX512VNNI : 0);
#else
    return 0;
#endif
}

static bool env_set(const char *name) {
    const char *v = getenv(name);
    return v && *v && strcmp(v, "0") != 0;
}

static _Atomic int avx512_use = -1;

unsigned smoe_cpu_avx512(void) {
    int use = atomic_load_explicit(&avx512_use, memory_order_relaxed);
    if (use < 0) {
        use = env_set("SMOE_NO_AVX512") ? 0 : (int)smoe_cpu_avx512_hw();
        if (env_set("SMOE_NO_VNNI")) use &= ~SMOE_CPU_AVX512VNNI;
        atomic_store_explicit(&avx512_use, use, memory_order_relaxed);
    }
    return (unsigned)use;
}

/* AMX: cpuid leaf 7 EDX bits 24 (AMX-TILE) and 25 (AMX-INT8); XCR0 bits 17 and 18 (the tile
 * configuration and data); and Linux's grant of the tile data to this process (without it the
 * first tile instruction is killed with SIGILL). Asked at most once. */
#if SMOE_HAVE_AMX && !defined(SMOE_AVX512_EMULATE)
static _Atomic int amx_hw = -1;
#endif

bool smoe_cpu_amx_hw(void) {
#if defined(SMOE_AVX512_EMULATE) /* tests/c/avx512_emu.h emulates the tiles too */
    return true;
#elif SMOE_HAVE_AMX
    int have = atomic_load_explicit(&amx_hw, memory_order_acquire);
    if (have < 0) {
        have = 0;
        unsigned a, b, c, d;
        if (smoe_cpu_avx512_hw() & SMOE_CPU_AVX512) {
            __cpuid_count(7, 0, a, b, c, d);
            unsigned lo, hi;
            __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
            (void)hi;
            enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
            have = (d >> 24 & 1) && (d >> 25 & 1) && (lo & 0x60000u) == 0x60000u &&
                   syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        }
        atomic_store_explicit(&amx_hw, have, memory_order_release);
    }
    return have > 0;
#else
    return false;
#endif
}

bool smoe_cpu_neon_dot_hw(void) {
#if SMOE_HAVE_NEON_DOT && defined(__ARM_FEATURE_DOTPROD)
    return true; /* every CPU this build targets has it */
#elif SMOE_HAVE_NEON_DOT && defined(__linux__)
    enum { HWCAP_ASIMDDP_BIT = 1 << 20 }; /* asm/hwcap.h's HWCAP_ASIMDDP */
    return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP_BIT) != 0;
#else
    return false;
#endif
}

static _Atomic int neon_dot_use = -1;

bool smoe_cpu_neon_dot(void) {
    int use = atomic_load_explicit(&neon_dot_use, memory_order_relaxed);
    if (use < 0) {
        use = !env_set("SMOE_NO_DOTPROD") && smoe_cpu_neon_dot_hw();
        atomic_store_explicit(&neon_dot_use, use, memory_order_relaxed);
    }
    return use > 0;
}

static _Atomic int amx_use = -1;

bool smoe_cpu_amx(void) {
    int use = atomic_load_explicit(&amx_use, memory_order_relaxed);
    if (use < 0) {
        use = !env_set("SMOE_NO_AMX") && (smoe_cpu_avx512() & SMOE_CPU_AVX512) && smoe_cpu_amx_hw();
        atomic_store_explicit(&amx_use, use, memory_order_relaxed);
    }
    return use > 0;
}

/* The rest is asked for after smoe_cpu_check, so it is built with the build's flags: libc's
 * fortified open and read (_FORTIFY_SOURCE, the default of Ubuntu's gcc) are always-inline
 * functions that cannot be inlined into the baseline region above. */
#if SMOE_HAVE_AVX2 && defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

#ifdef __linux__
/* A sysfs file's first line into buf (NUL-terminated); false where it cannot be read. */
static bool read_line(const char *path, char *buf, size_t cap) {
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    const ssize_t n = read(fd, buf, cap - 1);
    close(fd);
    if (n <= 0) return false;
    buf[n] = 0;
    buf[strcspn(buf, "\n")] = 0;
    return true;
}

/* The CPUs a list such as "0-1,32,34-35" names */
static uint32_t list_count(const char *s) {
    uint32_t count = 0;
    while (*s) {
        char *end;
        const unsigned long a = strtoul(s, &end, 10);
        if (end == s) return 0;
        unsigned long b = a;
        if (*end == '-') {
            const char *t = end + 1;
            b = strtoul(t, &end, 10);
            if (end == t || b < a) return 0;
        }
        count += (uint32_t)(b - a + 1);
        if (*end != ',') return *end ? 0 : count;
        s = end + 1;
        if (!*s) return 0; /* a trailing comma */
    }
    return count;
}
#endif

#if defined(SMOE_CPU_TEST_HOOKS) && defined(__linux__)
uint32_t smoe_cpu_test_list_count(const char *s) { return list_count(s); }
#endif

static _Atomic int64_t l2_thread = -1;

uint32_t smoe_cpu_l2_per_thread(void) {
    int64_t v = atomic_load_explicit(&l2_thread, memory_order_relaxed);
    if (v >= 0) return (uint32_t)v;
    v = 0;
#ifdef __linux__
    for (int i = 0; i < 8; i++) { /* the first level-2 data or unified cache */
        char path[96], buf[256];
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/level", i);
        if (!read_line(path, buf, sizeof buf)) break;
        if (strcmp(buf, "2") != 0) continue;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/type", i);
        if (!read_line(path, buf, sizeof buf) || strcmp(buf, "Instruction") == 0) continue;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        if (!read_line(path, buf, sizeof buf)) break;
        char *end;
        uint64_t size = strtoull(buf, &end, 10);
        size <<= *end == 'K' ? 10 : *end == 'M' ? 20 : 0;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/shared_cpu_list", i);
        const uint32_t sharers = read_line(path, buf, sizeof buf) ? list_count(buf) : 0;
        if (sharers && size / sharers <= UINT32_MAX) v = (int64_t)(size / sharers);
        break;
    }
#endif
    atomic_store_explicit(&l2_thread, v, memory_order_relaxed);
    return (uint32_t)v;
}
