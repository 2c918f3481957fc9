/* retention.c — the within-layer order of the retention cache: LRU, or LRFU (decayed use counts).
 *
 * Why LRFU. On routing traces recorded from the engine decoding its own text on a realistic a3b
 * vault (bench/retention_trace.py, replayed slot for slot by bench/retention_sim.py; the figures
 * are in bench/RESULTS.md, "Retention policy on real traces"), recency is what predicts the next
 * token's experts: plain LFU, and a hot set pinned from the prompt's routing statistics, lose
 * hits to today's per-layer LRU at 10 % and 25 %. What gains is a little frequency on top of
 * recency: each blob's score is its uses, each worth 2^(−v/H) after v further visits of its
 * layer (H = SMOE_RETAIN_HALF_LIFE = 4 visits, a decode token being one visit); the victim is
 * the smallest score, ties to the least recent. A blob used by the last token and by one a few
 * tokens earlier outlives one used once by the last token alone; a blob from a burst long ago
 * decays below both. The gain is largest when the budget is tightest (5 %), where the quota is
 * about one token's experts per layer and pure LRU keeps only the last token's.
 *
 * Time is counted per layer in visits: a run of acquires of one layer is one visit (a decode
 * step, or one layer-major chunk: one use per acquire, so a prefill chunk counts a blob once
 * however many tokens used it). The streamer calls this from its compute thread only.
 */
#include "retention.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static smoe_retain_kind from_env(double *half_life) {
    const char *e = getenv("SMOE_RETENTION");
    if (!e || !*e) return SMOE_RETAIN_LRFU;
    if (strcmp(e, "lru") == 0) return SMOE_RETAIN_LRU;
    if (strcmp(e, "lrfu") == 0) return SMOE_RETAIN_LRFU;
    if (strncmp(e, "lrfu:", 5) == 0) {
        char *end;
        double h = strtod(e + 5, &end);
        if (end != e + 5 && *end == 0 && h > 0 && h < 1e6) {
            *half_life = h;
            return SMOE_RETAIN_LRFU;
        }
    }
    smoe_log(SMOE_LOG_WARN, "SMOE_RETENTION=%s: not lru, lrfu or lrfu:H (H > 0); using lrfu", e);
    return SMOE_RETAIN_LRFU;
}

bool smoe_retention_init(smoe_retention *r, smoe_retain_kind kind, double half_life, uint32_t n_layers,
                         uint32_t n_experts) {
    memset(r, 0, sizeof *r);
    if (half_life <= 0) half_life = SMOE_RETAIN_HALF_LIFE;
    if (kind == SMOE_RETAIN_DEFAULT) kind = from_env(&half_life);
    r->kind = kind;
    r->decay = pow(2.0, -1.0 / half_life);
    r->n_experts = n_experts;
    r->last_layer = UINT32_MAX;
    if (kind != SMOE_RETAIN_LRFU) return true;
    size_t keys = (size_t)n_layers * n_experts;
    r->visit = smoe_alloc((size_t)n_layers * sizeof *r->visit, 64);
    r->score = smoe_alloc(keys * sizeof *r->score, 64);
    r->seen = smoe_alloc(keys * sizeof *r->seen, 64);
    if (!r->visit || !r->score || !r->seen) {
        smoe_retention_free(r);
        return false;
    }
    memset(r->visit, 0, (size_t)n_layers * sizeof *r->visit);
    memset(r->score, 0, keys * sizeof *r->score);
    memset(r->seen, 0, keys * sizeof *r->seen);
    return true;
}

void smoe_retention_free(smoe_retention *r) {
    smoe_free(r->visit);
    smoe_free(r->score);
    smoe_free(r->seen);
    r->visit = NULL;
    r->score = NULL;
    r->seen = NULL;
}

/* key's score as of its layer's current visit. */
static double score_now(const smoe_retention *r, uint32_t key) {
    uint32_t v = r->visit[key / r->n_experts];
    return r->score[key] * pow(r->decay, (double)(v - r->seen[key]));
}

void smoe_retention_used(smoe_retention *r, uint32_t layer, uint32_t key) {
    if (r->kind != SMOE_RETAIN_LRFU) return;
    if (layer != r->last_layer) {
        r->visit[layer]++;
        r->last_layer = layer;
    }
    r->score[key] = score_now(r, key) + 1.0;
    r->seen[key] = r->visit[layer];
}

bool smoe_retention_before(const smoe_retention *r, uint32_t a, uint64_t sa, uint32_t b, uint64_t sb) {
    if (r->kind == SMOE_RETAIN_LRFU) {
        double xa = score_now(r, a), xb = score_now(r, b);
        if (xa != xb) return xa < xb;
    }
    return sa < sb;
}

const char *smoe_retention_name(const smoe_retention *r) {
    return r->kind == SMOE_RETAIN_LRFU ? "lrfu" : "lru";
}
