/* session.c — creating and freeing a session, its options, counters and KV access.
 *
 * Everything a session will ever use is allocated here, sized by the params: the KV cache, the
 * RoPE tables, the activation planes for `chunk` tokens, the streamer's slots, the threads.
 * smoe_prefill_chunk and smoe_decode_step then never allocate. */
#include "session.h"
#include "cpu.h"

#include <math.h>
#include <string.h>
#include <unistd.h>

smoe_session_params smoe_session_default_params(void) {
    smoe_session_params p;
    memset(&p, 0, sizeof p);
    p.struct_size = sizeof p;
    p.context = 4096;
    p.chunk = 256; /* bench/RESULTS.md: 1024 tokens on mini cost 12.6 s at 64, 7.2 s at 256, 7.6 s at 1024 */
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    p.threads = cores > 0 ? (uint32_t)cores : 1;
    p.io_threads = 4;
    p.cache_bytes = 0;
    p.direct_io = true;
    p.verify_blobs = true; /* bench/RESULTS.md "Per-read blob checksums": cheap next to the read */
    p.coalesce_bytes = 16u << 20; /* bench/RESULTS.md "Coalesced reads" */
    return p;
}

smoe_sampler_params smoe_sampler_default_params(void) {
    smoe_sampler_params p;
    memset(&p, 0, sizeof p);
    p.struct_size = sizeof p;
    p.temperature = 0.0f;
    p.top_k = 0;
    p.top_p = 1.0f;
    p.min_p = 0.0f;
    p.repetition_penalty = 1.0f;
    p.repetition_window = 64;
    p.seed = 0;
    return p;
}

/* Params from a caller whose struct may be older (smaller) than ours: fields it lacks keep
 * their defaults. */
static smoe_status read_params(const smoe_session_params *in, smoe_session_params *out) {
    *out = smoe_session_default_params();
    if (!in)
        return SMOE_OK;
    if (in->struct_size < offsetof(smoe_session_params, cache_bytes) || in->struct_size > sizeof *out)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_session_params.struct_size %u is not a known size (%zu)",
                         in->struct_size, sizeof *out);
    memcpy(out, in, in->struct_size);
    out->struct_size = sizeof *out;
    return SMOE_OK;
}

/* Lets go of one session's hold on a share; the last one frees it. */
static void share_drop(smoe_share *sh) {
    if (!sh || atomic_fetch_sub(&sh->refs, 1) != 1)
        return;
    smoe_streamer_free(sh->streamer);
    smoe_pool_free(sh->pool);
    pthread_mutex_destroy(&sh->mu);
    smoe_free(sh);
}

void smoe_session_free(smoe_session *s) {
    if (!s)
        return;
    if (s->backend)
        s->backend->free(s); /* first: it may hold the streamer's slots pinned */
    share_drop(s->share);
    void *bufs[] = {s->k_cache, s->v_cache, s->k_new, s->v_new, s->rope_cos, s->rope_sin, s->history, s->x, s->xn, s->q, s->att,
                    s->scores, s->router, s->topk_idx, s->topk_w, s->slot_out, s->xg, s->hg, s->h, s->yg,
                    s->qx_codes, s->qx_d, s->qx_gsum,
                    s->logits, s->sample_f, s->sample_i, s->exp_count, s->exp_rows, s->union_list,
                    s->union_slot, s->pending, s->pending_slots, s->union_sizes, s->expert_counts};
    for (size_t i = sizeof bufs / sizeof bufs[0]; i-- > 0;)
        smoe_free(bufs[i]);
    smoe_free(s);
}

/* One plane: counted in plane_bytes, 64-byte aligned, zeroed. */
static void *plane(smoe_session *s, size_t count, size_t elem, bool *ok) {
    size_t bytes = count * elem;
    if (bytes == 0)
        bytes = 64;
    void *p = smoe_alloc(bytes, 64);
    if (!p)
        *ok = false;
    s->plane_bytes += bytes;
    return p;
}

