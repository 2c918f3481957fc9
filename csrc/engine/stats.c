/* stats.c — what a session reports: counters, union sizes, expert counts, its device's; and the
 * calls that clear the caches or read the KV cache. Each claims the session around its body
 * (smoe.h, Threading); those that read the share's caches also hold the share's lock. */
#include "engine/engine.h"
#include "smoe_testing.h"

#include <string.h>

static smoe_status session_read_kv_claimed(const smoe_session *s, uint32_t layer, uint32_t start, uint32_t n, float *k,
                                 float *v) {
    if (!s)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "session is NULL");
    if (layer >= s->cfg.num_hidden_layers || (uint64_t)start + n > s->pos)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "KV rows [%u, %u) of layer %u: the cache holds %u positions of %u layers",
                         start, start + n, layer, s->pos, s->cfg.num_hidden_layers);
    if (s->linear_index[layer] >= 0) { /* a linear-attention layer keeps a state, no KV rows */
        const size_t len = (size_t)n * s->cfg.num_key_value_heads * s->cfg.head_dim;
        if (k) memset(k, 0, len * sizeof *k);
        if (v) memset(v, 0, len * sizeof *v);
        return SMOE_OK;
    }
    return smoe_be_status((smoe_session *)s, s->backend->read_kv(s->be, layer, start, n, k, v));
}

static smoe_status stats_claimed(const smoe_session *s, smoe_counters *out) {
    if (!s || !out)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_stats: NULL argument");
    if (out->struct_size < offsetof(smoe_counters, batch_steps) || out->struct_size > sizeof *out)
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
    c.dense_bytes = smoe_vault_resident_bytes(s->vault);
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
    if (s->backend->tier_clear)
        s->backend->tier_clear(s->be);
    return SMOE_OK;
}

/* The entry points of the calls above: each claims the session around its body (smoe.h, Threading). */
smoe_status smoe_session_read_kv(const smoe_session *s, uint32_t layer, uint32_t start, uint32_t n, float *k, float *v) {
    if (!s)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_session_read_kv: session is NULL");
    smoe_status st = smoe_session_enter(s, "smoe_session_read_kv");
    if (st != SMOE_OK)
        return st;
    smoe_share_lock(s); /* a device's copies run on the share's streams */
    st = session_read_kv_claimed(s, layer, start, n, k, v);
    smoe_share_unlock(s);
    return smoe_session_leave(s, st);
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
    if (s->backend->device_stats) {
        smoe_share_lock(s); /* the device's counters are the share's */
        s->backend->device_stats(s->be, &c);
        smoe_share_unlock(s);
    }
    c.struct_size = out->struct_size;
    memcpy(out, &c, out->struct_size);
    return smoe_session_leave(s, SMOE_OK);
}

const char *smoe_session_backend(const smoe_session *s) {
    if (!s) {
        smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_session_backend: session is NULL");
        return "";
    }
    return s->backend->describe(s->be);
}
