/* kernels_avx2_ggml_qx.h — the GGML formats' 8-bit-activation product (kernels_avx2_ggml.h says
 * how), included twice by kernels_avx2.c: plain AVX2 (GQ_VNNI 0: vpmaddubsw + vpmaddwd) and
 * AVX-VNNI (GQ_VNNI 1: one vpdpbusd per block where the format has no sub-scales), chosen at run
 * time as the q4/q8 kernels are (smoe_avx2_qx_vnni). The same integers, so the same bits.
 * Before including: GQ(name), GQ_ATTR, GQ_VNNI. No include guard, on purpose. */

/* The 8-bit-activation product of one format (a constant after inlining): rows one at a time;
 * per step k of 256 columns, the row's 8 blocks decoded once (g_decode8) and multiplied by every
 * token's codes, each (row, token) with its own tot and bia, kept in tile arrays between steps. */
GQ_ATTR INLINE void GQ(g_qx_rows)(const uint8_t fmt, const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y,
                      size_t ldy, uint32_t r0, uint32_t r1) {
    const uint32_t cols = W->cols, nb = cols / 32, steps = (nb + 7) / 8;
    uint32_t bs = 32, ts = 0;
    smoe_ggml_block(fmt, &bs, &ts);
    const smoe_qx_size z = smoe_qx_sizes(cols, fmt, 32);
    const bool q2k = fmt == SMOE_FMT_GGML_Q2_K; /* its mins per 16 columns: a second integer sum, M */
    const bool has_min = gb_has_min(fmt), has_sub = gb_has_sub(fmt);
    const bool unsigned_q = has_min || q2k; /* Q4_1, Q5_1, Q4_K, Q5_K, Q2_K: 0..31, a valid u8 operand as they are */
    const __m256i ones8 = _mm256_set1_epi8(1);
    const size_t row_bytes = (size_t)(cols / bs) * ts;
#if !GQ_VNNI
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    __m256 tot[TT], bia[TT];
    _Alignas(32) uint8_t xr[GP_XBYTES]; /* a tile's codes in pair order */
    const uint32_t tt = cols <= MAXC && GP_XBYTES / cols < TT ? GP_XBYTES / cols : TT;
    const bool relaid = cols <= MAXC;
    for (uint32_t t0 = 0; t0 < n; t0 += tt) {
        const uint32_t nt = n - t0 < tt ? n - t0 : tt;
        if (relaid)
            for (uint32_t t = 0; t < nt; t++) gp_relay((const uint8_t *)X->codes + (size_t)(t0 + t) * z.code_bytes, cols, xr + (size_t)t * cols);
        for (uint32_t r = r0; r < r1; r++) {
            const uint8_t *row = w + (size_t)r * row_bytes;
            if (r + QX_BATCH_AHEAD < r1) /* rows on, while this one computes (bench/RESULTS.md) */
                for (size_t b = 0; b < row_bytes; b += 64)
                    _mm_prefetch((const char *)row + QX_BATCH_AHEAD * row_bytes + b, _MM_HINT_T0);
            for (uint32_t t = 0; t < nt; t++) tot[t] = bia[t] = _mm256_setzero_ps();
            for (uint32_t k = 0; k < steps; k++) {
                __m256i q[8], qa[8], sub[8];
                __m256 sigl, mu;
                const uint32_t valid = nb - 8 * k < 8 ? nb - 8 * k : 8; /* the last step of a 32-block row may be short */
                if (valid == 8) {
                    g_decode8(fmt, row, k, q, &sigl, &mu, sub);
                } else { /* blocks past the row: zero (the reference's empty blocks) */
                    int8_t qb[8 * 32] = {0};
                    int16_t sb[16] = {0};
                    float sg[8] = {0}, m[8] = {0};
                    gb_qx_decode(fmt, row, 8 * k, valid, qb, sb, sg, m);
                    for (int i = 0; i < 8; i++) {
                        q[i] = _mm256_loadu_si256((const __m256i *)(const void *)(qb + 32 * i));
                        sub[i] = _mm256_set_m128i(_mm_set1_epi16(sb[2 * i + 1]), _mm_set1_epi16(sb[2 * i]));
                    }
                    sigl = _mm256_permutevar8x32_ps(_mm256_loadu_ps(sg), _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
                    mu = _mm256_loadu_ps(m);
                }
                for (int i = 0; i < 8; i++) qa[i] = unsigned_q ? q[i] : _mm256_sign_epi8(q[i], q[i]);
                __m256i msub[8];
                __m256 nul = _mm256_setzero_ps();
                if (q2k) {
                    float nu[8];
                    for (int i = 0; i < 8; i++) {
                        int16_t mm[2];
                        nu[i] = gb_q2k_mins(row, 8 * k + (uint32_t)i, mm);
                        msub[i] = _mm256_set_m128i(_mm_set1_epi16(mm[1]), _mm_set1_epi16(mm[0]));
                    }
                    nul = _mm256_permutevar8x32_ps(_mm256_loadu_ps(nu), _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
                }
                for (uint32_t t = 0; t < nt; t++) {
                    const int8_t *ct = (const int8_t *)X->codes + (size_t)(t0 + t) * z.code_bytes + 256 * (size_t)k;
                    const float *dt = X->d + (size_t)(t0 + t) * z.d_floats + 8 * k;
                    __m256i p[8], p2[8];
                    for (int j = 0; j < 8; j++) {
                        const int b = 2 * (j % 4) + j / 4;
                        const __m256i cv = _mm256_loadu_si256((const __m256i *)(const void *)(ct + 32 * b));
                        const __m256i s8 = unsigned_q ? cv : _mm256_sign_epi8(cv, q[b]);
                        const __m256i pr = GQ_VNNI && !has_sub ? _mm256_setzero_si256() : _mm256_maddubs_epi16(qa[b], s8);
#if GQ_VNNI
                        p[j] = has_sub ? _mm256_madd_epi16(pr, sub[b]) : _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), qa[b], s8);
#else
                        p[j] = _mm256_madd_epi16(pr, has_sub ? sub[b] : ones);
#endif
                        if (q2k) p2[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, cv), msub[b]);
                    }
                    const __m256 I = _mm256_cvtepi32_ps(g_reduce8(p));
                    tot[t] = _mm256_fmadd_ps(I, _mm256_mul_ps(sigl, _mm256_loadu_ps(dt)), tot[t]);
                    if (has_min)
                        bia[t] = _mm256_fmadd_ps(mu, _mm256_loadu_ps(X->gsum + (size_t)(t0 + t) * z.gsum_floats + 8 * k),
                                                 bia[t]);
                    if (q2k)
                        bia[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(g_reduce8(p2)), _mm256_mul_ps(nul, _mm256_loadu_ps(dt)),
                                                 bia[t]);
                }
            }
            for (uint32_t t = 0; t < nt; t++)
                y[(size_t)(t0 + t) * ldy + r] = has_min || q2k ? hsum8(tot[t]) + hsum8(bia[t]) : hsum8(tot[t]);
        }
    }
}

