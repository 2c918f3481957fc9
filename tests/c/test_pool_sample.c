/* test_pool_sample.c — the worker pool (csrc/cpu/pool.c) and the sampler (csrc/engine/sample.c).
 *
 * Built and run by tests/test_c_units.py; exits non-zero if any check failed. Frequencies are
 * checked within 0.015 absolute over 20,000 draws (about 4.7 standard deviations at p = 0.3).
 */
#include "cpu/pool.h"
#include "engine/sample.h"

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>


#include "check.h"

/* ---------------------------------------------------------------------------------- pool */

enum { MAX_ITEMS = 5000, MAX_W = 8, MAX_CALLS = 64 };

typedef struct {
    _Atomic uint32_t hits[MAX_ITEMS];
    uint64_t partial[MAX_W]; /* per worker: Σ f(i) over its items */
    uint32_t calls[MAX_W];
    _Atomic uint32_t n_calls;
    uint32_t begin[MAX_CALLS], end[MAX_CALLS]; /* each call's range, in the order the calls began */
    _Atomic uint32_t bad_worker;
} pool_ctx;

static uint64_t f_item(uint32_t i) { return (uint64_t)i * i * 2654435761u % 1000003u; }

static void task(void *vctx, uint32_t begin, uint32_t end, uint32_t worker) {
    pool_ctx *c = vctx;
    if (worker >= MAX_W) {
        atomic_fetch_add(&c->bad_worker, 1);
        return;
    }
    c->calls[worker]++;
    const uint32_t k = atomic_fetch_add(&c->n_calls, 1);
    if (k < MAX_CALLS) {
        c->begin[k] = begin;
        c->end[k] = end;
    }
    for (uint32_t i = begin; i < end; i++) {
        atomic_fetch_add(&c->hits[i], 1);
        c->partial[worker] += f_item(i);
    }
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* One run checked: every item once, each call a chunk on grain boundaries, the chunks of one size
 * (the last one shorter), at most 4 a thread, the sum right. */
static void check_run(smoe_pool *pool, pool_ctx *c, uint32_t n, uint32_t grain) {
    memset(c, 0, sizeof *c);
    smoe_pool_run(pool, task, c, n, grain);
    const uint32_t threads = smoe_pool_threads(pool), g = grain ? grain : 1;
    CHECK(atomic_load(&c->bad_worker) == 0, "worker id out of range");
    uint64_t sum = 0, want = 0;
    for (uint32_t i = 0; i < n; i++) {
        want += f_item(i);
        CHECK(atomic_load(&c->hits[i]) == 1, "threads %u n %u grain %u: item %u ran %u times", threads, n, grain, i,
              atomic_load(&c->hits[i]));
    }
    for (uint32_t w = 0; w < MAX_W; w++) {
        sum += c->partial[w];
        CHECK(!c->calls[w] || w < threads, "worker %u of %u ran", w, threads);
    }
    const uint32_t calls = atomic_load(&c->n_calls);
    CHECK(n == 0 ? calls == 0 : calls >= 1 && calls <= 4 * threads, "threads %u n %u: %u calls", threads, n, calls);
    uint32_t chunk = 0;
    for (uint32_t k = 0; k < calls && k < MAX_CALLS; k++) {
        const uint32_t b = c->begin[k], e = c->end[k];
        CHECK(b < e, "empty range given to fn");
        CHECK(b % g == 0 && (e % g == 0 || e == n), "range [%u, %u) not on grain %u", b, e, g);
        if (e != n) {
            CHECK(chunk == 0 || e - b == chunk, "threads %u n %u: chunks of %u and %u items", threads, n, chunk, e - b);
            chunk = e - b;
        }
    }
    CHECK(n <= g || threads == 1 || calls > 1 || n <= chunk, "threads %u n %u grain %u: one call", threads, n, g);
    CHECK(sum == want, "threads %u n %u: sum %llu, want %llu", threads, n, (unsigned long long)sum,
          (unsigned long long)want);
}

/* A thread that stalls hands its chunks to the others: worker 1, given a chunk, holds it until the
 * caller has run every other chunk (5 s at most, then the check fails), which the caller can do
 * only if chunks are claimed, not dealt out in advance. */
typedef struct {
    _Atomic uint32_t by[MAX_W];
} stall_ctx;

static void stall_task(void *vctx, uint32_t begin, uint32_t end, uint32_t worker) {
    stall_ctx *c = vctx;
    (void)begin;
    (void)end;
    atomic_fetch_add(&c->by[worker < MAX_W ? worker : 0], 1);
    if (worker == 1)
        for (int ms = 0; ms < 5000 && atomic_load(&c->by[0]) < 7; ms++) sleep_ms(1);
}

static void test_pool_stall(void) {
    smoe_pool *pool = NULL;
    if (smoe_pool_new(2, &pool) != SMOE_OK) {
        CHECK(0, "pool_new: %s", smoe_last_error());
        return;
    }
    stall_ctx c;
    memset(&c, 0, sizeof c);
    smoe_pool_run(pool, stall_task, &c, 8, 1);
    const uint32_t w0 = atomic_load(&c.by[0]), w1 = atomic_load(&c.by[1]);
    CHECK(w0 + w1 == 8 && w1 <= 1, "chunks run: %u by the caller, %u by the stalled worker", w0, w1);
    smoe_pool_free(pool);
}

static int pool_runs = 10000; /* argv[1] lowers it for the sanitizer builds */

static void test_pool(void) {
    static pool_ctx ctx;
    smoe_pool *bad = (smoe_pool *)1;
    CHECK(smoe_pool_new(0, &bad) == SMOE_ERR_INVALID_ARG && bad == NULL, "threads = 0 accepted");
    smoe_pool_free(NULL);

    const uint32_t ns[] = {0, 1, 2, 3, 5, 63, 64, 65, 1000, 4999};
    const uint32_t grains[] = {0, 1, 3, 16, 64};
    for (uint32_t threads = 1; threads <= MAX_W; threads++) {
        if (threads > 4 && threads != MAX_W) continue;
        smoe_pool *pool = NULL;
        CHECK(smoe_pool_new(threads, &pool) == SMOE_OK && pool, "pool_new(%u): %s", threads, smoe_last_error());
        if (!pool) continue;
        CHECK(smoe_pool_threads(pool) == threads, "smoe_pool_threads");
        for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++)
            for (size_t gi = 0; gi < sizeof grains / sizeof *grains; gi++) check_run(pool, &ctx, ns[ni], grains[gi]);

        /* many consecutive runs, no hang, still right; then after sleeps (workers on the futex).
         * More threads than cores (8 here) is slow by nature: fewer runs there. */
        const int runs = threads <= 4 ? pool_runs : pool_runs / 10;
        for (int r = 0; r < runs && !failures; r++) check_run(pool, &ctx, 1 + (uint32_t)(r * 7919) % 300, 1 + r % 5);
        for (int r = 0; r < 3; r++) {
            sleep_ms(30);
            check_run(pool, &ctx, 100, 1);
        }
        smoe_pool_free(pool);
    }
    /* create and free repeatedly, including right after a run and with workers asleep */
    for (int r = 0; r < 50; r++) {
        smoe_pool *pool = NULL;
        if (smoe_pool_new(3, &pool) != SMOE_OK) {
            CHECK(0, "pool_new: %s", smoe_last_error());
            break;
        }
        if (r % 2) check_run(pool, &ctx, 10, 1);
        if (r % 10 == 0) sleep_ms(10);
        smoe_pool_free(pool);
    }
}

