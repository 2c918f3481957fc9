/* kernels_ref.c — the portable reference kernels (kernels.h), and the kernels every build shares.
 *
 * The reduction-order rule
 * ------------------------
 * Float addition is not associative, so a sum's bits depend on the order of its terms. The
 * layer-major prefill multiplies a whole chunk of tokens by a weight matrix at once; the
 * token-serial step multiplies one. The two must agree bit for bit, and neither may depend on
 * how the rows were cut between threads. So every output element here is reduced in one order
 * that is a function of its own shape only — never of n, of [r0, r1), or of the thread count:
 *
 *   dot(w, x) over cols c = 0 .. cols-1:
 *     16 lane accumulators a[0..15], all starting at +0.0f;
 *     for c in increasing order: a[c % 16] += w[c] · x[c]   (product rounded, then added:
 *                                                             the build uses -ffp-contract=off)
 *     then the fixed tree  s8[j] = a[j] + a[j+8]    (j < 8)
 *                          s4[j] = s8[j] + s8[j+4]  (j < 4)
 *                          s2[j] = s4[j] + s4[j+2]  (j < 2)
 *                          dot   = s2[0] + s2[1]
 *
 * The tree is what a SIMD horizontal sum does naturally (two 8-wide registers added, then the
 * 128-bit halves, then the 64-bit halves, then the last pair), so the AVX2 and NEON kernels can
 * reproduce it exactly; the 16 independent lanes also give the compiler room to vectorise this
 * file. Where w is quantised, w[c] is first dequantised exactly as docs/vault.md says
 * (float(scale)·float(q) + float(bias), a separate multiply and add), so the dequantised value
 * is the same whether it is produced once per row and reused for a whole batch of tokens (as
 * smoe_matmul_rows does) or once per token.
 *
 * How smoe_matmul_rows keeps to the rule while reusing work: it walks rows in tiles of 4 and
 * tokens in tiles of 32; for each tile it dequantises a block of up to 1024 columns of the 4
 * rows into a stack buffer once and feeds it to every token of the tile. Each (row, token) pair
 * owns its own 16 lane accumulators, which persist across the column blocks, and blocks start
 * at multiples of 16, so lane j still sees columns c ≡ j (mod 16) in increasing order: tiling
 * rows, tokens or columns changes which work is shared, never the order of any one sum.
 *
 * The other reductions (RMSNorm's sum of squares, attention's q·k) use the same 16-lane dot;
 * softmax sums and attention's weighted sum of V run in plain index / position order. All of
 * them are per token, so n never enters.
 *
 * Numerics follow Hugging Face transformers' Qwen3-MoE in float32: RMSNorm is
 * weight · (x · 1/sqrt(mean(x²) + eps)); attention scales scores by head_dim^-0.5 rounded to
 * float; softmax is max-subtracted with expf, each entry divided by the sum; silu(g) is
 * g / (1 + expf(-g)); the router's top-k weights are divided by their sum.
 *
 * Assumes a little-endian host (the vault is little-endian and is used in place).
 *
 */
#include "ggml_blocks.h"
#include "kernels_isa.h"
#include "ggml_iq_grids.h" /* the IQ codebooks, defined here */

#include <math.h>
#include <string.h>

enum {
    LANES = 16,  /* lane accumulators of every dot product */
    BLOCK = 1024, /* columns dequantised at a time; a multiple of 128 (the largest quant group) and of LANES */
    RTILE = 4,   /* rows sharing one pass over the tokens */
    TTILE = 32,  /* tokens sharing one dequantised block */
};

/* ------------------------------------------------------------------------ scalar formats */

static inline float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float bf16_to_f32(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

/* IEEE half → float, exactly, without relying on F16C. */
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1f) return f32_from_bits(sign | 0x7f800000u | (man << 13)); /* inf, nan */
    if (exp != 0) return f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
    /* zero or subnormal: man · 2^-24, exact in float (a normal float for man > 0) */
    float v = (float)man * 0x1p-24f;
    return sign ? -v : v;
}

static inline uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Scale (or bias) i of the array at p (f16, bf16 or f32), as f32 (exactly) */
static inline float load_scale(uint8_t scale_format, const uint8_t *p, size_t i) {
    if (scale_format == SMOE_SCALE_F32) return f32_from_bits(load_u32(p + 4 * i));
    uint16_t v = load_u16(p + 2 * i);
    return scale_format == SMOE_SCALE_F16 ? f16_to_f32(v) : bf16_to_f32(v);
}

/* The dequantisation and lane loops are written twice: with GCC/Clang vector extensions (a
 * 16-lane accumulator held as two vectors of 8 floats, lanes 0–7 and 8–15; every lane is an
 * independent IEEE float, so the arithmetic is exactly that of the scalar loop, only laid out so
 * that the compiler keeps the accumulators in registers), and as plain C for other compilers or
 * with -DSMOE_KERNELS_SCALAR. The tests build both and compare their bits. Vectors are moved only
 * with memcpy and never passed to or returned from functions, which keeps the ABI out of it. */
#if defined(__GNUC__) && !defined(SMOE_KERNELS_SCALAR)
#define SMOE_LANES_VEC 1
typedef float v8f __attribute__((vector_size(8 * sizeof(float))));
typedef uint32_t v8u __attribute__((vector_size(8 * sizeof(uint32_t))));
typedef int32_t v8i __attribute__((vector_size(8 * sizeof(int32_t)))); /* codes → float via signed ints */
typedef uint16_t v8h __attribute__((vector_size(8 * sizeof(uint16_t))));
#define V8_LOAD(v, p) memcpy(&(v), (p), sizeof(v8f))
#define V8_STORE(p, v) memcpy((p), &(v), sizeof(v8f))
#else
#define SMOE_LANES_VEC 0
#endif

/* ----------------------------------------------------------------------- dequantisation */

/* buf[c] = bf16 src[c] widened, c < nc */
static inline void deq_bf16(float *restrict buf, const uint8_t *restrict src, uint32_t nc) {
    uint32_t c = 0;
#if SMOE_LANES_VEC
    for (; c + 8 <= nc; c += 8) {
        v8h h;
        memcpy(&h, src + 2 * c, sizeof h);
        v8u u = __builtin_convertvector(h, v8u) << 16;
        memcpy(buf + c, &u, sizeof u);
    }
#endif
    for (; c < nc; c++) buf[c] = bf16_to_f32(load_u16(src + 2 * c));
}

