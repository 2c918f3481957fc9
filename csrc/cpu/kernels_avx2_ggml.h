/* kernels_avx2_ggml.h — the 8-bit-activation product for the GGML block formats on AVX2, with
 * the bits of kernels_ref.c's ref_ggml_qx. Included once by kernels_avx2.c (its helpers: hsum8).
 *
 * A row is decoded 256 columns at a time into its integer form (ggml_blocks.h: q, sub, σ, μ per
 * block of 32 columns), in registers, and multiplied by each token's codes (in column order, one
 * 32-byte load per block): per block, the 32 products
 * q·code come out of one vpmaddubsw (|q| against code·sign(q), pairs < 2^15) and one vpmaddwd
 * against the block's two sub-scales (1 for most formats), which leaves 8 partial int32 sums; the
 * 8 blocks of one step k are reduced by a vphaddd tree straight into lane order (lane j: block
 * 8k + 2·(j%4) + j/4, the block whose d is d[8k + j]). Integer sums are exact, so that order is
 * free; the float operations are the reference's: tot = fma((float)I, σ·d, tot) per lane, bia =
 * fma(μ, gsum, bia), y = hsum8(tot) (+ hsum8(bia)).
 *
 * The decoders (g_decode8) work on vectors for every format but Q2_K, Q3_K, Q4_1, Q5_1, which take
 * gb_qx_decode, the reference's own (the same values either way: integers and the same rounded
 * products). The codebook formats (IQ1_S ... IQ3_S) always take the pair layout (gp_decode's
 * g_iq_decode8). */


/* 32 int8 of one block: low nibbles of 16 bytes (columns 0–15) then high nibbles (16–31) */
INLINE __m256i g_nibbles(const uint8_t *qs) {
    const __m128i b = _mm_loadu_si128((const __m128i *)(const void *)qs);
    const __m256i v = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
    return _mm256_and_si256(v, _mm256_set1_epi8(15));
}

/* The f16 at p, p + stride, … (8 of them) widened by vcvtph2ps: gb_f16q's values */
INLINE __m256 g_f16x8(const uint8_t *p, size_t stride) { /* gathered in two integers: no store to reload */
    uint64_t a = 0, b = 0;
    for (int i = 0; i < 4; i++) {
        uint16_t h0, h1;
        memcpy(&h0, p + stride * (size_t)i, 2);
        memcpy(&h1, p + stride * (size_t)(i + 4), 2);
        a |= (uint64_t)h0 << (16 * i);
        b |= (uint64_t)h1 << (16 * i);
    }
    return _mm256_cvtph_ps(_mm_set_epi64x((long long)b, (long long)a));
}

INLINE float g_f16_1(const uint8_t *p) { return _mm256_cvtss_f32(g_f16x8(p, 0)); }

/* the 8 bytes at p, p + stride, … as int32 lanes */
INLINE __m256i g_bytes8(const uint8_t *p, size_t stride) {
    uint8_t b[16] = {0};
    for (int i = 0; i < 8; i++) b[i] = p[stride * (size_t)i];
    return _mm256_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)b));
}

/* The 8 int32 sums of p[0..8) (8 lanes each), lane j the sum of p[j] */
INLINE __m256i g_reduce8(const __m256i p[8]) {
    const __m256i s01 = _mm256_hadd_epi32(p[0], p[1]), s23 = _mm256_hadd_epi32(p[2], p[3]);
    const __m256i s45 = _mm256_hadd_epi32(p[4], p[5]), s67 = _mm256_hadd_epi32(p[6], p[7]);
    const __m256i a = _mm256_hadd_epi32(s01, s23), b = _mm256_hadd_epi32(s45, s67);
    /* a: p0..p3 halves of the low 128 bits, then of the high; b likewise for p4..p7 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* g_kpm[i]: the 8 bytes ±1 of the sign byte of 7-bit index i (gb_ksigns; byte j −1 where bit j is
 * set), built by the compiler */
#define G_PM1(b, j) ((((b) >> (j)) & 1) ? 0xFFull << (8 * (j)) : 1ull << (8 * (j)))
#define G_PM8(b) (G_PM1(b, 0) | G_PM1(b, 1) | G_PM1(b, 2) | G_PM1(b, 3) | G_PM1(b, 4) | G_PM1(b, 5) | G_PM1(b, 6) | G_PM1(b, 7))
#define G_KPM(i) G_PM8(GB_KSIGNS(i))
#define G_KPMx4(b) G_KPM(b), G_KPM((b) + 1), G_KPM((b) + 2), G_KPM((b) + 3)
#define G_KPMx16(b) G_KPMx4(b), G_KPMx4((b) + 4), G_KPMx4((b) + 8), G_KPMx4((b) + 12)
static const uint64_t g_kpm[128] = {G_KPMx16(0), G_KPMx16(16), G_KPMx16(32), G_KPMx16(48), G_KPMx16(64), G_KPMx16(80), G_KPMx16(96), G_KPMx16(112)};
#undef G_KPMx16
#undef G_KPMx4
#undef G_KPM
#undef G_PM8
#undef G_PM1

/* byte j of the result: byte j / 8 of v (each of v's 4 bytes spread over 8) */
INLINE __m256i g_spread4(uint32_t v) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                            3, 3, 3, 3, 3, 3);
    return _mm256_shuffle_epi8(_mm256_set1_epi32((int)v), spread);
}

/* byte j of the result: 0xFF where bit j % 8 of byte j / 8 of v is set, else 0 */
INLINE __m256i g_bits32(uint32_t v) {
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201ll);
    return _mm256_cmpeq_epi8(_mm256_and_si256(g_spread4(v), bit), bit);
}

/* The codebook formats' step (one 256-column block at blk): per part i of 32 columns, its 4
 * codebook entries as one register, signed by its sign bits (IQ2/IQ3: q = ±g) or 8·g ± 1 (IQ1);
 * byte 2i + h of *sbv the sub-scale 2·ls + 1 of its half h (built in registers: bytes stored one
 * by one and loaded as a vector would stall the load); σ in plain order, the return value (d·f, or
 * (d·(2·ls + 1))·f for the formats with a scale per 32, whose products then take no sub-scales). The
 * fields are read where gb_iq_fields (ggml_blocks.h) reads them, so the integers are gb_qx_decode's
 * (tests/c/test_ggml.c compares the products bit for bit). The IQ3 grids' 8 entries a part come
 * from one vpgatherdd (3.4 against 5.4 ms for IQ3_S with 8 loads, bench/ggml_kernels.c n = 1 on the
 * Xeon; the IQ2 and IQ1 grids' 4 through a 64-bit gather were slower: bench/RESULTS.md). */
