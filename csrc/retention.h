/* retention.h — which retained blob the streamer gives up on a miss (the retention policy's
 * within-layer order), kept apart from the streamer's I/O and slot states.
 *
 * The streamer (streamer.c) chooses the victim's layer itself: the per-layer quota, another
 * layer than the requester, the layer used most recently (its essay says why). Between two
 * candidates that tie on all that, it asks smoe_retention_before which to give up first. */
#ifndef SMOE_RETENTION_H
#define SMOE_RETENTION_H

#include <stdbool.h>
#include <stdint.h>

typedef enum {
    SMOE_RETAIN_DEFAULT = 0, /* SMOE_RETENTION from the environment, else SMOE_RETAIN_LRFU */
    SMOE_RETAIN_LRU = 1,     /* least recently used first */
    SMOE_RETAIN_LRFU = 2,    /* smallest use count decayed with a half-life of layer visits first */
} smoe_retain_kind;

#define SMOE_RETAIN_HALF_LIFE 4.0 /* visits of the layer (decode: tokens); bench/RESULTS.md */

typedef struct {
    smoe_retain_kind kind;
    double decay;          /* per visit of the layer: 2^(−1/half_life) */
    uint32_t n_experts;
    uint32_t last_layer;   /* layer of the last acquire; a change starts a visit */
    uint32_t *visit;       /* (n_layers) visits of each layer so far: its decay clock */
    double *score;         /* (n_layers × n_experts) decayed uses as of seen[key] */
    uint32_t *seen;        /* (n_layers × n_experts) the layer's visit at the last use */
} smoe_retention;

/* kind SMOE_RETAIN_DEFAULT reads SMOE_RETENTION ("lru", "lrfu" or "lrfu:H" with H the half-life
 * in visits; anything else is the default, logged). half_life ≤ 0 means SMOE_RETAIN_HALF_LIFE.
 * False when out of memory (r is then empty and smoe_retention_free is still safe). */
bool smoe_retention_init(smoe_retention *r, smoe_retain_kind kind, double half_life, uint32_t n_layers,
                         uint32_t n_experts);
void smoe_retention_free(smoe_retention *r);

/* Every acquire, hit or miss, of key = layer × n_experts + expert. */
void smoe_retention_used(smoe_retention *r, uint32_t layer, uint32_t key);

/* Of two retained blobs of the same layer (keys a and b, last acquired at clock stamps sa and
 * sb), whether a should go before b. */
bool smoe_retention_before(const smoe_retention *r, uint32_t a, uint64_t sa, uint32_t b, uint64_t sb);

const char *smoe_retention_name(const smoe_retention *r);

#endif