static void build_rope(smoe_session *s) {
    /* As transformers computes it, in float32: inv_freq = 1 / θ^(2i/d), angle = pos · inv_freq. */
    uint32_t d = s->cfg.head_dim, half = d / 2;
    for (uint32_t i = 0; i < half; i++) {
        float inv = 1.0f / powf((float)s->cfg.rope_theta, (float)(2 * i) / (float)d);
        for (uint32_t p = 0; p < s->params.context; p++) {
            float a = (float)p * inv;
            s->rope_cos[(size_t)p * half + i] = cosf(a);
            s->rope_sin[(size_t)p * half + i] = sinf(a);
        }
    }
}

/* A new session of vault; with sibling, holding sibling's share (whose params then stand for
 * threads, io_threads, cache_bytes, direct_io and verify_blobs) instead of making its own. */
static smoe_status session_new(smoe_vault *vault, const smoe_session_params *params, smoe_session *sibling,
                               smoe_session **out) {
    smoe_status isa = smoe_cpu_check(); /* first: before any code that may use AVX2 (cpu.c) */
    if (isa != SMOE_OK) {
        if (out) *out = NULL;
        return isa;
    }
    if (!out)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_session_new: out is NULL");
    *out = NULL;
    if (!vault)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_session_new: vault is NULL");
    smoe_session_params p;
    smoe_status st = read_params(params, &p);
    if (st != SMOE_OK)
        return st;
    const smoe_config *c = &vault->lay.cfg;
    if (sibling) {
        p.threads = sibling->params.threads;
        p.io_threads = sibling->params.io_threads;
        p.cache_bytes = sibling->params.cache_bytes;
        p.direct_io = sibling->params.direct_io;
        p.verify_blobs = sibling->params.verify_blobs;
    }
    if (p.context == 0 || p.chunk == 0 || p.threads == 0 || p.io_threads == 0)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "context, chunk, threads and io_threads must be at least 1");
    if (p.kv_dtype > SMOE_KV_F16)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "kv_dtype %u is not a smoe_kv_dtype (0 f32, 1 bf16, 2 f16)", p.kv_dtype);
    if (p.context > c->max_position_embeddings)
        p.context = c->max_position_embeddings;
    if (p.chunk > 65536 || p.threads > 256 || p.io_threads > 256)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "chunk ≤ 65536, threads ≤ 256 and io_threads ≤ 256 (got %u, %u, %u)",
                         p.chunk, p.threads, p.io_threads);
    const smoe_backend *backend;
    if ((st = smoe_backend_for(p.device, &backend)) != SMOE_OK)
        return st;
    if (sibling && (backend != &smoe_backend_cpu || sibling->backend != &smoe_backend_cpu))
        return smoe_fail(SMOE_ERR_UNSUPPORTED, "smoe_session_new_shared: only CPU sessions share a cache");

    smoe_session *s = smoe_alloc(sizeof *s, 64);
    if (!s)
        return smoe_fail(SMOE_ERR_NOMEM, "out of memory for the session");
    atomic_init(&s->busy, 0);
    atomic_init(&s->cancel, 0);
    s->vault = vault;
    s->lay = &vault->lay;
    s->cfg = *c;
    s->params = p;
    s->q_dim = c->num_attention_heads * c->head_dim;
    s->kv_dim = c->num_key_value_heads * c->head_dim;
    s->ffn = c->intermediate_size > c->moe_intermediate_size ? c->intermediate_size : c->moe_intermediate_size;

    size_t C = p.chunk, H = c->hidden_size, E = c->num_experts, K = c->num_experts_per_tok, L = c->num_hidden_layers;
    bool ok = true;
    size_t kv = L * p.context * s->kv_dim;
    s->kv_elem = smoe_kv_elem_bytes(p.kv_dtype);
    /* Not zeroed: attention and smoe_session_read_kv read only rows below the position, which
     * were written first; so the OS maps the cache's pages as positions fill (for a large
     * cache, which malloc takes from mmap), not all at creation. */
    s->k_cache = smoe_alloc_untouched(kv * s->kv_elem, 64);
    s->v_cache = smoe_alloc_untouched(kv * s->kv_elem, 64);
    ok = s->k_cache && s->v_cache;
    s->kv_bytes = 2 * kv * s->kv_elem;
    if (p.kv_dtype != SMOE_KV_F32) {
        s->k_new = plane(s, C * s->kv_dim, sizeof(float), &ok);
        s->v_new = plane(s, C * s->kv_dim, sizeof(float), &ok);
    }
    s->rope_cos = plane(s, (size_t)p.context * (c->head_dim / 2), sizeof(float), &ok);
    s->rope_sin = plane(s, (size_t)p.context * (c->head_dim / 2), sizeof(float), &ok);
    s->history = plane(s, p.context, sizeof(int32_t), &ok);
    s->x = plane(s, C * H, sizeof(float), &ok);
    s->xn = plane(s, C * H, sizeof(float), &ok);
    s->q = plane(s, C * s->q_dim, sizeof(float), &ok);
    s->att = plane(s, C * s->q_dim, sizeof(float), &ok);
    s->scores = plane(s, (size_t)p.threads * p.context, sizeof(float), &ok);
    s->router = plane(s, C * E, sizeof(float), &ok);
    s->topk_idx = plane(s, C * K, sizeof(int32_t), &ok);
    s->topk_w = plane(s, C * K, sizeof(float), &ok);
    s->slot_out = plane(s, C * K * H, sizeof(float), &ok);
    s->xg = plane(s, C * H, sizeof(float), &ok);
    s->hg = plane(s, C * 2 * s->ffn, sizeof(float), &ok);
    s->h = plane(s, C * s->ffn, sizeof(float), &ok);
    s->yg = plane(s, C * H, sizeof(float), &ok);
    {
        /* the widest input of any q8/q4 product: hidden, q_dim (o_proj) or an FFN width (down) */
        uint32_t cols = H > s->q_dim ? (uint32_t)H : s->q_dim;
        cols = cols > s->ffn ? cols : s->ffn;
        smoe_qx_size z = smoe_qx_sizes(cols, SMOE_FMT_Q8, 32); /* q8's int16 codes and group 32's sums: the larger */
        s->qx_codes = plane(s, C * z.code_bytes, 1, &ok);
        s->qx_d = plane(s, C * z.d_floats, sizeof(float), &ok);
        s->qx_gsum = plane(s, C * z.gsum_floats, sizeof(float), &ok);
    }
    s->logits = plane(s, c->vocab_size, sizeof(float), &ok);
    s->sample_f = plane(s, c->vocab_size, sizeof(float), &ok);
    s->sample_i = plane(s, c->vocab_size, sizeof(int32_t), &ok);
    s->exp_count = plane(s, E, sizeof(uint32_t), &ok);
    s->exp_rows = plane(s, E * C, sizeof(uint32_t), &ok);
    s->union_list = plane(s, E, sizeof(int32_t), &ok);
    s->union_slot = plane(s, E, sizeof(int32_t), &ok);
    s->pending = plane(s, E, sizeof(uint32_t), &ok);
    s->pending_slots = plane(s, E, sizeof(int), &ok);
    s->union_sizes = plane(s, L, sizeof(uint32_t), &ok);
    s->expert_counts = plane(s, L * E, sizeof(uint64_t), &ok);
    if (!ok) {
        smoe_session_free(s);
        return smoe_fail(SMOE_ERR_NOMEM, "out of memory for the KV cache (%zu bytes) and planes (%llu bytes)",
                         (size_t)s->kv_bytes, (unsigned long long)s->plane_bytes);
    }
    build_rope(s);

    if (sibling) {
        atomic_fetch_add(&sibling->share->refs, 1);
        s->share = sibling->share;
        s->pool = s->share->pool;
        s->streamer = s->share->streamer;
        smoe_sampler_params sdef = smoe_sampler_default_params();
        smoe_sampler_init(&s->sampler, &sdef);
        s->backend = backend;
        *out = s;
        return SMOE_OK;
    }
    s->share = smoe_alloc(sizeof *s->share, 64);
    if (!s->share) {
        smoe_session_free(s);
        return smoe_fail(SMOE_ERR_NOMEM, "out of memory for the session");
    }
    if (pthread_mutex_init(&s->share->mu, NULL) != 0) {
        smoe_free(s->share);
        s->share = NULL;
        smoe_session_free(s);
        return smoe_fail(SMOE_ERR_NOMEM, "could not create the session's lock");
    }
    atomic_init(&s->share->refs, 1);
    if ((st = smoe_pool_new(p.threads, &s->share->pool)) != SMOE_OK) {
        smoe_session_free(s);
        return st;
    }
    s->pool = s->share->pool;

    if (c->num_sparse_layers > 0) {
        /* The budget in whole blobs; never fewer than one token's experts of one layer, never
         * more than there are blobs. */
        uint64_t total = (uint64_t)c->num_sparse_layers * c->num_experts;
        uint64_t slots = p.cache_bytes / vault->lay.blob_bytes;
        if (slots < K)
            slots = K;
        if (slots > total)
            slots = total;
        /* A vault.bin rewritten in place since the vault opened it would mix the loaded tables
         * and dense weights with new blobs. */
        if ((st = smoe_vault_check_unchanged(vault)) != SMOE_OK) {
            smoe_session_free(s);
            return st;
        }
        smoe_streamer_params sp = {
            .path = vault->path,
            .fd = vault->fd,
            .blob_bytes = vault->lay.blob_bytes,
            .blob_offset = vault->lay.blob_offset,
            .blob_crc = vault->lay.blob_crc,
            .n_layers = c->num_hidden_layers,
            .n_experts = c->num_experts,
            .n_sparse_layers = c->num_sparse_layers,
            .n_slots = (uint32_t)slots,
            .io_threads = p.io_threads,
            .direct_io = p.direct_io,
            .verify = p.verify_blobs,
            .coalesce_bytes = p.coalesce_bytes,
        };
        if ((st = smoe_streamer_new(&sp, &s->share->streamer)) != SMOE_OK) {
            smoe_session_free(s);
            return st;
        }
        s->streamer = s->share->streamer;
    }
    smoe_sampler_params sdef = smoe_sampler_default_params();
    smoe_sampler_init(&s->sampler, &sdef);
    s->backend = backend;
    if ((st = backend->init(s)) != SMOE_OK) {
        smoe_session_free(s);
        return st;
    }
    *out = s;
    return SMOE_OK;
}

