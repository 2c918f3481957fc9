/* backend_cuda.c — the CUDA backend (backend.h): the session side of cuda_ops.h.
 *
 * What lives where:
 *   VRAM   the dense region (uploaded once at init, the vault's own bytes), the KV cache in f32
 *          for the whole context, the activation planes for `chunk` tokens, the RoPE tables (the
 *          host's, copied) and the expert cache: gpu_cache_bytes / blob_bytes whole blobs (at least
 *          MIN_VSLOTS), evicted least recently used.
 *   host   the streamer's retention cache (cache_bytes), its slots pinned with cudaHostRegister
 *          so uploads are asynchronous DMA; behind it the disk, read with Direct I/O.
 *
 * One layer's FFN for n tokens (layer-major: the chunk; token-serial: n = 1):
 *   1. norm, router product and top-k on the GPU; the top-k ids come back to the host (n·K ints:
 *      the only synchronisation of the layer);
 *   2. the union in order of first appearance, exactly as layer.c forms it, and per union expert
 *      its rows (t·K + slot);
 *   3. the experts already in VRAM run at once, all of them in one launch per product;
 *   4. each expert that is not: its blob from the streamer (a host hit, or a read from disk that
 *      was fired for every missing expert before the first wait), an asynchronous copy into a VRAM
 *      slot on the upload stream, and the products of up to MISS_BATCH such experts in one launch
 *      on the compute stream once their copies are done — so copies overlap the products of the
 *      experts before them. A VRAM slot is reused
 *      only after the compute stream passed the last product that read it (an event the upload
 *      stream waits on), never by host waits;
 *   5. the weighted sum in slot order and the residual.
 * When the VRAM cache holds every expert of the model and every expert of layer l is in it (after
 * the first passes have uploaded them), steps 1–4 need no host: the union and its row lists are
 * formed on the GPU (smoe_cu_union) and the layer never waits; its statistics (expert counts, union
 * size, hits) come back once per pass, in cuda_settle. SMOE_CUDA_DEVICE_UNION=0 turns that off.
 * Nothing is uploaded that the routing did not ask for, and each union expert once per layer.
 * The products of an expert are the same kernels whichever launch runs them (cuda_ops.h), so
 * layer-major and token-serial agree bit for bit. */
#include "../session.h"
#include "cuda_ops.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { MIN_VSLOTS = 2, RING = 64, MISS_BATCH = 8, HIST_CAP = 4096 };

typedef struct {
    smoe_cu_stream cs, us; /* compute, upload */
    char line[320];
    uint8_t *dense;
    uint8_t *k, *v; /* the KV cache, elements of the session's kv_dtype */
    float *cos, *sin;
    float *x, *xn, *q, *att, *router, *topk_w, *slot_out, *xg, *hg, *h, *logits;
    /* the f16 rows the tensor-core products read (cuda_ops.h, smoe_cu_act): of xn or att (a16),
     * of the gathered rows (g16) and of the SwiGLU output (h16), each with its row scales */
    void *a16, *g16, *h16;
    float *ae, *ge, *he;
    int32_t *topk_idx;
    /* a pass's first position, then its ids (pass[1 ..]): one upload a pass; the kernels read the
     * position from here, so that a recorded decode step replays at any position */
    int32_t *pass, *h_pass;
    float *ks, *vs; /* the pass's new K and V rows, normalised and rotated here, then stored at pos */
    /* A layer's index arrays, one block uploaded with one copy: per union position its first row,
     * row count and VRAM blob (ustart, ucount, wtab), the launch order (items), and each gathered
     * row's t·K + slot (rows, last, so that only the part in use is copied). */
    uint8_t *idx, *h_idx;
    size_t idx_rows_off, idx_bytes;
    uint32_t *rows, *ustart, *ucount, *items;
    const uint8_t **wtab;
    uint32_t *h_rows, *h_ustart, *h_ucount, *h_items;
    const uint8_t **h_wtab;
    /* pinned staging for what the host sends and gets back */
    int32_t *h_topk;
    uint32_t *h_vslot; /* (experts) VRAM slot of each union position */
    int *h_sslot;      /* (experts) streamer slot of each miss, −1 before acquire */
    /* VRAM expert cache */
    uint8_t *vcache;
    uint64_t blob_bytes;
    uint32_t n_vslots;
    int32_t *vslot_of;   /* (layers × experts) */
    int64_t *vslot_key;  /* (n_vslots) −1: empty */
    uint32_t *prev, *next; /* LRU list over slots, sentinel n_vslots; head = least recent */
    smoe_cu_event *vslot_ev; /* (n_vslots) the event after the last product that read it, or NULL */
    smoe_cu_event ring[RING];
    uint32_t ring_next;
    /* streamer slots */
    uint32_t n_sslots;
    bool *registered;
    smoe_cu_event *sslot_ev; /* (n_sslots) after the upload from that slot */
    int *held;               /* streamer slots whose upload was enqueued, not yet released */
    uint32_t n_held;
    /* counters */
    uint64_t uploads, upload_bytes, hits, misses, other_bytes;
    /* The union on the device (the file's comment): per layer whether all its experts are in VRAM
     * (only kept when the cache holds every expert), their blobs' addresses (d_vtab, staged in
     * h_vtab), the lists smoe_cu_union writes, and the statistics it keeps until cuda_settle. */
    bool device_union;
    bool *complete, *pending; /* (layers) */
    const uint8_t **d_vtab, **h_vtab, **d_wtab; /* (layers × experts), (layers × experts), (experts) */
    uint32_t *d_start, *d_count, *d_items, n_items_cap;
    uint32_t *d_counts, *d_used, *d_bad, *h_counts, *h_used, *h_bad; /* (layers × experts), (layers), 1 */
    uint32_t n_pending, n_complete;
    /* A whole decode step recorded once every sparse layer is complete (cuda_decode_step), dropped
     * when one stops being; SMOE_CUDA_GRAPH=0 never records. */
    bool graphs;
    smoe_cu_graph graph;
    /* Sampling's selection on the GPU (cuda_sample): the working logits, the penalty's window of
     * ids and the selection, with their pinned mirrors; SMOE_CUDA_SAMPLE=0 leaves it to the host. */
    bool gpu_sampling;
    float *d_sv;
    int32_t *d_hist, *h_hist;
    smoe_cu_sample_out *d_sout, *h_sout;
    float *fa_part; /* flash attention's splits side by side (smoe_cu_attention_part_floats) */
} cuda_state;

#define ST(s) ((cuda_state *)(s)->backend_state)

static smoe_status cu_fail(smoe_session *s, int err, const char *what) {
    s->broken = true;
    return smoe_fail(SMOE_ERR_INTERNAL, "cuda: %s: %s (the session must be reset)", what, smoe_cu_error_string(err));
}

