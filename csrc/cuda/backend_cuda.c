/* backend_cuda.c — the CUDA backend (backend.h): its share and session state, and the ops of a
 * pass outside the MoE step (moe_cuda.c has those, the device tier and the recorded step).
 *
 * Every op enqueues kernels on the share's compute stream and returns; the host waits only where
 * it must read what the GPU made: routing's ids (moe_cuda.c), the logits, the sampler's
 * candidates, the KV rows asked for, the pass's end. Products that run on the tensor cores read
 * f16 rows of their input: a norm prepares them in the same launch for the plane it writes, any
 * other input is prepared by the product that needs it (a16_of says which plane's rows a16 holds).
 * The kernels keep each element's reduction order whatever the rows (cuda_common.cuh), so the
 * GPU's layer-major, token-serial and batched passes agree bit for bit. */
#include "cuda/cuda_state.h"
#include "cpu/kernels.h" /* the KV types' sizes and widening, which every backend shares */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------ life cycle */

/* Every dense matrix the kernels read 8 columns at a time from 16-byte aligned rows; GGML block
 * formats (ggml.cu) are read byte by byte, at any alignment. */
static smoe_status check_tensor(const uint8_t *dense, const smoe_tensor *T, const char *what) {
    if (!T) return SMOE_OK;
    uint32_t bs, ts;
    if (smoe_ggml_block(T->format, &bs, &ts)) {
        if (T->cols % 8 != 0)
            return smoe_fail(SMOE_ERR_UNSUPPORTED, "cuda: %s (%s, %u × %u) is not a multiple of 8 columns", what,
                             smoe_format_name(T->format), T->rows, T->cols);
        return SMOE_OK;
    }
    uint64_t at = T->data ? (uint64_t)(T->data - dense) : T->offset;
    if (T->cols % 8 != 0 || at % 16 != 0)
        return smoe_fail(SMOE_ERR_UNSUPPORTED, "cuda: %s (%u × %u at offset %llu) is not a multiple of 8 columns "
                                               "at a 16-byte boundary", what, T->rows, T->cols, (unsigned long long)at);
    return SMOE_OK;
}

static smoe_status check_norm(const smoe_tensor *T, const char *what) {
    if (T && T->format != SMOE_FMT_F32 && T->format != SMOE_FMT_BF16)
        return smoe_fail(SMOE_ERR_UNSUPPORTED, "cuda: %s is stored as format %u; norms must be f32 or bf16", what,
                         T->format);
    return SMOE_OK;
}

/* Bias vectors (attention, router, sinks, experts') are read as f32 or bf16. */
static smoe_status check_bias(const smoe_tensor *T, const char *what) {
    if (T && T->format != SMOE_FMT_F32 && T->format != SMOE_FMT_BF16)
        return smoe_fail(SMOE_ERR_UNSUPPORTED, "cuda: %s is stored as format %u; it must be f32 or bf16", what,
                         T->format);
    return SMOE_OK;
}

static smoe_status check_layout(const smoe_layout *lay, const uint8_t *dense) {
    smoe_status st;
    if ((st = check_tensor(dense, lay->embed, "the embedding")) != SMOE_OK ||
        (st = check_tensor(dense, lay->lm_head, "lm_head")) != SMOE_OK ||
        (st = check_norm(lay->final_norm, "the final norm")) != SMOE_OK)
        return st;
    for (uint32_t l = 0; l < lay->cfg.num_hidden_layers; l++) {
        const smoe_layer_weights *L = &lay->layers[l];
        const smoe_tensor *mats[] = {L->q, L->k, L->v, L->o, L->router, L->mlp_gate, L->mlp_up, L->mlp_down,
                                     L->shared_gate, L->shared_up, L->shared_down, L->q_gate, L->shared_expert_gate,
                                     L->lin_qkv, L->lin_z, L->lin_b, L->lin_a, L->lin_out};
        for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++)
            if ((st = check_tensor(dense, mats[i], "a layer's matrix")) != SMOE_OK) return st;
        const smoe_tensor *norms[] = {L->input_norm, L->post_norm, L->q_norm, L->k_norm};
        for (size_t i = 0; i < 4; i++)
            if ((st = check_norm(norms[i], "a layer's norm")) != SMOE_OK) return st;
        const smoe_tensor *biases[] = {L->q_bias, L->k_bias, L->v_bias, L->o_bias};
        for (size_t i = 0; i < 4; i++)
            if ((st = check_bias(biases[i], "an attention bias")) != SMOE_OK) return st;
        if ((st = check_bias(L->router_bias, "router.bias")) != SMOE_OK ||
            (st = check_bias(L->sinks, "the attention sinks")) != SMOE_OK)
            return st;
        for (int i = SMOE_XT_GATE_BIAS; i < SMOE_XT_COUNT; i++)
            if (lay->xl[l].has[i] && (st = check_bias(&lay->xl[l].t[i], "an expert bias")) != SMOE_OK)
                return st;
    }
    for (uint32_t l = 0; l < lay->cfg.num_hidden_layers; l++) /* each sparse layer's blob layout */
        for (int i = 0; i < 3 && lay->layer_sparse[l]; i++)
            if ((st = check_tensor(dense, &lay->xl[l].t[i], "an expert matrix")) != SMOE_OK) return st;
    return SMOE_OK;
}

/* The Gated DeltaNet layers' conv, A_log, dt_bias and norm, widened to f32 on the host (any format
 * the CPU reads) and uploaded once: lin_w, layer l's at lin_off[l]. */
