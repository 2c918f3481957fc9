/* kernels_neon.c — AArch64 Advanced SIMD (NEON) kernels (kernels_isa.h says when they are built).
 *
 * Baseline ARMv8.0-A: float FMA (vfmaq_f32), half→single conversion (FCVTL), pairwise add; no
 * FP16-arithmetic or SVE extension, so they run on every arm64 CPU (Advanced SIMD is mandatory in
 * AArch64). One instance uses more: the 8-bit-activation product (q4/q8 and the GGML block
 * formats) by ARMv8.2's SDOT (smoe_neon_matmul_rows_qx_dot, at the end; the same integers, so the
 * same bits), which kernels.c runs only where cpu.c says the CPU has it.
 *
 * What they must keep
 * -------------------
 * The rule of kernels_ref.c: each output element is reduced by one sequence of floating-point
 * operations that depends on its own shape only — never on n, on the rows [r0, r1) a thread was
 * given, or on the thread count — so the token-serial and layer-major paths agree bit for bit.
 * They need not agree with the reference kernels bit for bit (they fuse multiply-adds and use
 * their own order); tests/c/test_kernels_neon.c checks them against the reference within a
 * stated tolerance, and checks their own n- and split-independence exactly.
 *
 * The order, for y[t, r] = Σ_c W[r, c]·x[t, c]
 * --------------------------------------------
 * One 8-lane accumulator per (row, token), held as two q registers (lanes 0–3 and 4–7); lane j
 * sees columns c ≡ j (mod 8) in increasing order; the end is the fixed tree of hsum8:
 *
 *     s_j = l_j + l_{j+4}  (j < 4: the two registers added)
 *     t_0 = s_0 + s_2,  t_1 = s_1 + s_3  (low and high 64-bit halves added)
 *     sum = t_0 + t_1   (one pairwise add)
 *
 * that is ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)). It is written out with vaddq / vadd / vpadds
 * rather than left to vaddvq_f32, whose pairing the intrinsic does not promise.
 *
 *  f32, bf16:  acc = fma(w[8v..8v+8), x[8v..8v+8), acc) for v = 0, 1, … (acc starts at +0; a
 *              last partial vector is zero-padded), y = hsum8(acc).
 *
 *  q8, q4:     the affine form, per group g of G columns (G = 32, 64 or 128, the tensor's):
 *                  Σ_c w_c·x_c = s_g·Σ_c q_c·x_c + b_g·Σ_c x_c
 *              so the inner loop multiplies integer codes (exact as floats) by x and the scale
 *              is applied once per group, not once per weight:
 *                  a   = q[0..8)·x[0..8);  a = fma(q[8k..8k+8), x[8k..8k+8), a)  for k = 1..G/8−1
 *                  tot = fma(a, s_g, tot)                        (tot starts at +0)
 *                  X_g = hsum8(x[0..8) + x[8..16) + … + x[G−8..G))  (adds in that order)
 *                  bia = fma(b[g..g+8), X[g..g+8), bia) over groups 8 at a time, zero-padded
 *                  y   = hsum8(tot) + hsum8(bia)
 *              q4 codes come out in column order (low nibble = even column, high nibble = odd
 *              column, interleaved by a zip), q8 codes by widening; both exact as floats.
 *              X_g is a function of the token alone, computed once per call (per tile of TT
 *              tokens) and the same way whatever n.
 *
 * This is, operation for operation, the order of kernels_avx2.c's float kernels (its q4 trick of
 * 16·q in odd lanes undone by an exact 1/16 gives the same values whenever no product is
 * subnormal), so where both files use the float forms a NEON build and an AVX2 build print the
 * same bits. Nothing relies on that: each instruction set only promises its own fixed order
 * and a bound against the reference.
 *
 * How the shapes share work without touching that order
 * ------------------------------------------------------
 * The two registers of an accumulator are two independent chains (lanes 0–3 see columns
 * 8v..8v+4, lanes 4–7 see 8v+4..8v+8), so a kernel may run one half's chain over a block of
 * columns and then the other's: each lane still sees its own columns in increasing order.
 *
 *  n = 1 (and a last tile of one token): RV rows at a time against one x, both halves at once,
 *  codes decoded into registers as they stream past, tot in registers — the matrix-vector
 *  product, bound by decoding and memory.
 *  n ≥ 2: tokens in tiles of TT; for each block of RB rows, each block of CB columns (q) or FCB
 *  columns (f32/bf16) is decoded once into a float buffer and fed to register blocks of RB rows
 *  × TB tokens, one half (4 lanes) at a time: 16 accumulators + 4 weights + 1 x of the 32 q
 *  registers. tot (q) and the accumulators (f32/bf16) live in a small stack array between blocks
 *  and halves. A store and a load are exact, so spilling changes nothing; every block size is a
 *  choice about reuse, never about the order of any one sum.
 *
 * Rows wider than MAXC columns (q) go to the reference kernel: a choice by shape, not by n.
 * Scales and biases may be f16, bf16 or f32: all are widened to f32 exactly before use, so the
 * scale format changes no operation above.
 *
 * Error, against the exact sum: the q forms carry the cancellation of s·q against b, so the bound
 * is relative to M = Σ_c (|s_g·q_c| + |b_g|)·|x_c|, not to Σ|w_c·x_c|; see the tests.
 *
 * Loads go through byte pointers (vld1q_u8 + reinterpret) wherever the address comes from the
 * vault, so no misaligned typed pointer is ever formed.
 */
#include "kernels_isa.h"

#if SMOE_HAVE_NEON

#include <arm_neon.h>
#include <math.h>
#include <string.h>

#include "ggml_blocks.h"

#define INLINE static inline __attribute__((always_inline))

enum {
    MAXC = 16384,     /* columns of a row the q kernels take; wider rows: reference */
    MAXG = MAXC / 32, /* groups of such a row at most (group size 32) */
    MAXU = MAXC / 64, /* units of 64 columns of such a row (the 8-bit-activation layout) */
    RB = 4,     /* rows of a register block (n ≥ 2) */
    TB = 4,     /* tokens of a register block: RB·TB half-accumulators + RB weights + 1 x */
    TT = 32,    /* tokens of a tile: they share one decoding of each weight block */
    CB = 512,   /* q columns decoded at a time (a multiple of every group size) */
    FCB = 512,  /* f32/bf16 columns per block (a multiple of 8) */
    RV = 4,     /* rows at a time in the matrix-vector kernels (n = 1) */
};

/* The group sizes the q kernels take: 32, 64, 128 (docs/vault.md). */
INLINE bool group_ok(uint32_t G) { return G == 32 || G == 64 || G == 128; }

/* ------------------------------------------------------------------------------ helpers */

/* One 8-lane accumulator or vector: lanes 0–3 and 4–7. */
typedef struct {
    float32x4_t lo, hi;
} f8;

INLINE f8 f8_zero(void) {
    f8 r = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
    return r;
}

INLINE f8 f8_load(const float *p) {
    f8 r = {vld1q_f32(p), vld1q_f32(p + 4)};
    return r;
}

