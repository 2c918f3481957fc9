/* backend.h — the seam: what the engine (engine/) asks of a device, and nothing more.
 *
 * The engine owns every decision of a pass: which layers run and in what order (engine/layer.c's
 * recipe), the MoE step (engine/moe.c: routing's ids, each layer's union in order of first
 * appearance, acquiring each union expert through the tiers — disk → the host retention cache
 * (streamer.h) → this device's expert cache — running the experts as their weights arrive,
 * combining in top-k order), batching several sessions, sampling, counters. A backend supplies
 * buffers, uploads and the ops below, on planes of its own (smoe_plane), and knows nothing of
 * sessions, shares, the streamer's policy or the sampler:
 *
 *   cpu   (cpu/backend.c) the kernels of cpu/kernels.h on a worker pool, planes in host memory;
 *         no device tier: experts run from the host retention cache's slots.
 *   cuda  (cuda/, built by `make CUDA=1`) dense weights (once per share), KV cache and planes in
 *         VRAM; a VRAM expert cache as the device tier, filled from pinned host slots.
 *
 * Two kinds of state. A *share* (share_new) is what sessions made with smoe_session_new_shared
 * hold together: the device itself, its dense weights, its expert cache, its worker pool or
 * streams. A *session* state (session_new) is one session's planes and KV cache; it points at its
 * share. Sessions of one share run their calls one at a time (the engine holds the share's lock),
 * so a backend needs no lock of its own.
 *
 * The rule that keeps the two prefill paths bit-identical: every op computes each output element
 * in one order that depends on that element's own shape, never on n (the rows of the pass), on
 * which call of `experts` ran an expert, on the rows' owners, or on threads and stream timing. The
 * engine relies on it; two backends need not agree bit for bit with each other.
 *
 * Every op returns a status with a message; after a failure that leaves the device's state unknown
 * the backend's `broken` hook says so, and the engine marks the session broken (it must be reset).
 * Ops never allocate once a session exists.
 *
 * Adding a backend means one more table like cpu/backend_cpu.c's and one more case in
 * smoe_backend_for (backend.c): nothing above this header changes. */
#ifndef SMOE_BACKEND_H
#define SMOE_BACKEND_H

#include "streamer.h"
#include "vault.h"

/* The planes the recipe names; each holds rows for `chunk` tokens of a session. */
typedef enum {
    SMOE_PL_X,   /* (chunk, hidden) the residual stream */
    SMOE_PL_XN,  /* (chunk, hidden) the normed input of the current block */
    SMOE_PL_Q,   /* (chunk, heads·head_dim) queries */
    SMOE_PL_K,   /* (chunk, kv_heads·head_dim) the pass's new K rows, before they are stored */
    SMOE_PL_V,   /* (chunk, kv_heads·head_dim) its new V rows */
    SMOE_PL_ATT, /* (chunk, heads·head_dim) attention output, heads concatenated */
    SMOE_PL_Y,   /* (chunk, hidden) a block's output, before the residual add */
    SMOE_PL_GATE, /* (chunk, max(heads·head_dim, linear value dim)) an output gate: gated attention's,
                     or a Gated DeltaNet's z */
    SMOE_PL_MIX,  /* (chunk, linear conv dim) a Gated DeltaNet's q, k, v rows (before its convolution) */
    SMOE_PL_BETA, /* (chunk, linear value heads) its b rows (beta = sigmoid(b)) */
    SMOE_PL_DECAY, /* (chunk, linear value heads) its a rows (the decay's input) */
    SMOE_PL_SGATE, /* (chunk, 1) a shared expert's gate, before the sigmoid */
} smoe_plane;

/* A Gated DeltaNet's sizes (Qwen3-Next, Qwen3.5-MoE); all 0 for a model without linear attention.
 * Its q and k have k_heads heads of k_dim, its v and output v_heads heads of v_dim; value head h
 * reads key head h / (v_heads / k_heads) (grouped), or h mod k_heads when v_tiled (llama.cpp's
 * qwen35moe order). The convolution runs over conv_dim = 2·k_heads·k_dim + v_heads·v_dim channels
 * with conv_kernel taps. */
