/* backend_cpu.c — the CPU backend: the kernels of kernels.h on the session's worker pool, in host
 * memory (backend.h). Its blocks are layer.c's, unchanged; the expert tiers are the streamer's. */
#include "session.h"
#include "prof.h"

#include <stdio.h>
#include <string.h>

static smoe_status cpu_init(smoe_session *s) {
    (void)s;
    return SMOE_OK;
}

static void cpu_free(smoe_session *s) { (void)s; }

static smoe_status cpu_embed(smoe_session *s, const int32_t *ids, uint32_t n) {
    smoe_embed(s, ids, n);
    SMOE_PROF_LAP(SMOE_P_EMBED);
    return SMOE_OK;
}

static smoe_status cpu_attention(smoe_session *s, uint32_t l, uint32_t pos0, uint32_t n) {
    smoe_attention_block(s, l, pos0, n);
    return SMOE_OK;
}

static smoe_status cpu_logits(smoe_session *s) {
    smoe_rmsnorm(s->xn, s->x, s->lay->final_norm, s->cfg.hidden_size, s->cfg.rms_norm_eps);
    SMOE_PROF_LAP(SMOE_P_NORM);
    smoe_linear(s, SMOE_P_LM_HEAD, s->lay->lm_head, s->lay->lm_head->data, s->xn, 1, s->logits);
    return SMOE_OK;
}

static smoe_status cpu_read_kv(const smoe_session *s, uint32_t layer, uint32_t start, uint32_t n, float *k, float *v) {
    size_t len = (size_t)n * s->kv_dim;
    if (k)
        smoe_kv_load(k, smoe_kv_row(s, s->k_cache, layer, start), len, s->params.kv_dtype);
    if (v)
        smoe_kv_load(v, smoe_kv_row(s, s->v_cache, layer, start), len, s->params.kv_dtype);
    return SMOE_OK;
}

static void cpu_cache_clear(smoe_session *s) { (void)s; }

static const char *cpu_describe(const smoe_session *s) {
    (void)s;
    static char line[64];
    static _Atomic int made;
    if (!atomic_load(&made)) { /* the same text from any thread that races here */
        snprintf(line, sizeof line, "cpu: %s", smoe_kernels());
        atomic_store(&made, 1);
    }
    return line;
}

const smoe_backend smoe_backend_cpu = {
    .name = "cpu",
    .init = cpu_init,
    .free = cpu_free,
    .embed = cpu_embed,
    .attention = cpu_attention,
    .ffn = smoe_ffn_block,
    .logits = cpu_logits,
    .read_kv = cpu_read_kv,
    .cache_clear = cpu_cache_clear,
    .describe = cpu_describe,
    .device_stats = NULL,
};
