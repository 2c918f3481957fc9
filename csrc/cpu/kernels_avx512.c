/* kernels_avx512.c — AVX-512 instances of the 8-bit-activation products (smoe_matmul_rows_qx).
 *
 * When they run
 * -------------
 * The build's baseline stays AVX2 (kernels_isa.h). This file alone holds AVX-512 code, in
 * functions marked with target attributes (no file-wide flag, so no other function of the
 * library can pick up an AVX-512 instruction, and every build recipe compiles it the same way).
 * kernels.c calls them only where cpu.c found AVX-512 F + BW + VL in cpuid and the OS saving
 * the ZMM and mask registers in XCR0 (xgetbv): the VNNI instance where the CPU has AVX512-VNNI,
 * the plain one (F + BW) otherwise. SMOE_NO_AVX512=1 turns both off (the AVX2 kernels run),
 * SMOE_NO_VNNI=1 the VNNI one (as it does for the AVX2 kernels). smoe_kernels() says which runs.
 *
 * What they must keep
 * -------------------
 * kernels_ref.c's arithmetic of smoe_matmul_rows_qx exactly: the bits of the reference (and of the
 * AVX2 instances) for every input. The integer block sums I are exact, so how they are formed
 * does not matter; the float part, per (row, token),
 *     tot[j] = fma((float)I_j, σ_j·d_j, tot[j])   j < 8, over the groups of 4 units in order
 *     y      = hsum8(tot) + hsum8(bia)
 * is done lane for lane: each reference lane j of a row is one lane of a 16-lane register that
 * holds two rows, in a permuted order (below); the same fma on a permuted lane is the same fma,
 * and one permute at the end puts the lanes back in the reference order for hsum8.
 *
 * How the integers are formed
 * ---------------------------
 *  - x's codes are re-laid once per call (per tile of tokens) into this file's own layout, int8:
 *    q4: per pair of units (128 columns, 64 weight bytes) the codes of the even columns (column
 *        128p + 2B at byte B) and then those of the odd ones: a weight byte's low nibble (an
 *        and) meets the even code at its own position and its high nibble (a shift and an and)
 *        the odd one, so the weights need no byte shuffle at all;
 *    q8: column order (the codes lie in [−127, 127], so int8 holds them), as the weights lie.
 *  - u8·s8 products summed 4 to an int32 lane: vpdpbusd (VNNI), or vpmaddubsw + vpmaddwd (BW;
 *    for q8 each weight byte is split in nibbles, since vpmaddubsw saturates 255·127·2, and the
 *    high one weighted 16 by vpmaddwd). q4: a unit pair's product holds block b of unit 2p + u
 *    in its 128-bit quarter 2u + b. q8: a unit's product holds block b in quarters 2b and 2b + 1;
 *    two units' products are folded to the q4 layout (two 128-bit shuffles and an add).
 *  - red4: 4 such registers (2 pairs × 2 rows) → 1 by two rounds of unpack + add. Lane 4Q + s
 *    then holds, for row s/2, the sum of quarter Q of pair s%2: the block (unit 2(s%2) + Q/2,
 *    block Q%2), whose reference lane is CMAP below.
 *
 * One token (n = 1) and a few (few_path: up to 4 of q4, 6 of q8 by default) have their own path
 * (qx_rows_few): one row at a time, read in place and prefetched into L2 AHEAD_BYTES on, its weights
 * loaded once per pass of up to TB tokens, two groups of 4 units per 16-lane register of integer sums, whose halves go into
 * each token's one 8-lane fma chain in turn (kernels.c says on which CPUs decode takes it rather
 * than the AVX2 one).
 *
 * Shapes: rows two at a time (an odd last row is computed twice, written once), tokens in
 * register blocks of up to TB, in tiles whose re-laid codes fit XBYTES of stack. Rows of more
 * than MAXC columns, or a group size other than 32/64/128, are not taken (false: kernels.c then
 * runs the AVX2 kernel), a choice by shape only. Nothing is read outside the row: a row's last
 * partial pair or unit is read with a masked load. Stack: ~95 KB (the tile, σ and d of a row pair).
 *
 * Not here (yet): the f32/bf16 products, RMSNorm and attention run the AVX2 kernels on every
 * x86-64 CPU; an AVX-512 version of them would have to keep the AVX2 kernels' 8-lane order.
 */
#include "kernels_isa.h"

#if SMOE_HAVE_AVX512

#include <stdatomic.h>
#include <string.h>

