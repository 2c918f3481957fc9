/* bench/kernels.c — matrix-product throughput of the dispatched kernels (kernels_avx2.c on
 * x86-64) and of the reference kernels, against this CPU's limits measured here too.
 *
 *   make lib && cc -O3 -std=c11 -ffp-contract=off -D_GNU_SOURCE -mavx2 -mfma -mf16c -Icsrc \
 *       bench/kernels.c csrc/cpu/kernels.c csrc/cpu/kernels_ref.c csrc/cpu/kernels_avx2.c csrc/cpu/kernels_avx512.c csrc/cpu/cpu.c csrc/util.c -lm -pthread \
 *       -o build/bench_kernels
 *   build/bench_kernels [threads [group [f32]]]   (threads default 1, rows split between them;
 *                                                 q group size 32, 64 (default) or 128; "f32": f32
 *                                                 scales instead of f16)
 *
 * Limits: peak FMA rate (12 independent 8-wide FMA chains per thread: 2 FMA/cycle × 16 flops)
 * and read bandwidth (a 1 GiB buffer summed with 256-bit loads). Products: q4 and q8 with f16
 * scales, bf16, f32; n = 1 on a matrix far larger than the caches (the weights stream from
 * memory, as decode reads them), n = 64 on a 2048 × 2048 matrix (the batched product of a
 * prefill chunk; compute-bound). Figures are medians of REPS runs, the fast and the reference
 * kernel alternating run by run, and for q8/q4 the 8-bit-activation product (smoe_matmul_rows_qx,
 * "q8-act": the session's default), its quantisation of x included in its time. GFLOP/s counts 2·rows·cols·n; GB/s counts the weight bytes
 * (codes + scales + biases) read once per call. One thread is timed by its CPU time (the machine
 * is shared); more threads by the wall clock.
 */
#include "cpu/kernels_isa.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

enum { REPS = 7 };

/* With one thread, the thread's CPU time: the machine is shared, and time spent descheduled
 * says nothing about the kernel. With more, wall time (they must all be running). */
static clockid_t bench_clock = CLOCK_THREAD_CPUTIME_ID;

