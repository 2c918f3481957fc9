/* sample.c — choosing the next id (sample.h).
 *
 * The pipeline, in the order Hugging Face's logits processors apply it:
 *   1. repetition penalty over the last repetition_window ids of the history, each distinct id
 *      once: a logit > 0 is divided by the penalty, any other multiplied by it; then the
 *      presence and frequency penalties (OpenAI's) over the ids drawn since the sampler was set:
 *      logit −= frequency_penalty · count + presence_penalty, in double, rounded back to float;
 *   1b. the mask, when one is in force (structured output): every id it does not allow → −inf;
 *   2. temperature 0 → argmax (lowest id on ties), no random draw;
 *   3. logits / temperature;
 *   4. top-k: keep the k largest (ties: lower id first);
 *   5. softmax over what is left (in double, max-subtracted);
 *   6. top-p: keep the smallest prefix of the candidates, best first, whose probability sums
 *      to ≥ top_p;
 *   7. min-p: drop candidates whose probability is < min_p · p_max;
 *   8. renormalise and draw one uniform double from xoroshiro128+ (seeded by splitmix64).
 * NaN logits count as −inf. The same seed and logits always give the same id.
 *
 * The vocabulary (151,936 for Qwen3) is never fully sorted unless the cut needs it: with top-k
 * a bounded heap selects the best k in O(V log k); top-p or min-p without top-k sort only the
 * ids above a logit threshold chosen so that the set surely contains the cut (section in
 * smoe_sample), usually a few hundred ids.
 */
#include "sample.h"

#include <math.h>
#include <string.h>

/* ---------------------------------------------------------------------------------- rng */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t xoroshiro128p(uint64_t s[2]) {
    const uint64_t s0 = s[0];
    uint64_t s1 = s[1];
    const uint64_t result = s0 + s1;
    s1 ^= s0;
    s[0] = rotl(s0, 24) ^ s1 ^ (s1 << 16);
    s[1] = rotl(s1, 37);
    return result;
}

/* uniform in [0, 1) from the top 53 bits (the low bits of xoroshiro128+ are the weak ones) */
static double uniform(uint64_t s[2]) { return (double)(xoroshiro128p(s) >> 11) * 0x1.0p-53; }

void smoe_sampler_init(smoe_sampler *s, const smoe_sampler_params *p) {
    s->p = *p;
    uint64_t x = p->seed;
    s->rng[0] = splitmix64(&x);
    s->rng[1] = splitmix64(&x);
    if ((s->rng[0] | s->rng[1]) == 0) s->rng[1] = 1; /* the all-zero state is a fixed point */
    for (uint32_t i = 0; i < s->n_drawn; i++) s->counts[s->drawn[i]] = 0;
    s->n_drawn = 0;
    s->masked = false;
}

void smoe_sampler_observe(smoe_sampler *s, int32_t id) {
    if (id < 0 || !s->counts) return;
    if (s->counts[id]++ == 0) s->drawn[s->n_drawn++] = id;
}

/* ---------------------------------------------------------------------------- selection */

static inline float clean(float x) { return x != x ? -INFINITY : x; }

/* a ranks before b: larger value, or equal value and lower id — a strict total order */
static inline bool better(const float *v, int32_t a, int32_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); }

/* x's bits as an int whose signed order is x's order, with NaN as −inf (as `clean` makes it) and
 * −0 as +0, so that keys are equal exactly where the (cleaned) floats are: integer steps only. */
static inline int32_t order_key(float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    const int32_t k = (int32_t)(b ^ ((uint32_t)((int32_t)b >> 31) & 0x7fffffffu));
    const int32_t neg_inf = (int32_t)(0xff800000u ^ 0x7fffffffu);
    return (b & 0x7fffffffu) > 0x7f800000u ? neg_inf : k == -1 ? 0 : k;
}

/* How many of b[0..KEY_BLOCK) have key m. Out of line: inlined, gcc vectorised the loop over
 * blocks instead of this one, loading element by element (greedy sampling 126 µs against 56). */
enum { KEY_BLOCK = 64 };
__attribute__((noinline)) static uint32_t key_hits(const float *b, int32_t m) {
    uint32_t hits = 0;
    for (uint32_t j = 0; j < KEY_BLOCK; j++) hits += (uint32_t)(order_key(b[j]) == m);
    return hits;
}

