/* kernels_isa.h — the reference kernels under their own names, and the instruction-set kernels
 * that kernels.c dispatches to. Private to kernels*.c, cpu.c and the kernel tests.
 *
 * The public names (kernels.h) pick one implementation per build: the AVX2 + FMA + F16C kernels
 * when the compiler targets them (the Makefile passes -mavx2 -mfma -mf16c on x86-64 unless
 * PORTABLE=1), the NEON kernels on AArch64 (unless PORTABLE=1), the reference kernels otherwise.
 * The choice is made at build time, never at run time, so one build always runs one arithmetic
 * (faster instances of one kernel picked at run time — AVX-VNNI, AVX-512 — give the same bits);
 * cpu.c refuses (SMOE_ERR_UNSUPPORTED) to open a vault on a CPU that cannot run what the build
 * chose (an x86-64 CPU without AVX2; every AArch64 CPU has NEON). */
#ifndef SMOE_KERNELS_ISA_H
#define SMOE_KERNELS_ISA_H

#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(SMOE_PORTABLE)
#define SMOE_HAVE_AVX2 1
#else
#define SMOE_HAVE_AVX2 0
#endif

/* AVX-VNNI instances of the 8-bit-activation products, picked at run time (GCC ≥ 11, Clang ≥ 12) */
#if SMOE_HAVE_AVX2 && ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define SMOE_HAVE_AVXVNNI 1
#else
#define SMOE_HAVE_AVXVNNI 0
#endif

/* AVX-512 (F + BW + VL, and AVX512-VNNI) instances of the 8-bit-activation products, picked at
 * run time (kernels_avx512.c, the only file with AVX-512 code; GCC ≥ 8, Clang ≥ 8) */
#if SMOE_HAVE_AVX2 && defined(__x86_64__) &&                                                                          \
    ((defined(__clang__) && __clang_major__ >= 8) || (!defined(__clang__) && __GNUC__ >= 8))
#define SMOE_HAVE_AVX512 1
#else
#define SMOE_HAVE_AVX512 0
#endif

/* AMX-INT8 instance of the q4/q8 product, picked at run time (kernels_avx512_amx.h; GCC ≥ 11,
 * Clang ≥ 12; Linux, whose permission to use the tile data cpu.c asks for) */
#if SMOE_HAVE_AVX512 && defined(__linux__) &&                                                                          \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define SMOE_HAVE_AMX 1
#else
#define SMOE_HAVE_AMX 0
#endif

/* AArch64 Advanced SIMD is part of every arm64 CPU: no flag, no runtime check (kernels_neon.c). */
#if defined(__aarch64__) && defined(__ARM_NEON) && !defined(SMOE_PORTABLE)
#define SMOE_HAVE_NEON 1
#else
#define SMOE_HAVE_NEON 0
#endif

/* The dot-product instance of the NEON 8-bit-activation product (ARMv8.2 SDOT: Apple M1 and later,
 * Neoverse N1/V1 (Graviton 2/3), Cortex-A55/A76 and later), picked at run time (cpu.h,
 * smoe_cpu_neon_dot): built where the target already has the extension (__ARM_FEATURE_DOTPROD:
 * clang's default for Apple silicon) or by GCC 9+ for the functions that use it. */
#if SMOE_HAVE_NEON && (defined(__ARM_FEATURE_DOTPROD) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 9))
#define SMOE_HAVE_NEON_DOT 1
#else
#define SMOE_HAVE_NEON_DOT 0
#endif

/* Which kernels this build runs: "avx2", "neon" or "portable". */
const char *smoe_kernels_isa(void);

/* The reference kernels (kernels_ref.c), kept forever: the fast ones are tested against them. */
void smoe_ref_matmul_rows(const smoe_tensor *W, const uint8_t *w, const float *x, size_t ldx, uint32_t n, float *y,
                          size_t ldy, uint32_t r0, uint32_t r1);
void smoe_ref_qx_prepare(const float *x, size_t ldx, uint32_t n, uint32_t cols, uint8_t wformat, uint32_t group,
                         void *codes, float *d, float *gsum);
void smoe_ref_matmul_rows_qx(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y,
                             size_t ldy, uint32_t r0, uint32_t r1);
void smoe_ref_rmsnorm(float *out, const float *x, const smoe_tensor *weight, uint32_t dim, float eps);
void smoe_ref_attend(float *out, const float *q, const void *k, const void *v, size_t stride, uint32_t n_pos,
                     uint32_t head_dim, uint32_t kv_dtype, float sink, float *scratch);

#if SMOE_HAVE_AVX2
/* kernels_avx2.c. matmul returns false for a shape it does not take (then the reference runs;
 * the choice depends on the tensor's shape and format only, never on n or on the rows). */
bool smoe_avx2_matmul_rows(const smoe_tensor *W, const uint8_t *w, const float *x, size_t ldx, uint32_t n, float *y,
                           size_t ldy, uint32_t r0, uint32_t r1);
bool smoe_avx2_matmul_rows_qx(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y,
                              size_t ldy, uint32_t r0, uint32_t r1);
