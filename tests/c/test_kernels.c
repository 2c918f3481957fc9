/* test_kernels.c — the reference kernels (csrc/cpu/kernels_ref.c) and the kernels this build dispatches
 * to (csrc/cpu/kernels_avx2.c on x86-64, unless built with -DSMOE_PORTABLE / without -mavx2) against
 * naive versions and against each other.
 *
 * Built and run by tests/test_c_units.py; exits non-zero on the first failed check group and
 * says what failed on stderr. With the argument "cpu" (and -DSMOE_CPU_TEST_HOOKS, linked with the
 * whole engine) it checks instead that smoe_open_vault and smoe_session_new refuse a CPU that
 * lacks what the build needs.
 *
 * Tolerances (u = 2⁻²⁴, ref the dot in double of the dequantised weights):
 *   reference matmul: |y − ref| ≤ 4·(cols/16 + 4)·u·Σ|w·x| + 1e-30 (a bound on float summation
 *           over cols/16 + 4 additions per lane chain and tree, with room to spare);
 *   fast matmul: |y − ref| ≤ 4·(cols/8 + 16)·u·M + 1e-30, M = Σ|w·x| for f32/bf16 and
 *           M = Σ_c (|s·q_c| + |b|)·|x_c| for q8/q4, whose affine form (s·Σq·x + b·Σx) cancels
 *           s·q against b only after rounding; and |y_fast − y_reference| within the sum of the two;
 *   rmsnorm, attend, softmax, swiglu (both): relative 1e-5 of the magnitude involved;
 *   attend, reference against dispatched: exact (bits), for every KV type; KV rounding: exact
 *           against a naive search (and vcvtps2ph where the build has F16C);
 *   dequantisation, n- and split-independence (both), topk order: exact (bits).
 */
#include "cpu/kernels_isa.h"
#include "cpu/cpu.h"
#ifdef SMOE_CPU_TEST_HOOKS
#include "smoe.h"
#endif

#if defined(__F16C__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


/* FNV-1a over the bits of every kernel output: the Python driver builds this program with the
 * vector-extension and the scalar lane loops (and at -O2 and -O3) and compares the printed
 * checksums, which must be equal. */
/* Two sets: [0] the tests of group 64 with f16/bf16 scales (what format 1 had: their checksums
 * must not change), [1] the other group sizes and f32 scales (test_groups). */
static uint64_t out_hash[2] = {0xcbf29ce484222325ull, 0xcbf29ce484222325ull};  /* the reference kernels' outputs */
static uint64_t fast_hash[2] = {0xcbf29ce484222325ull, 0xcbf29ce484222325ull}; /* the dispatched kernels' outputs */
static int hashing_fast;                            /* which of the two hash_floats feeds */
static int hash_set;                                /* 0 or 1, as above */

static void hash_floats(const float *v, size_t n) {
    uint64_t *h = hashing_fast ? &fast_hash[hash_set] : &out_hash[hash_set];
    const unsigned char *b = (const unsigned char *)v;
    for (size_t i = 0; i < n * sizeof(float); i++) *h = (*h ^ b[i]) * 0x100000001b3ull;
}

#include "check.h"

#define TEST_DATA_SEED 0x1234567
#include "test_data.h"

/* ------------------------------------------------------------------------------ matmul */

typedef void (*matmul_fn)(const smoe_tensor *, const uint8_t *, const float *, size_t, uint32_t, float *, size_t,
                          uint32_t, uint32_t);

/* s, q and b of W[r, c] for q8/q4 (W = s·q + b), as doubles */
static void affine_parts(const smoe_tensor *t, const uint8_t *b, uint32_t r, uint32_t c, double *s, double *q,
                         double *bias) {
    float sf, bf;
    unsigned qu;
    naive_q(t, b, r, c, &sf, &bf, &qu);
    *s = sf;
    *q = qu;
    *bias = bf;
}

/* fast: test the dispatched smoe_matmul_rows (and compare it with the reference kernel);
 * otherwise the reference kernel itself. */
static void test_matmul_case(uint8_t format, uint8_t sf, uint32_t G, uint32_t rows, uint32_t cols, int fast) {
    const matmul_fn mm = fast ? smoe_matmul_rows : smoe_ref_matmul_rows;
    hashing_fast = fast;
    test_tensor tt = make_tensor(format, sf, G, rows, cols, 0);
    const smoe_tensor *W = &tt.t;
    const uint32_t N = 64;
    const size_t ldx = cols + 3, ldy = rows + 5;
    float *x = malloc(sizeof(float) * ldx * N);
    for (size_t i = 0; i < ldx * N; i++) x[i] = rndf(-1, 1);
    float *wd = malloc(sizeof(float) * rows * cols); /* (rows, cols) naive dequantised */
    for (uint32_t r = 0; r < rows; r++)
        for (uint32_t c = 0; c < cols; c++) wd[(size_t)r * cols + c] = naive_w(W, tt.bytes, r, c);

    /* dequant_row: bit-exact */
    float *row = malloc(sizeof(float) * cols);
    for (uint32_t r = 0; r < rows; r++) {
        smoe_dequant_row(W, tt.bytes, r, row);
        int bad = memcmp(row, wd + (size_t)r * cols, sizeof(float) * cols) != 0;
        CHECK(!bad, "%s %ux%u: dequant_row(%u) differs from the naive dequantisation", fmt_name_g(format, sf, G), rows,
              cols, r);
        if (bad) break;
    }

    /* n = 64, all rows, padded strides: against the double-precision dot */
    float *y64 = malloc(sizeof(float) * ldy * N);
    for (size_t i = 0; i < ldy * N; i++) y64[i] = NAN;
    mm(W, tt.bytes, x, ldx, N, y64, ldy, 0, rows);
    float *yref = NULL; /* (N, rows) the reference kernel, when testing the fast one */
    if (fast) {
        yref = malloc(sizeof(float) * rows * N);
        smoe_ref_matmul_rows(W, tt.bytes, x, ldx, N, yref, rows, 0, rows);
    }
    double *amag = malloc(sizeof(double) * rows * cols); /* (rows, cols) affine magnitudes */
    for (uint32_t r = 0; r < rows; r++)
        for (uint32_t c = 0; c < cols; c++) amag[(size_t)r * cols + c] = affine_mag(W, tt.bytes, r, c);
    int worst_reported = 0;
    for (uint32_t t = 0; t < N; t++)
        for (uint32_t r = 0; r < rows; r++) {
            double ref = 0, mag = 0, am = 0;
            for (uint32_t c = 0; c < cols; c++) {
                double p = (double)wd[(size_t)r * cols + c] * x[t * ldx + c];
                ref += p;
                mag += fabs(p);
                am += amag[(size_t)r * cols + c] * fabs(x[t * ldx + c]);
            }
            double tol_ref = 4.0 * (cols / 16.0 + 4) * 0x1p-24 * mag + 1e-30;
            double tol_fast = 4.0 * (cols / 8.0 + 16) * 0x1p-24 * am + 1e-30;
            double tol = fast ? tol_fast : tol_ref;
            double err = fabs(y64[t * ldy + r] - ref);
            if (!(err <= tol) && !worst_reported++)
                CHECK(err <= tol, "%s %ux%u%s: y[t=%u, r=%u] = %.9g, double ref %.9g (tol %.3g)", fmt_name_g(format, sf, G),
                      rows, cols, fast ? " fast" : "", t, r, y64[t * ldy + r], ref, tol);
            if (fast) {
                double d = fabs((double)y64[t * ldy + r] - yref[(size_t)t * rows + r]);
                if (!(d <= tol_fast + tol_ref) && !worst_reported++)
                    CHECK(d <= tol_fast + tol_ref, "%s %ux%u: fast y[t=%u, r=%u] = %.9g, reference kernel %.9g",
                          fmt_name_g(format, sf, G), rows, cols, t, r, y64[t * ldy + r], yref[(size_t)t * rows + r]);
            }
        }
    free(amag);
    free(yref);
    for (uint32_t t = 0; t < N; t++) hash_floats(y64 + t * ldy, rows);
    for (uint32_t t = 0; t < N; t++)
        for (size_t r = rows; r < ldy; r++)
            CHECK(isnan(y64[t * ldy + r]), "matmul wrote past rows into the stride padding");

    /* every other way of cutting the same work gives the same bits */
    float *y = malloc(sizeof(float) * rows * N);
    const uint32_t batch_sizes[] = {1, 7, 33};
    for (size_t bi = 0; bi < sizeof batch_sizes / sizeof *batch_sizes; bi++) {
        uint32_t nb = batch_sizes[bi];
        for (uint32_t t0 = 0; t0 < N; t0 += nb) {
            uint32_t nt = N - t0 < nb ? N - t0 : nb;
            /* row splits: a random cut into up to 5 ranges, some empty */
            uint32_t cuts[6] = {0, 0, 0, 0, 0, rows};
            for (int k = 1; k < 5; k++) cuts[k] = (uint32_t)(rnd() % (rows + 1));
            for (int a = 1; a < 5; a++)
                for (int b = a + 1; b < 5; b++)
                    if (cuts[b] < cuts[a]) {
                        uint32_t tmp = cuts[a];
                        cuts[a] = cuts[b];
                        cuts[b] = tmp;
                    }
            for (int k = 0; k < 5; k++)
                mm(W, tt.bytes, x + t0 * ldx, ldx, nt, y + (size_t)t0 * rows, rows, cuts[k], cuts[k + 1]);
        }
        int diff = 0;
        for (uint32_t t = 0; t < N && !diff; t++)
            for (uint32_t r = 0; r < rows; r++)
                if (f32_bits(y[(size_t)t * rows + r]) != f32_bits(y64[t * ldy + r])) {
                    CHECK(0, "%s %ux%u: batch %u with split rows gives other bits at t=%u r=%u: %a vs %a",
                          fmt_name_g(format, sf, G), rows, cols, nb, t, r, y[(size_t)t * rows + r], y64[t * ldy + r]);
                    diff = 1;
                    break;
                }
    }
    /* one row at a time, one token at a time */
    for (uint32_t t = 0; t < N; t += 9)
        for (uint32_t r = 0; r < rows; r += 5) {
            mm(W, tt.bytes, x + t * ldx, ldx, 1, y, rows, r, r + 1); /* writes y[r] only */
            CHECK(f32_bits(y[r]) == f32_bits(y64[t * ldy + r]), "%s: single (t=%u, r=%u) differs",
                  fmt_name_g(format, sf, G), t, r);
        }

    free(y);
    free(y64);
    free(row);
    free(wd);
    free(x);
    free(tt.alloc);
    hashing_fast = 0;
}