smoe_status smoe_session_new(smoe_vault *vault, const smoe_session_params *params, smoe_session **out) {
    return session_new(vault, params, NULL, out);
}

smoe_status smoe_session_new_shared(smoe_session *sibling, const smoe_session_params *params, smoe_session **out) {
    if (!sibling) {
        if (out)
            *out = NULL;
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_session_new_shared: sibling is NULL");
    }
    return session_new(sibling->vault, params, sibling, out);
}

smoe_status smoe_session_reset(smoe_session *s) {
    if (!s)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "session is NULL");
    smoe_status st = smoe_session_enter(s, "smoe_session_reset");
    if (st != SMOE_OK)
        return st;
    smoe_session_set_pos(s, 0);
    s->broken = false;
    return smoe_session_leave(s, SMOE_OK);
}

uint32_t smoe_session_position(const smoe_session *s) { return s ? __atomic_load_n(&s->pos, __ATOMIC_ACQUIRE) : 0; }

smoe_status smoe_session_rewind(smoe_session *s, uint32_t position) {
    if (!s)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "session is NULL");
    smoe_status st = smoe_session_enter(s, "smoe_session_rewind");
    if (st != SMOE_OK)
        return st;
    if (position > s->pos)
        st = smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_session_rewind: position %u is past the current one (%u)", position,
                       s->pos);
    else
        smoe_session_set_pos(s, position);
    return smoe_session_leave(s, st);
}

