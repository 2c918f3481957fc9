/* batch.c — one decode step of several sessions in one layer-major pass, on any backend.
 *
 * n requests decoding at once each need, per layer, their top-k experts. Stepping them one after
 * another reads up to n·k blobs per layer (and, on a GPU, launches every kernel n times); stepping
 * them together reads the layer's union of their experts once and applies each to every session
 * routed to it, as layer-major prefill does for the tokens of a chunk. The sessions share one
 * retention cache and device (smoe_session_new_shared), so "once" is once for all of them.
 *
 * Per layer:
 *   - attention runs for each session on its own planes and KV cache, at its own position
 *     (layer.c's attention block with n = 1: exactly what smoe_decode_step runs);
 *   - the sessions' residual rows are gathered into one session's planes (the "lead": the one
 *     with the largest chunk, which bounds n) by the backend's copy_row, and the FFN block runs
 *     there over n rows: the MoE step of moe.c, each row's routing counted for its own session;
 *   - the rows go back to their sessions.
 * Then each session's logits, their check and sampling, on its own planes. Every value a session
 * sees is therefore the value smoe_decode_step alone would give it (backend.h's rule: no op's
 * value for a row depends on the other rows): its logits, sampled id and KV rows are
 * bit-identical, whatever the batch's other members and their order.
 *
 * Nothing is committed (position, history, sampler, counters) until every session's logits
 * passed their check: a failure leaves every session of the batch where it was. */
#include "engine/engine.h"

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

/* Moves row 0 of every session's residual X into row i of the lead's (or back, when back). The
 * lead's own row 0 goes to row li first, before session 0's row lands on it. */
static smoe_status shuttle(smoe_session *const *ss, uint32_t n, uint32_t li, bool back) {
    smoe_session *lead = ss[li];
    const smoe_backend *be = lead->backend;
    smoe_status st = SMOE_OK;
    if (!back && li != 0) st = be->copy_row(lead->be, li, lead->be, 0);
    for (uint32_t i = 0; i < n && st == SMOE_OK; i++) {
        if (i == li)
            continue;
        st = back ? be->copy_row(ss[i]->be, 0, lead->be, i) : be->copy_row(lead->be, i, ss[i]->be, 0);
    }
    if (st == SMOE_OK && back && li != 0) st = be->copy_row(lead->be, 0, lead->be, li);
    return smoe_be_status(lead, st);
}

static smoe_status decode_batch(smoe_session *const *ss, const int32_t *ids, uint32_t n, float *logits,
                                int32_t *next_ids, int32_t *failed) {
    smoe_status st;
    uint32_t li = 0;
    for (uint32_t i = 0; i < n; i++) {
        *failed = (int32_t)i;
        if ((st = smoe_check_tokens(ss[i], &ids[i], 1)) != SMOE_OK)
            return st;
        if (ss[i]->params.chunk > ss[li]->params.chunk)
            li = i;
    }
    *failed = -1;
    smoe_session *lead = ss[li];
    if (n > lead->params.chunk)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_decode_batch: %u sessions, more than the largest chunk (%u)", n,
                         lead->params.chunk);
    double t0 = smoe_now();
    const smoe_config *c = &lead->cfg;
    smoe_streamer_stats io0 = {0}, io1 = {0};
    if (lead->streamer)
        smoe_streamer_get_stats(lead->streamer, &io0);

    for (uint32_t i = 0; i < n; i++) {
        *failed = (int32_t)i;
        smoe_session *s = ss[i];
        if ((st = smoe_be_status(s, s->backend->stage(s->be, &ids[i], 1, s->pos))) != SMOE_OK ||
            (st = smoe_be_status(s, s->backend->embed(s->be, 1))) != SMOE_OK)
            return st;
    }
    for (uint32_t l = 0; l < c->num_hidden_layers; l++) {
        /* positions unchanged on failure: each session's row pos is rewritten next time */
        for (uint32_t i = 0; i < n; i++) {
            *failed = (int32_t)i;
            if ((st = smoe_session_check_cancel(ss[i], l)) != SMOE_OK ||
                (st = smoe_layer_attention(ss[i], l, 1)) != SMOE_OK)
                goto fail;
        }
        *failed = -1;
        if ((st = shuttle(ss, n, li, false)) != SMOE_OK)
            goto fail;
        if ((st = smoe_layer_ffn(lead, l, n, ss)) != SMOE_OK) {
            if (st == SMOE_ERR_CANCELLED) /* the lead's cancel, seen while its blobs arrived */
                *failed = (int32_t)li;
            goto fail;
        }
        if ((st = shuttle(ss, n, li, true)) != SMOE_OK)
            goto fail;
    }
    if ((st = smoe_pass_end(lead, n, ss, NULL)) != SMOE_OK)
        return st;
    static const uint32_t row0 = 0;
    for (uint32_t i = 0; i < n; i++) {
        *failed = (int32_t)i;
        if ((st = smoe_pass_logits(ss[i], &row0, 1, ss[i]->pos, &ss[i]->last_logits)) != SMOE_OK)
            return st;
    }
    *failed = -1;

    /* Every session passed: commit them all. */
    double dt = smoe_now() - t0;
    for (uint32_t i = 0; i < n; i++) {
        smoe_session *s = ss[i];
        s->history[s->pos] = ids[i];
        smoe_session_set_pos(s, s->pos + 1);
        if (logits)
            memcpy(logits + (size_t)i * c->vocab_size, s->last_logits, c->vocab_size * sizeof(float));
        if (next_ids && (st = smoe_pass_sample(s, s->last_logits, &next_ids[i])) != SMOE_OK) {
            *failed = (int32_t)i; /* a device's failure: the sessions before it are committed */
            return st;
        }
        s->tokens_decoded++;
        s->decode_s += dt;
    }
    if (lead->streamer)
        smoe_streamer_get_stats(lead->streamer, &io1);
    lead->share->batch_steps++;
    lead->share->batch_tokens += n;
    lead->share->batch_blob_reads += io1.blob_reads - io0.blob_reads;
    return SMOE_OK;
fail:
    for (uint32_t l = 0; l < c->num_hidden_layers; l++) lead->moe.deferred[l] = false;
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