static smoe_status linear_weights(cuda_share *sh) {
    const smoe_layout *lay = sh->lay;
    const uint32_t L = lay->cfg.num_hidden_layers;
    size_t total = 0;
    sh->lin_off = malloc(L * sizeof *sh->lin_off);
    if (!sh->lin_off) return smoe_fail(SMOE_ERR_NOMEM, "cuda: out of memory");
    for (uint32_t l = 0; l < L; l++) {
        const smoe_layer_weights *W = &lay->layers[l];
        sh->lin_off[l] = -1;
        if (W->attn != SMOE_ATTN_LINEAR) continue;
        sh->lin_off[l] = (int64_t)total;
        const smoe_tensor *t[] = {W->lin_conv, W->lin_a_log, W->lin_dt_bias, W->lin_norm};
        for (int i = 0; i < 4; i++) total += (size_t)t[i]->rows * t[i]->cols;
    }
    if (total == 0) return SMOE_OK;
    cuda_state tmp = {.sh = sh};
    cuda_state *c = &tmp;
    CU(smoe_cu_deltanet_setup());
    float *host = malloc(total * sizeof *host);
    if (!host) return smoe_fail(SMOE_ERR_NOMEM, "cuda: out of memory");
    for (uint32_t l = 0; l < L; l++) {
        if (sh->lin_off[l] < 0) continue;
        const smoe_layer_weights *W = &lay->layers[l];
        const smoe_tensor *t[] = {W->lin_conv, W->lin_a_log, W->lin_dt_bias, W->lin_norm};
        float *o = host + sh->lin_off[l];
        for (int i = 0; i < 4; i++)
            for (uint32_t r = 0; r < t[i]->rows; r++, o += t[i]->cols) smoe_dequant_row(t[i], t[i]->data, r, o);
    }
    int err = smoe_cu_alloc((void **)&sh->lin_w, total * sizeof *host);
    if (!err) err = smoe_cu_upload(sh->lin_w, host, total * sizeof *host, sh->cs);
    if (!err) err = smoe_cu_stream_sync(sh->cs);
    free(host);
    CU(err);
    sh->other_bytes += total * sizeof(float);
    return SMOE_OK;
}

static void cuda_share_free(void *vsh) {
    cuda_share *sh = vsh;
    if (!sh) return;
    if (sh->cs) smoe_cu_stream_sync(sh->cs);
    if (sh->us) smoe_cu_stream_sync(sh->us);
    smoe_cuda_tier_free(sh);
    for (int i = 0; i < RING; i++) smoe_cu_event_free(sh->ring[i]);
    smoe_cu_free(sh->dense);
    smoe_cu_free(sh->lin_w);
    free(sh->lin_off);
    for (uint32_t i = 0; i < sh->n_as; i++) smoe_cu_stream_free(sh->as[i]);
    smoe_cu_stream_free(sh->cs);
    smoe_cu_stream_free(sh->us);
    free(sh);
}

static smoe_status cuda_share_new(const smoe_be_share_params *p, void **out) {
    const smoe_config *cf = &p->lay->cfg;
    char name[128];
    int major = 0, minor = 0;
    size_t free_b = 0, total_b = 0;
    int err = smoe_cu_device(0, name, sizeof name, &major, &minor, &free_b, &total_b);
    if (err != 0)
        return smoe_fail(SMOE_ERR_UNSUPPORTED, "cuda: no usable GPU (%s)", smoe_cu_error_string(err));
    if (major < 8) /* mma.sync m16n8k16 and cp.async: the build's oldest target is sm_80 */
        return smoe_fail(SMOE_ERR_UNSUPPORTED, "cuda: %s has compute capability %d.%d; pysmoe's CUDA kernels need 8.0 "
                         "(Ampere) or newer", name, major, minor);
    /* the embedding table on the GPU whole: a paged one (docs/vault.md 4.1) read into the dense region first */
    smoe_status st = p->vault ? smoe_vault_dense_ready(p->vault) : SMOE_OK; /* lm_head in (vault.c) */
    if (st == SMOE_OK && p->vault) st = smoe_vault_load_paged(p->vault);
    if (st == SMOE_OK) st = check_layout(p->lay, p->dense);
    if (st != SMOE_OK) return st;
    if (cf->num_experts > 1024)
        return smoe_fail(SMOE_ERR_UNSUPPORTED, "cuda: %u experts; the routing kernel takes up to 1024", cf->num_experts);
    cuda_share *sh = calloc(1, sizeof *sh);
    if (!sh) return smoe_fail(SMOE_ERR_NOMEM, "cuda: out of memory");
    *out = sh;
    memcpy(sh->name, name, sizeof name);
    sh->major = major;
    sh->minor = minor;
    sh->lay = p->lay;
    sh->host_dense = p->dense;
    for (uint32_t l = 0; l < cf->num_hidden_layers; l++) {
        sh->plain_attention |= p->lay->layer_attn[l] == SMOE_ATTN_SLIDING || p->lay->layers[l].sinks;
    }
    sh->streamer = p->streamer;
    sh->cache_bytes = p->device_cache_bytes;
    const char *sa = getenv("SMOE_CUDA_SAMPLE");
    sh->gpu_sampling = !(sa && sa[0] == '0');
    cuda_state tmp = {.sh = sh}; /* for CU's failure path */
    cuda_state *c = &tmp;
    CU(smoe_cu_stream_new(&sh->cs));
    CU(smoe_cu_stream_new(&sh->us));
    const char *as = getenv("SMOE_CUDA_ATT_STREAMS");
    sh->n_as = as ? (uint32_t)strtoul(as, NULL, 10) : 4;
    if (sh->n_as > ATT_STREAMS) sh->n_as = ATT_STREAMS;
    for (uint32_t i = 0; i < sh->n_as; i++) CU(smoe_cu_stream_new(&sh->as[i]));
    for (int i = 0; i < RING; i++) CU(smoe_cu_event_new(&sh->ring[i]));
    err = smoe_cu_alloc((void **)&sh->dense, p->lay->dense_bytes);
    if (smoe_cu_out_of_memory(err)) {
        smoe_cu_last_error();
        return smoe_fail(SMOE_ERR_NOMEM, "cuda: the dense weights (%.2f GiB) do not fit in the GPU's free VRAM "
                                         "(%.2f GiB)", (double)p->lay->dense_bytes / (1u << 30),
                         (double)free_b / (1u << 30));
    }
    CU(err);
    sh->other_bytes = p->lay->dense_bytes;
    CU(smoe_cu_upload(sh->dense, p->dense, p->lay->dense_bytes, sh->cs));
    CU(smoe_cu_stream_sync(sh->cs));
    if ((st = linear_weights(sh)) != SMOE_OK) return st;
    sh->broken = false;
    return SMOE_OK;
}

