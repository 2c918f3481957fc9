/* engine.h — a session as the engine keeps it, and the engine's parts that share it.
 *
 * The engine is everything above the backend seam (backend.h), written once for every device:
 *   session.c   creating and freeing sessions and shares, options, reset and rewind;
 *   stats.c     counters, union sizes, expert counts, cache clearing, KV access;
 *   layer.c     a model family's layer as a recipe of backend ops, read from the vault's parameters;
 *   moe.c       the MoE step: routing's ids → the union → each expert through the tiers → run → combine;
 *   pass.c      a pass over n rows (embedding, layers, logits): the token-serial step and the
 *               layer-major prefill (smoe_decode_step, smoe_prefill_chunk, smoe_prefill_rows);
 *   batch.c     smoe_decode_batch: several sessions' decode steps in one layer-major pass;
 *   sample.c    the sampler (sample.h).
 *
 * A session holds what is the session's whatever the device: its position and the ids there
 * (history), its sampler, the host-side bookkeeping of the MoE step, its counters, and its
 * backend state (planes and KV cache, on the device). Sessions made from one another hold one
 * share: the host retention cache (the streamer) and the backend's share (the device, its dense
 * weights, its expert cache, its worker pool or streams). */
#ifndef SMOE_ENGINE_H
#define SMOE_ENGINE_H

#include "backend.h"
#include "engine/sample.h"

#include <pthread.h>

#define SMOE_NO_POS UINT32_MAX /* a position nobody holds */
#include <stdatomic.h>

/* What sessions made from one another hold together, counted in refs, freed with the last of
 * them in whatever order. Its compute side is single-threaded (the streamer, a device): every
 * call that runs a pass or touches the caches holds mu (smoe_share_lock), so sessions of one
 * share run such calls one at a time, in whatever threads. */
typedef struct {
    _Atomic uint32_t refs;
    pthread_mutex_t mu;
    const smoe_backend *backend;
    void *be;                /* the backend's share (backend.h) */
    smoe_streamer *streamer; /* the host tier; NULL when the model has no sparse layer */
    smoe_session_params params; /* of the session that made it: threads, caches, device */
    uint64_t batch_steps, batch_tokens, batch_blob_reads; /* smoe_decode_batch: calls, tokens, reads */
} smoe_share;

/* The MoE step's host-side state for a pass of up to `chunk` rows (moe.c), sized at creation. */
typedef struct {
    int32_t *ids;          /* (chunk, K) routing's experts per row, best first */
    int32_t *pos_of;       /* (experts) union position of each expert in this layer, −1 if none */
    int32_t *expert;       /* (experts) the union: expert per position, in order of first appearance */
    uint32_t *start, *count; /* (experts) each position's rows in rows[] */
    uint32_t *rows;        /* (chunk·K) t·K + slot per position, grouped */
    const void **w;        /* (experts) each position's weights for the backend */
    int32_t *slot;         /* (experts) each position's host slot, −1 if none held */
    uint8_t *state;        /* (experts) moe.c's position states */
    uint32_t *pending;     /* (experts) positions holding a host slot, not yet run */
    int *pending_slots;    /* (experts) their slots, for smoe_streamer_wait_any */
    uint32_t *batch;       /* (experts) the positions of one `experts` call */
    int *held;             /* (experts) host slots whose device fills are not yet synced */
    int32_t *routed;       /* (layers, chunk·K) ids of the layers a device ran alone, from pass_end */
    bool *deferred;        /* (layers) which layers those are in the running pass */
    uint32_t *sizes_out;   /* (layers) where the running pass records its union sizes, or NULL */
    uint32_t size, next;   /* the running step's union so far; its first position not yet acquired */
    bool acquiring;        /* no acquire of the running step has yet found the streamer out of slots */
    uint32_t reads;        /* positions of the running step whose weights must come from the disk */
    bool streaming;        /* the running pass's last sparse layer read from the disk (true before
                              its first): the next one routes in parts (layer.c) */
} smoe_moe_state;

/* A family's recipe: what the layer (layer.c) and the MoE step (moe.c) do differently per model
 * family, as data, filled at session creation from the vault's parameters (session.c). */
typedef struct {
    smoe_router_kind route; /* the router's rule */
    smoe_act act;          /* the experts' activation */
    uint32_t window;       /* sliding layers' window (positions, the row's own included) */
    /* RoPE's frequencies: YaRN when yarn_factor > 1 (transformers' _compute_yarn_parameters) */
    double yarn_factor, yarn_original_max, yarn_beta_fast, yarn_beta_slow, yarn_attention_factor;
    bool yarn_truncate;
} smoe_recipe;

