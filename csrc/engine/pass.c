/* pass.c — a pass over n rows, its end, its logits and sampling; and the token-serial step.
 *
 * A pass is what every call that advances a session runs: the ids staged on the device at the
 * session's position, the embedding, every layer (layer.c), then the logits of the rows the caller
 * asked for. smoe_decode_step is the pass of one row; smoe_prefill_chunk (prefill.c) of a chunk;
 * smoe_decode_batch (batch.c) of one row per session, their FFNs together. Sampling lives in one
 * place, smoe_pass_sample, whichever call asked for an id.
 *
 * A backend that can record a whole decode step (a GPU whose expert cache holds every expert)
 * records the first step that runs without the host and replays it after: the same ops, so the
 * same bits; the routed ids of its layers come back at the pass's end, where they are counted as
 * the walk would have counted them. */
#include "engine/engine.h"
#include "prof.h"

#include <math.h>
#include <string.h>

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

/* The embedding and every layer of a staged pass of n rows; the layers' cancel checks. */
static smoe_status walk(smoe_session *s, uint32_t n) {
    smoe_status st = smoe_be_status(s, s->backend->embed(s->be, n));
    SMOE_PROF_LAP(SMOE_P_EMBED);
    s->moe.streaming = true; /* until a sparse layer finds every expert it needs retained */
    for (uint32_t l = 0; st == SMOE_OK && l < s->cfg.num_hidden_layers; l++) {
        /* position unchanged on failure: the pass's KV rows are rewritten next time */
        if ((st = smoe_session_check_cancel(s, l)) == SMOE_OK) st = smoe_layer(s, l, n, NULL);
    }
    /* every dense weight in and checked (a deferred lm_head: vault.c) before logits or the end */
    if (st == SMOE_OK) st = smoe_vault_dense_ready(s->vault);
    return st;
}

/* ------------------------------------------------------------- recurrent states (engine.h) */

smoe_status smoe_state_sync(smoe_session *s) {
    if (!s->recurrent) return SMOE_OK;
    /* a snapshot past the position holds ids that a rewind dropped (and that may be rewritten) */
    if (s->snap_pos != SMOE_NO_POS && s->snap_pos > s->pos) s->snap_pos = SMOE_NO_POS;
    if (s->state_pos == s->pos) return SMOE_OK;
    const smoe_backend *be = s->backend;
    uint32_t from = 0;
    smoe_status st;
    if (s->snap_pos != SMOE_NO_POS && s->snap_pos <= s->pos) {
        from = s->snap_pos;
        st = be->state(s->be, SMOE_STATE_RESTORE);
    } else {
        st = be->state(s->be, SMOE_STATE_RESET);
    }
    s->state_pos = SMOE_NO_POS;
    if ((st = smoe_be_status(s, st)) != SMOE_OK) return st;
    /* the stored ids from there to the position, a chunk at a time; the KV rows they rewrite get
     * the bits they hold (layer-major = token-serial), the expert reads are counted as any pass's */
    for (uint32_t at = from; at < s->pos;) {
        const uint32_t n = s->pos - at < s->params.chunk ? s->pos - at : s->params.chunk;
        if ((st = smoe_be_status(s, be->stage(s->be, s->history + at, n, at))) != SMOE_OK ||
            (st = walk(s, n)) != SMOE_OK || (st = smoe_pass_end(s, n, NULL, NULL)) != SMOE_OK) {
            for (uint32_t l = 0; l < s->cfg.num_hidden_layers; l++) s->moe.deferred[l] = false;
            return st;
        }
        at += n;
    }
    s->state_pos = s->pos;
    return SMOE_OK;
}

smoe_status smoe_state_advanced(smoe_session *s, bool snapshot) {
    if (!s->recurrent) return SMOE_OK;
    s->state_pos = s->pos;
    if (!snapshot) return SMOE_OK;
    s->snap_pos = SMOE_NO_POS;
    smoe_status st = smoe_be_status(s, s->backend->state(s->be, SMOE_STATE_SAVE));
    if (st == SMOE_OK) s->snap_pos = s->pos;
    return st;
}