static void cuda_session_free(void *b) {
    cuda_state *c = b;
    if (!c) return;
    if (c->sh && c->sh->cs) smoe_cu_stream_sync(c->sh->cs);
    void *dbufs[] = {c->k, c->v, c->cos, c->sin, c->x, c->xn, c->q, c->att, c->router, c->topk_w, c->slot_out,
                     c->xg, c->hg, c->h, c->logits, c->topk_idx, c->routed, c->pass, c->idx, c->ks, c->vs, c->d_sv,
                     c->d_hist, c->d_sout, c->fa_part, c->a16, c->g16, c->h16, c->ae, c->ge, c->he,
                     (void *)c->d_wtab, c->d_start, c->d_count, c->d_items, c->d_counts, c->d_used, c->d_bad,
                     c->gate, c->mix, c->beta, c->decay, c->sgate, c->lin_s, c->lin_conv, c->snap_s, c->snap_conv};
    for (size_t i = 0; i < sizeof dbufs / sizeof dbufs[0]; i++) smoe_cu_free(dbufs[i]);
    smoe_cu_graph_free(c->graph);
    void *hbufs[] = {c->h_hist, c->h_sout, c->h_topk, c->h_routed, c->h_pass, c->h_idx, c->h_logits};
    for (size_t i = 0; i < sizeof hbufs / sizeof hbufs[0]; i++) smoe_cu_host_free(hbufs[i]);
    free(c->ran_resident);
    free(c);
}

static smoe_status dalloc(cuda_state *c, void *pp, size_t bytes) {
    int err = smoe_cu_alloc((void **)pp, bytes);
    if (smoe_cu_out_of_memory(err)) {
        smoe_cu_last_error(); /* not an error of the next launch */
        return smoe_fail(SMOE_ERR_NOMEM, "cuda: %.1f MiB more of VRAM could not be had (%.2f GiB in use by this session, "
                                         "%.2f GiB free): the dense weights, the KV cache (context, kv_dtype) and the "
                                         "planes (chunk) must fit", (double)bytes / (1 << 20),
                         (double)c->other_bytes / (1u << 30), (double)smoe_cuda_vram_free() / (1u << 30));
    }
    if (err) return smoe_cuda_fail(c, err, "smoe_cu_alloc");
    c->other_bytes += bytes;
    return SMOE_OK;
}