typedef struct {
    uint32_t k_heads, v_heads, k_dim, v_dim, conv_kernel;
    uint32_t v_tiled;
} smoe_linear_shape;

/* What a backend does to a session's recurrent states (`state`). */
typedef enum {
    SMOE_STATE_RESET,   /* every linear layer's recurrent and convolution state ← 0 (position 0) */
    SMOE_STATE_SAVE,    /* the snapshot ← the live states */
    SMOE_STATE_RESTORE, /* the live states ← the snapshot */
} smoe_state_op;

/* Floats per row of plane p (Q and ATT: heads·head_dim; K and V: kv_heads·head_dim; the rest the
 * hidden size), the same on every backend. */
static inline uint32_t smoe_plane_width(const smoe_config *cf, smoe_plane p) {
    switch (p) {
    case SMOE_PL_Q:
    case SMOE_PL_ATT: return cf->num_attention_heads * cf->head_dim;
    case SMOE_PL_K:
    case SMOE_PL_V: return cf->num_key_value_heads * cf->head_dim;
    default: return cf->hidden_size;
    }
}

/* One product of `project`: out rows = in rows · Wᵀ. */
typedef struct {
    const smoe_tensor *W;
    smoe_plane out;
} smoe_proj;

/* What `attend` does around the attention itself, per layer (the family's recipe says). */
typedef struct {
    const smoe_tensor *q_norm, *k_norm; /* 1 × head_dim each (QK-norm before RoPE), or NULL: none */
    const smoe_tensor *sinks;           /* 1 × heads: each head's sink logit (gpt-oss), or NULL */
    uint32_t window;                    /* positions a row sees, its own included; 0: all before it */
} smoe_attn;

/* How `route` turns the router's logits into K experts and their weights (kind: vault.h's
 * smoe_router_kind). */
typedef struct {
    const smoe_tensor *W;    /* experts × hidden */
    const smoe_tensor *bias; /* 1 × experts, added to the logits (SMOE_ROUTER_TOPK_SOFTMAX), or NULL */
    uint32_t K;
    smoe_router_kind kind;
    bool renorm;             /* SMOE_ROUTER_SOFTMAX_TOPK only */
} smoe_route;

/* The experts' activation between gate/up and down (smoe_be_session_params.act). */
typedef enum {
    SMOE_ACT_SILU = 0,           /* silu(gate) · up */
    SMOE_ACT_SWIGLU_CLAMPED = 1, /* gpt-oss: (clamp(up, ±limit) + 1) · g · sigmoid(alpha · g), g = min(gate, limit) */
} smoe_act_kind;

typedef struct {
    smoe_act_kind kind;
    float alpha, limit; /* SMOE_ACT_SWIGLU_CLAMPED's */
} smoe_act;

/* A layer's union as the engine formed it, for `experts`. */
typedef struct {
    uint32_t l;                      /* the layer */
    uint32_t n;                      /* rows of the pass */
    uint32_t size;                   /* union positions */
    const int32_t *expert;           /* (size) the expert at each position, in order of first appearance */
    const uint32_t *start, *count;   /* (size) position u's rows are rows[start[u] .. start[u] + count[u]) */
    const uint32_t *rows;            /* (n·K) t·K + slot, grouped by position, increasing within one */
    const void *const *w;            /* (size) each position's weights as the backend reads them: a host
                                        blob (no device tier) or the handle of the device tier's slot;
                                        valid for the positions handed to `experts` */
} smoe_union;

/* Sampling's candidates, chosen on the device (`select`): the draw among them is the engine's. */
enum { SMOE_SELECT_CAP = 1024 };
typedef struct {
    uint32_t count;                  /* 0: the draw ends at best (greedy and the like) */
    int32_t best;
    float m;                         /* the largest value of v */
    const int32_t *ids;              /* (count) best first */
    const float *vals;               /* (count) their values after the penalty and temperature */
} smoe_candidates;

