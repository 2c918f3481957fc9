/* ggml_blocks.h — the GGML block formats (smoe.h: SMOE_FMT_GGML_*, numbered 32 + ggml_type), as
 * the kernels read them. Shared by kernels_ref.c and the instruction-set files (static inline:
 * nothing here calls back into a dispatcher).
 *
 * A row of a GGML tensor is cols / block_size blocks laid out exactly as ggml's ggml-common.h
 * lays them out (smoe_ggml_block in vault.h gives the two sizes). Little-endian, any alignment
 * (a block of Q4_0 is 18 bytes: every multi-byte field is read with memcpy).
 *
 * Dequantisation (gb_dequant_block) is gguf-py's `gguf.quants.dequantize`, operation for
 * operation, in f32 with every product rounded (the build uses -ffp-contract=off), so the values
 * are the same bits (tests/test_ggml_formats.py). For a block whose f16 scale is inf or NaN, IEEE
 * arithmetic decides: inf·0 is NaN, inf·q is ±inf, NaN·q is NaN (the tests compare such blocks
 * with NaN equal to NaN, whatever its payload). The e8m0 scale of MXFP4 is always finite
 * (2^-128 … 2^127), though 2^127·12 overflows to inf.
 *
 * For the 8-bit-activation product (kernels.h's smoe_qx; kernels_ref.c states the order), each
 * block of 32 columns is written as integers and at most two floats (gb_qx_decode):
 *     w_c ≈ σ · sub[c / 16] · q_c + μ          (q_c int8, sub int16, σ and μ f32)
 * where the integer part Σ_c sub·q_c·code_c is exact and σ is the block's own scale as
 * dequantisation computes it (d, or d·sc for the K-quants with a 6-bit scale per 32; f16 values
 * widened with a NaN quieted, gb_f16q). Per type:
 *     Q4_0  q = nibble − 8        σ = d                    Q5_0  q = 5-bit − 16   σ = d
 *     Q8_0  q = qs                σ = d                    IQ4_NL q = kvalues[nibble], σ = d
 *     MXFP4 q = kvalues_mxfp4[nibble], σ = 2^(e−128)       IQ4_XS q = kvalues[nibble], σ = d·(ls−32)
 *     Q4_K  q = nibble (0..15)    σ = d·sc   μ = −(dmin·m)  Q5_K  q = 5-bit (0..31), σ, μ as Q4_K
 *     Q4_1  q = nibble (0..15)    σ = d      μ = m          Q5_1  q = 5-bit (0..31), σ = d, μ = m
 *     Q6_K  q = 6-bit − 32        sub = the two int8 scales of its 16-column halves, σ = d
 *     Q3_K  q = 3-bit − 4 … 3     sub = the two 6-bit scales − 32, σ = d
 *     Q2_K  q = 2-bit (0..3)      sub = the two 4-bit scales, σ = d, and a min per 16 columns:
 *           w_c = d·sub_h·q_c − dmin·m_h, whose min term takes the activation codes too
 *           (gb_q2k_mins: ν·Σ_h m_h·Σ_{c ∈ half h} code_c, ν = −dmin; kernels_ref.c)
 * and the IQ1/IQ2/IQ3 formats (gb_iq_part: a codebook entry g per 8 or 4 columns, its signs,
 * a 3- or 4-bit scale ls per 32 or 16 columns; every one an integer multiple of d/8), with
 * f = 1/8, 1/4, 1 below; a scale per 32 goes into σ = (d·(2·ls + 1))·f (sub = 1, the cheaper
 * product without sub-scales), one per 16 into sub = 2·ls_h + 1 with σ = d·f:
 *     IQ2_XXS (per 32), IQ2_XS, IQ2_S (per 16)   w = d·(ls + ½)/4·(±g)    q = ±g       f = 1/8
 *     IQ3_XXS (per 32)                          w = d·(ls + ½)/2·(±g)    q = ±g       f = 1/4
 *     IQ3_S (per 32)                            w = d·(2·ls + 1)·(±g)    q = ±g       f = 1
 *     IQ1_S (per 32), IQ1_M (per 16)            w = d·(2·ls + 1)·(g ± ⅛) q = 8·g ± 1  f = 1/8
 * F16 has no such form: its products take f32 activations. */
#ifndef SMOE_GGML_BLOCKS_H
#define SMOE_GGML_BLOCKS_H

