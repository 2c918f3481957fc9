/* backend_cpu.c — the CPU backend (backend.h): the kernels of kernels.h on a worker pool, planes
 * and KV cache in host memory. It has no device tier: the engine hands `experts` the host
 * retention cache's slots, where the blobs landed.
 *
 * A share is the worker pool (threads, including the calling thread); a session state its planes
 * for `chunk` rows and its KV cache. The products live in products.c; here the rest of a pass:
 * staging, embedding, norms, attention (RoPE and the KV cache with it), residuals, logits. */
#include "cpu/cpu_state.h"
#include "prof.h"

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

/* ------------------------------------------------------------------------------ life cycle */

static smoe_status cpu_share_new(const smoe_be_share_params *p, void **out) {
    cpu_share *sh = smoe_alloc(sizeof *sh, 64);
    if (!sh) return smoe_fail(SMOE_ERR_NOMEM, "out of memory for the session");
    sh->lay = p->lay;
    sh->vault = p->vault;
    smoe_status st = smoe_pool_new(p->threads, &sh->pool);
    if (st != SMOE_OK) {
        smoe_free(sh);
        return st;
    }
    *out = sh;
    return SMOE_OK;
}

static void cpu_share_free(void *vsh) {
    cpu_share *sh = vsh;
    if (!sh) return;
    smoe_pool_free(sh->pool);
    smoe_free(sh);
}

static void cpu_rows_at(void *b, uint32_t r0);

static void cpu_session_free(void *b) {
    cpu_state *c = b;
    if (!c) return;
    cpu_rows_at(c, 0); /* the planes' own addresses */
    void *bufs[] = {c->ids, c->row_scratch, c->k_cache, c->v_cache, c->x, c->xn, c->q, c->k, c->v, c->att, c->yg, c->scores,
                    c->router, c->topk_w, c->route_scratch, c->slot_out, c->xg, c->xrow, c->hg, c->h, c->qx_codes, c->qx_d,
                    c->qx_gsum, c->qx_tiles, c->logits, c->bias, c->gate, c->mix, c->beta, c->decay, c->sgate, c->lin_s,
                    c->lin_conv, c->snap_s, c->snap_conv, c->lin_w, c->lin_row, c->lin_scratch};
    for (size_t i = sizeof bufs / sizeof bufs[0]; i-- > 0;) smoe_free(bufs[i]);
    smoe_free(c);
}

/* One plane: counted in *bytes, 64-byte aligned, zeroed. */
static void *plane(uint64_t *bytes, size_t count, size_t elem, bool *ok) {
    size_t n = count * elem;
    if (n == 0) n = 64;
    void *p = smoe_alloc(n, 64);
    if (!p) *ok = false;
    *bytes += n;
    return p;
}

