/* kernels.c — the kernels of kernels.h that have instruction-set instances: which one runs.
 *
 * The functions below pick, at build time, the AVX2 kernels of kernels_avx2.c or the NEON
 * kernels of kernels_neon.c (which keep the reduction-order rule with their own, stated, order
 * and are tested against the reference within a tolerance) or the reference kernels of
 * kernels_ref.c, which keep their own names (smoe_ref_*) in every build. See kernels_isa.h. On x86-64
 * the 8-bit-activation product then picks, at run time, an instance with these bits exactly:
 * AVX512-VNNI, AVX-512 (F + BW), AVX-VNNI or plain AVX2, the first this CPU has (cpu.h,
 * smoe_cpu_avx512; kernels_avx512.c, kernels_avx2_qx.h), unless SMOE_NO_AVX512=1 / SMOE_NO_VNNI=1.
 * On AArch64 it takes the SDOT instance (the same bits) where the CPU has ARMv8.2's dot product
 * (cpu.h, smoe_cpu_neon_dot), unless SMOE_NO_DOTPROD=1.
 *
 * One token (n = 1, decode's products and a short prompt's one-token experts) is a matrix-vector
 * product bound by reading the weights; both the AVX2 and the AVX-512 instances have one that
 * streams a row at a time and prefetches ahead (same bits). It takes the AVX-512 instance where
 * that one runs with VNNI, except on an AMD CPU whose AVX2 instance has AVX-VNNI too (Zen 5):
 *  - AVX512-VNNI without AVX-VNNI (AMD Zen 4, Intel Ice Lake, Cascade Lake): the AVX2 instance
 *    would run without VNNI; on a Sapphire Rapids Xeon the plain AVX2 matvec costs 0-10 % more
 *    CPU time per byte than the AVX512-VNNI one (bench/RESULTS.md, "One token on AVX-512");
 *    Zen 4 itself not measured;
 *  - Intel with both (Sapphire Rapids and later Xeons): measured there, AVX512-VNNI 1-7 % (q4)
 *    and 2-20 % (q8) less CPU time per byte than the AVX-VNNI one;
 *  - AMD with both (Zen 5): the AVX2 instance; measured there in the engine, decode 1.23x
 *    slower with the AVX-512 one, every product (bench/RESULTS.md, "Zen 5: every item").
 * SMOE_MATVEC=avx2 or avx512 forces one (to measure and test; avx512 only where the AVX-512
 * instances run at all). A few tokens (2 or more) always take the AVX-512 instance where it runs;
 * there up to 4 q4 and 6 q8 tokens go a row at a time as one token does (kernels_avx512.c, few_path), the
 * AVX2 instance's few-token path (kernels_avx2.c) serving CPUs without AVX-512.
 *
 * The reference kernels (kernels_ref.c) and the instruction-set files (kernels_avx2.c,
 * kernels_avx512.c, kernels_neon.c) never call back into this file: it is the only one that
 * names them all (kernels_isa.h).
 */
#include "kernels_isa.h"

#include "cpu.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

const char *smoe_kernels_isa(void) { return SMOE_HAVE_AVX2 ? "avx2" : SMOE_HAVE_NEON ? "neon" : "portable"; }

/* ", cuda" after the CPU's kernels in a library built with the CUDA backend (smoe.h) */
#if SMOE_CUDA
#define SMOE_KERNELS_DEVICES ", cuda"
#else
#define SMOE_KERNELS_DEVICES ""
#endif

const char *smoe_kernels(void) {
#if SMOE_HAVE_AVX2
    const unsigned a512 = smoe_cpu_avx512();
#if SMOE_HAVE_AMX
    if ((a512 & SMOE_CPU_AVX512VNNI) && smoe_cpu_amx()) return "avx2+avx512vnni+amx" SMOE_KERNELS_DEVICES;
    if (smoe_cpu_amx()) return "avx2+avx512+amx" SMOE_KERNELS_DEVICES;
#endif
    if (a512 & SMOE_CPU_AVX512VNNI) return "avx2+avx512vnni" SMOE_KERNELS_DEVICES;
    if (a512 & SMOE_CPU_AVX512) return "avx2+avx512" SMOE_KERNELS_DEVICES;
    if (smoe_avx2_qx_vnni()) return "avx2+avx-vnni" SMOE_KERNELS_DEVICES;
#endif
#if SMOE_HAVE_NEON_DOT
    if (smoe_cpu_neon_dot()) return "neon+dotprod" SMOE_KERNELS_DEVICES;
#endif
    return SMOE_HAVE_AVX2 ? "avx2" SMOE_KERNELS_DEVICES
           : SMOE_HAVE_NEON ? "neon" SMOE_KERNELS_DEVICES : "portable" SMOE_KERNELS_DEVICES;
}