static double now(void) {
    struct timespec t;
    clock_gettime(bench_clock, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return v[n / 2];
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* ------------------------------------------------------------------------------ threads */

typedef struct {
    void (*fn)(void *, int);
    void *ctx;
    int id;
} job;

static void *job_main(void *p) {
    job *j = p;
    j->fn(j->ctx, j->id);
    return NULL;
}

static void run_threads(int threads, void (*fn)(void *, int), void *ctx) {
    pthread_t tid[64];
    job jobs[64];
    for (int i = 0; i < threads; i++) {
        jobs[i] = (job){fn, ctx, i};
        if (i) pthread_create(&tid[i], NULL, job_main, &jobs[i]);
    }
    fn(ctx, 0);
    for (int i = 1; i < threads; i++) pthread_join(tid[i], NULL);
}

/* --------------------------------------------------------------------------------- limits */

#if defined(__AVX2__) && defined(__FMA__)
static void peak_fma_body(void *ctx, int id) {
    (void)id;
    long iters = *(long *)ctx;
    __m256 a[12];
    for (int i = 0; i < 12; i++) a[i] = _mm256_set1_ps((float)i * 1e-3f);
    const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
    for (long i = 0; i < iters; i++) {
        for (int j = 0; j < 12; j++) a[j] = _mm256_fmadd_ps(a[j], m, c);
        __asm__ volatile("" : "+x"(a[0]), "+x"(a[1]), "+x"(a[2]), "+x"(a[3]), "+x"(a[4]), "+x"(a[5]));
        __asm__ volatile("" : "+x"(a[6]), "+x"(a[7]), "+x"(a[8]), "+x"(a[9]), "+x"(a[10]), "+x"(a[11]));
    }
}

static double peak_fma(int threads) {
    long iters = 20000000;
    double v[REPS];
    for (int r = 0; r < REPS; r++) {
        double t = now();
        run_threads(threads, peak_fma_body, &iters);
        v[r] = (double)iters * 12 * 16 * threads / (now() - t) / 1e9;
    }
    return median(v, REPS);
}
#endif

typedef struct {
    const uint8_t *buf;
    size_t bytes;
    int threads;
    volatile uint64_t sink;
} bw_ctx;

static void bw_body(void *p, int id) {
    bw_ctx *c = p;
    size_t per = c->bytes / (size_t)c->threads;
    const uint64_t *q = (const uint64_t *)(const void *)(c->buf + per * (size_t)id);
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = 0; i < per / 8; i += 4) {
        s0 += q[i];
        s1 += q[i + 1];
        s2 += q[i + 2];
        s3 += q[i + 3];
    }
    c->sink += s0 + s1 + s2 + s3;
}

static double read_bw(int threads) {
    bw_ctx c = {NULL, (size_t)1 << 30, threads, 0};
    uint8_t *b = aligned_alloc(64, c.bytes);
    memset(b, 1, c.bytes);
    c.buf = b;
    double v[REPS];
    for (int r = 0; r < REPS; r++) {
        double t = now();
        run_threads(threads, bw_body, &c);
        v[r] = (double)c.bytes / (now() - t) / 1e9;
    }
    free(b);
    return median(v, REPS);
}

/* ------------------------------------------------------------------------------- products */

typedef struct {
    smoe_tensor t;
    uint8_t *bytes;
} tensor;

static uint32_t q_group = 64;          /* argv[2] */
static uint8_t q_scales = SMOE_SCALE_F16; /* argv[3] "f32": SMOE_SCALE_F32 */

static tensor make(uint8_t format, uint32_t rows, uint32_t cols) {
    tensor m;
    memset(&m, 0, sizeof m);
    smoe_tensor *t = &m.t;
    t->format = format;
    t->scale_format = format >= SMOE_FMT_Q8 ? q_scales : SMOE_SCALE_NONE;
    t->group = format >= SMOE_FMT_Q8 ? q_group : 0;
    t->rows = rows;
    t->cols = cols;
    uint64_t n = (uint64_t)rows * cols;
    switch (format) {
    case SMOE_FMT_F32: t->nbytes = 4 * n; break;
    case SMOE_FMT_BF16: t->nbytes = 2 * n; break;
    default: {
        uint64_t codes = format == SMOE_FMT_Q8 ? n : n / 2, sb = (q_scales == SMOE_SCALE_F32 ? 4 : 2) * (n / q_group);
        t->scales_off = codes;
        t->biases_off = codes + sb;
        t->nbytes = codes + 2 * sb;
    }
    }
    m.bytes = aligned_alloc(64, (t->nbytes + 63) / 64 * 64);
    for (uint64_t i = 0; i < t->nbytes / 8; i++) ((uint64_t *)(void *)m.bytes)[i] = rnd();
    if (format == SMOE_FMT_F32) /* finite values */
        for (uint64_t i = 0; i < n; i++) ((float *)(void *)m.bytes)[i] = (float)(rnd() % 2001) * 1e-3f - 1.0f;
    if (format == SMOE_FMT_BF16)
        for (uint64_t i = 0; i < n; i++) ((uint16_t *)(void *)m.bytes)[i] = (uint16_t)(0x3c00 + rnd() % 0x300);
    if (format >= SMOE_FMT_Q8) /* scales and biases around 2^-6 */
        for (uint64_t g = 0; g < 2 * (n / q_group); g++) {
            const uint16_t h = (uint16_t)(0x2400 | (rnd() & 0x83ff));
            if (q_scales == SMOE_SCALE_F32)
                ((float *)(void *)(m.bytes + t->scales_off))[g] = _cvtsh_ss(h);
            else
                ((uint16_t *)(void *)(m.bytes + t->scales_off))[g] = h;
        }
    t->data = m.bytes;
    return m;
}

typedef void (*matmul_fn)(const smoe_tensor *, const uint8_t *, const float *, size_t, uint32_t, float *, size_t,
                          uint32_t, uint32_t);

typedef struct {
    matmul_fn fn;      /* NULL: the 8-bit-activation product (smoe_matmul_rows_qx) */
    const tensor *m;
    const float *x;
    float *y;
    uint32_t n;
    int threads;
    smoe_qx qx;        /* fn NULL: x quantised here, in the timed call, as the engine does per product */
    void *codes;
    float *d, *gsum;
} mm_ctx;

static void mm_body(void *p, int id) {
    mm_ctx *c = p;
    uint32_t rows = c->m->t.rows, per = (rows / (uint32_t)c->threads + 15) / 16 * 16;
    uint32_t r0 = per * (uint32_t)id, r1 = r0 + per < rows ? r0 + per : rows;
    if (r0 >= r1) return;
    if (c->fn)
        c->fn(&c->m->t, c->m->bytes, c->x, c->m->t.cols, c->n, c->y, rows, r0, r1);
    else
        smoe_matmul_rows_qx(&c->m->t, c->m->bytes, &c->qx, c->n, c->y, rows, r0, r1);
}

static double time_once(mm_ctx *c) {
    double t = now();
    if (!c->fn) {
        uint32_t cols = c->m->t.cols;
        smoe_qx_prepare(c->x, cols, c->n, cols, c->m->t.format, c->m->t.group, c->codes, c->d, c->gsum);
        c->qx = (smoe_qx){c->codes, c->d, c->gsum, cols, c->m->t.group, c->m->t.format, NULL};
    }
    run_threads(c->threads, mm_body, c);
    return now() - t;
}

/* the fast and the reference kernel on the same matrix, alternating run by run */
static void bench_pair(uint8_t format, uint32_t rows, uint32_t cols, uint32_t n, int threads, double peak,
                       double bw) {
    tensor m = make(format, rows, cols);
    float *x = malloc(sizeof(float) * cols * n), *y = malloc(sizeof(float) * rows * n);
    for (size_t i = 0; i < (size_t)cols * n; i++) x[i] = (float)(rnd() % 2001) * 1e-3f - 1.0f;
    mm_ctx fast = {.fn = smoe_matmul_rows, .m = &m, .x = x, .y = y, .n = n, .threads = threads};
    mm_ctx ref = fast, q8x = fast;
    ref.fn = smoe_ref_matmul_rows;
    const int has_qx = format == SMOE_FMT_Q8 || format == SMOE_FMT_Q4;
    if (has_qx) {
        smoe_qx_size z = smoe_qx_sizes(cols, format, q_group);
        q8x.fn = NULL;
        q8x.codes = aligned_alloc(64, (z.code_bytes * n + 63) / 64 * 64);
        q8x.d = malloc(sizeof(float) * z.d_floats * n);
        q8x.gsum = malloc(sizeof(float) * z.gsum_floats * n);
    }
    time_once(&fast); /* warm */
    time_once(&ref);
    if (has_qx) time_once(&q8x);
    double vf[REPS], vr[REPS], vq[REPS], ratio[REPS], qratio[REPS];
    for (int r = 0; r < REPS; r++) {
        vf[r] = time_once(&fast);
        vr[r] = time_once(&ref);
        ratio[r] = vr[r] / vf[r];
        if (has_qx) {
            vq[r] = time_once(&q8x);
            qratio[r] = vf[r] / vq[r];
        }
    }
    static const char *fmts[] = {"f32", "bf16", "q8", "q4"};
    static const char *names[] = {"fast", "reference", "q8-act"};
    double times[3] = {median(vf, REPS), median(vr, REPS), has_qx ? median(vq, REPS) : 0};
    for (int k = 0; k < 2 + has_qx; k++) {
        double t = times[k];
        double gflops = 2.0 * rows * cols * n / t / 1e9, gbs = (double)m.t.nbytes / t / 1e9;
        printf("%-9s %-4s %5u x %-5u n=%-3u %8.2f ms %7.1f GFLOP/s (%3.0f%% of peak) %6.1f GB/s (%3.0f%% of bw)",
               names[k], fmts[format], rows, cols, n, t * 1e3, gflops, 100 * gflops / peak, gbs, 100 * gbs / bw);
        if (k == 0) printf("  fast/ref ×%.2f", median(ratio, REPS));
        if (k == 2) printf("  q8-act/fast ×%.2f", median(qratio, REPS));
        printf("\n");
    }
    fflush(stdout);
    free(q8x.codes);
    free(q8x.d);
    free(q8x.gsum);
    free(x);
    free(y);
    free(m.bytes);
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 1;
    if (threads < 1 || threads > 64) threads = 1;
    if (argc > 2) q_group = (uint32_t)atoi(argv[2]);
    if (q_group != 32 && q_group != 128) q_group = 64;
    if (argc > 3 && strcmp(argv[3], "f32") == 0) q_scales = SMOE_SCALE_F32;
    if (threads > 1) bench_clock = CLOCK_MONOTONIC;
#if defined(__AVX2__) && defined(__FMA__)
    double peak = peak_fma(threads);
#else
    double peak = NAN;
#endif
    double bw = read_bw(threads);
    printf("q group %u, %s scales\n", q_group, q_scales == SMOE_SCALE_F32 ? "f32" : "f16");
    printf("kernels: %s, %d thread(s), %s; peak FMA %.1f GFLOP/s, read bandwidth %.1f GB/s\n", smoe_kernels_isa(),
           threads, threads > 1 ? "wall clock" : "thread CPU time", peak, bw);
    const uint8_t formats[] = {SMOE_FMT_Q4, SMOE_FMT_Q8, SMOE_FMT_BF16, SMOE_FMT_F32};
    for (size_t f = 0; f < sizeof formats; f++) {
        /* n = 1 over ~128 MiB of q4 (less for the wider formats' time's sake: still ≫ L2) */
        uint32_t rows = formats[f] == SMOE_FMT_Q4 ? 32768 : formats[f] == SMOE_FMT_Q8 ? 16384 : 8192;
        bench_pair(formats[f], rows, 8192, 1, threads, peak, bw);
        bench_pair(formats[f], 2048, 2048, 64, threads, peak, bw);
    }
    return 0;
}
