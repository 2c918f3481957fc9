/* decode_profile.c — where a resident decode step and a short prefill spend their time.
 *
 * Built from the engine's sources with the per-stage timers compiled in (csrc/prof.h; the
 * library itself is built without them, where they cost nothing):
 *
 *   cc -std=c11 -O3 -g -ffp-contract=off -D_GNU_SOURCE -DSMOE_PROFILE=1 -mavx2 -mfma -mf16c -pthread \
 *      -Icsrc csrc/[a-z]*.c csrc/engine/*.c csrc/cpu/*.c bench/decode_profile.c -lm -o build/decode_profile
 *   build/decode_profile VAULT [THREADS=2] [PROMPT=45] [DECODE=32] [REPEATS=3] [CACHE_MIB=all]
 *
 * Warms the cache with every expert (a 256-token prefill, then more until a pass reads
 * nothing), then per repeat: reset, prefill PROMPT−1 tokens layer-major (timed per stage), decode
 * DECODE tokens (timed per stage). Prints the per-stage table of the median repeat of each (by
 * wall time) and the cache misses of the timed runs (0 means every expert was resident).
 * SMOE_PROF_CPU=1 in the environment: the stages in the caller's thread CPU time (meaningful with
 * THREADS=1 on a shared machine: what each stage costs, whatever else runs). SMOE_PART_ROWS=N: the
 * session's part_rows (smoe.h; 0 or unset: the engine's choice). */
#include "prof.h"
#include "smoe.h"

#if !SMOE_PROFILE
#error "build with -DSMOE_PROFILE=1 (the command above)"
#endif

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static int die(const char *what, smoe_status st) {
    fprintf(stderr, "%s: %s: %s\n", what, smoe_status_str(st), smoe_last_error());
    return 1;
}

typedef struct {
    double wall;
    double s[SMOE_P_COUNT];
    uint64_t n[SMOE_P_COUNT];
} profile;

static void prof_reset(void) {
    memset(smoe_prof_s, 0, sizeof smoe_prof_s);
    memset(smoe_prof_n, 0, sizeof smoe_prof_n);
}

static void prof_take(profile *p, double wall) {
    p->wall = wall;
    memcpy(p->s, smoe_prof_s, sizeof p->s);
    memcpy(p->n, smoe_prof_n, sizeof p->n);
}

static int by_wall(const void *a, const void *b) {
    double x = ((const profile *)a)->wall, y = ((const profile *)b)->wall;
    return (x > y) - (x < y);
}

