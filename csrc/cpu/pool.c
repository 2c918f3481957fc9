/* pool.c — the compute worker pool (pool.h).
 *
 * threads − 1 persistent workers; the caller of smoe_pool_run is worker 0. A run is published
 * through one atomic generation counter: the caller writes the task (fn, ctx, n, grain), sets
 * `pending` to the number of workers, re-arms one claim flag per worker range, and increments
 * `gen`. Workers watching `gen` see the new value, claim their range (an atomic exchange on
 * its flag), run it and decrement `pending`. The caller runs range 0 and then claims every
 * range still unclaimed and runs it itself: when there are more threads than free cores (or a
 * worker is slow to wake), the work does not wait for a descheduled thread. Which thread runs a
 * range never changes its result (kernels.h), only who does the arithmetic. No mutex is taken
 * on this path.
 *
 * A worker that saw generation k and was descheduled may claim a range of run k+1: the caller
 * writes the task before re-arming the flags, and the claim's acquire makes it visible, so the
 * worker runs run k+1's range correctly and counts it in run k+1's `pending`.
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
#include <signal.h>
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

typedef struct {
    smoe_pool *pool;
    uint32_t index; /* worker number, 1 .. threads−1 */
} worker_arg;

struct smoe_pool {
    uint32_t threads;
    pthread_t *tids;      /* (threads − 1) */
    worker_arg *args;     /* (threads − 1) */
    uint32_t started;     /* workers created so far */

    /* the task of the current generation: written by the caller before gen is bumped */
    smoe_task_fn fn;
    void *ctx;
    uint32_t n, grain;

    _Atomic uint32_t gen;             /* bumped once per run (and once at shutdown) */
    _Atomic uint32_t *claimed;        /* (threads) per range: 0 armed, 1 taken; [0] unused */
    _Atomic uint32_t pending;         /* workers still running this generation */
    _Atomic uint32_t sleepers;        /* workers asleep (or about to be) on gen */
    _Atomic uint32_t caller_sleeping; /* the caller asleep (or about to be) on pending */
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

/* Range of worker w: the ceil(n/grain) grains are dealt out as evenly as possible, the lower
 * workers taking the extra ones, so with little work the caller (worker 0) gets some. */
static void worker_range(uint32_t n, uint32_t grain, uint32_t threads, uint32_t w, uint32_t *begin, uint32_t *end) {
    const uint64_t grains = ((uint64_t)n + grain - 1) / grain;
    const uint64_t base = grains / threads, extra = grains % threads;
    const uint64_t g0 = w * base + (w < extra ? w : extra);
    const uint64_t g1 = g0 + base + (w < extra ? 1 : 0);
    const uint64_t b = g0 * grain, e = g1 * grain;
    *begin = (uint32_t)(b < n ? b : n);
    *end = (uint32_t)(e < n ? e : n);
}

static void run_range(smoe_pool *p, uint32_t w) {
    uint32_t b, e;
    worker_range(p->n, p->grain, p->threads, w, &b, &e);
    if (b < e) p->fn(p->ctx, b, e, w);
}

/* Runs range w unless someone already took it; true if this thread ran it. */
static bool claim_and_run(smoe_pool *p, uint32_t w) {
    if (atomic_exchange_explicit(&p->claimed[w], 1, memory_order_acq_rel) != 0) return false;
    run_range(p, w);
    return true;
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
        if (claim_and_run(p, a->index) && atomic_fetch_sub(&p->pending, 1) == 1 && atomic_load(&p->caller_sleeping))
            word_wake(p, &p->pending);
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
    smoe_free(pool->claimed);
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
    atomic_init(&p->pending, 0);
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
    p->claimed = smoe_alloc(sizeof *p->claimed * threads, 64);
    if (!p->tids || !p->args || !p->claimed) {
        smoe_pool_free(p);
        return smoe_fail(SMOE_ERR_NOMEM, "worker pool: out of memory");
    }
    /* Workers block every signal, so the host (Python's SIGINT handling) sees them on its own
     * threads; they inherit the mask of the creating thread. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    /* The kernels keep blocks of unpacked weights and tokens' codes on the stack (up to ~300 KB:
     * the AVX2 q8 product in lanes by block): give workers a stack of at least SMOE_WORKER_STACK
     * whatever the platform's default (musl's is 128 KB). The calling thread runs range 0 on its
     * own stack, which needs as much. */
    pthread_attr_t attr;
    int err = pthread_attr_init(&attr);
    size_t stack = 0;
    if (!err && pthread_attr_getstacksize(&attr, &stack) == 0 && stack < SMOE_WORKER_STACK)
        pthread_attr_setstacksize(&attr, SMOE_WORKER_STACK);
    for (uint32_t i = 0; !err && i < threads - 1; i++) {
        p->args[i].pool = p;
        p->args[i].index = i + 1;
        err = pthread_create(&p->tids[i], &attr, worker_main, &p->args[i]);
        if (err) break;
        p->started++;
    }
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
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
    pool->fn = fn;
    pool->ctx = ctx;
    pool->n = n;
    pool->grain = grain;
    atomic_store(&pool->pending, pool->threads - 1);
    for (uint32_t w = 1; w < pool->threads; w++) /* seq_cst: after the task fields above */
        atomic_store(&pool->claimed[w], 0);
    publish(pool);
    run_range(pool, 0);
    for (uint32_t w = 1; w < pool->threads; w++)
        if (claim_and_run(pool, w)) atomic_fetch_sub(&pool->pending, 1);
    const double wait0 = SMOE_PROF_NOW();
    (void)wait0;
    uint32_t left, rounds = 0;
    while ((left = atomic_load_explicit(&pool->pending, memory_order_acquire)) != 0) {
        if (spin(&rounds)) continue;
        atomic_store(&pool->caller_sleeping, 1);
        if ((left = atomic_load(&pool->pending)) != 0) word_wait(pool, &pool->pending, left);
        atomic_store(&pool->caller_sleeping, 0);
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
