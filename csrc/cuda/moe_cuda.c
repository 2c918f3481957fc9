/* moe_cuda.c — the CUDA backend's part of the MoE step (engine/moe.c owns the step): routing, the
 * experts of a union, their combination, the device tier (a VRAM expert cache), a layer routed on
 * the device alone, and the recorded decode step.
 *
 * The engine's walk of a layer:
 *   1. route: norm's f16 rows, router product and top-k on the GPU; the ids come back (n·K ints:
 *      the only wait of the layer);
 *   2. the engine forms the union, looks each expert up in the tier (a hit touches its slot),
 *      and runs the hits at once: `experts` uploads the layer's index block (rows, counts; the
 *      first call) and the launch order and blobs of its items, gathers the rows, and runs gate+up
 *      (one "pair" launch when they are alike), SwiGLU and down for all its experts in one launch
 *      each;
 *   3. each miss, as its blob lands in a host slot: a VRAM slot claimed (the least recently used
 *      of its layer's share: see "the device tier" below), the
 *      blob copied in on the upload stream (tier_fill), and the products of up to MISS_BATCH such
 *      experts in one launch on the compute stream once their copies are done — so copies overlap
 *      the products of the experts before them;
 *   4. combine: the weighted sum in slot order and the residual.
 * When the cache holds every expert of the model and every expert of layer l is in it, the whole
 * step runs on the GPU (moe_resident): the union and its row lists are formed there (smoe_cu_union)
 * and the layer never waits; its routed ids come back once per pass (pass_end). Once every sparse
 * layer is so, a decode step's launches are the same at every position (the position is read on
 * the GPU): the first such step is recorded, each later one replays it. SMOE_CUDA_DEVICE_UNION=0
 * and SMOE_CUDA_GRAPH=0 turn those off. The products of an expert are the same kernels whichever
 * launch runs them (cuda_ops.h), so the bits are those of the walk. */
#include "cuda/cuda_state.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------- the products */

static bool same_layout(const smoe_cu_tensor *a, const smoe_cu_tensor *b) {
    return a->format == b->format && a->scale_format == b->scale_format && a->rows == b->rows && a->cols == b->cols &&
           a->group == b->group && a->scales_off == b->scales_off && a->biases_off == b->biases_off;
}

/* The gathered rows of the union's experts, rows [0, total) of t·K + slot in c->rows: f16 rows
 * from XN's (prepared by its norm) for tensor-core products, f32 rows for the others. */
static smoe_status gather_rows(cuda_state *c, uint32_t total) {
    const smoe_tensor *X = c->xl_now->t; /* the layer's blob layout (GGUF mixes differ by layer) */
    const uint32_t K = c->cfg->num_experts_per_tok, H = c->cfg->hidden_size;
    const bool tg = smoe_cuda_tensor_cores(&X[0]), tu = smoe_cuda_tensor_cores(&X[1]);
    smoe_cu_act a;
    smoe_status st = smoe_cuda_act(c, SMOE_PL_XN, total / K, tg || tu, &a);
    if (st != SMOE_OK) return st;
    if (tg || tu) CU(smoe_cu_gather16(c->sh->cs, c->g16, c->ge, c->a16, c->ae, c->rows, K, total, H));
    if (!tg || !tu) CU(smoe_cu_gather(c->sh->cs, c->xg, c->xn, c->rows, K, total, H));
    return SMOE_OK;
}

