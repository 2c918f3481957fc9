/* test_ggml.c — the products of the GGML block formats (csrc/cpu/ggml_blocks.h): the reference
 * kernels against sums in double, the dispatched kernels against the reference, and every way of
 * cutting the work (tokens, rows) against one call, bit for bit. Built and run by
 * tests/test_c_units.py (dequantisation itself is checked against gguf-py in test_ggml_formats.py).
 *
 * Tolerances (u = 2⁻²⁴; w the dequantised weights; ref = Σ w·x in double):
 *   f32 activations, reference and dispatched: |y − ref| ≤ 4·(cols/8 + 16)·u·Σ|w·x| + 1e-30;
 *   8-bit activations, reference: against the exact sum of its own terms Σ_b σ_b·d_b·I_b (+ μ_b·gsum_b),
 *       4·(cols/256 + 16)·u·Σ|terms|; against ref, that plus the quantisation bound Σ_c |σ·sub·q_c|·d_b/2
 *       (+ 16·u·Σ|μ·x|) — and for Q6_K/Q3_K and the IQ codebook formats, whose integer form σ·(sub·q)
 *       rounds differently from the dequantised (d·sub)·q, 4u·Σ|w·x| more;
 *   8-bit activations, dispatched against the reference: exact (bits), every n, every row split. */
#include "cpu/ggml_blocks.h"
#include "cpu/cpu.h"
#include "cpu/kernels_isa.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

static uint64_t rng_state = 0x6767;

