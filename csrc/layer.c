/* layer.c — the math of one decoder layer for n tokens, shared by both prefill paths.
 *
 * Qwen3-MoE as transformers implements Qwen3MoeDecoderLayer:
 *
 *   h  = x + o_proj(attention(rope(q_norm(q_proj(rms(x)))), rope(k_norm(k_proj(rms(x)))), v_proj(rms(x))))
 *   x' = h + ffn(rms(h))        ffn = Σ_k w_k · down(silu(gate(·)) · up(·)) over the top-k experts
 *                                     of softmax(router(·)), or a dense MLP on dense layers
 *
 * Each function here works on rows [0, n) of the session's planes. The serial step calls them
 * with n = 1; the layer-major prefill with the whole chunk. Nothing here depends on n for the
 * value of any row, which is the whole of the bit-identity argument:
 *   - matrix products go through smoe_matmul_rows, whose per-element reduction is fixed;
 *   - norms, RoPE, attention, routing are per token;
 *   - a token's expert outputs land in its own (token, slot) rows and are summed in slot order,
 *     never in the order blobs happened to arrive.
 *
 * Experts. For a sparse layer the tokens route in order; an expert's read is fired the moment
 * it first enters the layer's union (smoe_streamer_acquire), so the disk works while later
 * tokens still route. Then each union expert, as its blob arrives, is applied to all the tokens
 * routed to it: their rows are gathered, gate and up run as one product over the blob, then
 * down. When the streamer has no free slot, compute drains a ready expert and retries. One
 * token (decode) whose K slots were all acquired instead waits for its K blobs and runs two pool
 * runs: gate and up of all K experts, then down of all K (run_single_experts) — the same products,
 * so the same bits, with 2 wake-ups and barriers per layer instead of 2K; a prefill does the same
 * for its experts that one token chose whose blobs are in. q, k and v of one token share one run.
 */
#include "session.h"
#include "prof.h"

#include <math.h>
#include <string.h>

/* ------------------------------------------------------------------ matrix products on the pool */

typedef struct {
    const smoe_tensor *W;
    const uint8_t *w;
    const float *x;
    const smoe_qx *qx; /* x as 8-bit codes, or NULL: multiply the f32 x */
    uint32_t n;
    float *y;
    size_t ldy;
} linear_task;

static void matmul(const smoe_tensor *W, const uint8_t *w, const float *x, const smoe_qx *qx, uint32_t n, float *y,
                   size_t ldy, uint32_t r0, uint32_t r1) {
    if (qx)
        smoe_matmul_rows_qx(W, w, qx, n, y, ldy, r0, r1);
    else
        smoe_matmul_rows(W, w, x, W->cols, n, y, ldy, r0, r1);
}

static void linear_rows(void *ctx, uint32_t r0, uint32_t r1, uint32_t worker) {
    (void)worker;
    const linear_task *t = ctx;
    matmul(t->W, t->w, t->x, t->qx, t->n, t->y, t->ldy, r0, r1);
}

/* Several products in one pool run: part i is W[i] on its own input (f32 x[i] or codes qx[i]) into
 * y[i], its rows numbered after the previous parts' in the run's items. Which thread computes a
 * row never changes its value (kernels.h), so one run gives each part the bits it would get alone,
 * with one wake-up and one barrier instead of one per product. */
enum { MAX_PARTS = 128 };

typedef struct {
    const smoe_tensor *W;
    const uint8_t *w;
    const float *x;
    smoe_qx qx;     /* x as codes when has_qx */
    bool has_qx;
    float *y;
    uint32_t first; /* its first item in the run */
} product_part;

typedef struct {
    const product_part *parts;
    uint32_t n_parts;
} parts_task;

static void parts_rows(void *ctx, uint32_t r0, uint32_t r1, uint32_t worker) {
    (void)worker;
    const parts_task *t = ctx;
    uint32_t i = 0;
    while (i + 1 < t->n_parts && t->parts[i + 1].first <= r0) i++;
    for (; i < t->n_parts && r0 < r1; i++) {
        const product_part *p = &t->parts[i];
        const uint32_t end = p->first + p->W->rows, e = r1 < end ? r1 : end;
        if (r0 < e)
            matmul(p->W, p->w, p->x, p->has_qx ? &p->qx : NULL, 1, p->y, p->W->rows, r0 - p->first, e - p->first);
        r0 = e;
    }
}

