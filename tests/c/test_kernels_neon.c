/* test_kernels_neon.c — the NEON kernels (csrc/cpu/kernels_neon.c) called by their own names, against
 * naive double-precision sums and the reference kernels (csrc/cpu/kernels_ref.c), and against themselves
 * cut every other way.
 *
 * Built and run for AArch64 by `make neon-check` (cross-compiled, under qemu-aarch64) and by
 * tests/test_c_units.py on an arm64 host. In a build without NEON (x86-64, -DSMOE_PORTABLE) there
 * is nothing to test: it says so and exits 0. tests/c/test_kernels.c covers the dispatched
 * kernels (smoe_matmul_rows etc.) in every build, NEON ones included; this file pins down what
 * the NEON file promises whatever the dispatch does.
 *
 * Tolerances (u = 2⁻²⁴, ref the dot in double of the dequantised weights), the bounds of
 * test_kernels.c for 8-lane accumulators:
 *   matmul: |y − ref| ≤ 4·(cols/8 + 16)·u·M + 1e-30, M = Σ|w·x| for f32/bf16 and
 *           M = Σ_c (|s·q_c| + |b|)·|x_c| for q8/q4 (the affine form s·Σq·x + b·Σx cancels s·q
 *           against b only after rounding); and |y − y_reference| within that plus the reference
 *           kernel's own bound 4·(cols/16 + 4)·u·Σ|w·x|;
 *   rmsnorm, attend: relative 1e-5 of the magnitude involved, as for every other kernel;
 *   attend against the reference: exact (bits), for every KV type (kernels.h);
 *   n- and split-independence, the dispatch, rmsnorm in place, every f16 scale: exact (bits).
 */
#include "cpu/kernels_isa.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if SMOE_HAVE_NEON

#include "check.h"

/* FNV-1a over the bits of every NEON output: every build (-O2, -O3) must print the same. */
static uint64_t out_hash = 0xcbf29ce484222325ull;

static void hash_floats(const float *v, size_t n) {
    const unsigned char *b = (const unsigned char *)v;
    for (size_t i = 0; i < n * sizeof(float); i++) out_hash = (out_hash ^ b[i]) * 0x100000001b3ull;
}

#define TEST_DATA_SEED 0x5eed0a64
#include "test_data.h"

/* ------------------------------------------------------------------------------ matmul */

static void neon_mm(const smoe_tensor *W, const uint8_t *w, const float *x, size_t ldx, uint32_t n, float *y,
                    size_t ldy, uint32_t r0, uint32_t r1) {
    bool took = smoe_neon_matmul_rows(W, w, x, ldx, n, y, ldy, r0, r1);
    CHECK(took, "smoe_neon_matmul_rows refused %s %ux%u", fmt_name_g(W->format, W->scale_format, W->group), W->rows,
          W->cols);
}

/* N = 65 tokens: two full tiles of 32 and a last tile of one token (the matrix-vector path
 * inside a batch), so the batched and the single-token kernels both meet every output. */
enum { N = 65 };

