/* pool.c — the compute worker pool (pool.h).
 *
 * threads − 1 persistent workers; the caller of smoe_pool_run is worker 0. A run's items are cut
 * into chunks (up to CHUNKS_PER_THREAD a thread, whole grains), and every thread, the caller too,
 * claims chunk after chunk until none is left: a thread that is slowed (a busier core, a vCPU the
 * host took away) or dealt the costlier rows (an expert with more tokens) leaves its share to the
 * others instead of making them wait. Which thread runs a chunk never changes its result
 * (kernels.h), only who does the arithmetic. No mutex is taken on this path.
 *
 * A run is published through one atomic generation counter: the caller writes the task (fn, ctx,
 * n, chunk), zeroes `done`, stores the claim word `next` — the new generation, the chunk count and
 * the next chunk's index in one 64-bit word — and increments `gen`. A claim is a compare-exchange
 * on `next` that succeeds only for the generation the claimer saw and an index below the count,
 * so a worker that saw generation k and was descheduled can never take a chunk of run k+1 with
 * run k's idea of it; its acquire makes the task fields visible, and they stay put until the chunk
 * it claimed is counted in `done`, which the caller waits for before it returns.
 *
 * Waiting spins briefly (runs of one decode step come back to back) and then sleeps: on Linux
 * on a futex on the very word being watched, elsewhere on a condition variable. A sleeper first
 * announces itself (`sleepers`, `caller_sleeping`) and then sleeps only if the word still holds
 * the value it saw; the waker changes the word first and then looks for sleepers. Both sides
 * use sequentially consistent atomics, so one of them always sees the other: no lost wakeup,
 * and no system call when nobody sleeps.
 */
#include "pool.h"
#include "prof.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>

#if defined(__linux__) && !defined(SMOE_NO_FUTEX) /* -DSMOE_NO_FUTEX: the condvar path, for tests */
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#define SMOE_POOL_FUTEX 1
#else
#define SMOE_POOL_FUTEX 0
#endif

/* Waiting: SPIN_PAUSE rounds of a pause instruction (microseconds: back-to-back runs never
 * sleep), then SPIN_YIELD rounds of sched_yield (when there are more threads than free cores,
 * the thread being waited for gets the core), then sleep. */
enum { SPIN_PAUSE = 2048, SPIN_YIELD = 64, MAX_THREADS = 1024 };

/* Chunks a thread's share is cut into: enough that a slow or overloaded thread's share is taken
 * over, few enough that a claim (one compare-exchange) and a product's per-call set-up stay small
 * against a chunk's work. */
enum { CHUNKS_PER_THREAD = 4 };

/* The claim word: generation (bits 40–63, its low 24 bits), chunk count (20–39), next index (0–19). */
#define CLAIM_WORD(gen, count, index) \
    ((uint64_t)((gen) & 0xFFFFFFu) << 40 | (uint64_t)(count) << 20 | (uint64_t)(index))
enum { MAX_CHUNKS = (1 << 20) - 1 };

typedef struct {
    smoe_pool *pool;
    uint32_t index; /* worker number, 1 .. threads−1 */
} worker_arg;

struct smoe_pool {
    uint32_t threads;
    pthread_t *tids;      /* (threads − 1) */
    worker_arg *args;     /* (threads − 1) */
    uint32_t started;     /* workers created so far */

    /* the task of the current generation: written by the caller before `next` and gen */
    smoe_task_fn fn;
    void *ctx;
    uint32_t n, chunk; /* items, and items per chunk (a multiple of the run's grain) */

    _Atomic uint32_t gen;             /* bumped once per run (and once at shutdown) */
    _Atomic uint64_t next;            /* the claim word (CLAIM_WORD) */
    _Atomic uint32_t done;            /* chunks of this generation finished */
    _Atomic uint32_t sleepers;        /* workers asleep (or about to be) on gen */
    _Atomic uint32_t caller_sleeping; /* the caller asleep (or about to be) on done */
    _Atomic bool stop;

#if !SMOE_POOL_FUTEX
    pthread_mutex_t mu;
    pthread_cond_t cv;
#endif
};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* One round of waiting; false when it is time to sleep. */
static inline bool spin(uint32_t *rounds) {
    const uint32_t r = ++*rounds;
    if (r < SPIN_PAUSE)
        cpu_relax();
    else if (r < SPIN_PAUSE + SPIN_YIELD)
        sched_yield();
    else
        return false;
    return true;
}

