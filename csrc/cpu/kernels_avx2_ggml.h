/* kernels_avx2_ggml.h — the 8-bit-activation product for the GGML block formats on AVX2, with
 * the bits of kernels_ref.c's ref_ggml_qx. Included once by kernels_avx2.c (its helpers: hsum8).
 *
 * A row is decoded once into its integer form (ggml_blocks.h: q, sub, σ, μ per block of 32
 * columns) in stack buffers, then multiplied by each token's codes: per block, the 32 products
 * q·code come out of one vpmaddubsw (|q| against code·sign(q), pairs < 2^15) and one vpmaddwd
 * against the block's two sub-scales (1 for most formats), which leaves 8 partial int32 sums; the
 * 8 blocks of one step k are reduced by a vphaddd tree straight into lane order (lane j: block
 * 8k + 2·(j%4) + j/4, the block whose d is d[8k + j]). Integer sums are exact, so that order is
 * free; the float operations are the reference's: tot = fma((float)I, σ·d, tot) per lane, bia =
 * fma(μ, gsum, bia), y = hsum8(tot) (+ hsum8(bia)).
 *
 * The row decoders: the formats people run most (Q4_K, Q6_K, Q8_0, MXFP4, Q4_0, IQ4_NL) on
 * vectors, the rest with gb_qx_decode, the reference's own (the same bytes either way: the
 * decoded form is integers and exactly rounded products). */

enum { GMAXB = MAXC / 32 }; /* blocks of 32 in a row the kernel takes */

/* 32 int8 of one block: low nibbles of 16 bytes (columns 0–15) then high nibbles (16–31) */
INLINE __m256i g_nibbles(const uint8_t *qs) {
    const __m128i b = _mm_loadu_si128((const __m128i *)(const void *)qs);
    const __m256i v = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
    return _mm256_and_si256(v, _mm256_set1_epi8(15));
}

/* Blocks [0, nb) of a row into q (32 per block), sub, sigma (plain order), mu. */
static void g_decode_row(uint8_t fmt, const uint8_t *row, uint32_t nb, int8_t *q, int16_t *sub, float *sigma,
                         float *mu) {
    switch (fmt) {
    case SMOE_FMT_GGML_Q8_0:
        for (uint32_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + 34 * (size_t)b;
            _mm256_storeu_si256((__m256i *)(void *)(q + 32 * b), _mm256_loadu_si256((const __m256i *)(const void *)(blk + 2)));
            sigma[b] = gb_f16(blk);
            sub[2 * b] = sub[2 * b + 1] = 1;
            mu[b] = 0.0f;
        }
        return;
    case SMOE_FMT_GGML_Q4_0:
    case SMOE_FMT_GGML_IQ4_NL:
    case SMOE_FMT_GGML_MXFP4: {
        const bool mx = fmt == SMOE_FMT_GGML_MXFP4, q40 = fmt == SMOE_FMT_GGML_Q4_0;
        const uint32_t ts = mx ? 17 : 18, at = mx ? 1 : 2;
        const int8_t *kv = mx ? gb_kvalues_mxfp4 : gb_kvalues_iq4nl;
        const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)kv));
        for (uint32_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + ts * (size_t)b;
            const __m256i nib = g_nibbles(blk + at);
            const __m256i v = q40 ? _mm256_sub_epi8(nib, _mm256_set1_epi8(8)) : _mm256_shuffle_epi8(table, nib);
            _mm256_storeu_si256((__m256i *)(void *)(q + 32 * b), v);
            sigma[b] = mx ? gb_e8m0_half(blk[0]) : gb_f16(blk);
            sub[2 * b] = sub[2 * b + 1] = 1;
            mu[b] = 0.0f;
        }
        return;
    }
    case SMOE_FMT_GGML_Q4_K:
        for (uint32_t s = 0; s < nb / 8; s++) {
            const uint8_t *blk = row + 144 * (size_t)s;
            const float d = gb_f16(blk), dmin = gb_f16(blk + 2);
            for (int c = 0; c < 4; c++) { /* 32 bytes: low nibbles = block 2c, high = block 2c + 1 */
                const __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(blk + 16 + 32 * c));
                const __m256i m15 = _mm256_set1_epi8(15);
                _mm256_storeu_si256((__m256i *)(void *)(q + 32 * (8 * s + 2 * c)), _mm256_and_si256(v, m15));
                _mm256_storeu_si256((__m256i *)(void *)(q + 32 * (8 * s + 2 * c + 1)),
                                    _mm256_and_si256(_mm256_srli_epi16(v, 4), m15));
            }
            for (int k = 0; k < 8; k++) {
                uint8_t sc, m;
                gb_scale_min_k4(blk + 4, k, &sc, &m);
                sigma[8 * s + k] = d * (float)sc;
                mu[8 * s + k] = -(dmin * (float)m);
                sub[2 * (8 * s + k)] = sub[2 * (8 * s + k) + 1] = 1;
            }
        }
        return;
    case SMOE_FMT_GGML_Q6_K:
        for (uint32_t s = 0; s < nb / 8; s++) {
            const uint8_t *blk = row + 210 * (size_t)s;
            const float d = gb_f16(blk + 208);
            const __m256i m15 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
            for (int half = 0; half < 2; half++) {
                const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
                const __m256i l0 = _mm256_loadu_si256((const __m256i *)(const void *)ql);        /* columns 0–31, 64–95 */
                const __m256i l1 = _mm256_loadu_si256((const __m256i *)(const void *)(ql + 32)); /* 32–63, 96–127 */
                const __m256i h = _mm256_loadu_si256((const __m256i *)(const void *)qh);
                const __m256i lo[4] = {_mm256_and_si256(l0, m15), _mm256_and_si256(l1, m15),
                                       _mm256_and_si256(_mm256_srli_epi16(l0, 4), m15),
                                       _mm256_and_si256(_mm256_srli_epi16(l1, 4), m15)};
                for (int k = 0; k < 4; k++) { /* columns 32k..32k+32 of the half: high bits 2k, 2k+1 of qh */
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(h, 2 * k), m3);
                    const __m256i v = _mm256_sub_epi8(_mm256_or_si256(lo[k], _mm256_slli_epi16(hi, 4)), off);
                    _mm256_storeu_si256((__m256i *)(void *)(q + 32 * (8 * s + 4 * half + k)), v);
                }
            }
            const int8_t *sc = (const int8_t *)(const void *)(blk + 192);
            for (int k = 0; k < 8; k++) {
                sigma[8 * s + k] = d;
                mu[8 * s + k] = 0.0f;
                sub[2 * (8 * s + k)] = sc[2 * k];
                sub[2 * (8 * s + k) + 1] = sc[2 * k + 1];
            }
        }
        return;
    default:
        gb_qx_decode(fmt, row, 0, nb, q, sub, sigma, mu);
    }
}