INLINE void f8_store(float *p, f8 v) {
    vst1q_f32(p, v.lo);
    vst1q_f32(p + 4, v.hi);
}

INLINE f8 f8_add(f8 a, f8 b) {
    f8 r = {vaddq_f32(a.lo, b.lo), vaddq_f32(a.hi, b.hi)};
    return r;
}

INLINE f8 f8_mul(f8 a, f8 b) {
    f8 r = {vmulq_f32(a.lo, b.lo), vmulq_f32(a.hi, b.hi)};
    return r;
}

/* acc + a·b, rounded once */
INLINE f8 f8_fma(f8 acc, f8 a, f8 b) {
    f8 r = {vfmaq_f32(acc.lo, a.lo, b.lo), vfmaq_f32(acc.hi, a.hi, b.hi)};
    return r;
}

/* ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) */
INLINE float hsum8(f8 v) {
    const float32x4_t s4 = vaddq_f32(v.lo, v.hi);
    const float32x2_t s2 = vadd_f32(vget_low_f32(s4), vget_high_f32(s4));
    return vpadds_f32(s2);
}

/* 4 floats from a byte address of any alignment */
INLINE float32x4_t ld4(const uint8_t *p) { return vreinterpretq_f32_u8(vld1q_u8(p)); }

INLINE float32x4_t bf16_lo(uint16x8_t h) { return vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16)); }
INLINE float32x4_t bf16_hi(uint16x8_t h) { return vreinterpretq_f32_u32(vshll_high_n_u16(h, 16)); }

INLINE f8 bf16x8(const uint8_t *p) { /* 8 bf16 → f32, exactly */
    const uint16x8_t h = vreinterpretq_u16_u8(vld1q_u8(p));
    f8 r = {bf16_lo(h), bf16_hi(h)};
    return r;
}

/* 8 weights of a row from column c (f32 or bf16) */
INLINE f8 f_load(const uint8_t *row, bool bf16, uint32_t c) {
    if (bf16) return bf16x8(row + 2 * (size_t)c);
    f8 r = {ld4(row + 4 * (size_t)c), ld4(row + 4 * (size_t)c + 16)};
    return r;
}

/* the same for the last m < 8 columns, zero-padded */
INLINE f8 f_load_tail(const uint8_t *row, bool bf16, uint32_t c, uint32_t m) {
    float buf[8] = {0};
    if (bf16) {
        uint16_t h[8] = {0};
        memcpy(h, row + 2 * (size_t)c, 2 * (size_t)m);
        return bf16x8((const uint8_t *)h);
    }
    memcpy(buf, row + 4 * (size_t)c, 4 * (size_t)m);
    return f8_load(buf);
}

INLINE f8 x_load_tail(const float *x, uint32_t m) {
    float buf[8] = {0};
    memcpy(buf, x, 4 * (size_t)m);
    return f8_load(buf);
}

INLINE float bf16_1(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* bytes of one scale or bias */
INLINE size_t scale_bytes(uint8_t sf) { return sf == SMOE_SCALE_F32 ? 4 : 2; }

/* dst[g] = the ng scales (or biases; f16, bf16 or f32) at src as f32 (exactly); zeros after, up
 * to a multiple of 8 */
static void load_scales(float *dst, const uint8_t *src, uint32_t ng, uint8_t sf) {
    if (sf == SMOE_SCALE_F32) {
        memcpy(dst, src, 4 * (size_t)ng);
        for (uint32_t g = ng; g % 8; g++) dst[g] = 0.0f;
        return;
    }
    for (uint32_t g = 0; g < ng; g += 8) {
        uint16x8_t h;
        if (ng - g >= 8) {
            h = vreinterpretq_u16_u8(vld1q_u8(src + 2 * (size_t)g));
        } else {
            uint16_t pad[8] = {0}; /* +0 in both formats */
            memcpy(pad, src + 2 * (size_t)g, 2 * (size_t)(ng - g));
            h = vld1q_u16(pad);
        }
        if (sf == SMOE_SCALE_F16) {
            vst1q_f32(dst + g, vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(h))));
            vst1q_f32(dst + g + 4, vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(h))));
        } else {
            vst1q_f32(dst + g, bf16_lo(h));
            vst1q_f32(dst + g + 4, bf16_hi(h));
        }
    }
}

/* X[g] = Σ of group g (G columns) of x, the order of the essay; zeros after, up to a multiple of 8 */
static void group_sums(float *X, const float *x, uint32_t gpr, uint32_t G) {
    uint32_t g = 0;
    for (; g < gpr; g++) {
        const float *xg = x + (size_t)g * G;
        f8 v = f8_load(xg);
        for (uint32_t k = 1; k < G / 8; k++) v = f8_add(v, f8_load(xg + 8 * k));
        X[g] = hsum8(v);
    }
    for (; g % 8; g++) X[g] = 0.0f;
}

/* hsum8 of Σ_g fma(b[g..g+8), X[g..g+8)) over gpr8 (a multiple of 8) zero-padded groups */
INLINE float bias_dot(const float *b, const float *X, uint32_t gpr8) {
    f8 a = f8_zero();
    for (uint32_t g = 0; g < gpr8; g += 8) a = f8_fma(a, f8_load(b + g), f8_load(X + g));
    return hsum8(a);
}

/* ------------------------------------------------------------------------- q codes */

/* Codes 16m..16m+15 of a group at p, one byte each, in column order. */
INLINE uint8x16_t q4_bytes16(const uint8_t *p, int m) {
    const uint8x16_t b = vld1q_u8(p + 16 * (m / 2));
    const uint8x16_t lo = vandq_u8(b, vdupq_n_u8(15)), hi = vshrq_n_u8(b, 4);
    return (m & 1) ? vzip2q_u8(lo, hi) : vzip1q_u8(lo, hi); /* byte j → codes 2j, 2j + 1 */
}

INLINE uint8x16_t q8_bytes16(const uint8_t *p, int m) { return vld1q_u8(p + 16 * m); }

INLINE uint8x16_t q_bytes16(const uint8_t *p, int m, bool q4) { return q4 ? q4_bytes16(p, m) : q8_bytes16(p, m); }

/* 16 codes as floats: c[0] columns 0–7, c[1] columns 8–15 of the 16 */
INLINE void codes16(f8 c[2], uint8x16_t b) {
    const uint16x8_t w0 = vmovl_u8(vget_low_u8(b)), w1 = vmovl_high_u8(b);
    c[0].lo = vcvtq_f32_u32(vmovl_u16(vget_low_u16(w0)));
    c[0].hi = vcvtq_f32_u32(vmovl_high_u16(w0));
    c[1].lo = vcvtq_f32_u32(vmovl_u16(vget_low_u16(w1)));
    c[1].hi = vcvtq_f32_u32(vmovl_high_u16(w1));
}

/* ------------------------------------------------------------------------ q: n = 1 */

typedef struct {
    const uint8_t *codes, *scales, *biases; /* of row 0 */
    size_t row_bytes;                       /* code bytes per row */
    size_t sbytes;                          /* bytes per scale */
    uint32_t G, gpr, gpr8;                  /* group size, groups per row, gpr rounded up to 8 */
    uint8_t sf;
    bool q4;
} qmat;

