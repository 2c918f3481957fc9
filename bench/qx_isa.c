/* bench/qx_isa.c — the 8-bit-activation product (smoe_matmul_rows_qx) instance by instance: AVX2
 * (its AVX-VNNI instance where the CPU has it, else the plain one) against AVX-512 (its VNNI
 * instance where the CPU has AVX512-VNNI, else F+BW), on the same inputs, alternated rep by rep.
 *
 *   cc -O3 -std=c11 -ffp-contract=off -D_GNU_SOURCE -mavx2 -mfma -mf16c -Icsrc bench/qx_isa.c \
 *       csrc/cpu/kernels.c csrc/cpu/kernels_ref.c csrc/cpu/kernels_avx2.c csrc/cpu/kernels_avx512.c csrc/cpu/cpu.c csrc/util.c -lm -pthread -o build/qx_isa
 *   build/qx_isa [q4|q8 [group]]      (default q4, group 64)
 *   build/qx_isa mv [q4|q8 [group [MiB]]]   (one token, every instance: matvec_main below)
 *   build/qx_isa amx [q4|q8 [group]]         (batches: AVX512-VNNI against AMX, amx_main below)
 *   build/qx_isa scale [MAX_THREADS]          (1 … MAX_THREADS threads on one product: scale_main below)
 *   build/qx_isa rate                         (every instance this CPU runs, one thread: rate_main below)
 *   build/qx_isa few [THREADS]                (n = 1 … 8 from memory, batched against row at a time: few_main below)
 *   build/qx_isa read [MAX_THREADS [MiB]]     (a plain read of MiB from memory at 1, 2, 4 … threads: read_main below)
 *
 * Shapes: n = 1 on 32768 × 2048 (32 MiB of q4 codes: the weights stream from memory, as decode
 * reads its experts), n = 2, 4, 8 and 64 on 768 × 2048 (an a3b expert's gate; the batched product
 * of a prefill chunk's tokens routed to one expert). One and two threads, each thread its half of
 * the rows, each calling the product K times per rep (K sized so that a rep lasts ~20 ms); the
 * figure is the median of REPS reps, wall clock. x is prepared once, outside the timing (both
 * instances read the same codes). The outputs of the two are compared bit for bit too. "read
 * only": the same weight bytes merely read (256-bit loads, summed), timed alongside: a product
 * that takes about that long is bound by reading its weights.
 */
#include "cpu/cpu.h"
#include "internal.h"
#include "cpu/kernels_isa.h"

#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { REPS = 9 };

typedef bool (*qx_fn)(const smoe_tensor *, const uint8_t *, const smoe_qx *, uint32_t, float *, size_t, uint32_t,
                      uint32_t);

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

typedef struct {
    qx_fn fn;
    const smoe_tensor *W;
    const smoe_qx *X;
    uint32_t n, r0, r1;
    float *y;
    int calls;
} work;

static void *work_main(void *p) {
    work *w = p;
    for (int i = 0; i < w->calls; i++) w->fn(w->W, w->W->data, w->X, w->n, w->y, w->W->rows, w->r0, w->r1);
    return NULL;
}

/* A stand-in for a product that only reads: the same rows' bytes (codes, scales, biases) summed
 * with 256-bit loads — what n = 1 would cost if it were bound by reading alone. */
static bool read_only(const smoe_tensor *W, const uint8_t *w, const smoe_qx *X, uint32_t n, float *y, size_t ldy,
                      uint32_t r0, uint32_t r1) {
    (void)X;
    (void)n;
    (void)ldy;
    const size_t rb = W->format == SMOE_FMT_Q4 ? W->cols / 2 : W->cols, sb = (size_t)W->cols / W->group * 2;
    __m256i acc = _mm256_setzero_si256();
    for (size_t i = (size_t)r0 * rb; i < (size_t)r1 * rb; i += 32)
        acc = _mm256_add_epi64(acc, _mm256_loadu_si256((const __m256i *)(const void *)(w + i)));
    for (int part = 0; part < 2; part++) {
        const uint8_t *s = w + (part ? W->biases_off : W->scales_off);
        for (size_t i = (size_t)r0 * sb; i + 32 <= (size_t)r1 * sb; i += 32)
            acc = _mm256_add_epi64(acc, _mm256_loadu_si256((const __m256i *)(const void *)(s + i)));
    }
    y[r0] = (float)_mm256_extract_epi64(acc, 0);
    return true;
}

/* seconds per call with `threads` threads */
static double time_calls(qx_fn fn, const smoe_tensor *W, const smoe_qx *X, uint32_t n, float *y, int threads,
                         int calls) {
    work w[2];
    pthread_t tid;
    const uint32_t half = W->rows / 2 / 16 * 16;
    for (int i = 0; i < threads; i++)
        w[i] = (work){fn, W, X, n, threads == 1 ? 0 : i == 0 ? 0 : half, threads == 1 || i == 1 ? W->rows : half, y,
                      calls};
    const double t = smoe_now();
    if (threads == 2) pthread_create(&tid, NULL, work_main, &w[1]);
    work_main(&w[0]);
    if (threads == 2) pthread_join(tid, NULL);
    return (smoe_now() - t) / calls;
}

