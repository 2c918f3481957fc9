/* batch.c — one decode step of several sessions in one layer-major pass, on any backend.
 *
 * n requests decoding at once each need, per layer, their top-k experts and every dense weight.
 * Stepping them one after another reads up to n·k blobs and the dense weights n times per layer
 * (and, on a GPU, launches every kernel n times); stepping them together reads the layer's union of
 * their experts once and applies each to every session routed to it, as layer-major prefill does
 * for the tokens of a chunk, and each dense product runs once over all of them. The sessions share
 * one retention cache and device (smoe_session_new_shared), so "once" is once for all of them.
 *
 * Every row lives in one session's planes, the "lead" (the one with the largest chunk, which
 * bounds n): the embeddings, the norms and products of every layer run there over n rows, as a
 * prefill chunk's do; only attention is per session: row t's Q, K and V go to session t's KV cache
 * at session t's position and it attends over that cache alone (the backend's attend op with the
 * batch's members). The FFN is the MoE step of moe.c over the n rows, each row's routing counted
 * for its own session; the logits come out of the lead, SMOE_LOGIT_ROWS rows at a time. Every
 * value a session sees is therefore the value smoe_decode_step alone would give it (backend.h's
 * rule: no op's value for a row depends on the other rows): its logits, sampled id and KV rows are
 * bit-identical, whatever the batch's other members and their order.
 *
 * Nothing is committed (position, history, sampler, counters) until every session's logits
 * passed their check: a failure leaves every session of the batch where it was. */
#include "engine/engine.h"

#include <math.h>

#include <string.h>

/* Arguments a batch needs before anything is claimed; *failed names the session at fault. */
static smoe_status check_batch(smoe_session *const *ss, const int32_t *ids, uint32_t n, int32_t *failed) {
    if (!ss || !ids || n == 0)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_decode_batch: %s", n == 0 ? "n is 0" : "NULL argument");
    for (uint32_t i = 0; i < n; i++) {
        *failed = (int32_t)i;
        if (!ss[i])
            return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_decode_batch: session %u is NULL", i);
        if (ss[i]->share != ss[0]->share)
            return smoe_fail(SMOE_ERR_INVALID_ARG,
                             "smoe_decode_batch: session %u does not share session 0's cache (smoe_session_new_shared)",
                             i);
        if (ss[i]->params.float_activations != ss[0]->params.float_activations)
            return smoe_fail(SMOE_ERR_INVALID_ARG,
                             "smoe_decode_batch: session %u's float_activations differs from session 0's", i);
        for (uint32_t j = 0; j < i; j++)
            if (ss[j] == ss[i])
                return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_decode_batch: session %u is session %u again", i, j);
    }
    *failed = -1;
    return SMOE_OK;
}

