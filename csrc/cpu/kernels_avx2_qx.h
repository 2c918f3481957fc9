/* kernels_avx2_qx.h — the 8-bit-activation products of kernels_avx2.c, included there twice:
 * once for plain AVX2 (QX_VNNI 0) and once with AVX-VNNI (QX_VNNI 1), chosen at run time. The
 * two differ only in how the exact integer products are formed (maddubs + madd + add, or
 * vpdpbusd / vpdpwssd); the integers are the same, so the results are the same bits.
 *
 * Before including: QX(name) (the instance's name for name), QX_ATTR (its function attribute),
 * QX_VNNI. No include guard, on purpose. */

#if QX_VNNI
/* Σ of u8·s8 products of (a, x) and (c, y), 4 adjacent bytes per int32 lane */
#define QX_U8S8(a, x, c, y) _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, x), c, y)
/* Σ of s16·s16 products of four pairs of vectors, 2 adjacent int16 per int32 lane */
#define QX_S16(a, x, b, y, c, z, d, u)                                                                             \
    _mm256_dpwssd_avx_epi32(                                                                                      \
        _mm256_dpwssd_avx_epi32(_mm256_dpwssd_avx_epi32(_mm256_madd_epi16(a, x), b, y), c, z), d, u)
#else
#define QX_U8S8(a, x, c, y)                                                                                        \
    _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(a, x), _mm256_maddubs_epi16(c, y)),                    \
                      _mm256_set1_epi16(1))
#define QX_S16(a, x, b, y, c, z, d, u)                                                                             \
    _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(a, x), _mm256_madd_epi16(b, y)),                          \
                     _mm256_add_epi32(_mm256_madd_epi16(c, z), _mm256_madd_epi16(d, u)))
#endif


/* One unit's (64 columns') stored codes unpacked into the layout of the x codes:
 * q4 (32 bytes): c[0] = unpacklo(lo, hi) (columns 0–15 | 32–47), c[1] = unpackhi (16–31 | 48–63);
 * q8 (64 bytes): c[v] = columns 8v..8v+8 | 32+8v..32+8v+8 as int16, v < 4. */
QX_ATTR INLINE void QX(qx_codes)(const bool q8, const uint8_t *w, __m256i c[4]) {
    if (!q8) {
        const __m256i m = _mm256_set1_epi8(0x0f);
        const __m256i b = _mm256_loadu_si256((const __m256i *)(const void *)w);
        const __m256i lo = _mm256_and_si256(b, m), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
        c[0] = _mm256_unpacklo_epi8(lo, hi);
        c[1] = _mm256_unpackhi_epi8(lo, hi);
        return;
    }
#define LD16(o) _mm_loadu_si128((const __m128i *)(const void *)(w + (o)))
    const __m128i a0 = LD16(0), a1 = LD16(16), b0 = LD16(32), b1 = LD16(48);
#undef LD16
    c[0] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi64(a0, b0));
    c[1] = _mm256_cvtepu8_epi16(_mm_unpackhi_epi64(a0, b0));
    c[2] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi64(a1, b1));
    c[3] = _mm256_cvtepu8_epi16(_mm_unpackhi_epi64(a1, b1));
}

/* A row of `cols` columns' codes for units [0, up) unpacked (qx_codes), zeros past cols: 64
 * bytes per unit for q4, 128 for q8. A last half unit is read through a zero-padded copy, so
 * nothing past the row is read. */
QX_ATTR static void QX(qx_unpack)(uint8_t *dst, const uint8_t *row, uint32_t cols, uint32_t up, bool q8) {
    const size_t wb = q8 ? 64 : 32, gb = q8 ? 128 : 64;
    const int nv = q8 ? 4 : 2;
    uint32_t g = 0;
    for (; g < (cols + 63) / 64; g++) {
        __m256i c[4];
        const uint8_t *src = row + wb * g;
        _Alignas(32) uint8_t half[64];
        if (64 * g + 64 > cols) {
            memcpy(half, src, wb / 2);
            memset(half + wb / 2, 0, wb / 2);
            src = half;
        }
        QX(qx_codes)(q8, src, c);
        for (int v = 0; v < nv; v++) _mm256_store_si256((__m256i *)(void *)(dst + gb * g + 32 * (size_t)v), c[v]);
    }
    memset(dst + gb * g, 0, gb * (size_t)(up - g));
}