static void test_matmul_shape(uint8_t format, uint8_t sf, uint32_t G, uint32_t rows, uint32_t cols) {
    uint64_t seed = rng_state; /* the same tensor and x for both kernels */
    test_matmul_case(format, sf, G, rows, cols, 0);
    rng_state = seed;
    test_matmul_case(format, sf, G, rows, cols, 1);
}

static void test_matmul(void) {
    struct {
        uint32_t rows, cols;
    } qshapes[] = {{1, 64}, {37, 320}, {5, 2112}, {13, 1024}, {3, 128}}, fshapes[] = {{1, 1}, {37, 333}, {6, 2101}, {9, 1024}, {2, 17}};
    for (size_t i = 0; i < sizeof qshapes / sizeof *qshapes; i++) {
        test_matmul_shape(SMOE_FMT_F32, SMOE_SCALE_NONE, 0, fshapes[i].rows, fshapes[i].cols);
        test_matmul_shape(SMOE_FMT_BF16, SMOE_SCALE_NONE, 0, fshapes[i].rows, fshapes[i].cols);
        for (uint8_t sf = SMOE_SCALE_F16; sf <= SMOE_SCALE_BF16; sf++) {
            test_matmul_shape(SMOE_FMT_Q8, sf, 64, qshapes[i].rows, qshapes[i].cols);
            test_matmul_shape(SMOE_FMT_Q4, sf, 64, qshapes[i].rows, qshapes[i].cols);
        }
    }
    /* random shapes: rows not a multiple of any register block, f32/bf16 cols of any residue */
    for (int trial = 0; trial < 6; trial++) {
        uint32_t rows = 1 + (uint32_t)(rnd() % 41), fcols = 1 + (uint32_t)(rnd() % 1500);
        uint32_t qcols = 64 * (1 + (uint32_t)(rnd() % 40));
        uint8_t sf = SMOE_SCALE_F16 + (uint8_t)(rnd() % 2);
        test_matmul_shape(SMOE_FMT_F32, SMOE_SCALE_NONE, 0, rows, fcols);
        test_matmul_shape(SMOE_FMT_BF16, SMOE_SCALE_NONE, 0, rows, fcols);
        test_matmul_shape(SMOE_FMT_Q8, sf, 64, rows, qcols);
        test_matmul_shape(SMOE_FMT_Q4, sf, 64, rows, qcols);
    }
    /* wider than the fast q kernels take (they hand it to the reference): still n-independent */
    test_matmul_shape(SMOE_FMT_Q4, SMOE_SCALE_F16, 64, 2, 64 * 300);
}

/* Every f16 value through the q8 path (q = 1, bias = +0) against the F16C instruction (or,
 * without F16C, the ldexp decoding). */
static void test_f16_all(void) {
    const uint32_t rows = 1024, cols = 64 * 64; /* 65536 groups: one per f16 bit pattern */
    smoe_tensor t;
    memset(&t, 0, sizeof t);
    t.format = SMOE_FMT_Q8;
    t.scale_format = SMOE_SCALE_F16;
    t.rows = rows;
    t.cols = cols;
    t.group = 64;
    uint64_t n = (uint64_t)rows * cols, ng = n / 64;
    t.scales_off = align64(n);
    t.biases_off = t.scales_off + align64(2 * ng);
    t.nbytes = t.biases_off + align64(2 * ng);
    uint8_t *b = aligned_alloc(64, t.nbytes);
    memset(b, 0, t.nbytes);
    memset(b, 1, n);
    for (uint32_t g = 0; g < ng; g++) {
        uint16_t h = (uint16_t)g;
        memcpy(b + t.scales_off + 2 * g, &h, 2);
    }
    t.data = b;
    float *row = malloc(sizeof(float) * cols);
    int bad = 0;
    for (uint32_t r = 0; r < rows && bad < 5; r++) {
        smoe_dequant_row(&t, b, r, row);
        for (uint32_t g = 0; g < cols / 64; g++) {
            uint16_t h = (uint16_t)(r * (cols / 64) + g);
#if defined(__F16C__)
            volatile float hw = _cvtsh_ss(h);
#else
            volatile float hw = naive_f16(h);
#endif
            volatile float want = hw * 1.0f;
            want = want + 0.0f;
            float got = row[g * 64 + 17];
            bool ok = isnan(want) ? isnan(got) : f32_bits(got) == f32_bits(want);
            if (!ok && bad++ < 5) CHECK(ok, "f16 0x%04x → %a, expected %a", h, got, (float)want);
        }
    }
    free(row);
    free(b);
}

/* ----------------------------------------------------------------------- per-token math */

static void test_rmsnorm(int fast) {
    void (*rmsnorm)(float *, const float *, const smoe_tensor *, uint32_t, float) = fast ? smoe_rmsnorm : smoe_ref_rmsnorm;
    hashing_fast = fast;
    const uint32_t dims[] = {1, 64, 100, 2048, 2053};
    for (size_t di = 0; di < sizeof dims / sizeof *dims; di++) {
        uint32_t dim = dims[di];
        for (uint8_t f = SMOE_FMT_F32; f <= SMOE_FMT_BF16; f++) {
            test_tensor w = make_tensor(f, SMOE_SCALE_NONE, 0, 1, dim, 0);
            float *x = malloc(sizeof(float) * dim), *out = malloc(sizeof(float) * dim);
            for (uint32_t i = 0; i < dim; i++) x[i] = rndf(-3, 3);
            const float eps = 1e-6f;
            rmsnorm(out, x, &w.t, dim, eps);
            hash_floats(out, dim);
            double ss = 0;
            for (uint32_t i = 0; i < dim; i++) ss += (double)x[i] * x[i];
            double inv = 1.0 / sqrt(ss / dim + eps);
            for (uint32_t i = 0; i < dim; i++) {
                double ref = x[i] * inv * naive_w(&w.t, w.bytes, 0, i);
                CHECK(fabs(out[i] - ref) <= 1e-5 * (fabs(ref) + 1e-6), "rmsnorm dim %u [%u]: %g vs %g", dim, i,
                      out[i], ref);
            }
            rmsnorm(x, x, &w.t, dim, eps); /* in place: the same bits */
            CHECK(memcmp(x, out, sizeof(float) * dim) == 0, "rmsnorm in place differs (dim %u)", dim);
            free(x);
            free(out);
            free(w.alloc);
        }
    }
}

static void test_rope(void) {
    const uint32_t heads = 3, hd = 128, h = hd / 2;
    float x[3 * 128], x0[3 * 128], cs[64], sn[64];
    for (uint32_t i = 0; i < heads * hd; i++) x[i] = x0[i] = rndf(-2, 2);
    for (uint32_t i = 0; i < h; i++) {
        double th = 17 * pow(1e6, -2.0 * i / hd);
        cs[i] = (float)cos(th);
        sn[i] = (float)sin(th);
    }
    smoe_rope(x, heads, hd, hd, cs, sn);
    for (uint32_t k = 0; k < heads; k++)
        for (uint32_t i = 0; i < hd; i++) {
            const float *v = x0 + k * hd;
            /* transformers: q·cos + rotate_half(q)·sin with cos = cat(c, c), sin = cat(s, s) */
            double rot = i < h ? -(double)v[i + h] : (double)v[i - h];
            double ref = (double)v[i] * cs[i % h] + rot * sn[i % h];
            CHECK(fabs(x[k * hd + i] - ref) <= 1e-6 * (fabs(v[i]) + fabs(rot) + 1e-3), "rope head %u [%u]: %g vs %g",
                  k, i, x[k * hd + i], ref);
        }
}

/* Partial RoPE (GLM: rotary_dim < head_dim): rotate-half within the first rot dims, the rest untouched. */
static void test_rope_partial(void) {
    const uint32_t heads = 2, hd = 64, rot = 32, h = rot / 2;
    float x[2 * 64], x0[2 * 64], cs[16], sn[16];
    for (uint32_t i = 0; i < heads * hd; i++) x[i] = x0[i] = rndf(-2, 2);
    for (uint32_t i = 0; i < h; i++) {
        double th = 5 * pow(1e4, -2.0 * i / rot);
        cs[i] = (float)cos(th);
        sn[i] = (float)sin(th);
    }
    smoe_rope(x, heads, hd, rot, cs, sn);
    for (uint32_t k = 0; k < heads; k++)
        for (uint32_t i = 0; i < hd; i++) {
            const float *v = x0 + k * hd;
            if (i >= rot) {
                CHECK(x[k * hd + i] == v[i], "partial rope head %u [%u] changed", k, i);
                continue;
            }
            double r = i < h ? -(double)v[i + h] : (double)v[i - h];
            double ref = (double)v[i] * cs[i % h] + r * sn[i % h];
            CHECK(fabs(x[k * hd + i] - ref) <= 1e-6 * (fabs(v[i]) + fabs(r) + 1e-3), "partial rope [%u]: %g vs %g", i,
                  x[k * hd + i], ref);
        }
}

