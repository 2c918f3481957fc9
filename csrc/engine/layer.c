/* layer.c — a decoder layer as a recipe of backend ops (backend.h), the same on every device.
 *
 * Qwen3-MoE as transformers implements Qwen3MoeDecoderLayer (gpt-oss's GptOssDecoderLayer is the same
 * recipe with the recipe's data: biases on q, k, v, o; no QK-norm; sinks in attention's softmax; a
 * sliding window on its sliding layers; YaRN's RoPE tables; top-k-then-softmax routing with a router
 * bias; the clamped SwiGLU with expert biases — engine.h's smoe_recipe, session.c's fill_recipe):
 *
 *   h  = x + o_proj(attention(rope(q_norm(q_proj(rms(x)))), rope(k_norm(k_proj(rms(x)))), v_proj(rms(x))))
 *   x' = h + ffn(rms(h))        ffn = Σ_k w_k · down(silu(gate(·)) · up(·)) over the top-k experts
 *                                     of softmax(router(·)) (moe.c), or a dense MLP on dense layers
 *
 * The other families are this recipe with the vault's parameters (vault.h, smoe_model_params):
 * q/k/v (and o) biases after their products (GLM, OLMoE's attention_bias); q_norm/k_norm per head,
 * over the whole projection before the heads are split (OLMoE), or none (Mixtral); RoPE over the
 * first rotary_dim dims of a head (GLM); GLM's grouped sigmoid router (route_grouped) and its
 * shared expert, a dense MLP on the same normed rows added after the routed experts. Which layers
 * have which tensors is the vault's business (vault.c checks them against the parameters); this
 * file only follows what is there.
 *
 * Every op works on rows [0, n) of the session's planes and computes each row's values whatever n
 * is, which is the whole of the bit-identity argument between the serial step (n = 1), the
 * layer-major prefill (the chunk) and a batch (row t the one token of session rows[t], every row in
 * the batch's lead's planes, each attending over its own session's KV cache): norms, RoPE,
 * attention and routing are per row; products reduce each element in a fixed order; a row's expert
 * outputs are summed in top-k slot order. A model family is another recipe of these ops (and, where its math
 * differs, a few new ones), never another copy of the engine. */
#include "engine/engine.h"

/* A backend op's status, SMOE_OK or the failure (with the session marked broken when the device
 * says so): `TRY(be->norm(...))`. */
#define TRY(call)                                                                                                      \
    do {                                                                                                               \
        smoe_status st_ = smoe_be_status(s, (call));                                                                   \
        if (st_ != SMOE_OK) return st_;                                                                                \
    } while (0)

smoe_status smoe_recipe_check(const smoe_layout *lay, const smoe_backend *be) {
    const smoe_model_params *m = &lay->mp;
    const char *fam = smoe_family_name(m->family), *why = NULL;
    const bool hybrid = m->family == SMOE_FAMILY_QWEN3_NEXT || m->family == SMOE_FAMILY_QWEN3_5_MOE;
    if (m->family > SMOE_FAMILY_GLM4_MOE && m->family != SMOE_FAMILY_GPT_OSS && !hybrid) why = "its layer recipe";
    for (uint32_t l = 0; !why && l < lay->cfg.num_hidden_layers; l++)
        if (lay->layer_attn[l] == SMOE_ATTN_LINEAR && !hybrid) why = "linear attention";
    if (why)
        return smoe_fail(SMOE_ERR_UNSUPPORTED, "this build of libsmoe cannot run a %s vault: the engine lacks %s", fam,
                         why);
    if (!why && m->attention_bias && !be->bias) why = "the bias op";
    if (!why && m->router_kind == SMOE_ROUTER_SIGMOID_GROUP && !be->route_grouped) why = "the grouped sigmoid router";
    /* the hybrids' ops: a backend without them has no Gated DeltaNet (CUDA today) */
    if (!why && hybrid && (!be->linear_attend || !be->state || !be->sigmoid_gate))
        why = "Gated DeltaNet linear attention and gated attention (use the cpu device)";
    if (why || (be->lacks && (why = be->lacks(lay)) != NULL))
        return smoe_fail(SMOE_ERR_UNSUPPORTED, "the %s backend cannot run this %s vault: it lacks %s", be->name, fam, why);
    return SMOE_OK;
}

/* A Gated DeltaNet layer's mixer (Qwen3-Next, Qwen3.5-MoE: Qwen3NextGatedDeltaNet):
 *
 *   mix, z, b, a = in-projections of rms(x)                       (batched over the rows)
 *   o = rmsnorm_gated(delta_rule(l2norm(conv(mix))), z)           (row by row, in token order:
 *                                                                   the states carry position to position)
 *   h = x + out_proj(o)                                           (batched) */