/* R rows from r against one token (X its group sums): codes decoded 16 at a time as they stream
 * past, for all R rows against two vectors of x; tot in registers. */
INLINE void q_rows_1(const int R, const bool q4, const uint32_t G, const qmat *m, uint32_t r, const float *x,
                     const float *X, float *y) {
    float s[RV][MAXG], b[RV][MAXG]; /* (rows, groups) scales and biases as f32 */
    const uint8_t *p[RV];
    f8 tot[RV];
    for (int i = 0; i < R; i++) {
        load_scales(s[i], m->scales + m->sbytes * (size_t)(r + i) * m->gpr, m->gpr, m->sf);
        load_scales(b[i], m->biases + m->sbytes * (size_t)(r + i) * m->gpr, m->gpr, m->sf);
        p[i] = m->codes + (size_t)(r + i) * m->row_bytes;
        tot[i] = f8_zero();
    }
    const size_t gbytes = q4 ? G / 2 : G;
    for (uint32_t g = 0; g < m->gpr; g++) {
        const float *xg = x + (size_t)g * G;
        f8 a[RV];
#pragma GCC unroll 8
        for (int k2 = 0; k2 < (int)G / 16; k2++) { /* columns 16·k2 .. 16·k2 + 16: k = 2·k2 and 2·k2 + 1 */
            const f8 x0 = f8_load(xg + 16 * k2), x1 = f8_load(xg + 16 * k2 + 8);
            for (int i = 0; i < R; i++) {
                f8 q[2];
                codes16(q, q_bytes16(p[i] + g * gbytes, k2, q4));
                a[i] = k2 == 0 ? f8_mul(q[0], x0) : f8_fma(a[i], q[0], x0);
                a[i] = f8_fma(a[i], q[1], x1);
            }
        }
        for (int i = 0; i < R; i++) {
            tot[i].lo = vfmaq_n_f32(tot[i].lo, a[i].lo, s[i][g]);
            tot[i].hi = vfmaq_n_f32(tot[i].hi, a[i].hi, s[i][g]);
        }
    }
    for (int i = 0; i < R; i++) {
        const float h = hsum8(tot[i]);
        y[r + i] = h + bias_dot(b[i], X, m->gpr8);
    }
}

static void q_matvec(const qmat *m, uint32_t r0, uint32_t r1, const float *x, const float *X, float *y) {
    uint32_t r = r0;
#define ROWS(q4, G)                                                                  \
    do {                                                                             \
        for (; r + RV <= r1; r += RV) q_rows_1(RV, q4, G, m, r, x, X, y);            \
        switch (r1 - r) {                                                            \
        case 3: q_rows_1(3, q4, G, m, r, x, X, y); break;                            \
        case 2: q_rows_1(2, q4, G, m, r, x, X, y); break;                            \
        case 1: q_rows_1(1, q4, G, m, r, x, X, y); break;                            \
        }                                                                            \
    } while (0)
    switch (m->G + m->q4) {
    case 32: ROWS(false, 32); break;
    case 33: ROWS(true, 32); break;
    case 64: ROWS(false, 64); break;
    case 65: ROWS(true, 64); break;
    case 128: ROWS(false, 128); break;
    case 129: ROWS(true, 128); break;
    }
#undef ROWS
}

/* ----------------------------------------------------------------------- q: n ≥ 2 */

/* R rows × T tokens over ng groups of G, one half (4 lanes) of each accumulator at a time. qf: the
 * decoded codes, row i at qf + i·CB; s[i]: row i's scales from this block's first group;
 * xt[j]: token j at this block's first column; tot[j][i]: the running tot of (row i, token j). */
INLINE void q_block(const int R, const int T, const uint32_t G, const float *qf, const float *const *s,
                    const float *const *xt, uint32_t ng, float (*tot)[RB][8]) {
    for (uint32_t g = 0; g < ng; g++) {
        const float *qg = qf + (size_t)g * G;
        for (int h = 0; h < 2; h++) {
            const int o = 4 * h;
            float32x4_t a[RB][TB];
            {
                float32x4_t qv[RB];
                for (int i = 0; i < R; i++) qv[i] = vld1q_f32(qg + (size_t)i * CB + o);
                for (int j = 0; j < T; j++) {
                    const float32x4_t xv = vld1q_f32(xt[j] + (size_t)g * G + o);
                    for (int i = 0; i < R; i++) a[i][j] = vmulq_f32(qv[i], xv);
                }
            }
            for (int k = 1; k < (int)G / 8; k++) {
                float32x4_t qv[RB];
                for (int i = 0; i < R; i++) qv[i] = vld1q_f32(qg + (size_t)i * CB + 8 * k + o);
                for (int j = 0; j < T; j++) {
                    const float32x4_t xv = vld1q_f32(xt[j] + (size_t)g * G + 8 * k + o);
                    for (int i = 0; i < R; i++) a[i][j] = vfmaq_f32(a[i][j], qv[i], xv);
                }
            }
            for (int i = 0; i < R; i++)
                for (int j = 0; j < T; j++) {
                    float *tp = tot[j][i] + o;
                    vst1q_f32(tp, vfmaq_n_f32(vld1q_f32(tp), a[i][j], s[i][g]));
                }
        }
    }
}

static void q_block_any(int R, int T, uint32_t G, const float *qf, const float *const *s, const float *const *xt,
                        uint32_t ng, float (*tot)[RB][8]) {
    switch ((int)(G / 32) * 64 + R * 8 + T) {
#define CASE(r, t)                                                                   \
    case 64 + r * 8 + t: q_block(r, t, 32, qf, s, xt, ng, tot); break;               \
    case 128 + r * 8 + t: q_block(r, t, 64, qf, s, xt, ng, tot); break;              \
    case 256 + r * 8 + t: q_block(r, t, 128, qf, s, xt, ng, tot); break;
        CASE(4, 4) CASE(4, 3) CASE(4, 2) CASE(4, 1)
        CASE(3, 4) CASE(3, 3) CASE(3, 2) CASE(3, 1)
        CASE(2, 4) CASE(2, 3) CASE(2, 2) CASE(2, 1)
        CASE(1, 4) CASE(1, 3) CASE(1, 2) CASE(1, 1)
#undef CASE
    }
}