/* GLM-4.5's router against a direct reading of transformers' Glm4MoeTopkRouter, and bias vectors. */
static void test_route_sigmoid_group(void) {
    for (int trial = 0; trial < 300; trial++) {
        const uint32_t groups[] = {1, 2, 4, 8};
        const uint32_t G = groups[rnd() % 4], per = 2 + (uint32_t)(rnd() % 7), E = G * per;
        const uint32_t TG = 1 + (uint32_t)(rnd() % G);
        uint32_t K = 1 + (uint32_t)(rnd() % (TG * per < 8 ? TG * per : 8));
        const bool renorm = rnd() % 2;
        const float scale = trial % 3 ? 2.5f : 1.0f;
        float logits[64], bias_f[64], c[64], val[8];
        int32_t idx[8];
        for (uint32_t e = 0; e < E; e++) {
            logits[e] = (float)(rnd() % 40) / 8.0f - 2.5f; /* ties on purpose */
            bias_f[e] = (float)(rnd() % 5) / 16.0f;
        }
        smoe_tensor bias = {.format = SMOE_FMT_F32, .rows = 1, .cols = E, .data = (const uint8_t *)bias_f};
        smoe_route_sigmoid_group(logits, E, &bias, G, TG, K, renorm, scale, idx, val, c);
        /* the reference: choice scores, group scores (sum of the two best), kept groups, top k */
        double s[64], ch[64], gs[8];
        for (uint32_t e = 0; e < E; e++) {
            s[e] = 1.0f / (1.0f + expf(-logits[e]));
            ch[e] = (float)s[e] + bias_f[e];
        }
        bool keep[8];
        for (uint32_t g = 0; g < G; g++) {
            double a = -INFINITY, b = -INFINITY;
            for (uint32_t e = g * per; e < (g + 1) * per; e++) {
                if (ch[e] > a) b = a, a = ch[e];
                else if (ch[e] > b) b = ch[e];
            }
            gs[g] = (float)((float)a + (float)b);
            keep[g] = G == 1;
        }
        for (uint32_t j = 0; j < TG && G > 1; j++) {
            int bg = -1;
            for (uint32_t g = 0; g < G; g++)
                if (!keep[g] && (bg < 0 || gs[g] > gs[bg])) bg = (int)g;
            keep[bg] = true;
        }
        bool used[64] = {0};
        double sum = 0;
        for (uint32_t j = 0; j < K; j++) {
            int be = -1;
            for (uint32_t e = 0; e < E; e++)
                if (keep[e / per] && !used[e] && (be < 0 || ch[e] > ch[be])) be = (int)e;
            used[be] = true;
            CHECK(idx[j] == be, "grouped route trial %d slot %u: %d vs %d", trial, j, idx[j], be);
            sum += s[be];
        }
        for (uint32_t j = 0; j < K; j++) {
            double want = (renorm ? s[idx[j]] / (sum + 1e-20) : s[idx[j]]) * scale;
            CHECK(fabs(val[j] - want) <= 1e-6 * fabs(want) + 1e-12, "grouped route trial %d weight %u: %g vs %g", trial,
                  j, val[j], want);
        }
    }
    /* bf16 bias vectors widen exactly */
    uint16_t b16[3] = {0x3F80, 0xC000, 0x3E00}; /* 1, -2, 0.125 */
    smoe_tensor bt = {.format = SMOE_FMT_BF16, .rows = 1, .cols = 3, .data = (const uint8_t *)b16};
    float y[3] = {0.5f, 0.5f, 0.5f};
    smoe_add_bias(y, &bt);
    CHECK(y[0] == 1.5f && y[1] == -1.5f && y[2] == 0.625f, "bf16 bias: %g %g %g", y[0], y[1], y[2]);
}

static void test_softmax(void) {
    const uint32_t ns[] = {1, 2, 128, 1000};
    for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++) {
        uint32_t n = ns[ni];
        float *x = malloc(sizeof(float) * n);
        double *ref = malloc(sizeof(double) * n), m = -INFINITY, z = 0;
        for (uint32_t i = 0; i < n; i++) {
            x[i] = rndf(-20, 20);
            if (x[i] > m) m = x[i];
        }
        for (uint32_t i = 0; i < n; i++) z += ref[i] = exp(x[i] - m);
        smoe_softmax(x, n);
        double sum = 0;
        for (uint32_t i = 0; i < n; i++) {
            sum += x[i];
            CHECK(fabs(x[i] - ref[i] / z) <= 1e-5 * ref[i] / z + 1e-12, "softmax n %u [%u]: %g vs %g", n, i, x[i],
                  ref[i] / z);
        }
        CHECK(fabs(sum - 1) < 1e-5, "softmax n %u sums to %g", n, sum);
        free(x);
        free(ref);
    }
    float big[3] = {1000.0f, 1000.0f, -1000.0f}; /* max subtraction keeps this finite */
    smoe_softmax(big, 3);
    CHECK(big[0] == 0.5f && big[1] == 0.5f && big[2] == 0.0f, "softmax of large logits: %g %g %g", big[0], big[1],
          big[2]);
}

/* The nearest of the two candidates lo < hi (their values vlo < vhi) to x, ties to the even code. */
static uint16_t nearest(double x, uint16_t lo, double vlo, uint16_t hi, double vhi) {
    double dl = x - vlo, dh = vhi - x;
    return dl < dh ? lo : dh < dl ? hi : (lo & 1) ? hi : lo;
}

/* f32 → f16 by search over the finite halves (ordered by their bits), independent of kernels.c */
static uint16_t naive_to_f16(float f) {
    uint16_t sign = (f32_bits(f) >> 16) & 0x8000;
    if (isnan(f)) return 0; /* not used */
    double x = fabs((double)f);
    if (x >= 65520.0) return sign | 0x7c00;
    uint16_t lo = 0, hi = 0x7bff;
    while (hi - lo > 1) { /* naive_f16(lo) ≤ x < naive_f16(hi) */
        uint16_t mid = (uint16_t)((lo + hi) / 2);
        if (naive_f16(mid) <= x) lo = mid; else hi = mid;
    }
    if (x >= naive_f16(0x7bff)) lo = hi = 0x7bff;
    if (lo == hi || x == naive_f16(lo)) return sign | lo;
    return sign | nearest(x, lo, naive_f16(lo), hi, naive_f16(hi));
}

static uint16_t naive_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    uint16_t t = (uint16_t)(u >> 16);                /* truncation: toward zero */
    if ((u & 0xffff) == 0) return t;
    double x = fabs((double)f), vlo = fabs((double)naive_bf16(t)), vhi = fabs((double)naive_bf16((uint16_t)(t + 1)));
    if ((t & 0x7fff) == 0x7f7f) vhi = ldexp(1.0, 128); /* above the largest finite: inf, at 2^128 */
    return nearest(x, t, vlo, (uint16_t)(t + 1), vhi);
}

/* smoe_kv_store against the naive roundings (and F16C's vcvtps2ph where the build has it), on a
 * sweep of every exponent and random bits, the halfway cases, the edges and NaN; and the
 * widening smoe_kv_load back. */
static void test_kv_store(void) {
    enum { N = 1 << 20 };
    float *x = malloc(sizeof(float) * N), *back = malloc(sizeof(float) * N);
    uint16_t *h = malloc(2 * N), *b = malloc(2 * N);
    for (uint32_t i = 0; i < N; i++) {
        uint32_t u = (uint32_t)(rnd() >> 32);
        if (i % 4 == 1) u = (u & 0xffff0000u) | 0x8000u;         /* a bf16 halfway */
        if (i % 4 == 2) u = (u & 0xffffe000u) | 0x1000u;         /* an f16-normal halfway */
        if (i % 8 == 3) u = (u & 0x807fffffu) | ((100u + i % 48) << 23); /* the f16 range's exponents */
        memcpy(&x[i], &u, 4);
    }
    const float edges[] = {0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, -65520.0f, 0x1p-14f, 0x1p-24f, 0x1p-25f,
                           0x1.000002p-25f, 0x1.8p-24f, 0x1.ffcp-15f, 0x1.ffep-15f, INFINITY, -INFINITY, 3.3895314e38f,
                           0x1.fffffep127f, 1e-40f};
    memcpy(x, edges, sizeof edges);
    smoe_kv_store(h, x, N, SMOE_KV_F16);
    smoe_kv_store(b, x, N, SMOE_KV_BF16);
    int bad = 0;
    for (uint32_t i = 0; i < N && bad < 5; i++) {
        if (isnan(x[i])) {
            uint32_t u = f32_bits(x[i]);
            uint16_t wh = (uint16_t)(((u >> 16) & 0x8000u) | 0x7e00u | ((u >> 13) & 0x3ffu));
            uint16_t wb = (uint16_t)((u >> 16) | 0x40u);
            if (h[i] != wh || b[i] != wb) CHECK(bad++ < 0, "NaN %08x → f16 %04x, bf16 %04x", u, h[i], b[i]);
            continue;
        }
        uint16_t wh = naive_to_f16(x[i]), wb = naive_to_bf16(x[i]);
        if (h[i] != wh) CHECK(bad++ < 0, "%a → f16 %04x, expected %04x", x[i], h[i], wh);
        if (b[i] != wb) CHECK(bad++ < 0, "%a → bf16 %04x, expected %04x", x[i], b[i], wb);
#if defined(__F16C__)
        uint16_t hw = (uint16_t)_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(x[i]), 0), 0);
        if (h[i] != hw) CHECK(bad++ < 0, "%a → f16 %04x, vcvtps2ph %04x", x[i], h[i], hw);
#endif
    }
    for (uint32_t i = 0; i < N; i++) { /* NaNs included: vcvtps2ph's, on hardware that has it */
#if defined(__F16C__)
        uint16_t hw = (uint16_t)_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(x[i]), 0), 0);
        if (h[i] != hw && bad++ < 5) CHECK(0, "%08x → f16 %04x, vcvtps2ph %04x", f32_bits(x[i]), h[i], hw);
#endif
    }
    smoe_kv_load(back, h, N, SMOE_KV_F16);
    for (uint32_t i = 0; i < N && bad < 5; i++) {
        double w = naive_f16(h[i]);
        if (!(isnan(w) ? isnan(back[i]) : (double)back[i] == w)) CHECK(bad++ < 0, "f16 %04x widened to %a", h[i], back[i]);
    }
    smoe_kv_load(back, b, N, SMOE_KV_BF16);
    for (uint32_t i = 0; i < N && bad < 5; i++)
        if (f32_bits(back[i]) != (uint32_t)b[i] << 16) CHECK(bad++ < 0, "bf16 %04x widened to %a", b[i], back[i]);
    smoe_kv_store(back, x, 5, SMOE_KV_F32);
    CHECK(memcmp(back, x, 5 * sizeof(float)) == 0, "f32 store is not a copy");
    free(x);
    free(back);
    free(h);
    free(b);
}