static smoe_status linear_mixer(smoe_session *s, const smoe_layer_weights *L, uint32_t l, uint32_t n,
                                smoe_session *const *rows) {
    const smoe_backend *be = s->backend;
    void *b = s->be;
    const smoe_proj in[4] = {{L->lin_qkv, SMOE_PL_MIX}, {L->lin_z, SMOE_PL_GATE}, {L->lin_b, SMOE_PL_BETA},
                             {L->lin_a, SMOE_PL_DECAY}};
    const smoe_proj out = {L->lin_out, SMOE_PL_Y};
    TRY(be->project(b, SMOE_PL_XN, in, 4, n));
    TRY(be->linear_attend(b, l, L->lin_conv, L->lin_a_log, L->lin_dt_bias, L->lin_norm, n, rows ? s->row_be : NULL));
    TRY(be->project(b, SMOE_PL_ATT, &out, 1, n));
    return SMOE_OK;
}

smoe_status smoe_layer_attention(smoe_session *s, uint32_t l, uint32_t n, smoe_session *const *rows) {
    const smoe_backend *be = s->backend;
    void *b = s->be;
    const smoe_layer_weights *L = &s->lay->layers[l];
    TRY(be->norm(b, SMOE_PL_XN, SMOE_PL_X, L->input_norm, n));
    if (L->attn == SMOE_ATTN_LINEAR) {
        smoe_status st = linear_mixer(s, L, l, n, rows);
        if (st != SMOE_OK) return st;
    } else {
        /* gated attention (Qwen3-Next's) also projects its output gate: ATT · sigmoid(gate) */
        const smoe_proj qkv[4] = {{L->q, SMOE_PL_Q}, {L->k, SMOE_PL_K}, {L->v, SMOE_PL_V}, {L->q_gate, SMOE_PL_GATE}};
        const smoe_proj o = {L->o, SMOE_PL_Y};
        const bool whole = s->lay->mp.qk_norm == SMOE_QK_NORM_WHOLE;
        TRY(be->project(b, SMOE_PL_XN, qkv, L->q_gate ? 4 : 3, n));
        if (L->q_bias) {
            TRY(be->bias(b, SMOE_PL_Q, L->q_bias, n));
            TRY(be->bias(b, SMOE_PL_K, L->k_bias, n));
            TRY(be->bias(b, SMOE_PL_V, L->v_bias, n));
        }
        if (whole) { /* OLMoE: RMSNorm over the whole q and k projections, then attention without one per head */
            TRY(be->norm(b, SMOE_PL_Q, SMOE_PL_Q, L->q_norm, n));
            TRY(be->norm(b, SMOE_PL_K, SMOE_PL_K, L->k_norm, n));
        }
        const smoe_attn a = {whole ? NULL : L->q_norm, whole ? NULL : L->k_norm, L->sinks,
                             L->attn == SMOE_ATTN_SLIDING ? s->recipe.window : 0};
        TRY(be->attend(b, l, &a, n, rows ? s->row_be : NULL));
        if (L->q_gate) TRY(be->sigmoid_gate(b, SMOE_PL_ATT, SMOE_PL_GATE, L->q->rows, L->q->rows, n));
        TRY(be->project(b, SMOE_PL_ATT, &o, 1, n));
        if (L->o_bias) TRY(be->bias(b, SMOE_PL_Y, L->o_bias, n));
    }
    TRY(be->add(b, SMOE_PL_X, SMOE_PL_Y, n));
    return SMOE_OK;
}


/* After a sparse layer's routed experts (combined into X): its shared expert, if it has one, on
 * the same normed rows (GLM), scaled by sigmoid(shared_gate · x) where the family has that gate
 * (Qwen3-Next, Qwen3.5-MoE). */
static smoe_status shared_expert(smoe_session *s, const smoe_layer_weights *L, uint32_t n) {
    const smoe_backend *be = s->backend;
    void *b = s->be;
    if (!L->shared_gate) return SMOE_OK;
    TRY(be->mlp(b, SMOE_PL_Y, SMOE_PL_XN, L->shared_gate, L->shared_up, L->shared_down, n));
    if (L->shared_expert_gate) {
        const smoe_proj g = {L->shared_expert_gate, SMOE_PL_SGATE};
        TRY(be->project(b, SMOE_PL_XN, &g, 1, n));
        TRY(be->sigmoid_gate(b, SMOE_PL_Y, SMOE_PL_SGATE, s->cfg.hidden_size, 1, n));
    }
    TRY(be->add(b, SMOE_PL_X, SMOE_PL_Y, n));
    return SMOE_OK;
}

