/* bench/ggml_kernels.c — the 8-bit-activation product (the session's default) of the GGML block
 * formats against pysmoe's own q4 (group 64, f16 scales) and q8, one thread, on the dispatched
 * kernels: n = 1 on a matrix far larger than the caches (decode: the weights stream from memory)
 * and n = 64 on 2048 × 2048 (a prefill chunk's batched product), the quantisation of x included.
 *
 *   make lib && cc -O3 -std=c11 -ffp-contract=off -D_GNU_SOURCE -mavx2 -mfma -mf16c -Icsrc \
 *       bench/ggml_kernels.c csrc/cpu/kernels.c csrc/cpu/kernels_ref.c csrc/cpu/kernels_avx2.c \
 *       csrc/cpu/kernels_avx512.c csrc/cpu/kernels_neon.c csrc/cpu/cpu.c csrc/util.c -lm -pthread -o build/bench_ggml
 *   build/bench_ggml [f32 [FORMAT]]     (f32: f32 activations, smoe_matmul_rows; FORMAT: only that row)
 *   build/bench_ggml shape ROWS COLS N... [FORMAT]   (8-bit activations at one shape, each n given:
 *                                        e.g. 3072 2048 1 4 16 for a3b's gate and up at a prefill's
 *                                        tokens an expert; the last argument a format name: only it)
 *
 * Figures: medians of REPS runs timed by the thread's CPU time (the machine is shared); GB/s
 * counts the weight bytes read once per call, GFLOP/s 2·rows·cols·n. The random bytes are the
 * codes; scales are set to small finite values (the speed does not depend on them). */
#include "cpu/kernels_isa.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { REPS = 7 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static uint64_t st = 88172645463325252ull;
static uint8_t rnd8(void) {
    st ^= st << 13;
    st ^= st >> 7;
    st ^= st << 17;
    return (uint8_t)(st >> 24);
}

/* a tensor of format f (q4/q8: group 64, f16 scales), scales 2^-8 */
static smoe_tensor make(uint8_t f, uint32_t rows, uint32_t cols, uint8_t **mem) {
    smoe_tensor t;
    memset(&t, 0, sizeof t);
    t.format = f;
    t.rows = rows;
    t.cols = cols;
    uint32_t bs, ts;
    if (smoe_ggml_block(f, &bs, &ts)) {
        t.nbytes = (uint64_t)rows * (cols / bs) * ts;
    } else {
        t.group = 64;
        t.scale_format = SMOE_SCALE_F16;
        const uint64_t codes = (uint64_t)rows * cols / (f == SMOE_FMT_Q4 ? 2 : 1), sb = 2ull * rows * cols / 64;
        t.scales_off = codes;
        t.biases_off = codes + sb;
        t.nbytes = codes + 2 * sb;
    }
    uint8_t *m = aligned_alloc(64, (t.nbytes + 63) / 64 * 64);
    for (uint64_t i = 0; i < t.nbytes; i++) m[i] = rnd8();
    if (t.group) {
        for (uint64_t i = t.scales_off; i < t.nbytes; i += 2) m[i] = 0, m[i + 1] = 0x1c; /* f16 2^-8 */
    } else {
        for (uint64_t b = 0; b < t.nbytes / ts; b++) {
            uint8_t *p = m + b * ts;
            switch (f) {
            case SMOE_FMT_GGML_MXFP4: p[0] = 120; break;
            case SMOE_FMT_GGML_Q6_K: p[208] = 0, p[209] = 0x1c; break;
            case SMOE_FMT_GGML_Q3_K: p[108] = 0, p[109] = 0x1c; break;
            case SMOE_FMT_GGML_Q2_K: p[80] = p[82] = 0, p[81] = p[83] = 0x1c; break;
            case SMOE_FMT_GGML_IQ1_M: /* d = 0x1c00 in the top nibbles of the scale words at 48 (smoe_ggml_iq1m_d) */
                for (int i = 0; i < 4; i++) p[49 + 2 * i] = (uint8_t)((p[49 + 2 * i] & 0x0f) | (((0x1c00 >> (4 * i)) & 15) << 4));
                break;
            default: p[0] = 0, p[1] = 0x1c, p[2] = 0, p[3] = 0x1c; break; /* d (and dmin / m where there is one) */
            }
        }
    }
    *mem = m;
    return t;
}