/* o[k] = s·q[k] + b for the G codes of a q8 group (compilers vectorise this one unaided) */
static inline void deq_q8(float *restrict o, const uint8_t *restrict q, uint32_t G, float s, float b) {
    for (uint32_t k = 0; k < G; k++) {
        float sq = s * (float)q[k];
        o[k] = sq + b;
    }
}

/* the same for a q4 group: G/8 words of 8 codes, code k of a word in bits [4k, 4k+4) */
static inline void deq_q4(float *restrict o, const uint8_t *restrict q, uint32_t G, float s, float b) {
#if SMOE_LANES_VEC
    const v8u shift = {0, 4, 8, 12, 16, 20, 24, 28};
    for (uint32_t i = 0; i < G / 8; i++) {
        v8u word = (v8u){0} + load_u32(q + 4 * i);
        v8u code = (word >> shift) & 15u;
        v8f sq = __builtin_convertvector((v8i)code, v8f) * s;
        v8f r = sq + b;
        V8_STORE(o + 8 * i, r);
    }
#else
    for (uint32_t i = 0; i < G / 8; i++) {
        const uint32_t word = load_u32(q + 4 * i);
        for (int k = 0; k < 8; k++) {
            float sq = s * (float)((word >> (4 * k)) & 15u);
            o[8 * i + k] = sq + b;
        }
    }
#endif
}

/* Columns [c0, c0 + nc) of row `row` of W as floats. For f32 the tensor's own memory is
 * returned; otherwise the values are written to buf (nc floats) and buf is returned.
 * For q8/q4, c0 and nc are multiples of the group size G (cols is; BLOCK is). */
static const float *row_block(const smoe_tensor *W, const uint8_t *w, uint32_t row, uint32_t c0, uint32_t nc,
                              float *buf) {
    const uint64_t cols = W->cols;
    switch (W->format) {
    case SMOE_FMT_F32:
        return (const float *)(const void *)(w + 4 * ((uint64_t)row * cols + c0));
    case SMOE_FMT_BF16: {
        deq_bf16(buf, w + 2 * ((uint64_t)row * cols + c0), nc);
        return buf;
    }
    case SMOE_FMT_Q8:
    case SMOE_FMT_Q4: {
        const uint32_t G = W->group;
        const uint64_t g0 = (uint64_t)row * (cols / G) + c0 / G; /* the block's first group */
        for (uint32_t g = 0; g < nc / G; g++) {
            const float s = load_scale(W->scale_format, w + W->scales_off, g0 + g);
            const float b = load_scale(W->scale_format, w + W->biases_off, g0 + g);
            if (W->format == SMOE_FMT_Q8)
                deq_q8(buf + g * G, w + (uint64_t)row * cols + c0 + (uint64_t)g * G, G, s, b);
            else
                deq_q4(buf + g * G, w + ((uint64_t)row * cols + c0) / 2 + (uint64_t)g * (G / 2), G, s, b);
        }
        return buf;
    }
    default: {
        uint32_t bs, ts;
        if (!smoe_ggml_block(W->format, &bs, &ts)) { /* the vault parser admits no other format */
            memset(buf, 0, (size_t)nc * sizeof *buf);
            return buf;
        }
        /* c0 and nc are multiples of the block size (cols is; BLOCK is a multiple of 256) */
        const uint8_t *blk = w + ((uint64_t)row * (cols / bs) + c0 / bs) * ts;
        for (uint32_t c = 0; c < nc; c += bs, blk += ts) gb_dequant_block(W->format, blk, buf + c);
        return buf;
    }
    }
}

void smoe_dequant_row(const smoe_tensor *W, const uint8_t *w, uint32_t row, float *out) {
    for (uint32_t c0 = 0; c0 < W->cols; c0 += BLOCK) {
        uint32_t nc = W->cols - c0 < BLOCK ? W->cols - c0 : BLOCK;
        const float *src = row_block(W, w, row, c0, nc, out + c0);
        if (src != out + c0) memcpy(out + c0, src, (size_t)nc * sizeof *out);
    }
}

/* --------------------------------------------------------------------- the fixed-order dot */

static inline float lanes_sum(const float a[LANES]) {
    float s8[8], s4[4], s2[2];
    for (int j = 0; j < 8; j++) s8[j] = a[j] + a[j + 8];
    for (int j = 0; j < 4; j++) s4[j] = s8[j] + s8[j + 4];
    for (int j = 0; j < 2; j++) s2[j] = s4[j] + s4[j + 2];
    return s2[0] + s2[1];
}

/* a[c % 16] += w[c]·x[c] for c in [0, nc); the block starts at a multiple of 16. */
static inline void lanes_acc(float a[restrict LANES], const float *restrict w, const float *restrict x, uint32_t nc) {
    uint32_t c = 0;
#if SMOE_LANES_VEC
    v8f lo, hi, wl, wh, xl, xh;
    V8_LOAD(lo, a);
    V8_LOAD(hi, a + 8);
    for (; c + LANES <= nc; c += LANES) {
        V8_LOAD(wl, w + c);
        V8_LOAD(wh, w + c + 8);
        V8_LOAD(xl, x + c);
        V8_LOAD(xh, x + c + 8);
        v8f pl = wl * xl, ph = wh * xh;
        lo += pl;
        hi += ph;
    }
    V8_STORE(a, lo);
    V8_STORE(a + 8, hi);
#else
    for (; c + LANES <= nc; c += LANES)
        for (int j = 0; j < LANES; j++) {
            float p = w[c + j] * x[c + j];
            a[j] += p;
        }
#endif
    for (; c < nc; c++) {
        float p = w[c] * x[c];
        a[c % LANES] += p;
    }
}