INLINE __m256 g_iq_decode8(const uint8_t fmt, const uint8_t *blk, __m256i q[8], __m128i *sbv) {
    const bool iq1 = gb_iq1(fmt);
    uint32_t dh = gb_u16(blk); /* the f16 d (IQ1_M: below) */
    uint64_t ls8 = 0; /* the formats with a scale per 32: part i's in byte i */
    for (int i = 0; i < 8; i++) {
        __m256i g, pm;
        if (fmt == SMOE_FMT_GGML_IQ2_XXS || fmt == SMOE_FMT_GGML_IQ3_XXS) {
            const bool two = fmt == SMOE_FMT_GGML_IQ2_XXS;
            const uint32_t aux = gb_u32(blk + (two ? 6 + 8 * i : 66 + 4 * i));
            if (two) {
                const uint8_t *ix = blk + 2 + 8 * i;
                g = _mm256_set_epi64x((long long)gb_iq2xxs_grid[ix[3]], (long long)gb_iq2xxs_grid[ix[2]],
                                      (long long)gb_iq2xxs_grid[ix[1]], (long long)gb_iq2xxs_grid[ix[0]]);
            } else {
                const __m256i ix = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(blk + 2 + 8 * i)));
                g = _mm256_i32gather_epi32((const int *)(const void *)gb_iq3xxs_grid, ix, 4);
            }
            pm = _mm256_set_epi64x((long long)g_kpm[(aux >> 21) & 127], (long long)g_kpm[(aux >> 14) & 127],
                                   (long long)g_kpm[(aux >> 7) & 127], (long long)g_kpm[aux & 127]);
            ls8 |= (uint64_t)(aux >> 28) << (8 * i);
        } else if (fmt == SMOE_FMT_GGML_IQ2_XS) {
            const uint8_t *p = blk + 2 + 8 * i;
            const uint32_t q0 = gb_u16(p), q1 = gb_u16(p + 2), q2 = gb_u16(p + 4), q3 = gb_u16(p + 6);
            g = _mm256_set_epi64x((long long)gb_iq2xs_grid[q3 & 511], (long long)gb_iq2xs_grid[q2 & 511],
                                  (long long)gb_iq2xs_grid[q1 & 511], (long long)gb_iq2xs_grid[q0 & 511]);
            pm = _mm256_set_epi64x((long long)g_kpm[q3 >> 9], (long long)g_kpm[q2 >> 9], (long long)g_kpm[q1 >> 9],
                                   (long long)g_kpm[q0 >> 9]);
        } else if (fmt == SMOE_FMT_GGML_IQ2_S || fmt == SMOE_FMT_GGML_IQ3_S) {
            const bool two = fmt == SMOE_FMT_GGML_IQ2_S;
            const uint8_t *ix = blk + 2 + (two ? 4 : 8) * i;
            const uint32_t qh = blk[66 + i];
            if (two)
                g = _mm256_set_epi64x((long long)gb_iq2s_grid[ix[3] | (qh << 2 & 0x300)], (long long)gb_iq2s_grid[ix[2] | (qh << 4 & 0x300)],
                                      (long long)gb_iq2s_grid[ix[1] | (qh << 6 & 0x300)], (long long)gb_iq2s_grid[ix[0] | (qh << 8 & 0x300)]);
            else
                g = _mm256_i32gather_epi32(
                    (const int *)(const void *)gb_iq3s_grid,
                    _mm256_or_si256(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)ix)),
                                    _mm256_and_si256(_mm256_sllv_epi32(_mm256_set1_epi32((int)qh), _mm256_setr_epi32(8, 7, 6, 5, 4, 3, 2, 1)),
                                                     _mm256_set1_epi32(256))),
                    4);
            pm = _mm256_or_si256(g_bits32(gb_u32(blk + (two ? 34 : 74) + 4 * i)), _mm256_set1_epi8(1));
        } else if (fmt == SMOE_FMT_GGML_IQ1_S) {
            const uint32_t h = gb_u16(blk + 34 + 2 * i);
            const uint8_t *ix = blk + 2 + 4 * i;
            g = _mm256_set_epi64x((long long)gb_iq1s_grid[ix[3] | (h >> 1 & 0x700)], (long long)gb_iq1s_grid[ix[2] | (h << 2 & 0x700)],
                                  (long long)gb_iq1s_grid[ix[1] | (h << 5 & 0x700)], (long long)gb_iq1s_grid[ix[0] | (h << 8 & 0x700)]);
            pm = _mm256_set1_epi8((char)(1 - 2 * (int)(h >> 15)));
            ls8 |= (uint64_t)((h >> 12) & 7) << (8 * i);
        } else { /* IQ1_M */
            const uint32_t n0 = blk[32 + 2 * i], n1 = blk[33 + 2 * i];
            const uint8_t *ix = blk + 4 * i;
            g = _mm256_set_epi64x((long long)gb_iq1s_grid[ix[3] | (n1 << 4 & 0x700)], (long long)gb_iq1s_grid[ix[2] | (n1 << 8 & 0x700)],
                                  (long long)gb_iq1s_grid[ix[1] | (n0 << 4 & 0x700)], (long long)gb_iq1s_grid[ix[0] | (n0 << 8 & 0x700)]);
            /* −1 bytes where a group's ⅛ is negative: bit 3 of each nibble, spread over its group's
               8 bytes (byte l of sg for group l; a branch per group would mispredict on random bits) */
            const uint32_t nb = n0 | n1 << 8;
            const uint32_t sg = ((nb >> 3) & 1) * 0xFFu | ((nb >> 7) & 1) * 0xFF00u | ((nb >> 11) & 1) * 0xFF0000u |
                                ((nb >> 15) & 1) * 0xFF000000u;
            pm = _mm256_or_si256(g_spread4(sg), _mm256_set1_epi8(1));
        }
        if (iq1) {
            const __m256i g2 = _mm256_add_epi8(g, g), g4 = _mm256_add_epi8(g2, g2);
            q[i] = _mm256_add_epi8(_mm256_add_epi8(g4, g4), pm);
        } else {
            q[i] = _mm256_sign_epi8(g, pm);
        }
    }
    __m128i ls; /* byte 2i + h: ls of part i's half h */
    const __m128i m15 = _mm_set1_epi8(15);
    if (fmt == SMOE_FMT_GGML_IQ2_XS || fmt == SMOE_FMT_GGML_IQ2_S) { /* 8 bytes of two nibbles */
        const __m128i v = _mm_loadl_epi64((const __m128i *)(const void *)(blk + (fmt == SMOE_FMT_GGML_IQ2_XS ? 66 : 74)));
        ls = _mm_unpacklo_epi8(_mm_and_si128(v, m15), _mm_and_si128(_mm_srli_epi16(v, 4), m15));
    } else if (fmt == SMOE_FMT_GGML_IQ3_S) { /* 4 bytes of two nibbles, one per part */
        const __m128i v = _mm_cvtsi32_si128((int)gb_u32(blk + 106));
        const __m128i l = _mm_unpacklo_epi8(_mm_and_si128(v, m15), _mm_and_si128(_mm_srli_epi16(v, 4), m15));
        ls = _mm_unpacklo_epi8(l, l);
    } else if (fmt == SMOE_FMT_GGML_IQ1_M) { /* 16 3-bit fields in the low 12 bits of 4 words */
        const __m128i w = _mm_loadl_epi64((const __m128i *)(const void *)(blk + 48)); /* u16 w0..w3 */
        /* 32-bit lanes: field j of word j/4 shifted down, for j = 0..7 then 8..15 */
        const __m256i sh = _mm256_setr_epi32(0, 3, 6, 9, 0, 3, 6, 9);
        const __m256i lo = _mm256_srlv_epi32(_mm256_cvtepu16_epi32(_mm_shuffle_epi8(w, _mm_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3))), sh);
        const __m256i hi = _mm256_srlv_epi32(_mm256_cvtepu16_epi32(_mm_shuffle_epi8(w, _mm_setr_epi8(4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7))), sh);
        const __m256i f = _mm256_and_si256(_mm256_packus_epi32(lo, hi), _mm256_set1_epi16(7)); /* [lo0-3 hi0-3 | lo4-7 hi4-7] */
        const __m256i fo = _mm256_permute4x64_epi64(f, 0xD8);                                  /* lo0-7, hi0-7 */
        ls = _mm_packus_epi16(_mm256_castsi256_si128(fo), _mm256_extracti128_si256(fo, 1));
        dh = smoe_ggml_iq1m_d(blk);
    } else { /* one per part, for both halves */
        const __m128i v = _mm_cvtsi64_si128((long long)ls8);
        ls = _mm_unpacklo_epi8(v, v);
    }
    *sbv = _mm_add_epi8(_mm_add_epi8(ls, ls), _mm_set1_epi8(1));
    const float d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128((int)dh)));
    const float f = gb_iq_f(fmt);
    if (!gb_iq_scale32(fmt)) return _mm256_set1_ps(d * f);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_shuffle_epi8(*sbv, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1))));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(d), sc), _mm256_set1_ps(f)); /* (d·(2·ls + 1))·f, in plain order */
}