static smoe_status cuda_session_new(void *vsh, const smoe_be_session_params *p, void **out, uint64_t *plane_bytes,
                                    uint64_t *kv_bytes) {
    cuda_share *sh = vsh;
    const smoe_config *cf = &sh->lay->cfg;
    int max_pos = smoe_cu_attention_max_positions(cf->head_dim, sh->plain_attention);
    if (p->context + 8 > (uint32_t)max_pos)
        return smoe_fail(SMOE_ERR_UNSUPPORTED, "cuda: a context of %u is more than the attention kernel holds (%d)",
                         p->context, max_pos - 8);
    cuda_state *c = calloc(1, sizeof *c);
    if (!c) return smoe_fail(SMOE_ERR_NOMEM, "cuda: out of memory");
    *out = c;
    c->sh = sh;
    c->lay = sh->lay;
    c->cfg = cf;
    c->context = p->context;
    c->chunk = p->chunk;
    c->kv_dtype = p->kv_dtype;
    c->kv_elem = smoe_kv_elem_bytes(p->kv_dtype);
    c->q_dim = cf->num_attention_heads * cf->head_dim;
    c->kv_dim = cf->num_key_value_heads * cf->head_dim;
    c->ffn = cf->intermediate_size > cf->moe_intermediate_size ? cf->intermediate_size : cf->moe_intermediate_size;
    if (c->lay->mp.shared_intermediate > c->ffn) c->ffn = c->lay->mp.shared_intermediate;
    c->rot = c->lay->mp.rotary_dim;
    c->act = (smoe_cu_act_fn){p->act.kind == SMOE_ACT_SWIGLU_CLAMPED, p->act.alpha, p->act.limit};
    c->a16_of = -1;
    c->lin = p->linear;
    c->n_linear = p->n_linear;
    c->linear_index = p->linear_index;
    c->conv_dim = 2 * p->linear.k_heads * p->linear.k_dim + p->linear.v_heads * p->linear.v_dim;
    bool gates = false; /* gated attention or a shared expert's gate */
    for (uint32_t l = 0; l < cf->num_hidden_layers; l++) {
        const smoe_layer_weights *L = &c->lay->layers[l];
        gates |= L->q_gate || L->shared_expert_gate;
        const smoe_tensor *mats[] = {L->q, L->k, L->v, L->o, L->router, L->mlp_gate, L->mlp_up, L->mlp_down,
                                     L->shared_gate, L->shared_up, L->shared_down, L->q_gate, L->shared_expert_gate,
                                     L->lin_qkv, L->lin_z, L->lin_b, L->lin_a, L->lin_out};
        for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++) c->any_tc |= mats[i] && smoe_cuda_tensor_cores(mats[i]);
    }
    for (uint32_t l = 0; l < cf->num_hidden_layers; l++)
        for (int i = 0; i < 3 && c->lay->layer_sparse[l]; i++) c->any_tc |= smoe_cuda_tensor_cores(&c->lay->xl[l].t[i]);
    smoe_status st;

    const size_t C = p->chunk, H = cf->hidden_size, E = cf->num_experts, K = cf->num_experts_per_tok;
    const size_t L = cf->num_hidden_layers, half = c->rot / 2, ffn = c->ffn, V = cf->vocab_size;
    const size_t kv = L * p->context * c->kv_dim * c->kv_elem; /* bytes */
    const size_t lin_v = (size_t)c->lin.v_heads * c->lin.v_dim, att_w = c->q_dim > lin_v ? c->q_dim : lin_v;
    size_t a16_w = H > c->q_dim ? H : c->q_dim;
    a16_w = a16_w > lin_v ? a16_w : lin_v; /* a DeltaNet's out-projection reads ATT at lin_v */
    /* the recurrent states are the session's like its KV cache: counted with it (cpu_state.h) */
    const size_t past = c->lin.conv_kernel ? c->lin.conv_kernel - 1 : 0;
    c->lin_s_bytes = (size_t)c->n_linear * c->lin.v_heads * c->lin.k_dim * c->lin.v_dim * 4;
    c->lin_conv_bytes = (size_t)c->n_linear * past * c->conv_dim * 4;
    *kv_bytes = 2 * kv + 2 * (c->lin_s_bytes + c->lin_conv_bytes);
    const size_t R = SMOE_LOGIT_ROWS;
    c->idx_wtab_off = smoe_align_up(12 * E, 8);
    c->idx_rows_off = c->idx_wtab_off + E * sizeof(void *);
    c->idx_bytes = c->idx_rows_off + C * K * 4;
    struct { void *pp; size_t bytes; } planes[] = {
        {&c->k, kv}, {&c->v, kv}, {&c->cos, p->context * half * 4}, {&c->sin, p->context * half * 4},
        {&c->x, C * H * 4}, {&c->xn, C * H * 4}, {&c->q, C * c->q_dim * 4}, {&c->att, C * att_w * 4},
        {&c->router, C * E * 4}, {&c->topk_w, C * K * 4}, {&c->slot_out, C * K * H * 4}, {&c->xg, C * K * H * 4},
        {&c->hg, C * K * 2 * ffn * 4}, {&c->h, C * K * ffn * 4}, {&c->logits, R * V * 4},
        {&c->fa_part, smoe_cu_attention_part_floats(cf->num_key_value_heads, cf->head_dim, p->context) * 4},
        {&c->d_sv, V * 4}, {&c->d_hist, HIST_CAP * 4}, {&c->d_sout, sizeof(smoe_cu_sample_out)},
        {&c->topk_idx, C * K * 4}, {&c->routed, L * C * K * 4}, {&c->pass, (C + 1) * 4}, {&c->ks, C * c->kv_dim * 4},
        {&c->vs, C * c->kv_dim * 4}, {&c->a16, C * a16_w * 2}, {&c->ae, C * 4},
        {&c->g16, C * K * H * 2}, {&c->ge, C * K * 4}, {&c->h16, C * K * ffn * 2}, {&c->he, C * K * 4},
        {&c->idx, c->idx_bytes}, {(void *)&c->d_wtab, E * sizeof(void *)}, {&c->d_start, E * 4},
        {&c->d_count, E * 4}, {&c->d_counts, E * 4}, {&c->d_used, L * 4}, {&c->d_bad, 4},
    };
    for (size_t i = 0; i < sizeof planes / sizeof planes[0]; i++)
        if ((st = dalloc(c, planes[i].pp, planes[i].bytes)) != SMOE_OK) return st;
    c->n_items_cap = 0;
    for (uint32_t n = 1; n <= C; n++) { /* the bound is not monotone in n (the tile follows n) */
        uint32_t b = smoe_cu_union_items(n * (uint32_t)K, (uint32_t)E, smoe_cuda_union_tile(n, (uint32_t)K, (uint32_t)E));
        c->n_items_cap = b > c->n_items_cap ? b : c->n_items_cap;
    }
    if ((st = dalloc(c, &c->d_items, (size_t)c->n_items_cap * 4)) != SMOE_OK) return st;
    if (gates || c->n_linear) {
        struct { void *pp; size_t bytes; } hy[] = {
            {&c->gate, C * att_w * 4}, {&c->sgate, C * 4}, {&c->mix, C * (c->conv_dim ? c->conv_dim : 1) * 4},
            {&c->beta, C * (c->lin.v_heads ? c->lin.v_heads : 1) * 4},
            {&c->decay, C * (c->lin.v_heads ? c->lin.v_heads : 1) * 4},
        };
        for (size_t i = 0; i < sizeof hy / sizeof hy[0]; i++)
            if ((st = dalloc(c, hy[i].pp, hy[i].bytes)) != SMOE_OK) return st;
    }
    if (c->n_linear) {
        struct { void *pp; size_t bytes; } sts[] = {
            {&c->lin_s, c->lin_s_bytes}, {&c->snap_s, c->lin_s_bytes}, {&c->lin_conv, c->lin_conv_bytes},
            {&c->snap_conv, c->lin_conv_bytes},
        };
        for (size_t i = 0; i < sizeof sts / sizeof sts[0]; i++)
            if (sts[i].bytes && (st = dalloc(c, sts[i].pp, sts[i].bytes)) != SMOE_OK) return st;
        /* position 0's states: zero (the engine starts there) */
        if (c->lin_s_bytes) CU(smoe_cu_memset(c->lin_s, 0, c->lin_s_bytes, sh->cs));
        if (c->lin_conv_bytes) CU(smoe_cu_memset(c->lin_conv, 0, c->lin_conv_bytes, sh->cs));
    }
    CU(smoe_cu_upload(c->cos, p->rope_cos, p->context * half * 4, sh->cs));
    CU(smoe_cu_upload(c->sin, p->rope_sin, p->context * half * 4, sh->cs));
    struct { void *pp; size_t bytes; } pinned[] = {
        {&c->h_topk, C * K * 4}, {&c->h_routed, L * C * K * 4}, {&c->h_pass, (C + 1) * 4}, {&c->h_idx, c->idx_bytes},
        {&c->h_hist, HIST_CAP * 4}, {&c->h_sout, sizeof(smoe_cu_sample_out)}, {&c->h_logits, R * V * 4},
    };
    for (size_t i = 0; i < sizeof pinned / sizeof pinned[0]; i++)
        CU(smoe_cu_host_alloc((void **)pinned[i].pp, pinned[i].bytes));
    c->ustart = (uint32_t *)c->idx, c->h_ustart = (uint32_t *)c->h_idx;
    c->ucount = c->ustart + E, c->h_ucount = c->h_ustart + E;
    c->items = c->ucount + E, c->h_items = c->h_ucount + E;
    c->wtab = (const uint8_t **)(c->idx + c->idx_wtab_off), c->h_wtab = (const uint8_t **)(c->h_idx + c->idx_wtab_off);
    c->rows = (uint32_t *)(c->idx + c->idx_rows_off), c->h_rows = (uint32_t *)(c->h_idx + c->idx_rows_off);
    c->ran_resident = calloc(L, sizeof *c->ran_resident);
    if (!c->ran_resident) return smoe_fail(SMOE_ERR_NOMEM, "cuda: out of memory");
    CU(smoe_cu_stream_sync(sh->cs));
    /* the share's expert cache, after the first session's planes (its budget is what is left) */
    if (!sh->tier_made && sh->streamer && (st = smoe_cuda_tier_new(c)) != SMOE_OK) return st;
    *plane_bytes = 0; /* everything is in VRAM (device_stats) */
    return SMOE_OK;
}