struct smoe_session {
    smoe_vault *vault;
    const smoe_layout *lay;
    smoe_config cfg;
    smoe_session_params params;
    smoe_recipe recipe;
    smoe_share *share;           /* the caches and the device, maybe shared with other sessions */
    const smoe_backend *backend; /* share->backend */
    void *be;                    /* this session's backend state: planes, KV cache */
    smoe_streamer *streamer;     /* share->streamer */
    smoe_sampler sampler;

    uint32_t pos;    /* tokens in the KV cache; stored with set_pos (smoe_session_position loads it) */
    bool broken;
    _Atomic int busy;   /* 1 while a call runs (smoe_session_enter .. smoe_session_leave) */
    int pid;            /* the process that made it (smoe_process_id): its pool's and streamer's threads are there */
    _Atomic int cancel; /* set by smoe_session_cancel, cleared by smoe_session_enter */

    int32_t *history;         /* (context) ids at each position */
    float *rope_cos, *rope_sin; /* (context, head_dim/2), given to the backend */
    void **row_be;            /* (chunk) a batch's sessions' backend states, row by row (batch.c) */
    float *sample_f;          /* (vocab) the sampler's scratch */
    int32_t *sample_i;        /* (vocab) */
    smoe_moe_state moe;
    uint32_t *union_sizes;    /* (layers) of the last prefill */
    uint64_t *expert_counts;  /* (layers, experts) tokens routed to each, since the last stats reset */

    /* Recurrent layers (Gated DeltaNet: Qwen3-Next, Qwen3.5-MoE). Their states live in the backend
     * state beside the KV cache, with one snapshot; see smoe_state_sync for how a rewind gets
     * the states of the position it returns to. */
    bool recurrent;           /* the model has linear-attention layers */
    uint32_t state_pos;       /* the position the live states hold; SMOE_NO_POS: unknown (a failed pass) */
    uint32_t snap_pos;        /* the snapshot's position; SMOE_NO_POS: none */
    int32_t *linear_index;    /* (layers) which recurrent state layer l uses, −1 none */

    /* Counters that are not the streamer's */
    double prefill_s, decode_s;
    uint64_t tokens_prefilled, tokens_decoded;
    uint64_t plane_bytes, kv_bytes; /* the backend's, and the engine's own host planes in plane_bytes */
};

/* ------------------------------------------------------------------------- passes (pass.c) */

/* The pass's end: waits for the device and settles what its layers deferred (expert counts,
 * union sizes into union_sizes when not NULL); owners: a batch's sessions row by row, or NULL. */
smoe_status smoe_pass_end(smoe_session *s, uint32_t n, smoe_session *const *owners, uint32_t *union_sizes);
/* The logits of rows[0..m) (m ≤ SMOE_LOGIT_ROWS) where the host reads them, checked to hold a
 * finite value (else SMOE_ERR_VAULT naming position `at`). */
smoe_status smoe_pass_logits(smoe_session *s, const uint32_t *rows, uint32_t m, uint32_t at, const float **out);
/* s's next id from logits (vocab floats: row `row` of the logits plane of backend state b — s's own,
 * or a batch's lead's): the device's selection where it has one, the draw here. After the history
 * holds the pass's ids. */
smoe_status smoe_pass_sample(smoe_session *s, void *b, uint32_t row, const float *logits, int32_t *next_id);
/* The backend op's status, marking the session broken when the device says its state is lost. */
static inline smoe_status smoe_be_status(smoe_session *s, smoe_status st) {
    if (st != SMOE_OK && s->backend->broken && s->backend->broken(s->be)) s->broken = true;
    return st;
}

/* The recurrent states brought to the session's position before a pass (nothing to do for a
 * model without linear attention, or when they are there already). How: a rewind (or reset, or a
 * failed or cancelled pass, which may have advanced some layers' states and not the position)
 * leaves the states behind; they are rebuilt by RECOMPUTATION from the nearest earlier state the
 * session holds — the snapshot taken at the end of the last prefill call, if it is at or before
 * the position, else position 0 — replaying the stored ids (history) through layer-major passes.
 * The replay gives the states bit for bit (layer-major = token-serial) and rewrites the KV rows
 * it passes with the bits they had. Why not snapshots at every chunk boundary: a state is
 * v_heads·k_dim·v_dim floats per linear layer (Qwen3.5-35B-A3B: 60 MiB per snapshot, 4K tokens
 * at chunk 256 would need 16 of them); one snapshot at the end of the prompt covers what chat
 * and the server do (they return to the end of the previous prompt or past it), and anything
 * else is still exact, only slower. On failure the states are unknown (state_pos SMOE_NO_POS). */