#define CU(call)                                                                                                       \
    do {                                                                                                               \
        int e_ = (call);                                                                                               \
        if (e_ != 0) return cu_fail(s, e_, #call);                                                                      \
    } while (0)

static smoe_cu_tensor desc(const smoe_tensor *T) {
    smoe_cu_tensor d = {T->format, T->scale_format, T->rows, T->cols, T->group, T->scales_off, T->biases_off};
    return d;
}

/* The device address of a dense tensor. */
static const uint8_t *dev(const smoe_session *s, const smoe_tensor *T) {
    return ST(s)->dense + (T->data - s->vault->dense);
}

static bool same_layout(const smoe_cu_tensor *a, const smoe_cu_tensor *b) {
    return a->format == b->format && a->scale_format == b->scale_format && a->rows == b->rows && a->cols == b->cols &&
           a->group == b->group && a->scales_off == b->scales_off && a->biases_off == b->biases_off;
}

static bool tensor_cores(const smoe_tensor *T) {
    smoe_cu_tensor d = desc(T);
    return smoe_cu_tensor_cores(&d) != 0;
}

/* The activation x (rows of R, ldx floats apart, cols columns) as products read it: its f16 rows
 * are prepared into x16/xe when `need` (some product that reads it runs on the tensor cores; the
 * others read the f32 rows whatever a holds). */
static smoe_status act(smoe_session *s, bool need, const float *x, size_t ldx, uint32_t cols, const smoe_cu_rows *R,
                       void *x16, float *xe, smoe_cu_act *a) {
    *a = (smoe_cu_act){.x = x, .ldx = ldx};
    if (!need) return SMOE_OK;
    CU(smoe_cu_prep(ST(s)->cs, x, ldx, cols, R, x16, xe));
    a->x16 = x16;
    a->xe = xe;
    return SMOE_OK;
}

static smoe_status linear(smoe_session *s, const smoe_tensor *T, const smoe_cu_act *a, uint32_t n, float *y,
                          size_t ldy) {
    smoe_cu_tensor d = desc(T);
    smoe_cu_rows R = {.w = dev(s, T), .n = n};
    CU(smoe_cu_matmul(ST(s)->cs, &d, &R, a, y, ldy));
    return SMOE_OK;
}

/* x rows [0, n) (ld floats apart, cols columns) into the a16 plane when T needs them, then y = x · Tᵀ. */
static smoe_status linear_x(smoe_session *s, const smoe_tensor *T, const float *x, size_t ld, uint32_t cols,
                            uint32_t n, float *y, size_t ldy) {
    cuda_state *c = ST(s);
    smoe_cu_rows R = {.n = n};
    smoe_cu_act a;
    smoe_status st = act(s, tensor_cores(T), x, ld, cols, &R, c->a16, c->ae, &a);
    return st != SMOE_OK ? st : linear(s, T, &a, n, y, ldy);
}

static smoe_status norm(smoe_session *s, float *out, const float *x, uint32_t rows, uint32_t dim,
                        const smoe_tensor *w) {
    CU(smoe_cu_rmsnorm(ST(s)->cs, out, x, rows, dim, dim, dev(s, w), w->format, s->cfg.rms_norm_eps));
    return SMOE_OK;
}

/* out rows [0, rows) = rmsnorm(x rows) · w (dim columns, rows dim apart), and *a the activation
 * the products read: with its f16 rows in the a16 plane, prepared in the same launch, when need. */
static smoe_status norm_act(smoe_session *s, float *out, const float *x, uint32_t rows, uint32_t dim,
                            const smoe_tensor *w, bool need, smoe_cu_act *a) {
    cuda_state *c = ST(s);
    *a = (smoe_cu_act){.x = out, .ldx = dim};
    if (!need) return norm(s, out, x, rows, dim, w);
    CU(smoe_cu_rmsnorm_prep(c->cs, out, x, rows, dim, dev(s, w), w->format, s->cfg.rms_norm_eps, c->a16, c->ae));
    a->x16 = c->a16;
    a->xe = c->ae;
    return SMOE_OK;
}

/* h (rows of R) = SwiGLU of hg's gate and up halves (I columns each), and *a the activation the
 * down product reads: with its f16 rows in the h16 plane, prepared in the same launch, when need. */
static smoe_status swiglu_act(smoe_session *s, bool need, uint32_t I, const smoe_cu_rows *R, smoe_cu_act *a) {
    cuda_state *c = ST(s);
    *a = (smoe_cu_act){.x = c->h, .ldx = I};
    if (!need) {
        CU(smoe_cu_swiglu(c->cs, c->h, c->hg, I, R));
        return SMOE_OK;
    }
    CU(smoe_cu_swiglu_prep(c->cs, c->h, c->hg, I, R, c->h16, c->he));
    a->x16 = c->h16;
    a->xe = c->he;
    return SMOE_OK;
}

static smoe_cu_event ring_event(cuda_state *c) {
    smoe_cu_event ev = c->ring[c->ring_next];
    c->ring_next = (c->ring_next + 1) % RING;
    return ev;
}

/* ------------------------------------------------------------------------- LRU of VRAM slots */

static void lru_unlink(cuda_state *c, uint32_t i) {
    c->next[c->prev[i]] = c->next[i];
    c->prev[c->next[i]] = c->prev[i];
}

static void lru_push_tail(cuda_state *c, uint32_t i) { /* most recent */
    uint32_t S = c->n_vslots;
    c->prev[i] = c->prev[S];
    c->next[i] = S;
    c->next[c->prev[S]] = i;
    c->prev[S] = i;
}

/* Layer l is no longer wholly in VRAM: its unions go back to the host, the recorded step is dropped. */
static void uncomplete(cuda_state *c, uint32_t l) {
    if (!c->complete || !c->complete[l]) return;
    c->complete[l] = false;
    c->n_complete--;
    smoe_cu_graph_free(c->graph);
    c->graph = NULL;
}

static void vram_forget_all(smoe_session *s) {
    cuda_state *c = ST(s);
    size_t keys = (size_t)s->cfg.num_hidden_layers * s->cfg.num_experts;
    for (size_t i = 0; i < keys; i++) c->vslot_of[i] = -1;
    for (uint32_t l = 0; l < s->cfg.num_hidden_layers; l++) uncomplete(c, l);
    uint32_t S = c->n_vslots;
    c->prev[S] = c->next[S] = S;
    for (uint32_t i = 0; i < S; i++) {
        c->vslot_key[i] = -1;
        c->vslot_ev[i] = NULL;
        lru_push_tail(c, i);
    }
}

/* ------------------------------------------------------------------------------ life cycle */

static void cuda_free(smoe_session *s) {
    cuda_state *c = ST(s);
    if (!c) return;
    if (c->cs) smoe_cu_stream_sync(c->cs);
    if (c->us) smoe_cu_stream_sync(c->us);
    for (uint32_t i = 0; i < c->n_held; i++) smoe_streamer_release(s->streamer, c->held[i]);
    if (c->registered)
        for (uint32_t i = 0; i < c->n_sslots; i++)
            if (c->registered[i]) smoe_cu_host_unregister((void *)smoe_streamer_data(s->streamer, (int)i));
    if (c->sslot_ev)
        for (uint32_t i = 0; i < c->n_sslots; i++) smoe_cu_event_free(c->sslot_ev[i]);
    for (int i = 0; i < RING; i++) smoe_cu_event_free(c->ring[i]);
    void *dbufs[] = {c->dense, c->k, c->v, c->cos, c->sin, c->x, c->xn, c->q, c->att, c->router, c->topk_w,
                     c->slot_out, c->xg, c->hg, c->h, c->logits, c->topk_idx, c->pass, c->idx, c->vcache,
                     c->ks, c->vs, c->d_sv, c->d_hist, c->d_sout, c->fa_part,
                     c->a16, c->g16, c->h16, c->ae, c->ge, c->he, (void *)c->d_vtab, (void *)c->d_wtab,
                     c->d_start, c->d_count, c->d_items, c->d_counts, c->d_used, c->d_bad};
    for (size_t i = 0; i < sizeof dbufs / sizeof dbufs[0]; i++) smoe_cu_free(dbufs[i]);
    smoe_cu_graph_free(c->graph);
    void *hbufs[] = {c->h_hist, c->h_sout, c->h_topk, c->h_pass, c->h_idx,
                     (void *)c->h_vtab, c->h_counts, c->h_used, c->h_bad};
    for (size_t i = 0; i < sizeof hbufs / sizeof hbufs[0]; i++) smoe_cu_host_free(hbufs[i]);
    smoe_cu_stream_free(c->cs);
    smoe_cu_stream_free(c->us);
    void *bufs[] = {c->h_vslot, c->h_sslot, c->vslot_of, c->vslot_key, c->prev, c->next, (void *)c->vslot_ev,
                    c->registered, (void *)c->sslot_ev, c->held, c->complete, c->pending};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
    free(c);
    s->backend_state = NULL;
}

/* Every dense matrix the kernels read 8 columns at a time from 16-byte aligned rows. */
static smoe_status check_tensor(const smoe_session *s, const smoe_tensor *T, const char *what) {
    if (!T) return SMOE_OK;
    uint64_t at = T->data ? (uint64_t)(T->data - s->vault->dense) : T->offset;
    if (T->cols % 8 != 0 || at % 16 != 0)
        return smoe_fail(SMOE_ERR_UNSUPPORTED, "cuda: %s (%u × %u at offset %llu) is not a multiple of 8 columns "
                                               "at a 16-byte boundary", what, T->rows, T->cols, (unsigned long long)at);
    return SMOE_OK;
}

static smoe_status check_norm(const smoe_tensor *T, const char *what) {
    if (T->format != SMOE_FMT_F32 && T->format != SMOE_FMT_BF16)
        return smoe_fail(SMOE_ERR_UNSUPPORTED, "cuda: %s is stored as format %u; norms must be f32 or bf16", what,
                         T->format);
    return SMOE_OK;
}

static smoe_status check_layout(const smoe_session *s) {
    const smoe_layout *lay = s->lay;
    smoe_status st;
    if ((st = check_tensor(s, lay->embed, "the embedding")) != SMOE_OK ||
        (st = check_tensor(s, lay->lm_head, "lm_head")) != SMOE_OK ||
        (st = check_norm(lay->final_norm, "the final norm")) != SMOE_OK)
        return st;
    for (uint32_t l = 0; l < s->cfg.num_hidden_layers; l++) {
        const smoe_layer_weights *L = &lay->layers[l];
        const smoe_tensor *mats[] = {L->q, L->k, L->v, L->o, L->router, L->mlp_gate, L->mlp_up, L->mlp_down};
        for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++)
            if ((st = check_tensor(s, mats[i], "a layer's matrix")) != SMOE_OK) return st;
        const smoe_tensor *norms[] = {L->input_norm, L->post_norm, L->q_norm, L->k_norm};
        for (size_t i = 0; i < 4; i++)
            if ((st = check_norm(norms[i], "a layer's norm")) != SMOE_OK) return st;
    }
    if (s->cfg.num_sparse_layers > 0)
        for (int i = 0; i < 3; i++)
            if ((st = check_tensor(s, &lay->expert[i], "an expert matrix")) != SMOE_OK) return st;
    return SMOE_OK;
}

