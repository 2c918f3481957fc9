/* kernels_avx512_qx.h — the 8-bit-activation products of kernels_avx512.c, included there twice:
 * for AVX-512 F + BW (QX_VNNI 0) and for AVX512-VNNI (QX_VNNI 1), chosen at run time. They
 * differ only in how the exact integer sums are formed (vpmaddubsw + vpmaddwd, or vpdpbusd);
 * the integers are the same, so the results are the same bits.
 *
 * Before including: QX(name) (the instance's name for name), QX_ATTR (its target attribute),
 * QX_INLINE (static inline always_inline QX_ATTR), QX_VNNI. No include guard, on purpose. */

#if QX_VNNI
/* q4: Σ over 8 columns per int32 lane of the low nibbles lo·(even codes) and high nibbles hi·(odd codes) */
#define QX_Q4(lo, xe, hi, xo) _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xe), hi, xo)
/* q8: Σ over 4 columns per int32 lane of w·x */
#define QX_Q8(w, x) _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x)
#else
#define QX_Q4(lo, xe, hi, xo)                                                                                          \
    _mm512_madd_epi16(_mm512_add_epi16(_mm512_maddubs_epi16(lo, xe), _mm512_maddubs_epi16(hi, xo)),                    \
                      _mm512_set1_epi16(1))
/* the low and high nibbles apart (|15·127·2| fits int16; 255·127·2 would saturate), the high
 * ones' pair sums weighted 16 */
#define QX_Q8(w, x)                                                                                                    \
    _mm512_add_epi32(                                                                                                  \
        _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_and_si512(w, _mm512_set1_epi8(0x0f)), x), _mm512_set1_epi16(1)),  \
        _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(0x0f)), x),   \
                          _mm512_set1_epi16(16)))
#endif

/* T tokens × rows w0 and w1 (rb bytes each) over ngr groups of 4 units: tot[j] += the scaled
 * block sums of token j, both rows, in red4's lane order. sc[k]: σ of group k (sigma2); xs[j],
 * dc[j]: token j's re-laid codes and its d in red4's order, per group. */
QX_INLINE void QX(qx_block)(const int T, const bool q8, const uint8_t *w0, const uint8_t *w1, size_t rb,
                                 const __m512 *sc, const uint8_t *const *xs, const __m512 *const *dc, uint32_t ngr,
                                 __m512 *tot) {
    const __m512i m = _mm512_set1_epi8(0x0f);
    __m512 acc[TB];
    for (int j = 0; j < T; j++) acc[j] = _mm512_setzero_ps();
    for (uint32_t k = 0; k < ngr; k++) {
        __m512i a[4], b[4]; /* rows 0 and 1: q4 (lo, hi) of pairs 2k, 2k + 1; q8 units 4k .. 4k + 3 */
        if (!q8) {
            for (int p = 0; p < 2; p++) {
                const __m512i v0 = load_w(w0, 128 * (size_t)k + 64 * (size_t)p, rb);
                const __m512i v1 = load_w(w1, 128 * (size_t)k + 64 * (size_t)p, rb);
                a[2 * p] = _mm512_and_si512(v0, m);
                a[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(v0, 4), m);
                b[2 * p] = _mm512_and_si512(v1, m);
                b[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(v1, 4), m);
            }
        } else {
            for (int u = 0; u < 4; u++) {
                a[u] = load_w(w0, 256 * (size_t)k + 64 * (size_t)u, rb);
                b[u] = load_w(w1, 256 * (size_t)k + 64 * (size_t)u, rb);
            }
        }
        const __m512 s = sc[k];
        for (int j = 0; j < T; j++) {
            const uint8_t *x = xs[j] + 256 * (size_t)k;
#define LDX(o) _mm512_load_si512(x + (o))
            __m512i c;
            if (!q8) {
                c = red4(QX_Q4(a[0], LDX(0), a[1], LDX(64)), QX_Q4(a[2], LDX(128), a[3], LDX(192)),
                         QX_Q4(b[0], LDX(0), b[1], LDX(64)), QX_Q4(b[2], LDX(128), b[3], LDX(192)));
            } else {
                const __m512i x0 = LDX(0), x1 = LDX(64), x2 = LDX(128), x3 = LDX(192);
                c = red4(fold(QX_Q8(a[0], x0), QX_Q8(a[1], x1)), fold(QX_Q8(a[2], x2), QX_Q8(a[3], x3)),
                         fold(QX_Q8(b[0], x0), QX_Q8(b[1], x1)), fold(QX_Q8(b[2], x2), QX_Q8(b[3], x3)));
            }
#undef LDX
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), _mm512_mul_ps(s, dc[j][k]), acc[j]);
        }
    }
    for (int j = 0; j < T; j++) tot[j] = acc[j];
}

