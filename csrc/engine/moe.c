/* moe.c — the MoE step, written once for every backend.
 *
 * For the n rows of a pass (a prefill chunk, one decode step, or one row per session of a batch)
 * a sparse layer:
 *   1. routes every row exactly (the backend's `route`: router product, softmax, top-k);
 *   2. forms the layer's union in order of first appearance — row by row, slot by slot — and
 *      fires each expert's acquisition the moment it first enters: from the device's own expert
 *      cache when the backend has one (a hit needs nothing more), else from the host retention
 *      cache, whose acquire starts the disk read of a miss (streamer.h). Nothing is acquired that
 *      the routing did not ask for;
 *   3. runs the device's hits at once, in one `experts` call;
 *   4. then runs the rest as their blobs arrive: each time one lands, every pending expert whose
 *      blob is in goes into one `experts` call (after a device fill for a backend with a device
 *      tier: its slot claimed, the blob copied in), so reads in flight overlap the compute of the
 *      experts before them and a warm cache runs a layer in one call;
 *   5. combines each row's K outputs in top-k slot order (`combine`), never in arrival order.
 * Which call ran an expert never changes its outputs (backend.h's rule), and the union, the rows
 * and the sum's order depend only on the routing: so layer-major, token-serial and batched passes
 * give the same bits, on every backend.
 *
 * Steps 1 and 2 may come in parts (smoe_moe_route per part of the rows, in row order: layer.c's
 * parts, whose attention runs between them): the union grows part by part in the same order of
 * first appearance and is acquired in the same order, so steps 3–5 (smoe_moe_finish) see what one
 * piece would have given them.
 *
 * A backend whose device tier holds every expert of the layer may run the whole step itself
 * (moe_resident): no host round trip, the routed ids coming back once per pass (pass.c settles
 * their counts). The step's bookkeeping then is the same, a pass later.
 *
 * Host slots. The streamer has a bounded number of slots; when it can give no more, the step runs
 * what it holds, releases those slots and acquires again — and a backend with a device tier first
 * waits for its fills (tier_sync), which hold host slots until their copies are done. A fill
 * batch stays within tier_batch, so the device slots of one batch are distinct. */
#include "engine/engine.h"
#include "prof.h"

#include <string.h>

enum { ON_DEVICE, NEED_HOST, PENDING, DONE }; /* a union position's state */

uint32_t smoe_moe_count(smoe_session *s, uint32_t l, uint32_t n, const int32_t *ids, smoe_session *const *owners) {
    const uint32_t E = s->cfg.num_experts, K = s->cfg.num_experts_per_tok;
    int32_t *seen = s->moe.pos_of; /* scratch: −1 everywhere between steps */
    uint32_t used = 0;
    for (uint32_t t = 0; t < n; t++) {
        uint64_t *counts = (owners ? owners[t] : s)->expert_counts + (size_t)l * E;
        for (uint32_t k = 0; k < K; k++) {
            const int32_t e = ids[(size_t)t * K + k];
            counts[e]++;
            if (seen[e] < 0) seen[e] = (int32_t)used++;
        }
    }
    for (uint32_t t = 0; t < n * K; t++) seen[ids[t]] = -1;
    return used;
}

/* Releases what a failed step still holds: its host slots and its device claims. */
static void abandon(smoe_session *s, uint32_t size, uint32_t n_held) {
    smoe_moe_state *m = &s->moe;
    const smoe_backend *be = s->backend;
    if (n_held) {
        be->tier_sync(s->be); /* a fill that failed leaves the device broken; the slots are ours again */
        for (uint32_t i = 0; i < n_held; i++) smoe_streamer_release(s->streamer, m->held[i]);
    }
    for (uint32_t u = 0; u < size; u++) {
        if (m->slot[u] >= 0) smoe_streamer_release(s->streamer, m->slot[u]);
        m->slot[u] = -1;
    }
}

/* pos_of back to −1 for the union's nu experts (its state between steps). */
static void forget_positions(smoe_moe_state *m, uint32_t nu) {
    for (uint32_t u = 0; u < nu; u++) m->pos_of[m->expert[u]] = -1;
}

/* Rows [r0, r0 + nr) of the routing (m->ids) into the union, acquiring as it goes: first the
 * device tier's hits (touched), then a host slot for each expert the device lacks, in union order
 * while the streamer has slots (m->next: the first position not yet tried). Counts each row's
 * routing for its owner. The union grows over the calls of one step (its parts, layer.c): m->size,
 * m->next and pos_of carry from one to the next. SMOE_ERR_INTERNAL for an id out of range. */