/* Blocks [8k, 8k + 8) of a row (one 256-column block, or eight 32-column ones) in registers'
 * reach: q (plain order, 32 per block), σ in lane order (lane j: block 2·(j%4) + j/4), μ in plain
 * order, and for the formats with sub-scales (gb_has_sub) each block's two as a vector. The values
 * are gb_qx_decode's. */
INLINE void g_decode8(const uint8_t fmt, const uint8_t *row, uint32_t k, __m256i q[8], __m256 *sigl, __m256 *mu,
                      __m256i sub[8]) {
    const __m256i m15 = _mm256_set1_epi8(15), lane_of = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    __m256 sgv = _mm256_setzero_ps(); /* σ in plain order */
    bool have_mu = false;
    switch (fmt) {
    case SMOE_FMT_GGML_Q8_0:
        for (int i = 0; i < 8; i++)
            q[i] = _mm256_loadu_si256((const __m256i *)(const void *)(row + 34 * (size_t)(8 * k + i) + 2));
        sgv = g_f16x8(row + 34 * (size_t)(8 * k), 34);
        break;
    case SMOE_FMT_GGML_Q4_0:
    case SMOE_FMT_GGML_IQ4_NL:
    case SMOE_FMT_GGML_MXFP4: {
        const bool mx = fmt == SMOE_FMT_GGML_MXFP4;
        const uint32_t ts = mx ? 17 : 18;
        const __m256i table = _mm256_broadcastsi128_si256(
            _mm_loadu_si128((const __m128i *)(const void *)(mx ? gb_kvalues_mxfp4 : gb_kvalues_iq4nl)));
        const uint8_t *blk0 = row + ts * (size_t)(8 * k);
        for (int i = 0; i < 8; i++) {
            const __m256i nib = g_nibbles(blk0 + ts * i + (mx ? 1 : 2));
            q[i] = fmt == SMOE_FMT_GGML_Q4_0 ? _mm256_sub_epi8(nib, _mm256_set1_epi8(8)) : _mm256_shuffle_epi8(table, nib);
        }
        if (mx) { /* 2^(e − 128): (e − 1) << 23, or 2^21 << e for e < 2 (subnormal) */
            const __m256i e = g_bytes8(blk0, ts);
            const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
            const __m256i sub2 = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
            sgv = _mm256_castsi256_ps(_mm256_blendv_epi8(normal, sub2, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
        } else {
            sgv = g_f16x8(blk0, ts);
        }
        break;
    }
    case SMOE_FMT_GGML_Q5_0: {
        for (int i = 0; i < 8; i++) {
            const uint8_t *blk = row + 22 * (size_t)(8 * k + i);
            const __m256i hb = g_bits32(gb_u32(blk + 2));
            q[i] = _mm256_sub_epi8(_mm256_or_si256(g_nibbles(blk + 6), _mm256_and_si256(hb, _mm256_set1_epi8(16))),
                                   _mm256_set1_epi8(16));
        }
        sgv = g_f16x8(row + 22 * (size_t)(8 * k), 22);
        break;
    }
    case SMOE_FMT_GGML_IQ4_XS: {
        const uint8_t *blk = row + 136 * (size_t)k;
        const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)gb_kvalues_iq4nl));
        for (int i = 0; i < 8; i++) q[i] = _mm256_shuffle_epi8(table, g_nibbles(blk + 8 + 16 * i));
        uint32_t lo4;
        uint16_t hi2;
        memcpy(&lo4, blk + 4, 4);
        memcpy(&hi2, blk + 2, 2);
        const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)lo4), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                            _mm256_set1_epi32(15));
        const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(hi2), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                            _mm256_set1_epi32(3));
        const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
        sgv = _mm256_mul_ps(_mm256_set1_ps(g_f16_1(blk)), _mm256_cvtepi32_ps(ls));
        break;
    }
    case SMOE_FMT_GGML_Q4_K:
    case SMOE_FMT_GGML_Q5_K: {
        const bool q5 = fmt == SMOE_FMT_GGML_Q5_K;
        const uint8_t *blk = row + (q5 ? 176 : 144) * (size_t)k;
        const __m256i qh = q5 ? _mm256_loadu_si256((const __m256i *)(const void *)(blk + 16)) : _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) { /* 32 bytes: low nibbles = block 2c, high = block 2c + 1 */
            const __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(blk + (q5 ? 48 : 16) + 32 * c));
            q[2 * c] = _mm256_and_si256(v, m15);
            q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);
        }
        if (q5)
            for (int i = 0; i < 8; i++) {
                const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(qh, i), _mm256_set1_epi8(1));
                q[i] = _mm256_or_si256(q[i], _mm256_slli_epi16(hb, 4));
            }
        uint32_t u[3], sc[2], mm[2]; /* gb_scale_min_k4 on four bytes at a time */
        memcpy(u, blk + 4, 12);
        sc[0] = u[0] & 0x3f3f3f3fu;
        mm[0] = u[1] & 0x3f3f3f3fu;
        sc[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
        mm[1] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
        const __m256 dd = g_f16x8(blk, 2); /* lanes: d, dmin, … */
        const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)sc)));
        const __m256 mf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)mm)));
        sgv = _mm256_mul_ps(_mm256_permutevar8x32_ps(dd, _mm256_setzero_si256()), scf);
        *mu = _mm256_xor_ps(_mm256_mul_ps(_mm256_permutevar8x32_ps(dd, _mm256_set1_epi32(1)), mf), _mm256_set1_ps(-0.0f));
        have_mu = true;
        break;
    }
    case SMOE_FMT_GGML_Q6_K: {
        const uint8_t *blk = row + 210 * (size_t)k;
        const __m256i m3 = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(const void *)ql);        /* columns 0–31, 64–95 */
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(const void *)(ql + 32)); /* 32–63, 96–127 */
            const __m256i h = _mm256_loadu_si256((const __m256i *)(const void *)qh);
            const __m256i lo[4] = {_mm256_and_si256(l0, m15), _mm256_and_si256(l1, m15),
                                   _mm256_and_si256(_mm256_srli_epi16(l0, 4), m15),
                                   _mm256_and_si256(_mm256_srli_epi16(l1, 4), m15)};
            for (int j = 0; j < 4; j++) { /* columns 32j..32j+32 of the half: high bits 2j, 2j+1 of qh */
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(h, 2 * j), m3);
                q[4 * half + j] = _mm256_sub_epi8(_mm256_or_si256(lo[j], _mm256_slli_epi16(hi, 4)), off);
            }
        }
        const int8_t *sc = (const int8_t *)(const void *)(blk + 192);
        for (int i = 0; i < 8; i++) sub[i] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * i + 1]), _mm_set1_epi16(sc[2 * i]));
        sgv = _mm256_set1_ps(g_f16_1(blk + 208));
        break;
    }
    default: { /* Q2_K, Q3_K, Q4_1, Q5_1 (and the codebook formats, which take gp_decode): the reference's decoder */
        int8_t qb[8 * 32];
        int16_t sb[16];
        float sg[8], m[8];
        gb_qx_decode(fmt, row, 8 * k, 8, qb, sb, sg, m);
        for (int i = 0; i < 8; i++) {
            q[i] = _mm256_loadu_si256((const __m256i *)(const void *)(qb + 32 * i));
            sub[i] = _mm256_set_m128i(_mm_set1_epi16(sb[2 * i + 1]), _mm_set1_epi16(sb[2 * i]));
        }
        sgv = _mm256_loadu_ps(sg);
        *mu = _mm256_loadu_ps(m);
        have_mu = true;
    }
    }
    *sigl = _mm256_permutevar8x32_ps(sgv, lane_of);
    if (!have_mu) *mu = _mm256_setzero_ps();
}