/* The first index of the largest of v[0..n) (n > 0; NaN counts as −inf, −0 as +0): the largest
 * key as an integer maximum (a vectorised pass), then the first block of KEY_BLOCK that holds it
 * (counted, vectorised) and the index in that block. Greedy sampling over a 151,936-id vocabulary
 * on a Zen 2 core: 56 µs, against 110 for a compare-and-branch scan after a cleaning copy
 * (bench/RESULTS.md, "The activation on the pool, and greedy's argmax vectorised"). */
static uint32_t argmax(const float *v, uint32_t n) {
    int32_t m = INT32_MIN;
    for (uint32_t i = 0; i < n; i++) {
        const int32_t k = order_key(v[i]);
        m = k > m ? k : m;
    }
    uint32_t i = 0;
    for (; i + KEY_BLOCK <= n; i += KEY_BLOCK)
        if (key_hits(v + i, m)) break;
    while (order_key(v[i]) != m) i++; /* the block holds it (or the tail does) */
    return i;
}

/* heap[0..size) is a heap whose root is the worst entry; restores it below position i */
static void sift_down(const float *v, int32_t *heap, uint32_t size, uint32_t i) {
    for (;;) {
        uint32_t worst = i, l = 2 * i + 1, r = l + 1;
        if (l < size && better(v, heap[worst], heap[l])) worst = l;
        if (r < size && better(v, heap[worst], heap[r])) worst = r;
        if (worst == i) return;
        int32_t t = heap[i];
        heap[i] = heap[worst];
        heap[worst] = t;
        i = worst;
    }
}

static void heapify(const float *v, int32_t *ids, uint32_t n) {
    for (uint32_t i = n / 2; i-- > 0;) sift_down(v, ids, n, i);
}

/* heapsort of a heap: the worst goes to the back each time, leaving ids best first */
static void heap_to_sorted(const float *v, int32_t *ids, uint32_t n) {
    for (uint32_t size = n; size > 1; size--) {
        int32_t t = ids[0];
        ids[0] = ids[size - 1];
        ids[size - 1] = t;
        sift_down(v, ids, size - 1, 0);
    }
}

/* The best k ids of v[0..n) (1 ≤ k ≤ n) into out[0..k), best first: O(n log k). */
static void select_top(const float *v, uint32_t n, uint32_t k, int32_t *out) {
    for (uint32_t i = 0; i < k; i++) out[i] = (int32_t)i;
    heapify(v, out, k);
    for (uint32_t i = k; i < n; i++)
        if (better(v, (int32_t)i, out[0])) {
            out[0] = (int32_t)i;
            sift_down(v, out, k, 0);
        }
    heap_to_sorted(v, out, k);
}

/* The ids with v ≥ t, best first, into out; returns how many. Such a set is a prefix of the
 * whole vocabulary in rank order. */
static uint32_t select_above(const float *v, uint32_t n, double t, int32_t *out) {
    uint32_t c = 0;
    for (uint32_t i = 0; i < n; i++)
        if ((double)v[i] >= t) out[c++] = (int32_t)i;
    heapify(v, out, c);
    heap_to_sorted(v, out, c);
    return c;
}

/* Walks the sorted candidates idx[0..s) — a prefix of all candidates in rank order, with
 * probabilities exp(v − m) / z — applying top-p then min-p, and returns how many to keep
 * (≥ 1). The prefix must reach the cut: either its mass is ≥ top_p, or it holds every
 * candidate that passes min-p, or it is all of them. */
static uint32_t cutoff(const float *v, const int32_t *idx, uint32_t s, float m, double z, float top_p, float min_p) {
    const double p_max = 1.0 / z; /* idx[0] holds the maximum m: exp(0) / z */
    const double min_keep = (double)min_p * p_max;
    double cum = 0.0;
    for (uint32_t j = 0; j < s; j++) {
        const double p = exp((double)v[idx[j]] - (double)m) / z;
        if (min_p > 0.0f && p < min_keep) return j > 0 ? j : 1;
        cum += p;
        if (top_p < 1.0f && cum >= (double)top_p) return j + 1;
    }
    return s;
}

/* ------------------------------------------------------------------------------- sample */

