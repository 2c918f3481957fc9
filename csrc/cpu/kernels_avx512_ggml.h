/* kernels_avx512_ggml.h — the GGML block formats' 8-bit-activation product with AVX512-VNNI,
 * with the bits of kernels_ref.c's ref_ggml_qx (and of the AVX2 instances). Included once, at the
 * end of kernels_avx512.c; kernels.c calls it for n > 1 where the CPU has AVX512-VNNI (n = 1 takes
 * the AVX2 instance's prefetching matrix-vector product, as q4 and q8 do).
 *
 * Formats and shapes: those of the AVX2 fast path (gp_takes_qx: Q4_K, Q5_K, Q6_K, Q8_0, Q4_0,
 * Q5_0, IQ4_NL, IQ4_XS, MXFP4, Q2_K, Q3_K, Q4_1, Q5_1 and the codebook formats IQ1_S … IQ3_S) on
 * rows of whole 256-column steps and at most MAXC columns; anything else is not taken (false: the
 * AVX2 instance runs), a choice by shape only.
 *
 * How: a row's step of 256 columns is decoded by the AVX2 decoders (kernels_avx2_ggml.h,
 * through g_decode8_plain: 8 blocks of 32 int8 in column order, σ in the reference's lane order, μ), paired
 * into 512-bit registers and transposed (g5_transpose) so that each 32-bit lane holds 4 columns of
 * ONE block, the block of the reference's lane (l mod 8); the token's codes are transposed the same
 * way once per tile (g5_relay_t). Four vpdpbusd per step then leave each lane a partial sum of its
 * block, and one add of the two 256-bit halves gives the 8 block sums in the reference's lane order
 * (lane j: block 2·(j%4) + j/4) — no reduction tree per token, the transposition paid once per row
 * step and once per token. The signed formats take |q| and the codes negated where q < 0 (AVX-512
 * has no vpsignb); the sub-scales (Q6_K's, Q3_K's, Q2_K's; IQ2_XS', IQ2_S', IQ1_M's 2·ls + 1)
 * multiply vpmaddubsw's int16 pairs in vpdpwssd, and Q2_K's mins meet each token's 16-column sums
 * in one vpmaddwd (gp_q2k_msum's integers). The float part is the reference's, lane for lane:
 * tot = fma((float)I, σ·d, tot), bia = fma(μ, gsum, bia) (Q2_K: fma(M, ν·d, bia)),
 * y = hsum8(tot) (+ hsum8(bia)). Integer sums are exact, so the bits are the reference's. */

#ifndef SMOE_AVX512_EMULATE

#include "ggml_blocks.h"
#include "kernels_avx2_ggml.h"

#define G5 TARGET("avx512f,avx512bw,avx512vl,avx512vnni")
#define G5_INLINE static inline __attribute__((always_inline)) G5

enum {
    G5_XBYTES = 32768, /* a tile's re-laid codes (stack; the codebook formats take twice it, as on AVX2) */
    G5_TT = 32,        /* tokens of a tile at most */
    G5_DP = 2 * G5_XBYTES / 512 + MAXC / 512, /* token pairs × steps of a tile at most */
};

/* [a | b] */
G5_INLINE __m512i g5_cat(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }

G5_INLINE float g5_hsum8(__m256 v) { /* ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) */
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
    return _mm_cvtss_f32(s1);
}

/* The transposed layout of a step (256 columns, 8 blocks, as 4 registers of 64 bytes in block
 * order: v[i] = blocks 2i, 2i + 1): t[m] lane l (4 bytes) = columns 4D..4D + 4 of block
 * B(l % 8), D = 2m + l / 8, with B(j) = 2·(j%4) + j/4 the block of the reference's lane j. A
 * vpdpbusd of t[m] against the codes in the same layout leaves in lane l a partial sum of block
 * B(l % 8) alone: four of them and one add of the two 256-bit halves give the 8 block sums in the
 * reference's lane order, without a reduction tree. */