static smoe_tensor make_q(uint8_t format, uint32_t G, uint32_t rows, uint32_t cols, void **alloc) {
    smoe_tensor t;
    memset(&t, 0, sizeof t);
    t.format = format;
    t.scale_format = SMOE_SCALE_F16;
    t.rows = rows;
    t.cols = cols;
    t.group = G;
    const size_t codes = (size_t)rows * cols / (format == SMOE_FMT_Q4 ? 2 : 1), sb = (size_t)rows * (cols / G) * 2;
    t.scales_off = codes;
    t.biases_off = codes + sb;
    t.nbytes = codes + 2 * sb;
    uint8_t *b = aligned_alloc(64, (t.nbytes + 63) / 64 * 64);
    for (size_t i = 0; i < codes; i++) b[i] = (uint8_t)rnd();
    for (size_t i = 0; i < 2 * sb; i += 2) { /* f16 in ±2^-6..2^-2 */
        const uint16_t h = (uint16_t)((rnd() & 1) << 15 | (9 + rnd() % 5) << 10 | (rnd() & 1023));
        memcpy(b + codes + i, &h, 2);
    }
    t.data = b;
    *alloc = b;
    return t;
}

/* n tokens of random x prepared as codes for a fresh rows × cols matrix of format and group G */
typedef struct {
    smoe_tensor W;
    void *alloc, *codes;
    float *x, *d, *gs;
    smoe_qx X;
} qx_case;

static qx_case make_case(uint8_t format, uint32_t G, uint32_t rows, uint32_t cols, uint32_t n) {
    qx_case c;
    c.W = make_q(format, G, rows, cols, &c.alloc);
    const smoe_qx_size z = smoe_qx_sizes(cols, format, G);
    c.x = malloc(sizeof(float) * cols * n);
    for (size_t i = 0; i < (size_t)cols * n; i++) c.x[i] = (float)((int)(rnd() % 2001) - 1000) * 1e-3f;
    c.codes = aligned_alloc(64, (z.code_bytes * n + 63) / 64 * 64);
    c.d = malloc(sizeof(float) * z.d_floats * n);
    c.gs = malloc(sizeof(float) * z.gsum_floats * n);
    smoe_qx_prepare(c.x, cols, n, cols, format, G, c.codes, c.d, c.gs);
    c.X = (smoe_qx){c.codes, c.d, c.gs, cols, G, format, NULL};
    return c;
}

/* a and b on the case's n tokens, all rows, into ya and yb: whether they gave the same bits */
static bool same_bits(qx_fn a, qx_fn b, const qx_case *c, uint32_t n, float *ya, float *yb) {
    const uint32_t rows = c->W.rows;
    a(&c->W, c->W.data, &c->X, n, ya, rows, 0, rows);
    b(&c->W, c->W.data, &c->X, n, yb, rows, 0, rows);
    return memcmp(ya, yb, sizeof(float) * rows * n) == 0;
}

static void free_case(qx_case *c) {
    free(c->x);
    free(c->codes);
    free(c->d);
    free(c->gs);
    free(c->alloc);
}

/* ---------------------------------------------------------------- one token: every instance
 * `qx_isa mv q4|q8 [group [MiB]]`: the matrix-vector product (n = 1) of every instance this CPU
 * runs — plain AVX2, AVX-VNNI, AVX-512 F+BW, AVX512-VNNI — and the plain read, on three shapes:
 * 32768 × 2048 (an lm_head-like long matrix), 768 × 2048 (an a3b expert's gate or up) and
 * 2048 × 768 (its down). Each call takes the next of a pool of distinct matrices holding MiB in
 * all (default 1024, well past the last-level cache), as decode walks layers and experts, so the
 * weights come from DRAM. One or two threads, each its half of the rows (the pool's split);
 * each rep makes every contender sweep the pool once, in an order rotated rep by rep; figures are
 * medians of REPS reps, wall clock, as GB/s of weight bytes (codes + scales + biases).
 * SMOE_PROF_CPU=1: each rep timed by its threads' CPU time instead (the slower thread's), which
 * on a loaded machine says what the product costs when it runs, not how often it was scheduled. */
typedef struct {
    qx_fn fn;
    smoe_tensor *W;
    const smoe_qx *X;
    size_t nw;
    uint32_t r0, r1;
    float *y;
    double cpu; /* its thread's CPU seconds */
} mv_work;