smoe_status smoe_session_cancel(smoe_session *s) {
    if (!s)
        return SMOE_ERR_INVALID_ARG; /* no smoe_fail: it formats a message, not signal-safe */
    atomic_store_explicit(&s->cancel, 1, memory_order_relaxed);
    return SMOE_OK;
}

smoe_status smoe_session_set_sampler(smoe_session *s, const smoe_sampler_params *params) {
    if (!s || !params)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_session_set_sampler: NULL argument");
    smoe_sampler_params p = smoe_sampler_default_params();
    if (params->struct_size < sizeof(uint32_t) + sizeof(float) || params->struct_size > sizeof p)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_sampler_params.struct_size %u is not a known size",
                         params->struct_size);
    memcpy(&p, params, params->struct_size);
    p.struct_size = sizeof p;
    smoe_status st = smoe_session_enter(s, "smoe_session_set_sampler");
    if (st != SMOE_OK)
        return st;
    if (!(p.temperature >= 0.0f) || !(p.top_p > 0.0f && p.top_p <= 1.0f) || !(p.min_p >= 0.0f && p.min_p <= 1.0f) ||
        !(p.repetition_penalty > 0.0f))
        st = smoe_fail(SMOE_ERR_INVALID_ARG,
                         "sampler: temperature ≥ 0, 0 < top_p ≤ 1, 0 ≤ min_p ≤ 1, repetition_penalty > 0 "
                         "(got %g, %g, %g, %g)",
                         p.temperature, p.top_p, p.min_p, p.repetition_penalty);
    else
        smoe_sampler_init(&s->sampler, &p);
    return smoe_session_leave(s, st);
}