/* One pair's product (kernels_avx2_ggml.h, "the pair layout"): 8 int32 lanes, the low 4 summing
 * block 2p's products, the high 4 block 2p + 1's. w: the pair's q; a: |q| (signed formats); s:
 * the sub-scales (Q6_K, Q3_K, Q2_K); x: the token's codes in pair order. */
GQ_ATTR INLINE __m256i GQ(gp_pair)(const uint8_t fmt, const __m256i w0, const __m256i w1, const __m256i a0, const __m256i a1,
                                   const __m256i s0, const __m256i s1, __m256i x0, __m256i x1) {
    const bool uns = gp_pair_unsigned(fmt), q6 = gp_has_sub(fmt);
    const __m256i u0 = uns ? w0 : a0, u1 = uns ? w1 : a1;
    if (!uns) {
        x0 = _mm256_sign_epi8(x0, w0);
        x1 = _mm256_sign_epi8(x1, w1);
    }
#if GQ_VNNI
    if (q6) return _mm256_dpwssd_avx_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u0, x0), s0), _mm256_maddubs_epi16(u1, x1), s1);
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u0, x0), u1, x1);
#else
    const __m256i ones = _mm256_set1_epi16(1), m0 = _mm256_maddubs_epi16(u0, x0), m1 = _mm256_maddubs_epi16(u1, x1);
    if (q6) return _mm256_add_epi32(_mm256_madd_epi16(m0, s0), _mm256_madd_epi16(m1, s1));
    if (gp_big(fmt)) return _mm256_add_epi32(_mm256_madd_epi16(m0, ones), _mm256_madd_epi16(m1, ones));
    return _mm256_madd_epi16(_mm256_add_epi16(m0, m1), ones); /* |q| ≤ 32: 4 products ≤ 16256 */