void smoe_matmul_rows(const smoe_tensor *W, const uint8_t *w, const float *x, size_t ldx, uint32_t n,
                      float *y, size_t ldy, uint32_t r0, uint32_t r1) {
#if SMOE_HAVE_AVX2
    if (smoe_avx2_matmul_rows(W, w, x, ldx, n, y, ldy, r0, r1)) return;
#elif SMOE_HAVE_NEON
    if (smoe_neon_matmul_rows(W, w, x, ldx, n, y, ldy, r0, r1)) return;
#endif
    smoe_ref_matmul_rows(W, w, x, ldx, n, y, ldy, r0, r1);
}

void smoe_qx_prepare(const float *x, size_t ldx, uint32_t n, uint32_t cols, uint8_t wformat, uint32_t group,
                     void *codes, float *d, float *gsum) {
#if SMOE_HAVE_AVX2
    if (smoe_avx2_qx_prepare(x, ldx, n, cols, wformat, group, codes, d, gsum)) return;
#endif
    smoe_ref_qx_prepare(x, ldx, n, cols, wformat, group, codes, d, gsum);
}

#if SMOE_HAVE_AVX2 && SMOE_HAVE_AVX512
/* Whether one token's product (n = 1) takes the AVX-512 instance (the rule at the top). Cached;
 * threads asking at once compute the same. */
static _Atomic int matvec512 = -1;

static bool matvec_avx512(void) {
    int use = atomic_load_explicit(&matvec512, memory_order_relaxed);
    if (use < 0) {
        const char *v = getenv("SMOE_MATVEC");
        if (v && strcmp(v, "avx512") == 0)
            use = 1;
        else if (v && strcmp(v, "avx2") == 0)
            use = 0;
        else
            use = (smoe_cpu_avx512() & SMOE_CPU_AVX512VNNI) && !(smoe_avx2_qx_vnni() && __builtin_cpu_is("amd"));
        atomic_store_explicit(&matvec512, use, memory_order_relaxed);
    }
    return use > 0;
}
#endif

#if SMOE_HAVE_AMX
#ifndef SMOE_AMX_MIN_N
#define SMOE_AMX_MIN_N 8 /* tokens from which q4/q8 products take the AMX kernel (bench/RESULTS.md, "AMX") */
#endif
/* SMOE_AMX_MIN_N, or the environment's (a positive integer; to measure and test) */
static _Atomic int amx_min = -1;

static uint32_t amx_min_n(void) {
    int v = atomic_load_explicit(&amx_min, memory_order_relaxed);
    if (v < 0) {
        const char *e = getenv("SMOE_AMX_MIN_N");
        const long l = e ? strtol(e, NULL, 10) : 0;
        v = l > 0 && l < (1L << 30) ? (int)l : SMOE_AMX_MIN_N;
        atomic_store_explicit(&amx_min, v, memory_order_relaxed);
    }
    return (uint32_t)v;
}

/* How many of n tokens the AMX kernel takes: 0 below amx_min_n(); else all but a last tile of
 * fewer than amx_min_n() tokens (a short tile costs it as much as a full one), which go to the
 * kernels after it (each (row, token) has the same bits whoever computes it) */
static uint32_t amx_tokens(uint32_t n) {
    const uint32_t amin = amx_min_n();
    if (n < amin) return 0;
    return n > 16 && n % 16 < amin ? n - n % 16 : n;
}
#endif

size_t smoe_qx_tiles_bytes(const smoe_qx *X, uint32_t n, uint32_t *items) {
    *items = 0;
#if SMOE_HAVE_AMX
    const uint32_t na = amx_tokens(n);
    if (na && smoe_cpu_amx()) return smoe_avx512_amx_tiles_bytes(X->cols, X->wformat, X->group, na, items);
#else
    (void)X;
    (void)n;
#endif
    return 0;
}