G5_INLINE void g5_transpose(const __m512i v[4], __m512i t[4]) {
    /* lane l: 8·(B % 4) + D from (v[0], v[1]) for B < 4, from (v[2], v[3]) for B ≥ 4 */
#define G5_IDX(m)                                                                                                      \
    _mm512_setr_epi32(0 + 2 * (m), 16 + 2 * (m), 0 + 2 * (m), 16 + 2 * (m), 8 + 2 * (m), 24 + 2 * (m), 8 + 2 * (m),  \
                      24 + 2 * (m), 1 + 2 * (m), 17 + 2 * (m), 1 + 2 * (m), 17 + 2 * (m), 9 + 2 * (m), 25 + 2 * (m),  \
                      9 + 2 * (m), 25 + 2 * (m))
    const __mmask16 hi = 0xcccc; /* lanes with l % 8 ∈ {2, 3, 6, 7}: blocks 4..7 */
    const __m512i i0 = G5_IDX(0), i1 = G5_IDX(1), i2 = G5_IDX(2), i3 = G5_IDX(3);
    const __m512i idx[4] = {i0, i1, i2, i3};
#undef G5_IDX
    for (int m = 0; m < 4; m++)
        t[m] = _mm512_mask_blend_epi32(hi, _mm512_permutex2var_epi32(v[0], idx[m], v[1]),
                                       _mm512_permutex2var_epi32(v[2], idx[m], v[3]));
}

/* One token's codes (column order, cols a multiple of 256) into the transposed layout, per step */
G5_INLINE void g5_relay_t(const uint8_t *x, uint32_t cols, uint8_t *out) {
    for (uint32_t c = 0; c < cols; c += 256) {
        __m512i v[4], t[4];
        for (int i = 0; i < 4; i++) v[i] = _mm512_loadu_si512(x + c + 64 * i);
        g5_transpose(v, t);
        for (int m = 0; m < 4; m++) _mm512_storeu_si512(out + c + 64 * m, t[m]);
    }
}