#include "vault.h"

#include <string.h>

static inline float gb_f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* IEEE half at p → float, exactly (inf and NaN kept, the payload shifted as numpy does). */
static inline float gb_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f) return gb_f32_from_bits(sign | 0x7f800000u | (man << 13));
    if (exp != 0) return gb_f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
    const float v = (float)man * 0x1p-24f; /* zero or subnormal: exact */
    return sign ? -v : v;
}

/* The same, a NaN quieted (its top mantissa bit set), as F16C's vcvtph2ps widens: the scales of
 * the integer form below, so that vector code may widen them with it. */
static inline float gb_f16q(const uint8_t *p) {
    const float f = gb_f16(p);
    if (f == f) return f;
    uint32_t u;
    memcpy(&u, &f, 4);
    return gb_f32_from_bits(u | 0x00400000u);
}

/* ggml's GGML_E8M0_TO_FP32_HALF: 2^(e − 128), subnormal for e < 2 */
static inline float gb_e8m0_half(uint8_t e) {
    return gb_f32_from_bits(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23);
}

static const int8_t gb_kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t gb_kvalues_mxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* The 6-bit scale and min j (< 8) of a Q4_K / Q5_K block's 12 packed bytes. */
static inline void gb_scale_min_k4(const uint8_t *s, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
        *m = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

/* The signed 6-bit scale j (< 16) of a Q3_K block's 12 packed bytes, minus 32. */
static inline int gb_scale_q3k(const uint8_t *s, int j) {
    const int lo = j < 8 ? s[j] & 15 : s[j - 8] >> 4, hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    return (lo | hi << 4) - 32;
}

/* The 6-bit scale i (< 8) of an IQ4_XS block, minus 32. */
static inline int gb_scale_iq4xs(const uint8_t *blk, int i) {
    uint16_t h;
    memcpy(&h, blk + 2, 2);
    return (((blk[4 + i / 2] >> (4 * (i % 2))) & 15) | (((h >> (2 * i)) & 3) << 4)) - 32;
}

/* The IQ formats' codebooks (ggml_iq_grids.h, from gguf-py; defined in kernels_ref.c): entry i's
 * byte j is value j. */
extern const uint64_t gb_iq2xxs_grid[256], gb_iq2xs_grid[512], gb_iq2s_grid[1024], gb_iq1s_grid[2048];
extern const uint32_t gb_iq3xxs_grid[256], gb_iq3s_grid[512];

/* The signs of 8 values from a 7-bit index: its bits, and an eighth that makes the count of minus
 * signs even (gguf-py's ksigns table; scripts/gen_iq_grids.py checks the rule), as a table the
 * compiler builds (a popcount is a library call where the build does not target POPCNT). */
#define GB_KSIGNS(i) ((i) | ((((i) ^ (i) >> 1 ^ (i) >> 2 ^ (i) >> 3 ^ (i) >> 4 ^ (i) >> 5 ^ (i) >> 6) & 1) << 7))
#define GB_KS8(i) GB_KSIGNS(i), GB_KSIGNS((i) + 1), GB_KSIGNS((i) + 2), GB_KSIGNS((i) + 3), GB_KSIGNS((i) + 4), \
                  GB_KSIGNS((i) + 5), GB_KSIGNS((i) + 6), GB_KSIGNS((i) + 7)
#define GB_KS32(i) GB_KS8(i), GB_KS8((i) + 8), GB_KS8((i) + 16), GB_KS8((i) + 24)
static const uint8_t gb_ksigns_table[128] = {GB_KS32(0), GB_KS32(32), GB_KS32(64), GB_KS32(96)};
#undef GB_KS32
#undef GB_KS8
static inline unsigned gb_ksigns(unsigned i) { return gb_ksigns_table[i & 127]; }

static inline uint32_t gb_u16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

static inline uint32_t gb_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Whether fmt is one of the codebook formats IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S */
static inline bool gb_is_iq(uint8_t fmt) {
    switch (fmt) {
    case SMOE_FMT_GGML_IQ2_XXS:
    case SMOE_FMT_GGML_IQ2_XS:
    case SMOE_FMT_GGML_IQ2_S:
    case SMOE_FMT_GGML_IQ3_XXS:
    case SMOE_FMT_GGML_IQ3_S:
    case SMOE_FMT_GGML_IQ1_S:
    case SMOE_FMT_GGML_IQ1_M: return true;
    }
    return false;
}

/* Whether fmt is IQ1_S or IQ1_M (values g ± ⅛, not ±g) */
static inline bool gb_iq1(uint8_t fmt) { return fmt == SMOE_FMT_GGML_IQ1_S || fmt == SMOE_FMT_GGML_IQ1_M; }

/* The power of two f of a codebook format's integer form (the header's table): σ = d·f, or
 * (d·(2·ls + 1))·f where the format has one scale per 32 */
static inline float gb_iq_f(uint8_t fmt) {
    return fmt == SMOE_FMT_GGML_IQ3_S ? 1.0f : fmt == SMOE_FMT_GGML_IQ3_XXS ? 0.25f : 0.125f;
}

/* Part k (< 8, 32 columns) of an IQ block at blk, as stored: e[l] the codebook entry (or, for the
 * 4-wide IQ3 grids, the two entries) of its group l of 8 columns, byte j the value of column
 * 8l + j (8..43 or 4..62 or 1..15 for IQ2/IQ3, int8 −1/0/1 for IQ1); byte l of *signs the group's
 * sign bits (IQ2/IQ3: bit j the sign of column 8l + j; IQ1: 0xFF where the group adds −⅛, 0 for
 * +⅛); ls[h] the scale of 16-column half h (the same for both halves where the format has one per
 * 32); dbits the block's f16 d. The vector decoders read the same fields. */
static inline __attribute__((always_inline)) void gb_iq_fields(uint8_t fmt, const uint8_t *blk, int k, uint64_t e[4], uint32_t *signs, int ls[2],
                                uint8_t dbits[2]) {
    uint32_t sg[4] = {0, 0, 0, 0};
    memcpy(dbits, blk, 2);
    ls[0] = ls[1] = 0;
    for (int l = 0; l < 4; l++) e[l] = 0;
    switch (fmt) {
    case SMOE_FMT_GGML_IQ2_XXS: {
        const uint32_t idx = gb_u32(blk + 2 + 8 * k), aux = gb_u32(blk + 6 + 8 * k);
        ls[0] = ls[1] = (int)(aux >> 28);
        for (int l = 0; l < 4; l++) {
            e[l] = gb_iq2xxs_grid[(idx >> (8 * l)) & 255];
            sg[l] = gb_ksigns((aux >> (7 * l)) & 127);
        }
        break;
    }
    case SMOE_FMT_GGML_IQ2_XS:
        for (int l = 0; l < 4; l++) {
            const uint32_t q = gb_u16(blk + 2 + 2 * (4 * k + l));
            e[l] = gb_iq2xs_grid[q & 511];
            sg[l] = gb_ksigns(q >> 9);
        }
        ls[0] = blk[66 + k] & 15, ls[1] = blk[66 + k] >> 4;
        break;
    case SMOE_FMT_GGML_IQ2_S:
        for (int l = 0; l < 4; l++) {
            e[l] = gb_iq2s_grid[blk[2 + 4 * k + l] | ((blk[66 + k] >> (2 * l)) & 3) << 8];
            sg[l] = blk[34 + 4 * k + l];
        }
        ls[0] = blk[74 + k] & 15, ls[1] = blk[74 + k] >> 4;
        break;
    case SMOE_FMT_GGML_IQ3_XXS: {
        const uint32_t aux = gb_u32(blk + 66 + 4 * k);
        ls[0] = ls[1] = (int)(aux >> 28);
        for (int l = 0; l < 4; l++) {
            e[l] = gb_iq3xxs_grid[blk[2 + 8 * k + 2 * l]] | (uint64_t)gb_iq3xxs_grid[blk[3 + 8 * k + 2 * l]] << 32;
            sg[l] = gb_ksigns((aux >> (7 * l)) & 127);
        }
        break;
    }
    case SMOE_FMT_GGML_IQ3_S: {
        const uint32_t qh = blk[66 + k];
        for (int l = 0; l < 4; l++) {
            const uint32_t m = 2 * (uint32_t)l;
            e[l] = gb_iq3s_grid[blk[2 + 8 * k + m] | ((qh >> m) & 1) << 8] |
                   (uint64_t)gb_iq3s_grid[blk[3 + 8 * k + m] | ((qh >> (m + 1)) & 1) << 8] << 32;
            sg[l] = blk[74 + 4 * k + l];
        }
        ls[0] = ls[1] = (blk[106 + k / 2] >> (4 * (k % 2))) & 15;
        break;
    }
    case SMOE_FMT_GGML_IQ1_S: {
        const uint32_t h = gb_u16(blk + 34 + 2 * k);
        for (int l = 0; l < 4; l++) {
            e[l] = gb_iq1s_grid[blk[2 + 4 * k + l] | ((h >> (3 * l)) & 7) << 8];
            sg[l] = h >> 15 ? 0xFF : 0;
        }
        ls[0] = ls[1] = (int)((h >> 12) & 7);
        break;
    }
    case SMOE_FMT_GGML_IQ1_M:
        for (int l = 0; l < 4; l++) {
            const uint32_t nib = (blk[32 + 2 * k + l / 2] >> (4 * (l % 2))) & 15;
            e[l] = gb_iq1s_grid[blk[4 * k + l] | (nib & 7) << 8];
            sg[l] = nib >> 3 ? 0xFF : 0;
        }
        for (int h = 0; h < 2; h++) ls[h] = (int)((gb_u16(blk + 48 + 2 * ((2 * k + h) / 4)) >> (3 * ((2 * k + h) % 4))) & 7);
        const uint16_t d = smoe_ggml_iq1m_d(blk);
        memcpy(dbits, &d, 2);
        break;
    }
    *signs = sg[0] | sg[1] << 8 | sg[2] << 16 | sg[3] << 24;
}

/* The same part unpacked: g[c] column c's codebook value, neg[c] its sign bit (IQ1: its ⅛'s). */
static inline void gb_iq_part(uint8_t fmt, const uint8_t *blk, int k, int8_t g[32], uint8_t neg[32], int ls[2],
                              uint8_t dbits[2]) {
    uint64_t e[4];
    uint32_t signs;
    gb_iq_fields(fmt, blk, k, e, &signs, ls, dbits);
    for (int c = 0; c < 32; c++) {
        g[c] = (int8_t)(uint8_t)(e[c / 8] >> (8 * (c % 8)));
        neg[c] = (uint8_t)((signs >> c) & 1);
    }
}

/* An IQ block at src dequantised into out (256 floats): gguf-py's operations */
static inline void gb_iq_dequant(uint8_t fmt, const uint8_t *src, float *out) {
    const bool iq1 = gb_iq1(fmt);
    for (int k = 0; k < 8; k++) {
        int8_t g[32];
        uint8_t neg[32], dbits[2];
        int ls[2];
        gb_iq_part(fmt, src, k, g, neg, ls, dbits);
        const float d = gb_f16(dbits);
        for (int c = 0; c < 32; c++) {
            const int l = ls[c / 16];
            float v;
            if (iq1) { /* dl·(g + δ) */
                const float dl = d * (float)(2 * l + 1), gd = (float)g[c] + (neg[c] ? -0.125f : 0.125f);
                v = dl * gd;
            } else {
                float db = fmt == SMOE_FMT_GGML_IQ3_S ? d * (float)(1 + 2 * l) : d * (0.5f + (float)l);
                if (fmt != SMOE_FMT_GGML_IQ3_S) db = db * (fmt == SMOE_FMT_GGML_IQ3_XXS ? 0.5f : 0.25f);
                v = db * (float)g[c];
                if (neg[c]) v = -v;
            }
            out[32 * k + c] = v;
        }
    }
}

/* One block at src, dequantised into out (block_size floats): gguf-py's operations. */
static inline void gb_dequant_block(uint8_t fmt, const uint8_t *src, float *out) {
    if (gb_is_iq(fmt)) {
        gb_iq_dequant(fmt, src, out);
        return;
    }
    switch (fmt) {
    case SMOE_FMT_GGML_F16: out[0] = gb_f16(src); return;
    case SMOE_FMT_GGML_Q4_0: {
        const float d = gb_f16(src);
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)((src[2 + j] & 15) - 8);
            out[j + 16] = d * (float)((src[2 + j] >> 4) - 8);
        }
        return;
    }
    case SMOE_FMT_GGML_Q5_0: {
        const float d = gb_f16(src);
        uint32_t qh;
        memcpy(&qh, src + 2, 4);
        for (int j = 0; j < 16; j++) {
            const int lo = (src[6 + j] & 15) | (int)((qh >> j) & 1) << 4;
            const int hi = (src[6 + j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
            out[j] = d * (float)(lo - 16);
            out[j + 16] = d * (float)(hi - 16);
        }
        return;
    }
    case SMOE_FMT_GGML_Q8_0: {
        const float d = gb_f16(src);
        for (int j = 0; j < 32; j++) out[j] = (float)(int8_t)src[2 + j] * d;
        return;
    }
    case SMOE_FMT_GGML_Q4_1:
    case SMOE_FMT_GGML_Q5_1: {
        const bool q5 = fmt == SMOE_FMT_GGML_Q5_1;
        const float d = gb_f16(src), m = gb_f16(src + 2);
        uint32_t qh = 0;
        if (q5) memcpy(&qh, src + 4, 4);
        const uint8_t *qs = src + (q5 ? 8 : 4);
        for (int j = 0; j < 16; j++) {
            const int lo = (qs[j] & 15) | (int)((qh >> j) & 1) << 4, hi = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
            const float dl = d * (float)lo, dh = d * (float)hi;
            out[j] = dl + m;
            out[j + 16] = dh + m;
        }
        return;
    }
    case SMOE_FMT_GGML_Q2_K: {
        const uint8_t *sc = src, *qs = src + 16;
        const float d = gb_f16(src + 80), dmin = gb_f16(src + 82);
        for (int e = 0; e < 256; e++) {
            const float dl = d * (float)(sc[e / 16] & 15), ml = dmin * (float)(sc[e / 16] >> 4);
            const int q = (qs[(e / 128) * 32 + e % 32] >> (2 * ((e % 128) / 32))) & 3;
            const float dq = dl * (float)q;
            out[e] = dq - ml;
        }
        return;
    }
    case SMOE_FMT_GGML_Q3_K: {
        const uint8_t *hm = src, *qs = src + 32, *sc = src + 96;
        const float d = gb_f16(src + 108);
        for (int e = 0; e < 256; e++) {
            const float dl = d * (float)gb_scale_q3k(sc, e / 16);
            const int ql = (qs[(e / 128) * 32 + e % 32] >> (2 * ((e % 128) / 32))) & 3;
            const int q = ql - (((hm[e % 32] >> (e / 32)) & 1) ? 0 : 4);
            out[e] = dl * (float)q;
        }
        return;
    }
    case SMOE_FMT_GGML_Q4_K:
    case SMOE_FMT_GGML_Q5_K: {
        const bool q5 = fmt == SMOE_FMT_GGML_Q5_K;
        const float d = gb_f16(src), dmin = gb_f16(src + 2);
        const uint8_t *sc = src + 4, *qh = src + 16, *qs = src + (q5 ? 48 : 16);
        for (int i = 0; i < 8; i++) {
            uint8_t s, m;
            gb_scale_min_k4(sc, i, &s, &m);
            const float d1 = d * (float)s, dm = dmin * (float)m;
            for (int l = 0; l < 32; l++) {
                int q = (qs[(i / 2) * 32 + l] >> (4 * (i % 2))) & 15;
                if (q5) q |= ((qh[l] >> i) & 1) << 4;
                const float dq = d1 * (float)q;
                out[32 * i + l] = dq - dm;
            }
        }
        return;
    }
    case SMOE_FMT_GGML_Q6_K: {
        const uint8_t *ql = src, *qh = src + 128;
        const int8_t *sc = (const int8_t *)(const void *)(src + 192);
        const float d = gb_f16(src + 208);
        for (int e = 0; e < 256; e++) {
            const int half = e / 128, r = e % 128;
            const int lo = (ql[half * 64 + r % 64] >> (4 * (r / 64))) & 15;
            const int hi = (qh[half * 32 + r % 32] >> (2 * (r / 32))) & 3;
            const float d1 = d * (float)sc[e / 16];
            out[e] = d1 * (float)((lo | hi << 4) - 32);
        }
        return;
    }
    case SMOE_FMT_GGML_IQ4_NL:
    case SMOE_FMT_GGML_MXFP4: {
        const bool mx = fmt == SMOE_FMT_GGML_MXFP4;
        const float d = mx ? gb_e8m0_half(src[0]) : gb_f16(src);
        const uint8_t *qs = src + (mx ? 1 : 2);
        const int8_t *kv = mx ? gb_kvalues_mxfp4 : gb_kvalues_iq4nl;
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)kv[qs[j] & 15];
            out[j + 16] = d * (float)kv[qs[j] >> 4];
        }
        return;
    }
    case SMOE_FMT_GGML_IQ4_XS: {
        const float d = gb_f16(src);
        const uint8_t *qs = src + 8;
        for (int i = 0; i < 8; i++) {
            const float dl = d * (float)gb_scale_iq4xs(src, i);
            for (int l = 0; l < 16; l++) {
                out[32 * i + l] = dl * (float)gb_kvalues_iq4nl[qs[16 * i + l] & 15];
                out[32 * i + 16 + l] = dl * (float)gb_kvalues_iq4nl[qs[16 * i + l] >> 4];
            }
        }
        return;
    }
    default: /* the vault parser admits no other format */
        return;
    }
}