/* The reference and the dispatched attention on KV of each type: the same bits (kernels.h), and
 * within 1e-5 of softmax(q·K/√d)·V in double on the stored (rounded) values. */
static void test_attend(void) {
    const uint32_t stride = 4 * 128 + 8;
    const uint32_t npos[] = {1, 2, 17, 300, 5, 9, 40, 3};
    const uint32_t hds[] = {128, 128, 128, 128, 64, 100, 68, 3};
    for (uint32_t dt = SMOE_KV_F32; dt <= SMOE_KV_F16; dt++)
        for (size_t pi = 0; pi < sizeof npos / sizeof *npos; pi++) {
            uint32_t n = npos[pi], hd = hds[pi];
            size_t eb = smoe_kv_elem_bytes(dt), cnt = (size_t)stride * n;
            float *kf = malloc(sizeof(float) * cnt), *vf = malloc(sizeof(float) * cnt);
            void *k = malloc(eb * cnt), *v = malloc(eb * cnt);
            float q[128], out[128], fast[128], *scratch = malloc(sizeof(float) * n);
            for (size_t i = 0; i < cnt; i++) {
                kf[i] = rndf(-1, 1);
                vf[i] = rndf(-1, 1);
            }
            smoe_kv_store(k, kf, cnt, dt);
            smoe_kv_store(v, vf, cnt, dt);
            smoe_kv_load(kf, k, cnt, dt); /* the values attention sees */
            smoe_kv_load(vf, v, cnt, dt);
            for (uint32_t i = 0; i < hd; i++) q[i] = rndf(-2, 2);
            smoe_ref_attend(out, q, k, v, stride, n, hd, dt, -INFINITY, scratch);
            hashing_fast = 0;
            hash_floats(out, hd);
            smoe_attend(fast, q, k, v, stride, n, hd, dt, -INFINITY, scratch);
            hashing_fast = 1;
            hash_floats(fast, hd);
            CHECK(memcmp(out, fast, sizeof(float) * hd) == 0, "attend kv_dtype %u n_pos %u hd %u: %s differs from the reference",
                  dt, n, hd, smoe_kernels_isa());
            double *s = malloc(sizeof(double) * n), m = -INFINITY, z = 0;
            for (uint32_t p = 0; p < n; p++) {
                double d = 0;
                for (uint32_t i = 0; i < hd; i++) d += (double)q[i] * kf[(size_t)p * stride + i];
                s[p] = d / sqrt(hd);
                if (s[p] > m) m = s[p];
            }
            for (uint32_t p = 0; p < n; p++) z += s[p] = exp(s[p] - m);
            for (uint32_t i = 0; i < hd; i++) {
                double ref = 0;
                for (uint32_t p = 0; p < n; p++) ref += s[p] / z * vf[(size_t)p * stride + i];
                CHECK(fabs(out[i] - ref) <= 1e-5, "attend kv_dtype %u n_pos %u [%u]: %g vs %g", dt, n, i, out[i], ref);
            }
            free(s);
            free(kf);
            free(vf);
            free(k);
            free(v);
            free(scratch);
        }
}

/* gpt-oss's kernels (attention sinks and a window, the clamped SwiGLU, top-k then softmax, a bias
 * row) against double-precision versions of transformers' formulas; the reference and the
 * dispatched attention give the same bits with a sink too. No hashing: the checksums above stay. */
static void test_gptoss_ops(void) {
    /* softmax with a sink: one more term in the denominator only; −inf: the plain softmax's bits */
    for (int trial = 0; trial < 50; trial++) {
        const uint32_t n = 1 + (uint32_t)(rnd() % 300);
        float x[300], y[300];
        const float sink = rndf(-10, 10);
        double m = sink, z = 0, e[300];
        for (uint32_t i = 0; i < n; i++) {
            x[i] = y[i] = rndf(-10, 10);
            if (x[i] > m) m = x[i];
        }
        for (uint32_t i = 0; i < n; i++) z += e[i] = exp(x[i] - m);
        z += exp(sink - m);
        smoe_softmax_sink(x, n, sink);
        for (uint32_t i = 0; i < n; i++)
            CHECK(fabs(x[i] - e[i] / z) <= 1e-5 * e[i] / z + 1e-12, "softmax_sink n %u [%u]: %g vs %g", n, i, x[i],
                  e[i] / z);
        memcpy(x, y, sizeof(float) * n);
        smoe_softmax_sink(x, n, -INFINITY);
        smoe_softmax(y, n);
        CHECK(memcmp(x, y, sizeof(float) * n) == 0, "softmax_sink(−inf) is not smoe_softmax's bits (n %u)", n);
    }

    /* attention with a sink over a window of the cache (the caller's k, v offset), each KV type */
    const uint32_t stride = 4 * 64 + 8;
    for (uint32_t dt = SMOE_KV_F32; dt <= SMOE_KV_F16; dt++)
        for (int trial = 0; trial < 12; trial++) {
            const uint32_t n = 1 + (uint32_t)(rnd() % 40), hd = trial % 3 == 0 ? 64 : trial % 3 == 1 ? 32 : 24;
            const uint32_t first = (uint32_t)(rnd() % n), seen = n - first; /* the window: [first, n) */
            const size_t eb = smoe_kv_elem_bytes(dt), cnt = (size_t)stride * n;
            float *kf = malloc(sizeof(float) * cnt), *vf = malloc(sizeof(float) * cnt);
            void *k = malloc(eb * cnt), *v = malloc(eb * cnt);
            float q[64], out[64], fast[64], scratch[40];
            for (size_t i = 0; i < cnt; i++) {
                kf[i] = rndf(-1, 1);
                vf[i] = rndf(-1, 1);
            }
            smoe_kv_store(k, kf, cnt, dt);
            smoe_kv_store(v, vf, cnt, dt);
            smoe_kv_load(kf, k, cnt, dt);
            smoe_kv_load(vf, v, cnt, dt);
            for (uint32_t i = 0; i < hd; i++) q[i] = rndf(-2, 2);
            const float sink = rndf(-3, 3);
            const size_t skip = (size_t)first * stride * eb;
            smoe_ref_attend(out, q, (const uint8_t *)k + skip, (const uint8_t *)v + skip, stride, seen, hd, dt, sink,
                            scratch);
            smoe_attend(fast, q, (const uint8_t *)k + skip, (const uint8_t *)v + skip, stride, seen, hd, dt, sink,
                        scratch);
            CHECK(memcmp(out, fast, sizeof(float) * hd) == 0, "attend with a sink, kv_dtype %u: %s differs", dt,
                  smoe_kernels_isa());
            double s[40], m = sink, z = 0;
            for (uint32_t p = first; p < n; p++) {
                double d = 0;
                for (uint32_t i = 0; i < hd; i++) d += (double)q[i] * kf[(size_t)p * stride + i];
                s[p] = d / sqrt(hd);
                if (s[p] > m) m = s[p];
            }
            for (uint32_t p = first; p < n; p++) z += s[p] = exp(s[p] - m);
            z += exp(sink - m);
            for (uint32_t i = 0; i < hd; i++) {
                double ref = 0;
                for (uint32_t p = first; p < n; p++) ref += s[p] / z * vf[(size_t)p * stride + i];
                CHECK(fabs(out[i] - ref) <= 1e-5, "attend with a sink, kv_dtype %u n %u window from %u [%u]: %g vs %g",
                      dt, n, first, i, out[i], ref);
            }
            free(kf);
            free(vf);
            free(k);
            free(v);
        }

    /* the clamped SwiGLU: (clamp(u, ±L) + 1) · g' · sigmoid(α·g'), g' = min(g, L) */
    {
        const uint32_t n = 1000;
        float g[1000], u[1000], h[1000];
        const float alpha = 1.702f, limit = 7.0f;
        for (uint32_t i = 0; i < n; i++) {
            g[i] = rndf(-12, 12);
            u[i] = rndf(-12, 12);
        }
        g[0] = NAN;
        smoe_swiglu_clamped(h, g, u, n, alpha, limit);
        CHECK(h[0] != h[0], "clamped swiglu keeps a NaN gate a NaN: %g", h[0]);
        for (uint32_t i = 1; i < n; i++) {
            const double gc = g[i] > limit ? limit : g[i], uc = u[i] > limit ? limit : u[i] < -limit ? -limit : u[i];
            const double ref = (uc + 1) * gc / (1 + exp(-(double)alpha * gc));
            CHECK(fabs(h[i] - ref) <= 1e-5 * fabs(ref) + 1e-6, "clamped swiglu [%u] g=%g u=%g: %g vs %g", i, g[i], u[i],
                  h[i], ref);
        }
    }

    /* the router: top k of the logits, softmax over those k */
    for (int trial = 0; trial < 100; trial++) {
        const uint32_t n = 2 + (uint32_t)(rnd() % 128), k = 1 + (uint32_t)(rnd() % (n < 8 ? n : 8));
        float lg[130], val[8];
        int32_t idx[8], sel[8];
        float sv[8];
        for (uint32_t i = 0; i < n; i++) lg[i] = rndf(-4, 4);
        smoe_topk_softmax(lg, n, k, idx, val);
        smoe_topk(lg, n, k, false, sel, sv);
        double m = sv[0], z = 0;
        for (uint32_t j = 0; j < k; j++) z += exp(sv[j] - m);
        for (uint32_t j = 0; j < k; j++) {
            CHECK(idx[j] == sel[j], "topk_softmax trial %d: id %u is %d, not %d", trial, j, idx[j], sel[j]);
            const double ref = exp(sv[j] - m) / z;
            CHECK(fabs(val[j] - ref) <= 1e-6, "topk_softmax trial %d [%u]: %g vs %g", trial, j, val[j], ref);
        }
    }

    /* a bias row: an exact add */
    {
        float y[37], b[37], y0[37];
        for (int i = 0; i < 37; i++) {
            y[i] = y0[i] = rndf(-3, 3);
            b[i] = rndf(-3, 3);
        }
        smoe_add_row(y, b, 37);
        for (int i = 0; i < 37; i++) {
            volatile float ref = y0[i] + b[i];
            CHECK(f32_bits(y[i]) == f32_bits(ref), "add_row [%d]", i);
        }
    }
}