/* What the session's qx planes hold: the codes of `x` for weights of `qx.wformat` and `qx.group`, or nothing
 * (x NULL). Products that share one input (q, k, v; gate, up) quantise it once. */
typedef struct {
    const float *x;
    smoe_qx qx;
} qx_planes;

/* x (n, W.cols) as the 8-bit codes W's product takes, prepared in the session's planes unless
 * they hold them already; NULL when W multiplies f32 inputs (f32/bf16 weights, or
 * float_activations). */
static const smoe_qx *prepare(smoe_session *s, const smoe_tensor *W, const float *x, uint32_t n, qx_planes *pl) {
    if (s->params.float_activations || (W->format != SMOE_FMT_Q8 && W->format != SMOE_FMT_Q4))
        return NULL;
    if (pl->x != x || pl->qx.cols != W->cols || pl->qx.wformat != W->format || pl->qx.group != W->group) {
        smoe_qx_prepare(x, W->cols, n, W->cols, W->format, W->group, s->qx_codes, s->qx_d, s->qx_gsum);
        SMOE_PROF_LAP(SMOE_P_QX);
        *pl = (qx_planes){x, {s->qx_codes, s->qx_d, s->qx_gsum, W->cols, W->group, W->format}};
    }
    return &pl->qx;
}

/* True when a and b take the same input codes (or both f32 inputs), so one prepare serves both. */
static bool same_codes(const smoe_tensor *a, const smoe_tensor *b) {
    return a->format == b->format && a->group == b->group && a->cols == b->cols;
}

/* Row grain keeps each thread's rows a multiple of 16: splits never cut a cache line of y. */
enum { ROW_GRAIN = 16 };

static void linear_with(smoe_session *s, int stage, const smoe_tensor *W, const uint8_t *w, const float *x, uint32_t n,
                        float *y, qx_planes *pl) {
    (void)stage; /* the profiler's (prof.h) */
    linear_task t = {W, w, x, prepare(s, W, x, n, pl), n, y, W->rows};
    smoe_pool_run(s->pool, linear_rows, &t, W->rows, ROW_GRAIN);
    SMOE_PROF_LAP(stage);
}

void smoe_linear(smoe_session *s, int stage, const smoe_tensor *W, const uint8_t *w, const float *x, uint32_t n,
                 float *y) {
    qx_planes pl = {0};
    linear_with(s, stage, W, w, x, n, y, &pl);
}

/* Gate and up of one expert (or dense MLP) in one dispatch: rows [0, I) are gate, [I, 2I) up;
 * output hg is (n, 2I) with gate in the first I columns. */
typedef struct {
    const smoe_tensor *gate, *up;
    const uint8_t *wg, *wu;
    const float *x;
    const smoe_qx *qg, *qu; /* x as codes for gate / up, or NULL */
    uint32_t n;
    float *y;
} gate_up_task;

static void gate_up_rows(void *ctx, uint32_t r0, uint32_t r1, uint32_t worker) {
    (void)worker;
    const gate_up_task *t = ctx;
    uint32_t I = t->gate->rows;
    size_t ld = 2 * (size_t)I;
    if (r0 < I)
        matmul(t->gate, t->wg, t->x, t->qg, t->n, t->y, ld, r0, r1 < I ? r1 : I);
    if (r1 > I)
        matmul(t->up, t->wu, t->x, t->qu, t->n, t->y + I, ld, (r0 > I ? r0 : I) - I, r1 - I);
}