static void test_matmul_case(uint8_t format, uint8_t sf, uint32_t G, uint32_t rows, uint32_t cols,
                             unsigned misalign) {
    test_tensor tt = make_tensor(format, sf, G, rows, cols, misalign);
    const smoe_tensor *W = &tt.t;
    char name[32];
    snprintf(name, sizeof name, "%s", fmt_name_g(format, sf, G));
    const size_t ldx = cols + 3, ldy = rows + 5;
    float *x = malloc(sizeof(float) * ldx * N);
    for (size_t i = 0; i < ldx * N; i++) x[i] = rndf(-1, 1);

    /* all tokens, all rows, padded strides */
    float *y = malloc(sizeof(float) * ldy * N);
    for (size_t i = 0; i < ldy * N; i++) y[i] = NAN;
    neon_mm(W, tt.bytes, x, ldx, N, y, ldy, 0, rows);
    hash_floats(y, ldy * N);
    for (uint32_t t = 0; t < N; t++)
        for (size_t r = rows; r < ldy; r++) CHECK(isnan(y[t * ldy + r]), "%s: wrote into the stride padding", name);

    float *yref = malloc(sizeof(float) * rows * N); /* (N, rows) the reference kernel */
    smoe_ref_matmul_rows(W, tt.bytes, x, ldx, N, yref, rows, 0, rows);
    float *ydisp = malloc(sizeof(float) * rows * N); /* (N, rows) what kernels.c dispatches to */
    smoe_matmul_rows(W, tt.bytes, x, ldx, N, ydisp, rows, 0, rows);

    float *wd = malloc(sizeof(float) * cols);  /* (cols) one row, naive dequantised */
    double *am = malloc(sizeof(double) * cols); /* (cols) its affine magnitudes */
    int reported = 0;
    for (uint32_t r = 0; r < rows; r++) {
        for (uint32_t c = 0; c < cols; c++) {
            wd[c] = naive_w(W, tt.bytes, r, c);
            am[c] = affine_mag(W, tt.bytes, r, c);
        }
        for (uint32_t t = 0; t < N; t++) {
            const float *xt = x + t * ldx;
            double ref = 0, mag = 0, amag = 0;
            for (uint32_t c = 0; c < cols; c++) {
                double p = (double)wd[c] * xt[c];
                ref += p;
                mag += fabs(p);
                amag += am[c] * fabs(xt[c]);
            }
            const double tol = 4.0 * (cols / 8.0 + 16) * 0x1p-24 * amag + 1e-30;
            const double tol_ref = 4.0 * (cols / 16.0 + 4) * 0x1p-24 * mag + 1e-30;
            const float got = y[t * ldy + r], kref = yref[(size_t)t * rows + r];
            const double err = fabs(got - ref), d = fabs((double)got - kref);
            if (!(err <= tol) && !reported++)
                CHECK(err <= tol, "%s %ux%u: y[t=%u, r=%u] = %.9g, double ref %.9g (err %.3g, tol %.3g)", name, rows,
                      cols, t, r, got, ref, err, tol);
            if (!(d <= tol + tol_ref) && !reported++)
                CHECK(d <= tol + tol_ref, "%s %ux%u: y[t=%u, r=%u] = %.9g, reference kernel %.9g", name, rows, cols,
                      t, r, got, kref);
            if (f32_bits(ydisp[(size_t)t * rows + r]) != f32_bits(got) && !reported++)
                CHECK(0, "%s %ux%u: smoe_matmul_rows is not the NEON kernel (t=%u, r=%u: %a vs %a)", name, rows, cols,
                      t, r, ydisp[(size_t)t * rows + r], got);
        }
    }

    /* the same work cut into other batches and random row ranges (some empty): the same bits */
    float *y2 = malloc(sizeof(float) * rows * N);
    const uint32_t batches[] = {1, 2, 3, 4, 5, 7, 31, 33};
    for (size_t bi = 0; bi < sizeof batches / sizeof *batches; bi++) {
        const uint32_t nb = batches[bi];
        for (uint32_t t0 = 0; t0 < N; t0 += nb) {
            const uint32_t nt = N - t0 < nb ? N - t0 : nb;
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
                neon_mm(W, tt.bytes, x + t0 * ldx, ldx, nt, y2 + (size_t)t0 * rows, rows, cuts[k], cuts[k + 1]);
        }
        int diff = 0;
        for (uint32_t t = 0; t < N && !diff; t++)
            for (uint32_t r = 0; r < rows && !diff; r++)
                if (f32_bits(y2[(size_t)t * rows + r]) != f32_bits(y[t * ldy + r])) {
                    CHECK(0, "%s %ux%u: batches of %u with split rows differ at t=%u r=%u: %a vs %a", name, rows, cols,
                          nb, t, r, y2[(size_t)t * rows + r], y[t * ldy + r]);
                    diff = 1;
                }
    }
    /* one row of one token */
    for (uint32_t t = 0; t < N; t += 7)
        for (uint32_t r = 0; r < rows; r += 3) {
            y2[r] = NAN;
            neon_mm(W, tt.bytes, x + t * ldx, ldx, 1, y2, rows, r, r + 1); /* writes y2[r] only */
            CHECK(f32_bits(y2[r]) == f32_bits(y[t * ldy + r]), "%s %ux%u: single (t=%u, r=%u) differs", name, rows,
                  cols, t, r);
        }

    free(y2);
    free(am);
    free(wd);
    free(ydisp);
    free(yref);
    free(y);
    free(x);
    free(tt.alloc);
}

