/* kernels_avx2.c — AVX2 + FMA + F16C kernels for x86-64 (kernels_isa.h says when they are built).
 *
 * What they must keep
 * -------------------
 * The rule of kernels_ref.c: each output element is reduced by one sequence of floating-point
 * operations that depends on its own shape only — never on n, on the rows [r0, r1) a thread was
 * given, or on the thread count — so the token-serial and layer-major paths agree bit for bit.
 * They need not agree with the reference kernels bit for bit (they use fused multiply-adds and
 * their own order); tests/c/test_kernels.c checks them against the reference within a stated
 * tolerance, and checks their own n- and split-independence exactly.
 *
 * The order, for y[t, r] = Σ_c W[r, c]·x[t, c]
 * --------------------------------------------
 * One 8-lane accumulator per (row, token); lane j sees columns c ≡ j (mod 8) in increasing
 * order; the end is the fixed tree ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) of hsum8.
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
 *                  y   = hsum8(tot · lf) + hsum8(bia)
 *              For q4 the codes come out of one vpshufb + vpand per 8, with odd lanes holding
 *              16·q (the high nibble left in place); lf = (1, 1/16, 1, 1/16, …) undoes that at
 *              the end, exactly (a power of two). For q8, lf = 1 and the multiply is skipped.
 *              X_g is a function of the token alone, computed once per call (per tile of TT
 *              tokens) and the same way whatever n.
 *
 * How the shapes share work without touching that order
 * ------------------------------------------------------
 *  n = 1 (and a last tile of one token): rows RV at a time, codes decoded into registers as they
 *  stream past, tot in registers — the matrix-vector product, bound by decoding and memory.
 *  n ≥ 2: tokens in tiles of TT; for each block of RB rows, each block of CB columns is decoded
 *  once into a float buffer and fed to register blocks of RB rows × TB tokens, whose partial
 *  accumulators (a) live in registers and whose tot lives in a small stack array between groups.
 *  A store and a load are exact, so spilling changes nothing; every block size is a choice about
 *  reuse, never about the order of any one sum.
 *
 * Rows wider than MAXC columns (q) go to the reference kernel: a choice by shape, not by n.
 * Scales and biases may be f16, bf16 or f32: all are widened to f32 exactly before use, so the
 * scale format changes no operation above.
 *
 * Error, against the exact sum: the q forms carry the cancellation of s·q against b, so the bound
 * is relative to M = Σ_c (|s_g·q_c| + |b_g|)·|x_c|, not to Σ|w_c·x_c|; see tests/c/test_kernels.c.
 */
#include "kernels_isa.h"
#include "cpu.h"

#if SMOE_HAVE_AVX2

#include "ggml_blocks.h"

#include <assert.h>
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

enum {
    MAXC = 16384,    /* columns of a row the q kernels take; wider rows: reference */
    MAXG = MAXC / 32, /* groups of such a row at most (group size 32) */
    RB = 3,      /* rows of a register block (n ≥ 2) */
    TB = 4,      /* tokens of a register block: RB·TB accumulators + RB codes + 1 x = 16 ymm */
    TT = 32,     /* tokens of a tile: they share one decoding of each weight block */
    CB = 512,    /* q columns decoded at a time (a multiple of every group size) */
    FCB = 512,   /* f32/bf16 columns per block (a multiple of 8) */
    RV = 4,      /* rows at a time in the matrix-vector kernels (n = 1) */
};

/* The group sizes the q kernels take: 32, 64, 128 (docs/vault.md). */
INLINE bool group_ok(uint32_t G) { return G == 32 || G == 64 || G == 128; }

/* ------------------------------------------------------------------------------ helpers */

/* ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) */
INLINE float hsum8(__m256 v) {
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
    return _mm_cvtss_f32(s1);
}

INLINE __m256i tail_mask(uint32_t m) { /* lanes [0, m) set, 0 ≤ m ≤ 8 */
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)m), lane);
}

INLINE __m256 bf16x8(const uint8_t *p) { /* 8 bf16 → f32, exactly */
    __m128i h = _mm_loadu_si128((const __m128i *)(const void *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
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

/* 8 f16 or bf16 values as f32, exactly */
INLINE __m256 widen8(__m128i h, uint8_t sf) {
    return sf == SMOE_SCALE_F16 ? _mm256_cvtph_ps(h)
                                : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* dst[g] = the ng scales (or biases; f16, bf16 or f32) at src as f32 (exactly); zeros after, up
 * to a multiple of 8. A last part of fewer than 8 is one vector too: its whole 32-bit pairs by a
 * masked load (nothing past src's ng values is read), an odd last value put in beside them. */
INLINE void load_scales(float *dst, const uint8_t *src, uint32_t ng, uint8_t sf) {
    uint32_t g = 0;
    if (sf == SMOE_SCALE_F32) {
        memcpy(dst, src, 4 * (size_t)ng);
        for (g = ng; g % 8; g++) dst[g] = 0.0f;
        return;
    }
    for (; g + 8 <= ng; g += 8)
        _mm256_storeu_ps(dst + g, widen8(_mm_loadu_si128((const __m128i *)(const void *)(src + 2 * g)), sf));
    if (g < ng) {
        const uint32_t m = ng - g; /* 1 to 7 values */
        const __m128i lane = _mm_setr_epi32(0, 1, 2, 3);
        __m128i h = _mm_maskload_epi32((const int *)(const void *)(src + 2 * g),
                                       _mm_cmpgt_epi32(_mm_set1_epi32((int)(m / 2)), lane));
        if (m % 2) {
            uint16_t last;
            memcpy(&last, src + 2 * (g + m - 1), 2);
            h = _mm_or_si128(h, _mm_and_si128(_mm_set1_epi32(last), _mm_cmpeq_epi32(_mm_set1_epi32((int)(m / 2)), lane)));
        }
        _mm256_storeu_ps(dst + g, widen8(h, sf));
    }
}

/* X[g] = Σ of group g (G columns) of x, the order of the essay; zeros after, up to a multiple of 8 */
static void group_sums(float *X, const float *x, uint32_t gpr, uint32_t G) {
    uint32_t g = 0;
    for (; g < gpr; g++) {
        const float *xg = x + (size_t)g * G;
        __m256 v = _mm256_loadu_ps(xg);
        for (uint32_t k = 1; k < G / 8; k++) v = _mm256_add_ps(v, _mm256_loadu_ps(xg + 8 * k));
        X[g] = hsum8(v);
    }
    for (; g % 8; g++) X[g] = 0.0f;
}

/* hsum8 of Σ_g fma(b[g..g+8), X[g..g+8)) over gpr8 (a multiple of 8) zero-padded groups */
INLINE float bias_dot(const float *b, const float *X, uint32_t gpr8) {
    __m256 a = _mm256_setzero_ps();
    for (uint32_t g = 0; g < gpr8; g += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(b + g), _mm256_loadu_ps(X + g), a);
    return hsum8(a);
}

/* ------------------------------------------------------------------------- q codes */

/* Codes 8k..8k+7 of a q4 row's codes at p (code 2j the low nibble of byte j) as floats: even
 * lanes q, odd lanes 16·q. The 16 bytes holding them are broadcast to both 128-bit halves; the
 * shuffle puts byte (4(k%4) + lane/2) in the low byte of each lane and the mask keeps its nibble. */
#define Z(x) ((int32_t)(0x80808000u | (x)))
#define CTRL(b) {Z(b), Z(b), Z(b + 1), Z(b + 1), Z(b + 2), Z(b + 2), Z(b + 3), Z(b + 3)}
static const int32_t q4_ctrl[4][8] __attribute__((aligned(32))) = {CTRL(0), CTRL(4), CTRL(8), CTRL(12)};
#undef CTRL
#undef Z

INLINE __m256 q4_code8(const uint8_t *p, int k) {
    const __m256i half = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)(p + 16 * (k / 4))));
    const __m256i ctrl = _mm256_load_si256((const __m256i *)(const void *)q4_ctrl[k % 4]);
    const __m256i mask = _mm256_setr_epi32(0x0f, 0xf0, 0x0f, 0xf0, 0x0f, 0xf0, 0x0f, 0xf0);
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_shuffle_epi8(half, ctrl), mask));
}