/* ---------------------------------------------------------------------------- a pass's ops */

/* The pass's position and ids up to the GPU. */
static smoe_status cuda_stage(void *b, const int32_t *ids, uint32_t n, uint32_t pos0) {
    cuda_state *c = b;
    CU(smoe_cu_stream_sync(c->sh->cs)); /* the staging buffer's last copy is done */
    c->h_pass[0] = (int32_t)pos0;
    memcpy(c->h_pass + 1, ids, n * sizeof *ids);
    CU(smoe_cu_upload(c->pass, c->h_pass, (n + 1) * sizeof *ids, c->sh->cs));
    c->pos0 = pos0;
    for (uint32_t l = 0; l < c->cfg->num_hidden_layers; l++) c->ran_resident[l] = false; /* a failed pass's */
    return SMOE_OK;
}

static smoe_status cuda_embed(void *b, uint32_t n) {
    cuda_state *c = b;
    smoe_cu_tensor d = smoe_cuda_desc(c->lay->embed);
    CU(smoe_cu_embed(c->sh->cs, &d, smoe_cuda_dev(c, c->lay->embed), c->pass + 1, n, c->x));
    smoe_cuda_written(c, SMOE_PL_X);
    return SMOE_OK;
}

/* Norms write XN for products (q/k/v, the router, the experts, a dense MLP, lm_head); their f16
 * rows come in the same launch when the model has tensor-core products. A QK-norm over the whole
 * projection (OLMoE) normalises Q or K rows in place, over the plane's width. */
static smoe_status cuda_norm(void *b, smoe_plane dst, smoe_plane src, const smoe_tensor *w, uint32_t n) {
    cuda_state *c = b;
    const uint32_t H = smoe_cuda_plane_cols(c, src);
    if (w->cols != H || smoe_cuda_plane_cols(c, dst) != H)
        return smoe_fail(SMOE_ERR_INTERNAL, "cuda: norm: a weight of %u over rows of %u", w->cols, H);
    float *out = smoe_cuda_plane(c, dst);
    const float *x = smoe_cuda_plane(c, src);
    smoe_cuda_written(c, dst);
    if (dst == SMOE_PL_XN && c->any_tc) {
        CU(smoe_cu_rmsnorm_prep(c->sh->cs, out, x, n, H, smoe_cuda_dev(c, w), w->format, c->cfg->rms_norm_eps, c->a16,
                                c->ae));
        c->a16_of = (int)dst;
        c->a16_cols = H;
        return SMOE_OK;
    }
    CU(smoe_cu_rmsnorm(c->sh->cs, out, x, n, H, H, smoe_cuda_dev(c, w), w->format, c->cfg->rms_norm_eps));
    return SMOE_OK;
}

/* The input rows are W.cols wide and the outputs W.rows (the planes' widths for every family but the
 * hybrids, whose gate and DeltaNet planes are written packed, as the CPU's are). */
static smoe_status cuda_project(void *b, smoe_plane src, const smoe_proj *out, uint32_t n_out, uint32_t n) {
    cuda_state *c = b;
    smoe_status st;
    bool need = false; /* the outputs read the same rows: prepared once, for whichever needs it */
    for (uint32_t i = 0; i < n_out; i++) need |= smoe_cuda_tensor_cores(out[i].W);
    smoe_cu_act a;
    if ((st = smoe_cuda_act_cols(c, src, n, out[0].W->cols, need, &a)) != SMOE_OK) return st;
    for (uint32_t i = 0; i < n_out; i++) {
        smoe_cuda_written(c, out[i].out);
        if ((st = smoe_cuda_linear(c, out[i].W, &a, n, smoe_cuda_plane(c, out[i].out), out[i].W->rows)) != SMOE_OK)
            return st;
    }
    return SMOE_OK;
}

/* QK-norm, RoPE and the KV append in one launch, then attention: for the pass's own rows at once,
 * or (a batch) each row with its own session's cache, tables and staged position. */