/* Whether products of this GGML format take 8-bit activation codes (gb_qx_decode has its form). */
static inline bool gb_takes_codes(uint8_t fmt) {
    switch (fmt) {
    case SMOE_FMT_GGML_Q4_0:
    case SMOE_FMT_GGML_Q4_1:
    case SMOE_FMT_GGML_Q5_0:
    case SMOE_FMT_GGML_Q5_1:
    case SMOE_FMT_GGML_Q8_0:
    case SMOE_FMT_GGML_Q2_K:
    case SMOE_FMT_GGML_Q3_K:
    case SMOE_FMT_GGML_Q4_K:
    case SMOE_FMT_GGML_Q5_K:
    case SMOE_FMT_GGML_Q6_K:
    case SMOE_FMT_GGML_IQ4_NL:
    case SMOE_FMT_GGML_IQ4_XS:
    case SMOE_FMT_GGML_MXFP4: return true;
    }
    return gb_is_iq(fmt);
}

/* The activation block type ggml's CPU backend quantises x into for products with this format (its
 * type_traits_cpu[].vec_dot_type), which smoe_qx_prepare imitates for the GGML formats: Q8_1 for
 * Q4_1 and Q5_1, Q8_K for the K-quants and the 256-column IQ formats, Q8_0 for the rest. */