INLINE __m256 q8_code8(const uint8_t *p, int k) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(p + 8 * k))));
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

/* R rows from r against one token (X its group sums), groups of G: codes decoded as they stream
 * past, 8 at a time for all R rows against one vector of x; tot in registers. */
INLINE void q_rows_1(const int R, const bool q4, const uint32_t G, const qmat *m, uint32_t r, const float *x,
                     const float *X, float *y) {
    float s[RV][MAXG], b[RV][MAXG]; /* (rows, groups) scales and biases as f32 */
    const uint8_t *p[RV];
    __m256 tot[RV];
    for (int i = 0; i < R; i++) {
        load_scales(s[i], m->scales + m->sbytes * (size_t)(r + i) * m->gpr, m->gpr, m->sf);
        load_scales(b[i], m->biases + m->sbytes * (size_t)(r + i) * m->gpr, m->gpr, m->sf);
        p[i] = m->codes + (size_t)(r + i) * m->row_bytes;
        tot[i] = _mm256_setzero_ps();
    }
    const size_t gbytes = q4 ? G / 2 : G;
    for (uint32_t g = 0; g < m->gpr; g++) {
        const float *xg = x + (size_t)g * G;
        __m256 a[RV];
#pragma GCC unroll 16
        for (int k = 0; k < (int)G / 8; k++) {
            const __m256 xv = _mm256_loadu_ps(xg + 8 * k);
            for (int i = 0; i < R; i++) {
                const uint8_t *pg = p[i] + g * gbytes;
                const __m256 q = q4 ? q4_code8(pg, k) : q8_code8(pg, k);
                a[i] = k == 0 ? _mm256_mul_ps(q, xv) : _mm256_fmadd_ps(q, xv, a[i]);
            }
        }
        for (int i = 0; i < R; i++) tot[i] = _mm256_fmadd_ps(a[i], _mm256_broadcast_ss(s[i] + g), tot[i]);
    }
    const __m256 lf = _mm256_setr_ps(1.0f, 0.0625f, 1.0f, 0.0625f, 1.0f, 0.0625f, 1.0f, 0.0625f);
    for (int i = 0; i < R; i++) {
        float h = hsum8(q4 ? _mm256_mul_ps(tot[i], lf) : tot[i]);
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

/* R rows × T tokens over ng groups of G. qf: the decoded codes, row i at qf + i·CB; s[i]: row
 * i's scales from this block's first group; xt[j]: token j at this block's first column;
 * tot[j][i]: the running tot of (row i, token j). */
INLINE void q_block(const int R, const int T, const uint32_t G, const float *qf, const float *const *s,
                    const float *const *xt, uint32_t ng, __m256 (*tot)[RB]) {
    for (uint32_t g = 0; g < ng; g++) {
        __m256 a[RB][TB];
        const float *qg = qf + (size_t)g * G;
        {
            __m256 qv[RB];
            for (int i = 0; i < R; i++) qv[i] = _mm256_loadu_ps(qg + (size_t)i * CB);
            for (int j = 0; j < T; j++) {
                __m256 xv = _mm256_loadu_ps(xt[j] + (size_t)g * G);
                for (int i = 0; i < R; i++) a[i][j] = _mm256_mul_ps(qv[i], xv);
            }
        }
        for (int k = 1; k < (int)G / 8; k++) {
            __m256 qv[RB];
            for (int i = 0; i < R; i++) qv[i] = _mm256_loadu_ps(qg + (size_t)i * CB + 8 * k);
            for (int j = 0; j < T; j++) {
                __m256 xv = _mm256_loadu_ps(xt[j] + (size_t)g * G + 8 * k);
                for (int i = 0; i < R; i++) a[i][j] = _mm256_fmadd_ps(qv[i], xv, a[i][j]);
            }
        }
        for (int i = 0; i < R; i++) {
            __m256 sv = _mm256_broadcast_ss(s[i] + g);
            for (int j = 0; j < T; j++) tot[j][i] = _mm256_fmadd_ps(a[i][j], sv, tot[j][i]);
        }
    }
}

static void q_block_any(int R, int T, uint32_t G, const float *qf, const float *const *s, const float *const *xt,
                        uint32_t ng, __m256 (*tot)[RB]) {
    switch ((int)(G / 32) * 64 + R * 8 + T) {
#define CASE(r, t)                                                                   \
    case 64 + r * 8 + t: q_block(r, t, 32, qf, s, xt, ng, tot); break;               \
    case 128 + r * 8 + t: q_block(r, t, 64, qf, s, xt, ng, tot); break;              \
    case 256 + r * 8 + t: q_block(r, t, 128, qf, s, xt, ng, tot); break;
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
    const __m256 lf = _mm256_setr_ps(1.0f, 0.0625f, 1.0f, 0.0625f, 1.0f, 0.0625f, 1.0f, 0.0625f);

    float X[TT][MAXG];             /* (tile tokens, groups) group sums of x */
    float sb[RB][MAXG], bb[RB][MAXG]; /* (block rows, groups) scales, biases */
    float qf[RB][CB];              /* (block rows, block columns) decoded codes */
    __m256 tot[TT][RB];            /* (tile tokens, block rows) running scaled sums */

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
            for (uint32_t t = 0; t < nt; t++)
                for (uint32_t i = 0; i < RB; i++) tot[t][i] = _mm256_setzero_ps();
            for (uint32_t c0 = 0; c0 < cols; c0 += CB) {
                const uint32_t nc = cols - c0 < CB ? cols - c0 : CB; /* a multiple of G */
                for (uint32_t i = 0; i < nr; i++) {
                    const uint8_t *p = m.codes + (size_t)(r + i) * m.row_bytes + (m.q4 ? c0 / 2 : c0);
                    for (uint32_t c = 0; c < nc; c += 32) /* 32 codes: 16 bytes (q4) or 32 (q8) */
                        for (int k = 0; k < 4; k++)
                            _mm256_storeu_ps(qf[i] + c + 8 * k, m.q4 ? q4_code8(p + c / 2, k) : q8_code8(p + c, k));
                }
                const float *s[RB] = {sb[0] + c0 / G, sb[1] + c0 / G, sb[2] + c0 / G};
                for (uint32_t tb = 0; tb < nt; tb += TB) {
                    const uint32_t ntb = nt - tb < TB ? nt - tb : TB;
                    const float *xt[TB];
                    for (uint32_t j = 0; j < ntb; j++) xt[j] = x + (size_t)(t0 + tb + j) * ldx + c0;
                    q_block_any((int)nr, (int)ntb, G, qf[0], s, xt, nc / G, tot + tb);
                }
            }
            for (uint32_t t = 0; t < nt; t++)
                for (uint32_t i = 0; i < nr; i++) {
                    float h = hsum8(m.q4 ? _mm256_mul_ps(tot[t][i], lf) : tot[t][i]);
                    yt[(size_t)t * ldy + r + i] = h + bias_dot(bb[i], X[t], m.gpr8);
                }
        }
    }
}

/* ---------------------------------------------------------- q with 8-bit activations */

/* smoe_matmul_rows_qx: the arithmetic kernels_ref.c states, on vectors. A row block's codes are first
 * unpacked into the layout of the x codes (qx_unpack); then for each (row, token), four units of
 * 64 columns at a time: the integer products P_u (8 int32 lanes: lanes 0–3 from block 0, 4–7 from
 * block 1; exact, so how they are formed does not matter), two rounds of hadd to the exact block
 * sums [I_{u..u+4, 0} | I_{u..u+4, 1}], and one fma into tot with σ · d, σ the scales of the
 * blocks' groups laid out as the lanes (qx_sigma: one broadcast for group 64, one permute for
 * 32 and 128). The code is in kernels_avx2_qx.h, instantiated for plain AVX2 and for AVX-VNNI;
 * the VNNI one runs where the CPU has it (the same bits: see that file).
 *
 * The matrix-vector product (n = 1, decode) takes one row at a time, one sequential stream (four
 * interleaved rows read 16-25 % slower from DRAM and L3 alike on Zen 5: bench/RESULTS.md, "One
 * row at a time"), reads its codes in place and prefetches into L2 the bytes QX_AHEAD_BYTES
 * further on as it goes (bench/RESULTS.md, "Resident decode and short prefill on AVX2": ×1.5 on
 * a3b-shaped decode; with the hardware prefetcher alone, four interleaved row streams read well
 * below the memory's bandwidth, long rows and short alike; the hint and distance below); for q4
 * it takes x in the order of the nibbles (qx_nibble_order) so the codes
 * need no unpacking. A few tokens (2 to QX_SMALL_N4 for q4, QX_SMALL_N8 for q8: the tokens a short
 * prompt routes to one expert, and a short prompt's attention) go the same way, a row at a time
 * with its codes read in place and unpacked once for a pass of up to 4 (q4) or 3 (q8) tokens
 * (qx_row_T): the batched product's unpacked copy of each row cost more than the products it fed
 * (bench/RESULTS.md, "A few tokens a row": ×1.2-1.8 on Zen 3). The plain batched q4 product sums the four units' int16 products in int16
 * (hadd_epi16, no overflow) before one widening madd (qx_h4_s16). None of this changes an integer,
 * so none changes a bit. */

/* The most tokens the q4 and q8 products take a row at a time (qx_rows_few), plain AVX2: on Zen 3
 * passes of 4 (q4) or 3 (q8) tokens over a row in registers beat the batched product up to ~24 q4
 * tokens (1.1-1.3x at 7-24 on a gate's shape, 0.93-0.98x at 32-128) and every q8 count below the
 * lanes product's (1.1-1.4x at 4-12; bench/RESULTS.md, "More tokens a row"). The AVX-VNNI
 * instance keeps the limits measured before (not measured since: no CPU with it at hand). */
#ifndef QX_SMALL_N4
#define QX_SMALL_N4 24
#endif
#ifndef QX_SMALL_N8
#define QX_SMALL_N8 15
#endif
#ifndef QX_SMALL_N4_VNNI
#define QX_SMALL_N4_VNNI 6
#endif
#ifndef QX_SMALL_N8_VNNI
#define QX_SMALL_N8_VNNI 3
#endif
/* The q4 tokens' codes in nibble order the few-token product keeps on the stack: n · cols bytes at
 * most (more go batched): 24 tokens of 4096 columns, 6 of the widest rows. */
#ifndef QX_FEW_XN_BYTES
#define QX_FEW_XN_BYTES 98304
#endif
#ifndef QX_LANES_N8
#define QX_LANES_N8 16 /* the fewest tokens the plain q8 product takes in lanes by block (12: 0.93-1.04x) */
#endif
/* The tokens' codes the q8 product in lanes by block takes a pass over the rows, in bytes (on the
 * stack; Zen 3: 64 KiB ×1.14-1.28 at 256 tokens, 128 and 256 KiB alike, ×1.2-1.6; Zen 2: 256 KiB
 * ×1.04-1.06 the kernel at 45 and 256 tokens, a row's codes re-laid once a tile), at most QX_XTILE_BYTES
 * and half a hardware thread's L2 (qx_xtile_bytes), and a row block's columns it takes at a time, in units
 * (32, 4 KiB of lanes a row: 4096 columns ×1.3-1.5 where in one piece ×1.0-1.1; 16 slower) */
#ifndef QX_XTILE_BYTES
#define QX_XTILE_BYTES 262144
#endif
enum { QX_XTILE_MIN = 131072 };

/* The tile's bytes: half the L2 a hardware thread has (smoe_cpu_l2_per_thread: a core's L2 over
 * its SMT siblings), between QX_XTILE_MIN and QX_XTILE_BYTES (QX_XTILE_MIN where unknown). Only
 * the tiling changes with it, never a value. */
static uint32_t qx_xtile_bytes(void) {
    const uint32_t half = smoe_cpu_l2_per_thread() / 2;
    return half > QX_XTILE_BYTES ? QX_XTILE_BYTES : half > QX_XTILE_MIN ? half : QX_XTILE_MIN;
}
#ifndef QX_KC_UNITS
#define QX_KC_UNITS 32
#endif
enum {
    QX_XTILE_MAX = 64, /* tokens of that tile at most */
    QRB = 4,    /* rows of a block of the batched product (bench/RESULTS.md: 4 × 1 measured best) */
    QTB = 1,    /* tokens of a block */
    QSB = 4,    /* tokens of a row's pass in the few-token product (qx_row_T), q4; q8 takes one fewer */
    QX_SMALL_MAX = QX_SMALL_N4 > QX_SMALL_N8 ? QX_SMALL_N4 : QX_SMALL_N8,
    MAXU = MAXC / 64, /* units of 64 columns of the widest row */
};
_Static_assert(QX_XTILE_BYTES >= MAXU * 128, "a tile of the q8 lanes product holds at least one token's codes");
_Static_assert(QX_SMALL_N4_VNNI <= QX_SMALL_MAX && QX_SMALL_N8_VNNI <= QX_SMALL_MAX,
               "the few-token product's arrays hold every instance's tokens");
_Static_assert(QX_FEW_XN_BYTES >= MAXC, "the few-token product takes a token of the widest rows");

/* How far on the matrix-vector products prefetch their weights, in bytes, and into L2 (the hint
 * T1), not L1: on the Xeon (Sapphire Rapids class, 2 threads, weights from DRAM) into L1 four rows
 * on they read at 70-88 % of the plain read rate, into L2 at 95-110 %; decode's products there
 * (bench/RESULTS.md, "The one-token product's prefetch into L2"), ms a token into L1 / into L2:
 * this file's q4/q8 matvec (forced with SMOE_MATVEC=avx2) q/k/v/o 10.0-10.5 / 8.0-9.2, lm_head
 * 17.8-20.3 / 15.6-16.9; the GGML one on a GGUF vault 8.7-9.1 / 7.7-8.0 and 17.2-17.6 / 15.6-16.7.
 * On Zen 5 into L2, two threads: decode's products at 43-46 GB/s, a plain read 36-52 that hour (bench/RESULTS.md,
 * "Zen 5: every item"; earlier, the prefetch into L1 ×2.4 over none there). */
#ifndef QX_AHEAD_BYTES
#define QX_AHEAD_BYTES 3072 /* the q4/q8 matvec (6144 read 5-10 % slower here) */
#endif
#ifndef GQ_AHEAD_BYTES
#define GQ_AHEAD_BYTES 6144 /* the GGML formats' matvecs (8-bit and f32 activations) */
#endif
#ifndef QX_BATCH_AHEAD
#define QX_BATCH_AHEAD 2 /* rows ahead the GGML formats' batched product prefetches its weights */
#endif

/* σ of kernels_ref.c for units [g, g+4): lane j the scale of the group holding block j/4 of unit
 * g + j%4, from s, the row's scales by group (zero-padded to a multiple of 8, which covers every
 * empty block). G = 64: [s_g..s_g+4 | s_g..s_g+4]; G = 32: block b of unit u is group 2u + b;
 * G = 128: unit u is half of group u/2. */
INLINE __m256 qx_sigma(const uint32_t G, const float *s, uint32_t g) {
    if (G == 64) return _mm256_broadcast_ps((const __m128 *)(const void *)(s + g));
    if (G == 32) return _mm256_permutevar8x32_ps(_mm256_loadu_ps(s + 2 * g), _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
    const __m128 two = _mm_castpd_ps(_mm_load_sd((const double *)(const void *)(s + g / 2)));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), _mm256_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1));
}