/* P of one group from its unpacked codes c and the token's codes x at the group. */
QX_ATTR INLINE __m256i QX(qx_dot)(const bool q8, const __m256i c[4], const uint8_t *x) {
#define LDU(o) _mm256_loadu_si256((const __m256i *)(const void *)(x + (o)))
    if (!q8)
        return QX_U8S8(c[0], LDU(0), c[1], LDU(32));
    return QX_S16(c[0], LDU(0), c[1], LDU(32), c[2], LDU(64), c[3], LDU(96));
#undef LDU
}

/* P of one group: w the row's unpacked codes (qx_unpack), x the token's codes. */
QX_ATTR INLINE __m256i QX(qx_p)(const bool q8, const uint8_t *w, const uint8_t *x) {
    __m256i c[4];
    for (int v = 0; v < (q8 ? 4 : 2); v++) c[v] = _mm256_load_si256((const __m256i *)(const void *)(w + 32 * v));
    return QX(qx_dot)(q8, c, x);
}

/* P of one group straight from the row's stored codes (the matrix-vector product, which reads each
 * weight once: unpacking into a buffer first would only add a store and a load). The same
 * integers as qx_p on the unpacked codes, so the same bits downstream. */
QX_ATTR INLINE __m256i QX(qx_p_raw)(const bool q8, const uint8_t *w, const uint8_t *x) {
    __m256i c[4];
    QX(qx_codes)(q8, w, c);
    return QX(qx_dot)(q8, c, x);
}

/* The token's q4 codes of one unit (64 bytes, the layout of kernels.c) rearranged for qx_p_q4:
 * [even columns of block 0 | of block 1] then [odd columns of block 0 | of block 1], the order of
 * a q4 unit's low and high nibbles. Done once per call; the integer sums do not change. */
QX_ATTR INLINE void QX(qx_nibble_order)(const uint8_t *x, uint8_t *out) {
    const __m256i ctrl = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12,
                                          14, 1, 3, 5, 7, 9, 11, 13, 15);
    /* x0: columns 0–15 | 32–47, x1: 16–31 | 48–63; each 128-bit half to [even 8 | odd 8] */
    const __m256i s0 = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(const void *)x), ctrl);
    const __m256i s1 = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(const void *)(x + 32)), ctrl);
    _mm256_storeu_si256((__m256i *)(void *)out, _mm256_unpacklo_epi64(s0, s1));
    _mm256_storeu_si256((__m256i *)(void *)(out + 32), _mm256_unpackhi_epi64(s0, s1));
}

/* One unit's stored codes as qx_p_q4 (q4: low and high nibbles, x in nibble order) and qx_p_raw
 * (q8: qx_codes) take them */