static smoe_status cuda_attend(void *b, uint32_t l, const smoe_attn *a, uint32_t n, void *const *members) {
    cuda_state *c = b;
    const smoe_tensor *q_norm = a->q_norm, *k_norm = a->k_norm;
    const smoe_config *cf = c->cfg;
    /* per-head QK-norm, or none (no such tensors, or a norm over the whole projection done before) */
    const uint8_t *qn = q_norm ? smoe_cuda_dev(c, q_norm) : NULL, *kn = k_norm ? smoe_cuda_dev(c, k_norm) : NULL;
    const uint8_t qf = q_norm ? q_norm->format : 0, kf = k_norm ? k_norm->format : 0;
    /* gpt-oss: sink logits and a sliding window (the plain attention kernel) */
    const uint8_t *sk = a->sinks ? smoe_cuda_dev(c, a->sinks) : NULL, sf = a->sinks ? a->sinks->format : 0;
    smoe_cuda_written(c, SMOE_PL_Q);
    smoe_cuda_written(c, SMOE_PL_K);
    smoe_cuda_written(c, SMOE_PL_ATT);
    const uint32_t rows = members ? n : 1;
    /* a batch's sessions side by side on the attention streams (each row its own planes' rows and
     * its session's cache, flash splits and tables: nothing shared), joined back into cs */
    cuda_share *sh = c->sh;
    const uint32_t ns = members && n > 1 ? (sh->n_as < n ? sh->n_as : n) : 0;
    if (ns) {
        smoe_cu_event fork = smoe_cuda_ring_event(sh);
        CU(smoe_cu_event_record(fork, sh->cs));
        for (uint32_t i = 0; i < ns; i++) CU(smoe_cu_stream_wait(sh->as[i], fork));
    }
    for (uint32_t t = 0; t < rows; t++) {
        cuda_state *o = members ? members[t] : c;
        const uint32_t m = members ? 1 : n;
        const size_t layer_at = (size_t)l * o->context * o->kv_dim * o->kv_elem;
        float *q = c->q + (size_t)t * c->q_dim, *att = c->att + (size_t)t * c->q_dim;
        smoe_cu_stream st = ns ? sh->as[t % ns] : sh->cs;
        CU(smoe_cu_qk_post(st, q, c->ks + (size_t)t * c->kv_dim, c->vs + (size_t)t * c->kv_dim,
                           o->k + layer_at, o->v + layer_at, o->kv_dtype, m, cf->num_attention_heads,
                           cf->num_key_value_heads, cf->head_dim, c->rot, qn, qf, kn, kf, cf->rms_norm_eps, o->cos,
                           o->sin, (const uint32_t *)o->pass));
        CU(smoe_cu_attention(st, att, q, o->k + layer_at, o->v + layer_at, o->kv_dtype, m,
                             cf->num_attention_heads, cf->num_key_value_heads, cf->head_dim, o->pos0,
                             (const uint32_t *)o->pass, o->fa_part, o->context, sk, sf, a->window));
    }
    for (uint32_t i = 0; i < ns; i++) {
        smoe_cu_event join = smoe_cuda_ring_event(sh);
        CU(smoe_cu_event_record(join, sh->as[i]));
        CU(smoe_cu_stream_wait(sh->cs, join));
    }
    return SMOE_OK;
}

static smoe_status cuda_bias(void *b, smoe_plane dst, const smoe_tensor *bias, uint32_t n) {
    cuda_state *c = b;
    const uint32_t W = smoe_cuda_plane_cols(c, dst);
    if (bias->cols != W) return smoe_fail(SMOE_ERR_INTERNAL, "cuda: bias: a vector of %u over rows of %u", bias->cols, W);
    smoe_cuda_written(c, dst);
    CU(smoe_cu_bias(c->sh->cs, smoe_cuda_plane(c, dst), n, W, smoe_cuda_dev(c, bias), bias->format));
    return SMOE_OK;
}

/* ------------------------------------------------------ the hybrids' ops (deltanet.cu) */

static smoe_status cuda_sigmoid_gate(void *b, smoe_plane dst, smoe_plane gate, uint32_t width, uint32_t gate_width,
                                     uint32_t n) {
    cuda_state *c = b;
    smoe_cuda_written(c, dst);
    CU(smoe_cu_sigmoid_gate(c->sh->cs, smoe_cuda_plane(c, dst), smoe_cuda_plane(c, gate), width, gate_width, n));
    return SMOE_OK;
}

/* Rows [0, n) of the pass in one launch per kernel (each walks them in token order), or a batch's
 * rows one launch each, with their own sessions' states: the same arithmetic per row either way. */
static smoe_status cuda_linear_attend(void *b, uint32_t l, const smoe_tensor *conv, const smoe_tensor *a_log,
                                      const smoe_tensor *dt_bias, const smoe_tensor *norm, uint32_t n,
                                      void *const *members) {
    cuda_state *c = b;
    const smoe_linear_shape *ln = &c->lin;
    const int64_t off = c->sh->lin_off ? c->sh->lin_off[l] : -1;
    if (c->n_linear == 0 || c->linear_index[l] < 0 || off < 0)
        return smoe_fail(SMOE_ERR_INTERNAL, "cuda: layer %u has no linear-attention state", l);
    const uint32_t K = ln->conv_kernel, vh = ln->v_heads, lin_v = vh * ln->v_dim;
    if (conv->rows * conv->cols != c->conv_dim * K || a_log->cols != vh || dt_bias->cols != vh ||
        norm->cols != ln->v_dim)
        return smoe_fail(SMOE_ERR_INTERNAL, "cuda: layer %u's DeltaNet weights do not have the session's shape", l);
    const float *cw = c->sh->lin_w + off, *A = cw + (size_t)c->conv_dim * K, *dt = A + vh, *nw = dt + vh;
    smoe_cuda_written(c, SMOE_PL_MIX);
    smoe_cuda_written(c, SMOE_PL_ATT);
    const uint32_t rows = members ? n : 1;
    for (uint32_t t = 0; t < rows; t++) {
        const cuda_state *o = members ? members[t] : c;
        const uint32_t m = members ? 1 : n;
        const size_t li = (size_t)o->linear_index[l];
        float *conv_state = o->lin_conv + li * (K ? K - 1 : 0) * c->conv_dim;
        float *state = o->lin_s + li * vh * ln->k_dim * ln->v_dim;
        CU(smoe_cu_deltanet_conv(c->sh->cs, c->mix + (size_t)t * c->conv_dim, m, conv_state, cw, ln->k_heads,
                                 ln->k_dim, c->conv_dim, K));
        CU(smoe_cu_deltanet_rule(c->sh->cs, c->att + (size_t)t * lin_v, c->mix + (size_t)t * c->conv_dim,
                                 c->beta + (size_t)t * vh, c->decay + (size_t)t * vh, c->gate + (size_t)t * lin_v,
                                 state, A, dt, nw, m, ln->k_heads, vh, ln->k_dim, ln->v_dim, ln->v_tiled,
                                 c->cfg->rms_norm_eps));
    }
    return SMOE_OK;
}