#define QX(name) name##_plain
#define QX_ATTR
#define QX_VNNI 0
#include "kernels_avx2_qx.h"
#undef QX
#undef QX_ATTR
#undef QX_VNNI

#if SMOE_HAVE_AVXVNNI
#define QX(name) name##_vnni
#define QX_ATTR __attribute__((target("avx2,fma,f16c,avxvnni")))
#define QX_VNNI 1
#include "kernels_avx2_qx.h"
#undef QX
#undef QX_ATTR
#undef QX_VNNI
#endif

static inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

/* kernels_ref.c's ref_ggml_prepare on vectors, the same bytes: max|x| per scale group
 * (order-free; Q8_K then finds the first x of that magnitude for its sign), codes rounded by
 * cvtps (round-half-even, as nearbyintf), d through F16C (nearest-even, as f32_to_f16). A token
 * holding an inf or a NaN is handed to the reference whole. */
static bool ggml_prepare(const float *x, size_t ldx, uint32_t n, uint32_t cols, uint8_t wformat, void *codes,
                         float *d, float *gsum) {
    if (cols % 32) return false;
    const smoe_qx_size z = smoe_qx_sizes(cols, wformat, 32);
    const int act = gb_act_type(wformat);
    const uint32_t nb = cols / 32, span = act == GB_ACT_Q8_K ? 8 : 1;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), big = _mm256_set1_ps(3.4028234664e38f);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), top = _mm256_set1_epi32(127);
    for (uint32_t t = 0; t < n; t++) {
        const float *xt = x + (size_t)t * ldx;
        int8_t *ct = (int8_t *)codes + (size_t)t * z.code_bytes;
        float *dt = d + (size_t)t * z.d_floats, *st = gsum + (size_t)t * z.gsum_floats;
        __m256 bad = _mm256_setzero_ps();
        for (uint32_t c = 0; c < cols; c += 8)
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(xt + c), absmask), big, _CMP_NLE_UQ));
        if (_mm256_movemask_ps(bad)) {
            smoe_ref_qx_prepare(xt, ldx, 1, cols, wformat, 32, ct, dt, st);
            continue;
        }
        memset(ct + 32 * (size_t)nb, 0, z.code_bytes - 32 * (size_t)nb);
        memset(dt, 0, sizeof(float) * z.d_floats);
        memset(st + nb, 0, sizeof(float) * (z.gsum_floats - nb));
        for (uint32_t B0 = 0; B0 < nb; B0 += span) {
            const uint32_t nB = nb - B0 < span ? nb - B0 : span;
            const float *xs = xt + 32 * (size_t)B0;
            __m256 a = _mm256_setzero_ps();
            for (uint32_t c = 0; c < 32 * nB; c += 8) a = _mm256_max_ps(a, _mm256_and_ps(_mm256_loadu_ps(xs + c), absmask));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            const float m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
            if (!(m >= 0x1p-100f)) {
                memset(ct + 32 * (size_t)B0, 0, 32 * (size_t)nB);
                for (uint32_t i = 0; i < nB; i++) st[B0 + i] = 0.0f;
                continue;
            }
            float iscale = 127.0f / m, dq = 0.0f;
            const float dr = m / 127.0f;
            if (act == GB_ACT_Q8_K) {
                uint32_t c = 0;
                while (fabsf(xs[c]) != m) c++; /* the first x of largest |x| */
                iscale = -127.0f / xs[c];
                dq = 1.0f / iscale;
            } else {
                dq = _cvtsh_ss(_cvtss_sh(dr, 0));
            }
            const __m256 mul = _mm256_set1_ps(iscale);
            for (uint32_t i = 0; i < nB; i++) {
                const uint32_t B = B0 + i;
                const float *xb = xt + 32 * (size_t)B;
                __m256i q[4];
                for (int k = 0; k < 4; k++)
                    q[k] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * k), mul)), top);
                const int32_t S = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
                const __m256i c01 = _mm256_packs_epi32(q[0], q[1]), c23 = _mm256_packs_epi32(q[2], q[3]);
                _mm256_storeu_si256((__m256i *)(void *)(ct + 32 * (size_t)B),
                                    _mm256_permutevar8x32_epi32(_mm256_packs_epi16(c01, c23), perm));
                dt[smoe_qx_dpos(B)] = dq;
                st[B] = act == GB_ACT_Q8_1 ? _cvtsh_ss(_cvtss_sh(dr * (float)S, 0)) : dq * (float)S;
            }
        }
    }
    return true;
}