/* out (n, hidden) = down(silu(gate(x)) · up(x)) for x (n, hidden). */
static void swiglu_mlp(smoe_session *s, const smoe_tensor *gate, const uint8_t *wg, const smoe_tensor *up,
                       const uint8_t *wu, const smoe_tensor *down, const uint8_t *wd, const float *x, uint32_t n,
                       float *out) {
    uint32_t I = gate->rows;
    qx_planes pl = {0};
    const smoe_qx *qg = prepare(s, gate, x, n, &pl);
    if (qg && up->format != gate->format && (up->format == SMOE_FMT_Q8 || up->format == SMOE_FMT_Q4)) {
        /* gate and up want different codes and there is one set of planes: one after the other */
        linear_task tg = {gate, wg, x, qg, n, s->hg, 2 * (size_t)I};
        smoe_pool_run(s->pool, linear_rows, &tg, I, ROW_GRAIN);
        linear_task tu = {up, wu, x, prepare(s, up, x, n, &pl), n, s->hg + I, 2 * (size_t)I};
        smoe_pool_run(s->pool, linear_rows, &tu, I, ROW_GRAIN);
    } else {
        /* up takes gate's codes (the same format), or its own when gate takes none */
        gate_up_task t = {gate, up, wg, wu, x, qg, NULL, n, s->hg};
        t.qu = prepare(s, up, x, n, &pl);
        smoe_pool_run(s->pool, gate_up_rows, &t, 2 * I, ROW_GRAIN);
    }
    SMOE_PROF_LAP(SMOE_P_GATE_UP);
    for (uint32_t i = 0; i < n; i++)
        smoe_swiglu(s->h + (size_t)i * I, s->hg + (size_t)i * 2 * I, s->hg + (size_t)i * 2 * I + I, I);
    SMOE_PROF_LAP(SMOE_P_SWIGLU);
    smoe_linear(s, SMOE_P_DOWN, down, wd, s->h, n, out);
}

/* --------------------------------------------------------------------------------- embedding */

void smoe_embed(smoe_session *s, const int32_t *ids, uint32_t n) {
    const smoe_tensor *E = s->lay->embed;
    for (uint32_t i = 0; i < n; i++)
        smoe_dequant_row(E, E->data, (uint32_t)ids[i], s->x + (size_t)i * s->cfg.hidden_size);
}

smoe_status smoe_check_tokens(const smoe_session *s, const int32_t *ids, uint32_t n) {
    if (s->broken)
        return smoe_fail(SMOE_ERR_SESSION_BROKEN, "the session is unusable after an earlier failure; reset it");
    for (uint32_t i = 0; i < n; i++)
        if (ids[i] < 0 || (uint32_t)ids[i] >= s->cfg.vocab_size)
            return smoe_fail(SMOE_ERR_BAD_TOKEN, "token id %d (index %u) is outside the vocabulary [0, %u)", ids[i],
                             i, s->cfg.vocab_size);
    if ((uint64_t)s->pos + n > s->params.context)
        return smoe_fail(SMOE_ERR_CONTEXT_FULL, "%u more tokens would pass the context of %u (position %u)", n,
                         s->params.context, s->pos);
    return SMOE_OK;
}

/* --------------------------------------------------------------------------------- attention */

typedef struct {
    smoe_session *s;
    uint32_t l, pos0;
} attend_task;

/* Items are (token, head) pairs; token t sees positions [0, pos0 + t]. */
static void attend_items(void *ctx, uint32_t i0, uint32_t i1, uint32_t worker) {
    const attend_task *t = ctx;
    smoe_session *s = t->s;
    const smoe_config *c = &s->cfg;
    uint32_t heads = c->num_attention_heads, hd = c->head_dim;
    uint32_t group = heads / c->num_key_value_heads;
    const uint8_t *kl = smoe_kv_row(s, s->k_cache, t->l, 0), *vl = smoe_kv_row(s, s->v_cache, t->l, 0);
    const size_t head_bytes = (size_t)hd * s->kv_elem;
    float *scratch = s->scores + (size_t)worker * s->params.context;
    for (uint32_t i = i0; i < i1; i++) {
        uint32_t tok = i / heads, h = i % heads, kvh = h / group;
        smoe_attend(s->att + (size_t)tok * s->q_dim + (size_t)h * hd, s->q + (size_t)tok * s->q_dim + (size_t)h * hd,
                    kl + kvh * head_bytes, vl + kvh * head_bytes, s->kv_dim, t->pos0 + tok + 1, hd,
                    s->params.kv_dtype, scratch);
    }
}