QX_ATTR INLINE void QX(qx_codes_nib)(const bool q8, const uint8_t *w, __m256i c[4]) {
    if (q8) {
        QX(qx_codes)(true, w, c);
        return;
    }
    const __m256i m = _mm256_set1_epi8(0x0f);
    const __m256i b = _mm256_loadu_si256((const __m256i *)(const void *)w);
    c[0] = _mm256_and_si256(b, m);
    c[1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
}

/* P of one q4 unit straight from its stored codes, x in nibble order (qx_nibble_order): the low
 * nibbles meet the even columns, the high the odd, each 128-bit half one 32-column block as in
 * qx_p. No unpacking: the same integers as qx_p_raw, two shuffles fewer. */
QX_ATTR INLINE __m256i QX(qx_p_q4)(const uint8_t *w, const uint8_t *x) {
    __m256i c[4];
    QX(qx_codes_nib)(false, w, c);
    return QX_U8S8(c[0], _mm256_loadu_si256((const __m256i *)(const void *)x), c[1],
                   _mm256_loadu_si256((const __m256i *)(const void *)(x + 32)));
}

#if !QX_VNNI
/* The q4 int16 products of one unit, before widening: lane k of each 128-bit half the sum of 4 of
 * its block's code products (|·| ≤ 4·15·127 = 7620). */
QX_ATTR INLINE __m256i QX(qx_s16)(const __m256i c0, const __m256i x0, const __m256i c1, const __m256i x1) {
    return _mm256_add_epi16(_mm256_maddubs_epi16(c0, x0), _mm256_maddubs_epi16(c1, x1));
}

/* [I_{0,0} .. I_{3,0} | I_{0,1} .. I_{3,1}] (unit k, block b) from four units' qx_s16: pairs, then
 * quads of lanes summed in int16 (≤ 30480, no overflow), then one madd to the int32 block sums.
 * The same exact integers as madd-then-hadd_epi32 with one multiply instead of four. */
QX_ATTR INLINE __m256i QX(qx_h4_s16)(const __m256i s0, const __m256i s1, const __m256i s2, const __m256i s3) {
    const __m256i q = _mm256_hadd_epi16(_mm256_hadd_epi16(s0, s1), _mm256_hadd_epi16(s2, s3));
    return _mm256_madd_epi16(q, _mm256_set1_epi16(1));
}
#endif

/* One row against one token, its codes read where they are stored (w: the row's codes; wb: their
 * bytes per unit), units past nu (cols / 64, a whole number here) taken as zero; otherwise as
 * qx_block. For q4, x is in nibble order (qx_nibble_order). */
QX_ATTR INLINE __m256 QX(qx_row_1)(const bool q8, const uint32_t G, const uint8_t *w, const float *s, const uint8_t *x,
                                  const float *d, uint32_t nu, uint32_t up) {
    const size_t wb = q8 ? 64 : 32, xb = q8 ? 128 : 64;
    __m256 acc = _mm256_setzero_ps();
    for (uint32_t g = 0; g < up; g += 4) {
        /* later rows' bytes, into L2: a prefetch never faults, past the end included */
        for (size_t b = 0; b < 4 * wb; b += 64) _mm_prefetch((const char *)w + QX_AHEAD_BYTES + g * wb + b, _MM_HINT_T1);
        __m256i p[4];
        for (uint32_t k = 0; k < 4; k++)
            p[k] = g + k >= nu ? _mm256_setzero_si256()
                   : q8        ? QX(qx_p_raw)(q8, w + (g + k) * wb, x + (g + k) * xb)
                               : QX(qx_p_q4)(w + (g + k) * wb, x + (g + k) * xb);
        const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
        const __m256 sd = _mm256_mul_ps(qx_sigma(G, s, g), _mm256_loadu_ps(d + 2 * g));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), sd, acc);
    }
    return acc;
}

/* One row against T ≤ QSB tokens, its codes read where they are stored and unpacked once for all T
 * (a few tokens routed to one expert: the batched product's unpacked copy of the row costs more
 * than the products it feeds). Otherwise as qx_row_1: x[j] token j's codes (q4: in nibble order),
 * d[j] its block scales, acc[j] its float lanes. The plain q4 products are summed in int16 as
 * qx_h4_s16 sums them (pairs of units, then the two pairs), the rest in int32 as qx_row_1. */
QX_ATTR INLINE void QX(qx_row_T)(const int T, const bool q8, const uint32_t G, const uint8_t *w, const float *s,
                                 const uint8_t *const *x, const float *const *d, uint32_t nu, uint32_t up,
                                 __m256 acc[QSB]) {
    const size_t wb = q8 ? 64 : 32, xb = q8 ? 128 : 64;
    const bool s16 = !QX_VNNI && !q8;
    for (int j = 0; j < T; j++) acc[j] = _mm256_setzero_ps();
    for (uint32_t g = 0; g < up; g += 4) {
        for (size_t b = 0; b < 4 * wb; b += 64) _mm_prefetch((const char *)w + QX_AHEAD_BYTES + g * wb + b, _MM_HINT_T1);
        __m256i h[QSB][2]; /* token j: units g, g+1 summed pairwise, then g+2, g+3 */
        for (uint32_t k = 0; k < 4; k++) {
            const bool in = g + k < nu;
            __m256i c[4];
            if (in) QX(qx_codes_nib)(q8, w + (g + k) * wb, c);
            for (int j = 0; j < T; j++) {
                const uint8_t *xj = x[j] + (g + k) * xb;
                __m256i p = _mm256_setzero_si256();
#define LDU(o) _mm256_loadu_si256((const __m256i *)(const void *)(xj + (o)))
#if QX_VNNI
                if (in) p = q8 ? QX(qx_dot)(true, c, xj) : QX_U8S8(c[0], LDU(0), c[1], LDU(32));
#else
                if (in) p = q8 ? QX(qx_dot)(true, c, xj) : QX(qx_s16)(c[0], LDU(0), c[1], LDU(32));
#endif
#undef LDU
                h[j][k / 2] = k % 2 == 0 ? p : s16 ? _mm256_hadd_epi16(h[j][k / 2], p) : _mm256_hadd_epi32(h[j][k / 2], p);
            }
        }
        const __m256 s4 = qx_sigma(G, s, g);
        for (int j = 0; j < T; j++) {
            const __m256i hj = s16 ? _mm256_madd_epi16(_mm256_hadd_epi16(h[j][0], h[j][1]), _mm256_set1_epi16(1))
                                   : _mm256_hadd_epi32(h[j][0], h[j][1]);
            const __m256 sd = _mm256_mul_ps(s4, _mm256_loadu_ps(d[j] + 2 * g));
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hj), sd, acc[j]);
        }
    }
}