typedef struct {
    const smoe_layout *lay;          /* weights; dense ones in host memory (tensor->data) */
    const uint8_t *dense;            /* the vault's dense region (lay->dense_bytes) */
    smoe_vault *vault;               /* a paged embedding's rows (smoe_vault_embed_row, smoe_vault_load_paged) */
    uint32_t threads;                /* compute threads (cpu) */
    uint64_t device_cache_bytes;     /* the device tier's budget (cuda: gpu_cache_bytes) */
    smoe_streamer *streamer;         /* the host tier, whose slots a device may pin; NULL without experts */
} smoe_be_share_params;

typedef struct {
    uint32_t context, chunk;
    smoe_kv_dtype kv_dtype;
    bool float_activations;
    const float *rope_cos, *rope_sin; /* (context, head_dim/2), the engine's, valid while the session lives */
    smoe_act act;                     /* the experts' activation (dense MLPs: silu always) */
    smoe_linear_shape linear;         /* the Gated DeltaNet's sizes; zeros: no linear layers */
    uint32_t n_linear;                /* linear-attention layers: a recurrent state (and a snapshot) each */
    const int32_t *linear_index;      /* (layers) which of them layer l is, −1 for the others; the engine's */
} smoe_be_session_params;

enum { SMOE_LOGIT_ROWS = 16 }; /* rows one `logits` call computes at most */