/* ---------------------------------------------------------------- the pair layout (fast path)
 *
 * The formats people's files hold (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q5_0, IQ4_NL, IQ4_XS, MXFP4; for
 * the 8-bit-activation product also Q2_K, Q3_K, Q4_1, Q5_1: gp_takes_qx) on rows of whole
 * 256-column steps take a second form, q4's (kernels_avx2_qx.h): a step's 8 blocks
 * as 4 pairs (2p, 2p + 1), each pair two registers, w[2p] = [block 2p columns 0–15 | block
 * 2p + 1 columns 0–15] and w[2p + 1] = the same of columns 16–31. A pair's product then holds
 * block 2p in its low 128 bits and 2p + 1 in its high ones, and three vphaddd of the 4 pairs give
 * the 8 block sums straight in the reference's lane order (lane j: block 2·(j%4) + j/4) — instead
 * of g_reduce8's 8 → 1 tree per block. The token's codes meet it in the same order: the two
 * halves of a pair's columns (gp_codes, or a copy re-laid once per call, gp_relay). The integers
 * are the same, so the bits are. */

enum { GP_XBYTES = 32768 }; /* stack for a tile of re-laid codes (n > 1): 16 tokens of 2048 columns */

/* the u16 at p */
INLINE uint64_t g_u16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

/* The 8 f16 at p, p + stride, … widened (vcvtph2ps): gathered in two integers, no store. */
INLINE __m256 gp_f16x8(const uint8_t *p, size_t stride) {
    uint64_t a = 0, b = 0;
    for (int i = 0; i < 4; i++) {
        a |= g_u16(p + stride * (size_t)i) << (16 * i);
        b |= g_u16(p + stride * (size_t)(i + 4)) << (16 * i);
    }
    return _mm256_cvtph_ps(_mm_set_epi64x((long long)b, (long long)a));
}

/* one f16 at p, in every lane */
INLINE __m256 gp_f16_all(const uint8_t *p) {
    return _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128((int)g_u16(p))));
}

/* [16 bytes at lo | 16 bytes at hi] */
INLINE __m256i gp_lu2(const uint8_t *hi, const uint8_t *lo) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)lo)),
                                   _mm_loadu_si128((const __m128i *)(const void *)hi), 1);
}

/* the 16 bytes at p in both halves */
INLINE __m256i gp_bc(const uint8_t *p) { return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)p)); }

/* A token's codes for pair p of step k (x: its codes in column order): [columns 0–15 of block
 * 2p | of 2p + 1], then columns 16–31 */
INLINE void gp_codes(const uint8_t *x, uint32_t k, int p, __m256i *x0, __m256i *x1) {
    const uint8_t *b = x + 256 * (size_t)k + 64 * p;
    *x0 = gp_lu2(b + 32, b);
    *x1 = gp_lu2(b + 48, b + 16);
}

/* The codes of a row of cols (a multiple of 256) re-laid in pair order: per 64 columns, 0–15,
 * 32–47, 16–31, 48–63, so that gp_codes' two registers are plain loads. */
INLINE void gp_relay(const uint8_t *x, uint32_t cols, uint8_t *out) {
    for (uint32_t c = 0; c < cols; c += 64) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)(x + c));
        const __m256i b = _mm256_loadu_si256((const __m256i *)(const void *)(x + c + 32));
        _mm256_storeu_si256((__m256i *)(void *)(out + c), _mm256_permute2x128_si256(a, b, 0x20));
        _mm256_storeu_si256((__m256i *)(void *)(out + c + 32), _mm256_permute2x128_si256(a, b, 0x31));
    }
}

/* The formats of the fast path (every GGML block format but F16), X(format) each: the one list
 * the kernels' per-format switches (the format a constant in each case) and gp_takes_qx expand */
#define GP_FORMATS(X)                                                                                                  \
    X(SMOE_FMT_GGML_Q4_0) X(SMOE_FMT_GGML_Q4_1) X(SMOE_FMT_GGML_Q5_0) X(SMOE_FMT_GGML_Q5_1) X(SMOE_FMT_GGML_Q8_0)      \
    X(SMOE_FMT_GGML_Q2_K) X(SMOE_FMT_GGML_Q3_K) X(SMOE_FMT_GGML_Q4_K) X(SMOE_FMT_GGML_Q5_K) X(SMOE_FMT_GGML_Q6_K)      \
    X(SMOE_FMT_GGML_IQ4_NL) X(SMOE_FMT_GGML_IQ4_XS) X(SMOE_FMT_GGML_MXFP4) X(SMOE_FMT_GGML_IQ2_XXS)                    \
    X(SMOE_FMT_GGML_IQ2_XS) X(SMOE_FMT_GGML_IQ2_S) X(SMOE_FMT_GGML_IQ3_XXS) X(SMOE_FMT_GGML_IQ3_S)                      \
    X(SMOE_FMT_GGML_IQ1_S) X(SMOE_FMT_GGML_IQ1_M)

/* Whether the fast path takes the format (on rows of whole 256-column steps): the 8-bit-activation
 * products (pair layout; AVX512-VNNI's transposed one) and the f32 ones' vector dequantisation */
INLINE bool gp_takes_qx(uint8_t fmt) {
    switch (fmt) {
#define GP_TAKES(f) case f:
        GP_FORMATS(GP_TAKES) return true;
#undef GP_TAKES
    }
    return false;
}
/* Formats with int16 sub-scales per 16 columns (sub) */
INLINE bool gp_has_sub(uint8_t fmt) { return gb_has_sub(fmt); }
/* Formats whose q is unsigned (0..31), a valid u8 operand as it is */
INLINE bool gp_unsigned(uint8_t fmt) {
    return fmt == SMOE_FMT_GGML_Q4_K || fmt == SMOE_FMT_GGML_Q5_K || fmt == SMOE_FMT_GGML_Q2_K || fmt == SMOE_FMT_GGML_Q4_1 ||
           fmt == SMOE_FMT_GGML_Q5_1;
}
/* The pair layout's offset for Q6_K: q + 32 is non-negative, a u8 operand as it is, so gp_decode
 * leaves q + off and the products take Σ sub·(q + off)·x − off·Σ_h sub_h·(the codes' 16-column
 * sums): the same integer as Σ sub·q·x (exact sums), for fewer operations than |q| and the codes'
 * signs (bench/RESULTS.md; Q3_K's q + 4 was slower for one token) */
