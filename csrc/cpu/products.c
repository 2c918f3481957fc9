/* products.c — the CPU backend's products on the worker pool: projections, dense MLPs, the
 * router, the experts of a union and their combination (backend.h's ops).
 *
 * Every product goes through smoe_matmul_rows / smoe_matmul_rows_qx, whose per-element reduction
 * is fixed (kernels.h), over rows split between threads at multiples of 16: which thread computes
 * a row never changes its value. So an expert's outputs are the same whichever `experts` call ran
 * it and with whatever other experts: up to 64 of them (every expert of a decode step; a prompt
 * chunk's in batches of up to chunk routed rows) go into two pool runs of products — gate and up
 * of all of them, each on its own rows' codes, then down of all — the same kernel calls on the
 * same inputs as its own product would make, with 2 wake-ups and barriers instead of 2 per
 * expert; q, k and v of one token share one run the same way. */
#include "cpu/cpu_state.h"
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

/* Row grain keeps each thread's rows a multiple of 16: splits never cut a cache line of y (nor an
 * AMX panel). */
enum { ROW_GRAIN = 16 };

/* Several products in one pool run: part i is W[i] on its own n[i] rows of input (f32 x[i] or codes
 * qx[i]) into y[i]. Its panels of ROW_GRAIN rows are per[i] items each of the run (per: the part's
 * cost a panel, its tokens; so the threads' even shares of items are even shares of work), after
 * the previous parts' items. Which thread computes a row never changes its value (kernels.h), so one
 * run gives each part the bits it would get alone, with one wake-up and one barrier instead of
 * one per product. */
enum { MAX_PARTS = 2 * CPU_BATCH_EXPERTS };

typedef struct {
    const smoe_tensor *W;
    const uint8_t *w;
    const float *x;
    smoe_qx qx;     /* x as codes when has_qx */
    bool has_qx;
    float *y;
    uint32_t n;     /* its rows of x (tokens) */
    size_t ldy;     /* y's row stride */
    uint32_t first; /* its first item in the run */
    uint32_t per;   /* its items a panel */
} product_part;

typedef struct {
    const product_part *parts;
    uint32_t n_parts;
} parts_task;

/* A part's items: its panels × per */
static inline uint32_t part_items(const smoe_tensor *W, uint32_t per) {
    return (W->rows + ROW_GRAIN - 1) / ROW_GRAIN * per;
}

/* Items [i0, i1): in each part they meet, the panels whose first item lies in the range (an item
 * boundary inside a panel gives the whole panel to the range after it) */
static void parts_rows(void *ctx, uint32_t i0, uint32_t i1, uint32_t worker) {
    (void)worker;
    const parts_task *t = ctx;
    uint32_t i = 0;
    while (i + 1 < t->n_parts && t->parts[i + 1].first <= i0) i++;
    for (; i < t->n_parts && t->parts[i].first < i1; i++) {
        const product_part *p = &t->parts[i];
        const uint32_t rows = p->W->rows, a = i0 > p->first ? i0 - p->first : 0, b = i1 - p->first;
        const uint32_t p0 = (a + p->per - 1) / p->per, p1 = (b + p->per - 1) / p->per;
        const uint32_t r0 = p0 * ROW_GRAIN < rows ? p0 * ROW_GRAIN : rows, r1 = p1 * ROW_GRAIN < rows ? p1 * ROW_GRAIN : rows;
        if (r0 < r1) matmul(p->W, p->w, p->x, p->has_qx ? &p->qx : NULL, p->n, p->y, p->ldy, r0, r1);
    }
}

/* The parts in one pool run (their first items already set) */
static void run_parts(cpu_state *s, const product_part *parts, uint32_t n_parts) {
    const product_part *last = &parts[n_parts - 1];
    parts_task t = {parts, n_parts};
    smoe_pool_run(s->pool, parts_rows, &t, last->first + part_items(last->W, last->per), 1);
}

/* What the session's qx planes hold: the codes of `x` for the products of W (and of every tensor
 * smoe_qx_shared pairs with it), or nothing (x NULL). Products that share one input (q, k, v; gate,
 * up) quantise it once. */