/* R rows × T tokens over up units (a multiple of 4): tot[i][j] += the scaled block sums.
 * w[i]: row i's unpacked codes; s[i]: its scales by group of G (zero-padded); x[j], d[j]: token
 * j's codes and block scales. */
QX_ATTR INLINE void QX(qx_block)(const int R, const int T, const bool q8, const uint32_t G, const uint8_t *const *w,
                     const float *const *s, const uint8_t *const *x, const float *const *d, uint32_t up,
                     __m256 (*tot)[QTB]) {
    const size_t gb = q8 ? 128 : 64; /* bytes per group, codes of both */
    __m256 acc[QRB][QTB];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < T; j++) acc[i][j] = _mm256_setzero_ps();
    for (uint32_t g = 0; g < up; g += 4) {
        __m256i h[QRB][QTB];
        for (int i = 0; i < R; i++)
            for (int j = 0; j < T; j++) {
                const uint8_t *wi = w[i] + g * gb, *xj = x[j] + g * gb;
#if !QX_VNNI
                if (!q8) {
                    __m256i p[4];
                    for (int k = 0; k < 4; k++) {
#define LDA(o) _mm256_load_si256((const __m256i *)(const void *)(wi + k * gb + (o)))
#define LDU(o) _mm256_loadu_si256((const __m256i *)(const void *)(xj + k * gb + (o)))
                        p[k] = QX(qx_s16)(LDA(0), LDU(0), LDA(32), LDU(32));
#undef LDA
#undef LDU
                    }
                    h[i][j] = QX(qx_h4_s16)(p[0], p[1], p[2], p[3]);
                    continue;
                }
#endif
                const __m256i a = _mm256_hadd_epi32(QX(qx_p)(q8, wi, xj), QX(qx_p)(q8, wi + gb, xj + gb));
                const __m256i b = _mm256_hadd_epi32(QX(qx_p)(q8, wi + 2 * gb, xj + 2 * gb), QX(qx_p)(q8, wi + 3 * gb, xj + 3 * gb));
                h[i][j] = _mm256_hadd_epi32(a, b);
            }
        for (int i = 0; i < R; i++) {
            const __m256 s4 = qx_sigma(G, s[i], g);
            for (int j = 0; j < T; j++) {
                const __m256 sd = _mm256_mul_ps(s4, _mm256_loadu_ps(d[j] + 2 * g));
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h[i][j]), sd, acc[i][j]);
            }
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < T; j++) tot[i][j] = acc[i][j];
}

QX_ATTR static void QX(qx_block_any)(int R, int T, bool q8, uint32_t G, const uint8_t *const *w, const float *const *s,
                         const uint8_t *const *x, const float *const *d, uint32_t up, __m256 (*tot)[QTB]) {
    switch (R * 8 + T + (q8 ? 64 : 0) + (int)G * 128) {
#define CASE(r, t, G) \
    case G * 128 + r * 8 + t: QX(qx_block)(r, t, false, G, w, s, x, d, up, tot); break; \
    case G * 128 + 64 + r * 8 + t: QX(qx_block)(r, t, true, G, w, s, x, d, up, tot); break;
#define CASES(G) CASE(4, 1, G) CASE(3, 1, G) CASE(2, 1, G) CASE(1, 1, G)
        CASES(32) CASES(64) CASES(128)
#undef CASES
#undef CASE
    }
}