#ifndef SMOE_AVX512_EMULATE
#include <immintrin.h>
#define TARGET(isa) __attribute__((target(isa)))
#else
/* tests only (tests/c/avx512_emu.h): the intrinsics as plain C, so that the C tests check this
 * file's logic bit for bit on a CPU without AVX-512; no target attributes then */
#include "avx512_emu.h"
#define TARGET(isa)
#endif

#define A512 TARGET("avx512f,avx512bw,avx512vl")
#define INLINE static inline __attribute__((always_inline)) A512

enum {
    MAXC = 16384,       /* columns of a row these kernels take, as the AVX2 ones */
    MAXU = MAXC / 64,   /* units of 64 columns of such a row */
    MAXG = MAXC / 32,   /* its groups at most (group size 32) */
    SPAD = 16,          /* zero floats after a row's scales: σ is loaded 16 at a time (and 16 more of room) */
    XBYTES = 64 * 1024, /* a tile's re-laid codes: 64 bytes per unit and token */
    TB = 4,             /* tokens of a register block */
};

#ifndef QX512_AHEAD_BYTES
/* bytes ahead the matrix-vector product prefetches its weights, into L2 (bench/RESULTS.md, "The
   one-token product's prefetch into L2"): on the Xeon, 2 threads, weights from DRAM, into L1 four
   rows on (4 KiB of q4, 8 KiB of q8) it read at 80-88 % of the plain read rate, into L2 6 KiB on
   at 100-110 % (the plain read has no prefetch); 4 and 8 KiB on were slower for q4 */
#define QX512_AHEAD_BYTES 6144
#endif
#ifndef QX512_BATCH_AHEAD
#define QX512_BATCH_AHEAD 2 /* rows ahead the batched products prefetch their weights (0: none) */
#endif
/* The most tokens the q4 and q8 products take a row at a time (qx_rows_few, as n = 1 is) rather
   batched, at start (smoe_avx512_few_limits changes them), and the bytes of their re-laid codes
   that path keeps on the stack. On the Emerald Rapids (bench/RESULTS.md, "A few tokens a row on
   AVX-512"), weights from memory, row at a time over batched: q8 1.03-1.40x at 2-6 tokens, 16 and 4
   threads, 12 of 12 figures (at 8: 0.80-1.26x with a call per row, 1.14-1.25x in the present
   form). q4 in the present form (the same machine, a day later, `qx_isa few 16` twice and `few 4`):
   gates 1.01-1.34x at 2-4 tokens (18 of 18), downs 0.96-1.09x, the downs below 1 from 6 tokens on;
   the engine's 45-token prefill at 16 threads 1.01-1.09x faster with q4 up to 4 tokens a row (three
   alternated rounds), 8 tokens unchanged. */
#ifndef QX512_FEW_N4
#define QX512_FEW_N4 4
#endif
#ifndef QX512_FEW_N8
#define QX512_FEW_N8 6
#endif
#ifndef QX512_FEW_XBYTES
#define QX512_FEW_XBYTES 65536
#endif
enum {
    AHEAD_BYTES = QX512_AHEAD_BYTES,
    BATCH_AHEAD = QX512_BATCH_AHEAD,
    FEW_MAX = 2 * TB, /* the most tokens qx_rows_few takes: two passes */
    FEW_XBYTES = QX512_FEW_XBYTES,
};
_Static_assert(FEW_XBYTES >= MAXU * 64, "the row-at-a-time path takes one token of the widest rows");
_Static_assert(QX512_FEW_N4 >= 1 && QX512_FEW_N4 <= FEW_MAX && QX512_FEW_N8 >= 1 && QX512_FEW_N8 <= FEW_MAX,
               "the row-at-a-time path's token limits");

static _Atomic uint32_t few_n4 = QX512_FEW_N4, few_n8 = QX512_FEW_N8;

_Static_assert(TB == 4, "qx_rows_few's passes (its cases) and qx_block_any's blocks are of up to 4 tokens");

void smoe_avx512_few_limits(uint32_t n4, uint32_t n8) {
    atomic_store_explicit(&few_n4, n4 == 0 ? QX512_FEW_N4 : n4 > FEW_MAX ? FEW_MAX : n4, memory_order_relaxed);
    atomic_store_explicit(&few_n8, n8 == 0 ? QX512_FEW_N8 : n8 > FEW_MAX ? FEW_MAX : n8, memory_order_relaxed);
}

