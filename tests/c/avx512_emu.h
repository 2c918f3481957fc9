/* avx512_emu.h — the AVX-512 intrinsics that csrc/cpu/kernels_avx512.c uses, as plain C on GCC's
 * vector types, following Intel's definitions operation by operation. Built only with
 * -DSMOE_AVX512_EMULATE (tests/test_c_units.py's "avx512emu" build): then kernels_avx512.c drops
 * its target attributes, cpu.c reports AVX-512 + VNNI, and test_kernels checks the kernels'
 * logic (layouts, lane orders, masks) bit for bit against the reference on a CPU without
 * AVX-512. It says nothing about the instructions themselves: a real AVX-512 CPU runs the same
 * tests on the real instructions. */
#ifndef SMOE_AVX512_EMU_H
#define SMOE_AVX512_EMU_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define EMU static inline

#define EMU_IN(T, n, name, v) \
    T name[n];                \
    memcpy(name, &(v), sizeof name)
#define EMU_OUT(R, arr) \
    R out_;             \
    memcpy(&out_, arr, sizeof out_);

EMU __m512i emu_loadu_si512(const void *p) {
    __m512i r;
    memcpy(&r, p, 64);
    return r;
}
EMU void emu_store_si512(void *p, __m512i v) { memcpy(p, &v, 64); }
EMU __m512 emu_loadu_ps(const float *p) {
    __m512 r;
    memcpy(&r, p, 64);
    return r;
}
EMU void emu_storeu_ps(float *p, __m512 v) { memcpy(p, &v, 64); }
EMU __m512i emu_maskz_loadu_epi8(uint64_t k, const void *p) {
    uint8_t r[64];
    for (int i = 0; i < 64; i++) r[i] = (k >> i & 1) ? ((const uint8_t *)p)[i] : 0;
    EMU_OUT(__m512i, r) return out_;
}
EMU __m256i emu_maskz_loadu_epi16_256(uint32_t k, const void *p) {
    uint16_t r[16];
    for (int i = 0; i < 16; i++)
        if (k >> i & 1)
            memcpy(r + i, (const uint8_t *)p + 2 * i, 2);
        else
            r[i] = 0;
    EMU_OUT(__m256i, r) return out_;
}
EMU void emu_mask_storeu_ps(float *p, uint32_t k, __m512 v) {
    EMU_IN(float, 16, a, v);
    for (int i = 0; i < 16; i++)
        if (k >> i & 1) p[i] = a[i];
}
EMU __m512 emu_cvtph_ps(__m256i h) {
    EMU_IN(__m128i, 2, a, h);
    float r[16];
    _mm256_storeu_ps(r, _mm256_cvtph_ps(a[0]));
    _mm256_storeu_ps(r + 8, _mm256_cvtph_ps(a[1]));
    EMU_OUT(__m512, r) return out_;
}
EMU __m512i emu_cvtepu16_epi32(__m256i h) {
    EMU_IN(uint16_t, 16, a, h);
    int32_t r[16];
    for (int i = 0; i < 16; i++) r[i] = a[i];
    EMU_OUT(__m512i, r) return out_;
}
EMU __m512i emu_slli_epi32(__m512i v, unsigned n) {
    EMU_IN(uint32_t, 16, a, v);
    for (int i = 0; i < 16; i++) a[i] = n > 31 ? 0 : a[i] << n;
    EMU_OUT(__m512i, a) return out_;
}
EMU __m512i emu_srli_epi16(__m512i v, unsigned n) {
    EMU_IN(uint16_t, 32, a, v);
    for (int i = 0; i < 32; i++) a[i] = n > 15 ? 0 : (uint16_t)(a[i] >> n);
    EMU_OUT(__m512i, a) return out_;
}
#define EMU_CAST(name, R, A) \
    EMU R name(A v) {        \
        R r;                 \
        memset(&r, 0, sizeof r); \
        memcpy(&r, &v, sizeof r < sizeof v ? sizeof r : sizeof v); \
        return r;            \
    }