smoe_status smoe_pass_end(smoe_session *s, uint32_t n, smoe_session *const *owners, uint32_t *union_sizes) {
    smoe_moe_state *m = &s->moe;
    const uint32_t L = s->cfg.num_hidden_layers, K = s->cfg.num_experts_per_tok;
    bool any = false;
    for (uint32_t l = 0; l < L; l++) any |= m->deferred[l];
    const smoe_status ready = smoe_vault_dense_ready(s->vault); /* a pass ends on checked weights alone */
    smoe_status st = SMOE_OK;
    if (s->backend->pass_end) st = smoe_be_status(s, s->backend->pass_end(s->be, n, any ? m->routed : NULL));
    if (st == SMOE_OK) st = ready;
    if (!any) return st;
    const uint32_t E = s->cfg.num_experts;
    for (uint32_t l = 0; l < L; l++) {
        if (!m->deferred[l]) continue;
        m->deferred[l] = false;
        const int32_t *ids = m->routed + (size_t)l * n * K;
        if (st != SMOE_OK) continue;
        for (uint32_t i = 0; i < n * K; i++)
            if (ids[i] < 0 || (uint32_t)ids[i] >= E) {
                s->broken = true;
                st = smoe_fail(SMOE_ERR_INTERNAL, "layer %u: routing gave expert %d, outside [0, %u) (the session "
                                                  "must be reset)", l, ids[i], E);
                break;
            }
        if (st != SMOE_OK) continue;
        const uint32_t used = smoe_moe_count(s, l, n, ids, owners);
        if (union_sizes) union_sizes[l] = used;
    }
    return st;
}

static bool any_finite(const float *x, uint32_t n) {
    for (uint32_t i = 0; i < n; i++)
        if (isfinite(x[i])) return true;
    return false;
}

smoe_status smoe_pass_logits(smoe_session *s, const uint32_t *rows, uint32_t m, uint32_t at, const float **out) {
    const smoe_layout *lay = s->lay;
    smoe_status st = smoe_be_status(s, s->backend->logits(s->be, lay->final_norm, lay->lm_head, rows, m));
    if (st == SMOE_OK) st = smoe_be_status(s, s->backend->logits_read(s->be, m, out));
    SMOE_PROF_LAP(SMOE_P_LM_HEAD);
    if (st != SMOE_OK) return st;
    /* Logits with no finite value (NaN or infinite scales in the vault, say) would make greedy
     * sampling return id 0 on every step, without a word: refuse them instead. */
    for (uint32_t i = 0; i < m; i++)
        if (!any_finite(*out + (size_t)i * s->cfg.vocab_size, s->cfg.vocab_size))
            return smoe_fail(SMOE_ERR_VAULT, "logits after position %u: every logit is NaN or infinite (non-finite "
                                             "weights? run `pysmoe verify`)", at + rows[i]);
    return SMOE_OK;
}

smoe_status smoe_pass_sample(smoe_session *s, void *b, uint32_t row, const float *logits, int32_t *next_id) {
    const smoe_backend *be = s->backend;
    smoe_sampler *sm = &s->sampler;
    const smoe_sampler_params *p = &sm->p;
    const uint32_t V = s->cfg.vocab_size;
    bool done = false;
    /* the device selects what it can (the penalties of counts and the mask stay here) */
    if (be->select && p->presence_penalty == 0.0f && p->frequency_penalty == 0.0f && !sm->masked) {
        uint32_t w = 0;
        if (p->repetition_penalty > 0.0f && p->repetition_penalty != 1.0f && p->repetition_window > 0)
            w = s->pos < p->repetition_window ? s->pos : p->repetition_window;
        smoe_candidates c;
        smoe_status st = smoe_be_status(s, be->select(b, row, p, s->history + s->pos - w, w, &c, &done));
        if (st != SMOE_OK) return st;
        if (done) {
            if (c.count == 0) {
                *next_id = c.best;
            } else {
                for (uint32_t j = 0; j < c.count; j++) {
                    s->sample_f[c.ids[j]] = c.vals[j];
                    s->sample_i[j] = c.ids[j];
                }
                *next_id = smoe_sample_top(sm, s->sample_f, s->sample_i, c.count, c.m);
            }
        }
    }
    if (!done) *next_id = smoe_sample(sm, logits, V, s->history, s->pos, s->sample_f, s->sample_i);
    smoe_sampler_observe(sm, *next_id);
    SMOE_PROF_LAP(SMOE_P_SAMPLE);
    return SMOE_OK;
}

