/* test_streamer.c — the streamer against files of known blobs. Driven by tests/test_streamer.py:
 *
 *   test_streamer TEST WORKDIR [SHMDIR [SEED]]
 *
 * TEST is one of the names in the table at the bottom, or "all". WORKDIR is where test files
 * go (on a filesystem with O_DIRECT: ext4, xfs...); SHMDIR, if given, a tmpfs. Prints what
 * failed and exits 1 at the first failure; exits 0 when every check passes.
 *
 * A test file has a 16 KiB "header" page, then one blob per (layer, expert) of a sparse layer,
 * in a shuffled order, each filled with a pattern derived from (layer, expert) so that any
 * mix-up of offsets, slots or bytes shows. Dense layers have offset 0 (no blob). */
#include "streamer.h"

#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: %s: CHECK(%s) failed: ", __FILE__, __LINE__, current, #cond);  \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static const char *current = "";
static const char *workdir, *shmdir;

/* ------------------------------------------------------------------------------- fixtures */

static uint64_t splitmix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static void fill_blob(uint8_t *buf, uint64_t bytes, uint32_t l, uint32_t e) {
    uint64_t seed = splitmix(((uint64_t)l << 32) | e);
    for (uint64_t i = 0; i < bytes / 8; i++) {
        uint64_t w = splitmix(seed + i);
        memcpy(buf + 8 * i, &w, 8);
    }
}

typedef struct {
    char path[512];
    uint32_t L, E;
    uint64_t blob_bytes;
    uint64_t *off; /* (L × E) */
    uint32_t *crc; /* (L × E) */
    uint8_t *expect; /* scratch, blob_bytes */
    int fd;          /* the file, open read-only as a vault holds it */
} vfile;

static uint64_t rng_state = 12345;
static uint64_t rnd(void) { return splitmix(rng_state++); }
static uint32_t rndn(uint32_t n) { return (uint32_t)(rnd() % n); }

static bool is_sparse(uint32_t dense_mask, uint32_t l) { return !(dense_mask >> l & 1u); }

static bool key_order; /* make_file lays blobs out in key order, as the vault writer does */

/* Writes dir/name with L × E blobs; layers in dense_mask get none. */
static void make_file(vfile *f, const char *dir, const char *name, uint32_t L, uint32_t E, uint64_t blob_bytes,
                      uint32_t dense_mask) {
    snprintf(f->path, sizeof f->path, "%s/%s", dir, name);
    f->L = L;
    f->E = E;
    f->blob_bytes = blob_bytes;
    f->off = calloc((size_t)L * E, sizeof *f->off);
    f->crc = calloc((size_t)L * E, sizeof *f->crc);
    f->expect = malloc(blob_bytes);
    uint32_t n = 0, *order = malloc(sizeof *order * L * E);
    for (uint32_t k = 0; k < L * E; k++)
        if (is_sparse(dense_mask, k / E)) order[n++] = k;
    for (uint32_t i = key_order ? 0 : n; i > 1; i--) { /* Fisher–Yates: file order unrelated to key order */
        uint32_t j = rndn(i), t = order[i - 1];
        order[i - 1] = order[j];
        order[j] = t;
    }
    int fd = open(f->path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0, "cannot create %s", f->path);
    uint8_t *page = calloc(1, SMOE_PAGE);
    memcpy(page, "TESTHDR", 7);
    CHECK(pwrite(fd, page, SMOE_PAGE, 0) == SMOE_PAGE, "write header");
    for (uint32_t i = 0; i < n; i++) {
        uint32_t k = order[i];
        uint64_t off = SMOE_PAGE + (uint64_t)i * blob_bytes;
        fill_blob(f->expect, blob_bytes, k / E, k % E);
        CHECK(pwrite(fd, f->expect, blob_bytes, (off_t)off) == (ssize_t)blob_bytes, "write blob");
        f->off[k] = off;
        f->crc[k] = smoe_checksum(f->expect, blob_bytes);
    }
    close(fd);
    f->fd = open(f->path, O_RDONLY | O_CLOEXEC);
    CHECK(f->fd >= 0, "cannot open %s", f->path);
    free(page);
    free(order);
}

static void free_file(vfile *f) {
    close(f->fd);
    unlink(f->path);
    free(f->off);
    free(f->crc);
    free(f->expect);
}

static smoe_streamer_params params(const vfile *f, uint32_t n_sparse, uint32_t n_slots, uint32_t io_threads,
                                   bool direct) {
    smoe_streamer_params p = {0};
    p.path = f->path;
    p.fd = f->fd;
    p.blob_bytes = f->blob_bytes;
    p.blob_offset = f->off;
    p.blob_crc = f->crc;
    p.n_layers = f->L;
    p.n_experts = f->E;
    p.n_sparse_layers = n_sparse;
    p.n_slots = n_slots;
    p.io_threads = io_threads;
    p.direct_io = direct;
    p.retention = SMOE_RETAIN_LRU; /* what the model below does unless model_set_lrfu */
    return p;
}

static smoe_streamer *open_streamer(const smoe_streamer_params *p) {
    smoe_streamer *s = NULL;
    smoe_status st = smoe_streamer_new(p, &s);
    CHECK(st == SMOE_OK && s, "smoe_streamer_new: %d %s", st, smoe_last_error());
    return s;
}

static bool blob_ok(vfile *f, const uint8_t *data, uint32_t l, uint32_t e) {
    fill_blob(f->expect, f->blob_bytes, l, e);
    return memcmp(data, f->expect, f->blob_bytes) == 0;
}

/* Acquire (must not be −1), wait (must succeed), check bytes, release. Returns the slot. */
static int use(smoe_streamer *s, vfile *f, uint32_t l, uint32_t e) {
    int slot = smoe_streamer_acquire(s, l, e);
    CHECK(slot >= 0, "acquire(%u,%u) = %d", l, e, slot);
    smoe_status st = smoe_streamer_wait(s, slot);
    CHECK(st == SMOE_OK, "wait(%u,%u): %d %s", l, e, st, smoe_last_error());
    CHECK(smoe_streamer_ready(s, slot), "ready after wait");
    CHECK(blob_ok(f, smoe_streamer_data(s, slot), l, e), "bytes of (%u,%u) wrong", l, e);
    smoe_streamer_release(s, slot);
    return slot;
}

static smoe_streamer_stats stats(smoe_streamer *s) {
    smoe_streamer_stats x;
    smoe_streamer_get_stats(s, &x);
    return x;
}

