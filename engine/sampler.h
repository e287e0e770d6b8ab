/*
 * Token sampling: greedy, temperature, top-k, top-p, seeded. A sampler owns the scratch it needs
 * for one vocabulary (made once per worker, not per step); the RNG state lives with the request
 * so a seeded request gives the same tokens whatever else is in the batch.
 */
#ifndef DUET_ENGINE_SAMPLER_H
#define DUET_ENGINE_SAMPLER_H

#include <stdint.h>

#include "common/status.h"

typedef struct {
    float temperature; /* 0 = greedy (argmax, first index on ties) */
    int64_t top_k;     /* 0 = no limit */
    float top_p;       /* (0, 1]; 1 = no nucleus cut */
    uint64_t seed;
} duet_sampling_t;

/* xoshiro256** state */
typedef struct {
    uint64_t s[4];
} duet_rng_t;

void duet_rng_seed(duet_rng_t *rng, uint64_t seed);
uint64_t duet_rng_next(duet_rng_t *rng);
/* Uniform in [0, 1) with 24 bits. */
float duet_rng_uniform(duet_rng_t *rng);

/* Greedy defaults: temperature 0, top_k 0, top_p 1, seed 0. */
void duet_sampling_default(duet_sampling_t *p);

/* DUET_ERR_RANGE naming the parameter when temperature < 0 or not finite, top_k < 0, top_p not
 * in (0, 1]. */
duet_status_t duet_sampling_validate(const duet_sampling_t *p);

typedef struct duet_sampler duet_sampler_t;

duet_status_t duet_sampler_create(int64_t vocab, duet_sampler_t **s_p);
void duet_sampler_destroy(duet_sampler_t *s); /* accepts NULL */

/* Index of the largest logit (first on ties). */
int32_t duet_argmax(const float *logits, int64_t n);

/* Draw one token from `logits` (not modified) under p, advancing rng. */
int32_t duet_sampler_sample(duet_sampler_t *s, const duet_sampling_t *p, duet_rng_t *rng,
                            const float *logits);

/*
 * The same rule with the uniform draw given: duet_sampler_sample(s, p, rng, l) ==
 * duet_sampler_sample_u(s, p, duet_sampling_draw(p, rng), l). Lets a device sampler and the CPU
 * one consume a request's RNG stream identically.
 */
int32_t duet_sampler_sample_u(duet_sampler_t *s, const duet_sampling_t *p, float u,
                              const float *logits);
/*
 * The distribution duet_sampler_sample draws from under p, dense over the vocabulary into
 * probs[vocab] (zero outside the top-k / nucleus candidates; one-hot at the argmax when p is
 * greedy). Speculative sampling compares the target's and the drafter's distributions with it.
 */
void duet_sampler_probs(duet_sampler_t *s, const duet_sampling_t *p, const float *logits,
                        float *probs);

/* The draw one token of p consumes: duet_rng_uniform(rng) when p samples, else 0 (no draw). */
float duet_sampling_draw(const duet_sampling_t *p, duet_rng_t *rng);

#endif