/* gate, up, SwiGLU and down of the items of R; then the event that says their slots are free. */
static smoe_status run_experts(cuda_state *c, const smoe_cu_rows *items, smoe_cu_event *done) {
    const smoe_tensor *X = c->xl_now->t; /* the layer's blob layout (GGUF mixes differ by layer) */
    const uint32_t H = c->cfg->hidden_size, I = X[0].rows;
    const smoe_cu_tensor g = smoe_cuda_desc(&X[0]), u = smoe_cuda_desc(&X[1]), d = smoe_cuda_desc(&X[2]);
    smoe_cu_rows R = *items;
    const smoe_cu_act xg = {.x = c->xg, .ldx = H, .x16 = c->g16, .xe = c->ge}; /* gather_rows made them */
    R.woff = X[0].offset;
    if (same_layout(&g, &u)) { /* gate and up alike: one launch for both (a pair) */
        R.pair = 1;
        R.woff2 = X[1].offset;
        CU(smoe_cu_matmul(c->sh->cs, &g, &R, &xg, c->hg, 2 * (size_t)I));
        R.pair = 0;
    } else {
        CU(smoe_cu_matmul(c->sh->cs, &g, &R, &xg, c->hg, 2 * (size_t)I));
        R.woff = X[1].offset;
        CU(smoe_cu_matmul(c->sh->cs, &u, &R, &xg, c->hg + I, 2 * (size_t)I));
    }
    const bool *has = c->xl_now->has;
    const smoe_tensor *t = X;
    if (has[SMOE_XT_GATE_BIAS]) /* gpt-oss: each expert's biases, from its blob, after its products */
        CU(smoe_cu_bias_items(c->sh->cs, c->hg, 2 * (size_t)I, 0, &R, t[SMOE_XT_GATE_BIAS].offset,
                              t[SMOE_XT_GATE_BIAS].format, I));
    if (has[SMOE_XT_UP_BIAS])
        CU(smoe_cu_bias_items(c->sh->cs, c->hg, 2 * (size_t)I, I, &R, t[SMOE_XT_UP_BIAS].offset,
                              t[SMOE_XT_UP_BIAS].format, I));
    smoe_cu_act h;
    smoe_status st = smoe_cuda_swiglu(c, smoe_cuda_tensor_cores(&X[2]), true, I, &R, &h);
    if (st != SMOE_OK) return st;
    R.woff = X[2].offset;
    R.yrow = c->rows;
    CU(smoe_cu_matmul(c->sh->cs, &d, &R, &h, c->slot_out, H));
    if (has[SMOE_XT_DOWN_BIAS])
        CU(smoe_cu_bias_items(c->sh->cs, c->slot_out, H, 0, &R, t[SMOE_XT_DOWN_BIAS].offset,
                              t[SMOE_XT_DOWN_BIAS].format, H));
    *done = smoe_cuda_ring_event(c->sh);
    CU(smoe_cu_event_record(*done, c->sh->cs));
    return SMOE_OK;
}

/* The router's product and top-k of XN rows [0, n) into idx (device) and topk_w, by r's rule:
 * softmax then top-k (Qwen3-MoE, Mixtral, OLMoE); the grouped sigmoid router with r->bias as its
 * correction (GLM-4.5, the vault's n_group, topk_group, routed_scaling_factor); r->bias added to the
 * logits, then top-k and a softmax over those k (gpt-oss). */
static smoe_status route_on_device(cuda_state *c, const smoe_route *r, uint32_t n, int32_t *idx) {
    const uint32_t E = c->cfg->num_experts, K = r->K;
    const smoe_model_params *m = &c->lay->mp;
    smoe_cu_act a;
    smoe_status st = smoe_cuda_act(c, SMOE_PL_XN, n, smoe_cuda_tensor_cores(r->W), &a);
    if (st != SMOE_OK || (st = smoe_cuda_linear(c, r->W, &a, n, c->router, E)) != SMOE_OK) return st;
    switch (r->kind) {
    case SMOE_ROUTER_SIGMOID_GROUP:
        if (!r->bias) return smoe_fail(SMOE_ERR_INTERNAL, "cuda: the grouped router without its router.bias");
        CU(smoe_cu_route_grouped(c->sh->cs, c->router, n, E, smoe_cuda_dev(c, r->bias), r->bias->format, m->n_group,
                                 m->topk_group, K, r->renorm, m->routed_scaling_factor, idx, c->topk_w));
        return SMOE_OK;
    case SMOE_ROUTER_TOPK_SOFTMAX:
        if (r->bias) CU(smoe_cu_bias(c->sh->cs, c->router, n, E, smoe_cuda_dev(c, r->bias), r->bias->format));
        CU(smoe_cu_route_topk_softmax(c->sh->cs, c->router, n, E, K, idx, c->topk_w));
        return SMOE_OK;
    default:
        if (r->bias) return smoe_fail(SMOE_ERR_INTERNAL, "cuda: a softmax router with a bias");
        CU(smoe_cu_route(c->sh->cs, c->router, n, E, K, r->renorm, idx, c->topk_w));
        return SMOE_OK;
    }
}