/* smoe_ref_qx_prepare on vectors, the same bytes: max|x| per 32 columns (order-free), codes
 * rounded by cvtps (round-half-even, as nearbyintf), packed into the layout of kernels_ref.c, the
 * group sums in group_sums' order. A block holding an inf or a NaN goes to the scalar code; a
 * last half unit (cols an odd multiple of 32) is read through a zero-padded copy, so its empty
 * block gets d = 0 and codes 0 as the reference gives it. */
bool smoe_avx2_qx_prepare(const float *x, size_t ldx, uint32_t n, uint32_t cols, uint8_t wformat, uint32_t group,
                          void *codes, float *d, float *gsum) {
    if (gb_takes_codes(wformat)) return ggml_prepare(x, ldx, n, cols, wformat, codes, d, gsum);
    if (cols % 32 || !group_ok(group) || cols % group) return false;
    const bool q8 = wformat == SMOE_FMT_Q8;
    const smoe_qx_size z = smoe_qx_sizes(cols, wformat, group);
    const uint32_t nu = (cols + 63) / 64, up = (uint32_t)z.d_floats / 2; /* units, and padded to 4 */
    const float tiny = 0x1p-100f;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), big = _mm256_set1_ps(3.4028234664e38f);
    for (uint32_t t = 0; t < n; t++) {
        const float *xt = x + (size_t)t * ldx;
        uint8_t *ct = (uint8_t *)codes + (size_t)t * z.code_bytes;
        float *dt = d + (size_t)t * z.d_floats, *st = gsum + (size_t)t * z.gsum_floats;
        for (uint32_t g = 0; g < nu; g++) {
            const float *xg = xt + (size_t)g * 64;
            float half[64]; /* a last unit of 32 columns, zero-padded */
            if (64 * g + 64 > cols) {
                memcpy(half, xg, 32 * sizeof(float));
                memset(half + 32, 0, 32 * sizeof(float));
                xg = half;
            }
            __m256 v[8];
            for (int k = 0; k < 8; k++) v[k] = _mm256_loadu_ps(xg + 8 * k);
            __m256i q[8]; /* codes of columns 8k..8k+8 as int32 */
            for (int b = 0; b < 2; b++) {
                __m256 a = _mm256_and_ps(v[4 * b], absmask);
                __m256 bad = _mm256_cmp_ps(a, big, _CMP_NLE_UQ);
                for (int k = 1; k < 4; k++) {
                    const __m256 ak = _mm256_and_ps(v[4 * b + k], absmask);
                    bad = _mm256_or_ps(bad, _mm256_cmp_ps(ak, big, _CMP_NLE_UQ));
                    a = _mm256_max_ps(a, ak);
                }
                float *db = dt + 8 * (g / 4) + g % 4 + 4 * b;
                if (_mm256_movemask_ps(bad)) { /* an inf or a NaN: codes 0, d as the scalar code sets it */
                    float worst = 0.0f;
                    for (int c = 0; c < 32; c++) {
                        const float ac = fabsf(xg[32 * b + c]);
                        if (ac != ac)
                            worst = ac;
                        else if (ac == INFINITY && worst == 0.0f)
                            worst = ac;
                    }
                    *db = worst;
                    for (int k = 0; k < 4; k++) q[4 * b + k] = _mm256_setzero_si256();
                    continue;
                }
                __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
                m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
                const float m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
                const bool zero = !(m >= tiny);
                *db = zero ? 0.0f : m / 127.0f;
                const __m256 id = _mm256_set1_ps(zero ? 0.0f : 127.0f / m);
                for (int k = 0; k < 4; k++) q[4 * b + k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[4 * b + k], id));
            }
            if (q8) { /* vector j: columns 8j..8j+8 | 32+8j..32+8j+8 as int16 */
                for (int j = 0; j < 4; j++) {
                    const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[j], q[j + 4]), 0xd8);
                    _mm256_storeu_si256((__m256i *)(void *)(ct + 128 * (size_t)g + 32 * j), p);
                }
            } else { /* columns 0–15, 32–47 | 16–31, 48–63 as int8 */
                const __m256i c0 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xd8); /* 0–15 */
                const __m256i c1 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xd8); /* 16–31 */
                const __m256i c2 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[4], q[5]), 0xd8); /* 32–47 */
                const __m256i c3 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[6], q[7]), 0xd8); /* 48–63 */
                const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi16(c0, c2), 0xd8);
                const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi16(c1, c3), 0xd8);
                _mm256_storeu_si256((__m256i *)(void *)(ct + 64 * (size_t)g), lo);
                _mm256_storeu_si256((__m256i *)(void *)(ct + 64 * (size_t)g + 32), hi);
            }
        }
        for (uint32_t g = nu; g < up; g++) {
            memset(ct + (size_t)g * (q8 ? 128 : 64), 0, q8 ? 128 : 64);
            dt[8 * (g / 4) + g % 4] = dt[8 * (g / 4) + g % 4 + 4] = 0.0f;
        }
        group_sums(st, xt, cols / group, group); /* zero-padded to gsum_floats */
    }
    return true;
}