static double thread_cpu(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void *mv_main(void *p) {
    mv_work *w = p;
    const double t = thread_cpu();
    for (size_t i = 0; i < w->nw; i++) w->fn(&w->W[i], w->W[i].data, w->X, 1, w->y, w->W[i].rows, w->r0, w->r1);
    w->cpu = thread_cpu() - t;
    return NULL;
}

static int mv_cpu; /* SMOE_PROF_CPU=1: time by the threads' CPU time (the slower thread's) */

static double mv_time(qx_fn fn, smoe_tensor *W, size_t nw, const smoe_qx *X, float *y, int threads) {
    mv_work w[2];
    pthread_t tid;
    const uint32_t rows = W[0].rows, half = rows / 2;
    for (int i = 0; i < threads; i++)
        w[i] = (mv_work){fn, W, X, nw, threads == 1 || i == 0 ? 0 : half, threads == 1 || i == 1 ? rows : half, y, 0};
    const double t = smoe_now();
    if (threads == 2) pthread_create(&tid, NULL, mv_main, &w[1]);
    mv_main(&w[0]);
    if (threads == 2) pthread_join(tid, NULL);
    const double wall = smoe_now() - t;
    if (!mv_cpu) return wall;
    return threads == 2 && w[1].cpu > w[0].cpu ? w[1].cpu : w[0].cpu;
}

typedef struct {
    const char *name;
    qx_fn fn;
} contender;

/* The product's instances this CPU runs, into c (6 at most): AVX2, AVX2 with AVX-VNNI, AVX-512 F+BW
 * (where `bw`, or where AVX512-VNNI is missing), AVX512-VNNI, and AMX (where `amx`). */
static int cpu_instances(contender *c, bool bw, bool amx) {
    int nc = 0;
    c[nc++] = (contender){"avx2", smoe_avx2_matmul_rows_qx_plain};
#if SMOE_HAVE_AVXVNNI
    if (smoe_avx2_qx_vnni()) c[nc++] = (contender){"avx-vnni", smoe_avx2_matmul_rows_qx_vnni};
#endif
#if SMOE_HAVE_AVX512
    const unsigned a512 = smoe_cpu_avx512_hw();
    if ((a512 & SMOE_CPU_AVX512) && (bw || !(a512 & SMOE_CPU_AVX512VNNI)))
        c[nc++] = (contender){"avx512", smoe_avx512_matmul_rows_qx_bw};
    if (a512 & SMOE_CPU_AVX512VNNI) c[nc++] = (contender){"avx512vnni", smoe_avx512_matmul_rows_qx_vnni};
#if SMOE_HAVE_AMX
    if (amx && smoe_cpu_amx()) c[nc++] = (contender){"amx", smoe_avx512_amx_matmul_rows_qx};
#endif
#endif
    (void)amx;
    return nc;
}

static int matvec_main(uint8_t format, uint32_t G, size_t mib) {
    const char *cpu = getenv("SMOE_PROF_CPU");
    mv_cpu = cpu && *cpu && strcmp(cpu, "0") != 0;
    contender c[7];
    int nc = cpu_instances(c, true, false);
    c[nc++] = (contender){"read only", read_only};
    printf("one token (n = 1), format %s, group %u, f16 scales, a pool of %zu MiB of distinct matrices; GB/s of weight "
           "bytes, median of %d reps (min-max), %s\n",
           format == SMOE_FMT_Q4 ? "q4" : "q8", G, mib, REPS, mv_cpu ? "thread CPU time" : "wall clock");
    static const uint32_t shapes[3][2] = {{32768, 2048}, {768, 2048}, {2048, 768}};
    for (int si = 0; si < 3; si++) {
        const uint32_t rows = shapes[si][0], cols = shapes[si][1];
        void *alloc0;
        smoe_tensor W0 = make_q(format, G, rows, cols, &alloc0);
        const size_t nw = mib * 1024 * 1024 / W0.nbytes + 1;
        smoe_tensor *W = malloc(sizeof *W * nw);
        void **allocs = malloc(sizeof *allocs * nw);
        W[0] = W0;
        allocs[0] = alloc0;
        for (size_t i = 1; i < nw; i++) W[i] = make_q(format, G, rows, cols, &allocs[i]);
        const smoe_qx_size z = smoe_qx_sizes(cols, format, G);
        float *x = malloc(sizeof(float) * cols);
        for (uint32_t i = 0; i < cols; i++) x[i] = (float)((int)(rnd() % 2001) - 1000) * 1e-3f;
        void *codes = aligned_alloc(64, (z.code_bytes + 63) / 64 * 64);
        float *d = malloc(sizeof(float) * z.d_floats), *gs = malloc(sizeof(float) * z.gsum_floats);
        smoe_qx_prepare(x, cols, 1, cols, format, G, codes, d, gs);
        const smoe_qx X = {codes, d, gs, cols, G, format, NULL};
        float *y0 = malloc(sizeof(float) * rows), *y = malloc(sizeof(float) * rows);
        c[0].fn(&W[0], W[0].data, &X, 1, y0, rows, 0, rows);
        for (int k = 1; k + 1 < nc; k++) {
            c[k].fn(&W[0], W[0].data, &X, 1, y, rows, 0, rows);
            if (memcmp(y0, y, sizeof(float) * rows) != 0) {
                printf("%s: its outputs differ from avx2's\n", c[k].name);
                return 1;
            }
        }
        const double bytes = (double)W0.nbytes * (double)nw;
        for (int threads = 1; threads <= 2; threads++) {
            double t[5][REPS];
            for (int r = 0; r < REPS; r++)
                for (int j = 0; j < nc; j++) {
                    const int k = (j + r) % nc;
                    t[k][r] = mv_time(c[k].fn, W, nw, &X, y, threads);
                }
            printf("%ux%u (%zu matrices), %d thread%s:", rows, cols, nw, threads, threads > 1 ? "s" : "");
            for (int k = 0; k < nc; k++) {
                qsort(t[k], REPS, sizeof(double), cmp_double);
                printf("  %s %.1f (%.1f-%.1f)", c[k].name, bytes / t[k][REPS / 2] * 1e-9, bytes / t[k][REPS - 1] * 1e-9,
                       bytes / t[k][0] * 1e-9);
            }
            printf("\n");
            fflush(stdout);
        }
        for (size_t i = 0; i < nw; i++) free(allocs[i]);
        free(W);
        free(allocs);
        free(x);
        free(codes);
        free(d);
        free(gs);
        free(y0);
        free(y);
    }
    return 0;
}

/* ---------------------------------------------------------------- batches: AVX512-VNNI against AMX
 * `qx_isa amx q4|q8 [group]`: n = 2 … 256 tokens on an a3b expert's gate (768 × 2048) and down
 * (2048 × 768) and on a q projection (4096 × 2048), the two instances alternated rep by rep
 * (medians of REPS, wall clock), their outputs compared bit for bit. */
static int amx_main(uint8_t format, uint32_t G) {
#if SMOE_HAVE_AMX
    if (!smoe_cpu_amx_hw() || !(smoe_cpu_avx512_hw() & SMOE_CPU_AVX512VNNI)) {
        printf("this CPU (or OS) lacks AMX-INT8 or AVX512-VNNI: nothing to compare\n");
        return 0;
    }
    const qx_fn fv = smoe_avx512_matmul_rows_qx_vnni, fa = smoe_avx512_amx_matmul_rows_qx;
    printf("format %s, group %u, f16 scales; avx512vnni against amx; median of %d reps, wall clock\n",
           format == SMOE_FMT_Q4 ? "q4" : "q8", G, REPS);
    printf("%-5s %-11s %-7s %12s %12s %8s\n", "n", "shape", "threads", "avx512vnni", "amx", "speedup");
    static const uint32_t shapes[][2] = {{768, 2048}, {2048, 768}, {4096, 2048}};
    static const uint32_t ns[] = {2, 4, 6, 8, 12, 16, 32, 64, 256};
    for (size_t sh = 0; sh < sizeof shapes / sizeof *shapes; sh++)
        for (size_t si = 0; si < sizeof ns / sizeof *ns; si++) {
            const uint32_t n = ns[si], rows = shapes[sh][0], cols = shapes[sh][1];
            qx_case c = make_case(format, G, rows, cols, n);
            const smoe_tensor W = c.W;
            const smoe_qx X = c.X;
            float *yv = malloc(sizeof(float) * rows * n), *ya = malloc(sizeof(float) * rows * n);
            if (!same_bits(fv, fa, &c, n, yv, ya)) {
                printf("n %u %ux%u: the two instances' outputs differ\n", n, rows, cols);
                return 1;
            }
            for (int threads = 1; threads <= 2; threads++) {
                const double probe = time_calls(fv, &W, &X, n, yv, threads, 1);
                int calls = (int)(0.02 / probe);
                if (calls < 1) calls = 1;
                double tv[REPS], ta[REPS];
                for (int r = 0; r < REPS; r++) {
                    if (r % 2 == 0) {
                        tv[r] = time_calls(fv, &W, &X, n, yv, threads, calls);
                        ta[r] = time_calls(fa, &W, &X, n, ya, threads, calls);
                    } else {
                        ta[r] = time_calls(fa, &W, &X, n, ya, threads, calls);
                        tv[r] = time_calls(fv, &W, &X, n, yv, threads, calls);
                    }
                }
                qsort(tv, REPS, sizeof *tv, cmp_double);
                qsort(ta, REPS, sizeof *ta, cmp_double);
                char shape[32];
                snprintf(shape, sizeof shape, "%ux%u", rows, cols);
                printf("%-5u %-11s %-7d %9.1f us %9.1f us %7.2fx\n", n, shape, threads, tv[REPS / 2] * 1e6,
                       ta[REPS / 2] * 1e6, tv[REPS / 2] / ta[REPS / 2]);
                fflush(stdout);
            }
            free_case(&c);
            free(yv);
            free(ya);
        }
    return 0;
#else
    (void)format;
    (void)G;
    printf("this build has no AMX kernel\n");
    return 0;
#endif
}

/* ------------------------------------------------------------- many threads on one product
 * `qx_isa scale [MAX]`: how a product's time falls as threads share its rows (1, 2, 4, … up to MAX,
 * default the CPU count), each thread a slice of rows at a multiple of 16 (the pool's split), for
 * the shapes of an a3b prefill: q8 4096 × 2048 (q), 256 tokens; q4 1536 × 2048 (an expert's gate
 * and up in one run) and 2048 × 768 (its down), 16 tokens. Beside them two probes of the machine
 * itself, every thread the same loop on registers alone: 512-bit FMAs (how many cores do vector
 * work at once: hyperthreads share one) and, where AMX runs, tile products (whether the threads
 * share AMX units). Per figure: the median of REPS reps, wall clock, and the speedup over 1 thread. */
typedef struct {
    work w;    /* the product's calls, as time_calls makes them */
    int probe; /* 0: the product; 1: FMA loop; 2: tile loop (w.calls iterations) */
    double sink;
} scale_work;

static __attribute__((target("avx512f"))) double fma_loop(int iters) {
    __m512 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm512_set1_ps(1.0f + i * 1e-3f);
    const __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
    for (int k = 0; k < iters; k++)
        for (int i = 0; i < 8; i++) a[i] = _mm512_fmadd_ps(a[i], m, c);
    __m512 s = a[0];
    for (int i = 1; i < 8; i++) s = _mm512_add_ps(s, a[i]);
    return _mm512_reduce_add_ps(s);
}

#if SMOE_HAVE_AMX
static __attribute__((target("amx-tile,amx-int8"))) double tile_loop(int iters) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.rows[i] = 16;
        cfg.colsb[i] = 64;
    }
    _Alignas(64) static const uint8_t src[16 * 64] = {1};
    _Alignas(64) int32_t out[16 * 16];
    _tile_loadconfig(&cfg);
    _tile_loadd(4, src, 64);
    _tile_loadd(5, src, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int k = 0; k < iters; k++) {
        _tile_dpbusd(0, 4, 5);
        _tile_dpbusd(1, 4, 5);
        _tile_dpbusd(2, 4, 5);
        _tile_dpbusd(3, 4, 5);
    }
    _tile_stored(0, out, 64);
    _tile_release();
    return out[0];
}
#endif