/* VRAM free now (SMOE_CUDA_VRAM_FREE, in bytes, lowers it: for tests). */
static size_t vram_free(void) {
    char name[8];
    int major, minor;
    size_t free_b = 0, total_b = 0;
    if (smoe_cu_device(0, name, sizeof name, &major, &minor, &free_b, &total_b) != 0) return 0;
    const char *lim = getenv("SMOE_CUDA_VRAM_FREE");
    if (lim && strtoull(lim, NULL, 10) < free_b) free_b = (size_t)strtoull(lim, NULL, 10);
    return free_b;
}

static smoe_status dalloc(smoe_session *s, void *pp, size_t bytes) {
    int err = smoe_cu_alloc((void **)pp, bytes);
    if (smoe_cu_out_of_memory(err)) {
        smoe_cu_last_error(); /* not an error of the next launch */
        return smoe_fail(SMOE_ERR_NOMEM, "cuda: %.1f MiB more of VRAM could not be had (%.2f GiB in use by this session, "
                                         "%.2f GiB free): the dense weights, the KV cache (context, kv_dtype) and the "
                                         "planes (chunk) must fit", (double)bytes / (1 << 20),
                         (double)ST(s)->other_bytes / (1u << 30), (double)vram_free() / (1u << 30));
    }
    if (err) return cu_fail(s, err, "smoe_cu_alloc");
    ST(s)->other_bytes += bytes;
    return SMOE_OK;
}

/* The rows of a device union's tiles for n tokens: a power of two from 8 to 64, at most n, holding
 * most experts of a uniform routing whole (mean m = n·K/E rows, m + 2√m); the few bigger ones take
 * two tiles, which costs less than a bigger tile for all (at 45 tokens, m + 3√m + 1 took 16-row
 * tiles: 12 % slower than the host path's kernel choice). Tiles change no bits. */
static uint32_t union_tile(uint32_t n, uint32_t K, uint32_t E) {
    double m = (double)n * K / E, want = m + 2.0 * sqrt(m);
    uint32_t t = 8;
    while (t < want && t < 64) t *= 2;
    return t < n ? t : n;
}

/* The device union's state (cuda_state), when the VRAM cache holds every expert. */
static smoe_status device_union_init(smoe_session *s) {
    cuda_state *c = ST(s);
    smoe_status st;
    size_t L = s->cfg.num_hidden_layers, E = s->cfg.num_experts, K = s->cfg.num_experts_per_tok, C = s->params.chunk;
    c->n_items_cap = 0;
    for (uint32_t n = 1; n <= C; n++) { /* the bound is not monotone in n (the tile follows n) */
        uint32_t b = smoe_cu_union_items(n * (uint32_t)K, (uint32_t)E, union_tile(n, (uint32_t)K, (uint32_t)E));
        c->n_items_cap = b > c->n_items_cap ? b : c->n_items_cap;
    }
    struct { void *pp; size_t bytes; } planes[] = {
        {&c->d_vtab, L * E * sizeof(void *)}, {&c->d_wtab, E * sizeof(void *)}, {&c->d_start, E * 4},
        {&c->d_count, E * 4}, {&c->d_items, c->n_items_cap * 4}, {&c->d_counts, L * E * 4}, {&c->d_used, L * 4},
        {&c->d_bad, 4},
    };
    for (size_t i = 0; i < sizeof planes / sizeof planes[0]; i++)
        if ((st = dalloc(s, planes[i].pp, planes[i].bytes)) != SMOE_OK) return st;
    CU(smoe_cu_memset(c->d_counts, 0, L * E * 4, c->cs));
    CU(smoe_cu_memset(c->d_bad, 0, 4, c->cs));
    CU(smoe_cu_host_alloc((void **)&c->h_vtab, L * E * sizeof(void *)));
    CU(smoe_cu_host_alloc((void **)&c->h_counts, L * E * 4));
    CU(smoe_cu_host_alloc((void **)&c->h_used, L * 4));
    CU(smoe_cu_host_alloc((void **)&c->h_bad, 4));
    c->complete = calloc(L, sizeof *c->complete);
    c->pending = calloc(L, sizeof *c->pending);
    if (!c->complete || !c->pending) return smoe_fail(SMOE_ERR_NOMEM, "cuda: out of memory");
    return SMOE_OK;
}

