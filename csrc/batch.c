/* batch.c — one decode step of several sessions in one layer-major pass.
 *
 * n requests decoding at once each need, per layer, their top-k experts. Stepping them one after
 * another reads up to n·k blobs per layer; stepping them together reads the layer's union of
 * their experts once and applies each blob to every session routed to it, as layer-major
 * prefill does for the tokens of a chunk. The sessions share one streamer and worker pool
 * (smoe_session_new_shared), so "once" is once for all of them.
 *
 * Per layer:
 *   - attention runs for each session on its own planes and KV cache, at its own position
 *     (smoe_attention_block with n = 1: exactly what smoe_decode_step runs);
 *   - the sessions' residual rows are gathered into one session's planes (the "lead": the one
 *     with the largest chunk, which bounds n), and the FFN block runs there over n rows:
 *     routing per row, the union's reads fired as experts first appear, each expert's product
 *     over the rows routed to it — the batched kernels layer-major prefill uses, whose every
 *     output row is computed as the single-row kernel computes it (kernels.h);
 *   - the rows go back to their sessions.
 * Then each session's final norm, lm_head, logits check and sampling, on its own planes.
 * Every value a session sees is therefore the value smoe_decode_step alone would give it: its
 * logits, sampled id and KV rows are bit-identical, whatever the batch's other members and
 * their order.
 *
 * Nothing is committed (position, history, sampler, counters) until every session's logits
 * passed their check: a failure leaves every session of the batch where it was. */
#include "session.h"
#include "prof.h"

#include <math.h>
#include <string.h>

static bool any_finite(const float *x, uint32_t n) {
    for (uint32_t i = 0; i < n; i++)
        if (isfinite(x[i])) return true;
    return false;
}

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
        if (ss[i]->backend != &smoe_backend_cpu)
            return smoe_fail(SMOE_ERR_UNSUPPORTED, "smoe_decode_batch: session %u runs on %s; batches run on the CPU",
                             i, ss[i]->backend->name);
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

/* Moves row 0 of every session's residual x into row i of the lead's (or back, when back). The
 * lead's own row 0 goes to row li first, before session 0's row lands on it. */
static void shuttle(smoe_session *const *ss, uint32_t n, uint32_t li, bool back) {
    smoe_session *lead = ss[li];
    size_t row = lead->cfg.hidden_size * sizeof(float);
    if (!back && li != 0)
        memcpy(lead->x + (size_t)li * lead->cfg.hidden_size, lead->x, row);
    for (uint32_t i = 0; i < n; i++) {
        if (i == li)
            continue;
        float *mine = lead->x + (size_t)i * lead->cfg.hidden_size;
        if (back)
            memcpy(ss[i]->x, mine, row);
        else
            memcpy(mine, ss[i]->x, row);
    }
    if (back && li != 0)
        memcpy(lead->x, lead->x + (size_t)li * lead->cfg.hidden_size, row);
}

/* The lead's FFN block counted every row's routing as its own: give each row's to its session. */
static void move_expert_counts(smoe_session *const *ss, uint32_t n, uint32_t li, uint32_t l) {
    smoe_session *lead = ss[li];
    uint32_t E = lead->cfg.num_experts, K = lead->cfg.num_experts_per_tok;
    for (uint32_t i = 0; i < n; i++) {
        if (i == li)
            continue;
        for (uint32_t k = 0; k < K; k++) {
            uint32_t e = (uint32_t)lead->topk_idx[(size_t)i * K + k];
            lead->expert_counts[(size_t)l * E + e]--;
            ss[i]->expert_counts[(size_t)l * E + e]++;
        }
    }
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

    for (uint32_t i = 0; i < n; i++)
        smoe_embed(ss[i], &ids[i], 1);
    for (uint32_t l = 0; l < c->num_hidden_layers; l++) {
        /* positions unchanged on failure: each session's row pos is rewritten next time */
        for (uint32_t i = 0; i < n; i++) {
            *failed = (int32_t)i;
            if ((st = smoe_session_check_cancel(ss[i], l)) != SMOE_OK)
                return st;
        }
        *failed = -1;
        for (uint32_t i = 0; i < n; i++)
            smoe_attention_block(ss[i], l, ss[i]->pos, 1);
        shuttle(ss, n, li, false);
        uint32_t used;
        if ((st = smoe_ffn_block(lead, l, n, &used)) != SMOE_OK) {
            if (st == SMOE_ERR_CANCELLED) /* the lead's cancel, seen while its blobs arrived */
                *failed = (int32_t)li;
            return st;
        }
        if (lead->lay->layers[l].sparse)
            move_expert_counts(ss, n, li, l);
        shuttle(ss, n, li, true);
    }
    for (uint32_t i = 0; i < n; i++) {
        smoe_session *s = ss[i];
        smoe_rmsnorm(s->xn, s->x, s->lay->final_norm, c->hidden_size, c->rms_norm_eps);
        smoe_linear(s, SMOE_P_LM_HEAD, s->lay->lm_head, s->lay->lm_head->data, s->xn, 1, s->logits);
        if (!any_finite(s->logits, c->vocab_size)) {
            *failed = (int32_t)i;
            return smoe_fail(SMOE_ERR_VAULT, "decode of session %u at position %u: every logit is NaN or infinite "
                                             "(non-finite weights? run `pysmoe verify`)", i, s->pos);
        }
    }

    /* Every session passed: commit them all. */
    double dt = smoe_now() - t0;
    for (uint32_t i = 0; i < n; i++) {
        smoe_session *s = ss[i];
        s->history[s->pos] = ids[i];
        smoe_session_set_pos(s, s->pos + 1);
        if (logits)
            memcpy(logits + (size_t)i * c->vocab_size, s->logits, c->vocab_size * sizeof(float));
        if (next_ids)
            next_ids[i] = smoe_sample(&s->sampler, s->logits, c->vocab_size, s->history, s->pos, s->sample_f,
                                      s->sample_i);
        s->tokens_decoded++;
        s->decode_s += dt;
    }
    if (lead->streamer)
        smoe_streamer_get_stats(lead->streamer, &io1);
    lead->share->batch_steps++;
    lead->share->batch_tokens += n;
    lead->share->batch_blob_reads += io1.blob_reads - io0.blob_reads;
    return SMOE_OK;
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
