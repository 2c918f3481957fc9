/* kernels_avx512_ggml.h — the GGML block formats' 8-bit-activation product with AVX512-VNNI,
 * with the bits of kernels_ref.c's ref_ggml_qx (and of the AVX2 instances). Included once, at the
 * end of kernels_avx512.c; kernels.c calls it for n > 1 where the CPU has AVX512-VNNI (n = 1 takes
 * the AVX2 instance's prefetching matrix-vector product, as q4 and q8 do).
 *
 * Formats and shapes: those of the AVX2 fast path (gp_takes: Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q5_0,
 * IQ4_NL, IQ4_XS, MXFP4) on rows of whole 256-column steps and at most MAXC columns; anything else
 * is not taken (false: the AVX2 instance runs), a choice by shape only.
 *
 * How: a row's step of 256 columns is decoded by the AVX2 decoder (kernels_avx2_ggml.h,
 * gp_decode: four pairs of blocks, [block 2p columns 0–15 | 2p + 1's] and the same of 16–31),
 * whose registers are paired again into four 512-bit ones: Z0 = columns 0–15 of blocks 0–3 (one
 * 128-bit quarter each), Z1 their columns 16–31, Z2, Z3 the same of blocks 4–7. The token's codes
 * are re-laid once per tile to match (g5_relay). Two vpdpbusd per half step give A (blocks 0–3,
 * quarter q = block q) and B (blocks 4–7); the signed formats take |q| and the codes negated
 * where q < 0 (AVX-512 has no vpsignb). Two tokens' A, B are reduced together (unpack + add),
 * and one permute gives [token t's 8 block sums | token t + 1's] in the reference's lane order
 * (lane j: block 2·(j%4) + j/4), so that the float part — tot = fma((float)I, σ·d, tot), bia =
 * fma(μ, gsum, bia), y = hsum8(tot) (+ hsum8(bia)) — is the reference's, lane for lane, on 16
 * lanes holding two tokens. Integer sums are exact, so the bits are the reference's. */

#ifndef SMOE_AVX512_EMULATE

#include "ggml_blocks.h"
#include "kernels_avx2_ggml.h"

#define G5 TARGET("avx512f,avx512bw,avx512vl,avx512vnni")
#define G5_INLINE static inline __attribute__((always_inline)) G5

enum {
    G5_XBYTES = 32768, /* a tile's re-laid codes (stack) */
    G5_TT = 32,        /* tokens of a tile at most */
};

/* One token's codes (column order, cols a multiple of 256) re-laid: per 128 columns (4 blocks),
 * the blocks' columns 0–15 in block order, then their columns 16–31. */
G5_INLINE void g5_relay(const uint8_t *x, uint32_t cols, uint8_t *out) {
    for (uint32_t c = 0; c < cols; c += 128) {
        const __m512i a = _mm512_loadu_si512(x + c), b = _mm512_loadu_si512(x + c + 64);
        _mm512_storeu_si512(out + c, _mm512_shuffle_i32x4(a, b, 0x88));
        _mm512_storeu_si512(out + c + 64, _mm512_shuffle_i32x4(a, b, 0xdd));
    }
}

/* [a | b] */
G5_INLINE __m512i g5_cat(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }
G5_INLINE __m512 g5_catf(__m256 a, __m256 b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a)), _mm256_castps_pd(b), 1));
}

/* One half step's product (4 blocks, quarter q = block q): z the weights (|q| for the signed
 * formats, with zs their signs), s Q6_K's sub-scales, x the re-laid codes. */
G5_INLINE __m512i g5_half(const uint8_t fmt, const __m512i z0, const __m512i z1, const __mmask64 n0, const __mmask64 n1,
                          const __m512i s0, const __m512i s1, __m512i x0, __m512i x1) {
    const bool uns = fmt == SMOE_FMT_GGML_Q4_K || fmt == SMOE_FMT_GGML_Q5_K;
    if (!uns) { /* the codes negated where q < 0: sign(x, q) with |q| */
        x0 = _mm512_mask_sub_epi8(x0, n0, _mm512_setzero_si512(), x0);
        x1 = _mm512_mask_sub_epi8(x1, n1, _mm512_setzero_si512(), x1);
    }
    if (fmt == SMOE_FMT_GGML_Q6_K)
        return _mm512_dpwssd_epi32(_mm512_madd_epi16(_mm512_maddubs_epi16(z0, x0), s0), _mm512_maddubs_epi16(z1, x1), s1);
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), z0, x0), z1, x1);
}