QX_ATTR static void QX(qx_block_any)(int T, bool q8, const uint8_t *w0, const uint8_t *w1, size_t rb,
                                     const __m512 *sc, const uint8_t *const *xs, const __m512 *const *dc,
                                     uint32_t ngr, __m512 *tot) {
    switch (T * 2 + q8) {
#define CASE(t)                                                                                                        \
    case t * 2: QX(qx_block)(t, false, w0, w1, rb, sc, xs, dc, ngr, tot); break;                                       \
    case t * 2 + 1: QX(qx_block)(t, true, w0, w1, rb, sc, xs, dc, ngr, tot); break;
        CASE(4) CASE(3) CASE(2) CASE(1)
#undef CASE
    }
}

/* The weights of groups of 4 units 2h and 2h + 1 of one row (only the first group when !two), read
 * in place (load_w: zeros past rb) and made ready for any token's codes: q4 pair s's low nibbles in
 * lo[s] and high ones in hi[s]; q8 pair s's two 64-column halves. */
QX_INLINE void QX(qx_mv_load)(const bool two, const bool q8, const uint8_t *row, size_t rb, uint32_t h, __m512i *lo,
                              __m512i *hi) {
    const __m512i m = _mm512_set1_epi8(0x0f);
    for (int s = 0; s < (two ? 4 : 2); s++) {
        const size_t pair = 4 * (size_t)h + (size_t)s; /* 128 columns: q4 64 bytes, q8 128 */
        if (!q8) {
            const __m512i v = load_w(row, 64 * pair, rb);
            lo[s] = _mm512_and_si512(v, m);
            hi[s] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
        } else {
            lo[s] = load_w(row, 128 * pair, rb);
            hi[s] = load_w(row, 128 * pair + 64, rb);
        }
    }
}

/* The integer block sums of those groups (qx_mv_load's weights) against one token's re-laid codes
 * x, in red4's lane order: lane 4Q + s the sum of quarter Q of pair s (pairs 0, 1 the first group's,
 * 2, 3 the second's) — so cinv puts them in [first group's reference lanes | second's], as it does
 * a row pair's. */
QX_INLINE __m512i QX(qx_mv_dot)(const bool two, const bool q8, const __m512i *lo, const __m512i *hi, const uint8_t *x,
                                uint32_t h) {
    __m512i p[4];
    for (int s = 0; s < 4; s++) {
        if (!two && s >= 2) {
            p[s] = _mm512_setzero_si512();
            continue;
        }
        const size_t pair = 4 * (size_t)h + (size_t)s;
        const __m512i x0 = _mm512_load_si512(x + 128 * pair), x1 = _mm512_load_si512(x + 128 * pair + 64);
        p[s] = q8 ? fold(QX_Q8(lo[s], x0), QX_Q8(hi[s], x1)) : QX_Q4(lo[s], x0, hi[s], x1);
    }
    return red4(p[0], p[1], p[2], p[3]);
}

/* σ of groups of 4 units 2h and 2h + 1 of a row, in the reference's lane order (kernels_avx2.c's
 * qx_sigma for each, side by side), from s, its scales by group (zero-padded by SPAD) */
QX_INLINE __m512 QX(qx_mv_sigma)(const uint32_t G, const float *s, uint32_t h) {
    if (G == 64)
        return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7),
                                     _mm512_loadu_ps(s + 8 * (size_t)h));
    if (G == 32)
        return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15),
                                     _mm512_loadu_ps(s + 16 * (size_t)h));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3),
                                 _mm512_loadu_ps(s + 4 * (size_t)h));
}

