/* decode.c — the token-serial step: one token through every layer, then logits and sampling.
 *
 * The prompt's last token also comes through here (after smoe_prefill_chunk has walked the
 * rest), so sampling lives in one place. */
#include "session.h"
#include "prof.h"

#include <math.h>
#include <string.h>

static bool any_finite(const float *x, uint32_t n) {
    for (uint32_t i = 0; i < n; i++)
        if (isfinite(x[i])) return true;
    return false;
}

static smoe_status decode(smoe_session *s, int32_t id, float *logits, int32_t *next_id) {
    smoe_status st = smoe_check_tokens(s, &id, 1);
    if (st != SMOE_OK)
        return st;
    double t0 = smoe_now();
    SMOE_PROF_START();
    const smoe_config *c = &s->cfg;
    uint32_t pos = s->pos;

    const smoe_backend *be = s->backend;
    bool ran = false;
    /* a backend that runs the whole step at once (a recorded graph) is asked before layer 0 */
    if (be->decode_step) {
        if ((st = smoe_session_check_cancel(s, 0)) != SMOE_OK || (st = be->decode_step(s, id, &ran)) != SMOE_OK)
            return st;
    }
    if (!ran) {
        if ((st = be->embed(s, &id, 1)) != SMOE_OK)
            return st;
        for (uint32_t l = 0; l < c->num_hidden_layers; l++) {
            /* position unchanged on failure: row pos of the KV cache is rewritten next time */
            uint32_t used;
            if ((st = smoe_session_check_cancel(s, l)) != SMOE_OK)
                return st;
            if ((st = be->attention(s, l, pos, 1)) != SMOE_OK || (st = be->ffn(s, l, 1, &used)) != SMOE_OK)
                return st;
        }
        if ((st = be->logits(s)) != SMOE_OK)
            return st;
    }
    if (be->settle && (st = be->settle(s, NULL)) != SMOE_OK)
        return st;
    /* Logits with no finite value (NaN or infinite scales in the vault, say) would make greedy
     * sampling return id 0 on every step, without a word: refuse them instead. */
    if (!any_finite(s->logits, c->vocab_size))
        return smoe_fail(SMOE_ERR_VAULT, "decode at position %u: every logit is NaN or infinite (non-finite weights? "
                                         "run `pysmoe verify`)", pos);

    s->history[pos] = id;
    smoe_session_set_pos(s, pos + 1);
    if (logits)
        memcpy(logits, s->logits, c->vocab_size * sizeof(float));
    if (next_id) {
        bool done = false;
        if (be->sample && (st = be->sample(s, next_id, &done)) != SMOE_OK)
            return st;
        if (!done)
            *next_id = smoe_sample(&s->sampler, s->logits, c->vocab_size, s->history, s->pos, s->sample_f,
                                   s->sample_i);
    }
    s->tokens_decoded++;
    s->decode_s += smoe_now() - t0;
    SMOE_PROF_LAP(SMOE_P_SAMPLE);
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