static smoe_status decode_batch(smoe_session *const *ss, const int32_t *ids, uint32_t n, float *logits,
                                int32_t *next_ids, int32_t *failed) {
    smoe_status st;
    uint32_t li = 0;
    for (uint32_t i = 0; i < n; i++) {
        *failed = (int32_t)i;
        if ((st = smoe_check_tokens(ss[i], &ids[i], 1)) != SMOE_OK || (st = smoe_state_sync(ss[i])) != SMOE_OK)
            return st;
        if (ss[i]->params.chunk > ss[li]->params.chunk)
            li = i;
    }
    *failed = -1;
    for (uint32_t i = 0; i < n; i++) /* until the step is committed */
        if (ss[i]->recurrent) ss[i]->state_pos = SMOE_NO_POS;
    smoe_session *lead = ss[li];
    const smoe_backend *be = lead->backend;
    if (n > lead->params.chunk)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_decode_batch: %u sessions, more than the largest chunk (%u)", n,
                         lead->params.chunk);
    double t0 = smoe_now();
    const smoe_config *c = &lead->cfg;
    const uint32_t L = c->num_hidden_layers, V = c->vocab_size;
    smoe_streamer_stats io0 = {0}, io1 = {0};
    if (lead->streamer)
        smoe_streamer_get_stats(lead->streamer, &io0);

    /* every row in the lead's planes (their embeddings there); each session staged at its position */
    for (uint32_t i = 0; i < n; i++) {
        *failed = (int32_t)i;
        smoe_session *s = ss[i];
        lead->row_be[i] = s->be;
        if (i != li && (st = smoe_be_status(s, be->stage(s->be, &ids[i], 1, s->pos))) != SMOE_OK)
            return st;
    }
    *failed = (int32_t)li;
    if ((st = smoe_be_status(lead, be->stage(lead->be, ids, n, lead->pos))) != SMOE_OK ||
        (st = smoe_be_status(lead, be->embed(lead->be, n))) != SMOE_OK)
        return st;
    for (uint32_t l = 0; l < L; l++) {
        /* positions unchanged on failure: each session's row pos is rewritten next time */
        for (uint32_t i = 0; i < n; i++) {
            *failed = (int32_t)i;
            if ((st = smoe_session_check_cancel(ss[i], l)) != SMOE_OK)
                goto fail;
        }
        *failed = -1;
        if ((st = smoe_layer(lead, l, n, ss)) != SMOE_OK) {
            if (st == SMOE_ERR_CANCELLED) /* the lead's cancel, seen while its blobs arrived */
                *failed = (int32_t)li;
            goto fail;
        }
    }
    if ((st = smoe_pass_end(lead, n, ss, NULL)) != SMOE_OK)
        return st;

    /* The logits, SMOE_LOGIT_ROWS rows at a time, each checked (and copied out) before anything is
     * committed; the sampling after the commit, from the last group still in the plane or its logits
     * made again (the same bits). */
    uint32_t rows[SMOE_LOGIT_ROWS];
    const float *out = NULL;
    uint32_t have = n; /* the first row of the group in the plane */
    for (uint32_t g = 0; g < n; g += SMOE_LOGIT_ROWS) {
        const uint32_t m = n - g < SMOE_LOGIT_ROWS ? n - g : SMOE_LOGIT_ROWS;
        for (uint32_t j = 0; j < m; j++) rows[j] = g + j;
        *failed = -1;
        if ((st = smoe_pass_logits(lead, rows, m, 0, &out)) != SMOE_OK) {
            if (st == SMOE_ERR_VAULT) /* name the session whose logits are not finite */
                for (uint32_t j = 0; j < m; j++) {
                    bool finite = false;
                    for (uint32_t k = 0; k < V && !finite; k++) finite = isfinite(out[(size_t)j * V + k]);
                    if (!finite) {
                        *failed = (int32_t)(g + j);
                        return smoe_fail(SMOE_ERR_VAULT, "decode of session %u at position %u: every logit is NaN "
                                                         "or infinite (non-finite weights? run `pysmoe verify`)",
                                         g + j, ss[g + j]->pos);
                    }
                }
            return st;
        }
        if (logits)
            memcpy(logits + (size_t)g * V, out, (size_t)m * V * sizeof(float));
        have = g;
    }

    /* Every session passed: commit them all. */
    double dt = smoe_now() - t0;
    for (uint32_t i = 0; i < n; i++) {
        smoe_session *s = ss[i];
        s->history[s->pos] = ids[i];
        smoe_session_set_pos(s, s->pos + 1);
        smoe_state_advanced(s, false);
        s->tokens_decoded++;
        s->decode_s += dt;
    }
    for (uint32_t g = 0; next_ids && g < n; g += SMOE_LOGIT_ROWS) {
        const uint32_t m = n - g < SMOE_LOGIT_ROWS ? n - g : SMOE_LOGIT_ROWS;
        if (g != have) {
            for (uint32_t j = 0; j < m; j++) rows[j] = g + j;
            if ((st = smoe_pass_logits(lead, rows, m, 0, &out)) != SMOE_OK)
                return st;
            have = g;
        }
        for (uint32_t j = 0; j < m; j++) {
            *failed = (int32_t)(g + j); /* a device's failure: the sessions before it have their ids */
            if ((st = smoe_pass_sample(ss[g + j], lead->be, j, out + (size_t)j * V, &next_ids[g + j])) != SMOE_OK)
                return st;
        }
    }
    *failed = -1;
    if (lead->streamer)
        smoe_streamer_get_stats(lead->streamer, &io1);
    lead->share->batch_steps++;
    lead->share->batch_tokens += n;
    lead->share->batch_blob_reads += io1.blob_reads - io0.blob_reads;
    return SMOE_OK;
fail:
    for (uint32_t l = 0; l < L; l++) lead->moe.deferred[l] = false;
    return st;
}

smoe_status smoe_decode_batch(smoe_session *const *sessions, const int32_t *ids, uint32_t n, float *logits,
                              int32_t *next_ids, int32_t *failed) {
    int32_t at = -1;
    smoe_status st = check_batch(sessions, ids, n, &at);
    if (st != SMOE_OK) {
        if (failed)
            *failed = at;
        return st;
    }
    uint32_t claimed = 0;
    for (; claimed < n; claimed++)
        if ((st = smoe_session_enter(sessions[claimed], "smoe_decode_batch")) != SMOE_OK)
            break;
    if (st != SMOE_OK) {
        at = (int32_t)claimed;
    } else {
        smoe_share_lock(sessions[0]);
        st = decode_batch(sessions, ids, n, logits, next_ids, &at);
        smoe_share_unlock(sessions[0]);
    }
    while (claimed-- > 0)
        smoe_session_leave(sessions[claimed], st);
    if (failed)
        *failed = st == SMOE_OK ? -1 : at;
    return st;
}