static void *scale_main_thread(void *p) {
    scale_work *w = p;
    if (w->probe == 1)
        w->sink = fma_loop(w->w.calls);
#if SMOE_HAVE_AMX
    else if (w->probe == 2)
        w->sink = tile_loop(w->w.calls);
#endif
    else
        work_main(&w->w);
    return NULL;
}

/* seconds per call (per `calls` iterations of a probe) with `threads` threads */
static double scale_time(qx_fn fn, const smoe_tensor *W, const smoe_qx *X, uint32_t n, float *y, int threads,
                         int calls, int probe) {
    scale_work w[256];
    pthread_t tid[256];
    const uint32_t rows = W ? W->rows : 0, per = (rows / 16 + (uint32_t)threads - 1) / (uint32_t)threads * 16;
    for (int i = 0; i < threads; i++) {
        uint32_t r0 = (uint32_t)i * per, r1 = r0 + per;
        if (r0 > rows) r0 = rows;
        if (r1 > rows || i == threads - 1) r1 = rows;
        w[i] = (scale_work){{fn, W, X, n, r0, r1, y, calls}, probe, 0};
    }
    const double t = smoe_now();
    for (int i = 1; i < threads; i++) pthread_create(&tid[i], NULL, scale_main_thread, &w[i]);
    scale_main_thread(&w[0]);
    for (int i = 1; i < threads; i++) pthread_join(tid[i], NULL);
    return (smoe_now() - t) / (probe ? 1 : calls);
}