/* whether n tokens of a q4 (q8) product with `up` units a row take the row-at-a-time path */
static inline bool few_path(uint32_t n, bool q8, uint32_t up) {
    const uint32_t lim = atomic_load_explicit(q8 ? &few_n8 : &few_n4, memory_order_relaxed);
    return n == 1 || (n <= lim && (size_t)n * 64 * up <= FEW_XBYTES);
}

INLINE bool group_ok(uint32_t G) { return G == 32 || G == 64 || G == 128; }

/* bytes of one scale or bias */
INLINE size_t sf_bytes(uint8_t sf) { return sf == SMOE_SCALE_F32 ? 4 : 2; }

/* ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), kernels_ref.c's hsum8 */
INLINE float hsum8(__m256 v) {
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
    return _mm_cvtss_f32(s1);
}

/* hsum8 of Σ_g fma(b[g..g+8), X[g..g+8)) over ng8 (a multiple of 8) zero-padded groups: bia */
INLINE float bias_dot(const float *b, const float *X, uint32_t ng8) {
    __m256 a = _mm256_setzero_ps();
    for (uint32_t g = 0; g < ng8; g += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(b + g), _mm256_loadu_ps(X + g), a);
    return hsum8(a);
}

/* dst = the ng scales (or biases; f16, bf16 or f32) at src as f32, exactly; zeros after, up to
 * `upto` floats at least (the next multiple of 16: dst has room) */
INLINE void load_scales(float *dst, const uint8_t *src, uint32_t ng, uint8_t sf, uint32_t upto) {
    uint32_t g = 0;
    if (sf == SMOE_SCALE_F32) {
        memcpy(dst, src, 4 * (size_t)ng);
        g = ng;
    }
    for (; g < ng; g += 16) {
        const __mmask16 m = ng - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (ng - g)) - 1);
        const __m256i h = _mm256_maskz_loadu_epi16(m, src + 2 * (size_t)g);
        const __m512 f = sf == SMOE_SCALE_F16 ? _mm512_cvtph_ps(h)
                                              : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        _mm512_mask_storeu_ps(dst + g, m, f);
    }
    for (uint32_t z = ng; z < upto; z += 16) _mm512_storeu_ps(dst + z, _mm512_setzero_ps());
}

/* One token's codes, `up` units in the reference layout (kernels_ref.c) at src, into this file's
 * layout at dst (64 bytes per unit, above). */
A512 static void relayout(uint8_t *dst, const void *src, uint32_t up, bool q8) {
    if (!q8) {
        /* in each 16-column chunk, the 8 even columns' codes then the 8 odd ones; then the
         * chunks' halves in column order (the reference's chunks are columns 0–15, 32–47,
         * 16–31, 48–63 of a unit), unit 2p then 2p + 1 */
        const __m512i split = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
        const __m512i even = _mm512_setr_epi64(0, 4, 2, 6, 8, 12, 10, 14), odd = _mm512_setr_epi64(1, 5, 3, 7, 9, 13, 11, 15);
        const uint8_t *s = src;
        for (uint32_t u = 0; u < up; u += 2) {
            const __m512i a = _mm512_shuffle_epi8(_mm512_loadu_si512(s + 64 * (size_t)u), split);
            const __m512i b = _mm512_shuffle_epi8(_mm512_loadu_si512(s + 64 * (size_t)u + 64), split);
            _mm512_store_si512(dst + 64 * (size_t)u, _mm512_permutex2var_epi64(a, even, b));
            _mm512_store_si512(dst + 64 * (size_t)u + 64, _mm512_permutex2var_epi64(a, odd, b));
        }
        return;
    }
    /* int16 → int8 (exact: |code| ≤ 127); the reference's 8-column runs are columns 0–7, 32–39,
     * 8–15, 40–47, 16–23, 48–55, 24–31, 56–63; after the in-lane pack they sit as the 64-bit
     * lanes 0, 2, 4, 6, 1, 3, 5, 7 hold columns 0, 8, 16, …, 56 — put back in order */
    const __m512i order = _mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7);
    const int16_t *s = src;
    for (uint32_t u = 0; u < up; u++) {
        const __m512i a = _mm512_loadu_si512(s + 64 * (size_t)u), b = _mm512_loadu_si512(s + 64 * (size_t)u + 32);
        _mm512_store_si512(dst + 64 * (size_t)u, _mm512_permutexvar_epi64(order, _mm512_packs_epi16(a, b)));
    }
}

/* CMAP[4Q + s]: the reference lane (kernels_ref.c's j: unit j%4 of the group, block j/4) of lane
 * 4Q + s of red4's result: unit 2(s%2) + Q/2, block Q%2 */