/* The ids of the pass's rows back to the host: the only wait of a layer the engine walks. */
static smoe_status ids_to_host(cuda_state *c, uint32_t K, uint32_t n, int32_t *ids) {
    CU(smoe_cu_download(c->h_topk, c->topk_idx, (size_t)n * K * 4, c->sh->cs));
    CU(smoe_cu_stream_sync(c->sh->cs)); /* also: every copy from the index block's staging is done */
    memcpy(ids, c->h_topk, (size_t)n * K * sizeof *ids);
    return SMOE_OK;
}

smoe_status smoe_cuda_route_grouped(void *b, const smoe_tensor *router, const smoe_tensor *bias, uint32_t K,
                                    bool renorm, uint32_t n, int32_t *ids) {
    cuda_state *c = b;
    const smoe_route r = {router, bias, K, SMOE_ROUTER_SIGMOID_GROUP, renorm};
    smoe_status st = route_on_device(c, &r, n, c->topk_idx);
    return st != SMOE_OK ? st : ids_to_host(c, K, n, ids);
}

smoe_status smoe_cuda_route(void *b, const smoe_route *r, uint32_t n, int32_t *ids) {
    cuda_state *c = b;
    smoe_status st = route_on_device(c, r, n, c->topk_idx);
    return st != SMOE_OK ? st : ids_to_host(c, r->K, n, ids);
}

smoe_status smoe_cuda_experts_begin(void *b, const smoe_union *u) {
    cuda_state *c = b;
    c->xl_now = &c->lay->xl[u->l];
    for (uint32_t p = 0; p < u->size; p++) {
        c->h_ustart[p] = u->start[p];
        c->h_ucount[p] = u->count[p];
    }
    c->union_rows = u->n * c->cfg->num_experts_per_tok;
    memcpy(c->h_rows, u->rows, (size_t)c->union_rows * sizeof *c->h_rows);
    c->items_used = 0;
    c->idx_up = false;
    return SMOE_OK;
}

smoe_status smoe_cuda_experts(void *b, const smoe_union *u, const uint32_t *items, uint32_t m) {
    cuda_state *c = b;
    cuda_share *sh = c->sh;
    const uint32_t off = c->items_used;
    uint32_t max_rows = 0, umax = 0;
    for (uint32_t i = 0; i < m; i++) {
        const uint32_t p = items[i];
        c->h_items[off + i] = p;
        c->h_wtab[p] = u->w[p];
        max_rows = u->count[p] > max_rows ? u->count[p] : max_rows;
        umax = p > umax ? p : umax;
    }
    smoe_status st;
    if (!c->idx_up) { /* the layer's first call: the whole block, then the gathered rows */
        CU(smoe_cu_upload(c->idx, c->h_idx, c->idx_rows_off + (size_t)c->union_rows * 4, sh->cs));
        if ((st = gather_rows(c, c->union_rows)) != SMOE_OK) return st;
        c->idx_up = true;
    } else { /* its items and, after them in the block, the blobs up to the last of its positions */
        const size_t from = (size_t)((uint8_t *)(c->h_items + off) - c->h_idx);
        const size_t to = c->idx_wtab_off + (size_t)(umax + 1) * sizeof(void *);
        CU(smoe_cu_upload(c->idx + from, c->h_idx + from, to - from, sh->cs));
    }
    if (sh->fills_pending) { /* the products read blobs the upload stream is still copying */
        CU(smoe_cu_stream_wait(sh->cs, sh->last_fill));
        sh->fills_pending = false;
    }
    smoe_cu_rows R = {.wtab = c->wtab, .items = c->items + off, .start = c->ustart, .count = c->ucount,
                      .n_items = m, .max_count = max_rows};
    smoe_cu_event done;
    if ((st = run_experts(c, &R, &done)) != SMOE_OK) return st;
    for (uint32_t i = 0; i < m; i++) sh->vslot_ev[smoe_cuda_vslot(sh, u->w[items[i]])] = done;
    c->items_used += m;
    return SMOE_OK;
}