static void test_matmul(void) {
    /* f32/bf16: cols of every residue mod 8, below and across the 512-column blocks */
    const struct {
        uint32_t rows, cols;
    } fshapes[] = {{1, 1}, {2, 7}, {5, 8}, {4, 9}, {9, 17}, {37, 333}, {6, 512}, {7, 513}, {3, 1031}, {8, 2101}},
      /* q8/q4: 1 group, across the 8-group blocks, wider */
      qshapes[] = {{1, 64}, {3, 128}, {5, 448}, {37, 320}, {13, 512}, {6, 576}, {4, 1024}, {5, 2112}};
    for (size_t i = 0; i < sizeof fshapes / sizeof *fshapes; i++)
        for (uint8_t f = SMOE_FMT_F32; f <= SMOE_FMT_BF16; f++)
            test_matmul_case(f, SMOE_SCALE_NONE, 0, fshapes[i].rows, fshapes[i].cols, (unsigned)(i % 2) * 4);
    for (size_t i = 0; i < sizeof qshapes / sizeof *qshapes; i++)
        for (uint8_t f = SMOE_FMT_Q8; f <= SMOE_FMT_Q4; f++)
            for (uint8_t sf = SMOE_SCALE_F16; sf <= SMOE_SCALE_BF16; sf++)
                test_matmul_case(f, sf, 64, qshapes[i].rows, qshapes[i].cols, (unsigned)(i % 2) * 4);
    for (int trial = 0; trial < 6; trial++) {
        const uint32_t rows = 1 + (uint32_t)(rnd() % 23), fcols = 1 + (uint32_t)(rnd() % 1100);
        const uint32_t qcols = 64 * (1 + (uint32_t)(rnd() % 24));
        const uint8_t sf = SMOE_SCALE_F16 + (uint8_t)(rnd() % 2);
        test_matmul_case(SMOE_FMT_F32, SMOE_SCALE_NONE, 0, rows, fcols, 0);
        test_matmul_case(SMOE_FMT_BF16, SMOE_SCALE_NONE, 0, rows, fcols, 4);
        test_matmul_case(SMOE_FMT_Q8, sf, 64, rows, qcols, 4);
        test_matmul_case(SMOE_FMT_Q4, sf, 64, rows, qcols, 0);
    }
    /* the widest q rows the NEON kernels take (256 groups), and one group more: refused (the
     * reference runs it; the choice is by shape) */
    test_matmul_case(SMOE_FMT_Q4, SMOE_SCALE_BF16, 64, 2, 64 * 256, 0);
    test_tensor wide = make_tensor(SMOE_FMT_Q8, SMOE_SCALE_F16, 64, 1, 64 * 257, 0);
    float *x = calloc(64 * 257, sizeof(float)), y = 0;
    CHECK(!smoe_neon_matmul_rows(&wide.t, wide.bytes, x, 0, 1, &y, 0, 0, 1), "q rows of 257 groups were taken");
    free(x);
    free(wide.alloc);
}

/* Groups of 32 and 128 and f32 scales (any group): one group, an odd number of groups (cols =
 * 32·odd for group 32), across the 512-column blocks, the widest rows taken. */
static void test_matmul_groups(void) {
    static const uint32_t groups[] = {32, 64, 128};
    static const uint8_t sfs[] = {SMOE_SCALE_F16, SMOE_SCALE_BF16, SMOE_SCALE_F32};
    for (size_t gi = 0; gi < 3; gi++)
        for (size_t si = 0; si < 3; si++) {
            const uint32_t G = groups[gi];
            if (G == 64 && sfs[si] != SMOE_SCALE_F32) continue; /* test_matmul */
            const uint32_t shapes[][2] = {{1, G}, {5, 3 * G}, {13, 11 * G}, {6, 1024}};
            for (size_t i = 0; i < 4; i++)
                for (uint8_t f = SMOE_FMT_Q8; f <= SMOE_FMT_Q4; f++)
                    test_matmul_case(f, sfs[si], G, shapes[i][0], shapes[i][1], (unsigned)(i % 2) * 4);
        }
    test_matmul_case(SMOE_FMT_Q4, SMOE_SCALE_F32, 32, 2, 16384, 0);
}