static double scale_median(qx_fn fn, const smoe_tensor *W, const smoe_qx *X, uint32_t n, float *y, int threads,
                           int calls, int probe) {
    double t[REPS];
    for (int r = 0; r < REPS; r++) t[r] = scale_time(fn, W, X, n, y, threads, calls, probe);
    qsort(t, REPS, sizeof *t, cmp_double);
    return t[REPS / 2];
}

static void scale_row(const char *name, qx_fn fn, const smoe_tensor *W, const smoe_qx *X, uint32_t n, float *y,
                      int max_threads, int probe) {
    int calls = probe == 1 ? 2000000 : probe ? 200000 : 1;
    if (!probe) {
        const double one = scale_time(fn, W, X, n, y, 1, 1, 0);
        calls = (int)(0.03 / one);
        if (calls < 1) calls = 1;
    }
    double t1 = 0;
    printf("%-34s", name);
    for (int T = 1; T <= max_threads; T *= 2) {
        const double t = scale_median(fn, W, X, n, y, T, probe ? calls : calls * T, probe);
        if (T == 1) t1 = t;
        /* a probe: every thread the same work, so T × the 1-thread work in t */
        const double speed = probe ? T * t1 / t : t1 / t;
        printf(" %4d: %8.1f us %5.2fx", T, t * 1e6, speed);
        fflush(stdout);
        if (T * 2 > max_threads && T != max_threads) T = max_threads / 2;
    }
    printf("\n");
}

static int scale_main(int max_threads) {
#if SMOE_HAVE_AVX512
    const unsigned a512 = smoe_cpu_avx512_hw();
    if (!(a512 & SMOE_CPU_AVX512VNNI)) {
        printf("this CPU (or OS) lacks AVX512-VNNI: nothing to scale\n");
        return 0;
    }
    if (max_threads < 1 || max_threads > 256) max_threads = 1;
    printf("1 … %d threads; median of %d reps, wall clock; speedup over 1 thread\n", max_threads, REPS);
    scale_row("probe: 512-bit FMA loop", NULL, NULL, NULL, 0, NULL, max_threads, 1);
#if SMOE_HAVE_AMX
    const bool amx = smoe_cpu_amx();
    if (amx) scale_row("probe: tile product loop", NULL, NULL, NULL, 0, NULL, max_threads, 2);
#else
    const bool amx = false;
#endif
    static const struct {
        uint8_t format;
        uint32_t rows, cols, n;
        const char *name;
    } cases[] = {{SMOE_FMT_Q8, 4096, 2048, 256, "q8 4096x2048 n=256"},
                 {SMOE_FMT_Q4, 1536, 2048, 16, "q4 1536x2048 n=16"},
                 {SMOE_FMT_Q4, 2048, 768, 16, "q4 2048x768 n=16"}};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        qx_case c = make_case(cases[i].format, 64, cases[i].rows, cases[i].cols, cases[i].n);
        float *y = malloc(sizeof(float) * cases[i].rows * cases[i].n);
        char name[64];
        snprintf(name, sizeof name, "%s vnni", cases[i].name);
        scale_row(name, smoe_avx512_matmul_rows_qx_vnni, &c.W, &c.X, cases[i].n, y, max_threads, 0);
#if SMOE_HAVE_AMX
        if (amx) {
            snprintf(name, sizeof name, "%s amx", cases[i].name);
            scale_row(name, smoe_avx512_amx_matmul_rows_qx, &c.W, &c.X, cases[i].n, y, max_threads, 0);
        }
#endif
        free(y);
        free_case(&c);
    }
    /* The few-token experts of a short prompt: 64 experts' gates (49152 × 2048 q4, 56 MiB with
     * scales: from memory) at 1 and 2 tokens, beside the same bytes merely read — how close the
     * products come to the machine's memory bandwidth at each thread count. */
    {
        qx_case c = make_case(SMOE_FMT_Q4, 64, 49152, 2048, 2);
        float *y = malloc(sizeof(float) * 49152 * 2);
        printf("(64 experts' gates: %.1f MB each call)\n", c.W.nbytes / 1e6);
        scale_row("read only, 64 experts' gates", read_only, &c.W, &c.X, 1, y, max_threads, 0);
        scale_row("q4 64 experts n=1 vnni", smoe_avx512_matmul_rows_qx_vnni, &c.W, &c.X, 1, y, max_threads, 0);
        scale_row("q4 64 experts n=2 vnni", smoe_avx512_matmul_rows_qx_vnni, &c.W, &c.X, 2, y, max_threads, 0);
        scale_row("q4 64 experts n=1 avx2", smoe_avx2_matmul_rows_qx, &c.W, &c.X, 1, y, max_threads, 0);
        free(y);
        free_case(&c);
    }