smoe_status smoe_cuda_combine(void *b, uint32_t K, uint32_t n) {
    cuda_state *c = b;
    CU(smoe_cu_moe_sum(c->sh->cs, c->x, c->slot_out, c->topk_w, n, K, c->cfg->hidden_size));
    return SMOE_OK;
}

/* ----------------------------------------------------------------- a layer on the device alone */

uint32_t smoe_cuda_union_tile(uint32_t n, uint32_t K, uint32_t E) {
    /* The rows of a device union's tiles for n tokens: a power of two from 8 to 64, at most n,
     * holding most experts of a uniform routing whole (mean m = n·K/E rows, m + 2√m); the few
     * bigger ones take two tiles, which costs less than a bigger tile for all (at 45 tokens,
     * m + 3√m + 1 took 16-row tiles: 12 % slower than the host path's kernel choice). Tiles change
     * no bits. */
    double m = (double)n * K / E, want = m + 2.0 * sqrt(m);
    uint32_t t = 8;
    while (t < want && t < 64) t *= 2;
    return t < n ? t : n;
}

smoe_status smoe_cuda_moe_resident(void *b, uint32_t l, const smoe_route *r, uint32_t n) {
    cuda_state *c = b;
    const uint32_t K = r->K;
    cuda_share *sh = c->sh;
    const uint32_t E = c->cfg->num_experts, H = c->cfg->hidden_size, nk = n * K;
    int32_t *idx = c->routed + (size_t)l * nk;
    c->xl_now = &c->lay->xl[l];
    smoe_status st = route_on_device(c, r, n, idx);
    if (st != SMOE_OK) return st;
    const uint32_t tile = smoe_cuda_union_tile(n, K, E), n_items = smoe_cu_union_items(nk, E, tile);
    CU(smoe_cu_union(sh->cs, idx, nk, E, tile, n_items, sh->d_vtab + (size_t)l * E, c->d_wtab, c->d_start, c->d_count,
                     c->d_items, c->rows, c->d_counts, c->d_used + l, c->d_bad));
    c->ran_resident[l] = true;
    smoe_cu_rows R = {.wtab = c->d_wtab, .items = c->d_items, .start = c->d_start, .count = c->d_count,
                      .n_items = n_items, .max_count = tile, .tile = tile};
    smoe_cu_event done;
    if ((st = gather_rows(c, nk)) != SMOE_OK || (st = run_experts(c, &R, &done)) != SMOE_OK) return st;
    CU(smoe_cu_moe_sum(sh->cs, c->x, c->slot_out, c->topk_w, n, K, H));
    return SMOE_OK;
}

smoe_status smoe_cuda_pass_end(void *b, uint32_t n, int32_t *routed) {
    cuda_state *c = b;
    cuda_share *sh = c->sh;
    const uint32_t L = c->cfg->num_hidden_layers, E = c->cfg->num_experts, nk = n * c->cfg->num_experts_per_tok;
    bool any = false;
    for (uint32_t l = 0; l < L; l++) any |= c->ran_resident[l];
    if (!any) {
        CU(smoe_cu_stream_sync(sh->cs));
        return SMOE_OK;
    }
    CU(smoe_cu_download(c->h_routed, c->routed, (size_t)L * nk * 4, sh->cs));
    CU(smoe_cu_stream_sync(sh->cs));
    for (uint32_t l = 0; l < L; l++) {
        if (!c->ran_resident[l]) continue;
        c->ran_resident[l] = false;
        const int32_t *ids = c->h_routed + (size_t)l * nk;
        uint64_t seen[16] = {0}; /* E ≤ 1024 */
        for (uint32_t i = 0; i < nk; i++) {
            const uint32_t e = (uint32_t)ids[i] % E;
            if (!(seen[e / 64] >> (e % 64) & 1)) sh->hits++;
            seen[e / 64] |= 1ull << (e % 64);
        }
        if (routed) memcpy(routed + (size_t)l * nk, ids, (size_t)nk * sizeof *ids);
    }
    return SMOE_OK;
}