static int warnings;
static void on_log(int level, const char *msg, void *user) {
    (void)msg;
    (void)user;
    if (level >= SMOE_LOG_WARN) warnings++;
}

/* --------------------------------------------------------------- a model of the policy */

/* What the streamer should do for acquire/release when every read is waited for before its
 * slot is released (so an unpinned slot is never loading). global_lru drops the quota. */
typedef struct {
    uint32_t n_slots, E, quota;
    bool global_lru;
    int32_t key[256];
    uint32_t pins[256];
    uint64_t stamp[256], clock;
    uint32_t count[64];
    uint64_t layer_use[64];
    uint64_t hits, misses;
    /* LRFU (retention.c): decayed uses per key on each layer's visit clock */
    bool lrfu;
    double decay;
    uint32_t last_layer, visit[64], seen[64 * 64];
    double score[64 * 64];
} model;

static void model_init(model *m, uint32_t n_slots, uint32_t E, uint32_t n_sparse, bool global_lru) {
    memset(m, 0, sizeof *m);
    m->n_slots = n_slots;
    m->E = E;
    m->quota = n_sparse ? n_slots / n_sparse : 0;
    m->global_lru = global_lru;
    for (uint32_t i = 0; i < n_slots; i++) m->key[i] = -1;
    m->last_layer = UINT32_MAX;
}

static void model_set_lrfu(model *m, double half_life) {
    m->lrfu = true;
    m->decay = pow(2.0, -1.0 / half_life);
}

static double model_score(const model *m, int32_t key) {
    return m->score[key] * pow(m->decay, (double)(m->visit[(uint32_t)key / m->E] - m->seen[key]));
}

/* Victim order, best first: most over quota; another layer before the requesting one; the
 * layer used most recently; the slot used least recently. As sort keys, compared in turn. */
static bool model_better(const model *m, uint32_t l, uint32_t i, uint32_t j) {
    uint32_t li = (uint32_t)m->key[i] / m->E, lj = (uint32_t)m->key[j] / m->E;
    if (!m->global_lru) {
        int64_t xi = (int64_t)m->count[li] - m->quota, xj = (int64_t)m->count[lj] - m->quota;
        if (xi != xj) return xi > xj;
        if ((li != l) != (lj != l)) return li != l;
        if (m->layer_use[li] != m->layer_use[lj]) return m->layer_use[li] > m->layer_use[lj];
        if (m->lrfu) {
            double si = model_score(m, m->key[i]), sj = model_score(m, m->key[j]);
            if (si != sj) return si < sj;
        }
    }
    return m->stamp[i] < m->stamp[j];
}

static int model_acquire(model *m, uint32_t l, uint32_t e) {
    int32_t key = (int32_t)(l * m->E + e);
    if (m->lrfu) {
        if (l != m->last_layer) {
            m->visit[l]++;
            m->last_layer = l;
        }
        m->score[key] = model_score(m, key) + 1.0;
        m->seen[key] = m->visit[l];
    }
    for (uint32_t i = 0; i < m->n_slots; i++)
        if (m->key[i] == key) {
            m->pins[i]++;
            m->stamp[i] = m->layer_use[l] = ++m->clock;
            m->hits++;
            return (int)i;
        }
    int best = -1;
    for (uint32_t i = 0; i < m->n_slots; i++) {
        if (m->pins[i]) continue;
        if (m->key[i] < 0) {
            best = (int)i;
            break;
        }
        if (best < 0 || model_better(m, l, i, (uint32_t)best)) best = (int)i;
    }
    if (best < 0) return -1;
    if (m->key[best] >= 0) m->count[(uint32_t)m->key[best] / m->E]--;
    m->key[best] = key;
    m->count[l]++;
    m->pins[best] = 1;
    m->stamp[best] = m->layer_use[l] = ++m->clock;
    m->misses++;
    return best;
}

static void model_release(model *m, int slot) { m->pins[slot]--; }

/* ---------------------------------------------------------------------------------- tests */

/* Every blob's bytes, once cold (all misses) and once warm (all hits); bad keys refused. */
static void t_basic_one(uint32_t io_threads, bool direct, const char *dir) {
    vfile f;
    make_file(&f, dir, "basic.bin", 4, 8, 2 * SMOE_PAGE, 1u << 1); /* layer 1 dense */
    smoe_streamer_params p = params(&f, 3, 64, io_threads, direct);
    smoe_streamer *s = open_streamer(&p);
    CHECK(smoe_streamer_slot_bytes(s) == 64 * f.blob_bytes, "slot bytes");
    uint32_t n = 0;
    for (uint32_t l = 0; l < 4; l++)
        for (uint32_t e = 0; e < 8 && is_sparse(2, l); e++, n++) use(s, &f, l, e);
    smoe_streamer_stats x = stats(s);
    CHECK(x.misses == n && x.hits == 0 && x.blob_reads == n && x.bytes_read == n * f.blob_bytes,
          "cold: misses %llu hits %llu reads %llu", (unsigned long long)x.misses, (unsigned long long)x.hits,
          (unsigned long long)x.blob_reads);
    for (uint32_t l = 0; l < 4; l++)
        for (uint32_t e = 0; e < 8 && is_sparse(2, l); e++) use(s, &f, l, e);
    x = stats(s);
    CHECK(x.misses == n && x.hits == n && x.blob_reads == n, "warm: hits %llu", (unsigned long long)x.hits);
    CHECK(smoe_streamer_acquire(s, 1, 0) == -2, "dense layer refused");
    CHECK(smoe_streamer_acquire(s, 4, 0) == -2 && smoe_streamer_acquire(s, 0, 8) == -2, "out of range refused");

    /* Everything in flight at once, consumed in completion order through wait_any. */
    smoe_streamer_clear(s);
    smoe_streamer_reset_stats(s);
    int slots[32];
    uint32_t keys[32], m = 0;
    for (uint32_t l = 0; l < 4; l++)
        for (uint32_t e = 0; e < 8 && is_sparse(2, l); e++) {
            slots[m] = smoe_streamer_acquire(s, l, e);
            CHECK(slots[m] >= 0, "acquire");
            keys[m++] = l * 8 + e;
        }
    while (m) {
        uint32_t i = smoe_streamer_wait_any(s, slots, m);
        CHECK(i < m && smoe_streamer_ready(s, slots[i]), "wait_any %u of %u", i, m);
        CHECK(smoe_streamer_wait(s, slots[i]) == SMOE_OK, "%s", smoe_last_error());
        CHECK(blob_ok(&f, smoe_streamer_data(s, slots[i]), keys[i] / 8, keys[i] % 8), "bytes");
        smoe_streamer_release(s, slots[i]);
        slots[i] = slots[m - 1];
        keys[i] = keys[m - 1];
        m--;
    }
    x = stats(s);
    CHECK(x.misses == n && x.blob_reads == n && x.hits == 0, "after clear all misses");
    smoe_streamer_free(s);
    free_file(&f);
}