#define CMAP 0, 2, 0, 2, 4, 6, 4, 6, 1, 3, 1, 3, 5, 7, 5, 7
/* its inverse: lanes [row 0's reference lanes 0..7 | row 1's] of a red4-ordered register */
#define CINV 0, 8, 1, 9, 4, 12, 5, 13, 2, 10, 3, 11, 6, 14, 7, 15
static const int32_t cmap_lanes[16] __attribute__((aligned(64))) = {CMAP};
static const int32_t cinv_lanes[16] __attribute__((aligned(64))) = {CINV};

/* σ of one group of 4 units for two rows in red4's lane order: from s0 and s1, the rows' scales
 * by group (zero-padded by SPAD), base the group's first unit (a multiple of 4). Block b of unit
 * u lies in group 2u + b (G = 32), u (64), u/2 (128). */
INLINE __m512 sigma2(const uint32_t G, const float *s0, const float *s1, uint32_t u) {
#define OFF32(j) (2 * ((j) % 4) + (j) / 4)
#define OFF64(j) ((j) % 4)
#define OFF128(j) (((j) % 4) / 2)
#define IDX(OFF, a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p)                                                       \
    _mm512_setr_epi32(OFF(a), OFF(b), 16 + OFF(c), 16 + OFF(d), OFF(e), OFF(f), 16 + OFF(g), 16 + OFF(h), OFF(i),     \
                      OFF(j), 16 + OFF(k), 16 + OFF(l), OFF(m), OFF(n), 16 + OFF(o), 16 + OFF(p))
#define IDX_(...) IDX(__VA_ARGS__)
#define IDXG(OFF) IDX_(OFF, CMAP)
    if (G == 64) return _mm512_permutex2var_ps(_mm512_loadu_ps(s0 + u), IDXG(OFF64), _mm512_loadu_ps(s1 + u));
    if (G == 32)
        return _mm512_permutex2var_ps(_mm512_loadu_ps(s0 + 2 * u), IDXG(OFF32), _mm512_loadu_ps(s1 + 2 * u));
    return _mm512_permutex2var_ps(_mm512_loadu_ps(s0 + u / 2), IDXG(OFF128), _mm512_loadu_ps(s1 + u / 2));
#undef IDXG
#undef IDX_
#undef IDX
#undef OFF128
#undef OFF64
#undef OFF32
}

/* 64 bytes of a row at off, zeros past its rb bytes (never read) */
INLINE __m512i load_w(const uint8_t *row, size_t off, size_t rb) {
    if (off + 64 <= rb) return _mm512_loadu_si512(row + off);
    if (off >= rb) return _mm512_setzero_si512();
    return _mm512_maskz_loadu_epi8(((__mmask64)1 << (rb - off)) - 1, row + off);
}

/* The q4 layout from two q8 units' products (block b of unit k in quarters 2b, 2b + 1): block b
 * of unit k in quarter 2k + b */
INLINE __m512i fold(__m512i p0, __m512i p1) {
    return _mm512_add_epi32(_mm512_shuffle_i32x4(p0, p1, 0x88), _mm512_shuffle_i32x4(p0, p1, 0xdd));
}

/* Two pairs' products of row 0 (a, b) and of row 1 (c, d) → lane 4Q + s: the sum of quarter Q of
 * (a, b, c, d)[s] */
INLINE __m512i red4(__m512i a, __m512i b, __m512i c, __m512i d) {
    const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
}

/* an instance's inline functions: its own target (a helper's may be narrower, never wider) */
#define QX_INLINE static inline __attribute__((always_inline)) QX_ATTR

#define QX(name) name##_bw
#define QX_ATTR A512
#define QX_VNNI 0
#include "kernels_avx512_qx.h"
#undef QX
#undef QX_ATTR
#undef QX_VNNI

#define QX(name) name##_vnni
#define QX_ATTR TARGET("avx512f,avx512bw,avx512vl,avx512vnni")
#define QX_VNNI 1
#include "kernels_avx512_qx.h"
#undef QX
#undef QX_ATTR
#undef QX_VNNI
#undef QX_INLINE

#include "kernels_avx512_ggml.h" /* the GGML block formats (smoe_avx512_ggml_qx) */

#if SMOE_HAVE_AMX
#include "kernels_avx512_amx.h" /* q4 and q8 on AMX tiles (smoe_avx512_amx_matmul_rows_qx) */
#endif

#endif /* SMOE_HAVE_AVX512 */