/* Sleeps while *word == expected (may return spuriously). */
static void word_wait(smoe_pool *p, _Atomic uint32_t *word, uint32_t expected) {
#if SMOE_POOL_FUTEX
    (void)p;
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
#else
    pthread_mutex_lock(&p->mu);
    while (atomic_load(word) == expected) pthread_cond_wait(&p->cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
#endif
}

/* Wakes every sleeper on word; the caller changed *word before. */
static void word_wake(smoe_pool *p, _Atomic uint32_t *word) {
#if SMOE_POOL_FUTEX
    (void)p;
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, MAX_THREADS, NULL, NULL, 0);
#else
    (void)word;
    /* taking the lock orders this wake after a waiter's check-then-wait */
    pthread_mutex_lock(&p->mu);
    pthread_mutex_unlock(&p->mu);
    pthread_cond_broadcast(&p->cv);
#endif
}

/* Claims the next chunk of generation gen: its index and the run's chunk count, or false when the
 * run has none left or is not gen's. */
static bool claim(smoe_pool *p, uint32_t gen, uint32_t *index, uint32_t *count) {
    uint64_t v = atomic_load_explicit(&p->next, memory_order_acquire);
    for (;;) {
        const uint32_t i = (uint32_t)(v & 0xFFFFF), c = (uint32_t)(v >> 20 & 0xFFFFF);
        if ((uint32_t)(v >> 40) != (gen & 0xFFFFFFu) || i >= c) return false;
        if (atomic_compare_exchange_weak_explicit(&p->next, &v, v + 1, memory_order_acq_rel, memory_order_acquire)) {
            *index = i;
            *count = c;
            return true;
        }
    }
}

/* Claims and runs chunks of generation gen until none is left; the number run. A worker's last
 * one wakes the caller if it sleeps. */
static uint32_t run_chunks(smoe_pool *p, uint32_t gen, uint32_t w) {
    uint32_t i, count, ran = 0;
    while (claim(p, gen, &i, &count)) {
        const uint32_t b = i * p->chunk, e = p->n - b < p->chunk ? p->n : b + p->chunk;
        p->fn(p->ctx, b, e, w);
        ran++;
        if (w != 0 && atomic_fetch_add(&p->done, 1) + 1 == count && atomic_load(&p->caller_sleeping))
            word_wake(p, &p->done);
    }
    return ran;
}

static void *worker_main(void *arg) {
    const worker_arg *a = arg;
    smoe_pool *p = a->pool;
    uint32_t seen = 0; /* gen at creation: a run may be published before this thread starts */
    for (;;) {
        uint32_t g, rounds = 0;
        while ((g = atomic_load_explicit(&p->gen, memory_order_acquire)) == seen) {
            if (spin(&rounds)) continue;
            atomic_fetch_add(&p->sleepers, 1);
            word_wait(p, &p->gen, seen);
            atomic_fetch_sub(&p->sleepers, 1);
        }
        seen = g;
        if (atomic_load_explicit(&p->stop, memory_order_acquire)) return NULL;
        (void)run_chunks(p, g, a->index);
    }
}

uint32_t smoe_pool_threads(const smoe_pool *pool) { return pool ? pool->threads : 0; }

/* Publishes a new generation and wakes sleeping workers. */
static void publish(smoe_pool *p) {
    atomic_fetch_add(&p->gen, 1);
    if (atomic_load(&p->sleepers) > 0) word_wake(p, &p->gen);
}

void smoe_pool_free(smoe_pool *pool) {
    if (!pool) return;
    if (pool->started > 0) {
        atomic_store(&pool->stop, true);
        publish(pool);
        for (uint32_t i = 0; i < pool->started; i++) pthread_join(pool->tids[i], NULL);
    }
#if !SMOE_POOL_FUTEX
    pthread_cond_destroy(&pool->cv);
    pthread_mutex_destroy(&pool->mu);
#endif
    smoe_free(pool->args);
    smoe_free(pool->tids);
    smoe_free(pool);
}

smoe_status smoe_pool_new(uint32_t threads, smoe_pool **out) {
    if (!out) return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_pool_new: out is NULL");
    *out = NULL;
    if (threads < 1 || threads > MAX_THREADS)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "threads must be in [1, %u], got %u", MAX_THREADS, threads);
    smoe_pool *p = smoe_alloc(sizeof *p, 64);
    if (!p) return smoe_fail(SMOE_ERR_NOMEM, "worker pool: out of memory");
    p->threads = threads;
    atomic_init(&p->gen, 0);
    atomic_init(&p->next, CLAIM_WORD(0, 0, 0));
    atomic_init(&p->done, 0);
    atomic_init(&p->sleepers, 0);
    atomic_init(&p->caller_sleeping, 0);
    atomic_init(&p->stop, false);