/* Two tokens' halves (a: blocks 0–3, b: 4–7) → [token 0's 8 block sums | token 1's], each in
 * the reference's lane order */
G5_INLINE __m512i g5_reduce2(const __m512i a0, const __m512i b0, const __m512i a1, const __m512i b1) {
    /* per quarter q: [a_q lanes 0+2, b_q 0+2, a_q 1+3, b_q 1+3] */
    const __m512i u0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, b0), _mm512_unpackhi_epi32(a0, b0));
    const __m512i u1 = _mm512_add_epi32(_mm512_unpacklo_epi32(a1, b1), _mm512_unpackhi_epi32(a1, b1));
    /* per quarter q: [A_q, B_q, A'_q, B'_q]: blocks q, 4 + q of token 0, then of token 1 */
    const __m512i v = _mm512_add_epi32(_mm512_unpacklo_epi64(u0, u1), _mm512_unpackhi_epi64(u0, u1));
    /* lane j < 8: block 2·(j%4) + j/4 of token 0 (block b < 4 at 4b, 4 + b' at 4b' + 1); then token 1 */
    return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 8, 1, 9, 4, 12, 5, 13, 2, 10, 3, 11, 6, 14, 7, 15), v);
}

G5_INLINE float g5_hsum8(__m256 v) { /* ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) */
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
    return _mm_cvtss_f32(s1);
}