/* ------------------------------------------------------------------------------- sampler */

static smoe_sampler_params params(float temperature, uint32_t top_k, float top_p, float min_p, uint64_t seed) {
    smoe_sampler_params p;
    memset(&p, 0, sizeof p);
    p.struct_size = sizeof p;
    p.temperature = temperature;
    p.top_k = top_k;
    p.top_p = top_p;
    p.min_p = min_p;
    p.repetition_penalty = 1.0f;
    p.repetition_window = 64;
    p.seed = seed;
    return p;
}

static uint64_t rng_state = 99;

static double rnd01(void) {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (double)((z ^ (z >> 31)) >> 11) * 0x1p-53;
}

static int32_t sample1(const smoe_sampler_params *p, const float *logits, uint32_t vocab, const int32_t *hist,
                       uint32_t nh) {
    static float scratch[200000];
    static int32_t sidx[200000];
    smoe_sampler s = {0};
    smoe_sampler_init(&s, p);
    return smoe_sample(&s, logits, vocab, hist, nh, scratch, sidx);
}

/* draws `draws` ids and compares their frequencies with want[vocab] */
static void check_freq(const char *what, const smoe_sampler_params *p, const float *logits, uint32_t vocab,
                       const double *want) {
    enum { DRAWS = 20000 };
    static float scratch[64];
    static int32_t sidx[64];
    uint32_t count[64] = {0};
    smoe_sampler s = {0};
    smoe_sampler_init(&s, p);
    for (int d = 0; d < DRAWS; d++) {
        int32_t id = smoe_sample(&s, logits, vocab, NULL, 0, scratch, sidx);
        CHECK(id >= 0 && (uint32_t)id < vocab, "%s: id %d", what, id);
        if (id >= 0 && (uint32_t)id < vocab) count[id]++;
    }
    for (uint32_t i = 0; i < vocab; i++) {
        double f = (double)count[i] / DRAWS;
        CHECK(fabs(f - want[i]) <= 0.015, "%s: id %u drawn %.4f of the time, expected %.4f", what, i, f, want[i]);
        if (want[i] == 0) CHECK(count[i] == 0, "%s: id %u excluded but drawn %u times", what, i, count[i]);
    }
}