#else
    (void)max_threads;
    printf("this build has no AVX-512 kernels\n");
#endif
    return 0;
}

/* One thread, each instance this CPU runs (AVX2 plain; AVX2 with AVX-VNNI, AVX-512 and AMX where
 * present) on the products of an a3b prefill: q8 4096 × 2048 (q, the dense projections) at 256, 45
 * and 16 tokens; q4 768 × 2048 (an expert's gate) at 16, 4 and 2. G multiply-adds a second (rows ×
 * cols × n over the median time of a call), so that a kernel can be set against the CPU's peak. */
static int rate_main(void) {
    contender is[6];
    const int ni = cpu_instances(is, false, true);
    static const struct {
        uint8_t format;
        uint32_t rows, cols, n;
    } cases[] = {{SMOE_FMT_Q8, 4096, 2048, 256}, {SMOE_FMT_Q8, 4096, 2048, 45}, {SMOE_FMT_Q8, 4096, 2048, 16},
                 {SMOE_FMT_Q4, 768, 2048, 16},   {SMOE_FMT_Q4, 768, 2048, 4},   {SMOE_FMT_Q4, 768, 2048, 2}};
    printf("one thread; G multiply-adds a second (median of %d reps, wall clock); group 64, f16 scales\n", REPS);
    printf("%-22s", "product");
    for (int i = 0; i < ni; i++) printf(" %14s", is[i].name);
    printf("\n");
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        qx_case c = make_case(cases[k].format, 64, cases[k].rows, cases[k].cols, cases[k].n);
        float *y = malloc(sizeof(float) * cases[k].rows * cases[k].n);
        char name[64];
        snprintf(name, sizeof name, "%s %ux%u n=%u", cases[k].format == SMOE_FMT_Q8 ? "q8" : "q4", cases[k].rows,
                 cases[k].cols, cases[k].n);
        printf("%-22s", name);
        for (int i = 0; i < ni; i++) {
            const double one = time_calls(is[i].fn, &c.W, &c.X, cases[k].n, y, 1, 1);
            int calls = (int)(0.02 / one);
            if (calls < 1) calls = 1;
            double t[REPS];
            for (int r = 0; r < REPS; r++) t[r] = time_calls(is[i].fn, &c.W, &c.X, cases[k].n, y, 1, calls);
            qsort(t, REPS, sizeof *t, cmp_double);
            printf(" %14.1f", (double)cases[k].rows * cases[k].cols * cases[k].n / t[REPS / 2] * 1e-9);
            fflush(stdout);
        }
        printf("\n");
        free(y);
        free_case(&c);
    }
    return 0;
}

/* ---------------------------------------------------------------- a few tokens from memory
 * `qx_isa few [THREADS]`: the AVX512-VNNI product at n = 1, 2, 3, 4, 6, 8 on weights that
 * stream from memory — 64 experts' gates (49152 × 2048 q4), their downs (131072 × 768 q4) and 16
 * layers' q8 query projections (32768 × 2048, 64 MiB) — at 1 and THREADS threads (each its share of
 * the rows), batched against row at a time (smoe_avx512_few_limits 1 and 8), alternated rep by
 * rep: GB/s of weight bytes (codes + scales + biases; medians of REPS) and the median of the reps'
 * ratios, row at a time over batched; beside them the same bytes merely read. The two paths'
 * outputs are compared bit for bit. */