EMU_CAST(emu_castsi512_ps, __m512, __m512i)
EMU_CAST(emu_castps_pd, __m512d, __m512)
EMU_CAST(emu_castps256_ps512, __m512, __m256)
EMU_CAST(emu_castps512_ps256, __m256, __m512)
EMU __m256d emu_extractf64x4_pd(__m512d v, int i) {
    EMU_IN(__m256d, 2, a, v);
    return a[i & 1];
}
EMU __m512i emu_broadcast_i32x4(__m128i v) {
    __m128i r[4] = {v, v, v, v};
    EMU_OUT(__m512i, r) return out_;
}
EMU __m512i emu_setr_epi64(int64_t a, int64_t b, int64_t c, int64_t d, int64_t e, int64_t f, int64_t g, int64_t h) {
    int64_t r[8] = {a, b, c, d, e, f, g, h};
    EMU_OUT(__m512i, r) return out_;
}
EMU __m512i emu_setr_epi32(int a, int b, int c, int d, int e, int f, int g, int h, int i, int j, int k, int l, int m,
                           int n, int o, int p) {
    int32_t r[16] = {a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p};
    EMU_OUT(__m512i, r) return out_;
}
EMU __m512i emu_set1_epi8(char c) {
    uint8_t r[64];
    memset(r, (uint8_t)c, 64);
    EMU_OUT(__m512i, r) return out_;
}
EMU __m512i emu_set1_epi16(short c) {
    int16_t r[32];
    for (int i = 0; i < 32; i++) r[i] = c;
    EMU_OUT(__m512i, r) return out_;
}
EMU __m512i emu_setzero_si512(void) {
    __m512i r;
    memset(&r, 0, sizeof r);
    return r;
}
EMU __m512 emu_setzero_ps(void) {
    __m512 r;
    memset(&r, 0, sizeof r);
    return r;
}
EMU __m512i emu_shuffle_epi8(__m512i v, __m512i c) {
    EMU_IN(uint8_t, 64, a, v);
    EMU_IN(uint8_t, 64, b, c);
    uint8_t r[64];
    for (int i = 0; i < 64; i++) r[i] = (b[i] & 0x80) ? 0 : a[(i & ~15) + (b[i] & 15)];
    EMU_OUT(__m512i, r) return out_;
}
EMU __m512i emu_permutex2var_epi64(__m512i va, __m512i vi, __m512i vb) {
    EMU_IN(uint64_t, 8, a, va);
    EMU_IN(uint64_t, 8, x, vi);
    EMU_IN(uint64_t, 8, b, vb);
    uint64_t r[8];
    for (int i = 0; i < 8; i++) r[i] = (x[i] & 8) ? b[x[i] & 7] : a[x[i] & 7];
    EMU_OUT(__m512i, r) return out_;
}
EMU __m512i emu_permutexvar_epi64(__m512i vi, __m512i va) {
    EMU_IN(uint64_t, 8, a, va);
    EMU_IN(uint64_t, 8, x, vi);
    uint64_t r[8];
    for (int i = 0; i < 8; i++) r[i] = a[x[i] & 7];
    EMU_OUT(__m512i, r) return out_;
}
EMU int8_t emu_sat8(int16_t v) { return v > 127 ? 127 : v < -128 ? -128 : (int8_t)v; }
EMU __m512i emu_packs_epi16(__m512i va, __m512i vb) {
    EMU_IN(int16_t, 32, a, va);
    EMU_IN(int16_t, 32, b, vb);
    int8_t r[64];
    for (int l = 0; l < 4; l++)
        for (int i = 0; i < 8; i++) {
            r[16 * l + i] = emu_sat8(a[8 * l + i]);
            r[16 * l + 8 + i] = emu_sat8(b[8 * l + i]);
        }
    EMU_OUT(__m512i, r) return out_;
}
EMU __m512 emu_permutex2var_ps(__m512 va, __m512i vi, __m512 vb) {
    EMU_IN(float, 16, a, va);
    EMU_IN(uint32_t, 16, x, vi);
    EMU_IN(float, 16, b, vb);
    float r[16];
    for (int i = 0; i < 16; i++) r[i] = (x[i] & 16) ? b[x[i] & 15] : a[x[i] & 15];
    EMU_OUT(__m512, r) return out_;
}
EMU __m512 emu_permutexvar_ps(__m512i vi, __m512 va) {
    EMU_IN(float, 16, a, va);
    EMU_IN(uint32_t, 16, x, vi);
    float r[16];
    for (int i = 0; i < 16; i++) r[i] = a[x[i] & 15];
    EMU_OUT(__m512, r) return out_;
}
EMU __m512i emu_shuffle_i32x4(__m512i va, __m512i vb, int imm) {
    EMU_IN(__m128i, 4, a, va);
    EMU_IN(__m128i, 4, b, vb);
    __m128i r[4] = {a[imm & 3], a[(imm >> 2) & 3], b[(imm >> 4) & 3], b[(imm >> 6) & 3]};
    EMU_OUT(__m512i, r) return out_;
}
EMU __m512i emu_add_epi32(__m512i va, __m512i vb) {
    EMU_IN(uint32_t, 16, a, va);
    EMU_IN(uint32_t, 16, b, vb);
    for (int i = 0; i < 16; i++) a[i] += b[i];
    EMU_OUT(__m512i, a) return out_;
}
EMU __m512i emu_add_epi16(__m512i va, __m512i vb) {
    EMU_IN(uint16_t, 32, a, va);
    EMU_IN(uint16_t, 32, b, vb);
    for (int i = 0; i < 32; i++) a[i] = (uint16_t)(a[i] + b[i]);
    EMU_OUT(__m512i, a) return out_;
}
EMU __m512i emu_and_si512(__m512i va, __m512i vb) {
    EMU_IN(uint64_t, 8, a, va);
    EMU_IN(uint64_t, 8, b, vb);
    for (int i = 0; i < 8; i++) a[i] &= b[i];
    EMU_OUT(__m512i, a) return out_;
}
/* unpack: in each 128-bit lane, elements of the low (hi = 0) or high half of a and b, interleaved */
EMU __m512i emu_unpack32(__m512i va, __m512i vb, int hi) {
    EMU_IN(uint32_t, 16, a, va);
    EMU_IN(uint32_t, 16, b, vb);
    uint32_t r[16];
    for (int l = 0; l < 4; l++)
        for (int i = 0; i < 2; i++) {
            r[4 * l + 2 * i] = a[4 * l + 2 * hi + i];
            r[4 * l + 2 * i + 1] = b[4 * l + 2 * hi + i];
        }
    EMU_OUT(__m512i, r) return out_;
}
EMU __m512i emu_unpack64(__m512i va, __m512i vb, int hi) {
    EMU_IN(uint64_t, 8, a, va);
    EMU_IN(uint64_t, 8, b, vb);
    uint64_t r[8];
    for (int l = 0; l < 4; l++) {
        r[2 * l] = a[2 * l + hi];
        r[2 * l + 1] = b[2 * l + hi];
    }
    EMU_OUT(__m512i, r) return out_;
}
EMU __m512i emu_dpbusd_epi32(__m512i vs, __m512i va, __m512i vb) {
    EMU_IN(int32_t, 16, s, vs);
    EMU_IN(uint8_t, 64, a, va);
    EMU_IN(int8_t, 64, b, vb);
    for (int i = 0; i < 16; i++)
        for (int k = 0; k < 4; k++) s[i] = (int32_t)((uint32_t)s[i] + (uint32_t)(a[4 * i + k] * b[4 * i + k]));
    EMU_OUT(__m512i, s) return out_;
}
EMU __m512i emu_madd_epi16(__m512i va, __m512i vb) {
    EMU_IN(int16_t, 32, a, va);
    EMU_IN(int16_t, 32, b, vb);
    int32_t r[16];
    for (int i = 0; i < 16; i++)
        r[i] = (int32_t)((uint32_t)(a[2 * i] * b[2 * i]) + (uint32_t)(a[2 * i + 1] * b[2 * i + 1]));
    EMU_OUT(__m512i, r) return out_;
}
EMU __m512i emu_maddubs_epi16(__m512i va, __m512i vb) {
    EMU_IN(uint8_t, 64, a, va);
    EMU_IN(int8_t, 64, b, vb);
    int16_t r[32];
    for (int i = 0; i < 32; i++) {
        const int v = a[2 * i] * b[2 * i] + a[2 * i + 1] * b[2 * i + 1];
        r[i] = (int16_t)(v > 32767 ? 32767 : v < -32768 ? -32768 : v);
    }
    EMU_OUT(__m512i, r) return out_;
}
EMU __m512 emu_fmadd_ps(__m512 va, __m512 vb, __m512 vc) {
    EMU_IN(float, 16, a, va);
    EMU_IN(float, 16, b, vb);
    EMU_IN(float, 16, c, vc);
    for (int i = 0; i < 16; i++) a[i] = fmaf(a[i], b[i], c[i]);
    EMU_OUT(__m512, a) return out_;
}
EMU __m512 emu_mul_ps(__m512 va, __m512 vb) {
    EMU_IN(float, 16, a, va);
    EMU_IN(float, 16, b, vb);
    for (int i = 0; i < 16; i++) a[i] = a[i] * b[i];
    EMU_OUT(__m512, a) return out_;
}
EMU __m512 emu_cvtepi32_ps(__m512i va) {
    EMU_IN(int32_t, 16, a, va);
    float r[16];
    for (int i = 0; i < 16; i++) r[i] = (float)a[i];
    EMU_OUT(__m512, r) return out_;
}