static void test_sampler(void) {
    /* greedy: argmax, lowest id on ties; no randomness */
    const float tie[6] = {0.5f, 2.0f, -1.0f, 2.0f, 1.0f, 2.0f};
    smoe_sampler_params g = params(0.0f, 0, 1.0f, 0.0f, 1);
    CHECK(sample1(&g, tie, 6, NULL, 0) == 1, "greedy tie → lowest id");
    const float nan_first[3] = {NAN, 1.0f, 0.5f};
    CHECK(sample1(&g, nan_first, 3, NULL, 0) == 1, "greedy skips NaN");
    /* greedy against a plain scan for the first maximum (NaN as −inf, −0 == +0), over lengths
       that end inside, at and past the argmax's blocks of 64 (KEY_BLOCK), with ties, zeros of both signs,
       infinities and NaN drawn often */
    for (int t = 0; t < 3000; t++) {
        static float v[300];
        const uint32_t n = 1 + (uint32_t)(rnd01() * 299);
        for (uint32_t i = 0; i < n; i++) {
            const int r = (int)(rnd01() * 8);
            v[i] = r == 0 ? -INFINITY : r == 1 ? 0.0f : r == 2 ? -0.0f : r == 3 ? NAN
                 : r == 4 && t % 7 == 0 ? INFINITY : (float)(int)(rnd01() * 5) - 2.0f;
        }
        uint32_t want = 0;
        for (uint32_t i = 1; i < n; i++) {
            const float b = v[want] != v[want] ? -INFINITY : v[want], x = v[i] != v[i] ? -INFINITY : v[i];
            if (x > b) want = i;
        }
        const int32_t got = sample1(&g, v, n, NULL, 0);
        CHECK(got == (int32_t)want, "greedy over %u values: id %d, the first maximum is %u", n, got, want);
    }

    /* repetition penalty: each distinct id once, over the window only */
    const float rep[3] = {3.0f, 1.5f, -1.0f};
    smoe_sampler_params pr = g;
    pr.repetition_penalty = 1.5f;
    const int32_t h00[2] = {0, 0};
    CHECK(sample1(&pr, rep, 3, h00, 2) == 0, "penalty applied twice to a repeated id (3/1.5 = 2 > 1.5)");
    pr.repetition_penalty = 2.5f;
    CHECK(sample1(&pr, rep, 3, h00, 2) == 1, "penalty not applied (3/2.5 = 1.2 < 1.5)");
    const int32_t h_old[3] = {0, 1, 1};
    pr.repetition_window = 2;
    CHECK(sample1(&pr, rep, 3, h_old, 3) == 0, "penalty reached outside its window");
    const float neg[2] = {-1.0f, -1.2f};
    const int32_t h0[1] = {0};
    pr.repetition_penalty = 1.5f; /* negative logits are multiplied: −1.5 < −1.2 */
    CHECK(sample1(&pr, neg, 2, h0, 1) == 1, "penalty on a negative logit");

    /* determinism; different seeds differ */
    enum { V = 1000 };
    static float logits[V];
    for (int i = 0; i < V; i++) logits[i] = (float)(3.0 * (rnd01() - 0.5));
    static float scratch[V];
    static int32_t sidx[V];
    int32_t a[200], b[200], c[200];
    smoe_sampler_params pt = params(1.0f, 0, 1.0f, 0.0f, 42);
    smoe_sampler sa = {0}, sb = {0}, sc = {0};
    smoe_sampler_init(&sa, &pt);
    smoe_sampler_init(&sb, &pt);
    pt.seed = 43;
    smoe_sampler_init(&sc, &pt);
    for (int i = 0; i < 200; i++) {
        a[i] = smoe_sample(&sa, logits, V, NULL, 0, scratch, sidx);
        b[i] = smoe_sample(&sb, logits, V, NULL, 0, scratch, sidx);
        c[i] = smoe_sample(&sc, logits, V, NULL, 0, scratch, sidx);
    }
    CHECK(memcmp(a, b, sizeof a) == 0, "same seed, different ids");
    CHECK(memcmp(a, c, sizeof a) != 0, "seeds 42 and 43 gave the same 200 ids");

    /* top-k = 1 and a tiny top-p are greedy, whatever the temperature and seed */
    const int32_t best = sample1(&g, logits, V, NULL, 0);
    for (uint64_t seed = 0; seed < 50; seed++) {
        smoe_sampler_params k1 = params(1.5f, 1, 1.0f, 0.0f, seed), p0 = params(0.8f, 0, 1e-6f, 0.0f, seed);
        smoe_sampler_params m1 = params(1.0f, 0, 1.0f, 1.0f, seed);
        CHECK(sample1(&k1, logits, V, NULL, 0) == best, "top_k=1 is not greedy (seed %llu)", (unsigned long long)seed);
        CHECK(sample1(&p0, logits, V, NULL, 0) == best, "top_p→0 is not greedy (seed %llu)", (unsigned long long)seed);
        CHECK(sample1(&m1, logits, V, NULL, 0) == best, "min_p=1 is not greedy (seed %llu)", (unsigned long long)seed);
    }
    /* with ties at the top, top_k = 1 keeps the lowest id */
    smoe_sampler_params k1 = params(1.0f, 1, 1.0f, 0.0f, 5);
    CHECK(sample1(&k1, tie, 6, NULL, 0) == 1, "top_k=1 tie → lowest id");

    /* distributions at temperature 1 (and 2), against softmax */
    const float lg[6] = {1.0f, 2.0f, 0.5f, -1.0f, 1.5f, 0.0f};
    double e[6], z = 0;
    for (int i = 0; i < 6; i++) z += e[i] = exp(lg[i]);
    double want[6];
    for (int i = 0; i < 6; i++) want[i] = e[i] / z;
    smoe_sampler_params d = params(1.0f, 0, 1.0f, 0.0f, 7);
    check_freq("t=1", &d, lg, 6, want);

    double z2 = 0;
    for (int i = 0; i < 6; i++) z2 += exp(lg[i] / 2.0);
    for (int i = 0; i < 6; i++) want[i] = exp(lg[i] / 2.0) / z2;
    d = params(2.0f, 0, 1.0f, 0.0f, 8);
    check_freq("t=2", &d, lg, 6, want);

    /* top-k 3: ids 1, 4, 0 renormalised */
    double z3 = e[1] + e[4] + e[0];
    for (int i = 0; i < 6; i++) want[i] = (i == 1 || i == 4 || i == 0) ? e[i] / z3 : 0;
    d = params(1.0f, 3, 1.0f, 0.0f, 9);
    check_freq("top_k=3", &d, lg, 6, want);

    /* top-p: probabilities sorted 1, 4, 0, 2, 5, 3; keep the shortest prefix with mass ≥ 0.7 */
    {
        const int order[6] = {1, 4, 0, 2, 5, 3};
        double cum = 0, kept = 0;
        int keep = 0;
        while (cum < 0.7) cum += e[order[keep++]] / z;
        for (int j = 0; j < keep; j++) kept += e[order[j]];
        for (int i = 0; i < 6; i++) want[i] = 0;
        for (int j = 0; j < keep; j++) want[order[j]] = e[order[j]] / kept;
        d = params(1.0f, 0, 0.7f, 0.0f, 10);
        check_freq("top_p=0.7", &d, lg, 6, want);
        d = params(1.0f, 5, 0.7f, 0.0f, 11); /* with top-k 5 the renormalised masses move; recompute */
        double z5 = 0;
        for (int j = 0; j < 5; j++) z5 += e[order[j]];
        cum = 0;
        keep = 0;
        while (cum < 0.7) cum += e[order[keep++]] / z5;
        kept = 0;
        for (int j = 0; j < keep; j++) kept += e[order[j]];
        for (int i = 0; i < 6; i++) want[i] = 0;
        for (int j = 0; j < keep; j++) want[order[j]] = e[order[j]] / kept;
        check_freq("top_k=5 top_p=0.7", &d, lg, 6, want);
    }

    /* min-p 0.3: keep p ≥ 0.3·p_max, i.e. logit ≥ 2 + ln 0.3 ≈ 0.796: ids 0, 1, 4 */
    for (int i = 0; i < 6; i++) want[i] = (lg[i] >= 2.0f + logf(0.3f)) ? e[i] / z3 : 0;
    d = params(1.0f, 0, 1.0f, 0.3f, 12);
    check_freq("min_p=0.3", &d, lg, 6, want);

    /* a Qwen-sized vocabulary with top-p and no top-k: every id drawn lies in the nucleus, and
     * the nucleus's head is drawn about as often as it should be */
    {
        enum { BIG = 151936 };
        static float big[BIG];
        static int32_t order[BIG];
        for (int i = 0; i < BIG; i++) big[i] = (float)(8.0 * (rnd01() + rnd01() + rnd01() - 1.5));
        double m = -INFINITY, zb = 0;
        for (int i = 0; i < BIG; i++) m = big[i] > m ? big[i] : m;
        for (int i = 0; i < BIG; i++) zb += exp(big[i] - m);
        /* the nucleus by a plain selection: repeatedly take the best remaining */
        static unsigned char in_nucleus[BIG];
        double cum = 0;
        int keep = 0;
        while (cum < 0.5) {
            int bi = -1;
            for (int i = 0; i < BIG; i++)
                if (!in_nucleus[i] && (bi < 0 || big[i] > big[bi])) bi = i;
            in_nucleus[bi] = 1;
            order[keep++] = bi;
            cum += exp(big[bi] - m) / zb;
        }
        smoe_sampler_params bp = params(1.0f, 0, 0.5f, 0.0f, 13);
        smoe_sampler s = {0};
        smoe_sampler_init(&s, &bp);
        static float bscratch[BIG];
        static int32_t bidx[BIG];
        int outside = 0, top = 0;
        const int DRAWS = 500;
        for (int d2 = 0; d2 < DRAWS; d2++) {
            int32_t id = smoe_sample(&s, big, BIG, NULL, 0, bscratch, bidx);
            if (id < 0 || id >= BIG || !in_nucleus[id]) outside++;
            else if (id == order[0]) top++;
        }
        CHECK(outside == 0, "vocab %d top_p 0.5: %d of %d draws outside the nucleus of %d", BIG, outside, DRAWS, keep);
        double p_top = exp(big[order[0]] - m) / zb / cum;
        CHECK(fabs((double)top / DRAWS - p_top) < 0.07, "vocab %d: best id drawn %.3f, expected %.3f", BIG,
              (double)top / DRAWS, p_top);
        fprintf(stderr, "info: nucleus of %d ids at top_p 0.5 over %d\n", keep, BIG);

        /* greedy and top-k on the big vocabulary agree with a plain argmax */
        smoe_sampler_params gk = params(0.7f, 1, 1.0f, 0.0f, 3);
        CHECK(sample1(&gk, big, BIG, NULL, 0) == order[0], "big vocab top_k=1");
        CHECK(sample1(&g, big, BIG, NULL, 0) == order[0], "big vocab greedy");
    }
}