G5_INLINE void g5_rows(const uint8_t fmt, const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y,
                       size_t ldy, uint32_t r0, uint32_t r1) {
    const uint32_t cols = W->cols, steps = cols / 256;
    uint32_t bs = 32, ts = 0;
    smoe_ggml_block(fmt, &bs, &ts);
    const smoe_qx_size z = smoe_qx_sizes(cols, fmt, 32);
    const bool has_min = gb_has_min(fmt), uns = has_min, q6 = fmt == SMOE_FMT_GGML_Q6_K;
    const size_t row_bytes = (size_t)steps * (256 / bs) * ts;
    const uint32_t tt = G5_XBYTES / cols < G5_TT ? G5_XBYTES / cols : G5_TT; /* ≥ 2: cols ≤ MAXC */
    _Alignas(64) uint8_t xr[G5_XBYTES];
    __m512 tot[G5_TT / 2], bia[G5_TT / 2];
    for (uint32_t t0 = 0; t0 < n; t0 += tt) {
        const uint32_t nt = n - t0 < tt ? n - t0 : tt, np = (nt + 1) / 2; /* token pairs; an odd last one twice */
        for (uint32_t t = 0; t < nt; t++) g5_relay((const uint8_t *)X->codes + (size_t)(t0 + t) * z.code_bytes, cols, xr + (size_t)t * cols);
        for (uint32_t r = r0; r < r1; r++) {
            const uint8_t *row = w + (size_t)r * row_bytes;
            for (uint32_t i = 0; i < np; i++) tot[i] = bia[i] = _mm512_setzero_ps();
            for (uint32_t k = 0; k < steps; k++) {
                __m256i q[8], sub[8];
                __m256 sigl, mu = _mm256_setzero_ps();
                gp_decode(fmt, row, k, q, &sigl, &mu, sub);
                __m512i zw[4], zs[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
                __mmask64 neg[4] = {0, 0, 0, 0};
                for (int h = 0; h < 2; h++)
                    for (int c = 0; c < 2; c++) { /* Z(2h + c): columns 16c.. of blocks 4h..4h + 4 */
                        const __m512i v = g5_cat(q[4 * h + c], q[4 * h + 2 + c]);
                        zw[2 * h + c] = uns ? v : _mm512_abs_epi8(v);
                        if (!uns) neg[2 * h + c] = _mm512_movepi8_mask(v);
                        if (q6) zs[2 * h + c] = g5_cat(sub[4 * h + c], sub[4 * h + 2 + c]);
                    }
                const __m512 sig2 = g5_catf(sigl, sigl), mu2 = g5_catf(mu, mu);
                for (uint32_t i = 0; i < np; i++) {
                    const uint32_t ta = 2 * i, tb = 2 * i + 1 < nt ? 2 * i + 1 : 2 * i;
                    const uint8_t *xa = xr + (size_t)ta * cols + 256 * (size_t)k, *xb = xr + (size_t)tb * cols + 256 * (size_t)k;
                    __m512i hv[4];
                    for (int h = 0; h < 2; h++) {
                        hv[h] = g5_half(fmt, zw[2 * h], zw[2 * h + 1], neg[2 * h], neg[2 * h + 1], zs[2 * h], zs[2 * h + 1],
                                        _mm512_loadu_si512(xa + 128 * h), _mm512_loadu_si512(xa + 128 * h + 64));
                        hv[2 + h] = g5_half(fmt, zw[2 * h], zw[2 * h + 1], neg[2 * h], neg[2 * h + 1], zs[2 * h], zs[2 * h + 1],
                                            _mm512_loadu_si512(xb + 128 * h), _mm512_loadu_si512(xb + 128 * h + 64));
                    }
                    const __m512 I = _mm512_cvtepi32_ps(g5_reduce2(hv[0], hv[1], hv[2], hv[3]));
                    const float *da = X->d + (size_t)(t0 + ta) * z.d_floats + 8 * k, *db = X->d + (size_t)(t0 + tb) * z.d_floats + 8 * k;
                    tot[i] = _mm512_fmadd_ps(I, _mm512_mul_ps(sig2, g5_catf(_mm256_loadu_ps(da), _mm256_loadu_ps(db))), tot[i]);
                    if (has_min) {
                        const float *ga = X->gsum + (size_t)(t0 + ta) * z.gsum_floats + 8 * k;
                        const float *gb = X->gsum + (size_t)(t0 + tb) * z.gsum_floats + 8 * k;
                        bia[i] = _mm512_fmadd_ps(mu2, g5_catf(_mm256_loadu_ps(ga), _mm256_loadu_ps(gb)), bia[i]);
                    }
                }
            }
            for (uint32_t i = 0; i < np; i++)
                for (uint32_t h = 0; h < 2 && 2 * i + h < nt; h++) {
                    const __m256 tv = h ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(tot[i]), 1)) : _mm512_castps512_ps256(tot[i]);
                    float v = g5_hsum8(tv);
                    if (has_min) v += g5_hsum8(h ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(bia[i]), 1)) : _mm512_castps512_ps256(bia[i]));
                    y[(size_t)(t0 + 2 * i + h) * ldy + r] = v;
                }
        }
    }
}

G5 bool smoe_avx512_ggml_qx(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y, size_t ldy,
                            uint32_t r0, uint32_t r1) {
    if (W->cols % 256 || W->cols > MAXC || !gp_takes(W->format)) return false;
    switch (W->format) {
#define G5_CASE(f)                                                                                                     \
    case f: g5_rows(f, W, w, X, n, y, ldy, r0, r1); return true;
        G5_CASE(SMOE_FMT_GGML_Q4_0)
        G5_CASE(SMOE_FMT_GGML_Q5_0)
        G5_CASE(SMOE_FMT_GGML_Q8_0)
        G5_CASE(SMOE_FMT_GGML_Q4_K)
        G5_CASE(SMOE_FMT_GGML_Q5_K)
        G5_CASE(SMOE_FMT_GGML_Q6_K)
        G5_CASE(SMOE_FMT_GGML_IQ4_NL)
        G5_CASE(SMOE_FMT_GGML_IQ4_XS)
        G5_CASE(SMOE_FMT_GGML_MXFP4)
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