#if !QX_VNNI
/* The plain q8 batched product in lanes by block (n ≥ QX_LANES_N8): a group of 4 units (8 blocks
 * of 32 columns) is held as 16 vectors of int16, lane L = k + 4b of each holding block b of unit
 * k — the lanes of the block sums and of d (qx_sigma) — vector V its columns 2V and 2V + 1. A
 * block's sum is then the vertical sum of its lane over the 16 madds, with no horizontal adds:
 * the same exact integers as qx_block, so the same bits. The rows and the tokens' codes are
 * both rearranged into it before the products; the tokens a tile at a time (rearranged once into
 * a stack buffer that stays in L2), the rows QRB at a time within a tile, and each row block's
 * columns QX_KC_UNITS at a time over the tile's tokens, so that its codes stay in L1 (the float
 * accumulators carried over, the units still in order). bench/RESULTS.md, "q8 in lanes by block":
 * the kernel ×1.2-1.3 at 16 tokens and ×1.5-1.6 at 256 on Zen 3; at fewer than 16 tokens the
 * rearranging costs what it saves. The q4 product in this layout was slower than qx_block's
 * (0.74-0.94×): it stays there. Each thread rearranges the tokens' codes for its own rows' call
 * (n tokens' code bytes against their products with all its rows; not measured apart): doing it
 * once in smoe_qx_prepare would change the layout every other instance and backend reads. */

/* A 4 × 4 transpose of int32 elements in each 128-bit half: v[p] element k ← v[k] element p. */
QX_ATTR INLINE void QX(qx_t4)(__m256i v[4]) {
    const __m256i a = _mm256_unpacklo_epi32(v[0], v[1]), b = _mm256_unpackhi_epi32(v[0], v[1]);
    const __m256i c = _mm256_unpacklo_epi32(v[2], v[3]), d = _mm256_unpackhi_epi32(v[2], v[3]);
    v[0] = _mm256_unpacklo_epi64(a, c);
    v[1] = _mm256_unpackhi_epi64(a, c);
    v[2] = _mm256_unpacklo_epi64(b, d);
    v[3] = _mm256_unpackhi_epi64(b, d);
}

/* Four units' q8 codes in the layout of qx_codes (c[k][u]: unit k's vector u, which holds in half
 * b the column pairs 4u..4u+3 of block b) stored at dst in lanes by block: transposing the units'
 * vectors u gives vectors 4u..4u+3. */
QX_ATTR INLINE void QX(qx_store_lanes)(__m256i c[4][4], uint8_t *dst) {
    for (int u = 0; u < 4; u++) {
        __m256i v[4] = {c[0][u], c[1][u], c[2][u], c[3][u]};
        QX(qx_t4)(v);
        for (int p = 0; p < 4; p++) _mm256_store_si256((__m256i *)(void *)(dst + 32 * (4 * u + p)), v[p]);
    }
}

/* A row of `cols` columns' q8 codes for units [0, up) in lanes by block (512 bytes per 4 units),
 * zeros past cols; a last half unit is read through a zero-padded copy, as in qx_unpack. */
QX_ATTR static void QX(qx_unpack_lanes)(uint8_t *dst, const uint8_t *row, uint32_t cols, uint32_t up) {
    const uint32_t nw = (cols + 63) / 64; /* units holding columns */
    for (uint32_t g = 0; g < up; g += 4) {
        __m256i c[4][4];
        for (uint32_t k = 0; k < 4; k++) {
            for (int u = 0; u < 4; u++) c[k][u] = _mm256_setzero_si256();
            if (g + k >= nw) continue;
            const uint8_t *src = row + 64 * (size_t)(g + k);
            _Alignas(32) uint8_t half[64];
            if (64 * (g + k) + 64 > cols) {
                memcpy(half, src, 32);
                memset(half + 32, 0, 32);
                src = half;
            }
            QX(qx_codes)(true, src, c[k]);
        }
        QX(qx_store_lanes)(c, dst + 128 * (size_t)g);
    }
}

/* R rows × one token over units [g0, g1) (multiples of 4), in lanes by block: acc[i] row i's float
 * lanes, carried in and out (qx_block's chain, unit group by unit group), started at +0 where g0
 * is 0 (in registers: a row block's zeroing of the tile's accumulators was a memset, 5 % of the
 * samples of a 256-token product on Zen 2). */
QX_ATTR INLINE void QX(qx_block_lanes)(const int R, const uint32_t G, const uint8_t *const *w, const float *const *s,
                                     const uint8_t *x, const float *d, uint32_t g0, uint32_t g1, __m256 *acc_io) {
    __m256 acc[QRB];
    for (int i = 0; i < R; i++) acc[i] = g0 == 0 ? _mm256_setzero_ps() : acc_io[i];
    for (uint32_t g = g0; g < g1; g += 4) {
        const size_t o = 128 * (size_t)g;
        __m256i I[QRB];
        for (int i = 0; i < R; i++) I[i] = _mm256_setzero_si256();
        for (int V = 0; V < 16; V++) {
            const __m256i xv = _mm256_load_si256((const __m256i *)(const void *)(x + o + 32 * V));
            for (int i = 0; i < R; i++)
                I[i] = _mm256_add_epi32(
                    I[i], _mm256_madd_epi16(_mm256_load_si256((const __m256i *)(const void *)(w[i] + o + 32 * V)), xv));
        }
        const __m256 dv = _mm256_loadu_ps(d + 2 * g);
        for (int i = 0; i < R; i++)
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I[i]), _mm256_mul_ps(qx_sigma(G, s[i], g), dv), acc[i]);
    }
    for (int i = 0; i < R; i++) acc_io[i] = acc[i];
}

