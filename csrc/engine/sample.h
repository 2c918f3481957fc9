/* sample.h — choosing the next id from logits: greedy, temperature, top-k, top-p, min-p,
 * repetition, presence and frequency penalties; deterministic for a given seed. */
#ifndef SMOE_SAMPLE_H
#define SMOE_SAMPLE_H

#include "internal.h"

typedef struct {
    smoe_sampler_params p;
    uint64_t rng[2];   /* xoroshiro128+ state from the seed */
    uint32_t *counts;  /* (vocab) times each id was drawn since the sampler was set; the session's */
    int32_t *drawn;    /* (vocab) the ids with a count, in order of their first draw */
    uint32_t n_drawn;
    uint32_t *mask;    /* (vocab / 32 rounded up) the allowed ids, bit id % 32 of word id / 32; the session's */
    bool masked;       /* mask is in force (smoe_session_set_mask) */
} smoe_sampler;

/* Sets p, seeds the generator, forgets the counts and lifts the mask (counts and drawn: vocab
 * entries each, the caller's, zeroed before the first init). */
void smoe_sampler_init(smoe_sampler *s, const smoe_sampler_params *p);
/* id was drawn (or forced in its place): counted for the presence and frequency penalties. */
void smoe_sampler_observe(smoe_sampler *s, int32_t id);

/* Picks the next id. logits (vocab) are not modified. With a mask in force, the ids it does not
 * allow are −inf after the penalties (so never drawn; all allowed ones −inf: the lowest allowed). history: the ids so far (for the
 * repetition penalty). scratch: vocab floats; scratch_idx: vocab ints. Never allocates.
 * Greedy (temperature 0) takes the largest logit after the penalty, lowest id on ties. */
int32_t smoe_sample(smoe_sampler *s, const float *logits, uint32_t vocab, const int32_t *history,
                    uint32_t n_history, float *scratch, int32_t *scratch_idx);

/* smoe_sample's end once top-k (k < vocab) has chosen: idx[0..k) the candidates best first, v their
 * logits after the penalty and the temperature (indexed by id; only those k are read), m the
 * largest. Softmax, top-p, min-p and the draw, exactly as smoe_sample does them — for a device
 * that selected the candidates itself. */
int32_t smoe_sample_top(smoe_sampler *s, const float *v, const int32_t *idx, uint32_t k, float m);

#endif