static void t_basic(void) {
    static const uint32_t threads[] = {1, 2, 4, 8};
    for (int i = 0; i < 4; i++) {
        t_basic_one(threads[i], true, workdir);
        t_basic_one(threads[i], false, workdir);
    }
}

/* A hand-worked script: quota 2 per layer over 4 slots and 2 sparse layers. */
static void t_script(void) {
    vfile f;
    make_file(&f, workdir, "script.bin", 2, 8, SMOE_PAGE, 0);
    smoe_streamer_params p = params(&f, 2, 4, 2, true);
    smoe_streamer *s = open_streamer(&p);
    static const struct {
        uint32_t l, e;
        bool hit;
    } script[] = {
        /* stamps 1-4; counts 2 + 2, both at quota */
        {0, 0, false}, {0, 1, false}, {1, 0, false}, {1, 1, false},
        {0, 0, true},  /* stamp 5 */
        {0, 2, false}, /* all at quota: another layer gives, its LRU (1,0) */
        {0, 1, true},  /* kept */
        {1, 0, false}, /* layer 0 is 1 over quota: its LRU (0,0) goes */
        {0, 0, false}, /* both at quota: layer 1 gives its LRU (1,1) */
        {1, 1, false}, /* layer 0 over again: (0,2) goes */
        {0, 1, true},  {0, 0, true}, {1, 0, true}, {1, 1, true},
    };
    uint64_t hits = 0, misses = 0;
    for (size_t i = 0; i < sizeof script / sizeof *script; i++) {
        use(s, &f, script[i].l, script[i].e);
        hits += script[i].hit;
        misses += !script[i].hit;
        smoe_streamer_stats x = stats(s);
        CHECK(x.hits == hits && x.misses == misses && x.blob_reads == misses, "step %zu (%u,%u): hits %llu misses %llu",
              i, script[i].l, script[i].e, (unsigned long long)x.hits, (unsigned long long)x.misses);
    }
    /* A loading slot asked for again is a hit, and pins nest. */
    smoe_streamer_clear(s);
    smoe_streamer_reset_stats(s);
    int a = smoe_streamer_acquire(s, 1, 5), b = smoe_streamer_acquire(s, 1, 5);
    CHECK(a >= 0 && a == b, "same slot");
    smoe_streamer_stats x = stats(s);
    CHECK(x.misses == 1 && x.hits == 1 && x.blob_reads == 1, "loading re-acquire is a hit");
    smoe_streamer_release(s, a);
    CHECK(smoe_streamer_wait(s, b) == SMOE_OK && blob_ok(&f, smoe_streamer_data(s, b), 1, 5), "still pinned");
    smoe_streamer_release(s, b);
    smoe_streamer_free(s);

    /* Random sequential scripts against the model, slot for slot. */
    for (int round = 0; round < 40; round++) {
        uint32_t n_slots = 1 + rndn(12), io = 1 + rndn(4);
        p = params(&f, 2, n_slots, io, round & 1);
        s = open_streamer(&p);
        model m;
        model_init(&m, n_slots, 8, 2, false);
        int held[16], mheld[16];
        uint32_t nheld = 0;
        for (int step = 0; step < 400; step++) {
            if (nheld && (rndn(3) == 0 || nheld == 16)) {
                uint32_t i = rndn(nheld);
                smoe_streamer_release(s, held[i]);
                model_release(&m, mheld[i]);
                held[i] = held[nheld - 1];
                mheld[i] = mheld[--nheld];
                continue;
            }
            uint32_t l = rndn(2), e = rndn(8);
            int slot = smoe_streamer_acquire(s, l, e), ms = model_acquire(&m, l, e);
            CHECK(slot == ms, "round %d step %d: acquire(%u,%u) = %d, model %d", round, step, l, e, slot, ms);
            if (slot < 0) continue;
            CHECK(smoe_streamer_wait(s, slot) == SMOE_OK, "%s", smoe_last_error());
            CHECK(blob_ok(&f, smoe_streamer_data(s, slot), l, e), "bytes");
            held[nheld] = slot;
            mheld[nheld++] = ms;
        }
        x = stats(s);
        CHECK(x.hits == m.hits && x.misses == m.misses && x.blob_reads == m.misses, "round %d counts", round);
        while (nheld) smoe_streamer_release(s, held[--nheld]);
        smoe_streamer_free(s);
    }
    free_file(&f);
}

/* A pool the size of top-k and a longer union: acquire until −1, consume one, retry. */
static void t_topk_pool(void) {
    vfile f;
    make_file(&f, workdir, "topk.bin", 2, 32, 4 * SMOE_PAGE, 0);
    for (uint32_t io = 1; io <= 8; io *= 2) {
        smoe_streamer_params p = params(&f, 2, 4, io, io & 2);
        smoe_streamer *s = open_streamer(&p);
        for (uint32_t layer = 0; layer < 2; layer++) {
            uint32_t want[20];
            for (uint32_t i = 0; i < 20; i++) want[i] = (i * 7 + layer) % 32; /* 20 distinct */
            int slots[4];
            uint32_t exp[4], n = 0, next = 0, minus = 0;
            while (next < 20 || n) {
                if (next < 20) {
                    int slot = smoe_streamer_acquire(s, layer, want[next]);
                    if (slot >= 0) {
                        CHECK(n < 4, "more pinned than slots");
                        slots[n] = slot;
                        exp[n++] = want[next++];
                        continue;
                    }
                    CHECK(slot == -1 && n == 4, "-1 only with every slot pinned (%d, %u)", slot, n);
                    minus++;
                }
                uint32_t i = smoe_streamer_wait_any(s, slots, n);
                CHECK(i < n, "wait_any");
                CHECK(smoe_streamer_wait(s, slots[i]) == SMOE_OK, "%s", smoe_last_error());
                CHECK(blob_ok(&f, smoe_streamer_data(s, slots[i]), layer, exp[i]), "bytes");
                smoe_streamer_release(s, slots[i]);
                slots[i] = slots[n - 1];
                exp[i] = exp[--n];
            }
            CHECK(minus > 0, "the pool was never full");
        }
        smoe_streamer_stats x = stats(s);
        CHECK(x.blob_reads == 40 && x.misses == 40 && x.hits == 0, "each blob read exactly once: %llu reads",
              (unsigned long long)x.blob_reads);
        smoe_streamer_free(s);
    }
    free_file(&f);
}