INLINE int gp_off(uint8_t fmt) { return fmt == SMOE_FMT_GGML_Q6_K ? 32 : 0; }
/* Whether the pair layout's q are u8 operands: gp_unsigned's formats and those with gp_off */
INLINE bool gp_pair_unsigned(uint8_t fmt) { return gp_unsigned(fmt) || gp_off(fmt); }
/* |q| up to 127 or 128: two vpmaddubsw results may not be added in int16 */
INLINE bool gp_big(uint8_t fmt) {
    return fmt == SMOE_FMT_GGML_Q8_0 || fmt == SMOE_FMT_GGML_IQ4_NL || fmt == SMOE_FMT_GGML_IQ4_XS;
}

/* The 16 bytes v (byte 2b + h: block b's value of half h, b < 8) as int16 registers matching the
 * pair layout (sub[2p + c]: [block 2p's value c ×8 | 2p + 1's ×8]), sign-extended. */
INLINE void gp_subs(const __m128i v, __m256i sub[8]) {
    const __m256i scv = _mm256_broadcastsi128_si256(v);
    for (int p = 0; p < 4; p++)
        for (int c = 0; c < 2; c++) { /* bytes 4p + c, 4p + 2 + c into the high byte of each int16 lane */
            const __m256i ctl = _mm256_setr_epi8(
                -128, 4 * p + c, -128, 4 * p + c, -128, 4 * p + c, -128, 4 * p + c, -128, 4 * p + c, -128, 4 * p + c, -128,
                4 * p + c, -128, 4 * p + c, -128, 4 * p + 2 + c, -128, 4 * p + 2 + c, -128, 4 * p + 2 + c, -128,
                4 * p + 2 + c, -128, 4 * p + 2 + c, -128, 4 * p + 2 + c, -128, 4 * p + 2 + c, -128, 4 * p + 2 + c);
            sub[2 * p + c] = _mm256_srai_epi16(_mm256_shuffle_epi8(scv, ctl), 8);
        }
}

/* Q2_K's min term (and gp_off's) needs Σ_{c ∈ half h} code_c per 16 columns, which does not
 * depend on the row: a token's 16-column sums (column order, int16: |Σ| ≤ 16·127) are taken once,
 * and a step's 8 block sums Σ_h m_h·s_h are then one vpmaddwd of its 16 mins (plain order) against
 * them. */
INLINE void gp_halfsums(const uint8_t *x, uint32_t cols, int16_t *hs) {
    for (uint32_t j = 0; j < cols / 16; j++) {
        int s = 0;
        for (int c = 0; c < 16; c++) s += (int8_t)x[16 * j + c];
        hs[j] = (int16_t)s;
    }
}

/* Q2_K's 16 mins of step k (gb_q2k_mins' m, byte 2b + h) as int16 */
INLINE __m256i gp_q2k_mins(const uint8_t *row, uint32_t k) {
    const __m128i v = _mm_loadu_si128((const __m128i *)(const void *)(row + 84 * (size_t)k));
    return _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(15)));
}

/* The step's 8 min sums (lane order) from its 16 mins m and the token's 16 half sums hs of the step */
INLINE __m256i gp_msum(const __m256i m, const int16_t *hs) {
    const __m256i b = _mm256_madd_epi16(m, _mm256_loadu_si256((const __m256i *)(const void *)hs));
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
}

/* gp_msum as float (exact integers): Q2_K's */
INLINE __m256 gp_q2k_msum(const __m256i m, const int16_t *hs) { return _mm256_cvtepi32_ps(gp_msum(m, hs)); }

/* Q2_K's 16 sub-scales of the block at blk (byte 2b + h: block b's half h), 0..15 */
INLINE __m128i gp_q2k_subs(const uint8_t *blk) {
    return _mm_and_si128(_mm_loadu_si128((const __m128i *)(const void *)blk), _mm_set1_epi8(15));
}

/* Q3_K's 16 sub-scales of the block at blk (byte 2b + h), −32..31: gb_scale_q3k four bytes at a
 * time, in registers — dword j = (u[j % 2] >> 4·(j / 2)) & 0x0f0f0f0f | ((u[2] >> 2j) & 0x03030303) << 4
 * of the scale words u[0..3) (built in an array and loaded as a vector, a store-forwarding stall
 * cost 1.0 of a one-token product's 2.6 ms: bench/RESULTS.md) */
INLINE __m128i gp_q3k_subs(const uint8_t *blk) {
    uint32_t u2;
    memcpy(&u2, blk + 104, 4);
    const __m128i u01 = _mm_shuffle_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(blk + 96)), 0x44); /* u0 u1 u0 u1 */
    const __m128i lo = _mm_and_si128(_mm_srlv_epi32(u01, _mm_setr_epi32(0, 0, 4, 4)), _mm_set1_epi8(15));
    const __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int)u2), _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
    return _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi32(hi, 4)), _mm_set1_epi8(32));
}

/* gp_off's 16 "mins" of a Q6_K step, 32·sub-scale, as int16 (|32·sub| ≤ 4096), from its 16
 * sub-scale bytes sc (2b + h; gp_decode's) */
INLINE __m256i gp_off_mins(const __m128i sc) { return _mm256_slli_epi16(_mm256_cvtepi8_epi16(sc), 5); }

/* Step k of a row in the pair layout: w[8] (signed q, or 0..31 for Q4_K / Q5_K, 0..3 for Q2_K,
 * q + gp_off for Q6_K),
 * σ in lane order, μ in plain order (Q4_K, Q5_K; for Q2_K ν = −dmin in every lane; else
 * untouched), and for Q6_K, Q3_K, Q2_K the sub-scales as int16 registers matching w (gp_subs) and
 * their 16 bytes (2b + h) in *scb.
 * The values are gb_qx_decode's. */