/* lanes_acc for four rows against one x: the same per-row order, one load of x. */
static inline void lanes_acc4(float a[restrict RTILE][LANES], const float *restrict w0, const float *restrict w1,
                              const float *restrict w2, const float *restrict w3, const float *restrict x,
                              uint32_t nc) {
    uint32_t c = 0;
#if SMOE_LANES_VEC
    const float *wr[RTILE] = {w0, w1, w2, w3};
    v8f lo[RTILE], hi[RTILE];
    for (int i = 0; i < RTILE; i++) {
        V8_LOAD(lo[i], a[i]);
        V8_LOAD(hi[i], a[i] + 8);
    }
    for (; c + LANES <= nc; c += LANES) {
        v8f xl, xh;
        V8_LOAD(xl, x + c);
        V8_LOAD(xh, x + c + 8);
        for (int i = 0; i < RTILE; i++) {
            v8f wl, wh;
            V8_LOAD(wl, wr[i] + c);
            V8_LOAD(wh, wr[i] + c + 8);
            v8f pl = wl * xl, ph = wh * xh;
            lo[i] += pl;
            hi[i] += ph;
        }
    }
    for (int i = 0; i < RTILE; i++) {
        V8_STORE(a[i], lo[i]);
        V8_STORE(a[i] + 8, hi[i]);
    }
#else
    for (; c + LANES <= nc; c += LANES)
        for (int j = 0; j < LANES; j++) {
            const float xv = x[c + j];
            float p0 = w0[c + j] * xv, p1 = w1[c + j] * xv, p2 = w2[c + j] * xv, p3 = w3[c + j] * xv;
            a[0][j] += p0;
            a[1][j] += p1;
            a[2][j] += p2;
            a[3][j] += p3;
        }
#endif
    for (; c < nc; c++) {
        const float xv = x[c];
        float p0 = w0[c] * xv, p1 = w1[c] * xv, p2 = w2[c] * xv, p3 = w3[c] * xv;
        a[0][c % LANES] += p0;
        a[1][c % LANES] += p1;
        a[2][c % LANES] += p2;
        a[3][c % LANES] += p3;
    }
}

static float dot16(const float *w, const float *x, uint32_t n) {
    float a[LANES] = {0};
    lanes_acc(a, w, x, n);
    return lanes_sum(a);
}

/* ------------------------------------------------------------------------------- matmul */

void smoe_ref_matmul_rows(const smoe_tensor *W, const uint8_t *w, const float *x, size_t ldx, uint32_t n,
                          float *y, size_t ldy, uint32_t r0, uint32_t r1) {
    const uint32_t cols = W->cols;
    float wbuf[RTILE][BLOCK];        /* (rows of the tile, block columns) dequantised weights */
    float acc[TTILE][RTILE][LANES];  /* (tokens of the tile, rows of the tile, lanes) */
    for (uint32_t r = r0; r < r1; r += RTILE) {
        const uint32_t nr = r1 - r < RTILE ? r1 - r : RTILE;
        for (uint32_t t0 = 0; t0 < n; t0 += TTILE) {
            const uint32_t nt = n - t0 < TTILE ? n - t0 : TTILE;
            memset(acc, 0, sizeof acc);
            for (uint32_t c0 = 0; c0 < cols; c0 += BLOCK) {
                const uint32_t nc = cols - c0 < BLOCK ? cols - c0 : BLOCK;
                const float *wr[RTILE];
                for (uint32_t i = 0; i < nr; i++) wr[i] = row_block(W, w, r + i, c0, nc, wbuf[i]);
                for (uint32_t t = 0; t < nt; t++) {
                    const float *xt = x + (t0 + t) * ldx + c0;
                    if (nr == RTILE)
                        lanes_acc4(acc[t], wr[0], wr[1], wr[2], wr[3], xt, nc);
                    else
                        for (uint32_t i = 0; i < nr; i++) lanes_acc(acc[t][i], wr[i], xt, nc);
                }
            }
            for (uint32_t t = 0; t < nt; t++)
                for (uint32_t i = 0; i < nr; i++) y[(t0 + t) * ldy + r + i] = lanes_sum(acc[t][i]);
        }
    }
}

/* ------------------------------------------------------------ 8-bit activations (q8, q4) */

/* The arithmetic of smoe_matmul_rows_qx, in full (kernels.h says what it approximates).
 *
 * Columns are taken in units of 64 (two blocks of 32), whatever the weights' group size G (32,
 * 64 or 128): a token has U = ceil(cols / 64) units, padded with empty units to a multiple of 4.
 * A block past cols (the second half of the last unit when cols is an odd multiple of 32, and
 * both halves of a padding unit) is empty: d = 0 and codes 0.
 *
 * Quantising x (smoe_qx_prepare; the AVX2 version gives the same bytes, tested), per token, per
 * block b of 32 columns (q4 and q8 weights; the GGML formats: ref_ggml_prepare below): m = max|x_c|;
 * d = m / 127; codes round-half-even(x_c · (127 / m)),
 * which lie in [−127, 127]. A block with m < 2⁻¹⁰⁰ (or m = 0) gets d = 0 and codes 0; one with
 * an infinite or NaN x gets d = that value (NaN for a NaN) and codes 0, so the output is not
 * finite either. The group sum gsum_g (g < cols/G) is the f32 sum of the group's G x in the
 * order of kernels_avx2.c's group sums: lane j = x_j + x_{8+j} + … + x_{G−8+j}, then hsum8 below;
 * zeros after, up to a multiple of 8.
 *
 * Layout of one token's codes, per unit:
 *   q4 weights, int8:  columns 0–15, 32–47, 16–31, 48–63
 *   q8 weights, int16: columns 0–7, 32–39, 8–15, 40–47, 16–23, 48–55, 24–31, 56–63
 * — the orders in which AVX2 unpacks 64 of a row's weight codes, so that each 128-bit half of a
 * product holds one block. d, per 4 units k: d[8k + j] = d of unit 4k + j%4, block j/4.
 *
 * The product, for one (row, token), with I_{u,b} = Σ_{c ∈ block b of unit u} q_c · code_c exact
 * (|I| < 2²⁴, so (float)I is exact), σ_{u,b} the row's scale of the group that holds block (u, b)
 * (the group of column 64u + 32b; 0 for an empty block) and bias_g the row's biases:
 *   tot[j] = +0;  for k = 0, 1, …:  tot[j] = fma((float)I_{4k+j%4, j/4}, σ_{4k+j%4, j/4}·d[8k+j], tot[j])
 *   bia[j] = +0;  for k = 0, 1, …:  bia[j] = fma(bias_{8k+j}, gsum_{8k+j}, bia[j])
 *   y = hsum8(tot) + hsum8(bia),   hsum8(l) = ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
 * Padded groups have bias = gsum = 0 and empty blocks σ = d = I = 0: they add exactly nothing.
 * For G = 64, σ_{u,b} = s_u and this is the order of the earlier 64-only kernels, bit for bit.
 * The AVX2 and NEON kernels compute the same operations on vectors, so all agree bit for bit
 * (tests/c/test_kernels.c, test_kernels_neon.c). */