/* -1: not asked yet. Threads that ask at once all compute the same answer; the atomic keeps
 * that from being a data race. */
static _Atomic int qx_use_vnni = -1;

bool smoe_avx2_qx_vnni(void) {
#if SMOE_HAVE_AVXVNNI
    int use = atomic_load_explicit(&qx_use_vnni, memory_order_relaxed);
    if (use < 0) {
        const char *off = getenv("SMOE_NO_VNNI"); /* to measure or test the plain path */
        use = !(off && *off && strcmp(off, "0") != 0) && __builtin_cpu_supports("avxvnni");
        atomic_store_explicit(&qx_use_vnni, use, memory_order_relaxed);
    }
    return use > 0;
#else
    return false;
#endif
}

#include "kernels_avx2_ggml.h"

#define GQ(name) name##_plain
#define GQ_ATTR
#define GQ_VNNI 0
#include "kernels_avx2_ggml_qx.h"
#undef GQ
#undef GQ_ATTR
#undef GQ_VNNI

#if SMOE_HAVE_AVXVNNI
#define GQ(name) name##_vnni
#define GQ_ATTR __attribute__((target("avx2,fma,f16c,avxvnni")))
#define GQ_VNNI 1
#include "kernels_avx2_ggml_qx.h"
#undef GQ
#undef GQ_ATTR
#undef GQ_VNNI
#endif