smoe_status smoe_layer_ffn(smoe_session *s, uint32_t l, uint32_t n, smoe_session *const *rows) {
    const smoe_backend *be = s->backend;
    void *b = s->be;
    const smoe_layer_weights *L = &s->lay->layers[l];
    TRY(be->norm(b, SMOE_PL_XN, SMOE_PL_X, L->post_norm, n));
    if (L->sparse) {
        smoe_status st = smoe_moe_step(s, l, n, rows);
        return st != SMOE_OK ? st : shared_expert(s, L, n);
    }
    TRY(be->mlp(b, SMOE_PL_Y, SMOE_PL_XN, L->mlp_gate, L->mlp_up, L->mlp_down, n));
    TRY(be->add(b, SMOE_PL_X, SMOE_PL_Y, n));
    return SMOE_OK;
}

/* Parts. A sparse layer's reads can start only once its rows have routed, and routing waits for
 * the attention block of every row: with the whole pass in one part the disk idles through each
 * layer's attention (for 256 rows of an a3b-shaped layer, 46 of its ~210 ms, cold). So where the
 * backend can (rows_at), a layer-major pass of enough rows runs its attention block and routing a
 * part of the rows at a time, in row order, each part's reads fired as it routes — the disk
 * reads the first part's experts while the next part computes — and then the experts and
 * combine over all the rows as one step, so each expert is still read once and applied once to
 * every row routed to it. Attention is causal: a part's rows see the KV rows that the earlier
 * parts stored at this layer, as they would in one part; every op computes each row the same
 * whatever rows it is given; so the bits do not change (tests/test_parts.py). Parts cost a re-read
 * of the attention's weights each (a warm 45-token pass 2–3 % in 5 parts), so they stop where there
 * is no read to overlap: when a part fires no read (its experts all retained) the rest of the
 * layer goes in one part, and a layer after one that read nothing runs in one part. Not for
 * linear attention (its rows carry state) or gated attention, nor for a batch of sessions. */
enum { PART_ROWS_MIN = 8, PARTS_MAX = 8 }; /* bench/RESULTS.md "Parts" */

/* Rows per part of layer l for a pass of n rows; n: one part. */
static uint32_t part_rows(const smoe_session *s, const smoe_layer_weights *L, uint32_t n, smoe_session *const *rows) {
    if (rows || !s->backend->rows_at || !L->sparse || L->attn == SMOE_ATTN_LINEAR || L->q_gate || !s->moe.streaming)
        return n;
    if (s->params.part_rows) return s->params.part_rows < n ? s->params.part_rows : n;
    uint32_t parts = n / PART_ROWS_MIN;
    if (parts > PARTS_MAX) parts = PARTS_MAX;
    return parts <= 1 ? n : (n + parts - 1) / parts;
}

static smoe_status layer_in_parts(smoe_session *s, uint32_t l, uint32_t n, uint32_t per) {
    const smoe_backend *be = s->backend;
    void *b = s->be;
    const smoe_layer_weights *L = &s->lay->layers[l];
    smoe_status st = SMOE_OK;
    smoe_moe_begin(s);
    for (uint32_t r0 = 0, nr = per; st == SMOE_OK && r0 < n; r0 += nr) {
        if (r0 > 0 && s->moe.reads == 0) nr = n - r0; /* every expert so far cached: no read to overlap */
        if (nr > n - r0) nr = n - r0;
        be->rows_at(b, r0);
        st = smoe_layer_attention(s, l, nr, NULL);
        if (st == SMOE_OK) st = smoe_be_status(s, be->norm(b, SMOE_PL_XN, SMOE_PL_X, L->post_norm, nr));
        if (st == SMOE_OK) st = smoe_moe_route(s, l, r0, nr, NULL); /* on failure it has dropped the step */
        else smoe_moe_drop(s);
    }
    be->rows_at(b, 0);
    if (st == SMOE_OK) st = smoe_moe_finish(s, l, n);
    return st != SMOE_OK ? st : shared_expert(s, L, n);
}

smoe_status smoe_layer(smoe_session *s, uint32_t l, uint32_t n, smoe_session *const *rows) {
    const uint32_t per = part_rows(s, &s->lay->layers[l], n, rows);
    if (per < n) return layer_in_parts(s, l, n, per);
    smoe_status st = smoe_layer_attention(s, l, n, rows);
    return st != SMOE_OK ? st : smoe_layer_ffn(s, l, n, rows);
}