enum { QX_UNIT = 64, QX_UNITS = 4, QX_TINY_EXP = -100 };

/* units of 64 columns per token, padded to a multiple of 4 */
static uint32_t qx_units(uint32_t cols) { return (cols + QX_UNITS * QX_UNIT - 1) / (QX_UNITS * QX_UNIT) * QX_UNITS; }

smoe_qx_size smoe_qx_sizes(uint32_t cols, uint8_t wformat, uint32_t group) {
    const uint32_t up = qx_units(cols);
    smoe_qx_size z = {(size_t)up * QX_UNIT * (wformat == SMOE_FMT_Q8 ? 2 : 1), (size_t)up * 2,
                      (size_t)(cols / group + 7) / 8 * 8};
    return z;
}

/* Where column c (< 64) of a unit sits in the layout above. */
static inline uint32_t qx_pos(uint32_t c, bool q8) {
    if (!q8)
        return (c & ~48u) | ((c & 16u) << 1) | ((c & 32u) >> 1); /* swap the 16-column chunks 1 and 2 */
    return 16 * ((c & 31u) >> 3) + 8 * (c >> 5) + (c & 7u);
}

static inline float hsum8_ref(const float l[8]) { return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7])); }

static inline uint16_t f32_to_f16(float f);

/* f rounded to IEEE half (nearest-even) and widened back */
static inline float f16_round(float f) {
    const uint16_t h = f32_to_f16(f);
    uint8_t b[2];
    memcpy(b, &h, 2);
    return gb_f16(b);
}

/* The GGML formats' activations, quantised as ggml's CPU backend quantises them for the weight type
 * (gb_act_type; its x86 code), so that a product differs from llama.cpp's only in the order of its
 * float sums. Codes in column order; per block B of 32 columns d_B, and gsum_B the block's
 * dequantised sum, which meets the weights' mins:
 *   Q8_0 (Q4_0, Q5_0, Q8_0, IQ4_NL, MXFP4; ggml's AVX2 quantize_row_q8_0): m = max|x| over the
 *     block; codes round-half-even(x · (127 / m)); d = m / 127 rounded to f16 (the d ggml's dot
 *     products read); gsum = d · Σ codes.
 *   Q8_1 (Q4_1, Q5_1; quantize_row_q8_1): the same codes and d; gsum = f16((m / 127) · Σ codes),
 *     ggml's s.
 *   Q8_K (the K-quants and IQ4_XS; quantize_row_q8_K_ref): per 256 columns (8 blocks), M the first
 *     x of largest |x|; iscale = −127 / M; codes min(127, round-half-even(iscale · x)); every block's
 *     d = 1 / iscale; gsum = d · Σ codes (ggml's −dmin·d·Σ m·bsums, regrouped).
 * As for q4/q8: a scale group whose m is below 2⁻¹⁰⁰ gets d = 0 and codes 0; one holding an inf or
 * NaN gets codes 0, and each of its blocks d = its first NaN (else inf, else 0), so the output is not
 * finite either. Blocks past cols: d = gsum = 0, codes 0. */
static void ref_ggml_prepare(const float *x, size_t ldx, uint32_t n, uint32_t cols, uint8_t wformat, void *codes,
                             float *d, float *gsum) {
    const smoe_qx_size z = smoe_qx_sizes(cols, wformat, 32);
    const uint32_t nb = cols / 32, act = (uint32_t)gb_act_type(wformat), span = act == GB_ACT_Q8_K ? 8 : 1;
    const float tiny = ldexpf(1.0f, QX_TINY_EXP);
    for (uint32_t t = 0; t < n; t++) {
        const float *xt = x + (size_t)t * ldx;
        int8_t *ct = (int8_t *)codes + (size_t)t * z.code_bytes;
        float *dt = d + (size_t)t * z.d_floats, *st = gsum + (size_t)t * z.gsum_floats;
        memset(ct, 0, z.code_bytes);
        memset(dt, 0, sizeof(float) * z.d_floats);
        memset(st, 0, sizeof(float) * z.gsum_floats);
        for (uint32_t B0 = 0; B0 < nb; B0 += span) {
            const uint32_t nB = nb - B0 < span ? nb - B0 : span;
            float m = 0.0f, M = 0.0f, bad[8] = {0};
            bool anybad = false;
            for (uint32_t i = 0; i < nB; i++) {
                for (uint32_t c = 0; c < 32; c++) {
                    const float v = xt[32 * (B0 + i) + c], a = fabsf(v);
                    if (a != a)
                        bad[i] = a; /* NaN wins */
                    else if (a == INFINITY && bad[i] == 0.0f)
                        bad[i] = a;
                    else if (a > m)
                        m = a, M = v;
                }
                anybad |= bad[i] != 0.0f;
            }
            if (anybad) {
                for (uint32_t i = 0; i < nB; i++) dt[smoe_qx_dpos(B0 + i)] = bad[i];
                continue;
            }
            if (!(m >= tiny)) continue;
            const float iscale = act == GB_ACT_Q8_K ? -127.0f / M : 127.0f / m;
            const float dr = m / 127.0f, dq = act == GB_ACT_Q8_K ? 1.0f / iscale : f16_round(dr);
            for (uint32_t i = 0; i < nB; i++) {
                const uint32_t B = B0 + i;
                int32_t S = 0;
                for (uint32_t c = 0; c < 32; c++) {
                    int v = (int)nearbyintf(xt[32 * B + c] * iscale);
                    v = v > 127 ? 127 : v;
                    ct[32 * B + c] = (int8_t)v;
                    S += v;
                }
                dt[smoe_qx_dpos(B)] = dq;
                st[B] = act == GB_ACT_Q8_1 ? f16_round(dr * (float)S) : dq * (float)S;
            }
        }
    }
}