typedef struct {
    const float *x;
    const smoe_tensor *W;
    smoe_qx qx;
} qx_planes;

/* Below this many values, work between two products (quantising their input, the activation)
 * stays on the caller: a pool run's wake-up and barrier would cost more than the threads save.
 * Above it, a prompt's rows go to the threads: with many threads these steps, each a few percent
 * of a prefill on one, were 13 % of a 256-token one at 16 (bench/RESULTS.md, "A 16-core Sapphire
 * Rapids"). */
enum { SPLIT_VALUES = 16384 };

/* Whether n rows of `per_row` values each go to the pool: at least two rows and `from` values */
static inline bool split_from(uint32_t n, uint32_t per_row, size_t from) { return n >= 2 && (size_t)n * per_row >= from; }

/* Whether n rows of `per_row` values each go to the pool (SPLIT_VALUES) */
static inline bool split_rows(uint32_t n, uint32_t per_row) { return split_from(n, per_row, SPLIT_VALUES); }

/* The activation costs a libm expf a value, ~4× what quantising one does: its rows go to the pool
 * from a quarter of SPLIT_VALUES, so that a decode step's (its top-k experts' rows, 8 × 768 for
 * a3b: 49 µs on the caller alone at 16 threads, 5–6 % of the token; bench/RESULTS.md, "The
 * activation on the pool") spreads too. */
enum { ACT_SPLIT_VALUES = SPLIT_VALUES / 4 };

typedef struct {
    const float *x;
    size_t ldx;
    const uint32_t *row; /* row j of the codes is row row[j] of x; NULL: row j */
    uint32_t cols, group;
    uint8_t format;
    smoe_qx_size z;
    void *codes;
    float *d, *gsum;
} qx_task;

static void qx_rows(void *ctx, uint32_t t0, uint32_t t1, uint32_t worker) {
    (void)worker;
    const qx_task *t = ctx;
    const smoe_qx_size z = t->z;
    if (!t->row) {
        smoe_qx_prepare(t->x + (size_t)t0 * t->ldx, t->ldx, t1 - t0, t->cols, t->format, t->group,
                        (uint8_t *)t->codes + (size_t)t0 * z.code_bytes, t->d + (size_t)t0 * z.d_floats,
                        t->gsum + (size_t)t0 * z.gsum_floats);
        return;
    }
    for (uint32_t j = t0; j < t1; j++)
        smoe_qx_prepare(t->x + (size_t)t->row[j] * t->ldx, t->ldx, 1, t->cols, t->format, t->group,
                        (uint8_t *)t->codes + (size_t)j * z.code_bytes, t->d + (size_t)j * z.d_floats,
                        t->gsum + (size_t)j * z.gsum_floats);
}

/* smoe_qx_prepare of n rows of x (row stride ldx; row j of the codes from row row[j] of x, or row
 * j where row is NULL) into the session's planes, the rows shared between the threads when there
 * are enough: each row's codes depend on that row alone, so the bytes are the same either way. */
static void qx_prepare_rows(cpu_state *s, const float *x, size_t ldx, const uint32_t *row, uint32_t n, uint32_t cols,
                            uint8_t format, uint32_t group) {
    qx_task t = {x, ldx, row, cols, group, format, smoe_qx_sizes(cols, format, group), s->qx_codes, s->qx_d, s->qx_gsum};
    if (split_rows(n, cols))
        smoe_pool_run(s->pool, qx_rows, &t, n, 1);
    else
        qx_rows(&t, 0, n, 0);
}

static void qx_prepare(cpu_state *s, const float *x, size_t ldx, uint32_t n, uint32_t cols, uint8_t format,
                       uint32_t group) {
    qx_prepare_rows(s, x, ldx, NULL, n, cols, format, group);
}

typedef struct {
    smoe_qx *const *qx;
    const uint32_t *n;
    void *const *buf;
    const uint32_t *first; /* (m + 1) qx k's items are [first[k], first[k + 1]) */
    uint32_t m;
} tiles_task;