static smoe_status cpu_session_new(void *vsh, const smoe_be_session_params *p, void **out, uint64_t *plane_bytes,
                                   uint64_t *kv_bytes) {
    cpu_share *sh = vsh;
    cpu_state *c = smoe_alloc(sizeof *c, 64);
    if (!c) return smoe_fail(SMOE_ERR_NOMEM, "out of memory for the session");
    *out = c;
    const smoe_config *cf = &sh->lay->cfg;
    c->sh = sh;
    c->pool = sh->pool;
    c->lay = sh->lay;
    c->cfg = cf;
    c->context = p->context;
    c->chunk = p->chunk;
    c->kv_dtype = p->kv_dtype;
    c->kv_elem = smoe_kv_elem_bytes(p->kv_dtype);
    c->float_activations = p->float_activations;
    c->rope_cos = p->rope_cos;
    c->rope_sin = p->rope_sin;
    c->act = p->act;
    c->q_dim = cf->num_attention_heads * cf->head_dim;
    c->kv_dim = cf->num_key_value_heads * cf->head_dim;
    c->ffn = cf->intermediate_size > cf->moe_intermediate_size ? cf->intermediate_size : cf->moe_intermediate_size;
    if (sh->lay->mp.shared_intermediate > c->ffn) c->ffn = sh->lay->mp.shared_intermediate;

    const size_t C = p->chunk, H = cf->hidden_size, E = cf->num_experts, K = cf->num_experts_per_tok;
    const size_t kv = (size_t)cf->num_hidden_layers * p->context * c->kv_dim;
    /* Not zeroed: attention and smoe_session_read_kv read only rows below the position, which
     * were written first; so the OS maps the cache's pages as positions fill (for a large
     * cache, which malloc takes from mmap), not all at creation. */
    c->k_cache = smoe_alloc_untouched(kv * c->kv_elem, 64);
    c->v_cache = smoe_alloc_untouched(kv * c->kv_elem, 64);
    bool ok = c->k_cache && c->v_cache;
    *kv_bytes = 2 * kv * c->kv_elem;
    uint64_t *pb = plane_bytes;
    c->ids = plane(pb, C, sizeof(int32_t), &ok);
    if (sh->lay->paged_bytes) c->row_scratch = plane(pb, smoe_vault_row_scratch_bytes(sh->lay), 1, &ok);
    c->x = plane(pb, C * H, sizeof(float), &ok);
    c->xn = plane(pb, C * H, sizeof(float), &ok);
    c->q = plane(pb, C * c->q_dim, sizeof(float), &ok);
    c->k = plane(pb, C * c->kv_dim, sizeof(float), &ok);
    c->v = plane(pb, C * c->kv_dim, sizeof(float), &ok);
    /* ATT holds attention's output or a DeltaNet's (v_heads · v_dim) */
    const size_t lin_v = (size_t)p->linear.v_heads * p->linear.v_dim;
    c->att = plane(pb, C * (c->q_dim > lin_v ? c->q_dim : lin_v), sizeof(float), &ok);
    c->yg = plane(pb, C * H, sizeof(float), &ok);
    c->scores = plane(pb, (size_t)smoe_pool_threads(c->pool) * p->context, sizeof(float), &ok);
    c->router = plane(pb, C * E, sizeof(float), &ok);
    c->topk_w = plane(pb, C * K, sizeof(float), &ok);
    c->route_scratch = plane(pb, E, sizeof(float), &ok);
    c->slot_out = plane(pb, C * K * H, sizeof(float), &ok);
    c->xg = plane(pb, C * H, sizeof(float), &ok);
    c->xrow = plane(pb, C, sizeof(uint32_t), &ok);
    c->hg = plane(pb, C * 2 * c->ffn, sizeof(float), &ok);
    c->h = plane(pb, C * c->ffn, sizeof(float), &ok);
    {
        /* the widest input of any q8/q4 product: hidden, q_dim (o_proj) or an FFN width (down) */
        uint32_t cols = H > c->q_dim ? (uint32_t)H : c->q_dim;
        cols = cols > lin_v ? cols : (uint32_t)lin_v; /* a DeltaNet's out_proj */
        cols = cols > c->ffn ? cols : c->ffn;
        smoe_qx_size z = smoe_qx_sizes(cols, SMOE_FMT_Q8, 32); /* q8's int16 codes and group 32's sums: the larger */
        c->qx_codes = plane(pb, C * z.code_bytes, 1, &ok);
        c->qx_d = plane(pb, C * z.d_floats, sizeof(float), &ok);
        c->qx_gsum = plane(pb, C * z.gsum_floats, sizeof(float), &ok);
        /* a batch of experts packs each one's tokens from a tile of its own: up to one more a batch */
        c->qx_tiles_bytes = smoe_qx_tiles_cap(cols, (uint32_t)C + 16 * CPU_BATCH_EXPERTS);
        if (c->qx_tiles_bytes) c->qx_tiles = plane(pb, c->qx_tiles_bytes, 1, &ok);
    }
    c->logits = plane(pb, (size_t)SMOE_LOGIT_ROWS * cf->vocab_size, sizeof(float), &ok);
    {
        /* a bias row of any product: q_dim, kv_dim, hidden, 2·ffn (gate and up) or the router's experts */
        size_t rows = c->q_dim > H ? c->q_dim : H;
        rows = rows > 2 * (size_t)c->ffn ? rows : 2 * (size_t)c->ffn;
        rows = rows > E ? rows : E;
        c->bias_rows = (uint32_t)rows;
        c->bias = plane(pb, rows + (size_t)cf->num_attention_heads, sizeof(float), &ok);
    }
    const uint32_t fam = c->lay->mp.family;
    if (fam == SMOE_FAMILY_QWEN3_NEXT || fam == SMOE_FAMILY_QWEN3_5_MOE) {
        /* gated attention, the shared expert's gate and (with linear layers) the Gated DeltaNet */
        const smoe_linear_shape *ln = &p->linear;
        const size_t vdim = (size_t)ln->v_heads * ln->v_dim, past = ln->conv_kernel ? ln->conv_kernel - 1 : 0;
        c->lin = *ln;
        c->conv_dim = 2 * ln->k_heads * ln->k_dim + ln->v_heads * ln->v_dim;
        c->n_linear = p->n_linear;
        c->linear_index = p->linear_index;
        const size_t gate_w = c->q_dim > vdim ? c->q_dim : vdim;
        c->gate = plane(pb, C * gate_w, sizeof(float), &ok);
        c->sgate = plane(pb, C, sizeof(float), &ok);
        if (p->n_linear) {
            c->mix = plane(pb, C * c->conv_dim, sizeof(float), &ok);
            c->beta = plane(pb, C * ln->v_heads, sizeof(float), &ok);
            c->decay = plane(pb, C * ln->v_heads, sizeof(float), &ok);
            const size_t s_floats = (size_t)p->n_linear * ln->v_heads * ln->k_dim * ln->v_dim;
            const size_t conv_floats = (size_t)p->n_linear * past * c->conv_dim;
            /* the states are the session's like its KV cache: counted with it */
            uint64_t kvb = 0;
            c->lin_s = plane(&kvb, s_floats, sizeof(float), &ok);
            c->lin_conv = plane(&kvb, conv_floats, sizeof(float), &ok);
            c->snap_s = plane(&kvb, s_floats, sizeof(float), &ok);
            c->snap_conv = plane(&kvb, conv_floats, sizeof(float), &ok);
            *kv_bytes += kvb;
            c->lin_w = plane(pb, (size_t)c->conv_dim * ln->conv_kernel + 2 * ln->v_heads + ln->v_dim, sizeof(float),
                             &ok);
            c->lin_row = plane(pb, c->conv_dim, sizeof(float), &ok);
            c->lin_scratch = plane(pb, (size_t)smoe_pool_threads(c->pool) * ln->v_dim, sizeof(float), &ok);
        }
    }
    if (!ok)
        return smoe_fail(SMOE_ERR_NOMEM, "out of memory for the KV cache (%llu bytes) and planes (%llu bytes)",
                         (unsigned long long)*kv_bytes, (unsigned long long)*plane_bytes);
    return SMOE_OK;
}

