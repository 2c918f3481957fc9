/* bench/kv_attend.c — the attention kernel (smoe_attend, dispatched: AVX2 on x86-64) over a KV
 * cache of each type, one thread, timed by its CPU time (the machine is shared): what a KV type
 * costs or saves in attention alone, without the rest of a decode step.
 *
 *   cc -O2 -std=c11 -ffp-contract=off -D_GNU_SOURCE -mavx2 -mfma -mf16c -Icsrc \
 *       bench/kv_attend.c csrc/cpu/kernels.c csrc/cpu/kernels_ref.c csrc/cpu/kernels_avx2.c csrc/cpu/kernels_avx512.c csrc/cpu/cpu.c csrc/util.c -lm \
 *       -o build/kv_attend
 *   build/kv_attend [positions [kv_heads [head_dim [query_heads_per_kv]]]]
 *
 * Per repeat: every query head of one token against `positions` rows of its KV head, the
 * layout of a session's cache (kv_heads · head_dim elements per position), the types alternating
 * run by run; the median of 15 repeats, as µs per token-layer and the KV bytes it read. Defaults:
 * mini's attention (4 KV heads of 64, 4 query heads each) at 1024 positions. */
#include "cpu/kernels_isa.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double cpu_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    const uint32_t npos = argc > 1 ? (uint32_t)atoi(argv[1]) : 1024, kvh = argc > 2 ? (uint32_t)atoi(argv[2]) : 4;
    const uint32_t hd = argc > 3 ? (uint32_t)atoi(argv[3]) : 64, group = argc > 4 ? (uint32_t)atoi(argv[4]) : 4;
    const size_t stride = (size_t)kvh * hd, n = stride * npos;
    enum { REPS = 15 };
    const int INNER = npos >= 20480 ? 1 : (int)(20480 / npos);
    const char *names[3] = {"f32", "bf16", "f16"};
    float *src = malloc(n * sizeof(float)), *q = malloc(hd * sizeof(float)), *out = malloc(hd * sizeof(float));
    float *scratch = malloc(npos * sizeof(float));
    void *k[3], *v[3];
    for (size_t i = 0; i < n; i++) src[i] = (float)((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
    for (uint32_t i = 0; i < hd; i++) q[i] = (float)i / (float)hd - 0.5f;
    for (uint32_t dt = 0; dt < 3; dt++) {
        k[dt] = malloc(n * smoe_kv_elem_bytes(dt));
        v[dt] = malloc(n * smoe_kv_elem_bytes(dt));
        smoe_kv_store(k[dt], src, n, dt);
        smoe_kv_store(v[dt], src, n, dt);
    }
    double t[3][REPS];
    volatile float sink = 0;
    for (int r = 0; r < REPS; r++)
        for (uint32_t j = 0; j < 3; j++) {
            const uint32_t dt = r % 2 ? 2 - j : j;
            const double t0 = cpu_s();
            for (int it = 0; it < INNER; it++)
                for (uint32_t h = 0; h < kvh * group; h++) {
                    const size_t off = (size_t)(h / group) * hd * smoe_kv_elem_bytes(dt);
                    smoe_attend(out, q, (const char *)k[dt] + off, (const char *)v[dt] + off, stride, npos, hd, dt,
                                scratch);
                    sink += out[0];
                }
            t[dt][r] = (cpu_s() - t0) / INNER;
        }
    printf("smoe_attend (%s), %u positions, %u KV heads x %u, %u query heads per KV head; median of %d\n",
           smoe_kernels_isa(), npos, kvh, hd, group, REPS);
    for (uint32_t dt = 0; dt < 3; dt++) {
        qsort(t[dt], REPS, sizeof(double), cmp);
        printf("%-5s %8.1f us per token-layer   KV read %6.2f MiB   %6.2f GB/s of KV\n", names[dt],
               1e6 * t[dt][REPS / 2], 2.0 * (double)n * (double)smoe_kv_elem_bytes(dt) / (1 << 20),
               2.0 * (double)n * (double)smoe_kv_elem_bytes(dt) / t[dt][REPS / 2] / 1e9);
    }
    return sink == 12345.0f; /* keeps the calls */
}