void smoe_ref_qx_prepare(const float *x, size_t ldx, uint32_t n, uint32_t cols, uint8_t wformat, uint32_t group,
                         void *codes, float *d, float *gsum) {
    if (gb_takes_codes(wformat)) {
        ref_ggml_prepare(x, ldx, n, cols, wformat, codes, d, gsum);
        return;
    }
    const bool q8 = wformat == SMOE_FMT_Q8;
    const smoe_qx_size z = smoe_qx_sizes(cols, wformat, group);
    const uint32_t up = qx_units(cols), ng = cols / group;
    const float tiny = ldexpf(1.0f, QX_TINY_EXP);
    for (uint32_t t = 0; t < n; t++) {
        const float *xt = x + (size_t)t * ldx;
        int8_t *c8 = (int8_t *)codes + (size_t)t * z.code_bytes;
        int16_t *c16 = (int16_t *)codes + (size_t)t * z.code_bytes / 2;
        float *dt = d + (size_t)t * z.d_floats, *st = gsum + (size_t)t * z.gsum_floats;
        for (uint32_t u = 0; u < up; u++)
            for (uint32_t b = 0; b < 2; b++) {
                const uint32_t c0 = QX_UNIT * u + 32 * b;
                const float *xb = xt + c0;
                float m = 0.0f, bad = 0.0f; /* bad: the first inf or NaN seen */
                if (c0 < cols)
                    for (uint32_t c = 0; c < 32; c++) {
                        const float a = fabsf(xb[c]);
                        if (a != a)
                            bad = a; /* NaN wins */
                        else if (a == INFINITY && bad == 0.0f)
                            bad = a;
                        else if (a > m)
                            m = a;
                    }
                const bool zero = bad != 0.0f || !(m >= tiny);
                const float id = zero ? 0.0f : 127.0f / m;
                dt[8 * (u / 4) + u % 4 + 4 * b] = bad != 0.0f ? bad : zero ? 0.0f : m / 127.0f;
                for (uint32_t c = 0; c < 32; c++) {
                    const int v = zero ? 0 : (int)nearbyintf(xb[c] * id);
                    const uint32_t at = u * QX_UNIT + qx_pos(32 * b + c, q8);
                    if (q8)
                        c16[at] = (int16_t)v;
                    else
                        c8[at] = (int8_t)v;
                }
            }
        for (uint32_t g = 0; g < z.gsum_floats; g++) {
            float l[8] = {0};
            if (g < ng)
                for (uint32_t j = 0; j < 8; j++) {
                    const float *xg = xt + (size_t)g * group + j;
                    l[j] = xg[0];
                    for (uint32_t k = 1; k < group / 8; k++) l[j] += xg[8 * k];
                }
            st[g] = g < ng ? hsum8_ref(l) : 0.0f;
        }
    }
}

bool smoe_qx_takes(const smoe_tensor *W) {
    return W->format == SMOE_FMT_Q8 || W->format == SMOE_FMT_Q4 || gb_takes_codes(W->format);
}

uint32_t smoe_qx_group(const smoe_tensor *W) { return gb_takes_codes(W->format) ? 32 : W->group; }

bool smoe_qx_shared(const smoe_tensor *a, const smoe_tensor *b) {
    if (a->cols != b->cols) return false;
    if (gb_takes_codes(a->format) && gb_takes_codes(b->format))
        return gb_act_type(a->format) == gb_act_type(b->format);
    return a->format == b->format && a->group == b->group;
}

/* The GGML block formats (ggml_blocks.h) take int8 codes in plain column order (column c at byte c
 * of the token's codes: a block's 32 codes are one 32-byte load), d and gsum per block of 32 in the
 * layout above, quantised as ggml quantises them (ref_ggml_prepare). With (q, sub, σ,
 * μ) a row's form of block b (gb_qx_decode) and I_b = Σ_{h=0,1} sub_{b,h}·Σ_{c ∈ half h of block b} q_c·code_c
 * (exact), the product for one (row, token) is
 *   tot[j] = +0;  for k = 0, 1, …:  b = 8k + 2·(j%4) + j/4   (the block whose d is d[8k + j]),
 *                                   tot[j] = fma((float)I_b, σ_b·d[8k+j], tot[j])
 *   bia[j] = +0;  for k = 0, 1, …:  bia[j] = fma(μ_{8k+j}, gsum_{8k+j}, bia[j])
 *   y = hsum8(tot) + hsum8(bia)   (Q4_1, Q5_1, Q4_K, Q5_K: with a min);   y = hsum8(tot) (the rest)
 * except Q2_K, whose mins are per 16 columns: with (m_0, m_1, ν) its gb_q2k_mins and the exact
 * M_b = Σ_h m_h·Σ_{c ∈ half h of block b} code_c, its bia runs in tot's lane order:
 *   bia[j] = +0;  for k = 0, 1, …:  bia[j] = fma((float)M_b, ν_b·d[8k+j], bia[j])   (b as for tot)
 *   y = hsum8(tot) + hsum8(bia)
 * A block past cols has I = σ = d = μ = gsum = M = ν = 0 and adds nothing. */