static void q_matmul(const smoe_tensor *W, const uint8_t *w, const float *x, size_t ldx, uint32_t n, float *y,
                     size_t ldy, uint32_t r0, uint32_t r1) {
    qmat m;
    m.q4 = W->format == SMOE_FMT_Q4;
    m.codes = w;
    m.scales = w + W->scales_off;
    m.biases = w + W->biases_off;
    m.row_bytes = m.q4 ? W->cols / 2 : W->cols;
    m.sf = W->scale_format;
    m.sbytes = scale_bytes(m.sf);
    m.G = W->group;
    m.gpr = W->cols / m.G;
    m.gpr8 = (m.gpr + 7) & ~7u;
    const uint32_t G = m.G, cols = W->cols;

    float X[TT][MAXG];                /* (tile tokens, groups) group sums of x */
    float sb[RB][MAXG], bb[RB][MAXG]; /* (block rows, groups) scales, biases */
    float qf[RB][CB];                 /* (block rows, block columns) decoded codes */
    float tot[TT][RB][8];             /* (tile tokens, block rows, lanes) running scaled sums */

    for (uint32_t t0 = 0; t0 < n; t0 += TT) {
        const uint32_t nt = n - t0 < TT ? n - t0 : TT;
        for (uint32_t t = 0; t < nt; t++) group_sums(X[t], x + (size_t)(t0 + t) * ldx, m.gpr, G);
        float *yt = y + (size_t)t0 * ldy;
        if (nt == 1) {
            q_matvec(&m, r0, r1, x + (size_t)t0 * ldx, X[0], yt);
            continue;
        }
        for (uint32_t r = r0; r < r1; r += RB) {
            const uint32_t nr = r1 - r < RB ? r1 - r : RB;
            for (uint32_t i = 0; i < nr; i++) {
                load_scales(sb[i], m.scales + m.sbytes * (size_t)(r + i) * m.gpr, m.gpr, m.sf);
                load_scales(bb[i], m.biases + m.sbytes * (size_t)(r + i) * m.gpr, m.gpr, m.sf);
            }
            memset(tot, 0, sizeof tot); /* +0 */
            for (uint32_t c0 = 0; c0 < cols; c0 += CB) {
                const uint32_t nc = cols - c0 < CB ? cols - c0 : CB; /* a multiple of G */
                for (uint32_t i = 0; i < nr; i++) {
                    const uint8_t *p = m.codes + (size_t)(r + i) * m.row_bytes + (m.q4 ? c0 / 2 : c0);
                    for (uint32_t c = 0; c < nc; c += 16) { /* 16 codes: chunk c/16 of the block */
                        f8 q[2];
                        codes16(q, q_bytes16(p, (int)(c / 16), m.q4));
                        f8_store(qf[i] + c, q[0]);
                        f8_store(qf[i] + c + 8, q[1]);
                    }
                }
                const float *s[RB] = {sb[0] + c0 / G, sb[1] + c0 / G, sb[2] + c0 / G, sb[3] + c0 / G};
                for (uint32_t tb = 0; tb < nt; tb += TB) {
                    const uint32_t ntb = nt - tb < TB ? nt - tb : TB;
                    const float *xt[TB];
                    for (uint32_t j = 0; j < ntb; j++) xt[j] = x + (size_t)(t0 + tb + j) * ldx + c0;
                    q_block_any((int)nr, (int)ntb, G, qf[0], s, xt, nc / G, tot + tb);
                }
            }
            for (uint32_t t = 0; t < nt; t++)
                for (uint32_t i = 0; i < nr; i++) {
                    const float h = hsum8(f8_load(tot[t][i]));
                    yt[(size_t)t * ldy + r + i] = h + bias_dot(bb[i], X[t], m.gpr8);
                }
        }
    }
}

/* ------------------------------------------------------------------------ f32, bf16 */

/* R rows from r against one token: acc in registers, the whole row in one pass. */
INLINE void f_rows_1(const int R, const uint8_t *w, size_t row_bytes, bool bf16, uint32_t cols, uint32_t r,
                     const float *x, float *y) {
    f8 acc[RV];
    const uint8_t *p[RV];
    for (int i = 0; i < R; i++) {
        acc[i] = f8_zero();
        p[i] = w + (size_t)(r + i) * row_bytes;
    }
    uint32_t c = 0;
    for (; c + 8 <= cols; c += 8) {
        const f8 xv = f8_load(x + c);
        for (int i = 0; i < R; i++) acc[i] = f8_fma(acc[i], f_load(p[i], bf16, c), xv);
    }
    if (c < cols) {
        const f8 xv = x_load_tail(x + c, cols - c);
        for (int i = 0; i < R; i++) acc[i] = f8_fma(acc[i], f_load_tail(p[i], bf16, c, cols - c), xv);
    }
    for (int i = 0; i < R; i++) y[r + i] = hsum8(acc[i]);
}

/* R rows × T tokens over nc columns (the last nc % 8 zero-padded), one half of each accumulator
 * at a time. wr[i]: row i at this block's first column (f32); xt[j]: token j likewise;
 * acc[j][i]: the accumulator of (row i, token j), carried in memory. */
INLINE void f_block(const int R, const int T, const float *const *wr, const float *const *xt, uint32_t nc,
                    float (*acc)[RB][8]) {
    const uint32_t nc8 = nc & ~7u, m = nc - nc8;
    float wtail[RB][8], xtail[TB][8]; /* the last partial vector of each row and token, padded */
    if (m) {
        for (int i = 0; i < R; i++) {
            memset(wtail[i], 0, sizeof wtail[i]);
            memcpy(wtail[i], wr[i] + nc8, 4 * (size_t)m);
        }
        for (int j = 0; j < T; j++) {
            memset(xtail[j], 0, sizeof xtail[j]);
            memcpy(xtail[j], xt[j] + nc8, 4 * (size_t)m);
        }
    }
    for (int h = 0; h < 2; h++) {
        const int o = 4 * h;
        float32x4_t a[RB][TB];
        for (int i = 0; i < R; i++)
            for (int j = 0; j < T; j++) a[i][j] = vld1q_f32(acc[j][i] + o);
        for (uint32_t c = 0; c < nc8; c += 8) {
            float32x4_t wv[RB];
            for (int i = 0; i < R; i++) wv[i] = vld1q_f32(wr[i] + c + o);
            for (int j = 0; j < T; j++) {
                const float32x4_t xv = vld1q_f32(xt[j] + c + o);
                for (int i = 0; i < R; i++) a[i][j] = vfmaq_f32(a[i][j], wv[i], xv);
            }
        }
        if (m) {
            float32x4_t wv[RB];
            for (int i = 0; i < R; i++) wv[i] = vld1q_f32(wtail[i] + o);
            for (int j = 0; j < T; j++) {
                const float32x4_t xv = vld1q_f32(xtail[j] + o);
                for (int i = 0; i < R; i++) a[i][j] = vfmaq_f32(a[i][j], wv[i], xv);
            }
        }
        for (int i = 0; i < R; i++)
            for (int j = 0; j < T; j++) vst1q_f32(acc[j][i] + o, a[i][j]);
    }
}

static void f_block_any(int R, int T, const float *const *wr, const float *const *xt, uint32_t nc,
                        float (*acc)[RB][8]) {
    switch (R * 8 + T) {
#define CASE(r, t) \
    case r * 8 + t: f_block(r, t, wr, xt, nc, acc); break;
        CASE(4, 4) CASE(4, 3) CASE(4, 2) CASE(4, 1)
        CASE(3, 4) CASE(3, 3) CASE(3, 2) CASE(3, 1)
        CASE(2, 4) CASE(2, 3) CASE(2, 2) CASE(2, 1)
        CASE(1, 4) CASE(1, 3) CASE(1, 2) CASE(1, 1)
#undef CASE
    }
}