/* Row pos of layer l in a KV cache (k_cache or v_cache). */
static inline void *kv_row(const cpu_state *c, void *cache, uint32_t l, uint32_t pos) {
    return (uint8_t *)cache + ((size_t)l * c->context + pos) * c->kv_dim * c->kv_elem;
}

/* ------------------------------------------------------------------------------- a pass */

/* The row planes an attention block and routing use, their ids and positions moved to row r0
 * (backend.h's rows_at); from the current r0, so any order of calls ends where it is asked. */
static void cpu_rows_at(void *b, uint32_t r0) {
    cpu_state *c = b;
    if (r0 == c->r0) return;
    const smoe_config *cf = c->cfg;
    const ptrdiff_t d = (ptrdiff_t)r0 - (ptrdiff_t)c->r0;
    const ptrdiff_t H = cf->hidden_size, E = cf->num_experts, K = cf->num_experts_per_tok;
    c->x += d * H;
    c->xn += d * H;
    c->yg += d * H;
    c->q += d * (ptrdiff_t)c->q_dim;
    c->att += d * (ptrdiff_t)c->q_dim;
    c->k += d * (ptrdiff_t)c->kv_dim;
    c->v += d * (ptrdiff_t)c->kv_dim;
    c->router += d * E;
    c->topk_w += d * K;
    c->ids += d;
    c->pos0 = (uint32_t)((ptrdiff_t)c->pos0 + d);
    c->r0 = r0;
}