/* The draw among the kept candidates idx[0..keep), best first: renormalised, one uniform double. */
static int32_t draw(smoe_sampler *s, const float *v, const int32_t *idx, uint32_t keep, float m) {
    double mass = 0.0;
    for (uint32_t j = 0; j < keep; j++) mass += exp((double)v[idx[j]] - (double)m);
    const double target = uniform(s->rng) * mass;
    double cum = 0.0;
    for (uint32_t j = 0; j < keep; j++) {
        cum += exp((double)v[idx[j]] - (double)m);
        if (target < cum) return idx[j];
    }
    return idx[keep - 1];
}

int32_t smoe_sample_top(smoe_sampler *s, const float *v, const int32_t *idx, uint32_t k, float m) {
    const smoe_sampler_params *p = &s->p;
    if (!(p->top_p < 1.0f || p->min_p > 0.0f)) return draw(s, v, idx, k, m);
    double z = 0.0; /* the softmax's sum, for the cut */
    for (uint32_t j = 0; j < k; j++) z += exp((double)v[idx[j]] - (double)m);
    return draw(s, v, idx, cutoff(v, idx, k, m, z, p->top_p, p->min_p), m);
}

int32_t smoe_sample(smoe_sampler *s, const float *logits, uint32_t vocab, const int32_t *history,
                    uint32_t n_history, float *scratch, int32_t *scratch_idx) {
    if (vocab == 0) return -1;
    const smoe_sampler_params *p = &s->p;
    const float pen = p->repetition_penalty;
    const bool repeat = pen > 0.0f && pen != 1.0f && p->repetition_window > 0 && history && n_history > 0;
    const bool counted = (p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f) && s->counts && s->n_drawn > 0;
    /* greedy with nothing to change a logit: the argmax of the logits as they are, no copy */
    if (!(p->temperature > 0.0f) && !repeat && !counted && !s->masked) return (int32_t)argmax(logits, vocab);

    float *v = scratch; /* (vocab) working logits */
    for (uint32_t i = 0; i < vocab; i++) v[i] = clean(logits[i]);

    if (repeat) {
        const uint32_t w = n_history < p->repetition_window ? n_history : p->repetition_window;
        for (uint32_t h = n_history - w; h < n_history; h++) {
            const int32_t id = history[h];
            if (id < 0 || (uint32_t)id >= vocab) continue;
            /* Penalise each distinct id once: a value already changed has been penalised. One
             * left unchanged by the penalty (0 or ±inf) is a fixed point, so a second pass over
             * it changes nothing either. */
            if (v[id] != clean(logits[id])) continue;
            v[id] = v[id] > 0.0f ? v[id] / pen : v[id] * pen;
        }
    }
    if (counted)
        for (uint32_t i = 0; i < s->n_drawn; i++) {
            const int32_t id = s->drawn[i];
            if ((uint32_t)id >= vocab) continue;
            v[id] = (float)((double)v[id] - ((double)p->frequency_penalty * s->counts[id] + (double)p->presence_penalty));
        }

    int32_t first = -1; /* the lowest id the mask allows */
    if (s->masked)
        for (uint32_t w = 0; w < (vocab + 31) / 32; w++) {
            const uint32_t bits = s->mask[w];
            for (uint32_t b = 0; first < 0 && bits && b < 32; b++)
                if (bits >> b & 1u) first = (int32_t)(w * 32 + b);
            if (bits == 0xffffffffu) continue;
            for (uint32_t b = 0; b < 32 && w * 32 + b < vocab; b++)
                if (!(bits >> b & 1u)) v[w * 32 + b] = -INFINITY;
        }

    const uint32_t best = argmax(v, vocab);
    if (v[best] == -INFINITY && first >= 0) return first; /* every allowed logit is −inf */
    if (!(p->temperature > 0.0f) || v[best] == -INFINITY) return (int32_t)best;

    for (uint32_t i = 0; i < vocab; i++) v[i] = v[i] / p->temperature;
    const float m = v[best];
    if (m == INFINITY) return (int32_t)best; /* a temperature so small that it overflowed */
    const bool cut = p->top_p < 1.0f || p->min_p > 0.0f;
    const uint32_t k = p->top_k > 0 && p->top_k < vocab ? p->top_k : vocab;
    int32_t *idx = scratch_idx; /* (vocab) candidate ids, best first */

    if (k < vocab) {
        select_top(v, vocab, k, idx);
        return smoe_sample_top(s, v, idx, k, m);
    } else {
        double z = 0.0;
        /* −inf (NaN, a masked id) adds exp(−inf) = 0: skipped, the same sum without the slow exp */
        for (uint32_t i = 0; i < vocab; i++)
            if (v[i] != -INFINITY) z += exp((double)v[i] - (double)m);
        if (!cut) { /* the whole vocabulary, in id order: no selection needed */
            const double target = uniform(s->rng) * z;
            double cum = 0.0;
            uint32_t last = best;
            for (uint32_t i = 0; i < vocab; i++) {
                if (v[i] == -INFINITY) continue;
                const double e = exp((double)v[i] - (double)m);
                if (e == 0.0) continue;
                cum += e;
                last = i;
                if (target < cum) return (int32_t)i;
            }
            return (int32_t)last;
        }
        /* Sort only a prefix that is sure to contain the cut: the ids with v ≥ t, for the
         * highest t (tried m−1, m−2, m−4, ...) whose set holds top_p of the mass, or else the
         * set that min-p keeps (p ≥ min_p·p_max ⇔ v ≥ m + ln min_p, taken 1 lower for rounding). */
        double t = -INFINITY;
        if (p->min_p > 0.0f) t = (double)m + log((double)p->min_p) - 1.0;
        if (p->top_p < 1.0f)
            for (double d = 1.0; (double)m - d > t; d *= 2.0) {
                double mass = 0.0;
                for (uint32_t i = 0; i < vocab; i++)
                    if ((double)v[i] >= (double)m - d) mass += exp((double)v[i] - (double)m);
                if (mass >= (double)p->top_p * z) {
                    t = (double)m - d;
                    break;
                }
            }
        return draw(s, v, idx, cutoff(v, idx, select_above(v, vocab, t, idx), m, z, p->top_p, p->min_p), m);
    }
}