QX_ATTR static void QX(qx_block_lanes_any)(int R, uint32_t G, const uint8_t *const *w, const float *const *s,
                                           const uint8_t *x, const float *d, uint32_t g0, uint32_t g1, __m256 *acc) {
    switch (R * 256 + (int)G) {
#define CASE(r, G) case r * 256 + G: QX(qx_block_lanes)(r, G, w, s, x, d, g0, g1, acc); break;
#define CASES(G) CASE(4, G) CASE(3, G) CASE(2, G) CASE(1, G)
        CASES(32) CASES(64) CASES(128)
#undef CASES
#undef CASE
    }
}

QX_ATTR __attribute__((noinline)) static void QX(qx_rows_lanes)(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X,
                                                                uint32_t n, float *y, size_t ldy, uint32_t r0, uint32_t r1) {
    const uint32_t G = W->group, cols = W->cols, ng = cols / G, ng8 = (ng + 7) & ~7u;
    const smoe_qx_size z = smoe_qx_sizes(cols, W->format, G);
    const uint32_t up = (uint32_t)z.d_floats / 2;
    const size_t sbytes = scale_bytes(W->scale_format);
    const uint8_t *scales = w + W->scales_off, *biases = w + W->biases_off;
    const uint32_t xb = qx_xtile_bytes(), tile = xb / z.code_bytes < QX_XTILE_MAX ? xb / z.code_bytes : QX_XTILE_MAX;
    _Alignas(32) uint8_t xl[QX_XTILE_BYTES];   /* the tile's codes in lanes by block */
    _Alignas(32) uint8_t cw[QRB][MAXU * 128];  /* a row block's */
    float sb[QRB][MAXG], bb[QRB][MAXG];        /* its scales, biases by group */
    __m256 acc[QX_XTILE_MAX][QRB];
    for (uint32_t t0 = 0; t0 < n; t0 += tile) {
        const uint32_t nt = n - t0 < tile ? n - t0 : tile;
        for (uint32_t j = 0; j < nt; j++) {
            const uint8_t *xj = (const uint8_t *)X->codes + (size_t)(t0 + j) * z.code_bytes;
            for (uint32_t g = 0; g < up; g += 4) {
                __m256i c[4][4];
                for (int k = 0; k < 4; k++)
                    for (int u = 0; u < 4; u++)
                        c[k][u] = _mm256_loadu_si256((const __m256i *)(const void *)(xj + 128 * (size_t)(g + k) + 32 * u));
                QX(qx_store_lanes)(c, xl + (size_t)j * z.code_bytes + 128 * (size_t)g);
            }
        }
        for (uint32_t r = r0; r < r1; r += QRB) {
            const uint32_t nr = r1 - r < QRB ? r1 - r : QRB;
            const uint8_t *wr[QRB];
            const float *sr[QRB];
            for (uint32_t i = 0; i < nr; i++) {
                QX(qx_unpack_lanes)(cw[i], w + (size_t)(r + i) * cols, cols, up);
                load_scales(sb[i], scales + sbytes * (size_t)(r + i) * ng, ng, W->scale_format);
                load_scales(bb[i], biases + sbytes * (size_t)(r + i) * ng, ng, W->scale_format);
                wr[i] = cw[i];
                sr[i] = sb[i];
            }
            for (uint32_t g0 = 0; g0 < up; g0 += QX_KC_UNITS) {
                const uint32_t g1 = up - g0 < QX_KC_UNITS ? up : g0 + QX_KC_UNITS;
                for (uint32_t j = 0; j < nt; j++)
                    QX(qx_block_lanes_any)((int)nr, G, wr, sr, xl + (size_t)j * z.code_bytes,
                                           X->d + (size_t)(t0 + j) * z.d_floats, g0, g1, acc[j]);
            }
            for (uint32_t j = 0; j < nt; j++)
                for (uint32_t i = 0; i < nr; i++)
                    y[(size_t)(t0 + j) * ldy + r + i] =
                        hsum8(acc[j][i]) + bias_dot(bb[i], X->gsum + (size_t)(t0 + j) * z.gsum_floats, ng8);
        }
    }
}
#endif