/* The two instances behind it (kernels_avx2_qx.h; the same bits), for the tests, and which one
 * smoe_avx2_matmul_rows_qx runs: VNNI where the CPU has AVX-VNNI, unless SMOE_NO_VNNI=1. */
bool smoe_avx2_matmul_rows_qx_plain(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y,
                                    size_t ldy, uint32_t r0, uint32_t r1);
#if SMOE_HAVE_AVXVNNI
bool smoe_avx2_matmul_rows_qx_vnni(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y,
                                   size_t ldy, uint32_t r0, uint32_t r1);
#endif
bool smoe_avx2_qx_vnni(void);
/* The GGML block formats' instance (kernels_avx2_ggml.h): plain, or AVX-VNNI where the build has
 * it and vnni is true (the caller checks the CPU: smoe_avx2_qx_vnni); false for another format. */
bool smoe_avx2_ggml_qx(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y, size_t ldy,
                       uint32_t r0, uint32_t r1, bool vnni);
/* The same bytes as smoe_ref_qx_prepare; false for a shape it does not take. */
bool smoe_avx2_qx_prepare(const float *x, size_t ldx, uint32_t n, uint32_t cols, uint8_t wformat, uint32_t group,
                          void *codes, float *d, float *gsum);
void smoe_avx2_rmsnorm(float *out, const float *x, const smoe_tensor *weight, uint32_t dim, float eps);
void smoe_avx2_attend(float *out, const float *q, const void *k, const void *v, size_t stride, uint32_t n_pos,
                      uint32_t head_dim, uint32_t kv_dtype, float sink, float *scratch);
#endif

#if SMOE_HAVE_AVX512
/* kernels_avx512.c: smoe_matmul_rows_qx with the reference's bits, false for a shape it does not
 * take (then the AVX2 kernel runs). Only for a CPU where smoe_cpu_avx512() (cpu.h) says so: _bw
 * needs SMOE_CPU_AVX512, _vnni also SMOE_CPU_AVX512VNNI. */
bool smoe_avx512_matmul_rows_qx_bw(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y,
                                   size_t ldy, uint32_t r0, uint32_t r1);
bool smoe_avx512_matmul_rows_qx_vnni(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y,
                                     size_t ldy, uint32_t r0, uint32_t r1);
/* The most tokens (1 … 8) the two above take a row at a time, as one token, rather than batched:
 * q4 and q8 (0: the build's, QX512_FEW_N4 / QX512_FEW_N8, as at start; to measure and test, never
 * while a product runs) */
void smoe_avx512_few_limits(uint32_t n4, uint32_t n8);
/* kernels_avx512_ggml.h: the GGML block formats' product (AVX512-VNNI), the same contract */
bool smoe_avx512_ggml_qx(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y, size_t ldy,
                         uint32_t r0, uint32_t r1);
#endif

#if SMOE_HAVE_AMX
/* kernels_avx512_amx.h: q4 and q8 (false for another format or shape), the same contract; only
 * where smoe_cpu_amx() (cpu.h) says so */
bool smoe_avx512_amx_matmul_rows_qx(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y,
                                    size_t ldy, uint32_t r0, uint32_t r1);
/* The AMX kernel's packed form of n tokens' codes (smoe_qx_tiles, kernels.h): its bytes and work
 * items (0: the kernel does not take codes of this shape), and items [i0, i1) of it into buf */
size_t smoe_avx512_amx_tiles_bytes(uint32_t cols, uint8_t format, uint32_t G, uint32_t n, uint32_t *items);
size_t smoe_avx512_amx_tiles_cap(uint32_t cols, uint32_t n); /* the most bytes for ≤ cols columns, ≤ n tokens */
void smoe_avx512_amx_tiles(const smoe_qx *X, uint32_t n, void *buf, uint32_t i0, uint32_t i1);
/* tests only: the calling thread's tile configuration loaded (NULL: released) and stored, 64 bytes */
void smoe_avx512_amx_tilecfg_set(const void *cfg);
void smoe_avx512_amx_tilecfg_get(void *cfg);
#endif

#if SMOE_HAVE_NEON
/* kernels_neon.c, with the same contract as the AVX2 ones (matmul: false = not this shape). */
bool smoe_neon_matmul_rows(const smoe_tensor *W, const uint8_t *w, const float *x, size_t ldx, uint32_t n, float *y,
                           size_t ldy, uint32_t r0, uint32_t r1);
bool smoe_neon_matmul_rows_qx(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y,
                              size_t ldy, uint32_t r0, uint32_t r1);
#if SMOE_HAVE_NEON_DOT
/* The same product, the same bits, by SDOT: q4, q8 and the GGML formats that take codes (false
 * for another format or shape). Only where smoe_cpu_neon_dot() (cpu.h) says so. */
bool smoe_neon_matmul_rows_qx_dot(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y,
                                  size_t ldy, uint32_t r0, uint32_t r1);
#endif
void smoe_neon_rmsnorm(float *out, const float *x, const smoe_tensor *weight, uint32_t dim, float eps);
void smoe_neon_attend(float *out, const float *q, const void *k, const void *v, size_t stride, uint32_t n_pos,
                      uint32_t head_dim, uint32_t kv_dtype, float sink, float *scratch);
#endif

#endif
