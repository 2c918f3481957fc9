/* cpu_state.h — the CPU backend's share and session state (backend_cpu.c, products.c). */
#ifndef SMOE_CPU_STATE_H
#define SMOE_CPU_STATE_H

#include "backend.h"
#include "cpu/kernels.h"
#include "cpu/pool.h"

typedef struct {
    smoe_pool *pool;
    const smoe_layout *lay;
    const smoe_vault *vault; /* rows of a paged embedding */
} cpu_share;

/* The most experts products.c runs in one batch (their products two pool runs, gate and up of
 * all, then down of all); the tile plane holds their codes packed one expert apart. */
enum { CPU_BATCH_EXPERTS = 64 };

typedef struct {
    cpu_share *sh;
    smoe_pool *pool;       /* sh->pool */
    const smoe_layout *lay;
    const smoe_config *cfg;
    uint32_t context, chunk;
    uint32_t q_dim;        /* heads · head_dim */
    uint32_t kv_dim;       /* kv_heads · head_dim */
    uint32_t ffn;          /* max(intermediate_size, moe_intermediate_size, the shared expert's) */
    smoe_kv_dtype kv_dtype;
    size_t kv_elem;        /* bytes per element of kv_dtype */
    bool float_activations;
    const float *rope_cos, *rope_sin; /* (context, head_dim/2), the engine's */
    smoe_act act;          /* the experts' activation */
    uint32_t pos0;         /* the staged pass's first position (plus r0 after rows_at(r0)) */
    uint32_t r0;           /* rows_at's first row: the row planes below and ids start there */
    int32_t *ids;          /* (chunk) its ids */
    uint8_t *row_scratch;  /* a paged embedding's page and row (smoe_vault_row_scratch_bytes); NULL without */

    void *k_cache, *v_cache; /* (layers, context, kv_dim) of kv_dtype; K after norm and RoPE */

    /* Activation planes: rows for `chunk` tokens */
    float *x;        /* (chunk, hidden) residual stream: SMOE_PL_X */
    float *xn;       /* (chunk, hidden) normed input of the current block: SMOE_PL_XN */
    float *q;        /* (chunk, q_dim): SMOE_PL_Q */
    float *k, *v;    /* (chunk, kv_dim) the new K and V rows: SMOE_PL_K, SMOE_PL_V */
    float *att;      /* (chunk, q_dim) attention output, heads concatenated: SMOE_PL_ATT */
    float *yg;       /* (chunk, hidden) a block's output (SMOE_PL_Y); in the MoE step one expert's
                        output rows, then combine's scratch row */
    float *scores;   /* (threads, context) attention scratch, one row per worker */
    float *router;   /* (chunk, experts) router logits, then probabilities */
    float *topk_w;   /* (chunk, top_k) */
    float *route_scratch; /* (experts) the grouped router's choice scores */
    float *slot_out; /* (chunk, top_k, hidden) each routed expert's output, summed in slot order */
    float *xg;       /* (chunk, hidden) the rows routed to one expert, gathered */
    uint32_t *xrow;  /* (chunk) a batch of experts' input rows: the row of xn each one is */
    float *hg;       /* (chunk, 2·ffn) gate rows then up rows of one expert / dense MLP */
    float *h;        /* (chunk, ffn) silu(gate)·up */
    void *qx_codes;  /* (chunk, ·) the input of the next q8/q4 product as 8-bit codes (kernels.h) */
    float *qx_d;     /* (chunk, ·) their block scales */
    float *qx_gsum;  /* (chunk, ·) their group sums */
    void *qx_tiles;  /* the same codes packed for the AMX kernel (smoe_qx_tiles), or NULL: no AMX here */
    size_t qx_tiles_bytes;
    float *logits;   /* (SMOE_LOGIT_ROWS, vocab) */
    float *bias;     /* (bias_rows + heads) one product's bias row widened, then attention's sink logits */
    uint32_t bias_rows;

    /* Gated attention, a shared expert's gate and the Gated DeltaNet (linear attention) */
    float *gate;     /* (chunk, max(q_dim, lin value dim)) SMOE_PL_GATE */
    float *mix;      /* (chunk, conv_dim) SMOE_PL_MIX: q, k, v before the convolution, then after it */
    float *beta;     /* (chunk, v_heads) SMOE_PL_BETA */
    float *decay;    /* (chunk, v_heads) SMOE_PL_DECAY */
    float *sgate;    /* (chunk, 1) SMOE_PL_SGATE */
    smoe_linear_shape lin;
    uint32_t conv_dim, n_linear;
    const int32_t *linear_index; /* (layers) the engine's: layer l's state, −1 none */
    /* The states a session carries from one position to the next, one per linear layer, and the
     * snapshot the engine rewinds to (engine/session.c says when it is taken). */
    float *lin_s;    /* (n_linear, v_heads, k_dim, v_dim) recurrent states */
    float *lin_conv; /* (n_linear, conv_kernel − 1, conv_dim) the convolution's last inputs, oldest first */
    float *snap_s, *snap_conv; /* their snapshot */
    float *lin_w;    /* (conv_dim·conv_kernel + 2·v_heads + v_dim) a layer's conv, A_log, dt_bias, norm widened */
    float *lin_row;  /* (conv_dim) one convolved row */
    float *lin_scratch; /* (threads, v_dim) the delta rule's scratch per worker */
} cpu_state;

/* y (n, W.rows) = x (n, W.cols) · Wᵀ, rows split over the worker pool. stage: the smoe_prof_stage
 * its time counts in when the profiler is compiled in (prof.h). (products.c) */
void smoe_cpu_linear(cpu_state *c, int stage, const smoe_tensor *W, const uint8_t *w, const float *x, uint32_t n,
                     float *y);

/* The plane p's rows. */
static inline float *smoe_cpu_plane(cpu_state *c, smoe_plane p) {
    switch (p) {
    case SMOE_PL_X: return c->x;
    case SMOE_PL_XN: return c->xn;
    case SMOE_PL_Q: return c->q;
    case SMOE_PL_K: return c->k;
    case SMOE_PL_V: return c->v;
    case SMOE_PL_ATT: return c->att;
    case SMOE_PL_Y: return c->yg;
    case SMOE_PL_GATE: return c->gate;
    case SMOE_PL_MIX: return c->mix;
    case SMOE_PL_BETA: return c->beta;
    case SMOE_PL_DECAY: return c->decay;
    case SMOE_PL_SGATE: return c->sgate;
    }
    return NULL;
}


/* products.c's ops (backend.h) */
smoe_status smoe_cpu_project(void *b, smoe_plane src, const smoe_proj *out, uint32_t n_out, uint32_t n);
smoe_status smoe_cpu_mlp(void *b, smoe_plane dst, smoe_plane src, const smoe_tensor *gate, const smoe_tensor *up,
                         const smoe_tensor *down, uint32_t n);
smoe_status smoe_cpu_route(void *b, const smoe_route *r, uint32_t n, int32_t *ids);
smoe_status smoe_cpu_route_grouped(void *b, const smoe_tensor *router, const smoe_tensor *bias, uint32_t K, bool renorm,
                                   uint32_t n, int32_t *ids);
smoe_status smoe_cpu_experts(void *b, const smoe_union *u, const uint32_t *items, uint32_t m);
smoe_status smoe_cpu_combine(void *b, uint32_t K, uint32_t n);

#endif