/* A few tokens (n ≤ QX_SMALL_N4 for q4, QX_SMALL_N8 for q8, the VNNI instance's own limits; q4's
 * n · cols ≤ QX_FEW_XN_BYTES; cols a multiple of 64): a row at a
 * time, its codes read in place (qx_row_T), QSB (q4) or QSB − 1 (q8) tokens a pass over it. Its own
 * function, not inlined: the batched product's frame and code stay as they were (bench/RESULTS.md,
 * "A few tokens a row"). */
QX_ATTR __attribute__((noinline)) static void QX(qx_rows_few)(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X,
                                                              uint32_t n, float *y, size_t ldy, uint32_t r0, uint32_t r1) {
    const uint32_t G = W->group, cols = W->cols, ng = cols / G, ng8 = (ng + 7) & ~7u;
    const bool q8 = W->format == SMOE_FMT_Q8;
    const smoe_qx_size z = smoe_qx_sizes(cols, W->format, G);
    const uint32_t up = (uint32_t)z.d_floats / 2, tile = q8 ? QSB - 1 : QSB;
    const size_t row_bytes = q8 ? cols : cols / 2, sbytes = scale_bytes(W->scale_format);
    const uint8_t *scales = w + W->scales_off, *biases = w + W->biases_off;
    _Alignas(32) uint8_t xn[QX_FEW_XN_BYTES]; /* q4: the tokens' codes in nibble order, cols bytes each */
    const uint8_t *xt[QX_SMALL_MAX];
    const float *dt[QX_SMALL_MAX];
    float sv[MAXG], bv[MAXG]; /* the row's scales, biases by group */
    for (uint32_t j = 0; j < n; j++) {
        const uint8_t *xj = (const uint8_t *)X->codes + (size_t)j * z.code_bytes;
        if (!q8) {
            uint8_t *xnj = xn + (size_t)j * cols;
            for (uint32_t g = 0; g < cols / 64; g++) QX(qx_nibble_order)(xj + 64 * (size_t)g, xnj + 64 * (size_t)g);
            xj = xnj;
        }
        xt[j] = xj;
        dt[j] = X->d + (size_t)j * z.d_floats;
    }
    for (uint32_t r = r0; r < r1; r++) {
        const uint8_t *wr = w + (size_t)r * row_bytes;
        load_scales(sv, scales + sbytes * (size_t)r * ng, ng, W->scale_format);
        load_scales(bv, biases + sbytes * (size_t)r * ng, ng, W->scale_format);
        for (uint32_t t = 0; t < n; t += tile) {
            const uint32_t nt = n - t < tile ? n - t : tile;
            __m256 acc[QSB]; /* set by the case below (the switch covers every T and G taken) */
            switch ((int)nt * 8 + q8 + (int)G * 16) {
#define CASE4(T, G) case G * 16 + T * 8: QX(qx_row_T)(T, false, G, wr, sv, xt + t, dt + t, cols / 64, up, acc); break;
#define CASE8(T, G) case G * 16 + T * 8 + 1: QX(qx_row_T)(T, true, G, wr, sv, xt + t, dt + t, cols / 64, up, acc); break;
#define CASES(T) CASE4(T, 32) CASE4(T, 64) CASE4(T, 128) CASE8(T, 32) CASE8(T, 64) CASE8(T, 128)
                CASES(1) CASES(2) CASES(3) CASE4(4, 32) CASE4(4, 64) CASE4(4, 128)
#undef CASES
#undef CASE8
#undef CASE4
            }
            for (uint32_t j = 0; j < nt; j++)
                y[(size_t)(t + j) * ldy + r] = hsum8(acc[j]) + bias_dot(bv, X->gsum + (size_t)(t + j) * z.gsum_floats, ng8);
        }
    }
}