static smoe_status union_add(smoe_session *s, uint32_t l, uint32_t r0, uint32_t nr, smoe_session *const *owners) {
    smoe_moe_state *m = &s->moe;
    const smoe_backend *be = s->backend;
    const uint32_t E = s->cfg.num_experts, K = s->cfg.num_experts_per_tok;
    smoe_status st = SMOE_OK;
    uint32_t nu = m->size, acq = m->next;
    for (uint32_t t = r0; t < r0 + nr && st == SMOE_OK; t++) {
        uint64_t *counts = (owners ? owners[t] : s)->expert_counts + (size_t)l * E;
        for (uint32_t k = 0; k < K; k++) {
            const int32_t e = m->ids[(size_t)t * K + k];
            if (e < 0 || (uint32_t)e >= E) {
                st = smoe_fail(SMOE_ERR_INTERNAL, "layer %u: routing gave expert %d, outside [0, %u)", l, e, E);
                break;
            }
            counts[e]++;
            if (m->pos_of[e] >= 0) {
                m->count[m->pos_of[e]]++;
                continue;
            }
            const uint32_t u = nu++;
            m->pos_of[e] = (int32_t)u;
            m->expert[u] = e;
            m->count[u] = 1;
            m->slot[u] = -1;
            m->w[u] = be->tier_lookup ? be->tier_lookup(s->be, l, (uint32_t)e) : NULL;
            m->state[u] = m->w[u] ? ON_DEVICE : NEED_HOST;
            if (m->state[u] == ON_DEVICE) {
                if (acq == u) acq++;
                continue;
            }
            /* fire the read at once while slots allow; the rest are acquired as slots free up */
            if (m->acquiring && acq == u) {
                const int slot = smoe_streamer_acquire(s->streamer, l, (uint32_t)e);
                if (slot >= 0) {
                    m->reads += !smoe_streamer_ready(s->streamer, slot); /* a miss: its read is fired */
                    m->slot[u] = slot;
                    m->state[u] = PENDING;
                    acq++;
                } else {
                    m->acquiring = false;
                    m->reads++; /* out of slots: this one, at least, is read later */
                    if (slot < -1) { /* a key the streamer refuses: its message is set */
                        st = SMOE_ERR_INTERNAL;
                        break;
                    }
                }
            }
        }
    }
    m->size = nu;
    m->next = acq;
    return st;
}

/* Each union position's rows of the pass's n, grouped, increasing within one; pos_of back to −1
 * (its state between steps). */
static void union_group(smoe_moe_state *m, uint32_t n, uint32_t K) {
    uint32_t off = 0;
    for (uint32_t u = 0; u < m->size; u++) {
        m->start[u] = off;
        off += m->count[u];
        m->count[u] = 0;
    }
    for (uint32_t r = 0; r < n * K; r++) {
        const uint32_t u = (uint32_t)m->pos_of[m->ids[r]];
        m->rows[m->start[u] + m->count[u]++] = r;
    }
    forget_positions(m, m->size);
}

/* Acquires host slots for positions [*next, size) that need one, in order, while the streamer
 * has slots. */
static smoe_status acquire_more(smoe_session *s, uint32_t l, uint32_t size, uint32_t *next) {
    smoe_moe_state *m = &s->moe;
    for (; *next < size; ++*next) {
        const uint32_t u = *next;
        if (m->state[u] != NEED_HOST) continue;
        const int slot = smoe_streamer_acquire(s->streamer, l, (uint32_t)m->expert[u]);
        if (slot == -1) break;
        if (slot < -1) return SMOE_ERR_INTERNAL; /* its message is set */
        m->slot[u] = slot;
        m->state[u] = PENDING;
    }
    return SMOE_OK;
}

/* The layer's routing rule for the backend's route ops. */
static smoe_route route_of(const smoe_session *s, uint32_t l) {
    const smoe_layer_weights *L = &s->lay->layers[l];
    return (smoe_route){L->router, L->router_bias, s->cfg.num_experts_per_tok, s->recipe.route, s->cfg.norm_topk_prob};
}

void smoe_moe_begin(smoe_session *s) {
    s->moe.size = 0;
    s->moe.next = 0;
    s->moe.acquiring = true;
    s->moe.reads = 0;
}

void smoe_moe_drop(smoe_session *s) {
    forget_positions(&s->moe, s->moe.size);
    abandon(s, s->moe.size, 0);
    s->moe.size = 0;
}

smoe_status smoe_moe_route(smoe_session *s, uint32_t l, uint32_t r0, uint32_t nr, smoe_session *const *owners) {
    const smoe_backend *be = s->backend;
    smoe_moe_state *m = &s->moe;
    const smoe_layer_weights *L = &s->lay->layers[l];
    const smoe_route r = route_of(s, l);
    int32_t *ids = m->ids + (size_t)r0 * r.K;
    smoe_status st = s->recipe.route == SMOE_ROUTER_SIGMOID_GROUP
                         ? be->route_grouped(s->be, L->router, L->router_bias, r.K, r.renorm, nr, ids)
                         : be->route(s->be, &r, nr, ids);
    if ((st = smoe_be_status(s, st)) == SMOE_OK) st = union_add(s, l, r0, nr, owners);
    smoe_streamer_submit(s->streamer); /* the reads acquired above, coalesced where adjacent */
    SMOE_PROF_LAP(SMOE_P_ROUTE);
    if (st != SMOE_OK) smoe_moe_drop(s);
    return st;
}