/* Tokens through n_layers sparse layers of vf; each layer visit pins its k experts together,
 * waits, checks and releases them. routing: 0 = experts 3l, 3l+1 and, alternating per token,
 * 3l+2 or 3l+7; 1 = random, each expert of the layer's previous visit kept with p = 1/2. */
static void cycle(smoe_streamer *s, vfile *f, model *q, model *lru, uint32_t tokens, uint32_t k, int routing) {
    uint32_t prev[64][8] = {{0}};
    for (uint32_t l = 0; l < f->L; l++)
        for (uint32_t j = 0; j < k; j++) prev[l][j] = j;
    for (uint32_t tok = 0; tok < tokens; tok++)
        for (uint32_t l = 0; l < f->L; l++) {
            uint32_t want[8], n = 0;
            if (routing == 0) {
                for (uint32_t j = 0; j < 3; j++) want[n++] = (l * 3 + j + (tok % 2 && j == 2 ? 5 : 0)) % f->E;
            } else {
                for (uint32_t j = 0; j < k; j++)
                    if (rndn(2)) want[n++] = prev[l][j];
                while (n < k) {
                    uint32_t e = rndn(f->E), dup = 0;
                    for (uint32_t j = 0; j < n; j++) dup |= want[j] == e;
                    if (!dup) want[n++] = e;
                }
                memcpy(prev[l], want, sizeof want);
            }
            int slots[8], qs[8], ls[8];
            for (uint32_t j = 0; j < n; j++) {
                slots[j] = smoe_streamer_acquire(s, l, want[j]);
                qs[j] = model_acquire(q, l, want[j]);
                ls[j] = model_acquire(lru, l, want[j]);
                CHECK(slots[j] >= 0 && slots[j] == qs[j] && ls[j] >= 0, "token %u layer %u: %d %d", tok, l, slots[j],
                      qs[j]);
                CHECK(smoe_streamer_wait(s, slots[j]) == SMOE_OK, "%s", smoe_last_error());
                CHECK(blob_ok(f, smoe_streamer_data(s, slots[j]), l, want[j]), "bytes");
            }
            for (uint32_t j = 0; j < n; j++) {
                smoe_streamer_release(s, slots[j]);
                model_release(q, qs[j]);
                model_release(lru, ls[j]);
            }
        }
}

/* Cycling layers with a budget below the working set: the quota keeps blobs; LRU keeps none. */
static void t_quota(void) {
    static const struct {
        uint32_t L, E, n_slots, k, tokens;
        int routing;
    } cases[] = {
        {4, 16, 10, 3, 40, 0}, /* 8 blobs that recur + 4 that alternate, in 10 slots */
        {4, 16, 8, 3, 40, 0},  /* tighter */
        {8, 32, 20, 4, 60, 1}, /* ~32 distinct per cycle in 20 slots */
        {8, 32, 12, 4, 60, 1}, /* quota 1 */
        {8, 32, 6, 4, 60, 1},  /* quota 0: fewer slots than layers */
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        vfile f;
        make_file(&f, workdir, "quota.bin", cases[c].L, cases[c].E, SMOE_PAGE, 0);
        smoe_streamer_params p = params(&f, cases[c].L, cases[c].n_slots, 4, true);
        smoe_streamer *s = open_streamer(&p);
        model q, lru;
        model_init(&q, cases[c].n_slots, cases[c].E, cases[c].L, false);
        model_init(&lru, cases[c].n_slots, cases[c].E, cases[c].L, true);
        cycle(s, &f, &q, &lru, cases[c].tokens, cases[c].k, cases[c].routing);
        smoe_streamer_stats x = stats(s);
        CHECK(x.hits == q.hits && x.misses == q.misses && x.blob_reads == q.misses, "case %zu matches the model", c);
        CHECK(lru.hits == 0, "case %zu: global LRU thrashes (%llu hits)", c, (unsigned long long)lru.hits);
        CHECK(x.hits > 0, "case %zu: the quota keeps nothing", c);
        printf("quota case %zu (%u layers, %u slots, k %u): hit rate %.3f (global LRU %.3f)\n", c, cases[c].L,
               cases[c].n_slots, cases[c].k, (double)x.hits / (double)(x.hits + x.misses),
               (double)lru.hits / (double)(lru.hits + lru.misses));
        smoe_streamer_free(s);
        free_file(&f);
    }
}

/* LRFU (retention.c): slot for slot against the model on the quota's random traces, bytes
 * exact, nothing read that was not asked for; and a scripted trace where it keeps the blob
 * used three times that LRU gives up. */