static smoe_status cuda_init(smoe_session *s) {
    const smoe_config *cf = &s->cfg;
    char name[128];
    int major = 0, minor = 0;
    size_t free_b = 0, total_b = 0;
    int err = smoe_cu_device(0, name, sizeof name, &major, &minor, &free_b, &total_b);
    if (err != 0)
        return smoe_fail(SMOE_ERR_UNSUPPORTED, "cuda: no usable GPU (%s)", smoe_cu_error_string(err));
    int max_pos = smoe_cu_attention_max_positions(cf->head_dim);
    if (s->params.context + 8 > (uint32_t)max_pos)
        return smoe_fail(SMOE_ERR_UNSUPPORTED, "cuda: a context of %u is more than the attention kernel holds (%d)",
                         s->params.context, max_pos - 8);
    smoe_status st = check_layout(s);
    if (st != SMOE_OK) return st;
    if (cf->num_experts > 1024)
        return smoe_fail(SMOE_ERR_UNSUPPORTED, "cuda: %u experts; the routing kernel takes up to 1024", cf->num_experts);
    cuda_state *c = calloc(1, sizeof *c);
    if (!c) return smoe_fail(SMOE_ERR_NOMEM, "cuda: out of memory");
    s->backend_state = c;
    CU(smoe_cu_stream_new(&c->cs));
    CU(smoe_cu_stream_new(&c->us));
    for (int i = 0; i < RING; i++) CU(smoe_cu_event_new(&c->ring[i]));

    size_t C = s->params.chunk, H = cf->hidden_size, E = cf->num_experts, K = cf->num_experts_per_tok;
    size_t L = cf->num_hidden_layers, half = cf->head_dim / 2, ffn = s->ffn;
    size_t kv = L * s->params.context * s->kv_dim * smoe_kv_elem_bytes(s->params.kv_dtype); /* bytes */
    if ((st = dalloc(s, &c->dense, s->lay->dense_bytes)) != SMOE_OK) return st;
    CU(smoe_cu_upload(c->dense, s->vault->dense, s->lay->dense_bytes, c->cs));
    struct { void *pp; size_t bytes; } planes[] = {
        {&c->k, kv}, {&c->v, kv}, {&c->cos, s->params.context * half * 4}, {&c->sin, s->params.context * half * 4},
        {&c->x, C * H * 4}, {&c->xn, C * H * 4}, {&c->q, C * s->q_dim * 4}, {&c->att, C * s->q_dim * 4},
        {&c->router, C * E * 4}, {&c->topk_w, C * K * 4}, {&c->slot_out, C * K * H * 4}, {&c->xg, C * K * H * 4},
        {&c->hg, C * K * 2 * ffn * 4}, {&c->h, C * K * ffn * 4}, {&c->logits, (size_t)cf->vocab_size * 4},
        {&c->fa_part, smoe_cu_attention_part_floats(cf->num_key_value_heads, cf->head_dim, s->params.context) * 4},
        {&c->d_sv, (size_t)cf->vocab_size * 4}, {&c->d_hist, HIST_CAP * 4}, {&c->d_sout, sizeof(smoe_cu_sample_out)},
        {&c->topk_idx, C * K * 4}, {&c->pass, (C + 1) * 4}, {&c->ks, C * s->kv_dim * 4}, {&c->vs, C * s->kv_dim * 4},
        {&c->a16, C * (H > s->q_dim ? H : s->q_dim) * 2}, {&c->ae, C * 4}, {&c->g16, C * K * H * 2},
        {&c->ge, C * K * 4}, {&c->h16, C * K * ffn * 2}, {&c->he, C * K * 4}, {&c->idx, 0},
    };
    c->idx_rows_off = smoe_align_up(12 * E, 8) + E * sizeof(void *);
    c->idx_bytes = c->idx_rows_off + C * K * 4;
    planes[sizeof planes / sizeof planes[0] - 1].bytes = c->idx_bytes;
    for (size_t i = 0; i < sizeof planes / sizeof planes[0]; i++)
        if ((st = dalloc(s, planes[i].pp, planes[i].bytes)) != SMOE_OK) return st;
    CU(smoe_cu_upload(c->cos, s->rope_cos, s->params.context * half * 4, c->cs));
    CU(smoe_cu_upload(c->sin, s->rope_sin, s->params.context * half * 4, c->cs));
    struct { void *pp; size_t bytes; } pinned[] = {
        {&c->h_topk, C * K * 4}, {&c->h_pass, (C + 1) * 4}, {&c->h_idx, c->idx_bytes},
        {&c->h_hist, HIST_CAP * 4}, {&c->h_sout, sizeof(smoe_cu_sample_out)},
    };
    for (size_t i = 0; i < sizeof pinned / sizeof pinned[0]; i++)
        CU(smoe_cu_host_alloc((void **)pinned[i].pp, pinned[i].bytes));
    size_t wtab_off = smoe_align_up(12 * E, 8);
    c->ustart = (uint32_t *)c->idx, c->h_ustart = (uint32_t *)c->h_idx;
    c->ucount = c->ustart + E, c->h_ucount = c->h_ustart + E;
    c->items = c->ucount + E, c->h_items = c->h_ucount + E;
    c->wtab = (const uint8_t **)(c->idx + wtab_off), c->h_wtab = (const uint8_t **)(c->h_idx + wtab_off);
    c->rows = (uint32_t *)(c->idx + c->idx_rows_off), c->h_rows = (uint32_t *)(c->h_idx + c->idx_rows_off);
    const char *sa = getenv("SMOE_CUDA_SAMPLE");
    c->gpu_sampling = !(sa && sa[0] == '0');
    c->h_vslot = calloc(E, sizeof *c->h_vslot);
    c->h_sslot = calloc(E, sizeof *c->h_sslot);
    if (!c->h_vslot || !c->h_sslot) return smoe_fail(SMOE_ERR_NOMEM, "cuda: out of memory");

    if (s->streamer) {
        c->blob_bytes = s->lay->blob_bytes;
        uint64_t total = (uint64_t)cf->num_sparse_layers * E;
        uint64_t n = s->params.gpu_cache_bytes / c->blob_bytes;
        if (n < MIN_VSLOTS) n = MIN_VSLOTS;
        if (n > total) n = total;
        c->n_vslots = (uint32_t)n;
        /* the expert cache takes what gpu_cache_bytes asks, or says plainly that it does not fit
         * (leaving 256 MiB for the runtime's own use) */
        size_t avail = vram_free(), reserve = (size_t)256 << 20;
        if ((size_t)n * c->blob_bytes + reserve > avail)
            return smoe_fail(SMOE_ERR_NOMEM, "cuda: gpu_cache_bytes asks %.2f GiB of VRAM for %llu experts, but %.2f GiB "
                                             "are free after this session's dense weights, KV cache and planes "
                                             "(%.2f GiB): give at most %.2f GiB", (double)n * c->blob_bytes / (1u << 30),
                             (unsigned long long)n, (double)avail / (1u << 30), (double)c->other_bytes / (1u << 30),
                             avail > reserve ? (double)(avail - reserve) / (1u << 30) : 0.0);
        CU(smoe_cu_alloc((void **)&c->vcache, n * c->blob_bytes));
        c->vslot_of = malloc(L * E * sizeof *c->vslot_of);
        c->vslot_key = malloc(n * sizeof *c->vslot_key);
        c->prev = malloc((n + 1) * sizeof *c->prev);
        c->next = malloc((n + 1) * sizeof *c->next);
        c->vslot_ev = calloc(n, sizeof *c->vslot_ev);
        c->n_sslots = (uint32_t)(smoe_streamer_slot_bytes(s->streamer) / c->blob_bytes);
        c->registered = calloc(c->n_sslots, sizeof *c->registered);
        c->sslot_ev = calloc(c->n_sslots, sizeof *c->sslot_ev);
        c->held = calloc(c->n_sslots, sizeof *c->held);
        if (!c->vslot_of || !c->vslot_key || !c->prev || !c->next || !c->vslot_ev || !c->registered || !c->sslot_ev ||
            !c->held)
            return smoe_fail(SMOE_ERR_NOMEM, "cuda: out of memory");
        const char *du = getenv("SMOE_CUDA_DEVICE_UNION");
        c->device_union = n == total && !(du && du[0] == '0');
        if (c->device_union && (st = device_union_init(s)) != SMOE_OK) return st;
        const char *gr = getenv("SMOE_CUDA_GRAPH");
        c->graphs = c->device_union && smoe_cu_attention_fixed(cf->head_dim) && !(gr && gr[0] == '0');
        vram_forget_all(s);
        /* Pinned host slots make the uploads asynchronous DMA; where pinning fails (a locked-memory
         * limit), the copies still work, staged by the driver. SMOE_CUDA_PIN=0 skips it. */
        const char *pin = getenv("SMOE_CUDA_PIN");
        uint32_t pinned_n = 0;
        for (uint32_t i = 0; i < c->n_sslots; i++) {
            CU(smoe_cu_event_new(&c->sslot_ev[i]));
            if (!(pin && pin[0] == '0')) {
                c->registered[i] = smoe_cu_host_register((void *)smoe_streamer_data(s->streamer, (int)i),
                                                         c->blob_bytes) == 0;
                pinned_n += c->registered[i];
            }
        }
        smoe_cu_last_error(); /* a failed registration is not an error of the next launch */
        if (pinned_n < c->n_sslots)
            smoe_log(SMOE_LOG_WARN, "cuda: %u of %u host cache slots pinned", pinned_n, c->n_sslots);
    }
    CU(smoe_cu_stream_sync(c->cs));
    snprintf(c->line, sizeof c->line, "cuda: %s (sm_%d%d), %u expert slots in VRAM (%.2f GiB)%s, %s pinned", name,
             major, minor, c->n_vslots, (double)c->n_vslots * (double)c->blob_bytes / (1u << 30),
             c->device_union ? ": all of them, unions on the GPU" : "", c->n_sslots ? "host cache" : "no host cache");
    return SMOE_OK;
}