enum { GB_ACT_Q8_0, GB_ACT_Q8_1, GB_ACT_Q8_K };
static inline int gb_act_type(uint8_t fmt) {
    switch (fmt) {
    case SMOE_FMT_GGML_Q4_1:
    case SMOE_FMT_GGML_Q5_1: return GB_ACT_Q8_1;
    case SMOE_FMT_GGML_Q2_K:
    case SMOE_FMT_GGML_Q3_K:
    case SMOE_FMT_GGML_Q4_K:
    case SMOE_FMT_GGML_Q5_K:
    case SMOE_FMT_GGML_Q6_K:
    case SMOE_FMT_GGML_IQ4_XS: return GB_ACT_Q8_K;
    }
    return gb_is_iq(fmt) ? GB_ACT_Q8_K : GB_ACT_Q8_0;
}

/* Whether a codebook format has one scale per 32 columns (IQ2_XXS, IQ3_XXS, IQ3_S, IQ1_S), which its
 * integer form folds into σ; the others have one per 16 (IQ2_XS, IQ2_S, IQ1_M), sub-scales */
static inline bool gb_iq_scale32(uint8_t fmt) {
    return fmt == SMOE_FMT_GGML_IQ2_XXS || fmt == SMOE_FMT_GGML_IQ3_XXS || fmt == SMOE_FMT_GGML_IQ3_S ||
           fmt == SMOE_FMT_GGML_IQ1_S;
}