#if !SMOE_POOL_FUTEX
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
#endif
    if (threads == 1) {
        *out = p;
        return SMOE_OK;
    }
    p->tids = smoe_alloc(sizeof *p->tids * (threads - 1), 64);
    p->args = smoe_alloc(sizeof *p->args * (threads - 1), 64);
    if (!p->tids || !p->args) {
        smoe_pool_free(p);
        return smoe_fail(SMOE_ERR_NOMEM, "worker pool: out of memory");
    }
    /* Workers block every signal (smoe_thread_start), so the host (Python's SIGINT handling) sees
     * them on its own threads. The kernels keep blocks of unpacked weights and tokens' codes on
     * the stack (up to ~410 KB: the AVX2 q8 product in lanes by block): workers get a stack of at
     * least SMOE_WORKER_STACK whatever the platform's default (musl's is 128 KB). The calling
     * thread runs range 0 on its own stack, which needs as much. */
    int err = 0;
    for (uint32_t i = 0; i < threads - 1; i++) {
        p->args[i].pool = p;
        p->args[i].index = i + 1;
        err = smoe_thread_start(&p->tids[i], "smoe-pool", SMOE_WORKER_STACK, worker_main, &p->args[i]);
        if (err) break;
        p->started++;
    }
    if (err) {
        smoe_pool_free(p);
        return smoe_fail(SMOE_ERR_NOMEM, "worker pool: cannot start thread %u of %u (error %d)", p->started + 1,
                         threads, err);
    }
    *out = p;
    return SMOE_OK;
}

void smoe_pool_run(smoe_pool *pool, smoe_task_fn fn, void *ctx, uint32_t n, uint32_t grain) {
    if (n == 0) return;
    if (grain == 0) grain = 1;
    if (pool->threads == 1 || n <= grain) {
        fn(ctx, 0, n, 0);
        return;
    }
    /* chunks of whole grains, at most CHUNKS_PER_THREAD a thread (and MAX_CHUNKS) */
    const uint64_t grains = ((uint64_t)n + grain - 1) / grain;
    uint64_t want = (uint64_t)pool->threads * CHUNKS_PER_THREAD;
    if (want > MAX_CHUNKS) want = MAX_CHUNKS;
    const uint64_t per = (grains + want - 1) / want;
    const uint32_t chunk = (uint32_t)(per * grain < n ? per * grain : n);
    const uint32_t count = (uint32_t)(((uint64_t)n + chunk - 1) / chunk);
    pool->fn = fn;
    pool->ctx = ctx;
    pool->n = n;
    pool->chunk = chunk;
    atomic_store(&pool->done, 0);
    const uint32_t g = atomic_load(&pool->gen) + 1; /* the generation publish() makes */
    atomic_store(&pool->next, CLAIM_WORD(g, count, 0)); /* seq_cst: after the task fields above */
    publish(pool);
    const uint32_t mine = run_chunks(pool, g, 0);
    const double wait0 = SMOE_PROF_NOW();
    (void)wait0;
    uint32_t d = atomic_fetch_add(&pool->done, mine) + mine, rounds = 0;
    while (d != count) {
        if (spin(&rounds)) {
            d = atomic_load_explicit(&pool->done, memory_order_acquire);
            continue;
        }
        atomic_store(&pool->caller_sleeping, 1);
        if ((d = atomic_load(&pool->done)) != count) word_wait(pool, &pool->done, d);
        atomic_store(&pool->caller_sleeping, 0);
        d = atomic_load(&pool->done);
    }
    SMOE_PROF_ADD(SMOE_P_POOL_WAIT, SMOE_PROF_NOW() - wait0);
    SMOE_PROF_ADD(SMOE_P_POOL_RUNS, 0.0);
}

#if SMOE_PROFILE
#include <time.h>

int smoe_prof_cpu;

double smoe_prof_now(void) {
    if (!smoe_prof_cpu) return smoe_now();
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

double smoe_prof_s[SMOE_P_COUNT];
uint64_t smoe_prof_n[SMOE_P_COUNT];
double smoe_prof_mark;
const char *const smoe_prof_names[SMOE_P_COUNT] = {
    "embed", "norm", "qx_prepare", "q,k,v products", "q/k norm, rope", "attention", "linear attention",
    "o_proj + residual",
    "router product", "routing", "gather/scatter, streamer", "expert gate+up", "swiglu", "expert down",
    "top-k combine", "lm_head", "logits, sampling", "(pool wait, nested)", "(pool runs, count)"};
#endif
