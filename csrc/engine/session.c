/* session.c — creating and freeing sessions and their shares, options, reset and rewind.
 *
 * Everything a session will ever use is allocated here, sized by the params: its host planes
 * (history, RoPE tables, the sampler's and the MoE step's bookkeeping), its backend state (the
 * activation planes for `chunk` tokens and the KV cache, on the device) and — for a session made
 * alone — its share: the streamer's slots and I/O threads, and the backend's share (the device,
 * its dense weights, its expert cache, its worker pool). Prefill and decode then never allocate.
 *
 * A session is made in four steps, undone in mirror order by smoe_session_free (which takes what
 * a failed step left): the options (read_params, check_params), the share (share_new, or the
 * sibling's), the engine's planes (engine_planes), the backend's (session_new of backend.h). */
#include "engine/engine.h"
#include "cpu/cpu.h"

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
    p.kv_dtype = SMOE_KV_F32;
    p.device = SMOE_DEVICE_CPU;
    p.cache_bytes = 0;
    p.coalesce_bytes = 16u << 20; /* bench/RESULTS.md "Coalesced reads" */
    p.direct_io = true;
    p.verify_blobs = true; /* bench/RESULTS.md "Per-read blob checksums": cheap next to the read */
    p.float_activations = false;
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
    p.presence_penalty = 0.0f;
    p.frequency_penalty = 0.0f;
    p.seed = 0;
    return p;
}

/* ------------------------------------------------------------------------------ options */

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

static smoe_status check_params(smoe_session_params *p, const smoe_config *c) {
    if (p->context == 0 || p->chunk == 0 || p->threads == 0 || p->io_threads == 0)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "context, chunk, threads and io_threads must be at least 1");
    if ((unsigned)p->kv_dtype > SMOE_KV_F16)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "kv_dtype %u is not a smoe_kv_dtype (0 f32, 1 bf16, 2 f16)",
                         (unsigned)p->kv_dtype);
    if (p->context > c->max_position_embeddings)
        p->context = c->max_position_embeddings;
    if (p->chunk > 65536 || p->threads > 256 || p->io_threads > 256)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "chunk ≤ 65536, threads ≤ 256 and io_threads ≤ 256 (got %u, %u, %u)",
                         p->chunk, p->threads, p->io_threads);
    return SMOE_OK;
}

/* -------------------------------------------------------------------------------- share */

/* Lets go of one session's hold on a share; the last one frees it (the backend's first: it may
 * hold the streamer's slots pinned). */
static void share_drop(smoe_share *sh) {
    if (!sh || atomic_fetch_sub(&sh->refs, 1) != 1)
        return;
    if (sh->be)
        sh->backend->share_free(sh->be);
    smoe_streamer_free(sh->streamer);
    pthread_mutex_destroy(&sh->mu);
    smoe_free(sh);
}

/* The streamer of vault's blobs for the budget of p (NULL out when the model has no sparse layer). */
static smoe_status streamer_new(smoe_vault *vault, const smoe_session_params *p, smoe_streamer **out) {
    const smoe_config *c = &vault->lay.cfg;
    *out = NULL;
    if (c->num_sparse_layers == 0)
        return SMOE_OK;
    /* The budget in whole blobs; never fewer than one token's experts of one layer, never more
     * than there are blobs. */
    uint64_t total = (uint64_t)c->num_sparse_layers * c->num_experts;
    uint64_t slots = p->cache_bytes / vault->lay.blob_bytes;
    if (slots < c->num_experts_per_tok)
        slots = c->num_experts_per_tok;
    if (slots > total)
        slots = total;
    /* A vault.bin rewritten in place since the vault opened it would mix the loaded tables and
     * dense weights with new blobs. */
    smoe_status st = smoe_vault_check_unchanged(vault);
    if (st != SMOE_OK)
        return st;
    smoe_streamer_params sp = {
        .path = vault->path,
        .fd = vault->fd,
        .blob_bytes = vault->lay.blob_bytes,
        .layer_bytes = vault->lay.layer_blob_bytes,
        .blob_offset = vault->lay.blob_offset,
        .blob_crc = vault->lay.blob_crc,
        .n_layers = c->num_hidden_layers,
        .n_experts = c->num_experts,
        .n_sparse_layers = c->num_sparse_layers,
        .n_slots = (uint32_t)slots,
        .io_threads = p->io_threads,
        .direct_io = p->direct_io,
        .verify = p->verify_blobs,
        .coalesce_bytes = p->coalesce_bytes,
    };
    return smoe_streamer_new(&sp, out);
}