smoe_status smoe_state_sync(smoe_session *s);
/* After a pass that advanced the states to s->pos; prefill also keeps them as the snapshot. */
smoe_status smoe_state_advanced(smoe_session *s, bool snapshot);

/* ---------------------------------------------------------------------- layers (layer.c) */

/* SMOE_OK when the engine has the recipe of the vault's family (its attention kinds, its router)
 * and the backend every op it needs; else SMOE_ERR_UNSUPPORTED naming the family and what lacks. */
smoe_status smoe_recipe_check(const smoe_layout *lay, const smoe_backend *be);

/* Layer l of the model for rows [0, n) of s's planes: the attention block (each row at its
 * staged position), then the FFN block (the MoE step or a dense MLP), residuals included. rows
 * NULL: s's own pass; else a batch whose row t is session rows[t]'s token (its KV cache, its
 * position, its routing counts), s->row_be holding their backend states. */
smoe_status smoe_layer(smoe_session *s, uint32_t l, uint32_t n, smoe_session *const *rows);
smoe_status smoe_layer_attention(smoe_session *s, uint32_t l, uint32_t n, smoe_session *const *rows);
smoe_status smoe_layer_ffn(smoe_session *s, uint32_t l, uint32_t n, smoe_session *const *rows);

/* ----------------------------------------------------------------------- the MoE step (moe.c) */

/* The MoE step of sparse layer l over XN rows [0, n): routing, the union in order of first
 * appearance (each expert's read fired as it first enters), every union expert acquired through
 * the tiers and run on its rows as its weights arrive, combined into X in top-k order. Row t's
 * routing counts for owners[t] (NULL: for s). On failure every slot it held is released. */
smoe_status smoe_moe_step(smoe_session *s, uint32_t l, uint32_t n, smoe_session *const *owners);
/* The same step in pieces, for a layer that routes its rows a part at a time (layer.c): begin;
 * route for each part, in row order (rows [r0, r0 + nr) of XN as the backend's rows [0, nr), its
 * reads fired); then finish over all n rows (the experts as they arrive, combine). A failed route
 * has released what the step held; smoe_moe_drop releases it after a failure between routes. The
 * union, its order and every row's sum are those of the step in one piece. */
void smoe_moe_begin(smoe_session *s);
smoe_status smoe_moe_route(smoe_session *s, uint32_t l, uint32_t r0, uint32_t nr, smoe_session *const *owners);
smoe_status smoe_moe_finish(smoe_session *s, uint32_t l, uint32_t n);
void smoe_moe_drop(smoe_session *s);
/* Counts routed ids (n·K of layer l) for their rows' owners; the number of distinct experts. */
uint32_t smoe_moe_count(smoe_session *s, uint32_t l, uint32_t n, const int32_t *ids, smoe_session *const *owners);

/* ----------------------------------------------------------------------------- calls */

/* Claims the session for one ABI call (smoe.h, Threading): SMOE_ERR_BUSY, touching nothing,
 * when another call holds it; otherwise clears any cancel request. fn names the call. */
static inline smoe_status smoe_session_enter(const smoe_session *cs, const char *fn) {
    smoe_session *s = (smoe_session *)cs; /* the claim is not part of the session's value */
    if (s->pid != smoe_process_id()) /* a fork's child: the session's threads stayed in the parent */
        return smoe_fail(SMOE_ERR_INVALID_ARG,
                         "%s: this session was made in process %d and this is process %d, a fork of it: the "
                         "session's threads are not here; make a new session in this process",
                         fn, s->pid, smoe_process_id());
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

/* Holds the session's share for a call that runs a pass or touches the caches (smoe_share). */
static inline void smoe_share_lock(const smoe_session *s) { pthread_mutex_lock(&s->share->mu); }
static inline void smoe_share_unlock(const smoe_session *s) { pthread_mutex_unlock(&s->share->mu); }

/* Checks ids and room for n more tokens; SMOE_OK or an error with a message. */
smoe_status smoe_check_tokens(const smoe_session *s, const int32_t *ids, uint32_t n);

#endif