void smoe_qx_tiles(const smoe_qx *X, uint32_t n, void *buf, uint32_t i0, uint32_t i1) {
#if SMOE_HAVE_AMX
    const uint32_t na = amx_tokens(n);
    if (na) smoe_avx512_amx_tiles(X, na, buf, i0, i1);
#else
    (void)X;
    (void)n;
    (void)buf;
    (void)i0;
    (void)i1;
#endif
}

size_t smoe_qx_tiles_cap(uint32_t cols, uint32_t n) {
#if SMOE_HAVE_AMX
    if (smoe_cpu_amx()) return smoe_avx512_amx_tiles_cap(cols, n);
#else
    (void)cols;
    (void)n;
#endif
    return 0;
}

void smoe_matmul_rows_qx(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y, size_t ldy,
                         uint32_t r0, uint32_t r1) {
#if SMOE_HAVE_AVX2
#if SMOE_HAVE_AMX
    /* AMX takes tiles of 16 tokens (amx_tokens: the rest to the kernels below) */
    const uint32_t na = amx_tokens(n);
    if (na && (W->format == SMOE_FMT_Q4 || W->format == SMOE_FMT_Q8) && smoe_cpu_amx()) {
        const uint32_t rest = n - na;
        if (smoe_avx512_amx_matmul_rows_qx(W, w, X, na, y, ldy, r0, r1)) {
            if (rest) {
                const smoe_qx Xr = smoe_qx_from(X, na);
                smoe_matmul_rows_qx(W, w, &Xr, rest, y + (size_t)na * ldy, ldy, r0, r1);
            }
            return;
        }
    }
#endif
#if SMOE_HAVE_AVX512
    /* n = 1: the rule above, for q4 and q8 (the formats whose matrix-vector path it measured) */
    const bool mv = (W->format == SMOE_FMT_Q4 || W->format == SMOE_FMT_Q8) && matvec_avx512();
    const unsigned a512 = n > 1 || mv ? smoe_cpu_avx512() : 0;
    if ((a512 & SMOE_CPU_AVX512VNNI) && smoe_avx512_ggml_qx(W, w, X, n, y, ldy, r0, r1)) return; /* GGML formats, n > 1 */
    if ((a512 & SMOE_CPU_AVX512VNNI) ? smoe_avx512_matmul_rows_qx_vnni(W, w, X, n, y, ldy, r0, r1)
        : (a512 & SMOE_CPU_AVX512)   ? smoe_avx512_matmul_rows_qx_bw(W, w, X, n, y, ldy, r0, r1)
                                     : false)
        return;
#endif
    if (smoe_avx2_matmul_rows_qx(W, w, X, n, y, ldy, r0, r1)) return;
#elif SMOE_HAVE_NEON
#if SMOE_HAVE_NEON_DOT
    if (smoe_cpu_neon_dot() && smoe_neon_matmul_rows_qx_dot(W, w, X, n, y, ldy, r0, r1)) return;
#endif
    if (smoe_neon_matmul_rows_qx(W, w, X, n, y, ldy, r0, r1)) return;
#endif
    smoe_ref_matmul_rows_qx(W, w, X, n, y, ldy, r0, r1);
}

void smoe_rmsnorm(float *out, const float *x, const smoe_tensor *weight, uint32_t dim, float eps) {
#if SMOE_HAVE_AVX2
    smoe_avx2_rmsnorm(out, x, weight, dim, eps);
#elif SMOE_HAVE_NEON
    smoe_neon_rmsnorm(out, x, weight, dim, eps);
#else
    smoe_ref_rmsnorm(out, x, weight, dim, eps);
#endif
}

void smoe_attend(float *out, const float *q, const void *k, const void *v, size_t stride, uint32_t n_pos,
                 uint32_t head_dim, uint32_t kv_dtype, float sink, float *scratch) {
#if SMOE_HAVE_AVX2
    smoe_avx2_attend(out, q, k, v, stride, n_pos, head_dim, kv_dtype, sink, scratch);
#elif SMOE_HAVE_NEON
    smoe_neon_attend(out, q, k, v, stride, n_pos, head_dim, kv_dtype, sink, scratch);
#else
    smoe_ref_attend(out, q, k, v, stride, n_pos, head_dim, kv_dtype, sink, scratch);
#endif
}