static smoe_status session_read_kv_claimed(const smoe_session *s, uint32_t layer, uint32_t start, uint32_t n, float *k,
                                 float *v) {
    if (!s)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "session is NULL");
    if (layer >= s->cfg.num_hidden_layers || (uint64_t)start + n > s->pos)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "KV rows [%u, %u) of layer %u: the cache holds %u positions of %u layers",
                         start, start + n, layer, s->pos, s->cfg.num_hidden_layers);
    return s->backend->read_kv(s, layer, start, n, k, v);
}

static smoe_status stats_claimed(const smoe_session *s, smoe_counters *out) {
    if (!s || !out)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_stats: NULL argument");
    if (out->struct_size < offsetof(smoe_counters, direct_io) || out->struct_size > sizeof *out)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_counters.struct_size %u is not a known size", out->struct_size);
    smoe_counters c;
    memset(&c, 0, sizeof c);
    c.struct_size = out->struct_size;
    c.position = s->pos;
    if (s->streamer) {
        smoe_streamer_stats ss;
        smoe_streamer_get_stats(s->streamer, &ss);
        c.blob_reads = ss.blob_reads;
        c.bytes_read = ss.bytes_read;
        c.cache_hits = ss.hits;
        c.cache_misses = ss.misses;
        c.io_wait_s = ss.io_wait_s;
        c.direct_io = ss.direct_io;
        c.read_requests = ss.read_requests;
        c.cache_bytes = smoe_streamer_slot_bytes(s->streamer);
        c.cache_slots = (uint32_t)(c.cache_bytes / s->lay->blob_bytes);
    }
    c.prefill_s = s->prefill_s;
    c.decode_s = s->decode_s;
    c.tokens_prefilled = s->tokens_prefilled;
    c.tokens_decoded = s->tokens_decoded;
    c.dense_bytes = s->lay->dense_bytes;
    c.kv_bytes = s->kv_bytes;
    c.plane_bytes = s->plane_bytes;
    c.resident_bytes = c.dense_bytes + c.cache_bytes + c.kv_bytes + c.plane_bytes;
    c.num_layers = s->cfg.num_hidden_layers;
    c.cache_sharers = atomic_load(&s->share->refs);
    c.batch_steps = s->share->batch_steps;
    c.batch_tokens = s->share->batch_tokens;
    c.batch_blob_reads = s->share->batch_blob_reads;
    memcpy(out, &c, out->struct_size);
    return SMOE_OK;
}

static smoe_status stats_union_sizes_claimed(const smoe_session *s, uint32_t *out, uint32_t cap) {
    if (!s || (!out && cap))
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_stats_union_sizes: NULL argument");
    uint32_t n = cap < s->cfg.num_hidden_layers ? cap : s->cfg.num_hidden_layers;
    memcpy(out, s->union_sizes, n * sizeof(uint32_t));
    return SMOE_OK;
}

static smoe_status stats_expert_counts_claimed(const smoe_session *s, uint32_t layer, uint64_t *counts, uint32_t cap) {
    if (!s || (!counts && cap))
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_stats_expert_counts: NULL argument");
    if (layer >= s->cfg.num_hidden_layers)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "layer %u: the model has %u", layer, s->cfg.num_hidden_layers);
    uint32_t n = cap < s->cfg.num_experts ? cap : s->cfg.num_experts;
    memcpy(counts, s->expert_counts + (size_t)layer * s->cfg.num_experts, n * sizeof(uint64_t));
    return SMOE_OK;
}