INLINE void gp_decode(const uint8_t fmt, const uint8_t *row, uint32_t k, __m256i w[8], __m256 *sigl, __m256 *mu,
                      __m256i sub[8], __m128i *scb) {
    const __m256i m15 = _mm256_set1_epi8(15), lane_of = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    __m256 sgv = _mm256_setzero_ps(); /* σ in plain order */
    switch (fmt) {
    case SMOE_FMT_GGML_Q8_0: {
        const uint8_t *b0 = row + 34 * (size_t)(8 * k);
        for (int p = 0; p < 4; p++) {
            const uint8_t *a = b0 + 34 * 2 * p, *b = a + 34;
            w[2 * p] = gp_lu2(b + 2, a + 2);
            w[2 * p + 1] = gp_lu2(b + 18, a + 18);
        }
        sgv = gp_f16x8(b0, 34);
        break;
    }
    case SMOE_FMT_GGML_Q4_0:
    case SMOE_FMT_GGML_IQ4_NL:
    case SMOE_FMT_GGML_MXFP4: {
        const bool mx = fmt == SMOE_FMT_GGML_MXFP4;
        const uint32_t ts = mx ? 17 : 18, o = mx ? 1 : 2;
        const __m256i table = _mm256_broadcastsi128_si256(
            _mm_loadu_si128((const __m128i *)(const void *)(mx ? gb_kvalues_mxfp4 : gb_kvalues_iq4nl)));
        const uint8_t *b0 = row + ts * (size_t)(8 * k);
        for (int p = 0; p < 4; p++) {
            const __m256i v = gp_lu2(b0 + ts * (2 * p + 1) + o, b0 + ts * 2 * p + o);
            const __m256i lo = _mm256_and_si256(v, m15), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);
            if (fmt == SMOE_FMT_GGML_Q4_0) {
                w[2 * p] = _mm256_sub_epi8(lo, _mm256_set1_epi8(8));
                w[2 * p + 1] = _mm256_sub_epi8(hi, _mm256_set1_epi8(8));
            } else {
                w[2 * p] = _mm256_shuffle_epi8(table, lo);
                w[2 * p + 1] = _mm256_shuffle_epi8(table, hi);
            }
        }
        if (mx) { /* 2^(e − 128): (e − 1) << 23, or 2^21 << e for e < 2 (subnormal) */
            uint64_t eb = 0;
            for (int i = 0; i < 8; i++) eb |= (uint64_t)b0[ts * i] << (8 * i);
            const __m256i e = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)eb));
            const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
            const __m256i sub2 = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
            sgv = _mm256_castsi256_ps(_mm256_blendv_epi8(normal, sub2, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
        } else {
            sgv = gp_f16x8(b0, ts);
        }
        break;
    }
    case SMOE_FMT_GGML_Q5_0: {
        const uint8_t *b0 = row + 22 * (size_t)(8 * k);
        const __m256i bit = _mm256_set1_epi64x(0x8040201008040201ll), sixteen = _mm256_set1_epi8(16);
        const __m256i spread0 = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0,
                                                 1, 1, 1, 1, 1, 1, 1, 1);
        const __m256i spread1 = _mm256_add_epi8(spread0, _mm256_set1_epi8(2));
        for (int p = 0; p < 4; p++) {
            const uint8_t *a = b0 + 22 * 2 * p, *b = a + 22;
            uint32_t ha, hb;
            memcpy(&ha, a + 2, 4);
            memcpy(&hb, b + 2, 4);
            const __m256i h = _mm256_set_m128i(_mm_set1_epi32((int)hb), _mm_set1_epi32((int)ha));
            const __m256i v = gp_lu2(b + 6, a + 6);
            const __m256i h0 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(h, spread0), bit), bit), sixteen);
            const __m256i h1 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(h, spread1), bit), bit), sixteen);
            w[2 * p] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(v, m15), h0), sixteen);
            w[2 * p + 1] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m15), h1), sixteen);
        }
        sgv = gp_f16x8(b0, 22);
        break;
    }
    case SMOE_FMT_GGML_Q4_1:
    case SMOE_FMT_GGML_Q5_1: { /* d, m, (qh,) qs: q = nibble (| fifth bit << 4), σ = d, μ = m */
        const bool q5 = fmt == SMOE_FMT_GGML_Q5_1;
        const uint32_t ts = q5 ? 24 : 20, o = q5 ? 8 : 4;
        const uint8_t *b0 = row + ts * (size_t)(8 * k);
        const __m256i bit = _mm256_set1_epi64x(0x8040201008040201ll), sixteen = _mm256_set1_epi8(16);
        const __m256i spread0 = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0,
                                                 1, 1, 1, 1, 1, 1, 1, 1);
        const __m256i spread1 = _mm256_add_epi8(spread0, _mm256_set1_epi8(2));
        for (int p = 0; p < 4; p++) {
            const uint8_t *a = b0 + ts * 2 * p, *b = a + ts;
            const __m256i v = gp_lu2(b + o, a + o);
            w[2 * p] = _mm256_and_si256(v, m15);
            w[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);
            if (q5) {
                uint32_t ha, hb;
                memcpy(&ha, a + 4, 4);
                memcpy(&hb, b + 4, 4);
                const __m256i h = _mm256_set_m128i(_mm_set1_epi32((int)hb), _mm_set1_epi32((int)ha));
                w[2 * p] = _mm256_or_si256(w[2 * p], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(h, spread0), bit), bit), sixteen));
                w[2 * p + 1] = _mm256_or_si256(w[2 * p + 1], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(h, spread1), bit), bit), sixteen));
            }
        }
        sgv = gp_f16x8(b0, ts);
        *mu = gp_f16x8(b0 + 2, ts);
        break;
    }
    case SMOE_FMT_GGML_IQ4_XS: {
        const uint8_t *blk = row + 136 * (size_t)k;
        const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)gb_kvalues_iq4nl));
        for (int p = 0; p < 4; p++) { /* blocks 2p, 2p + 1: 32 bytes in a row */
            const __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(blk + 8 + 32 * p));
            w[2 * p] = _mm256_shuffle_epi8(table, _mm256_and_si256(v, m15));
            w[2 * p + 1] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), m15));
        }
        uint32_t lo4;
        memcpy(&lo4, blk + 4, 4);
        const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)lo4), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                            _mm256_set1_epi32(15));
        const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)g_u16(blk + 2)), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                            _mm256_set1_epi32(3));
        const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
        sgv = _mm256_mul_ps(gp_f16_all(blk), _mm256_cvtepi32_ps(ls));
        break;
    }
    case SMOE_FMT_GGML_Q4_K:
    case SMOE_FMT_GGML_Q5_K: {
        const bool q5 = fmt == SMOE_FMT_GGML_Q5_K;
        const uint8_t *blk = row + (q5 ? 176 : 144) * (size_t)k, *qs = blk + (q5 ? 48 : 16);
        const __m256i sh = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4), one = _mm256_set1_epi8(1);
        for (int p = 0; p < 4; p++) { /* 32 bytes: low nibbles = block 2p, high = block 2p + 1 */
            w[2 * p] = _mm256_and_si256(_mm256_srlv_epi32(gp_bc(qs + 32 * p), sh), m15);
            w[2 * p + 1] = _mm256_and_si256(_mm256_srlv_epi32(gp_bc(qs + 32 * p + 16), sh), m15);
            if (q5) { /* bit 2p (2p + 1) of qh[c]: block 2p's (2p + 1's) fifth bit of column c */
                const __m256i hs = _mm256_setr_epi32(2 * p, 2 * p, 2 * p, 2 * p, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1);
                const __m256i h0 = _mm256_and_si256(_mm256_srlv_epi32(gp_bc(blk + 16), hs), one);
                const __m256i h1 = _mm256_and_si256(_mm256_srlv_epi32(gp_bc(blk + 32), hs), one);
                w[2 * p] = _mm256_or_si256(w[2 * p], _mm256_slli_epi16(h0, 4));
                w[2 * p + 1] = _mm256_or_si256(w[2 * p + 1], _mm256_slli_epi16(h1, 4));
            }
        }
        uint32_t u[3], sc[2], mm[2]; /* gb_scale_min_k4 on four bytes at a time */
        memcpy(u, blk + 4, 12);
        sc[0] = u[0] & 0x3f3f3f3fu;
        mm[0] = u[1] & 0x3f3f3f3fu;
        sc[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
        mm[1] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
        uint32_t ddm;
        memcpy(&ddm, blk, 4);
        const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128((int)ddm)); /* d, dmin */
        const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)((uint64_t)sc[1] << 32 | sc[0]))));
        const __m256 mf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)((uint64_t)mm[1] << 32 | mm[0]))));
        sgv = _mm256_mul_ps(_mm256_broadcastss_ps(dd), scf);
        *mu = _mm256_xor_ps(_mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dd)), mf), _mm256_set1_ps(-0.0f));
        break;
    }
    case SMOE_FMT_GGML_Q6_K: {
        const uint8_t *blk = row + 210 * (size_t)k;
        const __m256i m3 = _mm256_set1_epi8(3);
        const __m256i scv = gp_bc(blk + 192); /* the 16 int8 sub-scales in both halves */
        *scb = _mm256_castsi256_si128(scv);
        for (int p = 0; p < 4; p++) { /* blocks 4h + j, 4h + j + 1 of half h = p / 2, j = 2·(p % 2) */
            const int h = p / 2, j = 2 * (p % 2);
            const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
            const __m256i hs = _mm256_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 2, 2 * j + 2, 2 * j + 2, 2 * j + 2);
            for (int c = 0; c < 2; c++) { /* columns 16c..16c + 16 of both blocks */
                __m256i lo = gp_lu2(ql + 32 + 16 * c, ql + 16 * c);
                if (p % 2) lo = _mm256_srli_epi16(lo, 4);
                const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(gp_bc(qh + 16 * c), hs), m3);
                w[2 * p + c] = _mm256_or_si256(_mm256_and_si256(lo, m15), _mm256_slli_epi16(hi, 4)); /* q + 32 (gp_off) */
                /* sub-scales 2b + c of blocks b = 2p, 2p + 1 (bytes 4p + c, 4p + 2 + c), sign-extended
                   from the high byte of each int16 lane */
                const __m256i ctl = _mm256_setr_epi8(
                    -128, 4 * p + c, -128, 4 * p + c, -128, 4 * p + c, -128, 4 * p + c, -128, 4 * p + c, -128, 4 * p + c, -128,
                    4 * p + c, -128, 4 * p + c, -128, 4 * p + 2 + c, -128, 4 * p + 2 + c, -128, 4 * p + 2 + c, -128,
                    4 * p + 2 + c, -128, 4 * p + 2 + c, -128, 4 * p + 2 + c, -128, 4 * p + 2 + c, -128, 4 * p + 2 + c);
                sub[2 * p + c] = _mm256_srai_epi16(_mm256_shuffle_epi8(scv, ctl), 8);
            }
        }
        sgv = gp_f16_all(blk + 208);
        break;
    }
    case SMOE_FMT_GGML_Q2_K: { /* scales[16] (sub: low nibbles, mins: high), qs[64], d, dmin */
        const uint8_t *blk = row + 84 * (size_t)k;
        const __m256i m3 = _mm256_set1_epi8(3);
        for (int p = 0; p < 4; p++) { /* blocks 2p, 2p + 1: 2-bit fields 2·(2p % 4), + 2 of qs half p / 2 */
            const int sh = 4 * (p % 2);
            const __m256i hs = _mm256_setr_epi32(sh, sh, sh, sh, sh + 2, sh + 2, sh + 2, sh + 2);
            for (int c = 0; c < 2; c++)
                w[2 * p + c] = _mm256_and_si256(_mm256_srlv_epi32(gp_bc(blk + 16 + 32 * (p / 2) + 16 * c), hs), m3);
        }
        *scb = gp_q2k_subs(blk);
        gp_subs(*scb, sub);
        sgv = gp_f16_all(blk + 80);
        *mu = _mm256_xor_ps(gp_f16_all(blk + 82), _mm256_set1_ps(-0.0f));
        break;
    }
    case SMOE_FMT_GGML_Q3_K: { /* hmask[32], qs[64], scales[12], d */
        const uint8_t *blk = row + 110 * (size_t)k;
        const __m256i m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1), four = _mm256_set1_epi8(4);
        for (int p = 0; p < 4; p++) {
            const int sh = 4 * (p % 2);
            const __m256i hs = _mm256_setr_epi32(sh, sh, sh, sh, sh + 2, sh + 2, sh + 2, sh + 2);
            const __m256i ms = _mm256_setr_epi32(2 * p, 2 * p, 2 * p, 2 * p, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1);
            for (int c = 0; c < 2; c++) { /* q = (low 2 bits | mask bit << 2) − 4 */
                const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(gp_bc(blk + 32 + 32 * (p / 2) + 16 * c), hs), m3);
                const __m256i hb = _mm256_and_si256(_mm256_srlv_epi32(gp_bc(blk + 16 * c), ms), one);
                w[2 * p + c] = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hb, 2)), four);
            }
        }
        *scb = gp_q3k_subs(blk);
        gp_subs(*scb, sub);
        sgv = gp_f16_all(blk + 108);
        break;
    }
    default:
        if (gb_is_iq(fmt)) { /* the plain parts, paired: [2p cols 0–15 | 2p + 1 cols 0–15], then 16–31 */
            uint32_t bs, ts;
            smoe_ggml_block(fmt, &bs, &ts);
            __m256i q[8];
            __m128i sv;
            sgv = g_iq_decode8(fmt, row + (size_t)ts * k, q, &sv);
            for (int p = 0; p < 4; p++) {
                w[2 * p] = _mm256_permute2x128_si256(q[2 * p], q[2 * p + 1], 0x20);
                w[2 * p + 1] = _mm256_permute2x128_si256(q[2 * p], q[2 * p + 1], 0x31);
            }
            if (gb_has_sub(fmt)) gp_subs(sv, sub);
        }
        break; /* another: not taken (gp_takes_qx) */
    }
    *sigl = _mm256_permutevar8x32_ps(sgv, lane_of);
}