static void t_retain(void) {
    static const struct {
        uint32_t L, E, n_slots, k, tokens;
        double half_life;
    } cases[] = {
        {8, 32, 20, 4, 60, 4}, {8, 32, 12, 4, 60, 2}, {8, 32, 40, 4, 60, 1}, {4, 16, 9, 3, 80, 8},
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        vfile f;
        make_file(&f, workdir, "retain.bin", cases[c].L, cases[c].E, SMOE_PAGE, 0);
        smoe_streamer_params p = params(&f, cases[c].L, cases[c].n_slots, 4, true);
        p.retention = SMOE_RETAIN_LRFU;
        p.half_life = cases[c].half_life;
        smoe_streamer *s = open_streamer(&p);
        model q, lru;
        model_init(&q, cases[c].n_slots, cases[c].E, cases[c].L, false);
        model_set_lrfu(&q, cases[c].half_life);
        model_init(&lru, cases[c].n_slots, cases[c].E, cases[c].L, false);
        cycle(s, &f, &q, &lru, cases[c].tokens, cases[c].k, 1);
        smoe_streamer_stats x = stats(s);
        CHECK(x.hits == q.hits && x.misses == q.misses && x.blob_reads == q.misses, "case %zu matches the model", c);
        printf("lrfu case %zu (%u layers, %u slots, k %u, half-life %g): hit rate %.3f (quota LRU %.3f)\n", c,
               cases[c].L, cases[c].n_slots, cases[c].k, cases[c].half_life,
               (double)x.hits / (double)(x.hits + x.misses), (double)lru.hits / (double)(lru.hits + lru.misses));
        smoe_streamer_free(s);
        free_file(&f);
    }

    /* 2 sparse layers, 3 slots (quota 1); layer 1 always asks for expert 0, layer 0 for
     * A A A B C A (A = 1, B = 2, C = 3). At C layer 0 is over quota and gives up A (LRU: used
     * longest ago) or B (LRFU: A's three uses outweigh B's one), so the last A hits only under
     * LRFU. */
    static const uint32_t script[] = {1, 1, 1, 2, 3, 1};
    for (int kind = SMOE_RETAIN_LRU; kind <= SMOE_RETAIN_LRFU; kind++) {
        vfile f;
        make_file(&f, workdir, "retain2.bin", 2, 8, SMOE_PAGE, 0);
        smoe_streamer_params p = params(&f, 2, 3, 2, true);
        p.retention = (smoe_retain_kind)kind;
        p.half_life = 4;
        smoe_streamer *s = open_streamer(&p);
        for (size_t i = 0; i < sizeof script / sizeof *script; i++) {
            CHECK(use(s, &f, 0, script[i]) >= 0, "acquire layer 0");
            CHECK(use(s, &f, 1, 0) >= 0, "acquire layer 1");
        }
        smoe_streamer_stats x = stats(s);
        uint64_t want_hits = kind == SMOE_RETAIN_LRFU ? 8 : 7;
        CHECK(x.hits == want_hits && x.misses == 12 - want_hits && x.blob_reads == x.misses,
              "%s: hits %llu misses %llu reads %llu (want %llu hits)", kind == SMOE_RETAIN_LRFU ? "lrfu" : "lru",
              (unsigned long long)x.hits, (unsigned long long)x.misses, (unsigned long long)x.blob_reads,
              (unsigned long long)want_hits);
        smoe_streamer_free(s);
        free_file(&f);
    }
}

/* The file shrinks after open: the read fails, names the blob, and the slot recovers. */
static void t_truncate_one(bool direct, uint64_t cut_extra) {
    vfile f;
    make_file(&f, workdir, "trunc.bin", 2, 4, 4 * SMOE_PAGE, 0);
    uint32_t last = 0;
    for (uint32_t k = 0; k < 8; k++)
        if (f.off[k] > f.off[last]) last = k;
    smoe_streamer_params p = params(&f, 2, 1, 2, direct);
    smoe_streamer *s = open_streamer(&p);
    uint32_t other = (last + 1) % 8;
    use(s, &f, other / 4, other % 4);
    CHECK(truncate(f.path, (off_t)(f.off[last] + cut_extra)) == 0, "truncate");
    smoe_streamer_clear(s); /* the cached intact blob must be re-read too */
    for (int round = 0; round < 2; round++) {
        int slot = smoe_streamer_acquire(s, last / 4, last % 4);
        CHECK(slot == 0, "acquire into the only slot");
        smoe_status st = smoe_streamer_wait(s, slot);
        const char *msg = smoe_last_error();
        char want[128];
        snprintf(want, sizeof want, "layer %u, expert %u, offset %llu", last / 4, last % 4,
                 (unsigned long long)f.off[last]);
        CHECK(st == SMOE_ERR_IO, "status %d", st);
        CHECK(strstr(msg, want) && strstr(msg, "short read"), "message: %s", msg);
        CHECK(smoe_streamer_ready(s, slot), "failed is not loading");
        CHECK(smoe_streamer_wait(s, slot) == SMOE_ERR_IO, "waiting again says the same");
        smoe_streamer_release(s, slot);
        use(s, &f, other / 4, other % 4); /* the slot is reusable, intact blobs still read */
    }
    smoe_streamer_stats x = stats(s);
    CHECK(x.blob_reads == 5 && x.misses == 5, "every failed acquire re-reads: %llu", (unsigned long long)x.blob_reads);
    smoe_streamer_free(s);
    free_file(&f);
}

static void t_truncate(void) {
    t_truncate_one(true, 0);
    t_truncate_one(false, 0);
    t_truncate_one(true, SMOE_PAGE);
    t_truncate_one(false, 100);
    t_truncate_one(true, 100);

    /* A read error (not a short read): errno text in the message. The file is a directory
     * opened read-only, whose pread fails with EISDIR. */
    vfile f;
    make_file(&f, workdir, "dirpath.bin", 1, 2, SMOE_PAGE, 0);
    smoe_streamer_params p = params(&f, 1, 2, 1, false);
    int dir_fd = open(workdir, O_RDONLY | O_CLOEXEC);
    CHECK(dir_fd >= 0, "open %s", workdir);
    p.path = workdir;
    p.fd = dir_fd;
    smoe_streamer *s = open_streamer(&p);
    int slot = smoe_streamer_acquire(s, 0, 1);
    CHECK(slot >= 0, "acquire");
    CHECK(smoe_streamer_wait(s, slot) == SMOE_ERR_IO, "read error");
    CHECK(strstr(smoe_last_error(), "layer 0, expert 1") && strstr(smoe_last_error(), "directory"), "message: %s",
          smoe_last_error());
    /* Asked for again while the failed slot is still pinned: a fresh read into another slot. */
    int again = smoe_streamer_acquire(s, 0, 1);
    CHECK(again >= 0 && again != slot, "re-read elsewhere (%d, %d)", again, slot);
    CHECK(smoe_streamer_wait(s, again) == SMOE_ERR_IO, "fails again");
    CHECK(smoe_streamer_acquire(s, 0, 0) == -1, "both slots pinned");
    smoe_streamer_release(s, slot);
    smoe_streamer_release(s, again);
    int bad[3] = {-5, 99, 0};
    CHECK(smoe_streamer_wait_any(s, bad, 3) == 0, "bad slots count as settled");
    smoe_streamer_stats x = stats(s);
    CHECK(x.misses == 2 && x.blob_reads == 2 && x.hits == 0, "two reads");
    for (int i = 0; i < 2; i++) { /* both slots free again */
        int a = smoe_streamer_acquire(s, 0, (uint32_t)i);
        CHECK(a >= 0, "reusable");
        CHECK(smoe_streamer_wait(s, a) == SMOE_ERR_IO, "still a directory");
    }
    smoe_streamer_free(s);
    close(dir_fd);
    free_file(&f);
}