EMU __m512 emu_add_ps(__m512 va, __m512 vb) {
    EMU_IN(float, 16, a, va);
    EMU_IN(float, 16, b, vb);
    for (int i = 0; i < 16; i++) a[i] = a[i] + b[i];
    EMU_OUT(__m512, a) return out_;
}
EMU __m512 emu_set1_ps(float f) {
    float a[16];
    for (int i = 0; i < 16; i++) a[i] = f;
    EMU_OUT(__m512, a) return out_;
}

/* AMX: eight tiles of up to 16 rows of 64 bytes, shaped by the last _tile_loadconfig (per thread,
 * as the hardware's). A tile instruction without a configuration aborts, where the CPU would
 * raise #UD; tdpbusd checks its operands' shapes as the CPU does. */
#include <stdlib.h>
static _Thread_local struct {
    uint8_t t[8][16][64];
    uint8_t rows[8];
    uint16_t colsb[8];
    int configured;
    uint8_t cfg[64]; /* as loaded, for _tile_storeconfig */
} emu_amx;
EMU void emu_tile_loadconfig(const void *cfg) {
    const uint8_t *c = cfg;
    if (c[0] != 1) abort(); /* palette 1 */
    for (int i = 0; i < 8; i++) {
        uint16_t cb;
        memcpy(&cb, c + 16 + 2 * i, 2);
        emu_amx.colsb[i] = cb;
        emu_amx.rows[i] = c[48 + i];
        if (cb > 64 || emu_amx.rows[i] > 16) abort();
    }
    memset(emu_amx.t, 0, sizeof emu_amx.t);
    memcpy(emu_amx.cfg, c, 64);
    emu_amx.configured = 1;
}
EMU void emu_tile_release(void) { emu_amx.configured = 0; }
/* STTILECFG: the configuration as loaded, or 64 zero bytes where none is */
EMU void emu_tile_storeconfig(void *cfg) {
    if (emu_amx.configured)
        memcpy(cfg, emu_amx.cfg, 64);
    else
        memset(cfg, 0, 64);
}
EMU void emu_tile_loadd(int dst, const void *base, size_t stride) {
    if (!emu_amx.configured) abort();
    memset(emu_amx.t[dst], 0, sizeof emu_amx.t[dst]);
    for (int r = 0; r < emu_amx.rows[dst]; r++) memcpy(emu_amx.t[dst][r], (const uint8_t *)base + r * stride, emu_amx.colsb[dst]);
}
EMU void emu_tile_stored(int src, void *base, size_t stride) {
    if (!emu_amx.configured) abort();
    for (int r = 0; r < emu_amx.rows[src]; r++) memcpy((uint8_t *)base + r * stride, emu_amx.t[src][r], emu_amx.colsb[src]);
}
EMU void emu_tile_zero(int dst) {
    if (!emu_amx.configured) abort();
    memset(emu_amx.t[dst], 0, sizeof emu_amx.t[dst]);
}
/* C[m][n] += Σ_k (u8) A[m][k] · (s8) B[k/4][4n + k%4], int32 (wrapping), as TDPBUSD */
EMU void emu_tile_dpbusd(int c, int a, int b) {
    if (!emu_amx.configured) abort();
    const int M = emu_amx.rows[c], N = emu_amx.colsb[c] / 4, K = emu_amx.colsb[a];
    if (emu_amx.rows[a] != M || emu_amx.rows[b] != K / 4 || emu_amx.colsb[b] != emu_amx.colsb[c] || K % 4) abort();
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            int32_t acc;
            memcpy(&acc, emu_amx.t[c][m] + 4 * n, 4);
            uint32_t u = (uint32_t)acc;
            for (int k = 0; k < K; k++)
                u += (uint32_t)((int32_t)emu_amx.t[a][m][k] * (int32_t)(int8_t)emu_amx.t[b][k / 4][4 * n + k % 4]);
            acc = (int32_t)u;
            memcpy(emu_amx.t[c][m] + 4 * n, &acc, 4);
        }
}