static double run(uint8_t f, uint32_t rows, uint32_t cols, uint32_t n, bool f32, double *gbs, double *gflops) {
    uint8_t *m;
    smoe_tensor W = make(f, rows, cols, &m);
    const uint32_t G = smoe_qx_group(&W);
    const smoe_qx_size z = smoe_qx_sizes(cols, f, G);
    float *x = malloc(sizeof(float) * cols * n), *y = malloc(sizeof(float) * rows * n);
    for (size_t i = 0; i < (size_t)cols * n; i++) x[i] = (float)(rnd8() - 128) / 64.0f;
    void *codes = aligned_alloc(64, (z.code_bytes * n + 63) / 64 * 64);
    float *d = malloc(sizeof(float) * z.d_floats * n), *gs = malloc(sizeof(float) * z.gsum_floats * n);
    double t[REPS];
    for (int k = 0; k < REPS; k++) {
        const double t0 = now();
        if (f32) {
            smoe_matmul_rows(&W, m, x, cols, n, y, rows, 0, rows);
        } else {
            smoe_qx_prepare(x, cols, n, cols, f, G, codes, d, gs);
            const smoe_qx X = {codes, d, gs, cols, G, f, NULL};
            smoe_matmul_rows_qx(&W, m, &X, n, y, rows, 0, rows);
        }
        t[k] = now() - t0;
    }
    qsort(t, REPS, sizeof *t, cmp);
    *gbs = (double)W.nbytes / t[REPS / 2] * 1e-9;
    *gflops = 2.0 * rows * cols * n / t[REPS / 2] * 1e-9;
    free(m), free(x), free(y), free(codes), free(d), free(gs);
    return t[REPS / 2];
}

int main(int argc, char **argv) {
    static const struct {
        uint8_t f;
        const char *name;
    } F[] = {{SMOE_FMT_Q4, "q4 (g64)"},         {SMOE_FMT_Q8, "q8 (g64)"},        {SMOE_FMT_GGML_Q4_K, "Q4_K"},
             {SMOE_FMT_GGML_Q5_K, "Q5_K"},      {SMOE_FMT_GGML_Q6_K, "Q6_K"},     {SMOE_FMT_GGML_Q8_0, "Q8_0"},
             {SMOE_FMT_GGML_Q4_0, "Q4_0"},      {SMOE_FMT_GGML_Q5_0, "Q5_0"},     {SMOE_FMT_GGML_IQ4_NL, "IQ4_NL"},
             {SMOE_FMT_GGML_IQ4_XS, "IQ4_XS"},  {SMOE_FMT_GGML_MXFP4, "MXFP4"},   {SMOE_FMT_GGML_Q3_K, "Q3_K"},
             {SMOE_FMT_GGML_Q2_K, "Q2_K"},      {SMOE_FMT_GGML_Q4_1, "Q4_1"},     {SMOE_FMT_GGML_Q5_1, "Q5_1"},
             {SMOE_FMT_GGML_IQ2_XXS, "IQ2_XXS"}, {SMOE_FMT_GGML_IQ2_XS, "IQ2_XS"}, {SMOE_FMT_GGML_IQ2_S, "IQ2_S"},
             {SMOE_FMT_GGML_IQ3_XXS, "IQ3_XXS"}, {SMOE_FMT_GGML_IQ3_S, "IQ3_S"},   {SMOE_FMT_GGML_IQ1_S, "IQ1_S"},
             {SMOE_FMT_GGML_IQ1_M, "IQ1_M"}};
    if (argc > 4 && strcmp(argv[1], "shape") == 0) { /* shape ROWS COLS N... [FORMAT] */
        const uint32_t rows = (uint32_t)atoi(argv[2]), cols = (uint32_t)atoi(argv[3]);
        const bool named = atoi(argv[argc - 1]) == 0; /* a format name, not an n */
        const int nend = named ? argc - 1 : argc;
        printf("kernels %s; one thread; 8-bit activations; %u x %u\n", smoe_kernels(), rows, cols);
        for (int a = 4; a < nend; a++) {
            const uint32_t n = (uint32_t)atoi(argv[a]);
            for (size_t i = 0; i < sizeof F / sizeof *F; i++) {
                if (named && strcmp(argv[argc - 1], F[i].name) != 0) continue;
                double g, fl;
                const double t = run(F[i].f, rows, cols, n, false, &g, &fl);
                printf("n=%-4u %-10s %8.3f ms %9.2f us/token\n", n, F[i].name, 1e3 * t, 1e6 * t / n);
            }
        }
        return 0;
    }
    const bool f32 = argc > 1 && strcmp(argv[1], "f32") == 0; /* f32 activations (smoe_matmul_rows) */
    printf("kernels %s; one thread; %s activations\n", smoe_kernels(), f32 ? "f32" : "8-bit");
    printf("%-10s %22s %22s\n", "format", "n=1, 16384x2048", "n=64, 2048x2048");
    for (size_t i = 0; i < sizeof F / sizeof *F; i++) {
        if (argc > 2 && strcmp(argv[2], F[i].name) != 0) continue; /* one format: its name */
        double g1, f1, g64, f64;
        const double t1 = run(F[i].f, 16384, 2048, 1, f32, &g1, &f1), t64 = run(F[i].f, 2048, 2048, 64, f32, &g64, &f64);
        printf("%-10s %7.2f ms %6.1f GB/s %7.2f ms %6.1f GFLOP/s\n", F[i].name, 1e3 * t1, g1, 1e3 * t64, f64);
    }
    return 0;
}