/* The streamer reads the file it was given, not whatever the path names later: vault.bin
 * deleted and replaced by other bytes under an open vault changes nothing read. */
static void t_pinned(void) {
    vfile f;
    make_file(&f, workdir, "pinned.bin", 1, 4, 2 * SMOE_PAGE, 0);
    CHECK(unlink(f.path) == 0, "unlink");
    int fd = open(f.path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    uint8_t *junk = calloc(1, 8 * SMOE_PAGE);
    memset(junk, 0xA5, 8 * SMOE_PAGE);
    CHECK(fd >= 0 && pwrite(fd, junk, 8 * SMOE_PAGE, 0) == 8 * SMOE_PAGE, "another file at the path");
    close(fd);
    free(junk);
    for (int direct = 0; direct < 2; direct++) {
        smoe_streamer_params p = params(&f, 1, 2, 2, direct);
        p.verify = true;
        smoe_streamer *s = open_streamer(&p);
        for (uint32_t e = 0; e < 4; e++) use(s, &f, 0, e); /* use() checks the bytes */
        smoe_streamer_free(s);
    }
    free_file(&f);
}

/* verify=true catches a corrupted blob; verify=false hands its bytes over. */
static void t_verify(void) {
    vfile f;
    make_file(&f, workdir, "verify.bin", 2, 4, 2 * SMOE_PAGE, 0);
    uint32_t bad = 6;
    int fd = open(f.path, O_RDWR);
    uint8_t byte;
    CHECK(pread(fd, &byte, 1, (off_t)(f.off[bad] + 1234)) == 1, "read");
    byte ^= 0x10;
    CHECK(pwrite(fd, &byte, 1, (off_t)(f.off[bad] + 1234)) == 1, "write");
    close(fd);
    for (int direct = 0; direct < 2; direct++) {
        smoe_streamer_params p = params(&f, 2, 2, 2, direct);
        p.verify = true;
        smoe_streamer *s = open_streamer(&p);
        int slot = smoe_streamer_acquire(s, 1, 2);
        CHECK(slot >= 0, "acquire");
        CHECK(smoe_streamer_wait(s, slot) == SMOE_ERR_IO, "checksum");
        char want[96];
        snprintf(want, sizeof want, "layer 1, expert 2, offset %llu", (unsigned long long)f.off[bad]);
        CHECK(strstr(smoe_last_error(), "blob (1,2) checksum mismatch") && strstr(smoe_last_error(), want),
              "message: %s", smoe_last_error());
        smoe_streamer_release(s, slot);
        for (uint32_t k = 0; k < 8; k++)
            if (k != bad) use(s, &f, k / 4, k % 4);
        smoe_streamer_free(s);

        p.verify = false;
        s = open_streamer(&p);
        slot = smoe_streamer_acquire(s, 1, 2);
        CHECK(smoe_streamer_wait(s, slot) == SMOE_OK, "no verify: no check");
        CHECK(!blob_ok(&f, smoe_streamer_data(s, slot), 1, 2), "the corrupted bytes");
        smoe_streamer_release(s, slot);
        smoe_streamer_free(s);
    }
    free_file(&f);
}

/* Direct I/O where it works (WORKDIR); the buffered fallback, logged once, when the O_DIRECT
 * open fails or its reads fail with EINVAL (forced through the test hooks: tmpfs takes O_DIRECT
 * on recent kernels); bad parameters. */
extern int smoe_streamer_test_fail_direct;

static void t_direct(void) {
    vfile f;
    make_file(&f, workdir, "direct.bin", 1, 4, SMOE_PAGE, 0);
    smoe_streamer_params p = params(&f, 1, 4, 2, true);
    smoe_set_log_callback(on_log, NULL);
    warnings = 0;
    smoe_streamer *s = open_streamer(&p);
    CHECK(stats(s).direct_io, "O_DIRECT on %s", workdir);
    for (uint32_t e = 0; e < 4; e++) use(s, &f, 0, e);
    CHECK(stats(s).direct_io && warnings == 0, "still direct after reads");
    smoe_streamer_free(s);
    p.direct_io = false;
    s = open_streamer(&p);
    CHECK(!stats(s).direct_io, "buffered when not asked");
    for (uint32_t e = 0; e < 4; e++) use(s, &f, 0, e);
    smoe_streamer_free(s);
    CHECK(warnings == 0, "no warning");

    p.direct_io = true;
    for (int hook = 1; hook <= 2; hook++) {
        smoe_streamer_test_fail_direct = hook;
        warnings = 0;
        s = open_streamer(&p);
        CHECK(!stats(s).direct_io && warnings == 1, "hook %d: fallback decided at creation, logged once (%d)", hook,
              warnings);
        for (uint32_t e = 0; e < 4; e++) use(s, &f, 0, e);
        CHECK(!stats(s).direct_io && warnings == 1, "hook %d: still one warning", hook);
        smoe_streamer_free(s);
    }
    smoe_streamer_test_fail_direct = 0;

    smoe_streamer_params bad = p;
    bad.fd = -1;
    smoe_streamer *none = (smoe_streamer *)&bad;
    CHECK(smoe_streamer_new(&bad, &none) == SMOE_ERR_INVALID_ARG && !none, "no descriptor");
    bad = p;
    bad.blob_bytes = 1000;
    CHECK(smoe_streamer_new(&bad, &none) == SMOE_ERR_INVALID_ARG, "blob_bytes");
    bad = p;
    bad.n_slots = 0;
    CHECK(smoe_streamer_new(&bad, &none) == SMOE_ERR_INVALID_ARG, "n_slots");
    bad = p;
    bad.io_threads = 0;
    CHECK(smoe_streamer_new(&bad, &none) == SMOE_ERR_INVALID_ARG, "io_threads");
    f.off[2] += 512;
    CHECK(smoe_streamer_new(&p, &none) == SMOE_ERR_INVALID_ARG, "unaligned offset");
    f.off[2] -= 512;
    CHECK(smoe_streamer_new(NULL, &none) == SMOE_ERR_INVALID_ARG, "NULL");
    smoe_streamer_free(NULL);
    free_file(&f);

    if (shmdir) { /* tmpfs: whatever the kernel does, the bytes are right and stats tell */
        warnings = 0;
        make_file(&f, shmdir, "direct.bin", 1, 4, SMOE_PAGE, 0);
        p = params(&f, 1, 4, 2, true);
        s = open_streamer(&p);
        for (uint32_t e = 0; e < 4; e++) use(s, &f, 0, e);
        bool d = stats(s).direct_io;
        printf("tmpfs %s: direct_io=%d, warnings=%d\n", shmdir, d, warnings);
        CHECK(d == (warnings == 0), "a fallback is logged once");
        smoe_streamer_free(s);
        free_file(&f);
    }
    smoe_set_log_callback(NULL, NULL);
}

/* Random acquires, releases and waits; freeing with reads in flight. */
static void t_stress(void) {
    vfile f;
    key_order = true; /* so that coalescing (on with 4 and 8 I/O threads) finds neighbours */
    make_file(&f, workdir, "stress.bin", 4, 16, SMOE_PAGE, 0);
    key_order = false;
    static const uint32_t threads[] = {1, 2, 4, 8};
    for (int ti = 0; ti < 4; ti++) {
        smoe_streamer_params p = params(&f, 4, 6, threads[ti], ti & 1);
        p.coalesce_bytes = ti >= 2 ? 3 * f.blob_bytes : 0;
        smoe_streamer *s = open_streamer(&p);
        int held[12];
        uint32_t key[12], n = 0;
        uint64_t minus = 0;
        for (int op = 0; op < 20000; op++) {
            uint32_t r = rndn(100);
            if (r < 45 && n < 12) {
                uint32_t k = rndn(64);
                int slot = smoe_streamer_acquire(s, k / 16, k % 16);
                CHECK(slot >= -1 && slot < 6, "acquire %d", slot);
                if (slot < 0) {
                    minus++;
                    continue;
                }
                held[n] = slot;
                key[n++] = k;
            } else if (r < 75 && n) {
                uint32_t i = rndn(n);
                if (rndn(2)) {
                    CHECK(smoe_streamer_wait(s, held[i]) == SMOE_OK, "%s", smoe_last_error());
                    CHECK(blob_ok(&f, smoe_streamer_data(s, held[i]), key[i] / 16, key[i] % 16), "bytes");
                }
                smoe_streamer_release(s, held[i]);
                held[i] = held[n - 1];
                key[i] = key[--n];
            } else if (r < 90 && n) {
                uint32_t i = rndn(n);
                CHECK(smoe_streamer_wait(s, held[i]) == SMOE_OK, "%s", smoe_last_error());
                CHECK(blob_ok(&f, smoe_streamer_data(s, held[i]), key[i] / 16, key[i] % 16), "bytes");
            } else if (r < 97 && n) {
                uint32_t i = smoe_streamer_wait_any(s, held, n);
                CHECK(i < n && smoe_streamer_ready(s, held[i]), "wait_any");
            } else if (r < 98 && n == 0) {
                smoe_streamer_clear(s);
            } else if (r < 99 && n == 0) {
                smoe_streamer_stats x = stats(s);
                CHECK(x.blob_reads == x.misses && x.bytes_read == x.misses * f.blob_bytes, "reads = misses");
                smoe_streamer_free(s); /* maybe with reads in flight */
                s = open_streamer(&p);
            }
        }
        smoe_streamer_stats x = stats(s);
        CHECK(x.blob_reads == x.misses, "reads = misses");
        while (n) smoe_streamer_release(s, held[--n]);
        CHECK(minus > 0, "never full");
        /* Reads in flight at free. */
        for (uint32_t i = 0; i < 6; i++) (void)smoe_streamer_acquire(s, 3, i);
        smoe_streamer_free(s);
    }
    free_file(&f);
}

/* A read released while still loading (what a cancel leaves) holds its slot until it lands:
 * acquire refuses (-1) meanwhile, and smoe_streamer_settle waits until it can succeed. */
static void t_settle(void) {
    vfile f;
    make_file(&f, workdir, "settle.bin", 1, 8, 2 * SMOE_PAGE, 0);
    uint32_t refused = 0;
    for (int direct = 0; direct < 2; direct++) {
        smoe_streamer_params p = params(&f, 1, 1, 1, direct);
        smoe_streamer *s = open_streamer(&p);
        for (uint32_t i = 0; i < 200; i++) {
            int slot = smoe_streamer_acquire(s, 0, i % 8);
            CHECK(slot >= 0, "acquire");
            smoe_streamer_release(s, slot); /* possibly still loading */
            int next = smoe_streamer_acquire(s, 0, (i + 1) % 8);
            if (next < 0) {
                refused++;
                CHECK(next == -1, "refusal is -1");
                CHECK(smoe_streamer_settle(s), "settle finds a slot");
                next = smoe_streamer_acquire(s, 0, (i + 1) % 8);
                CHECK(next >= 0, "acquire after settle");
            }
            CHECK(smoe_streamer_wait(s, next) == SMOE_OK, "wait");
            CHECK(blob_ok(&f, smoe_streamer_data(s, next), 0, (i + 1) % 8), "bytes");
            smoe_streamer_release(s, next);
        }
        int held = smoe_streamer_acquire(s, 0, 0);
        CHECK(held >= 0 && !smoe_streamer_settle(s), "every slot pinned: settle says so");
        smoe_streamer_release(s, held);
        smoe_streamer_free(s);
    }
    printf("settle: %u of 400 acquires found the slot still loading\n", refused);
    free_file(&f);
}

/* Coalescing: misses held until submit, adjacent blobs read as one request of at most
 * max_run blobs, each blob still settled (and failed) on its own. */
static void wait_ok(smoe_streamer *s, vfile *f, int slot, uint32_t l, uint32_t e) {
    smoe_status st = smoe_streamer_wait(s, slot);
    CHECK(st == SMOE_OK, "wait(%u,%u): %d %s", l, e, st, smoe_last_error());
    CHECK(blob_ok(f, smoe_streamer_data(s, slot), l, e), "bytes of (%u,%u) wrong", l, e);
}

static void t_coalesce_one(bool direct) {
    vfile f;
    key_order = true;
    make_file(&f, workdir, "coalesce.bin", 2, 16, 2 * SMOE_PAGE, 0);
    key_order = false;
    smoe_streamer_params p = params(&f, 2, 32, 2, direct);
    p.verify = true;
    p.coalesce_bytes = 4 * f.blob_bytes + 1; /* runs of at most 4 blobs */
    smoe_streamer *s = open_streamer(&p);

    /* Routing order; sorted: 0 | 3 4 5 6 | 9 | 12 13 14 15 → 4 requests for 10 blobs. */
    const uint32_t ex[] = {5, 3, 4, 9, 6, 12, 13, 14, 15, 0};
    int slot[10];
    for (int i = 0; i < 10; i++) {
        slot[i] = smoe_streamer_acquire(s, 1, ex[i]);
        CHECK(slot[i] >= 0, "acquire");
    }
    usleep(20000);
    CHECK(!smoe_streamer_ready(s, slot[0]), "held until submit: nothing was read");
    CHECK(stats(s).read_requests == 0, "nothing issued before submit");
    smoe_streamer_submit(s);
    for (int i = 9; i >= 0; i--) wait_ok(s, &f, slot[i], 1, ex[i]);
    smoe_streamer_stats x = stats(s);
    CHECK(x.blob_reads == 10 && x.misses == 10 && x.bytes_read == 10 * f.blob_bytes, "blob accounting: %llu",
          (unsigned long long)x.blob_reads);
    CHECK(x.read_requests == 4, "read requests %llu, want 4", (unsigned long long)x.read_requests);
    for (int i = 0; i < 10; i++) smoe_streamer_release(s, slot[i]);
    /* Retained ones are hits and read nothing; the held ones go out at the next wait, unasked. */
    int a = smoe_streamer_acquire(s, 1, 4), b = smoe_streamer_acquire(s, 1, 7), c = smoe_streamer_acquire(s, 1, 8);
    wait_ok(s, &f, c, 1, 8);
    wait_ok(s, &f, b, 1, 7);
    wait_ok(s, &f, a, 1, 4);
    x = stats(s);
    CHECK(x.hits == 1 && x.blob_reads == 12 && x.read_requests == 5, "7 and 8 in one request: %llu",
          (unsigned long long)x.read_requests);
    smoe_streamer_release(s, a);
    smoe_streamer_release(s, b);
    smoe_streamer_release(s, c);
    smoe_streamer_clear(s);

    /* A corrupt blob inside a run fails alone, by name; its neighbours are fine. */
    int fd = open(f.path, O_RDWR);
    uint8_t byte;
    uint32_t bad = 1 * 16 + 4;
    CHECK(pread(fd, &byte, 1, (off_t)(f.off[bad] + 999)) == 1, "read");
    byte ^= 0x01;
    CHECK(pwrite(fd, &byte, 1, (off_t)(f.off[bad] + 999)) == 1, "write");
    for (int i = 0; i < 4; i++) slot[i] = smoe_streamer_acquire(s, 1, 3 + (uint32_t)i);
    for (int i = 0; i < 4; i++) {
        if (i == 1) {
            CHECK(smoe_streamer_wait(s, slot[i]) == SMOE_ERR_IO, "the corrupt blob fails");
            CHECK(strstr(smoe_last_error(), "blob (1,4) checksum mismatch"), "message: %s", smoe_last_error());
        } else {
            wait_ok(s, &f, slot[i], 1, 3 + (uint32_t)i);
        }
        smoe_streamer_release(s, slot[i]);
    }
    byte ^= 0x01;
    CHECK(pwrite(fd, &byte, 1, (off_t)(f.off[bad] + 999)) == 1, "write");
    close(fd);
    use(s, &f, 1, 4); /* read again, now intact */
    smoe_streamer_clear(s);

    /* A short read part way through a run: the blobs it covered are fine, the rest name
     * themselves as short. The file ends one page into blob (1,14). */
    CHECK(truncate(f.path, (off_t)(f.off[1 * 16 + 14] + SMOE_PAGE)) == 0, "truncate");
    for (int i = 0; i < 4; i++) slot[i] = smoe_streamer_acquire(s, 1, 12 + (uint32_t)i);
    wait_ok(s, &f, slot[0], 1, 12);
    wait_ok(s, &f, slot[1], 1, 13);
    for (int i = 2; i < 4; i++) {
        CHECK(smoe_streamer_wait(s, slot[i]) == SMOE_ERR_IO, "short");
        char want[64];
        snprintf(want, sizeof want, "short read of blob (1,%d)", 12 + i);
        CHECK(strstr(smoe_last_error(), want), "message: %s", smoe_last_error());
    }
    for (int i = 0; i < 4; i++) smoe_streamer_release(s, slot[i]);

    /* Freed with reads still held: they are issued and finished, nothing leaks or hangs. */
    for (uint32_t e = 0; e < 12; e++) (void)smoe_streamer_acquire(s, 0, e);
    smoe_streamer_free(s);

    /* Off (coalesce_bytes < 2 blobs): one request per blob, issued at acquire. */
    p.coalesce_bytes = f.blob_bytes;
    s = open_streamer(&p);
    for (uint32_t e = 0; e < 4; e++) use(s, &f, 0, e);
    CHECK(stats(s).read_requests == 4, "one request per blob");
    smoe_streamer_free(s);
    free_file(&f);
}

static void t_coalesce(void) {
    t_coalesce_one(true);
    t_coalesce_one(false);
}

static const struct {
    const char *name;
    void (*fn)(void);
} tests[] = {
    {"coalesce", t_coalesce},
    {"basic", t_basic},     {"script", t_script}, {"topk_pool", t_topk_pool}, {"quota", t_quota}, {"retain", t_retain},
    {"truncate", t_truncate}, {"verify", t_verify}, {"pinned", t_pinned}, {"direct", t_direct},       {"stress", t_stress}, {"settle", t_settle},
};

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s TEST|all WORKDIR [SHMDIR]\n", argv[0]);
        return 2;
    }
    workdir = argv[2];
    shmdir = argc > 3 && argv[3][0] ? argv[3] : NULL;
    if (argc > 4) rng_state = strtoull(argv[4], NULL, 0);
    bool any = false;
    for (size_t i = 0; i < sizeof tests / sizeof *tests; i++)
        if (!strcmp(argv[1], "all") || !strcmp(argv[1], tests[i].name)) {
            current = tests[i].name;
            tests[i].fn();
            printf("ok %s\n", tests[i].name);
            any = true;
        }
    if (!any) {
        fprintf(stderr, "no test %s\n", argv[1]);
        return 2;
    }
    return 0;
}