static smoe_status share_new(smoe_vault *vault, const smoe_session_params *p, const smoe_backend *backend,
                             smoe_share **out) {
    smoe_share *sh = smoe_alloc(sizeof *sh, 64);
    if (!sh)
        return smoe_fail(SMOE_ERR_NOMEM, "out of memory for the session");
    if (pthread_mutex_init(&sh->mu, NULL) != 0) {
        smoe_free(sh);
        return smoe_fail(SMOE_ERR_NOMEM, "could not create the session's lock");
    }
    atomic_init(&sh->refs, 1);
    sh->backend = backend;
    sh->params = *p;
    smoe_status st = streamer_new(vault, p, &sh->streamer);
    if (st == SMOE_OK) {
        const smoe_be_share_params bp = {
            .lay = &vault->lay,
            .dense = vault->dense,
            .vault = vault,
            .threads = p->threads,
            .device_cache_bytes = p->gpu_cache_bytes,
            .streamer = sh->streamer,
        };
        st = backend->share_new(&bp, &sh->be);
    }
    if (st != SMOE_OK) {
        share_drop(sh);
        return st;
    }
    *out = sh;
    return SMOE_OK;
}

/* -------------------------------------------------------------------------------- planes */

/* One host plane: counted in plane_bytes, 64-byte aligned, zeroed. */
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

/* YaRN's frequency i (of d/2) from the plain one, as transformers' _compute_yarn_parameters:
 * interpolated (÷ factor) below the correction range of dimensions, kept above it, a linear ramp
 * between; the range from beta_fast and beta_slow rotations over original_max positions. */
static float yarn_inv_freq(const smoe_recipe *r, float pos_freq, uint32_t i, uint32_t d, double theta) {
    const double two_pi = 6.283185307179586;
    double low = d * log(r->yarn_original_max / (r->yarn_beta_fast * two_pi)) / (2 * log(theta));
    double high = d * log(r->yarn_original_max / (r->yarn_beta_slow * two_pi)) / (2 * log(theta));
    if (r->yarn_truncate) {
        low = floor(low);
        high = ceil(high);
    }
    low = low > 0 ? low : 0;
    high = high < d - 1 ? high : d - 1;
    if (low == high) high += 0.001; /* transformers' guard against a zero-width ramp */
    float ramp = (float)(((float)i - (float)low) / (float)(high - low));
    ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
    const float extra = 1.0f - ramp; /* the share of the unscaled frequency */
    const float inv_extra = 1.0f / pos_freq, inv_inter = 1.0f / ((float)r->yarn_factor * pos_freq);
    return inv_inter * (1.0f - extra) + inv_extra * extra;
}

static void build_rope(smoe_session *s) {
    /* As transformers computes it, in float32: inv_freq = 1 / θ^(2i/d) (YaRN's mix of it with
     * inv_freq / factor when the recipe says), angle = pos · inv_freq, over the d = rotary_dim
     * leading dims of a head (all of it but for partial RoPE); YaRN's cos and sin are scaled by its
     * attention factor. */
    const smoe_recipe *r = &s->recipe;
    const bool yarn = r->yarn_factor > 1.0;
    const float scale = yarn ? (float)r->yarn_attention_factor : 1.0f;
    uint32_t d = s->lay->mp.rotary_dim, half = d / 2;
    for (uint32_t i = 0; i < half; i++) {
        const float pos_freq = powf((float)s->cfg.rope_theta, (float)(2 * i) / (float)d);
        const float inv = yarn ? yarn_inv_freq(r, pos_freq, i, d, s->cfg.rope_theta) : 1.0f / pos_freq;
        for (uint32_t p = 0; p < s->params.context; p++) {
            float a = (float)p * inv;
            float c = cosf(a), sn = sinf(a);
            s->rope_cos[(size_t)p * half + i] = yarn ? c * scale : c;
            s->rope_sin[(size_t)p * half + i] = yarn ? sn * scale : sn;
        }
    }
}