void smoe_attention_block(smoe_session *s, uint32_t l, uint32_t pos0, uint32_t n) {
    const smoe_config *c = &s->cfg;
    const smoe_layer_weights *L = &s->lay->layers[l];
    uint32_t H = c->hidden_size, hd = c->head_dim, half = hd / 2;
    float eps = c->rms_norm_eps;

    for (uint32_t t = 0; t < n; t++)
        smoe_rmsnorm(s->xn + (size_t)t * H, s->x + (size_t)t * H, L->input_norm, H, eps);
    SMOE_PROF_LAP(SMOE_P_NORM);

    /* K and V in f32 land straight in the cache rows of their positions; other types are
     * computed in the k_new/v_new planes and rounded into the cache below, before attention, so
     * every token (its own position included) attends over the stored values on both paths. */
    const bool f32 = s->params.kv_dtype == SMOE_KV_F32;
    float *krows = f32 ? smoe_kv_row(s, s->k_cache, l, pos0) : s->k_new;
    float *vrows = f32 ? smoe_kv_row(s, s->v_cache, l, pos0) : s->v_new;
    qx_planes pl = {0}; /* q, k and v share one quantisation of xn when their formats agree */
    if (n == 1 && same_codes(L->q, L->k) && same_codes(L->q, L->v)) {
        /* one token: the three products in one pool run */
        const smoe_qx *qx = prepare(s, L->q, s->xn, 1, &pl);
        product_part parts[3] = {{L->q, L->q->data, s->xn, {0}, qx != NULL, s->q, 0},
                                 {L->k, L->k->data, s->xn, {0}, qx != NULL, krows, L->q->rows},
                                 {L->v, L->v->data, s->xn, {0}, qx != NULL, vrows, L->q->rows + L->k->rows}};
        for (int i = 0; qx && i < 3; i++) parts[i].qx = *qx;
        parts_task t = {parts, 3};
        smoe_pool_run(s->pool, parts_rows, &t, L->q->rows + L->k->rows + L->v->rows, ROW_GRAIN);
        SMOE_PROF_LAP(SMOE_P_QKV);
    } else {
        linear_with(s, SMOE_P_QKV, L->q, L->q->data, s->xn, n, s->q, &pl);
        linear_with(s, SMOE_P_QKV, L->k, L->k->data, s->xn, n, krows, &pl);
        linear_with(s, SMOE_P_QKV, L->v, L->v->data, s->xn, n, vrows, &pl);
    }

    for (uint32_t t = 0; t < n; t++) {
        const float *cs = s->rope_cos + (size_t)(pos0 + t) * half;
        const float *sn = s->rope_sin + (size_t)(pos0 + t) * half;
        float *qt = s->q + (size_t)t * s->q_dim, *kt = krows + (size_t)t * s->kv_dim;
        for (uint32_t h = 0; h < c->num_attention_heads; h++)
            smoe_rmsnorm(qt + (size_t)h * hd, qt + (size_t)h * hd, L->q_norm, hd, eps);
        for (uint32_t h = 0; h < c->num_key_value_heads; h++)
            smoe_rmsnorm(kt + (size_t)h * hd, kt + (size_t)h * hd, L->k_norm, hd, eps);
        smoe_rope(qt, c->num_attention_heads, hd, cs, sn);
        smoe_rope(kt, c->num_key_value_heads, hd, cs, sn);
    }

    if (!f32) {
        smoe_kv_store(smoe_kv_row(s, s->k_cache, l, pos0), krows, (size_t)n * s->kv_dim, s->params.kv_dtype);
        smoe_kv_store(smoe_kv_row(s, s->v_cache, l, pos0), vrows, (size_t)n * s->kv_dim, s->params.kv_dtype);
    }

    SMOE_PROF_LAP(SMOE_P_QKNORM);

    attend_task at = {s, l, pos0};
    smoe_pool_run(s->pool, attend_items, &at, n * c->num_attention_heads, 1);
    SMOE_PROF_LAP(SMOE_P_ATTEND);

    smoe_linear(s, SMOE_P_O, L->o, L->o->data, s->att, n, s->xn);
    for (size_t i = 0; i < (size_t)n * H; i++)
        s->x[i] += s->xn[i];
    SMOE_PROF_LAP(SMOE_P_O);
}

/* ---------------------------------------------------------------------------------------- FFN */

/* Applies union expert u (its blob ready in slot) to every (token, slot) routed to it. */
static void run_expert(smoe_session *s, uint32_t e, const uint8_t *blob) {
    const smoe_layout *lay = s->lay;
    uint32_t H = s->cfg.hidden_size, K = s->cfg.num_experts_per_tok;
    uint32_t m = s->exp_count[e];
    const uint32_t *rows = s->exp_rows + (size_t)e * s->params.chunk;
    for (uint32_t j = 0; j < m; j++)
        memcpy(s->xg + (size_t)j * H, s->xn + (size_t)(rows[j] / K) * H, H * sizeof(float));
    SMOE_PROF_LAP(SMOE_P_GATHER);
    const smoe_tensor *g = &lay->expert[0], *u = &lay->expert[1], *d = &lay->expert[2];
    swiglu_mlp(s, g, blob + g->offset, u, blob + u->offset, d, blob + d->offset, s->xg, m, s->yg);
    for (uint32_t j = 0; j < m; j++)
        memcpy(s->slot_out + (size_t)rows[j] * H, s->yg + (size_t)j * H, H * sizeof(float));
    SMOE_PROF_LAP(SMOE_P_GATHER);
}