static void tiles_items(void *ctx, uint32_t i0, uint32_t i1, uint32_t worker) {
    (void)worker;
    const tiles_task *t = ctx;
    for (uint32_t k = 0; k < t->m && i0 < i1; k++) {
        const uint32_t a = t->first[k], b = t->first[k + 1];
        if (i0 >= b) continue;
        const uint32_t e = i1 < b ? i1 : b;
        smoe_qx_tiles(t->qx[k], t->n[k], t->buf[k], i0 - a, e - a);
        i0 = e;
    }
}

/* The codes of qx[k] (n[k] tokens each, k < m) packed once for the AMX kernel into the session's
 * tile plane, one after the other, where their products will run there (kernels.h,
 * smoe_qx_tiles): the pieces split between the threads, then every product and thread that takes
 * qx[k] reads them, instead of each packing its own. Those past the plane's room pack their own. */
static void pack_tiles(cpu_state *s, smoe_qx *const *qx, const uint32_t *n, uint32_t m) {
    uint32_t first[CPU_BATCH_EXPERTS + 1], k = 0;
    void *buf[CPU_BATCH_EXPERTS];
    size_t at = 0;
    first[0] = 0;
    for (; k < m && k < CPU_BATCH_EXPERTS; k++) {
        uint32_t items = 0;
        const size_t bytes = smoe_qx_tiles_bytes(qx[k], n[k], &items);
        if (bytes == 0 || at + bytes > s->qx_tiles_bytes) break;
        buf[k] = (uint8_t *)s->qx_tiles + at;
        at += bytes;
        first[k + 1] = first[k] + items;
    }
    if (k == 0) return;
    tiles_task t = {qx, n, buf, first, k};
    smoe_pool_run(s->pool, tiles_items, &t, first[k], 1);
    for (uint32_t j = 0; j < k; j++) qx[j]->tiles = buf[j];
}

/* The session's code planes as codes of cols columns made for (format, group), from row 0 */
static smoe_qx planes_qx(const cpu_state *s, uint32_t cols, uint32_t group, uint8_t format) {
    return (smoe_qx){s->qx_codes, s->qx_d, s->qx_gsum, cols, group, format, NULL};
}

/* x (n, W.cols) as the 8-bit codes W's product takes, prepared in the session's planes unless
 * they hold them already (and packed for the AMX kernel where it takes them); NULL when W
 * multiplies f32 inputs (f32/bf16 weights, or float_activations). */
static const smoe_qx *prepare(cpu_state *s, const smoe_tensor *W, const float *x, uint32_t n, qx_planes *pl) {
    if (s->float_activations || !smoe_qx_takes(W))
        return NULL;
    const uint32_t G = smoe_qx_group(W);
    if (pl->x != x || !smoe_qx_shared(pl->W, W)) {
        qx_prepare(s, x, W->cols, n, W->cols, W->format, G);
        SMOE_PROF_LAP(SMOE_P_QX);
        *pl = (qx_planes){x, W, planes_qx(s, W->cols, G, W->format)};
        smoe_qx *q = &pl->qx;
        pack_tiles(s, &q, &n, 1);
    }
    return &pl->qx;
}


static void linear_with(cpu_state *s, int stage, const smoe_tensor *W, const uint8_t *w, const float *x, uint32_t n,
                        float *y, qx_planes *pl) {
    (void)stage; /* the profiler's (prof.h) */
    linear_task t = {W, w, x, prepare(s, W, x, n, pl), n, y, W->rows};
    smoe_pool_run(s->pool, linear_rows, &t, W->rows, ROW_GRAIN);
    SMOE_PROF_LAP(stage);
}

void smoe_cpu_linear(cpu_state *s, int stage, const smoe_tensor *W, const uint8_t *w, const float *x, uint32_t n,
                     float *y) {
    qx_planes pl = {0};
    linear_with(s, stage, W, w, x, n, y, &pl);
}