QX_ATTR bool QX(smoe_avx2_matmul_rows_qx)(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y,
                              size_t ldy, uint32_t r0, uint32_t r1) {
    const uint32_t G = W->group, cols = W->cols;
    if (!group_ok(G) || cols % G || cols > MAXC) return false;
    const bool q8 = W->format == SMOE_FMT_Q8;
    const smoe_qx_size z = smoe_qx_sizes(cols, W->format, G);
    const uint32_t ng = cols / G, ng8 = (ng + 7) & ~7u, up = (uint32_t)z.d_floats / 2;
    const size_t row_bytes = q8 ? cols : cols / 2, sbytes = scale_bytes(W->scale_format);
    const uint8_t *scales = w + W->scales_off, *biases = w + W->biases_off;

    _Alignas(32) uint8_t cw[QRB][MAXU * 128]; /* (block rows, units · bytes) unpacked codes */
    float sb[QRB][MAXG], bb[QRB][MAXG];       /* (block rows, groups) scales, biases */
    __m256 tot[QRB][QTB];

    if (n == 1 && cols % 64 == 0) { /* matrix-vector: a row at a time, codes read in place */
        float sv[MAXG], bv[MAXG]; /* the row's scales, biases by group */
        const uint8_t *x = X->codes;
        if (!q8) {
            for (uint32_t g = 0; g < cols / 64; g++) QX(qx_nibble_order)(x + 64 * (size_t)g, cw[0] + 64 * (size_t)g);
            x = cw[0]; /* the unpacked-codes buffer is free in this branch */
        }
        for (uint32_t r = r0; r < r1; r++) { /* one row at a time: kernels_avx2.c says why */
            const uint8_t *wr = w + (size_t)r * row_bytes;
            __m256 acc = _mm256_setzero_ps(); /* set by the case below (the switch covers every G taken) */
            load_scales(sv, scales + sbytes * (size_t)r * ng, ng, W->scale_format);
            load_scales(bv, biases + sbytes * (size_t)r * ng, ng, W->scale_format);
            switch (q8 + G * 16) { /* q8 and G constant in each instance of the row product */
#define CASE(G) \
    case G * 16: acc = QX(qx_row_1)(false, G, wr, sv, x, X->d, cols / 64, up); break; \
    case G * 16 + 1: acc = QX(qx_row_1)(true, G, wr, sv, x, X->d, cols / 64, up); break;
                CASE(32) CASE(64) CASE(128)
#undef CASE
            }
            y[r] = hsum8(acc) + bias_dot(bv, X->gsum, ng8);
        }
        return true;
    }
    const uint32_t few = QX_VNNI ? (q8 ? QX_SMALL_N8_VNNI : QX_SMALL_N4_VNNI) : (q8 ? QX_SMALL_N8 : QX_SMALL_N4);
    if (n <= few && cols % 64 == 0 && (q8 || (size_t)n * cols <= QX_FEW_XN_BYTES)) {
        QX(qx_rows_few)(W, w, X, n, y, ldy, r0, r1);
        return true;
    }
#if !QX_VNNI
    if (q8 && n >= QX_LANES_N8) {
        QX(qx_rows_lanes)(W, w, X, n, y, ldy, r0, r1);
        return true;
    }
#endif
    for (uint32_t r = r0; r < r1; r += QRB) {
        const uint32_t nr = r1 - r < QRB ? r1 - r : QRB;
        for (uint32_t i = 0; i < nr; i++) {
            QX(qx_unpack)(cw[i], w + (size_t)(r + i) * row_bytes, cols, up, q8);
            load_scales(sb[i], scales + sbytes * (size_t)(r + i) * ng, ng, W->scale_format);
            load_scales(bb[i], biases + sbytes * (size_t)(r + i) * ng, ng, W->scale_format);
        }
        const uint8_t *wr[QRB];
        const float *sr[QRB];
        for (uint32_t i = 0; i < QRB; i++) {
            wr[i] = cw[i];
            sr[i] = sb[i];
        }
        for (uint32_t t = 0; t < n; t += QTB) {
            const uint32_t nt = n - t < QTB ? n - t : QTB;
            const uint8_t *xt[QTB];
            const float *dt[QTB];
            for (uint32_t j = 0; j < nt; j++) {
                xt[j] = (const uint8_t *)X->codes + (size_t)(t + j) * z.code_bytes;
                dt[j] = X->d + (size_t)(t + j) * z.d_floats;
            }
            QX(qx_block_any)((int)nr, (int)nt, q8, G, wr, sr, xt, dt, up, tot);
            for (uint32_t i = 0; i < nr; i++)
                for (uint32_t j = 0; j < nt; j++)
                    y[(size_t)(t + j) * ldy + r + i] =
                        hsum8(tot[i][j]) + bias_dot(bb[i], X->gsum + (size_t)(t + j) * z.gsum_floats, ng8);
        }
    }
    return true;
}

#undef QX_U8S8
#undef QX_S16