/* Step k of a row, for every format of the 8-bit fast path (gp_takes_qx), with q in plain block
 * order (32 int8 a block; the AVX512-VNNI product's transposed layout and the f32 dequantisation
 * start from it), σ in the reference's lane order, μ in plain order (Q4_K, Q5_K, Q4_1, Q5_1; Q2_K's
 * ν = −dmin), and for the formats with sub-scales their 16 bytes (2b + h: block b's half h). The same values as the AVX2
 * decoders': g_decode8 where it has a vector decoder, g_iq_decode8, and for Q2_K, Q3_K, Q4_1, Q5_1
 * gp_decode's pair layout undone (block 2p = the low halves of the pair's two registers). */
INLINE void g_decode8_plain(const uint8_t fmt, const uint8_t *row, size_t step_bytes, uint32_t k, __m256i q[8],
                            __m256 *sigl, __m256 *mu, __m128i *sc) {
    const uint8_t *blk = row + step_bytes * k;
    if (gb_is_iq(fmt)) {
        *sigl = _mm256_permutevar8x32_ps(g_iq_decode8(fmt, blk, q, sc), _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
    } else if (fmt == SMOE_FMT_GGML_Q2_K || fmt == SMOE_FMT_GGML_Q3_K || fmt == SMOE_FMT_GGML_Q4_1 ||
               fmt == SMOE_FMT_GGML_Q5_1) {
        __m256i w[8], sub[8];
        gp_decode(fmt, row, k, w, sigl, mu, sub, sc);
        for (int p = 0; p < 4; p++) {
            q[2 * p] = _mm256_permute2x128_si256(w[2 * p], w[2 * p + 1], 0x20);
            q[2 * p + 1] = _mm256_permute2x128_si256(w[2 * p], w[2 * p + 1], 0x31);
        }
    } else {
        __m256i sub[8];
        g_decode8(fmt, row, k, q, sigl, mu, sub);
        if (fmt == SMOE_FMT_GGML_Q6_K) *sc = _mm_loadu_si128((const __m128i *)(const void *)(blk + 192));
    }
}

/* ------------------------------------------------------------- dequantisation (f32 activations)
 *
 * 256 columns (step k) of a row as gb_dequant_block writes them, on vectors: the integers q from
 * g_decode8_plain (plain block order), each 8 columns' scale s and additive term a from the scalar
 * code of the reference (the same gb_f16 and the same products), then per weight the reference's
 * operations without contraction, so the same floats:
 *   w = s·(float)q                       Q8_0, Q4_0, Q5_0, IQ4_NL, IQ4_XS, MXFP4, Q6_K, Q3_K, IQ2/IQ3
 *   w = (s·(float)q) + a                 Q4_K, Q5_K, Q2_K (a = −dmin·m: x − y is x + (−y)), Q4_1, Q5_1 (a = m)
 *   w = s·((float)q·⅛)                   IQ1_S, IQ1_M (q = 8·g ± 1: g ± ⅛ exactly)
 * The codebook formats' q are ±g, and s·(−g) = −(s·g), the reference's negation; their s is
 * gguf-py's db from 2·ls + 1 (g_iq_decode8's sub-scale bytes): d·(0.5 + ls) = d·((2·ls + 1)·½).
 * With x, one token's 256 activations, the weights are not stored but multiplied into acc (the
 * order of f_block for one row and one token). */
INLINE void g_dequant_step_fma(const uint8_t fmt, const uint8_t *row, uint32_t k, float *out, const float *x, __m256 *acc) {
    uint32_t bs = 32, ts = 0;
    smoe_ggml_block(fmt, &bs, &ts);
    const size_t step_bytes = (size_t)(256 / bs) * ts;
    const uint8_t *blk = row + step_bytes * k; /* the step's first block */
    __m256i q[8];
    __m256 sigl, mu;
    __m128i scv = _mm_setzero_si128();
    g_decode8_plain(fmt, row, step_bytes, k, q, &sigl, &mu, &scv);
    const bool iq = gb_is_iq(fmt), iq1 = iq && gb_iq1(fmt);
    const bool add = gb_has_min(fmt) || fmt == SMOE_FMT_GGML_Q2_K;
    float d0 = 0.0f, dmin = 0.0f;
    switch (fmt) {
    case SMOE_FMT_GGML_Q4_K:
    case SMOE_FMT_GGML_Q5_K: d0 = gb_f16(blk), dmin = gb_f16(blk + 2); break;
    case SMOE_FMT_GGML_Q6_K: d0 = gb_f16(blk + 208); break;
    case SMOE_FMT_GGML_Q2_K: d0 = gb_f16(blk + 80), dmin = gb_f16(blk + 82); break;
    case SMOE_FMT_GGML_Q3_K: d0 = gb_f16(blk + 108); break;
    case SMOE_FMT_GGML_IQ4_XS: d0 = gb_f16(blk); break;
    default:
        if (iq) {
            uint8_t dbits[2];
            const uint16_t dh = fmt == SMOE_FMT_GGML_IQ1_M ? smoe_ggml_iq1m_d(blk) : (uint16_t)gb_u16(blk);
            memcpy(dbits, &dh, 2);
            d0 = gb_f16(dbits);
        }
        break;
    }
    uint8_t sb[16] = {0}; /* the sub-scale bytes, 2i + h (Q6_K, Q3_K: int8; Q2_K: two nibbles; IQ: 2·ls + 1) */
    if (gb_has_sub(fmt) || iq) _mm_storeu_si128((__m128i *)(void *)sb, scv);
    for (int i = 0; i < 8; i++) {
        _Alignas(32) int8_t qb[32];
        _mm256_store_si256((__m256i *)(void *)qb, q[i]);
        float s[4], a[4] = {0.0f, 0.0f, 0.0f, 0.0f}; /* the scale and additive term of each 8 columns */
        for (int c = 0; c < 4; c += 2) {
            if (c && !gb_has_sub(fmt)) { /* one scale for the block's 32 columns */
                s[2] = s[0], a[2] = a[0];
                break;
            }
            const int h = 2 * i + c / 2; /* these 16 columns' index among the step's halves */
            switch (fmt) {
            case SMOE_FMT_GGML_Q4_K:
            case SMOE_FMT_GGML_Q5_K: {
                uint8_t sc, m;
                gb_scale_min_k4(blk + 4, i, &sc, &m);
                s[c] = d0 * (float)sc;
                a[c] = -(dmin * (float)m);
                break;
            }
            case SMOE_FMT_GGML_Q6_K:
            case SMOE_FMT_GGML_Q3_K: s[c] = d0 * (float)(int8_t)sb[h]; break;
            case SMOE_FMT_GGML_Q2_K:
                s[c] = d0 * (float)(sb[h] & 15);
                a[c] = -(dmin * (float)(blk[h] >> 4));
                break;
            case SMOE_FMT_GGML_Q4_1:
            case SMOE_FMT_GGML_Q5_1:
                s[c] = gb_f16(blk + ts * i);
                a[c] = gb_f16(blk + ts * i + 2);
                break;
            case SMOE_FMT_GGML_IQ4_XS: s[c] = d0 * (float)gb_scale_iq4xs(blk, i); break;
            case SMOE_FMT_GGML_MXFP4: s[c] = gb_e8m0_half(blk[ts * i]); break;
            case SMOE_FMT_GGML_Q8_0:
            case SMOE_FMT_GGML_Q4_0:
            case SMOE_FMT_GGML_Q5_0:
            case SMOE_FMT_GGML_IQ4_NL: s[c] = gb_f16(blk + ts * i); break;
            default: { /* the codebook formats: 2·ls + 1 of the half */
                const float b = (float)sb[h];
                if (iq1 || fmt == SMOE_FMT_GGML_IQ3_S) /* d·(2·ls + 1) */
                    s[c] = d0 * b;
                else /* (d·(0.5 + ls))·¼, IQ3_XXS ·½ */
                    s[c] = (d0 * (b * 0.5f)) * (fmt == SMOE_FMT_GGML_IQ3_XXS ? 0.5f : 0.25f);
                break;
            }
            }
        }
        s[1] = s[0], a[1] = a[0], s[3] = s[2], a[3] = a[2];
        for (int c = 0; c < 4; c++) {
            __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(qb + 8 * c))));
            if (iq1) qf = _mm256_mul_ps(qf, _mm256_set1_ps(0.125f));
            __m256 v = _mm256_mul_ps(_mm256_set1_ps(s[c]), qf);
            if (add) v = _mm256_add_ps(v, _mm256_set1_ps(a[c]));
            if (x) /* one token (f_rows_1's order: acc = fma(w, x, acc) in column order) */
                *acc = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + 32 * i + 8 * c), *acc);
            else
                _mm256_storeu_ps(out + 32 * i + 8 * c, v);
        }
    }
}

INLINE void g_dequant_step(const uint8_t fmt, const uint8_t *row, uint32_t k, float *out) {
    g_dequant_step_fma(fmt, row, k, out, NULL, NULL);
}