/* ------------------------------------------------------------------------------ the blocks */

/* The pass's position (s->pos) and ids up to the GPU. */
static smoe_status stage_pass(smoe_session *s, const int32_t *ids, uint32_t n) {
    cuda_state *c = ST(s);
    CU(smoe_cu_stream_sync(c->cs)); /* the staging buffer's last copy is done */
    c->h_pass[0] = (int32_t)s->pos;
    memcpy(c->h_pass + 1, ids, n * sizeof *ids);
    CU(smoe_cu_upload(c->pass, c->h_pass, (n + 1) * sizeof *ids, c->cs));
    return SMOE_OK;
}

static smoe_status embed_rows(smoe_session *s, uint32_t n) {
    cuda_state *c = ST(s);
    smoe_cu_tensor d = desc(s->lay->embed);
    CU(smoe_cu_embed(c->cs, &d, dev(s, s->lay->embed), c->pass + 1, n, c->x));
    return SMOE_OK;
}

static smoe_status cuda_embed(smoe_session *s, const int32_t *ids, uint32_t n) {
    smoe_status st = stage_pass(s, ids, n);
    return st != SMOE_OK ? st : embed_rows(s, n);
}

static smoe_status cuda_attention(smoe_session *s, uint32_t l, uint32_t pos0, uint32_t n) {
    cuda_state *c = ST(s);
    const smoe_config *cf = &s->cfg;
    const smoe_layer_weights *L = &s->lay->layers[l];
    uint32_t H = cf->hidden_size, hd = cf->head_dim;
    smoe_status st;
    size_t layer_at = (size_t)l * s->params.context * s->kv_dim * smoe_kv_elem_bytes(s->params.kv_dtype);
    uint8_t *kl = c->k + layer_at, *vl = c->v + layer_at;
    const uint32_t *dpos = (const uint32_t *)c->pass;
    smoe_cu_act a;
    /* q, k and v read the same rows: prepared once, for whichever of them needs it */
    bool need = tensor_cores(L->q) || tensor_cores(L->k) || tensor_cores(L->v);
    if ((st = norm_act(s, c->xn, c->x, n, H, L->input_norm, need, &a)) != SMOE_OK ||
        (st = linear(s, L->q, &a, n, c->q, s->q_dim)) != SMOE_OK ||
        (st = linear(s, L->k, &a, n, c->ks, s->kv_dim)) != SMOE_OK ||
        (st = linear(s, L->v, &a, n, c->vs, s->kv_dim)) != SMOE_OK)
        return st;
    CU(smoe_cu_qk_post(c->cs, c->q, c->ks, c->vs, kl, vl, s->params.kv_dtype, n, cf->num_attention_heads,
                       cf->num_key_value_heads, hd, dev(s, L->q_norm), L->q_norm->format, dev(s, L->k_norm),
                       L->k_norm->format, cf->rms_norm_eps, c->cos, c->sin, dpos));
    CU(smoe_cu_attention(c->cs, c->att, c->q, kl, vl, s->params.kv_dtype, n, cf->num_attention_heads,
                         cf->num_key_value_heads, hd, pos0, dpos, c->fa_part, s->params.context));
    if ((st = linear_x(s, L->o, c->att, s->q_dim, s->q_dim, n, c->xn, H)) != SMOE_OK) return st;
    CU(smoe_cu_add(c->cs, c->x, c->xn, (size_t)n * H));
    return SMOE_OK;
}

/* The gathered rows of the union's experts, rows [0, total) of t·K + slot in c->rows: f16 rows
 * from xn's (prepared once) for tensor-core products, f32 rows for the others. */
static smoe_status gather_rows(smoe_session *s, uint32_t total) {
    cuda_state *c = ST(s);
    const smoe_layout *lay = s->lay;
    uint32_t K = s->cfg.num_experts_per_tok, H = s->cfg.hidden_size;
    bool tg = tensor_cores(&lay->expert[0]), tu = tensor_cores(&lay->expert[1]);
    if (tg || tu) CU(smoe_cu_gather16(c->cs, c->g16, c->ge, c->a16, c->ae, c->rows, K, total, H));
    if (!tg || !tu) CU(smoe_cu_gather(c->cs, c->xg, c->xn, c->rows, K, total, H));
    return SMOE_OK;
}

/* The host path's lists: union positions items[first .. first + count), max_rows the most rows any
 * of them has. */
static smoe_cu_rows host_items(const cuda_state *c, uint32_t first, uint32_t count, uint32_t max_rows) {
    return (smoe_cu_rows){.wtab = c->wtab, .items = c->items + first, .start = c->ustart, .count = c->ucount,
                          .n_items = count, .max_count = max_rows};
}

/* gate, up, SwiGLU and down of the items of R; then the event that says their slots are free. */
static smoe_status run_experts(smoe_session *s, const smoe_cu_rows *items, smoe_cu_event *done) {
    cuda_state *c = ST(s);
    const smoe_layout *lay = s->lay;
    uint32_t H = s->cfg.hidden_size, I = lay->expert[0].rows;
    smoe_cu_tensor g = desc(&lay->expert[0]), u = desc(&lay->expert[1]), d = desc(&lay->expert[2]);
    smoe_cu_rows R = *items;
    smoe_cu_act xg = {.x = c->xg, .ldx = H, .x16 = c->g16, .xe = c->ge}; /* moe() prepared the f16 rows */
    R.woff = lay->expert[0].offset;
    if (same_layout(&g, &u)) { /* gate and up alike: one launch for both (a pair) */
        R.pair = 1;
        R.woff2 = lay->expert[1].offset;
        CU(smoe_cu_matmul(c->cs, &g, &R, &xg, c->hg, 2 * (size_t)I));
        R.pair = 0;
    } else {
        CU(smoe_cu_matmul(c->cs, &g, &R, &xg, c->hg, 2 * (size_t)I));
        R.woff = lay->expert[1].offset;
        CU(smoe_cu_matmul(c->cs, &u, &R, &xg, c->hg + I, 2 * (size_t)I));
    }
    smoe_cu_act h;
    smoe_status st = swiglu_act(s, tensor_cores(&lay->expert[2]), I, &R, &h);
    if (st != SMOE_OK) return st;
    R.woff = lay->expert[2].offset;
    R.yrow = c->rows;
    CU(smoe_cu_matmul(c->cs, &d, &R, &h, c->slot_out, H));
    *done = ring_event(c);
    CU(smoe_cu_event_record(*done, c->cs));
    return SMOE_OK;
}