static void ref_ggml_qx(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y, size_t ldy,
                        uint32_t r0, uint32_t r1) {
    enum { CB = 32 }; /* blocks of 32 columns decoded at a time: 4 steps of k */
    uint32_t bs = 32, ts = 0;
    smoe_ggml_block(W->format, &bs, &ts);
    const uint32_t cols = W->cols, nb = cols / 32, up = qx_units(cols);
    const bool has_min = gb_has_min(W->format), q2k = W->format == SMOE_FMT_GGML_Q2_K;
    const smoe_qx_size z = smoe_qx_sizes(cols, W->format, 32);
    int8_t q[CB * 32];
    int16_t sub[CB * 2];
    float sigma[CB], mu[CB];
    for (uint32_t r = r0; r < r1; r++) {
        const uint8_t *row = w + (size_t)r * (cols / bs) * ts;
        for (uint32_t t = 0; t < n; t++) {
            const int8_t *c8 = (const int8_t *)X->codes + (size_t)t * z.code_bytes;
            const float *dt = X->d + (size_t)t * z.d_floats, *st = X->gsum + (size_t)t * z.gsum_floats;
            float tot[8] = {0}, bia[8] = {0};
            for (uint32_t b0 = 0; b0 < 2 * up; b0 += CB) {
                const uint32_t m = b0 >= nb ? 0 : nb - b0 < CB ? nb - b0 : CB;
                gb_qx_decode(W->format, row, b0, m, q, sub, sigma, mu);
                for (uint32_t i = m; i < CB; i++) sigma[i] = mu[i] = 0.0f;
                for (uint32_t k = b0 / 8; k < (b0 + CB) / 8 && k < 2 * up / 8; k++)
                    for (uint32_t j = 0; j < 8; j++) {
                        const uint32_t b = 8 * k + 2 * (j % 4) + j / 4, i = b - b0;
                        int32_t I = 0;
                        if (b < nb)
                            for (uint32_t hh = 0; hh < 2; hh++) {
                                int32_t part = 0;
                                for (uint32_t c = 0; c < 16; c++)
                                    part += (int32_t)q[32 * i + 16 * hh + c] * c8[32 * b + 16 * hh + c];
                                I += (int32_t)sub[2 * i + hh] * part;
                            }
                        const float sd = sigma[i] * dt[8 * k + j];
                        tot[j] = fmaf((float)I, sd, tot[j]);
                        if (has_min) bia[j] = fmaf(mu[8 * k + j - b0], st[8 * k + j], bia[j]);
                        if (q2k) {
                            int16_t mm[2] = {0, 0};
                            const float nu = b < nb ? gb_q2k_mins(row, b, mm) : 0.0f;
                            int32_t M = 0;
                            for (uint32_t c = 0; c < 32; c++) M += mm[c / 16] * c8[32 * b + c];
                            bia[j] = fmaf((float)M, nu * dt[8 * k + j], bia[j]);
                        }
                    }
            }
            y[(size_t)t * ldy + r] = has_min || q2k ? hsum8_ref(tot) + hsum8_ref(bia) : hsum8_ref(tot);
        }
    }
}

void smoe_ref_matmul_rows_qx(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y,
                             size_t ldy, uint32_t r0, uint32_t r1) {
    if (gb_takes_codes(W->format)) {
        ref_ggml_qx(W, w, X, n, y, ldy, r0, r1);
        return;
    }
    const bool q8 = W->format == SMOE_FMT_Q8;
    const uint32_t cols = W->cols, G = W->group, ng = cols / G, up = qx_units(cols);
    const uint8_t sf = W->scale_format;
    const smoe_qx_size z = smoe_qx_sizes(cols, W->format, G);
    for (uint32_t r = r0; r < r1; r++) {
        const size_t s0 = (size_t)r * ng; /* the row's first scale and bias */
        const uint8_t *row = w + (size_t)r * (q8 ? cols : cols / 2);
        for (uint32_t t = 0; t < n; t++) {
            const int8_t *c8 = (const int8_t *)X->codes + (size_t)t * z.code_bytes;
            const int16_t *c16 = (const int16_t *)X->codes + (size_t)t * z.code_bytes / 2;
            const float *dt = X->d + (size_t)t * z.d_floats, *st = X->gsum + (size_t)t * z.gsum_floats;
            float tot[8] = {0}, bia[8] = {0};
            for (uint32_t k = 0; k < up; k += QX_UNITS) {
                for (uint32_t j = 0; j < 8; j++) {
                    const uint32_t u = k + j % 4, b = j / 4, c0 = QX_UNIT * u + 32 * b;
                    int32_t I = 0;
                    float sg = 0.0f;
                    if (c0 < cols) {
                        sg = load_scale(sf, w + W->scales_off, s0 + c0 / G);
                        for (uint32_t c = 0; c < 32; c++) {
                            const uint32_t col = c0 + c;
                            const int32_t qc = q8 ? row[col] : (row[col / 2] >> (4 * (col & 1))) & 15;
                            const uint32_t at = u * QX_UNIT + qx_pos(32 * b + c, q8);
                            I += qc * (q8 ? (int32_t)c16[at] : (int32_t)c8[at]);
                        }
                    }
                    const float sd = sg * dt[2 * k + j];
                    tot[j] = fmaf((float)I, sd, tot[j]);
                }
            }
            for (uint32_t k = 0; k < z.gsum_floats; k += 8)
                for (uint32_t j = 0; j < 8; j++) {
                    const uint32_t g = k + j;
                    const float bg = g < ng ? load_scale(sf, w + W->biases_off, s0 + g) : 0.0f;
                    bia[j] = fmaf(bg, st[g], bia[j]);
                }
            y[(size_t)t * ldy + r] = hsum8_ref(tot) + hsum8_ref(bia);
        }
    }
}

/* ------------------------------------------------------------------------ per-token math */

void smoe_ref_rmsnorm(float *out, const float *x, const smoe_tensor *weight, uint32_t dim, float eps) {
    const float ss = dot16(x, x, dim);
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    float wbuf[BLOCK]; /* (block) the weight, widened */
    for (uint32_t c0 = 0; c0 < dim; c0 += BLOCK) {
        const uint32_t nc = dim - c0 < BLOCK ? dim - c0 : BLOCK;
        const float *wv = row_block(weight, weight->data, 0, c0, nc, wbuf);
        for (uint32_t c = 0; c < nc; c++) {
            float xn = x[c0 + c] * inv;
            out[c0 + c] = wv[c] * xn;
        }
    }
}

void smoe_rope(float *x, uint32_t n_heads, uint32_t head_dim, uint32_t rot, const float *cos, const float *sin) {
    const uint32_t h = rot / 2;
    for (uint32_t k = 0; k < n_heads; k++) {
        float *v = x + (size_t)k * head_dim; /* (head_dim) */
        for (uint32_t i = 0; i < h; i++) {
            const float a = v[i], b = v[i + h];
            float ac = a * cos[i], bs = b * sin[i], bc = b * cos[i], as = a * sin[i];
            v[i] = ac - bs;
            v[i + h] = bc + as;
        }
    }
}

void smoe_softmax(float *x, uint32_t n) {
    if (n == 0) return;
    float m = x[0];
    for (uint32_t i = 1; i < n; i++)
        if (x[i] > m) m = x[i];
    float sum = 0.0f;
    for (uint32_t i = 0; i < n; i++) {
        x[i] = expf(x[i] - m);
        sum += x[i];
    }
    for (uint32_t i = 0; i < n; i++) x[i] = x[i] / sum;
}