/* The 8 int32 sums of p[0..8) (8 lanes each), lane j the sum of p[j] */
INLINE __m256i g_reduce8(const __m256i p[8]) {
    const __m256i s01 = _mm256_hadd_epi32(p[0], p[1]), s23 = _mm256_hadd_epi32(p[2], p[3]);
    const __m256i s45 = _mm256_hadd_epi32(p[4], p[5]), s67 = _mm256_hadd_epi32(p[6], p[7]);
    const __m256i a = _mm256_hadd_epi32(s01, s23), b = _mm256_hadd_epi32(s45, s67);
    /* a: p0..p3 halves of the low 128 bits, then of the high; b likewise for p4..p7 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

static bool g_matmul_qx(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y, size_t ldy,
                        uint32_t r0, uint32_t r1) {
    const uint8_t fmt = W->format;
    const uint32_t cols = W->cols;
    uint32_t bs = 32, ts = 0;
    smoe_ggml_block(fmt, &bs, &ts);
    if (cols > MAXC || cols % bs) return false;
    const uint32_t nb = cols / 32, nb8 = (nb + 7) / 8 * 8;
    const smoe_qx_size z = smoe_qx_sizes(cols, fmt, 32);
    const bool has_min = gb_has_min(fmt);
    const size_t row_bytes = (size_t)(cols / bs) * ts;
    int8_t q[MAXC] __attribute__((aligned(32)));
    int8_t qa[MAXC] __attribute__((aligned(32))); /* |q| */
    int16_t sub[2 * GMAXB];
    float sigma[GMAXB], sigl[GMAXB], mu[GMAXB]; /* σ in plain and in lane order; μ */
    const __m256i lane_of = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (uint32_t r = r0; r < r1; r++) {
        g_decode_row(fmt, w + (size_t)r * row_bytes, nb, q, sub, sigma, mu);
        for (uint32_t b = nb; b < nb8; b++) {
            memset(q + 32 * b, 0, 32);
            sigma[b] = mu[b] = 0.0f;
            sub[2 * b] = sub[2 * b + 1] = 0;
        }
        for (uint32_t k = 0; k < nb8 / 8; k++)
            _mm256_storeu_ps(sigl + 8 * k, _mm256_permutevar8x32_ps(_mm256_loadu_ps(sigma + 8 * k), lane_of));
        for (uint32_t b = 0; b < nb8; b++) {
            const __m256i v = _mm256_load_si256((const __m256i *)(const void *)(q + 32 * b));
            _mm256_store_si256((__m256i *)(void *)(qa + 32 * b), _mm256_sign_epi8(v, v));
        }
        for (uint32_t t = 0; t < n; t++) {
            const int8_t *ct = (const int8_t *)X->codes + (size_t)t * z.code_bytes;
            const float *dt = X->d + (size_t)t * z.d_floats, *st = X->gsum + (size_t)t * z.gsum_floats;
            __m256 tot = _mm256_setzero_ps(), bia = _mm256_setzero_ps();
            for (uint32_t k = 0; k < nb8 / 8; k++) {
                __m256i p[8];
                for (int j = 0; j < 8; j++) {
                    const uint32_t b = 8 * k + 2 * (j % 4) + j / 4, u = 4 * k + j % 4, h = j / 4;
                    const int8_t *cu = ct + 64 * (size_t)u + 16 * h;
                    const __m256i cv = _mm256_loadu2_m128i((const __m128i *)(const void *)(cu + 32),
                                                           (const __m128i *)(const void *)cu);
                    const __m256i wv = _mm256_load_si256((const __m256i *)(const void *)(q + 32 * b));
                    const __m256i wa = _mm256_load_si256((const __m256i *)(const void *)(qa + 32 * b));
                    const __m256i pr = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(cv, wv));
                    const __m256i sv = _mm256_set_m128i(_mm_set1_epi16(sub[2 * b + 1]), _mm_set1_epi16(sub[2 * b]));
                    p[j] = _mm256_madd_epi16(pr, sv);
                }
                const __m256 I = _mm256_cvtepi32_ps(g_reduce8(p));
                const __m256 sd = _mm256_mul_ps(_mm256_loadu_ps(sigl + 8 * k), _mm256_loadu_ps(dt + 8 * k));
                tot = _mm256_fmadd_ps(I, sd, tot);
                if (has_min) bia = _mm256_fmadd_ps(_mm256_loadu_ps(mu + 8 * k), _mm256_loadu_ps(st + 8 * k), bia);
            }
            y[(size_t)t * ldy + r] = has_min ? hsum8(tot) + hsum8(bia) : hsum8(tot);
        }
    }
    return true;
}