/* Releases the streamer slots whose uploads were enqueued (waiting for the copies), and, after a
 * failure, the misses [from, n_miss) that were acquired but not uploaded, whose VRAM slots then
 * hold nothing. */
static void release_held(smoe_session *s) {
    cuda_state *c = ST(s);
    for (uint32_t i = 0; i < c->n_held; i++) {
        smoe_cu_event_sync(c->sslot_ev[c->held[i]]);
        smoe_streamer_release(s->streamer, c->held[i]);
    }
    c->n_held = 0;
}

static void abandon(smoe_session *s, uint32_t l, const uint32_t *miss, uint32_t from, uint32_t n_miss) {
    cuda_state *c = ST(s);
    release_held(s);
    for (uint32_t i = from; i < n_miss; i++) {
        uint32_t u = miss[i], vs = c->h_vslot[u];
        if (c->h_sslot[u] >= 0) smoe_streamer_release(s->streamer, c->h_sslot[u]);
        c->h_sslot[u] = -1;
        c->vslot_of[(size_t)l * s->cfg.num_experts + (uint32_t)s->union_list[u]] = -1;
        c->vslot_key[vs] = -1;
    }
}

/* The union and its lists on the GPU for a layer whose experts are all in VRAM: no host round trip
 * (the file's comment). Same products, same bits as moe()'s host path: only the order of the union
 * and the tiles differ, and neither changes an element's reduction. */
static smoe_status moe_on_device(smoe_session *s, uint32_t l, uint32_t n) {
    cuda_state *c = ST(s);
    const smoe_config *cf = &s->cfg;
    uint32_t E = cf->num_experts, K = cf->num_experts_per_tok, H = cf->hidden_size, nk = n * K;
    uint32_t tile = union_tile(n, K, E), n_items = smoe_cu_union_items(nk, E, tile);
    CU(smoe_cu_union(c->cs, c->topk_idx, nk, E, tile, n_items, c->d_vtab + (size_t)l * E, c->d_wtab, c->d_start,
                     c->d_count, c->d_items, c->rows, c->d_counts + (size_t)l * E, c->d_used + l, c->d_bad));
    if (!c->pending[l]) c->pending[l] = true, c->n_pending++;
    smoe_cu_rows R = {.wtab = c->d_wtab, .items = c->d_items, .start = c->d_start, .count = c->d_count,
                      .n_items = n_items, .max_count = tile, .tile = tile};
    smoe_cu_event done;
    smoe_status st;
    if ((st = gather_rows(s, nk)) != SMOE_OK || (st = run_experts(s, &R, &done)) != SMOE_OK) return st;
    CU(smoe_cu_moe_sum(c->cs, c->x, c->slot_out, c->topk_w, n, K, H));
    return SMOE_OK;
}

/* After the host path ran layer l: when the cache holds every expert and now all of l's, l's blob
 * addresses go up once and its next passes take moe_on_device. */
static smoe_status note_complete(smoe_session *s, uint32_t l) {
    cuda_state *c = ST(s);
    uint32_t E = s->cfg.num_experts;
    if (!c->device_union || c->complete[l]) return SMOE_OK;
    for (uint32_t e = 0; e < E; e++)
        if (c->vslot_of[(size_t)l * E + e] < 0) return SMOE_OK;
    const uint8_t **h = c->h_vtab + (size_t)l * E;
    for (uint32_t e = 0; e < E; e++) h[e] = c->vcache + (size_t)c->vslot_of[(size_t)l * E + e] * c->blob_bytes;
    CU(smoe_cu_upload(c->d_vtab + (size_t)l * E, h, E * sizeof *h, c->cs));
    c->complete[l] = true;
    c->n_complete++;
    return SMOE_OK;
}

/* a: xn as cuda_ffn prepared it (its f16 rows for the router if it needs them and for the experts'
 * gathered rows). */