typedef struct smoe_backend {
    const char *name; /* "cpu", "cuda" */

    /* ------------------------------------------------------------------------------ buffers */
    smoe_status (*share_new)(const smoe_be_share_params *p, void **out);
    void (*share_free)(void *share);
    /* A session's planes and KV cache; *plane_bytes and *kv_bytes: what it allocated in host
     * memory for them, for smoe_counters (a device reports its VRAM through device_stats). */
    smoe_status (*session_new)(void *share, const smoe_be_session_params *p, void **out, uint64_t *plane_bytes,
                               uint64_t *kv_bytes);
    void (*session_free)(void *b); /* safe on what a failed session_new left (NULL too) */

    /* ------------------------------------------------------------------------ a pass's ops */
    /* The pass's ids (host array) and its first position, for embed and attend. */
    smoe_status (*stage)(void *b, const int32_t *ids, uint32_t n, uint32_t pos0);
    smoe_status (*embed)(void *b, uint32_t n); /* X rows [0, n) ← embedding rows of the staged ids */
    /* Optional. The ops that follow, up to the next call, see rows [r0, r0 + n) of the planes and of
     * the staged pass (positions pos0 + r0 on) as their rows [0, n); r0 = 0 restores the whole pass,
     * as `stage` does. Only the planes an attention block and routing touch (X, XN, Q, K, V, ATT,
     * Y, the routing's rows) need follow it: layer.c runs a layer's softmax attention and routing a
     * part of the rows at a time with it, so that the first part's expert reads are in flight while
     * the next part computes (engine/layer.c, "parts"); the experts and combine run at r0 = 0. NULL:
     * a layer runs in one part. */
    void (*rows_at)(void *b, uint32_t r0);
    /* dst rows = rmsnorm(src rows) · w (1 × the planes' width: hidden for X/XN/Y; Q or K for a
     * QK-norm over the whole projection, dst == src). */
    smoe_status (*norm)(void *b, smoe_plane dst, smoe_plane src, const smoe_tensor *w, uint32_t n);
    /* Each out[i].out rows = src rows · out[i].Wᵀ: several products of one input in one go. */
    smoe_status (*project)(void *b, smoe_plane src, const smoe_proj *out, uint32_t n_out, uint32_t n);
    /* Attention of layer l for rows [0, n): per head, the Q rows normed by a->q_norm and the K rows
     * by a->k_norm when they are given, both rotated (RoPE) for their positions; the K and V rows
     * stored in the KV cache at those positions (rounded to the cache's type); then ATT rows =
     * causal attention of Q over the cache, each row seeing the positions up to its own (the last
     * a->window of them when it is not 0), with head h's sink logit a->sinks[h] in the softmax's
     * denominator when sinks are given (smoe_attn). members NULL: the rows are b's own pass, row t
     * at position pos0 + t of b's cache. Else row t is the one row of session state members[t] (a
     * batch: its cache, its staged position, its cache's type; b's planes hold every row). */
    smoe_status (*attend)(void *b, uint32_t l, const smoe_attn *a, uint32_t n, void *const *members);
    smoe_status (*add)(void *b, smoe_plane dst, smoe_plane src, uint32_t n); /* dst += src (hidden) */
    /* dst rows (width floats each) *= sigmoid(gate rows): elementwise (gate_width == width) or by
     * one gate per row (gate_width 1). Gated attention's output gate, a shared expert's gate. */
    smoe_status (*sigmoid_gate)(void *b, smoe_plane dst, smoe_plane gate, uint32_t width, uint32_t gate_width,
                                uint32_t n);
    /* The Gated DeltaNet of linear-attention layer l (transformers' Qwen3NextGatedDeltaNet with its
     * torch fallbacks) for rows [0, n), IN TOKEN ORDER: MIX rows through the layer's causal
     * convolution (conv: conv_dim × conv_kernel; its state carried from the row before) and silu;
     * each q and k head L2-normed (q also scaled by 1/√k_dim); per value head h, g = −exp(a_log[h])
     * · softplus(DECAY + dt_bias[h]) and beta = sigmoid(BETA), the recurrent state decayed by exp(g)
     * and updated by the delta rule, read by q; ATT rows (v_heads·v_dim) ← each head's output
     * rmsnormed · norm (1 × v_dim) · silu(GATE rows). members as in attend: row t is the one row of
     * session state members[t], with its own states. The states advance by n rows. */
    smoe_status (*linear_attend)(void *b, uint32_t l, const smoe_tensor *conv, const smoe_tensor *a_log,
                                 const smoe_tensor *dt_bias, const smoe_tensor *norm, uint32_t n,
                                 void *const *members);
    /* The session's recurrent states (smoe_state_op). NULL with linear_attend NULL. */
    smoe_status (*state)(void *b, smoe_state_op op);
    /* dst rows += bias (1 × the plane's width, f32 or bf16). NULL: the backend lacks it (lacks says so). */
    smoe_status (*bias)(void *b, smoe_plane dst, const smoe_tensor *bias, uint32_t n);
    /* dst rows = down(silu(gate(src)) · up(src)): a dense MLP. */
    smoe_status (*mlp)(void *b, smoe_plane dst, smoe_plane src, const smoe_tensor *gate, const smoe_tensor *up,
                       const smoe_tensor *down, uint32_t n);
    /* XN rows through the router r (smoe_route: the product, its bias, then r->kind's rule; top-K
     * ties: lower index); ids (n·r->K, host) ← the chosen experts, best first per row; their
     * weights stay on the device for combine. */
    smoe_status (*route)(void *b, const smoe_route *r, uint32_t n, int32_t *ids);
    /* As route for router_kind 1 (vault parameters): sigmoid scores, bias (1 × experts) for
     * the choice, group-limited top K, renormalised when renorm, × routed_scaling_factor. NULL: the
     * backend lacks it. */
    smoe_status (*route_grouped)(void *b, const smoe_tensor *router, const smoe_tensor *bias, uint32_t K, bool renorm,
                                 uint32_t n, int32_t *ids);
    /* Before the first `experts` call of a union (NULL: nothing to do). */
    smoe_status (*experts_begin)(void *b, const smoe_union *u);
    /* The union positions items[0..m): each expert's FFN (the vault's expert gate, up, down) over
     * the XN rows routed to it, each output into its (t·K + slot) row of the routed outputs. Without
     * a device tier the op is done with u->w's host blobs when it returns. */
    smoe_status (*experts)(void *b, const smoe_union *u, const uint32_t *items, uint32_t m);
    /* X rows += Σ_k weight[t, k] · routed output (t·K + k), in slot order. */
    smoe_status (*combine)(void *b, uint32_t K, uint32_t n);
    /* The logits plane's rows [0, m) ← head(rmsnorm(X rows[i]) · norm), m ≤ SMOE_LOGIT_ROWS. */
    smoe_status (*logits)(void *b, const smoe_tensor *norm, const smoe_tensor *head, const uint32_t *rows,
                          uint32_t m);
    /* Those m rows (m × vocab) where the host can read them, until the next op. */
    smoe_status (*logits_read)(void *b, uint32_t m, const float **out);

    /* ----------------------------- the device tier: an expert cache in front of the host's */
    /* All NULL for a backend whose experts run from host memory. Handles are the backend's. */
    const void *(*tier_lookup)(void *b, uint32_t l, uint32_t e); /* retained: its handle (a use); NULL: a miss */
    const void *(*tier_claim)(void *b, uint32_t l, uint32_t e);  /* a slot for a miss (evicting), its handle */
    /* The host blob (from host slot `slot`) into the claimed slot, asynchronously; `experts` on that
     * position waits for it. The host slot may be released only after tier_sync. */
    smoe_status (*tier_fill)(void *b, const void *handle, const uint8_t *blob, int slot);
    smoe_status (*tier_sync)(void *b);                    /* every fill enqueued so far is done */
    void (*tier_drop)(void *b, const void *handle);       /* a claimed slot that was never filled */
    uint32_t (*tier_batch)(void *b);                      /* most fills one `experts` call may wait on */
    void (*tier_clear)(void *b);                          /* forget every retained expert */

    /* ---------------------- the MoE step on the device alone (NULL: the engine's walk always) */
    /* True when the device tier holds every expert of layer l, so moe_resident can run it. */
    bool (*tier_resident)(void *b, uint32_t l);
    /* route, union, experts and combine of layer l on the device, no host round trip; the routed
     * ids stay on the device until pass_end. Same bits as the engine's walk of the same layer. */
    smoe_status (*moe_resident)(void *b, uint32_t l, const smoe_route *r, uint32_t n);
    /* The end of a pass: waits for the device; routed (layers × n·K, host), when not NULL, gets the
     * ids of the layers that moe_resident ran in this pass (the other layers' entries untouched). */
    smoe_status (*pass_end)(void *b, uint32_t n, int32_t *routed);

    /* --------------------------- a recorded decode step (NULL: never recorded): the backend says
     * whether the walk that follows would run without the host (every sparse layer resident) */
    smoe_status (*replay)(void *b, bool *ran);            /* the recorded step, if any and still valid */
    smoe_status (*record_begin)(void *b, bool *recording);
    smoe_status (*record_end)(void *b, bool keep);

    /* ----------------------------------------------------------------------------- the rest */
    /* What of this vault's recipe the backend lacks (an op, a parameter it does not implement),
     * as a short phrase for the refusal's message, or NULL when it runs the vault. NULL hook: it
     * runs every recipe the engine runs. Called before share_new. */
    const char *(*lacks)(const smoe_layout *lay);
    /* Sampling's selection on the device over row `row` of the logits plane (NULL, or *done
     * false: the engine selects on the host): the cleaning, the repetition penalty over
     * window[0..w) and the top candidates as the engine's sampler (engine/sample.h) would choose. */
    smoe_status (*select)(void *b, uint32_t row, const smoe_sampler_params *p, const int32_t *window, uint32_t w,
                          smoe_candidates *out, bool *done);
    /* KV rows of layer [start, start + n) widened to f32 into k, v (either may be NULL). */
    smoe_status (*read_kv)(void *b, uint32_t layer, uint32_t start, uint32_t n, float *k, float *v);
    const char *(*describe)(void *b);                     /* one line: the device and its kernels */
    void (*device_stats)(void *b, smoe_device_counters *out); /* NULL: all zero */
    /* True once an op failed in a way that leaves the device's state unknown (the session must be
     * reset). NULL: never. */
    bool (*broken)(void *b);
} smoe_backend;

/* The backend for a smoe_device into *out; SMOE_ERR_UNSUPPORTED (this build has none) or
 * SMOE_ERR_INVALID_ARG (no such device), with a message, and *out NULL. (backend.c) */
smoe_status smoe_backend_for(smoe_device device, const smoe_backend **out);

#endif
