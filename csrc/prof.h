/* prof.h — per-stage timers of the compute path, compiled in only with -DSMOE_PROFILE=1.
 *
 * Off (the library's build), every macro is empty: no clock is read, nothing is stored. On
 * (bench/decode_profile.c compiles the engine's sources with it), the caller's thread keeps one
 * mark: SMOE_PROF_LAP(stage) adds the time since the previous lap to `stage` and moves the mark,
 * so consecutive regions each end with a lap naming themselves and every second of a step is
 * counted once. The pool's wait (the caller idle after its own range, until the last worker
 * finishes) is counted apart, nested inside whichever product was running. Not thread-safe: one
 * session at a time, which is what the tool runs. */
#ifndef SMOE_PROF_H
#define SMOE_PROF_H

#include "internal.h"

typedef enum {
    SMOE_P_EMBED,     /* embedding rows */
    SMOE_P_NORM,      /* input, post-attention and final RMSNorm */
    SMOE_P_QX,        /* smoe_qx_prepare: activations to 8-bit codes */
    SMOE_P_QKV,       /* q, k, v products */
    SMOE_P_QKNORM,    /* per-head q/k norm, RoPE, KV rounding */
    SMOE_P_ATTEND,    /* attention over the cache */
    SMOE_P_LINEAR,    /* a Gated DeltaNet's convolution, q/k norms, delta rule and gated norm (its products in QKV) */
    SMOE_P_O,         /* o_proj product, residual add */
    SMOE_P_ROUTER,    /* router product */
    SMOE_P_ROUTE,     /* softmax, top-k, union bookkeeping, acquire/submit */
    SMOE_P_GATHER,    /* rows gathered for an expert / scattered back, streamer wait + release */
    SMOE_P_GATE_UP,   /* gate and up products of experts and dense MLPs */
    SMOE_P_SWIGLU,    /* silu(gate)·up */
    SMOE_P_DOWN,      /* down products */
    SMOE_P_COMBINE,   /* weighted sum of the top-k outputs, residual add */
    SMOE_P_LM_HEAD,   /* final lm_head product */
    SMOE_P_SAMPLE,    /* logits check, copy, sampling, bookkeeping */
    SMOE_P_LAPPED,    /* (end of the lapped stages) */
    SMOE_P_POOL_WAIT = SMOE_P_LAPPED, /* nested: caller waiting for workers inside smoe_pool_run */
    SMOE_P_POOL_RUNS, /* nested: smoe_pool_run calls that went to the workers (count only) */
    SMOE_P_COUNT
} smoe_prof_stage;

#if SMOE_PROFILE
extern double smoe_prof_s[SMOE_P_COUNT];
extern uint64_t smoe_prof_n[SMOE_P_COUNT];
extern double smoe_prof_mark;
extern const char *const smoe_prof_names[SMOE_P_COUNT];
/* the clock: monotonic seconds, or the calling thread's CPU seconds when smoe_prof_cpu is set (with
 * one thread, what the work cost whatever else the machine runs) */
extern int smoe_prof_cpu;
double smoe_prof_now(void);
#define SMOE_PROF_START() (smoe_prof_mark = smoe_prof_now())
#define SMOE_PROF_LAP(stage)                                                                                      \
    do {                                                                                                          \
        const double now_ = smoe_prof_now();                                                                           \
        smoe_prof_s[stage] += now_ - smoe_prof_mark;                                                              \
        smoe_prof_n[stage]++;                                                                                     \
        smoe_prof_mark = now_;                                                                                    \
    } while (0)
#define SMOE_PROF_ADD(stage, seconds) (smoe_prof_s[stage] += (seconds), smoe_prof_n[stage]++)
#define SMOE_PROF_NOW() smoe_prof_now()
#else
#define SMOE_PROF_START() ((void)0)
#define SMOE_PROF_LAP(stage) ((void)0)
#define SMOE_PROF_ADD(stage, seconds) ((void)0)
#define SMOE_PROF_NOW() 0.0
#endif

#endif