void smoe_softmax_sink(float *x, uint32_t n, float sink) {
    float m = sink;
    for (uint32_t i = 0; i < n; i++)
        if (x[i] > m) m = x[i];
    float sum = 0.0f;
    for (uint32_t i = 0; i < n; i++) {
        x[i] = expf(x[i] - m);
        sum += x[i];
    }
    sum += expf(sink - m); /* + 0 exactly when sink is −inf: smoe_softmax's bits */
    for (uint32_t i = 0; i < n; i++) x[i] = x[i] / sum;
}

/* ------------------------------------------------------------------------------ KV cache */

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline uint16_t f32_to_bf16(float f) {
    const uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* NaN, quieted */
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* float → IEEE half, nearest-even, the bits F16C's vcvtps2ph (imm 0) gives for every input */
static inline uint16_t f32_to_f16(float f) {
    const uint32_t x = f32_bits(f), ax = x & 0x7fffffffu;
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu)); /* NaN, quieted */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* ≥ 65520 rounds to inf */
    if (ax >= 0x38800000u) {                                  /* a normal half: ≥ 2^-14 */
        const uint32_t m = ax - 0x38000000u;                  /* exponent rebiased (127 → 15) */
        return (uint16_t)(sign | ((m + 0xfffu + ((m >> 13) & 1u)) >> 13));
    }
    const uint32_t e = ax >> 23;
    if (e < 102) return sign; /* < 2^-25: rounds to zero */
    /* a subnormal half: the value in units of 2^-24 is mant · 2^(e−126), rounded */
    const uint32_t mant = (ax & 0x7fffffu) | 0x800000u, sh = 126 - e; /* 14 ≤ sh ≤ 24 */
    uint32_t q = mant >> sh;
    const uint32_t rem = mant & ((1u << sh) - 1), halfway = 1u << (sh - 1);
    if (rem > halfway || (rem == halfway && (q & 1u))) q++;
    return (uint16_t)(sign | q);
}

size_t smoe_kv_elem_bytes(uint32_t kv_dtype) { return kv_dtype == SMOE_KV_F32 ? 4 : 2; }

void smoe_kv_store(void *dst, const float *src, size_t n, uint32_t kv_dtype) {
    if (kv_dtype == SMOE_KV_F32) {
        memcpy(dst, src, n * sizeof(float));
        return;
    }
    uint16_t *d = dst;
    if (kv_dtype == SMOE_KV_BF16)
        for (size_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    else
        for (size_t i = 0; i < n; i++) d[i] = f32_to_f16(src[i]);
}

/* element i of a KV row of kv_dtype, as f32 (exactly) */
static inline float kv_get(const void *row, size_t i, uint32_t kv_dtype) {
    if (kv_dtype == SMOE_KV_F32) return ((const float *)row)[i];
    const uint16_t h = ((const uint16_t *)row)[i];
    return kv_dtype == SMOE_KV_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

void smoe_kv_load(float *dst, const void *src, size_t n, uint32_t kv_dtype) {
    for (size_t i = 0; i < n; i++) dst[i] = kv_get(src, i, kv_dtype);
}

/* Σ q[c]·k[c] exactly as the AVX2 and NEON dot8 computes it (kernels.h, smoe_attend). */
static float attend_dot8(const float *q, const void *k, uint32_t kv_dtype, uint32_t n) {
    float a[8] = {0};
    for (uint32_t c = 0; c < n; c += 8)
        for (uint32_t j = 0; j < 8; j++) {
            const bool in = c + j < n;
            a[j] = fmaf(in ? q[c + j] : 0.0f, in ? kv_get(k, c + j, kv_dtype) : 0.0f, a[j]);
        }
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

void smoe_ref_attend(float *out, const float *q, const void *k, const void *v, size_t stride, uint32_t n_pos,
                     uint32_t head_dim, uint32_t kv_dtype, float sink, float *scratch) {
    /* head_dim ** -0.5 as transformers computes it (in double), then rounded to float */
    const float scale = (float)(1.0 / sqrt((double)head_dim));
    const size_t eb = smoe_kv_elem_bytes(kv_dtype);
    for (uint32_t p = 0; p < n_pos; p++)
        scratch[p] = attend_dot8(q, (const uint8_t *)k + p * stride * eb, kv_dtype, head_dim) * scale;
    smoe_softmax_sink(scratch, n_pos, sink);
    for (uint32_t d = 0; d < head_dim; d++) out[d] = 0.0f;
    for (uint32_t p = 0; p < n_pos; p++) {
        const void *vp = (const uint8_t *)v + p * stride * eb; /* (head_dim) */
        for (uint32_t d = 0; d < head_dim; d++) out[d] = fmaf(scratch[p], kv_get(vp, d, kv_dtype), out[d]);
    }
}

/* a ranks before b: larger value, or equal value and lower index */
static inline bool ranks_before(float va, uint32_t a, float vb, uint32_t b) {
    return va > vb || (va == vb && a < b);
}

/* ranking value of p[i]: NaN ranks as −inf */
static inline float rank_of(const float *p, int32_t i) { return p[i] != p[i] ? -INFINITY : p[i]; }

void smoe_topk(const float *p, uint32_t n, uint32_t k, bool renorm, int32_t *idx, float *val) {
    if (k > n) k = n;
    if (k == 0) return;
    /* insertion into a sorted list of k ids (k is small: experts per token); with NaN ranking
     * as −inf, idx always holds k distinct valid indices */
    uint32_t have = 0;
    for (uint32_t i = 0; i < n; i++) {
        const float v = rank_of(p, (int32_t)i);
        if (have == k && !ranks_before(v, i, rank_of(p, idx[k - 1]), (uint32_t)idx[k - 1])) continue;
        uint32_t j = have < k ? have++ : k - 1;
        while (j > 0 && ranks_before(v, i, rank_of(p, idx[j - 1]), (uint32_t)idx[j - 1])) {
            idx[j] = idx[j - 1];
            j--;
        }
        idx[j] = (int32_t)i;
    }
    for (uint32_t j = 0; j < k; j++) val[j] = p[idx[j]];
    if (renorm) {
        float sum = 0.0f;
        for (uint32_t j = 0; j < k; j++) sum += val[j];
        for (uint32_t j = 0; j < k; j++) val[j] = val[j] / sum;
    }
}

void smoe_swiglu(float *h, const float *g, const float *u, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        const float gi = g[i];
        float silu = gi / (1.0f + expf(-gi));
        h[i] = silu * u[i];
    }
}

void smoe_topk_softmax(const float *logits, uint32_t n, uint32_t k, int32_t *idx, float *val) {
    smoe_topk(logits, n, k, false, idx, val);
    smoe_softmax(val, k < n ? k : n);
}

void smoe_swiglu_clamped(float *h, const float *g, const float *u, uint32_t n, float alpha, float limit) {
    for (uint32_t i = 0; i < n; i++) {
        /* comparisons, not fminf: a NaN stays a NaN, as torch's clamp keeps it */
        const float gi = g[i] > limit ? limit : g[i];
        const float ui = u[i] > limit ? limit : u[i] < -limit ? -limit : u[i];
        const float ga = gi * alpha;
        const float sig = 1.0f / (1.0f + expf(-ga));
        const float glu = gi * sig;
        const float u1 = ui + 1.0f;
        h[i] = u1 * glu;
    }
}

void smoe_add_row(float *y, const float *b, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) y[i] += b[i];
}

void smoe_axpy(float *y, float a, const float *x, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        float ax = a * x[i];
        y[i] += ax;
    }
}