/* The family's recipe from the vault's parameters. */
static void fill_recipe(smoe_session *s) {
    const smoe_model_params *m = &s->lay->mp;
    s->recipe = (smoe_recipe){
        .route = (smoe_router_kind)m->router_kind,
        .act = {SMOE_ACT_SILU, 0, 0},
        .window = m->sliding_window,
        .yarn_factor = m->yarn_factor,
        .yarn_original_max = m->yarn_original_max,
        .yarn_beta_fast = m->yarn_beta_fast,
        .yarn_beta_slow = m->yarn_beta_slow,
        .yarn_attention_factor = m->yarn_attention_factor,
        .yarn_truncate = m->yarn_truncate != 0,
    };
    if (m->family == SMOE_FAMILY_GPT_OSS) s->recipe.act = (smoe_act){SMOE_ACT_SWIGLU_CLAMPED, m->swiglu_alpha, m->swiglu_limit};
}

/* The engine's own host planes: history, RoPE tables, the sampler's and the MoE step's. */
static smoe_status engine_planes(smoe_session *s) {
    const smoe_config *c = &s->cfg;
    const size_t C = s->params.chunk, E = c->num_experts, K = c->num_experts_per_tok, L = c->num_hidden_layers;
    const size_t V = c->vocab_size;
    smoe_moe_state *m = &s->moe;
    bool ok = true;
    s->history = plane(s, s->params.context, sizeof(int32_t), &ok);
    s->rope_cos = plane(s, (size_t)s->params.context * (s->lay->mp.rotary_dim / 2), sizeof(float), &ok);
    s->rope_sin = plane(s, (size_t)s->params.context * (s->lay->mp.rotary_dim / 2), sizeof(float), &ok);
    s->sample_f = plane(s, V, sizeof(float), &ok);
    s->sample_i = plane(s, V, sizeof(int32_t), &ok);
    s->sampler.counts = plane(s, V, sizeof(uint32_t), &ok);
    s->sampler.drawn = plane(s, V, sizeof(int32_t), &ok);
    s->sampler.mask = plane(s, (V + 31) / 32, sizeof(uint32_t), &ok);
    m->ids = plane(s, C * K, sizeof(int32_t), &ok);
    m->pos_of = plane(s, E, sizeof(int32_t), &ok);
    m->expert = plane(s, E, sizeof(int32_t), &ok);
    m->start = plane(s, E, sizeof(uint32_t), &ok);
    m->count = plane(s, E, sizeof(uint32_t), &ok);
    m->rows = plane(s, C * K, sizeof(uint32_t), &ok);
    m->w = plane(s, E, sizeof(void *), &ok);
    m->slot = plane(s, E, sizeof(int32_t), &ok);
    m->state = plane(s, E, 1, &ok);
    m->pending = plane(s, E, sizeof(uint32_t), &ok);
    m->pending_slots = plane(s, E, sizeof(int), &ok);
    m->batch = plane(s, E, sizeof(uint32_t), &ok);
    m->held = plane(s, E, sizeof(int), &ok);
    m->routed = plane(s, L * C * K, sizeof(int32_t), &ok);
    m->deferred = plane(s, L, sizeof(bool), &ok);
    s->union_sizes = plane(s, L, sizeof(uint32_t), &ok);
    s->expert_counts = plane(s, L * E, sizeof(uint64_t), &ok);
    s->row_be = plane(s, C, sizeof(void *), &ok);
    s->linear_index = plane(s, L, sizeof(int32_t), &ok);
    if (!ok)
        return smoe_fail(SMOE_ERR_NOMEM, "out of memory for the session's planes (%llu bytes)",
                         (unsigned long long)s->plane_bytes);
    for (size_t e = 0; e < E; e++) m->pos_of[e] = -1;
    uint32_t n_linear = 0;
    for (size_t l = 0; l < L; l++)
        s->linear_index[l] = s->lay->layers[l].attn == SMOE_ATTN_LINEAR ? (int32_t)n_linear++ : -1;
    s->recurrent = n_linear > 0;
    s->state_pos = 0; /* the backend's states start zeroed: position 0's */
    s->snap_pos = SMOE_NO_POS;
    build_rope(s);
    smoe_sampler_params sdef = smoe_sampler_default_params();
    smoe_sampler_init(&s->sampler, &sdef);
    return SMOE_OK;
}

