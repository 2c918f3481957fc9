/* session.h — a session's state, and the layer math that both prefill paths share.
 *
 * The token-serial step (decode.c) and the layer-major prefill (prefill.c) differ only in the
 * order of their loops: token-serial runs every layer for one token, layer-major runs one layer
 * for every token of a chunk. Both call the same block functions below with n tokens (n = 1
 * for the serial step), and every kernel computes each output element the same way whatever n
 * is (kernels.h), which is what makes the two paths bit-identical. */
#ifndef SMOE_SESSION_H
#define SMOE_SESSION_H

#include "backend.h"
#include "kernels.h"
#include "pool.h"
#include "sample.h"
#include "streamer.h"
#include "vault.h"

#include <pthread.h>
#include <stdatomic.h>

/* The worker pool and streamer (retention cache) of one or more sessions. smoe_session_new makes
 * one per session; smoe_session_new_shared makes the new session hold its sibling's, counted in
 * refs, so they are freed with the last session that holds them, in whatever order sessions are
 * freed. Their compute side is single-threaded (pool.h, streamer.h): every call that runs the
 * pool or touches the streamer holds mu (smoe_share_lock), so sessions of one share run such
 * calls one at a time, in whatever threads. */
typedef struct {
    _Atomic uint32_t refs;
    pthread_mutex_t mu;
    smoe_pool *pool;
    smoe_streamer *streamer; /* NULL when the model has no sparse layer */
    uint64_t batch_steps, batch_tokens, batch_blob_reads; /* smoe_decode_batch: calls, tokens, reads */
} smoe_share;

struct smoe_session {
    smoe_vault *vault;
    const smoe_layout *lay;
    smoe_config cfg;
    smoe_session_params params;
    smoe_share *share;       /* pool and streamer, maybe shared with other sessions */
    smoe_pool *pool;         /* share->pool */
    smoe_streamer *streamer; /* share->streamer: NULL when the model has no sparse layer */
    smoe_sampler sampler;
    const smoe_backend *backend; /* the device that runs the layers (backend.h) */
    void *backend_state;         /* the backend's own, made by backend->init */

    uint32_t pos;    /* tokens in the KV cache; stored with set_pos (smoe_session_position loads it) */
    bool broken;
    _Atomic int busy;   /* 1 while a call runs (smoe_session_enter .. smoe_session_leave) */
    _Atomic int cancel; /* set by smoe_session_cancel, cleared by smoe_session_enter */
    uint32_t q_dim;  /* heads · head_dim */
    uint32_t kv_dim; /* kv_heads · head_dim */
    uint32_t ffn;    /* max(intermediate_size, moe_intermediate_size) */

    /* KV cache and positions */
    void *k_cache, *v_cache; /* (layers, context, kv_dim) of params.kv_dtype; K after norm and RoPE */
    size_t kv_elem;          /* bytes per element of params.kv_dtype */
    float *k_new, *v_new;    /* (chunk, kv_dim) K and V of the tokens being appended, in f32 before
                                they are rounded into the cache; NULL for f32 (they go straight in) */
    float *rope_cos, *rope_sin; /* (context, head_dim/2) */
    int32_t *history;         /* (context) ids at each position */

    /* Activation planes: rows for `chunk` tokens */
    float *x;        /* (chunk, hidden) residual stream */
    float *xn;       /* (chunk, hidden) normed input of the current block; reused for block outputs */
    float *q;        /* (chunk, q_dim) */
    float *att;      /* (chunk, q_dim) attention output, heads concatenated */
    float *scores;   /* (threads, context) attention scratch, one row per worker */
    float *router;   /* (chunk, experts) router logits, then probabilities */
    int32_t *topk_idx; /* (chunk, top_k) */
    float *topk_w;   /* (chunk, top_k) */
    float *slot_out; /* (chunk, top_k, hidden) each routed expert's output, summed in slot order */
    float *xg;       /* (chunk, hidden) the rows routed to one expert, gathered */
    float *hg;       /* (chunk, 2·ffn) gate rows then up rows of one expert / dense MLP */
    float *h;        /* (chunk, ffn) silu(gate)·up */
    float *yg;       /* (chunk, hidden) one expert's output rows */
    void *qx_codes;  /* (chunk, ·) the input of the next q8/q4 product as 8-bit codes (kernels.h) */
    float *qx_d;     /* (chunk, ·) their block scales */
    float *qx_gsum;  /* (chunk, ·) their group sums */
    float *logits;   /* (vocab) */
    float *sample_f; /* (vocab) sampler scratch */
    int32_t *sample_i; /* (vocab) */

