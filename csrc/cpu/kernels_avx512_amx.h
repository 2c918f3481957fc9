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
 * Loops: panels of 16 rows, then token tiles of 16, then the blocks, where X brings its codes
 * packed (X->tiles: smoe_avx512_amx_tiles, once for every product and thread that takes that X —
 * each panel is unpacked and its scales loaded once for all the tokens); else token tiles, each
 * packed here, then panels (a q4 panel unpacked once per token tile). Rows of up to AMAXC
 * columns (the scratch is on the stack, ~170 KB).
 * Layouts:
 *  - A (weights): q8 rows are read by the tile loads in place (32 bytes of a row per block,
 *    stride = the row's bytes); q4 rows are unpacked to bytes, 16 rows at a time, each block as
 *    [low nibbles of its 16 bytes | high nibbles] (its even columns, then its odd ones).
 *  - B (codes): per tile of 16 tokens and block, 8 rows of 64 bytes, VNNI-packed: row kk holds
 *    4 codes of each token (K positions 4kk … 4kk + 3, in A's column order), the token's dword
 *    at 4n. A token tile's packed form: B of its blocks, then their d (block, 16 tokens), then its
 *    group sums (group, 16 tokens); tokens past n zeros (amx_shape's `tile` bytes a tile).
 *  - C: 16 rows × 16 tokens of int32, stored to the stack and read back a row at a time.
 * Tiles: tmm0, tmm1 C; tmm2, tmm3 A; tmm4, tmm5 B (two blocks in flight). The tile state is
 * configured at each call's start and, at its end, given back as the call found it: released
 * where no configuration was loaded (so a thread's context switches save no tile data between
 * calls), else the caller's configuration loaded again. The calling thread may be a host's: a
 * library beside this one in the process (llama.cpp's ggml) loads its configuration once per
 * thread and keeps using it, and its next tile instruction on a released state is an illegal
 * instruction (SIGILL, seen on a Xeon model 207 with llama-cpp-python 0.3.36 in one process). Only
 * the configuration comes back: the tiles' data is zeroed, which no caller can have relied on
 * across a foreign call. */

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

/* What the kernel and the packing share of X's shape */
typedef struct {
    uint32_t up, ngr, nblk, ng8; /* units of 64 columns, spans of 256 (4 units), blocks, groups padded to 8 */
    smoe_qx_size z;
    size_t tile; /* bytes of a packed token tile */
} amx_shape;

/* X's shape, false where the kernel does not take it (format, group, width) */
static AMX_ATTR bool amx_shape_of(uint32_t cols, uint8_t format, uint32_t G, amx_shape *g) {
    if (!(format == SMOE_FMT_Q4 || format == SMOE_FMT_Q8) || !group_ok(G) || cols % G || cols > AMAXC) return false;
    g->z = smoe_qx_sizes(cols, format, G);
    g->up = (uint32_t)g->z.d_floats / 2;
    g->ngr = g->up / 4;
    g->nblk = 2 * g->up;
    g->ng8 = (cols / G + 7) & ~7u;
    g->tile = (size_t)g->nblk * 512 + sizeof(float) * AN * ((size_t)g->nblk + g->ng8);
    return true;
}

/* Spans [s0, s1) (256 columns each: blocks 8s … 8s + 7) of token tile T of X's n tokens into its
 * packed form at tile (and the tile's group sums with span 0) */
static AMX_ATTR void amx_pack(const smoe_qx *X, const amx_shape *g, uint32_t n, uint32_t T, uint32_t s0, uint32_t s1,
                              uint8_t *tile) {
    const bool q8 = X->wformat == SMOE_FMT_Q8;
    const uint32_t t0 = AN * T, nt = n - t0 < AN ? n - t0 : AN, b0 = 8 * s0, b1 = 8 * s1;
    uint8_t *bt = tile;
    float *dt = (float *)(void *)(tile + (size_t)g->nblk * 512), *gt = dt + (size_t)g->nblk * AN;
    _Alignas(64) uint8_t xb[AMAXU * 64]; /* one token's re-laid codes (its spans [s0, s1)) */
    memset(bt + (size_t)b0 * 512, 0, (size_t)(b1 - b0) * 512);
    memset(dt + (size_t)b0 * AN, 0, sizeof(float) * AN * (b1 - b0));
    if (s0 == 0) memset(gt, 0, sizeof(float) * AN * g->ng8);
    for (uint32_t tn = 0; tn < nt; tn++) {
        const size_t t = t0 + tn;
        relayout(xb + 256 * (size_t)s0, (const uint8_t *)X->codes + t * g->z.code_bytes + (q8 ? 512 : 256) * (size_t)s0,
                 4 * (s1 - s0), q8);
        for (uint32_t b = b0; b < b1; b++) {
            uint8_t *tb = bt + (size_t)b * 512 + 4 * tn;
            /* the block's 32 codes in A's column order: q8 column order; q4 even columns, then odd */
            const uint8_t *lo = q8 ? xb + AK * (size_t)b : xb + 128 * (size_t)(b / 4) + 16 * (b % 4);
            const uint8_t *hi = q8 ? lo + 16 : lo + 64;
            for (int kk = 0; kk < 4; kk++) {
                memcpy(tb + 64 * kk, lo + 4 * kk, 4);
                memcpy(tb + 64 * (kk + 4), hi + 4 * kk, 4);
            }
            dt[(size_t)b * AN + tn] = X->d[t * g->z.d_floats + smoe_qx_dpos(b)];
        }
        if (s0 == 0)
            for (uint32_t k = 0; k < g->ng8; k++) gt[(size_t)k * AN + tn] = X->gsum[t * g->z.gsum_floats + k];
    }
}

AMX_ATTR size_t smoe_avx512_amx_tiles_bytes(uint32_t cols, uint8_t format, uint32_t G, uint32_t n, uint32_t *items) {
    amx_shape g;
    if (!amx_shape_of(cols, format, G, &g) || n == 0) return 0;
    const uint32_t ntiles = (n + AN - 1) / AN;
    *items = ntiles * g.ngr;
    return ntiles * g.tile;
}

AMX_ATTR size_t smoe_avx512_amx_tiles_cap(uint32_t cols, uint32_t n) {
    amx_shape g;
    const uint32_t c = cols < AMAXC ? (cols + 31) / 32 * 32 : AMAXC; /* wider rows: not the kernel's */
    if (n == 0 || c == 0 || !amx_shape_of(c, SMOE_FMT_Q8, 32, &g)) return 0; /* group 32: the most group sums */
    return (size_t)(n + AN - 1) / AN * g.tile;
}

AMX_ATTR void smoe_avx512_amx_tiles(const smoe_qx *X, uint32_t n, void *buf, uint32_t i0, uint32_t i1) {
    amx_shape g;
    if (!amx_shape_of(X->cols, X->wformat, X->group, &g)) return;
    /* item i: span i % ngr of tile i / ngr; a run of items within one tile packed at once */
    while (i0 < i1) {
        const uint32_t T = i0 / g.ngr, s0 = i0 % g.ngr, s1 = (i1 - T * g.ngr < g.ngr) ? i1 - T * g.ngr : g.ngr;
        amx_pack(X, &g, n, T, s0, s1, (uint8_t *)buf + T * g.tile);
        i0 = T * g.ngr + s1;
    }
}

AMX_ATTR bool smoe_avx512_amx_matmul_rows_qx(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n,
                                             float *y, size_t ldy, uint32_t r0, uint32_t r1) {
    const uint32_t G = W->group, cols = W->cols;
    amx_shape g;
    if (!amx_shape_of(cols, W->format, G, &g) || n == 0) return false;
    if (r0 >= r1) return true;
    const bool q8 = W->format == SMOE_FMT_Q8;
    const uint32_t ng = cols / G, ng8 = g.ng8, up = g.up, ngr = g.ngr;
    const uint32_t nblk = g.nblk, upto = 2 * up + SPAD;
    const size_t rb = q8 ? cols : cols / 2, sbytes = sf_bytes(W->scale_format), lda = (size_t)nblk * AK;
    const size_t ls = upto + 16, lb = ng8 + 16; /* a row's σ and biases as load_scales writes them (zeros after) */
    const uint8_t *scales = w + W->scales_off, *biases = w + W->biases_off;
    const uint32_t nb_cols = cols / AK, gshift = G == 32 ? 0 : G == 64 ? 1 : 2; /* blocks of the row; of a group: 1 << gshift */

    /* the blocks in the order the lanes take them: lane j's chain over the groups k of 4 units
     * (block 2(4k + j%4) + j/4), then lane j + 1's */
    uint16_t order[8 * (AMAXU / 4)];
    for (uint32_t j = 0, q = 0; j < 8; j++)
        for (uint32_t k = 0; k < ngr; k++) order[q++] = (uint16_t)(2 * (4 * k + j % 4) + j / 4);

    /* stack, ~170 KB at AMAXC: a token tile packed (where X brings none), the unpacked panel, and
     * their floats */
    _Alignas(64) uint8_t own[2 * AMAXU * 512 + sizeof(float) * AN * (2 * AMAXU + AMAXG)];
    _Alignas(64) uint8_t ap[AM * 2 * AMAXU * AK];   /* (16 rows, blocks · 32) unpacked weights */
    _Alignas(64) float sg[AM * (AMAXG + 2 * SPAD)]; /* (16 rows, groups) σ, ls apart */
    _Alignas(64) float bi[AM * (AMAXG + SPAD)];     /* (16 rows, groups) biases, lb apart */
    _Alignas(64) int32_t cb[2][2][AM * AN];         /* two pairs of blocks' C */
    _Alignas(64) float tot[8][AM * AN];             /* the lanes' totals of a panel's tile */

    _Alignas(64) amx_tilecfg prev, cfg;
    _tile_storeconfig(&prev); /* all zeros where none is loaded */
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

    /* token tiles [T0, T0 + per): every tile at once where X brings them packed, else one at a time,
     * packed here */
    const uint32_t ntiles = (n + AN - 1) / AN, per = X->tiles ? ntiles : 1;
    for (uint32_t T0 = 0; T0 < ntiles; T0 += per) {
        if (!X->tiles) amx_pack(X, &g, n, T0, 0, ngr, own);
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
            for (uint32_t T = T0; T < T0 + per; T++) {
            /* B, d and the group sums of token tile T */
            const uint8_t *bt = X->tiles ? (const uint8_t *)X->tiles + T * g.tile : own;
            const float *dt = (const float *)(const void *)(bt + (size_t)nblk * 512), *gt = dt + (size_t)nblk * AN;
            const uint32_t t0 = AN * T, nt = n - t0 < AN ? n - t0 : AN;
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
    }
    if (prev.palette)
        _tile_loadconfig(&prev);
    else
        _tile_release();
    return true;
}

/* Tests only: the calling thread's tile configuration, loaded (cfg NULL: released) and stored (64
 * bytes; all zeros where none is loaded), to check that the product gives it back as it found it */
AMX_ATTR void smoe_avx512_amx_tilecfg_set(const void *cfg) {
    if (cfg)
        _tile_loadconfig(cfg);
    else
        _tile_release();
}
AMX_ATTR void smoe_avx512_amx_tilecfg_get(void *cfg) { _tile_storeconfig(cfg); }

#undef AMX_INLINE
#undef AMX_ATTR