bool smoe_avx2_ggml_qx(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y, size_t ldy,
                       uint32_t r0, uint32_t r1, bool vnni) {
#if SMOE_HAVE_AVXVNNI
    if (vnni) return g_matmul_qx_vnni(W, w, X, n, y, ldy, r0, r1);
#else
    (void)vnni;
#endif
    return g_matmul_qx_plain(W, w, X, n, y, ldy, r0, r1);
}

bool smoe_avx2_matmul_rows_qx(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y,
                              size_t ldy, uint32_t r0, uint32_t r1) {
    if (gb_takes_codes(W->format)) return smoe_avx2_ggml_qx(W, w, X, n, y, ldy, r0, r1, smoe_avx2_qx_vnni());
#if SMOE_HAVE_AVXVNNI
    if (smoe_avx2_qx_vnni()) return smoe_avx2_matmul_rows_qx_vnni(W, w, X, n, y, ldy, r0, r1);
#endif
    return smoe_avx2_matmul_rows_qx_plain(W, w, X, n, y, ldy, r0, r1);
}

/* ------------------------------------------------------------------------ f32, bf16 */

/* 8 weights of a row from column c (f32 or bf16), the last m < 8 zero-padded when m > 0. */
INLINE __m256 f_load(const uint8_t *row, bool bf16, uint32_t c) {
    return bf16 ? bf16x8(row + 2 * (size_t)c) : _mm256_loadu_ps((const float *)(const void *)row + c);
}

INLINE __m256 f_load_tail(const uint8_t *row, bool bf16, uint32_t c, uint32_t m) {
    if (bf16) {
        uint16_t h[8] = {0};
        memcpy(h, row + 2 * (size_t)c, 2 * m);
        return bf16x8((const uint8_t *)h);
    }
    return _mm256_maskload_ps((const float *)(const void *)row + c, tail_mask(m));
}

/* R rows from r against one token: acc in registers, the whole row in one pass. */
INLINE void f_rows_1(const int R, const uint8_t *w, size_t row_bytes, bool bf16, uint32_t cols, uint32_t r,
                     const float *x, float *y) {
    __m256 acc[RV];
    const uint8_t *p[RV];
    for (int i = 0; i < R; i++) {
        acc[i] = _mm256_setzero_ps();
        p[i] = w + (size_t)(r + i) * row_bytes;
    }
    uint32_t c = 0;
    for (; c + 8 <= cols; c += 8) {
        __m256 xv = _mm256_loadu_ps(x + c);
        for (int i = 0; i < R; i++) acc[i] = _mm256_fmadd_ps(f_load(p[i], bf16, c), xv, acc[i]);
    }
    if (c < cols) {
        __m256 xv = _mm256_maskload_ps(x + c, tail_mask(cols - c));
        for (int i = 0; i < R; i++) acc[i] = _mm256_fmadd_ps(f_load_tail(p[i], bf16, c, cols - c), xv, acc[i]);
    }
    for (int i = 0; i < R; i++) y[r + i] = hsum8(acc[i]);
}

/* R rows × T tokens over nc columns (the last m = nc % 8 zero-padded). wr[i]: row i at this
 * block's first column (f32); xt[j]: token j likewise; acc[j][i] carried in memory. */