/* ----------------------------------------------------------------------- the recorded step */

/* Every sparse layer routed on the device alone (their blobs' tables up). */
static bool all_resident(cuda_state *c) {
    if (!c->sh->device_union) return false;
    for (uint32_t l = 0; l < c->cfg->num_hidden_layers; l++)
        if (c->lay->layers[l].sparse && !smoe_cuda_tier_resident(c, l)) return false;
    return true;
}

smoe_status smoe_cuda_replay(void *b, bool *ran) {
    cuda_state *c = b;
    cuda_share *sh = c->sh;
    *ran = false;
    if (!c->graph) return SMOE_OK;
    if (c->graph_epoch != sh->epoch || sh->n_complete < c->cfg->num_sparse_layers) {
        smoe_cu_graph_free(c->graph); /* a layer left VRAM since: the recording is stale */
        c->graph = NULL;
        return SMOE_OK;
    }
    CU(smoe_cu_graph_launch(c->graph, sh->cs));
    for (uint32_t l = 0; l < c->cfg->num_hidden_layers; l++) c->ran_resident[l] = c->lay->layers[l].sparse;
    *ran = true;
    return SMOE_OK;
}

smoe_status smoe_cuda_record_begin(void *b, bool *recording) {
    cuda_state *c = b;
    *recording = false;
    if (!c->sh->graphs || c->graph || !all_resident(c)) return SMOE_OK;
    CU(smoe_cu_capture_begin(c->sh->cs));
    *recording = true;
    return SMOE_OK;
}

smoe_status smoe_cuda_record_end(void *b, bool keep) {
    cuda_state *c = b;
    int e = smoe_cu_capture_end(c->sh->cs, keep, &c->graph);
    for (uint32_t l = 0; l < c->cfg->num_hidden_layers; l++) c->ran_resident[l] = false; /* nothing ran */
    if (e) return smoe_cuda_fail(c, e, "recording a decode step");
    c->graph_epoch = c->sh->epoch;
    return SMOE_OK;
}

/* ------------------------------------------------------------------ the device tier (VRAM) */

uint32_t smoe_cuda_vslot(const cuda_share *sh, const void *handle) {
    return (uint32_t)(((const uint8_t *)handle - sh->vcache) / sh->blob_bytes);
}

static void lru_unlink(cuda_share *sh, uint32_t i) {
    sh->next[sh->prev[i]] = sh->next[i];
    sh->prev[sh->next[i]] = sh->prev[i];
}

static void lru_push_tail(cuda_share *sh, uint32_t i) { /* most recent */
    const uint32_t S = sh->n_vslots + sh->slot_list[i];
    sh->prev[i] = sh->prev[S];
    sh->next[i] = S;
    sh->next[sh->prev[S]] = i;
    sh->prev[S] = i;
}

/* Layer l is no longer wholly in VRAM: its unions go back to the host, recorded steps are stale. */
static void uncomplete(cuda_share *sh, uint32_t l) {
    if (!sh->complete || !sh->complete[l]) return;
    sh->complete[l] = false;
    sh->n_complete--;
    sh->epoch++;
}

static void forget_all(cuda_share *sh) {
    const uint32_t L = sh->lay->cfg.num_hidden_layers;
    const size_t keys = (size_t)L * sh->lay->cfg.num_experts;
    for (size_t i = 0; i < keys; i++) sh->vslot_of[i] = -1;
    for (uint32_t l = 0; l < L; l++) {
        uncomplete(sh, l);
        sh->resident[l] = 0;
    }
    const uint32_t S = sh->n_vslots;
    for (uint32_t j = S; j < S + sh->n_lists; j++) sh->prev[j] = sh->next[j] = j;
    for (uint32_t i = 0; i < S; i++) {
        sh->vslot_key[i] = -1;
        sh->vslot_ev[i] = NULL;
        lru_push_tail(sh, i);
    }
    sh->fills_pending = false;
}