static void print(const char *title, profile *runs, int repeats, uint32_t units, const char *unit) {
    qsort(runs, (size_t)repeats, sizeof *runs, by_wall);
    const profile *p = &runs[repeats / 2];
    double lapped = 0;
    for (int i = 0; i < SMOE_P_LAPPED; i++) lapped += p->s[i];
    printf("\n%s: median of %d by %s, %.3f s (%.2f ms per %s; walls:", title, repeats,
           smoe_prof_cpu ? "thread CPU time" : "wall", p->wall, 1e3 * p->wall / units, unit);
    for (int r = 0; r < repeats; r++) printf(" %.3f", runs[r].wall);
    printf(")\n| stage | ms per %s | share | calls per %s |\n|---|---|---|---|\n", unit, unit);
    for (int i = 0; i < SMOE_P_LAPPED; i++)
        if (p->n[i])
            printf("| %s | %.3f | %.1f%% | %.1f |\n", smoe_prof_names[i], 1e3 * p->s[i] / units,
                   100 * p->s[i] / lapped, (double)p->n[i] / units);
    printf("| (sum of stages) | %.3f | 100%% | |\n", 1e3 * lapped / units);
    printf("| %s | %.3f | %.1f%% | %.1f |\n", smoe_prof_names[SMOE_P_POOL_WAIT], 1e3 * p->s[SMOE_P_POOL_WAIT] / units,
           100 * p->s[SMOE_P_POOL_WAIT] / lapped, (double)p->n[SMOE_P_POOL_WAIT] / units);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s VAULT [THREADS] [PROMPT] [DECODE] [REPEATS] [CACHE_MIB]\n", argv[0]);
        return 2;
    }
    const uint32_t threads = argc > 2 ? (uint32_t)atoi(argv[2]) : 2;
    const uint32_t prompt = argc > 3 ? (uint32_t)atoi(argv[3]) : 45;
    const uint32_t decode = argc > 4 ? (uint32_t)atoi(argv[4]) : 32;
    const int repeats = argc > 5 ? atoi(argv[5]) : 3;
    const char *cpu = getenv("SMOE_PROF_CPU");
    smoe_prof_cpu = cpu && *cpu && strcmp(cpu, "0") != 0;
    smoe_vault *v = NULL;
    smoe_status st = smoe_open_vault(argv[1], &v);
    if (st != SMOE_OK) return die("open", st);
    smoe_config cfg = {.struct_size = sizeof cfg};
    smoe_vault_config(v, &cfg);
    smoe_session_params sp = smoe_session_default_params();
    sp.threads = threads;
    sp.context = 1024;
    const char *pr = getenv("SMOE_PART_ROWS");
    if (pr && *pr) sp.part_rows = (uint32_t)atoi(pr);
    char path[4096];
    snprintf(path, sizeof path, "%s/vault.bin", argv[1]);
    struct stat sb;
    /* default: the whole vault file, more than every expert blob */
    sp.cache_bytes = argc > 6 ? (uint64_t)atoll(argv[6]) << 20 : stat(path, &sb) == 0 ? (uint64_t)sb.st_size : 0;
    smoe_session *s = NULL;
    if ((st = smoe_session_new(v, &sp, &s)) != SMOE_OK) return die("session", st);
    smoe_counters c = {.struct_size = sizeof c};
    smoe_stats(s, &c);

    int32_t ids[1024];
    uint64_t seed = 12345;
    for (int i = 0; i < 1024; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = (int32_t)((seed >> 33) % cfg.vocab_size);
    }
    /* warm: prefills until one reads nothing */
    for (int pass = 0; pass < 8; pass++) {
        smoe_stats(s, &c);
        uint64_t before = c.blob_reads;
        smoe_session_reset(s);
        if ((st = smoe_prefill_chunk(s, ids + 37 * pass, 256, NULL, NULL)) != SMOE_OK) return die("warm", st);
        smoe_stats(s, &c);
        if (c.blob_reads == before && pass > 0) break;
    }
    smoe_stats(s, &c);
    printf("vault %s: layers %u, experts %u, threads %u, cache %.0f MiB in %u slots, %llu blobs read warming\n",
           argv[1], cfg.num_hidden_layers, cfg.num_experts, threads, c.cache_bytes / 1048576.0, c.cache_slots,
           (unsigned long long)c.blob_reads);
    smoe_stats_reset(s);

    profile *pre = calloc((size_t)repeats, sizeof *pre), *dec = calloc((size_t)repeats, sizeof *dec);
    for (int r = 0; r < repeats; r++) {
        smoe_session_reset(s);
        prof_reset();
        double t0 = smoe_prof_now();
        if (prompt > 1 && (st = smoe_prefill_chunk(s, ids, prompt - 1, NULL, NULL)) != SMOE_OK) return die("prefill", st);
        prof_take(&pre[r], smoe_prof_now() - t0);
        int32_t next = ids[prompt - 1];
        prof_reset();
        t0 = smoe_prof_now();
        for (uint32_t i = 0; i < decode; i++)
            if ((st = smoe_decode_step(s, next, NULL, &next)) != SMOE_OK) return die("decode", st);
        prof_take(&dec[r], smoe_prof_now() - t0);
    }
    smoe_stats(s, &c);
    printf("timed runs: cache misses %llu, hits %llu\n", (unsigned long long)c.cache_misses,
           (unsigned long long)c.cache_hits);
    if (prompt > 1) print("prefill (layer-major)", pre, repeats, prompt - 1, "token");
    print("decode", dec, repeats, decode, "token");
    smoe_session_free(s);
    smoe_close_vault(v);
    free(pre);
    free(dec);
    return 0;
}