static int few_main(int threads) {
#if SMOE_HAVE_AVX512
    if (!(smoe_cpu_avx512_hw() & SMOE_CPU_AVX512VNNI)) {
        printf("this CPU (or OS) lacks AVX512-VNNI: nothing to time\n");
        return 0;
    }
    if (threads < 1 || threads > 256) threads = 1;
    static const uint32_t ns[] = {1, 2, 3, 4, 6, 8};
    enum { NN = sizeof ns / sizeof *ns, NMAX = 8 };
    static const struct {
        uint8_t format;
        uint32_t rows, cols;
        const char *name;
    } cases[] = {{SMOE_FMT_Q4, 49152, 2048, "q4 gates 49152x2048"},
                 {SMOE_FMT_Q4, 131072, 768, "q4 downs 131072x768"},
                 {SMOE_FMT_Q8, 32768, 2048, "q8 32768x2048"}};
    printf("GB/s of weights (median of %d reps, alternated): batched, row at a time, ratio; 1 | %d threads\n", REPS,
           threads);
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        qx_case c = make_case(cases[i].format, 64, cases[i].rows, cases[i].cols, NMAX);
        const size_t ny = (size_t)cases[i].rows * NMAX;
        float *ya = malloc(sizeof(float) * ny), *yb = malloc(sizeof(float) * ny);
        const double gb = (double)c.W.nbytes * 1e-9;
        printf("%-22s read only", cases[i].name);
        for (int T = 1; T <= threads; T = T == threads ? threads + 1 : threads) {
            const double one = scale_time(read_only, &c.W, &c.X, 1, ya, 1, 1, 0);
            const int calls = one > 0.03 ? 1 : (int)(0.03 / one);
            printf(" %7.1f%16s", gb / scale_median(read_only, &c.W, &c.X, 1, ya, T, calls * T, 0), "");
        }
        printf("\n");
        for (int k = 0; k < NN; k++) {
            const uint32_t n = ns[k];
            printf("%-22s n=%-6u", cases[i].name, n);
            for (int T = 1; T <= threads; T = T == threads ? threads + 1 : threads) {
                smoe_avx512_few_limits(1, 1);
                const double one = scale_time(smoe_avx512_matmul_rows_qx_vnni, &c.W, &c.X, n, ya, 1, 1, 0);
                const int calls = (one > 0.03 ? 1 : (int)(0.03 / one)) * T;
                double ta[REPS], tb[REPS], r[REPS];
                for (int rep = 0; rep < REPS; rep++) {
                    smoe_avx512_few_limits(1, 1);
                    ta[rep] = scale_time(smoe_avx512_matmul_rows_qx_vnni, &c.W, &c.X, n, ya, T, calls, 0);
                    smoe_avx512_few_limits(NMAX, NMAX);
                    tb[rep] = scale_time(smoe_avx512_matmul_rows_qx_vnni, &c.W, &c.X, n, yb, T, calls, 0);
                    r[rep] = ta[rep] / tb[rep];
                }
                qsort(ta, REPS, sizeof *ta, cmp_double);
                qsort(tb, REPS, sizeof *tb, cmp_double);
                qsort(r, REPS, sizeof *r, cmp_double);
                printf(" %7.1f %7.1f %5.2fx", gb / ta[REPS / 2], gb / tb[REPS / 2], r[REPS / 2]);
                fflush(stdout);
            }
            smoe_avx512_few_limits(1, 1);
            smoe_avx512_matmul_rows_qx_vnni(&c.W, c.W.data, &c.X, n, ya, cases[i].rows, 0, cases[i].rows);
            smoe_avx512_few_limits(NMAX, NMAX);
            smoe_avx512_matmul_rows_qx_vnni(&c.W, c.W.data, &c.X, n, yb, cases[i].rows, 0, cases[i].rows);
            printf("  %s\n", memcmp(ya, yb, sizeof(float) * cases[i].rows * n) ? "BITS DIFFER" : "same bits");
        }
        free(ya);
        free(yb);
        free_case(&c);
    }
#else
    (void)threads;
    printf("this build has no AVX-512 kernels\n");
#endif
    return 0;
}

/* The machine's plain read rate from memory: one buffer of `mib` MiB (past every cache), written
 * once, then summed with 256-bit loads by T threads, each its own contiguous share, T = 1, 2, 4 …
 * max_threads (and max_threads itself); median of REPS reps, wall clock from the first thread's
 * start to the last one's end. What a product bound by reading its weights can reach at best: the
 * floor that a prefill of a few tokens, which reads each routed expert once, is measured against. */
typedef struct {
    const uint8_t *p;
    size_t len;
    uint64_t sink;
} read_share;

static void *read_share_main(void *arg) {
    read_share *r = arg;
    __m256i acc0 = _mm256_setzero_si256(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    for (size_t i = 0; i + 128 <= r->len; i += 128) {
        acc0 = _mm256_add_epi64(acc0, _mm256_load_si256((const __m256i *)(r->p + i)));
        acc1 = _mm256_add_epi64(acc1, _mm256_load_si256((const __m256i *)(r->p + i + 32)));
        acc2 = _mm256_add_epi64(acc2, _mm256_load_si256((const __m256i *)(r->p + i + 64)));
        acc3 = _mm256_add_epi64(acc3, _mm256_load_si256((const __m256i *)(r->p + i + 96)));
    }
    acc0 = _mm256_add_epi64(_mm256_add_epi64(acc0, acc1), _mm256_add_epi64(acc2, acc3));
    r->sink = (uint64_t)_mm256_extract_epi64(acc0, 0) + (uint64_t)_mm256_extract_epi64(acc0, 3);
    return NULL;
}

static double read_time(const uint8_t *buf, size_t len, int threads) {
    read_share sh[256];
    pthread_t tid[256];
    const size_t per = len / (size_t)threads / 4096 * 4096;
    for (int i = 0; i < threads; i++) sh[i] = (read_share){buf + (size_t)i * per, per, 0};
    const double t = smoe_now();
    for (int i = 1; i < threads; i++) pthread_create(&tid[i], NULL, read_share_main, &sh[i]);
    read_share_main(&sh[0]);
    for (int i = 1; i < threads; i++) pthread_join(tid[i], NULL);
    return (smoe_now() - t) / ((double)per * (double)threads);
}

static int read_main(int max_threads, size_t mib) {
    if (max_threads < 1 || max_threads > 256) max_threads = 1;
    const size_t len = mib << 20;
    uint8_t *buf = aligned_alloc(4096, len);
    if (!buf) {
        printf("cannot allocate %zu MiB\n", mib);
        return 1;
    }
    for (size_t i = 0; i < len; i++) buf[i] = (uint8_t)(i * 2654435761u >> 13);
    printf("plain read of %zu MiB from memory, 256-bit loads; median of %d reps, wall clock\n", mib, REPS);
    for (int T = 1; T <= max_threads; T = T * 2 > max_threads && T != max_threads ? max_threads : T * 2) {
        double t[REPS];
        for (int r = 0; r < REPS; r++) t[r] = read_time(buf, len, T);
        qsort(t, REPS, sizeof *t, cmp_double);
        printf("%3d threads: %6.1f GB/s (min–max %.1f–%.1f)\n", T, 1e-9 / t[REPS / 2], 1e-9 / t[REPS - 1],
               1e-9 / t[0]);
        fflush(stdout);
        if (T == max_threads) break;
    }
    free(buf);
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "read") == 0)
        return read_main(argc > 2 ? atoi(argv[2]) : (int)sysconf(_SC_NPROCESSORS_ONLN),
                         argc > 3 ? (size_t)atoi(argv[3]) : 2048);
    if (argc > 1 && strcmp(argv[1], "rate") == 0)
        return rate_main();
    if (argc > 1 && strcmp(argv[1], "few") == 0)
        return few_main(argc > 2 ? atoi(argv[2]) : (int)sysconf(_SC_NPROCESSORS_ONLN));
    if (argc > 1 && strcmp(argv[1], "amx") == 0)
        return amx_main(argc > 2 && strcmp(argv[2], "q8") == 0 ? SMOE_FMT_Q8 : SMOE_FMT_Q4,
                        argc > 3 ? (uint32_t)atoi(argv[3]) : 64);
    if (argc > 1 && strcmp(argv[1], "scale") == 0)
        return scale_main(argc > 2 ? atoi(argv[2]) : (int)sysconf(_SC_NPROCESSORS_ONLN));
    if (argc > 1 && strcmp(argv[1], "mv") == 0)
        return matvec_main(argc > 2 && strcmp(argv[2], "q8") == 0 ? SMOE_FMT_Q8 : SMOE_FMT_Q4,
                           argc > 3 ? (uint32_t)atoi(argv[3]) : 64, argc > 4 ? (size_t)atoi(argv[4]) : 1024);
    const uint8_t format = argc > 1 && strcmp(argv[1], "q8") == 0 ? SMOE_FMT_Q8 : SMOE_FMT_Q4;
    const uint32_t G = argc > 2 ? (uint32_t)atoi(argv[2]) : 64;
    const unsigned a512 = smoe_cpu_avx512_hw();
    if (!(a512 & SMOE_CPU_AVX512)) {
        printf("this CPU (or OS) has no AVX-512: nothing to compare\n");
        return 0;
    }