static smoe_status cuda_state_op(void *b, smoe_state_op op) {
    cuda_state *c = b;
    if (c->n_linear == 0) return SMOE_OK;
    smoe_cu_stream cs = c->sh->cs;
    float *live[2] = {c->lin_s, c->lin_conv}, *snap[2] = {c->snap_s, c->snap_conv};
    const size_t bytes[2] = {c->lin_s_bytes, c->lin_conv_bytes};
    for (int i = 0; i < 2; i++) {
        if (!bytes[i]) continue;
        switch (op) {
        case SMOE_STATE_RESET: CU(smoe_cu_memset(live[i], 0, bytes[i], cs)); break;
        case SMOE_STATE_SAVE: CU(smoe_cu_copy(snap[i], live[i], bytes[i], cs)); break;
        case SMOE_STATE_RESTORE: CU(smoe_cu_copy(live[i], snap[i], bytes[i], cs)); break;
        }
    }
    return SMOE_OK;
}

static smoe_status cuda_add(void *b, smoe_plane dst, smoe_plane src, uint32_t n) {
    cuda_state *c = b;
    smoe_cuda_written(c, dst);
    CU(smoe_cu_add(c->sh->cs, smoe_cuda_plane(c, dst), smoe_cuda_plane(c, src), (size_t)n * c->cfg->hidden_size));
    return SMOE_OK;
}

static smoe_status cuda_mlp(void *b, smoe_plane dst, smoe_plane src, const smoe_tensor *gate, const smoe_tensor *up,
                            const smoe_tensor *down, uint32_t n) {
    cuda_state *c = b;
    const uint32_t I = gate->rows, H = c->cfg->hidden_size;
    smoe_cu_rows R = {.n = n};
    smoe_status st;
    const bool need = smoe_cuda_tensor_cores(gate) || smoe_cuda_tensor_cores(up);
    smoe_cu_act a;
    if ((st = smoe_cuda_act(c, src, n, need, &a)) != SMOE_OK ||
        (st = smoe_cuda_linear(c, gate, &a, n, c->hg, 2 * (size_t)I)) != SMOE_OK ||
        (st = smoe_cuda_linear(c, up, &a, n, c->hg + I, 2 * (size_t)I)) != SMOE_OK)
        return st;
    smoe_cuda_written(c, dst);
    if ((st = smoe_cuda_swiglu(c, smoe_cuda_tensor_cores(down), false, I, &R, &a)) != SMOE_OK ||
        (st = smoe_cuda_linear(c, down, &a, n, smoe_cuda_plane(c, dst), H)) != SMOE_OK)
        return st;
    return SMOE_OK;
}

static smoe_status cuda_logits(void *b, const smoe_tensor *norm, const smoe_tensor *head, const uint32_t *rows,
                               uint32_t m) {
    cuda_state *c = b;
    const uint32_t H = c->cfg->hidden_size;
    smoe_status st;
    /* the rows, contiguous: in place when they are [r, r + m), else gathered into xg first */
    bool run = true;
    for (uint32_t i = 1; i < m; i++) run &= rows[i] == rows[0] + i;
    const float *x = c->x + (size_t)rows[0] * H;
    if (!run) {
        for (uint32_t i = 0; i < m; i++)
            CU(smoe_cu_copy(c->xg + (size_t)i * H, c->x + (size_t)rows[i] * H, H * sizeof(float), c->sh->cs));
        x = c->xg;
    }
    smoe_cuda_written(c, SMOE_PL_XN);
    smoe_cu_act a = {.x = c->xn, .ldx = H};
    if (smoe_cuda_tensor_cores(head)) {
        CU(smoe_cu_rmsnorm_prep(c->sh->cs, c->xn, x, m, H, smoe_cuda_dev(c, norm), norm->format, c->cfg->rms_norm_eps,
                                c->a16, c->ae));
        c->a16_of = SMOE_PL_XN;
        c->a16_cols = H;
        a.x16 = c->a16;
        a.xe = c->ae;
    } else {
        CU(smoe_cu_rmsnorm(c->sh->cs, c->xn, x, m, H, H, smoe_cuda_dev(c, norm), norm->format, c->cfg->rms_norm_eps));
    }
    if ((st = smoe_cuda_linear(c, head, &a, m, c->logits, c->cfg->vocab_size)) != SMOE_OK) return st;
    return SMOE_OK;
}

static smoe_status cuda_logits_read(void *b, uint32_t m, const float **out) {
    cuda_state *c = b;
    CU(smoe_cu_download(c->h_logits, c->logits, (size_t)m * c->cfg->vocab_size * 4, c->sh->cs));
    CU(smoe_cu_stream_sync(c->sh->cs));
    *out = c->h_logits;
    return SMOE_OK;
}

/* ----------------------------------------------------------------------------------- the rest */

/* The selection of the engine's sampler on the GPU, the draw on the host (backend.h): greedy and
 * top-k up to SAMPLE_CAP; anything else (no top-k with a temperature, a longer penalty window) is
 * left to the host. */
static smoe_status cuda_select(void *b, uint32_t row, const smoe_sampler_params *p, const int32_t *window, uint32_t w,
                               smoe_candidates *out, bool *done) {
    cuda_state *c = b;
    const uint32_t V = c->cfg->vocab_size;
    *done = false;
    if (!c->sh->gpu_sampling) return SMOE_OK;
    if (p->temperature > 0.0f && !(p->top_k > 0 && p->top_k <= SAMPLE_CAP && p->top_k < V)) return SMOE_OK;
    if (w > HIST_CAP) return SMOE_OK;
    if (w) {
        memcpy(c->h_hist, window, w * sizeof *c->h_hist); /* the last step synced */
        CU(smoe_cu_upload(c->d_hist, c->h_hist, w * sizeof *c->h_hist, c->sh->cs));
    }
    const float pen = w ? p->repetition_penalty : 1.0f;
    CU(smoe_cu_sample_select(c->sh->cs, c->logits + (size_t)row * V, c->d_sv, V, c->d_hist, w, pen, p->temperature,
                             p->top_k, c->d_sout));
    CU(smoe_cu_download(c->h_sout, c->d_sout, sizeof *c->h_sout, c->sh->cs));
    CU(smoe_cu_stream_sync(c->sh->cs));
    const smoe_cu_sample_out *o = c->h_sout;
    if (o->flags == 2) return SMOE_OK;
    *done = true;
    *out = (smoe_candidates){.count = o->flags == 1 ? 0 : o->count, .best = o->best, .m = o->m, .ids = o->ids,
                             .vals = o->vals};
    return SMOE_OK;
}