static void f_matmul(const smoe_tensor *W, const uint8_t *w, const float *x, size_t ldx, uint32_t n, float *y,
                     size_t ldy, uint32_t r0, uint32_t r1) {
    const bool bf16 = W->format == SMOE_FMT_BF16;
    const uint32_t cols = W->cols;
    const size_t row_bytes = (size_t)cols * (bf16 ? 2 : 4);
    float wb[RB][FCB];    /* (block rows, block columns) the weights as f32 */
    float acc[TT][RB][8]; /* (tile tokens, block rows, lanes) */

    for (uint32_t t0 = 0; t0 < n; t0 += TT) {
        const uint32_t nt = n - t0 < TT ? n - t0 : TT;
        float *yt = y + (size_t)t0 * ldy;
        if (nt == 1) {
            const float *xt = x + (size_t)t0 * ldx;
            uint32_t r = r0;
            for (; r + RV <= r1; r += RV) f_rows_1(RV, w, row_bytes, bf16, cols, r, xt, yt);
            switch (r1 - r) {
            case 3: f_rows_1(3, w, row_bytes, bf16, cols, r, xt, yt); break;
            case 2: f_rows_1(2, w, row_bytes, bf16, cols, r, xt, yt); break;
            case 1: f_rows_1(1, w, row_bytes, bf16, cols, r, xt, yt); break;
            }
            continue;
        }
        for (uint32_t r = r0; r < r1; r += RB) {
            const uint32_t nr = r1 - r < RB ? r1 - r : RB;
            memset(acc, 0, sizeof acc); /* +0 */
            for (uint32_t c0 = 0; c0 < cols; c0 += FCB) {
                const uint32_t nc = cols - c0 < FCB ? cols - c0 : FCB;
                const float *wr[RB];
                for (uint32_t i = 0; i < nr; i++) {
                    const uint8_t *row = w + (size_t)(r + i) * row_bytes;
                    /* f32 rows are copied too: the register block then loads through a float
                     * pointer that is known to be aligned for float */
                    uint32_t c = 0;
                    for (; c + 8 <= nc; c += 8) f8_store(wb[i] + c, f_load(row, bf16, c0 + c));
                    if (c < nc) {
                        float tail[8];
                        f8_store(tail, f_load_tail(row, bf16, c0 + c, nc - c));
                        memcpy(wb[i] + c, tail, 4 * (size_t)(nc - c));
                    }
                    wr[i] = wb[i];
                }
                for (uint32_t tb = 0; tb < nt; tb += TB) {
                    const uint32_t ntb = nt - tb < TB ? nt - tb : TB;
                    const float *xt[TB];
                    for (uint32_t j = 0; j < ntb; j++) xt[j] = x + (size_t)(t0 + tb + j) * ldx + c0;
                    f_block_any((int)nr, (int)ntb, wr, xt, nc, acc + tb);
                }
            }
            for (uint32_t t = 0; t < nt; t++)
                for (uint32_t i = 0; i < nr; i++) yt[(size_t)t * ldy + r + i] = hsum8(f8_load(acc[t][i]));
        }
    }
}

bool smoe_neon_matmul_rows(const smoe_tensor *W, const uint8_t *w, const float *x, size_t ldx, uint32_t n, float *y,
                           size_t ldy, uint32_t r0, uint32_t r1) {
    switch (W->format) {
    case SMOE_FMT_F32:
    case SMOE_FMT_BF16:
        f_matmul(W, w, x, ldx, n, y, ldy, r0, r1);
        return true;
    case SMOE_FMT_Q8:
    case SMOE_FMT_Q4:
        if (!group_ok(W->group) || W->cols % W->group || W->cols > MAXC) return false;
        q_matmul(W, w, x, ldx, n, y, ldy, r0, r1);
        return true;
    default:
        return false;
    }
}

/* ------------------------------------------------------------------------ per-token math */

/* Σ a[c]·b[c]: one 8-lane fma chain in column order, the last vector zero-padded, then hsum8. */
INLINE float dot8(const float *a, const float *b, uint32_t n) {
    f8 acc = f8_zero();
    uint32_t c = 0;
    for (; c + 8 <= n; c += 8) acc = f8_fma(acc, f8_load(a + c), f8_load(b + c));
    if (c < n) acc = f8_fma(acc, x_load_tail(a + c, n - c), x_load_tail(b + c, n - c));
    return hsum8(acc);
}

void smoe_neon_rmsnorm(float *out, const float *x, const smoe_tensor *weight, uint32_t dim, float eps) {
    const float ss = dot8(x, x, dim);
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    const bool bf16 = weight->format == SMOE_FMT_BF16;
    uint32_t c = 0;
    for (; c + 8 <= dim; c += 8) {
        const f8 xv = f8_load(x + c), wv = f_load(weight->data, bf16, c);
        const f8 o = {vmulq_f32(wv.lo, vmulq_n_f32(xv.lo, inv)), vmulq_f32(wv.hi, vmulq_n_f32(xv.hi, inv))};
        f8_store(out + c, o);
    }
    for (; c < dim; c++) {
        float wv;
        if (bf16)
            wv = bf16_1(weight->data + 2 * (size_t)c);
        else
            memcpy(&wv, weight->data + 4 * (size_t)c, 4);
        float xn = x[c] * inv;
        out[c] = wv * xn;
    }
}

/* 4 KV elements of type dt from element i of row, as f32 (exactly) */
INLINE float32x4_t kv4(const void *row, size_t i, const uint32_t dt) {
    if (dt == SMOE_KV_F32) return vld1q_f32((const float *)row + i);
    const uint16x4_t h = vld1_u16((const uint16_t *)row + i);
    if (dt == SMOE_KV_BF16) return vreinterpretq_f32_u32(vshll_n_u16(h, 16));
    return vcvt_f32_f16(vreinterpret_f16_u16(h));
}

INLINE f8 kv8(const void *row, size_t i, const uint32_t dt) {
    f8 r = {kv4(row, i, dt), kv4(row, i + 4, dt)};
    return r;
}

/* the m < 8 elements of type dt from element i of row, zero-padded */
INLINE f8 kv8_tail(const void *row, size_t i, uint32_t m, const uint32_t dt) {
    if (dt == SMOE_KV_F32) return x_load_tail((const float *)row + i, m);
    uint16_t buf[8] = {0};
    memcpy(buf, (const uint16_t *)row + i, m * sizeof(uint16_t));
    return kv8(buf, 0, dt);
}

INLINE float kv1(const void *row, size_t i, const uint32_t dt) {
    if (dt == SMOE_KV_F32) return ((const float *)row)[i];
    uint16_t b[4] = {((const uint16_t *)row)[i], 0, 0, 0};
    return vgetq_lane_f32(kv4(b, 0, dt), 0);
}

