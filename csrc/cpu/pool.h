/* pool.h — the compute worker pool. The caller is worker 0; threads−1 others wait for work. */
#ifndef SMOE_POOL_H
#define SMOE_POOL_H

#include "internal.h"

typedef struct smoe_pool smoe_pool;

/* Least stack a worker thread gets (the caller's own thread needs as much: smoe.h says so). */
enum { SMOE_WORKER_STACK = 1 << 20 };

/* fn handles items [begin, end) as worker `worker` (0 ≤ worker < threads). */
typedef void (*smoe_task_fn)(void *ctx, uint32_t begin, uint32_t end, uint32_t worker);

smoe_status smoe_pool_new(uint32_t threads, smoe_pool **out);
void smoe_pool_free(smoe_pool *pool);
uint32_t smoe_pool_threads(const smoe_pool *pool);

/* Splits [0, n) into contiguous chunks (boundaries at multiples of grain except at n; a few a
 * thread), which the threads, the caller among them, claim one after another and run in parallel;
 * returns when all are done. fn may be called several times a run on one thread, with its own
 * worker number each time. Never allocates. Not reentrant: fn must not call smoe_pool_run. */
void smoe_pool_run(smoe_pool *pool, smoe_task_fn fn, void *ctx, uint32_t n, uint32_t grain);

#endif