#undef _mm512_loadu_si512
#undef _mm512_load_si512
#undef _mm512_store_si512
#undef _mm512_loadu_ps
#undef _mm512_storeu_ps
#undef _mm512_maskz_loadu_epi8
#undef _mm256_maskz_loadu_epi16
#undef _mm512_mask_storeu_ps
#undef _mm512_cvtph_ps
#undef _mm512_cvtepu16_epi32
#undef _mm512_slli_epi32
#undef _mm512_srli_epi16
#undef _mm512_castsi512_ps
#undef _mm512_castps_pd
#undef _mm512_castps256_ps512
#undef _mm512_castps512_ps256
#undef _mm512_extractf64x4_pd
#undef _mm512_broadcast_i32x4
#undef _mm512_setr_epi64
#undef _mm512_setr_epi32
#undef _mm512_set1_epi8
#undef _mm512_set1_epi16
#undef _mm512_setzero_si512
#undef _mm512_setzero_ps
#undef _mm512_shuffle_epi8
#undef _mm512_permutex2var_epi64
#undef _mm512_permutexvar_epi64
#undef _mm512_packs_epi16
#undef _mm512_permutex2var_ps
#undef _mm512_permutexvar_ps
#undef _mm512_shuffle_i32x4
#undef _mm512_add_epi32
#undef _mm512_add_epi16
#undef _mm512_and_si512
#undef _mm512_unpacklo_epi32
#undef _mm512_unpackhi_epi32
#undef _mm512_unpacklo_epi64
#undef _mm512_unpackhi_epi64
#undef _mm512_dpbusd_epi32
#undef _mm512_madd_epi16
#undef _mm512_maddubs_epi16
#undef _mm512_fmadd_ps
#undef _mm512_mul_ps
#undef _mm512_cvtepi32_ps