static void test_topk(void) {
    const float p[] = {0.1f, 0.3f, 0.3f, 0.2f, 0.3f, 0.05f};
    int32_t idx[6];
    float val[6];
    smoe_topk(p, 6, 3, false, idx, val);
    CHECK(idx[0] == 1 && idx[1] == 2 && idx[2] == 4, "topk ties: %d %d %d", idx[0], idx[1], idx[2]);
    smoe_topk(p, 6, 4, true, idx, val);
    CHECK(idx[0] == 1 && idx[1] == 2 && idx[2] == 4 && idx[3] == 3, "topk 4: %d %d %d %d", idx[0], idx[1], idx[2],
          idx[3]);
    float sum = ((0.3f + 0.3f) + 0.3f) + 0.2f;
    CHECK(val[0] == 0.3f / sum && val[3] == 0.2f / sum, "topk renorm: %g %g", val[0], val[3]);
    smoe_topk(p, 6, 6, false, idx, val);
    CHECK(idx[4] == 0 && idx[5] == 5, "topk all: %d %d", idx[4], idx[5]);

    /* NaN ranks last, and idx always holds valid, distinct ids */
    const float pn[5] = {NAN, 0.2f, NAN, -INFINITY, 0.1f};
    smoe_topk(pn, 5, 4, false, idx, val);
    CHECK(idx[0] == 1 && idx[1] == 4 && idx[2] == 0 && idx[3] == 2, "topk with NaN: %d %d %d %d", idx[0], idx[1],
          idx[2], idx[3]);

    /* random, with many ties, against a selection by the total order */
    for (int trial = 0; trial < 200; trial++) {
        uint32_t n = 1 + (uint32_t)(rnd() % 200), k = 1 + (uint32_t)(rnd() % (n < 16 ? n : 16));
        float q[200];
        for (uint32_t i = 0; i < n; i++) q[i] = (float)(rnd() % 20) / 20.0f;
        int32_t got[16];
        float gv[16];
        smoe_topk(q, n, k, false, got, gv);
        bool used[200] = {0};
        for (uint32_t j = 0; j < k; j++) {
            int32_t b = -1;
            for (uint32_t i = 0; i < n; i++)
                if (!used[i] && (b < 0 || q[i] > q[b])) b = (int32_t)i;
            used[b] = true;
            CHECK(got[j] == b && gv[j] == q[b], "topk random trial %d pos %u: %d vs %d", trial, j, got[j], b);
        }
    }
}

static void test_swiglu_axpy(void) {
    const uint32_t n = 1000;
    float g[1000], u[1000], h[1000], y[1000], y0[1000];
    for (uint32_t i = 0; i < n; i++) {
        g[i] = rndf(-30, 30);
        u[i] = rndf(-2, 2);
        y[i] = y0[i] = rndf(-1, 1);
    }
    smoe_swiglu(h, g, u, n);
    for (uint32_t i = 0; i < n; i++) {
        double ref = g[i] / (1 + exp(-(double)g[i])) * u[i];
        CHECK(fabs(h[i] - ref) <= 1e-5 * fabs(ref) + 1e-30, "swiglu [%u] g=%g: %g vs %g", i, g[i], h[i], ref);
    }
    smoe_axpy(y, 0.37f, u, n);
    for (uint32_t i = 0; i < n; i++) {
        volatile float ax = 0.37f * u[i];
        float ref = y0[i] + ax;
        CHECK(f32_bits(y[i]) == f32_bits(ref), "axpy [%u]", i);
    }
}

#ifdef SMOE_CPU_TEST_HOOKS
/* The runtime check: with the hook pretending the CPU lacks AVX2, the first entry points refuse
 * with SMOE_ERR_UNSUPPORTED and say how to get a build that runs. */