/* Rows [0, n) of y (row stride ldy, bias->cols columns) += the bias row, widened once. */
static void add_bias(cpu_state *s, const smoe_tensor *bias, const uint8_t *wb, float *y, size_t ldy, uint32_t n) {
    smoe_dequant_row(bias, wb, 0, s->bias);
    for (uint32_t t = 0; t < n; t++) smoe_add_row(y + (size_t)t * ldy, s->bias, bias->cols);
}

/* The activation between gate/up and down of n rows: h (n, I) from hg (n, 2I), gate then up. */
typedef struct {
    const smoe_act *act;
    float *h;
    const float *hg;
    uint32_t I;
} act_task;

/* Rows [r0, r1) of the activation: each value depends on its own gate and up alone. */
static void act_rows(void *ctx, uint32_t r0, uint32_t r1, uint32_t worker) {
    (void)worker;
    const act_task *t = ctx;
    const uint32_t I = t->I;
    for (uint32_t i = r0; i < r1; i++) {
        const float *g = t->hg + (size_t)i * 2 * I, *u = g + I;
        if (t->act->kind == SMOE_ACT_SWIGLU_CLAMPED)
            smoe_swiglu_clamped(t->h + (size_t)i * I, g, u, I, t->act->alpha, t->act->limit);
        else
            smoe_swiglu(t->h + (size_t)i * I, g, u, I);
    }
}