#endif
}

/* The 8 block sums of a step (lane order) from its decoded row and a token's codes x (pair
 * order: relaid, or read with gp_codes from column order at step k). */
GQ_ATTR INLINE __m256i GQ(gp_step)(const uint8_t fmt, const __m256i w[8], const __m256i a[8], const __m256i s[8],
                                   const uint8_t *x, bool relaid, uint32_t k) {
    __m256i p[4];
    for (int i = 0; i < 4; i++) {
        __m256i x0, x1;
        if (relaid) {
            x0 = _mm256_loadu_si256((const __m256i *)(const void *)(x + 64 * i));
            x1 = _mm256_loadu_si256((const __m256i *)(const void *)(x + 64 * i + 32));
        } else {
            gp_codes(x, k, i, &x0, &x1);
        }
        p[i] = GQ(gp_pair)(fmt, w[2 * i], w[2 * i + 1], a[2 * i], a[2 * i + 1], s[2 * i], s[2 * i + 1], x0, x1);
    }
    return _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
}

/* gp_step for two tokens' re-laid codes x, x2 at once (each decoded register read once) */
GQ_ATTR INLINE void GQ(gp_step2)(const uint8_t fmt, const __m256i w[8], const __m256i a[8], const __m256i s[8],
                                 const uint8_t *x, const uint8_t *x2, __m256i *h, __m256i *h2) {
    __m256i p[4], p2[4];
    for (int i = 0; i < 4; i++) {
#define GP_LD(b) _mm256_loadu_si256((const __m256i *)(const void *)(b))
        p[i] = GQ(gp_pair)(fmt, w[2 * i], w[2 * i + 1], a[2 * i], a[2 * i + 1], s[2 * i], s[2 * i + 1], GP_LD(x + 64 * i),
                           GP_LD(x + 64 * i + 32));
        p2[i] = GQ(gp_pair)(fmt, w[2 * i], w[2 * i + 1], a[2 * i], a[2 * i + 1], s[2 * i], s[2 * i + 1], GP_LD(x2 + 64 * i),
                            GP_LD(x2 + 64 * i + 32));
#undef GP_LD
    }
    *h = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    *h2 = _mm256_hadd_epi32(_mm256_hadd_epi32(p2[0], p2[1]), _mm256_hadd_epi32(p2[2], p2[3]));
}

/* The fast path's product (gp_takes_qx formats, cols a multiple of 256): the reference's float
 * operations exactly as g_qx_rows. One token (and cols ≤ MAXC): x re-laid once into pair order
 * on the stack, rows one at a time, the weights GQ_AHEAD_BYTES further prefetched into L2 as they
 * stream past (kernels_avx2.c says why); more: rows one at a time, each step
 * decoded once for a tile of TT tokens, whose codes are read in place (gp_codes). */