/* One row against T tokens (xs[j], ds[j]: token j's re-laid codes and its d): tot[j] of
 * kernels_ref.c, its 8 lanes in the reference order. The groups of 4 units go two at a time (one
 * 16-lane register of integer sums, whose two halves then go into the same 8-lane fma chain one
 * after the other: the reference's order exactly); each pair of groups' weights is loaded once for
 * the T tokens. Where pf, the bytes AHEAD_BYTES on are prefetched into L2 as it goes (past the
 * row: the next rows'; a prefetch never faults). */
QX_INLINE void QX(qx_mv_row)(const int T, const bool pf, const bool q8, const uint32_t G, const uint8_t *row, size_t rb,
                             const float *s, const uint8_t *const *xs, const float *const *ds, uint32_t ngr,
                             __m512i cinv, __m256 *tot) {
    const size_t step = q8 ? 512 : 256; /* weight bytes of 8 units */
    for (int j = 0; j < T; j++) tot[j] = _mm256_setzero_ps();
    uint32_t h = 0;
    for (; 2 * h + 2 <= ngr; h++) {
        if (pf)
            for (size_t b = 0; b < step; b += 64) _mm_prefetch((const char *)row + AHEAD_BYTES + step * h + b, _MM_HINT_T1);
        __m512i lo[4], hi[4];
        QX(qx_mv_load)(true, q8, row, rb, h, lo, hi);
        const __m512 sig = QX(qx_mv_sigma)(G, s, h);
        for (int j = 0; j < T; j++) {
            const __m512 f = _mm512_permutexvar_ps(cinv, _mm512_cvtepi32_ps(QX(qx_mv_dot)(true, q8, lo, hi, xs[j], h)));
            const __m512 sd = _mm512_mul_ps(sig, _mm512_loadu_ps(ds[j] + 16 * (size_t)h));
            tot[j] = _mm256_fmadd_ps(_mm512_castps512_ps256(f), _mm512_castps512_ps256(sd), tot[j]);
            tot[j] = _mm256_fmadd_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)),
                                     _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sd), 1)), tot[j]);
        }
    }
    if (2 * h < ngr) { /* an odd last group of 4 units: its d alone (no read past the token's) */
        if (pf) /* its bytes' worth ahead too, or on such rows (768 columns: 3 groups) the prefetches cover
                   two thirds of what is read (bench/RESULTS.md, "Zen 5: every item") */
            for (size_t b = 0; b < step / 2; b += 64) _mm_prefetch((const char *)row + AHEAD_BYTES + step * h + b, _MM_HINT_T1);
        __m512i lo[4], hi[4];
        QX(qx_mv_load)(false, q8, row, rb, h, lo, hi);
        const __m256 sig = _mm512_castps512_ps256(QX(qx_mv_sigma)(G, s, h));
        for (int j = 0; j < T; j++) {
            const __m512 f = _mm512_permutexvar_ps(cinv, _mm512_cvtepi32_ps(QX(qx_mv_dot)(false, q8, lo, hi, xs[j], h)));
            tot[j] = _mm256_fmadd_ps(_mm512_castps512_ps256(f), _mm256_mul_ps(sig, _mm256_loadu_ps(ds[j] + 16 * (size_t)h)),
                                     tot[j]);
        }
    }
}

/* Rows r0 .. r1 against n = T + T2 tokens (T2 = 0, or T = TB): per row its scales, then one pass
 * of T tokens over its weights (prefetching ahead) and, where T2, a second of T2 (from L1). */
QX_INLINE void QX(qx_few_rows)(const int T, const int T2, const bool q8, const uint32_t G, const uint8_t *w, size_t rb,
                               const uint8_t *scales, const uint8_t *biases, uint8_t sf, uint32_t ng, uint32_t up,
                               const uint8_t *const *xs, const float *const *ds, const float *const *gs,
                               uint32_t r0, uint32_t r1, float *y, size_t ldy) {
    const size_t sbytes = sf_bytes(sf);
    const uint32_t ng8 = (ng + 7) & ~7u, ngr = up / 4;
    const __m512i cinv = _mm512_load_si512(cinv_lanes);
    float sv[MAXG + 2 * SPAD], bv[MAXG + 2 * SPAD];
    for (uint32_t r = r0; r < r1; r++) {
        load_scales(sv, scales + sbytes * (size_t)r * ng, ng, sf, 2 * up + SPAD);
        load_scales(bv, biases + sbytes * (size_t)r * ng, ng, sf, ng8);
        const uint8_t *row = w + (size_t)r * rb;
        __m256 tot[TB];
        QX(qx_mv_row)(T, true, q8, G, row, rb, sv, xs, ds, ngr, cinv, tot);
        for (int j = 0; j < T; j++) y[(size_t)j * ldy + r] = hsum8(tot[j]) + bias_dot(bv, gs[j], ng8);
        if (T2) {
            QX(qx_mv_row)(T2, false, q8, G, row, rb, sv, xs + T, ds + T, ngr, cinv, tot);
            for (int j = 0; j < T2; j++) y[(size_t)(T + j) * ldy + r] = hsum8(tot[j]) + bias_dot(bv, gs[T + j], ng8);
        }
    }
}