static smoe_status cpu_stage(void *b, const int32_t *ids, uint32_t n, uint32_t pos0) {
    cpu_state *c = b;
    cpu_rows_at(c, 0);
    memcpy(c->ids, ids, n * sizeof *ids);
    c->pos0 = pos0;
    return SMOE_OK;
}

static smoe_status cpu_embed(void *b, uint32_t n) {
    cpu_state *c = b;
    const smoe_tensor *E = c->lay->embed;
    const size_t H = c->cfg->hidden_size;
    if (c->lay->paged_bytes) { /* on disk: each row read and checked (vault.c) */
        if (n > 1) smoe_vault_embed_prefetch(c->sh->vault, c->ids, n);
        for (uint32_t i = 0; i < n; i++) {
            smoe_status st = smoe_vault_embed_row(c->sh->vault, (uint32_t)c->ids[i], c->row_scratch, c->x + i * H);
            if (st != SMOE_OK) return st;
        }
        return SMOE_OK;
    }
    for (uint32_t i = 0; i < n; i++) smoe_dequant_row(E, E->data, (uint32_t)c->ids[i], c->x + i * H);
    return SMOE_OK;
}

static smoe_status cpu_norm(void *b, smoe_plane dst, smoe_plane src, const smoe_tensor *w, uint32_t n) {
    cpu_state *c = b;
    const uint32_t H = smoe_plane_width(c->cfg, src);
    if (w->cols != H || smoe_plane_width(c->cfg, dst) != H)
        return smoe_fail(SMOE_ERR_INTERNAL, "norm: a weight of %u over rows of %u", w->cols, H);
    float *out = smoe_cpu_plane(c, dst);
    const float *x = smoe_cpu_plane(c, src);
    for (uint32_t t = 0; t < n; t++)
        smoe_rmsnorm(out + (size_t)t * H, x + (size_t)t * H, w, H, c->cfg->rms_norm_eps);
    SMOE_PROF_LAP(SMOE_P_NORM);
    return SMOE_OK;
}

static smoe_status cpu_bias(void *b, smoe_plane dst, const smoe_tensor *w, uint32_t n) {
    cpu_state *c = b;
    const uint32_t W = smoe_plane_width(c->cfg, dst);
    if (w->cols != W) return smoe_fail(SMOE_ERR_INTERNAL, "bias: a vector of %u over rows of %u", w->cols, W);
    float *y = smoe_cpu_plane(c, dst);
    for (uint32_t t = 0; t < n; t++) smoe_add_bias(y + (size_t)t * W, w);
    return SMOE_OK;
}

static smoe_status cpu_add(void *b, smoe_plane dst, smoe_plane src, uint32_t n) {
    cpu_state *c = b;
    float *y = smoe_cpu_plane(c, dst);
    const float *x = smoe_cpu_plane(c, src);
    for (size_t i = 0; i < (size_t)n * c->cfg->hidden_size; i++)
        y[i] += x[i];
    SMOE_PROF_LAP(SMOE_P_COMBINE);
    return SMOE_OK;
}