INLINE void f_block(const int R, const int T, const float *const *wr, const float *const *xt, uint32_t nc,
                    __m256 (*acc)[RB]) {
    __m256 a[RB][TB];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < T; j++) a[i][j] = acc[j][i];
    uint32_t c = 0;
    for (; c + 8 <= nc; c += 8) {
        __m256 wv[RB];
        for (int i = 0; i < R; i++) wv[i] = _mm256_loadu_ps(wr[i] + c);
        for (int j = 0; j < T; j++) {
            __m256 xv = _mm256_loadu_ps(xt[j] + c);
            for (int i = 0; i < R; i++) a[i][j] = _mm256_fmadd_ps(wv[i], xv, a[i][j]);
        }
    }
    if (c < nc) {
        const __m256i mk = tail_mask(nc - c);
        __m256 wv[RB];
        for (int i = 0; i < R; i++) wv[i] = _mm256_maskload_ps(wr[i] + c, mk);
        for (int j = 0; j < T; j++) {
            __m256 xv = _mm256_maskload_ps(xt[j] + c, mk);
            for (int i = 0; i < R; i++) a[i][j] = _mm256_fmadd_ps(wv[i], xv, a[i][j]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < T; j++) acc[j][i] = a[i][j];
}

static void f_block_any(int R, int T, const float *const *wr, const float *const *xt, uint32_t nc,
                        __m256 (*acc)[RB]) {
    switch (R * 8 + T) {
#define CASE(r, t) \
    case r * 8 + t: f_block(r, t, wr, xt, nc, acc); break;
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
    float wb[RB][FCB]; /* (block rows, block columns) bf16 weights widened */
    __m256 acc[TT][RB]; /* (tile tokens, block rows) */

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
            for (uint32_t t = 0; t < nt; t++)
                for (uint32_t i = 0; i < RB; i++) acc[t][i] = _mm256_setzero_ps();
            for (uint32_t c0 = 0; c0 < cols; c0 += FCB) {
                const uint32_t nc = cols - c0 < FCB ? cols - c0 : FCB;
                const float *wr[RB];
                for (uint32_t i = 0; i < nr; i++) {
                    const uint8_t *row = w + (size_t)(r + i) * row_bytes;
                    if (!bf16) {
                        wr[i] = (const float *)(const void *)row + c0;
                        continue;
                    }
                    uint32_t c = 0;
                    for (; c + 8 <= nc; c += 8) _mm256_storeu_ps(wb[i] + c, bf16x8(row + 2 * (size_t)(c0 + c)));
                    for (; c < nc; c++) wb[i][c] = bf16_1(row + 2 * (size_t)(c0 + c));
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
                for (uint32_t i = 0; i < nr; i++) yt[(size_t)t * ldy + r + i] = hsum8(acc[t][i]);
        }
    }
}

/* g_matmul for one token, a gp_takes_qx format and whole 256-column steps: each row dequantised in
 * registers and multiplied as it goes (f_block's order for one row and one token), no buffer. */
INLINE void g_rows_1(const uint8_t fmt, const uint8_t *w, size_t row_bytes, uint32_t cols, const float *x, float *y,
                     uint32_t r0, uint32_t r1) {
    for (uint32_t r = r0; r < r1; r++) {
        const uint8_t *row = w + (size_t)r * row_bytes;
        __m256 acc = _mm256_setzero_ps();
        for (uint32_t k = 0; k < cols / 256; k++) {
            for (size_t b = 0; b < row_bytes / (cols / 256); b += 64)
                _mm_prefetch((const char *)row + GQ_AHEAD_BYTES + k * (row_bytes / (cols / 256)) + b, _MM_HINT_T1);
            g_dequant_step_fma(fmt, row, k, NULL, x + 256 * (size_t)k, &acc);
        }
        y[r] = hsum8(acc);
    }
}

static bool g_matmul_1(const smoe_tensor *W, const uint8_t *w, const float *x, float *y, uint32_t r0, uint32_t r1) {
    uint32_t bs = 32, ts = 0;
    smoe_ggml_block(W->format, &bs, &ts);
    const size_t row_bytes = (size_t)(W->cols / bs) * ts;
    switch (W->format) {
#define G1_CASE(f)                                                                                                     \
    case f: g_rows_1(f, w, row_bytes, W->cols, x, y, r0, r1); return true;
        GP_FORMATS(G1_CASE)
#undef G1_CASE
    }
    return false;
}

/* Steps [k0, k0 + nk) of a row of a gp_takes_qx format dequantised into out (g_dequant_step with
 * the format a constant: the decoder and the scales' switch inlined per format) */
static void g_dequant_steps(uint8_t fmt, const uint8_t *row, uint32_t k0, uint32_t nk, float *out) {
    switch (fmt) {
#define GD_CASE(f)                                                                                                     \
    case f:                                                                                                            \
        for (uint32_t k = 0; k < nk; k++) g_dequant_step(f, row, k0 + k, out + 256 * (size_t)k);                       \
        return;
        GP_FORMATS(GD_CASE)
#undef GD_CASE
    }
}

/* f_matmul's order for a GGML block format: blocks of FCB columns of RB rows dequantised
 * (ggml_blocks.h, the reference's values) into a buffer and fed to f_block, for every n (one token
 * too: f_block's order is f_rows_1's). */
static void g_matmul(const smoe_tensor *W, const uint8_t *w, const float *x, size_t ldx, uint32_t n, float *y,
                     size_t ldy, uint32_t r0, uint32_t r1) {
    const uint32_t cols = W->cols;
    uint32_t bs = 32, ts = 0;
    smoe_ggml_block(W->format, &bs, &ts);
    const size_t row_bytes = (size_t)(cols / bs) * ts;
    const bool fast = gp_takes_qx(W->format) && cols % 256 == 0;
    float wb[RB][FCB]; /* (block rows, block columns) dequantised */
    __m256 acc[TT][RB]; /* (tile tokens, block rows) */
    for (uint32_t t0 = 0; t0 < n; t0 += TT) {
        const uint32_t nt = n - t0 < TT ? n - t0 : TT;
        if (nt == 1 && fast && g_matmul_1(W, w, x + (size_t)t0 * ldx, y + (size_t)t0 * ldy, r0, r1)) continue;
        for (uint32_t r = r0; r < r1; r += RB) {
            const uint32_t nr = r1 - r < RB ? r1 - r : RB;
            for (uint32_t t = 0; t < nt; t++)
                for (uint32_t i = 0; i < RB; i++) acc[t][i] = _mm256_setzero_ps();
            for (uint32_t c0 = 0; c0 < cols; c0 += FCB) {
                const uint32_t nc = cols - c0 < FCB ? cols - c0 : FCB; /* a multiple of bs: FCB is of 256 */
                const float *wr[RB];
                for (uint32_t i = 0; i < nr; i++) {
                    const uint8_t *blk = w + (size_t)(r + i) * row_bytes + (size_t)(c0 / bs) * ts;
                    if (fast) /* whole 256-column steps on vectors (kernels_avx2_ggml.h): the same floats */
                        g_dequant_steps(W->format, w + (size_t)(r + i) * row_bytes, c0 / 256, nc / 256, wb[i]);
                    else
                        for (uint32_t c = 0; c < nc; c += bs, blk += ts) gb_dequant_block(W->format, blk, wb[i] + c);
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
                for (uint32_t i = 0; i < nr; i++) y[(size_t)(t0 + t) * ldy + r + i] = hsum8(acc[t][i]);
        }
    }
}

bool smoe_avx2_matmul_rows(const smoe_tensor *W, const uint8_t *w, const float *x, size_t ldx, uint32_t n, float *y,
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
    default: {
        uint32_t bs, ts;
        if (!smoe_ggml_block(W->format, &bs, &ts)) return false;
        g_matmul(W, w, x, ldx, n, y, ldy, r0, r1);
        return true;
    }
    }
}

/* ------------------------------------------------------------------------ per-token math */

/* Σ a[c]·b[c]: one 8-lane fma chain in column order, the last vector zero-padded, then hsum8. */
INLINE float dot8(const float *a, const float *b, uint32_t n) {
    __m256 acc = _mm256_setzero_ps();
    uint32_t c = 0;
    for (; c + 8 <= n; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), acc);
    if (c < n) {
        const __m256i mk = tail_mask(n - c);
        acc = _mm256_fmadd_ps(_mm256_maskload_ps(a + c, mk), _mm256_maskload_ps(b + c, mk), acc);
    }
    return hsum8(acc);
}

void smoe_avx2_rmsnorm(float *out, const float *x, const smoe_tensor *weight, uint32_t dim, float eps) {
    const float ss = dot8(x, x, dim);
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    const __m256 iv = _mm256_set1_ps(inv);
    const bool bf16 = weight->format == SMOE_FMT_BF16;
    uint32_t c = 0;
    for (; c + 8 <= dim; c += 8) {
        __m256 xn = _mm256_mul_ps(_mm256_loadu_ps(x + c), iv);
        _mm256_storeu_ps(out + c, _mm256_mul_ps(f_load(weight->data, bf16, c), xn));
    }
    for (; c < dim; c++) {
        float wv = bf16 ? bf16_1(weight->data + 2 * (size_t)c) : ((const float *)(const void *)weight->data)[c];
        float xn = x[c] * inv;
        out[c] = wv * xn;
    }
}

/* 8 KV elements of type dt from element i of row, as f32 (exactly) */
INLINE __m256 kv8(const void *row, size_t i, const uint32_t dt) {
    if (dt == SMOE_KV_F32) return _mm256_loadu_ps((const float *)row + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)(const void *)((const uint16_t *)row + i));
    if (dt == SMOE_KV_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* the m < 8 elements of type dt from element i of row, zero-padded */
INLINE __m256 kv8_tail(const void *row, size_t i, uint32_t m, const uint32_t dt) {
    if (dt == SMOE_KV_F32) return _mm256_maskload_ps((const float *)row + i, tail_mask(m));
    uint16_t buf[8] = {0};
    memcpy(buf, (const uint16_t *)row + i, m * sizeof(uint16_t));
    return kv8(buf, 0, dt);
}

INLINE float kv1(const void *row, size_t i, const uint32_t dt) {
    if (dt == SMOE_KV_F32) return ((const float *)row)[i];
    const uint16_t h = ((const uint16_t *)row)[i];
    if (dt == SMOE_KV_BF16) return _mm_cvtss_f32(_mm_castsi128_ps(_mm_cvtsi32_si128((int)((uint32_t)h << 16))));
    return _cvtsh_ss(h);
}

/* smoe_attend for KV elements of type dt (a constant after inlining): the order of kernels.h */
INLINE void attend_t(float *out, const float *q, const void *k, const void *v, size_t stride, uint32_t n_pos,
                     uint32_t head_dim, float sink, float *scratch, const uint32_t dt) {
    const float scale = (float)(1.0 / sqrt((double)head_dim));
    const size_t eb = dt == SMOE_KV_F32 ? 4 : 2;
    /* each position's dot is one chain of fmas (the reference's order); four positions at a time
       run four chains side by side, so the fma latency is not paid per product */
    uint32_t p = 0;
    for (; p + 4 <= n_pos; p += 4) {
        const uint8_t *kp = (const uint8_t *)k + p * stride * eb;
        const size_t ks = stride * eb;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        uint32_t c = 0;
        for (; c + 8 <= head_dim; c += 8) {
            const __m256 qc = _mm256_loadu_ps(q + c);
            a0 = _mm256_fmadd_ps(qc, kv8(kp, c, dt), a0);
            a1 = _mm256_fmadd_ps(qc, kv8(kp + ks, c, dt), a1);
            a2 = _mm256_fmadd_ps(qc, kv8(kp + 2 * ks, c, dt), a2);
            a3 = _mm256_fmadd_ps(qc, kv8(kp + 3 * ks, c, dt), a3);
        }
        if (c < head_dim) {
            const uint32_t m = head_dim - c;
            const __m256 qc = _mm256_maskload_ps(q + c, tail_mask(m));
            a0 = _mm256_fmadd_ps(qc, kv8_tail(kp, c, m, dt), a0);
            a1 = _mm256_fmadd_ps(qc, kv8_tail(kp + ks, c, m, dt), a1);
            a2 = _mm256_fmadd_ps(qc, kv8_tail(kp + 2 * ks, c, m, dt), a2);
            a3 = _mm256_fmadd_ps(qc, kv8_tail(kp + 3 * ks, c, m, dt), a3);
        }
        scratch[p] = hsum8(a0) * scale;
        scratch[p + 1] = hsum8(a1) * scale;
        scratch[p + 2] = hsum8(a2) * scale;
        scratch[p + 3] = hsum8(a3) * scale;
    }
    for (; p < n_pos; p++) {
        const void *kp = (const uint8_t *)k + p * stride * eb;
        __m256 acc = _mm256_setzero_ps();
        uint32_t c = 0;
        for (; c + 8 <= head_dim; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), kv8(kp, c, dt), acc);
        if (c < head_dim) {
            const uint32_t m = head_dim - c;
            acc = _mm256_fmadd_ps(_mm256_maskload_ps(q + c, tail_mask(m)), kv8_tail(kp, c, m, dt), acc);
        }
        scratch[p] = hsum8(acc) * scale;
    }
    smoe_softmax_sink(scratch, n_pos, sink);
    /* out[d] = Σ_p a_p·v_p[d] in position order, 64 dimensions at a time in registers */
    uint32_t d0 = 0;
    for (; d0 + 64 <= head_dim; d0 += 64) {
        __m256 o[8];
        for (int j = 0; j < 8; j++) o[j] = _mm256_setzero_ps();
        for (uint32_t p = 0; p < n_pos; p++) {
            const __m256 a = _mm256_broadcast_ss(scratch + p);
            const void *vp = (const uint8_t *)v + p * stride * eb;
            for (int j = 0; j < 8; j++) o[j] = _mm256_fmadd_ps(a, kv8(vp, d0 + 8 * (size_t)j, dt), o[j]);
        }
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(out + d0 + 8 * j, o[j]);
    }
    for (uint32_t d = d0; d < head_dim; d++) {
        float o = 0.0f;
        for (uint32_t p = 0; p < n_pos; p++) o = fmaf(scratch[p], kv1((const uint8_t *)v + p * stride * eb, d, dt), o);
        out[d] = o;
    }
}

void smoe_avx2_attend(float *out, const float *q, const void *k, const void *v, size_t stride, uint32_t n_pos,
                      uint32_t head_dim, uint32_t kv_dtype, float sink, float *scratch) {
    if (kv_dtype == SMOE_KV_BF16)
        attend_t(out, q, k, v, stride, n_pos, head_dim, sink, scratch, SMOE_KV_BF16);
    else if (kv_dtype == SMOE_KV_F16)
        attend_t(out, q, k, v, stride, n_pos, head_dim, sink, scratch, SMOE_KV_F16);
    else
        attend_t(out, q, k, v, stride, n_pos, head_dim, sink, scratch, SMOE_KV_F32);
}

#endif /* SMOE_HAVE_AVX2 */