static smoe_status moe(smoe_session *s, uint32_t l, uint32_t n, const smoe_cu_act *a, uint32_t *union_size) {
    cuda_state *c = ST(s);
    const smoe_config *cf = &s->cfg;
    const smoe_layer_weights *L = &s->lay->layers[l];
    uint32_t E = cf->num_experts, K = cf->num_experts_per_tok, H = cf->hidden_size;
    smoe_status st;
    if ((st = linear(s, L->router, a, n, c->router, E)) != SMOE_OK) return st;
    CU(smoe_cu_route(c->cs, c->router, n, E, K, cf->norm_topk_prob, c->topk_idx, c->topk_w));
    if (c->device_union && c->complete[l]) {
        *union_size = 0; /* cuda_settle writes it */
        return moe_on_device(s, l, n);
    }
    CU(smoe_cu_download(c->h_topk, c->topk_idx, (size_t)n * K * 4, c->cs));
    CU(smoe_cu_stream_sync(c->cs));

    /* The union in order of first appearance (layer.c's), and each expert's rows. */
    memset(s->exp_count, 0, E * sizeof(uint32_t));
    uint32_t nu = 0;
    for (uint32_t t = 0; t < n; t++)
        for (uint32_t k = 0; k < K; k++) {
            int32_t e = c->h_topk[(size_t)t * K + k];
            if (e < 0 || (uint32_t)e >= E) return cu_fail(s, 0, "routing gave an expert out of range");
            s->expert_counts[(size_t)l * E + (uint32_t)e]++;
            if (s->exp_count[e] == 0) s->union_list[nu++] = e;
            s->exp_rows[(size_t)e * s->params.chunk + s->exp_count[e]++] = t * K + k;
        }
    *union_size = nu;
    uint32_t off = 0, n_hit = 0, n_miss = 0, max_hit = 0;
    uint32_t *miss = s->pending; /* (experts) union positions that need an upload */
    for (uint32_t u = 0; u < nu; u++) {
        uint32_t e = (uint32_t)s->union_list[u], m = s->exp_count[e];
        c->h_ustart[u] = off;
        c->h_ucount[u] = m;
        memcpy(c->h_rows + off, s->exp_rows + (size_t)e * s->params.chunk, m * sizeof(uint32_t));
        off += m;
        int32_t vs = c->vslot_of[(size_t)l * E + e];
        if (vs >= 0) {
            c->h_items[n_hit++] = u;
            max_hit = m > max_hit ? m : max_hit;
            c->h_vslot[u] = (uint32_t)vs;
            lru_unlink(c, (uint32_t)vs);
            lru_push_tail(c, (uint32_t)vs);
        } else {
            miss[n_miss++] = u;
        }
    }
    /* Misses take the least recently used slots, in union order; a slot taken twice in this layer is
     * reused only after the product that read it (events, below). */
    for (uint32_t i = 0; i < n_miss; i++) {
        uint32_t u = miss[i], e = (uint32_t)s->union_list[u], vs = c->next[c->n_vslots];
        if (c->vslot_key[vs] >= 0) {
            c->vslot_of[c->vslot_key[vs]] = -1;
            uncomplete(c, (uint32_t)(c->vslot_key[vs] / E));
        }
        c->vslot_key[vs] = (int64_t)l * E + e;
        c->vslot_of[(size_t)l * E + e] = (int32_t)vs;
        lru_unlink(c, vs);
        lru_push_tail(c, vs);
        c->h_vslot[u] = vs;
        c->h_items[n_hit + i] = u;
        c->h_sslot[u] = -1;
    }
    for (uint32_t u = 0; u < nu; u++) c->h_wtab[u] = c->vcache + (size_t)c->h_vslot[u] * c->blob_bytes;
    c->hits += n_hit;
    c->misses += n_miss;
    CU(smoe_cu_upload(c->idx, c->h_idx, c->idx_rows_off + (size_t)off * 4, c->cs));
    if ((st = gather_rows(s, off)) != SMOE_OK) return st;

    /* Fire every miss's read (as far as the host cache's slots allow) before the first wait. */
    uint32_t acquired = 0;
    for (; acquired < n_miss; acquired++) {
        int slot = smoe_streamer_acquire(s->streamer, l, (uint32_t)s->union_list[miss[acquired]]);
        if (slot < 0) break;
        c->h_sslot[miss[acquired]] = slot;
    }
    smoe_streamer_submit(s->streamer);

    if (n_hit > 0) {
        smoe_cu_event done;
        smoe_cu_rows R = host_items(c, 0, n_hit, max_hit);
        if ((st = run_experts(s, &R, &done)) != SMOE_OK) {
            abandon(s, l, miss, 0, n_miss);
            return st;
        }
        for (uint32_t i = 0; i < n_hit; i++) c->vslot_ev[c->h_vslot[c->h_items[i]]] = done;
    }

    uint32_t batch0 = 0, batch_rows = 0; /* the misses [batch0, i) uploaded, their products not yet enqueued */
    for (uint32_t i = 0; i < n_miss; i++) {
        uint32_t u = miss[i], vs = c->h_vslot[u];
        if ((st = smoe_session_check_cancel(s, l)) != SMOE_OK) {
            abandon(s, l, miss, i, n_miss);
            return st;
        }
        while (c->h_sslot[u] < 0) { /* no host slot was free at the first pass: free some, acquire again */
            if (c->n_held > 0) {
                release_held(s);
            } else if (!smoe_streamer_settle(s->streamer)) {
                abandon(s, l, miss, i, n_miss);
                return smoe_fail(SMOE_ERR_INTERNAL, "cuda: layer %u: no host cache slot could be acquired", l);
            }
            for (; acquired < n_miss; acquired++) {
                int slot = smoe_streamer_acquire(s->streamer, l, (uint32_t)s->union_list[miss[acquired]]);
                if (slot < 0) break;
                c->h_sslot[miss[acquired]] = slot;
            }
            smoe_streamer_submit(s->streamer);
        }
        int slot = c->h_sslot[u];
        if ((st = smoe_streamer_wait(s->streamer, slot)) != SMOE_OK) {
            abandon(s, l, miss, i, n_miss);
            return st;
        }
        int e1 = 0;
        if (c->vslot_ev[vs]) e1 = smoe_cu_stream_wait(c->us, c->vslot_ev[vs]);
        if (!e1) e1 = smoe_cu_upload(c->vcache + (size_t)vs * c->blob_bytes, smoe_streamer_data(s->streamer, slot),
                                     c->blob_bytes, c->us);
        if (!e1) e1 = smoe_cu_event_record(c->sslot_ev[slot], c->us);
        if (e1) {
            abandon(s, l, miss, i, n_miss);
            return cu_fail(s, e1, "expert upload");
        }
        c->held[c->n_held++] = slot;
        c->h_sslot[u] = -1;
        c->uploads++;
        c->upload_bytes += c->blob_bytes;
        batch_rows = c->h_ucount[u] > batch_rows ? c->h_ucount[u] : batch_rows;
        /* The products of up to MISS_BATCH uploaded experts go in one launch, once the last of their
         * copies is done (the upload stream runs in order). Consecutive misses take distinct slots
         * (LRU, at most n_vslots apart), so no slot of a batch is uploaded twice before its products. */
        if (i + 1 - batch0 < MISS_BATCH && i + 1 - batch0 < c->n_vslots && i + 1 < n_miss) continue;
        if ((e1 = smoe_cu_stream_wait(c->cs, c->sslot_ev[slot])) != 0) {
            abandon(s, l, miss, i + 1, n_miss);
            return cu_fail(s, e1, "expert upload");
        }
        smoe_cu_event done;
        smoe_cu_rows R = host_items(c, n_hit + batch0, i + 1 - batch0, batch_rows);
        if ((st = run_experts(s, &R, &done)) != SMOE_OK) {
            abandon(s, l, miss, i + 1, n_miss);
            return st;
        }
        for (uint32_t j = batch0; j <= i; j++) c->vslot_ev[c->h_vslot[miss[j]]] = done;
        batch0 = i + 1;
        batch_rows = 0;
    }
    CU(smoe_cu_moe_sum(c->cs, c->x, c->slot_out, c->topk_w, n, K, H));
    release_held(s);
    return note_complete(s, l);
}

static smoe_status cuda_ffn(smoe_session *s, uint32_t l, uint32_t n, uint32_t *union_size) {
    cuda_state *c = ST(s);
    const smoe_layer_weights *L = &s->lay->layers[l];
    uint32_t H = s->cfg.hidden_size;
    smoe_status st;
    smoe_cu_act a;
    if (L->sparse) {
        bool need = tensor_cores(&s->lay->expert[0]) || tensor_cores(&s->lay->expert[1]) || tensor_cores(L->router);
        if ((st = norm_act(s, c->xn, c->x, n, H, L->post_norm, need, &a)) != SMOE_OK) return st;
        return moe(s, l, n, &a, union_size);
    }
    *union_size = 0;
    uint32_t I = L->mlp_gate->rows;
    smoe_cu_rows R = {.n = n};
    bool need = tensor_cores(L->mlp_gate) || tensor_cores(L->mlp_up);
    if ((st = norm_act(s, c->xn, c->x, n, H, L->post_norm, need, &a)) != SMOE_OK ||
        (st = linear(s, L->mlp_gate, &a, n, c->hg, 2 * (size_t)I)) != SMOE_OK ||
        (st = linear(s, L->mlp_up, &a, n, c->hg + I, 2 * (size_t)I)) != SMOE_OK)
        return st;
    if ((st = swiglu_act(s, tensor_cores(L->mlp_down), I, &R, &a)) != SMOE_OK ||
        (st = linear(s, L->mlp_down, &a, n, c->xg, H)) != SMOE_OK)
        return st;
    CU(smoe_cu_add(c->cs, c->x, c->xg, (size_t)n * H));
    return SMOE_OK;
}

static smoe_status logits_row(smoe_session *s) {
    cuda_state *c = ST(s);
    smoe_status st;
    uint32_t H = s->cfg.hidden_size;
    smoe_cu_act a;
    if ((st = norm_act(s, c->xn, c->x, 1, H, s->lay->final_norm, tensor_cores(s->lay->lm_head), &a)) != SMOE_OK ||
        (st = linear(s, s->lay->lm_head, &a, 1, c->logits, s->cfg.vocab_size)) != SMOE_OK)
        return st;
    return SMOE_OK;
}

static smoe_status logits_back(smoe_session *s) {
    cuda_state *c = ST(s);
    CU(smoe_cu_download(s->logits, c->logits, (size_t)s->cfg.vocab_size * 4, c->cs));
    CU(smoe_cu_stream_sync(c->cs));
    return SMOE_OK;
}

static smoe_status cuda_logits(smoe_session *s) {
    smoe_status st = logits_row(s);
    return st != SMOE_OK ? st : logits_back(s);
}

/* One decode step's kernels, embedding to logits row, as decode.c would enqueue them. */
static smoe_status step_kernels(smoe_session *s) {
    smoe_status st = embed_rows(s, 1);
    for (uint32_t l = 0; st == SMOE_OK && l < s->cfg.num_hidden_layers; l++) {
        uint32_t used;
        if ((st = cuda_attention(s, l, s->pos, 1)) == SMOE_OK) st = cuda_ffn(s, l, 1, &used);
    }
    return st != SMOE_OK ? st : logits_row(s);
}