/* The matrix-vector product (n = 1, decode's) and the few-token one (few_path: n ≤ FEW_MAX, the
 * tokens a short prompt routes to one expert): one row at a time (one sequential stream), its codes
 * read in place once for each pass of up to TB tokens (the row is in L1 for the second), the bytes
 * AHEAD_BYTES on prefetched as it goes — the AVX2 matvec's way (kernels_avx2.c says why each) — with
 * the tokens' codes re-laid once per call and the passes' shape chosen once per call, so that each
 * row loop is straight code (with a call and a switch per row, one token on 384-byte rows read
 * 18-25 % slower in one build than another: bench/RESULTS.md, "A few tokens a row on AVX-512").
 * The batched path below re-reads a pair of rows' weights from L1 per block of tokens too, but
 * prefetches them only a pair of rows on. The integers are those of the batched
 * path and each (row, token)'s fma chain is the reference's, so the bits are the same. The caller
 * keeps n · up · 64 ≤ FEW_XBYTES. */
QX_ATTR static bool QX(qx_rows_few)(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y,
                                    size_t ldy, uint32_t r0, uint32_t r1) {
    const uint32_t G = W->group, cols = W->cols;
    const bool q8 = W->format == SMOE_FMT_Q8;
    const smoe_qx_size z = smoe_qx_sizes(cols, W->format, G);
    const uint32_t ng = cols / G, up = (uint32_t)z.d_floats / 2;
    const size_t rb = q8 ? cols : cols / 2;
    const uint8_t *scales = w + W->scales_off, *biases = w + W->biases_off;
    const uint8_t sf = W->scale_format;
    _Alignas(64) uint8_t xb[FEW_XBYTES]; /* the tokens' re-laid codes, up · 64 bytes each */
    const uint8_t *xs[FEW_MAX];
    const float *ds[FEW_MAX], *gs[FEW_MAX];
    for (uint32_t t = 0; t < n; t++) {
        relayout(xb + (size_t)t * 64 * up, (const uint8_t *)X->codes + (size_t)t * z.code_bytes, up, q8);
        xs[t] = xb + (size_t)t * 64 * up;
        ds[t] = X->d + (size_t)t * z.d_floats;
        gs[t] = X->gsum + (size_t)t * z.gsum_floats;
    }
    switch (n * 2 + q8) {
#define CASE(nn, t, t2)                                                                                                \
    case nn * 2: QX(qx_few_rows)(t, t2, false, G, w, rb, scales, biases, sf, ng, up, xs, ds, gs, r0, r1, y, ldy); break; \
    case nn * 2 + 1: QX(qx_few_rows)(t, t2, true, G, w, rb, scales, biases, sf, ng, up, xs, ds, gs, r0, r1, y, ldy); break;
        CASE(1, 1, 0) CASE(2, 2, 0) CASE(3, 3, 0) CASE(4, 4, 0) CASE(5, 4, 1) CASE(6, 4, 2) CASE(7, 4, 3) CASE(8, 4, 4)
#undef CASE
    default: return false;
    }
    return true;
}

