/* kernels_avx512_amx.h — the 8-bit-activation product (q4, q8) on AMX tiles, included once by
 * kernels_avx512.c (its helpers: load_w, load_scales, relayout, hsum8's tree). For a CPU with
 * AMX-INT8 (Intel Sapphire Rapids and later Xeons) and a batch of tokens; kernels.c picks it
 * where cpu.c found AMX usable (cpuid, XCR0, and the Linux permission to use its tile data) and
 * n is at least SMOE_AMX_MIN_N (below it the AVX512-VNNI kernel wastes less of a tile).
 *
 * What it must keep: kernels_ref.c's arithmetic exactly, as every instance does. The integer
 * block sums I (32 columns of a weight row against one token's codes) are exact however they are
 * formed; here one tile product forms them for 16 rows × 16 tokens at once (tdpbusd: u8 weights
 * · s8 codes, summed 4 to an int32, K = 32 bytes: one block, so each C element is one I). The
 * float part is the reference's, per (row, token):
 *     tot[j] = fma((float)I, σ·d, tot[j])    over the groups of 4 units in order, j < 8
 *     y      = hsum8(tot) + hsum8(bia)       (bia[i] = fma(b_g, gsum_g, bia[i]) over g ≡ i mod 8)
 * done with the 16 tokens of a tile in the 16 lanes of a register: the same fma on each lane, in
 * the same order, and the lane sums of hsum8 as whole-register adds in its tree.
 *
 * Loops: token tiles of 16, then panels of 16 rows, then the blocks (a q4 panel is unpacked
 * once per token tile). Rows of up to AMAXC columns (the scratch is on the stack, ~170 KB).
 * Layouts:
 *  - A (weights): q8 rows are read by the tile loads in place (32 bytes of a row per block,
 *    stride = the row's bytes); q4 rows are unpacked to bytes, 16 rows at a time, each block as
 *    [low nibbles of its 16 bytes | high nibbles] (its even columns, then its odd ones).
 *  - B (codes): per tile of 16 tokens and block, 8 rows of 64 bytes, VNNI-packed: row kk holds
 *    4 codes of each token (K positions 4kk … 4kk + 3, in A's column order), the token's dword
 *    at 4n.
 *  - C: 16 rows × 16 tokens of int32, stored to the stack and read back a row at a time.
 * Tiles: tmm0, tmm1 C; tmm2, tmm3 A; tmm4, tmm5 B (two blocks in flight). The tile state is
 * configured at each call's start and released at its end (so a thread's context switches save
 * no tile data between calls). */

#define AMX_ATTR TARGET("avx512f,avx512bw,avx512vl,amx-tile,amx-int8")
#define AMX_INLINE static inline __attribute__((always_inline)) AMX_ATTR

enum {
    AM = 16, AN = 16, AK = 32, /* rows of a panel, tokens of a tile, columns of a block */
    AMAXC = 4096,              /* columns it takes (its scratch is on the stack): wider rows run the VNNI kernel */
    AMAXU = AMAXC / 64,        /* units of such a row */
    AMAXG = AMAXC / 32,        /* its groups at most */
};

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

/* The 16 C rows of one block (stored at cb) into the panel's accumulators: acc[m] (16 tokens) =
 * fma(I, σ[m]·d, acc[m]), σ[m] = sig[m·ls] (the block's group's scale in row m) */
AMX_INLINE void amx_epilogue(const int32_t *cb, const float *sig, size_t ls, const float *dv, __m512 *acc) {
    const __m512 d = _mm512_loadu_ps(dv);
    for (int m = 0; m < AM; m++) {
        const __m512 c = _mm512_cvtepi32_ps(_mm512_loadu_si512(cb + AN * m));
        acc[m] = _mm512_fmadd_ps(c, _mm512_mul_ps(_mm512_set1_ps(sig[ls * m]), d), acc[m]);
    }
}

