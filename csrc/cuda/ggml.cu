/* ggml.cu — products and embedding rows with GGML block formats (smoe.h's SMOE_FMT_GGML_*, ggml_type
 * + 32: GGUF imports, gpt-oss's MXFP4 experts as released), on the FP32 cores (cuda_ops.h).
 *
 * A row of a GGML tensor is cols / block_size blocks laid out as ggml's ggml-common.h lays them out
 * (cpu/ggml_blocks.h describes them; vault.h's smoe_ggml_block gives the sizes). Blocks of 18, 22 or
 * 34 bytes sit at any alignment, so every field is read byte by byte. A weight is dequantised with
 * gb_dequant_block's operations (gguf-py's), each product and sum rounded (no fused multiply-add),
 * so the GPU's dequantised weights are the CPU's bits.
 *
 * The products keep cuda_common.cuh's rule: the columns in words of 8 (a word never straddles a
 * block, nor a K-quant's sub-block of 16 or 32), lane l of the row's warp taking words l, l + 32, …
 * in order with acc = fma(w_c, x_c, acc) over the word's columns, then the warp's butterfly; tokens
 * tiled 8 to a warp and 64 to a block, which touches no sum's order. So decode, a chunk and a
 * streamed expert's launch give each element the same bits. */
#include "cuda_common.cuh"

enum {
    G_F16 = 33, G_Q4_0 = 34, G_Q4_1 = 35, G_Q5_0 = 38, G_Q5_1 = 39, G_Q8_0 = 40, G_Q2_K = 42, G_Q3_K = 43,
    G_Q4_K = 44, G_Q5_K = 45, G_Q6_K = 46, G_IQ2_XXS = 48, G_IQ2_XS = 49, G_IQ3_XXS = 50, G_IQ1_S = 51,
    G_IQ4_NL = 52, G_IQ3_S = 53, G_IQ2_S = 54, G_IQ4_XS = 55, G_IQ1_M = 61, G_MXFP4 = 71
};

/* The IQ formats' codebooks (cpu/ggml_iq_grids.h, from gguf-py), as device arrays: cu_gb_iq2xxs_grid, ... */
#define GB_GRID(type, name) __device__ const type cu_##name
#include "../cpu/ggml_iq_grids.h"
#undef GB_GRID