#if SMOE_HAVE_AVX512
    const qx_fn f512 = (a512 & SMOE_CPU_AVX512VNNI) ? smoe_avx512_matmul_rows_qx_vnni : smoe_avx512_matmul_rows_qx_bw;
    const char *n512 = (a512 & SMOE_CPU_AVX512VNNI) ? "avx512vnni" : "avx512";
    const qx_fn f2 = smoe_avx2_matmul_rows_qx; /* its own choice: AVX-VNNI where present */
    const char *n2 = smoe_avx2_qx_vnni() ? "avx2+avx-vnni" : "avx2";
    printf("format %s, group %u, f16 scales; contenders %s and %s; median of %d reps, wall clock\n",
           format == SMOE_FMT_Q4 ? "q4" : "q8", G, n2, n512, REPS);
    printf("%-6s %-14s %-7s %12s %12s %8s %12s\n", "n", "shape", "threads", n2, n512, "speedup", "read only");
    const uint32_t ns[] = {1, 2, 4, 8, 64};
    for (size_t si = 0; si < sizeof ns / sizeof ns[0]; si++) {
        const uint32_t n = ns[si], rows = n == 1 ? 32768 : 768, cols = 2048;
        qx_case c = make_case(format, G, rows, cols, n);
        const smoe_tensor W = c.W;
        const smoe_qx X = c.X;
        float *y2 = malloc(sizeof(float) * rows * n), *y5 = malloc(sizeof(float) * rows * n);
        if (!same_bits(f2, f512, &c, n, y2, y5)) {
            printf("n %u: the two instances' outputs differ\n", n);
            return 1;
        }
        for (int threads = 1; threads <= 2; threads++) {
            const double probe = time_calls(f2, &W, &X, n, y2, threads, 1);
            int calls = (int)(0.02 / probe);
            if (calls < 1) calls = 1;
            double t2[REPS], t5[REPS], tr[REPS];
            for (int r = 0; r < REPS; r++) {
                if (r % 2 == 0) {
                    t2[r] = time_calls(f2, &W, &X, n, y2, threads, calls);
                    t5[r] = time_calls(f512, &W, &X, n, y5, threads, calls);
                } else {
                    t5[r] = time_calls(f512, &W, &X, n, y5, threads, calls);
                    t2[r] = time_calls(f2, &W, &X, n, y2, threads, calls);
                }
                tr[r] = time_calls(read_only, &W, &X, n, y2, threads, calls);
            }
            qsort(t2, REPS, sizeof *t2, cmp_double);
            qsort(t5, REPS, sizeof *t5, cmp_double);
            qsort(tr, REPS, sizeof *tr, cmp_double);
            char shape[32];
            snprintf(shape, sizeof shape, "%ux%u", rows, cols);
            printf("%-6u %-14s %-7d %9.1f us %9.1f us %7.2fx %9.1f us\n", n, shape, threads, t2[REPS / 2] * 1e6,
                   t5[REPS / 2] * 1e6, t2[REPS / 2] / t5[REPS / 2], tr[REPS / 2] * 1e6);
        }
        free_case(&c);
        free(y2);
        free(y5);
    }
#endif
    return 0;
}