/* smoe_attend for KV elements of type dt (a constant after inlining): the order of kernels.h */
INLINE void attend_t(float *out, const float *q, const void *k, const void *v, size_t stride, uint32_t n_pos,
                     uint32_t head_dim, float sink, float *scratch, const uint32_t dt) {
    const float scale = (float)(1.0 / sqrt((double)head_dim));
    const size_t eb = dt == SMOE_KV_F32 ? 4 : 2;
    for (uint32_t p = 0; p < n_pos; p++) {
        const void *kp = (const uint8_t *)k + p * stride * eb;
        f8 acc = f8_zero();
        uint32_t c = 0;
        for (; c + 8 <= head_dim; c += 8) acc = f8_fma(acc, f8_load(q + c), kv8(kp, c, dt));
        if (c < head_dim) acc = f8_fma(acc, x_load_tail(q + c, head_dim - c), kv8_tail(kp, c, head_dim - c, dt));
        scratch[p] = hsum8(acc) * scale;
    }
    smoe_softmax_sink(scratch, n_pos, sink);
    /* out[d] = Σ_p a_p·v_p[d] as one fma chain in position order from +0, 64 dimensions at a time
     * in registers, then 4, then 1 */
    uint32_t d0 = 0;
    for (; d0 + 64 <= head_dim; d0 += 64) {
        float32x4_t o[16];
        for (int j = 0; j < 16; j++) o[j] = vdupq_n_f32(0.0f);
        for (uint32_t p = 0; p < n_pos; p++) {
            const float a = scratch[p];
            const void *vp = (const uint8_t *)v + p * stride * eb;
            for (int j = 0; j < 16; j++) o[j] = vfmaq_n_f32(o[j], kv4(vp, d0 + 4 * (size_t)j, dt), a);
        }
        for (int j = 0; j < 16; j++) vst1q_f32(out + d0 + 4 * j, o[j]);
    }
    for (; d0 + 4 <= head_dim; d0 += 4) {
        float32x4_t o = vdupq_n_f32(0.0f);
        for (uint32_t p = 0; p < n_pos; p++)
            o = vfmaq_n_f32(o, kv4((const uint8_t *)v + p * stride * eb, d0, dt), scratch[p]);
        vst1q_f32(out + d0, o);
    }
    for (uint32_t d = d0; d < head_dim; d++) {
        float o = 0.0f;
        for (uint32_t p = 0; p < n_pos; p++) o = fmaf(scratch[p], kv1((const uint8_t *)v + p * stride * eb, d, dt), o);
        out[d] = o;
    }
}

void smoe_neon_attend(float *out, const float *q, const void *k, const void *v, size_t stride, uint32_t n_pos,
                      uint32_t head_dim, uint32_t kv_dtype, float sink, float *scratch) {
    if (kv_dtype == SMOE_KV_BF16)
        attend_t(out, q, k, v, stride, n_pos, head_dim, sink, scratch, SMOE_KV_BF16);
    else if (kv_dtype == SMOE_KV_F16)
        attend_t(out, q, k, v, stride, n_pos, head_dim, sink, scratch, SMOE_KV_F16);
    else
        attend_t(out, q, k, v, stride, n_pos, head_dim, sink, scratch, SMOE_KV_F32);
}


/* ---------------------------------------------------------- q with 8-bit activations */

/* smoe_matmul_rows_qx with NEON: the reference's arithmetic (kernels_ref.c), the same bits. Each
 * row's codes are unpacked once into the layout of the x codes; per (row, token) and block the
 * integer products are widened (vmull, exact) and pairwise added into int32 (vpadal), summed
 * with vaddvq (exact); the float part is the reference's, lanes 0–3 and 4–7 in two vectors. */

/* A row of `cols` columns' codes for units [0, up) in the layout of kernels_ref.c (q4 as int8:
 * columns 0–15, 32–47, 16–31, 48–63 per unit of 64; q8 as int16: columns 8v..8v+8 | 32+8v..32+8v+8
 * for v = 0..3), zeros past cols. A last half unit is read through a zero-padded copy. */
static void qx_unpack_neon(uint8_t *dst, const uint8_t *src, uint32_t cols, uint32_t up, bool q8) {
    const size_t wb = q8 ? 64 : 32; /* stored bytes per unit */
    for (uint32_t g = 0; g < up; g++) {
        if (64 * g >= cols) {
            memset(dst + (size_t)g * (q8 ? 128 : 64), 0, q8 ? 128 : 64);
            continue;
        }
        uint8_t half[64];
        const uint8_t *u = src + wb * g; /* the unit's stored codes */
        if (64 * g + 64 > cols) {         /* a half unit: its second half zero */
            memcpy(half, u, wb / 2);
            memset(half + wb / 2, 0, wb / 2);
            u = half;
        }
        if (!q8) {
            const uint8x16_t b0 = vld1q_u8(u), b1 = vld1q_u8(u + 16);
            const uint8x16_t m = vdupq_n_u8(15);
            const uint8x16_t l0 = vandq_u8(b0, m), h0 = vshrq_n_u8(b0, 4); /* columns 0–31: even, odd */
            const uint8x16_t l1 = vandq_u8(b1, m), h1 = vshrq_n_u8(b1, 4); /* columns 32–63 */
            uint8_t *o = dst + 64 * (size_t)g;
            vst1q_u8(o, vzip1q_u8(l0, h0));      /* 0–15 */
            vst1q_u8(o + 16, vzip1q_u8(l1, h1)); /* 32–47 */
            vst1q_u8(o + 32, vzip2q_u8(l0, h0)); /* 16–31 */
            vst1q_u8(o + 48, vzip2q_u8(l1, h1)); /* 48–63 */
        } else {
            const uint8_t *p = u;
            int16_t *o = (int16_t *)(void *)(dst + 128 * (size_t)g);
            for (int v = 0; v < 4; v++) {
                vst1q_s16(o + 16 * v, vreinterpretq_s16_u16(vmovl_u8(vld1_u8(p + 8 * v))));
                vst1q_s16(o + 16 * v + 8, vreinterpretq_s16_u16(vmovl_u8(vld1_u8(p + 32 + 8 * v))));
            }
        }
    }
}

/* The exact block sums of one group: *i0 block 0 (columns 0–31), *i1 block 1. */
INLINE void qx_sums_neon(const uint8_t *w, const uint8_t *x, bool q8, int32_t *i0, int32_t *i1) {
    if (!q8) { /* block 0: bytes 0–15 and 32–47 of the layout; block 1: 16–31 and 48–63 */
        int32x4_t a = vdupq_n_s32(0), b = vdupq_n_s32(0);
        for (int h = 0; h < 2; h++) {
            const int8x16_t wa = vreinterpretq_s8_u8(vld1q_u8(w + 32 * h)), xa = vld1q_s8((const int8_t *)x + 32 * h);
            const int8x16_t wb = vreinterpretq_s8_u8(vld1q_u8(w + 32 * h + 16));
            const int8x16_t xb = vld1q_s8((const int8_t *)x + 32 * h + 16);
            a = vpadalq_s16(a, vmull_s8(vget_low_s8(wa), vget_low_s8(xa)));
            a = vpadalq_s16(a, vmull_high_s8(wa, xa));
            b = vpadalq_s16(b, vmull_s8(vget_low_s8(wb), vget_low_s8(xb)));
            b = vpadalq_s16(b, vmull_high_s8(wb, xb));
        }
        *i0 = vaddvq_s32(a);
        *i1 = vaddvq_s32(b);
        return;
    }
    const int16_t *wv = (const int16_t *)(const void *)w, *xv = (const int16_t *)(const void *)x;
    int32x4_t a = vdupq_n_s32(0), b = vdupq_n_s32(0);
    for (int v = 0; v < 4; v++) { /* the first 8 of each 16 are block 0, the last 8 block 1 */
        const int16x8_t w0 = vld1q_s16(wv + 16 * v), x0 = vld1q_s16(xv + 16 * v);
        const int16x8_t w1 = vld1q_s16(wv + 16 * v + 8), x1 = vld1q_s16(xv + 16 * v + 8);
        a = vmlal_s16(a, vget_low_s16(w0), vget_low_s16(x0));
        a = vmlal_high_s16(a, w0, x0);
        b = vmlal_s16(b, vget_low_s16(w1), vget_low_s16(x1));
        b = vmlal_high_s16(b, w1, x1);
    }
    *i0 = vaddvq_s32(a);
    *i1 = vaddvq_s32(b);
}