/* One decode step's pass, recorded or replayed where the backend can. */
static smoe_status decode_pass(smoe_session *s) {
    const smoe_backend *be = s->backend;
    void *b = s->be;
    static const uint32_t row0 = 0;
    bool ran = false, recording = false;
    smoe_status st = SMOE_OK;
    if (be->replay && (st = smoe_be_status(s, be->replay(b, &ran))) != SMOE_OK) return st;
    if (!ran) {
        if (be->record_begin && (st = smoe_be_status(s, be->record_begin(b, &recording))) != SMOE_OK) return st;
        st = walk(s, 1);
        if (st == SMOE_OK)
            st = smoe_be_status(s, be->logits(b, s->lay->final_norm, s->lay->lm_head, &row0, 1));
        if (recording) {
            smoe_status e = smoe_be_status(s, be->record_end(b, st == SMOE_OK));
            if (st == SMOE_OK && (st = e) == SMOE_OK) st = smoe_be_status(s, be->replay(b, &ran));
            if (st == SMOE_OK && !ran) st = smoe_fail(SMOE_ERR_INTERNAL, "a recorded decode step did not replay");
        }
        if (st != SMOE_OK) {
            for (uint32_t l = 0; l < s->cfg.num_hidden_layers; l++) s->moe.deferred[l] = false;
            return st;
        }
    } else {
        /* a replay ran every layer on the device alone */
        for (uint32_t l = 0; l < s->cfg.num_hidden_layers; l++) s->moe.deferred[l] = s->lay->layers[l].sparse;
    }
    return smoe_pass_end(s, 1, NULL, NULL);
}

static smoe_status decode(smoe_session *s, int32_t id, float *logits, int32_t *next_id) {
    smoe_status st = smoe_check_tokens(s, &id, 1);
    if (st == SMOE_OK) st = smoe_state_sync(s);
    if (st != SMOE_OK)
        return st;
    if (s->recurrent) s->state_pos = SMOE_NO_POS; /* until the step is committed */
    double t0 = smoe_now();
    SMOE_PROF_START();
    const uint32_t pos = s->pos;
    const float *out;
    if ((st = smoe_be_status(s, s->backend->stage(s->be, &id, 1, pos))) != SMOE_OK ||
        (st = decode_pass(s)) != SMOE_OK ||
        (st = smoe_be_status(s, s->backend->logits_read(s->be, 1, &out))) != SMOE_OK)
        return st;
    SMOE_PROF_LAP(SMOE_P_LM_HEAD);
    if (!any_finite(out, s->cfg.vocab_size))
        return smoe_fail(SMOE_ERR_VAULT, "decode at position %u: every logit is NaN or infinite (non-finite weights? "
                                         "run `pysmoe verify`)", pos);
    s->history[pos] = id;
    smoe_session_set_pos(s, pos + 1);
    smoe_state_advanced(s, false);
    if (logits)
        memcpy(logits, out, s->cfg.vocab_size * sizeof(float));
    if (next_id && (st = smoe_pass_sample(s, s->be, 0, out, next_id)) != SMOE_OK)
        return st;
    s->tokens_decoded++;
    s->decode_s += smoe_now() - t0;
    return SMOE_OK;
}

smoe_status smoe_decode_step(smoe_session *s, int32_t id, float *logits, int32_t *next_id) {
    if (!s)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_decode_step: session is NULL");
    smoe_status st = smoe_session_enter(s, "smoe_decode_step");
    if (st != SMOE_OK)
        return st;
    smoe_share_lock(s);
    st = decode(s, id, logits, next_id);
    smoe_share_unlock(s);
    return smoe_session_leave(s, st);
}

/* ------------------------------------------------------------------- the layer-major prefill */

/* A prefill pass of n ids with the logits after rows[0..n_rows) into logits (n_rows × vocab) and
 * an id sampled after the last one into next_id (either may be NULL). */