static uint64_t rnd(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float rndf(float lo, float hi) { return lo + (hi - lo) * (float)((rnd() >> 40) * 0x1p-24); }

static const struct {
    uint8_t fmt;
    const char *name;
    int scale_at[2]; /* offsets of its f16 scales in a block (-1: none); MXFP4: its e8m0 byte */
} FMTS[] = {
    {SMOE_FMT_GGML_F16, "F16", {0, -1}},     {SMOE_FMT_GGML_Q4_0, "Q4_0", {0, -1}},
    {SMOE_FMT_GGML_Q5_0, "Q5_0", {0, -1}},   {SMOE_FMT_GGML_Q8_0, "Q8_0", {0, -1}},
    {SMOE_FMT_GGML_Q4_1, "Q4_1", {0, 2}},    {SMOE_FMT_GGML_Q5_1, "Q5_1", {0, 2}},
    {SMOE_FMT_GGML_Q2_K, "Q2_K", {80, 82}},  {SMOE_FMT_GGML_Q3_K, "Q3_K", {108, -1}},
    {SMOE_FMT_GGML_Q4_K, "Q4_K", {0, 2}},    {SMOE_FMT_GGML_Q5_K, "Q5_K", {0, 2}},
    {SMOE_FMT_GGML_Q6_K, "Q6_K", {208, -1}}, {SMOE_FMT_GGML_IQ4_NL, "IQ4_NL", {0, -1}},
    {SMOE_FMT_GGML_IQ4_XS, "IQ4_XS", {0, -1}}, {SMOE_FMT_GGML_MXFP4, "MXFP4", {0, -1}},
    {SMOE_FMT_GGML_IQ2_XXS, "IQ2_XXS", {0, -1}}, {SMOE_FMT_GGML_IQ2_XS, "IQ2_XS", {0, -1}},
    {SMOE_FMT_GGML_IQ2_S, "IQ2_S", {0, -1}}, {SMOE_FMT_GGML_IQ3_XXS, "IQ3_XXS", {0, -1}},
    {SMOE_FMT_GGML_IQ3_S, "IQ3_S", {0, -1}}, {SMOE_FMT_GGML_IQ1_S, "IQ1_S", {0, -1}},
    {SMOE_FMT_GGML_IQ1_M, "IQ1_M", {-1, -1}}, /* its d: the top nibbles of its scale words (make_g) */
};
enum { NFMT = sizeof FMTS / sizeof FMTS[0] };

/* A random f16 of magnitude 2^-10 .. 2^-5, either sign */
static uint16_t rnd_f16(void) { return (uint16_t)((rnd() & 1) << 15 | (5 + rnd() % 6) << 10 | (rnd() & 0x3ff)); }

typedef struct {
    smoe_tensor t;
    uint8_t *bytes; /* rows × row_bytes, at an odd address: blocks are read at any alignment */
    uint8_t *alloc;
} gtensor;

static gtensor make_g(int fi, uint32_t rows, uint32_t cols) {
    gtensor g;
    uint32_t bs, ts;
    smoe_ggml_block(FMTS[fi].fmt, &bs, &ts);
    memset(&g.t, 0, sizeof g.t);
    g.t.format = FMTS[fi].fmt;
    g.t.rows = rows;
    g.t.cols = cols;
    g.t.nbytes = (uint64_t)rows * (cols / bs) * ts;
    g.alloc = malloc(g.t.nbytes + 1);
    g.bytes = g.alloc + 1;
    for (uint64_t i = 0; i < g.t.nbytes; i++) g.bytes[i] = (uint8_t)rnd();
    for (uint64_t b = 0; b < g.t.nbytes / ts; b++)
        for (int k = 0; k < 2; k++) {
            const int at = FMTS[fi].scale_at[k];
            if (at < 0) continue;
            if (g.t.format == SMOE_FMT_GGML_MXFP4) {
                g.bytes[b * ts] = (uint8_t)(118 + rnd() % 8);
                continue;
            }
            const uint16_t h = rnd_f16();
            memcpy(g.bytes + b * ts + at, &h, 2);
        }
    if (g.t.format == SMOE_FMT_GGML_IQ1_M)
        for (uint64_t b = 0; b < g.t.nbytes / ts; b++) {
            const uint16_t h = rnd_f16();
            for (int i = 0; i < 4; i++) {
                uint16_t w;
                memcpy(&w, g.bytes + b * ts + 48 + 2 * i, 2);
                w = (uint16_t)((w & 0x0FFFu) | ((h >> (4 * i)) & 15u) << 12);
                memcpy(g.bytes + b * ts + 48 + 2 * i, &w, 2);
            }
        }
    g.t.data = g.bytes;
    return g;
}

static uint32_t f32_bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* dequantised (rows, cols) */
static float *dequant(const gtensor *g) {
    float *w = malloc(sizeof(float) * g->t.rows * g->t.cols);
    for (uint32_t r = 0; r < g->t.rows; r++) smoe_dequant_row(&g->t, g->bytes, r, w + (size_t)r * g->t.cols);
    return w;
}

static void test_f32(int fi, uint32_t rows, uint32_t cols) {
    gtensor g = make_g(fi, rows, cols);
    const uint32_t N = 37;
    const size_t ldx = cols + 3, ldy = rows + 2;
    float *x = malloc(sizeof(float) * ldx * N), *w = dequant(&g);
    for (size_t i = 0; i < ldx * N; i++) x[i] = rndf(-1, 1);
    float *yr = malloc(sizeof(float) * ldy * N), *yf = malloc(sizeof(float) * ldy * N), *y = malloc(sizeof(float) * ldy * N);
    smoe_ref_matmul_rows(&g.t, g.bytes, x, ldx, N, yr, ldy, 0, rows);
    smoe_matmul_rows(&g.t, g.bytes, x, ldx, N, yf, ldy, 0, rows);
#if SMOE_HAVE_AVX2
    { /* AVX2 runs f32 rows in the order it runs a GGML format's: the rows dequantised by the
         reference (gb_dequant_block) as an f32 tensor give the same bits, so the vector
         dequantisation writes the reference's floats */
        smoe_tensor tf = g.t;
        tf.format = SMOE_FMT_F32;
        tf.nbytes = (uint64_t)rows * cols * 4;
        for (uint32_t n1 = 1; n1 <= N; n1 += N - 1) { /* one token, and all */
            smoe_matmul_rows(&tf, (const uint8_t *)w, x, ldx, n1, y, ldy, 0, rows);
            for (uint32_t t = 0; t < n1; t++)
                for (uint32_t r = 0; r < rows; r++)
                    if (f32_bits_of(y[t * ldy + r]) != f32_bits_of(yf[t * ldy + r])) {
                        CHECK(0, "%s %ux%u f32 (n %u): y[t=%u, r=%u] = %a, on the reference's dequantised rows %a",
                              FMTS[fi].name, rows, cols, n1, t, r, yf[t * ldy + r], y[t * ldy + r]);
                        t = n1;
                        break;
                    }
        }
    }
#endif
    int bad = 0;
    for (uint32_t t = 0; t < N && !bad; t++)
        for (uint32_t r = 0; r < rows; r++) {
            double ref = 0, mag = 0;
            for (uint32_t c = 0; c < cols; c++) {
                const double p = (double)w[(size_t)r * cols + c] * x[t * ldx + c];
                ref += p;
                mag += fabs(p);
            }
            const double tol = 4.0 * (cols / 8.0 + 16) * 0x1p-24 * mag + 1e-30;
            if (!(fabs(yr[t * ldy + r] - ref) <= tol) || !(fabs(yf[t * ldy + r] - ref) <= tol)) {
                CHECK(0, "%s %ux%u f32: y[t=%u, r=%u] reference %.9g, dispatched %.9g, double %.9g (tol %.3g)",
                      FMTS[fi].name, rows, cols, t, r, yr[t * ldy + r], yf[t * ldy + r], ref, tol);
                bad = 1;
                break;
            }
        }
    /* tokens one at a time and in uneven batches, rows cut anywhere: the same bits */
    const uint32_t batch[] = {1, 5, 32};
    for (int bi = 0; bi < 3; bi++) {
        for (uint32_t t0 = 0; t0 < N; t0 += batch[bi]) {
            const uint32_t nt = N - t0 < batch[bi] ? N - t0 : batch[bi], cut = (uint32_t)(rnd() % (rows + 1));
            smoe_matmul_rows(&g.t, g.bytes, x + t0 * ldx, ldx, nt, y + t0 * ldy, ldy, 0, cut);
            smoe_matmul_rows(&g.t, g.bytes, x + t0 * ldx, ldx, nt, y + t0 * ldy, ldy, cut, rows);
        }
        for (uint32_t t = 0; t < N; t++)
            for (uint32_t r = 0; r < rows; r++)
                if (f32_bits_of(y[t * ldy + r]) != f32_bits_of(yf[t * ldy + r])) {
                    CHECK(0, "%s %ux%u f32: batch %u with a row cut differs at t=%u r=%u", FMTS[fi].name, rows, cols,
                          batch[bi], t, r);
                    t = N;
                    break;
                }
    }
    free(x);
    free(w);
    free(yr);
    free(yf);
    free(y);
    free(g.alloc);
}

static void test_qx(int fi, uint32_t rows, uint32_t cols) {
    const uint8_t fmt = FMTS[fi].fmt;
    gtensor g = make_g(fi, rows, cols);
    enum { N = 40 };
    const size_t ldx = cols + 5, ldy = rows + 3;
    const uint32_t nb = cols / 32;
    float *x = malloc(sizeof(float) * ldx * N), *w = dequant(&g);
    for (size_t i = 0; i < ldx * N; i++) x[i] = rndf(-1, 1) * (rnd() % 7 == 0 ? 8.0f : 1.0f);
    for (uint32_t c = 0; c < 32; c++) x[ldx + c] = 0.0f; /* token 1: an all-zero block */
    const smoe_qx_size z = smoe_qx_sizes(cols, fmt, 32);
    void *codes = aligned_alloc(64, (z.code_bytes * N + 63) / 64 * 64);
    float *d = malloc(sizeof(float) * z.d_floats * N), *gs = malloc(sizeof(float) * z.gsum_floats * N);
    smoe_qx_prepare(x, ldx, N, cols, fmt, 32, codes, d, gs);
    const smoe_qx X = {codes, d, gs, cols, 32, fmt, NULL};
    float *yr = malloc(sizeof(float) * ldy * N), *yf = malloc(sizeof(float) * ldy * N), *y = malloc(sizeof(float) * ldy * N);
    for (size_t i = 0; i < ldy * N; i++) yr[i] = yf[i] = NAN;
    smoe_ref_matmul_rows_qx(&g.t, g.bytes, &X, N, yr, ldy, 0, rows);
    smoe_matmul_rows_qx(&g.t, g.bytes, &X, N, yf, ldy, 0, rows);

    int8_t *q = malloc(32 * (size_t)nb);
    int16_t *sub = malloc(sizeof(int16_t) * 2 * nb);
    float *sigma = malloc(sizeof(float) * nb), *mu = malloc(sizeof(float) * nb);
    uint32_t bs, ts;
    smoe_ggml_block(fmt, &bs, &ts);
    const int inexact_form = fmt == SMOE_FMT_GGML_Q6_K || fmt == SMOE_FMT_GGML_Q3_K || gb_is_iq(fmt);
    int reported = 0;
    for (uint32_t r = 0; r < rows; r++) {
        gb_qx_decode(fmt, g.bytes + (size_t)r * (cols / bs) * ts, 0, nb, q, sub, sigma, mu);
        for (uint32_t t = 0; t < N; t++) {
            const int8_t *ct = (const int8_t *)codes + t * z.code_bytes;
            double kern = 0, mag = 0, full = 0, fmag = 0, qerr = 0, mmag = 0;
            for (uint32_t b = 0; b < nb; b++) {
                const uint32_t u = b / 2, h = b % 2;
                const double db = d[t * z.d_floats + 8 * (u / 4) + u % 4 + 4 * h];
                long I = 0;
                double qabs = 0;
                for (uint32_t c = 0; c < 32; c++) {
                    const uint32_t at = 32 * b + c; /* the GGML formats' codes: in column order */
                    I += (long)sub[2 * b + c / 16] * q[32 * b + c] * ct[at];
                    qabs += fabs((double)sigma[b] * sub[2 * b + c / 16] * q[32 * b + c]);
                }
                kern += (double)sigma[b] * db * (double)I;
                mag += fabs((double)sigma[b] * db * (double)I);
                qerr += qabs * fabs(db) * 0.5; /* d < 0 where ggml's Q8_K scale flips the codes' sign */
                if (fmt == SMOE_FMT_GGML_Q2_K) { /* its mins against the codes: ν·d·Σ_h m_h·Σ code */
                    int16_t mm[2];
                    const double nu = gb_q2k_mins(g.bytes + (size_t)r * (cols / bs) * ts, b, mm);
                    long M = 0;
                    for (uint32_t c = 0; c < 32; c++) M += (long)mm[c / 16] * ct[32 * b + c];
                    kern += nu * db * (double)M;
                    mag += fabs(nu * db * (double)M);
                    qerr += 16 * fabs(nu) * (mm[0] + mm[1]) * fabs(db) * 0.5;
                }
                if (gb_has_min(fmt)) {
                    kern += (double)mu[b] * gs[t * z.gsum_floats + b];
                    mag += fabs((double)mu[b] * gs[t * z.gsum_floats + b]);
                    for (uint32_t c = 0; c < 32; c++) mmag += fabs((double)mu[b] * x[t * ldx + 32 * b + c]);
                    qerr += fabs((double)mu[b]) * 32 * fabs(db) * 0.5; /* gsum: the codes' sum, not x's */
                }
            }
            for (uint32_t c = 0; c < cols; c++) {
                full += (double)w[(size_t)r * cols + c] * x[t * ldx + c];
                fmag += fabs((double)w[(size_t)r * cols + c] * x[t * ldx + c]);
            }
            const double tol_k = 4.0 * (cols / 256.0 + 16) * 0x1p-24 * mag + 1e-30;
            const double tol_q = qerr + tol_k + 16 * 0x1p-24 * mmag + (inexact_form ? 4 * 0x1p-24 * fmag : 0);
            const double yv = yr[t * ldy + r];
            if (!(fabs(yv - kern) <= tol_k) && !reported++)
                CHECK(0, "%s %ux%u qx: y[t=%u, r=%u] = %.9g, exact sum of its terms %.9g (tol %.3g)", FMTS[fi].name,
                      rows, cols, t, r, yv, kern, tol_k);
            if (!(fabs(yv - full) <= tol_q) && !reported++)
                CHECK(0, "%s %ux%u qx: y[t=%u, r=%u] = %.9g, float-x dot %.9g (tol %.3g)", FMTS[fi].name, rows, cols,
                      t, r, yv, full, tol_q);
            if (f32_bits_of(yv) != f32_bits_of(yf[t * ldy + r]) && !reported++)
                CHECK(0, "%s %ux%u qx: dispatched y[t=%u, r=%u] = %a, reference %a", FMTS[fi].name, rows, cols, t, r,
                      yf[t * ldy + r], yv);
        }
    }
#if SMOE_HAVE_AVX2
    /* both AVX2 instances (plain, and AVX-VNNI where the CPU has it), every n from 1 */
    for (int vnni = 0; vnni < 2; vnni++)
    for (uint32_t n = 1; n <= N; n += (n < 6 ? 1 : 7)) {
        if (vnni && !(SMOE_HAVE_AVXVNNI && __builtin_cpu_supports("avxvnni"))) break;
        static int said;
        if (vnni && !said++) printf("ggml qx instance avx-vnni: checked\n");
        for (size_t i = 0; i < ldy * n; i++) y[i] = NAN;
        const uint32_t cut = n % (rows + 1);
        bool ok = smoe_avx2_ggml_qx(&g.t, g.bytes, &X, n, y, ldy, 0, cut, vnni);
        ok = smoe_avx2_ggml_qx(&g.t, g.bytes, &X, n, y, ldy, cut, rows, vnni) && ok;
        CHECK(ok, "%s %ux%u: the AVX2 qx kernel refused", FMTS[fi].name, rows, cols);
        for (uint32_t t = 0; t < n && ok; t++)
            for (uint32_t r = 0; r < rows; r++)
                if (f32_bits_of(y[t * ldy + r]) != f32_bits_of(yr[t * ldy + r])) {
                    CHECK(0, "%s %ux%u qx, n %u: AVX2 (vnni %d) y[t=%u, r=%u] = %a, reference %a", FMTS[fi].name, rows,
                          cols, n, vnni, t, r, y[t * ldy + r], yr[t * ldy + r]);
                    t = n;
                    ok = false;
                    break;
                }
    }
#endif
#if SMOE_HAVE_AVX512
    /* the AVX512-VNNI instance (kernels_avx512_ggml.h) where the CPU has it, every n from 1; a shape
       or format it does not take says false (the AVX2 instance then runs) */
    if (smoe_cpu_avx512_hw() & SMOE_CPU_AVX512VNNI) {
        static int said;
        for (uint32_t n = 1; n <= N; n += (n < 6 ? 1 : 7)) {
            for (size_t i = 0; i < ldy * n; i++) y[i] = NAN;
            const uint32_t cut = n % (rows + 1);
            bool ok = smoe_avx512_ggml_qx(&g.t, g.bytes, &X, n, y, ldy, 0, cut);
            ok = smoe_avx512_ggml_qx(&g.t, g.bytes, &X, n, y, ldy, cut, rows) && ok;
            if (!ok) break; /* not taken: nothing to compare */
            if (!said++) printf("ggml qx instance avx512vnni: checked\n");
            for (uint32_t t = 0; t < n; t++)
                for (uint32_t r = 0; r < rows; r++)
                    if (f32_bits_of(y[t * ldy + r]) != f32_bits_of(yr[t * ldy + r])) {
                        CHECK(0, "%s %ux%u qx, n %u: AVX512-VNNI y[t=%u, r=%u] = %a, reference %a", FMTS[fi].name, rows,
                              cols, n, t, r, y[t * ldy + r], yr[t * ldy + r]);
                        t = n;
                        break;
                    }
        }
    }
#endif
    /* batches and row cuts through the dispatcher: the same bits */
    const uint32_t batch[] = {1, 3, 17};
    for (int bi = 0; bi < 3; bi++) {
        for (uint32_t t0 = 0; t0 < N; t0 += batch[bi]) {
            const uint32_t nt = N - t0 < batch[bi] ? N - t0 : batch[bi], cut = (uint32_t)(rnd() % (rows + 1));
            const smoe_qx Xt = {(const uint8_t *)codes + t0 * z.code_bytes, d + t0 * z.d_floats,
                                gs + t0 * z.gsum_floats, cols, 32, fmt, NULL};
            smoe_matmul_rows_qx(&g.t, g.bytes, &Xt, nt, y + t0 * ldy, ldy, 0, cut);
            smoe_matmul_rows_qx(&g.t, g.bytes, &Xt, nt, y + t0 * ldy, ldy, cut, rows);
        }
        for (uint32_t t = 0; t < N; t++)
            for (uint32_t r = 0; r < rows; r++)
                if (f32_bits_of(y[t * ldy + r]) != f32_bits_of(yf[t * ldy + r])) {
                    CHECK(0, "%s %ux%u qx: batch %u with a row cut differs at t=%u r=%u", FMTS[fi].name, rows, cols,
                          batch[bi], t, r);
                    t = N;
                    break;
                }
    }
    /* a signalling-NaN and an inf scale: NaN or inf outputs, the same bits from every instance */
    if (FMTS[fi].scale_at[0] >= 0 && fmt != SMOE_FMT_GGML_MXFP4 && rows >= 2) {
        const uint16_t snan = 0x7d01, inf = 0x7c00;
        memcpy(g.bytes + FMTS[fi].scale_at[0], &snan, 2);
        memcpy(g.bytes + (cols / bs) * ts + ts * (nb > 8 ? 1 : 0) + FMTS[fi].scale_at[0], &inf, 2);
        smoe_ref_matmul_rows_qx(&g.t, g.bytes, &X, N, yr, ldy, 0, rows);
        smoe_matmul_rows_qx(&g.t, g.bytes, &X, N, yf, ldy, 0, rows);
        for (uint32_t t = 0; t < N; t++) {
            CHECK(isnan(yr[t * ldy]) && !isfinite(yr[t * ldy + 1]), "%s qx: a NaN / inf scale, y = %g, %g", FMTS[fi].name,
                  yr[t * ldy], yr[t * ldy + 1]);
            for (uint32_t r = 0; r < rows; r++)
                if (f32_bits_of(yr[t * ldy + r]) != f32_bits_of(yf[t * ldy + r])) {
                    CHECK(0, "%s qx, a NaN / inf scale: dispatched y[t=%u, r=%u] = %a, reference %a", FMTS[fi].name, t, r,
                          yf[t * ldy + r], yr[t * ldy + r]);
                    t = N;
                    break;
                }
        }
    }
    /* a NaN in x gives NaN, never a finite y */
    x[2 * ldx + cols - 1] = NAN;
    smoe_qx_prepare(x, ldx, N, cols, fmt, 32, codes, d, gs);
    smoe_matmul_rows_qx(&g.t, g.bytes, &X, 3, y, ldy, 0, rows);
    for (uint32_t r = 0; r < rows; r++) CHECK(isnan(y[2 * ldy + r]), "%s qx: NaN in x, y[r=%u] = %g", FMTS[fi].name, r, y[2 * ldy + r]);

    free(q);
    free(sub);
    free(sigma);
    free(mu);
    free(x);
    free(w);
    free(codes);
    free(d);
    free(gs);
    free(yr);
    free(yf);
    free(y);
    free(g.alloc);
}

/* the dispatched smoe_qx_prepare (AVX2 where built) against the reference for a GGML format of each
 * activation type (Q4_K: ggml's Q8_K, Q4_1: Q8_1, Q8_0: Q8_0): the same bytes (codes in column
 * order), with zero, tiny, inf and NaN blocks among random ones; and the codes and scales ggml's
 * quantisers give (kernels_ref.c, ref_ggml_prepare) */
static void test_prepare_same_bytes(void) {
    static const uint32_t colss[] = {32, 96, 256, 2080};
    static const uint8_t fmts[] = {SMOE_FMT_GGML_Q4_K, SMOE_FMT_GGML_Q4_1, SMOE_FMT_GGML_Q8_0};
    for (size_t fi = 0; fi < sizeof fmts / sizeof *fmts; fi++)
        for (size_t ci = 0; ci < sizeof colss / sizeof *colss; ci++) {
            const uint8_t fmt = fmts[fi];
            const int act = gb_act_type(fmt);
            const uint32_t cols = colss[ci], n = 7, nb = cols / 32;
            const smoe_qx_size z = smoe_qx_sizes(cols, fmt, 32);
            float *x = malloc(sizeof(float) * cols * n);
            for (size_t i = 0; i < (size_t)cols * n; i++) x[i] = rndf(-3, 3);
            for (uint32_t c = 0; c < 32; c++) x[c] = 0.0f, x[cols + c] = 1e-35f * (float)c;
            x[2 * cols + 3] = INFINITY;
            x[3 * cols + cols - 1] = NAN;
            x[5 * cols + 7] = 9.0f, x[5 * cols + 9] = -9.0f; /* ties of |x|: Q8_K takes the first one's sign */
            uint8_t *cr = calloc(z.code_bytes, n), *cf = calloc(z.code_bytes, n);
            float *dr = calloc(z.d_floats * n, sizeof(float)), *df = calloc(z.d_floats * n, sizeof(float));
            float *sr = calloc(z.gsum_floats * n, sizeof(float)), *sf = calloc(z.gsum_floats * n, sizeof(float));
            smoe_ref_qx_prepare(x, cols, n, cols, fmt, 32, cr, dr, sr);
            smoe_qx_prepare(x, cols, n, cols, fmt, 32, cf, df, sf);
            CHECK(memcmp(cr, cf, z.code_bytes * n) == 0, "prepare for GGML %u, cols %u: codes differ", fmt, cols);
            CHECK(memcmp(dr, df, sizeof(float) * z.d_floats * n) == 0, "prepare for GGML %u, cols %u: d differs", fmt, cols);
            CHECK(memcmp(sr, sf, sizeof(float) * z.gsum_floats * n) == 0, "prepare for GGML %u, cols %u: sums differ", fmt,
                  cols);
            for (uint32_t t = 4; t < n; t++)
                for (uint32_t b = 0; b < nb; b++) {
                    const int8_t *cb = (const int8_t *)cr + t * z.code_bytes + 32 * b;
                    const float db = dr[t * z.d_floats + smoe_qx_dpos(b)];
                    const float *xb = x + (size_t)t * cols + 32 * b;
                    int S = 0, top = 0;
                    for (uint32_t c = 0; c < 32; c++) {
                        S += cb[c];
                        top = abs(cb[c]) > top ? abs(cb[c]) : top;
                        CHECK(fabsf((float)cb[c] - xb[c] / db) <= 0.51f + 1e-3f * fabsf(xb[c] / db),
                              "GGML %u codes: token %u column %u: %d for x/d = %g", fmt, t, 32 * b + c, cb[c], xb[c] / db);
                    }
                    if (act == GB_ACT_Q8_K) { /* one d per 256 columns, of the sign that gives the max −127 */
                        const float d0 = dr[t * z.d_floats + 8 * (b / 8)];
                        CHECK(db == d0, "Q8_K: block %u's d %g, its 256's %g", b, db, d0);
                        CHECK(t != 5 || b != 0 || (cb[7] == -127 && cb[9] == 127), "Q8_K: the first max's sign");
                    } else {
                        CHECK((float)(_Float16)db == db, "GGML %u: d %g is not an f16", fmt, db);
                        CHECK(top == 127, "GGML %u: block max code %d", fmt, top);
                    }
                    const float g = sr[t * z.gsum_floats + b];
                    if (act == GB_ACT_Q8_1) /* ggml's s: f16((m/127)·S), d being f16(m/127) */
                        CHECK((float)(_Float16)g == g && fabsf(g - db * (float)S) <= 0x1p-10f * fabsf(db * (float)S) + 1e-30f,
                              "Q8_1: s %g for d·S %g", g, db * (float)S);
                    else
                        CHECK(g == db * (float)S, "GGML %u: gsum %g, want d·S %g", fmt, g, db * (float)S);
                }
            free(x), free(cr), free(cf), free(dr), free(df), free(sr), free(sf);
        }
}

int main(void) {
    test_prepare_same_bytes();
    static const struct {
        uint32_t rows, cols;
    } shapes[] = {{1, 256}, {7, 512}, {13, 768}, {3, 2304}};
    int codes_formats = 0;
    for (int fi = 0; fi < NFMT; fi++)
        for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
            test_f32(fi, shapes[si].rows, shapes[si].cols);
            const smoe_tensor probe = {.format = FMTS[fi].fmt, .cols = shapes[si].cols};
            if (smoe_qx_takes(&probe)) {
                CHECK(smoe_qx_group(&probe) == 32, "%s: codes for group %u", FMTS[fi].name, smoe_qx_group(&probe));
                test_qx(fi, shapes[si].rows, shapes[si].cols);
                codes_formats += si == 0;
            }
        }
    /* block-32 formats at widths that are not a multiple of 256, F16 at any width */
    for (int fi = 0; fi < NFMT; fi++) {
        uint32_t bs, ts;
        smoe_ggml_block(FMTS[fi].fmt, &bs, &ts);
        if (bs == 256) continue;
        const uint32_t cols = bs == 1 ? 37 : 96;
        test_f32(fi, 5, cols);
        const smoe_tensor probe = {.format = FMTS[fi].fmt, .cols = cols};
        if (smoe_qx_takes(&probe)) test_qx(fi, 5, cols);
    }
    CHECK(codes_formats == NFMT - 1, "%d formats take 8-bit codes, expected %d (all but F16)", codes_formats, NFMT - 1);
    if (failures) {
        fprintf(stderr, "test_ggml: %d failure(s)\n", failures);
        return 1;
    }
    printf("isa %s\ntest_ggml: ok\n", smoe_kernels_isa());
    return 0;
}