__constant__ int8_t kv_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
__constant__ int8_t kv_mxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* Columns per block and bytes per block (vault.h's smoe_ggml_block); 0 for another format. */
__host__ __device__ __forceinline__ void g_block(uint32_t fmt, uint32_t *bs, uint32_t *ts) {
    uint32_t b = 32, t = 0;
    switch (fmt) {
    case G_F16: b = 1, t = 2; break;
    case G_Q4_0: t = 18; break;
    case G_Q4_1: t = 20; break;
    case G_Q5_0: t = 22; break;
    case G_Q5_1: t = 24; break;
    case G_Q8_0: t = 34; break;
    case G_Q2_K: b = 256, t = 84; break;
    case G_Q3_K: b = 256, t = 110; break;
    case G_Q4_K: b = 256, t = 144; break;
    case G_Q5_K: b = 256, t = 176; break;
    case G_Q6_K: b = 256, t = 210; break;
    case G_IQ4_NL: t = 18; break;
    case G_IQ4_XS: b = 256, t = 136; break;
    case G_IQ2_XXS: b = 256, t = 66; break;
    case G_IQ2_XS: b = 256, t = 74; break;
    case G_IQ2_S: b = 256, t = 82; break;
    case G_IQ3_XXS: b = 256, t = 98; break;
    case G_IQ3_S: b = 256, t = 110; break;
    case G_IQ1_S: b = 256, t = 50; break;
    case G_IQ1_M: b = 256, t = 56; break;
    case G_MXFP4: t = 17; break;
    default: b = 0; break;
    }
    *bs = b;
    *ts = t;
}

__device__ __forceinline__ float g_f16(const uint8_t *p) {
    return __half2float(__ushort_as_half((unsigned short)(p[0] | p[1] << 8)));
}

__device__ __forceinline__ uint32_t g_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

__device__ __forceinline__ float g_mul(float a, float b) { return __fmul_rn(a, b); }

__device__ __forceinline__ uint32_t g_u16(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8; }

/* 7 sign bits and an eighth that makes the count of minus signs even (cpu/ggml_blocks.h, gb_ksigns) */
__device__ __forceinline__ uint32_t g_ksigns(uint32_t i) { return i | (uint32_t)(__popc(i) & 1) << 7; }

/* The 8 columns [8l, 8l + 8) of part k (32 columns) of an IQ codebook block, dequantised as
 * gb_dequant_block does (cpu/ggml_blocks.h, gb_iq_part: the same fields): a word is one group of 8,
 * one codebook entry (two for the 4-wide IQ3 grids) and one sign byte or ⅛ sign. */
__device__ __forceinline__ void g_iq_word(uint32_t fmt, const uint8_t *blk, uint32_t k, uint32_t l, float v[8]) {
    int8_t g[8];
    uint32_t sg = 0, ls = 0;
    uint64_t e = 0;
    const uint32_t h = l / 2; /* the word's 16-column half */
    uint16_t dbits = (uint16_t)g_u16(blk);
    switch (fmt) {
    case G_IQ2_XXS: {
        const uint32_t aux = g_u32(blk + 6 + 8 * k);
        e = cu_gb_iq2xxs_grid[blk[2 + 8 * k + l]];
        sg = g_ksigns((aux >> (7 * l)) & 127), ls = aux >> 28;
        break;
    }
    case G_IQ2_XS: {
        const uint32_t q = g_u16(blk + 2 + 2 * (4 * k + l));
        e = cu_gb_iq2xs_grid[q & 511];
        sg = g_ksigns(q >> 9), ls = (blk[66 + k] >> (4 * h)) & 15;
        break;
    }
    case G_IQ2_S:
        e = cu_gb_iq2s_grid[blk[2 + 4 * k + l] | ((blk[66 + k] >> (2 * l)) & 3) << 8];
        sg = blk[34 + 4 * k + l], ls = (blk[74 + k] >> (4 * h)) & 15;
        break;
    case G_IQ3_XXS: {
        const uint32_t aux = g_u32(blk + 66 + 4 * k);
        e = (uint64_t)cu_gb_iq3xxs_grid[blk[2 + 8 * k + 2 * l]] | (uint64_t)cu_gb_iq3xxs_grid[blk[3 + 8 * k + 2 * l]] << 32;
        sg = g_ksigns((aux >> (7 * l)) & 127), ls = aux >> 28;
        break;
    }
    case G_IQ3_S: {
        const uint32_t qh = blk[66 + k], m = 2 * l;
        e = (uint64_t)cu_gb_iq3s_grid[blk[2 + 8 * k + m] | ((qh >> m) & 1) << 8] |
            (uint64_t)cu_gb_iq3s_grid[blk[3 + 8 * k + m] | ((qh >> (m + 1)) & 1) << 8] << 32;
        sg = blk[74 + 4 * k + l], ls = (blk[106 + k / 2] >> (4 * (k % 2))) & 15;
        break;
    }
    case G_IQ1_S: {
        const uint32_t q = g_u16(blk + 34 + 2 * k);
        e = cu_gb_iq1s_grid[blk[2 + 4 * k + l] | ((q >> (3 * l)) & 7) << 8];
        sg = q >> 15, ls = (q >> 12) & 7;
        break;
    }
    default: { /* G_IQ1_M: d in the top nibbles of the scale words at 48 */
        const uint32_t nib = (blk[32 + 2 * k + l / 2] >> (4 * (l % 2))) & 15, s = 2 * k + h;
        e = cu_gb_iq1s_grid[blk[4 * k + l] | (nib & 7) << 8];
        sg = nib >> 3, ls = (g_u16(blk + 48 + 2 * (s / 4)) >> (3 * (s % 4))) & 7;
        dbits = (uint16_t)((g_u16(blk + 48) >> 12) | ((g_u16(blk + 50) >> 8) & 0xF0u) | ((g_u16(blk + 52) >> 4) & 0xF00u) |
                           (g_u16(blk + 54) & 0xF000u));
        break;
    }
    }
#pragma unroll
    for (int j = 0; j < 8; j++) g[j] = (int8_t)(e >> (8 * j));
    const float d = __half2float(__ushort_as_half(dbits));
    if (fmt == G_IQ1_S || fmt == G_IQ1_M) { /* dl·(g + δ) */
        const float dl = g_mul(d, (float)(2 * ls + 1)), delta = sg ? -0.125f : 0.125f;
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = g_mul(dl, __fadd_rn((float)g[j], delta));
        return;
    }
    float db;
    if (fmt == G_IQ3_S)
        db = g_mul(d, (float)(1 + 2 * ls));
    else
        db = g_mul(g_mul(d, __fadd_rn(0.5f, (float)ls)), fmt == G_IQ3_XXS ? 0.5f : 0.25f);
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const float x = g_mul(db, (float)g[j]);
        v[j] = (sg >> j) & 1 ? -x : x;
    }
}