GQ_ATTR INLINE void GQ(gp_rows)(const uint8_t fmt, const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y,
                                size_t ldy, uint32_t r0, uint32_t r1) {
    const uint32_t cols = W->cols, steps = cols / 256;
    uint32_t bs = 32, ts = 0;
    smoe_ggml_block(fmt, &bs, &ts);
    const smoe_qx_size z = smoe_qx_sizes(cols, fmt, 32);
    const bool has_min = gb_has_min(fmt), uns = gp_pair_unsigned(fmt), q2k = fmt == SMOE_FMT_GGML_Q2_K;
    const bool off = gp_off(fmt) != 0, halves = q2k || off; /* the codes' 16-column sums wanted */
    const size_t step_bytes = (size_t)(256 / bs) * ts, row_bytes = steps * step_bytes;
    __m256i q[8], a[8], s[8], mq = _mm256_setzero_si256(); /* mq: Q2_K's mins */
    for (int i = 0; i < 8; i++) a[i] = s[i] = _mm256_setzero_si256();
    if (n == 1 && cols <= MAXC) {
        _Alignas(32) uint8_t xr[MAXC];
        int16_t hs[MAXC / 16]; /* Q2_K, gp_off: the half sums */
        gp_relay(X->codes, cols, xr);
        if (halves) gp_halfsums(X->codes, cols, hs);
        for (uint32_t r = r0; r < r1; r++) {
            const uint8_t *row = w + (size_t)r * row_bytes;
            __m256 tot = _mm256_setzero_ps(), bia = _mm256_setzero_ps();
            for (uint32_t k = 0; k < steps; k++) {
                for (size_t b = 0; b < step_bytes; b += 64) _mm_prefetch((const char *)row + GQ_AHEAD_BYTES + k * step_bytes + b, _MM_HINT_T1);
                __m256 sigl, mu = _mm256_setzero_ps();
                __m128i scb = _mm_setzero_si128(); /* the sub-scale bytes (gp_off's mins) */
                gp_decode(fmt, row, k, q, &sigl, &mu, s, &scb);
                if (!uns)
                    for (int i = 0; i < 8; i++) a[i] = _mm256_sign_epi8(q[i], q[i]);
                __m256i Ii = GQ(gp_step)(fmt, q, a, s, xr + 256 * (size_t)k, true, k);
                if (off) Ii = _mm256_sub_epi32(Ii, gp_msum(gp_off_mins(scb), hs + 16 * k));
                const __m256 I = _mm256_cvtepi32_ps(Ii);
                tot = _mm256_fmadd_ps(I, _mm256_mul_ps(sigl, _mm256_loadu_ps(X->d + 8 * k)), tot);
                if (has_min) bia = _mm256_fmadd_ps(mu, _mm256_loadu_ps(X->gsum + 8 * k), bia);
                if (q2k)
                    bia = _mm256_fmadd_ps(gp_q2k_msum(gp_q2k_mins(row, k), hs + 16 * k), _mm256_mul_ps(mu, _mm256_loadu_ps(X->d + 8 * k)),
                                          bia);
            }
            y[r] = has_min || q2k ? hsum8(tot) + hsum8(bia) : hsum8(tot);
        }
        return;
    }
    __m256 tot[TT], bia[TT];
    /* a tile's codes in pair order: twice the bytes for the codebook formats, whose decoding costs
       more than the codes' trip out of L1 (bench/RESULTS.md); the others use the first GP_XBYTES */
    _Alignas(32) uint8_t xr[2 * GP_XBYTES];
    int16_t hs[GP_XBYTES / 16]; /* Q2_K, gp_off: the half sums (relaid; else a step's, hs1) */
    const uint32_t xbytes = gb_is_iq(fmt) ? 2 * GP_XBYTES : GP_XBYTES;
    const uint32_t tt = cols <= MAXC && xbytes / cols < TT ? xbytes / cols : TT;
    const bool relaid = cols <= MAXC;
    for (uint32_t t0 = 0; t0 < n; t0 += tt) {
        const uint32_t nt = n - t0 < tt ? n - t0 : tt;
        if (relaid)
            for (uint32_t t = 0; t < nt; t++) {
                const uint8_t *xt = (const uint8_t *)X->codes + (size_t)(t0 + t) * z.code_bytes;
                gp_relay(xt, cols, xr + (size_t)t * cols);
                if (halves) gp_halfsums(xt, cols, hs + (size_t)t * (cols / 16));
            }
        for (uint32_t r = r0; r < r1; r++) {
            const uint8_t *row = w + (size_t)r * row_bytes;
            if (r + QX_BATCH_AHEAD < r1) /* rows on, while this one computes (bench/RESULTS.md) */
                for (size_t b = 0; b < row_bytes; b += 64)
                    _mm_prefetch((const char *)row + QX_BATCH_AHEAD * row_bytes + b, _MM_HINT_T0);
            for (uint32_t t = 0; t < nt; t++) tot[t] = bia[t] = _mm256_setzero_ps();
            for (uint32_t k = 0; k < steps; k++) {
                __m256 sigl, mu = _mm256_setzero_ps();
                __m128i scb = _mm_setzero_si128();
                gp_decode(fmt, row, k, q, &sigl, &mu, s, &scb);
                if (!uns)
                    for (int i = 0; i < 8; i++) a[i] = _mm256_sign_epi8(q[i], q[i]);
                if (q2k) mq = gp_q2k_mins(row, k);
                if (off) mq = gp_off_mins(scb);
                uint32_t t = 0;
                if (relaid)
                    for (; t + 2 <= nt; t += 2) {
                        const uint8_t *ct = xr + (size_t)t * cols + 256 * (size_t)k;
                        const float *dt = X->d + (size_t)(t0 + t) * z.d_floats + 8 * k;
                        __m256i h, h2;
                        GQ(gp_step2)(fmt, q, a, s, ct, ct + cols, &h, &h2);
                        if (off) {
                            const int16_t *hh = hs + (size_t)t * (cols / 16) + 16 * k;
                            h = _mm256_sub_epi32(h, gp_msum(mq, hh));
                            h2 = _mm256_sub_epi32(h2, gp_msum(mq, hh + cols / 16));
                        }
                        tot[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_mul_ps(sigl, _mm256_loadu_ps(dt)), tot[t]);
                        tot[t + 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h2), _mm256_mul_ps(sigl, _mm256_loadu_ps(dt + z.d_floats)),
                                                     tot[t + 1]);
                        if (has_min) {
                            const float *gt = X->gsum + (size_t)(t0 + t) * z.gsum_floats + 8 * k;
                            bia[t] = _mm256_fmadd_ps(mu, _mm256_loadu_ps(gt), bia[t]);
                            bia[t + 1] = _mm256_fmadd_ps(mu, _mm256_loadu_ps(gt + z.gsum_floats), bia[t + 1]);
                        }
                        if (q2k) {
                            const int16_t *h = hs + (size_t)t * (cols / 16) + 16 * k;
                            bia[t] = _mm256_fmadd_ps(gp_q2k_msum(mq, h), _mm256_mul_ps(mu, _mm256_loadu_ps(dt)), bia[t]);
                            bia[t + 1] = _mm256_fmadd_ps(gp_q2k_msum(mq, h + cols / 16), _mm256_mul_ps(mu, _mm256_loadu_ps(dt + z.d_floats)),
                                                         bia[t + 1]);
                        }
                    }
                for (; t < nt; t++) {
                    const uint8_t *ct = relaid ? xr + (size_t)t * cols + 256 * (size_t)k
                                               : (const uint8_t *)X->codes + (size_t)(t0 + t) * z.code_bytes;
                    const float *dt = X->d + (size_t)(t0 + t) * z.d_floats + 8 * k;
                    int16_t hs1[16]; /* the step's 16-column sums (Q2_K, gp_off) */
                    if (halves && !relaid) gp_halfsums(ct + 256 * (size_t)k, 256, hs1);
                    const int16_t *h = relaid ? hs + (size_t)t * (cols / 16) + 16 * k : hs1;
                    __m256i Ii = GQ(gp_step)(fmt, q, a, s, ct, relaid, k);
                    if (off) Ii = _mm256_sub_epi32(Ii, gp_msum(mq, h));
                    tot[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Ii), _mm256_mul_ps(sigl, _mm256_loadu_ps(dt)), tot[t]);
                    if (has_min)
                        bia[t] = _mm256_fmadd_ps(mu, _mm256_loadu_ps(X->gsum + (size_t)(t0 + t) * z.gsum_floats + 8 * k), bia[t]);
                    if (q2k) bia[t] = _mm256_fmadd_ps(gp_q2k_msum(mq, h), _mm256_mul_ps(mu, _mm256_loadu_ps(dt)), bia[t]);
                }
            }
            for (uint32_t t = 0; t < nt; t++)
                y[(size_t)(t0 + t) * ldy + r] = has_min || q2k ? hsum8(tot[t]) + hsum8(bia[t]) : hsum8(tot[t]);
        }
    }
}

GQ_ATTR static bool GQ(g_matmul_qx)(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y, size_t ldy,
                        uint32_t r0, uint32_t r1) {
    switch (W->format) {
#define G_CASE(f)                                                                                                      \
    case f:                                                                                                            \
        if (W->cols % 256 == 0)                                                                                        \
            GQ(gp_rows)(f, W, w, X, n, y, ldy, r0, r1);                                                                \
        else                                                                                                           \
            GQ(g_qx_rows)(f, W, w, X, n, y, ldy, r0, r1);                                                              \
        return true;
        GP_FORMATS(G_CASE)
#undef G_CASE
    }
    return false;
}