/* Experts routed exactly one (token, slot) each (every expert of a decode step; the one-token
 * experts of a short prefill) in two pool runs: gate and up of all of them, each on its token's
 * codes, then down of all, each on its own silu(gate)·up row (those rows quantised as tokens: per
 * row, the codes a one-row call gives). u[0..m): their union positions, slots held, m ≤ chunk and
 * 2m ≤ MAX_PARTS. Each output lands in its (token, slot) row of slot_out as run_expert puts it, by
 * the same kernel calls on the same inputs: the same bits. Their slots are released. */
static smoe_status run_single_experts(smoe_session *s, uint32_t n, const uint32_t *u, uint32_t m) {
    const smoe_layout *lay = s->lay;
    const smoe_tensor *g = &lay->expert[0], *up = &lay->expert[1], *d = &lay->expert[2];
    const uint32_t H = s->cfg.hidden_size, K = s->cfg.num_experts_per_tok, I = g->rows;
    product_part parts[MAX_PARTS];
    const uint8_t *blob[MAX_PARTS / 2];
    uint32_t row[MAX_PARTS / 2]; /* t·K + slot of each expert's one routed (token, slot) */
    for (uint32_t k = 0; k < m; k++) {
        smoe_status st = smoe_streamer_wait(s->streamer, s->union_slot[u[k]]);
        if (st != SMOE_OK) return st;
        blob[k] = smoe_streamer_data(s->streamer, s->union_slot[u[k]]);
        row[k] = s->exp_rows[(size_t)s->union_list[u[k]] * s->params.chunk];
    }
    SMOE_PROF_LAP(SMOE_P_GATHER);

    const bool codes = !s->params.float_activations && (g->format == SMOE_FMT_Q8 || g->format == SMOE_FMT_Q4);
    smoe_qx_size z = {0};
    if (codes) {
        z = smoe_qx_sizes(H, g->format, g->group);
        smoe_qx_prepare(s->xn, H, n, H, g->format, g->group, s->qx_codes, s->qx_d, s->qx_gsum);
        SMOE_PROF_LAP(SMOE_P_QX);
    }
    for (uint32_t k = 0; k < m; k++) {
        const uint32_t t = row[k] / K;
        float *hk = s->hg + (size_t)k * 2 * I;
        const smoe_qx qx = {(const uint8_t *)s->qx_codes + t * z.code_bytes, s->qx_d + t * z.d_floats,
                            s->qx_gsum + t * z.gsum_floats, H, g->group, g->format};
        parts[2 * k] = (product_part){g, blob[k] + g->offset, s->xn + (size_t)t * H, qx, codes, hk, 2 * k * I};
        parts[2 * k + 1] =
            (product_part){up, blob[k] + up->offset, s->xn + (size_t)t * H, qx, codes, hk + I, (2 * k + 1) * I};
    }
    parts_task task = {parts, 2 * m};
    smoe_pool_run(s->pool, parts_rows, &task, 2 * m * I, ROW_GRAIN);
    SMOE_PROF_LAP(SMOE_P_GATE_UP);

    for (uint32_t k = 0; k < m; k++)
        smoe_swiglu(s->h + (size_t)k * I, s->hg + (size_t)k * 2 * I, s->hg + (size_t)k * 2 * I + I, I);
    SMOE_PROF_LAP(SMOE_P_SWIGLU);

    const bool dcodes = !s->params.float_activations && (d->format == SMOE_FMT_Q8 || d->format == SMOE_FMT_Q4);
    if (dcodes) {
        z = smoe_qx_sizes(I, d->format, d->group);
        smoe_qx_prepare(s->h, I, m, I, d->format, d->group, s->qx_codes, s->qx_d, s->qx_gsum);
        SMOE_PROF_LAP(SMOE_P_QX);
    }
    for (uint32_t k = 0; k < m; k++) {
        const smoe_qx qx = {(const uint8_t *)s->qx_codes + k * z.code_bytes, s->qx_d + k * z.d_floats,
                            s->qx_gsum + k * z.gsum_floats, I, d->group, d->format};
        parts[k] = (product_part){d, blob[k] + d->offset, s->h + (size_t)k * I, qx, dcodes,
                                  s->slot_out + (size_t)row[k] * H, k * H};
    }
    task.n_parts = m;
    smoe_pool_run(s->pool, parts_rows, &task, m * H, ROW_GRAIN);
    SMOE_PROF_LAP(SMOE_P_DOWN);
    for (uint32_t k = 0; k < m; k++) {
        smoe_streamer_release(s->streamer, s->union_slot[u[k]]);
        s->union_slot[u[k]] = -1;
    }
    return SMOE_OK;
}