static smoe_status prefill(smoe_session *s, const int32_t *ids, uint32_t n, const uint32_t *rows, uint32_t n_rows,
                           float *logits, int32_t *next_id) {
    if (n == 0 || n > s->params.chunk)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "prefill: n = %u, must be 1 to the session's chunk (%u)", n,
                         s->params.chunk);
    for (uint32_t i = 0; i < n_rows; i++)
        if (rows[i] >= n || (i > 0 && rows[i] <= rows[i - 1]))
            return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_prefill_rows: rows[%u] = %u: rows must increase strictly "
                                                   "and be below n = %u", i, rows[i], n);
    smoe_status st = smoe_check_tokens(s, ids, n);
    if (st == SMOE_OK) st = smoe_state_sync(s);
    if (st != SMOE_OK)
        return st;
    if (s->recurrent) s->state_pos = SMOE_NO_POS; /* until the pass is committed */
    double t0 = smoe_now();
    SMOE_PROF_START();
    const uint32_t pos = s->pos, V = s->cfg.vocab_size;
    if ((st = smoe_be_status(s, s->backend->stage(s->be, ids, n, pos))) != SMOE_OK)
        return st;
    memset(s->union_sizes, 0, s->cfg.num_hidden_layers * sizeof *s->union_sizes);
    s->moe.sizes_out = s->union_sizes;
    st = walk(s, n);
    s->moe.sizes_out = NULL;
    if (st != SMOE_OK) {
        for (uint32_t l = 0; l < s->cfg.num_hidden_layers; l++) s->moe.deferred[l] = false;
        return st;
    }
    if ((st = smoe_pass_end(s, n, NULL, s->union_sizes)) != SMOE_OK)
        return st;
    /* the logits the caller asked for, SMOE_LOGIT_ROWS at a time; next_id's from the last row's
     * alone (row 0 of the logits plane, where a device's selection reads them) */
    const float *out = NULL;
    bool have_last = false;
    for (uint32_t i = 0; i < n_rows; i += SMOE_LOGIT_ROWS) {
        const uint32_t m = n_rows - i < SMOE_LOGIT_ROWS ? n_rows - i : SMOE_LOGIT_ROWS;
        if ((st = smoe_pass_logits(s, rows + i, m, pos, &out)) != SMOE_OK)
            return st;
        memcpy(logits + (size_t)i * V, out, (size_t)m * V * sizeof(float));
        have_last = m == 1 && rows[i] == n - 1;
    }
    if (next_id && !have_last) {
        const uint32_t last = n - 1;
        if ((st = smoe_pass_logits(s, &last, 1, pos, &out)) != SMOE_OK)
            return st;
    }
    for (uint32_t i = 0; i < n; i++)
        s->history[pos + i] = ids[i];
    smoe_session_set_pos(s, pos + n);
    if ((st = smoe_state_advanced(s, true)) != SMOE_OK)
        return st;
    if (next_id && (st = smoe_pass_sample(s, s->be, 0, out, next_id)) != SMOE_OK)
        return st;
    s->tokens_prefilled += n;
    s->prefill_s += smoe_now() - t0;
    return SMOE_OK;
}

smoe_status smoe_prefill_rows(smoe_session *s, const int32_t *ids, uint32_t n, const uint32_t *rows, uint32_t n_rows,
                              float *logits, int32_t *next_id) {
    if (!s || (!ids && n) || (n_rows && (!rows || !logits)))
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_prefill_rows: NULL argument");
    smoe_status st = smoe_session_enter(s, "smoe_prefill_rows");
    if (st != SMOE_OK)
        return st;
    smoe_share_lock(s);
    st = prefill(s, ids, n, rows, n_rows, logits, next_id);
    smoe_share_unlock(s);
    return smoe_session_leave(s, st);
}

smoe_status smoe_prefill_chunk(smoe_session *s, const int32_t *ids, uint32_t n, float *logits, int32_t *next_id) {
    if (!s || (!ids && n))
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_prefill_chunk: NULL argument");
    smoe_status st = smoe_session_enter(s, "smoe_prefill_chunk");
    if (st != SMOE_OK)
        return st;
    const uint32_t last = n ? n - 1 : 0;
    smoe_share_lock(s);
    st = prefill(s, ids, n, &last, logits ? 1 : 0, logits, next_id);
    smoe_share_unlock(s);
    return smoe_session_leave(s, st);
}