static smoe_status stats_reset_claimed(smoe_session *s) {
    if (!s)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "session is NULL");
    if (s->streamer)
        smoe_streamer_reset_stats(s->streamer);
    s->share->batch_steps = s->share->batch_tokens = s->share->batch_blob_reads = 0;
    s->prefill_s = s->decode_s = 0;
    s->tokens_prefilled = s->tokens_decoded = 0;
    memset(s->expert_counts, 0, (size_t)s->cfg.num_hidden_layers * s->cfg.num_experts * sizeof(uint64_t));
    return SMOE_OK;
}

static smoe_status cache_clear_claimed(smoe_session *s) {
    if (!s)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "session is NULL");
    if (s->streamer)
        smoe_streamer_clear(s->streamer);
    s->backend->cache_clear(s);
    return SMOE_OK;
}

/* The entry points of the calls above: each claims the session around its body (smoe.h, Threading). */
smoe_status smoe_session_read_kv(const smoe_session *s, uint32_t layer, uint32_t start, uint32_t n, float *k, float *v) {
    if (!s)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_session_read_kv: session is NULL");
    smoe_status st = smoe_session_enter(s, "smoe_session_read_kv");
    if (st != SMOE_OK)
        return st;
    return smoe_session_leave(s, session_read_kv_claimed(s, layer, start, n, k, v));
}

smoe_status smoe_stats(const smoe_session *s, smoe_counters *out) {
    if (!s)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_stats: session is NULL");
    smoe_status st = smoe_session_enter(s, "smoe_stats");
    if (st != SMOE_OK)
        return st;
    smoe_share_lock(s);
    st = stats_claimed(s, out);
    smoe_share_unlock(s);
    return smoe_session_leave(s, st);
}

smoe_status smoe_stats_union_sizes(const smoe_session *s, uint32_t *out, uint32_t cap) {
    if (!s)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_stats_union_sizes: session is NULL");
    smoe_status st = smoe_session_enter(s, "smoe_stats_union_sizes");
    if (st != SMOE_OK)
        return st;
    return smoe_session_leave(s, stats_union_sizes_claimed(s, out, cap));
}

smoe_status smoe_stats_expert_counts(const smoe_session *s, uint32_t layer, uint64_t *counts, uint32_t cap) {
    if (!s)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_stats_expert_counts: session is NULL");
    smoe_status st = smoe_session_enter(s, "smoe_stats_expert_counts");
    if (st != SMOE_OK)
        return st;
    return smoe_session_leave(s, stats_expert_counts_claimed(s, layer, counts, cap));
}

smoe_status smoe_stats_reset(smoe_session *s) {
    if (!s)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_stats_reset: session is NULL");
    smoe_status st = smoe_session_enter(s, "smoe_stats_reset");
    if (st != SMOE_OK)
        return st;
    smoe_share_lock(s);
    st = stats_reset_claimed(s);
    smoe_share_unlock(s);
    return smoe_session_leave(s, st);
}

smoe_status smoe_cache_clear(smoe_session *s) {
    if (!s)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_cache_clear: session is NULL");
    smoe_status st = smoe_session_enter(s, "smoe_cache_clear");
    if (st != SMOE_OK)
        return st;
    smoe_share_lock(s);
    st = cache_clear_claimed(s);
    smoe_share_unlock(s);
    return smoe_session_leave(s, st);
}

smoe_status smoe_device_stats(const smoe_session *s, smoe_device_counters *out) {
    if (!s || !out)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_device_stats: NULL argument");
    if (out->struct_size < offsetof(smoe_device_counters, uploads) || out->struct_size > sizeof *out)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_device_counters.struct_size %u is not a known size",
                         out->struct_size);
    smoe_status st = smoe_session_enter(s, "smoe_device_stats");
    if (st != SMOE_OK)
        return st;
    smoe_device_counters c;
    memset(&c, 0, sizeof c);
    c.device = s->params.device;
    if (s->backend->device_stats)
        s->backend->device_stats(s, &c);
    c.struct_size = out->struct_size;
    memcpy(out, &c, out->struct_size);
    return smoe_session_leave(s, SMOE_OK);
}

const char *smoe_session_backend(const smoe_session *s) {
    if (!s) {
        smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_session_backend: session is NULL");
        return "";
    }
    return s->backend->describe(s);
}