/* Row t's KV owner: the pass's own state, or members[t] (a batch). */
static inline const cpu_state *owner(const cpu_state *c, void *const *members, uint32_t t) {
    return members ? (const cpu_state *)members[t] : c;
}

/* Row t's position: pos0 + t of a pass, or its member's staged position. */
static inline uint32_t row_pos(const cpu_state *c, void *const *members, uint32_t t) {
    return members ? ((const cpu_state *)members[t])->pos0 : c->pos0 + t;
}

typedef struct {
    cpu_state *c;
    void *const *members;
    uint32_t l;
    uint32_t window;     /* positions a row sees (its own included); 0: all */
    const float *sinks;  /* (heads) sink logits, or NULL */
} attend_task;

/* Items are (token, head) pairs; token t sees positions [0, its own]. The scratch row is the KV
 * owner's (sized for its context; sessions of one share run on one pool, one call at a time). */
static void attend_items(void *ctx, uint32_t i0, uint32_t i1, uint32_t worker) {
    const attend_task *t = ctx;
    cpu_state *c = t->c;
    const smoe_config *cf = c->cfg;
    const uint32_t heads = cf->num_attention_heads, hd = cf->head_dim;
    const uint32_t group = heads / cf->num_key_value_heads;
    for (uint32_t i = i0; i < i1; i++) {
        const uint32_t tok = i / heads, h = i % heads, kvh = h / group;
        const cpu_state *o = owner(c, t->members, tok);
        const uint8_t *kl = kv_row(o, o->k_cache, t->l, 0), *vl = kv_row(o, o->v_cache, t->l, 0);
        const size_t head_bytes = (size_t)hd * o->kv_elem;
        const uint32_t seen = row_pos(c, t->members, tok) + 1;
        const uint32_t first = t->window && seen > t->window ? seen - t->window : 0; /* a sliding window's start */
        const size_t skip = (size_t)first * c->kv_dim * o->kv_elem;
        smoe_attend(c->att + (size_t)tok * c->q_dim + (size_t)h * hd, c->q + (size_t)tok * c->q_dim + (size_t)h * hd,
                    kl + skip + kvh * head_bytes, vl + skip + kvh * head_bytes, c->kv_dim, seen - first, hd,
                    o->kv_dtype, t->sinks ? t->sinks[h] : -INFINITY, o->scores + (size_t)worker * o->context);
    }
}

/* K and V rows land in the cache rounded to its type before attention, so every token (its own
 * position included) attends over the stored values on every path. */
static smoe_status cpu_attend(void *b, uint32_t l, const smoe_attn *a, uint32_t n, void *const *members) {
    cpu_state *c = b;
    const smoe_tensor *q_norm = a->q_norm, *k_norm = a->k_norm;
    const smoe_config *cf = c->cfg;
    const uint32_t hd = cf->head_dim, rot = c->lay->mp.rotary_dim, half = rot / 2;
    const float eps = cf->rms_norm_eps;
    for (uint32_t t = 0; t < n; t++) {
        const cpu_state *o = owner(c, members, t);
        const uint32_t pos = row_pos(c, members, t);
        const float *cs = o->rope_cos + (size_t)pos * half, *sn = o->rope_sin + (size_t)pos * half;
        float *qt = c->q + (size_t)t * c->q_dim, *kt = c->k + (size_t)t * c->kv_dim;
        for (uint32_t h = 0; q_norm && h < cf->num_attention_heads; h++)
            smoe_rmsnorm(qt + (size_t)h * hd, qt + (size_t)h * hd, q_norm, hd, eps);
        for (uint32_t h = 0; k_norm && h < cf->num_key_value_heads; h++)
            smoe_rmsnorm(kt + (size_t)h * hd, kt + (size_t)h * hd, k_norm, hd, eps);
        smoe_rope(qt, cf->num_attention_heads, hd, rot, cs, sn);
        smoe_rope(kt, cf->num_key_value_heads, hd, rot, cs, sn);
        if (members) { /* each row into its own session's cache */
            smoe_kv_store(kv_row(o, o->k_cache, l, pos), kt, c->kv_dim, o->kv_dtype);
            smoe_kv_store(kv_row(o, o->v_cache, l, pos), c->v + (size_t)t * c->kv_dim, c->kv_dim, o->kv_dtype);
        }
    }
    if (!members) {
        const size_t len = (size_t)n * c->kv_dim;
        smoe_kv_store(kv_row(c, c->k_cache, l, c->pos0), c->k, len, c->kv_dtype);
        smoe_kv_store(kv_row(c, c->v_cache, l, c->pos0), c->v, len, c->kv_dtype);
    }
    SMOE_PROF_LAP(SMOE_P_QKNORM);
    attend_task at = {c, members, l, a->window, NULL};
    if (a->sinks) { /* after the bias rows' room: nothing else uses it during attention */
        float *sk = c->bias + c->bias_rows;
        smoe_dequant_row(a->sinks, a->sinks->data, 0, sk);
        at.sinks = sk;
    }
    smoe_pool_run(c->pool, attend_items, &at, n * cf->num_attention_heads, 1);
    SMOE_PROF_LAP(SMOE_P_ATTEND);
    return SMOE_OK;
}