const void *smoe_cuda_tier_lookup(void *b, uint32_t l, uint32_t e) {
    cuda_share *sh = ((cuda_state *)b)->sh;
    const int32_t vs = sh->vslot_of[(size_t)l * sh->lay->cfg.num_experts + e];
    if (vs < 0) return NULL;
    lru_unlink(sh, (uint32_t)vs);
    lru_push_tail(sh, (uint32_t)vs);
    sh->hits++;
    return sh->vcache + (size_t)vs * sh->blob_bytes;
}

/* A claim takes the least recently used slot of layer l's share; a slot taken twice in one layer
 * is reused only after the products that read it (the upload stream waits for their event,
 * tier_fill), and one fill batch (tier_batch) is never larger than a share, so its slots differ.
 *
 * Why a share a layer and not one LRU list: a pass walks the layers in order, so with one list the
 * least recent slots always belong to the layers next in the walk. A prompt's union is most of a
 * layer's experts; when the cache holds less than the model, each layer's misses then evict what
 * the next layer is about to ask for, and a prefill re-uploads nearly every expert it uses (a3b at
 * 16 GiB, 80 % of its experts in VRAM: 15.2 GB uploaded for a 45-token prompt whose experts miss
 * 2.9 GB). With a share a layer, a layer's misses evict only its own least recent experts. */
const void *smoe_cuda_tier_claim(void *b, uint32_t l, uint32_t e) {
    cuda_share *sh = ((cuda_state *)b)->sh;
    const uint32_t E = sh->lay->cfg.num_experts, vs = sh->next[sh->n_vslots + sh->list_of[l]];
    if (sh->vslot_key[vs] >= 0) {
        const uint32_t old = (uint32_t)(sh->vslot_key[vs] / E);
        sh->vslot_of[sh->vslot_key[vs]] = -1;
        sh->resident[old]--;
        uncomplete(sh, old);
    }
    sh->vslot_key[vs] = (int64_t)l * E + e;
    sh->vslot_of[(size_t)l * E + e] = (int32_t)vs;
    sh->resident[l]++;
    lru_unlink(sh, vs);
    lru_push_tail(sh, vs);
    sh->misses++;
    return sh->vcache + (size_t)vs * sh->blob_bytes;
}

smoe_status smoe_cuda_tier_fill(void *b, const void *handle, const uint8_t *blob, int slot) {
    cuda_state *c = b;
    cuda_share *sh = c->sh;
    const uint32_t vs = smoe_cuda_vslot(sh, handle);
    if (sh->vslot_ev[vs]) CU(smoe_cu_stream_wait(sh->us, sh->vslot_ev[vs]));
    CU(smoe_cu_upload(sh->vcache + (size_t)vs * sh->blob_bytes, blob, sh->blob_bytes, sh->us));
    CU(smoe_cu_event_record(sh->sslot_ev[slot], sh->us));
    sh->last_fill = sh->sslot_ev[slot];
    sh->fills_pending = true;
    sh->uploads++;
    sh->upload_bytes += sh->blob_bytes;
    return SMOE_OK;
}

smoe_status smoe_cuda_tier_sync(void *b) {
    cuda_state *c = b;
    CU(smoe_cu_stream_sync(c->sh->us));
    return SMOE_OK;
}

void smoe_cuda_tier_drop(void *b, const void *handle) {
    cuda_share *sh = ((cuda_state *)b)->sh;
    const uint32_t vs = smoe_cuda_vslot(sh, handle), E = sh->lay->cfg.num_experts;
    if (sh->vslot_key[vs] < 0) return;
    const uint32_t l = (uint32_t)(sh->vslot_key[vs] / E);
    sh->vslot_of[sh->vslot_key[vs]] = -1;
    sh->vslot_key[vs] = -1;
    sh->resident[l]--;
    uncomplete(sh, l);
}

uint32_t smoe_cuda_tier_batch(void *b) { return ((cuda_state *)b)->sh->batch; }

void smoe_cuda_tier_clear(void *b) {
    cuda_share *sh = ((cuda_state *)b)->sh;
    smoe_cu_stream_sync(sh->cs);
    smoe_cu_stream_sync(sh->us);
    if (sh->n_vslots) forget_all(sh);
}