#define _mm512_loadu_si512 emu_loadu_si512
#define _mm512_load_si512 emu_loadu_si512
#define _mm512_store_si512 emu_store_si512
#define _mm512_loadu_ps emu_loadu_ps
#define _mm512_storeu_ps emu_storeu_ps
#define _mm512_maskz_loadu_epi8 emu_maskz_loadu_epi8
#define _mm256_maskz_loadu_epi16 emu_maskz_loadu_epi16_256
#define _mm512_mask_storeu_ps emu_mask_storeu_ps
#define _mm512_cvtph_ps emu_cvtph_ps
#define _mm512_cvtepu16_epi32 emu_cvtepu16_epi32
#define _mm512_slli_epi32 emu_slli_epi32
#define _mm512_srli_epi16 emu_srli_epi16
#define _mm512_castsi512_ps emu_castsi512_ps
#define _mm512_castps_pd emu_castps_pd
#define _mm512_castps256_ps512 emu_castps256_ps512
#define _mm512_castps512_ps256 emu_castps512_ps256
#define _mm512_extractf64x4_pd emu_extractf64x4_pd
#define _mm512_broadcast_i32x4 emu_broadcast_i32x4
#define _mm512_setr_epi64 emu_setr_epi64
#define _mm512_setr_epi32 emu_setr_epi32
#define _mm512_set1_epi8 emu_set1_epi8
#define _mm512_set1_epi16 emu_set1_epi16
#define _mm512_setzero_si512 emu_setzero_si512
#define _mm512_setzero_ps emu_setzero_ps
#define _mm512_shuffle_epi8 emu_shuffle_epi8
#define _mm512_permutex2var_epi64 emu_permutex2var_epi64
#define _mm512_permutexvar_epi64 emu_permutexvar_epi64
#define _mm512_packs_epi16 emu_packs_epi16
#define _mm512_permutex2var_ps emu_permutex2var_ps
#define _mm512_permutexvar_ps emu_permutexvar_ps
#define _mm512_shuffle_i32x4 emu_shuffle_i32x4
#define _mm512_add_epi32 emu_add_epi32
#define _mm512_add_epi16 emu_add_epi16
#define _mm512_and_si512 emu_and_si512
#define _mm512_unpacklo_epi32(a, b) emu_unpack32(a, b, 0)
#define _mm512_unpackhi_epi32(a, b) emu_unpack32(a, b, 1)
#define _mm512_unpacklo_epi64(a, b) emu_unpack64(a, b, 0)
#define _mm512_unpackhi_epi64(a, b) emu_unpack64(a, b, 1)
#define _mm512_dpbusd_epi32 emu_dpbusd_epi32
#define _mm512_madd_epi16 emu_madd_epi16
#define _mm512_maddubs_epi16 emu_maddubs_epi16
#define _mm512_fmadd_ps emu_fmadd_ps
#define _mm512_mul_ps emu_mul_ps
#define _mm512_cvtepi32_ps emu_cvtepi32_ps
#undef _mm512_storeu_si512
#undef _mm512_add_ps
#undef _mm512_set1_ps
#define _mm512_storeu_si512 emu_store_si512
#define _mm512_add_ps emu_add_ps
#define _mm512_set1_ps emu_set1_ps
#undef _tile_loadconfig
#undef _tile_storeconfig
#undef _tile_release
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbusd
#define _tile_loadconfig emu_tile_loadconfig
#define _tile_storeconfig emu_tile_storeconfig
#define _tile_release emu_tile_release
#define _tile_loadd emu_tile_loadd
#define _tile_stored emu_tile_stored
#define _tile_zero emu_tile_zero
#define _tile_dpbusd emu_tile_dpbusd

#endif