/* the mask (smoe_session_set_mask's): forbidden ids never drawn, greedy the best allowed one */
static void test_mask(void) {
    static float scratch[70];
    static int32_t sidx[70];
    uint32_t mask[3] = {0};
    float logits[70];
    for (int i = 0; i < 70; i++) logits[i] = (float)(i % 7); /* best: 6, 13, 20, ... */
    const uint32_t allowed[3] = {3, 33, 69};                 /* logits 3, 5, 6 */
    for (int i = 0; i < 3; i++) mask[allowed[i] / 32] |= 1u << (allowed[i] % 32);
    smoe_sampler s = {0};
    smoe_sampler_params g = params(0.0f, 0, 1.0f, 0.0f, 1);
    smoe_sampler_init(&s, &g);
    s.mask = mask;
    s.masked = true;
    CHECK(smoe_sample(&s, logits, 70, NULL, 0, scratch, sidx) == 69, "masked greedy → the best allowed id");
    smoe_sampler_params t = params(1.0f, 0, 0.9f, 0.0f, 7);
    smoe_sampler_init(&s, &t);
    CHECK(!s.masked, "smoe_sampler_init lifts the mask");
    s.masked = true;
    for (int d = 0; d < 2000; d++) {
        int32_t id = smoe_sample(&s, logits, 70, NULL, 0, scratch, sidx);
        CHECK(id == 3 || id == 33 || id == 69, "masked draw %d gave forbidden id %d", d, id);
    }
    float none[70];
    for (int i = 0; i < 70; i++) none[i] = i == 5 ? 1.0f : -INFINITY; /* only a forbidden id is finite */
    CHECK(smoe_sample(&s, none, 70, NULL, 0, scratch, sidx) == 3, "every allowed logit −inf → the lowest allowed id");
}

int main(int argc, char **argv) {
    if (argc > 1) pool_runs = atoi(argv[1]);
    double t0 = smoe_now();
    test_pool();
    test_pool_stall();
    double t1 = smoe_now();
    test_sampler();
    test_mask();
    fprintf(stderr, "info: pool %.2f s, sampler %.2f s\n", t1 - t0, smoe_now() - t1);
    if (failures) {
        fprintf(stderr, "test_pool_sample: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_pool_sample: ok\n");
    return 0;
}