static void activate(cpu_state *s, const smoe_act *act, float *h, const float *hg, uint32_t I, uint32_t n) {
    act_task t = {act, h, hg, I};
    if (split_from(n, I, ACT_SPLIT_VALUES))
        smoe_pool_run(s->pool, act_rows, &t, n, 1);
    else
        act_rows(&t, 0, n, 0);
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

/* An FFN's weights: gate, up, down and their optional biases (NULL: none), each with its bytes. */
typedef struct {
    const smoe_tensor *gate, *up, *down, *gate_b, *up_b, *down_b;
    const uint8_t *wg, *wu, *wd, *wgb, *wub, *wdb;
} ffn_weights;

/* out (n, hidden) = down(act(gate(x) + gate_b, up(x) + up_b)) + down_b for x (n, hidden). */
static void swiglu_mlp(cpu_state *s, const ffn_weights *f, const smoe_act *act, const float *x, uint32_t n,
                       float *out) {
    const smoe_tensor *gate = f->gate, *up = f->up, *down = f->down;
    const uint8_t *wg = f->wg, *wu = f->wu, *wd = f->wd;
    uint32_t I = gate->rows;
    qx_planes pl = {0};
    const smoe_qx *qg = prepare(s, gate, x, n, &pl);
    if (qg && !smoe_qx_shared(gate, up) && smoe_qx_takes(up)) {
        /* gate and up want different codes and there is one set of planes: one after the other */
        linear_task tg = {gate, wg, x, qg, n, s->hg, 2 * (size_t)I};
        smoe_pool_run(s->pool, linear_rows, &tg, I, ROW_GRAIN);
        linear_task tu = {up, wu, x, prepare(s, up, x, n, &pl), n, s->hg + I, 2 * (size_t)I};
        smoe_pool_run(s->pool, linear_rows, &tu, I, ROW_GRAIN);
    } else {
        /* up takes gate's codes (smoe_qx_shared), or its own when gate takes none */
        gate_up_task t = {gate, up, wg, wu, x, qg, NULL, n, s->hg};
        t.qu = prepare(s, up, x, n, &pl);
        smoe_pool_run(s->pool, gate_up_rows, &t, 2 * I, ROW_GRAIN);
    }
    if (f->gate_b) add_bias(s, f->gate_b, f->wgb, s->hg, 2 * (size_t)I, n);
    if (f->up_b) add_bias(s, f->up_b, f->wub, s->hg + I, 2 * (size_t)I, n);
    SMOE_PROF_LAP(SMOE_P_GATE_UP);
    activate(s, act, s->h, s->hg, I, n);
    SMOE_PROF_LAP(SMOE_P_SWIGLU);
    smoe_cpu_linear(s, SMOE_P_DOWN, down, wd, s->h, n, out);
    if (f->down_b) add_bias(s, f->down_b, f->wdb, out, down->rows, n);
}

/* ------------------------------------------------------------------------------ projections */

smoe_status smoe_cpu_project(void *b, smoe_plane src, const smoe_proj *out, uint32_t n_out, uint32_t n) {
    cpu_state *s = b;
    const float *x = smoe_cpu_plane(s, src);
    qx_planes pl = {0}; /* products of one input share one quantisation of it where smoe_qx_shared says */
    bool one_run = n == 1 && n_out > 1 && n_out <= MAX_PARTS;
    /* one run when the parts share their codes and cost the same a row (one format), so an even
       split of the rows is an even split of the work */
    for (uint32_t i = 1; one_run && i < n_out; i++)
        one_run = smoe_qx_shared(out[0].W, out[i].W) && out[i].W->format == out[0].W->format;
    if (one_run) {
        /* one token: the products in one pool run */
        const smoe_qx *qx = prepare(s, out[0].W, x, 1, &pl);
        product_part parts[MAX_PARTS];
        uint32_t items = 0;
        for (uint32_t i = 0; i < n_out; i++) {
            parts[i] = (product_part){out[i].W,  out[i].W->data, x, {0}, qx != NULL, smoe_cpu_plane(s, out[i].out),
                                      1,         out[i].W->rows, items, 1};
            if (qx) parts[i].qx = *qx;
            items += part_items(out[i].W, 1);
        }
        run_parts(s, parts, n_out);
    } else {
        for (uint32_t i = 0; i < n_out; i++)
            linear_with(s, SMOE_P_QKV, out[i].W, out[i].W->data, x, n, smoe_cpu_plane(s, out[i].out), &pl);
    }
    SMOE_PROF_LAP(SMOE_P_QKV);
    return SMOE_OK;
}

smoe_status smoe_cpu_mlp(void *b, smoe_plane dst, smoe_plane src, const smoe_tensor *gate, const smoe_tensor *up,
                         const smoe_tensor *down, uint32_t n) {
    cpu_state *s = b;
    const ffn_weights f = {gate, up, down, NULL, NULL, NULL, gate->data, up->data, down->data, NULL, NULL, NULL};
    const smoe_act silu = {SMOE_ACT_SILU, 0, 0};
    swiglu_mlp(s, &f, &silu, smoe_cpu_plane(s, src), n, smoe_cpu_plane(s, dst));
    return SMOE_OK;
}

/* ------------------------------------------------------------------------------------ routing */

smoe_status smoe_cpu_route(void *b, const smoe_route *r, uint32_t n, int32_t *ids) {
    cpu_state *s = b;
    const uint32_t E = s->cfg->num_experts, K = r->K;
    smoe_cpu_linear(s, SMOE_P_ROUTER, r->W, r->W->data, s->xn, n, s->router);
    if (r->bias) add_bias(s, r->bias, r->bias->data, s->router, E, n);
    for (uint32_t t = 0; t < n; t++) {
        float *p = s->router + (size_t)t * E;
        if (r->kind == SMOE_ROUTER_TOPK_SOFTMAX) {
            smoe_topk_softmax(p, E, K, ids + (size_t)t * K, s->topk_w + (size_t)t * K);
        } else {
            smoe_softmax(p, E);
            smoe_topk(p, E, K, r->renorm, ids + (size_t)t * K, s->topk_w + (size_t)t * K);
        }
    }
    SMOE_PROF_LAP(SMOE_P_ROUTE);
    return SMOE_OK;
}

smoe_status smoe_cpu_route_grouped(void *b, const smoe_tensor *router, const smoe_tensor *bias, uint32_t K, bool renorm,
                                   uint32_t n, int32_t *ids) {
    cpu_state *s = b;
    const uint32_t E = s->cfg->num_experts;
    const smoe_model_params *m = &s->lay->mp;
    smoe_cpu_linear(s, SMOE_P_ROUTER, router, router->data, s->xn, n, s->router);
    for (uint32_t t = 0; t < n; t++)
        smoe_route_sigmoid_group(s->router + (size_t)t * E, E, bias, m->n_group, m->topk_group, K,
                                 renorm, m->routed_scaling_factor, ids + (size_t)t * K, s->topk_w + (size_t)t * K,
                                 s->route_scratch);
    SMOE_PROF_LAP(SMOE_P_ROUTE);
    return SMOE_OK;
}

/* ------------------------------------------------------------------------------------ experts */

/* The expert FFN of layer l whose blob is at blob: its tensors and their bytes. */
static ffn_weights expert_weights(const cpu_state *s, uint32_t l, const uint8_t *blob) {
    const smoe_expert_layout *x = &s->lay->xl[l];
    const smoe_tensor *t = x->t;
    ffn_weights f = {&t[SMOE_XT_GATE], &t[SMOE_XT_UP], &t[SMOE_XT_DOWN], NULL, NULL, NULL,
                     blob + t[SMOE_XT_GATE].offset, blob + t[SMOE_XT_UP].offset, blob + t[SMOE_XT_DOWN].offset,
                     NULL, NULL, NULL};
    if (x->has[SMOE_XT_GATE_BIAS]) {
        f.gate_b = &t[SMOE_XT_GATE_BIAS];
        f.wgb = blob + f.gate_b->offset;
    }
    if (x->has[SMOE_XT_UP_BIAS]) {
        f.up_b = &t[SMOE_XT_UP_BIAS];
        f.wub = blob + f.up_b->offset;
    }
    if (x->has[SMOE_XT_DOWN_BIAS]) {
        f.down_b = &t[SMOE_XT_DOWN_BIAS];
        f.wdb = blob + f.down_b->offset;
    }
    return f;
}

/* Applies union position p (weights at blob) to every (token, slot) routed to it. */
static void run_expert(cpu_state *s, const smoe_union *un, uint32_t p, const uint8_t *blob) {
    const uint32_t H = s->cfg->hidden_size, K = s->cfg->num_experts_per_tok;
    const uint32_t m = un->count[p];
    const uint32_t *rows = un->rows + un->start[p];
    for (uint32_t j = 0; j < m; j++)
        memcpy(s->xg + (size_t)j * H, s->xn + (size_t)(rows[j] / K) * H, H * sizeof(float));
    SMOE_PROF_LAP(SMOE_P_GATHER);
    const ffn_weights f = expert_weights(s, un->l, blob);
    swiglu_mlp(s, &f, &s->act, s->xg, m, s->yg);
    for (uint32_t j = 0; j < m; j++)
        memcpy(s->slot_out + (size_t)rows[j] * H, s->yg + (size_t)j * H, H * sizeof(float));
    SMOE_PROF_LAP(SMOE_P_GATHER);
}

/* Rows of yg into their (token, slot) rows of slot_out: row j to rows[j] (UINT32_MAX: none) */
typedef struct {
    float *dst;
    const float *src;
    const uint32_t *rows;
    uint32_t H;
} scatter_task;

static void scatter_rows(void *ctx, uint32_t j0, uint32_t j1, uint32_t worker) {
    (void)worker;
    const scatter_task *t = ctx;
    for (uint32_t j = j0; j < j1; j++)
        if (t->rows[j] != UINT32_MAX)
            memcpy(t->dst + (size_t)t->rows[j] * t->H, t->src + (size_t)j * t->H, t->H * sizeof(float));
}

/* Union positions p[0..m) (Σ routed rows ≤ chunk, m ≤ CPU_BATCH_EXPERTS) in two pool runs of
 * products: gate and up of all of them, each on its own rows' codes, then down of all, each on
 * its own silu(gate)·up rows; each part's panels weighted by its rows, so that the threads' even
 * shares of the run are even shares of its work. An expert's input rows are its tokens' rows of
 * xn where every expert has one (each token's codes prepared once), else gathered into xg, expert
 * by expert (and quantised there: per row, the codes any call gives). Quantising, packing for
 * AMX (each expert's codes from a tile of its own) and the activation are one pool run each for
 * the whole batch too. Each output lands in its (token, slot) row of slot_out as run_expert puts
 * it, by the same kernel calls on the same inputs (n = the expert's rows, as run_expert's): the
 * same bits. */
static void run_experts(cpu_state *s, const smoe_union *un, const uint32_t *p, uint32_t m) {
    const smoe_layout *lay = s->lay;
    const smoe_tensor *x = smoe_expert_of(lay, un->l);
    const smoe_tensor *g = &x[SMOE_XT_GATE], *up = &x[SMOE_XT_UP], *d = &x[SMOE_XT_DOWN];
    const uint32_t H = s->cfg->hidden_size, K = s->cfg->num_experts_per_tok, I = g->rows;
    product_part parts[MAX_PARTS];
    const uint8_t *blob[CPU_BATCH_EXPERTS];
    uint32_t first[CPU_BATCH_EXPERTS + 1]; /* expert k's rows are [first[k], first[k + 1]) of h, hg */
    uint32_t src_row[CPU_BATCH_EXPERTS];   /* and its first input row in src */
    uint32_t cnt[CPU_BATCH_EXPERTS];       /* its rows */
    smoe_qx qx[CPU_BATCH_EXPERTS];         /* its codes */
    smoe_qx *qxp[CPU_BATCH_EXPERTS];
    bool gather = false;
    first[0] = 0;
    for (uint32_t k = 0; k < m; k++) {
        blob[k] = un->w[p[k]];
        cnt[k] = un->count[p[k]];
        first[k + 1] = first[k] + cnt[k];
        gather |= cnt[k] > 1;
        qxp[k] = &qx[k];
    }
    const uint32_t R = first[m];
    const bool codes = !s->float_activations && smoe_qx_takes(g);
    const float *src = s->xn;
    uint32_t src_n = un->n;
    const uint32_t *src_of = NULL; /* with codes: the gathered rows' rows of xn, quantised from there */
    if (gather) {
        for (uint32_t k = 0; k < m; k++) {
            const uint32_t *rows = un->rows + un->start[p[k]];
            for (uint32_t j = 0; j < cnt[k]; j++) s->xrow[first[k] + j] = rows[j] / K;
            src_row[k] = first[k];
        }
        if (codes) {
            src_of = s->xrow;
        } else {
            for (uint32_t j = 0; j < R; j++)
                memcpy(s->xg + (size_t)j * H, s->xn + (size_t)s->xrow[j] * H, H * sizeof(float));
            src = s->xg;
        }
        src_n = R;
        SMOE_PROF_LAP(SMOE_P_GATHER);
    } else {
        for (uint32_t k = 0; k < m; k++) src_row[k] = un->rows[un->start[p[k]]] / K;
    }

    const uint32_t gG = smoe_qx_group(g), dG = smoe_qx_group(d);
    if (codes) {
        qx_prepare_rows(s, src, H, src_of, src_n, H, g->format, gG);
        const smoe_qx all = planes_qx(s, H, gG, g->format);
        for (uint32_t k = 0; k < m; k++) qx[k] = smoe_qx_from(&all, src_row[k]);
        pack_tiles(s, qxp, cnt, m);
        SMOE_PROF_LAP(SMOE_P_QX);
    }
    uint32_t items = 0;
    for (uint32_t k = 0; k < m; k++) {
        const uint32_t c = cnt[k];
        float *hk = s->hg + (size_t)first[k] * 2 * I;
        const float *xk = codes ? NULL : src + (size_t)src_row[k] * H; /* with codes, x is not read */
        parts[2 * k] = (product_part){g, blob[k] + g->offset, xk, qx[k], codes, hk, c, 2 * (size_t)I, items, c};
        items += part_items(g, c);
        parts[2 * k + 1] = (product_part){up, blob[k] + up->offset, xk, qx[k], codes, hk + I, c, 2 * (size_t)I, items, c};
        items += part_items(up, c);
    }
    run_parts(s, parts, 2 * m);
    SMOE_PROF_LAP(SMOE_P_GATE_UP);

    for (uint32_t k = 0; k < m; k++) {
        const ffn_weights f = expert_weights(s, un->l, blob[k]);
        float *hk = s->hg + (size_t)first[k] * 2 * I;
        if (f.gate_b) add_bias(s, f.gate_b, f.wgb, hk, 2 * (size_t)I, cnt[k]);
        if (f.up_b) add_bias(s, f.up_b, f.wub, hk + I, 2 * (size_t)I, cnt[k]);
    }
    activate(s, &s->act, s->h, s->hg, I, R);
    SMOE_PROF_LAP(SMOE_P_SWIGLU);

    const bool dcodes = !s->float_activations && smoe_qx_takes(d);
    if (dcodes) {
        qx_prepare(s, s->h, I, R, I, d->format, dG);
        const smoe_qx all = planes_qx(s, I, dG, d->format);
        for (uint32_t k = 0; k < m; k++) qx[k] = smoe_qx_from(&all, first[k]);
        pack_tiles(s, qxp, cnt, m);
        SMOE_PROF_LAP(SMOE_P_QX);
    }
    /* one row: straight into its slot_out row; more: into yg's rows [first[k], …), copied below */
    items = 0;
    for (uint32_t k = 0; k < m; k++) {
        const uint32_t f0 = first[k], c = cnt[k];
        float *y = c == 1 ? s->slot_out + (size_t)un->rows[un->start[p[k]]] * H : s->yg + (size_t)f0 * H;
        parts[k] = (product_part){d, blob[k] + d->offset, s->h + (size_t)f0 * I, qx[k], dcodes, y, c, H, items, c};
        items += part_items(d, c);
    }
    run_parts(s, parts, m);
    for (uint32_t k = 0; k < m; k++) {
        const ffn_weights f = expert_weights(s, un->l, blob[k]);
        if (f.down_b) add_bias(s, f.down_b, f.wdb, (float *)parts[k].y, H, cnt[k]);
    }
    SMOE_PROF_LAP(SMOE_P_DOWN);
    if (gather) {
        /* the outputs in yg (experts of more than one row) into their slot_out rows; xrow now
           says where (one-row experts wrote theirs there already) */
        for (uint32_t k = 0; k < m; k++) {
            const uint32_t *rows = un->rows + un->start[p[k]];
            for (uint32_t j = 0; j < cnt[k]; j++) s->xrow[first[k] + j] = cnt[k] > 1 ? rows[j] : UINT32_MAX;
        }
        scatter_task t = {s->slot_out, s->yg, s->xrow, H};
        if (split_rows(R, H))
            smoe_pool_run(s->pool, scatter_rows, &t, R, 1);
        else
            scatter_rows(&t, 0, R, 0);
        SMOE_PROF_LAP(SMOE_P_GATHER);
    }
}

smoe_status smoe_cpu_experts(void *b, const smoe_union *un, const uint32_t *items, uint32_t m) {
    cpu_state *s = b;
    const smoe_tensor *x = smoe_expert_of(s->lay, un->l);
    const smoe_tensor *eg = &x[SMOE_XT_GATE], *eu = &x[SMOE_XT_UP];
    /* batches of up to CPU_BATCH_EXPERTS experts and chunk routed rows, when gate and up take the
     * same codes (the one set of code planes serves both); else one by one */
    const bool batch = smoe_qx_shared(eg, eu);
    uint32_t group[CPU_BATCH_EXPERTS], ns = 0, rows = 0;
    for (uint32_t i = 0; i < m; i++) {
        const uint32_t p = items[i], c = un->count[p];
        if (!batch) {
            run_expert(s, un, p, un->w[p]);
            continue;
        }
        if (ns && (ns == CPU_BATCH_EXPERTS || rows + c > s->chunk)) {
            run_experts(s, un, group, ns);
            ns = rows = 0;
        }
        group[ns++] = p;
        rows += c;
    }
    if (ns) run_experts(s, un, group, ns);
    return SMOE_OK;
}

/* Weighted sum in top-k slot order, then the residual. */
smoe_status smoe_cpu_combine(void *b, uint32_t K, uint32_t n) {
    cpu_state *s = b;
    const uint32_t H = s->cfg->hidden_size;
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