/* Whether the format's integer form has sub-scales other than 1 (sub: Q6_K, Q3_K, Q2_K, IQ2_XS,
 * IQ2_S, IQ1_M) */
static inline bool gb_has_sub(uint8_t fmt) {
    return fmt == SMOE_FMT_GGML_Q6_K || fmt == SMOE_FMT_GGML_Q3_K || fmt == SMOE_FMT_GGML_Q2_K ||
           (gb_is_iq(fmt) && !gb_iq_scale32(fmt));
}

/* Whether the format carries a min (μ ≠ 0): Q4_1, Q5_1, Q4_K, Q5_K (their q are non-negative). */
static inline bool gb_has_min(uint8_t fmt) {
    return fmt == SMOE_FMT_GGML_Q4_K || fmt == SMOE_FMT_GGML_Q5_K || fmt == SMOE_FMT_GGML_Q4_1 ||
           fmt == SMOE_FMT_GGML_Q5_1;
}

/* Part k of an IQ block at blk in the integer form (the header's table): q, its two sub-scales, σ */
static inline void gb_iq_qx_part(uint8_t fmt, const uint8_t *blk, int k, int8_t *qi, int16_t sub[2], float *sigma) {
    const bool iq1 = gb_iq1(fmt);
    int8_t g[32];
    uint8_t neg[32], dbits[2];
    int ls[2];
    gb_iq_part(fmt, blk, k, g, neg, ls, dbits);
    for (int l = 0; l < 32; l++)
        qi[l] = (int8_t)(iq1 ? 8 * g[l] + (neg[l] ? -1 : 1) : neg[l] ? -g[l] : g[l]);
    const float d = gb_f16q(dbits), f = gb_iq_f(fmt);
    if (gb_iq_scale32(fmt)) { /* one scale per 32: in σ */
        sub[0] = sub[1] = 1;
        *sigma = d * (float)(2 * ls[0] + 1) * f;
    } else {
        sub[0] = (int16_t)(2 * ls[0] + 1);
        sub[1] = (int16_t)(2 * ls[1] + 1);
        *sigma = d * f;
    }
}