static int test_cpu_check(void) {
    smoe_cpu_test_lacks_isa = 1;
    smoe_vault *v = NULL;
    smoe_status st = smoe_open_vault("/nonexistent", &v);
    if (SMOE_HAVE_AVX2) {
        CHECK(st == SMOE_ERR_UNSUPPORTED && v == NULL, "open_vault on a CPU without AVX2: status %d", (int)st);
        CHECK(strstr(smoe_last_error(), "AVX2") && strstr(smoe_last_error(), "PORTABLE=1"), "message: %s",
              smoe_last_error());
        smoe_session *s = NULL;
        st = smoe_session_new(NULL, NULL, &s);
        CHECK(st == SMOE_ERR_UNSUPPORTED && s == NULL, "session_new on a CPU without AVX2: status %d", (int)st);
    } else {
        CHECK(st == SMOE_ERR_VAULT, "a portable build runs anywhere: open_vault gave %d (%s)", (int)st,
              smoe_last_error());
    }
    smoe_cpu_test_lacks_isa = 0;
#ifdef __linux__
    /* the sysfs CPU lists smoe_cpu_l2_per_thread counts an L2's sharers in */
    static const struct {
        const char *list;
        uint32_t count;
    } lists[] = {{"0", 1}, {"0-1", 2}, {"0,64", 2}, {"0-1,32,34-35", 5}, {"7-7", 1}, {"", 0}, {"x", 0},
                 {"3-1", 0}, {"0-", 0}, {"0,", 0}, {"0;1", 0}};
    for (size_t i = 0; i < sizeof lists / sizeof *lists; i++)
        CHECK(smoe_cpu_test_list_count(lists[i].list) == lists[i].count, "CPU list \"%s\": %u, not %u", lists[i].list,
              smoe_cpu_test_list_count(lists[i].list), lists[i].count);
    FILE *f = fopen("/sys/devices/system/cpu/cpu0/cache/index2/size", "r");
    if (f) { /* where sysfs describes the caches, an L2 is found, of a plausible size */
        fclose(f);
        const uint32_t l2 = smoe_cpu_l2_per_thread();
        CHECK(l2 >= 16384 && l2 <= (64u << 20), "L2 per hardware thread: %u bytes", l2);
    }
#endif
    st = smoe_open_vault("/nonexistent", &v);
    CHECK(st == SMOE_ERR_VAULT, "this CPU: open_vault of a missing directory gave %d (%s)", (int)st, smoe_last_error());
    if (failures) {
        fprintf(stderr, "test_kernels cpu: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_kernels cpu: ok\n");
    return 0;
}
#endif

/* ------------------------------------------------------------- 8-bit activations (qx) */

/* The documented layout (kernels.c): where column c of a group sits among the group's codes. */
static uint32_t doc_qx_pos(uint32_t c, int q8) { /* c < 64: the column within its unit of 64 */
    static const uint32_t q4_chunk_at[4] = {0, 32, 16, 48}; /* columns 0–15, 32–47, 16–31, 48–63 */
    if (!q8) return q4_chunk_at[c / 16] + c % 16;
    uint32_t half = c / 32, v = (c % 32) / 8; /* vectors [8v..8v+8 | 32+8v..32+8v+8] of int16 */
    return 16 * v + 8 * half + c % 8;
}

/* smoe_qx_prepare, the reference and the dispatched qx matmul: codes and scales as documented;
 * the product within a bound of the exact sum over the quantised x; the fast kernel equal to the
 * reference bit for bit; and every batch size and row split giving the same bits. */
static void test_matmul_qx_case(uint8_t format, uint8_t sf, uint32_t G, uint32_t rows, uint32_t cols) {
    const int q8 = format == SMOE_FMT_Q8;
    test_tensor tt = make_tensor(format, sf, G, rows, cols, 0);
    const smoe_tensor *W = &tt.t;
    const uint32_t N = 40, nu = (cols + 63) / 64, ng = cols / G; /* units of 64 columns, groups */
    const size_t ldx = cols + 5, ldy = rows + 3;
    float *x = malloc(sizeof(float) * ldx * N);
    for (size_t i = 0; i < ldx * N; i++) x[i] = rndf(-1, 1) * (rnd() % 7 == 0 ? 8.0f : 1.0f);
    for (uint32_t c = 0; c < 32 && c < cols; c++) x[ldx + c] = 0.0f;  /* token 1: an all-zero block */
    const smoe_qx_size z = smoe_qx_sizes(cols, format, G);
    void *codes = aligned_alloc(64, align64(z.code_bytes * N));
    float *d = malloc(sizeof(float) * z.d_floats * N), *gs = malloc(sizeof(float) * z.gsum_floats * N);
    smoe_qx_prepare(x, ldx, N, cols, format, G, codes, d, gs);
    const smoe_qx X = {codes, d, gs, cols, G, format, NULL};

    /* the codes and scales, against the documentation */
    int bad = 0;
    for (uint32_t t = 0; t < N && !bad; t++)
        for (uint32_t g = 0; g < nu && !bad; g++)
            for (uint32_t b = 0; b < 2; b++) {
                const float *xb = x + t * ldx + 64 * g + 32 * b;
                float m = 0;
                if (64 * g + 32 * b < cols) /* else an empty block: d = 0, codes 0 */
                    for (int c = 0; c < 32; c++) m = fabsf(xb[c]) > m ? fabsf(xb[c]) : m;
                const float db = d[t * z.d_floats + 8 * (g / 4) + g % 4 + 4 * b];
                if (db != m / 127.0f) {
                    CHECK(0, "qx %ux%u: d[t=%u, g=%u, b=%u] = %a, want %a", rows, cols, t, g, b, db, m / 127.0f);
                    bad = 1;
                    break;
                }
                for (uint32_t c = 0; c < 32; c++) {
                    const uint32_t at = 64 * g + doc_qx_pos(32 * b + c, q8);
                    const int code = q8 ? ((const int16_t *)codes)[t * z.code_bytes / 2 + at]
                                        : ((const int8_t *)codes)[t * z.code_bytes + at];
                    const float want = m > 0 ? nearbyintf(xb[c] * (127.0f / m)) : 0.0f; /* xb read only if m > 0 */
                    if (code != (int)want || code < -127 || code > 127) {
                        CHECK(0, "qx %ux%u: code (t=%u, col %u) = %d, want %d", rows, cols, t, 64 * g + 32 * b + c,
                              code, (int)want);
                        bad = 1;
                        break;
                    }
                }
            }

    /* the reference against the exact sum of its own terms (s·d·I + b·gsum: a float-rounding
     * bound), and against the dot with the float x (adding the quantisation bound Σ|s·q|·d/2) */
    float *yr = malloc(sizeof(float) * ldy * N), *yf = malloc(sizeof(float) * ldy * N);
    for (size_t i = 0; i < ldy * N; i++) yr[i] = yf[i] = NAN;
    smoe_ref_matmul_rows_qx(W, tt.bytes, &X, N, yr, ldy, 0, rows);
    smoe_matmul_rows_qx(W, tt.bytes, &X, N, yf, ldy, 0, rows);
    int reported = 0;
    for (uint32_t t = 0; t < N; t++)
        for (uint32_t r = 0; r < rows; r++) {
            double kern = 0, mag = 0, full = 0, qerr = 0, bmag = 0;
            for (uint32_t c = 0; c < cols; c++) {
                const uint32_t g = c / 64, b = (c % 64) / 32, at = 64 * g + doc_qx_pos(c % 64, q8);
                const int code = q8 ? ((const int16_t *)codes)[t * z.code_bytes / 2 + at]
                                    : ((const int8_t *)codes)[t * z.code_bytes + at];
                const double db = d[t * z.d_floats + 8 * (g / 4) + g % 4 + 4 * b];
                double sg, q, bias;
                affine_parts(W, tt.bytes, r, c, &sg, &q, &bias);
                kern += sg * q * db * code;
                mag += fabs(sg * q * db * code);
                full += (double)naive_w(W, tt.bytes, r, c) * x[t * ldx + c];
                qerr += fabs(sg * q) * db * 0.5;
                bmag += fabs(bias * x[t * ldx + c]);
            }
            for (uint32_t g = 0; g < ng; g++) {
                double sg, q, bias;
                affine_parts(W, tt.bytes, r, G * g, &sg, &q, &bias);
                kern += bias * gs[t * z.gsum_floats + g];
                mag += fabs(bias * gs[t * z.gsum_floats + g]);
            }
            const double tol_k = 4.0 * (cols / 256.0 + 16) * 0x1p-24 * mag + 1e-30;
            const double tol_q = qerr + tol_k + 16 * 0x1p-24 * bmag;
            const double y = yr[t * ldy + r];
            if (!(fabs(y - kern) <= tol_k) && !reported++)
                CHECK(0, "qx %s %ux%u: y[t=%u, r=%u] = %.9g, exact sum of its terms %.9g (tol %.3g)",
                      fmt_name_g(format, sf, G), rows, cols, t, r, y, kern, tol_k);
            if (!(fabs(y - full) <= tol_q) && !reported++)
                CHECK(0, "qx %s %ux%u: y[t=%u, r=%u] = %.9g, float-x dot %.9g (tol %.3g)", fmt_name_g(format, sf, G), rows,
                      cols, t, r, y, full, tol_q);
            if (f32_bits(yr[t * ldy + r]) != f32_bits(yf[t * ldy + r]) && !reported++)
                CHECK(0, "qx %s %ux%u: dispatched y[t=%u, r=%u] = %a, reference %a", fmt_name_g(format, sf, G), rows, cols,
                      t, r, yf[t * ldy + r], yr[t * ldy + r]);
        }
#if SMOE_HAVE_AVX2
    /* both AVX2 instances (plain, and VNNI where the CPU has it), whichever one dispatch picked */
    for (int vnni = 0; vnni < 1 + SMOE_HAVE_AVXVNNI; vnni++) {
        if (vnni && !__builtin_cpu_supports("avxvnni")) continue;
        float *yi = malloc(sizeof(float) * ldy * N);
        /* all N at once (the batched product), then in batches of 1 to 7 (the matrix-vector and the
           few-token products, a row at a time) */
        for (uint32_t bs = 0; bs <= 7; bs++) {
            const uint32_t step = bs ? bs : N;
            for (uint32_t t0 = 0; t0 < N; t0 += step) {
                const uint32_t nt = N - t0 < step ? N - t0 : step;
                const smoe_qx Xt = {(const uint8_t *)codes + t0 * z.code_bytes, d + t0 * z.d_floats,
                                    gs + t0 * z.gsum_floats, cols, G, format, NULL};
#if SMOE_HAVE_AVXVNNI
                if (vnni)
                    smoe_avx2_matmul_rows_qx_vnni(W, tt.bytes, &Xt, nt, yi + (size_t)t0 * ldy, ldy, 0, rows);
                else
#endif
                    smoe_avx2_matmul_rows_qx_plain(W, tt.bytes, &Xt, nt, yi + (size_t)t0 * ldy, ldy, 0, rows);
            }
            for (uint32_t t = 0; t < N; t++)
                for (uint32_t r = 0; r < rows; r++)
                    if (f32_bits(yi[t * ldy + r]) != f32_bits(yr[t * ldy + r])) {
                        CHECK(0, "qx %s %ux%u: the %s instance in batches of %u gives y[t=%u, r=%u] = %a, reference %a",
                              fmt_name_g(format, sf, G), rows, cols, vnni ? "VNNI" : "plain AVX2", step, t, r,
                              yi[t * ldy + r], yr[t * ldy + r]);
                        t = N;
                        break;
                    }
        }
        free(yi);
    }
#endif
    hashing_fast = 0;
    for (uint32_t t = 0; t < N; t++) hash_floats(yr + t * ldy, rows);
    hashing_fast = 1;
    for (uint32_t t = 0; t < N; t++) hash_floats(yf + t * ldy, rows);
    hashing_fast = 0;
    for (uint32_t t = 0; t < N; t++)
        for (size_t r = rows; r < ldy; r++)
            CHECK(isnan(yf[t * ldy + r]) && isnan(yr[t * ldy + r]), "qx matmul wrote into the stride padding");

    /* batch sizes and row splits: the same bits */
    float *y = malloc(sizeof(float) * rows * N);
    const uint32_t batch_sizes[] = {1, 2, 3, 4, 6, 17};
    for (size_t bi = 0; bi < sizeof batch_sizes / sizeof *batch_sizes; bi++) {
        for (uint32_t t0 = 0; t0 < N; t0 += batch_sizes[bi]) {
            const uint32_t nt = N - t0 < batch_sizes[bi] ? N - t0 : batch_sizes[bi];
            const smoe_qx Xt = {(const uint8_t *)codes + t0 * z.code_bytes, d + t0 * z.d_floats,
                                gs + t0 * z.gsum_floats, cols, G, format, NULL};
            uint32_t cut = (uint32_t)(rnd() % (rows + 1)), cut2 = (uint32_t)(rnd() % (rows + 1));
            if (cut2 < cut) { uint32_t tmp = cut; cut = cut2; cut2 = tmp; }
            smoe_matmul_rows_qx(W, tt.bytes, &Xt, nt, y + (size_t)t0 * rows, rows, 0, cut);
            smoe_matmul_rows_qx(W, tt.bytes, &Xt, nt, y + (size_t)t0 * rows, rows, cut, cut2);
            smoe_matmul_rows_qx(W, tt.bytes, &Xt, nt, y + (size_t)t0 * rows, rows, cut2, rows);
        }
        for (uint32_t t = 0; t < N; t++)
            for (uint32_t r = 0; r < rows; r++)
                if (f32_bits(y[(size_t)t * rows + r]) != f32_bits(yf[t * ldy + r])) {
                    CHECK(0, "qx %s %ux%u: batch %u with split rows differs at t=%u r=%u", fmt_name_g(format, sf, G),
                          rows, cols, batch_sizes[bi], t, r);
                    t = N;
                    break;
                }
    }

    /* a non-finite x gives a non-finite y (never a silent finite one) */
    x[2 * ldx + 5] = INFINITY;
    x[3 * ldx + cols - 1] = NAN;
    smoe_qx_prepare(x, ldx, N, cols, format, G, codes, d, gs);
    smoe_matmul_rows_qx(W, tt.bytes, &X, 4, y, rows, 0, rows);
    for (uint32_t r = 0; r < rows; r++) {
        CHECK(!isfinite(y[2 * rows + r]) || naive_w(W, tt.bytes, r, 5) == 0.0f, "qx: inf in x, finite y[r=%u]", r);
        CHECK(isnan(y[3 * rows + r]), "qx: NaN in x, y[r=%u] = %g", r, y[3 * rows + r]);
    }

    free(y);
    free(yr);
    free(yf);
    free(codes);
    free(d);
    free(gs);
    free(x);
    free(tt.alloc);
}

/* The dispatched smoe_qx_prepare (AVX2 where built) against the reference: the same bytes, with
 * zeros, tiny values, infinities and NaNs in some blocks. */
static void test_qx_prepare_same_bytes(uint32_t G, const uint32_t *colss, size_t ncols) {
    const uint8_t fmts[] = {SMOE_FMT_Q4, SMOE_FMT_Q8};
    for (size_t ci = 0; ci < ncols; ci++)
        for (size_t fi = 0; fi < 2; fi++) {
            const uint32_t cols = colss[ci], n = 9;
            const size_t ldx = cols + 7;
            float *x = malloc(sizeof(float) * ldx * n);
            for (size_t i = 0; i < ldx * n; i++) x[i] = rndf(-3, 3) * (rnd() % 5 == 0 ? 1e-3f : 1.0f);
            for (uint32_t c = 0; c < 32; c++) x[1 * ldx + c] = 0.0f;             /* a zero block */
            for (uint32_t c = 0; c < 32 && 32 + c < cols; c++) x[2 * ldx + 32 + c] = 1e-35f; /* tiny */
            x[3 * ldx + 3] = INFINITY;
            x[4 * ldx + cols - 2] = -INFINITY;
            x[5 * ldx + 40 % cols] = NAN;
            x[5 * ldx + 41 % cols] = INFINITY;
            x[6 * ldx + 7] = -0.0f;
            const smoe_qx_size z = smoe_qx_sizes(cols, fmts[fi], G);
            uint8_t *c1 = malloc(z.code_bytes * n), *c2 = malloc(z.code_bytes * n);
            float *d1 = malloc(sizeof(float) * z.d_floats * n), *d2 = malloc(sizeof(float) * z.d_floats * n);
            float *s1 = malloc(sizeof(float) * z.gsum_floats * n), *s2 = malloc(sizeof(float) * z.gsum_floats * n);
            memset(c1, 0x55, z.code_bytes * n);
            memset(c2, 0xaa, z.code_bytes * n);
            memset(d1, 0x55, sizeof(float) * z.d_floats * n);
            memset(d2, 0xaa, sizeof(float) * z.d_floats * n);
            memset(s1, 0x55, sizeof(float) * z.gsum_floats * n);
            memset(s2, 0xaa, sizeof(float) * z.gsum_floats * n);
            smoe_ref_qx_prepare(x, ldx, n, cols, fmts[fi], G, c1, d1, s1);
            smoe_qx_prepare(x, ldx, n, cols, fmts[fi], G, c2, d2, s2);
            CHECK(memcmp(c1, c2, z.code_bytes * n) == 0, "qx_prepare %s cols %u: codes differ from the reference",
                  fmt_name_g(fmts[fi], SMOE_SCALE_F16, G), cols);
            CHECK(memcmp(d1, d2, sizeof(float) * z.d_floats * n) == 0, "qx_prepare G %u cols %u: d differs", G, cols);
            CHECK(memcmp(s1, s2, sizeof(float) * z.gsum_floats * n) == 0, "qx_prepare G %u cols %u: sums differ", G,
                  cols);
            /* the group sums, against a double sum (f32 rounding of ≤ 128 terms) */
            for (uint32_t t = 0; t < n; t++)
                for (uint32_t g = 0; g < cols / G; g++) {
                    double e = 0, m = 0;
                    for (uint32_t c = 0; c < G; c++) {
                        e += x[t * ldx + g * G + c];
                        m += fabs(x[t * ldx + g * G + c]);
                    }
                    const float got = s1[t * z.gsum_floats + g];
                    if (isfinite(e) && !(fabs(got - e) <= G * 0x1p-24 * m))
                        CHECK(0, "qx_prepare G %u: gsum[t=%u, g=%u] = %.9g, double %.9g", G, t, g, got, e);
                }
            free(x);
            free(c1);
            free(c2);
            free(d1);
            free(d2);
            free(s1);
            free(s2);
        }
}

static void test_matmul_qx(void) {
    const struct {
        uint32_t rows, cols;
    } shapes[] = {{1, 64}, {37, 320}, {5, 2112}, {13, 1024}, {3, 128}, {4, 448}};
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
        test_matmul_qx_case(SMOE_FMT_Q4, SMOE_SCALE_F16, 64, shapes[i].rows, shapes[i].cols);
        test_matmul_qx_case(SMOE_FMT_Q8, SMOE_SCALE_BF16, 64, shapes[i].rows, shapes[i].cols);
    }
    test_matmul_qx_case(SMOE_FMT_Q4, SMOE_SCALE_BF16, 64, 9, 768);
    test_matmul_qx_case(SMOE_FMT_Q8, SMOE_SCALE_F16, 64, 9, 768);
}