/* Releases every slot the union still pins (after a failure). */
static void release_union(smoe_session *s, uint32_t n_union) {
    for (uint32_t u = 0; u < n_union; u++)
        if (s->union_slot[u] >= 0) {
            smoe_streamer_release(s->streamer, s->union_slot[u]);
            s->union_slot[u] = -1;
        }
}

/* Waits for any acquired-but-not-computed union expert, runs it, releases its slot.
 * pending[0..*np) are union positions holding a slot. */
static smoe_status drain_one(smoe_session *s, uint32_t *pending, uint32_t *np, int *slots) {
    for (uint32_t i = 0; i < *np; i++)
        slots[i] = s->union_slot[pending[i]];
    uint32_t i = smoe_streamer_wait_any(s->streamer, slots, *np);
    uint32_t u = pending[i];
    int slot = s->union_slot[u];
    smoe_status st = smoe_streamer_wait(s->streamer, slot);
    if (st != SMOE_OK)
        return st;
    SMOE_PROF_LAP(SMOE_P_GATHER);
    run_expert(s, (uint32_t)s->union_list[u], smoe_streamer_data(s->streamer, slot));
    smoe_streamer_release(s->streamer, slot);
    s->union_slot[u] = -1;
    pending[i] = pending[--*np];
    return SMOE_OK;
}

/* Computes the union's experts as their blobs arrive, acquiring the rest as slots are released;
 * union positions [0, next_acquire) hold a slot already unless computed (slot −1). On failure
 * every slot is released. */
static smoe_status run_union(smoe_session *s, uint32_t l, uint32_t n_union, uint32_t next_acquire) {
    smoe_status st = SMOE_OK;
    /* the union positions [0, next_acquire) not yet computed are the pending ones */
    uint32_t *pending = s->pending;
    int *slots = s->pending_slots;
    uint32_t np = 0;
    for (uint32_t u = 0; u < next_acquire; u++)
        if (s->union_slot[u] >= 0)
            pending[np++] = u;
    while (np > 0 || next_acquire < n_union) {
        while (next_acquire < n_union) {
            int slot = smoe_streamer_acquire(s->streamer, l, (uint32_t)s->union_list[next_acquire]);
            if (slot < 0) {
                if (slot < -1) /* a key the streamer refuses: its message is already set */
                    st = SMOE_ERR_INTERNAL;
                break;
            }
            s->union_slot[next_acquire] = slot;
            pending[np++] = next_acquire++;
        }
        if (st != SMOE_OK)
            break;
        smoe_streamer_submit(s->streamer);
        if (np == 0) {
            /* No slot of ours is pending: the slots are held by reads a cancelled or failed
             * call left in flight. Wait for one to land, then acquire again. */
            if (smoe_streamer_settle(s->streamer))
                continue;
            st = smoe_fail(SMOE_ERR_INTERNAL, "layer %u: no streamer slot could be acquired", l);
            break;
        }
        /* a cancel need not wait for the rest of a layer's reads */
        if ((st = smoe_session_check_cancel(s, l)) != SMOE_OK || (st = drain_one(s, pending, &np, slots)) != SMOE_OK)
            break;
    }
    if (st != SMOE_OK)
        release_union(s, n_union);
    return st;
}