/* ------------------------------------------------- gates and the Gated DeltaNet (backend.h) */

static smoe_status cpu_sigmoid_gate(void *b, smoe_plane dst, smoe_plane gate, uint32_t width, uint32_t gate_width,
                                    uint32_t n) {
    cpu_state *c = b;
    float *y = smoe_cpu_plane(c, dst);
    const float *g = smoe_cpu_plane(c, gate);
    for (uint32_t t = 0; t < n; t++) {
        float *yt = y + (size_t)t * width;
        const float *gt = g + (size_t)t * gate_width;
        if (gate_width == 1) {
            const float s = smoe_sigmoid(gt[0]);
            for (uint32_t i = 0; i < width; i++) yt[i] = s * yt[i];
        } else {
            for (uint32_t i = 0; i < width; i++) yt[i] = yt[i] * smoe_sigmoid(gt[i]);
        }
    }
    return SMOE_OK;
}

/* Layer l's recurrent state of value head h, and its convolution state, in session state o. */
static inline float *lin_state(const cpu_state *o, uint32_t l, uint32_t h) {
    const smoe_linear_shape *ln = &o->lin;
    return o->lin_s + ((size_t)o->linear_index[l] * ln->v_heads + h) * ln->k_dim * ln->v_dim;
}

static inline float *conv_state(const cpu_state *o, uint32_t l) {
    return o->lin_conv + (size_t)o->linear_index[l] * (o->lin.conv_kernel - 1) * o->conv_dim;
}

typedef struct {
    cpu_state *c;
    void *const *members;
    uint32_t l, n;
    const float *a_log, *dt_bias, *norm; /* (v_heads), (v_heads), (v_dim) widened */
} linear_task;

/* Items are value heads; each runs its rows in token order, so a head's state sees the tokens in
 * sequence whichever worker holds it and however many rows the pass has. */