/* Every (format, scale format, group) that format 1 did not have — groups of 32 and 128, f32
 * scales with any group — through the float-activation and the 8-bit-activation products: each
 * against double sums and the reference, n- and row-split independent, on misaligned shapes
 * (one group; an odd number of groups, so cols = 32·odd for group 32; rows not a multiple of
 * any register block). Hashed into their own checksums. */
static void test_groups(void) {
    static const uint32_t groups[] = {32, 64, 128};
    static const uint8_t sfs[] = {SMOE_SCALE_F16, SMOE_SCALE_BF16, SMOE_SCALE_F32};
    for (size_t gi = 0; gi < 3; gi++)
        for (size_t si = 0; si < 3; si++) {
            const uint32_t G = groups[gi];
            const uint8_t sf = sfs[si];
            if (G == 64 && sf != SMOE_SCALE_F32) continue; /* test_matmul and test_matmul_qx */
            const uint32_t shapes[][2] = {{1, G}, {5, 3 * G}, {13, 11 * G}, {6, 1024}};
            for (size_t i = 0; i < 4; i++)
                for (uint8_t f = SMOE_FMT_Q8; f <= SMOE_FMT_Q4; f++) {
                    test_matmul_shape(f, sf, G, shapes[i][0], shapes[i][1]);
                    test_matmul_qx_case(f, sf, G, shapes[i][0], shapes[i][1]);
                }
        }
    /* wider than the fast kernels take, group 32: the reference, still n-independent */
    test_matmul_shape(SMOE_FMT_Q8, SMOE_SCALE_F32, 32, 2, 32 * 513);
    static const uint32_t cols32[] = {32, 96, 160, 2080, 4128}, cols128[] = {128, 384, 2176};
    test_qx_prepare_same_bytes(32, cols32, 5);
    test_qx_prepare_same_bytes(128, cols128, 3);
}

/* Every instance of the 8-bit-activation product that this build has and this CPU runs — AVX2
 * plain and AVX-VNNI (kernels_avx2_qx.h), AVX-512 F+BW and AVX512-VNNI (kernels_avx512_qx.h),
 * AMX (kernels_avx512_amx.h) —
 * against the reference, bit for bit: q4 and q8, groups 32, 64 and 128, f16/bf16/f32 scales, row
 * counts that are no multiple of any block, cols ending in a half unit or a partial pair of
 * units, every n from 1 to 70 on the small shapes (and some n on the wide ones), whole and split
 * row ranges. Prints which instances it checked and which it skipped and why (the Python
 * driver checks that a CPU with AVX-512 did check those). */
typedef bool (*qx_instance)(const smoe_tensor *, const uint8_t *, const smoe_qx *, uint32_t, float *, size_t, uint32_t,
                            uint32_t);

#if SMOE_HAVE_AVX512
/* The AVX-512 instances with every n up to 8 taken a row at a time (smoe_avx512_few_limits), so
 * that path's bits are checked at each n it may be given, not only below the build's limits */
static bool few8(qx_instance fn, const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y,
                 size_t ldy, uint32_t r0, uint32_t r1) {
    smoe_avx512_few_limits(8, 8);
    const bool ok = fn(W, w, X, n, y, ldy, r0, r1);
    smoe_avx512_few_limits(1, 1); /* the batched path for every n > 1 (the instances above) */
    return ok;
}
static bool avx512_few_bw(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y, size_t ldy,
                          uint32_t r0, uint32_t r1) {
    return few8(smoe_avx512_matmul_rows_qx_bw, W, w, X, n, y, ldy, r0, r1);
}
static bool avx512_few_vnni(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y, size_t ldy,
                            uint32_t r0, uint32_t r1) {
    return few8(smoe_avx512_matmul_rows_qx_vnni, W, w, X, n, y, ldy, r0, r1);
}
#endif

#if SMOE_HAVE_AMX
/* The AMX kernel on X's codes packed first (smoe_avx512_amx_tiles), in three uneven pieces over a
 * buffer of junk, as the engine's threads pack them: the packed form must give the same bits. */
static bool amx_packed(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y, size_t ldy,
                       uint32_t r0, uint32_t r1) {
    uint32_t items = 0;
    const size_t bytes = smoe_avx512_amx_tiles_bytes(X->cols, X->wformat, X->group, n, &items);
    if (bytes == 0) return smoe_avx512_amx_matmul_rows_qx(W, w, X, n, y, ldy, r0, r1); /* refuses the same */
    CHECK(bytes <= smoe_avx512_amx_tiles_cap(X->cols, n), "amx tiles: %zu bytes above the cap", bytes);
    uint8_t *buf = aligned_alloc(64, align64(bytes));
    memset(buf, 0xa5, bytes);
    const uint32_t a = items / 3, b = items - items / 4;
    smoe_avx512_amx_tiles(X, n, buf, b, items);
    smoe_avx512_amx_tiles(X, n, buf, 0, a);
    smoe_avx512_amx_tiles(X, n, buf, a, b);
    smoe_qx Xt = *X;
    Xt.tiles = buf;
    const bool ok = smoe_avx512_amx_matmul_rows_qx(W, w, &Xt, n, y, ldy, r0, r1);
    free(buf);
    return ok;
}
#endif

#if SMOE_HAVE_AMX
/* The AMX product gives the calling thread's tile configuration back as it found it: a host's own
 * configuration (a library beside this one, as llama.cpp's ggml, loads one per thread and keeps
 * using it: a released state under its next tile instruction is SIGILL) loaded again, and none
 * left where there was none. Where the CPU runs AMX, or under the emulation. */
static void test_amx_keeps_callers_tiles(void) {
    if (!smoe_cpu_amx_hw()) {
        printf("amx tile configuration kept: skipped (no AMX)\n");
        return;
    }
    test_tensor tt = make_tensor(SMOE_FMT_Q4, SMOE_SCALE_F16, 64, 37, 2048, 0);
    enum { N = 32 };
    const smoe_qx_size z = smoe_qx_sizes(2048, SMOE_FMT_Q4, 64);
    float *x = malloc(sizeof(float) * 2048 * N), *d = malloc(sizeof(float) * z.d_floats * N);
    float *gs = malloc(sizeof(float) * z.gsum_floats * N), *y = malloc(sizeof(float) * 37 * N);
    void *codes = aligned_alloc(64, align64(z.code_bytes * N));
    for (size_t i = 0; i < (size_t)2048 * N; i++) x[i] = rndf(-1, 1);
    smoe_qx_prepare(x, 2048, N, 2048, SMOE_FMT_Q4, 64, codes, d, gs);
    const smoe_qx X = {codes, d, gs, 2048, 64, SMOE_FMT_Q4, NULL};
    /* a host's configuration: palette 1, shapes unlike the kernel's */
    _Alignas(64) uint8_t host[64], now[64], zeros[64];
    memset(host, 0, sizeof host);
    memset(zeros, 0, sizeof zeros);
    host[0] = 1;
    for (int i = 0; i < 8; i++) {
        const uint16_t cb = (uint16_t)(4 * (i + 1));
        memcpy(host + 16 + 2 * i, &cb, 2);
        host[48 + i] = (uint8_t)(2 + i);
    }
    smoe_avx512_amx_tilecfg_set(host);
    CHECK(smoe_avx512_amx_matmul_rows_qx(&tt.t, tt.bytes, &X, N, y, 37, 0, 37), "amx refused 37x2048");
    memset(now, 0xa5, sizeof now);
    smoe_avx512_amx_tilecfg_get(now);
    CHECK(memcmp(now, host, 64) == 0, "amx product left the caller's tile configuration changed");
    smoe_avx512_amx_tilecfg_set(NULL);
    CHECK(smoe_avx512_amx_matmul_rows_qx(&tt.t, tt.bytes, &X, N, y, 37, 0, 37), "amx refused 37x2048");
    memset(now, 0xa5, sizeof now);
    smoe_avx512_amx_tilecfg_get(now);
    CHECK(memcmp(now, zeros, 64) == 0, "amx product left a tile configuration loaded where there was none");
    printf("amx tile configuration kept: checked\n");
    free(x);
    free(d);
    free(gs);
    free(y);
    free(codes);
    free(tt.alloc);
}
#endif