static smoe_status moe_block(smoe_session *s, uint32_t l, uint32_t n, uint32_t *union_size) {
    const smoe_config *c = &s->cfg;
    const smoe_layer_weights *L = &s->lay->layers[l];
    uint32_t E = c->num_experts, K = c->num_experts_per_tok, H = c->hidden_size;

    smoe_linear(s, SMOE_P_ROUTER, L->router, L->router->data, s->xn, n, s->router);

    /* Route in token order; fire each expert's read when it first enters the union. */
    memset(s->exp_count, 0, E * sizeof(uint32_t));
    uint32_t n_union = 0, next_acquire = 0;
    for (uint32_t t = 0; t < n; t++) {
        float *p = s->router + (size_t)t * E;
        smoe_softmax(p, E);
        smoe_topk(p, E, K, c->norm_topk_prob, s->topk_idx + (size_t)t * K, s->topk_w + (size_t)t * K);
        for (uint32_t k = 0; k < K; k++) {
            uint32_t e = (uint32_t)s->topk_idx[(size_t)t * K + k];
            s->expert_counts[(size_t)l * E + e]++;
            if (s->exp_count[e] == 0) {
                s->union_list[n_union] = (int32_t)e;
                s->union_slot[n_union] = -1;
                n_union++;
                /* Fire at once while slots allow; the rest are acquired as slots free up. */
                if (next_acquire == n_union - 1) {
                    int slot = smoe_streamer_acquire(s->streamer, l, e);
                    if (slot >= 0)
                        s->union_slot[next_acquire++] = slot;
                }
            }
            s->exp_rows[(size_t)e * s->params.chunk + s->exp_count[e]++] = t * K + k;
        }
    }
    *union_size = n_union;
    smoe_streamer_submit(s->streamer); /* the reads acquired above, coalesced where adjacent */
    SMOE_PROF_LAP(SMOE_P_ROUTE);

    const smoe_tensor *eg = &s->lay->expert[0], *eu = &s->lay->expert[1];
    smoe_status st = SMOE_OK;
    if (next_acquire == n_union && same_codes(eg, eu)) {
        /* every slot held: the experts with one routed (token, slot), two pool runs per batch; in a
         * prefill only those whose blob is in already (resident), so reads in flight still
         * overlap the other experts' compute in arrival order */
        const uint32_t cap = s->params.chunk < MAX_PARTS / 2 ? s->params.chunk : MAX_PARTS / 2;
        uint32_t *single = s->pending, m = 0; /* scratch until run_union */
        for (uint32_t u = 0; u < n_union && st == SMOE_OK; u++) {
            const bool in = n == 1 || smoe_streamer_ready(s->streamer, s->union_slot[u]);
            if (s->exp_count[s->union_list[u]] == 1 && in)
                single[m++] = u;
            if (m == cap || (m > 0 && u + 1 == n_union)) {
                st = run_single_experts(s, n, single, m);
                m = 0;
            }
        }
        if (st != SMOE_OK) {
            release_union(s, n_union);
            return st;
        }
    }
    if ((st = run_union(s, l, n_union, next_acquire)) != SMOE_OK)
        return st;

    /* Weighted sum in top-k slot order, then the residual. */
    for (uint32_t t = 0; t < n; t++) {
        float *acc = s->yg; /* (hidden) scratch: the expert outputs are all in slot_out now */
        memset(acc, 0, H * sizeof(float));
        for (uint32_t k = 0; k < K; k++)
            smoe_axpy(acc, s->topk_w[(size_t)t * K + k], s->slot_out + ((size_t)t * K + k) * H, H);
        float *xt = s->x + (size_t)t * H;
        for (uint32_t i = 0; i < H; i++)
            xt[i] += acc[i];
    }
    SMOE_PROF_LAP(SMOE_P_COMBINE);
    return SMOE_OK;
}

smoe_status smoe_ffn_block(smoe_session *s, uint32_t l, uint32_t n, uint32_t *union_size) {
    const smoe_layer_weights *L = &s->lay->layers[l];
    uint32_t H = s->cfg.hidden_size;
    for (uint32_t t = 0; t < n; t++)
        smoe_rmsnorm(s->xn + (size_t)t * H, s->x + (size_t)t * H, L->post_norm, H, s->cfg.rms_norm_eps);
    SMOE_PROF_LAP(SMOE_P_NORM);
    if (L->sparse)
        return moe_block(s, l, n, union_size);
    *union_size = 0;
    swiglu_mlp(s, L->mlp_gate, L->mlp_gate->data, L->mlp_up, L->mlp_up->data, L->mlp_down, L->mlp_down->data, s->xn,
               n, s->yg);
    for (size_t i = 0; i < (size_t)n * H; i++)
        s->x[i] += s->yg[i];
    SMOE_PROF_LAP(SMOE_P_COMBINE);
    return SMOE_OK;
}