/* The 8 columns of word wi (columns 8wi … 8wi + 7) of a row starting at row, dequantised. */
__device__ __forceinline__ void g_word(uint32_t fmt, const uint8_t *row, uint32_t wi, float v[8]) {
    uint32_t bs, ts;
    g_block(fmt, &bs, &ts);
    const uint32_t col0 = 8 * wi, e0 = col0 % bs;
    const uint8_t *blk = row + (size_t)(col0 / bs) * ts;
    switch (fmt) {
    case G_F16: {
        const uint8_t *p = row + 2 * (size_t)col0;
#pragma unroll
        for (int k = 0; k < 8; k++) v[k] = g_f16(p + 2 * k);
        return;
    }
    case G_Q4_0:
    case G_Q4_1:
    case G_Q5_0:
    case G_Q5_1: {
        const bool five = fmt == G_Q5_0 || fmt == G_Q5_1, min = fmt == G_Q4_1 || fmt == G_Q5_1;
        const float d = g_f16(blk), m = min ? g_f16(blk + 2) : 0.0f;
        const uint32_t qh = five ? g_u32(blk + (min ? 4 : 2)) : 0;
        const uint8_t *qs = blk + (fmt == G_Q4_0 ? 2 : fmt == G_Q4_1 ? 4 : fmt == G_Q5_0 ? 6 : 8);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const uint32_t e = e0 + k, j = e & 15;
            int q = e < 16 ? qs[j] & 15 : qs[j] >> 4;
            if (five) q |= (int)((qh >> e) & 1) << 4;
            if (min)
                v[k] = __fadd_rn(g_mul(d, (float)q), m);
            else
                v[k] = g_mul(d, (float)(q - (five ? 16 : 8)));
        }
        return;
    }
    case G_Q8_0: {
        const float d = g_f16(blk);
#pragma unroll
        for (int k = 0; k < 8; k++) v[k] = g_mul((float)(int8_t)blk[2 + e0 + k], d);
        return;
    }
    case G_Q2_K: {
        const uint8_t *sc = blk, *qs = blk + 16;
        const float d = g_f16(blk + 80), dmin = g_f16(blk + 82);
        const uint32_t s = sc[e0 / 16];
        const float dl = g_mul(d, (float)(s & 15)), ml = g_mul(dmin, (float)(s >> 4));
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const uint32_t e = e0 + k;
            const int q = (qs[(e / 128) * 32 + e % 32] >> (2 * ((e % 128) / 32))) & 3;
            v[k] = __fsub_rn(g_mul(dl, (float)q), ml);
        }
        return;
    }
    case G_Q3_K: {
        const uint8_t *hm = blk, *qs = blk + 32, *sc = blk + 96;
        const float d = g_f16(blk + 108);
        const uint32_t j = e0 / 16;
        const int lo = j < 8 ? sc[j] & 15 : sc[j - 8] >> 4, hi = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
        const float dl = g_mul(d, (float)((lo | hi << 4) - 32));
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const uint32_t e = e0 + k;
            const int ql = (qs[(e / 128) * 32 + e % 32] >> (2 * ((e % 128) / 32))) & 3;
            const int q = ql - (((hm[e % 32] >> (e / 32)) & 1) ? 0 : 4);
            v[k] = g_mul(dl, (float)q);
        }
        return;
    }
    case G_Q4_K:
    case G_Q5_K: {
        const bool q5 = fmt == G_Q5_K;
        const float d = g_f16(blk), dmin = g_f16(blk + 2);
        const uint8_t *s = blk + 4, *qh = blk + 16, *qs = blk + (q5 ? 48 : 16);
        const uint32_t i = e0 / 32;
        uint32_t sv, mv;
        if (i < 4) {
            sv = s[i] & 63;
            mv = s[i + 4] & 63;
        } else {
            sv = (s[i + 4] & 0xF) | ((s[i - 4] >> 6) << 4);
            mv = (s[i + 4] >> 4) | ((s[i] >> 6) << 4);
        }
        const float d1 = g_mul(d, (float)sv), dm = g_mul(dmin, (float)mv);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const uint32_t l = (e0 + k) % 32;
            int q = (qs[(i / 2) * 32 + l] >> (4 * (i % 2))) & 15;
            if (q5) q |= ((qh[l] >> i) & 1) << 4;
            v[k] = __fsub_rn(g_mul(d1, (float)q), dm);
        }
        return;
    }
    case G_Q6_K: {
        const uint8_t *ql = blk, *qh = blk + 128;
        const float d = g_f16(blk + 208);
        const float d1 = g_mul(d, (float)(int8_t)blk[192 + e0 / 16]);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const uint32_t e = e0 + k, half = e / 128, r = e % 128;
            const int lo = (ql[half * 64 + r % 64] >> (4 * (r / 64))) & 15;
            const int hi = (qh[half * 32 + r % 32] >> (2 * (r / 32))) & 3;
            v[k] = g_mul(d1, (float)((lo | hi << 4) - 32));
        }
        return;
    }
    case G_IQ4_NL:
    case G_MXFP4: {
        const bool mx = fmt == G_MXFP4;
        float d;
        if (mx) {
            const uint32_t e = blk[0];
            d = __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23); /* 2^(e − 128) */
        } else {
            d = g_f16(blk);
        }
        const uint8_t *qs = blk + (mx ? 1 : 2);
        const int8_t *kv = mx ? kv_mxfp4 : kv_iq4nl;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const uint32_t e = e0 + k, j = e & 15;
            v[k] = g_mul(d, (float)kv[e < 16 ? qs[j] & 15 : qs[j] >> 4]);
        }
        return;
    }
    case G_IQ4_XS: {
        const float d = g_f16(blk);
        const uint8_t *qs = blk + 8;
        const uint32_t i = e0 / 32, hbits = (uint32_t)blk[2] | (uint32_t)blk[3] << 8;
        const int ls = (int)(((blk[4 + i / 2] >> (4 * (i % 2))) & 15) | (((hbits >> (2 * i)) & 3) << 4)) - 32;
        const float dl = g_mul(d, (float)ls);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const uint32_t l = (e0 + k) % 32;
            v[k] = g_mul(dl, (float)kv_iq4nl[l < 16 ? qs[16 * i + l] & 15 : qs[16 * i + l - 16] >> 4]);
        }
        return;
    }
    case G_IQ2_XXS:
    case G_IQ2_XS:
    case G_IQ2_S:
    case G_IQ3_XXS:
    case G_IQ3_S:
    case G_IQ1_S:
    case G_IQ1_M: g_iq_word(fmt, blk, e0 / 32, (e0 % 32) / 8, v); return;
    default:
#pragma unroll
        for (int k = 0; k < 8; k++) v[k] = 0.0f; /* refused before any launch (smoe_cu_ggml) */
        return;
    }
}

__device__ __forceinline__ float g_chain8(float s, const float v[8], const float *x) {
    const float4 a = reinterpret_cast<const float4 *>(x)[0], b = reinterpret_cast<const float4 *>(x)[1];
    s = fmaf(v[0], a.x, s); s = fmaf(v[1], a.y, s); s = fmaf(v[2], a.z, s); s = fmaf(v[3], a.w, s);
    s = fmaf(v[4], b.x, s); s = fmaf(v[5], b.y, s); s = fmaf(v[6], b.z, s); s = fmaf(v[7], b.w, s);
    return s;
}

__global__ void __launch_bounds__(MM_WARPS * 32) k_ggml(smoe_cu_tensor T, smoe_cu_rows R, const float *__restrict__ x,
                                                        size_t ldx, float *__restrict__ y, size_t ldy) {
    const uint32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const uint8_t *w;
    uint32_t start, count, bx, ycol;
    launch_item(R, T, &ycol, &bx, &w, &start, &count);
    y += ycol;
    const uint32_t r = bx * MM_WARPS + warp;
    if (r >= T.rows) return;
    const uint32_t t0 = blockIdx.z * MM_TZ;
    if (t0 >= count) return;
    uint32_t bs, ts;
    g_block(T.format, &bs, &ts);
    const uint8_t *row = w + (size_t)r * (T.cols / bs) * ts;
    const uint32_t t1 = min(count, t0 + (uint32_t)MM_TZ), nw = T.cols / 8;
    for (uint32_t tb = t0; tb < t1; tb += MM_TT) {
        const uint32_t nt = min((uint32_t)MM_TT, t1 - tb);
        float acc[MM_TT];
#pragma unroll
        for (int t = 0; t < MM_TT; t++) acc[t] = 0.0f;
        for (uint32_t wi = lane; wi < nw; wi += 32) {
            float v[8];
            g_word(T.format, row, wi, v);
#pragma unroll
            for (int t = 0; t < MM_TT; t++)
                if ((uint32_t)t < nt) acc[t] = g_chain8(acc[t], v, x + (size_t)(start + tb + t) * ldx + 8 * (size_t)wi);
        }
#pragma unroll
        for (int t = 0; t < MM_TT; t++) {
            if ((uint32_t)t >= nt) break; /* nt is the warp's: the shuffles stay converged */
            const float sum = warp_sum(acc[t]);
            if (lane == 0) {
                const uint32_t j = start + tb + t;
                y[(size_t)(R.yrow ? R.yrow[j] : j) * ldy + r] = sum;
            }
        }
    }
}