void smoe_session_free(smoe_session *s) {
    if (!s)
        return;
    if (s->pid != smoe_process_id())
        return; /* a fork's child: freeing would wait for threads that are not here; its copy goes with it */
    if (s->be)
        s->backend->session_free(s->be); /* first: it may hold the share's device and slots */
    share_drop(s->share);
    smoe_moe_state *m = &s->moe;
    void *bufs[] = {s->history, s->rope_cos, s->rope_sin, s->sample_f, s->sample_i, s->sampler.counts,
                    s->sampler.drawn, s->sampler.mask, m->ids, m->pos_of, m->expert, m->start, m->count, m->rows, (void *)m->w,
                    m->slot, m->state, m->pending, m->pending_slots, m->batch, m->held, m->routed, m->deferred,
                    s->union_sizes, s->expert_counts, (void *)s->row_be, s->linear_index};
    for (size_t i = sizeof bufs / sizeof bufs[0]; i-- > 0;)
        smoe_free(bufs[i]);
    smoe_free(s);
}

/* A new session of vault; with sibling, holding sibling's share (whose params then stand for
 * threads, io_threads, the caches, direct_io, verify_blobs and the device) instead of making its
 * own. */
static smoe_status session_new(smoe_vault *vault, const smoe_session_params *params, smoe_session *sibling,
                               smoe_session **out) {
    smoe_status isa = smoe_cpu_check(); /* first: before any code that may use AVX2 (cpu/cpu.c) */
    if (isa != SMOE_OK) {
        if (out) *out = NULL;
        return isa;
    }
    if (!out)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_session_new: out is NULL");
    *out = NULL;
    if (!vault)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_session_new: vault is NULL");
    if (sibling && sibling->pid != smoe_process_id())
        return smoe_fail(SMOE_ERR_INVALID_ARG,
                         "smoe_session_new_shared: the sibling was made in process %d and this is process %d, a fork "
                         "of it: its worker threads and cache readers are not here; make a session from the vault",
                         sibling->pid, smoe_process_id());
    if (vault->pid != smoe_process_id() && atomic_load(&vault->dense_state) == 0)
        return smoe_vault_dense_ready(vault); /* forked while the vault still read in a thread: says so */
    smoe_session_params p;
    smoe_status st = read_params(params, &p);
    if (st != SMOE_OK)
        return st;
    if (sibling) {
        const smoe_session_params *sp = &sibling->share->params;
        p.threads = sp->threads;
        p.io_threads = sp->io_threads;
        p.cache_bytes = sp->cache_bytes;
        p.coalesce_bytes = sp->coalesce_bytes;
        p.direct_io = sp->direct_io;
        p.verify_blobs = sp->verify_blobs;
        p.device = sp->device;
        p.gpu_cache_bytes = sp->gpu_cache_bytes;
    }
    const smoe_config *c = &vault->lay.cfg;
    if ((st = check_params(&p, c)) != SMOE_OK)
        return st;
    const smoe_backend *backend;
    if ((st = smoe_backend_for(p.device, &backend)) != SMOE_OK)
        return st;
    if ((st = smoe_recipe_check(&vault->lay, backend)) != SMOE_OK)
        return st;

    smoe_session *s = smoe_alloc(sizeof *s, 64);
    if (!s)
        return smoe_fail(SMOE_ERR_NOMEM, "out of memory for the session");
    atomic_init(&s->busy, 0);
    atomic_init(&s->cancel, 0);
    s->pid = smoe_process_id();
    s->vault = vault;
    s->lay = &vault->lay;
    s->cfg = *c;
    s->params = p;
    fill_recipe(s);
    s->backend = backend;
    if (sibling) {
        atomic_fetch_add(&sibling->share->refs, 1);
        s->share = sibling->share;
    } else if ((st = share_new(vault, &p, backend, &s->share)) != SMOE_OK) {
        smoe_free(s);
        return st;
    }
    s->streamer = s->share->streamer;
    if ((st = engine_planes(s)) == SMOE_OK) {
        const smoe_model_params *mp = &s->lay->mp;
        uint32_t n_linear = 0;
        for (uint32_t l = 0; l < c->num_hidden_layers; l++) n_linear += s->linear_index[l] >= 0;
        const smoe_be_session_params bp = {
            .linear = n_linear ? (smoe_linear_shape){mp->linear_k_heads, mp->linear_v_heads, mp->linear_k_dim,
                                                     mp->linear_v_dim, mp->linear_conv_kernel, mp->linear_v_tiled}
                               : (smoe_linear_shape){0},
            .n_linear = n_linear,
            .linear_index = s->linear_index,
            .context = p.context,
            .chunk = p.chunk,
            .kv_dtype = p.kv_dtype,
            .float_activations = p.float_activations,
            .rope_cos = s->rope_cos,
            .rope_sin = s->rope_sin,
            .act = s->recipe.act,
        };
        uint64_t planes = 0;
        /* The share's lock: a backend's session may touch the share's device (an upload). */
        smoe_share_lock(s);
        st = backend->session_new(s->share->be, &bp, &s->be, &planes, &s->kv_bytes);
        smoe_share_unlock(s);
        s->plane_bytes += planes;
    }
    if (st != SMOE_OK) {
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

/* ------------------------------------------------------------------------ position, sampler */

smoe_status smoe_session_reset(smoe_session *s) {
    if (!s)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "session is NULL");
    smoe_status st = smoe_session_enter(s, "smoe_session_reset");
    if (st != SMOE_OK)
        return st;
    smoe_session_set_pos(s, 0);
    s->broken = false;
    if (s->recurrent) s->state_pos = SMOE_NO_POS; /* the next pass starts from zeroed states */
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
        !(p.repetition_penalty > 0.0f) || !(p.presence_penalty >= -2.0f && p.presence_penalty <= 2.0f) ||
        !(p.frequency_penalty >= -2.0f && p.frequency_penalty <= 2.0f))
        st = smoe_fail(SMOE_ERR_INVALID_ARG,
                       "sampler: temperature ≥ 0, 0 < top_p ≤ 1, 0 ≤ min_p ≤ 1, repetition_penalty > 0, presence and "
                       "frequency penalties in [−2, 2] (got %g, %g, %g, %g, %g, %g)",
                       p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
                       p.frequency_penalty);
    else
        smoe_sampler_init(&s->sampler, &p);
    return smoe_session_leave(s, st);
}

smoe_status smoe_session_set_mask(smoe_session *s, const uint32_t *bitmask, uint32_t n_words) {
    if (!s)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_session_set_mask: NULL session");
    const uint32_t V = s->cfg.vocab_size, words = (V + 31) / 32;
    if (bitmask && n_words != words)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_session_set_mask: %u words; a vocabulary of %u ids needs %u",
                         n_words, V, words);
    bool any = false; /* an id below vocab_size allowed: bits past it are ignored */
    for (uint32_t w = 0; bitmask && w < words && !any; w++)
        any = (V - w * 32 >= 32 ? bitmask[w] : bitmask[w] & ((1u << (V - w * 32)) - 1u)) != 0;
    if (bitmask && !any)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_session_set_mask: the mask allows no id");
    smoe_status st = smoe_session_enter(s, "smoe_session_set_mask");
    if (st != SMOE_OK)
        return st;
    if (bitmask)
        memcpy(s->sampler.mask, bitmask, words * sizeof(uint32_t));
    s->sampler.masked = bitmask != NULL;
    return smoe_session_leave(s, SMOE_OK);
}