static smoe_status cuda_read_kv(void *b, uint32_t layer, uint32_t start, uint32_t n, float *k, float *v) {
    cuda_state *c = b;
    const smoe_kv_dtype dt = c->kv_dtype;
    const size_t es = c->kv_elem, count = (size_t)n * c->kv_dim;
    const size_t at = ((size_t)layer * c->context + start) * c->kv_dim * es;
    /* the stored elements land in the front of the caller's floats, then widen in place from the
     * last one down (element i's float never covers an element below i that is still to be read) */
    if (k) CU(smoe_cu_download(k, c->k + at, count * es, c->sh->cs));
    if (v) CU(smoe_cu_download(v, c->v + at, count * es, c->sh->cs));
    CU(smoe_cu_stream_sync(c->sh->cs));
    if (es != 4)
        for (size_t i = count; i-- > 0;) {
            if (k) smoe_kv_load(k + i, (const uint8_t *)k + i * es, 1, dt);
            if (v) smoe_kv_load(v + i, (const uint8_t *)v + i * es, 1, dt);
        }
    return SMOE_OK;
}

static const char *cuda_describe(void *b) { return ((cuda_state *)b)->sh->line; }

static void cuda_device_stats(void *b, smoe_device_counters *out) {
    const cuda_state *c = b;
    const cuda_share *sh = c->sh;
    out->uploads = sh->uploads;
    out->upload_bytes = sh->upload_bytes;
    out->vram_hits = sh->hits;
    out->vram_misses = sh->misses;
    out->vram_cache_bytes = (uint64_t)sh->n_vslots * sh->blob_bytes;
    out->vram_other_bytes = sh->other_bytes + c->other_bytes;
    out->vram_slots = sh->n_vslots;
}

static bool cuda_broken(void *b) {
    const cuda_state *c = b;
    return c->broken || c->sh->broken;
}

/* The CUDA kernels implement the recipes of Qwen3-MoE, Mixtral, OLMoE, GLM-4.5, gpt-oss, Qwen3-Next
 * and Qwen3.5-MoE: QK-norm per head, over the whole projection or none, RoPE over all or the first
 * rotary_dim dims of a head (YaRN's tables are the engine's), attention biases, sinks and a sliding
 * window, gated attention's output gate, the Gated DeltaNet (value heads up to 1024 wide), softmax
 * routing, the grouped sigmoid router (up to SMOE_CU_MAX_GROUPS groups) and top-k-then-softmax,
 * shared experts (with or without a sigmoid gate), expert biases and the clamped SwiGLU; blob
 * layouts that may differ by layer (llama.cpp's mixes); q4, q8, bf16, f32 and the GGML block
 * formats (ggml.cu). */
static const char *cuda_lacks(const smoe_layout *lay) {
    const smoe_model_params *m = &lay->mp;
    if (m->family > SMOE_FAMILY_QWEN3_5_MOE) return "this family's ops";
    for (uint32_t l = 0; l < lay->cfg.num_hidden_layers; l++) {
        const smoe_layer_weights *L = &lay->layers[l];
        if (L->attn != SMOE_ATTN_LINEAR) continue;
        if (L->lin_norm->cols > 1024) return "a Gated DeltaNet value head wider than 1024";
        if (L->lin_conv->cols < 1) return "a Gated DeltaNet convolution without taps";
    }
    if (m->qk_norm > SMOE_QK_NORM_WHOLE) return "this QK-norm";
    if (m->rotary_dim % 2 || m->rotary_dim > lay->cfg.head_dim) return "a RoPE over an odd or too wide rotary_dim";
    if (m->router_kind >= SMOE_ROUTER_KINDS) return "this router";
    if (lay->cfg.num_experts_per_tok > 32) return "more than 32 experts a token"; /* moe.cu's k_route */
    if (lay->cfg.num_experts > 32 * 32) return "more than 1,024 experts a layer";  /* k_route: 32 a lane */
    if (m->router_kind == SMOE_ROUTER_SIGMOID_GROUP && m->n_group > SMOE_CU_MAX_GROUPS)
        return "a grouped router of more than 64 groups";
    return NULL;
}

const smoe_backend smoe_backend_cuda = {
    .name = "cuda",
    .lacks = cuda_lacks,
    .share_new = cuda_share_new,
    .share_free = cuda_share_free,
    .session_new = cuda_session_new,
    .session_free = cuda_session_free,
    .stage = cuda_stage,
    .embed = cuda_embed,
    .norm = cuda_norm,
    .project = cuda_project,
    .attend = cuda_attend,
    .add = cuda_add,
    .bias = cuda_bias,
    .sigmoid_gate = cuda_sigmoid_gate,
    .linear_attend = cuda_linear_attend,
    .state = cuda_state_op,
    .mlp = cuda_mlp,
    .route = smoe_cuda_route,
    .route_grouped = smoe_cuda_route_grouped,
    .experts_begin = smoe_cuda_experts_begin,
    .experts = smoe_cuda_experts,
    .combine = smoe_cuda_combine,
    .logits = cuda_logits,
    .logits_read = cuda_logits_read,
    .tier_lookup = smoe_cuda_tier_lookup,
    .tier_claim = smoe_cuda_tier_claim,
    .tier_fill = smoe_cuda_tier_fill,
    .tier_sync = smoe_cuda_tier_sync,
    .tier_drop = smoe_cuda_tier_drop,
    .tier_batch = smoe_cuda_tier_batch,
    .tier_clear = smoe_cuda_tier_clear,
    .tier_resident = smoe_cuda_tier_resident,
    .moe_resident = smoe_cuda_moe_resident,
    .pass_end = smoe_cuda_pass_end,
    .replay = smoe_cuda_replay,
    .record_begin = smoe_cuda_record_begin,
    .record_end = smoe_cuda_record_end,
    .select = cuda_select,
    .read_kv = cuda_read_kv,
    .describe = cuda_describe,
    .device_stats = cuda_device_stats,
    .broken = cuda_broken,
};
