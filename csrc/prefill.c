/* prefill.c — layer-major batched prefill.
 *
 * A token-serial walk reads, for every prompt token, its top-k experts in every layer: for a
 * 45-token prompt over a 94-layer model that is 45 × 94 × 8 blob reads. Layer-major inverts the
 * loops: for a chunk of up to C tokens, each layer runs attention for all of them, routes all
 * of them exactly, and reads each expert of the layer's union once, applying it to every token
 * routed to it (layer.c). I/O per chunk becomes Σ over layers of |union|, which saturates near
 * the layer's expert count instead of growing with the prompt.
 *
 * Nothing is predicted: the routing of every token is computed from its true hidden state, and
 * a read fires the moment an expert first enters the union. The result is bit-identical to
 * feeding the same tokens one at a time through smoe_decode_step (session.h says why). */
#include "session.h"
#include "prof.h"

static smoe_status prefill(smoe_session *s, const int32_t *ids, uint32_t n) {
    if (n == 0 || n > s->params.chunk)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_prefill_chunk: n = %u, must be 1 to the session's chunk (%u)", n,
                         s->params.chunk);
    smoe_status st = smoe_check_tokens(s, ids, n);
    if (st != SMOE_OK)
        return st;
    double t0 = smoe_now();
    SMOE_PROF_START();
    uint32_t pos = s->pos;

    const smoe_backend *be = s->backend;
    if ((st = be->embed(s, ids, n)) != SMOE_OK)
        return st;
    for (uint32_t l = 0; l < s->cfg.num_hidden_layers; l++) {
        /* position unchanged on failure: the chunk's KV rows are rewritten next time */
        if ((st = smoe_session_check_cancel(s, l)) != SMOE_OK)
            return st;
        if ((st = be->attention(s, l, pos, n)) != SMOE_OK || (st = be->ffn(s, l, n, &s->union_sizes[l])) != SMOE_OK)
            return st;
    }
    if (be->settle && (st = be->settle(s, s->union_sizes)) != SMOE_OK)
        return st;
    for (uint32_t i = 0; i < n; i++)
        s->history[pos + i] = ids[i];
    smoe_session_set_pos(s, pos + n);
    s->tokens_prefilled += n;
    s->prefill_s += smoe_now() - t0;
    return SMOE_OK;
}

smoe_status smoe_prefill_chunk(smoe_session *s, const int32_t *ids, uint32_t n) {
    if (!s || (!ids && n))
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_prefill_chunk: NULL argument");
    smoe_status st = smoe_session_enter(s, "smoe_prefill_chunk");
    if (st != SMOE_OK)
        return st;
    smoe_share_lock(s);
    st = prefill(s, ids, n);
    smoe_share_unlock(s);
    return smoe_session_leave(s, st);
}