    /* The union of one layer (chunk): experts in order of first appearance */
    uint32_t *exp_count;  /* (experts) tokens routed to each */
    uint32_t *exp_rows;   /* (experts, chunk) t·top_k + slot of each routed (token, slot) */
    int32_t *union_list;  /* (experts) */
    int32_t *union_slot;  /* (experts) streamer slot per union position, −1 before acquire */
    uint32_t *pending;    /* (experts) union positions holding a slot, not yet computed */
    int *pending_slots;   /* (experts) their slots, for smoe_streamer_wait_any */
    uint32_t *union_sizes; /* (layers) of the last prefill */
    uint64_t *expert_counts; /* (layers, experts) tokens routed to each, since the last stats reset */

    /* Counters that are not the streamer's */
    double prefill_s, decode_s;
    uint64_t tokens_prefilled, tokens_decoded;
    uint64_t plane_bytes, kv_bytes;
};

/* y (n, W.rows) = x (n, W.cols) · Wᵀ, rows split over the worker pool. stage: the smoe_prof_stage
 * its time counts in when the profiler is compiled in (prof.h). */
void smoe_linear(smoe_session *s, int stage, const smoe_tensor *W, const uint8_t *w, const float *x, uint32_t n,
                 float *y);

/* Row pos of layer l in a KV cache (k_cache or v_cache). */
static inline void *smoe_kv_row(const smoe_session *s, void *cache, uint32_t l, uint32_t pos) {
    return (uint8_t *)cache + ((size_t)l * s->params.context + pos) * s->kv_dim * s->kv_elem;
}

/* x rows [0, n) ← embedding rows of ids. */
void smoe_embed(smoe_session *s, const int32_t *ids, uint32_t n);

/* Attention block of layer l for tokens at positions pos0 .. pos0+n−1: norm, QKV, QK-norm,
 * RoPE, K/V append, causal attention, o_proj, residual. */
void smoe_attention_block(smoe_session *s, uint32_t l, uint32_t pos0, uint32_t n);

/* FFN block of layer l (sparse: routing + experts; dense: MLP), residual included. The number
 * of distinct experts the n tokens used goes to *union_size (0 for a dense layer). On failure
 * every slot it pinned is released. */
smoe_status smoe_ffn_block(smoe_session *s, uint32_t l, uint32_t n, uint32_t *union_size);

/* Claims the session for one ABI call (smoe.h, Threading): SMOE_ERR_BUSY, touching nothing,
 * when another call holds it; otherwise clears any cancel request. fn names the call. */
static inline smoe_status smoe_session_enter(const smoe_session *cs, const char *fn) {
    smoe_session *s = (smoe_session *)cs; /* the claim is not part of the session's value */
    int idle = 0;
    if (!atomic_compare_exchange_strong_explicit(&s->busy, &idle, 1, memory_order_acquire, memory_order_relaxed))
        return smoe_fail(SMOE_ERR_BUSY, "%s: another call is running on this session", fn);
    atomic_store_explicit(&s->cancel, 0, memory_order_relaxed);
    return SMOE_OK;
}

/* Releases the claim and passes st through, so a call ends `return smoe_session_leave(s, st);`. */
static inline smoe_status smoe_session_leave(const smoe_session *cs, smoe_status st) {
    atomic_store_explicit(&((smoe_session *)cs)->busy, 0, memory_order_release);
    return st;
}

/* SMOE_ERR_CANCELLED with a message when smoe_session_cancel asked the running call to stop. */
static inline smoe_status smoe_session_check_cancel(const smoe_session *s, uint32_t layer) {
    if (!atomic_load_explicit(&((smoe_session *)s)->cancel, memory_order_relaxed))
        return SMOE_OK;
    return smoe_fail(SMOE_ERR_CANCELLED, "cancelled in layer %u (smoe_session_cancel); position %u unchanged", layer,
                     s->pos);
}

/* The position a finished call leaves, published for smoe_session_position's atomic load. */
static inline void smoe_session_set_pos(smoe_session *s, uint32_t pos) { __atomic_store_n(&s->pos, pos, __ATOMIC_RELEASE); }

/* Holds the session's share for a call that runs the pool or the streamer (smoe_share). */
static inline void smoe_share_lock(const smoe_session *s) { pthread_mutex_lock(&s->share->mu); }
static inline void smoe_share_unlock(const smoe_session *s) { pthread_mutex_unlock(&s->share->mu); }

/* Checks ids and room for n more tokens; SMOE_OK or an error with a message. */
smoe_status smoe_check_tokens(const smoe_session *s, const int32_t *ids, uint32_t n);

#endif