static void linear_heads(void *ctx, uint32_t h0, uint32_t h1, uint32_t worker) {
    const linear_task *t = ctx;
    cpu_state *c = t->c;
    const smoe_linear_shape *ln = &c->lin;
    const uint32_t dk = ln->k_dim, dv = ln->v_dim, per_k = ln->v_heads / ln->k_heads;
    const size_t key_dim = (size_t)ln->k_heads * dk, vdim = (size_t)ln->v_heads * dv;
    const float eps = c->cfg->rms_norm_eps;
    float *scratch = c->lin_scratch + (size_t)worker * dv;
    for (uint32_t h = h0; h < h1; h++) {
        const uint32_t kh = ln->v_tiled ? h % ln->k_heads : h / per_k;
        const float A = -expf(t->a_log[h]);
        for (uint32_t r = 0; r < t->n; r++) {
            const cpu_state *o = owner(c, t->members, r);
            const float *mix = c->mix + (size_t)r * c->conv_dim;
            const float *q = mix + (size_t)kh * dk, *k = mix + key_dim + (size_t)kh * dk;
            const float *v = mix + 2 * key_dim + (size_t)h * dv;
            const float g = A * smoe_softplus(c->decay[(size_t)r * ln->v_heads + h] + t->dt_bias[h]);
            const float beta = smoe_sigmoid(c->beta[(size_t)r * ln->v_heads + h]);
            float *out = c->att + (size_t)r * vdim + (size_t)h * dv;
            smoe_delta_step(out, lin_state(o, t->l, h), q, k, v, expf(g), beta, dk, dv, scratch);
            smoe_rmsnorm_gated(out, out, c->gate + (size_t)r * vdim + (size_t)h * dv, t->norm, dv, eps);
        }
    }
}

/* A small weight (1 × cols, or rows × cols) widened to f32 into out, row by row. */
static void widen(const smoe_tensor *W, float *out) {
    for (uint32_t r = 0; r < W->rows; r++) smoe_dequant_row(W, W->data, r, out + (size_t)r * W->cols);
}

static smoe_status cpu_linear_attend(void *b, uint32_t l, const smoe_tensor *conv, const smoe_tensor *a_log,
                                     const smoe_tensor *dt_bias, const smoe_tensor *norm, uint32_t n,
                                     void *const *members) {
    cpu_state *c = b;
    const smoe_linear_shape *ln = &c->lin;
    if (c->n_linear == 0 || c->linear_index[l] < 0)
        return smoe_fail(SMOE_ERR_INTERNAL, "layer %u has no linear-attention state", l);
    const uint32_t K = ln->conv_kernel, dk = ln->k_dim;
    float *convw = c->lin_w, *A = convw + (size_t)c->conv_dim * K, *dt = A + ln->v_heads, *nw = dt + ln->v_heads;
    widen(conv, convw);
    widen(a_log, A);
    widen(dt_bias, dt);
    widen(norm, nw);
    /* the convolution and the q, k norms, row by row in token order (each row's state is its
     * owner's: the row before it in a pass, or the session's last position in a batch) */
    const float qscale = 1.0f / sqrtf((float)dk);
    for (uint32_t r = 0; r < n; r++) {
        const cpu_state *o = owner(c, members, r);
        float *mix = c->mix + (size_t)r * c->conv_dim;
        smoe_conv1d_step(c->lin_row, conv_state(o, l), mix, convw, c->conv_dim, K);
        memcpy(mix, c->lin_row, c->conv_dim * sizeof *mix);
        for (uint32_t h = 0; h < ln->k_heads; h++) {
            smoe_l2norm(mix + (size_t)h * dk, dk, 1e-6f, qscale);
            smoe_l2norm(mix + ((size_t)ln->k_heads + h) * dk, dk, 1e-6f, 1.0f);
        }
    }
        linear_task lt = {c, members, l, n, A, dt, nw};
    smoe_pool_run(c->pool, linear_heads, &lt, ln->v_heads, 1);
    SMOE_PROF_LAP(SMOE_P_LINEAR);
    return SMOE_OK;
}