/* Every f16 bit pattern as a q8 scale through the NEON kernels (one group per row, code 1, bias
 * +0, x one-hot at column 17): y = 1·s + 0, the converted scale itself, against the ldexp
 * decoding. Infinite and NaN scales give 0·s = NaN in the other lanes: checked for NaN. */
static void test_f16_scales(void) {
    const uint32_t rows = 65536, cols = 64;
    smoe_tensor t;
    memset(&t, 0, sizeof t);
    t.format = SMOE_FMT_Q8;
    t.scale_format = SMOE_SCALE_F16;
    t.rows = rows;
    t.cols = cols;
    t.group = 64;
    const uint64_t n = (uint64_t)rows * cols;
    t.scales_off = align64(n);
    t.biases_off = t.scales_off + align64(2 * rows);
    t.nbytes = t.biases_off + align64(2 * rows);
    uint8_t *b = aligned_alloc(64, t.nbytes);
    memset(b, 0, t.nbytes);
    memset(b, 1, n);
    for (uint32_t r = 0; r < rows; r++) {
        uint16_t h = (uint16_t)r;
        memcpy(b + t.scales_off + 2 * r, &h, 2);
    }
    t.data = b;
    float x[64] = {0};
    x[17] = 1.0f;
    float *y = malloc(sizeof(float) * rows);
    for (int pass = 0; pass < 2; pass++) { /* n = 1 (matrix-vector) and n = 2 (batched) kernels */
        const uint32_t nt = pass ? 2 : 1;
        float *x2 = malloc(sizeof(float) * 64 * nt), *y2 = malloc(sizeof(float) * rows * nt);
        for (uint32_t j = 0; j < nt; j++) memcpy(x2 + 64 * j, x, sizeof x);
        neon_mm(&t, b, x2, 64, nt, y2, rows, 0, rows);
        memcpy(y, y2 + (size_t)(nt - 1) * rows, sizeof(float) * rows);
        int bad = 0;
        for (uint32_t r = 0; r < rows; r++) {
            const float want = naive_f16((uint16_t)r);
            const bool ok = isfinite(want) ? f32_bits(y[r]) == f32_bits(want + 0.0f) : isnan(y[r]);
            if (!ok && bad++ < 5) CHECK(ok, "f16 scale 0x%04x (n = %u): y = %a, expected %a", r, nt, y[r], want);
        }
        free(x2);
        free(y2);
    }
    free(y);
    free(b);
}

/* ----------------------------------------------------------------------- per-token math */

static void test_rmsnorm(void) {
    const uint32_t dims[] = {1, 7, 8, 9, 64, 100, 2048, 2053};
    for (size_t di = 0; di < sizeof dims / sizeof *dims; di++) {
        const uint32_t dim = dims[di];
        for (uint8_t f = SMOE_FMT_F32; f <= SMOE_FMT_BF16; f++) {
            test_tensor w = make_tensor(f, SMOE_SCALE_NONE, 0, 1, dim, (unsigned)(di % 2) * 4);
            float *x = malloc(sizeof(float) * dim), *out = malloc(sizeof(float) * dim);
            float *ref = malloc(sizeof(float) * dim), *disp = malloc(sizeof(float) * dim);
            for (uint32_t i = 0; i < dim; i++) x[i] = rndf(-3, 3);
            const float eps = 1e-6f;
            smoe_neon_rmsnorm(out, x, &w.t, dim, eps);
            hash_floats(out, dim);
            smoe_ref_rmsnorm(ref, x, &w.t, dim, eps);
            smoe_rmsnorm(disp, x, &w.t, dim, eps);
            double ss = 0;
            for (uint32_t i = 0; i < dim; i++) ss += (double)x[i] * x[i];
            const double inv = 1.0 / sqrt(ss / dim + eps);
            for (uint32_t i = 0; i < dim; i++) {
                const double want = x[i] * inv * naive_w(&w.t, w.bytes, 0, i);
                CHECK(fabs(out[i] - want) <= 1e-5 * (fabs(want) + 1e-6), "rmsnorm dim %u [%u]: %g vs %g", dim, i,
                      out[i], want);
                CHECK(fabs(out[i] - ref[i]) <= 2e-5 * (fabs(want) + 1e-6), "rmsnorm dim %u [%u]: %g, reference %g",
                      dim, i, out[i], ref[i]);
            }
            CHECK(memcmp(disp, out, sizeof(float) * dim) == 0, "smoe_rmsnorm is not the NEON kernel (dim %u)", dim);
            smoe_neon_rmsnorm(x, x, &w.t, dim, eps); /* in place: the same bits */
            CHECK(memcmp(x, out, sizeof(float) * dim) == 0, "rmsnorm in place differs (dim %u)", dim);
            free(x);
            free(out);
            free(ref);
            free(disp);
            free(w.alloc);
        }
    }
}