AMX_ATTR bool smoe_avx512_amx_matmul_rows_qx(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n,
                                             float *y, size_t ldy, uint32_t r0, uint32_t r1) {
    const uint32_t G = W->group, cols = W->cols;
    if (!(W->format == SMOE_FMT_Q4 || W->format == SMOE_FMT_Q8) || !group_ok(G) || cols % G || cols > AMAXC || n == 0)
        return false;
    if (r0 >= r1) return true;
    const bool q8 = W->format == SMOE_FMT_Q8;
    const smoe_qx_size z = smoe_qx_sizes(cols, W->format, G);
    const uint32_t ng = cols / G, ng8 = (ng + 7) & ~7u, up = (uint32_t)z.d_floats / 2, ngr = up / 4;
    const uint32_t nblk = 2 * up, upto = 2 * up + SPAD;
    const size_t rb = q8 ? cols : cols / 2, sbytes = sf_bytes(W->scale_format), lda = (size_t)nblk * AK;
    const size_t ls = upto + 16, lb = ng8 + 16; /* a row's σ and biases as load_scales writes them (zeros after) */
    const uint8_t *scales = w + W->scales_off, *biases = w + W->biases_off;
    const uint32_t nb_cols = cols / AK, gshift = G == 32 ? 0 : G == 64 ? 1 : 2; /* blocks of the row; of a group: 1 << gshift */

    /* the blocks in the order the lanes take them: lane j's chain over the groups k of 4 units
     * (block 2(4k + j%4) + j/4), then lane j + 1's */
    uint16_t order[8 * (AMAXU / 4)];
    for (uint32_t j = 0, q = 0; j < 8; j++)
        for (uint32_t k = 0; k < ngr; k++) order[q++] = (uint16_t)(2 * (4 * k + j % 4) + j / 4);

    /* stack, ~170 KB at AMAXC: B of a token tile, the unpacked panel, and their floats */
    _Alignas(64) uint8_t bt[2 * AMAXU * 512];       /* (blocks) B tiles of the token tile */
    _Alignas(64) uint8_t ap[AM * 2 * AMAXU * AK];   /* (16 rows, blocks · 32) unpacked weights */
    _Alignas(64) uint8_t xb[AMAXU * 64];            /* one token's re-laid codes */
    _Alignas(64) float dt[2 * AMAXU * AN];          /* (blocks, 16 tokens) d */
    _Alignas(64) float gt[AMAXG * AN];              /* (groups, 16 tokens) group sums */
    _Alignas(64) float sg[AM * (AMAXG + 2 * SPAD)]; /* (16 rows, groups) σ, ls apart */
    _Alignas(64) float bi[AM * (AMAXG + SPAD)];     /* (16 rows, groups) biases, lb apart */
    _Alignas(64) int32_t cb[2][2][AM * AN];         /* two pairs of blocks' C */
    _Alignas(64) float tot[8][AM * AN];             /* the lanes' totals of a panel's tile */

    amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 2; i++) {
        cfg.rows[i] = AM; /* C: 16 rows × 16 int32 */
        cfg.colsb[i] = 64;
        cfg.rows[2 + i] = AM; /* A: 16 rows × 32 bytes */
        cfg.colsb[2 + i] = AK;
        cfg.rows[4 + i] = AK / 4; /* B: 8 rows × 64 bytes */
        cfg.colsb[4 + i] = 64;
    }
    _tile_loadconfig(&cfg);
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const __m512i i0 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), i1 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);

    for (uint32_t t0 = 0; t0 < n; t0 += AN) {
        const uint32_t nt = n - t0 < AN ? n - t0 : AN;
        /* B, d and the group sums of the token tile (tokens past n: zeros) */
        memset(bt, 0, (size_t)nblk * 512);
        memset(dt, 0, sizeof(float) * nblk * AN);
        memset(gt, 0, sizeof(float) * ng8 * AN);
        for (uint32_t tn = 0; tn < nt; tn++) {
            const size_t t = t0 + tn;
            relayout(xb, (const uint8_t *)X->codes + t * z.code_bytes, up, q8);
            for (uint32_t b = 0; b < nblk; b++) {
                uint8_t *tile = bt + (size_t)b * 512 + 4 * tn;
                /* the block's 32 codes in A's column order: q8 column order; q4 even columns, then odd */
                const uint8_t *lo = q8 ? xb + AK * (size_t)b : xb + 128 * (size_t)(b / 4) + 16 * (b % 4);
                const uint8_t *hi = q8 ? lo + 16 : lo + 64;
                for (int kk = 0; kk < 4; kk++) {
                    memcpy(tile + 64 * kk, lo + 4 * kk, 4);
                    memcpy(tile + 64 * (kk + 4), hi + 4 * kk, 4);
                }
                dt[(size_t)b * AN + tn] = X->d[t * z.d_floats + smoe_qx_dpos(b)];
            }
            for (uint32_t g = 0; g < ng8; g++) gt[(size_t)g * AN + tn] = X->gsum[t * z.gsum_floats + g];
        }

        for (uint32_t rp = r0; rp < r1; rp += AM) {
            const uint32_t mr = r1 - rp < AM ? r1 - rp : AM;
            /* σ by group and the biases of the panel's rows (rows past r1: zeros) */
            for (uint32_t m = 0; m < AM; m++) {
                if (m < mr) {
                    load_scales(sg + ls * m, scales + sbytes * (size_t)(rp + m) * ng, ng, W->scale_format, upto);
                    load_scales(bi + lb * m, biases + sbytes * (size_t)(rp + m) * ng, ng, W->scale_format, ng8);
                } else {
                    memset(sg + ls * m, 0, sizeof(float) * ls);
                    memset(bi + lb * m, 0, sizeof(float) * lb);
                }
            }
            /* A: q4 unpacked (and q8 copied when the panel is short: no tile load past the tensor) */
            const uint8_t *a_base = ap;
            size_t a_stride = lda;
            if (q8 && mr == AM) {
                a_base = w + (size_t)rp * rb;
                a_stride = rb;
            } else {
                for (uint32_t m = 0; m < AM; m++) {
                    uint8_t *dst = ap + (size_t)m * lda;
                    if (m >= mr) {
                        memset(dst, 0, lda);
                        continue;
                    }
                    const uint8_t *row = w + (size_t)(rp + m) * rb;
                    if (q8) {
                        memcpy(dst, row, rb);
                        memset(dst + rb, 0, lda - rb);
                        continue;
                    }
                    for (uint32_t p = 0; p < up / 2; p++) {
                        const __m512i v = load_w(row, 64 * (size_t)p, rb);
                        const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                        _mm512_storeu_si512(dst + 128 * (size_t)p, _mm512_permutex2var_epi64(lo, i0, hi));
                        _mm512_storeu_si512(dst + 128 * (size_t)p + 64, _mm512_permutex2var_epi64(lo, i1, hi));
                    }
                }
            }
            /* The blocks in `order`, two at a time, software-pipelined: the tile products of the
             * next pair are issued and stored before the float work of this pair reads its C
             * (stored a pair earlier, so its stores have landed). */
            const uint32_t nq = 8 * ngr; /* even */
#define BLK(q) ((uint32_t)order[q])
#define PRODUCT(c, a, bb, q, dst)                                                                                      \
    do {                                                                                                               \
        const uint32_t b_ = BLK(q);                                                                                    \
        _tile_zero(c);                                                                                                 \
        if (b_ < nb_cols) {                                                                                            \
            _tile_loadd(a, a_base + AK * (size_t)b_, a_stride);                                                        \
            _tile_loadd(bb, bt + 512 * (size_t)b_, 64);                                                                \
            _tile_dpbusd(c, a, bb);                                                                                    \
        }                                                                                                              \
        _tile_stored(c, dst, 64);                                                                                      \
    } while (0)
            __m512 acc[AM];
            for (int m = 0; m < AM; m++) acc[m] = _mm512_setzero_ps();
            PRODUCT(0, 2, 4, 0, cb[0][0]);
            PRODUCT(1, 3, 5, 1, cb[0][1]);
            uint32_t lane = 0, left = ngr; /* the lane being summed; its blocks still to come */
            for (uint32_t q = 0; q < nq; q += 2) {
                const uint32_t h = (q / 2) & 1;
                if (q + 2 < nq) {
                    PRODUCT(0, 2, 4, q + 2, cb[h ^ 1][0]);
                    PRODUCT(1, 3, 5, q + 3, cb[h ^ 1][1]);
                }
                for (uint32_t e = 0; e < 2; e++) {
                    const uint32_t b = BLK(q + e);
                    amx_epilogue(cb[h][e], sg + (b >> gshift), ls, dt + (size_t)b * AN, acc);
                    if (--left == 0) { /* the lane's last block */
                        for (int m = 0; m < AM; m++) {
                            _mm512_storeu_ps(tot[lane] + AN * m, acc[m]);
                            acc[m] = _mm512_setzero_ps();
                        }
                        lane++;
                        left = ngr;
                    }
                }
            }
#undef PRODUCT
#undef BLK
            /* y = hsum8(tot) + hsum8(bia), 16 tokens a register */
            for (uint32_t m = 0; m < mr; m++) {
                __m512 ba[8];
                for (int i = 0; i < 8; i++) ba[i] = _mm512_setzero_ps();
                const float *bm = bi + lb * m;
                for (uint32_t g = 0; g < ng8; g += 8)
                    for (int i = 0; i < 8; i++)
                        ba[i] = _mm512_fmadd_ps(_mm512_set1_ps(bm[g + i]), _mm512_loadu_ps(gt + (size_t)(g + i) * AN), ba[i]);
#define L(i) _mm512_loadu_ps(tot[i] + AN * m)
                const __m512 main_ = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(L(0), L(4)), _mm512_add_ps(L(2), L(6))),
                                                   _mm512_add_ps(_mm512_add_ps(L(1), L(5)), _mm512_add_ps(L(3), L(7))));
#undef L
                const __m512 bias = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(ba[0], ba[4]), _mm512_add_ps(ba[2], ba[6])),
                                                  _mm512_add_ps(_mm512_add_ps(ba[1], ba[5]), _mm512_add_ps(ba[3], ba[7])));
                float out[AN];
                _mm512_storeu_ps(out, _mm512_add_ps(main_, bias));
                for (uint32_t tn = 0; tn < nt; tn++) y[(t0 + tn) * ldy + rp + m] = out[tn];
            }
        }
    }
    _tile_release();
    return true;
}

#undef AMX_INLINE
#undef AMX_ATTR