static smoe_status cpu_state_op(void *b, smoe_state_op op) {
    cpu_state *c = b;
    if (c->n_linear == 0) return SMOE_OK;
    const smoe_linear_shape *ln = &c->lin;
    const size_t s_bytes = (size_t)c->n_linear * ln->v_heads * ln->k_dim * ln->v_dim * sizeof(float);
    const size_t conv_bytes = (size_t)c->n_linear * (ln->conv_kernel ? ln->conv_kernel - 1 : 0) * c->conv_dim *
                              sizeof(float);
    switch (op) {
    case SMOE_STATE_RESET:
        memset(c->lin_s, 0, s_bytes);
        memset(c->lin_conv, 0, conv_bytes);
        break;
    case SMOE_STATE_SAVE:
        memcpy(c->snap_s, c->lin_s, s_bytes);
        memcpy(c->snap_conv, c->lin_conv, conv_bytes);
        break;
    case SMOE_STATE_RESTORE:
        memcpy(c->lin_s, c->snap_s, s_bytes);
        memcpy(c->lin_conv, c->snap_conv, conv_bytes);
        break;
    }
    return SMOE_OK;
}

static smoe_status cpu_logits(void *b, const smoe_tensor *norm, const smoe_tensor *head, const uint32_t *rows,
                              uint32_t m) {
    cpu_state *c = b;
    const uint32_t H = c->cfg->hidden_size;
    for (uint32_t i = 0; i < m; i++)
        smoe_rmsnorm(c->xn + (size_t)i * H, c->x + (size_t)rows[i] * H, norm, H, c->cfg->rms_norm_eps);
    SMOE_PROF_LAP(SMOE_P_NORM);
    smoe_cpu_linear(c, SMOE_P_LM_HEAD, head, head->data, c->xn, m, c->logits);
    return SMOE_OK;
}

static smoe_status cpu_logits_read(void *b, uint32_t m, const float **out) {
    (void)m;
    *out = ((cpu_state *)b)->logits;
    return SMOE_OK;
}

/* ----------------------------------------------------------------------------------- the rest */

static smoe_status cpu_read_kv(void *b, uint32_t layer, uint32_t start, uint32_t n, float *k, float *v) {
    cpu_state *c = b;
    const size_t len = (size_t)n * c->kv_dim;
    if (k)
        smoe_kv_load(k, kv_row(c, c->k_cache, layer, start), len, c->kv_dtype);
    if (v)
        smoe_kv_load(v, kv_row(c, c->v_cache, layer, start), len, c->kv_dtype);
    return SMOE_OK;
}

static const char *cpu_describe(void *b) {
    (void)b;
    static char line[64];
    static _Atomic int made;
    if (!atomic_load(&made)) { /* the same text from any thread that races here */
        snprintf(line, sizeof line, "cpu: %s", smoe_kernels());
        atomic_store(&made, 1);
    }
    return line;
}

static const char *cpu_lacks(const smoe_layout *lay) {
    if (lay->mp.family == SMOE_FAMILY_GPT_OSS) return NULL; /* every op of its recipe is here */
    for (uint32_t l = 0; l < lay->cfg.num_hidden_layers; l++)
        for (int i = SMOE_XT_GATE_BIAS; i < SMOE_XT_COUNT; i++)
            if (lay->xl[l].has[i]) return "expert biases";
    return NULL;
}

const smoe_backend smoe_backend_cpu = {
    .name = "cpu",
    .lacks = cpu_lacks,
    .share_new = cpu_share_new,
    .share_free = cpu_share_free,
    .session_new = cpu_session_new,
    .session_free = cpu_session_free,
    .stage = cpu_stage,
    .embed = cpu_embed,
    .rows_at = cpu_rows_at,
    .norm = cpu_norm,
    .project = smoe_cpu_project,
    .attend = cpu_attend,
    .add = cpu_add,
    .sigmoid_gate = cpu_sigmoid_gate,
    .linear_attend = cpu_linear_attend,
    .state = cpu_state_op,
    .bias = cpu_bias,
    .route_grouped = smoe_cpu_route_grouped,
    .mlp = smoe_cpu_mlp,
    .route = smoe_cpu_route,
    .experts = smoe_cpu_experts,
    .combine = smoe_cpu_combine,
    .logits = cpu_logits,
    .logits_read = cpu_logits_read,
    .read_kv = cpu_read_kv,
    .describe = cpu_describe,
};