smoe_status smoe_moe_step(smoe_session *s, uint32_t l, uint32_t n, smoe_session *const *owners) {
    const smoe_backend *be = s->backend;
    if (be->moe_resident && be->tier_resident(s->be, l)) {
        const smoe_route r = route_of(s, l);
        s->moe.deferred[l] = true;
        return smoe_be_status(s, be->moe_resident(s->be, l, &r, n));
    }
    smoe_moe_begin(s);
    smoe_status st = smoe_moe_route(s, l, 0, n, owners);
    return st != SMOE_OK ? st : smoe_moe_finish(s, l, n);
}

smoe_status smoe_moe_finish(smoe_session *s, uint32_t l, uint32_t n) {
    const smoe_backend *be = s->backend;
    void *b = s->be;
    smoe_moe_state *m = &s->moe;
    const uint32_t K = s->cfg.num_experts_per_tok, size = m->size;
    uint32_t next = m->next;
    smoe_status st = SMOE_OK;
    union_group(m, n, K);
    m->streaming = m->reads > 0;
    if (m->sizes_out) m->sizes_out[l] = size;
    const smoe_union un = {l, n, size, m->expert, m->start, m->count, m->rows, m->w};
    if (be->experts_begin) st = smoe_be_status(s, be->experts_begin(b, &un));

    /* the device's hits, in one call */
    uint32_t nb = 0, n_held = 0, left = size;
    for (uint32_t u = 0; u < size && st == SMOE_OK; u++)
        if (m->state[u] == ON_DEVICE) {
            m->batch[nb++] = u;
            m->state[u] = DONE;
        }
    if (st == SMOE_OK && nb) {
        st = smoe_be_status(s, be->experts(b, &un, m->batch, nb));
        left -= nb;
    }

    /* the rest as their blobs arrive */
    const bool tier = be->tier_claim != NULL;
    const uint32_t cap = tier ? be->tier_batch(b) : size;
    while (st == SMOE_OK && left > 0) {
        if ((st = acquire_more(s, l, size, &next)) != SMOE_OK) break;
        smoe_streamer_submit(s->streamer);
        uint32_t np = 0;
        for (uint32_t u = 0; u < size; u++)
            if (m->state[u] == PENDING) {
                m->pending[np] = u;
                m->pending_slots[np++] = m->slot[u];
            }
        if (np == 0) {
            /* No slot could be had: free the ones device fills hold, or wait for reads a cancelled
             * or failed call left in flight, then acquire again. */
            if (n_held) {
                if ((st = smoe_be_status(s, be->tier_sync(b))) != SMOE_OK) break;
                for (uint32_t i = 0; i < n_held; i++) smoe_streamer_release(s->streamer, m->held[i]);
                n_held = 0;
                continue;
            }
            if (smoe_streamer_settle(s->streamer)) continue;
            st = smoe_fail(SMOE_ERR_INTERNAL, "layer %u: no host cache slot could be acquired", l);
            break;
        }
        /* a cancel need not wait for the rest of a layer's reads */
        if ((st = smoe_session_check_cancel(s, l)) != SMOE_OK) break;
        smoe_streamer_wait_any(s->streamer, m->pending_slots, np);
        nb = 0;
        for (uint32_t i = 0; i < np && nb < cap; i++) {
            const uint32_t u = m->pending[i];
            if (!smoe_streamer_ready(s->streamer, m->slot[u])) continue;
            if ((st = smoe_streamer_wait(s->streamer, m->slot[u])) != SMOE_OK) break; /* a failed read */
            const uint8_t *blob = smoe_streamer_data(s->streamer, m->slot[u]);
            if (tier) {
                m->w[u] = be->tier_claim(b, l, (uint32_t)m->expert[u]);
                if ((st = smoe_be_status(s, be->tier_fill(b, m->w[u], blob, m->slot[u]))) != SMOE_OK) {
                    be->tier_drop(b, m->w[u]);
                    break;
                }
                m->held[n_held++] = m->slot[u];
                m->slot[u] = -1;
            } else {
                m->w[u] = blob;
            }
            m->batch[nb++] = u;
            m->state[u] = DONE;
        }
        SMOE_PROF_LAP(SMOE_P_GATHER);
        if (st == SMOE_OK && nb) st = smoe_be_status(s, be->experts(b, &un, m->batch, nb));
        left -= nb;
        if (!tier)
            for (uint32_t i = 0; i < nb; i++) {
                const uint32_t u = m->batch[i];
                smoe_streamer_release(s->streamer, m->slot[u]);
                m->slot[u] = -1;
            }
    }
    if (st == SMOE_OK && n_held) {
        st = smoe_be_status(s, be->tier_sync(b));
        if (st == SMOE_OK) {
            for (uint32_t i = 0; i < n_held; i++) smoe_streamer_release(s->streamer, m->held[i]);
            n_held = 0;
        }
    }
    if (st != SMOE_OK) {
        abandon(s, size, n_held);
        return st;
    }
    return smoe_be_status(s, be->combine(b, K, n));
}