static void test_attend(void) {
    const uint32_t stride = 4 * 128 + 8;
    const uint32_t npos[] = {1, 2, 17, 300, 5, 9, 40, 3};
    const uint32_t hds[] = {128, 128, 128, 128, 64, 100, 68, 3};
    for (uint32_t dt = SMOE_KV_F32; dt <= SMOE_KV_F16; dt++)
        for (size_t pi = 0; pi < sizeof npos / sizeof *npos; pi++) {
            const uint32_t n = npos[pi], hd = hds[pi];
            const size_t eb = smoe_kv_elem_bytes(dt), cnt = (size_t)stride * n;
            float *kf = malloc(sizeof(float) * cnt), *vf = malloc(sizeof(float) * cnt);
            void *k = malloc(eb * cnt), *v = malloc(eb * cnt);
            float q[128], out[128], ref[128], disp[128], *scratch = malloc(sizeof(float) * n);
            for (size_t i = 0; i < cnt; i++) {
                kf[i] = rndf(-1, 1);
                vf[i] = rndf(-1, 1);
            }
            smoe_kv_store(k, kf, cnt, dt);
            smoe_kv_store(v, vf, cnt, dt);
            smoe_kv_load(kf, k, cnt, dt);
            smoe_kv_load(vf, v, cnt, dt);
            for (uint32_t i = 0; i < hd; i++) q[i] = rndf(-2, 2);
            smoe_neon_attend(out, q, k, v, stride, n, hd, dt, -INFINITY, scratch);
            hash_floats(out, hd);
            smoe_ref_attend(ref, q, k, v, stride, n, hd, dt, -INFINITY, scratch);
            smoe_attend(disp, q, k, v, stride, n, hd, dt, -INFINITY, scratch);
            double *s = malloc(sizeof(double) * n), m = -INFINITY, z = 0;
            for (uint32_t p = 0; p < n; p++) {
                double d = 0;
                for (uint32_t i = 0; i < hd; i++) d += (double)q[i] * kf[(size_t)p * stride + i];
                s[p] = d / sqrt(hd);
                if (s[p] > m) m = s[p];
            }
            for (uint32_t p = 0; p < n; p++) z += s[p] = exp(s[p] - m);
            for (uint32_t i = 0; i < hd; i++) {
                double want = 0;
                for (uint32_t p = 0; p < n; p++) want += s[p] / z * vf[(size_t)p * stride + i];
                CHECK(fabs(out[i] - want) <= 1e-5, "attend kv_dtype %u n_pos %u hd %u [%u]: %g vs %g", dt, n, hd, i,
                      out[i], want);
            }
            CHECK(memcmp(ref, out, sizeof(float) * hd) == 0, "attend kv_dtype %u n_pos %u hd %u: NEON differs from the reference",
                  dt, n, hd);
            CHECK(memcmp(disp, out, sizeof(float) * hd) == 0, "smoe_attend is not the NEON kernel (n_pos %u)", n);
            free(s);
            free(kf);
            free(vf);
            free(k);
            free(v);
            free(scratch);
        }
}

int main(void) {
    CHECK(strcmp(smoe_kernels_isa(), "neon") == 0, "smoe_kernels_isa() = %s", smoe_kernels_isa());
    test_matmul();
    test_matmul_groups();
    test_f16_scales();
    test_rmsnorm();
    test_attend();
    if (failures) {
        fprintf(stderr, "test_kernels_neon: %d failure(s)\n", failures);
        return 1;
    }
    printf("checksum_neon %016llx\n", (unsigned long long)out_hash);
    printf("test_kernels_neon: ok\n");
    return 0;
}

#else /* !SMOE_HAVE_NEON */

int main(void) {
    printf("test_kernels_neon: skipped: this build runs the %s kernels, not NEON\n", smoe_kernels_isa());
    return 0;
}

#endif