/* Once every sparse layer's experts are all in VRAM, a decode step's launches are the same at every
 * position (the position is read on the GPU, the unions are formed there): the first such step
 * records them, each later one replays the recording, so the host launches one graph instead of
 * some 25 kernels a layer. The bits are those of the per-layer walk (the same kernels). */
static smoe_status cuda_decode_step(smoe_session *s, int32_t id, bool *ran) {
    cuda_state *c = ST(s);
    *ran = false;
    if (!c->graphs || c->n_complete < s->cfg.num_sparse_layers) return SMOE_OK;
    *ran = true;
    smoe_status st = stage_pass(s, &id, 1);
    if (st != SMOE_OK) return st;
    if (!c->graph) {
        CU(smoe_cu_capture_begin(c->cs));
        st = step_kernels(s);
        int e = smoe_cu_capture_end(c->cs, st == SMOE_OK, &c->graph);
        if (st != SMOE_OK) return st;
        if (e) return cu_fail(s, e, "recording a decode step");
    }
    CU(smoe_cu_graph_launch(c->graph, c->cs));
    for (uint32_t l = 0; l < s->cfg.num_hidden_layers; l++)
        if (s->lay->layers[l].sparse && !c->pending[l]) c->pending[l] = true, c->n_pending++;
    return logits_back(s);
}

/* The end of a pass: waits for the GPU and brings back what the device unions kept (backend.h). */
static smoe_status cuda_settle(smoe_session *s, uint32_t *union_sizes) {
    cuda_state *c = ST(s);
    uint32_t L = s->cfg.num_hidden_layers, E = s->cfg.num_experts;
    if (c->n_pending == 0) {
        CU(smoe_cu_stream_sync(c->cs));
        return SMOE_OK;
    }
    CU(smoe_cu_download(c->h_counts, c->d_counts, (size_t)L * E * 4, c->cs));
    CU(smoe_cu_download(c->h_used, c->d_used, (size_t)L * 4, c->cs));
    CU(smoe_cu_download(c->h_bad, c->d_bad, 4, c->cs));
    CU(smoe_cu_memset(c->d_counts, 0, (size_t)L * E * 4, c->cs));
    CU(smoe_cu_stream_sync(c->cs));
    for (uint32_t l = 0; l < L; l++) {
        if (!c->pending[l]) continue;
        c->pending[l] = false;
        for (uint32_t e = 0; e < E; e++) s->expert_counts[(size_t)l * E + e] += c->h_counts[(size_t)l * E + e];
        c->hits += c->h_used[l];
        if (union_sizes) union_sizes[l] = c->h_used[l];
    }
    c->n_pending = 0;
    if (*c->h_bad) return cu_fail(s, 0, "routing gave an expert out of range");
    return SMOE_OK;
}

/* The selection of smoe_sample on the GPU, the draw among the candidates on the host (sample.h):
 * the same id as smoe_sample over the same logits. Greedy and top-k up to SAMPLE_CAP; anything
 * else (no top-k with a temperature, a longer penalty window) is left to the host. */
static smoe_status cuda_sample(smoe_session *s, int32_t *next_id, bool *done) {
    cuda_state *c = ST(s);
    const smoe_sampler_params *p = &s->sampler.p;
    uint32_t V = s->cfg.vocab_size;
    *done = false;
    if (!c->gpu_sampling) return SMOE_OK;
    if (p->temperature > 0.0f && !(p->top_k > 0 && p->top_k <= SAMPLE_CAP && p->top_k < V)) return SMOE_OK;
    uint32_t w = 0;
    if (p->repetition_penalty > 0.0f && p->repetition_penalty != 1.0f && p->repetition_window > 0) {
        w = s->pos < p->repetition_window ? s->pos : p->repetition_window;
        if (w > HIST_CAP) return SMOE_OK;
        memcpy(c->h_hist, s->history + s->pos - w, w * sizeof *c->h_hist); /* the last step synced */
        CU(smoe_cu_upload(c->d_hist, c->h_hist, w * sizeof *c->h_hist, c->cs));
    }
    CU(smoe_cu_sample_select(c->cs, c->logits, c->d_sv, V, c->d_hist, w, p->repetition_penalty, p->temperature,
                             p->top_k, c->d_sout));
    CU(smoe_cu_download(c->h_sout, c->d_sout, sizeof *c->h_sout, c->cs));
    CU(smoe_cu_stream_sync(c->cs));
    const smoe_cu_sample_out *o = c->h_sout;
    if (o->flags == 2) return SMOE_OK;
    *done = true;
    if (o->flags == 1) {
        *next_id = o->best;
        return SMOE_OK;
    }
    for (uint32_t j = 0; j < o->count; j++) {
        s->sample_f[o->ids[j]] = o->vals[j];
        s->sample_i[j] = o->ids[j];
    }
    *next_id = smoe_sample_top(&s->sampler, s->sample_f, s->sample_i, o->count, o->m);
    return SMOE_OK;
}

static smoe_status cuda_read_kv(const smoe_session *cs, uint32_t layer, uint32_t start, uint32_t n, float *k, float *v) {
    smoe_session *s = (smoe_session *)cs; /* cu_fail marks it broken */
    cuda_state *c = ST(s);
    uint32_t dt = s->params.kv_dtype;
    size_t es = smoe_kv_elem_bytes(dt), count = (size_t)n * s->kv_dim;
    size_t at = ((size_t)layer * s->params.context + start) * s->kv_dim * es;
    /* the stored elements land in the front of the caller's floats, then widen in place from the
     * last one down (element i's float never covers an element below i that is still to be read) */
    if (k) CU(smoe_cu_download(k, c->k + at, count * es, c->cs));
    if (v) CU(smoe_cu_download(v, c->v + at, count * es, c->cs));
    CU(smoe_cu_stream_sync(c->cs));
    if (es != 4)
        for (size_t i = count; i-- > 0;) {
            if (k) smoe_kv_load(k + i, (const uint8_t *)k + i * es, 1, dt);
            if (v) smoe_kv_load(v + i, (const uint8_t *)v + i * es, 1, dt);
        }
    return SMOE_OK;
}

static void cuda_cache_clear(smoe_session *s) {
    cuda_state *c = ST(s);
    smoe_cu_stream_sync(c->cs);
    smoe_cu_stream_sync(c->us);
    if (c->n_vslots) vram_forget_all(s);
}

static const char *cuda_describe(const smoe_session *s) { return ST(s)->line; }

static void cuda_device_stats(const smoe_session *s, smoe_device_counters *out) {
    const cuda_state *c = ST(s);
    out->uploads = c->uploads;
    out->upload_bytes = c->upload_bytes;
    out->vram_hits = c->hits;
    out->vram_misses = c->misses;
    out->vram_cache_bytes = (uint64_t)c->n_vslots * c->blob_bytes;
    out->vram_other_bytes = c->other_bytes;
    out->vram_slots = c->n_vslots;
}

const smoe_backend smoe_backend_cuda = {
    .name = "cuda",
    .init = cuda_init,
    .free = cuda_free,
    .embed = cuda_embed,
    .attention = cuda_attention,
    .ffn = cuda_ffn,
    .logits = cuda_logits,
    .decode_step = cuda_decode_step,
    .sample = cuda_sample,
    .settle = cuda_settle,
    .read_kv = cuda_read_kv,
    .cache_clear = cuda_cache_clear,
    .describe = cuda_describe,
    .device_stats = cuda_device_stats,
};