extern "C" int smoe_cu_ggml(const smoe_cu_tensor *T) {
    uint32_t bs, ts;
    g_block(T->format, &bs, &ts);
    return bs != 0;
}

extern "C" int smoe_cu_matmul_ggml(smoe_cu_stream st, const smoe_cu_tensor *T, const smoe_cu_rows *R,
                                   const smoe_cu_act *a, float *y, size_t ldy) {
    const uint32_t items = R->items ? R->n_items : 1, m = R->items ? R->max_count : R->n;
    if (items == 0 || m == 0) return 0;
    if (!smoe_cu_ggml(T) || T->cols % 8 != 0) return (int)cudaErrorInvalidValue;
    const uint32_t px = R->pair ? 2 : 1; /* a pair launch: twice the row blocks (launch_item) */
    dim3 grid(px * ((T->rows + MM_WARPS - 1) / MM_WARPS), items, (m + MM_TZ - 1) / MM_TZ);
    k_ggml<<<grid, MM_WARPS * 32, 0, (cudaStream_t)st>>>(*T, *R, a->x, a->ldx, y, ldy);
    return (int)cudaGetLastError();
}

__global__ void k_embed_ggml(smoe_cu_tensor T, const uint8_t *w, const int32_t *ids, float *x) {
    const uint32_t t = blockIdx.x;
    uint32_t bs, ts;
    g_block(T.format, &bs, &ts);
    const uint8_t *row = w + (size_t)(uint32_t)ids[t] * (T.cols / bs) * ts;
    for (uint32_t wi = threadIdx.x; wi < T.cols / 8; wi += blockDim.x) {
        float v[8];
        g_word(T.format, row, wi, v);
#pragma unroll
        for (int k = 0; k < 8; k++) x[(size_t)t * T.cols + 8 * wi + k] = v[k];
    }
}

extern "C" int smoe_cu_embed_ggml(smoe_cu_stream st, const smoe_cu_tensor *T, const uint8_t *w, const int32_t *ids,
                                  uint32_t n, float *x) {
    if (n == 0) return 0;
    if (!smoe_cu_ggml(T) || T->cols % 8 != 0) return (int)cudaErrorInvalidValue;
    k_embed_ggml<<<n, 128, 0, (cudaStream_t)st>>>(*T, w, ids, x);
    return (int)cudaGetLastError();
}