G5_INLINE void g5_rows(const uint8_t fmt, const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y,
                       size_t ldy, uint32_t r0, uint32_t r1) {
    const uint32_t cols = W->cols, steps = cols / 256;
    uint32_t bs = 32, ts = 0;
    smoe_ggml_block(fmt, &bs, &ts);
    const smoe_qx_size z = smoe_qx_sizes(cols, fmt, 32);
    const bool q2k = fmt == SMOE_FMT_GGML_Q2_K; /* its mins per 16 columns: a second integer sum */
    const bool has_min = gb_has_min(fmt), uns = gp_unsigned(fmt), has_sub = gb_has_sub(fmt), has_bia = has_min || q2k;
    const size_t step_bytes = (size_t)(256 / bs) * ts, row_bytes = (size_t)steps * step_bytes;
    /* the codebook formats' decoding costs more than the codes' trip out of L1: a longer tile */
    const uint32_t xbytes = gb_is_iq(fmt) ? 2 * G5_XBYTES : G5_XBYTES;
    const uint32_t tt = xbytes / cols < G5_TT ? xbytes / cols : G5_TT; /* ≥ 2: cols ≤ MAXC */
    _Alignas(64) uint8_t xr[2 * G5_XBYTES];
    /* two tokens' d (and gsum; Q2_K: half sums) per step side by side, [token 2i's | token 2i + 1's],
       so that the float part runs on 16 lanes: np·steps ≤ (tt + 1) / 2 · cols / 256 ≤ G5_DP */
    _Alignas(64) float dp[G5_DP * 16];
    union { /* gsum (the formats with a min) or Q2_K's 16-column sums: never both */
        float g[G5_DP * 16];
        int16_t h[G5_DP * 32];
    } gh __attribute__((aligned(64)));
    float *const gp = gh.g;
    int16_t *const hp = gh.h;
    __m512 tot[G5_TT / 2], bia[G5_TT / 2];
    /* sub-scales: int16 lanes 2l, 2l + 1 ← sub-scale 2·B(l % 8) + h of the step (t[0], t[1]: h = 0) */
    static const int16_t sidx[32] __attribute__((aligned(64))) = {0, 0, 4, 4, 8, 8, 12, 12, 2, 2, 6, 6, 10, 10, 14, 14,
                                                                  0, 0, 4, 4, 8, 8, 12, 12, 2, 2, 6, 6, 10, 10, 14, 14};
    const __m512i sidx0 = _mm512_load_si512(sidx);
    const __m512i sidx1 = _mm512_add_epi16(sidx0, _mm512_set1_epi16(1));
    /* Q2_K's min sums: vpmaddwd's block b in lane b of each token's half, to the lane order */
    const __m512i lane16 = _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    for (uint32_t t0 = 0; t0 < n; t0 += tt) {
        const uint32_t nt = n - t0 < tt ? n - t0 : tt, np = (nt + 1) / 2; /* token pairs; an odd last one twice */
        for (uint32_t t = 0; t < nt; t++)
            g5_relay_t((const uint8_t *)X->codes + (size_t)(t0 + t) * z.code_bytes, cols, xr + (size_t)t * cols);
        for (uint32_t i = 0; i < np; i++)
            for (uint32_t h = 0; h < 2; h++) {
                const uint32_t t = 2 * i + h < nt ? 2 * i + h : 2 * i;
                const uint8_t *xt = (const uint8_t *)X->codes + (size_t)(t0 + t) * z.code_bytes;
                for (uint32_t k = 0; k < steps; k++) {
                    const size_t at = (size_t)i * steps + k;
                    memcpy(dp + 16 * at + 8 * h, X->d + (size_t)(t0 + t) * z.d_floats + 8 * k, 32);
                    if (has_min) memcpy(gp + 16 * at + 8 * h, X->gsum + (size_t)(t0 + t) * z.gsum_floats + 8 * k, 32);
                    if (q2k) gp_halfsums(xt + 256 * (size_t)k, 256, hp + 32 * at + 16 * h);
                }
            }
        for (uint32_t r = r0; r < r1; r++) {
            const uint8_t *row = w + (size_t)r * row_bytes;
            if (r + BATCH_AHEAD < r1) /* rows on, while this one computes, as the q4/q8 product does */
                for (size_t b = 0; b < row_bytes; b += 64)
                    _mm_prefetch((const char *)row + BATCH_AHEAD * row_bytes + b, _MM_HINT_T0);
            for (uint32_t i = 0; i < np; i++) tot[i] = bia[i] = _mm512_setzero_ps();
            for (uint32_t k = 0; k < steps; k++) {
                __m256i q[8];
                __m256 sigl, mu = _mm256_setzero_ps();
                __m128i sc = _mm_setzero_si128();
                g_decode8_plain(fmt, row, step_bytes, k, q, &sigl, &mu, &sc);
                __m512i v[4], zt[4], s[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
                __mmask64 neg[4] = {0, 0, 0, 0};
                for (int i = 0; i < 4; i++) v[i] = g5_cat(q[2 * i], q[2 * i + 1]);
                g5_transpose(v, zt);
                if (!uns)
                    for (int m = 0; m < 4; m++) {
                        neg[m] = _mm512_movepi8_mask(zt[m]);
                        zt[m] = _mm512_abs_epi8(zt[m]);
                    }
                if (has_sub) { /* int8 (Q6_K, Q3_K: signed; the others' are below 32) */
                    const __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc));
                    s[0] = _mm512_permutexvar_epi16(sidx0, sc16);
                    s[1] = _mm512_permutexvar_epi16(sidx1, sc16);
                }
                __m512i mq = _mm512_setzero_si512(); /* Q2_K: the step's 16 mins, for both tokens */
                if (q2k) {
                    const __m256i m = gp_q2k_mins(row, k);
                    mq = g5_cat(m, m);
                }
                const __m512 sig2 = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(sigl)), _mm256_castps_pd(sigl), 1));
                const __m512 mu2 = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(mu)), _mm256_castps_pd(mu), 1));
                for (uint32_t i = 0; i < np; i++) {
                    __m512i acc[2];
                    for (uint32_t h = 0; h < 2; h++) {
                        const uint32_t t = 2 * i + h < nt ? 2 * i + h : 2 * i;
                        const uint8_t *xt = xr + (size_t)t * cols + 256 * (size_t)k;
                        acc[h] = _mm512_setzero_si512();
                        for (int m = 0; m < 4; m++) {
                            __m512i xv = _mm512_loadu_si512(xt + 64 * m);
                            if (!uns) xv = _mm512_mask_sub_epi8(xv, neg[m], _mm512_setzero_si512(), xv);
                            acc[h] = has_sub ? _mm512_dpwssd_epi32(acc[h], _mm512_maddubs_epi16(zt[m], xv), s[m / 2])
                                             : _mm512_dpbusd_epi32(acc[h], zt[m], xv);
                        }
                    }
                    /* [token 2i's lanes 0–7 + 8–15 | token 2i + 1's]: the 8 block sums of each */
                    const __m512i I = _mm512_add_epi32(_mm512_shuffle_i64x2(acc[0], acc[1], 0x44),
                                                       _mm512_shuffle_i64x2(acc[0], acc[1], 0xee));
                    const size_t at = (size_t)i * steps + k;
                    const __m512 dv = _mm512_load_ps(dp + 16 * at);
                    tot[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(sig2, dv), tot[i]);
                    if (has_min) bia[i] = _mm512_fmadd_ps(mu2, _mm512_load_ps(gp + 16 * at), bia[i]);
                    if (q2k) { /* gp_q2k_msum of both tokens: Σ_h m_h·(their codes' half sums), per block */
                        const __m512i M = _mm512_permutexvar_epi32(lane16, _mm512_madd_epi16(mq, _mm512_load_si512(hp + 32 * at)));
                        bia[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(M), _mm512_mul_ps(mu2, dv), bia[i]);
                    }
                }
            }
            for (uint32_t i = 0; i < np; i++)
                for (uint32_t h = 0; h < 2 && 2 * i + h < nt; h++) {
                    const __m512d td = _mm512_castps_pd(tot[i]), bd = _mm512_castps_pd(bia[i]);
                    const __m256 tv = _mm256_castpd_ps(h ? _mm512_extractf64x4_pd(td, 1) : _mm512_castpd512_pd256(td));
                    const __m256 bv = _mm256_castpd_ps(h ? _mm512_extractf64x4_pd(bd, 1) : _mm512_castpd512_pd256(bd));
                    y[(size_t)(t0 + 2 * i + h) * ldy + r] = has_bia ? g5_hsum8(tv) + g5_hsum8(bv) : g5_hsum8(tv);
                }
        }
    }
}

G5 bool smoe_avx512_ggml_qx(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y, size_t ldy,
                            uint32_t r0, uint32_t r1) {
    if (W->cols % 256 || W->cols > MAXC) return false;
    switch (W->format) {
#define G5_CASE(f)                                                                                                     \
    case f: g5_rows(f, W, w, X, n, y, ldy, r0, r1); return true;
        GP_FORMATS(G5_CASE)
#undef G5_CASE
    }
    return false;
}

#undef G5_INLINE
#undef G5

#else /* tests/c/avx512_emu.h's build: this instance is not emulated; the AVX2 one runs */

bool smoe_avx512_ggml_qx(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y, size_t ldy,
                         uint32_t r0, uint32_t r1) {
    (void)W, (void)w, (void)X, (void)n, (void)y, (void)ldy, (void)r0, (void)r1;
    return false;
}

#endif