bool smoe_cuda_tier_resident(void *b, uint32_t l) {
    cuda_state *c = b;
    cuda_share *sh = c->sh;
    const uint32_t E = c->cfg->num_experts;
    if (!sh->device_union || sh->resident[l] < E) return false;
    if (!sh->complete[l]) { /* every expert of l is in now: its blobs' addresses go up once */
        const uint8_t **h = sh->h_vtab + (size_t)l * E;
        for (uint32_t e = 0; e < E; e++) h[e] = sh->vcache + (size_t)sh->vslot_of[(size_t)l * E + e] * sh->blob_bytes;
        if (smoe_cu_upload(sh->d_vtab + (size_t)l * E, h, E * sizeof *h, sh->cs) != 0) return false;
        sh->complete[l] = true;
        sh->n_complete++;
    }
    return true;
}

smoe_status smoe_cuda_tier_new(cuda_state *c) {
    cuda_share *sh = c->sh;
    const smoe_config *cf = c->cfg;
    const size_t L = cf->num_hidden_layers, E = cf->num_experts;
    sh->tier_made = true;
    sh->blob_bytes = sh->lay->blob_bytes;
    const uint64_t total = (uint64_t)cf->num_sparse_layers * E;
    uint64_t n = sh->cache_bytes / sh->blob_bytes;
    if (n < MIN_VSLOTS) n = MIN_VSLOTS;
    if (n > total) n = total;
    sh->n_vslots = (uint32_t)n;
    /* the expert cache takes what gpu_cache_bytes asks, or says plainly that it does not fit
     * (leaving 256 MiB for the runtime's own use) */
    const size_t avail = smoe_cuda_vram_free(), reserve = (size_t)256 << 20;
    if ((size_t)n * sh->blob_bytes + reserve > avail)
        return smoe_fail(SMOE_ERR_NOMEM, "cuda: gpu_cache_bytes asks %.2f GiB of VRAM for %llu experts, but %.2f GiB "
                                         "are free after the dense weights and this session's KV cache and planes "
                                         "(%.2f GiB): give at most %.2f GiB",
                         (double)n * sh->blob_bytes / (1u << 30), (unsigned long long)n, (double)avail / (1u << 30),
                         (double)(sh->other_bytes + c->other_bytes) / (1u << 30),
                         avail > reserve ? (double)(avail - reserve) / (1u << 30) : 0.0);
    CU(smoe_cu_alloc((void **)&sh->vcache, n * sh->blob_bytes));
    sh->vslot_of = malloc(L * E * sizeof *sh->vslot_of);
    sh->vslot_key = malloc(n * sizeof *sh->vslot_key);
    /* the shares: n / sparse layers slots each (the first n % sparse layers one more) */
    const char *pol = getenv("SMOE_CUDA_VRAM_LRU");
    const uint32_t Ls = cf->num_sparse_layers;
    const bool shares = Ls > 1 && n >= 2 * (uint64_t)Ls && !(pol && strcmp(pol, "global") == 0);
    sh->n_lists = shares ? Ls : 1;
    sh->prev = malloc((n + sh->n_lists) * sizeof *sh->prev);
    sh->next = malloc((n + sh->n_lists) * sizeof *sh->next);
    sh->slot_list = malloc(n * sizeof *sh->slot_list);
    sh->list_of = calloc(L, sizeof *sh->list_of);
    if (!sh->prev || !sh->next || !sh->slot_list || !sh->list_of) return smoe_fail(SMOE_ERR_NOMEM, "cuda: out of memory");
    uint32_t smallest = (uint32_t)n;
    for (uint32_t l = 0, j = 0, i = 0; l < L; l++) {
        if (!shares || !c->lay->layers[l].sparse) continue;
        const uint32_t share = (uint32_t)(n / Ls) + (j < n % Ls);
        for (uint32_t k = 0; k < share; k++) sh->slot_list[i++] = j;
        if (share < smallest) smallest = share;
        sh->list_of[l] = j++;
    }
    if (!shares)
        for (uint64_t i = 0; i < n; i++) sh->slot_list[i] = 0;
    sh->batch = smallest < MISS_BATCH ? smallest : MISS_BATCH;
    sh->vslot_ev = calloc(n, sizeof *sh->vslot_ev);
    sh->resident = calloc(L, sizeof *sh->resident);
    sh->complete = calloc(L, sizeof *sh->complete);
    sh->n_sslots = (uint32_t)(smoe_streamer_slot_bytes(sh->streamer) / sh->blob_bytes);
    sh->registered = calloc(sh->n_sslots, sizeof *sh->registered);
    sh->sslot_ev = calloc(sh->n_sslots, sizeof *sh->sslot_ev);
    if (!sh->vslot_of || !sh->vslot_key || !sh->prev || !sh->next || !sh->vslot_ev || !sh->resident ||
        !sh->complete || !sh->registered || !sh->sslot_ev)
        return smoe_fail(SMOE_ERR_NOMEM, "cuda: out of memory");
    const char *du = getenv("SMOE_CUDA_DEVICE_UNION");
    sh->device_union = n == total && !(du && du[0] == '0');
    if (sh->device_union) {
        CU(smoe_cu_alloc((void **)&sh->d_vtab, L * E * sizeof(void *)));
        CU(smoe_cu_host_alloc((void **)&sh->h_vtab, L * E * sizeof(void *)));
        sh->other_bytes += L * E * sizeof(void *);
    }
    const char *gr = getenv("SMOE_CUDA_GRAPH");
    sh->graphs = sh->device_union && smoe_cu_attention_fixed(cf->head_dim, sh->plain_attention) && !(gr && gr[0] == '0');
    forget_all(sh);
    /* Pinned host slots make the fills asynchronous DMA; where pinning fails (a locked-memory
     * limit), the copies still work, staged by the driver. SMOE_CUDA_PIN=0 skips it. */
    const char *pin = getenv("SMOE_CUDA_PIN");
    uint32_t pinned_n = 0;
    for (uint32_t i = 0; i < sh->n_sslots; i++) {
        CU(smoe_cu_event_new(&sh->sslot_ev[i]));
        if (!(pin && pin[0] == '0')) {
            sh->registered[i] = smoe_cu_host_register((void *)smoe_streamer_data(sh->streamer, (int)i),
                                                      sh->blob_bytes) == 0;
            pinned_n += sh->registered[i];
        }
    }
    smoe_cu_last_error(); /* a failed registration is not an error of the next launch */
    if (pinned_n < sh->n_sslots)
        smoe_log(SMOE_LOG_WARN, "cuda: %u of %u host cache slots pinned", pinned_n, sh->n_sslots);
    snprintf(sh->line, sizeof sh->line, "cuda: %s (sm_%d%d), %u expert slots in VRAM (%.2f GiB)%s, %s pinned",
             sh->name, sh->major, sh->minor, sh->n_vslots, (double)sh->n_vslots * (double)sh->blob_bytes / (1u << 30),
             sh->device_union ? ": all of them, unions on the GPU"
             : sh->n_lists > 1 ? ", a share a layer" : ", one LRU list",
             sh->n_sslots ? "host cache" : "no host cache");
    return SMOE_OK;
}

void smoe_cuda_tier_free(cuda_share *sh) {
    if (sh->registered)
        for (uint32_t i = 0; i < sh->n_sslots; i++)
            if (sh->registered[i]) smoe_cu_host_unregister((void *)smoe_streamer_data(sh->streamer, (int)i));
    if (sh->sslot_ev)
        for (uint32_t i = 0; i < sh->n_sslots; i++) smoe_cu_event_free(sh->sslot_ev[i]);
    smoe_cu_free(sh->vcache);
    smoe_cu_free((void *)sh->d_vtab);
    smoe_cu_host_free((void *)sh->h_vtab);
    void *bufs[] = {sh->vslot_of, sh->vslot_key, sh->prev, sh->next, sh->slot_list, sh->list_of, (void *)sh->vslot_ev, sh->resident,
                    sh->complete, sh->registered, (void *)sh->sslot_ev};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
}