QX_ATTR bool QX(smoe_avx512_matmul_rows_qx)(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n,
                                            float *y, size_t ldy, uint32_t r0, uint32_t r1) {
    const uint32_t G = W->group, cols = W->cols;
    if (!group_ok(G) || cols % G || cols > MAXC) return false;
    const bool q8 = W->format == SMOE_FMT_Q8;
    const smoe_qx_size z = smoe_qx_sizes(cols, W->format, G);
    if (few_path(n, q8, (uint32_t)z.d_floats / 2))
        return QX(qx_rows_few)(W, w, X, n, y, ldy, r0, r1);
    const uint32_t ng = cols / G, ng8 = (ng + 7) & ~7u, up = (uint32_t)z.d_floats / 2, ngr = up / 4;
    const uint32_t upto = 2 * up + SPAD; /* scales read by sigma2 at most, any G */
    const size_t rb = q8 ? cols : cols / 2, sbytes = sf_bytes(W->scale_format);
    const uint8_t *scales = w + W->scales_off, *biases = w + W->biases_off;
    const uint32_t tile = XBYTES / (64 * up); /* tokens whose codes fit xbuf: ≥ 4 */

    _Alignas(64) uint8_t xbuf[XBYTES];   /* (tile tokens, up units · 64) re-laid codes */
    __m512 dbuf[XBYTES / 256];           /* (tile tokens, groups) d in red4's order */
    __m512 sc[MAXU / 4];                 /* (groups) σ of the row pair */
    float sb[2][MAXG + 2 * SPAD], bb[2][MAXG + 2 * SPAD]; /* (rows, groups) scales, biases */
    const __m512i cmap = _mm512_load_si512(cmap_lanes), cinv = _mm512_load_si512(cinv_lanes);

    for (uint32_t t0 = 0; t0 < n; t0 += tile) {
        const uint32_t nt = n - t0 < tile ? n - t0 : tile;
        for (uint32_t t = 0; t < nt; t++) {
            relayout(xbuf + (size_t)t * 64 * up, (const uint8_t *)X->codes + (size_t)(t0 + t) * z.code_bytes, up, q8);
            const float *d = X->d + (size_t)(t0 + t) * z.d_floats;
            for (uint32_t k = 0; k < ngr; k++)
                dbuf[t * ngr + k] = _mm512_permutexvar_ps(cmap, _mm512_castps256_ps512(_mm256_loadu_ps(d + 8 * k)));
        }
        for (uint32_t r = r0; r < r1; r += 2) {
            const uint32_t rr[2] = {r, r + 1 < r1 ? r + 1 : r}; /* an odd last row: twice */
            if (BATCH_AHEAD && r + BATCH_AHEAD + 2 <= r1) /* the pair BATCH_AHEAD rows on, as the matvec does */
                for (size_t b = 0; b < 2 * rb; b += 64)
                    _mm_prefetch((const char *)w + (size_t)(r + BATCH_AHEAD) * rb + b, _MM_HINT_T0);
            for (int i = 0; i < 2; i++) {
                load_scales(sb[i], scales + sbytes * (size_t)rr[i] * ng, ng, W->scale_format, upto);
                load_scales(bb[i], biases + sbytes * (size_t)rr[i] * ng, ng, W->scale_format, ng8);
            }
            for (uint32_t k = 0; k < ngr; k++) sc[k] = sigma2(G, sb[0], sb[1], 4 * k);
            for (uint32_t t = 0; t < nt; t += TB) {
                const uint32_t nb = nt - t < TB ? nt - t : TB;
                const uint8_t *xs[TB];
                const __m512 *dc[TB];
                __m512 tot[TB];
                for (uint32_t j = 0; j < nb; j++) {
                    xs[j] = xbuf + (size_t)(t + j) * 64 * up;
                    dc[j] = dbuf + (size_t)(t + j) * ngr;
                }
                QX(qx_block_any)((int)nb, q8, w + (size_t)rr[0] * rb, w + (size_t)rr[1] * rb, rb, sc, xs, dc, ngr, tot);
                for (uint32_t j = 0; j < nb; j++) {
                    const size_t tj = t0 + t + j;
                    const float *gs = X->gsum + tj * z.gsum_floats;
                    const __m512 f = _mm512_permutexvar_ps(cinv, tot[j]);
                    y[tj * ldy + rr[0]] = hsum8(_mm512_castps512_ps256(f)) + bias_dot(bb[0], gs, ng8);
                    if (rr[1] != rr[0])
                        y[tj * ldy + rr[1]] = hsum8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1))) +
                                              bias_dot(bb[1], gs, ng8);
                }
            }
        }
    }
    return true;
}

#undef QX_Q4
#undef QX_Q8