/* --------------------------------------------------------------------------- logprobs */

smoe_status smoe_logprobs(const float *logits, uint32_t vocab, int32_t token, uint32_t top_n, double *token_lp,
                          int32_t *top_ids, double *top_lps) {
    if (!logits || vocab == 0 || (top_n && (!top_ids || !top_lps)))
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_logprobs: NULL argument or an empty vocabulary");
    if (top_n > SMOE_TOP_LOGPROBS || top_n > vocab)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_logprobs: top_n = %u, at most %u and the vocabulary (%u)", top_n,
                         SMOE_TOP_LOGPROBS, vocab);
    if (token_lp && (token < 0 || (uint32_t)token >= vocab))
        return smoe_fail(SMOE_ERR_BAD_TOKEN, "smoe_logprobs: token %d is outside the vocabulary [0, %u)", token, vocab);
    float m = -INFINITY;
    for (uint32_t i = 0; i < vocab; i++) {
        const float x = clean(logits[i]);
        if (x > m) m = x;
    }
    /* log Σ exp: max-subtracted in double; all −inf (or a +inf) is no distribution: lse = m */
    double lse = (double)m;
    if (isfinite(m)) {
        double z = 0.0;
        for (uint32_t i = 0; i < vocab; i++) z += exp((double)clean(logits[i]) - (double)m);
        lse = (double)m + log(z);
    }
#define LP(x) ((double)(x) == lse ? 0.0 : (double)(x) - lse)
    if (token_lp) *token_lp = LP(clean(logits[token]));
    /* the best top_n by insertion into a sorted list (larger value, then lower id first) */
    uint32_t k = 0;
    for (uint32_t i = 0; i < vocab && top_n; i++) {
        const float x = clean(logits[i]);
        if (k == top_n && !(x > clean(logits[top_ids[k - 1]]))) continue; /* ties keep the lower id */
        uint32_t j = k < top_n ? k++ : k - 1;
        while (j > 0 && x > clean(logits[top_ids[j - 1]])) {
            top_ids[j] = top_ids[j - 1];
            j--;
        }
        top_ids[j] = (int32_t)i;
    }
    for (uint32_t j = 0; j < top_n; j++) top_lps[j] = LP(clean(logits[top_ids[j]]));
#undef LP
    return SMOE_OK;
}