#define GQ(name) name
#define GQ_DOT 0
#include "kernels_neon_ggml.h"
#undef GQ
#undef GQ_DOT

/* Row r's scales and biases by group (sb, bb) and its scale by block in the lanes' order for units
 * [0, up) (se, σ of kernels_ref.c: se[2k + j], k a multiple of 4, is unit k + j % 4's block j / 4;
 * 0 past cols). */
INLINE void qx_row_scales(const smoe_tensor *W, const uint8_t *w, uint32_t r, uint32_t up, float *sb, float *bb,
                          float *se) {
    const uint32_t G = W->group, cols = W->cols, ng = cols / G;
    const size_t sbytes = scale_bytes(W->scale_format);
    load_scales(sb, w + W->scales_off + sbytes * (size_t)r * ng, ng, W->scale_format);
    load_scales(bb, w + W->biases_off + sbytes * (size_t)r * ng, ng, W->scale_format);
    for (uint32_t k = 0; k < up; k += 4)
        for (uint32_t j = 0; j < 8; j++) {
            const uint32_t c0 = 64 * (k + j % 4) + 32 * (j / 4); /* the block's first column */
            se[2 * k + j] = c0 < cols ? sb[c0 / G] : 0.0f;
        }
}

bool smoe_neon_matmul_rows_qx(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y,
                              size_t ldy, uint32_t r0, uint32_t r1) {
    if (gb_takes_codes(W->format)) return g_matmul_qx_neon(W, w, X, n, y, ldy, r0, r1);
    const uint32_t G = W->group, cols = W->cols;
    if (!group_ok(G) || cols % G || cols > MAXC) return false;
    const bool q8 = W->format == SMOE_FMT_Q8;
    const smoe_qx_size z = smoe_qx_sizes(cols, W->format, G);
    const uint32_t ng = cols / G, ng8 = (ng + 7) & ~7u, up = (uint32_t)z.d_floats / 2;
    const size_t row_bytes = q8 ? cols : cols / 2, gb = q8 ? 128 : 64;
    _Alignas(16) uint8_t cw[MAXU * 128]; /* (units · bytes) one row's unpacked codes */
    float sb[MAXG], bb[MAXG];            /* (groups) its scales and biases, zero-padded */
    float se[2 * MAXU];                  /* (units · 2) σ of kernels_ref.c per lane: se[8k + j] for units 4k.. */
    for (uint32_t r = r0; r < r1; r++) {
        qx_unpack_neon(cw, w + (size_t)r * row_bytes, cols, up, q8);
        qx_row_scales(W, w, r, up, sb, bb, se);
        for (uint32_t t = 0; t < n; t++) {
            const uint8_t *xt = (const uint8_t *)X->codes + (size_t)t * z.code_bytes;
            const float *dt = X->d + (size_t)t * z.d_floats, *st = X->gsum + (size_t)t * z.gsum_floats;
            float32x4_t t0 = vdupq_n_f32(0.0f), t1 = vdupq_n_f32(0.0f);
            for (uint32_t g = 0; g < up; g += 4) {
                int32_t i[8]; /* [I_{g..g+4, 0} | I_{g..g+4, 1}] */
                for (uint32_t k = 0; k < 4; k++)
                    qx_sums_neon(cw + (g + k) * gb, xt + (g + k) * gb, q8, &i[k], &i[4 + k]);
                const float32x4_t sd0 = vmulq_f32(vld1q_f32(se + 2 * g), vld1q_f32(dt + 2 * g));
                const float32x4_t sd1 = vmulq_f32(vld1q_f32(se + 2 * g + 4), vld1q_f32(dt + 2 * g + 4));
                t0 = vfmaq_f32(t0, vcvtq_f32_s32(vld1q_s32(i)), sd0);
                t1 = vfmaq_f32(t1, vcvtq_f32_s32(vld1q_s32(i + 4)), sd1);
            }
            f8 tot = {t0, t1};
            y[(size_t)t * ldy + r] = hsum8(tot) + bias_dot(bb, st, ng8);
        }
    }
    return true;
}

#if SMOE_HAVE_NEON_DOT
/* ------------------------------------------- q with 8-bit activations, by SDOT (ARMv8.2)
 *
 * The same integers as smoe_neon_matmul_rows_qx, so the same bits: each block's sum of code
 * products is formed by vdotq_s32 (4 products a lane, exact in int32) and the four units' lanes
 * reduced by pairwise adds (exact), instead of widening multiplies and one across-vector add a
 * block; the float part is that function's, operation for operation.
 *  q4: the row's codes (0–15, as int8) and the tokens' in kernels_ref.c's layout (qx_unpack_neon).
 *  q8: the stored codes are 0–255; as int8 they are w − 128 (the top bit flipped), so a block's
 *      Σ w·x = Σ (w − 128)·x + 128·Σ x, with Σ x the block's sum of the token's codes. The tokens'
 *      int16 codes are narrowed (exact: |x| ≤ 127) into column order, a tile of tokens at a time,
 *      with those sums beside them.
 *  GGML formats: kernels_neon_ggml.h's product with GQ_DOT 1. */
#if !defined(__ARM_FEATURE_DOTPROD)
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod")
#endif

enum { DOT_XTILE_BYTES = 65536 }; /* q8: the tokens' narrowed codes of a tile (stack) */

/* A q8 row's stored codes, units [0, up), as int8 w − 128 in column order (a unit's block 0 in its
 * bytes 0–31, block 1 in 32–63); zeros past cols (where every token's codes are zero too). */
static void qx_unpack_q8_dot(int8_t *dst, const uint8_t *src, uint32_t cols, uint32_t up) {
    const uint8x16_t top = vdupq_n_u8(0x80);
    for (uint32_t c = 0; c < 64 * up; c += 16)
        vst1q_s8(dst + c, c < cols ? vreinterpretq_s8_u8(veorq_u8(vld1q_u8(src + c), top)) : vdupq_n_s8(0));
}

/* A token's q8 codes (int16, kernels_ref.c's layout: per unit, for v < 4, columns 8v..8v+8 of
 * block 0 then of block 1) narrowed into column order, and each block's sum: s0[u], s1[u]. */