/* The header's form of blocks [b0, b0 + nb) of 32 columns of a row (row: the row's first byte; b0
 * and nb multiples of 8 for the 256-column formats): q[32·i + c], sub[2·i + h], sigma[i], mu[i]
 * for block b0 + i. A format without a min writes mu = 0. */
static inline void gb_qx_decode(uint8_t fmt, const uint8_t *row, uint32_t b0, uint32_t nb, int8_t *q, int16_t *sub,
                                float *sigma, float *mu) {
    uint32_t bs = 32, ts = 0;
    smoe_ggml_block(fmt, &bs, &ts);
    for (uint32_t i = 0; i < nb; i++) {
        const uint32_t b = b0 + i;
        const uint8_t *blk = row + (size_t)(b * 32 / bs) * ts; /* the ggml block holding it */
        const int k = (int)(b % (bs / 32));                      /* its 32-column part there */
        int8_t *qi = q + 32 * (size_t)i;
        sub[2 * i] = sub[2 * i + 1] = 1;
        mu[i] = 0.0f;
        if (gb_is_iq(fmt)) {
            gb_iq_qx_part(fmt, blk, k, qi, sub + 2 * i, sigma + i);
            continue;
        }
        switch (fmt) {
        case SMOE_FMT_GGML_Q4_0:
        case SMOE_FMT_GGML_Q5_0: {
            const bool q5 = fmt == SMOE_FMT_GGML_Q5_0;
            uint32_t qh = 0;
            if (q5) memcpy(&qh, blk + 2, 4);
            const uint8_t *qs = blk + (q5 ? 6 : 2);
            for (int j = 0; j < 16; j++) {
                const int lo = (qs[j] & 15) | (int)((qh >> j) & 1) << 4, hi = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
                qi[j] = (int8_t)(lo - (q5 ? 16 : 8));
                qi[j + 16] = (int8_t)(hi - (q5 ? 16 : 8));
            }
            sigma[i] = gb_f16q(blk);
            break;
        }
        case SMOE_FMT_GGML_Q8_0:
            memcpy(qi, blk + 2, 32);
            sigma[i] = gb_f16q(blk);
            break;
        case SMOE_FMT_GGML_Q4_1:
        case SMOE_FMT_GGML_Q5_1: {
            const bool q5 = fmt == SMOE_FMT_GGML_Q5_1;
            uint32_t qh = 0;
            if (q5) memcpy(&qh, blk + 4, 4);
            const uint8_t *qs = blk + (q5 ? 8 : 4);
            for (int j = 0; j < 16; j++) {
                qi[j] = (int8_t)((qs[j] & 15) | (int)((qh >> j) & 1) << 4);
                qi[j + 16] = (int8_t)((qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4);
            }
            sigma[i] = gb_f16q(blk);
            mu[i] = gb_f16q(blk + 2);
            break;
        }
        case SMOE_FMT_GGML_IQ4_NL:
        case SMOE_FMT_GGML_MXFP4: {
            const bool mx = fmt == SMOE_FMT_GGML_MXFP4;
            const uint8_t *qs = blk + (mx ? 1 : 2);
            const int8_t *kv = mx ? gb_kvalues_mxfp4 : gb_kvalues_iq4nl;
            for (int j = 0; j < 16; j++) {
                qi[j] = kv[qs[j] & 15];
                qi[j + 16] = kv[qs[j] >> 4];
            }
            sigma[i] = mx ? gb_e8m0_half(blk[0]) : gb_f16q(blk);
            break;
        }
        case SMOE_FMT_GGML_IQ4_XS: {
            const uint8_t *qs = blk + 8 + 16 * k;
            for (int j = 0; j < 16; j++) {
                qi[j] = gb_kvalues_iq4nl[qs[j] & 15];
                qi[j + 16] = gb_kvalues_iq4nl[qs[j] >> 4];
            }
            sigma[i] = gb_f16q(blk) * (float)gb_scale_iq4xs(blk, k);
            break;
        }
        case SMOE_FMT_GGML_Q4_K:
        case SMOE_FMT_GGML_Q5_K: {
            const bool q5 = fmt == SMOE_FMT_GGML_Q5_K;
            const uint8_t *qs = blk + (q5 ? 48 : 16) + (k / 2) * 32, *qh = blk + 16;
            for (int l = 0; l < 32; l++) {
                int v = (qs[l] >> (4 * (k % 2))) & 15;
                if (q5) v |= ((qh[l] >> k) & 1) << 4;
                qi[l] = (int8_t)v;
            }
            uint8_t s, m;
            gb_scale_min_k4(blk + 4, k, &s, &m);
            sigma[i] = gb_f16q(blk) * (float)s;
            mu[i] = -(gb_f16q(blk + 2) * (float)m);
            break;
        }
        case SMOE_FMT_GGML_Q6_K: {
            const uint8_t *ql = blk + (k / 4) * 64, *qh = blk + 128 + (k / 4) * 32;
            const int r = (k % 4) * 32; /* columns [r, r + 32) of the 128-column half */
            for (int l = 0; l < 32; l++) {
                const int lo = (ql[(r + l) % 64] >> (4 * ((r + l) / 64))) & 15, hi = (qh[l] >> (2 * (r / 32))) & 3;
                qi[l] = (int8_t)((lo | hi << 4) - 32);
            }
            const int8_t *sc = (const int8_t *)(const void *)(blk + 192);
            sub[2 * i] = sc[2 * k];
            sub[2 * i + 1] = sc[2 * k + 1];
            sigma[i] = gb_f16q(blk + 208);
            break;
        }
        case SMOE_FMT_GGML_Q2_K: {
            const uint8_t *qs = blk + 16 + (k / 4) * 32;
            for (int l = 0; l < 32; l++) qi[l] = (int8_t)((qs[l] >> (2 * (k % 4))) & 3);
            sub[2 * i] = (int16_t)(blk[2 * k] & 15);
            sub[2 * i + 1] = (int16_t)(blk[2 * k + 1] & 15);
            sigma[i] = gb_f16q(blk + 80);
            break;
        }
        case SMOE_FMT_GGML_Q3_K: {
            const uint8_t *hm = blk, *qs = blk + 32 + (k / 4) * 32;
            for (int l = 0; l < 32; l++) {
                const int ql = (qs[l] >> (2 * (k % 4))) & 3;
                qi[l] = (int8_t)(ql - (((hm[l] >> k) & 1) ? 0 : 4));
            }
            sub[2 * i] = (int16_t)gb_scale_q3k(blk + 96, 2 * k);
            sub[2 * i + 1] = (int16_t)gb_scale_q3k(blk + 96, 2 * k + 1);
            sigma[i] = gb_f16q(blk + 108);
            break;
        }
        default:
            memset(qi, 0, 32);
            sigma[i] = 0.0f;
        }
    }
}

/* Q2_K's mins of block b (32 columns) of a row: m[h] the 4-bit min of its half h (16 columns);
 * returns ν = −dmin (widened as gb_f16q), so that the block's min term is ν·Σ_h m_h·Σ_{c ∈ h} x_c. */
static inline float gb_q2k_mins(const uint8_t *row, uint32_t b, int16_t m[2]) {
    const uint8_t *blk = row + (size_t)(b / 8) * 84;
    const uint32_t k = b % 8;
    m[0] = (int16_t)(blk[2 * k] >> 4);
    m[1] = (int16_t)(blk[2 * k + 1] >> 4);
    return -gb_f16q(blk + 82);
}

#endif