static void test_qx_instances(void) {
    struct {
        const char *name;
        qx_instance fn;
        const char *lacks; /* NULL: present and checked; else why not */
    } inst[10] = {{"avx2", NULL, "not built"},       {"avx-vnni", NULL, "not built"}, {"avx512", NULL, "not built"},
                  {"avx512vnni", NULL, "not built"}, {"amx", NULL, "not built"},      {"amx-packed", NULL, "not built"},
                  {"avx512-few", NULL, "not built"}, {"avx512vnni-few", NULL, "not built"},
                  {"neon", NULL, "not built"},       {"neon-dot", NULL, "not built"}};
#if SMOE_HAVE_AVX2
    inst[0].fn = smoe_avx2_matmul_rows_qx_plain;
    inst[0].lacks = NULL;
#if SMOE_HAVE_AVXVNNI
    inst[1].fn = smoe_avx2_matmul_rows_qx_vnni;
    inst[1].lacks = __builtin_cpu_supports("avxvnni") ? NULL : "CPU lacks AVX-VNNI";
#endif
#endif
#if SMOE_HAVE_AVX512
    const unsigned hw = smoe_cpu_avx512_hw();
    inst[2].fn = smoe_avx512_matmul_rows_qx_bw;
    inst[2].lacks = (hw & SMOE_CPU_AVX512) ? NULL : "CPU or OS lacks AVX-512 F/BW/VL";
    inst[3].fn = smoe_avx512_matmul_rows_qx_vnni;
    inst[3].lacks = (hw & SMOE_CPU_AVX512VNNI) ? NULL : "CPU or OS lacks AVX512-VNNI";
    inst[6].fn = avx512_few_bw;
    inst[6].lacks = inst[2].lacks;
    inst[7].fn = avx512_few_vnni;
    inst[7].lacks = inst[3].lacks;
    smoe_avx512_few_limits(1, 1); /* "avx512", "avx512vnni": the batched path for n > 1 */
#endif
#if SMOE_HAVE_AMX
    inst[4].fn = smoe_avx512_amx_matmul_rows_qx;
    inst[4].lacks = smoe_cpu_amx_hw() ? NULL : "CPU or OS lacks AMX-INT8 (or Linux's grant of its tiles)";
    inst[5].fn = amx_packed;
    inst[5].lacks = inst[4].lacks;
#endif
#if SMOE_HAVE_NEON
    inst[8].fn = smoe_neon_matmul_rows_qx;
    inst[8].lacks = NULL;
#if SMOE_HAVE_NEON_DOT
    inst[9].fn = smoe_neon_matmul_rows_qx_dot;
    inst[9].lacks = smoe_cpu_neon_dot_hw() ? NULL : "CPU lacks SDOT (ARMv8.2 dot product)";
#endif
#endif
    enum { NINST = sizeof inst / sizeof *inst };
    int any = 0;
    for (int i = 0; i < NINST; i++) any |= inst[i].lacks == NULL;
    static const uint8_t sfs[3] = {SMOE_SCALE_F16, SMOE_SCALE_BF16, SMOE_SCALE_F32};
    static const struct {
        uint32_t G, rows, cols;
        int sweep; /* every n in 1..70, else n in {1, 2, 5, 17, 70} */
    } shapes[] = {{32, 1, 32, 1},    {32, 13, 96, 1},  {32, 7, 160, 1},   {32, 3, 2080, 0},  {64, 5, 64, 1},
                  {64, 13, 192, 1},  {64, 9, 448, 1},  {64, 37, 2112, 0}, {128, 3, 128, 1},  {128, 11, 384, 1},
                  {128, 5, 2176, 0}, {32, 19, 4096, 0}, {64, 3, 16384, 0}};
    enum { NMAX = 70 };
    size_t cases = 0;
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes && any; si++)
        for (uint8_t f = SMOE_FMT_Q8; f <= SMOE_FMT_Q4; f++) {
            const uint32_t G = shapes[si].G, rows = shapes[si].rows, cols = shapes[si].cols;
            const uint8_t sf = sfs[(si + f) % 3];
            test_tensor tt = make_tensor(f, sf, G, rows, cols, 0);
            const size_t ldy = rows + 1;
            const smoe_qx_size z = smoe_qx_sizes(cols, f, G);
            float *x = malloc(sizeof(float) * cols * NMAX), *d = malloc(sizeof(float) * z.d_floats * NMAX);
            float *gs = malloc(sizeof(float) * z.gsum_floats * NMAX);
            float *yr = malloc(sizeof(float) * ldy * NMAX), *yi = malloc(sizeof(float) * ldy * NMAX);
            void *codes = aligned_alloc(64, align64(z.code_bytes * NMAX));
            for (size_t i = 0; i < (size_t)cols * NMAX; i++) x[i] = rndf(-1, 1) * (rnd() % 5 == 0 ? 30.0f : 1.0f);
            smoe_qx_prepare(x, cols, NMAX, cols, f, G, codes, d, gs);
            const smoe_qx X = {codes, d, gs, cols, G, f, NULL};
            smoe_ref_matmul_rows_qx(&tt.t, tt.bytes, &X, NMAX, yr, ldy, 0, rows);
            for (uint32_t n = 1; n <= NMAX; n++) {
                if (!shapes[si].sweep && n != 1 && n != 2 && n != 5 && n != 17 && n != NMAX) continue;
                for (int i = 0; i < NINST; i++) {
                    if (inst[i].lacks || (i >= 6 && n > 8)) continue;
                    for (size_t k = 0; k < ldy * n; k++) yi[k] = NAN;
                    const uint32_t cut = n % (rows + 1);
                    bool ok = inst[i].fn(&tt.t, tt.bytes, &X, n, yi, ldy, 0, cut);
                    ok = inst[i].fn(&tt.t, tt.bytes, &X, n, yi, ldy, cut, rows) && ok;
                    if ((i == 4 || i == 5) && cols > 4096) { /* AMX takes rows of up to 4096 columns (its scratch is on the stack) */
                        CHECK(!ok, "qx instance amx took %u columns", cols);
                        continue;
                    }
                    CHECK(ok, "qx instance %s refused %ux%u G %u", inst[i].name, rows, cols, G);
                    cases++;
                    for (uint32_t t = 0; t < n && ok; t++) {
                        for (uint32_t r = 0; r < rows; r++)
                            if (f32_bits(yi[t * ldy + r]) != f32_bits(yr[t * ldy + r])) {
                                CHECK(0, "qx instance %s, %s %ux%u, n %u: y[t=%u, r=%u] = %a, reference %a", inst[i].name,
                                      fmt_name_g(f, sf, G), rows, cols, n, t, r, yi[t * ldy + r], yr[t * ldy + r]);
                                ok = false;
                                break;
                            }
                        CHECK(isnan(yi[t * ldy + rows]), "qx instance %s wrote into the stride padding", inst[i].name);
                    }
                }
            }
            free(x);
            free(d);
            free(gs);
            free(yr);
            free(yi);
            free(codes);
            free(tt.alloc);
        }
#if SMOE_HAVE_AVX512
    smoe_avx512_few_limits(0, 0); /* the build's own, for the dispatched kernels' tests */
#endif
    /* one line per instance: checked, or skipped and why */
    for (int i = 0; i < NINST; i++)
        if (inst[i].lacks)
            printf("qx instance %s: skipped (%s)\n", inst[i].name, inst[i].lacks);
        else
            printf("qx instance %s: checked (%zu calls, bits equal to the reference)\n", inst[i].name, cases);
}

int main(int argc, char **argv) {
#ifdef SMOE_CPU_TEST_HOOKS
    if (argc > 1 && strcmp(argv[1], "cpu") == 0) return test_cpu_check();
#endif
    (void)argc;
    (void)argv;
    test_f16_all();
    test_matmul();
    test_matmul_qx();
    {
        const uint64_t seed = rng_state; /* its own draws: the checksums below stay what they were */
        test_qx_instances();
#if SMOE_HAVE_AMX
        test_amx_keeps_callers_tiles();
#endif
        rng_state = seed;
    }
    {
        static const uint32_t cols64[] = {64, 192, 320, 2048, 4160};
        test_qx_prepare_same_bytes(64, cols64, 5);
    }
    for (int fast = 0; fast < 2; fast++) { /* the same inputs for both: the hashes must be comparable */
        uint64_t seed = rng_state;
        test_rmsnorm(fast);
        if (!fast) rng_state = seed;
    }
    test_rope();
    test_rope_partial();
    test_route_sigmoid_group();
    test_softmax();
    test_attend();
    test_kv_store();
    hashing_fast = 0;
    test_topk();
    test_swiglu_axpy();
    hash_set = 1;
    test_groups();
    hashing_fast = 0;
    hash_set = 0;
    test_gptoss_ops();
    if (failures) {
        fprintf(stderr, "test_kernels: %d failure(s)\n", failures);
        return 1;
    }
    printf("isa %s\n", smoe_kernels_isa());
    printf("checksum %016llx\n", (unsigned long long)out_hash[0]);
    printf("checksum_fast %016llx\n", (unsigned long long)fast_hash[0]);
    printf("checksum_groups %016llx\n", (unsigned long long)out_hash[1]);
    printf("checksum_groups_fast %016llx\n", (unsigned long long)fast_hash[1]);
    printf("test_kernels: ok\n");
    return 0;
}