static void qx_x8_dot(int8_t *dst, int32_t *s0, int32_t *s1, const uint8_t *codes, uint32_t up) {
    const int16_t *x = (const int16_t *)(const void *)codes;
    for (uint32_t u = 0; u < up; u++, x += 64, dst += 64) {
        int32x4_t a = vdupq_n_s32(0), b = vdupq_n_s32(0);
        for (int v = 0; v < 4; v++) {
            const int16x8_t lo = vld1q_s16(x + 16 * v), hi = vld1q_s16(x + 16 * v + 8);
            vst1_s8(dst + 8 * v, vmovn_s16(lo));
            vst1_s8(dst + 32 + 8 * v, vmovn_s16(hi));
            a = vpadalq_s16(a, lo);
            b = vpadalq_s16(b, hi);
        }
        s0[u] = vaddvq_s32(a);
        s1[u] = vaddvq_s32(b);
    }
}

/* [Σ of a0's lanes, a1's, a2's, a3's] */
INLINE int32x4_t sum4x4(int32x4_t a0, int32x4_t a1, int32x4_t a2, int32x4_t a3) {
    return vpaddq_s32(vpaddq_s32(a0, a1), vpaddq_s32(a2, a3));
}

#define GQ(name) name##_dot
#define GQ_DOT 1
#include "kernels_neon_ggml.h"
#undef GQ
#undef GQ_DOT

/* One row against one token over units [0, up) (a multiple of 4): the float lanes of
 * smoe_neon_matmul_rows_qx. w, x: 64 bytes a unit, block 0's two 16-byte pieces at p0 and p1,
 * block 1's at p2 and p3 (q4: kernels_ref.c's layout; q8: column order); xs0, xs1: the token's
 * block sums by unit (q8; NULL for q4). */
INLINE f8 qx_row_dot(const int8_t *w, const int8_t *x, const int32_t *xs0, const int32_t *xs1, const float *se,
                     const float *dt, uint32_t up, bool q8) {
    const int p0 = 0, p1 = q8 ? 16 : 32, p2 = q8 ? 32 : 16, p3 = 48; /* block 0: p0, p1; block 1: p2, p3 */
    float32x4_t t0 = vdupq_n_f32(0.0f), t1 = vdupq_n_f32(0.0f);
    for (uint32_t g = 0; g < up; g += 4) {
        int32x4_t a[4], b[4];
        for (int k = 0; k < 4; k++) {
            const int8_t *wk = w + 64 * (size_t)(g + k), *xk = x + 64 * (size_t)(g + k);
            a[k] = vdotq_s32(vdotq_s32(vdupq_n_s32(0), vld1q_s8(wk + p0), vld1q_s8(xk + p0)), vld1q_s8(wk + p1),
                             vld1q_s8(xk + p1));
            b[k] = vdotq_s32(vdotq_s32(vdupq_n_s32(0), vld1q_s8(wk + p2), vld1q_s8(xk + p2)), vld1q_s8(wk + p3),
                             vld1q_s8(xk + p3));
        }
        int32x4_t i0 = sum4x4(a[0], a[1], a[2], a[3]), i1 = sum4x4(b[0], b[1], b[2], b[3]);
        if (q8) { /* + 128 · Σ x of each block */
            i0 = vaddq_s32(i0, vshlq_n_s32(vld1q_s32(xs0 + g), 7));
            i1 = vaddq_s32(i1, vshlq_n_s32(vld1q_s32(xs1 + g), 7));
        }
        const float32x4_t sd0 = vmulq_f32(vld1q_f32(se + 2 * g), vld1q_f32(dt + 2 * g));
        const float32x4_t sd1 = vmulq_f32(vld1q_f32(se + 2 * g + 4), vld1q_f32(dt + 2 * g + 4));
        t0 = vfmaq_f32(t0, vcvtq_f32_s32(i0), sd0);
        t1 = vfmaq_f32(t1, vcvtq_f32_s32(i1), sd1);
    }
    return (f8){t0, t1};
}

bool smoe_neon_matmul_rows_qx_dot(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y,
                                  size_t ldy, uint32_t r0, uint32_t r1) {
    if (gb_takes_codes(W->format)) return g_matmul_qx_neon_dot(W, w, X, n, y, ldy, r0, r1);
    if (W->format != SMOE_FMT_Q4 && W->format != SMOE_FMT_Q8) return false;
    const uint32_t G = W->group, cols = W->cols;
    if (!group_ok(G) || cols % G || cols > MAXC) return false;
    const bool q8 = W->format == SMOE_FMT_Q8;
    const smoe_qx_size z = smoe_qx_sizes(cols, W->format, G);
    const uint32_t ng = cols / G, ng8 = (ng + 7) & ~7u, up = (uint32_t)z.d_floats / 2;
    const size_t row_bytes = q8 ? cols : cols / 2;
    /* q8: tokens a tile, their narrowed codes and block sums on the stack; q4: all n at once */
    const uint32_t tile = q8 ? DOT_XTILE_BYTES / (64 * up) : n;
    _Alignas(16) int8_t cw[MAXU * 64];          /* one row's codes as int8 */
    _Alignas(16) int8_t xq[DOT_XTILE_BYTES]; /* q8: a tile of tokens' codes as int8 */
    int32_t xs[2 * DOT_XTILE_BYTES / 64];     /* q8: their block sums, [token][2][up] */
    float sb[MAXG], bb[MAXG], se[2 * MAXU];
    for (uint32_t t0 = 0; t0 < n; t0 += tile) {
        const uint32_t nt = n - t0 < tile ? n - t0 : tile;
        if (q8)
            for (uint32_t t = 0; t < nt; t++)
                qx_x8_dot(xq + (size_t)t * 64 * up, xs + (size_t)t * 2 * up, xs + (size_t)t * 2 * up + up,
                          (const uint8_t *)X->codes + (size_t)(t0 + t) * z.code_bytes, up);
        for (uint32_t r = r0; r < r1; r++) {
            if (q8)
                qx_unpack_q8_dot(cw, w + (size_t)r * row_bytes, cols, up);
            else
                qx_unpack_neon((uint8_t *)cw, w + (size_t)r * row_bytes, cols, up, false);
            qx_row_scales(W, w, r, up, sb, bb, se);
            for (uint32_t t = 0; t < nt; t++) {
                const uint32_t tt = t0 + t;
                const float *dt = X->d + (size_t)tt * z.d_floats, *st = X->gsum + (size_t)tt * z.gsum_floats;
                const f8 tot = q8 ? qx_row_dot(cw, xq + (size_t)t * 64 * up, xs + (size_t)t * 2 * up,
                                               xs + (size_t)t * 2 * up + up, se, dt, up, true)
                                  : qx_row_dot(cw, (const int8_t *)X->codes + (size_t)tt * z.code_bytes, NULL, NULL,
                                               se, dt, up, false);
                y[(size_t)tt * ldy + r] = hsum8(tot) + bias_dot(bb, st, ng8);
            }
        }
    }
    return true;
}

#if !defined(__ARM_FEATURE_DOTPROD)
#pragma GCC pop_options
#endif
#endif /* SMOE_HAVE_NEON_DOT */

#endif /* SMOE_HAVE_NEON */