void smoe_add_bias(float *y, const smoe_tensor *w) {
    const uint32_t n = w->cols;
    if (w->format == SMOE_FMT_F32) {
        const float *b = (const float *)w->data;
        for (uint32_t i = 0; i < n; i++) y[i] += b[i];
    } else { /* bf16: the high half of an f32 */
        const uint16_t *b = (const uint16_t *)w->data;
        for (uint32_t i = 0; i < n; i++) {
            uint32_t u = (uint32_t)b[i] << 16;
            float f;
            memcpy(&f, &u, 4);
            y[i] += f;
        }
    }
}

void smoe_route_sigmoid_group(const float *logits, uint32_t E, const smoe_tensor *bias, uint32_t n_group,
                              uint32_t topk_group, uint32_t k, bool renorm, float scale, int32_t *idx, float *val,
                              float *c) {
    for (uint32_t e = 0; e < E; e++) c[e] = 1.0f / (1.0f + expf(-logits[e]));
    smoe_add_bias(c, bias);
    if (n_group > 1 && topk_group < n_group) {
        const uint32_t per = E / n_group;
        float gs[SMOE_MAX_GROUPS];
        int32_t gi[SMOE_MAX_GROUPS], top2[2];
        float tv[2];
        for (uint32_t g = 0; g < n_group; g++) {
            smoe_topk(c + (size_t)g * per, per, 2, false, top2, tv);
            gs[g] = tv[0] + tv[1];
        }
        float gv[SMOE_MAX_GROUPS];
        smoe_topk(gs, n_group, topk_group, false, gi, gv);
        bool keep[SMOE_MAX_GROUPS] = {0};
        for (uint32_t j = 0; j < topk_group; j++) keep[gi[j]] = true;
        for (uint32_t g = 0; g < n_group; g++)
            if (!keep[g])
                for (uint32_t e = 0; e < per; e++) c[(size_t)g * per + e] = -INFINITY;
    }
    smoe_topk(c, E, k, false, idx, val);
    float sum = 0.0f;
    for (uint32_t j = 0; j < k; j++) {
        val[j] = 1.0f / (1.0f + expf(-logits[idx[j]]));
        sum += val[j];
    }
    for (uint32_t j = 0; j < k; j++) {
        float v = renorm ? val[j] / (sum + 1e-20f) : val[j];
        val[j] = v * scale;
    }
}

/* ------------------------------------------------------------------------ Gated DeltaNet */

float smoe_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

float smoe_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

void smoe_conv1d_step(float *out, float *state, const float *x, const float *w, uint32_t ch, uint32_t kernel) {
    const uint32_t past = kernel - 1;
    for (uint32_t c = 0; c < ch; c++) {
        const float *wc = w + (size_t)c * kernel;
        float acc = 0.0f;
        for (uint32_t j = 0; j < past; j++) acc += wc[j] * state[(size_t)j * ch + c];
        acc += wc[past] * x[c];
        out[c] = acc / (1.0f + expf(-acc));
    }
    if (past == 0) return;
    memmove(state, state + ch, (size_t)(past - 1) * ch * sizeof *state);
    memcpy(state + (size_t)(past - 1) * ch, x, ch * sizeof *state);
}

void smoe_l2norm(float *x, uint32_t n, float eps, float scale) {
    float ss = 0.0f;
    for (uint32_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss + eps);
    for (uint32_t i = 0; i < n; i++) x[i] = x[i] * inv * scale;
}

void smoe_delta_step(float *out, float *S, const float *q, const float *k, const float *v, float decay, float beta,
                     uint32_t dk, uint32_t dv, float *scratch) {
    float *kv = scratch; /* (dv) Sᵀk after the decay, then delta */
    for (uint32_t j = 0; j < dv; j++) kv[j] = 0.0f;
    for (uint32_t i = 0; i < dk; i++) {
        float *Si = S + (size_t)i * dv;
        const float ki = k[i];
        for (uint32_t j = 0; j < dv; j++) {
            Si[j] = Si[j] * decay;
            kv[j] += Si[j] * ki;
        }
    }
    for (uint32_t j = 0; j < dv; j++) kv[j] = (v[j] - kv[j]) * beta;
    for (uint32_t j = 0; j < dv; j++) out[j] = 0.0f;
    for (uint32_t i = 0; i < dk; i++) {
        float *Si = S + (size_t)i * dv;
        const float ki = k[i], qi = q[i];
        for (uint32_t j = 0; j < dv; j++) {
            Si[j] += ki * kv[j];
            out[j] += Si[j] * qi;
        }
    }
}

void smoe_rmsnorm_gated(float *out, const float *x, const float *z, const float *w, uint32_t dim, float eps) {
    float ss = 0.0f;
    for (uint32_t i = 0; i < dim; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (uint32_t i = 0; i < dim; i++) {
        const float zi = z[i];
        out[i] = w[i] * (x[i] * inv) * (zi / (1.0f + expf(-zi)));
    }
}
